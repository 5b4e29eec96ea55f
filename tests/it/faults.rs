//! Faults from outside, injected between the engine and PostgreSQL by the testkit's fault proxy:
//! every connection cut (a database restart, a pooler's recycling), a statement cut before its
//! answer, a database that stops answering. Every request ends, nothing runs twice, nothing is
//! lost, and the service serves again as soon as the database does.

use idemflow::PgStore;
use std::time::{Duration, Instant};

use idemflow::{Outcome, Runner};
use idemflow_testrig::faults::FaultProxy;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::*;

/// A pool of `size` connections through a fault proxy, every connection opened and idle, as the
/// engine recommends it be built (no test before acquire: a ping per request is a round trip).
pub(crate) async fn pool_through(
    options: PgPoolOptions,
    connect: PgConnectOptions,
    size: u32,
) -> (PgPool, FaultProxy) {
    let upstream = tokio::net::lookup_host((connect.get_host(), connect.get_port()))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await;
    let pool = options
        .max_connections(size)
        .min_connections(0)
        .test_before_acquire(false)
        .connect_with(connect.host("127.0.0.1").port(proxy.port()))
        .await
        .unwrap();
    let mut held = Vec::new();
    for _ in 0..size {
        held.push(pool.acquire().await.unwrap());
    }
    drop(held);
    // Released connections are pinged in the background: let them settle into the idle queue.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool.num_idle(), size as usize);
    (pool, proxy)
}

/// After the database drops every connection, each pooled connection used to fail one request
/// (a 503) before the pool noticed. A connection lost before the request's first statement ran
/// is replaced, and the request served.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_dead_pooled_connection_costs_no_client_a_failure(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, proxy) = pool_through(options, connect, 4).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let checkout = harness.checkout();
    let opened = proxy.connections();

    proxy.cut_all();
    // The cut reaches the sockets at once; the pool learns of it only on use.
    tokio::time::sleep(Duration::from_millis(50)).await;
    for index in 0..8 {
        let key = idemflow::Key::parse(&format!("after-cut-{index}")).unwrap();
        let outcome = runner
            .run(&checkout, &tenant(1), &key, request(&body(100 + index)))
            .await;
        assert!(
            matches!(outcome, Ok(Outcome::Executed(_))),
            "request {index} after the cut: {outcome:?}"
        );
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 8);
    assert_eq!(harness.provider.charge_count(), 8);
    assert!(
        proxy.connections() > opened,
        "fresh connections were opened"
    );
}

/// The same under concurrent load: every connection cut while 40 checkouts run. Each request
/// ends (answered, or told to come back and finished by the resumer); no order or charge is
/// doubled; none is lost; the service answers new requests right after.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_cut_under_load_loses_nothing_and_doubles_nothing(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, proxy) = pool_through(options, connect, 8).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.delay.lock().unwrap() = Some(Duration::from_millis(20));
    *harness.provider.timeout.lock().unwrap() = Some(Duration::from_secs(1));
    let runner = Runner::new(pool.clone());
    let checkout = std::sync::Arc::new(harness.checkout_leased(Duration::from_secs(2)));

    let requests = 40;
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..requests {
        let (runner, checkout) = (runner.clone(), checkout.clone());
        tasks.spawn(async move {
            tokio::time::sleep(Duration::from_millis(5 * index)).await;
            let key = idemflow::Key::parse(&format!("load-{index}")).unwrap();
            let body = body(1000 + index as i64);
            runner
                .run(&checkout, &tenant(1), &key, request(&body))
                .await
        });
    }
    tokio::time::sleep(Duration::from_millis(60)).await;
    proxy.cut_all();
    tokio::time::sleep(Duration::from_millis(40)).await;
    proxy.cut_all();
    let mut answered = 0;
    while let Some(joined) = tasks.join_next().await {
        match joined.unwrap() {
            Ok(Outcome::Executed(_)) => answered += 1,
            // Told to come back: the key is left for a retry or the resumer.
            Ok(Outcome::Interrupted { .. } | Outcome::InProgress { .. }) | Err(_) => {}
            Ok(other) => panic!("unexpected outcome {other:?}"),
        }
    }

    // The fault is over: new requests are served at once.
    let healed = Instant::now();
    let fresh = run(&runner, &checkout, &tenant(1), "after-the-cut", &body(7)).await;
    executed(&fresh);
    assert!(
        healed.elapsed() < Duration::from_secs(2),
        "{:?}",
        healed.elapsed()
    );

    // What the cut interrupted is finished by the resumer from its recovery point; every
    // request that was answered is among the keys that ran once.
    resume_everything(&pool, &runner, &harness, Duration::from_secs(2)).await;
    let keys = each_key_ran_once(&pool, &harness).await;
    assert!(answered < keys, "{answered} answered, {keys} keys");
    assert_eq!(
        harness.provider.keys().len() as i64,
        keys,
        "one derived key per request"
    );
}

