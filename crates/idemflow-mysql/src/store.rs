//! [`MySqlStore`]: this crate's statements behind the store boundary
//! ([`idemflow_store::Store`]), proven by the same conformance suite as every other engine.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_store::{Claim, Failure, LookUp, Store, TakenOver};
use serde_json::Value;
use sqlx::{MySqlConnection, MySqlPool};

use crate::{ClaimRequest, Claimed, Owner, StoreError, Transaction};

/// The MySQL/MariaDB engine's store.
#[derive(Debug, Clone, Copy, Default)]
pub struct MySqlStore;

fn taken(taken: crate::TakenOver) -> TakenOver<Owner> {
    TakenOver {
        owner: taken.owner,
        recovery_point: taken.recovery_point,
        phase_output: taken.phase_output,
        request: taken.request,
        attempts: taken.attempts,
        last_error: taken.last_error,
    }
}

#[async_trait]
impl Store for MySqlStore {
    type Pool = MySqlPool;
    type Transaction = Transaction;
    type Connection = MySqlConnection;
    type Owner = Owner;
    /// Nothing: the claim draws its token (its life) by its insert.
    type Ticket = ();
    type Error = StoreError;

    fn failure(error: &StoreError) -> Failure {
        match error {
            StoreError::Fenced => Failure::Fenced,
            StoreError::Busy => Failure::Busy,
            _ => Failure::Other,
        }
    }

    fn token(owner: &Owner) -> i64 {
        owner.lock_version()
    }

    fn connection(transaction: &mut Transaction) -> &mut MySqlConnection {
        transaction.connection()
    }

    async fn look_up(
        pool: &MySqlPool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, StoreError> {
        let mut connection = pool.acquire().await?;
        Ok(match crate::look_up(&mut connection, tenant, key).await? {
            crate::LookUp::Found(found) => LookUp::Found(found),
            crate::LookUp::Absent => LookUp::Absent(()),
        })
    }

    async fn begin_claim(
        pool: &MySqlPool,
        claim: Claim<'_>,
        (): (),
    ) -> Result<Option<(Transaction, Owner)>, StoreError> {
        let request = ClaimRequest {
            tenant: claim.tenant,
            key: claim.key,
            fingerprint: claim.fingerprint,
            workflow: claim.workflow,
            request: claim.request,
            lease: claim.lease,
        };
        Ok(
            match crate::begin_claim(pool.acquire().await?, &request).await? {
                Claimed::Owned(transaction, owner) => Some((transaction, owner)),
                Claimed::Lost(_) => None,
            },
        )
    }

    async fn begin(pool: &MySqlPool) -> Result<Transaction, StoreError> {
        Transaction::begin(pool.acquire().await?).await
    }

    async fn commit(transaction: Transaction) -> Result<(), StoreError> {
        transaction.commit().await.map(drop)
    }

    async fn rollback(transaction: Transaction) -> Result<(), StoreError> {
        transaction.rollback().await.map(drop)
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), StoreError> {
        crate::advance(
            transaction.connection(),
            owner,
            recovery_point,
            output,
            lease,
        )
        .await
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), StoreError> {
        crate::finish(
            transaction.connection(),
            owner,
            recovery_point,
            response,
            apart_above,
        )
        .await
    }

    async fn renew_lease(
        pool: &MySqlPool,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let mut connection = pool.acquire().await?;
        crate::renew_lease(&mut connection, owner, lease).await
    }

    async fn postpone(
        pool: &MySqlPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), StoreError> {
        crate::postpone(pool.acquire().await?, owner, retry_after, last_error)
            .await
            .map(drop)
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), StoreError> {
        crate::delete_owned(transaction.connection(), owner).await
    }

    async fn end_lease(
        pool: &MySqlPool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
    ) -> Result<Option<i64>, StoreError> {
        let mut connection = pool.acquire().await?;
        crate::end_lease(&mut connection, tenant.as_str(), key.as_str(), seen).await
    }

    async fn take_over(
        pool: &MySqlPool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<TakenOver<Owner>>, StoreError> {
        let (one, _) = crate::take_over(pool.acquire().await?, tenant, key, seen, lease).await?;
        Ok(one.map(taken))
    }

    async fn take_over_due(
        pool: &MySqlPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, TakenOver<Owner>)>, StoreError> {
        let (due, _) = crate::take_over_due(pool.acquire().await?, workflows, batch).await?;
        Ok(due
            .into_iter()
            .map(|(workflow, one)| (workflow, taken(one)))
            .collect())
    }

    async fn response_apart(
        pool: &MySqlPool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let mut connection = pool.acquire().await?;
        crate::response_apart(&mut connection, tenant, key, life).await
    }

    async fn expire_batch(
        pool: &MySqlPool,
        keep_for: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let (deleted, _) = crate::expire_batch(pool.acquire().await?, keep_for, batch).await?;
        Ok(deleted)
    }
}
