//! The runner's cases for a workflow whose phases are all foreign (a payment: one call to the
//! mock provider over HTTP, its answer the response), written once, generic over [`Engine`], and
//! run on every engine: PostgreSQL, SQLite, MariaDB and Redis, the one engine that runs only such
//! workflows. `engines.rs` runs the checkout (local phases too) on the SQL engines.
//!
//! The HTTP layer's plain handler (itself a one-phase foreign workflow) is one of the cases, over a
//! real axum server and reqwest.
//!
//! Each engine brings [`Keys`]: what a case does behind the runner's back (ending every lease,
//! ageing every finished key, counting keys). Leases are ended by rewinding them, never by
//! sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, PhaseName, StoredResponse, TenantId};
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_redis::RedisPool;
use idemflow_runner::{
    CrashHook, CrashPoint, Engine, ForeignPhase, Outcome, PhaseContext, PhaseError, PoolOf,
    Registry, Request, Resumer, Retention, RunError, Runner, RunnerConfig, Workflow,
};
use idemflow_sqlite::SqliteStore;
use idemflow_testkit::provider::{Fault, MockProvider};
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};
use serde::{Deserialize, Serialize};

/// An engine's keys, behind the runner's back.
#[async_trait]
trait Keys: Engine + idemflow_store::Tamper {
    /// Keys stored, of any state.
    async fn keys(pool: &PoolOf<Self>) -> usize;
}

/// Rows in a SQL engine's keys table.
async fn sql_keys<DB: sqlx::Database>(pool: &sqlx::Pool<DB>) -> usize
where
    i64: sqlx::Type<DB> + for<'r> sqlx::Decode<'r, DB>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    <DB as sqlx::Database>::Arguments: sqlx::IntoArguments<DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    let mut connection = pool.acquire().await.unwrap();
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_keys")
        .fetch_one(&mut *connection)
        .await
        .unwrap();
    usize::try_from(count).unwrap()
}

#[async_trait]
impl Keys for PgStore {
    async fn keys(pool: &sqlx::PgPool) -> usize {
        sql_keys(pool).await
    }
}

#[async_trait]
impl Keys for SqliteStore {
    async fn keys(pool: &sqlx::SqlitePool) -> usize {
        sql_keys(pool).await
    }
}

#[async_trait]
impl Keys for MySqlStore {
    async fn keys(pool: &sqlx::MySqlPool) -> usize {
        sql_keys(pool).await
    }
}

#[async_trait]
impl Keys for idemflow_redis::RedisStore {
    async fn keys(pool: &RedisPool) -> usize {
        crate::support::redis::rows(pool).await.len()
    }
}

/// One test per case and engine, each on a fresh database (a prefix of its own on Redis).
macro_rules! every_engine {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[sqlx::test(migrator = "idemflow::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    super::$case::<idemflow_pg::PgStore>(pool).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::engines::sqlite(concat!("foreign-", stringify!($case))).await;
                    super::$case::<idemflow_sqlite::SqliteStore>(pool).await;
                }
            )*
        }
        mod mariadb {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::mariadb::fresh(
                        concat!("foreign_", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_mysql::MySqlStore>(pool).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::redis::fresh(
                        concat!("foreign-", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_redis::RedisStore>(pool).await;
                }
            )*
        }
    };
}

every_engine!(
    a_payment_runs_once_and_every_retry_replays_it,
    a_concurrent_duplicate_is_told_the_payment_is_in_progress,
    a_storm_of_duplicates_charges_each_key_once_and_fails_no_client,
    a_crash_at_any_point_is_finished_by_the_resumer_and_charges_once,
    a_failed_call_is_postponed_and_the_resumer_finishes_it,
    retention_frees_a_finished_key_for_a_new_request,
    the_http_layer_runs_a_handler_once_and_replays_it_byte_for_byte,
);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Payment {
    pub(crate) amount: u64,
}

/// Charges the mock provider with the derived key, and answers with the charge.
pub(crate) struct Pay {
    pub(crate) provider: ProviderClient,
}

#[async_trait]
impl ForeignPhase for Pay {
    const NAME: &'static str = "pay";
    type Input = Payment;
    type Output = StoredResponse;

