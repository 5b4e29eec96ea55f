//! The consumer's statements on MySQL/MariaDB ([`ConsumerStore`]), on `processed_messages` only.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{ConsumerStore, EngineError};
use sqlx::MySqlPool;

use crate::error::{DUPLICATE_KEY, error_number};
use crate::statements::{EXPIRE_IDENTITIES, INSERT_IDENTITY, STORED_FINGERPRINT};
use crate::{MySqlStore, StoreError, Transaction};

#[async_trait]
impl ConsumerStore for MySqlStore {
    /// A plain transaction: a second delivery of the message waits at its identity's insert, on
    /// the first one's row, up to the session's lock wait timeout (`wait_limit` is not applied:
    /// InnoDB's wait is set per session, in whole seconds, when the pool's connections open).
    async fn begin_delivery(
        pool: &MySqlPool,
        _wait_limit: Option<Duration>,
    ) -> Result<Transaction, EngineError> {
        let connection = pool.acquire().await.map_err(StoreError::from)?;
        Ok(Transaction::begin(connection).await?)
    }

    /// A duplicate key (1062) is the answer "applied already": the statement is undone, the
    /// transaction goes on. (`INSERT IGNORE` would also hide errors that are not duplicates.)
    async fn insert_identity(
        transaction: &mut Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, EngineError> {
        let inserted = sqlx::query(INSERT_IDENTITY)
            .bind(subscriber)
            .bind(message_id)
            .bind(fingerprint)
            .execute(transaction.connection())
            .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(error) if error_number(&error) == Some(DUPLICATE_KEY) => Ok(false),
            Err(error) => Err(StoreError::from(error).into()),
        }
    }

    async fn stored_fingerprint(
        transaction: &mut Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(sqlx::query_scalar(STORED_FINGERPRINT)
            .bind(subscriber)
            .bind(message_id)
            .fetch_optional(transaction.connection())
            .await
            .map_err(StoreError::from)?)
    }

    async fn expire_identities(
        pool: &MySqlPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let millis = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let deleted = sqlx::query(EXPIRE_IDENTITIES)
            .bind(millis)
            .bind(batch)
            .execute(pool)
            .await
            .map_err(StoreError::from)?;
        Ok(deleted.rows_affected())
    }
}
