/// A finished request's answer, stored with the key in the same transaction as the last local
/// effect, and returned byte for byte on every replay.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredResponse {
    /// The HTTP status code (or the status of whatever protocol carries the request).
    pub status: u16,
    /// Response headers in order; names as given. Replays return exactly these.
    pub headers: Vec<(String, String)>,
    /// The exact body bytes. Written as a base64 string wherever the response is encoded as JSON
    /// (a foreign phase's recorded output): a JSON array of numbers would take ten times the
    /// bytes in memory and in the row. An array is still read, as earlier versions wrote it.
    #[serde(with = "crate::bytes")]
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A response with this status and body, and no headers.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// A JSON response with a `content-type: application/json` header.
    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        Self {
            status,
            headers: vec![("content-type".to_owned(), "application/json".to_owned())],
            body: value.to_string().into_bytes(),
        }
    }

    /// An RFC 9457 problem response (`content-type: application/problem+json`).
    pub fn problem(status: u16, value: &serde_json::Value) -> Self {
        Self {
            status,
            headers: vec![(
                "content-type".to_owned(),
                "application/problem+json".to_owned(),
            )],
            body: value.to_string().into_bytes(),
        }
    }

    /// An RFC 9457 problem in the one shape every problem of the engine and its HTTP layer
    /// has: `type` `about:blank`, `title`, `status`, `detail`, and `code`, a word a client can
    /// branch on.
    pub fn problem_of(status: u16, title: &str, code: &str, detail: &str) -> Self {
        Self::problem(status, &problem_document(status, title, code, detail))
    }

    /// Appends a header, after those already there.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The document of [`StoredResponse::problem_of`], for a layer that answers it without storing.
pub fn problem_document(status: u16, title: &str, code: &str, detail: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    })
}
