//! The retention workload: `retention_rows` finished keys two days old, deleted while the
//! checkout workload's requests run at `retention_clients` clients: by `idemflow::expire`
//! (batches of `retention_batch` back to back), then the same rows again by
//! `idemflow::expire_paced` (the engine's own pacing). Claim latency (request start → the first
//! local phase: look-up, BEGIN and the claim done) idle and during each.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemflow::Runner;
use sqlx::PgPool;

use crate::Error;
use crate::load::{Measured, Until};
use crate::report::{self, Paced, Report, Retention, Run, Target, ms, over, triple};
use crate::requests::{Engine, engine_op};
use crate::timed::{Op, run_loop, run_row};
use crate::workflows;
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "retention",
    number: Some(6),
    measures: "deleting finished keys while checkouts run: rows per second, claim latency",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

/// The paced variant: `expire_paced` with batches of 250 at most 60,000 rows/s (above the
/// 50,000 rows/s target, with short bursts so the requests in between keep their latency).
const PACED_ROWS_PER_SECOND: f64 = 60_000.0;
const PACED_BATCH: i64 = 250;

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        report.retention = Some(retention(ctx).await?);
        Ok(())
    })
}

/// The load measured idle, during `expire`, and during `expire_paced` (the rows seeded again).
async fn retention(ctx: &Ctx<'_>) -> Result<Retention, Error> {
    let config = ctx.config;
    let rows = config.retention_rows;
    let seed_seconds = seed_old_keys(ctx, rows).await?;
    let clients = config.retention_clients.max(1);
    let pool = ctx.scratch.pool(clients).await?;
    let engine = Engine {
        runner: Runner::new(pool.clone()),
        workflow: Arc::new(workflows::checkout(None)?),
        tenant: ctx.tenant.clone(),
    };
    let op = |name: &str| engine_op(engine.clone(), ctx.prefix(name), None);
    let (warm_op, idle_op) = (op("retention-warm"), op("retention-idle"));
    let (during_op, paced_op) = (op("retention-during"), op("retention-paced"));
    run_loop(clients, Until::Elapsed(config.warm_up), &warm_op).await?;
    let idle = run_loop(clients, Until::Elapsed(config.duration), &idle_op).await?;
    let (deleted, seconds, during) = under_retention(ctx, &during_op, clients, None).await?;
    // The same rows again, deleted by the engine's pacing instead of flat out.
    seed_old_keys(ctx, rows).await?;
    let budget = Some(PACED_ROWS_PER_SECOND);
    let paced = under_retention(ctx, &paced_op, clients, budget).await?;
    pool.close().await;
    let row = |variant: &str, measured: &Measured| {
        run_row(report::RETENTION, variant, clients, measured, None)
    };
    let retention = Retention {
        rows,
        batch: config.retention_batch,
        deleted,
        seconds,
        rows_per_second: deleted as f64 / seconds.max(1e-9),
        seed_seconds,
        idle: row("workload 1, idle", &idle),
        during: row("workload 1, during retention", &during),
        paced: Some(Paced {
            batch: PACED_BATCH,
            budget_rows_per_second: PACED_ROWS_PER_SECOND,
            deleted: paced.0,
            seconds: paced.1,
            rows_per_second: paced.0 as f64 / paced.1.max(1e-9),
            during: row("workload 1, during paced retention", &paced.2),
        }),
    };
    progress(&retention);
    Ok(retention)
}

/// Seeds `rows` finished keys created two days ago (`old-1` …); returns the seconds it took.
async fn seed_old_keys(ctx: &Ctx<'_>, rows: u64) -> Result<f64, Error> {
    let seeding = Instant::now();
    let chunk = 250_000;
    let mut first = 1;
    while first <= rows {
        let last = (first + chunk - 1).min(rows);
        ctx.seed_finished("old-", first, last, "2 days").await?;
        first = last + 1;
    }
    ctx.vacuum_keys().await?;
    let seconds = seeding.elapsed().as_secs_f64();
    eprintln!("  retention: {rows} finished keys seeded in {seconds:.1} s");
    Ok(seconds)
}

/// The engine's retention: `idemflow::expire` (batches of `batch` back to back), or, with a
/// budget, `idemflow::expire_paced` (batches of [`PACED_BATCH`], at most that many rows/s).
async fn delete_old_keys(pool: PgPool, batch: i64, budget: Option<f64>) -> Result<u64, Error> {
    let keep_for = Duration::from_secs(24 * 60 * 60);
    let Some(rows_per_second) = budget else {
        return Ok(idemflow::expire(&pool, keep_for, batch).await?);
    };
    let rate = u32::try_from(rows_per_second as u64).unwrap_or(u32::MAX);
    Ok(idemflow::expire_paced(&pool, keep_for, PACED_BATCH, Some(rate)).await?)
}