/// A database that stops answering (every byte swallowed, no reset: a network partition, a host
/// gone) used to hold each request until the operating system gave up on its socket. Every wait
/// for the database is bounded by the runner's database timeout: requests end within it, and
/// once the database answers again they are served at once and what was cut is finished.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_database_that_stops_answering_fails_requests_within_a_bound(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, proxy) = pool_through(options, connect, 4).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.delay.lock().unwrap() = Some(Duration::from_millis(300));
    *harness.provider.timeout.lock().unwrap() = Some(Duration::from_secs(1));
    let wait = Duration::from_millis(400);
    let config = idemflow::RunnerConfig::default().with_database_timeout(wait);
    let runner = Runner::with_config(pool.clone(), config);
    let checkout = std::sync::Arc::new(harness.checkout_leased(Duration::from_secs(3)));
    // The bound a request may take once the database is gone: its current wait, and the failure
    // record's (a few statements) when the lost statement was a phase's.
    let bound = 6 * wait + Duration::from_millis(500);

    // One request is calling the provider when the database goes quiet: its record after the
    // call gets no answer.
    let in_call = {
        let (runner, checkout) = (runner.clone(), checkout.clone());
        tokio::spawn(async move {
            let key = idemflow::Key::parse("in-call").unwrap();
            let started = Instant::now();
            let body = body(5);
            let outcome = runner
                .run(&checkout, &tenant(1), &key, request(&body))
                .await;
            (outcome, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.blackhole(true);

    // New requests while the database is quiet, more than the pool has connections.
    let mut quiet = tokio::task::JoinSet::new();
    for index in 0..6 {
        let (runner, checkout) = (runner.clone(), checkout.clone());
        quiet.spawn(async move {
            let key = idemflow::Key::parse(&format!("quiet-{index}")).unwrap();
            let body = body(10 + index);
            let started = Instant::now();
            let outcome = runner
                .run(&checkout, &tenant(1), &key, request(&body))
                .await;
            (outcome, started.elapsed())
        });
    }
    while let Some(joined) = quiet.join_next().await {
        let (outcome, took) = joined.unwrap();
        assert!(
            matches!(outcome, Err(idemflow::RunError::DatabaseTimeout(_))),
            "{outcome:?}"
        );
        assert!(
            took <= bound,
            "a request waited {took:?} for a quiet database"
        );
    }
    let (outcome, took) = in_call.await.unwrap();
    assert!(outcome.is_err(), "{outcome:?}");
    assert!(
        took <= bound + Duration::from_millis(300),
        "the request in its call took {took:?}"
    );

    // The database answers again: requests are served within a bound.
    proxy.heal();
    let healed = Instant::now();
    let served = run(&runner, &checkout, &tenant(1), "after-the-quiet", &body(99)).await;
    executed(&served);
    assert!(
        healed.elapsed() < Duration::from_secs(2),
        "{:?}",
        healed.elapsed()
    );

    // The request cut in its call is finished from its recovery point, charged once.
    resume_everything(&pool, &runner, &harness, Duration::from_secs(3)).await;
    each_key_ran_once(&pool, &harness).await;
}

/// The database restarts under load: every connection cut, none accepted for a second and a half,
/// then back. Clients retry each request with its key until answered, as the client library does.
/// Every request is answered (0 lost), each executed once (0 duplicated), and the time from the
/// database's return to the first request served is reported and bounded.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_database_restart_under_load_loses_and_duplicates_nothing(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, proxy) = pool_through(options, connect, 8).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.delay.lock().unwrap() = Some(Duration::from_millis(10));
    *harness.provider.timeout.lock().unwrap() = Some(Duration::from_secs(1));
    let config =
        idemflow::RunnerConfig::default().with_database_timeout(Duration::from_millis(500));
    let runner = Runner::with_config(pool.clone(), config);
    let checkout = std::sync::Arc::new(harness.checkout_leased(Duration::from_secs(2)));
    // A resumer runs all along, as in production: it finishes what the restart interrupted.
    let mut registry = idemflow::Registry::new();
    registry
        .register(harness.checkout_leased(Duration::from_secs(2)))
        .unwrap();
    let resumer = idemflow::Resumer::with_config(
        runner.clone(),
        registry,
        idemflow::ResumerConfig::default()
            .with_idle_max(Duration::from_millis(200))
            .with_error_backoff_max(Duration::from_millis(500))
            .with_shutdown_grace(Duration::from_secs(2))
            .with_retention(None),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let resuming = tokio::spawn(async move {
        resumer
            .run(async {
                let _ = stopped.await;
            })
            .await
    });

    let started = Instant::now();
    let up_at = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let first_after_up = std::sync::Arc::new(std::sync::Mutex::new(None::<Instant>));
    let clients = 16;
    let per_client = 12;
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let (runner, checkout) = (runner.clone(), checkout.clone());
        let (up_at, first_after_up) = (up_at.clone(), first_after_up.clone());
        tasks.spawn(async move {
            for request_number in 0..per_client {
                let key =
                    idemflow::Key::parse(&format!("restart-{client}-{request_number}")).unwrap();
                let body = body(i64::from(client * 100 + request_number));
                let mut tries = 0;
                loop {
                    tries += 1;
                    assert!(tries < 200, "{key:?} never answered");
                    let outcome = runner
                        .run(&checkout, &tenant(1), &key, request(&body))
                        .await;
                    if let Ok(Outcome::Executed(_) | Outcome::Replayed(_)) = outcome {
                        let up = *up_at.lock().unwrap();
                        if let Some(up) = up {
                            first_after_up
                                .lock()
                                .unwrap()
                                .get_or_insert(Instant::now().max(up));
                        }
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    proxy.down(true);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.down(false);
    *up_at.lock().unwrap() = Some(Instant::now());
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap();
    }
    let _ = stop.send(());
    resuming.await.unwrap();

    let up = up_at.lock().unwrap().unwrap();
    let recovered = first_after_up
        .lock()
        .unwrap()
        .map(|first| first.duration_since(up));
    println!(
        "database restart: {} requests in {:?}; first request served {:?} after the database was back",
        clients * per_client,
        started.elapsed(),
        recovered
    );
    let recovered = recovered.expect("a request was served after the restart");
    assert!(
        recovered < Duration::from_secs(2),
        "recovered after {recovered:?}"
    );

    let requests = i64::from(clients * per_client);
    let keys = each_key_ran_once(&pool, &harness).await;
    assert_eq!(
        keys, requests,
        "every request answered and finished (0 lost)"
    );
}

/// Every statement of a checkout, in turn, is cut after it reached the server and before its
/// answer came back: the look-up, the claim with its `BEGIN`, the phase's insert, each record,
/// each `COMMIT` (which may have committed without the client knowing). Generated, not listed:
/// the sweep goes on until a request sends fewer statements than the cut's position. After each
/// cut the client retries with its key until answered (a resumer finishing what the cut left):
/// one order and one charge per key, the key finished, and a first answer, if the client got
/// one, is what every retry replays.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_cut_at_every_statement_of_a_checkout_runs_it_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // The test's own reads and rewinds go straight to the database, past the proxy.
    let observer = PgPool::connect_with(connect.clone()).await.unwrap();
    let (engine_pool, proxy) = pool_through(options, connect, 2).await;
    create_orders(&observer).await;
    let pool = observer;
    let harness = Harness::default();
    *harness.provider.timeout.lock().unwrap() = Some(Duration::from_secs(1));
    let runner = Runner::new(engine_pool.clone());
    let checkout = harness.checkout_leased(Duration::from_secs(2));
    let mut registry = idemflow::Registry::new();
    registry
        .register(harness.checkout_leased(Duration::from_secs(2)))
        .unwrap();
    let resumer = idemflow::Resumer::new(runner.clone(), registry);
    // Statements prepared on both connections first, so every position is the request's own.
    for warm in 0..2 {
        executed(
            &run(
                &runner,
                &checkout,
                &tenant(1),
                &format!("warm-{warm}"),
                &body(1),
            )
            .await,
        );
    }

    let mut position = 1;
    loop {
        let key = format!("cut-{position}");
        let body = body(i64::from(position));
        proxy.cut_statement(position);
        let first = run_key(&runner, &checkout, &key, &body).await;
        if proxy.cut_pending() {
            // The request sent fewer statements than `position`: every one has been cut.
            proxy.heal();
            executed(&first.expect("an uncut request runs"));
            break;
        }
        // Retry until answered, as a client does; what the cut left is the resumer's too.
        let mut answer = None;
        for _ in 0..20 {
            if let Some(Outcome::Executed(response) | Outcome::Replayed(response)) =
                run_key(&runner, &checkout, &key, &body).await
            {
                answer = Some(response);
                break;
            }
            // The key may have no row yet: a cut session may still be ending on the server with
            // its claim in flight (the retry got 409), and that claim then vanishes.
            sqlx::query(
                "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' \
                 WHERE key = $1 AND state = 'started'",
            )
            .bind(&key)
            .execute(&pool)
            .await
            .unwrap();
            resumer.drain().await.unwrap();
            // As a client would, wait a moment before the next retry.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let answer = answer.unwrap_or_else(|| panic!("{key} never answered"));
        if let Some(Outcome::Executed(response)) = &first {
            assert_eq!(
                response, &answer,
                "{key}: the replay differs from the first answer"
            );
        }
        let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders WHERE key = $1")
            .bind(&key)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(orders, 1, "{key}: {orders} orders");
        position += 1;
        assert!(position < 40, "the sweep never ended");
    }
    println!(
        "cut each of the {} statements of a checkout in turn",
        position - 1
    );
    assert!(
        position > 8,
        "a checkout sends more statements than {position}"
    );
    each_key_ran_once(&pool, &harness).await;
}

/// Ends every lease and lets a resumer finish what is left, from its recovery point.
async fn resume_everything(
    pool: &PgPool,
    runner: &Runner<PgStore>,
    harness: &Harness,
    lease: Duration,
) {
    expire_all_leases(pool).await;
    let mut registry = idemflow::Registry::new();
    registry.register(harness.checkout_leased(lease)).unwrap();
    idemflow::Resumer::new(runner.clone(), registry)
        .drain()
        .await
        .unwrap();
}

/// Nothing lost, nothing doubled: every key finished, one order and one charge per key.
/// Returns the number of keys.
async fn each_key_ran_once(pool: &PgPool, harness: &Harness) -> i64 {
    let unfinished = count(
        pool,
        "SELECT count(*) FROM idempotency_keys WHERE state <> 'done'",
    )
    .await;
    assert_eq!(unfinished, 0, "every started key was finished");
    let doubled = count(
        pool,
        "SELECT count(*) FROM (SELECT key FROM orders GROUP BY key HAVING count(*) > 1) doubled",
    )
    .await;
    assert_eq!(doubled, 0, "an order was created twice for one key");
    let keys = count(pool, "SELECT count(*) FROM idempotency_keys").await;
    assert_eq!(
        count(pool, "SELECT count(*) FROM orders").await,
        keys,
        "an order without its key, or a key without its order"
    );
    assert_eq!(harness.provider.charge_count() as i64, keys);
    keys
}

/// One attempt of `key`; `None` when it ended in an error (the cut connection, say).
async fn run_key(
    runner: &Runner<PgStore>,
    workflow: &idemflow::Workflow<PgStore>,
    key: &str,
    body: &[u8],
) -> Option<Outcome> {
    let key = idemflow::Key::parse(key).unwrap();
    runner
        .run(workflow, &tenant(1), &key, request(body))
        .await
        .ok()
}

/// A slow network (every message to the database delayed): requests take longer, and nothing
/// else changes: each is executed once, with the round trips of a fast network.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_slow_network_changes_nothing_but_time(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, proxy) = pool_through(options, connect, 4).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let checkout = std::sync::Arc::new(harness.checkout());
    let batch = |prefix: &'static str| {
        let (runner, checkout) = (runner.clone(), checkout.clone());
        async move {
            let mut tasks = tokio::task::JoinSet::new();
            for index in 0..8 {
                let (runner, checkout) = (runner.clone(), checkout.clone());
                tasks.spawn(async move {
                    let key = format!("{prefix}-{index}");
                    executed(&run(&runner, &checkout, &tenant(1), &key, &body(index)).await).clone()
                });
            }
            while let Some(joined) = tasks.join_next().await {
                joined.unwrap();
            }
        }
    };
    batch("warm").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = proxy.counts().snapshot();
    batch("fast").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let fast = proxy.counts().snapshot() - before;

    proxy.delay(Duration::from_millis(15));
    let started = Instant::now();
    let before = proxy.counts().snapshot();
    batch("slow").await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let slow = proxy.counts().snapshot() - before;
    proxy.delay(Duration::ZERO);

    assert!(
        started.elapsed() >= Duration::from_millis(15 * 9),
        "the delay was felt"
    );
    assert_eq!(slow.round_trips, fast.round_trips, "{slow:?} vs {fast:?}");
    assert_eq!(slow.commits, fast.commits, "{slow:?} vs {fast:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 24);
}

/// Sessions the server ended while they sat idle in the pool (`idle_session_timeout`: FATAL
/// 57P05, not a cut the pool sees) cost no client a failure, at the look-up and equally at the
/// fence confirmation before a call (its renewal is the first statement on a connection taken from
/// the pool, here the oldest idle one, dead). Without warm connections every statement but the
/// claim's takes a connection from the pool.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn sessions_the_server_ended_while_idle_cost_no_client_a_failure(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let size = 4;
    let pool = options
        .max_connections(size)
        .min_connections(0)
        .test_before_acquire(false)
        .connect_with(connect.options([("idle_session_timeout", "300")]))
        .await
        .unwrap();
    create_orders(&pool).await;
    let harness = Harness::default();
    // A charge timeout so close to the lease that every call confirms its fence first.
    *harness.provider.timeout.lock().unwrap() = Some(Duration::from_millis(1900));
    let checkout = harness.checkout_leased(Duration::from_secs(2));
    let runner = Runner::with_config(
        pool.clone(),
        idemflow::RunnerConfig::default().with_warm_connections(false),
    );
    for round in 0..3 {
        let mut held = Vec::new();
        for _ in 0..size {
            held.push(pool.acquire().await.unwrap());
        }
        drop(held);
        // What is under test is the server's own idle timeout: the sessions must sit idle past
        // it, and the server ends each with a FATAL 57P05 the pool learns of only on use.
        tokio::time::sleep(Duration::from_millis(700)).await;
        let key = format!("after-idle-{round}");
        let outcome = run(&runner, &checkout, &tenant(1), &key, &body(100 + round)).await;
        assert!(
            matches!(outcome, Outcome::Executed(_)),
            "round {round}: {outcome:?}"
        );
    }
    // The connection the commit before the call handed back dies idle while the owner pauses
    // (a slow process): the fence confirmation's renewal is the first statement on it.
    let paused = runner
        .clone()
        .with_crash_hook(std::sync::Arc::new(PauseAfterCommit));
    let outcome = run(&paused, &checkout, &tenant(1), "paused", &body(200)).await;
    assert!(matches!(outcome, Outcome::Executed(_)), "{outcome:?}");
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 4);
    assert_eq!(harness.provider.charge_count(), 4);
}

/// Pauses a run after the commit before its call, past the sessions' idle timeout.
#[derive(Debug)]
struct PauseAfterCommit;

#[idemflow::async_trait]
impl idemflow::CrashHook for PauseAfterCommit {
    async fn crash_at(
        &self,
        point: &idemflow::CrashPoint,
        _: &idemflow::TenantId,
        _: &idemflow::Key,
    ) -> bool {
        if matches!(point, idemflow::CrashPoint::AfterCommit { .. }) {
            tokio::time::sleep(Duration::from_millis(700)).await;
        }
        false
    }
}
