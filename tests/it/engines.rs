//! The runner's conformance suite: a checkout (a local phase, a foreign call to the mock provider
//! over real HTTP, a local phase that answers) run by the same runner, resumer and retention on
//! every engine, each case written once, generic over [`Engine`] (`engines!` below makes one
//! test per case and engine). Where `conformance.rs` proves an engine's store, this proves the
//! runner drives it: execution, replay, 409 and 422, crashes finished by a resumer with each
//! derived key called at most as the provider's ledger allows, retryable failures postponed and
//! resumed, retention. Leases are ended by rewinding them in SQL, never by sleeping.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, PhaseName, StoredResponse, TenantId};
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_runner::{
    ConnectionOf, CrashHook, CrashPoint, ForeignPhase, LocalPhase, Outcome, PhaseContext,
    PhaseError, PoolOf, Registry, Request, Resumer, Retention, RunError, Runner, RunnerConfig,
    Workflow,
};
use idemflow_sqlite::SqliteStore;
use idemflow_testkit::provider::{Fault, MockProvider};
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};
use serde::{Deserialize, Serialize};

/// What a case does on an engine's database behind the runner's back, in the engine's SQL.
#[async_trait]
pub(crate) trait Lab:
    idemflow_runner::SqlEngine + idemflow_consumer::ConsumerStore + idemflow_store::Tamper
{
    /// Creates the table the checkout's local phases write.
    async fn create_orders(pool: &PoolOf<Self>);
    /// Inserts an order in the phase's transaction.
    async fn insert_order(
        connection: &mut ConnectionOf<Self>,
        key: &str,
        amount: i64,
    ) -> Result<(), sqlx::Error>;
    /// Orders stored under `key`.
    async fn orders(pool: &PoolOf<Self>, key: &str) -> i64;
    /// Rows in the keys table.
    async fn keys(pool: &PoolOf<Self>) -> i64;
    /// Moves every processed message's time two days back.
    async fn age_processed(pool: &PoolOf<Self>);
    /// Sends `sql` as it is (the simple query protocol), as a phase's own statement would be.
    async fn execute(
        connection: &mut ConnectionOf<Self>,
        sql: &'static str,
    ) -> Result<(), sqlx::Error>;
    /// A statement the database commits around, where it has one (MariaDB's DDL).
    const IMPLICIT_COMMIT: Option<&'static str>;
}

