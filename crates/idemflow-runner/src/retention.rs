use std::time::Duration;

use crate::engine::{Engine, EnginePool, PoolOf};
use idemflow_store::layout::Maintained;

use crate::error::RunError;

/// How long finished keys are kept, and how they are deleted.
///
/// Retention is how long a retry is still recognised as the same request: a client retrying
/// after its key was deleted runs the request again. Keep it longer than the longest retry
/// horizon of your clients (an offline mobile client may retry the next day).
///
/// A [`crate::Resumer`] runs it (the default one unless [`crate::ResumerConfig::retention`] says
/// otherwise); a job of your own may run it once:
///
/// ```no_run
/// # async fn example<E: idemflow_runner::Engine>(pool: E::Pool) -> Result<(), idemflow_runner::RunError> {
/// use std::time::Duration;
/// use idemflow_runner::{ResumerConfig, Retention};
///
/// // Keep finished keys for a week.
/// let retention = Retention::default().with_keep_for(Duration::from_secs(7 * 24 * 60 * 60));
/// let config = ResumerConfig::default().with_retention(Some(retention));
/// // Or once, now:
/// let deleted = retention.expire::<E>(&pool).await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Retention {
    /// Finished keys whose response was stored longer ago than this are deleted. Default 24
    /// hours.
    pub keep_for: Duration,
    /// Rows deleted per statement (and so per transaction): short locks, bounded WAL bursts.
    /// Default 500.
    pub batch_size: i64,
    /// At most this many rows deleted per second: batches are spaced out so the requests
    /// running meanwhile get the CPU and the WAL between them. `None` runs batches back to back
    /// (as fast as the database goes). Default 20,000 rows/s: a day of 1,000,000 keys expires
    /// in under a minute, and requests keep their latency (docs/benchmarks.md, the retention workload).
    pub max_rows_per_second: Option<u32>,
    /// How often a worker runs it. Default 60 s.
    pub every: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep_for: Duration::from_secs(24 * 60 * 60),
            batch_size: 500,
            max_rows_per_second: Some(20_000),
            every: Duration::from_secs(60),
        }
    }
}

impl Retention {
    /// Deletes every key finished longer ago than `keep_for`, in batches, at most
    /// `max_rows_per_second`; returns how many. What a worker runs every `every`.
    ///
    /// On PostgreSQL's partitioned layout (`idemflow_pg::partitions`) it maintains the partitions instead:
    /// creates those due ahead of the clock and drops those whose every key is past `keep_for`
    /// (no row is deleted one by one), and returns the keys dropped with them. That needs the
    /// rights of the table's owner (docs/operations.md, "Partitioned expiry").
    pub async fn expire<E: Engine>(&self, pool: &impl EnginePool<E>) -> Result<u64, RunError> {
        self.expire_on::<E>(pool.as_pool()).await
    }

    /// [`Retention::expire`] on engine `E`'s pool, named through the engine: what code generic
    /// over `E: SqlEngine` calls (there the pool's type is `sqlx::Pool<E::Database>`, which the
    /// compiler does not see as `E`'s pool).
    pub async fn expire_on<E: Engine>(&self, pool: &PoolOf<E>) -> Result<u64, RunError> {
        if let Some(maintained) = E::maintain_layout(pool, self.keep_for).await? {
            return Ok(record_layout(&maintained));
        }
        paced::<E>(
            pool,
            self.keep_for,
            self.batch_size,
            self.max_rows_per_second,
        )
        .await
    }
}

/// Deletes every key finished more than `older_than` ago, `batch_size` rows per
/// transaction, back to back until none is left; returns how many. Started keys are never
/// deleted. For a one-off clean-up (the CLI's `expire`); a worker paces it ([`Retention`]).
pub async fn expire<E: Engine>(
    pool: &impl EnginePool<E>,
    older_than: Duration,
    batch_size: i64,
) -> Result<u64, RunError> {
    expire_paced(pool, older_than, batch_size, None).await
}

/// As [`expire`], with batches spaced so that at most `max_rows_per_second` rows go per second.
pub async fn expire_paced<E: Engine>(
    pool: &impl EnginePool<E>,
    older_than: Duration,
    batch_size: i64,
    max_rows_per_second: Option<u32>,
) -> Result<u64, RunError> {
    paced::<E>(pool.as_pool(), older_than, batch_size, max_rows_per_second).await
}

/// A layout maintenance run in the logs and the metrics: each partition dropped, created or kept,
/// and the keys expired with what was dropped.
fn record_layout(maintained: &Maintained) -> u64 {
    if maintained.skipped {
        return 0;
    }
    let keys: u64 = maintained.dropped.iter().map(|dropped| dropped.keys).sum();
    for dropped in &maintained.dropped {
        tracing::info!(
            partition = %dropped.name,
            keys = dropped.keys,
            bodies_apart = dropped.bodies_apart,
            "retention dropped a partition of expired keys"
        );
    }
    for created in &maintained.created {
        tracing::info!(partition = %created, "retention created a partition ahead");
    }
    for kept in &maintained.kept {
        // Past the window and still holding started keys: nobody finished them. Alert on it.
        tracing::warn!(
            partition = %kept.name,
            started_keys = kept.started_keys,
            "a partition past the retention window is kept: it holds started keys"
        );
    }
    metrics::counter!("idemflow_expired_total").increment(keys);
    metrics::counter!("idemflow_partitions_dropped_total")
        .increment(maintained.dropped.len() as u64);
    metrics::gauge!("idemflow_partitions_kept_for_started_keys").set(maintained.kept.len() as f64);
    metrics::gauge!("idemflow_partitions_ahead").set(f64::from(maintained.ahead));
    keys
}

async fn paced<E: Engine>(
    pool: &PoolOf<E>,
    older_than: Duration,
    batch_size: i64,
    max_rows_per_second: Option<u32>,
) -> Result<u64, RunError> {
    let total = idemflow_store::retention::paced(batch_size, max_rows_per_second, |batch| {
        E::expire_batch(pool, older_than, batch)
    })
    .await?;
    if total > 0 {
        tracing::info!(deleted = total, "retention expired finished keys");
    }
    metrics::counter!("idemflow_expired_total").increment(total);
    Ok(total)
}

idemflow_core::with_setters! {
    Retention {
        with_keep_for => keep_for: Duration,
        with_batch_size => batch_size: i64,
        with_max_rows_per_second => max_rows_per_second: Option<u32>,
        with_every => every: Duration,
    }
}
