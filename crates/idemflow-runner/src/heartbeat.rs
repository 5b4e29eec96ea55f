//! Keeping an owner's lease alive while its phase runs, and the grace a phase gets past its time
//! limit.
//!
//! A lease must outlast the work done under it, or a resumer takes the key over while its owner
//! still runs. Phases may run longer than a lease (a slow provider), so the owner renews every
//! third of the lease; a renewal that finds the token changed means another owner has the key,
//! and the work is dropped at once rather than allowed to commit or call out as a stale owner.

use std::future::Future;
use std::time::Duration;

use crate::deadline::Within;
use crate::engine::{ConnectionPool, Engine, EngineError, PoolOf};
use crate::error::RunError;
use crate::runner::Runner;

impl<E: Engine> Runner<E> {
    /// Runs `work`, renewing the owner's lease every third of it while `work` runs. If a renewal
    /// finds the lease lost (fenced), `work` is dropped and `Fenced` returned: an owner that lost
    /// its lease stops and commits nothing.
    pub(crate) async fn with_heartbeat<T>(
        &self,
        enabled: bool,
        owner: &E::Owner,
        lease: Duration,
        work: impl Future<Output = T>,
    ) -> Result<T, RunError> {
        if !enabled {
            return Ok(work.await);
        }
        tokio::select! {
            biased;
            output = work => Ok(output),
            lost = heartbeat::<E>(&self.pool, owner, lease, self.config.database_timeout) => Err(lost),
        }
    }
}

/// How far past its time limit a local phase may run before the runner stops it. The database
/// cancels a statement at the limit itself (`statement_timeout`), a clean error the phase sees;
/// the runner's own stop, a little later, covers a phase stuck outside the database.
pub(crate) fn overrun_grace(limit: Duration) -> Duration {
    (limit / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
}

/// Renews the lease every third of it until a renewal is fenced; returns that.
async fn heartbeat<E: Engine>(
    pool: &PoolOf<E>,
    owner: &E::Owner,
    lease: Duration,
    wait: Duration,
) -> RunError {
    let interval = lease / 3;
    loop {
        tokio::time::sleep(interval).await;
        let renewal = async {
            let mut connection = pool.acquire().await?;
            E::renew_lease(&mut connection, owner, lease).await
        };
        // A renewal the database does not answer is a failed one: the next tries again.
        let renewed = match renewal.within(wait.min(interval)).await {
            Ok(renewed) => renewed,
            Err(timeout) => {
                tracing::warn!(%timeout, "lease renewal failed");
                continue;
            }
        };
        match renewed {
            Ok(()) => tracing::debug!("lease renewed"),
            Err(EngineError::Fenced) => {
                tracing::warn!("lease lost while a phase ran: stopping it");
                return RunError::Fenced;
            }
            // The phase goes on; the next renewal tries again, and the fence still protects.
            Err(error) => tracing::warn!(%error, "lease renewal failed"),
        }
    }
}