#[async_trait]
impl Lab for PgStore {
    async fn create_orders(pool: &sqlx::PgPool) {
        sqlx::query("CREATE TABLE test_orders (key text NOT NULL, amount bigint NOT NULL)")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_order(
        connection: &mut sqlx::PgConnection,
        key: &str,
        amount: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_orders (key, amount) VALUES ($1, $2)")
            .bind(key)
            .bind(amount)
            .execute(connection)
            .await
            .map(drop)
    }

    async fn orders(pool: &sqlx::PgPool, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM test_orders WHERE key = $1")
            .bind(key)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn keys(pool: &sqlx::PgPool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn age_processed(pool: &sqlx::PgPool) {
        sqlx::query(
            "UPDATE processed_messages SET processed_at = processed_at - interval '2 days'",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn execute(
        connection: &mut sqlx::PgConnection,
        sql: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(connection).await.map(drop)
    }

    const IMPLICIT_COMMIT: Option<&'static str> = None;
}

#[async_trait]
impl Lab for SqliteStore {
    async fn create_orders(pool: &sqlx::SqlitePool) {
        sqlx::query("CREATE TABLE test_orders (key TEXT NOT NULL, amount INTEGER NOT NULL) STRICT")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn insert_order(
        connection: &mut sqlx::SqliteConnection,
        key: &str,
        amount: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_orders (key, amount) VALUES (?1, ?2)")
            .bind(key)
            .bind(amount)
            .execute(connection)
            .await
            .map(drop)
    }

    async fn orders(pool: &sqlx::SqlitePool, key: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM test_orders WHERE key = ?1")
            .bind(key)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn keys(pool: &sqlx::SqlitePool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn age_processed(pool: &sqlx::SqlitePool) {
        sqlx::query("UPDATE processed_messages SET processed_at = processed_at - 2 * 86400000")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn execute(
        connection: &mut sqlx::SqliteConnection,
        sql: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(connection).await.map(drop)
    }

    const IMPLICIT_COMMIT: Option<&'static str> = None;
}

#[async_trait]
impl Lab for MySqlStore {
    async fn create_orders(pool: &sqlx::MySqlPool) {
        sqlx::query(
            "CREATE TABLE test_orders (`key` VARBINARY(255) NOT NULL, amount BIGINT NOT NULL) \
             ENGINE = InnoDB",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn insert_order(
        connection: &mut sqlx::MySqlConnection,
        key: &str,
        amount: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO test_orders (`key`, amount) VALUES (?, ?)")
            .bind(key)
            .bind(amount)
            .execute(connection)
            .await
            .map(drop)
    }

    async fn orders(pool: &sqlx::MySqlPool, key: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM test_orders WHERE `key` = ?")
            .bind(key)
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn keys(pool: &sqlx::MySqlPool) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM idempotency_keys")
            .fetch_one(pool)
            .await
            .unwrap()
    }

    async fn age_processed(pool: &sqlx::MySqlPool) {
        sqlx::query("UPDATE processed_messages SET processed_at = processed_at - 2 * 86400000")
            .execute(pool)
            .await
            .unwrap();
    }

    async fn execute(
        connection: &mut sqlx::MySqlConnection,
        sql: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(connection).await.map(drop)
    }

    const IMPLICIT_COMMIT: Option<&'static str> =
        Some("CREATE TABLE IF NOT EXISTS test_ddl (x INT)");
}

/// A fresh SQLite database file for `case`, removed at the next run of the same case.
pub(crate) async fn sqlite(case: &str) -> sqlx::SqlitePool {
    let directory = std::env::temp_dir().join(format!("idemflow-engines-{case}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    idemflow_sqlite::open_file(
        &directory.join("idemflow.db"),
        &idemflow_sqlite::OpenOptions::default(),
    )
    .await
    .unwrap()
}

/// One test per case and engine: PostgreSQL on a fresh database of its own (`#[sqlx::test]`),
/// SQLite on a fresh file, MariaDB on a fresh database of its own.
macro_rules! engines {
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
                    let pool = super::sqlite(stringify!($case)).await;
                    super::$case::<idemflow_sqlite::SqliteStore>(pool).await;
                }
            )*
        }
        mod mariadb {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::mariadb::fresh(
                        concat!("engines_", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_mysql::MySqlStore>(pool).await;
                }
            )*
        }
    };
}

pub(crate) use engines;

engines!(
    a_checkout_runs_once_and_every_retry_replays_it,
    a_concurrent_duplicate_is_told_the_key_is_in_progress,
    a_storm_of_duplicates_runs_each_key_once_and_fails_no_client,
    a_crash_at_any_point_is_finished_by_the_resumer_and_runs_nothing_twice,
    a_retryable_failure_is_postponed_and_the_resumer_finishes_it,
    retention_frees_a_finished_key_for_a_new_request,
    the_consumer_applies_a_message_once_and_acknowledges_its_redeliveries,
    the_consumer_rolls_a_failed_handler_back_with_the_identity,
    the_consumer_applies_concurrent_deliveries_of_one_message_once,
    the_consumers_retention_forgets_old_identities_only,
    the_consumer_never_applies_twice_a_message_whose_handler_ended_its_transaction,
);

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Checkout {
    pub(crate) amount: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Order {
    pub(crate) amount: i64,
}

/// Inserts the order, in the claim's transaction.
pub(crate) struct CreateOrder;

#[async_trait]
impl<E: Lab> LocalPhase<E> for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = Order;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        checkout: Checkout,
        context: &PhaseContext,
    ) -> Result<Order, PhaseError> {
        E::insert_order(connection, context.key.as_str(), checkout.amount).await?;
        Ok(Order {
            amount: checkout.amount,
        })
    }
}

/// Charges the mock provider over HTTP, with the derived key.
pub(crate) struct Charge {
    pub(crate) provider: ProviderClient,
}

#[async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = "charge";
    type Input = Order;
    type Output = String;

    fn timeout(&self) -> Duration {
        Duration::from_secs(10)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        order: Order,
        _: &PhaseContext,
    ) -> Result<String, PhaseError> {
        let charged = self
            .provider
            .charge(
                key.as_str(),
                u64::try_from(order.amount).unwrap(),
                "usd",
                "tok_visa",
            )
            .await
            .map_err(|error| PhaseError::retryable(error.to_string()))?;
        match charged {
            ChargeResult::Succeeded { charge_id } => Ok(charge_id),
            declined => Err(PhaseError::terminal(format!("{declined:?}"))),
        }
    }
}

/// Answers with the charge.
pub(crate) struct Answer;

#[async_trait]
impl<E: Lab> LocalPhase<E> for Answer {
    const NAME: &'static str = "answer";
    type Input = String;
    type Output = StoredResponse;

    async fn run(
        &self,
        _: &mut ConnectionOf<E>,
        charge: String,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        Ok(StoredResponse::new(
            201,
            format!(r#"{{"charge":"{charge}"}}"#),
        ))
    }
}

pub(crate) fn checkout<E: Lab>(provider: &MockProvider) -> Workflow<E> {
    Workflow::<E>::builder_on::<Checkout>("checkout.v1")
        .local(CreateOrder)
        .foreign(Charge {
            provider: provider.client(),
        })
        .local(Answer)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap()
}

pub(crate) fn tenant() -> TenantId {
    TenantId::new("t-engines").unwrap()
}

pub(crate) fn request(body: &[u8]) -> Request<'_> {
    Request {
        method: "POST",
        path: "/v1/checkouts",
        body,
    }
}

pub(crate) fn charge_key(key: &Key) -> String {
    DerivedKey::new(&tenant(), key, PhaseName::new("charge").unwrap()).to_string()
}

pub(crate) const BODY: &[u8] = br#"{"amount": 1200}"#;

async fn a_checkout_runs_once_and_every_retry_replays_it<E: Lab>(pool: PoolOf<E>) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let workflow = checkout::<E>(&provider);
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("order-1").unwrap();

    let Outcome::Executed(first) = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap()
    else {
        panic!("the first request runs")
    };
    assert_eq!(first.status, 201);
    // Whitespace and member order do not make another request.
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
    assert_eq!(E::orders(&pool, "order-1").await, 1);
    assert_eq!(provider.calls_for(&charge_key(&key)), 1);
    assert_eq!(provider.charges().len(), 1);
}

async fn a_concurrent_duplicate_is_told_the_key_is_in_progress<E: Lab>(pool: PoolOf<E>) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let key = Key::parse("order-slow").unwrap();
    provider.push_fault_for(charge_key(&key), Fault::Delay(Duration::from_millis(1500)));
    let workflow = Arc::new(checkout::<E>(&provider));
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let first = {
        let (runner, workflow, key) = (runner.clone(), Arc::clone(&workflow), key.clone());
        tokio::spawn(async move { runner.run(&workflow, &tenant(), &key, request(BODY)).await })
    };
    // The claim committed before the call went out: the duplicate sees a live lease.
    while !provider.is_in_flight(&charge_key(&key)) {
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
    assert_eq!(E::orders(&pool, "order-slow").await, 1);
    assert_eq!(provider.charges().len(), 1);
}

/// A storm of duplicates: many copies of each of a few requests at once, their look-ups all
/// finding the key absent and their claims racing (on MariaDB, inserts waiting on one uncommitted
/// claim deadlock as it ends, and InnoDB rolls victims back). Each key runs once (one order, one
/// charge), and no client is answered with a failure: every copy gets the response, the replay,
/// "in progress" (409) or "busy" (503 with `Retry-After`), never a database error (500).
async fn a_storm_of_duplicates_runs_each_key_once_and_fails_no_client<E: Lab>(pool: PoolOf<E>) {
    const KEYS: usize = 6;
    const COPIES: usize = 12;
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let workflow = Arc::new(checkout::<E>(&provider));
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let start = Arc::new(tokio::sync::Barrier::new(KEYS * COPIES));
    let mut copies = tokio::task::JoinSet::new();
    for index in 0..KEYS * COPIES {
        let (runner, workflow, start) = (runner.clone(), Arc::clone(&workflow), Arc::clone(&start));
        let key = Key::parse(&format!("storm-{}", index % KEYS)).unwrap();
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
    for index in 0..KEYS {
        assert_eq!(E::orders(&pool, &format!("storm-{index}")).await, 1);
    }
    assert_eq!(provider.charges().len(), KEYS);
}

/// Stops the run at one crash point, for one key, once.
#[derive(Debug)]
pub(crate) struct CrashOnce {
    pub(crate) point: CrashPoint,
    pub(crate) armed: AtomicBool,
}

#[async_trait]
impl CrashHook for CrashOnce {
    async fn crash_at(&self, point: &CrashPoint, _: &TenantId, _: &Key) -> bool {
        *point == self.point && self.armed.swap(false, Ordering::SeqCst)
    }
}

async fn a_crash_at_any_point_is_finished_by_the_resumer_and_runs_nothing_twice<E: Lab>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let workflow = checkout::<E>(&provider);
    let points = CrashPoint::all(&workflow);
    assert!(points.len() >= 5, "{points:?}");
    for (index, point) in points.into_iter().enumerate() {
        let key = Key::parse(&format!("order-crash-{index}")).unwrap();
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
        registry.register(checkout::<E>(&provider)).unwrap();
        let resumer = Resumer::new(
            Runner::<E>::on(pool.clone(), RunnerConfig::default()),
            registry,
        );
        let drained = resumer.drain().await.unwrap();
        let finished = Runner::<E>::on(pool.clone(), RunnerConfig::default())
            .run(&workflow, &tenant(), &key, request(BODY))
            .await
            .unwrap();
        // Before the claim's first commit nothing of the key was left: the retry runs it anew.
        // After the finish committed it was done: nothing to resume, the retry replays. Between
        // the two, the resumer finished it.
        let first_commit = CrashPoint::BeforeCommit {
            phase: "create_order",
        };
        if point == first_commit {
            assert_eq!(drained.taken, 0, "{point:?}");
            assert!(
                matches!(&finished, Outcome::Executed(response) if response.status == 201),
                "{point:?}: {finished:?}"
            );
        } else {
            if point == CrashPoint::AfterFinish {
                assert_eq!(drained.taken, 0, "{point:?}");
            } else {
                assert_eq!(drained.finished, 1, "{point:?}: {drained:?}");
            }
            assert!(
                matches!(&finished, Outcome::Replayed(response) if response.status == 201),
                "{point:?}: {finished:?}"
            );
        }
        let name = key.as_str();
        assert_eq!(E::orders(&pool, name).await, 1, "{point:?}: orders");
        let executed = provider
            .charges()
            .iter()
            .filter(|charge| charge.idempotency_key == charge_key(&key))
            .count();
        assert_eq!(executed, 1, "{point:?}: charges executed");
    }
}

async fn a_retryable_failure_is_postponed_and_the_resumer_finishes_it<E: Lab>(pool: PoolOf<E>) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let key = Key::parse("order-flaky").unwrap();
    provider.push_fault_for(charge_key(&key), Fault::ServerError(503));
    let workflow = checkout::<E>(&provider);
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
    registry.register(checkout::<E>(&provider)).unwrap();
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
    assert_eq!(E::orders(&pool, "order-flaky").await, 1);
    assert_eq!(provider.charges().len(), 1);
}

async fn retention_frees_a_finished_key_for_a_new_request<E: Lab>(pool: PoolOf<E>) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let workflow = checkout::<E>(&provider);
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("order-old").unwrap();
    let ran = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(ran, Outcome::Executed(_)), "{ran:?}");
    // Within the window nothing goes.
    let retention = Retention::default().with_keep_for(Duration::from_secs(86_400));
    assert_eq!(retention.expire(&pool).await.unwrap(), 0);
    E::age_finished(&pool, Duration::from_secs(2 * 86_400))
        .await
        .unwrap();
    assert_eq!(retention.expire(&pool).await.unwrap(), 1);
    assert_eq!(E::keys(&pool).await, 0);
    // The key is new again: the same request under it runs again (retention is the horizon of
    // a retry), its local effects too; the provider's own idempotency answers the charge with
    // the first one, since the derived key is the same.
    let anew = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(anew, Outcome::Executed(_)), "{anew:?}");
    assert_eq!(E::orders(&pool, "order-old").await, 2);
    assert_eq!(provider.charges().len(), 1);
}

/// SQLite's one writer: a request that cannot get the write lock within the busy timeout is
/// answered busy (503 over HTTP), and leaves nothing behind; the same key then runs.
#[tokio::test]
async fn on_sqlite_a_writer_held_past_the_busy_timeout_is_busy_and_leaves_no_key() {
    let directory = std::env::temp_dir().join("idemflow-engines-busy");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let options =
        idemflow_sqlite::OpenOptions::default().with_busy_timeout(Duration::from_millis(200));
    let pool = idemflow_sqlite::open_file(&directory.join("idemflow.db"), &options)
        .await
        .unwrap();
    SqliteStore::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let workflow = checkout::<SqliteStore>(&provider);
    let runner = Runner::new(pool.clone());
    let key = Key::parse("order-busy").unwrap();

    // Another writer (another process, say) holds the write lock.
    let holder = idemflow_sqlite::Transaction::begin(pool.acquire().await.unwrap())
        .await
        .unwrap();
    let busy = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(matches!(busy, Err(RunError::Busy)), "{busy:?}");
    holder.rollback().await.unwrap();
    assert_eq!(SqliteStore::keys(&pool).await, 0);
    assert_eq!(provider.calls(), 0);

    let ran = runner
        .run(&workflow, &tenant(), &key, request(BODY))
        .await
        .unwrap();
    assert!(matches!(ran, Outcome::Executed(_)), "{ran:?}");
    assert_eq!(SqliteStore::orders(&pool, "order-busy").await, 1);
}

/// The consumer's handler: an order per message, failing on its first `fail_first` runs, slow
/// when asked.
struct Orders {
    fail_first: std::sync::atomic::AtomicU32,
    hold: Duration,
}

impl Orders {
    fn new(fail_first: u32, hold: Duration) -> Self {
        Self {
            fail_first: std::sync::atomic::AtomicU32::new(fail_first),
            hold,
        }
    }
}

#[async_trait]
impl<E: Lab> idemflow_consumer::Handler<E> for Orders {
    async fn handle(
        &self,
        connection: &mut ConnectionOf<E>,
        message: &idemflow_consumer::Message,
    ) -> Result<(), idemflow_consumer::HandlerError> {
        E::insert_order(connection, message.id(), 1).await?;
        tokio::time::sleep(self.hold).await;
        let left = self.fail_first.load(Ordering::SeqCst);
        if left > 0 {
            self.fail_first.store(left - 1, Ordering::SeqCst);
            return Err("the handler failed".into());
        }
        Ok(())
    }
}

fn consumer<E: Lab>(pool: &PoolOf<E>) -> idemflow_consumer::Consumer<E> {
    idemflow_consumer::Consumer::new(
        pool.clone(),
        idemflow_consumer::Subscriber::new("ledger").unwrap(),
    )
}

fn message(id: &str, payload: &[u8]) -> idemflow_consumer::Message {
    idemflow_consumer::Message::new(id.to_owned(), payload.to_vec()).unwrap()
}

async fn the_consumer_applies_a_message_once_and_acknowledges_its_redeliveries<E: Lab>(
    pool: PoolOf<E>,
) {
    use idemflow_consumer::{ConsumerError, Processed};
    E::create_orders(&pool).await;
    let consumer = consumer::<E>(&pool);
    let handler = Orders::new(0, Duration::ZERO);
    let first = message("m-1", b"credit 10");
    assert_eq!(
        consumer.process(&handler, &first).await.unwrap(),
        Processed::Applied
    );
    assert_eq!(
        consumer.process(&handler, &first).await.unwrap(),
        Processed::Duplicate
    );
    let other = consumer
        .process(&handler, &message("m-1", b"credit 99"))
        .await;
    assert!(
        matches!(other, Err(ConsumerError::PayloadMismatch { .. })),
        "{other:?}"
    );
    assert_eq!(E::orders(&pool, "m-1").await, 1);
    // Another subscriber applies it for itself.
    let audit = idemflow_consumer::Consumer::new(
        pool.clone(),
        idemflow_consumer::Subscriber::new("audit").unwrap(),
    );
    assert_eq!(
        audit.process(&handler, &first).await.unwrap(),
        Processed::Applied
    );
    assert_eq!(E::orders(&pool, "m-1").await, 2);
}

/// A consumer's handler that ends the delivery's transaction under it, as `ending` says, after
/// writing its order; and, with `again`, writes its order once more after that (the deadlock
/// idiom's retry), succeeding either way.
struct EndsItsTransaction {
    ending: &'static str,
    again: bool,
}

#[async_trait]
impl<E: Lab> idemflow_consumer::Handler<E> for EndsItsTransaction {
    async fn handle(
        &self,
        connection: &mut ConnectionOf<E>,
        message: &idemflow_consumer::Message,
    ) -> Result<(), idemflow_consumer::HandlerError> {
        E::insert_order(connection, message.id(), 1).await?;
        E::execute(connection, self.ending).await?;
        if self.again {
            E::insert_order(connection, message.id(), 1).await?;
        }
        Ok(())
    }
}

/// A handler holds the connection itself. One that rolls the delivery's transaction back and
/// writes again (the deadlock idiom) committed its order without the message's identity: before,
/// the delivery was reported applied, and each redelivery applied it again. One that commits
/// committed the identity with its order. Either way the message is applied once: the consumer
/// sees the transaction ended, records the identity, and says so; a redelivery is a duplicate.
async fn the_consumer_never_applies_twice_a_message_whose_handler_ended_its_transaction<E: Lab>(
    pool: PoolOf<E>,
) {
    use idemflow_consumer::{ConsumerError, Processed};
    E::create_orders(&pool).await;
    let consumer = consumer::<E>(&pool);
    for (id, ending, again) in [
        ("m-rollback-again", "ROLLBACK", true),
        ("m-commit", "COMMIT", false),
    ] {
        let handler = EndsItsTransaction { ending, again };
        let delivery = message(id, b"credit 30");
        let first = consumer.process(&handler, &delivery).await;
        assert!(
            matches!(&first, Err(ConsumerError::TransactionEnded(ended)) if ended == id),
            "{id}: {first:?}"
        );
        for _ in 0..2 {
            assert_eq!(
                consumer.process(&handler, &delivery).await.unwrap(),
                Processed::Duplicate,
                "{id}"
            );
        }
        assert_eq!(E::orders(&pool, id).await, 1, "{id}: applied once");
    }
}

async fn the_consumer_rolls_a_failed_handler_back_with_the_identity<E: Lab>(pool: PoolOf<E>) {
    use idemflow_consumer::{ConsumerError, Processed};
    E::create_orders(&pool).await;
    let consumer = consumer::<E>(&pool);
    let handler = Orders::new(1, Duration::ZERO);
    let delivery = message("m-2", b"credit 20");
    let failed = consumer.process(&handler, &delivery).await;
    assert!(
        matches!(failed, Err(ConsumerError::Handler(_))),
        "{failed:?}"
    );
    assert_eq!(E::orders(&pool, "m-2").await, 0, "the effect rolled back");
    // Redelivered: not a duplicate, since nothing of the first delivery stayed.
    assert_eq!(
        consumer.process(&handler, &delivery).await.unwrap(),
        Processed::Applied
    );
    assert_eq!(E::orders(&pool, "m-2").await, 1);
}

async fn the_consumer_applies_concurrent_deliveries_of_one_message_once<E: Lab>(pool: PoolOf<E>) {
    use idemflow_consumer::Processed;
    E::create_orders(&pool).await;
    let consumer = consumer::<E>(&pool);
    let handler = Arc::new(Orders::new(0, Duration::from_millis(200)));
    let deliveries = (0..3).map(|_| {
        let (consumer, handler) = (consumer.clone(), Arc::clone(&handler));
        tokio::spawn(async move {
            consumer
                .process(handler.as_ref(), &message("m-3", b"credit 30"))
                .await
        })
    });
    let mut outcomes = Vec::new();
    for delivery in deliveries.collect::<Vec<_>>() {
        outcomes.push(delivery.await.unwrap().unwrap());
    }
    outcomes.sort_by_key(|outcome| *outcome == Processed::Duplicate);
    assert_eq!(
        outcomes,
        [
            Processed::Applied,
            Processed::Duplicate,
            Processed::Duplicate
        ]
    );
    assert_eq!(E::orders(&pool, "m-3").await, 1);
}

async fn the_consumers_retention_forgets_old_identities_only<E: Lab>(pool: PoolOf<E>) {
    use idemflow_consumer::Processed;
    E::create_orders(&pool).await;
    let consumer = consumer::<E>(&pool);
    let handler = Orders::new(0, Duration::ZERO);
    for id in ["m-4", "m-5", "m-6"] {
        assert_eq!(
            consumer
                .process(&handler, &message(id, b"x"))
                .await
                .unwrap(),
            Processed::Applied
        );
    }
    let day = Duration::from_secs(86_400);
    assert_eq!(
        idemflow_consumer::expire_processed(&pool, day, 2, None)
            .await
            .unwrap(),
        0
    );
    E::age_processed(&pool).await;
    assert_eq!(
        consumer
            .process(&handler, &message("m-7", b"x"))
            .await
            .unwrap(),
        Processed::Applied
    );
    // In batches of two, the three old ones; the new one stays.
    assert_eq!(
        idemflow_consumer::expire_processed(&pool, day, 2, None)
            .await
            .unwrap(),
        3
    );
    assert_eq!(
        consumer
            .process(&handler, &message("m-7", b"x"))
            .await
            .unwrap(),
        Processed::Duplicate
    );
}

/// A local phase whose statement never ends (a runaway query).
#[derive(Clone)]
struct Runaway;

#[async_trait]
impl LocalPhase<SqliteStore> for Runaway {
    const NAME: &'static str = "runaway";
    type Input = Checkout;
    type Output = StoredResponse;

