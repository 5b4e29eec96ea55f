//! The `idemflow` binary on a SQLite database file (`sqlite://path`): `migrate` creates and
//! migrates it, `expire` deletes finished keys past their window and nothing else, a mistyped
//! path creates nothing, and the commands SQLite does not have yet say so.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idemflow_core::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_sqlite::{ClaimRequest, Claimed, OpenOptions, begin_claim, finish, open_file};
use serde_json::json;

fn scratch(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("idemflow-cli-sqlite-{name}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    directory.join("idemflow.db")
}

fn idemflow(path: &Path, arguments: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .arg("--database-url")
        .arg(format!("sqlite://{}", path.display()))
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

/// Claims `key` and, when `finished`, finishes it.
async fn seed(pool: &sqlx::SqlitePool, key: &str, finished: bool) {
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
async fn migrate_creates_the_file_and_expire_deletes_only_finished_keys_past_their_window() {
    let path = scratch("expire");
    let (code, stdout, _) = idemflow(&path, &["migrate"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(stdout.contains("create idempotency keys"), "{stdout}");
    assert!(path.exists());

    let pool = open_file(&path, &OpenOptions::default()).await.unwrap();
    for key in ["old-1", "old-2", "old-3"] {
        seed(&pool, key, true).await;
    }
    seed(&pool, "recent", true).await;
    seed(&pool, "started", false).await;
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = finished_at - 2 * 86400000 \
         WHERE key LIKE 'old-%'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("UPDATE idempotency_keys SET locked_until = locked_until - 2 * 86400000")
        .execute(&pool)
        .await
        .unwrap();

    let (code, stdout, stderr) = idemflow(
        &path,
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
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["recent", "started"]);
    let bodies: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_responses")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(bodies, 1, "the expired keys' bodies went with them");
}

#[test]
fn a_command_on_a_path_with_no_database_creates_nothing() {
    let path = scratch("typo");
    let (code, _, stderr) = idemflow(&path, &["expire", "--older-than", "1d"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no SQLite database at"), "{stderr}");
    assert!(!path.exists());
}

#[test]
fn the_partitioned_layout_s_commands_say_sqlite_has_none() {
    let path = scratch("not-yet");
    for arguments in [
        &["partitions", "list"][..],
        &["partitions", "maintain", "--keep-for", "2d"],
    ] {
        let (code, _, stderr) = idemflow(&path, arguments);
        assert_eq!(code, 2, "{arguments:?}: {stderr}");
        assert!(stderr.contains("no SQLite form"), "{stderr}");
    }
}

/// The operator's commands answer on SQLite as on PostgreSQL: a lapsed key is listed as stuck and
/// counted in the resumer's lag, a key is inspected, a live lease is not ended without `--force`,
/// and an ended one advances the fence.
#[tokio::test]
async fn inspect_list_and_end_lease_work_on_a_sqlite_file() {
    let path = scratch("keys");
    let pool = open_file(&path, &OpenOptions::default()).await.unwrap();
    seed(&pool, "lapsed", false).await;
    seed(&pool, "live", false).await;
    seed(&pool, "done", true).await;
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = locked_until - 3600000, \
         last_error = 'provider: 503' WHERE key = 'lapsed'",
    )
    .execute(&pool)
    .await
    .unwrap();

    let (code, stdout, stderr) = idemflow(&path, &["--json", "list", "--stuck"]);
    assert_eq!(code, 0, "{stderr}");
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|key| key["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["lapsed"], "{listed}");

    let (code, stdout, stderr) = idemflow(&path, &["--json", "stats"]);
    assert_eq!(code, 0, "{stderr}");
    let stats: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        stats["counts"],
        json!([
            {"workflow": "checkout@1", "state": "done", "keys": 1},
            {"workflow": "checkout@1", "state": "started", "keys": 2},
        ]),
        "{stats}"
    );
    let lag = stats["resumer_lag_ms"].as_i64().unwrap();
    assert!(
        (3_500_000..3_700_000).contains(&lag),
        "the lapsed key's lag: {lag}"
    );

    let (code, stdout, stderr) = idemflow(
        &path,
        &["--json", "inspect", "--tenant", "t-1", "--key", "done"],
    );
    assert_eq!(code, 0, "{stderr}");
    let done: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["response_status"], 200);
    assert_eq!(done["response_bytes"], 2, "the body apart is counted");
    assert_eq!(done["fingerprint_hex"], "01".repeat(32));

    let (code, _, stderr) = idemflow(&path, &["inspect", "--tenant", "t-1", "--key", "nope"]);
    assert_eq!(code, 1, "{stderr}");

    let (code, stdout, _) = idemflow(
        &path,
        &["--json", "end-lease", "--tenant", "t-1", "--key", "live"],
    );
    assert_eq!(
        code, 1,
        "a live lease is not ended without --force: {stdout}"
    );
    let before: i64 =
        sqlx::query_scalar("SELECT lock_version FROM idempotency_keys WHERE key = 'live'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let (code, stdout, stderr) = idemflow(
        &path,
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
        "SELECT lock_version, locked_until - CAST(unixepoch('subsec') * 1000 AS INTEGER) \
         FROM idempotency_keys WHERE key = 'live'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_ne!(after, before, "the fence advanced");
    assert_eq!(ended["new_lock_version"], after);
    assert!(lease_left <= 0, "due now: {lease_left}");
}

/// Claims `key` with `request` and finishes it with `response`: its body in the row, or apart
/// when longer than `apart_above` bytes.
async fn seed_finished(
    pool: &sqlx::SqlitePool,
    key: &str,
    request: &serde_json::Value,
    response: &StoredResponse,
    apart_above: usize,
) {
    let (tenant, key) = (TenantId::new("t-1").unwrap(), Key::parse(key).unwrap());
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let claim = ClaimRequest {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: "checkout@1",
        request,
        lease: Duration::from_secs(30),
    };
    let Claimed::Owned(mut transaction, owner) = begin_claim(pool.acquire().await.unwrap(), &claim)
        .await
        .unwrap()
    else {
        panic!("new");
    };
    finish(
        transaction.connection(),
        &owner,
        "complete",
        response,
        apart_above,
    )
    .await
    .unwrap();
    transaction.commit().await.unwrap();
}

/// `inspect --show-request --show-response` shows what is stored, as on PostgreSQL: a body in the
/// row or apart, one that is not UTF-8 as base64, sealed values by their key only (never
/// opened); and the time left before retention deletes the key. `stats --json` counts as objects,
/// and `end-lease` of a due key names the request's retry and a resumer both.
#[tokio::test]
async fn inspect_shows_the_stored_bodies_and_the_time_left_before_expiry() {
    let path = scratch("bodies");
    let pool = open_file(&path, &OpenOptions::default()).await.unwrap();
    let response = StoredResponse::new(201, br#"{"order_id":41}"#.to_vec())
        .with_header("content-type", "application/json");
    let request = json!({"amount": 1200});
    seed_finished(&pool, "in-row", &request, &response, 1 << 20).await;
    seed_finished(&pool, "apart", &request, &response, 0).await;
    let binary = StoredResponse::new(200, vec![0xde, 0xad, 0xbe, 0xef]);
    seed_finished(&pool, "binary", &json!({}), &binary, 1 << 20).await;
    // As the runner stores them sealed (crates/idemflow-runner/src/sealing.rs).
    let sealed = StoredResponse {
        status: 201,
        headers: vec![("idemflow:sealed".to_owned(), "2026-11".into())],
        body: b"\x02sealed-bytes".to_vec(),
    };
    let sealed_request = json!({"idemflow:sealed": "2026-12", "data": "AQID"});
    seed_finished(&pool, "sealed", &sealed_request, &sealed, 1 << 20).await;
    seed(&pool, "lapsed", false).await;
    // Finished an hour and a half ago (away from a unit's boundary, so the text does not
    // flicker); a lease that ended an hour ago.
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = finished_at - 5400000 \
         WHERE state = 'done'",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE idempotency_keys \
         SET locked_until = CAST(unixepoch('subsec') * 1000 AS INTEGER) - 3600000 \
         WHERE key = 'lapsed'",
    )
    .execute(&pool)
    .await
    .unwrap();

    let show = |key: &str, json: bool| {
        let mut arguments = vec![
            "inspect",
            "--tenant",
            "t-1",
            "--key",
            key,
            "--show-request",
            "--show-response",
            "--retention",
            "7d",
        ];
        if json {
            arguments.insert(0, "--json");
        }
        let (code, stdout, stderr) = idemflow(&path, &arguments);
        assert_eq!((code, stderr.as_str()), (0, ""), "{stdout}");
        stdout
    };
    let stdout = show("in-row", false);
    assert!(
        stdout.ends_with(
            "\nexpiry          expires in ~6d 22h (finished 1h 30m ago; retention 7d 0h)\n\
             \nrequest\n{\n  \"amount\": 1200\n}\n\
             \nresponse 201, body 15 bytes\ncontent-type: application/json\n\n{\"order_id\":41}\n"
        ),
        "{stdout}"
    );
    let stdout = show("apart", false);
    assert!(
        stdout.ends_with(
            "\nresponse 201, body 15 bytes, stored apart\ncontent-type: application/json\n\
             \n{\"order_id\":41}\n"
        ),
        "{stdout}"
    );
    let apart: serde_json::Value = serde_json::from_str(&show("apart", true)).unwrap();
    assert_eq!(apart["response"]["body_apart"], true, "{apart}");
    assert_eq!(apart["response"]["body"], r#"{"order_id":41}"#);
    assert_eq!(
        apart["response"]["headers"],
        json!([["content-type", "application/json"]])
    );
    assert_eq!(
        apart["request"],
        json!({"sealed_under": null, "json": request})
    );
    let finished = apart["finished_seconds_ago"].as_i64().unwrap();
    assert!((5400..5460).contains(&finished), "{apart}");
    assert_eq!(apart["retention_seconds"], 604_800);
    assert_eq!(apart["expires_in_seconds"], 604_800 - finished);

    let stdout = show("binary", false);
    assert!(
        stdout.ends_with("\nresponse 200, body 4 bytes, not UTF-8: shown as base64\n\n3q2+7w==\n"),
        "{stdout}"
    );
    let stdout = show("sealed", false);
    assert!(
        stdout.ends_with(
            "\nrequest\nsealed under key 2026-12 (not decrypted: this tool holds no keyring)\n\
             \nresponse 201, sealed under key 2026-11: headers and body (13 bytes), not \
             decrypted: this tool holds no keyring\n"
        ),
        "{stdout}"
    );
    assert!(!show("sealed", true).contains("AQID"));

    let stdout = show("lapsed", false);
    assert!(
        stdout.contains("\nexpiry          not expired while started\n"),
        "{stdout}"
    );
    assert!(
        stdout.ends_with("\nrequest\n{}\n\nresponse\n- (started: no response is stored yet)\n"),
        "{stdout}"
    );

    let (code, stdout, stderr) = idemflow(&path, &["--json", "stats"]);
    assert_eq!(code, 0, "{stderr}");
    let stats: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        stats["counts"],
        json!([
            {"workflow": "checkout@1", "state": "done", "keys": 4},
            {"workflow": "checkout@1", "state": "started", "keys": 1},
        ]),
        "{stats}"
    );

    let (code, stdout, stderr) =
        idemflow(&path, &["end-lease", "--tenant", "t-1", "--key", "lapsed"]);
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert_eq!(
        stdout,
        "nothing to end: the lease of key \"lapsed\" of tenant \"t-1\" expired 1h 0m ago; it is \
         due now: the next retry of the request takes it over, or a resumer that runs workflow \
         \"checkout@1\" (none runs a live-only workflow, such as a plain-handler route's: its \
         keys wait for that retry)\n"
    );
}

/// One HTTP/1.1 exchange on a fresh connection: the status and the body.
async fn http(address: &str, request: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned());
    (status, body.unwrap_or_default())
}

/// `idemflow console --read-only` on a SQLite file: the overview and a key's page from a
/// read-only open, an action refused by the server; and no console beyond loopback without a
/// password.
#[tokio::test]
async fn the_console_serves_a_sqlite_file_read_only_and_only_on_loopback_without_a_password() {
    use tokio::io::AsyncBufReadExt;
    let path = scratch("console");
    assert_eq!(idemflow(&path, &["migrate"]).0, 0);
    let pool = open_file(&path, &OpenOptions::default()).await.unwrap();
    seed(&pool, "k-1", true).await;
    pool.close().await;

    let (code, _, stderr) = idemflow(&path, &["console", "--bind", "0.0.0.0:0"]);
    assert_ne!(code, 0);
    assert!(stderr.contains("IDEMFLOW_CONSOLE_PASSWORD"), "{stderr}");

    let mut console = tokio::process::Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .arg("--database-url")
        .arg(format!("sqlite://{}", path.display()))
        .args(["console", "--bind", "127.0.0.1:0", "--read-only"])
        .env_remove("DATABASE_URL")
        .env_remove("IDEMFLOW_CONSOLE_PASSWORD")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(console.stderr.take().unwrap()).lines();
    let banner = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let address = banner
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.strip_suffix('/'))
        .unwrap_or_else(|| panic!("{banner}"))
        .to_owned();
    assert!(banner.contains("(read-only)"), "{banner}");
    let get =
        |path: &str| format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    let (status, overview) = http(&address, &get("/")).await;
    assert_eq!(status, 200, "{overview}");
    assert!(overview.contains("SQLite") && overview.contains("read-only"));
    let (status, page) = http(&address, &get("/key?tenant=t-1&key=k-1")).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(r#"id="actions-off""#) && page.contains("k-1"));
    let form = "tenant=t-1&key=k-1&lock_version=1&state=done&confirmed=yes";
    let post = format!(
        "POST /key/expire HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
        form.len()
    );
    assert_eq!(http(&address, &post).await.0, 403);
    console.kill().await.unwrap();
    let pool = open_file(&path, &OpenOptions::default()).await.unwrap();
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(kept, 1);
}
