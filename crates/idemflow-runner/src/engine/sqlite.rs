//! SQLite's steps, from `idemflow-sqlite`. Its one writer shapes them: a claim, a takeover and
//! every local phase hold the write lock for their transaction (`BEGIN IMMEDIATE`); a look-up
//! reads without it, so a key being claimed looks absent until the claim commits, and the claim
//! that then waits for the lock finds the row and answers from it. Busy past the busy timeout is
//! [`EngineError::Busy`]: nothing was written.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_pg::Limits;
use idemflow_sqlite::{self as store, Owner, SqliteStore, StoreError, Transaction};
use idemflow_store::{Claim, LookUp};
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqliteConnection, SqlitePool};
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
impl Engine for SqliteStore {
    type Pool = sqlx::Pool<Sqlite>;
    type Transaction = Transaction;
    type Owner = Owner;
    type Ticket = ();
    type TakenOver = store::TakenOver;
    const NAME: &'static str = "sqlite";

    fn connection(transaction: &mut Transaction) -> &mut SqliteConnection {
        transaction.connection()
    }

    fn taken(taken_over: store::TakenOver) -> Taken<Owner> {
        taken(taken_over)
    }

    fn taken_owner(taken: &store::TakenOver) -> &Owner {
        &taken.owner
    }

    /// SQLite has no per-statement time limit a session can set: a local phase is held to its
    /// limit by the runner alone, and its connection closed (rolling back) past it.
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

    async fn look_up(
        connection: &mut SqliteConnection,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, EngineError> {
        Ok(match store::look_up(connection, tenant, key).await? {
            store::LookUp::Found(found) => LookUp::Found(found),
            store::LookUp::Absent => LookUp::Absent(()),
        })
    }

    async fn response_apart(
        connection: &mut SqliteConnection,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(store::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: PoolConnection<Sqlite>,
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
        Ok(
            store::take_over_in(transaction.connection(), tenant, key, seen, lease)
                .await?
                .map(taken),
        )
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

    /// No announcement: resumers on SQLite poll.
    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        Ok(store::postpone_in(transaction.connection(), owner, retry_after, last_error).await?)
    }

    async fn postpone_alone(
        pool: &SqlitePool,
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
        connection: &mut SqliteConnection,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(store::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &SqlitePool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, store::TakenOver)>, EngineError> {
        let connection = pool.acquire().await?;
        let (due, _connection) = store::take_over_due(connection, workflows, batch).await?;
        Ok(due)
    }

    async fn resumer_lag(pool: &SqlitePool) -> Result<Duration, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::resumer_lag(&mut connection).await?)
    }

    async fn count_due_unknown(
        pool: &SqlitePool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::count_due_unknown(&mut connection, workflows).await?)
    }

    async fn expire_batch(
        pool: &SqlitePool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let connection = pool.acquire().await?;
        let (deleted, _connection) = store::expire_batch(connection, older_than, batch).await?;
        Ok(deleted)
    }

    async fn maintain_layout(
        _pool: &SqlitePool,
        _keep_for: Duration,
    ) -> Result<Option<u64>, RunError> {
        Ok(None)
    }

    /// Nothing announces due keys between processes on SQLite: the resumer polls.
    async fn listen_for_due(_pool: SqlitePool, _wake: Arc<Notify>) {
        std::future::pending::<()>().await;
    }
}
