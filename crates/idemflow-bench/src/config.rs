//! What one invocation measures, and how long: the full run, the quick smoke test, and `--only`.

use std::time::Duration;

use crate::workloads::{self, WORKLOADS};

/// What one invocation measures, and how long.
#[derive(Debug, Clone)]
pub struct Config {
    /// The server to measure: a scratch database is created on it, used and dropped.
    pub database_url: String,
    /// The MariaDB (or MySQL) server of the mariadb workload: `MARIADB_URL`, else root at
    /// 127.0.0.1:3306.
    pub mariadb_url: String,
    /// The Redis server the redis workload runs on (under a prefix of its own).
    pub redis_url: String,
    /// The Redis Cluster the redis workload's cluster rows run on: its nodes' URLs,
    /// comma-separated (`REDIS_CLUSTER_URLS`, as scripts/lib/redis-cluster.sh exports them);
    /// `None`: the cluster rows are not run, and the report says so.
    pub redis_cluster_urls: Option<String>,
    /// Tiny counts for CI (a smoke test): only the counts are meant to be read.
    pub quick: bool,
    /// Concurrent clients for the checkout, local-only, replay, http and pgbench workloads (and
    /// the sqlite, mariadb and redis workloads' runs).
    pub clients: Vec<usize>,
    /// Each timed run, after its warm-up.
    pub duration: Duration,
    /// Requests before each timed run on the same pool (connections opened, statements prepared).
    pub warm_up: Duration,
    /// Run pgbench where it is installed.
    pub pgbench: bool,
    /// Finished keys seeded for the replay workloads.
    pub replay_keys: u64,
    /// The storm workload: clients, keys per round, rounds.
    pub storm_clients: usize,
    pub storm_keys: usize,
    pub storm_rounds: usize,
    /// The drain workload: keys left at a recovery point, and the numbers of resumers draining
    /// them.
    pub drain_keys: u64,
    pub drain_resumers: Vec<usize>,
    /// The retention workload: finished keys to delete, the batch size, and the checkout
    /// workload's clients meanwhile.
    pub retention_rows: u64,
    pub retention_batch: i64,
    pub retention_clients: usize,
    /// The wire workload: requests counted per variant (after a warm-up).
    pub wire_requests: u64,
    /// The provider-storm workload (the duplicate storm through the mock provider): keys, sends
    /// per key, clients.
    pub provider_storm_keys: usize,
    pub provider_storm_duplicates: usize,
    pub provider_storm_clients: usize,
    /// The mass-crash workload: checkout `serve` processes, keys sent to them (spread over the
    /// ramp), the ramp, and the numbers of `worker` processes that recover them (a run each).
    pub crash_serves: usize,
    pub crash_keys: usize,
    pub crash_ramp: Duration,
    pub crash_workers: Vec<usize>,
    /// The fleet workload: serve and worker processes of the fleet, its keys, its HTTP clients.
    pub fleet_serves: usize,
    pub fleet_workers: usize,
    pub fleet_requests: usize,
    pub fleet_clients: usize,
    /// The partitioned-expiry workload: finished keys expired by each variant (the retention
    /// workload's clients run meanwhile), the numbers of live partitions whose look-up and claim
    /// are measured against the unpartitioned table, and the clients of those runs.
    pub partitioned_keys: u64,
    pub partition_counts: Vec<usize>,
    pub partitioned_clients: usize,
    /// Only these workloads run (`--only`), by name; `None`: all of them.
    pub only: Option<Vec<&'static str>>,
}

