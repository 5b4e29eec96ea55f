//! The protocol end to end against a real PostgreSQL: claim, replay, mismatch, in-progress,
//! takeover, fencing, failures and resumption. One fresh database per test.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use idemflow::{
    Fingerprint, Key, Outcome, Rejection, RunError, Runner, RunnerConfig, StoredResponse,
    TerminalPolicy,
};
use idemflow_pg::{self as store, ClaimRequest, StoreError};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn first_attempt_executes_and_retries_replay(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());

    let first = run(&runner, &workflow, &tenant(1), "k1", &body(100)).await;
    let response = executed(&first).clone();
    assert_eq!(response.status, 201);

    // Whitespace and key order are not part of the request's identity.
    let retry = run(
        &runner,
        &workflow,
        &tenant(1),
        "k1",
        br#"{"source":"tok_visa","amount":100}"#,
    )
    .await;
    assert_eq!(retry, Outcome::Replayed(response));
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(harness.provider.call_count(), 1);
    assert_eq!(key_row(&pool, "k1").await.unwrap().0, "done");
    assert_eq!(harness.provider.keys(), vec!["1:k1:charge".to_owned()]);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn fifty_concurrent_attempts_run_each_phase_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = options
        .max_connections(20)
        .connect_with(connect)
        .await
        .unwrap();
    create_orders(&pool).await;
    let harness = Harness::default();
    // A slow provider keeps the lease live while the others arrive.
    *harness.provider.delay.lock().unwrap() = Some(Duration::from_millis(200));
    let runner = Runner::new(pool.clone());
    let workflow = std::sync::Arc::new(harness.checkout());

    let mut attempts = Vec::new();
    for _ in 0..50 {
        let (runner, workflow) = (runner.clone(), workflow.clone());
        attempts.push(tokio::spawn(async move {
            run(&runner, &workflow, &tenant(1), "same", &body(100)).await
        }));
    }
    let mut executed_count = 0;
    let mut response = None;
    let mut others = Vec::new();
    for attempt in attempts {
        match attempt.await.unwrap() {
            Outcome::Executed(stored) => {
                executed_count += 1;
                response = Some(stored);
            }
            other => others.push(other),
        }
    }
    assert_eq!(executed_count, 1, "exactly one attempt executes");
    let response = response.unwrap();
    for other in others {
        match other {
            Outcome::InProgress { retry_after } => assert!(retry_after > Duration::ZERO),
            Outcome::Replayed(replayed) => assert_eq!(replayed, response),
            unexpected => panic!("unexpected outcome {unexpected:?}"),
        }
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders").await,
        1,
        "create_order ran once"
    );
    assert_eq!(harness.provider.call_count(), 1, "charge was called once");
    assert_eq!(harness.create.runs.load(Ordering::SeqCst), 1);
    assert_eq!(harness.finish.runs.load(Ordering::SeqCst), 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn concurrent_duplicates_of_a_local_only_workflow_get_409_or_the_replay(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = options
        .max_connections(20)
        .connect_with(connect)
        .await
        .unwrap();
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = std::sync::Arc::new(harness.local_only());
    let mut attempts = Vec::new();
    for _ in 0..20 {
        let (runner, workflow) = (runner.clone(), workflow.clone());
        attempts.push(tokio::spawn(async move {
            run(&runner, &workflow, &tenant(1), "local", &body(5)).await
        }));
    }
    let outcomes: Vec<Outcome> = futures_join(attempts).await;
    let executed_count = outcomes
        .iter()
        .filter(|outcome| matches!(outcome, Outcome::Executed(_)))
        .count();
    assert_eq!(executed_count, 1);
    // One transaction holds the claim and the effect. A duplicate that arrives while it is open
    // is told so at once (409), without waiting on it; one that arrives after gets the replay.
    assert!(outcomes.iter().all(|outcome| matches!(
        outcome,
        Outcome::Executed(_) | Outcome::Replayed(_) | Outcome::InProgress { .. }
    )));
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

async fn futures_join<T: Send + 'static>(handles: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut results = Vec::new();
    for handle in handles {
        results.push(handle.await.unwrap());
    }
    results
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn replay_returns_the_stored_bytes_after_the_data_changed(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let first = executed(&run(&runner, &workflow, &tenant(1), "k", &body(100)).await).clone();

    sqlx::query("UPDATE orders SET status = 'refunded', amount = 0")
        .execute(&pool)
        .await
        .unwrap();
    let replay = run(&runner, &workflow, &tenant(1), "k", &body(100)).await;
    let Outcome::Replayed(replayed) = replay else {
        panic!("expected a replay, got {replay:?}")
    };
    assert_eq!(
        replayed.body, first.body,
        "the replay never recomputes from current state"
    );
    assert_eq!(replayed.status, first.status);
    assert_eq!(replayed.headers, first.headers);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn same_key_with_another_body_is_a_mismatch_and_changes_nothing(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(100)).await);
    let before: (Vec<u8>, String, i64, Vec<u8>) = sqlx::query_as(
        "SELECT fingerprint, recovery_point, lock_version, response_body FROM idempotency_keys",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", &body(101)).await,
        Outcome::Mismatch
    );
    // Another path is another request too.
    let elsewhere = idemflow::Request {
        method: "POST",
        path: "/v2/checkouts",
        body: &body(100),
    };
    assert_eq!(
        runner
            .run(
                &workflow,
                &tenant(1),
                &idemflow::Key::parse("k").unwrap(),
                elsewhere
            )
            .await
            .unwrap(),
        Outcome::Mismatch
    );
    // And so is another workflow under the same key.
    let local_only = harness.local_only();
    assert_eq!(
        run(&runner, &local_only, &tenant(1), "k", &body(100)).await,
        Outcome::Mismatch
    );

    let after: (Vec<u8>, String, i64, Vec<u8>) = sqlx::query_as(
        "SELECT fingerprint, recovery_point, lock_version, response_body FROM idempotency_keys",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(before, after);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_mismatch_on_a_started_key_is_reported_before_its_progress(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.provider.script.fail_next.store(1, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "k", &body(1)).await,
        Outcome::Interrupted { .. }
    ));
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", &body(2)).await,
        Outcome::Mismatch
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_same_key_under_two_tenants_is_two_requests(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    executed(&run(&runner, &workflow, &tenant(1), "shared", &body(100)).await);
    executed(&run(&runner, &workflow, &tenant(2), "shared", &body(100)).await);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2);
    assert_eq!(
        harness.provider.charge_count(),
        2,
        "two tenants never share a derived key"
    );
    assert_eq!(
        harness.provider.keys(),
        vec!["1:shared:charge".to_owned(), "2:shared:charge".to_owned()]
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_request_rejected_before_execution_leaves_no_row(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let long_key = "k".repeat(256);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("", body(1)),
        (&long_key, body(1)),
        ("bad\nkey", body(1)),
        ("k", b"{not json".to_vec()),
        (
            "k",
            br#"{"amount": 1, "amount": 2, "source": "x"}"#.to_vec(),
        ),
        ("k", b"\xff\xfe".to_vec()),
        ("k", br#"{"amount": "one hundred", "source": "x"}"#.to_vec()),
        ("k", br#"{"source": "x"}"#.to_vec()),
        // PostgreSQL cannot store U+0000 in jsonb: refused up front, not a database error.
        ("k", br#"{"amount": 1, "source": "a\u0000b"}"#.to_vec()),
    ];
    for (key, body) in &cases {
        let outcome = run(&runner, &workflow, &tenant(1), key, body).await;
        assert!(
            matches!(outcome, Outcome::Rejected(_)),
            "{key:?} {outcome:?}"
        );
    }
    let outcome = run(&runner, &workflow, &tenant(1), "", &body(1)).await;
    assert!(matches!(
        outcome,
        Outcome::Rejected(Rejection::InvalidKey(_))
    ));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 0);
    // The client may fix the request and send it again under the same key.
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_failed_first_local_phase_rolls_back_its_effects_and_keeps_the_key_resumable(
    pool: PgPool,
) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.create.fail_next.store(1, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());

    let outcome = run(&runner, &workflow, &tenant(1), "k", &body(100)).await;
    assert!(
        matches!(outcome, Outcome::Interrupted { .. }),
        "{outcome:?}"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders").await,
        0,
        "the insert rolled back"
    );
    assert_eq!(key_row(&pool, "k").await.unwrap().1, "start");
    let last_error: Option<String> = sqlx::query_scalar("SELECT last_error FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        last_error
            .unwrap()
            .contains("create_order: scripted failure")
    );
    assert_eq!(harness.provider.call_count(), 0);

    // Until the retry time passes, the key is in progress; after it, a retry finishes it.
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "k", &body(100)).await,
        Outcome::InProgress { .. }
    ));
    expire_lease(&pool, "k").await;
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(100)).await);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_failed_local_phase_after_a_foreign_one_keeps_the_foreign_result(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.finish.fail_next.store(1, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());

    let outcome = run(&runner, &workflow, &tenant(1), "k", &body(100)).await;
    assert!(
        matches!(outcome, Outcome::Interrupted { .. }),
        "{outcome:?}"
    );
    // mark_paid's update rolled back; the charge's result is recorded as the recovery point.
    assert_eq!(
        count(
            &pool,
            "SELECT count(*) FROM orders WHERE status = 'created'"
        )
        .await,
        1
    );
    let (state, recovery_point, ..) = key_row(&pool, "k").await.unwrap();
    assert_eq!(
        (state.as_str(), recovery_point.as_str()),
        ("started", "charge")
    );

    expire_lease(&pool, "k").await;
    let response = executed(&run(&runner, &workflow, &tenant(1), "k", &body(100)).await).clone();
    assert_eq!(response.status, 201);
    assert_eq!(
        harness.provider.call_count(),
        1,
        "the charge is not repeated: its result was kept"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE status = 'paid'").await,
        1
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_crash_between_phases_is_finished_by_a_second_call_without_repeating_effects(
    pool: PgPool,
) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());

    // Crash 1: after create_order committed, during the charge (the call never returns).
    harness
        .provider
        .script
        .hang_next
        .store(true, Ordering::SeqCst);
    let (one, seven, eight) = (tenant(1), body(7), body(8));
    let crashed = tokio::time::timeout(
        Duration::from_millis(300),
        run(&runner, &workflow, &one, "a", &seven),
    );
    assert!(crashed.await.is_err(), "the first owner is gone mid-call");
    assert_eq!(key_row(&pool, "a").await.unwrap().1, "create_order");
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "a", &body(7)).await,
        Outcome::InProgress { .. }
    ));
    expire_lease(&pool, "a").await;
    executed(&run(&runner, &workflow, &tenant(1), "a", &body(7)).await);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE key = 'a'").await,
        1,
        "create_order ran once"
    );
    assert_eq!(harness.provider.charge_count(), 1);
    assert_eq!(
        harness.provider.calls.lock().unwrap()["1:a:charge"],
        2,
        "called again with the same key"
    );

    // Crash 2: after the charge returned, during mark_paid (its transaction never commits).
    harness.finish.hang_next.store(true, Ordering::SeqCst);
    let crashed = tokio::time::timeout(
        Duration::from_millis(300),
        run(&runner, &workflow, &one, "b", &eight),
    );
    assert!(crashed.await.is_err());
    let (state, recovery_point, claimed_with, _) = key_row(&pool, "b").await.unwrap();
    assert_eq!(
        (state.as_str(), recovery_point.as_str()),
        ("started", "create_order")
    );
    expire_lease(&pool, "b").await;
    let response = executed(&run(&runner, &workflow, &tenant(1), "b", &body(8)).await).clone();
    assert_eq!(response.status, 201);
    let (state, recovery_point, lock_version, attempts) = key_row(&pool, "b").await.unwrap();
    assert_eq!(
        (state.as_str(), recovery_point.as_str(), attempts),
        ("done", "mark_paid", 2)
    );
    assert_ne!(
        lock_version, claimed_with,
        "the takeover drew a new fencing token"
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM orders WHERE key = 'b'").await,
        1
    );
    let paid_by: String = sqlx::query_scalar("SELECT paid_by FROM orders WHERE key = 'b'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        paid_by, "attempt-2",
        "only the second owner's mark_paid committed"
    );
    assert_eq!(harness.provider.charge_count(), 2, "one charge per request");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_stale_owner_commits_nothing(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (
        Runner::new(pool.clone()),
        std::sync::Arc::new(harness.checkout()),
    );

    // Owner A stalls inside the charge call, after its claim committed.
    harness
        .provider
        .script
        .hang_next
        .store(true, Ordering::SeqCst);
    let stale = {
        let (runner, workflow) = (runner.clone(), workflow.clone());
        tokio::spawn(async move {
            runner
                .run(
                    &workflow,
                    &tenant(1),
                    &idemflow::Key::parse("k").unwrap(),
                    request(&body(100)),
                )
                .await
        })
    };
    harness.provider.script.entered.notified().await;

    // Its lease expires; B takes over and finishes the request.
    expire_lease(&pool, "k").await;
    let response = executed(&run(&runner, &workflow, &tenant(1), "k", &body(100)).await).clone();

    // A wakes up and tries to commit mark_paid: fenced, nothing of it lands.
    harness.provider.script.resume.notify_one();
    let stale_result = stale.await.unwrap();
    assert!(
        matches!(stale_result, Err(RunError::Fenced)),
        "{stale_result:?}"
    );
    assert_eq!(
        harness.finish.runs.load(Ordering::SeqCst),
        2,
        "both owners ran mark_paid"
    );
    let paid_by: String = sqlx::query_scalar("SELECT paid_by FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        paid_by, "attempt-2",
        "only the new owner's effects committed"
    );
    let replay = run(&runner, &workflow, &tenant(1), "k", &body(100)).await;
    assert_eq!(replay, Outcome::Replayed(response));
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn every_kind_of_stale_write_is_fenced(pool: PgPool) {
    let tenant = tenant(9);
    let key = Key::parse("fenced").unwrap();
    let fingerprint = Fingerprint::of_json("POST", "/x", b"{}").unwrap();
    let request = serde_json::json!({});
    let claim = ClaimRequest {
        tenant: &tenant,
        key: &key,
        lock_version: 1 << 40,
        fingerprint: &fingerprint,
        workflow: "w.v1",
        request: &request,
        lease: Duration::from_secs(60),
    };
    let store::Claimed::Owned(claimed, stale) =
        store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
            .await
            .unwrap()
    else {
        panic!("a new key is ours");
    };
    claimed.commit().await.unwrap();
    let mut connection = pool.acquire().await.unwrap();

    // A live lease cannot be taken over.
    let too_early = store::take_over(
        &mut connection,
        &tenant,
        &key,
        stale.lock_version(),
        Duration::from_secs(60),
    );
    assert!(too_early.await.unwrap().is_none());

    expire_lease(&pool, "fenced").await;
    let taken = store::take_over(
        &mut connection,
        &tenant,
        &key,
        stale.lock_version(),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .unwrap();
    assert_ne!(taken.owner.lock_version(), stale.lock_version());
    // A second takeover with the same token loses the compare-and-set.
    expire_lease(&pool, "fenced").await;
    let again = store::take_over(
        &mut connection,
        &tenant,
        &key,
        stale.lock_version(),
        Duration::from_secs(60),
    );
    assert!(again.await.unwrap().is_none());
    store::renew_lease(&mut connection, &taken.owner, Duration::from_secs(60))
        .await
        .unwrap();

    let before: (String, String, i64, Option<String>) = sqlx::query_as(
        "SELECT state, recovery_point, lock_version, last_error FROM idempotency_keys",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let output = serde_json::json!({"x": 1});
    let response = StoredResponse::new(200, "stale");
    let long = Duration::from_secs(60);
    let results = [
        store::advance(&mut connection, &stale, "phase", &output, long).await,
        store::finish(&mut connection, &stale, "phase", &response, usize::MAX).await,
        store::renew_lease(&mut connection, &stale, long).await,
        store::postpone(&mut connection, &stale, Duration::ZERO, "stale").await,
        store::delete_owned(&mut connection, &stale).await,
    ];
    for result in results {
        assert!(matches!(result, Err(StoreError::Fenced)), "{result:?}");
    }
    let after: (String, String, i64, Option<String>) = sqlx::query_as(
        "SELECT state, recovery_point, lock_version, last_error FROM idempotency_keys",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(before, after);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_lease_is_judged_by_the_database_clock(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.provider.script.fail_next.store(1, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "k", &body(1)).await,
        Outcome::Interrupted { .. }
    ));
    // An hour left by the database's clock: in progress, whatever this process's clock says.
    sqlx::query("UPDATE idempotency_keys SET locked_until = now() + interval '1 hour'")
        .execute(&pool)
        .await
        .unwrap();
    let Outcome::InProgress { retry_after } =
        run(&runner, &workflow, &tenant(1), "k", &body(1)).await
    else {
        panic!("expected in progress")
    };
    assert!(
        retry_after > Duration::from_secs(3590) && retry_after <= Duration::from_secs(3600),
        "{retry_after:?}"
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_terminal_error_is_stored_and_replayed_by_default(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.finish.fail_terminally.store(true, Ordering::SeqCst);
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let response = executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await).clone();
    assert_eq!(response, StoredResponse::new(409, "order rejected"));
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", &body(1)).await,
        Outcome::Replayed(response)
    );
    assert_eq!(key_row(&pool, "k").await.unwrap().1, "charge");
    assert_eq!(harness.finish.runs.load(Ordering::SeqCst), 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_terminal_error_can_forget_the_key_instead(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness.finish.fail_terminally.store(true, Ordering::SeqCst);
    let config = RunnerConfig::default().with_terminal_errors(TerminalPolicy::Forget);
    let (runner, workflow) = (
        Runner::with_config(pool.clone(), config),
        harness.checkout(),
    );
    let outcome = run(&runner, &workflow, &tenant(1), "k", &body(1)).await;
    assert_eq!(
        outcome,
        Outcome::Forgotten(StoredResponse::new(409, "order rejected"))
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
    // The same key runs again as a new request; the charge is replayed by the provider.
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await);
    assert_eq!(harness.provider.charge_count(), 1);
    assert_eq!(harness.provider.call_count(), 2);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_declined_card_is_data_stored_like_any_response(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let declined = br#"{"amount": 100, "source": "tok_declined"}"#;
    let response = executed(&run(&runner, &workflow, &tenant(1), "k", declined).await).clone();
    assert_eq!(response.status, 402);
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", declined).await,
        Outcome::Replayed(response)
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_dropped_request_leaves_no_connection_in_a_transaction(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    // One connection: a leaked transaction would be handed straight to the next borrower, and
    // what it writes would never become visible to anyone else.
    let pool = options
        .max_connections(1)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let observer = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect)
        .await
        .unwrap();
    create_orders(&pool).await;
    sqlx::query("CREATE TABLE probe (step bigint)")
        .execute(&pool)
        .await
        .unwrap();
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());

    let (one, small) = (tenant(1), body(1));
    // Dropped at every point of the first transaction, from before BEGIN to mid-phase.
    for step in 0..200_i64 {
        let key = format!("drop-{step}");
        let attempt = run(&runner, &workflow, &one, &key, &small);
        let _ =
            tokio::time::timeout(Duration::from_micros(step.unsigned_abs() * 15), attempt).await;
        sqlx::query("INSERT INTO probe VALUES ($1)")
            .bind(step)
            .execute(&pool)
            .await
            .unwrap();
        let visible: i64 = sqlx::query_scalar("SELECT count(*) FROM probe WHERE step = $1")
            .bind(step)
            .fetch_one(&observer)
            .await
            .unwrap();
        assert_eq!(
            visible, 1,
            "step {step}: the pooled connection was left inside a transaction"
        );
    }
    // Dropped mid-phase: the key stays resumable.
    harness.create.hang_next.store(true, Ordering::SeqCst);
    let attempt = run(&runner, &workflow, &one, "mid", &small);
    assert!(
        tokio::time::timeout(Duration::from_millis(200), attempt)
            .await
            .is_err()
    );
    assert!(
        key_row(&pool, "mid").await.is_none(),
        "the claim rolled back with its transaction"
    );
    executed(&run(&runner, &workflow, &one, "mid", &small).await);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_request_failing_the_workflows_check_is_rejected_before_its_claim(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let workflow = idemflow::Workflow::builder::<CheckoutRequest>("checked.v1")
        .validate(|request| {
            if request.amount > 0 {
                Ok(())
            } else {
                Err("amount must be positive".into())
            }
        })
        .local(PlaceOrder(harness.create.clone()))
        .build()
        .unwrap();
    let runner = Runner::new(pool.clone());
    let outcome = run(&runner, &workflow, &tenant(1), "k", &body(0)).await;
    assert_eq!(
        outcome,
        Outcome::Rejected(Rejection::InvalidInput("amount must be positive".into()))
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
    assert_eq!(harness.create.runs.load(Ordering::SeqCst), 0);
    executed(&run(&runner, &workflow, &tenant(1), "k", &body(3)).await);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_look_up_answers_duplicates_and_still_claims_and_takes_over(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let first = executed(&run(&runner, &workflow, &tenant(1), "k", &body(1)).await).clone();
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", &body(1)).await,
        Outcome::Replayed(first)
    );
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", &body(2)).await,
        Outcome::Mismatch
    );

    harness.provider.script.fail_next.store(1, Ordering::SeqCst);
    let interrupted = run(&runner, &workflow, &tenant(1), "flaky", &body(1)).await;
    assert!(matches!(interrupted, Outcome::Interrupted { .. }));
    let busy = run(&runner, &workflow, &tenant(1), "flaky", &body(1)).await;
    assert!(matches!(busy, Outcome::InProgress { .. }), "{busy:?}");
    expire_lease(&pool, "flaky").await;
    executed(&run(&runner, &workflow, &tenant(1), "flaky", &body(1)).await);
    assert_eq!(count(&pool, "SELECT count(*) FROM orders").await, 2);
    assert_eq!(harness.provider.charge_count(), 2);
}
