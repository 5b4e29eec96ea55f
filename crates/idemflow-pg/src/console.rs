//! What the console reads and does beyond the CLI's reports: a page of keys in key order
//! ([`scan_keys`]), the table at a glance from its indexes ([`overview`]), and the expiry of one
//! key now ([`expire_key`]).

use idemflow_store::{KeyReport, Overview, ScanFrom, StartedKeys};
use sqlx::PgConnection;

use crate::error::StoreError;
use crate::maintenance::{REPORT_COLUMNS, report, resumer_lag};
use crate::millis::millis;

/// Up to `limit` keys from `from`, in `(tenant, key)` order: a range scan of the primary key.
pub async fn scan_keys(
    connection: &mut PgConnection,
    from: &ScanFrom,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let after = if from.inclusive { ">=" } else { ">" };
    let (tenant, key) = (&from.after.0, &from.after.1);
    // With a tenant, the scan stays in its range of the primary key: `after.1` is the position.
    let rows = match &from.tenant {
        Some(only) => {
            let sql = format!(
                "SELECT {REPORT_COLUMNS} FROM idempotency_keys \
                 WHERE tenant = $1 AND key {after} $2 ORDER BY key LIMIT $3"
            );
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(only)
                .bind(key)
                .bind(limit)
                .fetch_all(connection)
                .await?
        }
        None => {
            let sql = format!(
                "SELECT {REPORT_COLUMNS} FROM idempotency_keys \
                 WHERE (tenant, key) {after} ($1, $2) ORDER BY tenant, key LIMIT $3"
            );
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(tenant)
                .bind(key)
                .bind(limit)
                .fetch_all(connection)
                .await?
        }
    };
    rows.iter().map(report).collect()
}

/// The table at a glance: started keys by workflow (the started-lease index), keys finished in
/// the last minute and quarter hour (the finished index), the resumer's lag, and the planner's
/// estimate of the table's rows (summed over partitions in the partitioned layout).
pub async fn overview(connection: &mut PgConnection) -> Result<Overview, StoreError> {
    let started: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT workflow, count(*), count(*) FILTER (WHERE locked_until <= now()) \
         FROM idempotency_keys WHERE state = 'started' GROUP BY workflow ORDER BY workflow",
    )
    .fetch_all(&mut *connection)
    .await?;
    let oldest_started_seconds: Option<i64> = sqlx::query_scalar(
        "SELECT floor(extract(epoch FROM now() - min(created_at)))::bigint \
         FROM idempotency_keys WHERE state = 'started'",
    )
    .fetch_one(&mut *connection)
    .await?;
    let (finished_last_minute, finished_last_15_minutes): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE finished_at > now() - interval '1 minute'), count(*) \
         FROM idempotency_keys \
         WHERE state = 'done' AND finished_at > now() - interval '15 minutes'",
    )
    .fetch_one(&mut *connection)
    .await?;
    // reltuples is -1 for a table never analysed: no estimate then.
    let estimated: Option<f64> = sqlx::query_scalar(
        "SELECT sum(reltuples)::float8 FROM pg_class \
         WHERE reltuples >= 0 AND (oid = to_regclass('idempotency_keys') \
             OR oid IN (SELECT inhrelid FROM pg_inherits \
                        WHERE inhparent = to_regclass('idempotency_keys')))",
    )
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
        #[allow(clippy::cast_possible_truncation)]
        estimated_keys: estimated.map(|rows| rows.round() as i64),
    })
}

/// Deletes one key now, with its body stored apart, if it is still as the operator was shown it:
/// its fencing token `lock_version` and its `state` (a finish keeps the token, so a key shown
/// started that finished since is not deleted: its stored response would be lost to a retry that
/// already counts on it). Returns the state of the key it deleted (the one named), `None` when the
/// key is gone, moved on, or being written right now (its row locked by an owner's transaction:
/// an operator's action never waits behind one). The next request with the key runs as a new one.
pub async fn expire_key(
    connection: &mut PgConnection,
    tenant: &str,
    key: &str,
    lock_version: i64,
    state: &str,
) -> Result<Option<String>, StoreError> {
    let deleted: Option<String> = sqlx::query_scalar(
        "WITH target AS ( \
             SELECT tenant, key FROM idempotency_keys \
             WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state = $4 \
             FOR UPDATE SKIP LOCKED \
         ), gone AS ( \
             DELETE FROM idempotency_keys AS keys USING target \
             WHERE keys.tenant = target.tenant AND keys.key = target.key \
               AND keys.lock_version = $3 AND keys.state = $4 \
             RETURNING keys.tenant, keys.key, keys.response_apart, keys.state \
         ), bodies AS ( \
             DELETE FROM idempotency_responses AS apart USING gone \
             WHERE gone.response_apart AND apart.tenant = gone.tenant AND apart.key = gone.key \
         ) \
         SELECT state FROM gone",
    )
    .bind(tenant)
    .bind(key)
    .bind(lock_version)
    .bind(state)
    .fetch_optional(connection)
    .await?;
    Ok(deleted)
}
