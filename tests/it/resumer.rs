//! The resumer against a real PostgreSQL: abandoned keys are finished from their recovery
//! points, concurrent resumers split the work, retries back off in the lease, exhausted keys take
//! the failure path, and shutdown gives leases back.

use idemflow::PgStore;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use idemflow::{DrainReport, Outcome, Registry, Resumer, ResumerConfig, Runner};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn resumer(pool: &PgPool, harness: &Harness, config: ResumerConfig) -> Resumer<PgStore> {
    logs();
    let mut registry = Registry::new();
    registry
        .register(harness.checkout_with_failure_path())
        .unwrap();
    Resumer::with_config(Runner::new(pool.clone()), registry, config)
}

/// A worker running `Resumer::run` until the test stops it.
struct Running {
    stop: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    fn start(worker: Resumer<PgStore>) -> Self {
        let stop = Arc::new(tokio::sync::Notify::new());
        let stopped = stop.clone();
        let task = tokio::spawn(worker.run(async move { stopped.notified().await }));
        Self { stop, task }
    }

    /// Asks it to shut down and waits until it has.
    async fn stop(self) {
        self.stop.notify_one();
        self.task.await.unwrap();
    }
}

fn quick_config() -> ResumerConfig {
    ResumerConfig::default()
        .with_idle_min(Duration::from_millis(10))
        .with_idle_max(Duration::from_millis(50))
        .with_retention(None)
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn keys_left_at_every_recovery_point_are_finished_without_repeating_effects(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (
        Runner::new(pool.clone()),
        harness.checkout_with_failure_path(),
    );
    let one = tenant(1);

    // Left at `start`: create_order failed (its insert rolled back).
    harness.create.fail_next.store(1, Ordering::SeqCst);
    let at_start = run(&runner, &workflow, &one, "at-start", &body(1)).await;
    assert!(matches!(at_start, Outcome::Interrupted { .. }));
    // Left at `create_order`: the owner vanished during the charge.
    harness
        .provider
        .script
        .hang_next
        .store(true, Ordering::SeqCst);
    let (two, gone) = (body(2), "at-create-order");
    let crashed = tokio::time::timeout(
        Duration::from_millis(200),
        run(&runner, &workflow, &one, gone, &two),
    );
    assert!(crashed.await.is_err());
    // Left at `charge`: mark_paid failed after the charge succeeded.
    harness.finish.fail_next.store(1, Ordering::SeqCst);
    let at_charge = run(&runner, &workflow, &one, "at-charge", &body(3)).await;
    assert!(matches!(at_charge, Outcome::Interrupted { .. }));

    let points: Vec<String> =
        sqlx::query_scalar("SELECT recovery_point FROM idempotency_keys ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(points, ["charge", "create_order", "start"]); // at-charge, at-create-order, at-start
    expire_all_leases(&pool).await;

    let report = resumer(&pool, &harness, quick_config())
        .drain()
        .await
        .unwrap();
    assert_eq!(
        report,
        DrainReport {
            taken: 3,
            finished: 3,
            interrupted: 0,
            failed: 0
        }
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'done'"
        )
        .await,
        3
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders").await,
        3,
        "one order per key"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE status = 'paid'").await,
        3
    );
    assert_eq!(harness.provider.charge_count(), 3, "one charge per key");
    let calls = harness.provider.calls.lock().unwrap().clone();
    assert_eq!(calls["1:at-start:charge"], 1);
    assert_eq!(
        calls["1:at-create-order:charge"], 2,
        "repeated with the same derived key"
    );
    assert_eq!(
        calls["1:at-charge:charge"], 1,
        "its result was kept: not called again"
    );
}

/// Seeds `count` keys of checkout.v1 left at `create_order` with expired leases, each with its
/// order row, as a crashed fleet would leave them.
async fn seed_due_keys(pool: &PgPool, count: i64) {
    sqlx::query(
        "INSERT INTO orders (id, tenant, key, amount) \
         SELECT 1000 + n, '1', 'due-' || n, n FROM generate_series(1, $1) AS n",
    )
    .bind(count)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys \
             (tenant, key, fingerprint, workflow, request, recovery_point, phase_output, locked_until) \
         SELECT '1', 'due-' || n, sha256(n::text::bytea), 'checkout.v1', \
                jsonb_build_object('amount', n, 'source', 'tok_visa'), 'create_order', \
                jsonb_build_object('order_id', 1000 + n, 'amount', n, 'source', 'tok_visa'), \
                now() - interval '1 minute' \
         FROM generate_series(1, $1) AS n",
    )
    .bind(count)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn four_concurrent_resumers_over_500_due_keys_never_run_a_key_twice(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = options
        .max_connections(20)
        .connect_with(connect)
        .await
        .unwrap();
    create_orders(&pool).await;
    seed_due_keys(&pool, 500).await;
    let harness = Harness::default();
    let config = quick_config().with_batch_size(16).with_concurrency(4);
    let drains: Vec<_> = (0..4)
        .map(|_| {
            let resumer = resumer(&pool, &harness, config.clone());
            tokio::spawn(async move { resumer.drain().await.unwrap() })
        })
        .collect();
    let mut taken = 0;
    for drain in drains {
        let report = drain.await.unwrap();
        assert_eq!(report.failed, 0, "{report:?}");
        taken += report.taken;
    }
    assert_eq!(taken, 500, "every key taken exactly once across the four");
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'done'"
        )
        .await,
        500
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE attempts <> 2"
        )
        .await,
        0
    );
    assert_eq!(
        harness.finish.runs.load(Ordering::SeqCst),
        500,
        "mark_paid ran once per key"
    );
    let calls = harness.provider.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 500);
    assert!(
        calls.values().all(|&calls| calls == 1),
        "one charge call per key"
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn leased_finished_and_unknown_workflow_keys_are_left_alone(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    executed(&run(&runner, &workflow, &tenant(1), "finished", &body(1)).await);
    seed_due_keys(&pool, 2).await;
    // due-1: still leased (a live owner); due-2: due, but of a workflow nobody here knows.
    sqlx::query("UPDATE idempotency_keys SET locked_until = now() + interval '1 minute' WHERE key = 'due-1'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE idempotency_keys SET workflow = 'ghost.v1' WHERE key = 'due-2'")
        .execute(&pool)
        .await
        .unwrap();
    let before: Vec<(String, i64, i32)> =
        sqlx::query_as("SELECT key, lock_version, attempts FROM idempotency_keys ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap();

    let report = resumer(&pool, &harness, quick_config())
        .drain()
        .await
        .unwrap();
    assert_eq!(report, DrainReport::default());
    let after: Vec<(String, i64, i32)> =
        sqlx::query_as("SELECT key, lock_version, attempts FROM idempotency_keys ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(before, after);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_empty_database_is_a_no_op(pool: PgPool) {
    let harness = Harness::default();
    assert_eq!(
        resumer(&pool, &harness, quick_config())
            .drain()
            .await
            .unwrap(),
        DrainReport::default()
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_failing_provider_raises_attempts_while_the_worker_keeps_running(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.retry.lock().unwrap() = Some(quick_retries(10));
    harness.provider.script.fail_next.store(4, Ordering::SeqCst);
    let (runner, workflow) = (
        Runner::new(pool.clone()),
        harness.checkout_with_failure_path(),
    );
    let outcome = run(&runner, &workflow, &tenant(1), "flaky", &body(1)).await;
    assert!(
        matches!(outcome, Outcome::Interrupted { .. }),
        "{outcome:?}"
    );
    let (attempts, error): (i32, Option<String>) =
        sqlx::query_as("SELECT attempts, last_error FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1);
    assert_eq!(error.as_deref(), Some("charge: scripted failure"));

    let worker = resumer(&pool, &harness, quick_config());
    let running = Running::start(worker);
    eventually(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        1,
    )
    .await;
    running.stop().await;

    assert_eq!(
        harness.provider.call_count(),
        5,
        "four failures, then the charge"
    );
    assert_eq!(harness.provider.charge_count(), 1);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE status = 'paid'").await,
        1
    );
    // attempts counted the executions at the `create_order` recovery point: 1 + 4 takeovers.
    let recorded: (i32, String) =
        sqlx::query_as("SELECT attempts, recovery_point FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(recorded, (5, "mark_paid".to_owned()));
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn when_retries_run_out_the_failure_path_response_is_stored(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.retry.lock().unwrap() = Some(quick_retries(2));
    harness
        .provider
        .script
        .fail_next
        .store(100, Ordering::SeqCst);
    let (runner, workflow) = (
        Runner::new(pool.clone()),
        harness.checkout_with_failure_path(),
    );
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "doomed", &body(9)).await,
        Outcome::Interrupted { .. }
    ));
    expire_all_leases(&pool).await;

    let report = resumer(&pool, &harness, quick_config())
        .drain()
        .await
        .unwrap();
    assert_eq!(report.finished, 1, "{report:?}");
    let (state, status, body_text): (String, i16, Vec<u8>) =
        sqlx::query_as("SELECT state, response_status, response_body FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), status), ("done", 502));
    let body_json: serde_json::Value = serde_json::from_slice(&body_text).unwrap();
    assert_eq!(body_json["failed_phase"], "charge");
    assert_eq!(body_json["attempts"], 2);
    assert_eq!(body_json["recovery_point"], "create_order");
    // What to undo: the recovery point's stored output, though an earlier attempt recorded it.
    let order_id: i64 = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        body_json["recovery_output"]["order_id"], order_id,
        "{body_json}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE status = 'failed'").await,
        1
    );
    // The client's retry gets the same final answer.
    let replay = run(&runner, &workflow, &tenant(1), "doomed", &body(9)).await;
    assert!(matches!(replay, Outcome::Replayed(response) if response.status == 502));
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn without_a_failure_path_giving_up_stores_a_500_problem(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.retry.lock().unwrap() = Some(quick_retries(1));
    harness
        .provider
        .script
        .fail_next
        .store(100, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let response = executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await).clone();
    assert_eq!(response.status, 500);
    assert!(
        String::from_utf8(response.body)
            .unwrap()
            .contains("gave up after 1 attempts: charge: scripted failure")
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'started'"
        )
        .await,
        0
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn shutdown_gives_back_the_leases_of_keys_not_yet_finished(pool: PgPool) {
    create_orders(&pool).await;
    seed_due_keys(&pool, 10).await;
    let harness = Harness::default();
    // The first key resumed hangs in its charge, so the other nine wait in the queue.
    harness
        .provider
        .script
        .hang_next
        .store(true, Ordering::SeqCst);
    let config = quick_config()
        .with_batch_size(10)
        .with_concurrency(1)
        .with_shutdown_grace(Duration::from_millis(100));
    let worker = resumer(&pool, &harness, config);
    let running = Running::start(worker);
    harness.provider.script.entered.notified().await;
    running.stop().await;

    // All ten are due again at once: nine never started, one stopped after the grace period.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE locked_until <= now()"
        )
        .await,
        10
    );
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'started'"
        )
        .await,
        10
    );
    // The nine unstarted ones did not count an attempt.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM idempotency_keys WHERE attempts = 1"
        )
        .await,
        9
    );
    // Another resumer finishes all of them now.
    let report = resumer(&pool, &harness, quick_config())
        .drain()
        .await
        .unwrap();
    assert_eq!(report.finished, 10);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_postponed_key_wakes_an_idle_resumer(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let retries = quick_retries(5).with_initial_backoff(Duration::ZERO);
    *harness.provider.retry.lock().unwrap() = Some(retries);
    // A resumer that, left to itself, would not scan again for a minute.
    let config = quick_config()
        .with_idle_min(Duration::from_secs(60))
        .with_idle_max(Duration::from_secs(60));
    let worker = resumer(&pool, &harness, config);
    let running = Running::start(worker);
    tokio::time::sleep(Duration::from_millis(300)).await; // let it make its first, empty scan

    harness.provider.script.fail_next.store(1, Ordering::SeqCst);
    let (runner, workflow) = (
        Runner::new(pool.clone()),
        harness.checkout_with_failure_path(),
    );
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "k", &body(1)).await,
        Outcome::Interrupted { .. }
    ));
    // The release announced the key: the resumer finishes it well before its next scan.
    eventually(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        1,
    )
    .await;
    running.stop().await;
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_worker_carries_on_after_its_connections_are_killed(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let worker = resumer(&pool, &harness, quick_config());
    let running = Running::start(worker);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Every other connection to this database is terminated, as a database restart would.
    let observer = PgPoolOptions::new()
        .max_connections(1)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    .fetch_one(&observer)
    .await
    .unwrap();
    assert!(killed >= 1, "the worker's connections were there to kill");

    seed_due_keys(&observer, 3).await;
    eventually(
        &observer,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        3,
    )
    .await;
    running.stop().await;
}

