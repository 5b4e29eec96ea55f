//! The mass-crash workload. `crash_serves` checkout `serve` processes (examples/checkout) take
//! `crash_keys` requests spread over them and over `crash_ramp`, from a client per request; the
//! provider (the testkit's mock, in this process, so its ledger is read directly) slows every
//! call but a tenth: six in ten are held without an answer (never executed), three in ten are
//! executed a second after the end of the ramp, after the kill (their callers gone, as a real
//! provider would). Once every key's call has reached the provider, all serve processes are
//! SIGKILLed at once. When the provider has nothing left in flight, the leases of the keys left
//! started are ended in SQL (as the CLI's `end-lease` does, with the same NOTIFY) so the recovery
//! measures the workers, not the lease; then the `worker` processes, started before the load,
//! finish them. Checked: every claimed key done, one paid order and one provider charge per key.
//! One run per number of workers (`crash_workers`).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::core::PhaseName;
use idemflow::{DerivedKey, Key, TenantId};
use idemflow_testkit::provider::{Fault, MockProvider};
use sqlx::PgPool;
use tokio::task::JoinSet;

use crate::Error;
use crate::config::Config;
use crate::db::{Scratch, literal};
use crate::processes::{Process, TENANT, checkout_binary, count, post, start, url_in};
use crate::report::{MassCrash, Report, Target};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "mass-crash",
    number: Some(9),
    measures: "checkout serve processes killed with requests in flight, recovered by workers",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

/// Long enough that no lease runs out during a run by itself (it is ended in SQL instead).
const LEASE_SECONDS: &str = "30";
/// The provider executes each delayed charge about this long after the end of the ramp (plus
/// the request's own way to the provider): after the kill, which comes as soon as every call
/// has reached the provider.
const MARGIN: Duration = Duration::from_secs(1);

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let config = ctx.config;
        let binary = tokio::task::spawn_blocking(checkout_binary).await??;
        for &workers in &config.crash_workers {
            eprintln!(
                "  {} keys over {} serve processes, recovered by {workers} worker process(es)",
                config.crash_keys, config.crash_serves
            );
            let prefix = ctx.prefix(&format!("crash{workers}"));
            let provider = MockProvider::builder().start().await?;
            let result = crash(config, ctx.scratch, &binary, workers, &prefix, &provider).await;
            provider.shutdown().await;
            report.mass_crash.push(result?);
        }
        report.notes.push(
            "mass crash: the leases of the keys left started were ended in SQL after the kill \
             (UPDATE … SET locked_until = least(locked_until, now()), then NOTIFY idemflow_due, as \
             the CLI's end-lease does), once the provider had nothing in flight: recovery time is \
             the workers', not the 30 s lease's"
                .to_owned(),
        );
        Ok(())
    })
}

/// What the provider does with the first call of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Answered at once: the request finishes before the kill.
    Answered,
    /// Executed after a delay that outlasts the kill (its caller gone).
    Delayed,
    /// Held without an answer until the caller is gone; nothing executed.
    Held,
}

fn class(index: usize) -> Class {
    match index % 10 {
        0 => Class::Answered,
        1..=3 => Class::Delayed,
        _ => Class::Held,
    }
}

/// When each step of a run happened.
struct Times {
    /// The load began.
    started: Instant,
    killed: Instant,
    /// The provider had nothing in flight and the leases were ended.
    rewound: Instant,
    /// Every claimed key done, or the deadline passed.
    finished: Instant,
}

/// What the load and the kill left.
struct AtKill {
    answered: u64,
    /// Answers before the kill other than a 201.
    not_201: u64,
    claimed: u64,
    done: u64,
    charged: u64,
}

