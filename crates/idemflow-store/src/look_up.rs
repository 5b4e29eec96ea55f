//! What a look-up of a key found ([`LookUp`], [`FoundKey`]): what deciding a request needs.

use std::time::Duration;

use idemflow_core::{Fingerprint, StoredResponse};

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
    /// The key's life, when its body is stored apart: read it with `Engine::response_apart`. Each
    /// engine names a life its own way (PostgreSQL: the key's creation time in microseconds since
    /// the Unix epoch; SQLite: its claim's token); only its own store reads it back.
    pub body_apart: Option<i64>,
}
