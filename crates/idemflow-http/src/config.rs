use std::time::Duration;

use axum::http::{Method, StatusCode};

/// What a covered route accepts: shared by [`crate::WorkflowService`] and
/// [`crate::IdempotencyLayer`]. The plain-handler layer's own settings are on its builder.
///
/// Made from [`HttpConfig::default`] (or [`HttpConfig::for_workflow`]) and its setters, so that
/// a setting added later changes no caller:
///
/// ```
/// use std::time::Duration;
///
/// use idemflow_http::{HttpConfig, KeyMode};
///
/// let config = HttpConfig::default()
///     .max_body_bytes(64 * 1024)
///     // Clients without keys keep working, and are counted, while they learn to send one …
///     .key_mode(KeyMode::Observe)
///     // … except on the route whose clients all send keys already.
///     .route_key_mode("/v1/orders/{id}/refunds", KeyMode::Enforce)
///     .max_wait(Duration::from_secs(5));
/// assert_eq!(config.key_mode_of(Some("/v1/payments")), KeyMode::Observe);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct HttpConfig {
    /// Methods that take an idempotency key; others pass through untouched. POST and PATCH by
    /// default: PUT and DELETE are idempotent by definition (RFC 9110), GET never changes state.
    /// A [`crate::WorkflowService`] made with `new` covers POST only.
    pub methods: Vec<Method>,
    /// The largest body accepted (413 beyond); it is read whole to be fingerprinted.
    pub max_body_bytes: usize,
    /// What a covered request without the header gets, on every route without a mode of its
    /// own in [`HttpConfig::route_key_modes`]: [`KeyMode::Enforce`] by default.
    pub key_mode: KeyMode,
    /// Routes (as the router names them: `/v1/orders/{id}/refunds`) with a key mode other than
    /// [`HttpConfig::key_mode`]; the first entry for a route counts.
    pub route_key_modes: Vec<(String, KeyMode)>,
    /// The longest a duplicate of a request still running may wait for its answer when it asks
    /// to (`Prefer: wait=N`, RFC 7240), whatever N; zero: never wait, answer 409 at once.
    /// Default 10 s.
    pub max_wait: Duration,
}

/// What a covered request without an `Idempotency-Key` gets. Both modes count it, by route and
/// mode, in `idemflow_http_keyless_requests_total`: an operator sees which clients still send
/// none before requiring one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyMode {
    /// Refused with 400 `idempotency_key_missing`: nothing runs, nothing is stored.
    #[default]
    Enforce,
    /// Run once, unprotected: passed straight to the handler, nothing stored; a retry runs it
    /// again. For a bounded period while clients learn to send keys. A workflow route has no
    /// handler to pass the request to, and enforces whatever its configuration says.
    Observe,
}

impl KeyMode {
    /// The mode's name, as the metric labels it: `enforce` or `observe`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Enforce => "enforce",
            Self::Observe => "observe",
        }
    }
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            max_body_bytes: 1024 * 1024,
            key_mode: KeyMode::Enforce,
            route_key_modes: Vec::new(),
            max_wait: Duration::from_secs(10),
        }
    }
}

impl HttpConfig {
    /// The default for a workflow route: POST only. A workflow is one kind of request; running
    /// it for a PATCH as well would make two methods one request.
    pub fn for_workflow() -> Self {
        Self {
            methods: vec![Method::POST],
            ..Self::default()
        }
    }

    /// Which methods take a key ([`HttpConfig::methods`]).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// The largest body accepted ([`HttpConfig::max_body_bytes`]).
    pub fn max_body_bytes(mut self, limit: usize) -> Self {
        self.max_body_bytes = limit;
        self
    }

    /// What a covered request without a key gets on every route without a mode of its own.
    pub fn key_mode(mut self, mode: KeyMode) -> Self {
        self.key_mode = mode;
        self
    }

    /// What a covered request without a key gets on one route, named as the router names it
    /// (its `MatchedPath`: `/v1/orders/{id}/refunds`, with the prefix of a nesting router).
    /// Set again for the same route, the later mode replaces the earlier.
    pub fn route_key_mode(mut self, route: impl Into<String>, mode: KeyMode) -> Self {
        let route = route.into();
        self.route_key_modes.retain(|(known, _)| *known != route);
        self.route_key_modes.push((route, mode));
        self
    }

    /// The longest a duplicate may wait for the first attempt's answer ([`HttpConfig::max_wait`]);
    /// zero turns waiting off.
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.max_wait = wait;
        self
    }

    /// Whether requests with `method` take a key (are in [`HttpConfig::methods`]).
    pub fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// The key mode of a route (`None`: a request no router matched, as under a bare tower
    /// stack).
    pub fn key_mode_of(&self, route: Option<&str>) -> KeyMode {
        route
            .and_then(|route| {
                self.route_key_modes
                    .iter()
                    .find(|(known, _)| known == route)
                    .map(|&(_, mode)| mode)
            })
            .unwrap_or(self.key_mode)
    }
}

