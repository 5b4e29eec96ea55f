//! The wire workload: the commits and round trips of one request, counted on the wire (see
//! `wire_counts`) for the single-client variant of the checkout, local-only and replay workloads
//! (engine and raw) and of the http workload, and per key a resumer drains. The counting hook
//! installed on the crash-hook variant says how often a hook is consulted per checkout.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use idemflow::Runner;

use crate::report::{
    CHECKOUT, DRAIN, ENGINE, ENGINE_HOOK, HTTP, HTTP_CHECKOUT, HTTP_REPLAY, LOCAL_ONLY, RAW,
    REPLAY, Report,
};
use crate::requests::{Engine, engine_request, replay_key, runner_for, workflow_for};
use crate::wire_counts::{self, WireCount, counted_pool, settle};
use crate::workflows::{self, CountingHook};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};
use crate::{
    DOCUMENTED_CHECKOUT, DOCUMENTED_LOCAL_ONLY, DOCUMENTED_REPLAY, Error, drain, http, raw,
};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "wire",
    number: None,
    measures: "commits and round trips per request, counted on the wire (one client)",
    runs: Runs::Once(run),
    targets: None,
    section: Some(section),
};

/// Warm-up requests before the counted ones (connections opened, statements prepared).
const WARM_UP: u64 = 3;

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let (counts, hook_calls) = engine_counts(ctx).await?;
        report.wire.extend(counts);
        report.hook_calls_per_request = hook_calls;
        report.wire.extend(raw_counts(ctx).await?);
        report.wire.extend(http_counts(ctx).await?);
        report.wire.push(drain_count(ctx).await?);
        Ok(())
    })
}

/// The engine's variants; and the crash hook's consultations per checkout request.
async fn engine_counts(ctx: &Ctx<'_>) -> Result<(Vec<WireCount>, Option<f64>), Error> {
    let (n, keys) = (ctx.config.wire_requests, ctx.config.replay_keys);
    let mut counted = Vec::new();
    let mut hook_calls = None;
    for (workload, variant, expected) in [
        (CHECKOUT, ENGINE, DOCUMENTED_CHECKOUT),
        (CHECKOUT, ENGINE_HOOK, DOCUMENTED_CHECKOUT),
        (LOCAL_ONLY, ENGINE, DOCUMENTED_LOCAL_ONLY),
        (REPLAY, ENGINE, DOCUMENTED_REPLAY),
    ] {
        let (pool, counts) = counted_pool(ctx.scratch).await?;
        let hook = Arc::new(CountingHook::default());
        let engine = &Engine {
            runner: runner_for(variant, pool.clone(), hook.clone()),
            workflow: Arc::new(workflow_for(workload)?),
            tenant: ctx.tenant.clone(),
        };
        let prefix = &ctx.prefix(&format!("wire-{workload}"));
        let replay = workload == REPLAY;
        let count = wire_counts::count(
            &counts,
            workload,
            variant,
            WARM_UP,
            n,
            Some(expected),
            |i| async move {
                let key = if replay {
                    replay_key(0, i, keys)
                } else {
                    format!("{prefix}-{i}")
                };
                engine_request(engine, &key, replay).await.map(drop)
            },
        )
        .await?;
        if variant == ENGINE_HOOK {
            hook_calls = Some(hook.0.load(Ordering::Relaxed) as f64 / (WARM_UP + n) as f64);
        }
        counted.push(count);
        pool.close().await;
    }
    Ok((counted, hook_calls))
}

/// The raw baseline's requests.
async fn raw_counts(ctx: &Ctx<'_>) -> Result<Vec<WireCount>, Error> {
    let (n, keys) = (ctx.config.wire_requests, ctx.config.replay_keys);
    let mut counted = Vec::new();
    let raw_expected = [
        (CHECKOUT, DOCUMENTED_CHECKOUT),
        (LOCAL_ONLY, DOCUMENTED_LOCAL_ONLY),
        // One autocommit select: no COMMIT on the wire.
        (REPLAY, (0, 1)),
    ];
    for (workload, expected) in raw_expected {
        let (pool, counts) = counted_pool(ctx.scratch).await?;
        let prefix = ctx.prefix(&format!("wire-raw-{workload}"));
        let (pool_ref, shape, prefix) = (&pool, &ctx.shape, &prefix);
        let count = wire_counts::count(
            &counts,
            workload,
            RAW,
            WARM_UP,
            n,
            Some(expected),
            |i| async move {
                let key = format!("{prefix}-{i}");
                match workload {
                    CHECKOUT => raw::checkout(pool_ref, shape, &key).await,
                    LOCAL_ONLY => raw::place(pool_ref, shape, &key).await,
                    _ => raw::replay(pool_ref, &replay_key(0, i, keys)).await,
                }
            },
        )
        .await?;
        counted.push(count);
        pool.close().await;
    }
    Ok(counted)
}

