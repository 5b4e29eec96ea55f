//! Load with faults, as real processes of the checkout example against the testkit's mock
//! provider (in this process, so its ledger counts what was really charged): a duplicate storm
//! over HTTP, and a mass crash of two services with requests in flight recovered by two worker
//! processes. Every process is killed by its guard when a test fails. The same at full size, with
//! the figures, is the benchmark's provider-storm and mass-crash workloads (docs/benchmarks.md).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::support::example::{
    Answer, charge_key, database_url, example_binary, post_checkout, start_serve, start_worker,
};
use idemflow_testkit::provider::{Fault, MockProvider};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The services' and workers' common arguments.
fn common<'a>(url: &'a str, provider: &'a MockProvider) -> [&'a str; 6] {
    [
        "--database-url",
        url,
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        "30",
    ]
}

/// Keys by state and their orders by status, for the keys starting with `prefix`.
async fn count(pool: &PgPool, sql: &str, prefix: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .bind(format!("{prefix}%"))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Every key of `keys`: done with a stored 201, one paid order, one charge under its derived key
/// at the provider.
async fn assert_once_each(pool: &PgPool, provider: &MockProvider, prefix: &str, keys: &[String]) {
    let done = count(
        pool,
        "SELECT count(*) FROM idempotency_keys \
         WHERE key LIKE $1 AND state = 'done' AND response_status = 201",
        prefix,
    )
    .await;
    assert_eq!(done, keys.len() as i64, "keys done with a 201");
    let orders: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT request_key, count(*), count(*) FILTER (WHERE status = 'paid') \
         FROM checkout_orders WHERE request_key LIKE $1 GROUP BY request_key",
    )
    .bind(format!("{prefix}%"))
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(orders.len(), keys.len(), "keys with an order");
    for (key, count, paid) in &orders {
        assert_eq!((*count, *paid), (1, 1), "{key}: one order, paid");
    }
    let mut charges: HashMap<String, usize> = HashMap::new();
    for charge in provider.charges() {
        *charges.entry(charge.idempotency_key).or_default() += 1;
    }
    for key in keys {
        assert_eq!(
            charges.get(&charge_key(key)).copied(),
            Some(1),
            "{key}: one charge"
        );
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_duplicate_storm_over_http_executes_each_key_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    const KEYS: usize = 40;
    const DUPLICATES: usize = 8;
    const CLIENTS: usize = 16;
    let url = database_url(&connect);
    let pool = options
        .max_connections(2)
        .connect_with(connect)
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let common = common(&url, &provider);
    let (_service, base) = start_serve(&binary, "serve", &common).await;

    // The sends of one key are consecutive in one queue that all clients take from: they are
    // taken by different clients at nearly the same moment, and run concurrently.
    let keys: Vec<String> = (0..KEYS).map(|i| format!("storm-{i:02}")).collect();
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let client = reqwest::Client::new();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        let (client, base, keys, next) = (client.clone(), base.clone(), keys.clone(), next.clone());
        clients.spawn(async move {
            let mut answers = Vec::new();
            loop {
                let send = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if send >= KEYS * DUPLICATES {
                    return answers;
                }
                let key = &keys[send / DUPLICATES];
                let answer = post_checkout(&client, &base, key).await.expect("an answer");
                answers.push((key.clone(), answer));
            }
        });
    }
    let mut answers = Vec::new();
    while let Some(joined) = clients.join_next().await {
        answers.extend(joined.unwrap());
    }
    assert_eq!(answers.len(), KEYS * DUPLICATES);

    let mut first: HashMap<&str, &Answer> = HashMap::new();
    let (mut replays, mut conflicts) = (0, 0);
    for (key, answer) in &answers {
        match (answer.status, answer.replayed) {
            (201, false) => {
                assert!(
                    first.insert(key.as_str(), answer).is_none(),
                    "{key} executed twice"
                );
            }
            (201, true) => replays += 1,
            (409, false) => conflicts += 1,
            _ => panic!("{key}: unexpected {answer:?}"),
        }
    }
    assert_eq!(first.len(), KEYS, "one first answer per key");
    for (key, answer) in &answers {
        if answer.replayed {
            assert_eq!(answer.body, first[key.as_str()].body, "{key}: replay");
        }
    }
    assert_eq!(replays + conflicts, KEYS * (DUPLICATES - 1));
    assert_once_each(&pool, &provider, "storm-", &keys).await;
    assert_eq!(provider.charges().len(), KEYS);
    assert_eq!(provider.calls(), KEYS, "one provider call per key");
}

