//! The `idemflow` binary on a MySQL/MariaDB database (`mysql://…`, the server at `MARIADB_URL`,
//! default `mysql://root@127.0.0.1:3306/test`; a database per test): `migrate`, `expire` of
//! finished keys past their window and nothing else, and the operator's commands answering as on
//! PostgreSQL.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use idemflow_core::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_mysql::{ClaimRequest, Claimed, OpenOptions, begin_claim, finish, open};
use serde_json::json;
use sqlx::{Connection, Executor, MySqlConnection};

fn server() -> String {
    std::env::var("MARIADB_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// A fresh database named for `test`; its URL.
async fn scratch(test: &str) -> String {
    let database = format!("if_cli_{test}");
    let mut admin = MySqlConnection::connect(&server()).await.unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS `{database}`"
        )))
        .await
        .unwrap();
    admin
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{database}`")))
        .await
        .unwrap();
    let base = server();
    let (host, _) = base.rsplit_once('/').unwrap();
    format!("{host}/{database}")
}

fn idemflow(url: &str, arguments: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .arg("--database-url")
        .arg(url)
        .args(arguments)
        .env_remove("DATABASE_URL")
        .output()
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// Claims `key` and, when `finished`, finishes it (its body stored apart).
async fn seed(pool: &sqlx::MySqlPool, key: &str, finished: bool) {
    let (tenant, key) = (TenantId::new("t-1").unwrap(), Key::parse(key).unwrap());
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let request = json!({});
    let claim = ClaimRequest {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: "checkout@1",
        request: &request,
        lease: Duration::from_secs(30),
    };
    let Claimed::Owned(mut transaction, owner) = begin_claim(pool.acquire().await.unwrap(), &claim)
        .await
        .unwrap()
    else {
        panic!("new");
    };
    if finished {
        finish(
            transaction.connection(),
            &owner,
            "complete",
            &StoredResponse::new(200, b"{}".to_vec()),
            0,
        )
        .await
        .unwrap();
    }
    transaction.commit().await.unwrap();
}

#[tokio::test]
async fn migrate_then_expire_deletes_only_finished_keys_past_their_window() {
    let url = scratch("expire").await;
    let (code, stdout, stderr) = idemflow(&url, &["migrate"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("create idempotency keys"), "{stdout}");

    let pool = open(&url, &OpenOptions::default()).await.unwrap();
    for key in ["old-1", "old-2", "old-3", "recent"] {
        seed(&pool, key, true).await;
    }
    seed(&pool, "started", false).await;
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = finished_at - 2 * 86400000 \
         WHERE `key` LIKE 'old-%'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE idempotency_keys SET locked_until = locked_until - 2 * 86400000")
        .execute(&pool)
        .await
        .unwrap();

    let (code, stdout, stderr) = idemflow(
        &url,
        &[
            "--json",
            "expire",
            "--older-than",
            "1d",
            "--batch-size",
            "2",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["deleted"], 3, "{report}");
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT CONVERT(`key` USING utf8mb4) FROM idempotency_keys ORDER BY `key`",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(left, ["recent", "started"]);
    let bodies: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_responses")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(bodies, 1, "the expired keys' bodies went with them");
}

/// The operator's commands answer on MariaDB as on PostgreSQL: a lapsed key is listed as stuck
/// and counted in the resumer's lag, a key is inspected, a live lease is not ended without
/// `--force`, and an ended one advances the fence.
#[tokio::test]
async fn inspect_list_stats_and_end_lease_work_on_mariadb() {
    let url = scratch("keys").await;
    let pool = open(&url, &OpenOptions::default()).await.unwrap();
    seed(&pool, "lapsed", false).await;
    seed(&pool, "live", false).await;
    seed(&pool, "done", true).await;
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = locked_until - 3600000, \
         last_error = 'provider: 503' WHERE `key` = 'lapsed'",
    )
    .execute(&pool)
    .await
    .unwrap();

    let (code, stdout, stderr) = idemflow(&url, &["--json", "list", "--stuck"]);
    assert_eq!(code, 0, "{stderr}");
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|key| key["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["lapsed"], "{listed}");

    let (code, stdout, stderr) = idemflow(&url, &["--json", "stats"]);
    assert_eq!(code, 0, "{stderr}");
    let stats: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        stats["counts"],
        json!([["checkout@1", "done", 1], ["checkout@1", "started", 2]]),
        "{stats}"
    );
    let lag = stats["resumer_lag_ms"].as_i64().unwrap();
    assert!(
        (3_500_000..3_700_000).contains(&lag),
        "the lapsed key's lag: {lag}"
    );

    let (code, stdout, stderr) = idemflow(
        &url,
        &["--json", "inspect", "--tenant", "t-1", "--key", "done"],
    );
    assert_eq!(code, 0, "{stderr}");
    let done: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["response_status"], 200);
    assert_eq!(done["response_bytes"], 2, "the body apart is counted");
    assert_eq!(done["fingerprint_hex"], "01".repeat(32));

    let (code, _, stderr) = idemflow(&url, &["inspect", "--tenant", "t-1", "--key", "nope"]);
    assert_eq!(code, 1, "{stderr}");

    let (code, stdout, _) = idemflow(
        &url,
        &["--json", "end-lease", "--tenant", "t-1", "--key", "live"],
    );
    assert_eq!(
        code, 1,
        "a live lease is not ended without --force: {stdout}"
    );
    let before: i64 =
        sqlx::query_scalar("SELECT lock_version FROM idempotency_keys WHERE `key` = 'live'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let (code, stdout, stderr) = idemflow(
        &url,
        &[
            "--json",
            "end-lease",
            "--tenant",
            "t-1",
            "--key",
            "live",
            "--force",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let ended: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(ended["outcome"], "ended", "{ended}");
    let (after, lease_left): (i64, i64) = sqlx::query_as(
        "SELECT lock_version, locked_until - \
                (TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000) \
         FROM idempotency_keys WHERE `key` = 'live'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_ne!(after, before, "the fence advanced");
    assert_eq!(ended["new_lock_version"], after);
    assert!(lease_left <= 0, "due now: {lease_left}");

    let (code, _, stderr) = idemflow(&url, &["partitions", "list"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no MySQL form"), "{stderr}");
}