    fn timeout(&self) -> Duration {
        Duration::from_secs(10)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        payment: Payment,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let charged = self
            .provider
            .charge(key.as_str(), payment.amount, "usd", "tok_visa")
            .await
            .map_err(|error| PhaseError::retryable(error.to_string()))?;
        match charged {
            ChargeResult::Succeeded { charge_id } => Ok(StoredResponse::new(
                201,
                format!(r#"{{"charge":"{charge_id}"}}"#),
            )),
            declined => Err(PhaseError::terminal(format!("{declined:?}"))),
        }
    }
}

fn payment<E: Engine>(provider: &MockProvider) -> Workflow<E> {
    Workflow::<E>::builder_on::<Payment>("payment.v1")
        .foreign(Pay {
            provider: provider.client(),
        })
        .lease(Duration::from_secs(30))
        .build()
        .unwrap()
}

pub(crate) fn tenant() -> TenantId {
    TenantId::new("t-foreign").unwrap()
}

pub(crate) fn request(body: &[u8]) -> Request<'_> {
    Request {
        method: "POST",
        path: "/v1/payments",
        body,
    }
}

pub(crate) fn pay_key(key: &Key) -> String {
    DerivedKey::new(&tenant(), key, PhaseName::new("pay").unwrap()).to_string()
}

fn charges_for(provider: &MockProvider, key: &Key) -> usize {
    provider
        .charges()
        .iter()
        .filter(|charge| charge.idempotency_key == pay_key(key))
        .count()
}

pub(crate) const BODY: &[u8] = br#"{"amount": 1200}"#;

