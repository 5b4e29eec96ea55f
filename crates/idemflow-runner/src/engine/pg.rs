//! PostgreSQL's steps: each a statement (or message) of `idemflow-pg`, as the runner sent them
//! before engines were a parameter, so its round trips per request are what they were.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_pg::{self as store, Limits, Owner, PgStore, StoreError, Transaction};
use idemflow_store::{Claim, LookUp};
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::sync::Notify;

use super::{Claimed, Engine, EngineError, KeyOwner, Taken};
use crate::error::RunError;

impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
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
        attempts: i64::from(taken.attempts),
        recovery_point: taken.recovery_point,
        phase_output: taken.phase_output,
        request: taken.request,
        last_error: taken.last_error,
        lease_from: taken.lease_from,
    }
}

fn claimed(claimed: store::Claimed) -> Claimed<PgStore> {
    match claimed {
        store::Claimed::Owned(transaction, owner) => Claimed::Owned(transaction, owner),
        store::Claimed::Lost(connection) => Claimed::Lost(connection),
    }
}

fn request<'a>(claim: &Claim<'a>, lock_version: i64) -> store::ClaimRequest<'a> {
    store::ClaimRequest {
        tenant: claim.tenant,
        key: claim.key,
        lock_version,
        fingerprint: claim.fingerprint,
        workflow: claim.workflow,
        request: claim.request,
        lease: claim.lease,
    }
}

#[async_trait]
impl Engine for PgStore {
    type Pool = sqlx::Pool<Postgres>;
    type Transaction = Transaction;
    type Owner = Owner;
    /// The token the look-up drew, and whether the look-up's connection (which goes on to hold
    /// the claim) has the claim prepared.
    type Ticket = (i64, bool);
    type TakenOver = store::TakenOver;
    const NAME: &'static str = "postgres";

    fn connection(transaction: &mut Transaction) -> &mut PgConnection {
        transaction
    }

    fn taken(taken_over: store::TakenOver) -> Taken<Owner> {
        taken(taken_over)
    }

    fn taken_owner(taken: &store::TakenOver) -> &Owner {
        &taken.owner
    }

    async fn begin(
        connection: PoolConnection<Postgres>,
        limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Ok(Transaction::begin_limited(connection, limits).await?)
    }

    async fn commit_keeping(
        transaction: Transaction,
    ) -> Result<PoolConnection<Postgres>, EngineError> {
        Ok(transaction.commit_keeping().await?)
    }

    async fn rollback(transaction: Transaction) -> Result<(), EngineError> {
        Ok(transaction.rollback().await?)
    }

    fn abandon(transaction: Transaction) {
        transaction.abandon();
    }

    async fn back_to_claim(transaction: &mut Transaction) -> Result<(), EngineError> {
        Ok(transaction.back_to_claim().await?)
    }

    async fn look_up(
        connection: &mut PgConnection,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<(i64, bool)>, EngineError> {
        Ok(match store::look_up(connection, tenant, key).await? {
            store::LookUp::Found(found) => LookUp::Found(found),
            store::LookUp::Claiming => LookUp::Claiming,
            store::LookUp::Absent {
                lock_version,
                claim_prepared,
            } => LookUp::Absent((lock_version, claim_prepared)),
        })
    }

    async fn response_apart(
        connection: &mut PgConnection,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(store::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: PoolConnection<Postgres>,
        claim: Claim<'_>,
        (lock_version, claim_prepared): (i64, bool),
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        let request = request(&claim, lock_version);
        Ok(claimed(
            store::begin_claim_knowing(connection, &request, limits, claim_prepared).await?,
        ))
    }

    async fn claim_again(
        connection: PoolConnection<Postgres>,
        claim: Claim<'_>,
        token: i64,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        // No look-up said whether this connection holds the prepared claim: the claim finds out.
        let request = request(&claim, token);
        Ok(claimed(
            store::begin_claim(connection, &request, limits).await?,
        ))
    }

    async fn take_over(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<Taken<Owner>>, EngineError> {
        Ok(store::take_over(transaction, tenant, key, seen, lease)
            .await?
            .map(taken))
    }

    async fn wait_for_claim_lock(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        wait: Duration,
    ) -> Result<bool, EngineError> {
        Ok(store::wait_for_claim_lock(transaction, tenant, key, wait).await?)
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(store::advance(transaction, owner, recovery_point, output, lease).await?)
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError> {
        Ok(store::finish(transaction, owner, recovery_point, response, apart_above).await?)
    }

    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        store::postpone(transaction, owner, retry_after, last_error).await?;
        // Resumers listening hear of it at the commit.
        Ok(store::notify_due(transaction).await?)
    }

    async fn postpone_alone(
        pool: &PgPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::postpone(&mut connection, owner, retry_after, last_error).await?)
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), EngineError> {
        Ok(store::delete_owned(transaction, owner).await?)
    }

    async fn renew_lease(
        connection: &mut PgConnection,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(store::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &PgPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, store::TakenOver)>, EngineError> {
        let mut connection = pool.acquire().await?;
        let due = store::take_over_due(&mut connection, workflows, batch).await?;
        Ok(due
            .into_iter()
            .map(|due| (due.workflow, due.taken))
            .collect())
    }

    async fn resumer_lag(pool: &PgPool) -> Result<Duration, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::resumer_lag(&mut connection).await?)
    }

    async fn count_due_unknown(
        pool: &PgPool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::count_due_unknown(&mut connection, workflows).await?)
    }