    fn timeout(&self) -> Option<Duration> {
        Some(Duration::from_millis(300))
    }

    async fn run(
        &self,
        connection: &mut sqlx::SqliteConnection,
        _: Checkout,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let _: i64 = sqlx::query_scalar(
            "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r",
        )
        .fetch_one(connection)
        .await?;
        Ok(StoredResponse::new(201, "never"))
    }
}

/// A write that never ends: every row of an endless sequence inserted, in the phase's (the
/// claim's) transaction.
#[derive(Clone)]
struct RunawayWrite;

#[async_trait]
impl LocalPhase<SqliteStore> for RunawayWrite {
    const NAME: &'static str = "runaway_write";
    type Input = Checkout;
    type Output = StoredResponse;

    fn timeout(&self) -> Option<Duration> {
        Some(Duration::from_millis(300))
    }

    async fn run(
        &self,
        connection: &mut sqlx::SqliteConnection,
        _: Checkout,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query(
            "INSERT INTO test_orders (key, amount) \
             WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) \
             SELECT 'runaway', x FROM r",
        )
        .execute(connection)
        .await?;
        Ok(StoredResponse::new(201, "never"))
    }
}

/// SQLite has no `statement_timeout`: a statement that never ends would hold the one write lock
/// for good, long after the runner gave its phase up (at the phase's limit) and closed its
/// connection, and every other writer of the file would be busy. The engine's statement timeout
/// interrupts it inside SQLite: the next request runs.
#[tokio::test]
async fn on_sqlite_a_runaway_statement_is_interrupted_and_frees_the_writer() {
    let directory = std::env::temp_dir().join("idemflow-engines-runaway");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let options = idemflow_sqlite::OpenOptions::default()
        .with_statement_timeout(Some(Duration::from_secs(1)));
    let pool = idemflow_sqlite::open_file(&directory.join("idemflow.db"), &options)
        .await
        .unwrap();
    SqliteStore::create_orders(&pool).await;
    let runaway = Workflow::<SqliteStore>::builder_on::<Checkout>("runaway.v1")
        .local(Runaway)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let runner = Runner::new(pool.clone());
    let started = std::time::Instant::now();
    let stuck = runner
        .run(
            &runaway,
            &tenant(),
            &Key::parse("runaway-1").unwrap(),
            request(BODY),
        )
        .await;
    assert!(
        matches!(&stuck, Ok(Outcome::Interrupted { .. })),
        "the attempt fails at its limit: {stuck:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    // The write lock is free again: another key's request runs, it is not told busy.
    let provider = MockProvider::start().await;
    let workflow = checkout::<SqliteStore>(&provider);
    let next = runner
        .run(
            &workflow,
            &tenant(),
            &Key::parse("after-runaway").unwrap(),
            request(BODY),
        )
        .await;
    assert!(matches!(next, Ok(Outcome::Executed(_))), "{next:?}");
}

/// SQLite: a local phase hung in a statement past its limit counts an attempt every time, and its
/// key gives up at its budget. The runner records the failed attempt once the phase's transaction
/// is rolled back, which on SQLite waits for the hung statement to be interrupted (the write lock
/// is its until then): with a statement timeout longer than the busy timeout that record was told
/// busy, the attempt went uncounted (its takeover rolled back with the phase), and every retry of
/// the key was answered 503 for ever. Found by the schedule explorer on SQLite (a price phase hung
/// in the database, a quarter-second busy timeout).
#[tokio::test]
async fn on_sqlite_a_phase_hung_in_a_statement_counts_its_attempts_and_gives_up() {
    hung_phase_counts_its_attempts(Runaway, "hung").await;
}

/// SQLite: the same for a phase hung in a *write*. Interrupted, a write takes its whole
/// transaction with it, the claim and its savepoint too: the record could not go back to the
/// claim, nothing was recorded, every retry claimed afresh, and the key never gave up.
#[tokio::test]
async fn on_sqlite_a_phase_hung_in_a_write_counts_its_attempts_and_gives_up() {
    hung_phase_counts_its_attempts(RunawayWrite, "hung-write").await;
}

async fn hung_phase_counts_its_attempts<P>(phase: P, name: &str)
where
    P: LocalPhase<SqliteStore, Input = Checkout, Output = StoredResponse> + Clone,
{
    let directory = std::env::temp_dir().join(format!("idemflow-engines-{name}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    // Shorter than the default, for a quick test; the statement timeout is left to follow it.
    let options =
        idemflow_sqlite::OpenOptions::default().with_busy_timeout(Duration::from_millis(600));
    let pool = idemflow_sqlite::open_file(&directory.join("idemflow.db"), &options)
        .await
        .unwrap();
    SqliteStore::create_orders(&pool).await;
    let budget = phase.retry_policy().max_attempts;
    let hung = Workflow::<SqliteStore>::builder_on::<Checkout>("hung.v1")
        .local(phase)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let runner = Runner::new(pool.clone());
    let key = Key::parse("hung-1").unwrap();
    let mut answers = Vec::new();
    for _ in 0..budget + 2 {
        let answer = runner.run(&hung, &tenant(), &key, request(BODY)).await;
        let ended = matches!(answer, Ok(Outcome::Executed(_)) | Ok(Outcome::Replayed(_)));
        answers.push(format!("{answer:?}"));
        if ended {
            break;
        }
        <SqliteStore as idemflow_store::Tamper>::lapse_leases(&pool, None)
            .await
            .unwrap();
    }
    let state: Option<String> =
        sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE key = 'hung-1'")
            .fetch_optional(&pool)
            .await
            .unwrap();
    assert_eq!(
        state.as_deref(),
        Some("done"),
        "the key gives up within {} runs; its answers: {answers:#?}",
        budget + 2
    );
    assert!(
        answers.iter().all(|answer| !answer.contains("Busy")),
        "no retry is told busy: {answers:#?}"
    );
}

/// Holds its claim's transaction open until told to go on.
struct Held {
    entered: Arc<tokio::sync::Notify>,
    release: Arc<tokio::sync::Notify>,
}

#[async_trait]
impl LocalPhase<MySqlStore> for Held {
    const NAME: &'static str = "held";
    type Input = Checkout;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut sqlx::MySqlConnection,
        checkout: Checkout,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        MySqlStore::insert_order(connection, context.key.as_str(), checkout.amount).await?;
        self.entered.notify_one();
        self.release.notified().await;
        Ok(StoredResponse::new(201, "held"))
    }
}

/// MariaDB: a duplicate whose claim waits for the first one's uncommitted claim past the
/// statement timeout is busy (503, try again later), as a lock wait past the lock wait timeout
/// is. The statement timeout is the shorter of the two, so it ends such a wait first (1969), which
/// was taken for a database failure: logged at ERROR, answered 503 "unavailable".
#[tokio::test]
async fn on_mariadb_a_duplicate_waiting_past_the_statement_timeout_is_busy() {
    let options = idemflow_mysql::OpenOptions::default()
        .with_lock_wait_timeout(Duration::from_secs(3))
        .with_statement_timeout(Some(Duration::from_millis(300)));
    let pool =
        crate::support::mariadb::fresh_with("engines_duplicate_statement_timeout", &options).await;
    MySqlStore::create_orders(&pool).await;
    let entered = Arc::new(tokio::sync::Notify::new());
    let release = Arc::new(tokio::sync::Notify::new());
    let held = Arc::new(
        Workflow::<MySqlStore>::builder_on::<Checkout>("held.v1")
            .local(Held {
                entered: entered.clone(),
                release: release.clone(),
            })
            .lease(Duration::from_secs(30))
            .build()
            .unwrap(),
    );
    let runner = Runner::new(pool.clone());
    let key = Key::parse("held-1").unwrap();
    let first = tokio::spawn({
        let (runner, held, key) = (runner.clone(), held.clone(), key.clone());
        async move { runner.run(&held, &tenant(), &key, request(BODY)).await }
    });
    entered.notified().await;
    let duplicate = runner.run(&held, &tenant(), &key, request(BODY)).await;
    assert!(matches!(duplicate, Err(RunError::Busy)), "{duplicate:?}");
    release.notify_one();
    let first = first.await.unwrap();
    assert!(
        matches!(&first, Ok(Outcome::Executed(response)) if response.status == 201),
        "{first:?}"
    );
    assert_eq!(MySqlStore::orders(&pool, "held-1").await, 1);
}
