//! Workload 11: a fleet of processes on one database. The checkout example's `serve` and `worker`
//! processes (examples/checkout) against the testkit's mock provider in this process; `clients`
//! HTTP clients take the `requests` keys from one queue and send each until answered, to the
//! services in turn (the next one after a connection error, a 503 or a 409). Three runs, in
//! order: one serve and one worker (the single-process baseline); `serves` and `workers`
//! processes; the same fleet with a process SIGKILLed every 150-450 ms (a serve or a worker,
//! chosen by a seeded generator) and a replacement of its kind started at once. Each run ends
//! when every key is answered and no key is left started. Checked in each: every key done, one
//! paid order and one provider charge per key, and (on a sample of every tenth key) every answer
//! a client got byte-equal to the replay.

use std::collections::HashMap;
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
use crate::mass_crash::{Process, TENANT, count, post, start, url_in};
use crate::report::Fleet;

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

/// The three runs; the first is the baseline the others' ratios divide by.
pub async fn run(
    config: &Config,
    scratch: &Scratch,
    binary: &std::path::Path,
    prefix: &str,
) -> Result<Vec<Fleet>, Error> {
    let provider = MockProvider::builder().start().await?;
    let mut runs = Vec::new();
    let shapes = [
        (1, 1, false),
        (config.fleet_serves, config.fleet_workers, false),
        (config.fleet_serves, config.fleet_workers, true),
    ];
    for (index, (serves, workers, kills)) in shapes.into_iter().enumerate() {
        let result = one_run(
            config,
            scratch,
            binary,
            &provider,
            &format!("{prefix}-{index}"),
            (serves, workers, kills),
        )
        .await;
        match result {
            Ok(mut fleet) => {
                fleet.ratio_to_single = runs
                    .first()
                    .map_or(1.0, |single: &Fleet| fleet.per_second / single.per_second);
                runs.push(fleet);
            }
            Err(error) => {
                provider.shutdown().await;
                return Err(error);
            }
        }
    }
    provider.shutdown().await;
    Ok(runs)
}

