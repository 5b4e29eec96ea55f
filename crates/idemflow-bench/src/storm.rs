//! The storm workload: a duplicate storm. Each round, `storm_clients` clients send
//! `storm_keys` fresh keys, every copy released at once (a barrier), through the checkout
//! workflow; the winner of each key executes, the others are told 409 (the key in progress) or
//! get the replay. Checked, or the run fails: one order, one foreign call and one finished key
//! per key.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::{Outcome, Runner};

use crate::Error;
use crate::db::literal;
use crate::load::Latencies;
use crate::report::{ENGINE, REPLAY, Report, Storm, Target, triple};
use crate::requests::Engine;
use crate::workflows::{self, Ledger};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "storm",
    number: Some(4),
    measures: "a duplicate storm: many clients on a few new keys at once, one execution per key",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        report.storm = Some(storm(ctx).await?);
        Ok(())
    })
}

/// How the clients were answered, and how long each answer took (µs).
#[derive(Default)]
struct Tally {
    executed: usize,
    replayed: usize,
    in_progress: usize,
    other: usize,
    winners: Vec<u32>,
    conflicts: Vec<u32>,
    replays: Vec<u32>,
}

impl Tally {
    fn record(&mut self, outcome: Outcome, took: Duration) {
        let micros = u32::try_from(took.as_micros()).unwrap_or(u32::MAX);
        match outcome {
            Outcome::Executed(_) => {
                self.executed += 1;
                self.winners.push(micros);
            }
            Outcome::Replayed(_) => {
                self.replayed += 1;
                self.replays.push(micros);
            }
            Outcome::InProgress { .. } => {
                self.in_progress += 1;
                self.conflicts.push(micros);
            }
            _ => self.other += 1,
        }
    }
}

async fn storm(ctx: &Ctx<'_>) -> Result<Storm, Error> {
    let config = ctx.config;
    let clients = config.storm_clients.max(1);
    let keys_per_round = config.storm_keys.max(1);
    let ledger = Ledger::default();
    let pool = ctx.scratch.pool(clients).await?;
    let engine = Arc::new(Engine {
        runner: Runner::new(pool.clone()),
        workflow: Arc::new(workflows::checkout(Some(ledger.clone()))?),
        tenant: ctx.tenant.clone(),
    });
    let prefix = ctx.prefix("storm");
    let mut tally = Tally::default();
    // Round 0 opens the pool's connections and is not counted; every round is checked.
    for round in 0..=config.storm_rounds {
        let answers = one_round(
            &engine,
            &format!("{prefix}-{round}"),
            clients,
            keys_per_round,
        )
        .await?;
        if round > 0 {
            for (outcome, took) in answers {
                tally.record(outcome?, took);
            }
        }
    }
    pool.close().await;
    check_once(ctx, &prefix, &ledger, &tally).await?;
    let storm = Storm {
        clients,
        keys_per_round,
        rounds: config.storm_rounds,
        requests: (tally.executed + tally.replayed + tally.in_progress + tally.other) as u64,
        executed: tally.executed as u64,
        replayed: tally.replayed as u64,
        in_progress: tally.in_progress as u64,
        other: tally.other as u64,
        // Checked above: the run fails otherwise.
        one_execution_per_key: true,
        winners: Latencies::from_unsorted(tally.winners).summary(),
        in_progress_latency: Latencies::from_unsorted(tally.conflicts).summary(),
        replayed_latency: Latencies::from_unsorted(tally.replays).summary(),
    };
    eprintln!(
        "  storm: {} executed, {} in progress (409), {} replayed, {} other",
        storm.executed, storm.in_progress, storm.replayed, storm.other
    );
    Ok(storm)
}

