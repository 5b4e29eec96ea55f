//! The consumer's statements on each engine: the delivery's transaction, its identity inserted
//! first (a second delivery in flight waits behind it: PostgreSQL and MySQL on the row, SQLite
//! on the write lock), the stored fingerprint read when the identity was there, and retention.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_pg::Limits;
use idemflow_runner::{EngineError, MySqlStore, PgStore, PoolOf, SqlEngine, SqliteStore};

use crate::consumer::ConsumerError;

/// An engine the consumer runs on: [`PgStore`] (the default), [`SqliteStore`] or [`MySqlStore`].
#[async_trait]
pub trait ConsumerStore: SqlEngine {
    /// Begins a delivery's write transaction; `wait_limit` bounds lock waits where the engine
    /// can (PostgreSQL's `lock_timeout`; SQLite waits up to its busy timeout).
    async fn begin_delivery(
        pool: &PoolOf<Self>,
        wait_limit: Option<Duration>,
    ) -> Result<Self::Transaction, ConsumerError>;

    /// Inserts the identity; false when it was there already.
    async fn insert_identity(
        transaction: &mut Self::Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, ConsumerError>;

    /// The fingerprint stored with the identity, read in a statement of its own.
    async fn stored_fingerprint(
        transaction: &mut Self::Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, ConsumerError>;

    /// Deletes up to `batch` identities applied more than `older_than` ago; how many.
    async fn expire_identities(
        pool: &PoolOf<Self>,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error>;
}

/// A store error as the consumer reports it.
pub(crate) fn consumer_error(error: EngineError, message_id: &str) -> ConsumerError {
    match error {
        EngineError::Busy => ConsumerError::HeldElsewhere(message_id.to_owned()),
        EngineError::Database(error) => ConsumerError::Database(error),
        other => ConsumerError::Database(sqlx::Error::Protocol(other.to_string())),
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

#[async_trait]
impl ConsumerStore for PgStore {
    /// The engine's transaction, not sqlx's: dropped while its BEGIN is in flight (a timeout
    /// around the call, a shutdown's select!), it closes the connection rather than hand it back
    /// to a shared pool inside the transaction. And it states READ COMMITTED, which the
    /// duplicate's check needs (a fresh snapshot per statement).
    async fn begin_delivery(
        pool: &sqlx::PgPool,
        wait_limit: Option<Duration>,
    ) -> Result<idemflow_pg::Transaction, ConsumerError> {
        let limits = Limits::default().with_lock_timeout(wait_limit);
        Ok(idemflow_pg::Transaction::begin_limited(pool.acquire().await?, &limits).await?)
    }

    async fn insert_identity(
        transaction: &mut idemflow_pg::Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, ConsumerError> {
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
                Err(ConsumerError::HeldElsewhere(message_id.to_owned()))
            }
            Err(error) => Err(error.into()),
        }
    }

    async fn stored_fingerprint(
        transaction: &mut idemflow_pg::Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, ConsumerError> {
        Ok(sqlx::query_scalar(
            "SELECT fingerprint FROM processed_messages \
             WHERE subscriber = $1 AND message_id = $2",
        )
        .bind(subscriber)
        .bind(message_id)
        .fetch_optional(&mut **transaction)
        .await?)
    }

    async fn expire_identities(
        pool: &sqlx::PgPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let mut connection = pool.acquire().await?;
        crate::retention::expire_processed_batch(&mut connection, older_than, batch).await
    }
}

#[async_trait]
impl ConsumerStore for SqliteStore {
    /// `BEGIN IMMEDIATE`: the write lock first, so a second delivery of the message waits here
    /// (up to the busy timeout) and then finds the first one's identity.
    async fn begin_delivery(
        pool: &sqlx::SqlitePool,
        _wait_limit: Option<Duration>,
    ) -> Result<idemflow_sqlite::Transaction, ConsumerError> {
        idemflow_sqlite::Transaction::begin(pool.acquire().await?)
            .await
            .map_err(|error| consumer_error(error.into(), "(any)"))
    }

    async fn insert_identity(
        transaction: &mut idemflow_sqlite::Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, ConsumerError> {
        let inserted = sqlx::query(
            "INSERT INTO processed_messages (subscriber, message_id, fingerprint, processed_at) \
             VALUES (?1, ?2, ?3, CAST(unixepoch('subsec') * 1000 AS INTEGER)) \
             ON CONFLICT (subscriber, message_id) DO NOTHING",
        )
        .bind(subscriber)
        .bind(message_id)
        .bind(fingerprint)
        .execute(transaction.connection())
        .await?;
        Ok(inserted.rows_affected() == 1)
    }

    async fn stored_fingerprint(
        transaction: &mut idemflow_sqlite::Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, ConsumerError> {
        Ok(sqlx::query_scalar(
            "SELECT fingerprint FROM processed_messages \
             WHERE subscriber = ?1 AND message_id = ?2",
        )
        .bind(subscriber)
        .bind(message_id)
        .fetch_optional(transaction.connection())
        .await?)
    }

    async fn expire_identities(
        pool: &sqlx::SqlitePool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let deleted = sqlx::query(
            "DELETE FROM processed_messages WHERE (subscriber, message_id) IN ( \
                 SELECT subscriber, message_id FROM processed_messages \
                 WHERE processed_at < CAST(unixepoch('subsec') * 1000 AS INTEGER) - ?1 \
                 ORDER BY processed_at LIMIT ?2)",
        )
        .bind(millis(older_than))
        .bind(batch)
        .execute(pool)
        .await?;
        Ok(deleted.rows_affected())
    }
}

#[async_trait]
impl ConsumerStore for MySqlStore {
    /// A plain transaction: a second delivery of the message waits at its identity's insert, on
    /// the first one's row, up to the session's lock wait timeout (`wait_limit` is not applied:
    /// InnoDB's wait is set per session, in whole seconds, when the pool's connections open).
    async fn begin_delivery(
        pool: &sqlx::MySqlPool,
        _wait_limit: Option<Duration>,
    ) -> Result<idemflow_mysql::Transaction, ConsumerError> {
        idemflow_mysql::Transaction::begin(pool.acquire().await?)
            .await
            .map_err(|error| consumer_error(error.into(), "(any)"))
    }

    /// A duplicate key (1062) is the answer "applied already": the statement is undone, the
    /// transaction goes on. (`INSERT IGNORE` would also hide errors that are not duplicates.)
    async fn insert_identity(
        transaction: &mut idemflow_mysql::Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, ConsumerError> {
        let inserted = sqlx::query(idemflow_mysql::statements::INSERT_IDENTITY)
            .bind(subscriber)
            .bind(message_id)
            .bind(fingerprint)
            .execute(transaction.connection())
            .await;
        match inserted {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(error))
                if error
                    .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                    .is_some_and(|error| error.number() == 1062) =>
            {
                Ok(false)
            }
            Err(error) => Err(consumer_error(
                idemflow_mysql::StoreError::from(error).into(),
                message_id,
            )),
        }
    }

    async fn stored_fingerprint(
        transaction: &mut idemflow_mysql::Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, ConsumerError> {
        Ok(
            sqlx::query_scalar(idemflow_mysql::statements::STORED_FINGERPRINT)
                .bind(subscriber)
                .bind(message_id)
                .fetch_optional(transaction.connection())
                .await?,
        )
    }

    async fn expire_identities(
        pool: &sqlx::MySqlPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, sqlx::Error> {
        let deleted = sqlx::query(idemflow_mysql::statements::EXPIRE_IDENTITIES)
            .bind(millis(older_than))
            .bind(batch)
            .execute(pool)
            .await?;
        Ok(deleted.rows_affected())
    }
}
