//! The schedule's reads and chaos on SQLite: a pool of its own on the engine's file. Its reads
//! never wait (WAL); its writes take the one write lock only if it is free within the pool's short
//! busy timeout, and otherwise do nothing this step, as PostgreSQL's skip a locked row.

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, TenantId};
use idemflow_sqlite::statements;
use serde_json::Value;
use sqlx::SqlitePool;
use sqlx::types::Json;

use super::{CallerView, Lapse, Observe, SampledRow, Stored};

/// The observer's pool on the engine's file.
pub(crate) struct SqliteObserver(pub SqlitePool);

/// How long the wind-down tries to take the write lock before it calls a key stuck.
const LAPSE_PATIENCE: Duration = Duration::from_secs(10);

#[async_trait]
impl Observe for SqliteObserver {
    fn engine(&self) -> &'static str {
        "sqlite"
    }

    fn clock_resolution(&self) -> f64 {
        // Leases are whole milliseconds cut from a float: up to one each way, and a little.
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
            Json<Value>,
            bool,
        );
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT key, state, lock_version, CAST(locked_until AS TEXT), recovery_point, \
                    CAST(created_at AS TEXT), request, \
                    state = 'started' \
                      AND locked_until <= CAST(unixepoch('subsec') * 1000 AS INTEGER) \
             FROM idempotency_keys WHERE tenant = ?1",
        )
        .bind(tenant.as_str())
        .fetch_all(&self.0)
        .await
        .map_err(|error| error.to_string())?;
        Ok(rows
            .into_iter()
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
                    SampledRow {
                        key,
                        state,
                        lock_version,
                        locked_until,
                        recovery_point,
                        created_at,
                        request: request.0,
                        due,
                    }
                },
            )
            .collect())
    }

    async fn caller_view(
        &self,
        tenant: &TenantId,
        key: &str,
    ) -> Result<Option<CallerView>, String> {
        type Seen = (i64, String, String, Option<bool>, Json<Value>);
        let row: Option<Seen> = sqlx::query_as(
            "SELECT lock_version, state, recovery_point, \
                    locked_until > CAST(unixepoch('subsec') * 1000 AS INTEGER), request \
             FROM idempotency_keys WHERE tenant = ?1 AND key = ?2",
        )
        .bind(tenant.as_str())
        .bind(key)
        .fetch_optional(&self.0)
        .await
        .map_err(|error| error.to_string())?;
        Ok(row.map(
            |(lock_version, state, recovery_point, live, request)| CallerView {
                lock_version,
                state,
                recovery_point,
                live,
                request: request.0,
            },
        ))
    }

    async fn started_lease(&self, tenant: &TenantId, key: &str) -> Option<(f64, i64)> {
        sqlx::query_as(
            "SELECT locked_until / 1000.0, lock_version \
             FROM idempotency_keys WHERE tenant = ?1 AND key = ?2 AND state = 'started'",
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
            "SELECT lock_version FROM idempotency_keys WHERE tenant = ?1 AND key = ?2",
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
        let result = sqlx::query(
            "UPDATE idempotency_keys \
             SET locked_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000 \
             WHERE tenant = ?1 AND key = ?2 AND state = 'started' AND lock_version = ?3 \
               AND CAST(locked_until AS TEXT) IS ?4",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(lock_version)
        .bind(locked_until)
        .execute(&self.0)
        .await;
        matches!(&result, Ok(done) if done.rows_affected() == 1)
    }

    async fn expire_key(
        &self,
        tenant: &TenantId,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Option<String> {
        let connection = self.0.acquire().await.ok()?;
        idemflow_sqlite::expire_key(connection, tenant.as_str(), key, lock_version, state)
            .await
            .ok()
            .and_then(|(deleted, _connection)| deleted)
    }

    async fn end_lease(&self, tenant: &TenantId, key: &str, locked_until: Option<&str>) -> bool {
        // What `idemflow end-lease` runs (the store's statements), with the look inside the
        // same write transaction, so no owner's write lands between the look and the end.
        let Ok(connection) = self.0.acquire().await else {
            return false;
        };
        let Ok(mut transaction) = idemflow_sqlite::Transaction::begin(connection).await else {
            return false;
        };
        let unchanged: Result<Option<i64>, _> = sqlx::query_scalar(
            "SELECT lock_version FROM idempotency_keys \
             WHERE tenant = ?1 AND key = ?2 AND CAST(locked_until AS TEXT) IS ?3",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(locked_until)
        .fetch_optional(transaction.connection())
        .await;
        let Ok(Some(seen)) = unchanged else {
            return false;
        };
        let Ok(token) = sqlx::query_scalar::<_, i64>(statements::NEXT_FENCE)
            .fetch_one(transaction.connection())
            .await
        else {
            return false;
        };
        let ended: Result<Option<i64>, _> = sqlx::query_scalar(statements::END_LEASE)
            .bind(tenant.as_str())
            .bind(key)
            .bind(seen)
            .bind(token)
            .fetch_optional(transaction.connection())
            .await;
        matches!(ended, Ok(Some(_))) && transaction.commit().await.is_ok()
    }

    async fn done_within(&self, tenant: &TenantId, window: Duration) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT key FROM idempotency_keys WHERE tenant = ?1 AND state = 'done' \
               AND finished_at > CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?2 + 60000",
        )
        .bind(tenant.as_str())
        .bind(i64::try_from(window.as_millis()).unwrap_or(i64::MAX))
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn present(&self, tenant: &TenantId) -> HashSet<String> {
        sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE tenant = ?1")
            .bind(tenant.as_str())
            .fetch_all(&self.0)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect()
    }

    async fn time_jump(&self, tenant: &TenantId, hours: i64) -> bool {
        // A body stored apart names its life by its claim's token, not a time: nothing else moves.
        sqlx::query(
            "UPDATE idempotency_keys SET created_at = created_at - ?2, \
                    updated_at = updated_at - ?2, finished_at = finished_at - ?2 \
             WHERE tenant = ?1",
        )
        .bind(tenant.as_str())
        .bind(hours * 60 * 60 * 1000)
        .execute(&self.0)
        .await
        .is_ok()
    }

    async fn kill(&self, _offset: i64) -> bool {
        // No server, no connection of another process to kill: a process's death is the crash
        // points' business.
        false
    }

    async fn corrupt(&self, tenant: &TenantId, key: &str) -> bool {
        let corrupted = sqlx::query(
            "UPDATE idempotency_keys SET phase_output = '{\"amount\": \"a lot\"}' \
             WHERE tenant = ?1 AND key = ?2 AND recovery_point = 'price'",
        )
        .bind(tenant.as_str())
        .bind(key)
        .execute(&self.0)
        .await;
        matches!(&corrupted, Ok(done) if done.rows_affected() == 1)
    }

    async fn lapse(&self, tenant: &TenantId, key: &str) -> Lapse {
        let started = std::time::Instant::now();
        loop {
            let lapsed = sqlx::query(
                "UPDATE idempotency_keys \
                 SET locked_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 1000 \
                 WHERE tenant = ?1 AND key = ?2 AND state = 'started'",
            )
            .bind(tenant.as_str())
            .bind(key)
            .execute(&self.0)
            .await;
            match lapsed {
                Ok(_) => return Lapse::Done,
                Err(error) if is_busy(&error) && started.elapsed() < LAPSE_PATIENCE => {}
                Err(error) if is_busy(&error) => return Lapse::Stuck,
                Err(_) => return Lapse::Failed,
            }
        }
    }

    async fn stored(&self, tenant: &TenantId, key: &Key) -> Result<Option<Stored>, String> {
        let mut connection = self.0.acquire().await.map_err(|error| error.to_string())?;
        let found = match idemflow_sqlite::look_up(&mut connection, tenant, key)
            .await
            .map_err(|error| error.to_string())?
        {
            idemflow_sqlite::LookUp::Found(found) => found,
            idemflow_sqlite::LookUp::Absent => return Ok(None),
        };
        let mut response = found.response;
        if let (Some(response), Some(life)) = (response.as_mut(), found.body_apart) {
            response.body = idemflow_sqlite::response_apart(&mut connection, tenant, key, life)
                .await
                .map_err(|error| error.to_string())?
                .ok_or("the body stored apart is gone")?;
        }
        let request: Option<Json<Value>> = sqlx::query_scalar(
            "SELECT request FROM idempotency_keys WHERE tenant = ?1 AND key = ?2",
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
            request: request.map(|request| request.0),
        }))
    }

    async fn effect_rows(&self, tenant: &TenantId) -> Vec<super::EffectRow> {
        sqlx::query_as(
            "SELECT key, life, phase, lock_version, claimed_at FROM sim_effects WHERE tenant = ?1",
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
             WHERE tenant = ?1 AND key = ?2 AND life = ?3 AND phase = ?4 \
               AND (NOT ?5 OR claimed_at = (SELECT CAST(created_at AS TEXT) \
                                            FROM idempotency_keys \
                                            WHERE tenant = ?1 AND key = ?2))",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(life)
        .bind(phase)
        .bind(per_claim)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn ledger_twice(&self, prefix: &str) -> Vec<(String, i64)> {
        sqlx::query_as(
            "SELECT message_id, count(*) FROM sim_ledger WHERE message_id LIKE ?1 \
             GROUP BY message_id HAVING count(*) > 1",
        )
        .bind(prefix)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn ledger_disagreeing(&self, prefix: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT message_id FROM sim_ledger WHERE message_id LIKE ?1 \
               AND message_id NOT IN (SELECT message_id FROM processed_messages \
                                      WHERE subscriber = 'sim-ledger') \
             UNION \
             SELECT message_id FROM processed_messages \
             WHERE subscriber = 'sim-ledger' AND message_id LIKE ?1 \
               AND message_id NOT IN (SELECT message_id FROM sim_ledger)",
        )
        .bind(prefix)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn transactions_left_open(&self) -> i64 {
        // A transaction left open on a pooled connection holds the one write lock: whether the
        // observer can take it says whether one is.
        let Ok(mut connection) = self.0.acquire().await else {
            return 0;
        };
        match sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut *connection)
            .await
        {
            Ok(_) => {
                let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *connection).await;
                0
            }
            Err(error) if is_busy(&error) => 1,
            Err(_) => 0,
        }
    }
}

/// SQLite's `SQLITE_BUSY` (5) or `SQLITE_LOCKED` (6), in any of their extended forms.
fn is_busy(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error)
        if error.code().and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| matches!(code & 0xff, 5 | 6)))
}
