//! [`Engine`]: the operations of the protocol an engine provides, on the connections and in the
//! transactions the runner manages itself (so a request costs the round trips it does on each
//! engine, no more). Each engine's crate implements it (`idemflow-pg`'s `PgStore`,
//! `idemflow-sqlite`'s `SqliteStore`, `idemflow-mysql`'s `MySqlStore`, `idemflow-redis`'s
//! `RedisStore`); the runner and everything above it speak only this trait.
//!
//! A workflow, its phases, its runner and its resumer all name one engine: a local phase receives
//! that engine's connection ([`SqlEngine`]), and a workflow built for one engine cannot be run by
//! a runner of another (it does not compile). What every engine must keep is in
//! docs/engines.md; the conformance suite (`tests/it/conformance.rs`) proves it, one source for
//! every engine.

use std::borrow::Borrow;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow_core::{Fingerprint, Key, StoredResponse, TenantId};
use serde_json::Value;
use tokio::sync::Notify;

use crate::error::EngineError;
use crate::last_error::LastError;
use crate::layout::Maintained;
use crate::limits::{Isolation, Limits};
use crate::look_up::LookUp;
use crate::operator::Operator;
use crate::owner::KeyOwner;
use crate::pool::ConnectionPool;
use crate::standing::Standing;

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

/// A key taken over from an owner whose lease ended, as the runner goes on with it.
#[derive(Debug)]
pub struct Taken<Owner> {
    /// The new owner, holding a fresh fencing token.
    pub owner: Owner,
    /// Executions begun at the recovery point, this one included.
    pub attempts: i64,
    /// The last completed phase (`start` before any).
    pub recovery_point: String,
    /// That phase's output.
    pub phase_output: Option<Value>,
    /// The stored request.
    pub request: Value,
    /// The error the previous attempt recorded, if it recorded one.
    pub last_error: Option<String>,
    /// When the statement that wrote the new lease was sent, by this process's monotonic clock:
    /// the lease lasts at least until this instant plus its length, whatever the clocks say.
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

/// A pool of engine `E`'s connections: what lets `Runner::new(pool)` and retention's functions
/// take any engine's pool (a `PgPool`, a `SqlitePool`, a `MySqlPool`, a Redis pool) and infer
/// the engine from it. Each engine implements it for its pool, once.
pub trait EnginePool<E: Engine>: Send + Sync {
    /// The pool, as the engine names it.
    fn into_pool(self) -> E::Pool;
    /// The pool, borrowed.
    fn as_pool(&self) -> &E::Pool;
}

/// An engine the runner can drive: see the module's documentation.
#[async_trait]
pub trait Engine: Clone + Debug + Send + Sync + Sized + 'static {
    /// The engine's pool of connections.
    type Pool: ConnectionPool + EnginePool<Self>;
    /// A write transaction on a pooled connection.
    type Transaction: Send + Sync + Debug;
    /// The holder of a key's lease.
    type Owner: KeyOwner;
    /// What a look-up that found no key hands to the claim.
    type Ticket: Send + 'static;
    /// The engine's name, for logs and metrics.
    const NAME: &'static str;

    /// The connection inside `transaction`.
    fn connection(transaction: &mut Self::Transaction) -> &mut ConnectionOf<Self>;

