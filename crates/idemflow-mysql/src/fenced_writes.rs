//! The owner's writes, each fenced by its token: a write that updates no row answers
//! [`StoreError::Fenced`], and the caller stops working on the key. (The server counts rows
//! matched, not changed: sqlx's connections ask for `CLIENT_FOUND_ROWS`.)

use std::time::Duration;

use idemflow_core::StoredResponse;
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection};

use crate::claim::millis;
use crate::error::StoreError;
use crate::statements::{self, FENCES_PER_LIFE};
use crate::transaction::Transaction;
use idemflow_store::Owner;

/// Records a completed phase, in the owner's transaction: its recovery point and typed output,
/// and a lease of `lease` from now (never shorter than the one held).
pub async fn advance(
    connection: &mut MySqlConnection,
    owner: &Owner,
    recovery_point: &str,
    output: &Value,
    lease: Duration,
) -> Result<(), StoreError> {
    let output = serde_json::to_string(output)
        .map_err(|error| StoreError::Corrupt(format!("phase output: {error}")))?;
    let updated = sqlx::query(statements::ADVANCE)
        .bind(recovery_point)
        .bind(recovery_point)
        .bind(output)
        .bind(millis(lease))
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .execute(connection)
        .await?
        .rows_affected();
    fenced(updated)
}

/// Stores the response and marks the key done, in the owner's transaction. A body longer than
/// `apart_above` bytes goes to `idempotency_responses` under the owner's life (its token's high
/// bits), in the same transaction, after the fenced update locked the key's row.
pub async fn finish(
    connection: &mut MySqlConnection,
    owner: &Owner,
    recovery_point: &str,
    response: &StoredResponse,
    apart_above: usize,
) -> Result<(), StoreError> {
    let apart = response.body.len() > apart_above;
    let headers = serde_json::to_string(&response.headers)
        .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
    let updated = sqlx::query(statements::FINISH)
        .bind(i64::from(response.status))
        .bind(recovery_point)
        .bind(i64::from(response.status))
        .bind(headers)
        .bind(if apart {
            None
        } else {
            Some(response.body.as_slice())
        })
        .bind(apart)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .execute(&mut *connection)
        .await?
        .rows_affected();
    fenced(updated)?;
    if apart {
        sqlx::query(statements::STORE_APART)
            .bind(owner.tenant().as_str())
            .bind(owner.key().as_str())
            .bind(life_of(owner.lock_version()))
            .bind(response.body.as_slice())
            .execute(connection)
            .await?;
    }
    Ok(())
}

/// The life a token belongs to.
pub(crate) fn life_of(lock_version: i64) -> i64 {
    lock_version / FENCES_PER_LIFE
}

/// Extends the owner's lease to `lease` from now (a heartbeat), never shortening it; a statement
/// of its own (autocommit). Fenced by the token and the holder: it renews this very owner's
/// hold, never that of a later taker that drew the same token after this owner's takeover
/// rolled back.
pub async fn renew_lease(
    connection: &mut MySqlConnection,
    owner: &Owner,
    lease: Duration,
) -> Result<(), StoreError> {
    let updated = sqlx::query(statements::RENEW_LEASE)
        .bind(millis(lease))
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
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
    connection: PoolConnection<MySql>,
    owner: &Owner,
    retry_after: Duration,
    last_error: &str,
) -> Result<PoolConnection<MySql>, StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    postpone_in(transaction.connection(), owner, retry_after, last_error).await?;
    transaction.commit().await
}

/// Postpones a key as [`postpone`] does, inside the caller's transaction.
pub async fn postpone_in(
    connection: &mut MySqlConnection,
    owner: &Owner,
    retry_after: Duration,
    last_error: &str,
) -> Result<(), StoreError> {
    let updated = sqlx::query(statements::POSTPONE)
        .bind(last_error)
        .bind(millis(retry_after))
        .bind(last_error)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .execute(connection)
        .await?
        .rows_affected();
    fenced(updated)
}

/// Deletes a started key its owner holds, so the client may send the key again as a new request
/// (the forget policy for terminal errors). Fenced.
pub async fn delete_owned(
    connection: &mut MySqlConnection,
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
    connection: &mut MySqlConnection,
    tenant: &str,
    key: &str,
    seen: i64,
) -> Result<Option<i64>, StoreError> {
    let ended = sqlx::query(statements::END_LEASE)
        .bind(tenant)
        .bind(key)
        .bind(seen)
        .execute(connection)
        .await?
        .rows_affected();
    // The fence advanced by one: the new token is the seen one's successor.
    Ok((ended == 1).then_some(seen + 1))
}

fn fenced(updated: u64) -> Result<(), StoreError> {
    if updated == 1 {
        Ok(())
    } else {
        Err(StoreError::Fenced)
    }
}
