//! Retention: finished keys older than the window are deleted in bounded batches; started keys
//! and fresh ones are kept.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use idemflow::{Registry, Resumer, ResumerConfig, Retention, Runner};
use sqlx::PgPool;

/// Seeds `count` keys named `prefix-N` in `state`, created `age` ago.
async fn seed(pool: &PgPool, prefix: &str, count: i64, state: &str, age: &str) {
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, state, locked_until, \
             response_status, response_headers, response_body, created_at, finished_at) \
         SELECT '1', $1 || '-' || n, sha256(n::text::bytea), 'checkout.v1', '{}', $3, \
                CASE WHEN $3 = 'started' THEN now() + interval '1 hour' END, \
                CASE WHEN $3 = 'done' THEN 201 END, CASE WHEN $3 = 'done' THEN '[]'::jsonb END, \
                CASE WHEN $3 = 'done' THEN '{}'::bytea END, now() - $4::interval, \
                CASE WHEN $3 = 'done' THEN now() - $4::interval END \
         FROM generate_series(1, $2) AS n",
    )
    .bind(prefix)
    .bind(count)
    .bind(state)
    .bind(age)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn expire_deletes_only_old_finished_keys_in_batches(pool: PgPool) {
    seed(&pool, "old-done", 2500, "done", "2 days").await;
    seed(&pool, "fresh-done", 10, "done", "1 hour").await;
    seed(&pool, "old-started", 5, "started", "3 days").await;
    let day = Duration::from_secs(24 * 60 * 60);

    // One batch deletes at most its size.
    let mut connection = pool.acquire().await.unwrap();
    assert_eq!(
        idemflow_pg::expire_batch(&mut connection, day, 1000)
            .await
            .unwrap(),
        1000
    );
    drop(connection);
    // expire() goes on batch by batch until nothing old is left.
    assert_eq!(idemflow::expire(&pool, day, 1000).await.unwrap(), 1500);
    assert_eq!(idemflow::expire(&pool, day, 1000).await.unwrap(), 0);

    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE key LIKE 'old-done-%'"
        )
        .await,
        0
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE key LIKE 'fresh-done-%'"
        )
        .await,
        10
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE key LIKE 'old-started-%'"
        )
        .await,
        5
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_worker_runs_retention_periodically(pool: PgPool) {
    seed(&pool, "old-done", 30, "done", "2 days").await;
    seed(&pool, "old-started", 2, "started", "2 days").await;
    let harness = Harness::default();
    let mut registry = Registry::new();
    registry.register(harness.checkout()).unwrap();
    let retention = Retention::default()
        .with_keep_for(Duration::from_secs(3600))
        .with_batch_size(7)
        .with_max_rows_per_second(Some(1000))
        .with_every(Duration::from_millis(20));
    let config = ResumerConfig::default().with_retention(Some(retention));
    let worker = Resumer::with_config(Runner::new(pool.clone()), registry, config);
    let stop = Arc::new(tokio::sync::Notify::new());
    let stopped = stop.clone();
    let running = tokio::spawn(worker.run(async move { stopped.notified().await }));
    eventually(&pool, "SELECT count(*) FROM idempotency_keys", 2).await;
    stop.notify_one();
    running.await.unwrap();
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'started'"
        )
        .await,
        2
    );
}

/// The window starts when the response is stored, not when the key was claimed: a key that
/// stayed started for longer than the window (resumers down for a day) and finished just now is
/// kept, or a client that only ever saw 409s would run the request again on its next retry.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_key_is_kept_for_the_window_after_it_finished_however_old_its_claim(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.provider.script.fail_next.store(1, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let outcome = run(&runner, &workflow, &tenant(1), "late", &body(5)).await;
    assert!(
        matches!(outcome, idemflow::Outcome::Interrupted { .. }),
        "{outcome:?}"
    );
    // A day and an hour pass before it is finished.
    sqlx::query(
        "UPDATE idempotency_keys SET created_at = now() - interval '25 hours', \
                locked_until = now() - interval '1 hour'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let response = executed(&run(&runner, &workflow, &tenant(1), "late", &body(5)).await).clone();

    let day = Duration::from_secs(24 * 60 * 60);
    assert_eq!(idemflow::expire(&pool, day, 100).await.unwrap(), 0);
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "late", &body(5)).await,
        idemflow::Outcome::Replayed(response)
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);

    // A day after it finished, it goes.
    sqlx::query("UPDATE idempotency_keys SET finished_at = now() - interval '25 hours'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(idemflow::expire(&pool, day, 100).await.unwrap(), 1);
}
