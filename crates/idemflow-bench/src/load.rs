//! Closed-loop load: N tokio tasks, each sending its next request as soon as the last one
//! answered, with every latency kept (sorted samples, no histogram approximation).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::Error;

/// When the clients stop.
#[derive(Debug, Clone)]
pub enum Until {
    Elapsed(Duration),
    /// Until the flag is set (by a concurrent job).
    Flag(Arc<AtomicBool>),
}

impl Until {
    fn done(&self, started: Instant) -> bool {
        match self {
            Self::Elapsed(duration) => started.elapsed() >= *duration,
            Self::Flag(flag) => flag.load(Ordering::Acquire),
        }
    }
}

/// Latencies of one run, in microseconds, sorted.
#[derive(Debug, Clone, Default)]
pub struct Latencies(Vec<u32>);

impl Latencies {
    pub fn from_unsorted(mut micros: Vec<u32>) -> Self {
        micros.sort_unstable();
        Self(micros)
    }

    /// All samples of several runs.
    pub fn merge<'a>(parts: impl IntoIterator<Item = &'a Latencies>) -> Self {
        Self::from_unsorted(
            parts
                .into_iter()
                .flat_map(|part| part.0.iter().copied())
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The nearest-rank percentile, in milliseconds.
    pub fn percentile_ms(&self, percentile: f64) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let rank = ((percentile / 100.0) * self.0.len() as f64).ceil() as usize;
        let index = rank.clamp(1, self.0.len()) - 1;
        Some(f64::from(self.0[index]) / 1000.0)
    }

    pub fn mean_ms(&self) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let sum: u64 = self.0.iter().map(|&micros| u64::from(micros)).sum();
        Some(sum as f64 / self.0.len() as f64 / 1000.0)
    }

    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            samples: self.0.len(),
            mean_ms: self.mean_ms(),
            p50_ms: self.percentile_ms(50.0),
            p95_ms: self.percentile_ms(95.0),
            p99_ms: self.percentile_ms(99.0),
            max_ms: self.percentile_ms(100.0),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LatencySummary {
    pub samples: usize,
    pub mean_ms: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub max_ms: Option<f64>,
}

/// What a closed-loop run measured.
#[derive(Debug, Clone)]
pub struct Measured {
    pub requests: u64,
    pub elapsed: Duration,
    /// Whole requests.
    pub latencies: Latencies,
    /// The part the operation reported separately (the claim), where it did.
    pub inner: Latencies,
}

impl Measured {
    pub fn per_second(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn micros(duration: Duration) -> u32 {
    u32::try_from(duration.as_micros()).unwrap_or(u32::MAX)
}

/// Runs `clients` tasks until `until`; each calls `op(client, sequence)` in a loop. The
/// operation may return a second duration (measured inside it) to be summarised apart. The
/// first error stops the run and is returned: a benchmark with failed requests means nothing.
pub async fn closed_loop<F, Fut>(clients: usize, until: Until, op: F) -> Result<Measured, Error>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Option<Duration>, Error>> + Send + 'static,
{
    let op = Arc::new(op);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients.max(1) {
        let op = op.clone();
        let until = until.clone();
        tasks.spawn(async move {
            let mut whole = Vec::with_capacity(4096);
            let mut inner = Vec::new();
            let mut sequence = 0_u64;
            while !until.done(started) {
                let sent = Instant::now();
                let part = op(client, sequence).await?;
                whole.push(micros(sent.elapsed()));
                if let Some(part) = part {
                    inner.push(micros(part));
                }
                sequence += 1;
            }
            Ok::<_, Error>((whole, inner))
        });
    }
    let mut whole = Vec::new();
    let mut inner = Vec::new();
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok((task_whole, task_inner))) => {
                whole.extend(task_whole);
                inner.extend(task_inner);
            }
            Ok(Err(error)) => {
                failure.get_or_insert(error);
                if let Until::Flag(flag) = &until {
                    flag.store(true, Ordering::Release);
                }
                tasks.abort_all();
            }
            Err(join) if join.is_cancelled() => {}
            Err(join) => {
                failure.get_or_insert_with(|| format!("a client task failed: {join}").into());
            }
        }
    }
    if let Some(error) = failure {
        return Err(error);
    }
    let elapsed = started.elapsed();
    Ok(Measured {
        requests: whole.len() as u64,
        elapsed,
        latencies: Latencies::from_unsorted(whole),
        inner: Latencies::from_unsorted(inner),
    })
}

/// CPU time this process has used (user + system), from /proc/self/stat; `None` where that is
/// not readable. Resolution: one clock tick (10 ms at the usual 100 Hz).
pub fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name may hold spaces; the fields after its closing parenthesis are fixed.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(
        ticks as f64 / CLOCK_TICKS_PER_SECOND,
    ))
}

/// `sysconf(_SC_CLK_TCK)`: 100 on Linux for every architecture that matters here.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;
