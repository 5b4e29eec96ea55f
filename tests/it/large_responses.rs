//! Large responses out of the key's row: a body above `RunnerConfig::response_apart_above` is
//! stored in `idempotency_responses` by the statement that finishes the key, replayed byte for
//! byte, sealed like any other, never written by an owner that lost its fence, never left behind
//! by a crash, and deleted with its key by retention.
#![allow(clippy::unwrap_used)]

use idemflow::PgStore;
use std::sync::Arc;
use std::time::Duration;

use idemflow::{
    Fingerprint, Key, Keyring, Outcome, Registry, Resumer, Runner, RunnerConfig, StoredResponse,
};
use idemflow_pg as store;
use idemflow_pg::{ClaimRequest, Claimed};
use sqlx::PgPool;

use crate::support::report::{CrashBeforeFinish, body_of, setup, workflow};
use crate::support::{expire_all_leases, request, tenant};

fn runner(pool: &PgPool, keyring: Option<Keyring>) -> Runner<PgStore> {
    Runner::with_config(pool.clone(), RunnerConfig::default().with_keyring(keyring))
}

fn report(bytes: usize) -> Vec<u8> {
    format!(r#"{{"bytes": {bytes}}}"#).into_bytes()
}

async fn send(runner: &Runner<PgStore>, key: &str, bytes: usize) -> Outcome {
    let body = report(bytes);
    let key = Key::parse(key).unwrap();
    runner
        .run(&workflow(), &tenant(1), &key, request(&body))
        .await
        .unwrap()
}

/// (body in the row?, stored apart?, bytes apart) of a key.
async fn placement(pool: &PgPool, key: &str) -> (bool, bool, Option<i32>) {
    sqlx::query_as(
        "SELECT k.response_body IS NOT NULL, k.response_apart, octet_length(r.body) \
         FROM idempotency_keys k \
         LEFT JOIN idempotency_responses r ON r.tenant = k.tenant AND r.key = k.key \
         WHERE k.key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

/// Bodies apart whose key is gone or does not say its body is apart.
async fn orphans(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM idempotency_responses r WHERE NOT EXISTS ( \
             SELECT 1 FROM idempotency_keys k \
             WHERE k.tenant = r.tenant AND k.key = r.key AND k.response_apart)",
    )
    .await
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_response_above_the_threshold_is_stored_apart_and_replayed_byte_for_byte(pool: PgPool) {
    setup(&pool).await;
    let runner = runner(&pool, None);
    let threshold = RunnerConfig::DEFAULT_RESPONSE_APART_ABOVE;
    for (key, bytes, apart) in [
        ("1kb", 1024, false),
        ("at-threshold", threshold, false),
        ("above-threshold", threshold + 1, true),
        ("1mb", 1 << 20, true),
    ] {
        let executed = match send(&runner, key, bytes).await {
            Outcome::Executed(response) => response,
            other => panic!("{key}: expected Executed, got {other:?}"),
        };
        assert_eq!(executed.body, body_of(bytes), "{key}");
        let expected = if apart {
            (false, true, Some(bytes as i32))
        } else {
            (true, false, None)
        };
        assert_eq!(placement(&pool, key).await, expected, "{key}");
        match send(&runner, key, bytes).await {
            Outcome::Replayed(replayed) => assert_eq!(replayed, executed, "{key}"),
            other => panic!("{key}: expected Replayed, got {other:?}"),
        }
        // Another request under the key is refused without reading the body.
        assert!(matches!(
            send(&runner, key, bytes + 1).await,
            Outcome::Mismatch
        ));
    }
    assert_eq!(count(&pool, "SELECT count(*) FROM renders").await, 4);
    // The operator's view reads the body wherever it is.
    let mut connection = pool.acquire().await.unwrap();
    let row = store::inspect(&mut connection, &tenant(1), &Key::parse("1mb").unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.response.unwrap().body, body_of(1 << 20));
    let report = store::key_report(&mut connection, "1", "1mb")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.response_bytes, Some(1 << 20));
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_sealed_response_apart_is_replayed_and_unreadable_at_rest(pool: PgPool) {
    setup(&pool).await;
    let runner = runner(&pool, Some(Keyring::new("k1", [9; 32]).unwrap()));
    let bytes = 200_000;
    let executed = match send(&runner, "sealed", bytes).await {
        Outcome::Executed(response) => response,
        other => panic!("expected Executed, got {other:?}"),
    };
    assert_eq!(executed.body, body_of(bytes));
    let (in_row, apart, _) = placement(&pool, "sealed").await;
    assert!(!in_row && apart);
    let at_rest: Vec<u8> = sqlx::query_scalar("SELECT body FROM idempotency_responses")
        .fetch_one(&pool)
        .await
        .unwrap();
    let plain = body_of(bytes);
    assert!(
        !at_rest.windows(64).any(|window| window == &plain[..64]),
        "the body is stored sealed"
    );
    match send(&runner, "sealed", bytes).await {
        Outcome::Replayed(replayed) => assert_eq!(replayed, executed),
        other => panic!("expected Replayed, got {other:?}"),
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_crash_before_the_finish_commits_leaves_no_body_and_the_resumer_stores_one(pool: PgPool) {
    setup(&pool).await;
    let bytes = 300_000;
    let crashing = runner(&pool, None).with_crash_hook(Arc::new(CrashBeforeFinish));
    let key = Key::parse("crashed").unwrap();
    let body = report(bytes);
    let crashed = crashing
        .run(&workflow(), &tenant(1), &key, request(&body))
        .await;
    assert!(
        matches!(crashed, Err(idemflow::RunError::Crashed(_))),
        "{crashed:?}"
    );
    // The finish statement ran in the crashed transaction: its body went with it.
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_responses").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM renders").await, 0);

    expire_all_leases(&pool).await;
    let mut registry = Registry::new();
    registry.register(workflow()).unwrap();
    let drained = Resumer::new(runner(&pool, None), registry)
        .drain()
        .await
        .unwrap();
    assert_eq!((drained.taken, drained.finished), (1, 1), "{drained:?}");
    assert_eq!(
        placement(&pool, "crashed").await,
        (false, true, Some(bytes as i32))
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM renders").await, 1);
    match send(&runner(&pool, None), "crashed", bytes).await {
        Outcome::Replayed(replayed) => assert_eq!(replayed.body, body_of(bytes)),
        other => panic!("expected Replayed, got {other:?}"),
    }
    assert_eq!(orphans(&pool).await, 0);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_owner_that_lost_its_fence_stores_no_body(pool: PgPool) {
    // A claim committed, its lease expired, and the key taken over: the first owner's finish of
    // a large body must write neither the key nor the body.
    let key = Key::parse("fenced").unwrap();
    let fingerprint = Fingerprint::of_json("POST", "/x", b"{}").unwrap();
    let mut connection = pool.acquire().await.unwrap();
    let lock_version = store::next_lock_version(&mut connection).await.unwrap();
    let claim = ClaimRequest {
        tenant: &tenant(1),
        key: &key,
        lock_version,
        fingerprint: &fingerprint,
        workflow: "report.v1",
        request: &serde_json::json!({}),
        lease: Duration::from_secs(60),
    };
    let Claimed::Owned(tx, stale) =
        store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
            .await
            .unwrap()
    else {
        panic!("the key is new");
    };
    tx.commit().await.unwrap();
    expire_all_leases(&pool).await;
    let taken = store::take_over_due(
        &mut connection,
        &[("report.v1".to_owned(), Duration::from_secs(30))],
        10,
    )
    .await
    .unwrap();
    assert_eq!(taken.len(), 1);
    let response = StoredResponse::new(200, body_of(100_000));
    let mut tx = store::Transaction::begin(&pool).await.unwrap();
    let finished = store::finish(&mut tx, &stale, "render", &response, 1024).await;
    drop(tx);
    assert!(
        matches!(finished, Err(store::StoreError::Fenced)),
        "{finished:?}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_responses").await,
        0
    );
    // The owner that holds the fence stores it.
    let owner = &taken[0].1.owner;
    let mut tx = store::Transaction::begin(&pool).await.unwrap();
    store::finish(&mut tx, owner, "render", &response, 1024)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        placement(&pool, "fenced").await,
        (false, true, Some(100_000))
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn retention_deletes_bodies_apart_with_their_keys(pool: PgPool) {
    setup(&pool).await;
    let runner = runner(&pool, None);
    for (i, bytes) in [1024, 70_000, 1 << 20, 500, 100_000]
        .into_iter()
        .enumerate()
    {
        assert!(matches!(
            send(&runner, &format!("old-{i}"), bytes).await,
            Outcome::Executed(_)
        ));
    }
    assert!(matches!(
        send(&runner, "recent", 80_000).await,
        Outcome::Executed(_)
    ));
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = now() - interval '2 days' \
         WHERE key LIKE 'old-%'",
    )
    .execute(&pool)
    .await
    .unwrap();
    // Batches of 2 rows: a batch may hold keys with and without bodies apart.
    let expired = idemflow::expire(&pool, Duration::from_secs(86_400), 2)
        .await
        .unwrap();
    assert_eq!(expired, 5);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        1
    );
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_responses")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["recent"]);
    assert_eq!(orphans(&pool).await, 0);
}

/// A replay reads the key's row, then its body apart in a second statement; retention deleting
/// the key and a new request claiming and finishing it in between (here: one transaction the
/// replay's second statement waits for, holding the bodies' table) must not make the replay
/// answer the old life's status and headers with the new life's body. The body read names the
/// row's life (`created_at`): it finds nothing, and the key is looked up again.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_replay_never_mixes_one_life_of_its_key_with_another(pool: PgPool) {
    setup(&pool).await;
    let runner = runner(&pool, None);
    let bytes = RunnerConfig::DEFAULT_RESPONSE_APART_ABOVE + 1;
    let Outcome::Executed(first) = send(&runner, "k", bytes).await else {
        panic!("executed");
    };
    assert!(placement(&pool, "k").await.1);

    let mut other_life = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE idempotency_responses IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *other_life)
        .await
        .unwrap();
    let replay = {
        let runner = runner.clone();
        tokio::spawn(async move { send(&runner, "k", bytes).await })
    };
    // The replay read the row and waits on the bodies' table.
    let mut waited = 0;
    while count(
        &pool,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE wait_event_type = 'Lock' AND query LIKE '%FROM idempotency_responses%'",
    )
    .await
        == 0
    {
        waited += 1;
        assert!(waited < 500, "the replay never waited for the body");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Meanwhile: the key expired and deleted, claimed again by the same request, and finished
    // with another answer (a later life; the same fingerprint, so the retry is its replay).
    sqlx::raw_sql(
        "UPDATE idempotency_keys SET created_at = created_at + interval '1 second', \
                response_status = 202 WHERE key = 'k'; \
         UPDATE idempotency_responses SET created_at = created_at + interval '1 second', \
                body = 'another life' WHERE key = 'k'",
    )
    .execute(&mut *other_life)
    .await
    .unwrap();
    other_life.commit().await.unwrap();

    let Outcome::Replayed(replayed) = replay.await.unwrap() else {
        panic!("a replay");
    };
    assert!(
        (replayed.status == 202 && replayed.body == b"another life") || replayed == first,
        "one life's status with another's body: {} and {:?}",
        replayed.status,
        String::from_utf8_lossy(&replayed.body[..replayed.body.len().min(40)])
    );
}
