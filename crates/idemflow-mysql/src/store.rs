//! [`MySqlStore`]: this crate's statements behind the engine boundary
//! ([`idemflow_store::Engine`]), proven by the same conformance suite as every other engine.
//!
//! A look-up is a consistent read, so a key being claimed looks absent until the claim commits;
//! the claim's insert then waits for that claim's transaction and, refused by the duplicate key,
//! answers from the committed row. Lock waits past the lock wait timeout are [`EngineError::Busy`];
//! a deadlock's victim is a restartable database error (the runner runs its transaction again):
//! either way the transaction is lost, nothing it wrote is kept.

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
use sqlx::{MySql, MySqlConnection, MySqlPool};
use tokio::sync::Notify;

use crate::Transaction;

/// The MySQL/MariaDB engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct MySqlStore;

impl EnginePool<MySqlStore> for MySqlPool {
    fn into_pool(self) -> MySqlPool {
        self
    }

    fn as_pool(&self) -> &MySqlPool {
        self
    }
}

impl SqlEngine for MySqlStore {
    type Database = MySql;

    fn engine_error(error: sqlx::Error) -> EngineError {
        crate::StoreError::from(error).into()
    }

    fn is_restartable(error: &sqlx::Error) -> bool {
        crate::error::is_restartable(error)
    }
}

#[async_trait]
impl Engine for MySqlStore {
    type Pool = MySqlPool;
    type Transaction = Transaction;
    type Owner = Owner;
    /// Nothing: the claim's insert draws its token (the key's life).
    type Ticket = ();
    const NAME: &'static str = "mysql";

    /// Every level: InnoDB decides the claim's insert and every fenced write on the latest
    /// committed row (a locking read), whatever the transaction's snapshot, so the primary key
    /// and the fence hold as at Read Committed; the level is set for the one transaction, and
    /// the session stays at Read Committed for the engine's own (docs/protocol.md).
    fn isolation_refused(_level: Isolation, _with_claim: bool) -> Option<&'static str> {
        None
    }

    fn connection(transaction: &mut Transaction) -> &mut MySqlConnection {
        transaction.connection()
    }

    fn operator(pool: &MySqlPool) -> Box<dyn idemflow_store::Operator> {
        Box::new(crate::MySqlOperator::new(pool.clone()))
    }

    /// The session's statement timeout (`max_statement_time`, set as each connection opens)
    /// bounds every statement; a local phase is held to its own limit by the runner, and its
    /// connection closed (the server rolling back) past it.
    async fn begin(
        connection: PoolConnection<MySql>,
        limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Ok(Transaction::begin_at(connection, limits.isolation).await?)
    }

    async fn commit_keeping(
        transaction: Transaction,
    ) -> Result<PoolConnection<MySql>, EngineError> {
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
        Ok(transaction.standing().await?)
    }

    async fn look_up(
        connection: &mut MySqlConnection,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, EngineError> {
        Ok(match crate::look_up(connection, tenant, key).await? {
            crate::LookUp::Found(found) => LookUp::Found(found),
            crate::LookUp::Absent => LookUp::Absent(()),
        })
    }

    async fn response_apart(
        connection: &mut MySqlConnection,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(crate::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: PoolConnection<MySql>,
        claim: Claim<'_>,
        (): (),
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        Ok(
            match crate::begin_claim_at(connection, &claim, limits.isolation).await? {
                crate::Claimed::Owned(transaction, owner) => Claimed::Owned(transaction, owner),
                crate::Claimed::Lost(connection) => Claimed::Lost(connection),
            },
        )
    }

    /// The claim keeps its token: its insert stores the life the rolled-back one drew (nobody
    /// else saw it; docs/protocol.md) rather than drawing a new one.
    async fn claim_again(
        connection: PoolConnection<MySql>,
        claim: Claim<'_>,
        token: i64,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        Ok(
            match crate::claim_again_at(connection, &claim, token, limits.isolation).await? {
                crate::Claimed::Owned(transaction, owner) => Claimed::Owned(transaction, owner),
                crate::Claimed::Lost(connection) => Claimed::Lost(connection),
            },
        )
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

    /// The key's row lock is the claim's exclusion: the takeover's fenced update waits for any
    /// transaction still holding the row (up to the lock wait timeout), and an abandoned one's
    /// statements end at the server's statement timeout.
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
        let connection = transaction.connection();
        Ok(crate::finish(connection, owner, recovery_point, response, apart_above).await?)
    }

    /// No announcement: resumers on MySQL poll.
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
        pool: &MySqlPool,
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
        connection: &mut MySqlConnection,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(crate::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &MySqlPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, Taken<Owner>)>, EngineError> {
        let connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        let (due, _connection) = crate::take_over_due(connection, workflows, batch).await?;
        Ok(due)
    }

    async fn resumer_lag(pool: &MySqlPool) -> Result<Duration, EngineError> {
        let mut connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        Ok(crate::resumer_lag(&mut connection).await?)
    }

    async fn count_due_unknown(
        pool: &MySqlPool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        let mut connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        Ok(crate::count_due_unknown(&mut connection, workflows).await?)
    }

    async fn expire_batch(
        pool: &MySqlPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let connection = pool.acquire().await.map_err(crate::StoreError::from)?;
        let (deleted, _connection) = crate::expire_batch(connection, older_than, batch).await?;
        Ok(deleted)
    }

    /// One table: retention deletes in batches.
    async fn maintain_layout(
        _pool: &MySqlPool,
        _keep_for: Duration,
    ) -> Result<Option<Maintained>, EngineError> {
        Ok(None)
    }

    /// Nothing announces due keys between sessions on MySQL: the resumer polls.
    async fn listen_for_due(_pool: MySqlPool, _wake: Arc<Notify>) {
        std::future::pending::<()>().await;
    }
}
