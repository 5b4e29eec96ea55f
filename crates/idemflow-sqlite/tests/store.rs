//! The SQLite store against real database files: two pools on one file stand for two processes.
//! Leases are expired by rewinding them in SQL, never by sleeping.

use std::path::PathBuf;
use std::time::Duration;

use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use idemflow_sqlite::{
    ClaimRequest, Claimed, LookUp, OpenOptions, StoreError, Transaction, advance, begin_claim, due,
    expire_batch, finish, look_up, open, open_file, renew_lease, response_apart, take_over,
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
    let options = OpenOptions {
        busy_timeout,
        ..OpenOptions::default()
    };
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

fn response(body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            FieldValue::from("application/json"),
        )],
        body: body.to_vec(),
    }
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
    let options = OpenOptions {
        busy_timeout: Duration::from_millis(100),
        max_connections: 1,
    };
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

/// Fencing tokens never repeat for a key, across retention's deletes included, and a takeover
/// fences the owner it replaced out of every write.
#[tokio::test]
async fn tokens_never_repeat_across_deletes_and_a_takeover_fences_the_old_owner() {
    let (pool, other) = two_processes("fences", Duration::from_secs(5)).await;
    let key = key("k-fence");
    let Claimed::Owned(transaction, old) = claim(&pool, &key).await.expect("claim") else {
        panic!("ours");
    };
    transaction.commit().await.expect("commit");
    // Its lease lapses (rewound in SQL).
    sqlx::query("UPDATE idempotency_keys SET locked_until = locked_until - 3600000")
        .execute(&pool)
        .await
        .expect("rewind");
    let mut connection = other.acquire().await.expect("connection");
    let found = due(&mut connection, 10).await.expect("due");
    assert_eq!(found.len(), 1);
    drop(connection);
    let (taken, _connection) = take_over(
        other.acquire().await.expect("connection"),
        &tenant(),
        &key,
        found[0].lock_version,
        Duration::from_secs(30),
    )
    .await
    .expect("take over");
    let taken = taken.expect("the lapsed key is taken");
    assert!(taken.owner.lock_version() > old.lock_version());
    assert_eq!(taken.attempts, 2);
    assert_eq!(taken.request, json!({"amount": 1}));
    // The old owner wakes up: every write it makes is refused.
    let mut connection = pool.acquire().await.expect("connection");
    assert!(matches!(
        renew_lease(&mut connection, &old, Duration::from_secs(30)).await,
        Err(StoreError::Fenced)
    ));
    let mut transaction = Transaction::begin(pool.acquire().await.expect("connection"))
        .await
        .expect("begin");
    assert!(matches!(
        finish(
            transaction.connection(),
            &old,
            "complete",
            &response(b"old"),
            false
        )
        .await,
        Err(StoreError::Fenced)
    ));
    transaction.rollback().await.expect("rollback");
    // A second takeover naming the old token finds nothing to take.
    let (again, _connection) = take_over(
        other.acquire().await.expect("connection"),
        &tenant(),
        &key,
        found[0].lock_version,
        Duration::from_secs(30),
    )
    .await
    .expect("take over");
    assert!(again.is_none());
    // The new owner finishes; retention deletes the key; a new claim of it holds a token no
    // owner of the old life ever held.
    let mut transaction = Transaction::begin(other.acquire().await.expect("connection"))
        .await
        .expect("begin");
    finish(
        transaction.connection(),
        &taken.owner,
        "complete",
        &response(b"{}"),
        false,
    )
    .await
    .expect("finish");
    transaction.commit().await.expect("commit");
    sqlx::query("UPDATE idempotency_keys SET finished_at = finished_at - 86400000 * 2")
        .execute(&pool)
        .await
        .expect("rewind");
    let (deleted, _) = expire_batch(
        pool.acquire().await.expect("connection"),
        Duration::from_secs(86400),
        100,
    )
    .await
    .expect("expire");
    assert_eq!(deleted, 1);
    let Claimed::Owned(transaction, new) = claim(&pool, &key).await.expect("claim") else {
        panic!("the deleted key is free");
    };
    transaction.commit().await.expect("commit");
    assert!(new.lock_version() > taken.owner.lock_version());
}

