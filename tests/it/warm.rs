//! Warm connections: the runner keeps a connection between requests when it knows it is clean
//! (right after its look-up answered, or its `COMMIT` succeeded), instead of handing it back to
//! sqlx's pool, which tests every returned connection with a round trip. These tests hold what
//! that must not break: the kept connections are idle outside any transaction, a kept connection
//! the server ended is replaced, a caller waiting on the pool itself is served while the runner
//! is busy, closing the pool is not held up, and with keeping turned off every connection goes
//! through the pool and its hooks.

use idemflow::PgStore;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::support::*;
use idemflow::{Outcome, Runner, RunnerConfig};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A pool of `size` whose sessions are named, so the test finds their server processes.
async fn named_pool(options: PgPoolOptions, connect: PgConnectOptions, size: u32) -> PgPool {
    options
        .max_connections(size)
        .test_before_acquire(false)
        // Far beyond what any test here waits: a caller left waiting fails the test loudly.
        .acquire_timeout(Duration::from_secs(20))
        .connect_with(connect.application_name("idemflow-warm-test"))
        .await
        .unwrap()
}

/// The state of every session of the named pool, as the server sees it.
async fn session_states(observer: &PgPool) -> Vec<(i32, String)> {
    sqlx::query_as(
        "SELECT pid, state FROM pg_stat_activity \
         WHERE application_name = 'idemflow-warm-test' AND datname = current_database() \
         ORDER BY pid",
    )
    .fetch_all(observer)
    .await
    .unwrap()
}

