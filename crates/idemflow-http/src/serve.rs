//! Serving a router over HTTP/1.1 with the limits `axum::serve` does not expose: how long a
//! client may take to send its headers and its body, and how large its header block may be.
//!
//! A slow client costs the server a connection, a task and a buffer for as long as it is let
//! take; without limits, one that sends a header byte a minute holds them for ever, and a few
//! thousand such clients hold the service. The engine itself is not at risk from them: a key is
//! claimed only once the whole body has been read (the layer and the workflow route read it
//! before they call the runner), so a client that stalls never holds a key or its lease.

use std::convert::Infallible;
use std::future::{Future, IntoFuture};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::time::Sleep;
use tower::ServiceExt;

use crate::body::BodyReadTimeout;
use crate::problem::body_timeout;

/// How long a client may take, and how much header it may send: the limits [`serve`] applies to
/// every connection. The defaults suit an API whose requests are small JSON documents; see
/// docs/http.md for what a client sees when it passes one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServeLimits {
    /// A connection that has not sent a request's complete header block within this time is
    /// closed, without an answer: a client that sends headers a byte at a time, one that opens a
    /// connection and sends nothing, and an idle keep-alive connection alike (the clock starts
    /// when the server waits for a request's first byte). Default 10 s: a client that means to
    /// send a request sends its headers in one packet.
    pub header_read_timeout: Duration,
    /// The largest header block, request line included, in bytes: beyond it the request is
    /// answered `431 Request Header Fields Too Large` and the connection closed. Default 16 KiB,
    /// room for a large bearer token and a few cookies; it bounds the buffer a client can make
    /// the server hold while it is still sending.
    pub max_header_bytes: usize,
    /// The most header fields a request may have: beyond, 431 and the connection closed.
    /// Default 100 (hyper's own).
    pub max_headers: usize,
    /// How long a handler waits for the request body, counted from its first read of it: a body
    /// that has not arrived whole by then ends the request with `408 Request Timeout` (a
    /// problem, `code: body_timeout`) and the connection is closed. Default 30 s: a 1 MiB body
    /// (the layer's default limit) at 35 KiB/s. Raise it for routes that take large uploads.
    pub body_read_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            body_read_timeout: Duration::from_secs(30),
        }
    }
}

/// Serves `router` on `listener` over HTTP/1.1 (keep-alive on) with `limits`: what
/// `axum::serve(listener, router)` does, with a bound on how long a slow client holds a
/// connection. Await the result to serve: it completes, `Ok(())`, only after a graceful shutdown
/// ([`Serve::with_graceful_shutdown`]); a failed accept (out of file descriptors) is logged and
/// retried a second later, not returned (the `io::Result` is `axum::serve`'s shape). Requests
/// carry the peer's address as `ConnectInfo<SocketAddr>`.
///
/// ```no_run
/// use std::time::Duration;
///
/// use axum::Router;
/// use axum::routing::get;
/// use idemflow_http::{ServeLimits, serve};
///
/// # async fn example() -> std::io::Result<()> {
/// let app: Router = Router::new().route("/healthz", get(|| async { "ok" }));
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// let limits = ServeLimits {
///     body_read_timeout: Duration::from_secs(60), // large uploads on slow links
///     ..ServeLimits::default()
/// };
/// serve(listener, app, limits)
///     .with_graceful_shutdown(async {
///         let _ = tokio::signal::ctrl_c().await;
///     })
///     .await?;
/// # Ok(())
/// # }
/// ```
pub fn serve(listener: TcpListener, router: Router, limits: ServeLimits) -> Serve {
    Serve {
        listener,
        router,
        limits,
        shutdown: None,
    }
}

/// A server [`serve`] made, not started yet: `.await` it (or spawn its `into_future()`).
#[must_use = "a server does nothing until it is awaited"]
pub struct Serve {
    listener: TcpListener,
    router: Router,
    limits: ServeLimits,
    shutdown: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
}

impl std::fmt::Debug for Serve {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Serve")
            .field("listener", &self.listener)
            .field("limits", &self.limits)
            .field("graceful_shutdown", &self.shutdown.is_some())
            .finish_non_exhaustive()
    }
}