/// Waits until `done` or panics after `limit`.
async fn wait_until<F, Fut>(limit: Duration, what: &str, mut done: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn two_services_killed_with_requests_in_flight_are_recovered_by_two_workers(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    /// Finished before the kill, one after the other, their answers kept.
    const ANSWERED: usize = 20;
    /// In flight at the kill: half held by the provider without an answer (never executed),
    /// half executed by it after the kill, their callers gone.
    const IN_FLIGHT: usize = 200;
    let url = database_url(&connect);
    let pool = options
        .max_connections(2)
        .connect_with(connect)
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let common = common(&url, &provider);
    let (mut first_service, first_url) = start_serve(&binary, "serve 1", &common).await;
    let (mut second_service, second_url) = start_serve(&binary, "serve 2", &common).await;
    // Running from the start, as in production: idle until leases end.
    let workers = [
        start_worker(&binary, "worker 1", &common).await,
        start_worker(&binary, "worker 2", &common).await,
    ];
    let bases = [first_url, second_url];
    let client = reqwest::Client::new();

    let mut first: HashMap<String, Answer> = HashMap::new();
    let mut keys = Vec::new();
    for i in 0..ANSWERED {
        let key = format!("crash-answered-{i:02}");
        let answer = post_checkout(&client, &bases[i % 2], &key).await.unwrap();
        assert_eq!((answer.status, answer.replayed), (201, false), "{answer:?}");
        first.insert(key.clone(), answer);
        keys.push(key);
    }

    let delay = Duration::from_secs(3);
    let in_flight: Vec<String> = (0..IN_FLIGHT)
        .map(|i| format!("crash-in-flight-{i:03}"))
        .collect();
    let mut delayed = Vec::new();
    for (i, key) in in_flight.iter().enumerate() {
        if i % 2 == 0 {
            provider.push_fault_for(charge_key(key), Fault::Timeout);
        } else {
            provider.push_fault_for(charge_key(key), Fault::Delay(delay));
            delayed.push(charge_key(key));
        }
    }
    let mut requests = tokio::task::JoinSet::new();
    for (i, key) in in_flight.iter().enumerate() {
        let (client, base, key) = (client.clone(), bases[i % 2].clone(), key.clone());
        requests.spawn(async move {
            let answer = post_checkout(&client, &base, &key).await;
            (key, answer)
        });
    }
    keys.extend(in_flight.iter().cloned());
    let total = ANSWERED + IN_FLIGHT;

    // Every request's call has reached the provider: kill both services at once.
    wait_until(
        Duration::from_secs(60),
        "every call reaching the provider",
        || async { provider.calls() >= total },
    )
    .await;
    first_service.signal_kill();
    second_service.signal_kill();
    first_service.kill();
    second_service.kill();
    let mut unanswered = 0;
    while let Some(joined) = requests.join_next().await {
        let (key, answer) = joined.unwrap();
        match answer {
            // A delayed charge that finished before the kill on a slow machine.
            Some(answer) => {
                assert_eq!((answer.status, answer.replayed), (201, false), "{answer:?}");
                first.insert(key, answer);
            }
            None => unanswered += 1,
        }
    }
    // The held calls can only have ended with their callers.
    assert!(
        unanswered >= IN_FLIGHT / 2,
        "{unanswered} in flight at the kill"
    );
    let started = count(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE key LIKE $1 AND state = 'started'",
        "crash-",
    )
    .await;
    // The held ones at least; an answer lost with its service leaves a key done, unanswered.
    assert!(
        started >= (IN_FLIGHT / 2) as i64 && started <= unanswered as i64,
        "{started} keys left started by the kill, {unanswered} requests unanswered"
    );

    // The provider executes the delayed charges of callers now gone; then the leases of the
    // keys the crash left started are ended (rather than waited for: 30 s), and the workers,
    // woken by the announcement, finish them.
    wait_until(
        Duration::from_secs(30),
        "the provider finishing its calls",
        || async { !delayed.iter().any(|key| provider.is_in_flight(key)) },
    )
    .await;
    assert_eq!(provider.pending_faults(), 0);
    eprintln!(
        "killed with {unanswered} of {total} requests unanswered, {started} keys started; \
         provider charges {}",
        provider.charges().len()
    );
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = least(locked_until, now()), updated_at = now() \
         WHERE state = 'started' AND key LIKE 'crash-%'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(idemflow::postgres::DUE_CHANNEL)
        .execute(&pool)
        .await
        .unwrap();
    wait_until(Duration::from_secs(60), "every key done", || async {
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE key LIKE $1 AND state = 'started'",
            "crash-",
        )
        .await
            == 0
    })
    .await;
    drop(workers);

    assert_once_each(&pool, &provider, "crash-", &keys).await;
    assert_eq!(provider.charges().len(), total);
    for key in &in_flight {
        // The killed call and the worker's: the second replayed or made the one charge.
        assert!(provider.calls_for(&charge_key(key)) <= 2, "{key}");
    }

    // Every key again, through a new service: the stored answers, byte for byte the first ones
    // where a client got one; nothing executed again.
    let (_service, base) = start_serve(&binary, "serve 3", &common).await;
    for key in &keys {
        let answer = post_checkout(&client, &base, key).await.unwrap();
        assert_eq!((answer.status, answer.replayed), (201, true), "{key}");
        if let Some(original) = first.get(key) {
            assert_eq!(answer.body, original.body, "{key}: replayed body");
            assert_eq!(answer.content_type, original.content_type, "{key}");
        }
    }
    assert_eq!(provider.charges().len(), total);
    let orders = count(
        &pool,
        "SELECT count(*) FROM checkout_orders WHERE request_key LIKE $1",
        "crash-",
    )
    .await;
    assert_eq!(orders, total as i64);
}
