//! What the console reads and does beyond the CLI's reports, as on every engine: a page of keys
//! in key order ([`scan_keys`]), the table at a glance from its indexes ([`overview`]), and the
//! expiry of one key now ([`expire_key`]).

use idemflow_store::{KeyReport, Overview, ScanFrom, StartedKeys};
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection};

use crate::claim::millis;
use crate::error::StoreError;
use crate::report::report;
use crate::statements;
use crate::take_over::resumer_lag;
use crate::transaction::Transaction;

/// Up to `limit` keys from `from`, in `(tenant, key)` order: a range scan of the primary key.
pub async fn scan_keys(
    connection: &mut MySqlConnection,
    from: &ScanFrom,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let (tenant, key) = (from.after.0.as_str(), from.after.1.as_str());
    let rows = match &from.tenant {
        Some(only) => {
            let sql = if from.inclusive {
                statements::SCAN_TENANT_FROM
            } else {
                statements::SCAN_TENANT_AFTER
            };
            sqlx::query(sql)
                .bind(only.as_bytes())
                .bind(key.as_bytes())
                .bind(limit)
                .fetch_all(connection)
                .await?
        }
        None => {
            let sql = if from.inclusive {
                statements::SCAN_FROM
            } else {
                statements::SCAN_AFTER
            };
            sqlx::query(sql)
                .bind(tenant.as_bytes())
                .bind(tenant.as_bytes())
                .bind(key.as_bytes())
                .bind(limit)
                .fetch_all(connection)
                .await?
        }
    };
    rows.iter().map(report).collect()
}

/// The table at a glance: started keys by workflow, keys finished in the last minute and
/// quarter hour (both on the state indexes), the resumer's lag and InnoDB's row estimate.
pub async fn overview(connection: &mut MySqlConnection) -> Result<Overview, StoreError> {
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
    let estimated_keys: Option<i64> = sqlx::query_scalar(statements::ESTIMATED_KEYS)
        .fetch_optional(&mut *connection)
        .await?
        .flatten();
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
        estimated_keys,
    })
}

/// Deletes one key now, with its body stored apart, if it is still as the operator was shown it
/// (its fencing token `lock_version` and its `state`: a finish keeps the token), in one
/// transaction holding the key's row lock. Returns the state of the key it deleted, `None` when
/// the key is gone, moved on, or being written right now (an owner's transaction holds its row). The next request with the key runs as a new one.
pub async fn expire_key(
    connection: PoolConnection<MySql>,
    tenant: &str,
    key: &str,
    lock_version: i64,
    state: &str,
) -> Result<(Option<String>, PoolConnection<MySql>), StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let found: Option<(i64, String)> = sqlx::query_as(statements::EXPIRE_KEY)
        .bind(tenant.as_bytes())
        .bind(key.as_bytes())
        .bind(lock_version)
        .bind(state)
        .fetch_optional(transaction.connection())
        .await?;
    if let Some((life, _)) = &found {
        for statement in [statements::DELETE_LIFE, statements::DELETE_APART_LIFE] {
            sqlx::query(statement)
                .bind(life)
                .execute(transaction.connection())
                .await?;
        }
    }
    Ok((found.map(|(_, state)| state), transaction.commit().await?))
}
