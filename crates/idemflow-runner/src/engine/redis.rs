//! Redis's steps, from `idemflow-redis`: each a script, each standing alone. There is no
//! transaction to share, so a workflow on Redis has foreign phases only ([`crate::SqlEngine`] is
//! what a local phase needs); `begin`, `commit` and `rollback` only carry the connection, and
//! `back_to_claim` has nothing to undo. A claim is visible at once, so a concurrent duplicate's
//! look-up finds it (409) and no claim lock is needed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_pg::Limits;
use idemflow_redis::{Owner, RedisPool, RedisStore, StoreError, Transaction};
use idemflow_store::{Claim, LookUp, Store, TakenOver};
use serde_json::Value;
use tokio::sync::Notify;

use super::{Claimed, ConnectionPool, Engine, EngineError, KeyOwner, Taken};
use crate::error::RunError;

/// A Redis command's failure, as a database error: the runner answers it as it answers any
/// database's (503, nothing uncommitted kept).
#[derive(Debug)]
struct CommandError(idemflow_redis::redis::RedisError);

impl std::fmt::Display for CommandError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "redis: {}", self.0)
    }
}

impl std::error::Error for CommandError {}

impl sqlx::error::DatabaseError for CommandError {
    fn message(&self) -> &str {
        self.0.detail().unwrap_or("redis command failed")
    }

    fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
        self
    }

    fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
        self
    }

    fn kind(&self) -> sqlx::error::ErrorKind {
        sqlx::error::ErrorKind::Other
    }
}

impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Corrupt(message) => Self::Corrupt(message),
            // A broken connection is an I/O error, as sqlx reports one: the runner tries again
            // where it would on a database.
            StoreError::Redis(error) if error.is_io_error() || error.is_connection_dropped() => {
                Self::Database(sqlx::Error::Io(std::io::Error::other(error)))
            }
            StoreError::Redis(error) => {
                Self::Database(sqlx::Error::Database(Box::new(CommandError(error))))
            }
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

/// One multiplexed connection, shared: taking one is a clone, there is always one, and it never
/// closes under the runner.
#[async_trait]
impl ConnectionPool for RedisPool {
    type Connection = RedisPool;
    type Pooled = Box<RedisPool>;

    async fn acquire(&self) -> Result<Box<RedisPool>, EngineError> {
        Ok(Box::new(self.clone()))
    }

    fn try_acquire(&self) -> Option<Box<RedisPool>> {
        Some(Box::new(self.clone()))
    }

    fn size(&self) -> u32 {
        1
    }

    fn max_size(&self) -> u32 {
        1
    }

    fn is_closed(&self) -> bool {
        false
    }

    async fn closed(&self) {
        std::future::pending::<()>().await;
    }

    fn close_on_drop(_pooled: &mut Box<RedisPool>) {}
}

fn taken(taken: TakenOver<Owner>, lease_from: Instant) -> Taken<Owner> {
    Taken {
        owner: taken.owner,
        attempts: taken.attempts,
        recovery_point: taken.recovery_point,
        phase_output: taken.phase_output,
        request: taken.request,
        last_error: taken.last_error,
        lease_from,
    }
}

#[async_trait]
impl Engine for RedisStore {
    type Pool = RedisPool;
    type Transaction = Transaction;
    type Owner = Owner;
    type Ticket = ();
    /// The key taken over, and when the script that wrote its lease was sent.
    type TakenOver = (TakenOver<Owner>, Instant);
    const NAME: &'static str = "redis";

    fn connection(transaction: &mut Transaction) -> &mut RedisPool {
        <RedisStore as Store>::connection(transaction)
    }

    fn taken((taken_over, lease_from): (TakenOver<Owner>, Instant)) -> Taken<Owner> {
        taken(taken_over, lease_from)
    }

    fn taken_owner((taken, _): &(TakenOver<Owner>, Instant)) -> &Owner {
        &taken.owner
    }

