//! Many processes of the checkout example on one database, SIGKILLed at random while load runs:
//! two `serve` and three `worker` processes (`--no-migrate`, after one migration), clients that
//! send every key a few times at once to different services and retry (same key, same body) on
//! connection errors, 503 and 409 until answered. Every ~300 ms a serve or a worker is killed and
//! a replacement of the same kind started at once. The kill schedule comes from a seeded RNG: the
//! seed is printed, and `IDEMFLOW_SEED=<seed>` replays the same choices (the interleaving with the
//! requests is the machine's). At the end: one order and one charge per key, every key done, and
//! every answer a client got equal, byte for byte, to the stored one. docs/scaling.md.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::support::example::{
    Answer, charge_key, database_url, example_binary, post_checkout, start_serve, start_worker,
};
use idemflow_testkit::provider::{Fault, MockProvider};
use idemflow_testrig::simulation::Rng;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const SERVES: usize = 2;
const WORKERS: usize = 3;
const KEYS: usize = 150;
/// Sends of each key, at once, each to a different service first.
const DUPLICATES: usize = 3;
/// A new key every this often: the load lasts `KEYS * PACE` (4.5 s).
const PACE: Duration = Duration::from_millis(30);
/// Kills happen for this long from the first request; then the keys a late kill left started
/// wait out their lease (`LEASE_SECONDS`) and are taken over by a retry or a worker.
const KILLING: Duration = Duration::from_secs(6);
const KILL_EVERY: Duration = Duration::from_millis(300);
/// Short, so that a killed request's key is taken over within the test (the provider call's
/// timeout is then 1 s, docs/operations.md).
const LEASE_SECONDS: &str = "4";
/// No client waits longer than this for its answer.
const PATIENCE: Duration = Duration::from_secs(60);

