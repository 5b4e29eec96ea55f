//! [`ConsumerStore`]: what the idempotent consumer (`idemflow-consumer`) asks of a SQL engine,
//! on `processed_messages` only (never the keys table): a delivery's transaction, its identity
//! inserted first, the stored fingerprint, and retention's batches. Each SQL engine's crate
//! implements it with its own statements.

use std::time::Duration;

use async_trait::async_trait;

use crate::engine::{PoolOf, SqlEngine};
use crate::error::EngineError;

/// An engine the consumer runs on.
#[async_trait]
pub trait ConsumerStore: SqlEngine {
    /// Begins a delivery's write transaction; `wait_limit` bounds lock waits where the engine
    /// can (PostgreSQL's `lock_timeout`; SQLite waits up to its busy timeout, InnoDB up to the
    /// session's lock wait timeout).
    async fn begin_delivery(
        pool: &PoolOf<Self>,
        wait_limit: Option<Duration>,
    ) -> Result<Self::Transaction, EngineError>;

    /// Inserts the identity; false when it was there already. A second delivery of the message
    /// in flight makes this wait behind the first's uncommitted identity; past the wait limit
    /// it is [`EngineError::Busy`].
    async fn insert_identity(
        transaction: &mut Self::Transaction,
        subscriber: &str,
        message_id: &str,
        fingerprint: &[u8],
    ) -> Result<bool, EngineError>;

    /// The fingerprint stored with the identity, read in a statement of its own (a fresh
    /// snapshot, which sees an identity committed after the transaction began).
    async fn stored_fingerprint(
        transaction: &mut Self::Transaction,
        subscriber: &str,
        message_id: &str,
    ) -> Result<Option<Vec<u8>>, EngineError>;

    /// Deletes up to `batch` identities applied more than `older_than` ago; how many.
    async fn expire_identities(
        pool: &PoolOf<Self>,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError>;
}
