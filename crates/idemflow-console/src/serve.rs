//! Running the console alone (`idemflow console`): on a loopback address as it is, or on any
//! other address only behind a basic-auth password, which comes from the environment (a flag
//! would show in `ps` and in shell history).

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
}

impl ServeOptions {
    /// Listening on `bind`, with no password.
    pub fn new(bind: SocketAddr) -> Self {
        Self {
            bind,
            password: None,
        }
    }

    /// Asks every request for this basic-auth password.
    #[must_use]
    pub fn password(mut self, password: Option<String>) -> Self {
        self.password = password.filter(|p| !p.is_empty());
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
    if let Some(password) = options.password {
        router = router.layer(middleware::from_fn(move |request, next| {
            let password = password.clone();
            async move { basic_auth(&password, request, next).await }
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
    }
}