async fn crash(
    config: &Config,
    scratch: &Scratch,
    binary: &Path,
    workers: usize,
    prefix: &str,
    provider: &MockProvider,
) -> Result<MassCrash, Error> {
    let keys = config.crash_keys.max(1);
    let ramp = config.crash_ramp;
    let (mut services, urls) = start_serves(config, scratch, binary, provider).await?;
    let recovering = start_workers(config, scratch, binary, provider, workers).await?;
    let script = Script::push(provider, prefix, keys, ramp)?;
    // One connection to look at the table with while the run goes.
    let watch = scratch.pool(1).await?;
    let like = literal(&format!("{prefix}-%"));
    let started = Instant::now();
    let requests = load(&script.names, urls, started, ramp)?;
    let killed = kill_when_called(provider, keys, &mut services, started + ramp).await?;
    let at_kill = at_kill(&watch, &like, requests, script.charged(provider)).await?;
    let rewound = end_leases(scratch, provider, &script, &like, ramp).await?;
    let charged_after_kill = script.charged(provider) - at_kill.charged;
    let deadline = rewound + Duration::from_secs(60 + keys as u64 / 20);
    let (finished, stuck) = wait_drained(&watch, &like, deadline).await?;
    drop(recovering);
    let checks = Checks::read(&watch, &like).await?;
    watch.close().await;
    let times = Times {
        started,
        killed,
        rewound,
        finished,
    };
    let mut result = summary(
        config,
        workers,
        &script,
        &times,
        &at_kill,
        charged_after_kill,
    );
    (result.max_provider_calls_per_key, result.one_charge_per_key) =
        ledger(provider, &checks.claimed_names)?;
    result.one_order_per_key = checks.bad_orders == 0 && checks.orphan_orders == 0;
    result.stuck = stuck;
    progress(&result);
    verdict(&result, &checks, at_kill.not_201)?;
    Ok(result)
}

/// The arguments every process takes.
fn common<'a>(config: &Config, scratch: &'a Scratch, provider: &'a MockProvider) -> [&'a str; 8] {
    [
        "--database-url",
        &scratch.url,
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        LEASE_SECONDS,
        // The smoke test runs beside other tests on the same server: a smaller share there.
        "--pool-size",
        if config.quick { "6" } else { "24" },
    ]
}

/// The `serve` processes and their URLs, started one at a time: each creates the example's
/// table if it is missing.
async fn start_serves(
    config: &Config,
    scratch: &Scratch,
    binary: &Path,
    provider: &MockProvider,
) -> Result<(Vec<Process>, Vec<String>), Error> {
    let mut services = Vec::new();
    let mut urls = Vec::new();
    for index in 0..config.crash_serves.max(1) {
        let mut arguments = vec!["serve", "--bind", "127.0.0.1:0"];
        arguments.extend(common(config, scratch, provider));
        let (process, line) = start(
            binary,
            &format!("serve {index}"),
            &arguments,
            "listening on",
        )
        .await?;
        urls.push(url_in(&line)?);
        services.push(process);
    }
    Ok((services, urls))
}

/// The `worker` processes, started before the load.
async fn start_workers(
    config: &Config,
    scratch: &Scratch,
    binary: &Path,
    provider: &MockProvider,
    workers: usize,
) -> Result<Vec<Process>, Error> {
    let mut recovering = Vec::new();
    for index in 0..workers {
        let mut arguments = vec!["worker", "--metrics-bind", "127.0.0.1:0"];
        arguments.extend(common(config, scratch, provider));
        let (process, _) =
            start(binary, &format!("worker {index}"), &arguments, "resuming").await?;
        recovering.push(process);
    }
    Ok(recovering)
}

/// The run's keys and the provider's script for them, one fault per derived key.
struct Script {
    names: Vec<String>,
    /// Each key's derived key at the provider.
    derived: Vec<String>,
}

impl Script {
    fn push(
        provider: &MockProvider,
        prefix: &str,
        keys: usize,
        ramp: Duration,
    ) -> Result<Self, Error> {
        let tenant = TenantId::new(TENANT)?;
        let phase = PhaseName::new("charge")?;
        // The provider's delay counts from a call's arrival; shortened by its request's
        // departure in the ramp, every delayed charge is executed about `MARGIN` after the end
        // of the ramp.
        let delay_of = |index: usize| ramp.mul_f64(1.0 - index as f64 / keys as f64) + MARGIN;
        let names: Vec<String> = (0..keys).map(|i| format!("{prefix}-{i:05}")).collect();
        let mut derived = Vec::with_capacity(keys);
        for (index, name) in names.iter().enumerate() {
            let key = DerivedKey::new(&tenant, &Key::parse(name)?, phase).to_string();
            match class(index) {
                Class::Answered => {}
                Class::Delayed => {
                    provider.push_fault_for(key.clone(), Fault::Delay(delay_of(index)))
                }
                Class::Held => provider.push_fault_for(key.clone(), Fault::Timeout),
            }
            derived.push(key);
        }
        Ok(Self { names, derived })
    }