/// `IDEMFLOW_SEED`, or one from the clock.
fn seed() -> u64 {
    match std::env::var("IDEMFLOW_SEED") {
        Ok(seed) => seed.parse().expect("IDEMFLOW_SEED: an unsigned integer"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    }
}

/// The base URLs of the services alive now.
type Live = Arc<RwLock<Vec<String>>>;

/// What the clients went through before their answers.
#[derive(Default)]
struct Retries {
    connection_errors: AtomicUsize,
    in_progress: AtomicUsize,
    unavailable: AtomicUsize,
}

/// Sends `key` until a final answer comes, to the live services in turn from the `first`th.
async fn answer(
    client: &reqwest::Client,
    live: &Live,
    retries: &Retries,
    key: &str,
    first: usize,
) -> Answer {
    let started = Instant::now();
    let mut turn = first;
    loop {
        assert!(
            started.elapsed() < PATIENCE,
            "{key}: no answer in {PATIENCE:?}"
        );
        let base = {
            let live = live.read().unwrap();
            live[turn % live.len()].clone()
        };
        turn += 1;
        match post_checkout(client, &base, key).await {
            None => {
                retries.connection_errors.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Some(answer) if answer.status == 409 => {
                retries.in_progress.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(answer) if answer.status == 503 => {
                retries.unavailable.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Some(answer) => return answer,
        }
    }
}

async fn scalar(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

#[sqlx::test(migrations = false)]
async fn serves_and_workers_killed_at_random_execute_each_key_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let seed = seed();
    eprintln!("many_processes: seed {seed} (IDEMFLOW_SEED={seed} replays the kill schedule)");
    let mut rng = Rng::new(seed);
    let url = database_url(&connect);
    let pool = options
        .max_connections(2)
        .connect_with(connect)
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let built = Instant::now();
    let common = [
        "--database-url",
        url.as_str(),
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        LEASE_SECONDS,
    ];
    // Every process after the first changes no schema: start-up races are another test's.
    let no_migrate: Vec<&str> = common.iter().copied().chain(["--no-migrate"]).collect();

    // The schema, once: a service that migrates, stopped as soon as it listens.
    start_serve(&binary, "migrate", &common).await.0.kill();
    let mut serves = Vec::new();
    for i in 0..SERVES {
        serves.push(start_serve(&binary, &format!("serve {i}"), &no_migrate).await);
    }
    let mut workers = Vec::new();
    for i in 0..WORKERS {
        workers.push(start_worker(&binary, &format!("worker {i}"), &no_migrate).await);
    }
    let live: Live = Arc::new(RwLock::new(
        serves.iter().map(|(_, base)| base.clone()).collect(),
    ));

    // Every third charge is held a while at the provider: more requests in flight at a kill.
    let keys: Vec<String> = (0..KEYS).map(|i| format!("many-{i:03}")).collect();
    for key in keys.iter().step_by(3) {
        provider.push_fault_for(charge_key(key), Fault::Delay(Duration::from_millis(400)));
    }

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    let retries = Arc::new(Retries::default());
    let load_started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for (i, key) in keys.iter().enumerate() {
        let (client, live, retries, key) =
            (client.clone(), live.clone(), retries.clone(), key.clone());
        clients.spawn(async move {
            tokio::time::sleep(PACE * i as u32).await;
            let mut sends = tokio::task::JoinSet::new();
            for duplicate in 0..DUPLICATES {
                let (client, live, retries, key) =
                    (client.clone(), live.clone(), retries.clone(), key.clone());
                sends.spawn(
                    async move { answer(&client, &live, &retries, &key, i + duplicate).await },
                );
            }
            let mut answers = Vec::new();
            while let Some(joined) = sends.join_next().await {
                answers.push(joined.unwrap());
            }
            (key, answers)
        });
    }

    // The killer, here rather than in a task: the processes stay this function's, reaped by their
    // guards whatever happens.
    let (mut serve_kills, mut worker_kills, mut started) = (0, 0, SERVES + WORKERS);
    while load_started.elapsed() < KILLING {
        let pause =
            KILL_EVERY.as_millis() as u64 / 2 + rng.next_u64() % KILL_EVERY.as_millis() as u64;
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let name = format!("replacement {started}");
        started += 1;
        if rng.below(2) == 0 {
            let victim = rng.below(serves.len() as u64) as usize;
            let (process, base) = &mut serves[victim];
            live.write().unwrap().retain(|live| live != base);
            eprintln!("many_processes: kill {} ({base})", process.name);
            process.kill();
            serve_kills += 1;
            let replacement = start_serve(&binary, &name, &no_migrate).await;
            live.write().unwrap().push(replacement.1.clone());
            serves[victim] = replacement;
        } else {
            let victim = rng.below(workers.len() as u64) as usize;
            eprintln!("many_processes: kill {}", workers[victim].name);
            workers[victim].kill();
            worker_kills += 1;
            workers[victim] = start_worker(&binary, &name, &no_migrate).await;
        }
    }

    let mut answers: HashMap<String, Vec<Answer>> = HashMap::new();
    while let Some(joined) = clients.join_next().await {
        let (key, got) = joined.unwrap();
        answers.insert(key, got);
    }
    let load_time = load_started.elapsed();

    // Every client answered with a 201; at most one of a key's answers ran it (the others, and
    // every answer of a key a worker finished, are replays).
    let mut executed_by_clients = 0;
    for (key, got) in &answers {
        assert_eq!(got.len(), DUPLICATES, "{key}");
        for answer in got {
            assert_eq!(answer.status, 201, "{key}: {answer:?}");
        }
        let fresh = got.iter().filter(|answer| !answer.replayed).count();
        assert!(fresh <= 1, "{key}: {fresh} answers that executed it");
        executed_by_clients += fresh;
    }

    // Workers drain what is left: the leases of any key still started are ended rather than
    // waited for, and the workers woken.
    if scalar(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE state <> 'done'",
    )
    .await
        > 0
    {
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = least(locked_until, now()), \
             updated_at = now() WHERE state = 'started'",
        )
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(idemflow::postgres::DUE_CHANNEL)
            .execute(&pool)
            .await
            .unwrap();
        let draining = Instant::now();
        while scalar(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE state <> 'done'",
        )
        .await
            > 0
        {
            assert!(
                draining.elapsed() < Duration::from_secs(20),
                "keys left undone"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // Every key done with a 201, one paid order each, one charge each at the provider.
    let keys_by_state: Vec<(String, i16, i64)> = sqlx::query_as(
        "SELECT state::text, response_status::int2, count(*) FROM idempotency_keys \
         GROUP BY 1, 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        keys_by_state,
        vec![("done".to_owned(), 201, KEYS as i64)],
        "keys by state and stored status"
    );
    let orders: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT request_key, count(*), count(*) FILTER (WHERE status = 'paid') \
         FROM checkout_orders GROUP BY request_key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(orders.len(), KEYS, "keys with an order");
    for (key, count, paid) in &orders {
        assert_eq!((*count, *paid), (1, 1), "{key}: one order, paid");
    }
    let mut charges: HashMap<String, usize> = HashMap::new();
    for charge in provider.charges() {
        *charges.entry(charge.idempotency_key).or_default() += 1;
    }
    for key in &keys {
        assert_eq!(charges.get(&charge_key(key)), Some(&1), "{key}: one charge");
    }
    assert_eq!(provider.charges().len(), KEYS, "charges in all");

    // Each key once more: the stored answer, byte for byte every answer a client got for it.
    for key in &keys {
        let stored = answer(&client, &live, &retries, key, 0).await;
        assert_eq!((stored.status, stored.replayed), (201, true), "{key}");
        for got in &answers[key] {
            assert_eq!(
                got.body, stored.body,
                "{key}: an answer differs from the stored one"
            );
            assert_eq!(got.content_type, stored.content_type, "{key}");
        }
    }
    assert_eq!(provider.charges().len(), KEYS, "charges after the replays");

    eprintln!(
        "many_processes: seed {seed}: {serve_kills} serves and {worker_kills} workers killed in \
         {load_time:.1?}; {executed_by_clients} keys answered to a client by the request that \
         finished them, {} whose finishing answer no client got; retries: {} connection errors, {} 409, {} 503; \
         provider calls {} for {KEYS} charges; {:.1?} from the example built to the end",
        KEYS - executed_by_clients,
        retries.connection_errors.load(Ordering::Relaxed),
        retries.in_progress.load(Ordering::Relaxed),
        retries.unavailable.load(Ordering::Relaxed),
        provider.calls(),
        built.elapsed(),
    );
    drop(workers);
    drop(serves);
}