    /// Why this engine cannot keep the protocol's guarantees in a transaction at `level`
    /// (`with_claim`: the transaction holds a new key's claim, as the leading local phases'
    /// does), or `None` where it can. A workflow whose local phases declare a refused level is
    /// refused when it is built, with this reason. By default every level but Read Committed is
    /// refused: an engine keeps a stronger one only where docs/protocol.md argues it.
    fn isolation_refused(level: Isolation, with_claim: bool) -> Option<&'static str> {
        let _ = with_claim;
        (level != Isolation::ReadCommitted)
            .then_some("this engine begins its transactions at Read Committed only")
    }

    /// Whether the keys table's layout keeps a new key's claim only at Read Committed (PostgreSQL's
    /// partitioned layout), asked on `connection` once, before a runner's first claim above Read
    /// Committed: such claims are then made at Read Committed and committed alone. A layout that
    /// changes later (a table adopted into partitions under a running process) says so by
    /// refusing the claim ([`crate::DatabaseErrorKind::ClaimLevelRefused`]). By default, no.
    async fn claims_at_read_committed_only(
        connection: &mut ConnectionOf<Self>,
    ) -> Result<bool, EngineError> {
        let _ = connection;
        Ok(false)
    }

    /// The operators' door to `pool`'s database: what tools (the console, the CLI) and tests
    /// read and do on it.
    fn operator(pool: &Self::Pool) -> Box<dyn Operator>;

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
    /// Whether `transaction` is still the one this engine began, after local phases ran in it
    /// ([`Standing`]); the runner asks before it records anything over their work. Where the
    /// engine cannot tell a commit from a rollback it answers [`Standing::Ended`]: the runner
    /// then never runs those phases again.
    async fn standing(transaction: &mut Self::Transaction) -> Result<Standing, EngineError>;

    /// Reads a key before deciding on it, outside any transaction.
    async fn look_up(
        connection: &mut ConnectionOf<Self>,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<Self::Ticket>, EngineError>;
    /// The body stored apart for one life of a key; `None` when that life is gone.
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
    /// Takes a key over from the owner holding `seen`, whose lease is over, in `transaction`;
    /// `None` when the key moved on.
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
    /// Records a completed phase in `transaction` (fenced), with a lease of `lease` from now.
    ///
    /// Like every write of an owner's, it runs only inside the transaction the engine began:
    /// if a phase ended that transaction, it changes nothing and answers [`EngineError::Fenced`],
    /// as it does when another owner holds the key ([`Engine::standing`] tells the two apart).
    async fn advance(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), EngineError>;
    /// Stores the response and marks the key done in `transaction` (fenced); a body longer than
    /// `apart_above` bytes is stored apart, under the key's life. Only inside the transaction
    /// the engine began, as [`Engine::advance`].
    async fn finish(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError>;
    /// Postpones a key after a failed attempt (fenced), in `transaction`, and announces it due:
    /// its lease ends `retry_after` from now, `last_error` is recorded, and the fence advances
    /// (the owner is done with the key).
    async fn postpone(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError>;
    /// Postpones a key on a connection of its own (a resumer giving a stopped key back).
    async fn postpone_alone(
        pool: &Self::Pool,
        owner: &Self::Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError>;
    /// Deletes a started key the owner holds (fenced): the forget policy.
    async fn delete_owned(
        transaction: &mut Self::Transaction,
        owner: &Self::Owner,
    ) -> Result<(), EngineError>;
    /// Extends the owner's lease to `lease` from now, never shortening it (fenced), outside any
    /// transaction. It renews this very owner's hold or changes nothing: where a token can be
    /// drawn twice (a draw rolled back with its transaction), the owner's holder is checked
    /// with it. So it also answers, from the row, whether an owner's uncommitted claim or
    /// takeover committed after all (under a phase that ended the transaction).
    async fn renew_lease(
        connection: &mut ConnectionOf<Self>,
        owner: &Self::Owner,
        lease: Duration,
    ) -> Result<(), EngineError>;
    /// The resumer's scan: takes over up to `batch` due keys of the named workflows, each with
    /// its workflow's lease, and each with its workflow's name.
    async fn take_over_due(
        pool: &Self::Pool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, Taken<Self::Owner>)>, EngineError>;
    /// How long the oldest lapsed lease of a started key has been over.
    async fn resumer_lag(pool: &Self::Pool) -> Result<Duration, EngineError>;
    /// Due keys of workflows not in `workflows`, by workflow.
    async fn count_due_unknown(
        pool: &Self::Pool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError>;
    /// Deletes up to `batch` keys finished more than `older_than` ago, with their bodies apart;
    /// returns how many.
    async fn expire_batch(
        pool: &Self::Pool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError>;
    /// Retention on a layout that does not delete row by row (PostgreSQL's partitions): what one
    /// maintenance run did, or `None` where retention deletes in batches.
    async fn maintain_layout(
        pool: &Self::Pool,
        keep_for: Duration,
    ) -> Result<Option<Maintained>, EngineError>;
    /// Wakes `wake` whenever a key is announced due, until dropped; never returns where the
    /// engine announces nothing between processes (the resumer polls).
    async fn listen_for_due(pool: Self::Pool, wake: Arc<Notify>);
}

/// An engine on a SQL database through sqlx: one whose transactions a local phase shares, so its
/// effects commit with the recovery point. Only a workflow on such an engine can have local
/// phases or a failure path; on any other, adding one does not compile.
///
/// Its connection is sqlx's connection to [`SqlEngine::Database`] (a local phase writes through
/// it), and its pool borrows as sqlx's pool (`pool.borrow()`, for statements of your own in code
/// generic over the engine). The pool's type itself stays the engine's, so generic code keeps
/// what the compiler knows of it: `Runner::new(pool)` works there too.
pub trait SqlEngine:
    Engine<
    Pool: ConnectionPool<
        Connection = <<Self as SqlEngine>::Database as sqlx::Database>::Connection,
    > + Borrow<sqlx::Pool<<Self as SqlEngine>::Database>>,
>
{
    /// The sqlx database the engine runs on.
    type Database: sqlx::Database;

    /// sqlx's error on this database, as the boundary reports it: the engine's own
    /// classification (a busy database, a lost connection, a missing schema), for statements
    /// sent on its connections by others than the engine (a savepoint around a failure path, a
    /// consumer's identity).
    fn engine_error(error: sqlx::Error) -> EngineError;

    /// Whether sqlx's `error` says the database rolled the transaction back to keep
    /// transactions apart (a serialization failure, a deadlock's victim: the engine's
    /// [`crate::DatabaseErrorKind::Restartable`]), read from a local phase's own error so the
    /// runner runs the transaction again instead of counting a failed attempt.
    fn is_restartable(error: &sqlx::Error) -> bool;
}

/// A done key's stored response, its body read apart when it was stored apart: what a replay of
/// it answers (before opening, where sealed). `None` when the key is absent, started, or its life
/// ended between the two reads. For tools and tests that read behind the runner's back.
pub async fn stored_response<E: Engine>(
    pool: &E::Pool,
    tenant: &TenantId,
    key: &Key,
) -> Result<Option<StoredResponse>, EngineError> {
    let mut connection = pool.acquire().await?;
    let LookUp::Found(found) = E::look_up(&mut connection, tenant, key).await? else {
        return Ok(None);
    };
    let Some(mut response) = found.response else {
        return Ok(None);
    };
    if let Some(life) = found.body_apart {
        match E::response_apart(&mut connection, tenant, key, life).await? {
            Some(body) => response.body = body,
            None => return Ok(None),
        }
    }
    Ok(Some(response))
}
