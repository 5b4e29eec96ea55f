use std::time::Duration;

use idemflow_pg as store;
use sqlx::PgPool;

use crate::error::RunError;

/// How long finished keys are kept, and how they are deleted.
///
/// Retention is how long a retry is still recognised as the same request: a client retrying
/// after its key was deleted runs the request again. Keep it longer than the longest retry
/// horizon of your clients (an offline mobile client may retry the next day).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Finished keys created longer ago than this are deleted. Default 24 hours.
    pub keep_for: Duration,
    /// Rows deleted per statement (and so per transaction): short locks, bounded WAL bursts.
    pub batch_size: i64,
    /// How often a worker runs it.
    pub every: Duration,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            keep_for: Duration::from_secs(24 * 60 * 60),
            batch_size: 1000,
            every: Duration::from_secs(60),
        }
    }
}

/// Deletes every finished key created more than `older_than` ago, `batch_size` rows per
/// transaction, until none is left; returns how many. Started keys are never deleted.
pub async fn expire(pool: &PgPool, older_than: Duration, batch_size: i64) -> Result<u64, RunError> {
    let batch_size = batch_size.max(1);
    let mut total = 0;
    loop {
        let mut connection = pool.acquire().await?;
        let deleted = store::expire_batch(&mut connection, older_than, batch_size).await?;
        total += deleted;
        if deleted < u64::try_from(batch_size).unwrap_or(u64::MAX) {
            if total > 0 {
                tracing::info!(deleted = total, "retention expired finished keys");
            }
            metrics::counter!("idemflow_expired_total").increment(total);
            return Ok(total);
        }
    }
}
