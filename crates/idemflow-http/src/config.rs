use std::time::Duration;

use axum::http::Method;

/// What the layer covers and how much it accepts.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Methods that take an idempotency key; others pass through untouched. POST and PATCH by
    /// default: PUT and DELETE are idempotent by definition (RFC 9110), GET never changes state.
    pub methods: Vec<Method>,
    /// The largest body accepted (413 beyond); it is read whole to be fingerprinted.
    pub max_body_bytes: usize,
    /// Whether a covered request without the header is refused (400) or passed through
    /// without idempotency.
    pub require_key: bool,
    /// For the plain-handler layer: how long the handler may take before the attempt counts
    /// as failed (and the key as resumable). Must be shorter than `lease`.
    pub handler_timeout: Duration,
    pub lease: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            max_body_bytes: 1024 * 1024,
            require_key: true,
            handler_timeout: Duration::from_secs(30),
            lease: Duration::from_secs(60),
        }
    }
}

impl HttpConfig {
    pub fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }
}
