//! The claim's message (`BEGIN`, advisory lock and insert in one round trip) and the look-up
//! before it, at their edges: a lost race, a claim in flight, a failing insert, a resumed key
//! with nothing to commit. Every connection must come back clean (no transaction left open or
//! aborted), so most tests run on a pool of one connection and use it again afterwards.

use std::time::Duration;

use crate::support::*;
use idemflow::{Fingerprint, Key, Outcome, Runner, RunnerConfig, TenantId, TerminalPolicy};
use idemflow_pg::partitions::{self, PartitionPlan};
use idemflow_pg::{self as store, ClaimRequest, Claimed, LookUp, statements};
use idemflow_testrig::server_log::ServerLog;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use std::sync::atomic::Ordering;

fn claim_of<'a>(
    tenant: &'a TenantId,
    key: &'a Key,
    fingerprint: &'a Fingerprint,
    request: &'a Value,
) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant,
        key,
        lock_version: 1 << 40,
        fingerprint,
        workflow: "checkout.v1",
        request,
        lease: Duration::from_secs(30),
    }
}

/// A pool of one connection: a test that uses it again sees the very connection a claim used.
async fn one_connection(options: PgPoolOptions, connect: PgConnectOptions) -> PgPool {
    options
        .max_connections(1)
        .connect_with(connect)
        .await
        .unwrap()
}

/// Claims a key that must be new; the claim's transaction, still open.
async fn owned(pool: &PgPool, claim: &ClaimRequest<'_>) -> idemflow_pg::Transaction {
    match store::begin_claim(pool.acquire().await.unwrap(), claim, &Default::default())
        .await
        .unwrap()
    {
        Claimed::Owned(transaction, _) => transaction,
        Claimed::Lost(_) => panic!("the key is new"),
    }
}