/// The checkout workload's requests while the old keys are deleted; returns (rows deleted,
/// seconds, the requests).
async fn under_retention(
    ctx: &Ctx<'_>,
    op: &Op,
    clients: usize,
    budget: Option<f64>,
) -> Result<(u64, f64, Measured), Error> {
    let rows = ctx.config.retention_rows;
    let deleting = ctx.scratch.pool(1).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let job = {
        let (deleting, stop) = (deleting.clone(), stop.clone());
        let batch = ctx.config.retention_batch;
        tokio::spawn(async move {
            let started = Instant::now();
            let deleted = delete_old_keys(deleting, batch, budget).await;
            stop.store(true, Ordering::Release);
            (deleted, started.elapsed())
        })
    };
    let during = run_loop(clients, Until::Flag(stop.clone()), op).await;
    let (deleted, took) = job.await?;
    let during = during?;
    let deleted = deleted?;
    deleting.close().await;
    let left = ctx.keys_like("old-%").await?;
    if left != 0 || deleted != rows {
        return Err(format!("retention deleted {deleted} of {rows}; {left} left").into());
    }
    Ok((deleted, took.as_secs_f64(), during))
}

fn progress(retention: &Retention) {
    let claim_p99 = |run: &Run| run.claim.and_then(|claim| claim.p99_ms).unwrap_or(f64::NAN);
    eprintln!(
        "  retention: {} rows in {:.2} s = {:.0} rows/s; claim p99 idle {:.2} ms, \
         during {:.2} ms, during paced ({:.0} rows/s) {:.2} ms",
        retention.deleted,
        retention.seconds,
        retention.rows_per_second,
        claim_p99(&retention.idle),
        claim_p99(&retention.during),
        retention
            .paced
            .as_ref()
            .map_or(f64::NAN, |paced| paced.rows_per_second),
        retention
            .paced
            .as_ref()
            .map_or(f64::NAN, |paced| claim_p99(&paced.during)),
    );
}

/// Each way of deleting: at least 50,000 rows/s, and the claim's p99 at most twice idle.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let Some(retention) = &report.retention else {
        return;
    };
    let p99 = |run: &Run| run.claim.and_then(|claim| claim.p99_ms);
    let mut judge = |how: &str, rows_per_second: f64, during: &Run| {
        targets.push(Target {
            name: format!("6 retention, {how}: rows deleted per second"),
            measured: format!("{rows_per_second:.0}"),
            target: "≥ 50000".to_owned(),
            met: Some(rows_per_second >= 50_000.0),
        });
        let ratio = over(p99(during), p99(&retention.idle));
        targets.push(Target {
            name: format!(
                "6 retention, {how}: claim p99 during ÷ idle (workload 1 @{})",
                retention.idle.clients
            ),
            measured: ratio.map_or("-".to_owned(), |ratio| format!("{ratio:.2}×")),
            target: "≤ 2×".to_owned(),
            met: ratio.map(|ratio| ratio <= 2.0),
        });
    };
    judge("back to back", retention.rows_per_second, &retention.during);
    if let Some(paced) = &retention.paced {
        judge("paced", paced.rows_per_second, &paced.during);
    }
}

fn section(report: &Report, out: &mut String) {
    let Some(retention) = &report.retention else {
        return;
    };
    let _ = writeln!(
        out,
        "\nretention: {} of {} finished keys deleted in batches of {} in {:.2} s = {:.0} rows/s \
         (seeded in {:.1} s), with workload 1 at {} clients:",
        retention.deleted,
        retention.rows,
        retention.batch,
        retention.seconds,
        retention.rows_per_second,
        retention.seed_seconds,
        retention.idle.clients
    );
    let mut rows = vec![("idle", &retention.idle), ("during", &retention.during)];
    if let Some(paced) = &retention.paced {
        let _ = writeln!(
            out,
            "  paced (expire_paced, batches of {}, at most {:.0} rows/s): {} rows in {:.2} s = {:.0} rows/s",
            paced.batch,
            paced.budget_rows_per_second,
            paced.deleted,
            paced.seconds,
            paced.rows_per_second
        );
        rows.push(("paced", &paced.during));
    }
    for (label, run) in rows {
        let _ = writeln!(
            out,
            "  {label:<6} {:>7.0} req/s, request p99 {} ms, claim p50/p99/max {} ms",
            run.per_second,
            ms(run.latency.p99_ms),
            run.claim.as_ref().map_or("-".to_owned(), triple)
        );
    }
}
