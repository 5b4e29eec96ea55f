//! What operators read of a key and of the table, whatever the engine: a key's report with its
//! journal ([`KeyReport`], [`JournalEntry`]), its stored bodies ([`KeyBodies`]) and the table's
//! statistics ([`TableStats`]).

use serde_json::Value;

/// Everything about one key, for operators (`idemflow inspect`, `list --stuck`), whatever the
/// engine.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KeyReport {
    /// The tenant the key belongs to.
    pub tenant: String,
    /// The idempotency key.
    pub key: String,
    /// The name of the workflow that claimed the key.
    pub workflow: String,
    /// `started` or `done`.
    pub state: String,
    /// The name of the last completed phase, `start` before any.
    pub recovery_point: String,
    /// Milliseconds left on the lease (negative: expired that long ago); `None` when done.
    pub lease_left_ms: Option<i64>,
    /// The current fencing token; ending the lease must name it.
    pub lock_version: i64,
    /// Executions begun at this recovery point (the claim, each takeover); back to 1 when a
    /// phase completes.
    pub attempts: i32,
    /// The error the last failed attempt recorded; cleared when a phase completes.
    pub last_error: Option<String>,
    /// The stored response's HTTP status; `None` while started.
    pub response_status: Option<i16>,
    /// The stored response body's length in bytes; `None` while started.
    pub response_bytes: Option<i32>,
    /// The request fingerprint, as 64 lowercase hex digits.
    pub fingerprint_hex: String,
    /// Age in whole seconds.
    pub age_seconds: i64,
    /// The key's timeline, oldest first ([`JournalEntry`]): at most [`JOURNAL_LIMIT`] entries,
    /// the claim always first. Empty for a key claimed before the journal existed, and when the
    /// stored journal cannot be read (a warning is logged; the report itself never fails on it).
    pub journal: Vec<JournalEntry>,
}

/// How many entries a key's journal keeps: when full, each new entry drops the oldest one after
/// the claim (the second), so the claim stays first and the newest last, and a key that fails
/// or is taken over again and again cannot grow its row without bound.
pub const JOURNAL_LIMIT: usize = 64;

/// One event in a key's journal: what changed the key, when, and the fencing token it held after
/// the change. Each entry is written by the database, in the very statement that makes the change
/// (the claim, an advance, a failed attempt's record, a takeover, an ended lease, the finish),
/// with the time read off the database's clock; never in a statement of its own.
///
/// An entry holds no request data (the journal is not sealed): only recovery-point names, tokens,
/// times, attempt numbers, statuses and a failed attempt's error text, which `last_error` already
/// stores in the clear.
///
/// Stored as a JSON object: `{"at": <ms>, "event": "<event>", "token": <n>, ...}`, with `point`,
/// `error`, `by`, `attempt` and `status` present only for the events that carry them.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalEntry {
    /// When, in milliseconds since the Unix epoch, by the database's clock (`at`).
    #[serde(rename = "at")]
    pub at_ms: i64,
    /// What happened: `claimed`, `phase` (a phase completed: a recovery point), `failed` (a
    /// failed attempt recorded), `taken_over` (by a resumer or a client retry), `lease_ended` (by
    /// an operator) or `finished` (the response stored).
    pub event: String,
    /// The key's fencing token (`lock_version`) after the change.
    pub token: i64,
    /// `phase`: the recovery point reached; `failed`: the recovery point the attempt began at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub point: Option<String>,
    /// `failed`: the error recorded (the text `last_error` gets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `taken_over`: `resumer` or `retry`; `lease_ended`: `operator`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub by: Option<String>,
    /// `taken_over`: the attempt the takeover begins (the key's `attempts` after it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i64>,
    /// `finished`: the stored response's HTTP status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<i64>,
}

/// A key's journal from its column's JSON text, for the engines' reports. A journal that is not
/// a JSON array of entries is logged (a warning naming the key) and read as empty, so a damaged
/// column never makes a report fail.
pub fn journal_from_json(tenant: &str, key: &str, json: &str) -> Vec<JournalEntry> {
    match serde_json::from_str(json) {
        Ok(journal) => journal,
        Err(error) => {
            tracing::warn!(%tenant, %key, %error, "a key's journal is unreadable; reported empty");
            Vec::new()
        }
    }
}

/// Counts by state and workflow, the oldest started key and the resumer lag.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TableStats {
    /// (workflow, state, count), ordered.
    pub counts: Vec<(String, String, i64)>,
    /// Age in seconds of the oldest started key.
    pub oldest_started_seconds: Option<i64>,
    /// Milliseconds since the oldest expired lease of a started key ended.
    pub resumer_lag_ms: i64,
}