async fn a_payment_runs_once_and_every_retry_replays_it<E: Keys>(pool: PoolOf<E>) {
    let provider = MockProvider::start().await;
    let workflow = payment::<E>(&provider);
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("pay-1").unwrap();

    let Outcome::Executed(first) = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap()
    else {
        panic!("the first request runs")
    };
    assert_eq!(first.status, 201);
    // Whitespace and member order do not make another request; the replay is byte for byte.
    let again = runner
        .run(&workflow, &tenant(), &key, request(br#"{ "amount":1200 }"#))
        .await
        .unwrap();
    assert_eq!(again, Outcome::Replayed(first.clone()));
    let other = runner
        .run(&workflow, &tenant(), &key, request(br#"{"amount": 1300}"#))
        .await
        .unwrap();
    assert_eq!(other, Outcome::Mismatch);
    assert_eq!(provider.calls_for(&pay_key(&key)), 1);
    assert_eq!(provider.charges().len(), 1);
}

async fn a_concurrent_duplicate_is_told_the_payment_is_in_progress<E: Keys>(pool: PoolOf<E>) {
    let provider = MockProvider::start().await;
    let key = Key::parse("pay-slow").unwrap();
    provider.push_fault_for(pay_key(&key), Fault::Delay(Duration::from_millis(1500)));
    let workflow = Arc::new(payment::<E>(&provider));
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let first = {
        let (runner, workflow, key) = (runner.clone(), Arc::clone(&workflow), key.clone());
        tokio::spawn(async move { runner.run(&workflow, &tenant(), &key, request(BODY)).await })
    };
    // The claim was stored before the call went out: the duplicate sees a live lease.
    while !provider.is_in_flight(&pay_key(&key)) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let duplicate = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(
        matches!(duplicate, Outcome::InProgress { retry_after } if retry_after > Duration::ZERO),
        "{duplicate:?}"
    );
    assert!(matches!(
        first.await.unwrap().unwrap(),
        Outcome::Executed(_)
    ));
    assert_eq!(provider.charges().len(), 1);
}

/// Many copies of each of a few requests at once: each key is charged once, and every copy is
/// answered with the response, its replay, "in progress" or "busy", never a failure.
async fn a_storm_of_duplicates_charges_each_key_once_and_fails_no_client<E: Keys>(pool: PoolOf<E>) {
    const KEYS: usize = 6;
    const COPIES: usize = 12;
    let provider = MockProvider::start().await;
    let workflow = Arc::new(payment::<E>(&provider));
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let start = Arc::new(tokio::sync::Barrier::new(KEYS * COPIES));
    let mut copies = tokio::task::JoinSet::new();
    for index in 0..KEYS * COPIES {
        let (runner, workflow, start) = (runner.clone(), Arc::clone(&workflow), Arc::clone(&start));
        let key = Key::parse(&format!("pay-storm-{}", index % KEYS)).unwrap();
        copies.spawn(async move {
            start.wait().await;
            runner.run(&workflow, &tenant(), &key, request(BODY)).await
        });
    }
    let (mut executed, mut answered) = (0, 0);
    while let Some(outcome) = copies.join_next().await {
        match outcome.unwrap() {
            Ok(Outcome::Executed(_)) => executed += 1,
            Ok(Outcome::Replayed(_) | Outcome::InProgress { .. }) | Err(RunError::Busy) => {
                answered += 1;
            }
            other => panic!("a copy was answered with a failure: {other:?}"),
        }
    }
    assert_eq!(
        executed, KEYS,
        "each key executed once ({answered} other answers)"
    );
    assert_eq!(provider.charges().len(), KEYS);
}

/// Stops the run at one crash point, for one key, once.
#[derive(Debug)]
struct CrashOnce {
    point: CrashPoint,
    armed: AtomicBool,
}

#[async_trait]
impl CrashHook for CrashOnce {
    async fn crash_at(&self, point: &CrashPoint, _: &TenantId, _: &Key) -> bool {
        *point == self.point && self.armed.swap(false, Ordering::SeqCst)
    }
}

async fn a_crash_at_any_point_is_finished_by_the_resumer_and_charges_once<E: Keys>(
    pool: PoolOf<E>,
) {
    let provider = MockProvider::start().await;
    let workflow = payment::<E>(&provider);
    let points = CrashPoint::all(&workflow);
    assert!(points.len() >= 3, "{points:?}");
    for (index, point) in points.into_iter().enumerate() {
        let key = Key::parse(&format!("pay-crash-{index}")).unwrap();
        let hook = Arc::new(CrashOnce {
            point: point.clone(),
            armed: AtomicBool::new(true),
        });
        let crashing = Runner::<E>::on(pool.clone(), RunnerConfig::default()).with_crash_hook(hook);
        let crashed = crashing
            .run(&workflow, &tenant(), &key, request(BODY))
            .await;
        assert!(
            matches!(crashed, Err(RunError::Crashed(_))),
            "{point:?}: {crashed:?}"
        );
        // The crashed process's lease runs out; a resumer in another process finishes the key.
        E::lapse_leases(&pool, None).await.unwrap();
        let mut registry = Registry::<E>::new();
        registry.register(payment::<E>(&provider)).unwrap();
        let resumer = Resumer::new(
            Runner::<E>::on(pool.clone(), RunnerConfig::default()),
            registry,
        );
        let drained = resumer.drain().await.unwrap();
        let retried = Runner::<E>::on(pool.clone(), RunnerConfig::default())
            .run(&workflow, &tenant(), &key, request(BODY))
            .await
            .unwrap();
        // What the crash left depends on the engine: a SQL engine rolls back what a crash before
        // a commit had written (the claim, or the finish), Redis has no commit to miss (each write
        // stands at once). Either the key was left started and the resumer finished it, or it was
        // left absent (the retry runs it) or done (the retry replays): never a second charge.
        assert_eq!(drained.taken, drained.finished, "{point:?}: {drained:?}");
        if point == CrashPoint::AfterFinish {
            assert_eq!(drained.taken, 0, "{point:?}");
        }
        match &retried {
            Outcome::Executed(response) => {
                assert_eq!(drained.taken, 0, "{point:?}: a resumed key is replayed");
                assert_eq!(response.status, 201, "{point:?}");
            }
            Outcome::Replayed(response) => assert_eq!(response.status, 201, "{point:?}"),
            other => panic!("{point:?}: {other:?}"),
        }
        assert_eq!(
            charges_for(&provider, &key),
            1,
            "{point:?}: charges executed"
        );
    }
}

async fn a_failed_call_is_postponed_and_the_resumer_finishes_it<E: Keys>(pool: PoolOf<E>) {
    let provider = MockProvider::start().await;
    let key = Key::parse("pay-flaky").unwrap();
    provider.push_fault_for(pay_key(&key), Fault::ServerError(503));
    let workflow = payment::<E>(&provider);
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let interrupted = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(
        matches!(interrupted, Outcome::Interrupted { .. }),
        "{interrupted:?}"
    );
    // Within its retry-after the key is in progress for a client retry.
    let retried = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(retried, Outcome::InProgress { .. }), "{retried:?}");
    E::lapse_leases(&pool, None).await.unwrap();
    let mut registry = Registry::<E>::new();
    registry.register(payment::<E>(&provider)).unwrap();
    let drained = Resumer::new(runner.clone(), registry)
        .drain()
        .await
        .unwrap();
    assert_eq!(drained.finished, 1, "{drained:?}");
    let replayed = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(replayed, Outcome::Replayed(_)), "{replayed:?}");
    assert_eq!(provider.charges().len(), 1);
}

async fn retention_frees_a_finished_key_for_a_new_request<E: Keys>(pool: PoolOf<E>) {
    let provider = MockProvider::start().await;
    let workflow = payment::<E>(&provider);
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("pay-old").unwrap();
    let ran = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(ran, Outcome::Executed(_)), "{ran:?}");
    let retention = Retention::default().with_keep_for(Duration::from_secs(86_400));
    // Within the window nothing goes.
    assert_eq!(retention.expire(&pool).await.unwrap(), 0);
    E::age_finished(&pool, Duration::from_secs(2 * 86_400))
        .await
        .unwrap();
    assert_eq!(retention.expire(&pool).await.unwrap(), 1);
    assert_eq!(E::keys(&pool).await, 0);
    // The key is new again: the request runs again, and the provider's own idempotency answers
    // the call with the first charge, since the derived key is the same.
    let anew = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(anew, Outcome::Executed(_)), "{anew:?}");
    assert_eq!(provider.charges().len(), 1);
}