    async fn begin(
        connection: Box<RedisPool>,
        _limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Ok(Transaction::on(*connection))
    }

    async fn commit_keeping(transaction: Transaction) -> Result<Box<RedisPool>, EngineError> {
        Ok(Box::new(transaction.into_pool()))
    }

    async fn rollback(_transaction: Transaction) -> Result<(), EngineError> {
        Ok(())
    }

    fn abandon(_transaction: Transaction) {}

    /// No local phase ran: nothing to undo.
    async fn back_to_claim(_transaction: &mut Transaction) -> Result<(), EngineError> {
        Ok(())
    }

    async fn look_up(
        connection: &mut RedisPool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, EngineError> {
        Ok(<RedisStore as Store>::look_up(connection, tenant, key).await?)
    }

    async fn response_apart(
        connection: &mut RedisPool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(<RedisStore as Store>::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: Box<RedisPool>,
        claim: Claim<'_>,
        (): (),
        _limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        Ok(
            match <RedisStore as Store>::begin_claim(&connection, claim, ()).await? {
                Some((transaction, owner)) => Claimed::Owned(transaction, owner),
                None => Claimed::Lost(connection),
            },
        )
    }

    /// Never reached on Redis (a commit is never refused); a fresh claim if it were.
    async fn claim_again(
        connection: Box<RedisPool>,
        claim: Claim<'_>,
        _token: i64,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        <Self as Engine>::begin_claim(connection, claim, (), limits).await
    }

    async fn take_over(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<Taken<Owner>>, EngineError> {
        let lease_from = Instant::now();
        let pool = <RedisStore as Store>::connection(transaction);
        Ok(
            <RedisStore as Store>::take_over(pool, tenant, key, seen, lease)
                .await?
                .map(|taken_over| taken(taken_over, lease_from)),
        )
    }

    /// A claim is one script: no session can be half-way through one.
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
        Ok(
            <RedisStore as Store>::advance(transaction, owner, recovery_point, output, lease)
                .await?,
        )
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError> {
        Ok(
            <RedisStore as Store>::finish(
                transaction,
                owner,
                recovery_point,
                response,
                apart_above,
            )
            .await?,
        )
    }

    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        let pool = <RedisStore as Store>::connection(transaction);
        Ok(<RedisStore as Store>::postpone(pool, owner, retry_after, last_error).await?)
    }

    async fn postpone_alone(
        pool: &RedisPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        Ok(<RedisStore as Store>::postpone(pool, owner, retry_after, last_error).await?)
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), EngineError> {
        Ok(<RedisStore as Store>::delete_owned(transaction, owner).await?)
    }

    async fn renew_lease(
        connection: &mut RedisPool,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(<RedisStore as Store>::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &RedisPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, (TakenOver<Owner>, Instant))>, EngineError> {
        let lease_from = Instant::now();
        Ok(<RedisStore as Store>::take_over_due(pool, workflows, batch)
            .await?
            .into_iter()
            .map(|(workflow, taken)| (workflow, (taken, lease_from)))
            .collect())
    }

    async fn resumer_lag(pool: &RedisPool) -> Result<Duration, EngineError> {
        Ok(idemflow_redis::resumer_lag(pool).await?)
    }

    async fn count_due_unknown(
        pool: &RedisPool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        Ok(idemflow_redis::count_due_unknown(pool, workflows).await?)
    }

    async fn expire_batch(
        pool: &RedisPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        Ok(<RedisStore as Store>::expire_batch(pool, older_than, batch).await?)
    }

    async fn maintain_layout(
        _pool: &RedisPool,
        _keep_for: Duration,
    ) -> Result<Option<u64>, RunError> {
        Ok(None)
    }

    /// Nothing announces due keys between processes on Redis yet: the resumer polls.
    async fn listen_for_due(_pool: RedisPool, _wake: Arc<Notify>) {
        std::future::pending::<()>().await;
    }
}