/// A body stored apart is read for the life the look-up found: once retention deleted that life
/// and a new one finished with its own body, the old life's read finds nothing, never the new
/// body.
#[tokio::test]
async fn a_body_apart_is_read_by_its_life_only() {
    let (pool, _) = two_processes("apart", Duration::from_secs(5)).await;
    let key = key("k-apart");
    let finish_with = |body: &'static [u8]| {
        let pool = pool.clone();
        let key = key.clone();
        async move {
            let Claimed::Owned(mut transaction, owner) = claim(&pool, &key).await.expect("claim")
            else {
                panic!("ours");
            };
            finish(
                transaction.connection(),
                &owner,
                "complete",
                &response(body),
                true,
            )
            .await
            .expect("finish");
            transaction.commit().await.expect("commit");
        }
    };
    finish_with(b"first life").await;
    let mut connection = pool.acquire().await.expect("connection");
    let LookUp::Found(found) = look_up(&mut connection, &tenant(), &key)
        .await
        .expect("look-up")
    else {
        panic!("found");
    };
    let life = found.body_apart.expect("stored apart");
    assert_eq!(found.response.expect("done").body, b"");
    assert_eq!(
        response_apart(&mut connection, &tenant(), &key, life)
            .await
            .expect("body")
            .as_deref(),
        Some(&b"first life"[..])
    );
    drop(connection);
    // Between the look-up and the body read: the window ends, retention deletes, a new life.
    sqlx::query("UPDATE idempotency_keys SET finished_at = finished_at - 86400000 * 2")
        .execute(&pool)
        .await
        .expect("rewind");
    let (deleted, _) = expire_batch(
        pool.acquire().await.expect("connection"),
        Duration::from_secs(86400),
        100,
    )
    .await
    .expect("expire");
    assert_eq!(deleted, 1);
    let bodies: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_responses")
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(bodies, 0, "retention takes the body with its key");
    finish_with(b"second life").await;
    let mut connection = pool.acquire().await.expect("connection");
    assert_eq!(
        response_apart(&mut connection, &tenant(), &key, life)
            .await
            .expect("body"),
        None
    );
}

/// Retention deletes finished keys past their window only, a batch at a time, and never a
/// started key however old.
#[tokio::test]
async fn retention_deletes_only_finished_keys_past_their_window_in_batches() {
    let (pool, _) = two_processes("retention", Duration::from_secs(5)).await;
    for index in 0..5 {
        let key = key(&format!("k-{index}"));
        let Claimed::Owned(mut transaction, owner) = claim(&pool, &key).await.expect("claim")
        else {
            panic!("ours");
        };
        if index < 4 {
            finish(
                transaction.connection(),
                &owner,
                "complete",
                &response(b"{}"),
                false,
            )
            .await
            .expect("finish");
        }
        transaction.commit().await.expect("commit");
    }
    // Three of the finished keys are two days old; one finished just now; one is started.
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = finished_at - 86400000 * 2, \
         created_at = created_at - 86400000 * 2 WHERE key IN ('k-0', 'k-1', 'k-2', 'k-4')",
    )
    .execute(&pool)
    .await
    .expect("rewind");
    let keep_for = Duration::from_secs(86400);
    let (first, _) = expire_batch(pool.acquire().await.expect("connection"), keep_for, 2)
        .await
        .expect("expire");
    let (second, _) = expire_batch(pool.acquire().await.expect("connection"), keep_for, 2)
        .await
        .expect("expire");
    let (third, _) = expire_batch(pool.acquire().await.expect("connection"), keep_for, 2)
        .await
        .expect("expire");
    assert_eq!((first, second, third), (2, 1, 0));
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(&pool)
        .await
        .expect("keys");
    assert_eq!(left, ["k-3", "k-4"]);
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