/// The plain-handler layer on a real server: the handler runs once; a retry gets its answer byte
/// for byte (marked replayed); the key with another body is 422; a duplicate while the handler
/// runs is 409.
async fn the_http_layer_runs_a_handler_once_and_replays_it_byte_for_byte<E: Keys>(pool: PoolOf<E>) {
    use axum::routing::post;

    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = {
        let runs = Arc::clone(&runs);
        move |body: axum::body::Bytes| {
            let runs = Arc::clone(&runs);
            async move {
                let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                if body.as_ref() == b"slow" {
                    tokio::time::sleep(Duration::from_millis(800)).await;
                }
                (
                    axum::http::StatusCode::CREATED,
                    format!("run {run} of {}", String::from_utf8_lossy(&body)),
                )
            }
        }
    };
    let layer = idemflow_http::IdempotencyLayer::new(
        Runner::<E>::on(pool.clone(), RunnerConfig::default()),
        "api.v1",
        idemflow_http::BearerTenant,
    )
    .unwrap();
    let router = axum::Router::new()
        .route("/v1/payments", post(handler))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    let client = reqwest::Client::new();
    let post = |key: &str, body: &'static str| {
        client
            .post(format!("http://{address}/v1/payments"))
            .header("authorization", "Bearer acme")
            .header("idempotency-key", format!("\"{key}\""))
            .body(body)
            .send()
    };

    let first = post("pay-http", "paid").await.unwrap();
    assert_eq!(first.status(), 201);
    let first_body = first.bytes().await.unwrap();
    let again = post("pay-http", "paid").await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.bytes().await.unwrap(), first_body);
    let other = post("pay-http", "other").await.unwrap();
    assert_eq!(other.status(), 422);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let slow = tokio::spawn(post("pay-slow", "slow"));
    while runs.load(Ordering::SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let duplicate = post("pay-slow", "slow").await.unwrap();
    assert_eq!(duplicate.status(), 409);
    assert_eq!(slow.await.unwrap().unwrap().status(), 201);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
