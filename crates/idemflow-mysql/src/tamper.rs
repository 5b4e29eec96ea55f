//! [`Tamper`] on MySQL/MariaDB: tests' writes behind the protocol's back.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{EngineError, Tamper};
use sqlx::MySqlPool;

use crate::{MySqlStore, StoreError};

#[async_trait]
impl Tamper for MySqlStore {
    async fn lapse_leases(pool: &MySqlPool, only: Option<(&str, &str)>) -> Result<(), EngineError> {
        let (tenant, key) = (only.map(|(tenant, _)| tenant), only.map(|(_, key)| key));
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = locked_until - 86400000 \
             WHERE state = 'started' AND (? IS NULL OR (tenant = ? AND `key` = ?))",
        )
        .bind(tenant)
        .bind(tenant)
        .bind(key)
        .execute(pool)
        .await
        .map_err(StoreError::from)?;
        Ok(())
    }

    async fn age_finished(pool: &MySqlPool, by: Duration) -> Result<(), EngineError> {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        sqlx::query(
            "UPDATE idempotency_keys SET finished_at = finished_at - ? WHERE state = 'done'",
        )
        .bind(by)
        .execute(pool)
        .await
        .map_err(StoreError::from)?;
        Ok(())
    }

    async fn damage_journals(pool: &MySqlPool) -> Result<(), EngineError> {
        sqlx::query("UPDATE idempotency_keys SET journal = '[{\"at\": oops'")
            .execute(pool)
            .await
            .map_err(StoreError::from)?;
        Ok(())
    }
}