/// Every client sends its key (`{round}-{client % keys}`) at the same moment; what each was
/// answered, and how long it took.
async fn one_round(
    engine: &Arc<Engine>,
    round: &str,
    clients: usize,
    keys: usize,
) -> Result<Vec<(Result<Outcome, Error>, Duration)>, Error> {
    let barrier = Arc::new(tokio::sync::Barrier::new(clients));
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let key = format!("{round}-{}", client % keys);
        let (engine, barrier) = (engine.clone(), barrier.clone());
        tasks.spawn(async move {
            barrier.wait().await;
            let sent = Instant::now();
            let key = idemflow::Key::parse(&key).expect("the storm's keys are valid");
            let outcome = engine
                .runner
                .run(&engine.workflow, &engine.tenant, &key, workflows::request())
                .await
                .map_err(Error::from);
            (outcome, sent.elapsed())
        });
    }
    let mut answers = Vec::with_capacity(clients);
    while let Some(joined) = tasks.join_next().await {
        answers.push(joined?);
    }
    Ok(answers)
}

/// One order, one finished key and one foreign call per key of the counted rounds and round 0,
/// and one execution per key of the counted rounds; else the run fails.
async fn check_once(
    ctx: &Ctx<'_>,
    prefix: &str,
    ledger: &Ledger,
    tally: &Tally,
) -> Result<(), Error> {
    let config = ctx.config;
    let keys_per_round = config.storm_keys.max(1);
    let total_keys = (config.storm_rounds + 1) * keys_per_round;
    let like = format!("{prefix}-%");
    let orders = ctx
        .scratch
        .scalar(&format!(
            "SELECT count(*) FROM orders WHERE key LIKE {}",
            literal(&like)
        ))
        .await?;
    let distinct = ctx
        .scratch
        .scalar(&format!(
            "SELECT count(DISTINCT key) FROM orders WHERE key LIKE {}",
            literal(&like)
        ))
        .await?;
    let done = ctx.done_keys_like(&like).await?;
    let calls = ledger.lock().map_err(|_| "ledger poisoned")?.clone();
    let executed = tally.executed;
    let once = usize::try_from(orders)? == total_keys
        && usize::try_from(distinct)? == total_keys
        && usize::try_from(done)? == total_keys
        && calls.len() == total_keys
        && calls.values().all(|&count| count == 1)
        && executed == config.storm_rounds * keys_per_round;
    if !once {
        return Err(format!(
            "duplicate storm: not one execution per key: {orders} orders over {distinct} keys, \
             {done} finished, {} foreign keys called {:?} times, {executed} executed, for {total_keys} keys",
            calls.len(),
            calls.values().collect::<Vec<_>>()
        )
        .into());
    }
    Ok(())
}

/// Exactly one execution per key; a loser holds its connection for one statement (the replay's
/// look-up, counted on the wire).
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let Some(storm) = &report.storm else {
        return;
    };
    targets.push(Target::exactly_once(
        "4 storm: executions per key".to_owned(),
        storm.one_execution_per_key,
    ));
    let replay_trips = report
        .wire(REPLAY, ENGINE)
        .map(|count| count.round_trips_per_request);
    targets.push(Target {
        name: "4 storm: statements a loser holds its connection for".to_owned(),
        measured: replay_trips.map_or("-".to_owned(), |trips| {
            format!(
                "{trips:.0} (409 p99 {} ms)",
                storm
                    .in_progress_latency
                    .p99_ms
                    .map_or("-".to_owned(), |ms| format!("{ms:.1}"))
            )
        }),
        target: "1".to_owned(),
        met: replay_trips.map(|trips| trips <= 1.0),
    });
}

fn section(report: &Report, out: &mut String) {
    let Some(storm) = &report.storm else {
        return;
    };
    let _ = writeln!(
        out,
        "\nduplicate storm: {} clients on {} keys × {} rounds: {} executed, {} answered 409 in progress, \
         {} replayed, {} other; one execution per key: {}",
        storm.clients,
        storm.keys_per_round,
        storm.rounds,
        storm.executed,
        storm.in_progress,
        storm.replayed,
        storm.other,
        storm.one_execution_per_key
    );
    let _ = writeln!(
        out,
        "  latency p50/p99/max ms: winners {}, 409 losers {}, replayed losers {}",
        triple(&storm.winners),
        triple(&storm.in_progress_latency),
        triple(&storm.replayed_latency)
    );
}
