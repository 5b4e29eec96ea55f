//! What operators see of keys ([`key_report`], [`stuck_keys`]) and of the table
//! ([`table_stats`]), in the store boundary's shared types, so the CLI renders every engine alike.

use idemflow_store::{KeyReport, TableStats};
use sqlx::mysql::MySqlRow;
use sqlx::{MySqlConnection, Row};

use crate::error::StoreError;
use crate::statements;

fn report(row: &MySqlRow) -> Result<KeyReport, StoreError> {
    Ok(KeyReport {
        tenant: row.try_get("tenant")?,
        key: row.try_get("key")?,
        workflow: row.try_get("workflow")?,
        state: row.try_get("state")?,
        recovery_point: row.try_get("recovery_point")?,
        lease_left_ms: row.try_get("lease_left_ms")?,
        lock_version: row.try_get("lock_version")?,
        attempts: row.try_get("attempts")?,
        last_error: row.try_get("last_error")?,
        response_status: row.try_get("response_status")?,
        response_bytes: row
            .try_get::<Option<i64>, _>("response_bytes")?
            .map(|bytes| i32::try_from(bytes).unwrap_or(i32::MAX)),
        fingerprint_hex: row.try_get("fingerprint_hex")?,
        age_seconds: row.try_get("age_seconds")?,
    })
}

/// Everything about one key; `None` if there is none.
pub async fn key_report(
    connection: &mut MySqlConnection,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyReport>, StoreError> {
    let row = sqlx::query(statements::KEY_REPORT)
        .bind(tenant)
        .bind(key)
        .fetch_optional(connection)
        .await?;
    row.as_ref().map(report).transpose()
}

/// Started keys that look stuck: past their lease, or with at least `min_attempts` attempts.
pub async fn stuck_keys(
    connection: &mut MySqlConnection,
    min_attempts: i32,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let rows = sqlx::query(statements::STUCK_KEYS)
        .bind(min_attempts)
        .bind(limit)
        .fetch_all(connection)
        .await?;
    rows.iter().map(report).collect()
}

/// The table at a glance: keys by workflow and state, the oldest started key, the resumer lag.
pub async fn table_stats(connection: &mut MySqlConnection) -> Result<TableStats, StoreError> {
    let counts: Vec<(String, String, i64)> = sqlx::query_as(statements::COUNTS)
        .fetch_all(&mut *connection)
        .await?;
    let oldest_started_seconds: Option<i64> = sqlx::query_scalar(statements::OLDEST_STARTED)
        .fetch_one(&mut *connection)
        .await?;
    let resumer_lag_ms: i64 = sqlx::query_scalar(statements::RESUMER_LAG)
        .fetch_one(connection)
        .await?;
    Ok(TableStats {
        counts,
        oldest_started_seconds,
        resumer_lag_ms,
    })
}
