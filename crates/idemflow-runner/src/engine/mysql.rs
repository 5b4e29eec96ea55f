//! MySQL's and MariaDB's steps, from `idemflow-mysql`. A look-up is a consistent read, so a key
//! being claimed looks absent until the claim commits; the claim's insert then waits for that
//! claim's transaction and, refused by the duplicate key, answers from the committed row. Lock
//! waits past the lock wait timeout and deadlock victims are [`EngineError::Busy`]: the
//! transaction is lost, nothing it wrote is kept.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_mysql::{self as store, MySqlStore, Owner, StoreError, Transaction};
use idemflow_pg::Limits;
use idemflow_store::{Claim, LookUp};
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, MySqlPool};
use tokio::sync::Notify;

use super::{Claimed, Engine, EngineError, KeyOwner, Taken};
use crate::error::RunError;

impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Busy => Self::Busy,
            StoreError::Database(error) => Self::Database(error),
            StoreError::Corrupt(message) => Self::Corrupt(message),
            other => Self::Corrupt(other.to_string()),
        }
    }
}

impl KeyOwner for Owner {
    fn tenant(&self) -> &TenantId {
        Owner::tenant(self)
    }

    fn key(&self) -> &Key {
        Owner::key(self)
    }

    fn lock_version(&self) -> i64 {
        Owner::lock_version(self)
    }
}

fn taken(taken: store::TakenOver) -> Taken<Owner> {
    Taken {
        owner: taken.owner,
        attempts: taken.attempts,
        recovery_point: taken.recovery_point,
        phase_output: taken.phase_output,
        request: taken.request,
        last_error: taken.last_error,
        lease_from: taken.lease_from,
    }
}

#[async_trait]
impl Engine for MySqlStore {
    type Pool = sqlx::Pool<MySql>;
    type Transaction = Transaction;
    type Owner = Owner;
    type Ticket = ();
    type TakenOver = store::TakenOver;
    const NAME: &'static str = "mysql";

    fn connection(transaction: &mut Transaction) -> &mut MySqlConnection {
        transaction.connection()
    }

    fn taken(taken_over: store::TakenOver) -> Taken<Owner> {
        taken(taken_over)
    }

    fn taken_owner(taken: &store::TakenOver) -> &Owner {
        &taken.owner
    }

    /// The session's statement timeout (`max_statement_time`, set as each connection opens)
    /// bounds every statement; a local phase is held to its own limit by the runner, and its
    /// connection closed (the server rolling back) past it.
    async fn begin(
        connection: PoolConnection<MySql>,
        _limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Ok(Transaction::begin(connection).await?)
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

    async fn look_up(
        connection: &mut MySqlConnection,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, EngineError> {
        Ok(match store::look_up(connection, tenant, key).await? {
            store::LookUp::Found(found) => LookUp::Found(found),
            store::LookUp::Absent => LookUp::Absent(()),
        })
    }

    async fn response_apart(
        connection: &mut MySqlConnection,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(store::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: PoolConnection<MySql>,
        claim: Claim<'_>,
        (): (),
        _limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        let request = store::ClaimRequest {
            tenant: claim.tenant,
            key: claim.key,
            fingerprint: claim.fingerprint,
            workflow: claim.workflow,
            request: claim.request,
            lease: claim.lease,
        };
        Ok(match store::begin_claim(connection, &request).await? {
            store::Claimed::Owned(transaction, owner) => Claimed::Owned(transaction, owner),
            store::Claimed::Lost(connection) => Claimed::Lost(connection),
        })
    }

    /// The claim draws a fresh token (a new life) by its insert: the refused one was never seen.
    async fn claim_again(
        connection: PoolConnection<MySql>,
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
        Ok(
            store::take_over_in(transaction.connection(), tenant, key, seen, lease)
                .await?
                .map(taken),
        )
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
        Ok(store::advance(
            transaction.connection(),
            owner,
            recovery_point,
            output,
            lease,
        )
        .await?)
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError> {
        Ok(store::finish(
            transaction.connection(),
            owner,
            recovery_point,
            response,
            apart_above,
        )
        .await?)
    }

    /// No announcement: resumers on MySQL poll.
    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        Ok(store::postpone_in(transaction.connection(), owner, retry_after, last_error).await?)
    }

    async fn postpone_alone(
        pool: &MySqlPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        let connection = pool.acquire().await?;
        store::postpone(connection, owner, retry_after, last_error).await?;
        Ok(())
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), EngineError> {
        Ok(store::delete_owned(transaction.connection(), owner).await?)
    }

    async fn renew_lease(
        connection: &mut MySqlConnection,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(store::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &MySqlPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, store::TakenOver)>, EngineError> {
        let connection = pool.acquire().await?;
        let (due, _connection) = store::take_over_due(connection, workflows, batch).await?;
        Ok(due)
    }

    async fn resumer_lag(pool: &MySqlPool) -> Result<Duration, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::resumer_lag(&mut connection).await?)
    }

    async fn count_due_unknown(
        pool: &MySqlPool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::count_due_unknown(&mut connection, workflows).await?)
    }

    async fn expire_batch(
        pool: &MySqlPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let connection = pool.acquire().await?;
        let (deleted, _connection) = store::expire_batch(connection, older_than, batch).await?;
        Ok(deleted)
    }

    async fn maintain_layout(
        _pool: &MySqlPool,
        _keep_for: Duration,
    ) -> Result<Option<u64>, RunError> {
        Ok(None)
    }

    /// Nothing announces due keys between sessions on MySQL: the resumer polls.
    async fn listen_for_due(_pool: MySqlPool, _wake: Arc<Notify>) {
        std::future::pending::<()>().await;
    }
}
