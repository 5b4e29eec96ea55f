//! Serving a router over HTTP/1.1 with the limits `axum::serve` does not expose: how long a
//! client may take to send its headers and its body, how large its header block may be, how
//! many connections are held at once and how many covered requests are processed at once.
//!
//! A slow client costs the server a connection, a task and a buffer for as long as it is let
//! take; without limits, one that sends a header byte a minute holds them for ever, and a few
//! thousand such clients hold the service. The engine itself is not at risk from them: a key is
//! claimed only once the whole body has been read (the layer and the workflow route read it
//! before they call the runner), so a client that stalls never holds a key or its lease.
//!
//! A crowd costs descriptors and memory: past the process's open-file limit every accept fails
//! (and a legitimate client waits for the retry), and each covered request holds its body and
//! what is made of it until it ends. So the server serves at most `max_connections`
//! connections: at the limit the connection idle the longest gives its place to a new one, and
//! with every connection busy the rest wait in the listen backlog. And a covered request past
//! `max_covered_requests` waits briefly for a place, then is answered 503.

use std::convert::Infallible;
use std::future::{Future, IntoFuture};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Sleep;
use tower::ServiceExt;

use crate::body::BodyReadTimeout;
use crate::problem::{Problem, body_timeout, overloaded};

/// How long a client may take, how much header it may send, and how many connections and
/// covered requests are served at once: the limits [`serve`] applies. The defaults suit an API
/// whose requests are small JSON documents; see docs/http.md for what a client sees when it
/// passes one, and why each default is what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
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
    /// The most connections served at once. At the limit, a connection accepted is given the
    /// place of the connection idle the longest, once that one has been idle a second (or half
    /// `header_read_timeout`): one that has sent no whole request (a client stalling in its
    /// headers, or opening connections it does not use) is closed at once, a kept-alive one
    /// between requests as hyper closes it. With every connection busy on a request, the server
    /// stops accepting: new connections wait in the listen backlog (the kernel completed their
    /// handshake) until a place frees, rather than being accepted past the process's
    /// descriptors and failed. The descriptors held for clients are at most this and one (a
    /// connection accepted, waiting for its place). Default 512: well under the usual
    /// open-file limit of 1,024, leaving the rest for the database pool, logs and files. At
    /// least 1.
    pub max_connections: usize,
    /// The most covered requests (those the idempotency layer or a workflow route takes a key
    /// for) processed at once, from the read of their body to the end of their run, whether
    /// their client stays or not: what the body and all made of it cost is held that long (up
    /// to about 12 times the body's size at its peak: 12 MiB for a request at the layer's 1 MiB
    /// body limit, and a few times its size once read). Default 256: a request spends most of
    /// its run waiting on other systems (a payment provider's seconds), holding no database
    /// connection meanwhile, so what runs at once is the arrival rate times that wait (100
    /// requests a second behind a 2-second provider: 200), and the limit must not shed those;
    /// bodies of a few KiB cost 256 requests a few MiB, and 256 at the body limit about 3 GiB at
    /// their peak if they all arrive at once. Lower it where memory is short and bodies large.
    /// Other routes are not counted. At least 1. See [`ServeLimits::covered_request_wait`].
    pub max_covered_requests: usize,
    /// How long a covered request past `max_covered_requests` waits for a place before it is
    /// answered `503 Service Unavailable` (a problem, `code: overloaded`, `Retry-After: 1`),
    /// its body unread and nothing stored, so the same key may be sent again. Default 1 s: a
    /// burst is queued, a sustained overload is shed.
    pub covered_request_wait: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            body_read_timeout: Duration::from_secs(30),
            max_connections: 512,
            max_covered_requests: 256,
            covered_request_wait: Duration::from_secs(1),
        }
    }
}

