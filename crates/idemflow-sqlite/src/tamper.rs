//! [`Tamper`] on SQLite: tests' writes behind the protocol's back.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{EngineError, Tamper};
use sqlx::SqlitePool;

use crate::claim::millis;
use crate::{SqliteStore, StoreError};

#[async_trait]
impl Tamper for SqliteStore {
    async fn lapse_leases(
        pool: &SqlitePool,
        only: Option<(&str, &str)>,
    ) -> Result<(), EngineError> {
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = locked_until - 86400000 \
             WHERE state = 'started' AND (?1 IS NULL OR (tenant = ?1 AND key = ?2))",
        )
        .bind(only.map(|(tenant, _)| tenant))
        .bind(only.map(|(_, key)| key))
        .execute(pool)
        .await
        .map_err(StoreError::from)?;
        Ok(())
    }

    async fn age_finished(pool: &SqlitePool, by: Duration) -> Result<(), EngineError> {
        sqlx::query(
            "UPDATE idempotency_keys SET finished_at = finished_at - ?1 WHERE state = 'done'",
        )
        .bind(millis(by))
        .execute(pool)
        .await
        .map_err(StoreError::from)?;
        Ok(())
    }

    async fn damage_journals(pool: &SqlitePool) -> Result<(), EngineError> {
        sqlx::query("UPDATE idempotency_keys SET journal = '[{\"at\": oops'")
            .execute(pool)
            .await
            .map_err(StoreError::from)?;
        Ok(())
    }
}