/// What of a plain handler's request and response is never written to the database.
///
/// The request is stored with its key for inspection (`idemflow inspect`); the handler itself
/// always gets the live request, whole. The response is stored to be replayed to whoever sends
/// the same key and request in the tenant, so what belongs to one client (a session cookie, a
/// token the handler issued) must not be in it. The live answer to the attempt that ran the
/// handler keeps every header the handler set.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Redaction {
    /// A request or response header whose lowercase name contains one of these is not stored
    /// (a response header is then not replayed either); a query parameter whose lowercase name
    /// contains one is stored with its value replaced by `REDACTED`. Broad on purpose: a false
    /// match only hides a value from `inspect`, or a header from a replay (see
    /// [`Redaction::public_response_headers`] for the standard ones that must be replayed).
    pub secret_words: Vec<String>,
    /// Response headers (lowercase names) never stored or replayed, whatever their names hold.
    pub unstored_response_headers: Vec<String>,
    /// Response headers (lowercase names) stored and replayed although their names hold a
    /// secret word: standard headers that carry no secret, whose loss would change what a
    /// replay means. Default `www-authenticate` (a 401 must carry its challenge) and
    /// `access-control-allow-credentials` (its value is `true`).
    pub public_response_headers: Vec<String>,
}

impl Default for Redaction {
    fn default() -> Self {
        let words = [
            "auth",
            "cookie",
            "token",
            "secret",
            "signature",
            "key",
            "password",
            "passwd",
            "session",
            "credential",
            "jwt",
        ];
        Self {
            secret_words: words.map(str::to_owned).to_vec(),
            unstored_response_headers: [
                "set-cookie",
                "set-cookie2",
                "authentication-info",
                "proxy-authentication-info",
            ]
            .map(str::to_owned)
            .to_vec(),
            public_response_headers: ["www-authenticate", "access-control-allow-credentials"]
                .map(str::to_owned)
                .to_vec(),
        }
    }
}

impl Redaction {
    pub(crate) fn is_secret(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        self.secret_words
            .iter()
            .any(|word| name.contains(word.as_str()))
    }

    /// Whether a response header of this name is stored, and so replayed.
    pub(crate) fn stores_response_header(&self, name: &str) -> bool {
        let listed =
            |names: &[String]| names.iter().any(|listed| listed.eq_ignore_ascii_case(name));
        !HOP_BY_HOP.contains(&name)
            && !TRANSFER.contains(&name)
            && !listed(&self.unstored_response_headers)
            && (!self.is_secret(name) || listed(&self.public_response_headers))
    }
}

/// Headers that describe one connection (RFC 9110 §7.6.1), never stored either way.
pub(crate) const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// Headers that describe one transfer of a response, not the response.
pub(crate) const TRANSFER: [&str; 3] = ["content-length", "date", "transfer-encoding"];

/// What a plain handler's status says about its execution: whether its response ends the
/// request (stored and replayed), or the request may be sent again.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct StatusRules {
    /// "Not executed; send it again": the key is deleted and the response answered, not
    /// stored, so the same key may come again (a routing refusal must not burn the key, a rate
    /// limit must not become the permanent answer). Default 404, 405, 408, 409, 425, 429, 501,
    /// 503.
    pub not_executed: Vec<StatusCode>,
    /// "The outcome is unknown" (an upstream failed or timed out behind the handler): a failed
    /// attempt, counted against the attempt budget; the response is answered, not stored, and
    /// the key stays started until a client retry runs the handler again. Default 502, 504.
    pub retried: Vec<StatusCode>,
}

impl Default for StatusRules {
    fn default() -> Self {
        Self {
            not_executed: [404, 405, 408, 409, 425, 429, 501, 503]
                .map(|code| StatusCode::from_u16(code).unwrap_or(StatusCode::NOT_FOUND))
                .to_vec(),
            retried: vec![StatusCode::BAD_GATEWAY, StatusCode::GATEWAY_TIMEOUT],
        }
    }
}

/// What becomes of a handler's response, by its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StatusClass {
    Stored,
    NotExecuted,
    Retried,
}

impl StatusRules {
    pub(crate) fn class(&self, status: StatusCode) -> StatusClass {
        if self.not_executed.contains(&status) {
            StatusClass::NotExecuted
        } else if self.retried.contains(&status) {
            StatusClass::Retried
        } else {
            StatusClass::Stored
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_headers_named_like_secrets_are_not_stored_but_standard_ones_are() {
        let redaction = Redaction::default();
        for name in [
            "x-session-token",
            "X-API-Key",
            "authorization",
            "x-upstream-signature",
            "x-jwt",
            "set-cookie",
            "authentication-info",
            "connection",
            "content-length",
        ] {
            assert!(!redaction.stores_response_header(name), "{name}");
        }
        for name in [
            "content-type",
            "location",
            "etag",
            "WWW-Authenticate",
            "access-control-allow-credentials",
            "x-request-id",
        ] {
            assert!(redaction.stores_response_header(name), "{name}");
        }
    }
}

idemflow_core::with_setters! {
    HttpConfig {
        with_methods => methods: Vec<Method>,
        with_max_body_bytes => max_body_bytes: usize,
        with_key_mode => key_mode: KeyMode,
        with_route_key_modes => route_key_modes: Vec<(String, KeyMode)>,
        with_max_wait => max_wait: Duration,
    }
}

idemflow_core::with_setters! {
    Redaction {
        with_secret_words => secret_words: Vec<String>,
        with_unstored_response_headers => unstored_response_headers: Vec<String>,
        with_public_response_headers => public_response_headers: Vec<String>,
    }
}

idemflow_core::with_setters! {
    StatusRules {
        with_not_executed => not_executed: Vec<StatusCode>,
        with_retried => retried: Vec<StatusCode>,
    }
}
