//! The consumer's statements on SQLite ([`ConsumerStore`]), on `processed_messages` only.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{ConsumerStore, EngineError};
use sqlx::SqlitePool;

use crate::claim::millis;
use crate::{SqliteStore, StoreError, Transaction};

#[async_trait]
impl ConsumerStore for SqliteStore {
    /// `BEGIN IMMEDIATE`: the write lock first, so a second delivery of the message waits here
    /// (up to the busy timeout) and then finds the first one's identity.
    async fn begin_delivery(
        pool: &SqlitePool,
        _wait_limit: Option<Duration>,
    ) -> Result<Transaction, EngineError> {
        let connection = pool.acquire().await.map_err(StoreError::from)?;
        Ok(Transaction::begin(connection).await?)
    }

    async fn insert_identity(
        transaction: &mut Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, EngineError> {
        let inserted = sqlx::query(
            "INSERT INTO processed_messages (subscriber, message_id, fingerprint, processed_at) \
             VALUES (?1, ?2, ?3, CAST(unixepoch('subsec') * 1000 AS INTEGER)) \
             ON CONFLICT (subscriber, message_id) DO NOTHING",
        )
        .bind(subscriber)
        .bind(message_id)
        .bind(fingerprint)
        .execute(transaction.connection())
        .await
        .map_err(StoreError::from)?;
        Ok(inserted.rows_affected() == 1)
    }

    async fn stored_fingerprint(
        transaction: &mut Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(sqlx::query_scalar(
            "SELECT fingerprint FROM processed_messages \
             WHERE subscriber = ?1 AND message_id = ?2",
        )
        .bind(subscriber)
        .bind(message_id)
        .fetch_optional(transaction.connection())
        .await
        .map_err(StoreError::from)?)
    }

    async fn expire_identities(
        pool: &SqlitePool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let deleted = sqlx::query(
            "DELETE FROM processed_messages WHERE (subscriber, message_id) IN ( \
                 SELECT subscriber, message_id FROM processed_messages \
                 WHERE processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1 \
                 ORDER BY processed_at LIMIT ?2)",
        )
        .bind(millis(older_than))
        .bind(batch)
        .execute(pool)
        .await
        .map_err(StoreError::from)?;
        Ok(deleted.rows_affected())
    }
}