/// Serves `router` on `listener` over HTTP/1.1 (keep-alive on) with `limits`: what
/// `axum::serve(listener, router)` does, with a bound on how long a slow client holds a
/// connection, on how many connections are held and on how many covered requests are processed
/// at once. Await the result to serve: it completes, `Ok(())`, only after a graceful shutdown
/// ([`Serve::with_graceful_shutdown`]); a failed accept (out of file descriptors) is logged and
/// retried after a short wait (10 ms, doubling to 160 ms while it keeps failing), not returned
/// (the `io::Result` is `axum::serve`'s shape). Requests carry the peer's address as
/// `ConnectInfo<SocketAddr>`.
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
/// // Large uploads on slow links.
/// let limits = ServeLimits::default().with_body_read_timeout(Duration::from_secs(60));
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
    let mut shutdown = shutdown.unwrap_or_else(|| Box::pin(std::future::pending()));
    let held = Arc::new(Held::new(
        limits.max_connections,
        CLOSABLE_AFTER.min(limits.header_read_timeout / 2),
    ));
    let covered = CoveredLimit {
        places: Arc::new(Semaphore::new(permits(limits.max_covered_requests))),
        wait: limits.covered_request_wait,
    };
    // Told once to stop; each connection holds a sender, so `all_closed` ends with the last.
    let (stop, stopping) = watch::channel(false);
    let (open, mut all_closed) = mpsc::channel::<()>(1);
    let mut accepting = Accepting::default();
    loop {
        let Some((stream, peer)) = accepting.accept(&listener, &mut shutdown).await else {
            break;
        };
        let Some(place) = accepting.place(&held, &limits, &mut shutdown).await else {
            break;
        };
        // Responses are written whole; waiting to fill a packet only delays them.
        let _ = stream.set_nodelay(true);
        let this = held.add();
        let service = Connection {
            router: router.clone(),
            peer,
            body_read_timeout: limits.body_read_timeout,
            covered: covered.clone(),
            this: this.clone(),
            held: held.clone(),
        };
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let (held, mut stopping, open) = (held.clone(), stopping.clone(), open.clone());
        tokio::spawn(async move {
            if let Err(error) = serve_connection(connection, &this, &mut stopping).await {
                // A client that timed out, sent too much header or went away: its own doing,
                // not the server's; at debug so a crowd of them cannot flood the log.
                tracing::debug!(%peer, %error, "connection ended");
            }
            held.remove(&this);
            drop((place, open)); // the connection is closed: its place is free
        });
    }
    // New connections are refused from here; those held finish what they are doing.
    drop(listener);
    let _ = stop.send(true);
    drop(open);
    let _ = all_closed.recv().await;
    Ok(())
}

/// The accept loop's state: failed accepts in a row (backed off), and whether the connection
/// limit was reached (said once per time it is).
#[derive(Default)]
struct Accepting {
    failures: u32,
    full: bool,
}

impl Accepting {
    /// The next connection; `None` once `shutdown` completes. A failed accept is retried after
    /// a backoff ([`accept_backoff`]), logged once per run of failures.
    async fn accept(
        &mut self,
        listener: &TcpListener,
        shutdown: &mut Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Option<(TcpStream, SocketAddr)> {
        loop {
            tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => {
                        if self.failures > 0 {
                            tracing::info!(failures = self.failures, "accepting connections again");
                            self.failures = 0;
                        }
                        return Some(accepted);
                    }
                    Err(error) => {
                        if let Some(wait) = accept_backoff(&error, self.failures) {
                            if self.failures == 0 {
                                tracing::error!(%error, "accepting a connection failed; retrying");
                            }
                            self.failures = self.failures.saturating_add(1);
                            tokio::select! {
                                () = tokio::time::sleep(wait) => {}
                                () = &mut *shutdown => return None,
                            }
                        }
                    }
                },
                () = &mut *shutdown => return None,
            }
        }
    }

    /// A place among the connections held; at the limit, the one idle the longest is closed to
    /// make it, and until then no other connection is accepted. `None` once `shutdown` completes.
    async fn place(
        &mut self,
        held: &Held,
        limits: &ServeLimits,
        shutdown: &mut Pin<Box<dyn Future<Output = ()> + Send>>,
    ) -> Option<OwnedSemaphorePermit> {
        if let Ok(place) = held.places.clone().try_acquire_owned() {
            self.full = false;
            return Some(place);
        }
        if !std::mem::replace(&mut self.full, true) {
            tracing::warn!(
                limit = limits.max_connections,
                "the connection limit is reached: connections idle the longest are closed to \
                 make room, and with none idle new ones wait in the backlog"
            );
        }
        tokio::select! {
            place = held.make_room() => place, // never closed
            () = &mut *shutdown => None,
        }
    }
}

/// Serves one connection until it ends, closing it when it is asked to make room (see
/// [`Held::make_room`]) or the server stops.
async fn serve_connection(
    connection: http1::Connection<TokioIo<TcpStream>, Connection>,
    this: &Connected,
    stopping: &mut watch::Receiver<bool>,
) -> Result<(), hyper::Error> {
    let mut connection = std::pin::pin!(connection);
    let mut closing = false;
    loop {
        let making_room = tokio::select! {
            result = connection.as_mut() => return result,
            () = this.close.notified(), if !closing => true,
            _ = stopping.wait_for(|stop| *stop), if !closing => false,
        };
        // Never answered and nothing in progress: a client that has sent no whole request in
        // all the while it was idle (hyper would wait out its header read timeout); closed at
        // once.
        if making_room && this.idle_since().is_some() && !this.answered() {
            return Ok(());
        }
        // Else closed by hyper when idle, or once the request in progress is answered.
        connection.as_mut().graceful_shutdown();
        closing = true;
    }
}

