//! The schedule's reads and chaos on MySQL/MariaDB: a pool of its own on the engine's database.
//! Its reads are consistent reads (they never wait); its writes lock the row first with
//! `FOR UPDATE SKIP LOCKED` and do nothing this step when an owner holds it, as PostgreSQL's do.
//! Keys are `VARBINARY`: read back as text with `CONVERT(… USING utf8mb4)`.

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, TenantId};
use sqlx::{MySqlConnection, MySqlPool};

use super::{CallerView, Lapse, Observe, SampledRow, Stored};

/// The observer's pool on the engine's database, and its sessions' ids (never killed).
pub(crate) struct MySqlObserver(pub MySqlPool);

/// Now in ms since the Unix epoch, UTC, as the engine's statements read it.
macro_rules! now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

/// How long the wind-down tries to lock a key before it calls it stuck.
const LAPSE_PATIENCE: Duration = Duration::from_secs(10);

/// Runs `write` in a transaction that first locks `key`'s row if it is free (and, when given,
/// still holds `lock_version` and the sampled lease end); whether it wrote one row.
async fn write_if_free(
    pool: &MySqlPool,
    tenant: &TenantId,
    key: &str,
    sampled: Option<(i64, Option<&str>)>,
    write: &'static str,
) -> bool {
    let Ok(mut connection) = pool.acquire().await else {
        return false;
    };
    if sqlx::raw_sql("BEGIN")
        .execute(&mut *connection)
        .await
        .is_err()
    {
        return false;
    }
    let wrote = lock_and_write(&mut connection, tenant, key, sampled, write).await;
    let end = if wrote { "COMMIT" } else { "ROLLBACK" };
    sqlx::raw_sql(end).execute(&mut *connection).await.is_ok() && wrote
}

async fn lock_and_write(
    connection: &mut MySqlConnection,
    tenant: &TenantId,
    key: &str,
    sampled: Option<(i64, Option<&str>)>,
    write: &'static str,
) -> bool {
    let locked: Result<Option<(i64, Option<String>)>, _> = sqlx::query_as(
        "SELECT lock_version, CAST(locked_until AS CHAR) FROM idempotency_keys \
         WHERE tenant = ? AND `key` = ? FOR UPDATE SKIP LOCKED",
    )
    .bind(tenant.as_str())
    .bind(key)
    .fetch_optional(&mut *connection)
    .await;
    let Ok(Some((lock_version, locked_until))) = locked else {
        return false;
    };
    if let Some((seen, seen_until)) = sampled
        && (seen != lock_version || seen_until != locked_until.as_deref())
    {
        return false;
    }
    let written = sqlx::query(write)
        .bind(tenant.as_str())
        .bind(key)
        .execute(&mut *connection)
        .await;
    matches!(&written, Ok(done) if done.rows_affected() == 1)
}

