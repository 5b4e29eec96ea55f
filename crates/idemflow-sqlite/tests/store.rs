//! What only the SQLite store has, against real database files (two pools on one file stand for
//! two processes): its pragmas, its one writer, busy, and transactions dropped unfinished. What
//! every engine keeps is proven by the conformance suite (tests/it/conformance.rs).

use std::path::PathBuf;
use std::time::Duration;

use idemflow_core::{Fingerprint, Key, TenantId};
use idemflow_sqlite::{
    ClaimRequest, Claimed, LookUp, OpenOptions, StoreError, Transaction, advance, begin_claim,
    look_up, open, open_file,
};
use serde_json::json;
use sqlx::SqlitePool;

/// A database file of its own for each test, removed with its directory at the start of the
/// next run of the same test.
fn scratch(name: &str) -> PathBuf {
    let directory = std::env::temp_dir().join(format!("idemflow-sqlite-test-{name}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).expect("a scratch directory");
    directory.join("idemflow.db")
}

async fn two_processes(name: &str, busy_timeout: Duration) -> (SqlitePool, SqlitePool) {
    let path = scratch(name);
    let options = OpenOptions::default().with_busy_timeout(busy_timeout);
    let first = open_file(&path, &options).await.expect("open");
    let second = open_file(&path, &options).await.expect("open again");
    (first, second)
}

fn tenant() -> TenantId {
    TenantId::new("t-1").expect("tenant")
}

fn key(name: &str) -> Key {
    Key::parse(name).expect("key")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_slice(&[7; 32]).expect("fingerprint")
}

async fn claim(pool: &SqlitePool, key: &Key) -> Result<Claimed, StoreError> {
    let tenant = tenant();
    let fingerprint = fingerprint();
    let request = json!({"amount": 1});
    begin_claim(
        pool.acquire().await.expect("connection"),
        &ClaimRequest {
            tenant: &tenant,
            key,
            fingerprint: &fingerprint,
            workflow: "checkout@1",
            request: &request,
            lease: Duration::from_secs(30),
        },
    )
    .await
}

/// The pragmas a payments engine needs are the ones every connection runs with: WAL (readers
/// never wait for the writer) and `synchronous = FULL` (a commit is on disk when it returns).
#[tokio::test]
async fn every_connection_runs_in_wal_with_full_sync() {
    let (pool, _) = two_processes("pragmas", Duration::from_secs(5)).await;
    let mut connection = pool.acquire().await.expect("connection");
    let journal: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(&mut *connection)
        .await
        .expect("journal mode");
    let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
        .fetch_one(&mut *connection)
        .await
        .expect("synchronous");
    assert_eq!(journal, "wal");
    assert_eq!(synchronous, 2, "FULL");
}

/// A claim in flight holds the write lock: a second process's claim of the same key waits for
/// it, then finds the first one's row and claims nothing; the key has one row, one effect.
#[tokio::test]
async fn a_concurrent_claim_waits_for_the_first_and_then_loses_it() {
    let (first, second) = two_processes("concurrent", Duration::from_secs(5)).await;
    let key = key("k-1");
    let Claimed::Owned(mut transaction, owner) = claim(&first, &key).await.expect("claim") else {
        panic!("a new key is ours");
    };
    let racing = tokio::spawn({
        let second = second.clone();
        let key = key.clone();
        async move { claim(&second, &key).await }
    });
    // The racing claim waits on the write lock, seeing nothing committed yet.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !racing.is_finished(),
        "the second claim waits for the first"
    );
    advance(
        transaction.connection(),
        &owner,
        "reserve",
        &json!({"order": 1}),
        Duration::from_secs(30),
    )
    .await
    .expect("advance");
    transaction.commit().await.expect("commit");
    let raced = racing.await.expect("join").expect("claim");
    assert!(matches!(raced, Claimed::Lost(_)), "the first claim won");
    let mut connection = second.acquire().await.expect("connection");
    let LookUp::Found(found) = look_up(&mut connection, &tenant(), &key)
        .await
        .expect("look-up")
    else {
        panic!("the key is there");
    };
    assert!(!found.done);
    assert!(found.lease_left > Duration::from_secs(25));
    assert_eq!(found.lock_version, owner.lock_version());
}

/// A writer held past the busy timeout makes the claim answer busy, with nothing begun and
/// nothing stored; once the writer is gone the same claim succeeds.
#[tokio::test]
async fn a_claim_behind_a_writer_past_the_busy_timeout_answers_busy_and_stores_nothing() {
    let (first, second) = two_processes("busy", Duration::from_millis(100)).await;
    let writer = Transaction::begin(first.acquire().await.expect("connection"))
        .await
        .expect("a writer");
    let key = key("k-busy");
    let busy = claim(&second, &key).await;
    assert!(matches!(busy, Err(StoreError::Busy)), "{busy:?}");
    writer.rollback().await.expect("rollback");
    let mut connection = second.acquire().await.expect("connection");
    assert!(matches!(
        look_up(&mut connection, &tenant(), &key)
            .await
            .expect("look-up"),
        LookUp::Absent
    ));
    drop(connection);
    assert!(matches!(
        claim(&second, &key).await.expect("claim"),
        Claimed::Owned(..)
    ));
}

/// A transaction dropped before it ends (a cancelled request) never goes back to the pool
/// inside its transaction: the next user of the pool writes at once.
#[tokio::test]
async fn a_dropped_transaction_leaves_no_connection_inside_it() {
    let path = scratch("dropped");
    let options = OpenOptions::default()
        .with_busy_timeout(Duration::from_millis(100))
        .with_max_connections(1);
    let pool = open_file(&path, &options).await.expect("open");
    let key = key("k-drop");
    let Claimed::Owned(transaction, _) = claim(&pool, &key).await.expect("claim") else {
        panic!("ours");
    };
    drop(transaction);
    // One connection in the pool: had it come back inside the claim, this would commit the
    // dropped claim, or wait on itself.
    let Claimed::Owned(transaction, _) = claim(&pool, &key).await.expect("claim again") else {
        panic!("the dropped claim left nothing");
    };
    transaction.commit().await.expect("commit");
}

/// An in-memory database is refused with a clear error: nothing in it would outlive a crash.
#[tokio::test]
async fn an_in_memory_database_is_refused() {
    let refused = open("sqlite::memory:", &OpenOptions::default()).await;
    let Err(sqlx::Error::Configuration(message)) = refused else {
        panic!("refused: {refused:?}");
    };
    assert!(message.to_string().contains("in-memory"), "{message}");
}

/// A statement timeout the busy timeout does not outlast is refused with a clear error: a phase
/// given up at its time limit could not record its attempt (its hung statement holds the write
/// lock past the record's wait), and a key whose phase always hangs would never give up.
#[tokio::test]
async fn a_statement_timeout_not_shorter_than_the_busy_timeout_is_refused() {
    let directory = std::env::temp_dir().join("idemflow-sqlite-statement-timeout");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).expect("a scratch directory");
    let options = OpenOptions::default()
        .with_busy_timeout(Duration::from_secs(1))
        .with_statement_timeout(Some(Duration::from_secs(1)));
    let refused = open_file(&directory.join("idemflow.db"), &options).await;
    let Err(sqlx::Error::Configuration(message)) = refused else {
        panic!("refused: {refused:?}");
    };
    assert!(message.to_string().contains("busy_timeout"), "{message}");
    assert_eq!(
        OpenOptions::default().statement_limit(),
        OpenOptions::default().busy_timeout / 2
    );
}

