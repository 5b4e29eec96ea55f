//! The engine a runner drives: the store operations of the protocol, on the connections and in the
//! transactions the runner manages itself (so a request costs the round trips it does on each
//! engine, no more).
//!
//! [`Engine`] is implemented by each engine's store type: [`PgStore`] (the default everywhere a
//! type takes an engine, so PostgreSQL code names none), [`SqliteStore`] and [`MySqlStore`]. A workflow, its
//! phases, its runner and its resumer all name one engine: a local phase receives that engine's
//! connection, and a workflow built for one engine cannot be run by a runner of another (it does
//! not compile). The statements themselves live in the engine's crate (`idemflow-pg`,
//! `idemflow-sqlite`); the implementations here only say which of them the runner's steps are.
//! What every engine must keep is in docs/engines.md; the conformance suite proves it.

mod mysql;
mod pg;
mod pool;
#[cfg(feature = "redis")]
mod redis;
mod sqlite;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
pub use idemflow_mysql::MySqlStore;
use idemflow_pg::Limits;
pub use idemflow_pg::PgStore;
#[cfg(feature = "redis")]
pub use idemflow_redis::RedisStore;
pub use idemflow_sqlite::SqliteStore;
use idemflow_store::{Claim, LookUp};
use serde_json::Value;
use tokio::sync::Notify;

pub use pool::ConnectionPool;

use crate::error::RunError;

/// What a store call's failure means to the runner.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A fenced write changed nothing: another owner holds the key.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// The database was busy past its limit (SQLite's one writer); nothing was written.
    #[error("busy: the database's writer was held for longer than its busy timeout")]
    Busy,
    /// A statement failed or the connection broke.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// A stored row breaks the schema's promises.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for EngineError {
    fn from(error: sqlx::Error) -> Self {
        Self::Database(error)
    }
}

/// The holder of a key's lease, as the runner reads it.
pub trait KeyOwner: Clone + Debug + Send + Sync + 'static {
    /// The tenant the key belongs to.
    fn tenant(&self) -> &TenantId;
    /// The key.
    fn key(&self) -> &Key;
    /// The fencing token the owner holds.
    fn lock_version(&self) -> i64;
}

/// A key taken over, as the runner goes on with it.
#[derive(Debug)]
pub struct Taken<Owner> {
    /// The new owner.
    pub owner: Owner,
    /// Executions begun at the recovery point, this one included.
    pub attempts: i64,
    /// The last completed phase (`start` before any).
    pub recovery_point: String,
    /// That phase's output.
    pub phase_output: Option<Value>,
    /// The stored request.
    pub request: Value,
    /// The error the previous attempt recorded.
    pub last_error: Option<String>,
    /// When the statement that wrote the new lease was sent (this process's monotonic clock).
    pub lease_from: Instant,
}

/// What a claim of an absent key came to.
#[derive(Debug)]
pub enum Claimed<E: Engine> {
    /// The key is ours, in an open transaction holding the uncommitted claim.
    Owned(E::Transaction, E::Owner),
    /// Another claim committed first; nothing was written. The connection, idle.
    Lost(PooledOf<E>),
}

/// The connection engine `E`'s statements run on; a local phase of a [`SqlEngine`] writes its
/// effects through it.
pub type ConnectionOf<E> = <<E as Engine>::Pool as ConnectionPool>::Connection;

/// A connection of engine `E` taken from its pool.
pub type PooledOf<E> = <<E as Engine>::Pool as ConnectionPool>::Pooled;

/// The pool of engine `E`.
pub type PoolOf<E> = <E as Engine>::Pool;

mod sealed {
    pub trait Sealed {}
    impl Sealed for idemflow_pg::PgStore {}
    impl Sealed for idemflow_sqlite::SqliteStore {}
    impl Sealed for idemflow_mysql::MySqlStore {}
    #[cfg(feature = "redis")]
    impl Sealed for idemflow_redis::RedisStore {}
}

