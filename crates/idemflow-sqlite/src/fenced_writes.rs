//! The owner's writes, each fenced by its token: a write that updates no row answers
//! [`StoreError::Fenced`], and the caller stops working on the key.

use std::time::Duration;

use idemflow_core::StoredResponse;
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqliteConnection};

use crate::claim::millis;
use crate::error::StoreError;
use crate::statements;
use crate::transaction::Transaction;
use idemflow_store::Owner;

/// Records a completed phase, in the owner's transaction: its recovery point and typed output,
/// and a lease of `lease` from now (never shorter than the one held).
pub async fn advance(
    connection: &mut SqliteConnection,
    owner: &Owner,
    recovery_point: &str,
    output: &Value,
    lease: Duration,
) -> Result<(), StoreError> {
    let output = serde_json::to_string(output)
        .map_err(|error| StoreError::Corrupt(format!("phase output: {error}")))?;
    let updated = sqlx::query(statements::ADVANCE)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .bind(recovery_point)
        .bind(output)
        .bind(millis(lease))
        .execute(connection)
        .await?
        .rows_affected();
    fenced(updated)
}

/// Stores the response and marks the key done, in the owner's transaction. A body longer than
/// `apart_above` bytes goes to `idempotency_responses` under the row's life, in the same
/// transaction.
pub async fn finish(
    connection: &mut SqliteConnection,
    owner: &Owner,
    recovery_point: &str,
    response: &StoredResponse,
    apart_above: usize,
) -> Result<(), StoreError> {
    let apart = response.body.len() > apart_above;
    let headers = serde_json::to_string(&response.headers)
        .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
    let statement = if apart {
        statements::FINISH_APART
    } else {
        statements::FINISH
    };
    let life: Option<i64> = sqlx::query_scalar(statement)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .bind(recovery_point)
        .bind(i64::from(response.status))
        .bind(headers)
        .bind(if apart {
            None
        } else {
            Some(response.body.as_slice())
        })
        .fetch_optional(&mut *connection)
        .await?;
    let Some(life) = life else {
        return Err(StoreError::Fenced);
    };
    if apart {
        sqlx::query(statements::STORE_APART)
            .bind(owner.tenant().as_str())
            .bind(owner.key().as_str())
            .bind(life)
            .bind(response.body.as_slice())
            .execute(connection)
            .await?;
    }
    Ok(())
}

/// Extends the owner's lease to `lease` from now (a heartbeat), never shortening it; a statement
/// of its own (SQLite commits it alone). Fenced by the token and the holder: it renews this very
/// owner's hold, never that of a later taker that drew the same token after this owner's draw
/// rolled back.
pub async fn renew_lease(
    connection: &mut SqliteConnection,
    owner: &Owner,
    lease: Duration,
) -> Result<(), StoreError> {
    let updated = sqlx::query(statements::RENEW_LEASE)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .bind(millis(lease))
        .bind(owner.holder())
        .execute(connection)
        .await?
        .rows_affected();
    fenced(updated)
}

/// Postpones a key after a failed attempt (fenced): its lease ends `retry_after` from now (zero:
/// at once), the error is recorded, and the fence advances, so a heartbeat of the owner still in
/// flight matches nothing.
pub async fn postpone(
    connection: PoolConnection<Sqlite>,
    owner: &Owner,
    retry_after: Duration,
    last_error: &str,
) -> Result<PoolConnection<Sqlite>, StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    postpone_in(transaction.connection(), owner, retry_after, last_error).await?;
    transaction.commit().await
}

/// Postpones a key as [`postpone`] does, inside the caller's write transaction.
pub async fn postpone_in(
    connection: &mut SqliteConnection,
    owner: &Owner,
    retry_after: Duration,
    last_error: &str,
) -> Result<(), StoreError> {
    let token: i64 = sqlx::query_scalar(statements::NEXT_FENCE)
        .fetch_one(&mut *connection)
        .await?;
    let updated = sqlx::query(statements::POSTPONE)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .bind(token)
        .bind(millis(retry_after))
        .bind(last_error)
        .execute(connection)
        .await?
        .rows_affected();
    fenced(updated)
}

/// Deletes a started key its owner holds, so the client may send the key again as a new request
/// (the forget policy for terminal errors). Fenced.
pub async fn delete_owned(
    connection: &mut SqliteConnection,
    owner: &Owner,
) -> Result<(), StoreError> {
    let deleted = sqlx::query(statements::DELETE_OWNED)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .execute(connection)
        .await?
        .rows_affected();
    fenced(deleted)
}

/// Ends a started key's lease now, if its token is still `seen`, and advances its fence; returns
/// the new token (`None`: not started, or the token moved on). For an owner believed gone.
pub async fn end_lease(
    connection: PoolConnection<Sqlite>,
    tenant: &str,
    key: &str,
    seen: i64,
) -> Result<(Option<i64>, PoolConnection<Sqlite>), StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let token: i64 = sqlx::query_scalar(statements::NEXT_FENCE)
        .fetch_one(transaction.connection())
        .await?;
    let ended: Option<i64> = sqlx::query_scalar(statements::END_LEASE)
        .bind(tenant)
        .bind(key)
        .bind(seen)
        .bind(token)
        .fetch_optional(transaction.connection())
        .await?;
    // Nothing ended: the drawn token is left unused (tokens need only never repeat).
    Ok((ended, transaction.commit().await?))
}

fn fenced(updated: u64) -> Result<(), StoreError> {
    if updated == 1 {
        Ok(())
    } else {
        Err(StoreError::Fenced)
    }
}
