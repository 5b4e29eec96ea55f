//! Commits and round trips per request on MariaDB, counted on the wire
//! (`idemflow_testrig::wire::mysql`), as `round_trips.rs` counts them on PostgreSQL.
//!
//! MySQL's protocol sends one command per round trip, and a prepared statement alone; the claim
//! and its savepoint travel as one message of the text protocol. So a new key's checkout is the
//! look-up; `BEGIN`, claim with savepoint, advance, `COMMIT`; `BEGIN`, finish, `COMMIT` (8),
//! beside its phases' own statements (one each here). The figures docs/engines.md gives are
//! these.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use idemflow::{Key, MySqlStore, Outcome, Request, Runner, TenantId, Workflow};
use idemflow_testrig::checkout::{self as reference, Orders};
use idemflow_testrig::wire::mysql::start_proxy;
use idemflow_testrig::wire::{Counts, WireCounts};
use sqlx::mysql::{MySqlConnectOptions, MySqlSslMode};

use crate::support::mariadb;

/// The reference checkout (`idemflow_testrig::checkout`): create_order, charge, mark_paid.
fn checkout() -> Workflow<MySqlStore> {
    reference::checkout::<MySqlStore>(None).unwrap()
}

/// The reference one-phase order: place_order.
fn local_only() -> Workflow<MySqlStore> {
    reference::place::<MySqlStore>().unwrap()
}

/// A migrated database for `test` and a runner on a pool of one connection through the
/// counting proxy (no ping before acquire, no TLS: the proxy reads the packets).
async fn counted(test: &str) -> (Runner<MySqlStore>, Arc<WireCounts>) {
    let direct = mariadb::fresh(test).await;
    sqlx::query(MySqlStore::ORDERS_TABLE)
        .execute(&direct)
        .await
        .unwrap();
    direct.close().await;
    let connect =
        MySqlConnectOptions::from_str(&mariadb::url_of(&mariadb::database_name(test))).unwrap();
    let upstream = tokio::net::lookup_host((connect.get_host(), connect.get_port()))
        .await
        .unwrap()
        .next()
        .unwrap();
    let (port, counts) = start_proxy(upstream).await;
    let pool = idemflow_mysql::pool_options(
        &idemflow_mysql::OpenOptions::default().with_max_connections(1),
    )
    .test_before_acquire(false)
    .connect_with(
        connect
            .host("127.0.0.1")
            .port(port)
            .ssl_mode(MySqlSslMode::Disabled),
    )
    .await
    .unwrap();
    (Runner::new(pool), counts)
}

async fn run(runner: &Runner<MySqlStore>, workflow: &Workflow<MySqlStore>, key: &str) -> Outcome {
    let tenant = TenantId::new("round-trips").unwrap();
    let request = Request {
        method: "POST",
        path: "/v1/orders",
        body: br#"{"amount": 100, "source": "tok_visa"}"#,
    };
    runner
        .run(workflow, &tenant, &Key::parse(key).unwrap(), request)
        .await
        .unwrap()
}

/// Runs `warm_up`, then `key`, counting the second (the first prepares the statements).
async fn measure(
    runner: &Runner<MySqlStore>,
    workflow: &Workflow<MySqlStore>,
    counts: &WireCounts,
    warm_up: &str,
    key: &str,
) -> (Outcome, Counts) {
    run(runner, workflow, warm_up).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let before = counts.snapshot();
    let outcome = run(runner, workflow, key).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    (outcome, counts.snapshot() - before)
}

fn executed(outcome: &Outcome) {
    assert!(
        matches!(outcome, Outcome::Executed(response) if response.status == 201),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_local_only_request_is_one_transaction() {
    let (runner, counts) = counted("round_trips_local_only").await;
    let (outcome, used) = measure(&runner, &local_only(), &counts, "warm-up", "k").await;
    executed(&outcome);
    assert_eq!(used.commits, 1, "{used:?}");
    // Look-up; BEGIN, claim with savepoint, place_order's insert, finish, COMMIT.
    assert_eq!(used.round_trips, 5 + 1, "{used:?}");
    assert_eq!(used.pings, 0, "{used:?}");
}

#[tokio::test]
async fn local_foreign_local_commits_twice() {
    let (runner, counts) = counted("round_trips_checkout").await;
    let (outcome, used) = measure(&runner, &checkout(), &counts, "warm-up", "k").await;
    executed(&outcome);
    assert_eq!(used.commits, 2, "{used:?}");
    // Look-up; BEGIN, claim with savepoint, create_order's insert, advance, COMMIT; the charge;
    // BEGIN, mark_paid's update, finish, COMMIT.
    assert_eq!(used.round_trips, 8 + 2, "{used:?}");
    assert_eq!(used.pings, 0, "{used:?}");
}

#[tokio::test]
async fn a_replay_is_one_read_and_commits_nothing() {
    let (runner, counts) = counted("round_trips_replay").await;
    let workflow = checkout();
    executed(&run(&runner, &workflow, "k").await);
    let (outcome, used) = measure(&runner, &workflow, &counts, "warm-up", "k").await;
    assert!(matches!(outcome, Outcome::Replayed(_)), "{outcome:?}");
    assert_eq!(used.commits, 0, "{used:?}");
    assert_eq!(used.round_trips, 1, "{used:?}");
    assert_eq!(used.pings, 0, "{used:?}");
}
