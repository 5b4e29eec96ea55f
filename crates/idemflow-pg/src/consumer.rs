//! The consumer's statements on PostgreSQL ([`ConsumerStore`]), on `processed_messages` only.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{ConsumerStore, EngineError, Limits, SqlEngine};
use sqlx::PgPool;

use crate::millis::millis;
use crate::{PgStore, Transaction};

#[async_trait]
impl ConsumerStore for PgStore {
    /// The engine's transaction, not sqlx's: dropped while its BEGIN is in flight (a timeout
    /// around the call, a shutdown's select!), it closes the connection rather than hand it back
    /// to a shared pool inside the transaction. And it states READ COMMITTED, which the
    /// duplicate's check needs (a fresh snapshot per statement).
    async fn begin_delivery(
        pool: &PgPool,
        wait_limit: Option<Duration>,
    ) -> Result<Transaction, EngineError> {
        let limits = Limits::default().with_lock_timeout(wait_limit);
        let connection = pool.acquire().await.map_err(PgStore::engine_error)?;
        Transaction::begin_limited(connection, &limits)
            .await
            .map_err(PgStore::engine_error)
    }

    async fn insert_identity(
        transaction: &mut Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, EngineError> {
        let inserted = sqlx::query(
            "INSERT INTO processed_messages (subscriber, message_id, fingerprint) \
             VALUES ($1, $2, $3) ON CONFLICT (subscriber, message_id) DO NOTHING",
        )
        .bind(subscriber)
        .bind(message_id)
        .bind(fingerprint)
        .execute(&mut **transaction)
        .await;
        match inserted {
            Ok(done) => Ok(done.rows_affected() == 1),
            // lock_not_available: the wait limit passed behind another delivery's identity.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("55P03") => {
                Err(EngineError::Busy)
            }
            Err(error) => Err(PgStore::engine_error(error)),
        }
    }

    async fn stored_fingerprint(
        transaction: &mut Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        sqlx::query_scalar(
            "SELECT fingerprint FROM processed_messages \
             WHERE subscriber = $1 AND message_id = $2",
        )
        .bind(subscriber)
        .bind(message_id)
        .fetch_optional(&mut **transaction)
        .await
        .map_err(PgStore::engine_error)
    }

    /// The oldest are chosen through the `processed_at` index and deleted by primary key;
    /// `SKIP LOCKED` lets two workers' retention runs split the rows instead of queueing on each
    /// other. A delivery that found a record this deletes before it could read it inserts again
    /// (the consumer loops).
    async fn expire_identities(
        pool: &PgPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let result = sqlx::query(
            "DELETE FROM processed_messages AS processed USING ( \
                 SELECT subscriber, message_id FROM processed_messages \
                 WHERE processed_at < now() - $1::bigint * interval '1 millisecond' \
                 ORDER BY processed_at \
                 LIMIT $2 \
                 FOR UPDATE SKIP LOCKED \
             ) AS old \
             WHERE processed.subscriber = old.subscriber AND processed.message_id = old.message_id",
        )
        .bind(millis(older_than))
        .bind(batch)
        .execute(pool)
        .await
        .map_err(PgStore::engine_error)?;
        Ok(result.rows_affected())
    }
}