#[async_trait]
impl Observe for MySqlObserver {
    fn engine(&self) -> &'static str {
        "mysql"
    }

    fn clock_resolution(&self) -> f64 {
        // Leases are whole milliseconds cut from microseconds: up to one each way, and a little.
        0.0025
    }

    async fn rows(&self, tenant: &TenantId) -> Result<Vec<SampledRow>, String> {
        type Row = (
            String,
            String,
            i64,
            Option<String>,
            String,
            String,
            String,
            bool,
        );
        let rows: Vec<Row> = sqlx::query_as(concat!(
            "SELECT CONVERT(`key` USING utf8mb4), CAST(state AS CHAR), lock_version, \
                    CAST(locked_until AS CHAR), recovery_point, CAST(created_at AS CHAR), \
                    request, state = 'started' AND locked_until <= ",
            now_ms!(),
            " FROM idempotency_keys WHERE tenant = ?"
        ))
        .bind(tenant.as_str())
        .fetch_all(&self.0)
        .await
        .map_err(|error| error.to_string())?;
        rows.into_iter()
            .map(
                |(
                    key,
                    state,
                    lock_version,
                    locked_until,
                    recovery_point,
                    created_at,
                    request,
                    due,
                )| {
                    Ok(SampledRow {
                        key,
                        state,
                        lock_version,
                        locked_until,
                        recovery_point,
                        created_at,
                        request: serde_json::from_str(&request)
                            .map_err(|error| error.to_string())?,
                        due,
                    })
                },
            )
            .collect()
    }

    async fn caller_view(
        &self,
        tenant: &TenantId,
        key: &str,
    ) -> Result<Option<CallerView>, String> {
        type Seen = (i64, String, String, Option<bool>, String);
        let row: Option<Seen> = sqlx::query_as(concat!(
            "SELECT lock_version, CAST(state AS CHAR), recovery_point, locked_until > ",
            now_ms!(),
            ", request FROM idempotency_keys WHERE tenant = ? AND `key` = ?"
        ))
        .bind(tenant.as_str())
        .bind(key)
        .fetch_optional(&self.0)
        .await
        .map_err(|error| error.to_string())?;
        row.map(|(lock_version, state, recovery_point, live, request)| {
            Ok(CallerView {
                lock_version,
                state,
                recovery_point,
                live,
                request: serde_json::from_str(&request).map_err(|error| error.to_string())?,
            })
        })
        .transpose()
    }

    async fn started_lease(&self, tenant: &TenantId, key: &str) -> Option<(f64, i64)> {
        sqlx::query_as(
            "SELECT locked_until / 1e3, lock_version \
             FROM idempotency_keys WHERE tenant = ? AND `key` = ? AND state = 'started'",
        )
        .bind(tenant.as_str())
        .bind(key)
        .fetch_optional(&self.0)
        .await
        .ok()
        .flatten()
    }

    async fn token(&self, tenant: &TenantId, key: &str) -> Option<i64> {
        sqlx::query_scalar(
            "SELECT lock_version FROM idempotency_keys WHERE tenant = ? AND `key` = ?",
        )
        .bind(tenant.as_str())
        .bind(key)
        .fetch_optional(&self.0)
        .await
        .ok()
        .flatten()
    }

    async fn expire_lease(
        &self,
        tenant: &TenantId,
        key: &str,
        lock_version: i64,
        locked_until: Option<&str>,
    ) -> bool {
        write_if_free(
            &self.0,
            tenant,
            key,
            Some((lock_version, locked_until)),
            concat!(
                "UPDATE idempotency_keys SET locked_until = ",
                now_ms!(),
                " - 1000 WHERE tenant = ? AND `key` = ? AND state = 'started'"
            ),
        )
        .await
    }

    async fn expire_key(
        &self,
        tenant: &TenantId,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Option<String> {
        let connection = self.0.acquire().await.ok()?;
        idemflow_mysql::expire_key(connection, tenant.as_str(), key, lock_version, state)
            .await
            .ok()
            .and_then(|(deleted, _connection)| deleted)
    }

    async fn end_lease(&self, tenant: &TenantId, key: &str, locked_until: Option<&str>) -> bool {
        // What `idemflow end-lease` runs (the store's statement), with the look inside the same
        // transaction, on the row it locked, so no owner's write lands between the look and the
        // end.
        let Some(seen) = self.token(tenant, key).await else {
            return false;
        };
        let Ok(mut connection) = self.0.acquire().await else {
            return false;
        };
        if sqlx::raw_sql("BEGIN")
            .execute(&mut *connection)
            .await
            .is_err()
        {
            return false;
        }
        let locked: Result<Option<(i64, Option<String>)>, _> = sqlx::query_as(
            "SELECT lock_version, CAST(locked_until AS CHAR) FROM idempotency_keys \
             WHERE tenant = ? AND `key` = ? FOR UPDATE SKIP LOCKED",
        )
        .bind(tenant.as_str())
        .bind(key)
        .fetch_optional(&mut *connection)
        .await;
        let still = matches!(&locked, Ok(Some((token, until)))
            if *token == seen && until.as_deref() == locked_until);
        let ended = still
            && matches!(
                idemflow_mysql::end_lease(&mut connection, tenant.as_str(), key, seen).await,
                Ok(Some(_))
            );
        let end = if ended { "COMMIT" } else { "ROLLBACK" };
        sqlx::raw_sql(end).execute(&mut *connection).await.is_ok() && ended
    }

    async fn done_within(&self, tenant: &TenantId, window: Duration) -> Vec<String> {
        sqlx::query_scalar(concat!(
            "SELECT CONVERT(`key` USING utf8mb4) FROM idempotency_keys \
             WHERE tenant = ? AND state = 'done' AND finished_at > ",
            now_ms!(),
            " - ? + 60000"
        ))
        .bind(tenant.as_str())
        .bind(i64::try_from(window.as_millis()).unwrap_or(i64::MAX))
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn present(&self, tenant: &TenantId) -> HashSet<String> {
        sqlx::query_scalar(
            "SELECT CONVERT(`key` USING utf8mb4) FROM idempotency_keys WHERE tenant = ?",
        )
        .bind(tenant.as_str())
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
        .into_iter()
        .collect()
    }

    async fn time_jump(&self, tenant: &TenantId, hours: i64) -> bool {
        // Every key of the tenant no owner holds: rows locked by an owner are skipped (their
        // next write moves on from there), as PostgreSQL's observer skips them.
        let Ok(mut connection) = self.0.acquire().await else {
            return false;
        };
        if sqlx::raw_sql("BEGIN")
            .execute(&mut *connection)
            .await
            .is_err()
        {
            return false;
        }
        let free: Result<Vec<Vec<u8>>, _> = sqlx::query_scalar(
            "SELECT `key` FROM idempotency_keys WHERE tenant = ? FOR UPDATE SKIP LOCKED",
        )
        .bind(tenant.as_str())
        .fetch_all(&mut *connection)
        .await;
        let mut moved = free.is_ok();
        for key in free.unwrap_or_default() {
            moved &= sqlx::query(
                "UPDATE idempotency_keys SET created_at = created_at - ?, \
                        updated_at = updated_at - ?, finished_at = finished_at - ? \
                 WHERE tenant = ? AND `key` = ?",
            )
            .bind(hours * 60 * 60 * 1000)
            .bind(hours * 60 * 60 * 1000)
            .bind(hours * 60 * 60 * 1000)
            .bind(tenant.as_str())
            .bind(key.as_slice())
            .execute(&mut *connection)
            .await
            .is_ok();
        }
        let end = if moved { "COMMIT" } else { "ROLLBACK" };
        sqlx::raw_sql(end).execute(&mut *connection).await.is_ok() && moved
    }

    async fn kill(&self, offset: i64) -> bool {
        // One of the engine's sessions on this database, never the observer's own (each marks
        // itself in `sim_observers` as it opens).
        let victim: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(id AS SIGNED) FROM information_schema.PROCESSLIST \
             WHERE db = DATABASE() AND id <> CONNECTION_ID() \
               AND id NOT IN (SELECT id FROM sim_observers) \
             ORDER BY id LIMIT 1 OFFSET ?",
        )
        .bind(offset)
        .fetch_optional(&self.0)
        .await
        .ok()
        .flatten();
        let Some(victim) = victim else {
            return false;
        };
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("KILL CONNECTION {victim}")))
            .execute(&self.0)
            .await
            .is_ok()
    }

    async fn corrupt(&self, tenant: &TenantId, key: &str) -> bool {
        write_if_free(
            &self.0,
            tenant,
            key,
            None,
            "UPDATE idempotency_keys SET phase_output = '{\"amount\": \"a lot\"}' \
             WHERE tenant = ? AND `key` = ? AND recovery_point = 'price'",
        )
        .await
    }

    async fn lapse(&self, tenant: &TenantId, key: &str) -> Lapse {
        let started = std::time::Instant::now();
        loop {
            let lapsed = write_if_free(
                &self.0,
                tenant,
                key,
                None,
                concat!(
                    "UPDATE idempotency_keys SET locked_until = ",
                    now_ms!(),
                    " - 1000 WHERE tenant = ? AND `key` = ? AND state = 'started'"
                ),
            )
            .await;
            if lapsed {
                return Lapse::Done;
            }
            // Not lapsed: the row is locked by a transaction no one ends, or it is not started
            // (any more).
            let started_now: Option<i64> = sqlx::query_scalar(
                "SELECT 1 FROM idempotency_keys WHERE tenant = ? AND `key` = ? \
                   AND state = 'started'",
            )
            .bind(tenant.as_str())
            .bind(key)
            .fetch_optional(&self.0)
            .await
            .ok()
            .flatten();
            if started_now.is_none() {
                return Lapse::Done;
            }
            if started.elapsed() >= LAPSE_PATIENCE {
                return Lapse::Stuck;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn stored(&self, tenant: &TenantId, key: &Key) -> Result<Option<Stored>, String> {
        let mut connection = self.0.acquire().await.map_err(|error| error.to_string())?;
        let found = match idemflow_mysql::look_up(&mut connection, tenant, key)
            .await
            .map_err(|error| error.to_string())?
        {
            idemflow_mysql::LookUp::Found(found) => found,
            idemflow_mysql::LookUp::Absent => return Ok(None),
        };
        let mut response = found.response;
        if let (Some(response), Some(life)) = (response.as_mut(), found.body_apart) {
            response.body = idemflow_mysql::response_apart(&mut connection, tenant, key, life)
                .await
                .map_err(|error| error.to_string())?
                .ok_or("the body stored apart is gone")?;
        }
        let request: Option<String> = sqlx::query_scalar(
            "SELECT request FROM idempotency_keys WHERE tenant = ? AND `key` = ?",
        )
        .bind(tenant.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *connection)
        .await
        .ok()
        .flatten();
        Ok(Some(Stored {
            response,
            lock_version: found.lock_version,
            request: request.and_then(|request| serde_json::from_str(&request).ok()),
        }))
    }

    async fn effect_rows(&self, tenant: &TenantId) -> Vec<super::EffectRow> {
        sqlx::query_as(
            "SELECT `key`, life, phase, lock_version, claimed_at FROM sim_effects WHERE tenant = ?",
        )
        .bind(tenant.as_str())
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn effects_of(
        &self,
        tenant: &TenantId,
        key: &str,
        life: i64,
        phase: &str,
        per_claim: bool,
    ) -> Vec<i64> {
        sqlx::query_scalar(
            "SELECT lock_version FROM sim_effects \
             WHERE tenant = ? AND `key` = ? AND life = ? AND phase = ? \
               AND (NOT ? OR claimed_at = (SELECT CAST(created_at AS CHAR) \
                                           FROM idempotency_keys \
                                           WHERE tenant = ? AND `key` = ?))",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(life)
        .bind(phase)
        .bind(per_claim)
        .bind(tenant.as_str())
        .bind(key)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn ledger_twice(&self, prefix: &str) -> Vec<(String, i64)> {
        sqlx::query_as(
            "SELECT message_id, COUNT(*) FROM sim_ledger WHERE message_id LIKE ? \
             GROUP BY message_id HAVING COUNT(*) > 1",
        )
        .bind(prefix)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn ledger_disagreeing(&self, prefix: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT message_id FROM sim_ledger WHERE message_id LIKE ? \
               AND CONVERT(message_id USING binary) NOT IN \
                   (SELECT message_id FROM processed_messages WHERE subscriber = 'sim-ledger') \
             UNION \
             SELECT CONVERT(message_id USING utf8mb4) FROM processed_messages \
             WHERE subscriber = 'sim-ledger' AND message_id LIKE ? \
               AND CONVERT(message_id USING utf8mb4) NOT IN (SELECT message_id FROM sim_ledger)",
        )
        .bind(prefix)
        .bind(prefix)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn transactions_left_open(&self) -> i64 {
        // Sessions of the engine's pool on this database inside a transaction, the observer's
        // own aside: InnoDB's list of active transactions (`SHOW ENGINE INNODB STATUS`, read
        // live; `information_schema.INNODB_TRX` is a cache InnoDB refreshes only when no one
        // read it for 100 ms, so schedules polling it side by side read it stale for good).
        let status: Result<(String, String, String), _> =
            sqlx::query_as("SHOW ENGINE INNODB STATUS")
                .fetch_one(&self.0)
                .await;
        let Ok((_, _, status)) = status else {
            return 0;
        };
        let mut active = Vec::new();
        let mut in_active = false;
        for line in status.lines() {
            if line.starts_with("---TRANSACTION") {
                in_active = line.contains("ACTIVE");
            } else if in_active
                && let Some(rest) = line.strip_prefix("MySQL thread id ")
                && let Some(id) = rest
                    .split(',')
                    .next()
                    .and_then(|id| id.trim().parse::<i64>().ok())
            {
                active.push(id);
                in_active = false;
            }
        }
        if active.is_empty() {
            return 0;
        }
        let sessions: Vec<i64> = sqlx::query_scalar(
            "SELECT CAST(id AS SIGNED) FROM information_schema.PROCESSLIST \
             WHERE db = DATABASE() AND id <> CONNECTION_ID() \
               AND id NOT IN (SELECT id FROM sim_observers)",
        )
        .fetch_all(&self.0)
        .await
        .unwrap_or_default();
        active.iter().filter(|id| sessions.contains(id)).count() as i64
    }

    fn left_open_patience(&self) -> Duration {
        // A session whose statement a phase gave up (its connection closed by the client) goes
        // on until the server's statement timeout ends it (at most 1.5 s in a schedule), then
        // rolls back: not left open.
        Duration::from_secs(3)
    }
}