async fn one_run(
    config: &Config,
    scratch: &Scratch,
    binary: &std::path::Path,
    provider: &MockProvider,
    prefix: &str,
    (serves, workers, kills): (usize, usize, bool),
) -> Result<Fleet, Error> {
    let common = [
        "--database-url",
        &scratch.url,
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        LEASE_SECONDS,
        "--pool-size",
        // The smoke test runs beside other tests on the same server: a smaller share.
        if config.quick { "4" } else { POOL_SIZE },
    ];
    let serve_arguments: Vec<&str> = ["serve", "--bind", "127.0.0.1:0"]
        .into_iter()
        .chain(common)
        .collect();
    let worker_arguments: Vec<&str> = ["worker", "--metrics-bind", "127.0.0.1:0"]
        .into_iter()
        .chain(common)
        .collect();
    // Started one at a time: the first creates the example's table.
    let mut services: Vec<(Process, String)> = Vec::new();
    for index in 0..serves {
        let (process, line) = start(
            binary,
            &format!("serve {index}"),
            &serve_arguments,
            "listening on",
        )
        .await?;
        services.push((process, url_in(&line)?));
    }
    let mut recovering: Vec<Process> = Vec::new();
    for index in 0..workers {
        let (process, _) = start(
            binary,
            &format!("worker {index}"),
            &worker_arguments,
            "resuming",
        )
        .await?;
        recovering.push(process);
    }
    let live = Arc::new(RwLock::new(
        services
            .iter()
            .map(|(_, url)| url.clone())
            .collect::<Vec<_>>(),
    ));

    let requests = config.fleet_requests;
    let names: Arc<Vec<String>> =
        Arc::new((0..requests).map(|i| format!("{prefix}-{i:05}")).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let retries = Arc::new(Retries::default());
    let sample = Arc::new(Mutex::new(HashMap::<String, Vec<u8>>::new()));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(0)
        .build()?;
    let began = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for client_index in 0..config.fleet_clients {
        let (client, live, names, next, retries, sample) = (
            client.clone(),
            live.clone(),
            names.clone(),
            next.clone(),
            retries.clone(),
            sample.clone(),
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

    // The killer: while clients run, a process every 150-450 ms, replaced at once.
    let seed = std::env::var("IDEMFLOW_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or(SEED);
    let mut rng = Rng::new(seed);
    let (mut serve_kills, mut worker_kills) = (0_u64, 0_u64);
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    let mut next_kill = Instant::now() + Duration::from_millis(150 + rng.below(300));
    while !clients.is_empty() {
        tokio::select! {
            joined = clients.join_next() => {
                if let Some(joined) = joined {
                    joined??;
                }
            }
            _ = ticks.tick(), if kills => {
                if Instant::now() < next_kill {
                    continue;
                }
                next_kill = Instant::now() + Duration::from_millis(150 + rng.below(300));
                let total = (services.len() + recovering.len()) as u64;
                let victim = rng.below(total) as usize;
                if victim < services.len() {
                    let (mut process, url) = services.swap_remove(victim);
                    // Out of the clients' rotation first, so new sends go elsewhere.
                    live.write().map_err(|_| "poisoned")?.retain(|live| *live != url);
                    process.kill();
                    serve_kills += 1;
                    let (process, line) = start(
                        binary,
                        "serve (replacement)",
                        &serve_arguments,
                        "listening on",
                    )
                    .await?;
                    let url = url_in(&line)?;
                    live.write().map_err(|_| "poisoned")?.push(url.clone());
                    services.push((process, url));
                } else {
                    let mut process = recovering.swap_remove(victim - services.len());
                    process.kill();
                    worker_kills += 1;
                    let (process, _) = start(
                        binary,
                        "worker (replacement)",
                        &worker_arguments,
                        "resuming",
                    )
                    .await?;
                    recovering.push(process);
                }
            }
        }
    }
    let seconds = began.elapsed().as_secs_f64();

    // Every key done (a killed request's key may still be finishing by a worker or a retry).
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
    let tenant = TenantId::new(TENANT)?;
    let phase = PhaseName::new("charge")?;
    let mut charges = HashMap::<String, u64>::new();
    for charge in provider.charges() {
        *charges.entry(charge.idempotency_key.clone()).or_default() += 1;
    }
    let mut one_charge = true;
    for name in names.iter() {
        let key = DerivedKey::new(&tenant, &Key::parse(name)?, phase).to_string();
        one_charge &= charges.get(&key).copied() == Some(1);
    }
    // The sample's answers against the replay, from whichever service is up.
    let sample = std::mem::take(&mut *sample.lock().map_err(|_| "poisoned")?);
    let mut byte_equal = true;
    for (index, (name, body)) in sample.iter().enumerate() {
        let (status, replayed) = answered(&client, &live, index, name, &retries).await?;
        byte_equal &= status == 201 && replayed == *body;
    }
    drop(services);
    drop(recovering);

    let fleet = Fleet {
        serves,
        workers,
        kills,
        clients: config.fleet_clients,
        requests: requests as u64,
        seconds,
        per_second: requests as f64 / seconds,
        ratio_to_single: 1.0,
        serve_kills,
        worker_kills,
        connection_errors: retries.connection_errors.load(Ordering::Relaxed),
        in_progress: retries.in_progress.load(Ordering::Relaxed),
        unavailable: retries.unavailable.load(Ordering::Relaxed),
        all_done: done == requests as u64,
        one_order_per_key: bad_orders == 0,
        one_charge_per_key: one_charge,
        sampled_replays_byte_equal: byte_equal,
        seed: kills.then_some(seed),
    };
    eprintln!(
        "  fleet: {serves} serve(s), {workers} worker(s), kills {kills}: {requests} requests in \
         {seconds:.2} s ({:.0}/s); kills {serve_kills} serve + {worker_kills} worker; retries: {} \
         connection errors, {} 409, {} 503",
        fleet.per_second, fleet.connection_errors, fleet.in_progress, fleet.unavailable
    );
    if !(fleet.all_done
        && fleet.one_order_per_key
        && fleet.one_charge_per_key
        && fleet.sampled_replays_byte_equal)
    {
        return Err(format!("fleet: an invariant broke: {fleet:?}").into());
    }
    Ok(fleet)
}
