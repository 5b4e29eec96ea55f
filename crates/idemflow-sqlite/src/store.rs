//! [`SqliteStore`]: this crate's statements behind the engine boundary
//! ([`idemflow_store::Engine`]), proven by the same conformance suite as every other engine.
//!
//! SQLite's one writer shapes the steps: a claim, a takeover and every local phase hold the write
//! lock for their transaction (`BEGIN IMMEDIATE`); a look-up reads without it, so a key being
//! claimed looks absent until the claim commits, and the claim that then waits for the lock finds
//! the row and answers from it. Busy past the busy timeout is [`EngineError::Busy`]: nothing was
//! written.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_store::layout::Maintained;
use idemflow_store::{
    Claim, Claimed, Engine, EngineError, EnginePool, Isolation, LastError, Limits, LookUp, Owner,
    SqlEngine, Standing, Taken,
};
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::Notify;

use crate::Transaction;

/// The SQLite engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteStore;

impl EnginePool<SqliteStore> for SqlitePool {
    fn into_pool(self) -> SqlitePool {
        self
    }

    fn as_pool(&self) -> &SqlitePool {
        self
    }
}

impl SqlEngine for SqliteStore {
    type Database = Sqlite;

    fn engine_error(error: sqlx::Error) -> EngineError {
        crate::StoreError::from(error).into()
    }

    /// Never: one writer at a time, taken first (`BEGIN IMMEDIATE`), so no transaction meets
    /// another's writes or waits in a cycle; a busy database is [`EngineError::Busy`].
    fn is_restartable(_error: &sqlx::Error) -> bool {
        false
    }
}

#[async_trait]
impl Engine for SqliteStore {
    type Pool = SqlitePool;
    type Transaction = Transaction;
    type Owner = Owner;
    /// Nothing: the claim draws its token in its own write transaction.
    type Ticket = ();
    const NAME: &'static str = "sqlite";

    /// Every level: SQLite is serializable by nature. Every transaction of the engine takes the
    /// one write lock first (`BEGIN IMMEDIATE`), so its transactions run one at a time and each
    /// declared level is kept, as Serializable; none is stated, and none ever restarts.
    fn isolation_refused(_level: Isolation, _with_claim: bool) -> Option<&'static str> {
        None
    }

    fn connection(transaction: &mut Transaction) -> &mut SqliteConnection {
        transaction.connection()
    }

    fn operator(pool: &SqlitePool) -> Box<dyn idemflow_store::Operator> {
        Box::new(crate::SqliteOperator::new(pool.clone()))
    }

    /// SQLite has no per-statement time limit a session can set: a local phase is held to its
    /// limit by the runner (and the statement timeout every connection gets when it opens), and
    /// its connection closed (rolling back) past it.
    async fn begin(
        connection: PoolConnection<Sqlite>,
        _limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Ok(Transaction::begin(connection).await?)
    }

    async fn commit_keeping(
        transaction: Transaction,
    ) -> Result<PoolConnection<Sqlite>, EngineError> {
        Ok(transaction.commit().await?)
    }

    async fn rollback(transaction: Transaction) -> Result<(), EngineError> {
        transaction.rollback().await?;
        Ok(())
    }

    fn abandon(transaction: Transaction) {
        transaction.abandon();
    }

    async fn back_to_claim(transaction: &mut Transaction) -> Result<(), EngineError> {
        Ok(transaction.back_to_claim().await?)
    }

    async fn standing(transaction: &mut Transaction) -> Result<Standing, EngineError> {
        Ok(transaction.standing())
    }

    async fn look_up(
        connection: &mut SqliteConnection,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, EngineError> {
        Ok(match crate::look_up(connection, tenant, key).await? {
            crate::LookUp::Found(found) => LookUp::Found(found),
            crate::LookUp::Absent => LookUp::Absent(()),
        })
    }

    async fn response_apart(
        connection: &mut SqliteConnection,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(crate::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: PoolConnection<Sqlite>,
        claim: Claim<'_>,
        (): (),
        _limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        Ok(match crate::begin_claim(connection, &claim).await? {
            crate::Claimed::Owned(transaction, owner) => Claimed::Owned(transaction, owner),
            crate::Claimed::Lost(connection) => Claimed::Lost(connection),
        })
    }

    /// The claim draws a fresh token under the write lock: the refused one was never seen.
    async fn claim_again(
        connection: PoolConnection<Sqlite>,
        claim: Claim<'_>,
        _token: i64,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        Self::begin_claim(connection, claim, (), limits).await
    }

    async fn take_over(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<Taken<Owner>>, EngineError> {
        Ok(crate::take_over_in(transaction.connection(), tenant, key, seen, lease).await?)
    }

    /// The write lock this transaction holds is the claim's exclusion: an abandoned transaction's
    /// connection has closed (or still holds the lock, and this one could not have begun).
    async fn wait_for_claim_lock(
        _transaction: &mut Transaction,
        _tenant: &TenantId,
        _key: &Key,
        _wait: Duration,
    ) -> Result<bool, EngineError> {
        Ok(true)
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), EngineError> {
        // Outside the transaction the engine began, a write would commit alone: it is not sent.
        if transaction.standing() != Standing::Open {
            return Err(EngineError::Fenced);
        }
        let connection = transaction.connection();
        Ok(crate::advance(connection, owner, recovery_point, output, lease).await?)
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError> {
        if transaction.standing() != Standing::Open {
            return Err(EngineError::Fenced);
        }
        let connection = transaction.connection();
        Ok(crate::finish(connection, owner, recovery_point, response, apart_above).await?)
    }

    /// No announcement: resumers on SQLite poll.
    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError> {
        let connection = transaction.connection();
        Ok(crate::postpone_in(connection, owner, retry_after, last_error.as_str()).await?)
    }

    async fn postpone_alone(
        pool: &SqlitePool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError> {
        let connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        crate::postpone(connection, owner, retry_after, last_error.as_str()).await?;
        Ok(())
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), EngineError> {
        Ok(crate::delete_owned(transaction.connection(), owner).await?)
    }

    async fn renew_lease(
        connection: &mut SqliteConnection,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(crate::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &SqlitePool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, Taken<Owner>)>, EngineError> {
        let connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        let (due, _connection) = crate::take_over_due(connection, workflows, batch).await?;
        Ok(due)
    }

    async fn resumer_lag(pool: &SqlitePool) -> Result<Duration, EngineError> {
        let mut connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        Ok(crate::resumer_lag(&mut connection).await?)
    }

    async fn count_due_unknown(
        pool: &SqlitePool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        let mut connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        Ok(crate::count_due_unknown(&mut connection, workflows).await?)
    }

    async fn expire_batch(
        pool: &SqlitePool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        let (deleted, _connection) = crate::expire_batch(connection, older_than, batch).await?;
        Ok(deleted)
    }

    /// One table: retention deletes in batches.
    async fn maintain_layout(
        _pool: &SqlitePool,
        _keep_for: Duration,
    ) -> Result<Option<Maintained>, EngineError> {
        Ok(None)
    }

    /// Nothing announces due keys between processes on SQLite: the resumer polls.
    async fn listen_for_due(_pool: SqlitePool, _wake: Arc<Notify>) {
        std::future::pending::<()>().await;
    }
}
