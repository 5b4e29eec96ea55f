//! The fleet workload: a fleet of processes on one database. The checkout example's `serve` and
//! `worker` processes (examples/checkout) against the testkit's mock provider in this process;
//! `clients` HTTP clients take the `requests` keys from one queue and send each until answered, to
//! the services in turn (the next one after a connection error, a 503 or a 409). Three runs, in
//! order: one serve and one worker (the single-process baseline); `serves` and `workers` processes;
//! the same fleet with a process SIGKILLed every 150-450 ms (a serve or a worker, chosen by a
//! seeded generator) and a replacement of its kind started at once. Each run ends when every key is
//! answered and no key is left started. Checked in each: every key done, one paid order and one
//! provider charge per key, and (on a sample of every tenth key) every answer a client got
//! byte-equal to the replay.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use idemflow::core::PhaseName;
use idemflow::{DerivedKey, Key, TenantId};
use idemflow_testkit::provider::MockProvider;
use idemflow_testrig::simulation::Rng;

use crate::Error;
use crate::config::Config;
use crate::db::Scratch;
use crate::processes::{Process, TENANT, checkout_binary, count, post, start, url_in};
use crate::report::{Fleet, Report};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "fleet",
    number: Some(11),
    measures: "checkouts through many serve and worker processes, then with processes killed",
    runs: Runs::Once(run),
    targets: None,
    section: Some(section),
};

/// Short, so a key a killed process left started is taken over within the run.
const LEASE_SECONDS: &str = "4";
/// Each process's pool: eight processes of 10 fit under the default max_connections of 100,
/// with room for the benchmark's own.
const POOL_SIZE: &str = "10";
/// The kill schedule's seed (fixed: runs are comparable); `IDEMFLOW_SEED` picks another.
const SEED: u64 = 0x1de7_f10e;

#[derive(Default)]
struct Retries {
    connection_errors: AtomicU64,
    in_progress: AtomicU64,
    unavailable: AtomicU64,
}

/// Sends `key` until a service answers it with something other than 409 or 503.
async fn answered(
    client: &reqwest::Client,
    live: &RwLock<Vec<String>>,
    mut turn: usize,
    key: &str,
    retries: &Retries,
) -> Result<(u16, Vec<u8>), Error> {
    let began = Instant::now();
    loop {
        if began.elapsed() > Duration::from_secs(120) {
            return Err(format!("fleet: {key} unanswered for two minutes").into());
        }
        let url = {
            let live = live.read().map_err(|_| "poisoned")?;
            live[turn % live.len()].clone()
        };
        turn += 1;
        match post(client, &url, key).await {
            None => {
                retries.connection_errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Some((409, _)) => {
                retries.in_progress.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some((503, _)) => {
                retries.unavailable.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(answer) => return Ok(answer),
        }
    }
}

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let config = ctx.config;
        eprintln!(
            "  {} requests, 1 serve × 1 worker, then {} × {}, then the same killed at random",
            config.fleet_requests, config.fleet_serves, config.fleet_workers
        );
        let binary = tokio::task::spawn_blocking(checkout_binary).await??;
        let prefix = ctx.prefix("fleet");
        let provider = MockProvider::builder().start().await?;
        let result = runs(config, ctx.scratch, &binary, &provider, &prefix).await;
        provider.shutdown().await;
        report.fleet = result?;
        Ok(())
    })
}

/// The three runs; the first is the baseline the others' ratios divide by.
async fn runs(
    config: &Config,
    scratch: &Scratch,
    binary: &Path,
    provider: &MockProvider,
    prefix: &str,
) -> Result<Vec<Fleet>, Error> {
    let mut runs: Vec<Fleet> = Vec::new();
    let shapes = [
        (1, 1, false),
        (config.fleet_serves, config.fleet_workers, false),
        (config.fleet_serves, config.fleet_workers, true),
    ];
    for (index, shape) in shapes.into_iter().enumerate() {
        let prefix = format!("{prefix}-{index}");
        let mut fleet = one_run(config, scratch, binary, provider, &prefix, shape).await?;
        fleet.ratio_to_single = runs
            .first()
            .map_or(1.0, |single| fleet.per_second / single.per_second);
        runs.push(fleet);
    }
    Ok(runs)
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
        "--pool-size",
        // The smoke test runs beside other tests on the same server: a smaller share.
        if config.quick { "4" } else { POOL_SIZE },
    ]
}

