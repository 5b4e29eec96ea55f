//! What operators see of keys ([`key_report`], [`stuck_keys`]) and of the table
//! ([`table_stats`]), in the engine boundary's shared types, so the CLI renders every engine alike.

use idemflow_store::{KeyReport, TableStats};
use sqlx::MySqlConnection;
use sqlx::mysql::MySqlRow;

use crate::error::StoreError;
use crate::statements;

/// A key's report from its row: the boundary's decoding, every engine's.
pub(crate) fn report(row: &MySqlRow) -> Result<KeyReport, StoreError> {
    idemflow_store::rows::key_report(row).map_err(StoreError::from)
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

/// A key's stored request and response as stored ([`KeyBodies`]), for operators; `None` if there
/// is none. One statement, so a body stored apart comes from the same snapshot as its row.
/// Nothing sealed is opened.
pub async fn key_bodies(
    connection: &mut MySqlConnection,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyBodies>, StoreError> {
    let row = sqlx::query(statements::KEY_BODIES)
        .bind(tenant)
        .bind(key)
        .fetch_optional(connection)
        .await?;
    row.as_ref()
        .map(idemflow_store::rows::key_bodies)
        .transpose()
        .map_err(StoreError::from)
}

pub use idemflow_store::{KeyBodies, KeyResponse};

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
