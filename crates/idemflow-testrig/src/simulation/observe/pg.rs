//! The schedule's reads and chaos on PostgreSQL.

use std::collections::HashSet;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, TenantId};
use serde_json::Value;
use sqlx::PgPool;
use sqlx::types::Json;

use super::{CallerView, Lapse, Observe, SampledRow, Stored};
use crate::server_log::{ServerLog, lost_claims};

/// The observer's pool on the schedule's layout (its own connections, never killed).
pub(crate) struct PgObserver(pub PgPool);

#[async_trait]
impl Observe for PgObserver {
    fn engine(&self) -> &'static str {
        "postgres"
    }

    fn clock_resolution(&self) -> f64 {
        // Microseconds, both ways: a millisecond for the rounding.
        0.001
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
            "SELECT key, state, lock_version, locked_until::text, recovery_point, \
                    created_at::text, request, \
                    state = 'started' AND locked_until <= now() \
             FROM idempotency_keys WHERE tenant = $1",
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
            "SELECT lock_version, state, recovery_point, locked_until > clock_timestamp(), \
                    request \
             FROM idempotency_keys WHERE tenant = $1 AND key = $2",
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
            "SELECT extract(epoch FROM locked_until)::float8, lock_version \
             FROM idempotency_keys WHERE tenant = $1 AND key = $2 AND state = 'started'",
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
            "SELECT lock_version FROM idempotency_keys WHERE tenant = $1 AND key = $2",
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
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' \
             WHERE (tenant, key) IN ( \
                 SELECT tenant, key FROM idempotency_keys \
                 WHERE tenant = $1 AND key = $2 AND state = 'started' AND lock_version = $3 \
                   AND locked_until::text IS NOT DISTINCT FROM $4 \
                 FOR UPDATE SKIP LOCKED)",
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
        let mut connection = self.0.acquire().await.ok()?;
        idemflow_pg::expire_key(&mut connection, tenant.as_str(), key, lock_version, state)
            .await
            .ok()
            .flatten()
    }

    async fn end_lease(&self, tenant: &TenantId, key: &str, locked_until: Option<&str>) -> bool {
        let Ok(mut tx) = self.0.begin().await else {
            return false;
        };
        // Held while ending the lease, so no owner's write lands between the look and the end.
        let unchanged: Result<Option<i64>, _> = sqlx::query_scalar(
            "SELECT lock_version FROM idempotency_keys \
             WHERE tenant = $1 AND key = $2 AND locked_until::text IS NOT DISTINCT FROM $3 \
             FOR UPDATE SKIP LOCKED",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(locked_until)
        .fetch_optional(&mut *tx)
        .await;
        if let Ok(Some(token)) = unchanged
            && let Ok(Some(_)) = idemflow_pg::end_lease(&mut tx, tenant.as_str(), key, token).await
        {
            return tx.commit().await.is_ok();
        }
        false
    }

    async fn done_within(&self, tenant: &TenantId, window: Duration) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT key FROM idempotency_keys WHERE tenant = $1 AND state = 'done' \
               AND finished_at > now() - $2::bigint * interval '1 millisecond' + interval '1 minute'",
        )
        .bind(tenant.as_str())
        .bind(i64::try_from(window.as_millis()).unwrap_or(i64::MAX))
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn present(&self, tenant: &TenantId) -> HashSet<String> {
        sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE tenant = $1")
            .bind(tenant.as_str())
            .fetch_all(&self.0)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect()
    }

    async fn time_jump(&self, tenant: &TenantId, hours: i64) -> bool {
        // A body stored apart names its key's life by the key's creation time: it moves with it.
        sqlx::query(
            "WITH moved AS ( \
                 UPDATE idempotency_keys SET created_at = created_at - $2::interval, \
                        updated_at = updated_at - $2::interval, \
                        finished_at = finished_at - $2::interval \
                 WHERE (tenant, key) IN (SELECT tenant, key FROM idempotency_keys \
                                         WHERE tenant = $1 FOR UPDATE SKIP LOCKED) \
                 RETURNING tenant, key, created_at + $2::interval AS was) \
             UPDATE idempotency_responses AS apart SET created_at = apart.created_at - $2::interval \
             FROM moved \
             WHERE apart.tenant = moved.tenant AND apart.key = moved.key \
               AND apart.created_at = moved.was",
        )
        .bind(tenant.as_str())
        .bind(format!("{hours} hours"))
        .execute(&self.0)
        .await
        .is_ok()
    }

    async fn kill(&self, offset: i64) -> bool {
        // The victim is chosen in a subquery: with `ORDER BY … OFFSET` in the same query level,
        // the planner evaluates the output list above the sort but below the limit, so
        // `pg_terminate_backend` would run on every row the offset skips as well.
        let killed: Result<Option<bool>, _> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM ( \
                 SELECT pid FROM pg_stat_activity \
                 WHERE application_name = $1 AND datname = current_database() \
                 ORDER BY pid OFFSET $2 LIMIT 1) victim",
        )
        .bind(crate::simulation::ENGINE_APPLICATION)
        .bind(offset)
        .fetch_optional(&self.0)
        .await;
        matches!(killed, Ok(Some(true)))
    }

    async fn corrupt(&self, tenant: &TenantId, key: &str) -> bool {
        let corrupted = sqlx::query(
            "UPDATE idempotency_keys SET phase_output = '{\"amount\": \"a lot\"}' \
             WHERE (tenant, key) IN (SELECT tenant, key FROM idempotency_keys \
                 WHERE tenant = $1 AND key = $2 AND recovery_point = 'price' \
                 FOR UPDATE SKIP LOCKED)",
        )
        .bind(tenant.as_str())
        .bind(key)
        .execute(&self.0)
        .await;
        matches!(&corrupted, Ok(done) if done.rows_affected() == 1)
    }

    async fn lapse(&self, tenant: &TenantId, key: &str) -> Lapse {
        let lapsed = sqlx::query(
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' \
             WHERE tenant = $1 AND key = $2 AND state = 'started'",
        )
        .bind(tenant.as_str())
        .bind(key)
        .execute(&self.0)
        .await;
        match lapsed {
            Ok(_) => Lapse::Done,
            // The observer's lock_timeout.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("55P03") => {
                Lapse::Stuck
            }
            Err(_) => Lapse::Failed,
        }
    }

    async fn stored(&self, tenant: &TenantId, key: &Key) -> Result<Option<Stored>, String> {
        let mut connection = self.0.acquire().await.map_err(|error| error.to_string())?;
        let row = idemflow_pg::inspect(&mut connection, tenant, key)
            .await
            .map_err(|error| error.to_string())?;
        let request: Option<Json<Value>> = sqlx::query_scalar(
            "SELECT request FROM idempotency_keys WHERE tenant = $1 AND key = $2",
        )
        .bind(tenant.as_str())
        .bind(key.as_str())
        .fetch_optional(&mut *connection)
        .await
        .ok()
        .flatten();
        Ok(row.map(|row| Stored {
            response: row.response,
            lock_version: row.lock_version,
            request: request.map(|request| request.0),
        }))
    }

    async fn effect_rows(&self, tenant: &TenantId) -> Vec<super::EffectRow> {
        sqlx::query_as(
            "SELECT key, life, phase, lock_version, claimed_at FROM sim_effects WHERE tenant = $1",
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
             WHERE tenant = $1 AND key = $2 AND life = $3 AND phase = $4 \
               AND (NOT $5 OR claimed_at = (SELECT created_at::text FROM idempotency_keys \
                                           WHERE tenant = $1 AND key = $2))",
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
            "SELECT message_id, count(*) FROM sim_ledger WHERE message_id LIKE $1 \
             GROUP BY message_id HAVING count(*) > 1",
        )
        .bind(prefix)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn ledger_disagreeing(&self, prefix: &str) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT coalesce(ledger.message_id, processed.message_id) \
             FROM (SELECT DISTINCT message_id FROM sim_ledger WHERE message_id LIKE $1) AS ledger \
             FULL JOIN (SELECT message_id FROM processed_messages \
                        WHERE subscriber = 'sim-ledger' AND message_id LIKE $1) AS processed \
               ON ledger.message_id = processed.message_id \
             WHERE ledger.message_id IS NULL OR processed.message_id IS NULL",
        )
        .bind(prefix)
        .fetch_all(&self.0)
        .await
        .unwrap_or_default()
    }

    async fn server_log_start(&self) -> Option<Result<ServerLog, String>> {
        Some(ServerLog::from_now(&self.0).await)
    }

    async fn lost_claims_logged(
        &self,
        tenant: &TenantId,
        start: &ServerLog,
    ) -> Result<Vec<String>, String> {
        let log = start.since(&self.0).await?;
        Ok(lost_claims(
            &log,
            &idemflow_core::hex::encode(tenant.as_str().as_bytes()),
        ))
    }

    async fn transactions_left_open(&self) -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND application_name = $1 \
               AND state LIKE 'idle in transaction%'",
        )
        .bind(crate::simulation::ENGINE_APPLICATION)
        .fetch_one(&self.0)
        .await
        .unwrap_or(0_i64)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::str::FromStr;

    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use sqlx::{Connection, PgConnection};

    use super::{Observe, PgObserver};
    use crate::simulation::ENGINE_APPLICATION;

    /// The world counts one kill per kill it draws, and its checks lean on that count: a kill
    /// that ended more sessions than it counted would let the others' ends pass for ordinary
    /// failures. The statement must end exactly one session, whatever offset it draws.
    #[tokio::test]
    async fn a_kill_ends_exactly_one_engine_session_whatever_its_offset() {
        let url = std::env::var("DATABASE_URL")
            .expect("DATABASE_URL names the PostgreSQL server the tests run on");
        let mut admin = PgConnection::connect(&url).await.unwrap();
        let database = format!("idemflow_observer_kill_{}", std::process::id());
        let drop = format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)");
        for statement in [drop.clone(), format!("CREATE DATABASE {database}")] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                .execute(&mut admin)
                .await
                .unwrap();
        }
        let options = PgConnectOptions::from_str(&url)
            .unwrap()
            .database(&database);

        let mut sessions = Vec::new();
        for _ in 0..6 {
            let engine = options.clone().application_name(ENGINE_APPLICATION);
            sessions.push(PgConnection::connect_with(&engine).await.unwrap());
        }
        let observer = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .unwrap();
        assert!(PgObserver(observer.clone()).kill(3).await);
        observer.close().await;

        let mut ended = 0;
        for session in &mut sessions {
            if sqlx::query("SELECT 1")
                .execute(&mut *session)
                .await
                .is_err()
            {
                ended += 1;
            }
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&mut admin)
            .await
            .unwrap();
        assert_eq!(ended, 1, "one kill, one session ended");
    }
}