/// How long a connection must have been idle before it may be closed to make room: a client
/// that means to send a request sends it within a round trip of connecting (or of its last
/// answer, on a kept-alive connection), so one idle this long is not about to. Half the header
/// read timeout, if that is shorter.
const CLOSABLE_AFTER: Duration = Duration::from_secs(1);

/// The connections a server holds: their places, and what each is doing.
struct Held {
    places: Arc<Semaphore>,
    connections: Mutex<Vec<Arc<Connected>>>,
    /// Told when a connection becomes idle (its answer written), for a new connection waiting
    /// for room.
    became_idle: Notify,
    /// How long a connection must have been idle to be closed for another.
    closable_after: Duration,
    started: Instant,
}

/// One held connection.
#[derive(Debug)]
struct Connected {
    /// When it last became idle (accepted, or its last answer written), in microseconds since
    /// the server started; `BUSY` while a request is in progress.
    idle_since: AtomicU64,
    answered: AtomicBool,
    /// Chosen to be closed for a new connection.
    closing: AtomicBool,
    close: Notify,
}

const BUSY: u64 = u64::MAX;

impl Connected {
    fn idle_since(&self) -> Option<u64> {
        let since = self.idle_since.load(Ordering::SeqCst);
        (since != BUSY).then_some(since)
    }

    fn answered(&self) -> bool {
        self.answered.load(Ordering::SeqCst)
    }
}

impl Held {
    fn new(limit: usize, closable_after: Duration) -> Self {
        Self {
            places: Arc::new(Semaphore::new(permits(limit))),
            connections: Mutex::new(Vec::new()),
            became_idle: Notify::new(),
            closable_after,
            started: Instant::now(),
        }
    }

    /// Microseconds since the server started.
    fn now(&self) -> u64 {
        micros(self.started.elapsed())
    }

    fn add(&self) -> Arc<Connected> {
        let connected = Arc::new(Connected {
            idle_since: AtomicU64::new(self.now()),
            answered: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            close: Notify::new(),
        });
        self.lock().push(connected.clone());
        connected
    }