/// An engine the runner can drive: see the module's documentation. Implemented by [`PgStore`],
/// [`SqliteStore`] and [`MySqlStore`]; sealed (a new engine is added here, and proven by the conformance suite).
#[async_trait]
pub trait Engine: sealed::Sealed + Clone + Debug + Send + Sync + Sized + 'static {
    /// The engine's pool of connections.
    type Pool: ConnectionPool;
    /// A write transaction on a pooled connection.
    type Transaction: Send + Sync + Debug;
    /// The holder of a key's lease.
    type Owner: KeyOwner;
    /// What a look-up that found no key hands to the claim.
    type Ticket: Send + 'static;
    /// A key a resumer's scan took over.
    type TakenOver: Send + Debug + 'static;
    /// The engine's name, for logs and metrics.
    const NAME: &'static str;

    /// The connection inside `transaction`.
    fn connection(transaction: &mut Self::Transaction) -> &mut ConnectionOf<Self>;
    /// What the runner goes on with, from a resumer's takeover.
    fn taken(taken: Self::TakenOver) -> Taken<Self::Owner>;
    /// The owner of a key a resumer's scan took over.
    fn taken_owner(taken: &Self::TakenOver) -> &Self::Owner;

    /// Begins a write transaction under `limits` on `connection`.
    async fn begin(
        connection: PooledOf<Self>,
        limits: &Limits,
    ) -> Result<Self::Transaction, EngineError>;
    /// Commits, handing the connection back idle.
    async fn commit_keeping(transaction: Self::Transaction) -> Result<PooledOf<Self>, EngineError>;
    /// Rolls back.
    async fn rollback(transaction: Self::Transaction) -> Result<(), EngineError>;
    /// Gives the transaction's connection up (closed, not pooled): a statement may still run.
    fn abandon(transaction: Self::Transaction);
    /// Undoes everything since the claim, keeping the uncommitted claim.
    async fn back_to_claim(transaction: &mut Self::Transaction) -> Result<(), EngineError>;

    /// Reads a key before deciding on it, outside any transaction.
    async fn look_up(
        connection: &mut ConnectionOf<Self>,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<Self::Ticket>, EngineError>;
    /// The body stored apart for one life of a key.
    async fn response_apart(
        connection: &mut ConnectionOf<Self>,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError>;
    /// Begins a transaction holding the claim of an absent key.
    async fn begin_claim(
        connection: PooledOf<Self>,
        claim: Claim<'_>,
        ticket: Self::Ticket,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError>;
    /// Claims again, with the token the lost claim held (nobody else ever saw it), after the
    /// claim's first commit was refused.
    async fn claim_again(
        connection: PooledOf<Self>,
        claim: Claim<'_>,
        token: i64,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError>;
    /// Takes a key over from the owner holding `seen`, in `transaction`.
    async fn take_over(
        transaction: &mut Self::Transaction,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<Taken<Self::Owner>>, EngineError>;
    /// Waits (up to `wait`) until no other session holds the key's claim; false if one still does.
    async fn wait_for_claim_lock(
        transaction: &mut Self::Transaction,
        tenant: &TenantId,
        key: &Key,
        wait: Duration,
    ) -> Result<bool, EngineError>;
    /// Records a completed phase (fenced).
    async fn advance(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), EngineError>;
    /// Stores the response and marks the key done (fenced).
    async fn finish(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError>;
    /// Postpones a key after a failed attempt (fenced), in `transaction`, and announces it due.
    async fn postpone(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError>;
    /// Postpones a key on a connection of its own (a resumer giving a stopped key back).
    async fn postpone_alone(
        pool: &PoolOf<Self>,
        owner: &Self::Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError>;
    /// Deletes a started key the owner holds (fenced).
    async fn delete_owned(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
    ) -> Result<(), EngineError>;
    /// Extends the owner's lease, never shortening it (fenced), outside any transaction.
    async fn renew_lease(
        connection: &mut ConnectionOf<Self>,
        owner: &Self::Owner,
        lease: Duration,
    ) -> Result<(), EngineError>;
    /// The resumer's scan: takes over up to `batch` due keys of the named workflows, each with
    /// its workflow's name.
    async fn take_over_due(
        pool: &PoolOf<Self>,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, Self::TakenOver)>, EngineError>;
    /// How long the oldest lapsed lease of a started key has been over.
    async fn resumer_lag(pool: &PoolOf<Self>) -> Result<Duration, EngineError>;
    /// Due keys of workflows not in `workflows`, by workflow.
    async fn count_due_unknown(
        pool: &PoolOf<Self>,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError>;
    /// Deletes up to `batch` keys finished more than `older_than` ago.
    async fn expire_batch(
        pool: &PoolOf<Self>,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError>;
    /// Retention on a layout that does not delete row by row (PostgreSQL's partitions): the keys
    /// dropped, or `None` where retention deletes in batches.
    async fn maintain_layout(
        pool: &PoolOf<Self>,
        keep_for: Duration,
    ) -> Result<Option<u64>, RunError>;
    /// Wakes `wake` whenever a key is announced due, until dropped; never returns where the
    /// engine announces nothing between processes (the resumer polls).
    async fn listen_for_due(pool: PoolOf<Self>, wake: Arc<Notify>);
}

/// An engine on a SQL database through sqlx: one whose transactions a local phase shares, so its
/// effects commit with the recovery point. Only a workflow on such an engine can have local
/// phases or a failure path ([`crate::LocalPhase`], [`crate::FailurePhase`]); on any other, adding
/// one does not compile. Sealed, like [`Engine`].
pub trait SqlEngine: Engine<Pool = sqlx::Pool<<Self as SqlEngine>::Database>> {
    /// The sqlx database the engine runs on.
    type Database: sqlx::Database;
}

impl SqlEngine for PgStore {
    type Database = sqlx::Postgres;
}

impl SqlEngine for SqliteStore {
    type Database = sqlx::Sqlite;
}

impl SqlEngine for MySqlStore {
    type Database = sqlx::MySql;
}

/// The engine a database's pool runs by default: what lets `Runner::new(pool)` and retention's
/// functions take any engine's pool and infer the engine.
pub trait EngineOf: sqlx::Database {
    /// The engine.
    type Engine: SqlEngine<Database = Self>;
}

impl EngineOf for sqlx::Postgres {
    type Engine = PgStore;
}

impl EngineOf for sqlx::Sqlite {
    type Engine = SqliteStore;
}

impl EngineOf for sqlx::MySql {
    type Engine = MySqlStore;
}

/// The engine a pool belongs to: what lets `Runner::new(pool)` and retention's functions take any
/// engine's pool (a `PgPool`, a `SqlitePool`, a `MySqlPool`, a Redis store's pool) and infer the
/// engine.
pub trait PoolEngine: ConnectionPool {
    /// The engine.
    type Engine: Engine<Pool = Self>;
}

impl<D: EngineOf> PoolEngine for sqlx::Pool<D> {
    type Engine = D::Engine;
}

#[cfg(feature = "redis")]
impl PoolEngine for idemflow_redis::RedisPool {
    type Engine = RedisStore;
}
