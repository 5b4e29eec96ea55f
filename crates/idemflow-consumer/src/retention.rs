//! Retention for processed messages: records older than a window are deleted in bounded batches,
//! as finished keys are.

use std::future::Future;
use std::time::Duration;

use idemflow_store::{ConsumerStore, EngineError, EnginePool};

use crate::metrics::EXPIRED;

/// How long processed-message records are kept, and how they are deleted.
///
/// The window is how long a redelivery is still recognised: a message delivered again after its
/// record was deleted is applied again. Keep it longer than any message can stay in the broker
/// (a queue's message TTL, a dead-letter queue replayed by hand days later) plus the publisher's
/// own retry horizon.
///
/// ```no_run
/// # async fn example(pool: sqlx::SqlitePool) -> Result<(), idemflow_store::EngineError> {
/// use std::time::Duration;
/// use idemflow_consumer::MessageRetention;
///
/// let retention = MessageRetention::default().with_keep_for(Duration::from_secs(3 * 24 * 60 * 60));
/// let deleted = retention.expire(&pool).await?;        // once, now
/// retention.run(&pool, std::future::pending()).await;  // or every `every`, until shutdown
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MessageRetention {
    /// Records of messages processed longer ago than this are deleted. Default 7 days: a record
    /// is small (its id, a 32-byte fingerprint, a time), and messages outlive requests' retries
    /// in queues and dead-letter queues.
    pub keep_for: Duration,
    /// Rows deleted per statement (and so per transaction): short locks, bounded WAL bursts.
    /// Default 500.
    pub batch_size: i64,
    /// At most this many rows deleted per second, so the deliveries processed meanwhile keep the
    /// CPU and the WAL. `None`: batches back to back. Default 20,000 rows/s.
    pub max_rows_per_second: Option<u32>,
    /// How often [`MessageRetention::run`] expires. Default 60 s.
    pub every: Duration,
}

impl Default for MessageRetention {
    fn default() -> Self {
        Self {
            keep_for: Duration::from_secs(7 * 24 * 60 * 60),
            batch_size: 500,
            max_rows_per_second: Some(20_000),
            every: Duration::from_secs(60),
        }
    }
}

impl MessageRetention {
    /// Deletes every record older than `keep_for`, in batches, at most `max_rows_per_second`;
    /// returns how many.
    pub async fn expire<E: ConsumerStore>(
        &self,
        pool: &impl EnginePool<E>,
    ) -> Result<u64, EngineError> {
        expire_processed(
            pool,
            self.keep_for,
            self.batch_size,
            self.max_rows_per_second,
        )
        .await
    }

    /// Expires now and then every `every` until `shutdown` completes. A failed run is logged and
    /// tried again at the next tick: retention is never urgent.
    pub async fn run<E: ConsumerStore>(
        &self,
        pool: &impl EnginePool<E>,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut ticks = tokio::time::interval(self.every.max(Duration::from_millis(1)));
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = ticks.tick() => {}
            }
            if let Err(error) = self.expire(pool).await {
                tracing::warn!(%error, "processed-message retention failed; trying again later");
            }
        }
    }
}

/// Deletes every record processed more than `older_than` ago, `batch_size` rows per
/// transaction, paced to at most `max_rows_per_second` (`None`: back to back); returns how many.
pub async fn expire_processed<E: ConsumerStore>(
    pool: &impl EnginePool<E>,
    older_than: Duration,
    batch_size: i64,
    max_rows_per_second: Option<u32>,
) -> Result<u64, EngineError> {
    let pool = pool.as_pool();
    let total = idemflow_store::retention::paced(batch_size, max_rows_per_second, |batch| {
        E::expire_identities(pool, older_than, batch)
    })
    .await?;
    if total > 0 {
        tracing::info!(deleted = total, "retention expired processed messages");
    }
    metrics::counter!(EXPIRED).increment(total);
    Ok(total)
}

idemflow_core::with_setters! {
    MessageRetention {
        with_keep_for => keep_for: Duration,
        with_batch_size => batch_size: i64,
        with_max_rows_per_second => max_rows_per_second: Option<u32>,
        with_every => every: Duration,
    }
}
