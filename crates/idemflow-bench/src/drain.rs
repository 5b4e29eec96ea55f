//! The drain workload: `drain_keys` checkout keys left at the create_order recovery point with
//! expired leases (as a crash right after the first commit leaves them), drained by 1, 2, then 4
//! resumers at once (`drain_resumers`), each with its default configuration and a pool of its
//! own. Checked, or the run fails: every key finished.

use idemflow::PgStore;
use std::fmt::Write as _;
use std::time::Instant;

use idemflow::{Registry, Resumer, ResumerConfig, Runner};
use sqlx::PgPool;

use crate::Error;
use crate::report::{CHECKOUT, Drain, ENGINE, Report, Target, over};
use crate::workflows;
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "drain",
    number: Some(5),
    measures: "resumers draining keys left at a recovery point: keys per second",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        for &resumers in &ctx.config.drain_resumers {
            report.drain.push(drain(ctx, resumers).await?);
        }
        Ok(())
    })
}

/// A resumer of the checkout workflow on `pool`, its retention off (nothing here expires).
pub(crate) fn resumer(pool: PgPool) -> Result<Resumer<PgStore>, Error> {
    let mut registry = Registry::new();
    registry.register(workflows::checkout(None)?)?;
    Ok(Resumer::with_config(
        Runner::new(pool),
        registry,
        ResumerConfig::default().with_retention(None),
    ))
}

async fn drain(ctx: &Ctx<'_>, resumers: usize) -> Result<Drain, Error> {
    let keys = ctx.config.drain_keys;
    let prefix = format!("{}:", ctx.prefix(&format!("drain{resumers}")));
    ctx.seed_started(&prefix, keys).await?;
    ctx.analyze_keys().await?;
    let concurrency = ResumerConfig::default().concurrency;
    let mut pools = Vec::new();
    let mut draining = Vec::new();
    for _ in 0..resumers.max(1) {
        let pool = ctx.scratch.pool(concurrency).await?;
        draining.push(resumer(pool.clone())?);
        pools.push(pool);
    }
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for resumer in draining {
        tasks.spawn(async move { resumer.drain().await });
    }
    let mut finished = 0;
    while let Some(joined) = tasks.join_next().await {
        let report = joined??;
        if report.failed > 0 || report.interrupted > 0 {
            return Err(format!("a resumer did not finish its keys: {report:?}").into());
        }
        finished += report.finished as u64;
    }
    let seconds = started.elapsed().as_secs_f64();
    for pool in pools {
        pool.close().await;
    }
    let done = ctx.done_keys_like(&format!("{prefix}%")).await?;
    if u64::try_from(done)? != keys || finished != keys {
        return Err(format!("drain: {done} of {keys} keys done, {finished} reported").into());
    }
    let keys_per_second = keys as f64 / seconds.max(1e-9);
    eprintln!(
        "  drain: {resumers} resumer(s): {keys} keys in {seconds:.2} s = {keys_per_second:.0} keys/s"
    );
    Ok(Drain {
        resumers,
        concurrency_per_resumer: concurrency,
        keys,
        finished,
        seconds,
        keys_per_second,
        keys_per_second_per_resumer: keys_per_second / resumers.max(1) as f64,
    })
}

/// One resumer drains at least half the checkout workload's rate of new requests, and two drain
/// more than one.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let rate = |resumers: usize| {
        report
            .drain
            .iter()
            .find(|drain| drain.resumers == resumers)
            .map(|drain| drain.keys_per_second)
    };
    targets.push(Target::ratio(
        format!(
            "5 resumer: keys/s of one resumer ÷ workload 1 req/s @{}",
            report.settings.reference_clients
        ),
        over(rate(1), report.rate(CHECKOUT, ENGINE)),
        0.5,
    ));
    targets.push(Target::ratio(
        "5 resumer: 2 resumers ÷ 1 resumer (scales)".to_owned(),
        over(rate(2), rate(1)),
        1.1,
    ));
}

fn section(report: &Report, out: &mut String) {
    if report.drain.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nresumer drain:");
    for drain in &report.drain {
        let _ = writeln!(
            out,
            "  {} resumer(s) × concurrency {}: {} keys in {:.2} s = {:.0} keys/s ({:.0} per resumer)",
            drain.resumers,
            drain.concurrency_per_resumer,
            drain.finished,
            drain.seconds,
            drain.keys_per_second,
            drain.keys_per_second_per_resumer
        );
    }
}
