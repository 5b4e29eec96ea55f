//! Timed runs: one operation (a request) sent by closed-loop clients on a fresh pool, after a
//! warm-up, with the server's counters read over the run; and several variants interleaved
//! A B C C B A, each for half the duration, so the drift over an invocation falls on each alike.

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::Error;
use crate::db::{Mark, ServerCounts};
use crate::load::{Latencies, Measured, Until, closed_loop, process_cpu};
use crate::report::Run;
use crate::workloads::{BoxFuture, Ctx};

/// One request of a workload: `(client, sequence)` → the request's claim time, if it has one.
pub(crate) type Op = Arc<dyn Fn(usize, u64) -> BoxFuture<'static, Option<Duration>> + Send + Sync>;

/// Takes one timed sample of `variant` of `workload` at `clients` clients for `duration`:
/// `sampler(ctx, workload, variant, clients, duration)`.
pub(crate) type Sampler =
    for<'a> fn(&'a Ctx<'a>, &'static str, &'static str, usize, Duration) -> BoxFuture<'a, Sample>;

/// Sequence numbers of warm-up requests start here, so their keys never meet the measured ones.
const WARM_UP_SEQUENCE: u64 = 1 << 40;

pub(crate) async fn run_loop(clients: usize, until: Until, op: &Op) -> Result<Measured, Error> {
    let op = op.clone();
    closed_loop(clients, until, move |client, sequence| op(client, sequence)).await
}

/// One timed run: its measurements, and the server's counters over it (warm-up included).
pub(crate) struct Sample {
    measured: Measured,
    /// This process's CPU time during the measured part.
    cpu: Option<Duration>,
    requests_with_warm_up: u64,
    server: ServerCounts,
}

/// Warm-up, then the timed run, on a pool opened after `mark`; closes the pool and reads the
/// server's counters.
pub(crate) async fn timed(
    ctx: &Ctx<'_>,
    clients: usize,
    duration: Duration,
    pool: PgPool,
    mark: Mark,
    op: Op,
) -> Result<Sample, Error> {
    let warm_op: Op = {
        let op = op.clone();
        Arc::new(move |client, sequence| op(client, sequence + WARM_UP_SEQUENCE))
    };
    let warm = run_loop(clients, Until::Elapsed(ctx.config.warm_up), &warm_op).await?;
    let cpu_before = process_cpu();
    let measured = run_loop(clients, Until::Elapsed(duration), &op).await?;
    let cpu = process_cpu()
        .zip(cpu_before)
        .map(|(after, before)| after.saturating_sub(before));
    pool.close().await;
    let requests_with_warm_up = warm.requests + measured.requests;
    let server = ctx.scratch.since(mark, requests_with_warm_up).await?;
    Ok(Sample {
        measured,
        cpu,
        requests_with_warm_up,
        server,
    })
}

/// Runs each variant of `plan` twice for half the duration, in the order given and then
/// reversed (A B C C B A), so drift over the invocation (the table grows, autovacuum, other load
/// on the machine) falls on every variant alike; each variant's two halves are merged.
pub(crate) async fn interleaved(
    ctx: &Ctx<'_>,
    clients: usize,
    plan: &[(&'static str, &'static str)],
    sampler: Sampler,
) -> Result<Vec<Run>, Error> {
    let half = ctx.config.duration / 2;
    let mut samples: Vec<Vec<Sample>> = plan.iter().map(|_| Vec::new()).collect();
    for index in (0..plan.len()).chain((0..plan.len()).rev()) {
        let (workload, variant) = plan[index];
        samples[index].push(sampler(ctx, workload, variant, clients, half).await?);
    }
    let mut runs = Vec::new();
    for (&(workload, variant), halves) in plan.iter().zip(samples) {
        let run = merged(workload, variant, clients, &halves);
        progress(&run);
        runs.push(run);
    }
    Ok(runs)
}

/// One variant's row from its halves: requests and time summed, latencies merged, the server's
/// counts weighted by each half's requests, and how far apart the halves' rates were.
fn merged(workload: &str, variant: &str, clients: usize, samples: &[Sample]) -> Run {
    let requests: u64 = samples.iter().map(|sample| sample.measured.requests).sum();
    let elapsed: Duration = samples.iter().map(|sample| sample.measured.elapsed).sum();
    let with_warm_up: u64 = samples.iter().map(|s| s.requests_with_warm_up).sum();
    let weighted = |value: &dyn Fn(&Sample) -> Option<f64>| {
        samples
            .iter()
            .map(|s| value(s).map(|v| v * s.requests_with_warm_up as f64))
            .sum::<Option<f64>>()
            .map(|total| total / with_warm_up.max(1) as f64)
    };
    let server = ServerCounts {
        commits_per_request: weighted(&|s| Some(s.server.commits_per_request)).unwrap_or(0.0),
        statements_per_request: weighted(&|s| s.server.statements_per_request),
    };
    let measured = Measured {
        requests,
        elapsed,
        latencies: Latencies::merge(samples.iter().map(|s| &s.measured.latencies)),
        inner: Latencies::merge(samples.iter().map(|s| &s.measured.inner)),
    };
    let rates: Vec<f64> = samples.iter().map(|s| s.measured.per_second()).collect();
    let cpu: Option<Duration> = samples.iter().map(|s| s.cpu).sum();
    let mut run = run_row(workload, variant, clients, &measured, Some(server));
    run.client_cpu_us_per_request = cpu.map(|cpu| cpu.as_secs_f64() * 1e6 / requests.max(1) as f64);
    if let [a, b] = rates[..] {
        run.spread = Some((a - b).abs() / ((a + b) / 2.0).max(1e-9));
    }
    run
}

/// A row of the runs table from one measurement.
pub(crate) fn run_row(
    workload: &str,
    variant: &str,
    clients: usize,
    measured: &Measured,
    server: Option<ServerCounts>,
) -> Run {
    Run {
        workload: workload.to_owned(),
        variant: variant.to_owned(),
        clients,
        requests: measured.requests,
        seconds: measured.elapsed.as_secs_f64(),
        per_second: measured.per_second(),
        latency: measured.latencies.summary(),
        claim: (!measured.inner.is_empty()).then(|| measured.inner.summary()),
        server,
        spread: None,
        client_cpu_us_per_request: None,
    }
}

/// A row as it is measured, on stderr.
pub(crate) fn progress(run: &Run) {
    eprintln!(
        "  {:<16} {:<33} {:>3} clients: {:>8.0}/s  p50 {:.2} ms  p99 {:.2} ms",
        run.workload,
        run.variant,
        run.clients,
        run.per_second,
        run.latency.p50_ms.or(run.latency.mean_ms).unwrap_or(0.0),
        run.latency.p99_ms.unwrap_or(0.0),
    );
}