    async fn expire_batch(
        pool: &PgPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let mut connection = pool.acquire().await?;
        Ok(store::expire_batch(&mut connection, older_than, batch).await?)
    }

    async fn maintain_layout(pool: &PgPool, keep_for: Duration) -> Result<Option<u64>, RunError> {
        let partitioned = {
            let mut connection = pool.acquire().await?;
            store::partitions::is_partitioned(&mut connection).await?
        };
        if !partitioned {
            return Ok(None);
        }
        maintain_partitions(pool, keep_for).await.map(Some)
    }

    async fn listen_for_due(pool: PgPool, wake: Arc<Notify>) {
        listen_for_due_keys(pool, wake).await;
    }
}

/// Retention on the partitioned layout: one maintenance run, reported in logs and metrics.
async fn maintain_partitions(pool: &PgPool, keep_for: Duration) -> Result<u64, RunError> {
    let maintained = store::partitions::maintain(pool, keep_for).await?;
    if maintained.skipped {
        return Ok(0);
    }
    let keys: u64 = maintained.dropped.iter().map(|dropped| dropped.keys).sum();
    for dropped in &maintained.dropped {
        tracing::info!(
            partition = %dropped.name,
            keys = dropped.keys,
            bodies_apart = dropped.bodies_apart,
            "retention dropped a partition of expired keys"
        );
    }
    for created in &maintained.created {
        tracing::info!(partition = %created, "retention created a partition ahead");
    }
    for kept in &maintained.kept {
        // Past the window and still holding started keys: nobody finished them. Alert on it.
        tracing::warn!(
            partition = %kept.name,
            started_keys = kept.started_keys,
            "a partition past the retention window is kept: it holds started keys"
        );
    }
    metrics::counter!("idemflow_expired_total").increment(keys);
    metrics::counter!("idemflow_partitions_dropped_total")
        .increment(maintained.dropped.len() as u64);
    metrics::gauge!("idemflow_partitions_kept_for_started_keys").set(maintained.kept.len() as f64);
    metrics::gauge!("idemflow_partitions_ahead").set(f64::from(maintained.ahead));
    Ok(keys)
}

/// Wakes the resumer when a key is announced due (a failed attempt postponed it, or an operator
/// ended its lease). PgListener reconnects by itself; a failure to connect is retried with a
/// pause.
async fn listen_for_due_keys(pool: PgPool, wake: Arc<Notify>) {
    loop {
        let mut listener = match PgListener::connect_with(&pool).await {
            Ok(listener) => listener,
            Err(error) => {
                tracing::warn!(%error, "cannot listen for due keys; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        if let Err(error) = listener.listen(store::DUE_CHANNEL).await {
            tracing::warn!(%error, "cannot listen for due keys; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            match listener.recv().await {
                Ok(_) => wake.notify_one(),
                Err(error) => {
                    tracing::warn!(%error, "lost the due-key listener; reconnecting");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    break;
                }
            }
        }
    }
}
