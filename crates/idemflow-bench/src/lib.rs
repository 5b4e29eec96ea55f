//! idemflow-bench: measures idemflow the way its users judge it — requests per second, latency,
//! commits and round trips per request — against a raw sqlx baseline (the same statements with
//! no engine) and pgbench (the same statements from C) run in the same invocation, on a scratch
//! database of its own. See docs/benchmarks.md.
//!
//! Each workload is a module of its own, listed with its name, what it measures, how it runs and
//! how it is judged in one registry (`workloads::WORKLOADS`, in run order); [`run`] runs the ones
//! the configuration selects. The binary is a thin shell over [`run`]; the CI smoke test calls
//! [`run`] with [`Config::quick`].

// The workloads, one module each (their run order is `workloads::WORKLOADS`).
mod checkout;
mod drain;
mod fleet;
mod http;
mod large_responses;
mod local_only;
pub mod mariadb;
mod mass_crash;
mod partitioned;
mod pgbench;
mod provider_storm;
pub mod redis;
mod replay;
mod retention;
mod sqlite;
mod storm;
mod transfers;
mod wire;

// What they share.
mod config;
mod db;
mod load;
mod machine;
mod processes;
mod raw;
pub mod report;
mod requests;
mod sqlite_runner;
mod timed;
mod wire_counts;
mod workflows;
mod workloads;

use std::time::Instant;

pub use config::Config;
pub use db::ServerCounts;
pub use load::LatencySummary;
pub use report::Report;
pub use sqlite_runner::{CHILD as SQLITE_CHILD, child as sqlite_child};
pub use wire_counts::WireCount;
pub use workloads::catalogue;

/// Any failure: the benchmark stops at the first one (a run with failed requests means nothing).
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// The commits and engine round trips per request that docs/protocol.md documents and
/// tests/it/round_trips.rs asserts, phase statements included (one per local phase here):
/// (commits, round trips).
pub const DOCUMENTED_CHECKOUT: (u64, u64) = (2, 7 + 2);
pub const DOCUMENTED_LOCAL_ONLY: (u64, u64) = (1, 4 + 1);
pub const DOCUMENTED_REPLAY: (u64, u64) = (0, 1);

/// Runs the workloads `config` selects against a scratch database on `config.database_url`,
/// which is dropped at the end whatever happens.
pub async fn run(config: &Config) -> Result<Report, Error> {
    let started = Instant::now();
    let load_start = machine::load_average();
    let scratch = db::Scratch::create(&config.database_url).await?;
    eprintln!("idemflow-bench: scratch database {}", scratch.name);
    let result = workloads::all(config, &scratch).await;
    let dropped = scratch.drop_database().await;
    let mut report = result?;
    dropped?;
    report.machine.load_average_start = load_start;
    report.machine.load_average_end = machine::load_average();
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}
