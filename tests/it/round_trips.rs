//! Commits and round trips per request, counted on the wire between the pool and PostgreSQL.
//!
//! The rule: a new request commits 1 + (number of foreign phases) times. The claim commits with
//! the local phases before the first foreign call; each foreign result commits with the local
//! phases after it (and with finish). Round trips are the engine's statements plus BEGIN and
//! COMMIT; the phases' own statements are counted separately (one each here). A new key's claim
//! shares its message with the BEGIN of its transaction.

use crate::support::wire::{Counts, WireCounts, start_proxy};
use crate::support::*;
use idemflow::PgStore;
use idemflow::{Outcome, Runner, Workflow};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A pool of one connection through the counting proxy, with statements already prepared, so
/// what is counted is one request's steady-state traffic.
async fn counted_pool(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) -> (sqlx::PgPool, std::sync::Arc<WireCounts>) {
    let upstream = tokio::net::lookup_host((connect.get_host(), connect.get_port()))
        .await
        .unwrap()
        .next()
        .unwrap();
    let (port, counts) = start_proxy(upstream).await;
    let pool = options
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(connect.host("127.0.0.1").port(port))
        .await
        .unwrap();
    (pool, counts)
}

/// Runs `warm_up` first, then `key`, and counts the second run: the first use of a statement on
/// a connection also prepares it, and preparing is not what is measured.
async fn measure(
    runner: &Runner<PgStore>,
    workflow: &Workflow<PgStore>,
    counts: &WireCounts,
    warm_up: &str,
    key: &str,
) -> (Outcome, Counts) {
    run(runner, workflow, &tenant(1), warm_up, &body(1)).await;
    // A released connection is pinged (and a dropped transaction rolled back) in the
    // background: let the warm-up's settle before counting.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let before = counts.snapshot();
    let outcome = run(runner, workflow, &tenant(1), key, &body(1)).await;
    // The pool pings a released connection in the background; let that settle before reading.
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    (outcome, counts.snapshot() - before)
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_local_only_request_is_one_transaction(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let (outcome, used) = measure(&runner, &harness.local_only(), &counts, "warm-up", "k").await;
    executed(&outcome);
    assert_eq!(used.commits, 1, "{used:?}");
    // Look-up, BEGIN with the claim, place_order's insert, finish, COMMIT.
    assert_eq!(used.round_trips, 4 + 1, "{used:?}");
    // The look-up's connection goes on to hold the claim, and the runner keeps it after the
    // COMMIT (a warm connection): no release ping.
    assert_eq!(used.pings, 0, "{used:?}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn local_foreign_local_commits_twice(options: PgPoolOptions, connect: PgConnectOptions) {
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let (outcome, used) = measure(&runner, &harness.checkout(), &counts, "warm-up", "k").await;
    executed(&outcome);
    assert_eq!(used.commits, 2, "{used:?}");
    // Look-up, BEGIN with the claim, create_order's insert, advance, COMMIT; the charge; BEGIN,
    // mark_paid's update, finish, COMMIT.
    assert_eq!(used.round_trips, 7 + 2, "{used:?}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn two_foreign_phases_commit_three_times(options: PgPoolOptions, connect: PgConnectOptions) {
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let (outcome, used) = measure(&runner, &harness.two_foreign(), &counts, "warm-up", "k").await;
    executed(&outcome);
    assert_eq!(used.commits, 3, "{used:?}");
    // As above, plus BEGIN, advance (the charge's result), COMMIT before the receipt.
    assert_eq!(used.round_trips, 10 + 2, "{used:?}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_replay_commits_nothing(options: PgPoolOptions, connect: PgConnectOptions) {
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.checkout();
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await);
    executed(&run(&runner, &workflow, &tenant(1), "warm-up", &body(1)).await);
    let (outcome, used) = measure(&runner, &workflow, &counts, "warm-up", "k").await;
    assert!(matches!(outcome, Outcome::Replayed(_)), "{outcome:?}");
    assert_eq!(used.commits, 0, "{used:?}");
    // The look-up alone, outside any transaction, on the connection the last request kept.
    assert_eq!(used.round_trips, 1, "{used:?}");
    assert_eq!(used.pings, 0, "{used:?}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_key_resumed_before_a_foreign_phase_calls_out_at_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.checkout();
    executed(&run(&runner, &workflow, &tenant(1), "warm-up", &body(1)).await);
    // The charge fails once: the key stays at create_order, released for a retry.
    harness
        .provider
        .script
        .fail_next
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let interrupted = run(&runner, &workflow, &tenant(1), "k", &body(1)).await;
    assert!(
        matches!(interrupted, Outcome::Interrupted { .. }),
        "{interrupted:?}"
    );
    expire_lease(&pool, "k").await;
    let mut connection = pool.acquire().await.unwrap();
    let due = idemflow_pg::take_over_due(
        &mut connection,
        &[(workflow.name().to_owned(), workflow.lease())],
        10,
    )
    .await
    .unwrap();
    drop(connection);
    let taken = due.into_iter().next().unwrap().1;
    assert_eq!(taken.recovery_point, "create_order");

    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let before = counts.snapshot();
    let outcome = runner.resume(&workflow, taken).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let used = counts.snapshot() - before;
    executed(&outcome);
    // The takeover is already committed, so nothing is committed before the charge, and it was
    // made a moment ago: its lease covers the call without a renewal. The charge; BEGIN,
    // mark_paid's update, finish, COMMIT.
    assert_eq!((used.commits, used.round_trips), (1, 3 + 1), "{used:?}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_duplicate_of_a_key_being_claimed_is_answered_in_one_round_trip(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let direct = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.checkout();
    executed(&run(&runner, &workflow, &tenant(1), "warm-up", &body(1)).await);

    // Another request's claim of "k", open (uncommitted) on a connection of its own.
    let (key, fingerprint, request) = (
        idemflow::Key::parse("k").unwrap(),
        idemflow::Fingerprint::from_slice(&[1; 32]).unwrap(),
        serde_json::json!({"amount": 1, "source": "tok_visa"}),
    );
    let tenant = tenant(1);
    let claim = idemflow_pg::ClaimRequest {
        tenant: &tenant,
        key: &key,
        lock_version: 1 << 40,
        fingerprint: &fingerprint,
        workflow: workflow.name(),
        request: &request,
        lease: workflow.lease(),
    };
    let idemflow_pg::Claimed::Owned(held, _) =
        idemflow_pg::begin_claim(direct.acquire().await.unwrap(), &claim, &Default::default())
            .await
            .unwrap()
    else {
        panic!("the key is new");
    };

    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let before = counts.snapshot();
    let outcome = run(&runner, &workflow, &tenant, "k", &body(1)).await;
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let used = counts.snapshot() - before;
    assert!(matches!(outcome, Outcome::InProgress { .. }), "{outcome:?}");
    // The look-up alone: it sees the claim's advisory lock and never waits on the claim.
    assert_eq!((used.round_trips, used.commits), (1, 0), "{used:?}");
    held.rollback().await.unwrap();
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_new_connections_first_claim_fails_no_message(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, counts) = counted_pool(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    // The pool's one connection has never claimed: its first claim prepares the claim in its
    // own message. Before, that message failed ("prepared statement does not exist", an ERROR
    // line in the server's log for every new connection) and went again.
    let before = counts.snapshot();
    executed(&run(&runner, &harness.checkout(), &tenant(1), "first", &body(1)).await);
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    let used = counts.snapshot() - before;
    assert_eq!(used.errors, 0, "{used:?}");
    assert_eq!(used.commits, 2, "{used:?}");
    // And the next request on it finds the claim prepared.
    let (outcome, used) = measure(&runner, &harness.checkout(), &counts, "second", "third").await;
    executed(&outcome);
    assert_eq!(used.errors, 0, "{used:?}");
    assert_eq!(used.round_trips, 7 + 2, "{used:?}");
}