/// The member of a sealed JSON value, and the one header name of a sealed response, whose value
/// is the id of the key it was sealed under (`idemflow_runner`'s sealing, docs/operations.md
/// "What is stored"). Read here so a tool without the keyring can say what is sealed, and under
/// which key, without opening it.
pub const SEALED_MARKER: &str = "idemflow:sealed";

/// A key's stored request and response exactly as the database holds them, for operators
/// (`idemflow inspect --show-request --show-response`, a console): after redaction, which
/// happened before storage, and still sealed where the runner sealed them (nothing here opens a
/// sealed value: [`KeyBodies::request_sealed_under`] and [`KeyResponse::sealed_under`] name the
/// key instead). Each engine reads it with its `key_bodies`, in one statement, so the request,
/// the response and a body stored apart come from one snapshot.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KeyBodies {
    /// The workflow's input as stored; sealed, `{"idemflow:sealed": "<key id>", "data": "…"}`.
    pub request: Value,
    /// The stored response; `None` while the key is started.
    pub response: Option<KeyResponse>,
    /// Whole seconds since the response was stored, by the database's clock: retention's window
    /// starts there (a key is deleted once this passes the retention period). `None` while
    /// started: a started key is never expired.
    pub finished_seconds_ago: Option<i64>,
}

impl KeyBodies {
    /// The id of the key the stored request is sealed under; `None` when it is stored in the
    /// clear. As the runner tells: an object of exactly the marker (a string) and the data.
    pub fn request_sealed_under(&self) -> Option<&str> {
        let Value::Object(members) = &self.request else {
            return None;
        };
        match (
            members.len(),
            members.get(SEALED_MARKER),
            members.get("data"),
        ) {
            (2, Some(Value::String(key_id)), Some(Value::String(_))) => Some(key_id),
            _ => None,
        }
    }
}

/// A done key's response as stored: what every retry replays (once opened, when sealed).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KeyResponse {
    /// The HTTP status; readable even when the response is sealed.
    pub status: u16,
    /// The headers in order; sealed, the one pair `("idemflow:sealed", "<key id>")`.
    pub headers: Vec<(String, idemflow_core::FieldValue)>,
    /// The body's exact bytes, read from `idempotency_responses` when stored apart; sealed, the
    /// ciphertext of the headers and the body. Base64 in JSON.
    #[serde(with = "idemflow_core::bytes")]
    pub body: Vec<u8>,
    /// Whether the body is stored apart from the key's row (`idempotency_responses`).
    pub apart: bool,
}

impl KeyResponse {
    /// The id of the key the response (headers and body) is sealed under; `None` when it is
    /// stored in the clear.
    pub fn sealed_under(&self) -> Option<&str> {
        match self.headers.as_slice() {
            [(name, key_id)] if name == SEALED_MARKER => key_id.to_str(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod key_bodies_tests {
    use serde_json::json;

    use super::*;

    fn response(headers: Vec<(String, idemflow_core::FieldValue)>) -> KeyResponse {
        KeyResponse {
            status: 201,
            headers,
            body: b"{}".to_vec(),
            apart: false,
        }
    }

    #[test]
    fn sealed_values_name_their_key_as_the_runner_marks_them() {
        let sealed = KeyBodies {
            request: json!({"idemflow:sealed": "2026-12", "data": "AQID"}),
            response: None,
            finished_seconds_ago: None,
        };
        assert_eq!(sealed.request_sealed_under(), Some("2026-12"));
        // A request that merely holds the member, or more than the two, is not sealed.
        for request in [
            json!({"idemflow:sealed": "2026-12"}),
            json!({"idemflow:sealed": "2026-12", "data": "AQID", "amount": 1}),
            json!({"idemflow:sealed": 7, "data": "AQID"}),
            json!(["idemflow:sealed", "data"]),
        ] {
            let clear = KeyBodies {
                request,
                ..sealed.clone()
            };
            assert_eq!(clear.request_sealed_under(), None, "{:?}", clear.request);
        }

        let marker = (SEALED_MARKER.to_owned(), "2026-12".into());
        assert_eq!(
            response(vec![marker.clone()]).sealed_under(),
            Some("2026-12")
        );
        let plain = ("content-type".to_owned(), "application/json".into());
        assert_eq!(response(vec![plain.clone()]).sealed_under(), None);
        assert_eq!(response(vec![marker, plain]).sealed_under(), None);
        assert_eq!(response(Vec::new()).sealed_under(), None);
    }
}
