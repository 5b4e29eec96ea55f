use std::time::{Duration, Instant};

use crate::engine::{Engine, PoolEngine, PoolOf};

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
/// # async fn example(pool: idemflow_runner::PgPool) -> Result<(), idemflow_runner::RunError> {
/// use std::time::Duration;
/// use idemflow_runner::{ResumerConfig, Retention};
///
/// // Keep finished keys for a week.
/// let retention = Retention::default().with_keep_for(Duration::from_secs(7 * 24 * 60 * 60));
/// let config = ResumerConfig::default().with_retention(Some(retention));
/// // Or once, now:
/// let deleted = retention.expire(&pool).await?;
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
    /// On the partitioned layout ([`idemflow_pg::partitions`]) it maintains the partitions instead:
    /// creates those due ahead of the clock and drops those whose every key is past `keep_for`
    /// (no row is deleted one by one), and returns the keys dropped with them. That needs the
    /// rights of the table's owner (docs/operations.md, "Partitioned expiry").
    pub async fn expire<P: PoolEngine>(&self, pool: &P) -> Result<u64, RunError> {
        self.expire_on::<P::Engine>(pool).await
    }

    /// [`Retention::expire`] on engine `E`.
    pub(crate) async fn expire_on<E: Engine>(&self, pool: &PoolOf<E>) -> Result<u64, RunError> {
        if let Some(dropped) = E::maintain_layout(pool, self.keep_for).await? {
            return Ok(dropped);
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
pub async fn expire<P: PoolEngine>(
    pool: &P,
    older_than: Duration,
    batch_size: i64,
) -> Result<u64, RunError> {
    expire_paced(pool, older_than, batch_size, None).await
}

/// As [`expire`], with batches spaced so that at most `max_rows_per_second` rows go per second.
pub async fn expire_paced<P: PoolEngine>(
    pool: &P,
    older_than: Duration,
    batch_size: i64,
    max_rows_per_second: Option<u32>,
) -> Result<u64, RunError> {
    paced::<P::Engine>(pool, older_than, batch_size, max_rows_per_second).await
}

async fn paced<E: Engine>(
    pool: &PoolOf<E>,
    older_than: Duration,
    batch_size: i64,
    max_rows_per_second: Option<u32>,
) -> Result<u64, RunError> {
    let batch_size = batch_size.max(1);
    let rate = max_rows_per_second.filter(|&rate| rate > 0).map(f64::from);
    let began = Instant::now();
    let mut total = 0;
    loop {
        let deleted = E::expire_batch(pool, older_than, batch_size).await?;
        total += deleted;
        if deleted < u64::try_from(batch_size).unwrap_or(u64::MAX) {
            if total > 0 {
                tracing::info!(deleted = total, "retention expired finished keys");
            }
            metrics::counter!("idemflow_expired_total").increment(total);
            return Ok(total);
        }
        // Paced against the whole run's schedule (not batch by batch), so the timer's rounding
        // of each short sleep does not add up: the rate holds at the limit.
        if let Some(rate) = rate {
            let due = began + Duration::from_secs_f64(total as f64 / rate);
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

idemflow_core::with_setters! {
    Retention {
        with_keep_for => keep_for: Duration,
        with_batch_size => batch_size: i64,
        with_max_rows_per_second => max_rows_per_second: Option<u32>,
        with_every => every: Duration,
    }
}
