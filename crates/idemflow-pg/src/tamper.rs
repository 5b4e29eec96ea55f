//! [`Tamper`] on PostgreSQL: tests' writes behind the protocol's back.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{EngineError, SqlEngine, Tamper};
use sqlx::PgPool;

use crate::PgStore;
use crate::millis::millis;

#[async_trait]
impl Tamper for PgStore {
    async fn lapse_leases(pool: &PgPool, only: Option<(&str, &str)>) -> Result<(), EngineError> {
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 day' \
             WHERE state = 'started' AND ($1::text IS NULL OR (tenant = $1 AND key = $2))",
        )
        .bind(only.map(|(tenant, _)| tenant))
        .bind(only.map(|(_, key)| key))
        .execute(pool)
        .await
        .map_err(PgStore::engine_error)?;
        Ok(())
    }

    async fn age_finished(pool: &PgPool, by: Duration) -> Result<(), EngineError> {
        sqlx::query(
            "UPDATE idempotency_keys SET finished_at = finished_at - $1 * interval '1 millisecond' \
             WHERE state = 'done'",
        )
        .bind(millis(by))
        .execute(pool)
        .await
        .map_err(PgStore::engine_error)?;
        Ok(())
    }

    /// jsonb holds only valid JSON: an object where a list of entries belongs.
    async fn damage_journals(pool: &PgPool) -> Result<(), EngineError> {
        sqlx::query(r#"UPDATE idempotency_keys SET journal = '{"not": "a journal"}'"#)
            .execute(pool)
            .await
            .map_err(PgStore::engine_error)?;
        Ok(())
    }
}
