//! The claim of a new key ([`begin_claim`]): a write transaction that finds the key still absent,
//! draws a fencing token and inserts the row, and stays open for the leading local phases.
//!
//! SQLite has one writer at a time, so a claim's exclusion is the write lock: a second claim of
//! the same key waits for it (up to the busy timeout), then finds the first one's row committed
//! and answers from it, or finds it absent (the first rolled back) and claims it.

use std::time::Duration;

use sqlx::Sqlite;
use sqlx::pool::PoolConnection;

use crate::error::StoreError;
use crate::statements;
use crate::transaction::Transaction;
use idemflow_store::{Owner, fresh_holder};

/// Everything a claim stores: the boundary's [`idemflow_store::Claim`].
pub type ClaimRequest<'a> = idemflow_store::Claim<'a>;

/// What [`begin_claim`] did.
#[derive(Debug)]
pub enum Claimed {
    /// The key is ours: the transaction holds the uncommitted claim.
    Owned(Transaction, Owner),
    /// Another claim of this key committed first. Nothing was written; look the key up again.
    Lost(PoolConnection<Sqlite>),
}

/// Begins a write transaction holding the claim of a new key.
pub async fn begin_claim(
    connection: PoolConnection<Sqlite>,
    claim: &ClaimRequest<'_>,
) -> Result<Claimed, StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let exists = sqlx::query(statements::EXISTS)
        .bind(claim.tenant.as_str())
        .bind(claim.key.as_str())
        .fetch_optional(transaction.connection())
        .await?
        .is_some();
    if exists {
        return Ok(Claimed::Lost(transaction.rollback().await?));
    }
    let token: i64 = sqlx::query_scalar(statements::NEXT_FENCE)
        .fetch_one(transaction.connection())
        .await?;
    let request = serde_json::to_string(claim.request)
        .map_err(|error| StoreError::Corrupt(format!("request: {error}")))?;
    let holder = fresh_holder();
    sqlx::query(statements::CLAIM)
        .bind(claim.tenant.as_str())
        .bind(claim.key.as_str())
        .bind(claim.fingerprint.as_bytes().as_slice())
        .bind(claim.workflow)
        .bind(request)
        .bind(millis(claim.lease))
        .bind(token)
        .bind(holder)
        .execute(transaction.connection())
        .await?;
    sqlx::query(statements::CLAIMED_SAVEPOINT)
        .execute(transaction.connection())
        .await?;
    Ok(Claimed::Owned(
        transaction,
        Owner::holding(claim.tenant.clone(), claim.key.clone(), token, holder),
    ))
}

/// Whole milliseconds, saturating (a lease of centuries is as good as forever).
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 2)
}
