use std::time::Duration;

/// What one invocation measures, and how long.
#[derive(Debug, Clone)]
pub struct Config {
    /// The server to measure: a scratch database is created on it, used and dropped.
    pub database_url: String,
    /// Tiny counts for CI (a smoke test): only the counts are meant to be read.
    pub quick: bool,
    /// Concurrent clients for workloads 1, 2, 3 and 7 (and pgbench).
    pub clients: Vec<usize>,
    /// Each timed run, after its warm-up.
    pub duration: Duration,
    /// Requests before each timed run on the same pool (connections opened, statements prepared).
    pub warm_up: Duration,
    /// Run pgbench where it is installed.
    pub pgbench: bool,
    /// Finished keys seeded for the replay workloads.
    pub replay_keys: u64,
    /// Workload 4: clients, keys per round, rounds.
    pub storm_clients: usize,
    pub storm_keys: usize,
    pub storm_rounds: usize,
    /// Workload 5: keys left at a recovery point, and the numbers of resumers draining them.
    pub drain_keys: u64,
    pub drain_resumers: Vec<usize>,
    /// Workload 6: finished keys to delete, the batch size, and workload 1's clients meanwhile.
    pub retention_rows: u64,
    pub retention_batch: i64,
    pub retention_clients: usize,
    /// Requests counted on the wire per workload (after a warm-up).
    pub wire_requests: u64,
}

impl Config {
    /// The full run documented in docs/benchmarks.md.
    pub fn full(database_url: impl Into<String>) -> Self {
        Self {
            database_url: database_url.into(),
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
            ..Self::full(database_url)
        }
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