/// The http workload's requests through the engine's route.
async fn http_counts(ctx: &Ctx<'_>) -> Result<Vec<WireCount>, Error> {
    let (n, keys) = (ctx.config.wire_requests, ctx.config.replay_keys);
    let mut counted = Vec::new();
    for (workload, expected) in [
        (HTTP_CHECKOUT, DOCUMENTED_CHECKOUT),
        (HTTP_REPLAY, DOCUMENTED_REPLAY),
    ] {
        let (pool, counts) = counted_pool(ctx.scratch).await?;
        let server = http::serve(
            Runner::new(pool.clone()),
            Arc::new(workflows::checkout(None)?),
        )
        .await?;
        let client = http::client(1)?;
        let prefix = ctx.prefix(&format!("wire-{workload}"));
        let replay = workload == HTTP_REPLAY;
        let (client, url, prefix) = (&client, &server.url, &prefix);
        let count = wire_counts::count(
            &counts,
            workload,
            HTTP,
            WARM_UP,
            n,
            Some(expected),
            |i| async move {
                let key = if replay {
                    replay_key(0, i, keys)
                } else {
                    format!("{prefix}-{i}")
                };
                http::post(client, url, &key, replay).await
            },
        )
        .await?;
        counted.push(count);
        drop(server);
        pool.close().await;
    }
    Ok(counted)
}

/// Round trips per resumed key: a drain of `wire_requests` keys through the counting proxy.
async fn drain_count(ctx: &Ctx<'_>) -> Result<WireCount, Error> {
    let n = ctx.config.wire_requests;
    let (pool, counts) = counted_pool(ctx.scratch).await?;
    let resumer = drain::resumer(pool.clone())?;
    let warm_prefix = format!("{}:", ctx.prefix("wire-drain-warm"));
    ctx.seed_started(&warm_prefix, WARM_UP).await?;
    resumer.drain().await?;
    let prefix = format!("{}:", ctx.prefix("wire-drain"));
    ctx.seed_started(&prefix, n).await?;
    settle().await;
    let before = counts.snapshot();
    let report = resumer.drain().await?;
    settle().await;
    let used = counts.snapshot() - before;
    pool.close().await;
    if report.finished != usize::try_from(n)? {
        return Err(format!("the counted drain finished {report:?} of {n} keys").into());
    }
    let per = |total: u64| total as f64 / n.max(1) as f64;
    Ok(WireCount {
        workload: DRAIN.to_owned(),
        variant: "resumer (per key, scans included)".to_owned(),
        requests: n,
        total_commits: used.commits,
        total_round_trips: used.round_trips,
        total_pings: used.pings,
        commits_per_request: per(used.commits),
        round_trips_per_request: per(used.round_trips),
        pings_per_request: per(used.pings),
        expected_commits: None,
        expected_round_trips: None,
    })
}

/// The counts, against the documented ones where there are documented ones.
fn section(report: &Report, out: &mut String) {
    if !report.wire.is_empty() {
        let _ = writeln!(out, "\ncounted on the wire (one client, after a warm-up):");
        let _ = writeln!(
            out,
            "{:<16} {:<33} {:>5} {:>8} {:>12} {:>6} {:>10}",
            "workload", "variant", "reqs", "commits", "round trips", "pings", "documented"
        );
        for count in &report.wire {
            let documented = match (count.expected_commits, count.expected_round_trips) {
                (Some(commits), Some(trips)) => {
                    let verdict = if count.as_documented() {
                        "ok"
                    } else {
                        "DIFFERS"
                    };
                    format!("{commits}/{trips} {verdict}")
                }
                _ => String::new(),
            };
            let _ = writeln!(
                out,
                "{:<16} {:<33} {:>5} {:>8.2} {:>12.2} {:>6.2} {:>10}",
                count.workload,
                count.variant,
                count.requests,
                count.commits_per_request,
                count.round_trips_per_request,
                count.pings_per_request,
                documented
            );
        }
    }
    if let Some(calls) = report.hook_calls_per_request {
        let _ = writeln!(
            out,
            "crash hook consulted {calls:.1} times per checkout request"
        );
    }
}
