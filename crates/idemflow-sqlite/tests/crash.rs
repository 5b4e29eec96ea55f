//! Several processes on one file, killed with SIGKILL: a child process (this test binary run
//! again, as `child`) claims a key and stops at a chosen point holding SQLite's write lock or
//! after its commit; the parent kills it and checks, from its own pool on the same file, that
//! nothing half-done is left, nothing committed is lost, and the key can be carried on at once.
#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use idemflow_sqlite::{
    ClaimRequest, Claimed, LookUp, OpenOptions, Transaction, advance, begin_claim, finish, look_up,
    open_file, response_apart, take_over,
};
use serde_json::json;
use sqlx::SqlitePool;

/// Set in the child's environment: `<database path>|<point>`.
const CHILD: &str = "IDEMFLOW_SQLITE_CRASH_CHILD";
/// The line the child prints once it stands at its point.
const READY: &str = "standing at";

fn tenant() -> TenantId {
    TenantId::new("t-crash").unwrap()
}

fn key() -> Key {
    Key::parse("k-crash").unwrap()
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            FieldValue::from("application/json"),
        )],
        body: b"{\"charge\":\"ch_1\"}".to_vec(),
    }
}

async fn pool(path: &Path) -> SqlitePool {
    // A dead process's lock must not be waited for: SQLite releases it as the process dies.
    let options = OpenOptions::default().with_busy_timeout(Duration::from_millis(500));
    open_file(path, &options).await.unwrap()
}

/// The child's part: run to `point` and stand there until killed. Not a test of its own: on its
/// own (no `IDEMFLOW_SQLITE_CRASH_CHILD`) it has nothing to do.
#[tokio::test]
async fn child() {
    let Ok(role) = std::env::var(CHILD) else {
        return;
    };
    let (path, point) = role.split_once('|').unwrap();
    let pool = pool(Path::new(path)).await;
    let fingerprint = Fingerprint::from_slice(&[3; 32]).unwrap();
    let request = json!({"amount": 1200});
    let (tenant, key) = (tenant(), key());
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
        panic!("the key is new");
    };
    advance(
        transaction.connection(),
        &owner,
        "reserve",
        &json!({"order": 7}),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let mut open = Some(transaction);
    if point != "in_claim" {
        open.take().unwrap().commit().await.unwrap();
        let mut transaction = Transaction::begin(pool.acquire().await.unwrap())
            .await
            .unwrap();
        finish(transaction.connection(), &owner, "complete", &response(), 0)
            .await
            .unwrap();
        if point == "after_finish" {
            transaction.commit().await.unwrap();
        } else {
            open = Some(transaction);
        }
    }
    println!("{READY} {point}");
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(open);
}

/// Runs the child to `point` on the database at `path`, then kills it with SIGKILL.
fn kill_at(path: &Path, point: &str) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, format!("{}|{point}", path.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let read = stdout.read_line(&mut line).unwrap();
        assert!(read > 0, "the child ended before standing at {point}");
        if line.contains(READY) {
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

fn scratch(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("idemflow-sqlite-crash-{name}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    directory.join("idemflow.db")
}

/// Killed inside its claim's transaction (the claim and its first phase written, not committed,
/// the write lock held): the key is absent, and another process claims it at once.
#[tokio::test]
async fn a_process_killed_inside_its_claim_leaves_no_key_and_no_lock() {
    let path = scratch("in-claim");
    kill_at(&path, "in_claim");
    let pool = pool(&path).await;
    let mut connection = pool.acquire().await.unwrap();
    assert!(matches!(
        look_up(&mut connection, &tenant(), &key()).await.unwrap(),
        LookUp::Absent
    ));
    drop(connection);
    let fingerprint = Fingerprint::from_slice(&[3; 32]).unwrap();
    let request = json!({"amount": 1200});
    let (tenant, key) = (tenant(), key());
    let claimed = begin_claim(
        pool.acquire().await.unwrap(),
        &ClaimRequest {
            tenant: &tenant,
            key: &key,
            fingerprint: &fingerprint,
            workflow: "checkout@1",
            request: &request,
            lease: Duration::from_secs(30),
        },
    )
    .await
    .expect("no lock outlives its process");
    assert!(matches!(claimed, Claimed::Owned(..)));
}

/// Killed inside its finish (the phase before committed, the finish written, not committed):
/// the key stands at its last recovery point with no response and no body apart, and once its
/// lease is over another process takes it over and finishes it.
#[tokio::test]
async fn a_process_killed_inside_its_finish_leaves_its_last_recovery_point() {
    let path = scratch("in-finish");
    kill_at(&path, "in_finish");
    let pool = pool(&path).await;
    let mut connection = pool.acquire().await.unwrap();
    let LookUp::Found(found) = look_up(&mut connection, &tenant(), &key()).await.unwrap() else {
        panic!("the committed claim is there");
    };
    assert!(!found.done);
    assert!(found.response.is_none());
    let bodies: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_responses")
        .fetch_one(&mut *connection)
        .await
        .unwrap();
    assert_eq!(
        bodies, 0,
        "the uncommitted body apart is gone with its finish"
    );
    sqlx::query("UPDATE idempotency_keys SET locked_until = locked_until - 3600000")
        .execute(&mut *connection)
        .await
        .unwrap();
    drop(connection);
    let (taken, _) = take_over(
        pool.acquire().await.unwrap(),
        &tenant(),
        &key(),
        found.lock_version,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let taken = taken.expect("the lapsed key is taken over");
    assert_eq!(taken.recovery_point, "reserve");
    assert_eq!(taken.phase_output, Some(json!({"order": 7})));
    let mut transaction = Transaction::begin(pool.acquire().await.unwrap())
        .await
        .unwrap();
    finish(
        transaction.connection(),
        &taken.owner,
        "complete",
        &response(),
        0,
    )
    .await
    .unwrap();
    transaction.commit().await.unwrap();
}

/// Killed right after its finish committed: the response, its body apart included, is there for
/// every replay (`synchronous = FULL`: a commit that returned is on disk).
#[tokio::test]
async fn a_process_killed_after_its_finish_loses_nothing_it_committed() {
    let path = scratch("after-finish");
    kill_at(&path, "after_finish");
    let pool = pool(&path).await;
    let mut connection = pool.acquire().await.unwrap();
    let LookUp::Found(found) = look_up(&mut connection, &tenant(), &key()).await.unwrap() else {
        panic!("the finished key is there");
    };
    assert!(found.done);
    let life = found.body_apart.expect("stored apart");
    let body = response_apart(&mut connection, &tenant(), &key(), life)
        .await
        .unwrap();
    assert_eq!(body.as_deref(), Some(response().body.as_slice()));
}