/// The fleet's processes: the services (with their URLs) and the workers, and how to start
/// another of each kind.
struct Processes<'a> {
    binary: &'a Path,
    serve_arguments: Vec<&'a str>,
    worker_arguments: Vec<&'a str>,
    services: Vec<(Process, String)>,
    workers: Vec<Process>,
    /// The URLs the clients send to: the live services'.
    live: Arc<RwLock<Vec<String>>>,
    serve_kills: u64,
    worker_kills: u64,
}

impl<'a> Processes<'a> {
    /// Starts `serves` services, one at a time (the first creates the example's table), then
    /// `workers` workers.
    async fn start(
        binary: &'a Path,
        common: [&'a str; 8],
        serves: usize,
        workers: usize,
    ) -> Result<Self, Error> {
        let mut processes = Self {
            binary,
            serve_arguments: ["serve", "--bind", "127.0.0.1:0"]
                .into_iter()
                .chain(common)
                .collect(),
            worker_arguments: ["worker", "--metrics-bind", "127.0.0.1:0"]
                .into_iter()
                .chain(common)
                .collect(),
            services: Vec::new(),
            workers: Vec::new(),
            live: Arc::default(),
            serve_kills: 0,
            worker_kills: 0,
        };
        for index in 0..serves {
            processes.start_serve(&format!("serve {index}")).await?;
        }
        for index in 0..workers {
            processes.start_worker(&format!("worker {index}")).await?;
        }
        Ok(processes)
    }

    async fn start_serve(&mut self, name: &str) -> Result<(), Error> {
        let (process, line) =
            start(self.binary, name, &self.serve_arguments, "listening on").await?;
        let url = url_in(&line)?;
        self.live.write().map_err(|_| "poisoned")?.push(url.clone());
        self.services.push((process, url));
        Ok(())
    }

    async fn start_worker(&mut self, name: &str) -> Result<(), Error> {
        let (process, _) = start(self.binary, name, &self.worker_arguments, "resuming").await?;
        self.workers.push(process);
        Ok(())
    }

    /// SIGKILLs a process chosen by `rng` and starts a replacement of its kind.
    async fn kill_one(&mut self, rng: &mut Rng) -> Result<(), Error> {
        let total = (self.services.len() + self.workers.len()) as u64;
        let victim = rng.below(total) as usize;
        if victim < self.services.len() {
            let (mut process, url) = self.services.swap_remove(victim);
            // Out of the clients' rotation first, so new sends go elsewhere.
            self.live
                .write()
                .map_err(|_| "poisoned")?
                .retain(|live| *live != url);
            process.kill();
            self.serve_kills += 1;
            self.start_serve("serve (replacement)").await
        } else {
            let mut process = self.workers.swap_remove(victim - self.services.len());
            process.kill();
            self.worker_kills += 1;
            self.start_worker("worker (replacement)").await
        }
    }
}

/// What the clients share: the keys, the HTTP client, the retries they made, and a sample of
/// the answers they got (every tenth key).
struct Load {
    names: Arc<Vec<String>>,
    client: reqwest::Client,
    retries: Arc<Retries>,
    sample: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

async fn one_run(
    config: &Config,
    scratch: &Scratch,
    binary: &Path,
    provider: &MockProvider,
    prefix: &str,
    (serves, workers, kills): (usize, usize, bool),
) -> Result<Fleet, Error> {
    let common = common(config, scratch, provider);
    let mut processes = Processes::start(binary, common, serves, workers).await?;
    let load = Load {
        names: Arc::new(
            (0..config.fleet_requests)
                .map(|i| format!("{prefix}-{i:05}"))
                .collect(),
        ),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(0)
            .build()?,
        retries: Arc::default(),
        sample: Arc::default(),
    };
    let seed = std::env::var("IDEMFLOW_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(SEED);
    let began = Instant::now();
    let mut clients = spawn_clients(config, &load, &processes.live);
    drive(&mut clients, &mut processes, kills.then(|| Rng::new(seed))).await?;
    let seconds = began.elapsed().as_secs_f64();
    let (done, bad_orders) = wait_done(scratch, prefix).await?;
    let one_charge = one_charge_per_key(provider, &load.names)?;
    let byte_equal = sampled_replays_byte_equal(&load, &processes.live).await?;
    let fleet = Fleet {
        serves,
        workers,
        kills,
        clients: config.fleet_clients,
        requests: config.fleet_requests as u64,
        seconds,
        per_second: config.fleet_requests as f64 / seconds,
        ratio_to_single: 1.0,
        serve_kills: processes.serve_kills,
        worker_kills: processes.worker_kills,
        connection_errors: load.retries.connection_errors.load(Ordering::Relaxed),
        in_progress: load.retries.in_progress.load(Ordering::Relaxed),
        unavailable: load.retries.unavailable.load(Ordering::Relaxed),
        all_done: done == config.fleet_requests as u64,
        one_order_per_key: bad_orders == 0,
        one_charge_per_key: one_charge,
        sampled_replays_byte_equal: byte_equal,
        seed: kills.then_some(seed),
    };
    drop(processes);
    verdict(&fleet)?;
    Ok(fleet)
}

/// `fleet_clients` clients taking the keys from one queue, each sending its key until answered,
/// to the live services in turn.
fn spawn_clients(
    config: &Config,
    load: &Load,
    live: &Arc<RwLock<Vec<String>>>,
) -> tokio::task::JoinSet<Result<(), Error>> {
    let next = Arc::new(AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for client_index in 0..config.fleet_clients {
        let (client, live, names, next, retries, sample) = (
            load.client.clone(),
            live.clone(),
            load.names.clone(),
            next.clone(),
            load.retries.clone(),
            load.sample.clone(),
        );
        clients.spawn(async move {
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                let Some(name) = names.get(index) else {
                    return Ok::<(), Error>(());
                };
                let (status, body) =
                    answered(&client, &live, client_index + index, name, &retries).await?;
                if status != 201 {
                    return Err(format!("fleet: {name} answered {status}").into());
                }
                if index % 10 == 0 {
                    sample
                        .lock()
                        .map_err(|_| "poisoned")?
                        .insert(name.clone(), body);
                }
            }
        });
    }
    clients
}

/// Waits for the clients; with a generator (`killer`), meanwhile kills a process every
/// 150-450 ms and replaces it at once.
async fn drive(
    clients: &mut tokio::task::JoinSet<Result<(), Error>>,
    processes: &mut Processes<'_>,
    mut killer: Option<Rng>,
) -> Result<(), Error> {
    let pause = |rng: &mut Rng| Instant::now() + Duration::from_millis(150 + rng.below(300));
    let mut next_kill = killer.as_mut().map(pause);
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    while !clients.is_empty() {
        tokio::select! {
            joined = clients.join_next() => {
                if let Some(joined) = joined {
                    joined??;
                }
            }
            _ = ticks.tick(), if killer.is_some() => {
                if let (Some(rng), Some(at)) = (killer.as_mut(), next_kill)
                    && Instant::now() >= at
                {
                    next_kill = Some(pause(rng));
                    processes.kill_one(rng).await?;
                }
            }
        }
    }
    Ok(())
}

/// Waits until every key is done (a killed request's key may still be finishing by a worker or
/// a retry); then the keys done and the keys without exactly one paid order.
async fn wait_done(scratch: &Scratch, prefix: &str) -> Result<(u64, u64), Error> {
    let watch = scratch.pool(1).await?;
    let like = format!("'{prefix}-%'");
    let deadline = Instant::now() + Duration::from_secs(60);
    let started =
        format!("SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state <> 'done'");
    while count(&watch, &started).await? > 0 {
        if Instant::now() > deadline {
            return Err("fleet: keys left started a minute after the load".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = count(
        &watch,
        &format!("SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state = 'done'"),
    )
    .await?;
    let bad_orders = count(
        &watch,
        &format!(
            "SELECT count(*) FROM idempotency_keys AS k LEFT JOIN ( \
                 SELECT request_key, count(*) AS orders, \
                     count(*) FILTER (WHERE status = 'paid') AS paid \
                 FROM checkout_orders WHERE request_key LIKE {like} GROUP BY request_key \
             ) AS o ON o.request_key = k.key \
             WHERE k.key LIKE {like} \
                 AND (o.orders IS DISTINCT FROM 1 OR o.paid IS DISTINCT FROM 1)"
        ),
    )
    .await?;
    watch.close().await;
    Ok((done, bad_orders))
}

/// Whether the provider charged each key exactly once.
fn one_charge_per_key(provider: &MockProvider, names: &[String]) -> Result<bool, Error> {
    let tenant = TenantId::new(TENANT)?;
    let phase = PhaseName::new("charge")?;
    let mut charges = HashMap::<String, u64>::new();
    for charge in provider.charges() {
        *charges.entry(charge.idempotency_key.clone()).or_default() += 1;
    }
    let mut one_charge = true;
    for name in names {
        let key = DerivedKey::new(&tenant, &Key::parse(name)?, phase).to_string();
        one_charge &= charges.get(&key).copied() == Some(1);
    }
    Ok(one_charge)
}

/// The sample's answers against the replay, from whichever service is up.
async fn sampled_replays_byte_equal(
    load: &Load,
    live: &RwLock<Vec<String>>,
) -> Result<bool, Error> {
    let sample = std::mem::take(&mut *load.sample.lock().map_err(|_| "poisoned")?);
    let mut byte_equal = true;
    for (index, (name, body)) in sample.iter().enumerate() {
        let (status, replayed) = answered(&load.client, live, index, name, &load.retries).await?;
        byte_equal &= status == 201 && replayed == *body;
    }
    Ok(byte_equal)
}

/// Reports the run, and fails it when an invariant broke.
fn verdict(fleet: &Fleet) -> Result<(), Error> {
    eprintln!(
        "  fleet: {} serve(s), {} worker(s), kills {}: {} requests in {:.2} s ({:.0}/s); kills {} \
         serve + {} worker; retries: {} connection errors, {} 409, {} 503",
        fleet.serves,
        fleet.workers,
        fleet.kills,
        fleet.requests,
        fleet.seconds,
        fleet.per_second,
        fleet.serve_kills,
        fleet.worker_kills,
        fleet.connection_errors,
        fleet.in_progress,
        fleet.unavailable
    );
    if !(fleet.all_done
        && fleet.one_order_per_key
        && fleet.one_charge_per_key
        && fleet.sampled_replays_byte_equal)
    {
        return Err(format!("fleet: an invariant broke: {fleet:?}").into());
    }
    Ok(())
}

fn section(report: &Report, out: &mut String) {
    if report.fleet.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nfleet (11): checkouts over HTTP through the example's serve and worker processes, \
         each key sent until answered"
    );
    for run in &report.fleet {
        let _ = writeln!(
            out,
            "  {} serve × {} worker{}: {} requests from {} clients in {:.2} s = {:.0}/s \
             ({:.2}× one process); kills {} serve + {} worker; retries {} connection, {} \
             409, {} 503; all done {}, one order {}, one charge {}, replays byte-equal {}",
            run.serves,
            run.workers,
            if run.kills { ", killed at random" } else { "" },
            run.requests,
            run.clients,
            run.seconds,
            run.per_second,
            run.ratio_to_single,
            run.serve_kills,
            run.worker_kills,
            run.connection_errors,
            run.in_progress,
            run.unavailable,
            run.all_done,
            run.one_order_per_key,
            run.one_charge_per_key,
            run.sampled_replays_byte_equal
        );
    }
}
