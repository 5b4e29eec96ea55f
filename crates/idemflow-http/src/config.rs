use axum::http::{Method, StatusCode};

/// What a covered route accepts: shared by [`crate::WorkflowService`] and
/// [`crate::IdempotencyLayer`]. The plain-handler layer's own settings are on its builder.
#[derive(Debug, Clone)]
pub struct HttpConfig {
    /// Methods that take an idempotency key; others pass through untouched. POST and PATCH by
    /// default: PUT and DELETE are idempotent by definition (RFC 9110), GET never changes state.
    /// A [`crate::WorkflowService`] made with `new` covers POST only.
    pub methods: Vec<Method>,
    /// The largest body accepted (413 beyond); it is read whole to be fingerprinted.
    pub max_body_bytes: usize,
    /// Whether a covered request without the header is refused (400) or passed through
    /// without idempotency.
    pub require_key: bool,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            max_body_bytes: 1024 * 1024,
            require_key: true,
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

    /// Whether requests with `method` take a key (are in [`HttpConfig::methods`]).
    pub fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
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