/// True when the connection is idle, outside any transaction: there, and only there, a
/// savepoint is refused as "no active transaction" (inside an open transaction it succeeds,
/// inside an aborted one it is refused as such).
async fn idle(connection: &mut sqlx::PgConnection) -> bool {
    match sqlx::Executor::execute(connection, "SAVEPOINT probe").await {
        Err(sqlx::Error::Database(error)) => error.code().as_deref() == Some("25P01"),
        _ => false,
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_commits_with_its_transaction_and_stores_every_value(pool: PgPool) {
    let tenant = TenantId::new("tenant-7").unwrap();
    let key = Key::parse("key with 'quotes' \\ and $$").unwrap();
    let fingerprint = Fingerprint::from_slice(&[7; 32]).unwrap();
    let request = json!({"note": "it's \u{e9}t\u{e9} \\ $$", "amount": 100});
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    let connection = pool.acquire().await.unwrap();
    let Claimed::Owned(tx, owner) = store::begin_claim(connection, &claim, &Default::default())
        .await
        .unwrap()
    else {
        panic!("a new key is ours");
    };
    assert_eq!(owner.lock_version(), 1 << 40);
    tx.commit().await.unwrap();

    let (stored_tenant, stored_key, stored_fingerprint, stored_request, lease_left): (
        String,
        String,
        Vec<u8>,
        Value,
        f64,
    ) = sqlx::query_as(
        "SELECT tenant, key, fingerprint, request, \
                extract(epoch FROM locked_until - now())::float8 FROM idempotency_keys",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored_tenant, tenant.as_str());
    assert_eq!(stored_key, key.as_str());
    assert_eq!(stored_fingerprint, fingerprint.as_bytes().to_vec());
    assert_eq!(stored_request, request);
    assert!(lease_left > 25.0 && lease_left <= 30.0, "{lease_left}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_that_loses_the_race_hands_back_an_idle_connection(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = one_connection(options, connect).await;
    let tenant = tenant(1);
    let key = Key::parse("raced").unwrap();
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let request = json!({"amount": 1});
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    let tx = owned(&pool, &claim).await;
    tx.commit().await.unwrap();

    // As if the look-up had found nothing just before the winner committed.
    let Claimed::Lost(mut connection) =
        store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
            .await
            .unwrap()
    else {
        panic!("the second claim must lose");
    };
    assert!(idle(&mut connection).await);
    assert!(matches!(
        store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap(),
        LookUp::Found(_)
    ));
    drop(connection);
    // The pool's only connection is fine for whoever takes it next.
    let mut again = pool.acquire().await.unwrap();
    assert!(idle(&mut again).await);
    drop(again);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        1
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_that_fails_otherwise_is_an_error_and_stores_nothing(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = one_connection(options, connect).await;
    let tenant = tenant(1);
    let key = Key::parse("nul").unwrap();
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    // jsonb cannot hold U+0000 (the runner refuses such requests before claiming; the store
    // itself must still fail cleanly).
    let request = json!({"note": "a\u{0}b"});
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    let error = store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
        .await
        .unwrap_err();
    assert!(matches!(error, store::StoreError::Database(_)), "{error:?}");
    let mut connection = pool.acquire().await.unwrap();
    assert!(idle(&mut connection).await);
    drop(connection);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_in_flight_makes_a_duplicate_in_progress_at_once(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.checkout();
    let tenant = tenant(1);
    let key = Key::parse("in-flight").unwrap();
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let request = json!({"amount": 1, "source": "tok_visa"});
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    let held = owned(&pool, &claim).await;

    let mut connection = pool.acquire().await.unwrap();
    assert!(matches!(
        store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap(),
        LookUp::Claiming
    ));
    drop(connection);
    // The duplicate is answered from the look-up alone: it never waits on the open claim (if it
    // did, this would not return before `held` is rolled back below).
    let duplicate = tokio::time::timeout(
        Duration::from_secs(30),
        run(&runner, &workflow, &tenant, "in-flight", &body(1)),
    )
    .await
    .expect("the duplicate waited on the claim in flight");
    assert!(
        matches!(duplicate, Outcome::InProgress { .. }),
        "{duplicate:?}"
    );

    // The claim rolls back (its request failed before any commit): the key is new again.
    held.rollback().await.unwrap();
    let mut connection = pool.acquire().await.unwrap();
    assert!(matches!(
        store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap(),
        LookUp::Absent { .. }
    ));
    drop(connection);
    executed(&run(&runner, &workflow, &tenant, "in-flight", &body(1)).await);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_racing_an_uncommitted_one_waits_and_loses(pool: PgPool) {
    let tenant = tenant(1);
    let key = Key::parse("racing").unwrap();
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let request = json!({"amount": 1});
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    let first = owned(&pool, &claim).await;
    let second = {
        let pool = pool.clone();
        let (tenant, key, request) = (tenant.clone(), key.clone(), request.clone());
        tokio::spawn(async move {
            let claim = claim_of(&tenant, &key, &fingerprint, &request);
            match store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
                .await
                .unwrap()
            {
                Claimed::Owned(..) => "owned",
                Claimed::Lost(_) => "lost",
            }
        })
    };
    // The second claim blocks on the first's advisory lock until it commits.
    eventually(
        &pool,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
        1,
    )
    .await;
    first.commit().await.unwrap();
    assert_eq!(second.await.unwrap(), "lost");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        1
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_connection_whose_prepared_claim_was_discarded_prepares_it_again(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = one_connection(options, connect).await;
    create_orders(&pool).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let workflow = harness.local_only();
    executed(&run(&runner, &workflow, &tenant(1), "first", &body(1)).await);
    // As a `DISCARD ALL` (from a pooler, say) would, for the claim's statement.
    sqlx::query(AssertSqlSafe(format!(
        "DEALLOCATE {}",
        statements::CLAIM_NAME
    )))
    .execute(&pool)
    .await
    .unwrap();
    executed(&run(&runner, &workflow, &tenant(1), "second", &body(1)).await);
    let mut connection = pool.acquire().await.unwrap();
    assert!(idle(&mut connection).await);
    drop(connection);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        2
    );
}

/// A takeover in flight (uncommitted, its first local phase running) holds the key's row lock;
/// a duplicate that finds the lease expired must not wait on it for as long as that phase runs.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_takeover_in_flight_makes_a_duplicate_in_progress_at_once(pool: PgPool) {
    create_orders(&pool).await;
    let harness = Harness::default();
    harness
        .create
        .fail_next
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let runner = Runner::new(pool.clone());
    let workflow = std::sync::Arc::new(harness.checkout());
    let first = run(&runner, &workflow, &tenant(1), "k", &body(1)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    expire_lease(&pool, "k").await;

    // A takes the key over and stalls in create_order, its takeover uncommitted.
    harness
        .create
        .hang_next
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let taking = {
        let (runner, workflow) = (runner.clone(), workflow.clone());
        tokio::spawn(async move {
            runner
                .run(
                    &workflow,
                    &tenant(1),
                    &idemflow::Key::parse("k").unwrap(),
                    request(&body(1)),
                )
                .await
        })
    };
    harness.create.entered.notified().await;

    let duplicate = tokio::time::timeout(
        Duration::from_secs(3),
        runner.run(
            &workflow,
            &tenant(1),
            &idemflow::Key::parse("k").unwrap(),
            request(&body(1)),
        ),
    )
    .await
    .expect("the duplicate waited on the takeover in flight");
    assert!(
        matches!(duplicate, Ok(Outcome::InProgress { .. })),
        "{duplicate:?}"
    );
    harness.create.resume.notify_one();
    executed(&taking.await.unwrap().unwrap());
}

/// A claim that never committed vanishes with its session (killed, or closed past a time limit):
/// the key is free at once, and the engine may tell another request so. The late record of the
/// vanished attempt must not claim the key again. Once, it did: request B ran under the free key
/// and was forgotten (its client told the key is free), then A's failure record re-claimed the
/// key with A's request, and B's next request under it was refused.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_failure_record_never_brings_back_a_claim_that_vanished(pool: PgPool) {
    create_orders(&pool).await;
    let first = Harness::default();
    first.create.hang_next.store(true, Ordering::SeqCst);
    first.create.fail_next.store(1, Ordering::SeqCst);
    let runner = Runner::new(pool.clone());
    let a = {
        let (runner, workflow) = (runner.clone(), first.local_only());
        tokio::spawn(async move { run(&runner, &workflow, &tenant(1), "k", &body(1)).await })
    };
    // A holds its uncommitted claim and is inside its phase; then its session dies, and the
    // server rolls the claim back.
    first.create.entered.notified().await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid() \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(killed, 1, "A's claim holds the key's advisory lock");
    // pg_terminate_backend only signals the session: its locks go when it has exited. Until
    // then B's look-up would rightly see the claim in progress.
    for _ in 0..1000 {
        let held = count(
            &pool,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid <> pg_backend_pid() \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .await;
        if held == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // B, another request under the key, runs and is forgotten: its client is told the key is free.
    let second = Harness::default();
    second.create.fail_terminally.store(true, Ordering::SeqCst);
    let forgetting = Runner::with_config(
        pool.clone(),
        RunnerConfig::default().with_terminal_errors(TerminalPolicy::Forget),
    );
    let b = run(&forgetting, &second.local_only(), &tenant(1), "k", &body(2)).await;
    assert!(matches!(b, Outcome::Forgotten(_)), "{b:?}");

    // A's phase now fails, and A deals with its attempt.
    first.create.resume.notify_one();
    let a = a.await.unwrap();
    assert!(
        !matches!(a, Outcome::Executed(_) | Outcome::Replayed(_)),
        "{a:?}"
    );
    let keys = count(&pool, "SELECT count(*) FROM idempotency_keys").await;
    assert_eq!(keys, 0, "A's vanished claim came back");

    // The key is free, as B was told: the next request under it runs.
    let next = run(
        &runner,
        &Harness::default().local_only(),
        &tenant(1),
        "k",
        &body(3),
    )
    .await;
    executed(&next);
}

/// The look-up says whether its connection holds the prepared claim, and a claim told it does
/// not prepares it in its own message. Behind a pooler the look-up may have asked another server
/// connection: a claim told "not prepared" on a connection that has it is refused ("already
/// exists"), rolled back, and claims as prepared, the key's row stored once.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_told_wrongly_that_its_connection_lacks_the_prepared_claim_still_claims(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = one_connection(options, connect).await;
    let (tenant, fingerprint, request) = (
        tenant(1),
        Fingerprint::from_slice(&[7; 32]).unwrap(),
        json!({"amount": 1}),
    );
    for name in ["first", "second"] {
        let key = Key::parse(name).unwrap();
        let mut connection = pool.acquire().await.unwrap();
        let LookUp::Absent {
            lock_version,
            claim_prepared,
        } = store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap()
        else {
            panic!("{name} is new");
        };
        // The first claim on this connection finds it unprepared; the second finds it prepared,
        // and is told otherwise.
        assert_eq!(claim_prepared, name == "second", "{name}");
        let claim = ClaimRequest {
            lock_version,
            ..claim_of(&tenant, &key, &fingerprint, &request)
        };
        let Claimed::Owned(transaction, _) =
            store::begin_claim_knowing(connection, &claim, &Default::default(), false)
                .await
                .unwrap()
        else {
            panic!("{name} is new");
        };
        transaction.commit().await.unwrap();
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        2
    );
    let mut connection = pool.acquire().await.unwrap();
    assert!(idle(&mut connection).await);
}

/// Two copies of one request that both found their key absent both claim it; the second waits
/// for the first's claim lock and loses when it commits. That is an answer (the loser replies
/// from the winner's row), not a fault: the server's log gets no `ERROR` line for it, whichever
/// form the claim's message took, on either layout of the keys table. (An operator who alerts on
/// `ERROR` lines would be paged for a request that was served correctly.)
async fn races_quietly(pool: &PgPool, layout: &str) {
    let log = ServerLog::from_now(pool).await.expect("the server's log");
    let mut keys = Vec::new();
    for claim_prepared in [false, true] {
        keys.push(lose_a_race(pool, &format!("quiet-{layout}"), claim_prepared).await);
    }
    assert_eq!(
        logged_lines(pool, &log, &keys).await,
        Vec::<String>::new(),
        "{layout}"
    );
}

/// One lost race on `pool`'s connections: a key (named from `prefix`) that two claims race for,
/// the second (whose connection holds the prepared claim or not, as `claim_prepared` says)
/// waiting for the first's claim lock and losing when it commits.
pub(crate) async fn lose_a_race(pool: &PgPool, prefix: &str, claim_prepared: bool) -> Key {
    let tenant = tenant(1);
    let fingerprint = Fingerprint::from_slice(&[3; 32]).unwrap();
    let request = json!({"amount": 1});
    let key = Key::parse(&format!("{prefix}-{}", unique())).unwrap();
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    // The loser's connection, whose look-up found the key absent before the winner claimed.
    let mut loser = pool.acquire().await.unwrap();
    let LookUp::Absent {
        claim_prepared: holds_it,
        ..
    } = store::look_up(&mut loser, &tenant, &key).await.unwrap()
    else {
        panic!("the key is new");
    };
    // The pool may hand back a connection an earlier claim prepared the claim on: the state the
    // case asks for is made either way.
    match (claim_prepared, holds_it) {
        (true, false) => {
            sqlx::Executor::execute(&mut *loser, statements::PREPARE_CLAIM)
                .await
                .unwrap();
        }
        (false, true) => {
            let deallocate = format!("DEALLOCATE {}", statements::CLAIM_NAME);
            sqlx::Executor::execute(&mut *loser, AssertSqlSafe(deallocate))
                .await
                .unwrap();
        }
        _ => {}
    }
    // The winner claims as the runner does: told by its look-up whether its connection holds
    // the prepared claim (a claim not told could fail once for it, a line of its own).
    let mut first = pool.acquire().await.unwrap();
    let LookUp::Absent {
        claim_prepared: prepared,
        ..
    } = store::look_up(&mut first, &tenant, &key).await.unwrap()
    else {
        panic!("the key is new");
    };
    let Claimed::Owned(winner, _) =
        store::begin_claim_knowing(first, &claim, &Default::default(), prepared)
            .await
            .unwrap()
    else {
        panic!("the key is new");
    };
    let second = {
        let (tenant, key, request) = (tenant.clone(), key.clone(), request.clone());
        tokio::spawn(async move {
            let claim = claim_of(&tenant, &key, &fingerprint, &request);
            matches!(
                store::begin_claim_knowing(loser, &claim, &Default::default(), claim_prepared)
                    .await
                    .unwrap(),
                Claimed::Lost(_)
            )
        })
    };
    eventually(
        pool,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        1,
    )
    .await;
    winner.commit().await.unwrap();
    assert!(second.await.unwrap(), "the second claim must lose");
    key
}

/// The lines the server logged since `log` began that name one of `keys` (as text, or in hex as
/// the claim's message carries it). `admin` must be a superuser's pool. A control error of its
/// own, which the log must show, first: an empty reading cannot pass for a quiet one.
pub(crate) async fn logged_lines(admin: &PgPool, log: &ServerLog, keys: &[Key]) -> Vec<String> {
    let marker = format!("control-{}", unique());
    let control = sqlx::query(AssertSqlSafe(format!("SELECT 1 / 0 AS \"{marker}\"")))
        .execute(admin)
        .await;
    assert!(control.is_err());
    let logged = eventually_logged(admin, log, &marker).await;
    logged
        .lines()
        .filter(|line| {
            keys.iter().any(|key| {
                line.contains(key.as_str())
                    || line.contains(&idemflow_core::hex::encode(key.as_str().as_bytes()))
            })
        })
        .map(str::to_owned)
        .collect()
}

/// A name no other test (of this run or another) puts in the server's log.
fn unique() -> String {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{}-{now}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The log from `log`'s start, once it shows `marker`.
async fn eventually_logged(pool: &PgPool, log: &ServerLog, marker: &str) -> String {
    for _ in 0..100 {
        let logged = log.since(pool).await.expect("the server's log");
        if logged.contains(marker) {
            return logged;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the server's log never showed {marker}: it is not the log being read");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_that_loses_the_race_writes_no_error_to_the_servers_log(pool: PgPool) {
    races_quietly(&pool, "table").await;
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_that_loses_the_race_on_partitions_writes_no_error_to_the_servers_log(
    pool: PgPool,
) {
    partitions::adopt(&pool, &PartitionPlan::default())
        .await
        .expect("adopt");
    races_quietly(&pool, "partitions").await;
}

/// A local phase at Serializable, which answers with the level its transaction ran at.
struct AtSerializable;

#[idemflow::async_trait]
impl idemflow::LocalPhase<idemflow::PgStore> for AtSerializable {
    const NAME: &'static str = "at_serializable";
    type Input = Value;
    type Output = idemflow::StoredResponse;

    fn isolation(&self) -> idemflow::Isolation {
        idemflow::Isolation::Serializable
    }

    async fn run(
        &self,
        connection: &mut sqlx::PgConnection,
        _: Value,
        _: &idemflow::PhaseContext,
    ) -> Result<idemflow::StoredResponse, idemflow::PhaseError> {
        let level: String = sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(connection)
            .await?;
        Ok(idemflow::StoredResponse::new(200, level))
    }
}

/// On the partitioned layout, whose trigger refuses a claim above Read Committed, a workflow
/// whose first local phase declares Serializable claims alone at Read Committed from its first
/// request: the runner asks the layout before its first such claim, so no claim is refused and
/// the server logs no ERROR for it (an operator alerting on ERROR lines is not paged).
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_stronger_first_phase_on_partitions_writes_no_error_to_the_servers_log(pool: PgPool) {
    partitions::adopt(&pool, &PartitionPlan::default())
        .await
        .expect("adopt");
    let log = ServerLog::from_now(&pool).await.expect("the server's log");
    let workflow = idemflow::Workflow::<idemflow::PgStore>::builder_on::<Value>("strong.v1")
        .local(AtSerializable)
        .build()
        .unwrap();
    let runner = Runner::new(pool.clone());
    let key = Key::parse(&format!("strong-{}", unique())).unwrap();
    let outcome = runner
        .run(&workflow, &tenant(1), &key, request(b"{}"))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Executed(idemflow::StoredResponse::new(200, "serializable"))
    );
    assert_eq!(
        logged_lines(&pool, &log, &[key]).await,
        Vec::<String>::new()
    );
}