/// One connection on a file of its own, its statements interrupted at 100 ms.
async fn one_connection_with_a_short_statement_timeout(name: &str) -> SqlitePool {
    open_file(
        &scratch(name),
        &OpenOptions::default()
            .with_busy_timeout(Duration::from_secs(2))
            .with_max_connections(1)
            .with_statement_timeout(Some(Duration::from_millis(100))),
    )
    .await
    .expect("open")
}

/// The statement timeout limits one statement, never a connection kept busy: a connection
/// running short statements back to back for far longer than the timeout (a service under steady
/// load, a bulk seeding) is never interrupted. SQLite counts a prepared statement's steps across
/// its runs and calls the progress handler every few thousand of them, so a handler that cannot tell one statement from the next would take a
/// steady stream of short ones for one statement that never ends.
#[tokio::test]
async fn a_connection_busy_with_short_statements_for_longer_than_the_statement_timeout_is_never_interrupted()
 {
    let pool =
        one_connection_with_a_short_statement_timeout("statement-timeout-busy-connection").await;
    let mut connection = pool.acquire().await.expect("connection");
    let until = std::time::Instant::now() + Duration::from_millis(800);
    let mut statements = 0;
    while std::time::Instant::now() < until {
        // A statement of a few thousand steps, short on its own (about a millisecond), one after
        // another on the one connection.
        let counted: i64 = sqlx::query_scalar(
            "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 3000) \
             SELECT count(*) FROM n",
        )
        .fetch_one(&mut *connection)
        .await
        .unwrap_or_else(|error| panic!("statement {statements} was interrupted: {error}"));
        assert_eq!(counted, 3000);
        statements += 1;
    }
    assert!(statements > 10, "only {statements} statements ran");
}

/// A statement that alone outruns the statement timeout is interrupted at it, and the connection
/// goes on serving: the timeout still does what it is for.
#[tokio::test]
async fn a_statement_that_outruns_the_statement_timeout_is_interrupted_and_the_connection_serves_on()
 {
    let pool = one_connection_with_a_short_statement_timeout("statement-timeout-runaway").await;
    let started = std::time::Instant::now();
    let runaway = sqlx::query_scalar::<_, i64>(
        "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT count(*) FROM n",
    )
    .fetch_one(&pool)
    .await;
    let Err(sqlx::Error::Database(error)) = runaway else {
        panic!("not interrupted: {runaway:?}");
    };
    assert!(error.message().contains("interrupted"), "{error}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let one: i64 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .expect("the connection serves on");
    assert_eq!(one, 1);
}