/// Leaves `keys` at `create_order` (the charge failed once), with expired leases.
async fn keys_before_the_charge(pool: &PgPool, harness: &Harness, keys: &[&str]) {
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    for key in keys {
        harness.provider.script.fail_next.store(1, Ordering::SeqCst);
        let outcome = run(&runner, &workflow, &tenant(1), key, &body(1)).await;
        assert!(
            matches!(outcome, Outcome::Interrupted { .. }),
            "{outcome:?}"
        );
    }
    expire_all_leases(pool).await;
}

/// A resumer takes over only the keys it can start now. Keys taken over and left waiting for a
/// slot would lose their lease while they wait, be taken by another owner, and be run anyway.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_resumer_takes_over_only_what_it_can_start(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    keys_before_the_charge(&pool, &harness, &["k1", "k2", "k3"]).await;
    let lease = Duration::from_secs(1);
    *harness.provider.timeout.lock().unwrap() = Some(Duration::from_millis(900));
    *harness.provider.delay.lock().unwrap() = Some(Duration::from_millis(800));
    let mut registry = Registry::new();
    registry.register(harness.checkout_leased(lease)).unwrap();
    let config = quick_config().with_batch_size(3).with_concurrency(1);
    let worker = Resumer::with_config(Runner::new(pool.clone()), registry, config);
    let running = Running::start(worker);

    // While the resumer's first charge runs, a client retries a key it has not called again.
    while harness.provider.call_count() < 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let calls = harness.provider.calls.lock().unwrap().clone();
    let other = ["k1", "k2", "k3"]
        .into_iter()
        .find(|key| calls[&format!("1:{key}:charge")] == 1)
        .unwrap();
    expire_lease(&pool, other).await;
    let workflow = harness.checkout_leased(lease);
    let outcome = run(
        &Runner::new(pool.clone()),
        &workflow,
        &tenant(1),
        other,
        &body(1),
    )
    .await;
    assert!(matches!(outcome, Outcome::Executed(_)), "{outcome:?}");

    eventually(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        3,
    )
    .await;
    // A resumer that had taken the key over before the client did, and kept it waiting for a
    // slot, would call it within one more charge's time: give it that time.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    running.stop().await;
    let calls = harness.provider.calls.lock().unwrap().clone();
    for key in ["k1", "k2", "k3"] {
        assert_eq!(
            calls[&format!("1:{key}:charge")],
            2,
            "{key}: its failed first call and one more: {calls:?}"
        );
    }
}

