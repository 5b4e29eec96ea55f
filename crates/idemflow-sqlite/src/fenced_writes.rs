//! The owner's writes, each fenced by its token: a write that updates no row answers
//! [`StoreError::Fenced`], and the caller stops working on the key.

use std::time::Duration;

use idemflow_core::StoredResponse;
use serde_json::Value;
use sqlx::SqliteConnection;

use crate::claim::millis;
use crate::error::StoreError;
use crate::owner::Owner;
use crate::statements;

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
/// of its own (SQLite commits it alone).
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
        .execute(connection)
        .await?
        .rows_affected();
    fenced(updated)
}

fn fenced(updated: u64) -> Result<(), StoreError> {
    if updated == 1 {
        Ok(())
    } else {
        Err(StoreError::Fenced)
    }
}
