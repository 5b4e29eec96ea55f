//! Running the console alone (`idemflow console`): on a loopback address as it is, answering only
//! requests that name loopback in their `Host`, or on any other address only behind a basic-auth
//! password, which comes from the environment (a flag would show in `ps` and in shell history).

use std::net::SocketAddr;

use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::{Console, Principal};

/// The environment variable the standalone console's password is read from.
pub const PASSWORD_ENV: &str = "IDEMFLOW_CONSOLE_PASSWORD";

/// How to serve the console alone.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ServeOptions {
    /// Where to listen.
    pub bind: SocketAddr,
    /// The basic-auth password (any user name; it names the principal of the actions).
    pub password: Option<String>,
    /// Routes served beside the console's, behind the same password and `Host` checks (the
    /// CLI's `/metrics`).
    pub routes: Option<axum::Router>,
}

impl ServeOptions {
    /// Listening on `bind`, with no password.
    pub fn new(bind: SocketAddr) -> Self {
        Self {
            bind,
            password: None,
            routes: None,
        }
    }

    /// Asks every request for this basic-auth password.
    #[must_use]
    pub fn password(mut self, password: Option<String>) -> Self {
        self.password = password.filter(|p| !p.is_empty());
        self
    }

    /// Serves `routes` beside the console's (they must not overlap them), behind the same checks.
    #[must_use]
    pub fn routes(mut self, routes: axum::Router) -> Self {
        self.routes = Some(routes);
        self
    }
}

/// Why the console could not be served.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A non-loopback address without a password: anyone who reaches it could end leases.
    #[error(
        "refusing to serve the console on {0} without a password: set {PASSWORD_ENV}, or bind \
         to a loopback address (127.0.0.1, [::1])"
    )]
    NoPassword(SocketAddr),
    /// Listening or serving failed.
    #[error("cannot serve on {0}: {1}")]
    Io(SocketAddr, std::io::Error),
}

/// Serves `console` until ctrl-c (or SIGTERM), on `options.bind`. `ready` is told the address
/// it listens on (the port when `bind` asked for port 0).
pub async fn serve(
    console: Console,
    options: ServeOptions,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    if options.password.is_none() && !options.bind.ip().is_loopback() {
        return Err(ServeError::NoPassword(options.bind));
    }
    let listener = tokio::net::TcpListener::bind(options.bind)
        .await
        .map_err(|error| ServeError::Io(options.bind, error))?;
    let local = listener
        .local_addr()
        .map_err(|error| ServeError::Io(options.bind, error))?;
    let mut router = console.router();
    if let Some(routes) = options.routes {
        router = router.merge(routes);
    }
    if let Some(password) = options.password {
        router = router.layer(middleware::from_fn(move |request, next| {
            let password = password.clone();
            async move { basic_auth(&password, request, next).await }
        }));
    } else {
        router = router.layer(middleware::from_fn(move |request, next| {
            loopback_host_only(local, request, next)
        }));
    }
    ready(local);
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|error| ServeError::Io(local, error))
}

async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => {
                    let _ = interrupt.await;
                    return;
                }
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}

/// Without a password the console trusts whoever reaches its loopback address, and a web page
/// reaches it too once its DNS name is rebound to 127.0.0.1: the browser then sends that name in
/// `Host` and `Origin` alike, so the cross-site check passes, and the page could read stored
/// requests and expire keys. Such a request names the page's host, never loopback's: only
/// loopback's own names are answered (421 Misdirected Request otherwise), before any handler runs.
async fn loopback_host_only(
    local: SocketAddr,
    request: Request<axum::body::Body>,
    next: Next,
) -> Response {
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|value| value.to_str().ok());
    if host.is_some_and(|host| names_loopback(host, local)) {
        return next.run(request).await;
    }
    (
        StatusCode::MISDIRECTED_REQUEST,
        "this console answers only requests for localhost, 127.0.0.1 or [::1]; \
         set a password to serve it under another name\n",
    )
        .into_response()
}

/// Whether `host` (a `Host` header) names loopback: `localhost`, `127.0.0.1`, `[::1]` or the
/// address bound, with the bound port or none.
fn names_loopback(host: &str, local: SocketAddr) -> bool {
    let host = host.to_ascii_lowercase();
    let name = host
        .strip_suffix(&format!(":{}", local.port()))
        .unwrap_or(&host);
    let bound = match local.ip() {
        std::net::IpAddr::V4(ip) => ip.to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
    };
    matches!(name, "localhost" | "127.0.0.1" | "[::1]") || name == bound
}

/// Lets a request through with the right password (any user name, which becomes its
/// [`Principal`]); asks for one otherwise.
async fn basic_auth(
    password: &str,
    mut request: Request<axum::body::Body>,
    next: Next,
) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Basic "))
        .and_then(|encoded| STANDARD.decode(encoded.trim()).ok())
        .and_then(|decoded| String::from_utf8(decoded).ok());
    if let Some((user, pass)) = given.as_deref().and_then(|text| text.split_once(':'))
        && same_secret(pass.as_bytes(), password.as_bytes())
    {
        let user = if user.is_empty() { "operator" } else { user };
        request.extensions_mut().insert(Principal(user.to_owned()));
        return next.run(request).await;
    }
    let mut response = (
        StatusCode::UNAUTHORIZED,
        "the console asks for its password\n",
    )
        .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"idemflow console\", charset=\"UTF-8\""),
    );
    response
}

/// Compares without stopping at the first difference, so the time taken says nothing of how
/// much of a guess was right.
fn same_secret(given: &[u8], expected: &[u8]) -> bool {
    let mut difference = u8::from(given.len() != expected.len());
    for index in 0..given.len().max(expected.len()) {
        let a = given.get(index).copied().unwrap_or(0);
        let b = expected.get(index).copied().unwrap_or(0);
        difference |= a ^ b;
    }
    difference == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_are_loopback() {
        let local: SocketAddr = "127.0.0.1:8089".parse().expect("address");
        for host in [
            "localhost",
            "LOCALHOST:8089",
            "127.0.0.1:8089",
            "[::1]",
            "[::1]:8089",
        ] {
            assert!(names_loopback(host, local), "{host}");
        }
        for host in [
            "localhost:8090",
            "rebound.example:8089",
            "127.0.0.1.rebound.example",
            "localhost.",
            "",
        ] {
            assert!(!names_loopback(host, local), "{host}");
        }
        let other: SocketAddr = "127.0.0.7:8089".parse().expect("address");
        assert!(names_loopback("127.0.0.7:8089", other));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"s3cret", b"s3cret"));
        assert!(!same_secret(b"s3cre", b"s3cret"));
        assert!(!same_secret(b"s3cret!", b"s3cret"));
        assert!(!same_secret(b"", b"s3cret"));
    }
}

idemflow_core::with_setters! {
    ServeOptions {
        with_bind => bind: SocketAddr,
        with_password => password: Option<String>,
        with_routes => routes: Option<axum::Router>,
    }
}
