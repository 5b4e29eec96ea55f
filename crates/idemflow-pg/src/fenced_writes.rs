//! The owner's writes to its key: [`advance`], [`finish`], [`renew_lease`], [`postpone`] and
//! [`delete_owned`]. Each names the [`Owner`]'s fencing token in its `WHERE` clause and fails
//! with [`StoreError::Fenced`] when no row matched, so an owner whose key was taken over (or
//! finished, or deleted) can never write over its successor.

use std::time::Duration;

use idemflow_core::StoredResponse;
use serde_json::Value;
use sqlx::PgConnection;

use crate::error::StoreError;
use crate::millis::millis;
use crate::statements;
use idemflow_store::Owner;

/// A fenced write's outcome from the rows it changed: none means the fence was lost.
fn fenced(rows_affected: u64) -> Result<(), StoreError> {
    if rows_affected == 0 {
        Err(StoreError::Fenced)
    } else {
        Ok(())
    }
}

/// Records a completed phase: its name becomes the recovery point, its output is stored, and the
/// lease is renewed (measured from this statement, and never shortened). Fenced.
pub async fn advance(
    connection: &mut PgConnection,
    owner: &Owner,
    recovery_point: &str,
    phase_output: &Value,
    lease: Duration,
) -> Result<(), StoreError> {
    let result = sqlx::query(statements::ADVANCE)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .bind(recovery_point)
        .bind(sqlx::types::Json(phase_output))
        .bind(millis(lease))
        .execute(connection)
        .await?;
    fenced(result.rows_affected())
}

/// Finishes a key: stores the response, marks it done and clears the lease. Fenced. Run in the
/// same transaction as the last local effect, so the response exists exactly when the effects do.
/// Its time is the start of the key's retention window.
///
/// A body longer than `apart_above` bytes is stored out of the key's row, in
/// `idempotency_responses` ([`statements::FINISH_APART`]), by the same statement: the keys table
/// stays narrow, and a look-up that is not a replay (a 409, a 422, a takeover) never reads it.
pub async fn finish(
    connection: &mut PgConnection,
    owner: &Owner,
    recovery_point: &str,
    response: &StoredResponse,
    apart_above: usize,
) -> Result<(), StoreError> {
    let apart = response.body.len() > apart_above;
    let statement = if apart {
        statements::FINISH_APART
    } else {
        statements::FINISH
    };
    let result = sqlx::query(statement)
        .bind(owner.tenant().as_str())
        .bind(owner.key().as_str())
        .bind(owner.lock_version())
        .bind(recovery_point)
        .bind(i16::try_from(response.status).unwrap_or(i16::MAX))
        .bind(sqlx::types::Json(&response.headers))
        .bind(response.body.as_slice())
        .execute(connection)
        .await?;
    fenced(result.rows_affected())
}

/// Extends the owner's lease to `lease` from this statement; never shortens it. Fenced.
pub async fn renew_lease(
    connection: &mut PgConnection,
    owner: &Owner,
    lease: Duration,
) -> Result<(), StoreError> {
    let result = sqlx::query(
        "UPDATE idempotency_keys \
         SET locked_until = greatest(locked_until, \
                                     clock_timestamp() + $4::bigint * interval '1 millisecond'), \
             updated_at = now() \
         WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done'",
    )
    .bind(owner.tenant().as_str())
    .bind(owner.key().as_str())
    .bind(owner.lock_version())
    .bind(millis(lease))
    .execute(connection)
    .await?;
    fenced(result.rows_affected())
}

/// Postpones a key after a failed attempt: the lease now ends after `retry_after` (zero: at
/// once, which gives the key back), so a client retry or a resumer may take it over then, and
/// the error is recorded, in `last_error` and in the journal (a `failed` entry with the recovery
/// point the attempt began at and the new token). Fenced; and it advances the fence (a new token
/// from the sequence): the owner is done with the key, and a renewal of its heartbeat still in
/// flight (waiting on this row's lock) then matches nothing, instead of stretching the wait back
/// to a whole lease.
pub async fn postpone(
    connection: &mut PgConnection,
    owner: &Owner,
    retry_after: Duration,
    last_error: &str,
) -> Result<(), StoreError> {
    let result = sqlx::query(
        "UPDATE idempotency_keys \
         SET locked_until = clock_timestamp() + $4::bigint * interval '1 millisecond', \
             (lock_version, journal) = ( \
                 SELECT fence.token, \
                        CASE WHEN jsonb_array_length(journal) >= 64 THEN journal - 1 \
                             ELSE journal END \
                        || jsonb_build_object( \
                               'at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                               'event', 'failed', 'token', fence.token, \
                               'point', recovery_point, 'error', $5::text) \
                 FROM (SELECT nextval('idempotency_keys_fence') AS token) AS fence), \
             last_error = $5, updated_at = now() \
         WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done'",
    )
    .bind(owner.tenant().as_str())
    .bind(owner.key().as_str())
    .bind(owner.lock_version())
    .bind(millis(retry_after))
    .bind(last_error)
    .execute(connection)
    .await?;
    fenced(result.rows_affected())
}

/// Deletes a started key its owner holds, so the client may send the same key again as a new
/// request (the forget policy for terminal errors). Fenced.
pub async fn delete_owned(connection: &mut PgConnection, owner: &Owner) -> Result<(), StoreError> {
    let result = sqlx::query(
        "DELETE FROM idempotency_keys \
         WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done'",
    )
    .bind(owner.tenant().as_str())
    .bind(owner.key().as_str())
    .bind(owner.lock_version())
    .execute(connection)
    .await?;
    fenced(result.rows_affected())
}