    fn remove(&self, connected: &Arc<Connected>) {
        self.lock().retain(|held| !Arc::ptr_eq(held, connected));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Connected>>> {
        self.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A place for a connection accepted at the limit: the connection idle the longest (one
    /// that has sent no whole request, or a kept-alive one between requests), once it has been
    /// idle `closable_after`, is closed for it; with none such, the first place freed, or the
    /// first connection to have been idle long enough. `None` only if the places were closed
    /// (never).
    async fn make_room(&self) -> Option<OwnedSemaphorePermit> {
        let mut closable = self.close_longest_idle();
        loop {
            let asked = closable.is_ok();
            // When the connection idle the longest will have been idle long enough.
            let then = match closable {
                Err(Some(at)) => self.started + Duration::from_micros(at),
                _ => Instant::now() + Duration::from_secs(3600),
            };
            tokio::select! {
                place = self.places.clone().acquire_owned() => return place.ok(),
                () = self.became_idle.notified(), if !asked => {}
                () = tokio::time::sleep_until(then.into()), if !asked => {}
            }
            if !asked {
                closable = self.close_longest_idle();
            }
        }
    }

    /// Asks the connection idle the longest to close, if it has been idle long enough; else
    /// says when it will have been (in microseconds since the server started), if any is idle.
    fn close_longest_idle(&self) -> Result<(), Option<u64>> {
        let connections = self.lock();
        let longest = connections
            .iter()
            .filter(|held| !held.closing.load(Ordering::SeqCst))
            .filter_map(|held| Some((held.idle_since()?, held)))
            .min_by_key(|(since, _)| *since);
        let Some((since, held)) = longest else {
            return Err(None);
        };
        let closable_at = since.saturating_add(micros(self.closable_after));
        if closable_at > self.now() {
            return Err(Some(closable_at));
        }
        held.closing.store(true, Ordering::SeqCst);
        held.close.notify_one();
        Ok(())
    }
}

/// A duration in whole microseconds, below `BUSY`.
fn micros(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros())
        .unwrap_or(BUSY - 1)
        .min(BUSY - 1)
}

/// A limit as semaphore permits: at least 1, at most what a semaphore holds.
fn permits(limit: usize) -> usize {
    limit.clamp(1, Semaphore::MAX_PERMITS)
}

/// How long to wait after an accept failed, `failures` failures in a row before it: a
/// connection reset or aborted before it was accepted is the client's business (no wait); out
/// of descriptors (`EMFILE`, `ENFILE`) or anything else is waited out briefly rather than spun
/// on: 10 ms, doubling while it keeps failing, to 160 ms. A whole second (axum's wait) kept a
/// legitimate client waiting that long after descriptors were free again.
fn accept_backoff(error: &io::Error, failures: u32) -> Option<Duration> {
    if matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    ) {
        return None;
    }
    Some(Duration::from_millis(10 << failures.min(4)))
}

/// The places for covered requests of one server, handed to the layer and the workflow route
/// in each request's extensions (see [`ServeLimits::max_covered_requests`]).
#[derive(Debug, Clone)]
pub(crate) struct CoveredLimit {
    places: Arc<Semaphore>,
    wait: Duration,
}

impl CoveredLimit {
    /// A place for one covered request, held until it is dropped; or, when none came free
    /// within the wait, the 503 to answer.
    pub(crate) async fn enter(&self) -> Result<OwnedSemaphorePermit, Problem> {
        if let Ok(place) = self.places.clone().try_acquire_owned() {
            return Ok(place);
        }
        match tokio::time::timeout(self.wait, self.places.clone().acquire_owned()).await {
            Ok(Ok(place)) => Ok(place),
            Ok(Err(_)) | Err(_) => Err(overloaded()),
        }
    }
}

/// The router, as one connection's hyper service.
#[derive(Clone)]
struct Connection {
    router: Router,
    peer: SocketAddr,
    body_read_timeout: Duration,
    covered: CoveredLimit,
    /// This connection, as the server holds it: busy from a request's head to its answer.
    this: Arc<Connected>,
    held: Arc<Held>,
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
        request.extensions_mut().insert(self.covered.clone());
        self.this.idle_since.store(BUSY, Ordering::SeqCst);
        let router = self.router.clone();
        let (this, held) = (self.this.clone(), self.held.clone());
        Box::pin(async move {
            let mut response = router
                .oneshot(request)
                .await
                .unwrap_or_else(|never| match never {});
            if expired.load(Ordering::Acquire) {
                // The layer answers 408 itself; a handler that read the body some other way (an
                // extractor's 400, say) is overruled: the client is told what happened.
                if response.status() != StatusCode::REQUEST_TIMEOUT {
                    response = body_timeout(timeout).into_response();
                }
                // The rest of the body may still be on its way: the connection cannot be reused.
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Ok(response.map(|body| Body::new(Answering { body, this, held })))
        })
    }
}

/// A response's body, which makes its connection idle again once it has been written (or the
/// connection is gone): hyper drops it then.
struct Answering {
    body: Body,
    this: Arc<Connected>,
    held: Arc<Held>,
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.this.answered.store(true, Ordering::SeqCst);
        self.this
            .idle_since
            .store(self.held.now(), Ordering::SeqCst);
        self.held.became_idle.notify_one();
    }
}

impl http_body::Body for Answering {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_accept_out_of_descriptors_is_retried_within_milliseconds() {
        // EMFILE and ENFILE, as Linux and the BSDs number them.
        for code in [24, 23] {
            let error = io::Error::from_raw_os_error(code);
            let waits: Vec<u64> = (0..8)
                .map(|failures| {
                    let wait = accept_backoff(&error, failures).expect("waited out");
                    u64::try_from(wait.as_millis()).unwrap_or(u64::MAX)
                })
                .collect();
            assert_eq!(waits, [10, 20, 40, 80, 160, 160, 160, 160], "{error}");
        }
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(accept_backoff(&reset, 0), None);
    }

    #[test]
    fn limits_are_at_least_one() {
        assert_eq!(permits(0), 1);
        assert_eq!(permits(512), 512);
        assert_eq!(permits(usize::MAX), Semaphore::MAX_PERMITS);
    }
}

idemflow_core::with_setters! {
    ServeLimits {
        with_header_read_timeout => header_read_timeout: Duration,
        with_max_header_bytes => max_header_bytes: usize,
        with_max_headers => max_headers: usize,
        with_body_read_timeout => body_read_timeout: Duration,
        with_max_connections => max_connections: usize,
        with_max_covered_requests => max_covered_requests: usize,
        with_covered_request_wait => covered_request_wait: Duration,
    }
}