/// A resumed key whose next phase is foreign confirms its fence before calling out when it was
/// handed over late (after a wait in a queue, a pause): it must not call as a stale owner.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_resumed_key_confirms_its_fence_before_calling_out(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    keys_before_the_charge(&pool, &harness, &["k"]).await;
    let workflow = harness.checkout();
    let names = vec![(workflow.name().to_owned(), Duration::from_secs(60))];
    let mut connection = pool.acquire().await.unwrap();
    let stale = idemflow_pg::take_over_due(&mut connection, &names, 10)
        .await
        .unwrap()
        .pop()
        .unwrap();
    // Before it starts, the key is taken over by another owner.
    expire_all_leases(&pool).await;
    let current = idemflow_pg::take_over_due(&mut connection, &names, 10)
        .await
        .unwrap();
    assert_eq!(current.len(), 1);

    // It was handed over after a wait longer than its lease could cover a call for.
    let mut stale = stale.1;
    stale.lease_from = std::time::Instant::now()
        .checked_sub(Duration::from_secs(3600))
        .unwrap();
    let outcome = Runner::new(pool.clone()).resume(&workflow, stale).await;
    assert!(
        matches!(outcome, Err(idemflow::RunError::Fenced)),
        "{outcome:?}"
    );
    assert_eq!(
        harness.provider.call_count(),
        1,
        "only the first, failed call: the stale owner never called"
    );
}