impl Config {
    /// The full run documented in docs/benchmarks.md.
    pub fn full(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
            mariadb_url: std::env::var("MARIADB_URL")
                .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned()),
            redis_url: std::env::var("REDIS_URL")
                .unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned()),
            redis_cluster_urls: std::env::var("REDIS_CLUSTER_URLS")
                .ok()
                .filter(|urls| !urls.trim().is_empty()),
            quick: false,
            clients: vec![1, 8, 32, 64],
            duration: Duration::from_secs(5),
            warm_up: Duration::from_millis(500),
            pgbench: true,
            replay_keys: 10_000,
            storm_clients: 64,
            storm_keys: 4,
            storm_rounds: 50,
            drain_keys: 10_000,
            drain_resumers: vec![1, 2, 4],
            retention_rows: 1_000_000,
            retention_batch: 1000,
            retention_clients: 8,
            wire_requests: 20,
            provider_storm_keys: 1000,
            provider_storm_duplicates: 20,
            provider_storm_clients: 50,
            crash_serves: 2,
            crash_keys: 2200,
            crash_ramp: Duration::from_secs(2),
            crash_workers: vec![1, 2, 4],
            fleet_serves: 4,
            fleet_workers: 4,
            fleet_requests: 10_000,
            fleet_clients: 64,
            partitioned_keys: 1_000_000,
            partition_counts: vec![2, 8, 31],
            partitioned_clients: 32,
            only: None,
        }
    }

    /// The CI smoke test: every workload with tiny counts, clients 1 and 8, no pgbench.
    pub fn quick(database_url: impl Into<String>) -> Self {
        Self {
            quick: true,
            clients: vec![1, 8],
            duration: Duration::from_millis(300),
            warm_up: Duration::from_millis(50),
            pgbench: false,
            replay_keys: 500,
            storm_clients: 8,
            storm_keys: 2,
            storm_rounds: 3,
            drain_keys: 300,
            retention_rows: 20_000,
            wire_requests: 10,
            provider_storm_keys: 40,
            provider_storm_duplicates: 5,
            provider_storm_clients: 8,
            crash_keys: 60,
            crash_ramp: Duration::from_millis(200),
            crash_workers: vec![1],
            fleet_serves: 2,
            fleet_workers: 2,
            fleet_requests: 60,
            fleet_clients: 8,
            partitioned_keys: 20_000,
            partitioned_clients: 8,
            ..Self::full(database_url)
        }
    }

    /// Limits the run to the named workloads: by name (`provider-storm`), or by the number its
    /// report identifiers start with (`8`, `8-provider-storm`).
    pub fn select(&mut self, names: &[String]) -> Result<(), String> {
        let mut chosen = Vec::new();
        for name in names
            .iter()
            .map(|name| name.trim())
            .filter(|name| !name.is_empty())
        {
            let Some(workload) = workloads::find(name) else {
                let known: Vec<&str> = WORKLOADS.iter().map(|workload| workload.name).collect();
                return Err(format!(
                    "--only {name}: no such workload; one of {}",
                    known.join(", ")
                ));
            };
            chosen.push(workload.name);
        }
        if chosen.is_empty() {
            return Err("--only names no workload".to_owned());
        }
        self.only = Some(chosen);
        Ok(())
    }

    /// Whether a workload runs, by its name (`checkout`, `mass-crash`, ...).
    pub fn runs(&self, workload: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.contains(&workload))
    }

    /// The client count the targets are judged at: 32 when measured, else the largest.
    pub fn reference_clients(&self) -> usize {
        if self.clients.contains(&32) {
            32
        } else {
            self.clients.iter().copied().max().unwrap_or(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Config;

    #[test]
    fn only_takes_names() {
        let mut config = Config::quick("postgres://localhost/x");
        let names = [
            "checkout",
            " provider-storm",
            "partitioned-expiry",
            "pgbench",
        ];
        assert_eq!(config.select(&names.map(str::to_owned)), Ok(()));
        assert_eq!(
            config.only.as_deref(),
            Some(
                &[
                    "checkout",
                    "provider-storm",
                    "partitioned-expiry",
                    "pgbench"
                ][..]
            )
        );
        assert!(config.runs("partitioned-expiry") && !config.runs("replay"));
        assert!(config.select(&["provider".to_owned()]).is_err());
    }

    #[test]
    fn only_takes_numbers_and_report_identifiers() {
        let mut config = Config::quick("postgres://localhost/x");
        assert!(config.runs("checkout") && config.runs("mass-crash"));
        let names = ["8-provider-storm", " 9", "wire"].map(str::to_owned);
        assert_eq!(config.select(&names), Ok(()));
        assert_eq!(
            config.only.as_deref(),
            Some(&["provider-storm", "mass-crash", "wire"][..])
        );
        assert!(config.runs("provider-storm") && !config.runs("checkout"));
        assert!(config.select(&["16".to_owned()]).is_err());
        assert_eq!(config.select(&["15".to_owned()]), Ok(()));
        assert!(config.runs("redis") && !config.runs("mariadb"));
        assert_eq!(config.select(&["14".to_owned()]), Ok(()));
        assert!(config.runs("mariadb") && !config.runs("sqlite"));
        assert_eq!(config.select(&["13".to_owned()]), Ok(()));
        assert!(config.runs("sqlite") && !config.runs("checkout"));
        assert_eq!(config.select(&["12".to_owned()]), Ok(()));
        assert!(config.runs("partitioned-expiry") && !config.runs("fleet"));
        assert_eq!(config.select(&["10".to_owned()]), Ok(()));
        assert!(config.runs("large-responses") && !config.runs("mass-crash"));
        assert!(config.select(&["9-storm".to_owned()]).is_err());
        assert!(config.select(&[String::new()]).is_err());
    }
}
