//! The MySQL/MariaDB store's own behaviour beside the conformance suite (tests/it/conformance.rs):
//! what InnoDB and the server's session settings make of the engine's statements. Against the
//! server at `MARIADB_URL` (default `mysql://root@127.0.0.1:3306/test`), a database per test.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use idemflow_core::{Fingerprint, Key, TenantId};
use idemflow_mysql::{ClaimRequest, Claimed, OpenOptions, begin_claim};
use serde_json::json;
use sqlx::{Connection, Executor, MySqlConnection, MySqlPool};

fn url() -> String {
    std::env::var("MARIADB_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

async fn fresh(test: &str, options: &OpenOptions) -> MySqlPool {
    let database = format!("if_store_{test}");
    let mut server = MySqlConnection::connect(&url()).await.unwrap();
    server
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS `{database}`"
        )))
        .await
        .unwrap();
    server
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{database}`")))
        .await
        .unwrap();
    let base = url();
    let (server_url, _) = base.rsplit_once('/').unwrap();
    idemflow_mysql::open(&format!("{server_url}/{database}"), options)
        .await
        .unwrap()
}

async fn claim(pool: &MySqlPool, key: &str) -> Claimed {
    let (tenant, key) = (TenantId::new("t").unwrap(), Key::parse(key).unwrap());
    let fingerprint = Fingerprint::from_slice(&[7; 32]).unwrap();
    let request = json!({"amount": 1});
    begin_claim(
        pool.acquire().await.unwrap(),
        &ClaimRequest {
            tenant: &tenant,
            key: &key,
            fingerprint: &fingerprint,
            workflow: "w@1",
            request: &request,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .unwrap()
}

/// A local phase's statement given up mid-flight (its future dropped past the phase's limit):
/// the server ends it at the statement timeout, and the claim's transaction rolls back to its
/// savepoint on the same connection, keeping the claim, so the failed attempt can be recorded.
#[tokio::test]
async fn a_statement_given_up_mid_flight_ends_at_the_statement_timeout_and_the_claim_is_kept() {
    let pool = fresh(
        "given_up",
        &OpenOptions::default()
            .with_lock_wait_timeout(Duration::from_secs(2))
            .with_statement_timeout(Some(Duration::from_millis(500)))
            .with_max_connections(4),
    )
    .await;
    let Claimed::Owned(mut transaction, _owner) = claim(&pool, "k").await else {
        panic!("the key is new");
    };
    let hung = tokio::time::timeout(
        Duration::from_millis(100),
        sqlx::query("SELECT SLEEP(3600)").execute(transaction.connection()),
    )
    .await;
    assert!(hung.is_err(), "the statement was given up: {hung:?}");
    let started = std::time::Instant::now();
    transaction.back_to_claim().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    transaction.commit().await.unwrap();
    let keys: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(keys, 1, "the claim was kept");
}

/// Every session of the pool gets the engine's settings as it opens: READ COMMITTED, the lock wait
/// timeout in whole seconds, the statement timeout, strict mode, UTC.
#[tokio::test]
async fn every_session_gets_the_engines_settings() {
    let pool = fresh(
        "settings",
        &OpenOptions::default()
            .with_lock_wait_timeout(Duration::from_secs(3))
            .with_statement_timeout(Some(Duration::from_millis(1500)))
            .with_max_connections(2),
    )
    .await;
    let (isolation, lock_wait, statement, sql_mode, time_zone): (String, u64, f64, String, String) =
        sqlx::query_as(
            "SELECT @@tx_isolation, @@innodb_lock_wait_timeout, @@max_statement_time, \
                    @@sql_mode, @@time_zone",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(isolation, "READ-COMMITTED");
    assert_eq!(lock_wait, 3);
    assert!((statement - 1.5).abs() < 1e-9, "{statement}");
    assert!(sql_mode.contains("STRICT_ALL_TABLES"), "{sql_mode}");
    assert_eq!(time_zone, "+00:00");
}
