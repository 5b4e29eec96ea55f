//! [`PgStore`]: this crate's statements behind the engine boundary ([`idemflow_store::Engine`]),
//! each step the statement (or message) the runner sends, so a request's round trips are what
//! they would be with the statements called by hand. The conformance suite proves PostgreSQL
//! with the same cases as every other engine.

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
use sqlx::postgres::PgListener;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::sync::Notify;

use crate::{ClaimRequest, Transaction};

/// The PostgreSQL engine.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgStore;

impl EnginePool<PgStore> for PgPool {
    fn into_pool(self) -> PgPool {
        self
    }

    fn as_pool(&self) -> &PgPool {
        self
    }
}

impl SqlEngine for PgStore {
    type Database = Postgres;

    fn engine_error(error: sqlx::Error) -> EngineError {
        lost(error)
    }

    fn is_restartable(error: &sqlx::Error) -> bool {
        crate::error::is_restartable(error)
    }
}

fn claimed(claimed: crate::Claimed) -> Claimed<PgStore> {
    match claimed {
        crate::Claimed::Owned(transaction, owner) => Claimed::Owned(transaction, owner),
        crate::Claimed::Lost(connection) => Claimed::Lost(connection),
    }
}

fn request<'a>(claim: &Claim<'a>, lock_version: i64) -> ClaimRequest<'a> {
    ClaimRequest {
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
    type Pool = PgPool;
    type Transaction = Transaction;
    type Owner = Owner;
    /// The token the look-up drew, and whether the look-up's connection (which goes on to hold
    /// the claim) has the claim prepared.
    type Ticket = (i64, bool);
    const NAME: &'static str = "postgres";

    /// Every level: the unique index decides the claim at each (a claim that meets a row of its
    /// key committed after its snapshot fails with 23505, or 40001 at Serializable: both a lost
    /// race), and a fenced write that meets a newer row fails with 40001 rather than write over
    /// it (docs/protocol.md, "A local phase at a stronger level"). The partitioned layout's
    /// trigger refuses a claim at any level but Read Committed
    /// (`Engine::claims_at_read_committed_only`, and `DatabaseErrorKind::ClaimLevelRefused` for a
    /// table adopted later); the runner then claims such keys alone at Read Committed, before the
    /// phases' transaction begins at their level.
    fn isolation_refused(_level: Isolation, _with_claim: bool) -> Option<&'static str> {
        None
    }

    /// The partitioned layout's trigger refuses a claim above Read Committed.
    async fn claims_at_read_committed_only(
        connection: &mut PgConnection,
    ) -> Result<bool, EngineError> {
        Ok(crate::partitions::is_partitioned(connection).await?)
    }

    fn connection(transaction: &mut Transaction) -> &mut PgConnection {
        transaction
    }

    fn operator(pool: &PgPool) -> Box<dyn idemflow_store::Operator> {
        Box::new(crate::PgOperator::new(pool.clone()))
    }

    async fn begin(
        connection: PoolConnection<Postgres>,
        limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Transaction::begin_limited(connection, limits)
            .await
            .map_err(lost)
    }

    async fn commit_keeping(
        transaction: Transaction,
    ) -> Result<PoolConnection<Postgres>, EngineError> {
        transaction.commit_keeping().await.map_err(lost)
    }

    async fn rollback(transaction: Transaction) -> Result<(), EngineError> {
        transaction.rollback().await.map_err(lost)
    }

    fn abandon(transaction: Transaction) {
        transaction.abandon();
    }

    async fn back_to_claim(transaction: &mut Transaction) -> Result<(), EngineError> {
        transaction.back_to_claim().await.map_err(lost)
    }

    async fn standing(transaction: &mut Transaction) -> Result<Standing, EngineError> {
        transaction.standing().await.map_err(lost)
    }

    async fn look_up(
        connection: &mut PgConnection,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<(i64, bool)>, EngineError> {
        Ok(match crate::look_up(connection, tenant, key).await? {
            crate::LookUp::Found(found) => LookUp::Found(found),
            crate::LookUp::Claiming => LookUp::Claiming,
            crate::LookUp::Absent {
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
        Ok(crate::response_apart(connection, tenant, key, life).await?)
    }

    async fn begin_claim(
        connection: PoolConnection<Postgres>,
        claim: Claim<'_>,
        (lock_version, claim_prepared): (i64, bool),
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        let request = request(&claim, lock_version);
        Ok(claimed(
            crate::begin_claim_knowing(connection, &request, limits, claim_prepared).await?,
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
            crate::begin_claim(connection, &request, limits).await?,
        ))
    }

    async fn take_over(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<Taken<Owner>>, EngineError> {
        Ok(crate::take_over(transaction, tenant, key, seen, lease).await?)
    }

    async fn wait_for_claim_lock(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        wait: Duration,
    ) -> Result<bool, EngineError> {
        Ok(crate::wait_for_claim_lock(transaction, tenant, key, wait).await?)
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(crate::advance(transaction, owner, recovery_point, output, lease).await?)
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError> {
        Ok(crate::finish(transaction, owner, recovery_point, response, apart_above).await?)
    }

    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError> {
        crate::postpone(transaction, owner, retry_after, last_error.as_str()).await?;
        // Resumers listening hear of it at the commit.
        Ok(crate::notify_due(transaction).await?)
    }

    async fn postpone_alone(
        pool: &PgPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError> {
        let mut connection = pool.acquire().await.map_err(lost)?;
        Ok(crate::postpone(&mut connection, owner, retry_after, last_error.as_str()).await?)
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), EngineError> {
        Ok(crate::delete_owned(transaction, owner).await?)
    }

    async fn renew_lease(
        connection: &mut PgConnection,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        Ok(crate::renew_lease(connection, owner, lease).await?)
    }

    async fn take_over_due(
        pool: &PgPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, Taken<Owner>)>, EngineError> {
        let mut connection = pool.acquire().await.map_err(lost)?;
        Ok(crate::take_over_due(&mut connection, workflows, batch).await?)
    }

    async fn resumer_lag(pool: &PgPool) -> Result<Duration, EngineError> {
        let mut connection = pool.acquire().await.map_err(lost)?;
        Ok(crate::resumer_lag(&mut connection).await?)
    }

    async fn count_due_unknown(
        pool: &PgPool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        let mut connection = pool.acquire().await.map_err(lost)?;
        Ok(crate::count_due_unknown(&mut connection, workflows).await?)
    }

    async fn expire_batch(
        pool: &PgPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let mut connection = pool.acquire().await.map_err(lost)?;
        Ok(crate::expire_batch(&mut connection, older_than, batch).await?)
    }

    async fn maintain_layout(
        pool: &PgPool,
        keep_for: Duration,
    ) -> Result<Option<Maintained>, EngineError> {
        let partitioned = {
            let mut connection = pool.acquire().await.map_err(lost)?;
            crate::partitions::is_partitioned(&mut connection).await?
        };
        if !partitioned {
            return Ok(None);
        }
        Ok(Some(crate::partitions::maintain(pool, keep_for).await?))
    }

    async fn listen_for_due(pool: PgPool, wake: Arc<Notify>) {
        listen_for_due_keys(pool, wake).await;
    }
}

/// sqlx's error as the boundary reports it.
fn lost(error: sqlx::Error) -> EngineError {
    EngineError::Database(crate::error::database_error(error))
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
        if let Err(error) = listener.listen(crate::DUE_CHANNEL).await {
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
