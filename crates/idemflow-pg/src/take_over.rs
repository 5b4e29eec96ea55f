//! Taking over a started key whose lease expired: [`take_over`] for one key a request retried,
//! and [`TakenOver`], what it returns, which the resumer's batch takeover
//! ([`crate::take_over_due`]) returns too. A takeover is how a key gets a new [`Owner`] after its
//! claim: it draws a new fencing token, so every write of the previous owner is refused from then
//! on.

use std::time::Duration;

use idemflow_core::{Key, TenantId};
use serde_json::Value;
use sqlx::{PgConnection, Row};

use crate::claim_lock::claim_lock;
use crate::error::StoreError;
use crate::millis::millis;
use idemflow_store::Owner;

/// What a successful takeover returns: the new owner and where execution stands.
pub type TakenOver = idemflow_store::Taken<Owner>;

/// Takes over a started key whose lease expired, by compare-and-set on the fencing token the
/// caller saw: if anyone else took it over (or finished it, or renewed the lease) in between, no
/// row matches and `None` comes back. The lease is judged by the database clock. The new owner's
/// token is drawn from the fence sequence: it never equals a token of this key's past. The
/// journal gets a `taken_over` entry by `retry`, with the new token and attempt.
///
/// The takeover also takes the key's claim lock (the advisory lock a claim holds) for its
/// transaction, trying it without waiting: a second request taking the same key over while the
/// first one's takeover is uncommitted finds it held and gets `None` at once, instead of waiting
/// on the row lock for as long as the first one's local phases run.
pub async fn take_over(
    connection: &mut PgConnection,
    tenant: &TenantId,
    key: &Key,
    seen_lock_version: i64,
    lease: Duration,
) -> Result<Option<TakenOver>, StoreError> {
    let lease_from = std::time::Instant::now();
    let row = sqlx::query(
        "UPDATE idempotency_keys \
         SET (lock_version, journal) = ( \
                 SELECT fence.token, \
                        CASE WHEN jsonb_array_length(journal) >= 64 THEN journal - 1 \
                             ELSE journal END \
                        || jsonb_build_object( \
                               'at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                               'event', 'taken_over', 'token', fence.token, 'by', 'retry', \
                               'attempt', attempts + 1) \
                 FROM (SELECT nextval('idempotency_keys_fence') AS token) AS fence), \
             attempts = attempts + 1, \
             locked_until = clock_timestamp() + $4::bigint * interval '1 millisecond', \
             updated_at = now() \
         WHERE tenant = $1 AND key = $2 AND lock_version = $3 \
           AND state <> 'done' AND locked_until <= now() \
           AND pg_try_advisory_xact_lock($5) \
         RETURNING lock_version, recovery_point, phase_output, request, attempts, last_error",
    )
    .bind(tenant.as_str())
    .bind(key.as_str())
    .bind(seen_lock_version)
    .bind(millis(lease))
    .bind(claim_lock(tenant, key))
    .fetch_optional(connection)
    .await;
    let row = match row {
        // At Repeatable Read or Serializable (a client retry's takeover shares the transaction
        // of the phases after it, at their level), a row changed since the statement's snapshot
        // is refused with a serialization failure where Read Committed re-reads it and matches
        // nothing: either way the key moved on, and the aborted transaction is rolled back.
        Err(error) if crate::error::is_restartable(&error) => return Ok(None),
        row => row?,
    };
    Ok(row.map(|row| {
        let phase_output: Option<sqlx::types::Json<Value>> = row.get("phase_output");
        let request: sqlx::types::Json<Value> = row.get("request");
        TakenOver {
            owner: Owner::new(tenant.clone(), key.clone(), row.get("lock_version")),
            attempts: i64::from(row.get::<i32, _>("attempts")),
            recovery_point: row.get("recovery_point"),
            phase_output: phase_output.map(|json| json.0),
            request: request.0,
            last_error: row.get("last_error"),
            lease_from,
        }
    }))
}