impl Serve {
    /// Stops when `signal` completes: the listener is closed at once (new connections are
    /// refused), requests in flight are answered, idle keep-alive connections are closed, and
    /// the server's future completes when the last connection has. A client still sending its
    /// headers or body is bounded by the limits, so the wait is too.
    pub fn with_graceful_shutdown<F>(mut self, signal: F) -> Self
    where
        F: Future<Output = ()> + Send + 'static,
    {
        self.shutdown = Some(Box::pin(signal));
        self
    }
}

impl IntoFuture for Serve {
    type Output = io::Result<()>;
    type IntoFuture = Pin<Box<dyn Future<Output = io::Result<()>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(run(self))
    }
}

async fn run(serve: Serve) -> io::Result<()> {
    let Serve {
        listener,
        router,
        limits,
        shutdown,
    } = serve;
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes)
        .max_headers(limits.max_headers);
    let graceful = GracefulShutdown::new();
    let mut shutdown = shutdown.unwrap_or_else(|| Box::pin(std::future::pending()));
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    accept_failed(error).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Responses are written whole; waiting to fill a packet only delays them.
        let _ = stream.set_nodelay(true);
        let service = Connection {
            router: router.clone(),
            peer,
            body_read_timeout: limits.body_read_timeout,
        };
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                // A client that timed out, sent too much header or went away: its own doing,
                // not the server's; at debug so a crowd of them cannot flood the log.
                tracing::debug!(%peer, %error, "connection ended");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// An accept that failed: a connection reset before it was accepted is the client's business;
/// anything else (out of file descriptors) is waited out, as axum does, rather than spun on.
async fn accept_failed(error: io::Error) {
    if matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return;
    }
    tracing::error!(%error, "accepting a connection failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

/// The router, as one connection's hyper service.
#[derive(Clone)]
struct Connection {
    router: Router,
    peer: SocketAddr,
    body_read_timeout: Duration,
}

impl hyper::service::Service<Request<Incoming>> for Connection {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, request: Request<Incoming>) -> Self::Future {
        let timeout = self.body_read_timeout;
        let expired = Arc::new(AtomicBool::new(false));
        let mut request = request.map(|body| {
            Body::new(DeadlineBody {
                body: Some(body),
                timeout,
                deadline: None,
                expired: expired.clone(),
            })
        });
        request.extensions_mut().insert(ConnectInfo(self.peer));
        let router = self.router.clone();
        Box::pin(async move {
            let response = router
                .oneshot(request)
                .await
                .unwrap_or_else(|never| match never {});
            if !expired.load(Ordering::Acquire) {
                return Ok(response);
            }
            // The layer answers 408 itself; a handler that read the body some other way (an
            // extractor's 400, say) is overruled: the client is told what happened.
            let mut response = if response.status() == StatusCode::REQUEST_TIMEOUT {
                response
            } else {
                body_timeout(timeout).into_response()
            };
            // The rest of the body may still be on its way: the connection cannot be reused.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            Ok(response)
        })
    }
}

/// A request body with a deadline, set when the handler first reads it.
struct DeadlineBody {
    /// `None` once the deadline passed.
    body: Option<Incoming>,
    timeout: Duration,
    deadline: Option<Pin<Box<Sleep>>>,
    /// Set when the deadline passed, for the service to see after the handler answered.
    expired: Arc<AtomicBool>,
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            return Poll::Ready(None);
        };
        let timeout = this.timeout;
        let deadline = this
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        // What has arrived is passed on, even at the deadline: a body that ended in time ends.
        if let Poll::Ready(frame) = Pin::new(body).poll_frame(context) {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        ready!(deadline.as_mut().poll(context));
        this.expired.store(true, Ordering::Release);
        // Dropped: hyper stops reading the body, and closes the connection after the answer.
        this.body = None;
        Poll::Ready(Some(Err(Box::new(BodyReadTimeout(timeout)))))
    }

    fn is_end_stream(&self) -> bool {
        self.body
            .as_ref()
            .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.body
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint)
    }
}
