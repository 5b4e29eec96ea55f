//! What the console reads and does beyond the CLI's reports, as on every engine: a page of keys
//! in key order ([`scan_keys`]), the table at a glance from its indexes ([`overview`]), and the
//! expiry of one key now ([`expire_key`]).

use idemflow_store::{KeyReport, Overview, ScanFrom, StartedKeys};
use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqliteConnection};

use crate::claim::millis;
use crate::error::StoreError;
use crate::report::report;
use crate::statements;
use crate::take_over::resumer_lag;
use crate::transaction::Transaction;

/// Up to `limit` keys from `from`, in `(tenant, key)` order: a range scan of the primary key.
pub async fn scan_keys(
    connection: &mut SqliteConnection,
    from: &ScanFrom,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let (tenant, key) = (from.after.0.as_str(), from.after.1.as_str());
    let sql = match (&from.tenant, from.inclusive) {
        (Some(_), true) => statements::SCAN_TENANT_FROM,
        (Some(_), false) => statements::SCAN_TENANT_AFTER,
        (None, true) => statements::SCAN_FROM,
        (None, false) => statements::SCAN_AFTER,
    };
    let tenant = from.tenant.as_deref().unwrap_or(tenant);
    let rows = sqlx::query(sql)
        .bind(tenant)
        .bind(key)
        .bind(limit)
        .fetch_all(connection)
        .await?;
    rows.iter().map(report).collect()
}

/// The table at a glance: started keys by workflow (the started-lease index), keys finished in
/// the last minute and quarter hour (the finished index) and the resumer's lag. SQLite keeps no
/// estimate of a table's rows.
pub async fn overview(connection: &mut SqliteConnection) -> Result<Overview, StoreError> {
    let started: Vec<(String, i64, i64)> = sqlx::query_as(statements::STARTED_BY_WORKFLOW)
        .fetch_all(&mut *connection)
        .await?;
    let oldest_started_seconds: Option<i64> = sqlx::query_scalar(statements::OLDEST_STARTED)
        .fetch_one(&mut *connection)
        .await?;
    let (finished_last_minute, finished_last_15_minutes): (i64, i64) =
        sqlx::query_as(statements::FINISHED_LATELY)
            .fetch_one(&mut *connection)
            .await?;
    let lag = resumer_lag(connection).await?;
    Ok(Overview {
        started: started
            .into_iter()
            .map(|(workflow, keys, due)| StartedKeys {
                workflow,
                keys,
                due,
            })
            .collect(),
        oldest_started_seconds,
        resumer_lag_ms: millis(lag),
        finished_last_minute,
        finished_last_15_minutes,
        estimated_keys: None,
    })
}

/// Deletes one key now, with its body stored apart, if it is still as the operator was shown it
/// (its fencing token `lock_version` and its `state`: a finish keeps the token), in one write
/// transaction. Returns the state of the key it deleted, `None` when the key is gone or moved on.
/// The next request with the key runs as a new one.
pub async fn expire_key(
    connection: PoolConnection<Sqlite>,
    tenant: &str,
    key: &str,
    lock_version: i64,
    state: &str,
) -> Result<(Option<String>, PoolConnection<Sqlite>), StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let deleted: Option<(i64, String)> = sqlx::query_as(statements::EXPIRE_KEY)
        .bind(tenant)
        .bind(key)
        .bind(lock_version)
        .bind(state)
        .fetch_optional(transaction.connection())
        .await?;
    if let Some((life, _)) = &deleted {
        sqlx::query(statements::DELETE_APART)
            .bind(tenant)
            .bind(key)
            .bind(life)
            .execute(transaction.connection())
            .await?;
    }
    Ok((deleted.map(|(_, state)| state), transaction.commit().await?))
}
