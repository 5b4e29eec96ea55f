//! The store boundary: the operations of the protocol every engine's store performs
//! ([`Store`]), in the engine's own types for what only it knows (its pool, transaction,
//! connection, owner and errors), and in shared types for what the protocol decides on
//! ([`LookUp`], [`FoundKey`], [`TakenOver`], [`Failure`]).
//!
//! An engine is proven by the one conformance suite (`tests/it/conformance.rs`), which runs every
//! case against each engine's store from one source. What each engine must keep, and how its
//! database keeps it, is in docs/engines.md.

#![deny(missing_docs)]

use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Fingerprint, Key, StoredResponse, TenantId};
use serde_json::Value;

mod console;
pub use console::{Overview, ScanFrom, StartedKeys};

/// What a failed store call means to the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A fenced write changed nothing: another owner holds the key. Stop working on it.
    Fenced,
    /// The database was busy past its limit; nothing was written. Try again later.
    Busy,
    /// Anything else: the call (and a transaction it was in) failed.
    Other,
}

/// What a look-up found.
#[derive(Debug, Clone)]
pub enum LookUp<Ticket> {
    /// The key's committed row.
    Found(FoundKey),
    /// No committed row, and a claim of the key is in flight (engines that can tell).
    Claiming,
    /// No committed row: the key may be claimed with this ticket (what the engine's look-up
    /// prepared for the claim, a fencing token on PostgreSQL).
    Absent(Ticket),
}

/// A key as a look-up sees it: what deciding a request needs.
#[derive(Debug, Clone)]
pub struct FoundKey {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The workflow that claimed the key.
    pub workflow: String,
    /// Whether its response is stored.
    pub done: bool,
    /// Time left on the lease (zero when over, or done).
    pub lease_left: Duration,
    /// The current fencing token.
    pub lock_version: i64,
    /// The stored response when done; its body is empty when stored apart.
    pub response: Option<StoredResponse>,
    /// The key's life, when its body is stored apart: read it with [`Store::response_apart`]. Each
    /// engine names a life its own way (PostgreSQL: the key's creation time in microseconds since
    /// the Unix epoch; SQLite: its claim's token); only its own store reads it back.
    pub body_apart: Option<i64>,
}

/// Everything a claim stores.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The tenant the key belongs to.
    pub tenant: &'a TenantId,
    /// The key.
    pub key: &'a Key,
    /// The request's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// The workflow (name and version) that runs the key.
    pub workflow: &'a str,
    /// The workflow's input.
    pub request: &'a Value,
    /// The claim's lease, from its insert.
    pub lease: Duration,
}

/// A key taken over from an owner whose lease ended.
#[derive(Debug, Clone)]
pub struct TakenOver<Owner> {
    /// The new owner, holding a fresh fencing token.
    pub owner: Owner,
    /// The last completed phase (`start` before any).
    pub recovery_point: String,
    /// That phase's output.
    pub phase_output: Option<Value>,
    /// The workflow's input.
    pub request: Value,
    /// Executions begun, this one included.
    pub attempts: i64,
    /// The error the previous attempt recorded, if it recorded one.
    pub last_error: Option<String>,
}

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
    /// The current fencing token; `Store::end_lease` must name it.
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

/// The protocol's operations on one engine's database.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The engine's connection pool.
    type Pool: Clone + Send + Sync + 'static;
    /// A write transaction: a claim's, a phase's, a finish's.
    type Transaction: Send;
    /// The connection a transaction runs on: what a local phase writes its effects through.
    type Connection: Send;
    /// The holder of a key's lease, named by its fencing token.
    type Owner: Clone + Debug + Send + Sync;
    /// What a look-up that found no key hands to the claim.
    type Ticket: Send;
    /// The engine's error.
    type Error: std::error::Error + Send + Sync + 'static;

    /// What `error` means to the protocol.
    fn failure(error: &Self::Error) -> Failure;

    /// The fencing token `owner` holds.
    fn token(owner: &Self::Owner) -> i64;

    /// The connection inside `transaction`.
    fn connection(transaction: &mut Self::Transaction) -> &mut Self::Connection;

    /// Reads a key before deciding on it.
    async fn look_up(
        pool: &Self::Pool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<Self::Ticket>, Self::Error>;

    /// Begins a transaction holding the claim of a key a look-up found absent; `None` when
    /// another claim of it committed first (nothing written: look it up again).
    async fn begin_claim(
        pool: &Self::Pool,
        claim: Claim<'_>,
        ticket: Self::Ticket,
    ) -> Result<Option<(Self::Transaction, Self::Owner)>, Self::Error>;

    /// Begins a write transaction (for a phase run by an owner that already holds its key).
    async fn begin(pool: &Self::Pool) -> Result<Self::Transaction, Self::Error>;

    /// Commits `transaction`.
    async fn commit(transaction: Self::Transaction) -> Result<(), Self::Error>;

    /// Rolls `transaction` back.
    async fn rollback(transaction: Self::Transaction) -> Result<(), Self::Error>;

    /// Records a completed phase in `transaction` (fenced), with a lease of `lease` from now.
    async fn advance(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), Self::Error>;

    /// Stores the response and marks the key done in `transaction` (fenced); a body longer than
    /// `apart_above` bytes is stored apart, under the key's life.
    async fn finish(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), Self::Error>;

    /// Extends `owner`'s lease to `lease` from now, never shortening it (fenced).
    async fn renew_lease(
        pool: &Self::Pool,
        owner: &Self::Owner,
        lease: Duration,
    ) -> Result<(), Self::Error>;

    /// Postpones a key after a failed attempt (fenced): its lease ends `retry_after` from now,
    /// `last_error` is recorded, and the fence advances (the owner is done with the key).
    async fn postpone(
        pool: &Self::Pool,
        owner: &Self::Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), Self::Error>;

    /// Deletes a started key `owner` holds, in `transaction` (the forget policy); fenced.
    async fn delete_owned(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
    ) -> Result<(), Self::Error>;

    /// Ends a started key's lease now if its token is still `seen`, advancing the fence: the new
    /// token, or `None` when the key is not started or its token moved on. For an operator.
    async fn end_lease(
        pool: &Self::Pool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
    ) -> Result<Option<i64>, Self::Error>;

    /// Takes `key` over from the owner holding `seen`, whose lease is over; `None` when the key
    /// moved on.
    async fn take_over(
        pool: &Self::Pool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<TakenOver<Self::Owner>>, Self::Error>;

    /// Takes over up to `batch` started keys whose lease is over, of the named workflows only,
    /// each with its workflow's lease (the resumer's scan); each comes with its workflow's name.
    async fn take_over_due(
        pool: &Self::Pool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, TakenOver<Self::Owner>)>, Self::Error>;

    /// The body stored apart for one life of a key; `None` when that life is gone.
    async fn response_apart(
        pool: &Self::Pool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, Self::Error>;

    /// Deletes up to `batch` keys finished more than `keep_for` ago, with their bodies apart;
    /// returns how many.
    async fn expire_batch(
        pool: &Self::Pool,
        keep_for: Duration,
        batch: i64,
    ) -> Result<u64, Self::Error>;
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
