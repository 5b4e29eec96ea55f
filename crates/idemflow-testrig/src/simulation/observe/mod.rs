//! What a schedule reads and does behind the engine's back, per engine: the observer's reads of
//! the keys' rows, the chaos it writes (leases rewound, an operator's `end-lease`, the clock
//! moved, an output corrupted, a connection killed), and the reads the final checks make.
//!
//! Every write here stands aside rather than wait for an owner: PostgreSQL's and MySQL's skip row
//! locks (`FOR UPDATE SKIP LOCKED`); SQLite's take the one write lock only if it is free within a short
//! busy timeout. Either way the chaos never lands in the middle of an owner's transaction; it
//! lands between two of them, which is where a lapsed lease or an operator meets an owner.

mod mysql;
mod pg;
mod sqlite;

use crate::server_log::ServerLog;
use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use serde_json::Value;

pub(crate) use mysql::MySqlObserver;
pub(crate) use pg::PgObserver;
pub(crate) use sqlite::SqliteObserver;

/// One row of `sim_effects`: key, life, phase, token, claim.
pub(crate) type EffectRow = (String, i64, String, i64, Option<String>);

/// A key's row as the schedule samples it. Times are text, compared for equality only.
#[derive(Debug, Clone)]
pub(crate) struct SampledRow {
    pub key: String,
    pub state: String,
    pub lock_version: i64,
    pub locked_until: Option<String>,
    pub recovery_point: String,
    pub created_at: String,
    pub request: Value,
    /// Started with its lease over.
    pub due: bool,
}

/// What a foreign call's check reads of its key.
#[derive(Debug, Clone)]
pub(crate) struct CallerView {
    pub lock_version: i64,
    pub state: String,
    pub recovery_point: String,
    /// The lease is live (`None` when the key holds none).
    pub live: Option<bool>,
    pub request: Value,
}

/// A finished key's stored response, with the token it is sealed under and its request.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    pub response: Option<StoredResponse>,
    pub lock_version: i64,
    pub request: Option<Value>,
}

/// How making a key's lease lapse at the wind-down went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lapse {
    Done,
    /// The key stayed locked after every actor ended: a transaction no one ends holds it.
    Stuck,
    Failed,
}

/// The schedule's reads and chaos on one engine.
#[async_trait]
pub(crate) trait Observe: Send + Sync {
    /// The engine's name, for the report.
    fn engine(&self) -> &'static str;

    /// How far a lease written from a phase's end may fall short of whole by the clock's
    /// rounding alone, in seconds.
    fn clock_resolution(&self) -> f64;

    /// Every key of `tenant`.
    async fn rows(&self, tenant: &TenantId) -> Result<Vec<SampledRow>, String>;

    /// What a foreign call's check reads of `key`.
    async fn caller_view(&self, tenant: &TenantId, key: &str)
    -> Result<Option<CallerView>, String>;

    /// A started key's lease end (seconds since the epoch) and token.
    async fn started_lease(&self, tenant: &TenantId, key: &str) -> Option<(f64, i64)>;

    /// A key's token.
    async fn token(&self, tenant: &TenantId, key: &str) -> Option<i64>;

    /// Rewinds a started key's lease if its token and lease end are still as sampled and no
    /// owner is writing it; whether it did.
    async fn expire_lease(
        &self,
        tenant: &TenantId,
        key: &str,
        lock_version: i64,
        locked_until: Option<&str>,
    ) -> bool;

    /// An operator's `end-lease` on a key whose lease end is still as sampled; whether it did.
    async fn end_lease(&self, tenant: &TenantId, key: &str, locked_until: Option<&str>) -> bool;

    /// An operator's expiry of one key from the console, under the token and state it was shown
    /// (the engine's own `expire_key`): the state of the key it deleted, `None` when none.
    async fn expire_key(
        &self,
        tenant: &TenantId,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Option<String>;

    /// Finished keys still within `window` (with a minute's margin): retention must keep them.
    async fn done_within(&self, tenant: &TenantId, window: Duration) -> Vec<String>;

    /// Every key of `tenant` present now.
    async fn present(&self, tenant: &TenantId) -> HashSet<String>;

    /// Moves every key of `tenant` (no owner writing it) `hours` into the past; whether it did.
    async fn time_jump(&self, tenant: &TenantId, hours: i64) -> bool;

    /// Kills one of the engine's connections (the `offset`th); whether one was. An engine with no
    /// server (SQLite) has none to kill.
    async fn kill(&self, offset: i64) -> bool;

    /// Replaces the output stored at `price` (a deploy changed its type); whether it did.
    async fn corrupt(&self, tenant: &TenantId, key: &str) -> bool;

    /// Makes a started key's lease lapse at the wind-down, waiting for the key if it must.
    async fn lapse(&self, tenant: &TenantId, key: &str) -> Lapse;

    /// A key's stored response (its body apart read back), token and request.
    async fn stored(&self, tenant: &TenantId, key: &Key) -> Result<Option<Stored>, String>;

    /// Local effects committed more than once: (key, life, phase, times), per claim if asked.
    /// Every effect row of `tenant`: key, life, phase, the token it ran under and the claim (its
    /// time) it ran in.
    async fn effect_rows(&self, tenant: &TenantId) -> Vec<EffectRow>;

    /// The tokens `phase` of `key`'s `life` committed under (in its present claim, if asked),
    /// once per time it committed.
    async fn effects_of(
        &self,
        tenant: &TenantId,
        key: &str,
        life: i64,
        phase: &str,
        per_claim: bool,
    ) -> Vec<i64>;

    /// Consumer ledger rows under `prefix` applied more than once.
    async fn ledger_twice(&self, prefix: &str) -> Vec<(String, i64)>;

    /// Messages under `prefix` with an effect and no identity, or the other way round.
    async fn ledger_disagreeing(&self, prefix: &str) -> Vec<String>;

    /// Transactions the engine's pool left open once every actor ended (PostgreSQL: its sessions
    /// idle in a transaction; SQLite: the write lock still held).
    async fn transactions_left_open(&self) -> i64;

    /// Where the server's own log ends now, for [`Observe::lost_claims_logged`]: `None` where
    /// there is no such log to check (SQLite has no server; MySQL and MariaDB do not log the
    /// errors they send clients).
    async fn server_log_start(&self) -> Option<Result<ServerLog, String>> {
        None
    }

    /// The `ERROR` lines the server logged since `start` for claims of `tenant`'s keys that lost
    /// the race for their key: the engine answers those from the winner's row, and must not
    /// page an operator for them.
    async fn lost_claims_logged(
        &self,
        _tenant: &TenantId,
        _start: &ServerLog,
    ) -> Result<Vec<String>, String> {
        Ok(Vec::new())
    }

    /// How long a transaction may take to end on its own after every actor ended (a connection
    /// handed back and tested by the pool, a statement the server runs on until its timeout).
    fn left_open_patience(&self) -> Duration {
        Duration::from_secs(1)
    }
}