    /// Charges the provider executed for the run's keys so far.
    fn charged(&self, provider: &MockProvider) -> u64 {
        let ours: HashSet<&str> = self.derived.iter().map(String::as_str).collect();
        provider
            .charges()
            .iter()
            .filter(|charge| ours.contains(charge.idempotency_key.as_str()))
            .count() as u64
    }

    fn delayed(&self) -> impl Iterator<Item = &String> {
        self.derived
            .iter()
            .enumerate()
            .filter(|(index, _)| class(*index) == Class::Delayed)
            .map(|(_, key)| key)
    }
}

/// The load: request i leaves at i/keys of the ramp, for serve i % serves; each answers its
/// status, or `None` when its connection failed (the kill).
fn load(
    names: &[String],
    urls: Vec<String>,
    started: Instant,
    ramp: Duration,
) -> Result<JoinSet<Option<u16>>, Error> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let urls = Arc::new(urls);
    let mut requests = JoinSet::new();
    for (index, name) in names.iter().enumerate() {
        let (client, urls, name) = (client.clone(), urls.clone(), name.clone());
        let leave = started + ramp.mul_f64(index as f64 / names.len() as f64);
        requests.spawn(async move {
            tokio::time::sleep_until(leave.into()).await;
            post(&client, &urls[index % urls.len()], &name)
                .await
                .map(|(status, _)| status)
        });
    }
    Ok(requests)
}

