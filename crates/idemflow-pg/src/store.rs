//! [`PgStore`]: this crate's statements behind the store boundary ([`idemflow_store::Store`]), so
//! the conformance suite proves PostgreSQL with the same cases as every other engine.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_store::{Claim, Failure, LookUp, Store, TakenOver};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};

use crate::{ClaimRequest, Claimed, Limits, Owner, StoreError, Transaction};

/// The PostgreSQL engine's store.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgStore;

fn taken(taken: crate::TakenOver) -> TakenOver<Owner> {
    TakenOver {
        owner: taken.owner,
        recovery_point: taken.recovery_point,
        phase_output: taken.phase_output,
        request: taken.request,
        attempts: i64::from(taken.attempts),
        last_error: taken.last_error,
    }
}

#[async_trait]
impl Store for PgStore {
    type Pool = PgPool;
    type Transaction = Transaction;
    type Connection = PgConnection;
    type Owner = Owner;
    /// The fencing token the look-up drew for the claim.
    type Ticket = i64;
    type Error = StoreError;

    fn failure(error: &StoreError) -> Failure {
        match error {
            StoreError::Fenced => Failure::Fenced,
            _ => Failure::Other,
        }
    }

    fn token(owner: &Owner) -> i64 {
        owner.lock_version()
    }

    fn connection(transaction: &mut Transaction) -> &mut PgConnection {
        transaction
    }

    async fn look_up(
        pool: &PgPool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<i64>, StoreError> {
        let mut connection = pool.acquire().await?;
        Ok(match crate::look_up(&mut connection, tenant, key).await? {
            crate::LookUp::Found(found) => LookUp::Found(found),
            crate::LookUp::Claiming => LookUp::Claiming,
            crate::LookUp::Absent { lock_version, .. } => LookUp::Absent(lock_version),
        })
    }

    async fn begin_claim(
        pool: &PgPool,
        claim: Claim<'_>,
        ticket: i64,
    ) -> Result<Option<(Transaction, Owner)>, StoreError> {
        let request = ClaimRequest {
            tenant: claim.tenant,
            key: claim.key,
            lock_version: ticket,
            fingerprint: claim.fingerprint,
            workflow: claim.workflow,
            request: claim.request,
            lease: claim.lease,
        };
        let connection = pool.acquire().await?;
        Ok(
            match crate::begin_claim(connection, &request, &Limits::default()).await? {
                Claimed::Owned(transaction, owner) => Some((transaction, owner)),
                Claimed::Lost(_) => None,
            },
        )
    }

    async fn begin(pool: &PgPool) -> Result<Transaction, StoreError> {
        Ok(Transaction::begin(pool).await?)
    }

    async fn commit(transaction: Transaction) -> Result<(), StoreError> {
        Ok(transaction.commit().await?)
    }

    async fn rollback(transaction: Transaction) -> Result<(), StoreError> {
        Ok(transaction.rollback().await?)
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), StoreError> {
        crate::advance(transaction, owner, recovery_point, output, lease).await
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), StoreError> {
        crate::finish(transaction, owner, recovery_point, response, apart_above).await
    }

    async fn renew_lease(pool: &PgPool, owner: &Owner, lease: Duration) -> Result<(), StoreError> {
        let mut connection = pool.acquire().await?;
        crate::renew_lease(&mut connection, owner, lease).await
    }

    async fn postpone(
        pool: &PgPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), StoreError> {
        let mut connection = pool.acquire().await?;
        crate::postpone(&mut connection, owner, retry_after, last_error).await
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), StoreError> {
        crate::delete_owned(transaction, owner).await
    }

    async fn end_lease(
        pool: &PgPool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
    ) -> Result<Option<i64>, StoreError> {
        let mut connection = pool.acquire().await?;
        crate::end_lease(&mut connection, tenant.as_str(), key.as_str(), seen).await
    }

    async fn take_over(
        pool: &PgPool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<TakenOver<Owner>>, StoreError> {
        let mut connection = pool.acquire().await?;
        Ok(crate::take_over(&mut connection, tenant, key, seen, lease)
            .await?
            .map(taken))
    }

    async fn take_over_due(
        pool: &PgPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, TakenOver<Owner>)>, StoreError> {
        let mut connection = pool.acquire().await?;
        Ok(crate::take_over_due(&mut connection, workflows, batch)
            .await?
            .into_iter()
            .map(|due| (due.workflow, taken(due.taken)))
            .collect())
    }

    async fn response_apart(
        pool: &PgPool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let mut connection = pool.acquire().await?;
        crate::response_apart(&mut connection, tenant, key, life).await
    }

    async fn expire_batch(
        pool: &PgPool,
        keep_for: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let mut connection = pool.acquire().await?;
        crate::expire_batch(&mut connection, keep_for, batch).await
    }
}
