//! What operators see of keys ([`key_report`], [`stuck_keys`]) and of the table
//! ([`table_stats`]), in the store boundary's shared types, so the CLI renders both engines alike.

use idemflow_store::{KeyReport, TableStats};
use sqlx::sqlite::SqliteRow;
use sqlx::{Row, SqliteConnection};

use crate::error::StoreError;
use crate::statements;

pub(crate) fn report(row: &SqliteRow) -> Result<KeyReport, StoreError> {
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
        response_bytes: row.try_get("response_bytes")?,
        fingerprint_hex: row.try_get("fingerprint_hex")?,
        age_seconds: row.try_get("age_seconds")?,
        journal: idemflow_store::journal_from_json(
            row.try_get("tenant")?,
            row.try_get("key")?,
            row.try_get("journal")?,
        ),
    })
}

/// Everything about one key; `None` if there is none.
pub async fn key_report(
    connection: &mut SqliteConnection,
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
    connection: &mut SqliteConnection,
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

/// A key's stored request and response as stored ([`KeyBodies`]), for operators; `None` if there
/// is none. One statement, so a body stored apart comes from the same snapshot as its row.
/// Nothing sealed is opened.
pub async fn key_bodies(
    connection: &mut SqliteConnection,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyBodies>, StoreError> {
    let row = sqlx::query(statements::KEY_BODIES)
        .bind(tenant)
        .bind(key)
        .fetch_optional(connection)
        .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let request: String = row.try_get("request")?;
    let request = serde_json::from_str(&request)
        .map_err(|error| StoreError::Corrupt(format!("request: {error}")))?;
    let status: Option<i64> = row.try_get("response_status")?;
    let response = match status {
        None => None,
        Some(status) => {
            let headers: String = row.try_get("response_headers")?;
            let body: Option<Vec<u8>> = row.try_get("response_body")?;
            Some(KeyResponse {
                status: u16::try_from(status)
                    .map_err(|_| StoreError::Corrupt(format!("response status {status}")))?,
                headers: serde_json::from_str(&headers)
                    .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?,
                body: body.ok_or_else(|| {
                    StoreError::Corrupt("a done key's body stored apart is missing".to_owned())
                })?,
                apart: row.try_get("response_apart")?,
            })
        }
    };
    Ok(Some(KeyBodies {
        request,
        response,
        finished_seconds_ago: row.try_get("finished_seconds_ago")?,
    }))
}

pub use idemflow_store::{KeyBodies, KeyResponse};

/// The table at a glance: keys by workflow and state, the oldest started key, the resumer lag.
/// One read transaction's snapshot is not needed: each figure is read on its own.
pub async fn table_stats(connection: &mut SqliteConnection) -> Result<TableStats, StoreError> {
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