/// SIGKILLs every service at once, as soon as every key's call has reached the provider.
async fn kill_when_called(
    provider: &MockProvider,
    keys: usize,
    services: &mut [Process],
    ramp_end: Instant,
) -> Result<Instant, Error> {
    let deadline = ramp_end + Duration::from_secs(60);
    while provider.calls() < keys {
        if Instant::now() > deadline {
            return Err(format!(
                "mass crash: only {} of {keys} provider calls made in time",
                provider.calls()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed = Instant::now();
    for service in services.iter_mut() {
        service.signal_kill();
    }
    for service in services.iter_mut() {
        service.kill();
    }
    Ok(killed)
}

/// The answers the clients got, and the keys claimed and done, once the services are gone.
async fn at_kill(
    watch: &PgPool,
    like: &str,
    mut requests: JoinSet<Option<u16>>,
    charged: u64,
) -> Result<AtKill, Error> {
    let (mut answered, mut not_201) = (0, 0);
    while let Some(joined) = requests.join_next().await {
        if let Some(status) = joined? {
            answered += 1;
            if status != 201 {
                not_201 += 1;
            }
        }
    }
    let keys = format!("SELECT count(*) FROM idempotency_keys WHERE key LIKE {like}");
    Ok(AtKill {
        answered,
        not_201,
        claimed: count(watch, &keys).await?,
        done: count(watch, &format!("{keys} AND state = 'done'")).await?,
        charged,
    })
}

/// Lets the provider finish what it was executing (its callers gone), then ends the leases of
/// the keys left started, as the CLI's `end-lease` does; when that was done.
async fn end_leases(
    scratch: &Scratch,
    provider: &MockProvider,
    script: &Script,
    like: &str,
    ramp: Duration,
) -> Result<Instant, Error> {
    let settle_deadline = Instant::now() + ramp + MARGIN + Duration::from_secs(30);
    while script.delayed().any(|key| provider.is_in_flight(key)) {
        if Instant::now() > settle_deadline {
            return Err("mass crash: the provider still has calls in flight".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if provider.pending_faults() > 0 {
        return Err(format!(
            "mass crash: {} scripted provider faults left unconsumed",
            provider.pending_faults()
        )
        .into());
    }
    scratch
        .execute(&format!(
            "UPDATE idempotency_keys SET locked_until = least(locked_until, now()), \
                 updated_at = now() \
             WHERE state = 'started' AND key LIKE {like}; \
             SELECT pg_notify('{}', '')",
            idemflow::postgres::DUE_CHANNEL
        ))
        .await?;
    Ok(Instant::now())
}

/// Waits until the workers have finished every key or `deadline` passed: when, and the keys
/// still started then.
async fn wait_drained(
    watch: &PgPool,
    like: &str,
    deadline: Instant,
) -> Result<(Instant, u64), Error> {
    let started_keys = format!(
        "SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state = 'started'"
    );
    loop {
        let left = count(watch, &started_keys).await?;
        if left == 0 {
            return Ok((Instant::now(), 0));
        }
        if Instant::now() > deadline {
            return Ok((Instant::now(), left));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the table says after the drain.
struct Checks {
    /// Keys without exactly one order, paid.
    bad_orders: u64,
    /// Orders without a key.
    orphan_orders: u64,
    /// Stored answers other than a 201.
    not_created: u64,
    claimed_names: Vec<String>,
}

impl Checks {
    async fn read(watch: &PgPool, like: &str) -> Result<Self, Error> {
        let bad_orders = format!(
            "SELECT count(*) FROM idempotency_keys AS k LEFT JOIN ( \
                 SELECT request_key, count(*) AS orders, \
                     count(*) FILTER (WHERE status = 'paid') AS paid \
                 FROM checkout_orders WHERE request_key LIKE {like} GROUP BY request_key \
             ) AS o ON o.request_key = k.key \
             WHERE k.key LIKE {like} \
                 AND (o.orders IS DISTINCT FROM 1 OR o.paid IS DISTINCT FROM 1)"
        );
        let orphan_orders = format!(
            "SELECT count(*) FROM checkout_orders AS o WHERE o.request_key LIKE {like} \
             AND NOT EXISTS (SELECT 1 FROM idempotency_keys AS k \
                 WHERE k.tenant = o.tenant AND k.key = o.request_key)"
        );
        let not_created = format!(
            "SELECT count(*) FROM idempotency_keys \
             WHERE key LIKE {like} AND state = 'done' AND response_status <> 201"
        );
        Ok(Self {
            bad_orders: count(watch, &bad_orders).await?,
            orphan_orders: count(watch, &orphan_orders).await?,
            not_created: count(watch, &not_created).await?,
            claimed_names: sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT key FROM idempotency_keys WHERE key LIKE {like}"
            )))
            .fetch_all(watch)
            .await?,
        })
    }
}

/// The provider's ledger per derived key of a claimed key: the most calls, and whether each
/// holds exactly one charge.
fn ledger(provider: &MockProvider, claimed_names: &[String]) -> Result<(u64, bool), Error> {
    let tenant = TenantId::new(TENANT)?;
    let phase = PhaseName::new("charge")?;
    let mut charges = HashMap::<String, u64>::new();
    for charge in provider.charges() {
        *charges.entry(charge.idempotency_key).or_default() += 1;
    }
    let mut max_calls = 0;
    let mut one_charge = true;
    for name in claimed_names {
        let key = DerivedKey::new(&tenant, &Key::parse(name)?, phase).to_string();
        max_calls = max_calls.max(provider.calls_for(&key) as u64);
        one_charge &= charges.get(&key).copied() == Some(1);
    }
    Ok((max_calls, one_charge))
}

/// The run's figures; the ledger's and the table's verdicts are filled in by the caller.
fn summary(
    config: &Config,
    workers: usize,
    script: &Script,
    times: &Times,
    at_kill: &AtKill,
    charged_after_kill: u64,
) -> MassCrash {
    let keys = script.names.len() as u64;
    let workers_seconds = times.finished.duration_since(times.rewound).as_secs_f64();
    MassCrash {
        serves: config.crash_serves.max(1),
        workers,
        keys,
        ramp_secs: config.crash_ramp.as_secs_f64(),
        held_keys: (0..script.names.len())
            .filter(|&i| class(i) == Class::Held)
            .count() as u64,
        delayed_keys: script.delayed().count() as u64,
        delay_margin_ms: MARGIN.as_secs_f64() * 1000.0,
        kill_at_secs: times.killed.duration_since(times.started).as_secs_f64(),
        answered_before_kill: at_kill.answered,
        in_flight_at_kill: keys - at_kill.answered,
        claimed: at_kill.claimed,
        done_at_kill: at_kill.done,
        charged_at_kill: at_kill.charged,
        charged_after_kill,
        settle_seconds: times.rewound.duration_since(times.killed).as_secs_f64(),
        drain_seconds: times.finished.duration_since(times.killed).as_secs_f64(),
        workers_seconds,
        keys_per_second: (at_kill.claimed - at_kill.done) as f64 / workers_seconds.max(1e-9),
        max_provider_calls_per_key: 0,
        one_charge_per_key: false,
        one_order_per_key: false,
        stuck: 0,
    }
}

fn progress(result: &MassCrash) {
    eprintln!(
        "  mass crash: {} serves, {} worker(s): killed {:.2} s after the load began \
         with {} requests in flight, {} keys claimed, {} done then; drained in {:.2} s from the \
         kill ({:.2} s after the leases ended); charges {}+{}, most calls per key {}, stuck {}",
        result.serves,
        result.workers,
        result.kill_at_secs,
        result.in_flight_at_kill,
        result.claimed,
        result.done_at_kill,
        result.drain_seconds,
        result.workers_seconds,
        result.charged_at_kill,
        result.charged_after_kill,
        result.max_provider_calls_per_key,
        result.stuck
    );
}

/// Fails the run unless every key was claimed and is done with a 201, once ordered and once
/// charged, and every answer before the kill was a 201.
fn verdict(result: &MassCrash, checks: &Checks, not_201: u64) -> Result<(), Error> {
    if result.stuck > 0
        || !result.one_charge_per_key
        || checks.bad_orders != 0
        || checks.orphan_orders != 0
        || checks.not_created != 0
        || not_201 != 0
        || result.claimed != result.keys
    {
        return Err(format!(
            "mass crash: {} keys stuck, one charge per key: {}, {} keys without exactly one paid \
             order, {} orders without a key, {} stored answers and {not_201} answers before the \
             kill other than 201, {} of {} keys claimed",
            result.stuck,
            result.one_charge_per_key,
            checks.bad_orders,
            checks.orphan_orders,
            checks.not_created,
            result.claimed,
            result.keys
        )
        .into());
    }
    Ok(())
}

/// Per number of workers: exactly one charge (and one paid order) per key, no key stuck.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    for run in &report.mass_crash {
        targets.push(Target {
            met: Some(run.one_charge_per_key && run.one_order_per_key),
            ..Target::exactly_once(
                format!(
                    "9 mass crash, {} worker(s): charges per derived key",
                    run.workers
                ),
                run.one_charge_per_key,
            )
        });
        targets.push(Target {
            name: format!("9 mass crash, {} worker(s): stuck keys", run.workers),
            measured: format!("{}", run.stuck),
            target: "0".to_owned(),
            met: Some(run.stuck == 0),
        });
    }
}

fn section(report: &Report, out: &mut String) {
    let Some(first) = report.mass_crash.first() else {
        return;
    };
    let _ = writeln!(
        out,
        "\nmass crash (9): checkout serve processes SIGKILLed at once with requests in flight, \
         leases then ended in SQL; worker processes finish the keys:"
    );
    let _ = writeln!(
        out,
        "  {:>2} {:>7} {:>6} {:>6} {:>9} {:>7} {:>7} {:>8} {:>9} {:>9} {:>9} {:>6} {:>5} {:>5} {:>5}",
        "sv",
        "workers",
        "keys",
        "kill@s",
        "in flight",
        "claimed",
        "done@k",
        "charged",
        "settle s",
        "drain s",
        "workers s",
        "keys/s",
        "calls",
        "1 chg",
        "stuck"
    );
    for run in &report.mass_crash {
        row(out, run);
    }
    let _ = writeln!(
        out,
        "  kill@s: load start → kill (every call at the provider by then; ramp {:.1} s); \
         in flight: sent, not answered at the kill; done@k: keys already done then; charged: \
         provider charges by the kill + after it (delayed calls whose callers were gone); \
         settle: kill → the provider has nothing in flight and the leases are ended; drain: \
         kill → every claimed key done; workers s: leases ended → done; calls: most provider \
         calls under one derived key; 1 chg: one charge and one paid order per key",
        first.ramp_secs
    );
}

fn row(out: &mut String, run: &MassCrash) {
    let _ = writeln!(
        out,
        "  {:>2} {:>7} {:>6} {:>6.2} {:>9} {:>7} {:>7} {:>8} {:>9.2} {:>9.2} {:>9.2} {:>6.0} {:>5} {:>5} {:>5}",
        run.serves,
        run.workers,
        run.keys,
        run.kill_at_secs,
        run.in_flight_at_kill,
        run.claimed,
        run.done_at_kill,
        format!("{}+{}", run.charged_at_kill, run.charged_after_kill),
        run.settle_seconds,
        run.drain_seconds,
        run.workers_seconds,
        run.keys_per_second,
        run.max_provider_calls_per_key,
        if run.one_charge_per_key && run.one_order_per_key {
            "yes"
        } else {
            "NO"
        },
        run.stuck
    );
}
