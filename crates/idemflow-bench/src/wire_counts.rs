//! Commits and round trips per request, counted on the wire: the single-client variant of a
//! workload runs through the testkit's counting proxy (a pool of one connection, no ping before
//! acquire), a few requests as warm-up (statements prepared), then a fixed number counted.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use idemflow_testrig::wire::{Counts, WireCounts, start_proxy};
use serde::Serialize;
use sqlx::PgPool;

use crate::Error;
use crate::db::Scratch;

/// What one request costs on the wire.
#[derive(Debug, Clone, Serialize)]
pub struct WireCount {
    pub workload: String,
    pub variant: String,
    /// Requests counted (after the warm-up).
    pub requests: u64,
    pub total_commits: u64,
    pub total_round_trips: u64,
    /// sqlx's pings (a bare Sync when a connection returns to the pool), counted apart.
    pub total_pings: u64,
    pub commits_per_request: f64,
    pub round_trips_per_request: f64,
    pub pings_per_request: f64,
    /// What docs/protocol.md and tests/it/round_trips.rs say, where they say it.
    pub expected_commits: Option<u64>,
    pub expected_round_trips: Option<u64>,
}

impl WireCount {
    /// Whether the counts are exactly the documented ones (true where nothing is documented).
    pub fn as_documented(&self) -> bool {
        self.expected_commits
            .is_none_or(|commits| self.total_commits == commits * self.requests)
            && self
                .expected_round_trips
                .is_none_or(|trips| self.total_round_trips == trips * self.requests)
    }
}

/// A pool of one connection through a fresh counting proxy.
pub async fn counted_pool(scratch: &Scratch) -> Result<(PgPool, Arc<WireCounts>), Error> {
    let upstream =
        tokio::net::lookup_host((scratch.connect.get_host(), scratch.connect.get_port()))
            .await?
            .next()
            .ok_or("the database host resolves to no address")?;
    let (port, counts) = start_proxy(upstream).await;
    let pool = scratch
        .pool_via(scratch.connect.clone().host("127.0.0.1").port(port))
        .await?;
    Ok((pool, counts))
}

/// Lets the background ping of the last released connection reach the proxy.
pub async fn settle() {
    tokio::time::sleep(Duration::from_millis(50)).await;
}

/// Runs `op(i)` `warm_up` times, then `requests` times counted.
#[allow(clippy::too_many_arguments)]
pub async fn count<F, Fut>(
    counts: &WireCounts,
    workload: &str,
    variant: &str,
    warm_up: u64,
    requests: u64,
    expected: Option<(u64, u64)>,
    mut op: F,
) -> Result<WireCount, Error>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<(), Error>>,
{
    for i in 0..warm_up {
        op(i).await?;
    }
    settle().await;
    let before = counts.snapshot();
    for i in warm_up..warm_up + requests {
        op(i).await?;
    }
    settle().await;
    let used: Counts = counts.snapshot() - before;
    let per = |total: u64| total as f64 / requests.max(1) as f64;
    Ok(WireCount {
        workload: workload.to_owned(),
        variant: variant.to_owned(),
        requests,
        total_commits: used.commits,
        total_round_trips: used.round_trips,
        total_pings: used.pings,
        commits_per_request: per(used.commits),
        round_trips_per_request: per(used.round_trips),
        pings_per_request: per(used.pings),
        expected_commits: expected.map(|(commits, _)| commits),
        expected_round_trips: expected.map(|(_, trips)| trips),
    })
}