/// A connection to the same database outside the pool under test.
async fn observer(connect: &PgConnectOptions) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap()
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn kept_connections_are_idle_outside_any_transaction(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let observer = observer(&connect).await;
    let pool = named_pool(options, connect, 4).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let (checkout, local_only) = (Arc::new(harness.checkout()), Arc::new(harness.local_only()));
    // New keys (one transaction; two around a foreign call), replays, a 422, at once.
    let mut requests = Vec::new();
    for n in 0..12u64 {
        let runner = runner.clone();
        let workflow = if n % 2 == 0 {
            checkout.clone()
        } else {
            local_only.clone()
        };
        requests.push(tokio::spawn(async move {
            let key = format!("k{}", n % 6);
            run(
                &runner,
                &workflow,
                &tenant(1),
                &key,
                &body(1 + (n / 6) as i64),
            )
            .await
        }));
    }
    for request in requests {
        let outcome = request.await.unwrap();
        assert!(
            matches!(
                outcome,
                Outcome::Executed(_)
                    | Outcome::Replayed(_)
                    | Outcome::Mismatch
                    | Outcome::InProgress { .. }
            ),
            "{outcome:?}"
        );
    }
    // Every session the runner holds or gave back is idle: none is left inside a transaction
    // (a kept one would carry it into the next request).
    let states = session_states(&observer).await;
    assert!(!states.is_empty(), "the pool's sessions are visible");
    assert!(
        states.iter().all(|(_, state)| state == "idle"),
        "{states:?}"
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_kept_connection_the_server_ended_is_replaced(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let observer = observer(&connect).await;
    let pool = named_pool(options, connect, 2).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.local_only();
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await);
    // The runner keeps its connection: the server ends every session of the pool.
    for (pid, _) in session_states(&observer).await {
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
            .bind(pid)
            .fetch_one(&observer)
            .await
            .unwrap();
        assert!(ended);
    }
    // The retry is answered from a live connection; so is a new key.
    let replayed = run(&runner, &workflow, &tenant(1), "k", &body(1)).await;
    assert!(matches!(replayed, Outcome::Replayed(_)), "{replayed:?}");
    executed(&run(&runner, &workflow, &tenant(1), "k2", &body(1)).await);
}

/// The runner never hands its connections back to the pool while it is busy, but one release
/// in sixteen goes back anyway: a caller waiting on the pool itself (a handler sharing it, a
/// resumer's scan, a heartbeat) gets one while the runner keeps every other connection busy.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_caller_waiting_on_the_pool_is_served_while_the_runner_is_busy(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = named_pool(options, connect, 2).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = Arc::new(harness.local_only());
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await);
    // Four clients replaying without pause on the pool's two connections: both cycle through
    // the runner (kept, or handed to a waiting request), never idle long enough to be given back
    // for idleness.
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for _ in 0..4 {
        let (runner, workflow, stop) = (runner.clone(), workflow.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let mut replays = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let outcome = run(&runner, &workflow, &tenant(1), "k", &body(1)).await;
                assert!(matches!(outcome, Outcome::Replayed(_)), "{outcome:?}");
                replays += 1;
            }
            replays
        }));
    }
    // Let both clients hold a connection each before asking the pool for one.
    tokio::time::timeout(Duration::from_secs(10), async {
        while pool.size() < 2 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the pool opened both connections");
    let mut served = 0;
    for _ in 0..5 {
        // Fails with PoolTimedOut after 20 s if the runner starves the pool's own callers.
        let connection = pool.acquire().await.expect("served from the pool");
        drop(connection);
        served += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let mut replays = 0;
    for client in clients {
        replays += client.await.unwrap();
    }
    assert_eq!(served, 5);
    assert!(replays > 0, "the runner was busy meanwhile");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn connections_kept_idle_go_back_to_the_pool(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = named_pool(options, connect, 1).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.local_only();
    executed(&run(&runner, &workflow, &tenant(1), "a", &body(1)).await);
    // The runner keeps the pool's one connection; a caller of the pool itself gets it once it
    // has been kept idle for a while.
    assert_eq!((pool.size(), pool.num_idle()), (1, 0));
    let connection = pool
        .acquire()
        .await
        .expect("the idle kept connection came back");
    drop(connection);
    // Closing the pool waits for every connection: the runner gives back what it keeps.
    executed(&run(&runner, &workflow, &tenant(1), "b", &body(1)).await);
    tokio::time::timeout(Duration::from_secs(10), pool.close())
        .await
        .expect("closing the pool is not held up by the runner's connections");
    assert!(pool.is_closed());
    drop(runner);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn with_warm_connections_off_every_request_hands_its_connection_to_the_pool_and_its_hooks(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // The pool's hooks count what passes through them: a pool whose `after_release` resets
    // session state must see every connection between two requests.
    let (acquired, released) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let options = {
        let (acquired, released) = (acquired.clone(), released.clone());
        options
            .before_acquire(move |_, _| {
                acquired.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(true) })
            })
            .after_release(move |_, _| {
                released.fetch_add(1, Ordering::SeqCst);
                Box::pin(async { Ok(true) })
            })
    };
    let pool = named_pool(options, connect, 2).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let workflow = harness.local_only();
    let requests = 6;

    // Off: each request (new keys and replays) takes its connection from the pool and gives it
    // back, so the hooks run for each, and nothing is held between requests.
    let config = RunnerConfig::default().with_warm_connections(false);
    let runner = Runner::with_config(pool.clone(), config);
    // New keys, then replays of them.
    let workflow = &workflow;
    let request = |runner: Runner<PgStore>, n: usize| async move {
        run(
            &runner,
            workflow,
            &tenant(1),
            &format!("k{}", n % 3),
            &body(1),
        )
        .await
    };
    for n in 0..requests {
        let outcome = request(runner.clone(), n).await;
        assert!(
            matches!(outcome, Outcome::Executed(_) | Outcome::Replayed(_)),
            "{outcome:?}"
        );
        // The release is sqlx's, in a task of its own: wait for it.
        tokio::time::timeout(Duration::from_secs(10), async {
            while released.load(Ordering::SeqCst) <= n || pool.num_idle() != pool.size() as usize {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the request's connection went back to the pool, through its hook");
    }
    assert!(acquired.load(Ordering::SeqCst) >= requests - 1);

    // On (the default): the same requests keep their connection, and the hooks do not see it.
    let before = released.load(Ordering::SeqCst);
    let runner = Runner::new(pool.clone());
    for n in 0..requests {
        request(runner.clone(), n).await;
    }
    assert_eq!(
        pool.num_idle() + 1,
        pool.size() as usize,
        "one connection kept"
    );
    assert!(released.load(Ordering::SeqCst) - before < requests);
}