/// A panic in a phase a resumer runs is a failed attempt: recorded, retried, and the worker
/// carries on.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_panicking_phase_in_a_resumed_key_is_retried_and_the_worker_carries_on(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.retry.lock().unwrap() = Some(quick_retries(5));
    keys_before_the_charge(&pool, &harness, &["k"]).await;
    harness
        .provider
        .script
        .panic_next
        .store(true, Ordering::SeqCst);
    let worker = resumer(&pool, &harness, quick_config());
    let running = Running::start(worker);
    eventually(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        1,
    )
    .await;
    running.stop().await;
    assert_eq!(
        harness.provider.call_count(),
        3,
        "failed, panicked, charged"
    );
    assert_eq!(harness.provider.charge_count(), 1);
}

/// A hook that panics at one crash point, once.
#[derive(Debug)]
struct PanicOnce(std::sync::atomic::AtomicBool);

#[async_trait::async_trait]
impl idemflow::CrashHook for PanicOnce {
    async fn crash_at(
        &self,
        point: &idemflow::CrashPoint,
        _: &idemflow::TenantId,
        _: &idemflow::Key,
    ) -> bool {
        if point.to_string() == "before_call:charge" && !self.0.swap(true, Ordering::SeqCst) {
            panic!("a bug in the engine's own code");
        }
        false
    }
}

/// A panic outside any phase (here, in a crash hook) ends the task that resumed the key; the
/// worker gives that key's lease back at once (its attempt counts) and keeps no record of it.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_key_whose_task_panicked_is_given_back_at_once(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    keys_before_the_charge(&pool, &harness, &["k"]).await;
    let mut registry = Registry::new();
    registry.register(harness.checkout()).unwrap();
    let hook = Arc::new(PanicOnce(std::sync::atomic::AtomicBool::new(false)));
    let runner = Runner::new(pool.clone()).with_crash_hook(hook);
    let worker = Resumer::with_config(runner, registry, quick_config());
    let running = Running::start(worker);
    // The lease is 60 s: only a key given back at once is finished within the wait.
    eventually(
        &pool,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        1,
    )
    .await;
    running.stop().await;
    assert_eq!(harness.provider.charge_count(), 1);
}
