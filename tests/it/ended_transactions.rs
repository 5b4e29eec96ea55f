//! A local phase that ends the runner's transaction under it, on every SQL engine.
//!
//! A local phase is handed the connection itself, so its code can end the transaction the runner
//! began: a `COMMIT` or `ROLLBACK` of its own, a statement MariaDB commits around (DDL), or the
//! deadlock idiom's retry of a statement after the database rolled the transaction back. After
//! that, a recovery point written "in the transaction" would commit apart from the effects it
//! vouches for: a crash, a retry or a resumer then runs the phase again, or the key is recorded
//! done without its effects. The runner must notice before it records anything: a phase's
//! effects that may have committed end the key with a stored 500 naming the cause, never a run
//! again; effects the database rolled back whole are an ordinary failed attempt.
//!
//! Each case crashes the runner just before the commit that would have recorded the phase (where
//! the old runner got to), then lets a resumer and the client's retry finish the key, and counts
//! what was applied.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, StoredResponse};
use idemflow_runner::{
    ConnectionOf, CrashPoint, ForeignPhase, LocalPhase, Outcome, PhaseContext, PhaseError, PoolOf,
    Registry, Resumer, Runner, RunnerConfig, Workflow,
};
use idemflow_testkit::provider::MockProvider;

use crate::engines::{
    Answer, BODY, Charge, Checkout, CrashOnce, CreateOrder, Lab, Order, charge_key, engines,
    request, sqlite, tenant,
};

engines!(
    a_phase_that_commits_and_succeeds_ends_its_key_with_a_500_and_runs_once,
    a_phase_that_commits_and_fails_ends_its_key_with_a_500_and_runs_once,
    a_phase_that_writes_again_after_a_rollback_ends_its_key_with_a_500_and_runs_once,
    a_phase_whose_writes_were_rolled_back_never_leaves_its_key_done_without_them,
    a_takeover_rolled_back_under_its_phase_never_records_over_the_next_takers_key,
);

/// How a phase ends the runner's transaction.
#[derive(Debug, Clone, Copy)]
enum Ending {
    Commit,
    Rollback,
    /// A statement the database commits around ([`Lab::IMPLICIT_COMMIT`]).
    Implicit,
}

/// What the phase does once it ended the transaction.
#[derive(Debug, Clone, Copy)]
enum After {
    Succeeds,
    /// Writes its effect again and succeeds: the deadlock idiom, "try the statement again".
    WritesAgain,
    Fails,
    /// Begins a transaction of its own, whose statement fails: the phase returns that error.
    BeginsAndFails,
    /// Fails with this error number, as a deadlock's victim (1213) or a lock wait (1205) does,
    /// and returns the error (MariaDB: `SIGNAL`).
    Signals(u16),
}

/// Where in the checkout the misbehaving phase is.
#[derive(Debug, Clone, Copy)]
enum At {
    /// The first phase: in the claim's own transaction, uncommitted.
    First,
    /// The last phase: after the charge, in a transaction of its own.
    Last,
}

/// An order written, the transaction ended, and then what `after` says.
async fn misbehave<E: Lab>(
    connection: &mut ConnectionOf<E>,
    key: &str,
    ending: Ending,
    after: After,
) -> Result<(), PhaseError> {
    E::insert_order(connection, key, 1).await?;
    let statement = match ending {
        Ending::Commit => "COMMIT",
        Ending::Rollback => "ROLLBACK",
        Ending::Implicit => E::IMPLICIT_COMMIT.expect("the engine commits around a statement"),
    };
    E::execute(connection, statement).await?;
    match after {
        After::Succeeds => Ok(()),
        After::WritesAgain => Ok(E::insert_order(connection, key, 1).await?),
        After::Fails => Err(PhaseError::retryable("failed after ending the transaction")),
        After::BeginsAndFails => {
            E::execute(connection, "BEGIN").await?;
            E::execute(connection, "SELECT * FROM no_such_table").await?;
            unreachable!("no such table")
        }
        After::Signals(1213) => {
            E::execute(
                connection,
                "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'Deadlock found'",
            )
            .await?;
            unreachable!("signalled")
        }
        After::Signals(1205) => {
            E::execute(
                connection,
                "SIGNAL SQLSTATE 'HY000' SET MYSQL_ERRNO = 1205, MESSAGE_TEXT = 'Lock wait timeout'",
            )
            .await?;
            unreachable!("signalled")
        }
        After::Signals(other) => unreachable!("no signal {other}"),
    }
}

/// The checkout's first phase, misbehaving.
struct EndsFirst {
    ending: Ending,
    after: After,
}

#[async_trait]
impl<E: Lab> LocalPhase<E> for EndsFirst {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = Order;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        checkout: Checkout,
        context: &PhaseContext,
    ) -> Result<Order, PhaseError> {
        misbehave::<E>(connection, context.key.as_str(), self.ending, self.after).await?;
        Ok(Order {
            amount: checkout.amount,
        })
    }
}

/// The checkout's last phase, misbehaving.
struct EndsLast {
    ending: Ending,
    after: After,
}

#[async_trait]
impl<E: Lab> LocalPhase<E> for EndsLast {
    const NAME: &'static str = "answer";
    type Input = String;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        charge: String,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        misbehave::<E>(connection, context.key.as_str(), self.ending, self.after).await?;
        Ok(StoredResponse::new(
            201,
            format!(r#"{{"charge":"{charge}"}}"#),
        ))
    }
}

fn workflow<E: Lab>(provider: &MockProvider, at: At, ending: Ending, after: After) -> Workflow<E> {
    let charge = Charge {
        provider: provider.client(),
    };
    let builder = Workflow::<E>::builder_on::<Checkout>("checkout.v1");
    let built = match at {
        At::First => builder
            .local(EndsFirst { ending, after })
            .foreign(charge)
            .local(Answer),
        At::Last => builder
            .local(CreateOrder)
            .foreign(charge)
            .local(EndsLast { ending, after }),
    };
    built
        .lease(std::time::Duration::from_secs(30))
        .build()
        .unwrap()
}

/// What a key came to.
#[derive(Debug)]
struct Ended {
    /// The stored response's status and body.
    status: u16,
    body: String,
    orders: i64,
    charges: usize,
}

/// Runs a misbehaving checkout under a key, crashing just before the commit that would record
/// the misbehaving phase, then lets a resumer and the client's retries finish it (at most a
/// retry budget's worth of rounds, each lapsing the lease first).
async fn run_to_the_end<E: Lab>(
    pool: &PoolOf<E>,
    provider: &MockProvider,
    at: At,
    ending: Ending,
    after: After,
) -> Ended {
    let name = format!("ends-{at:?}-{ending:?}-{after:?}")
        .to_lowercase()
        .replace(|c: char| !c.is_ascii_alphanumeric(), "-");
    let key = Key::parse(&name).unwrap();
    let point = match at {
        At::First => CrashPoint::BeforeCommit {
            phase: "create_order",
        },
        At::Last => CrashPoint::BeforeFinish,
    };
    let hook = Arc::new(CrashOnce {
        point,
        armed: AtomicBool::new(true),
    });
    let crashing = Runner::<E>::on(pool.clone(), RunnerConfig::default()).with_crash_hook(hook);
    let flow = workflow::<E>(provider, at, ending, after);
    let first = crashing.run(&flow, &tenant(), &key, request(BODY)).await;
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let mut answers = vec![format!("{first:?}")];
    for _ in 0..8 {
        E::lapse_leases(pool, None).await.unwrap();
        let mut registry = Registry::<E>::new();
        registry
            .register(workflow::<E>(provider, at, ending, after))
            .unwrap();
        let drained = Resumer::new(runner.clone(), registry).drain().await;
        answers.push(format!("{drained:?}"));
        let retried = runner.run(&flow, &tenant(), &key, request(BODY)).await;
        answers.push(format!("{retried:?}"));
        if let Ok(Outcome::Replayed(response)) = retried {
            return Ended {
                status: response.status,
                body: String::from_utf8_lossy(&response.body).into_owned(),
                orders: E::orders(pool, &name).await,
                charges: provider.calls_for(&charge_key(&key)),
            };
        }
    }
    panic!("{name}: the key never ended: {answers:#?}");
}

/// The checkout's phase commits the runner's transaction and succeeds: what it wrote committed
/// before its recovery point. Recording it now would be recording over a transaction that ended;
/// before, a crash there left the effects without the point, for a resumer to apply again.
async fn a_phase_that_commits_and_succeeds_ends_its_key_with_a_500_and_runs_once<E: Lab>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first =
        run_to_the_end::<E>(&pool, &provider, At::First, Ending::Commit, After::Succeeds).await;
    assert_transaction_ended(&first, 1, 0);
    let last =
        run_to_the_end::<E>(&pool, &provider, At::Last, Ending::Commit, After::Succeeds).await;
    // The order of the first phase, and the one the last wrote before its COMMIT.
    assert_transaction_ended(&last, 2, 1);
    if E::IMPLICIT_COMMIT.is_some() {
        let implicit = run_to_the_end::<E>(
            &pool,
            &provider,
            At::First,
            Ending::Implicit,
            After::Succeeds,
        )
        .await;
        assert_transaction_ended(&implicit, 1, 0);
    }
}

/// The phase commits and then fails: its effects are durable, so the failure is not a retry.
/// Before, the claim committed with them, nothing was recorded, and every resumed attempt
/// applied them again.
async fn a_phase_that_commits_and_fails_ends_its_key_with_a_500_and_runs_once<E: Lab>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first =
        run_to_the_end::<E>(&pool, &provider, At::First, Ending::Commit, After::Fails).await;
    assert_transaction_ended(&first, 1, 0);
    let last = run_to_the_end::<E>(&pool, &provider, At::Last, Ending::Commit, After::Fails).await;
    assert_transaction_ended(&last, 2, 1);
}

/// The deadlock idiom inside a phase: the transaction is rolled back (here by the phase itself,
/// as a deadlock's victim is by the database) and the statement tried again, which then commits
/// alone, in autocommit.
async fn a_phase_that_writes_again_after_a_rollback_ends_its_key_with_a_500_and_runs_once<
    E: Lab,
>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first = run_to_the_end::<E>(
        &pool,
        &provider,
        At::First,
        Ending::Rollback,
        After::WritesAgain,
    )
    .await;
    assert_transaction_ended(&first, 1, 0);
    let last = run_to_the_end::<E>(
        &pool,
        &provider,
        At::Last,
        Ending::Rollback,
        After::WritesAgain,
    )
    .await;
    assert_transaction_ended(&last, 2, 1);
}

/// The phase's transaction is rolled back under it and the phase carries on as if it had
/// succeeded. Before, the key was recorded done (a 201) while the order was gone. Now it never
/// ends done without its effects: it ends with a 500, at once where the engine cannot tell a
/// rollback from a commit, or after its retries where it can (each retry rolls back again).
async fn a_phase_whose_writes_were_rolled_back_never_leaves_its_key_done_without_them<E: Lab>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first = run_to_the_end::<E>(
        &pool,
        &provider,
        At::First,
        Ending::Rollback,
        After::Succeeds,
    )
    .await;
    assert_eq!(first.status, 500, "{first:?}");
    assert_eq!(first.orders, 0, "{first:?}");
    assert_eq!(first.charges, 0, "{first:?}");
    let last = run_to_the_end::<E>(
        &pool,
        &provider,
        At::Last,
        Ending::Rollback,
        After::Succeeds,
    )
    .await;
    assert_eq!(last.status, 500, "{last:?}");
    assert_eq!(last.orders, 1, "the first phase's order only: {last:?}");
    assert_eq!(last.charges, 1, "{last:?}");
}

/// The phase commits, begins a transaction of its own, and a statement in it fails: the
/// connection is in a transaction (aborted, on PostgreSQL) that is not the runner's. Taken for
/// the runner's, the failure was an ordinary retry, and the committed order ran again.
/// (MariaDB names no transaction: a `BEGIN` after the `COMMIT` hides it, docs/runner.md.)
async fn a_phase_that_fails_in_a_transaction_of_its_own_ends_its_key_with_a_500_and_runs_once<
    E: Lab,
>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first = run_to_the_end::<E>(
        &pool,
        &provider,
        At::First,
        Ending::Commit,
        After::BeginsAndFails,
    )
    .await;
    assert_transaction_ended(&first, 1, 0);
    let last = run_to_the_end::<E>(
        &pool,
        &provider,
        At::Last,
        Ending::Commit,
        After::BeginsAndFails,
    )
    .await;
    assert_transaction_ended(&last, 2, 1);
}

mod postgres_and_sqlite {
    #[sqlx::test(migrator = "idemflow::MIGRATOR")]
    async fn a_phase_that_fails_in_a_transaction_of_its_own_ends_its_key_with_a_500_and_runs_once(
        pool: sqlx::PgPool,
    ) {
        super::a_phase_that_fails_in_a_transaction_of_its_own_ends_its_key_with_a_500_and_runs_once::<
            idemflow_pg::PgStore,
        >(pool)
        .await;
    }

    #[tokio::test]
    async fn on_sqlite_a_phase_that_fails_in_a_transaction_of_its_own_ends_its_key_with_a_500_and_runs_once()
     {
        let pool = crate::engines::sqlite("a_phase_that_fails_in_a_transaction_of_its_own").await;
        super::a_phase_that_fails_in_a_transaction_of_its_own_ends_its_key_with_a_500_and_runs_once::<
            idemflow_sqlite::SqliteStore,
        >(pool)
        .await;
    }
}

/// Where the handover stands: each step waited for by the other side.
#[derive(Default)]
struct Handover {
    /// Runs of the first phase so far.
    runs: std::sync::atomic::AtomicUsize,
    /// The first taker's phase rolled its takeover back and wrote again in autocommit.
    rolled_back: tokio::sync::Notify,
    /// The first taker's phase may return.
    release_first: tokio::sync::Notify,
    /// The next taker holds the key, committed, and is in its foreign phase.
    next_holds: tokio::sync::Notify,
    /// The next taker's foreign phase may return.
    release_next: tokio::sync::Notify,
}

/// The first phase: fails its first run (the key is postponed, to be taken over), ends the
/// transaction under the second (a rollback and the write tried again, in autocommit) and waits
/// there, and runs plainly after that.
struct RollsBackItsTakeover(Arc<Handover>);

#[async_trait]
impl<E: Lab> LocalPhase<E> for RollsBackItsTakeover {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = Order;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        checkout: Checkout,
        context: &PhaseContext,
    ) -> Result<Order, PhaseError> {
        let handover = &self.0;
        let run = handover
            .runs
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if run == 0 {
            return Err(PhaseError::retryable("the first attempt fails"));
        }
        if run == 1 {
            misbehave::<E>(
                connection,
                context.key.as_str(),
                Ending::Rollback,
                After::WritesAgain,
            )
            .await?;
            handover.rolled_back.notify_one();
            handover.release_first.notified().await;
        } else {
            E::insert_order(connection, context.key.as_str(), checkout.amount).await?;
        }
        Ok(Order {
            amount: checkout.amount,
        })
    }
}

/// The foreign phase: the next taker waits in it, holding the key, until released.
struct HeldCall(Arc<Handover>);

#[async_trait]
impl ForeignPhase for HeldCall {
    const NAME: &'static str = "charge";
    type Input = Order;
    type Output = String;

    async fn call(&self, _: &DerivedKey, _: Order, _: &PhaseContext) -> Result<String, PhaseError> {
        self.0.next_holds.notify_one();
        self.0.release_next.notified().await;
        Ok("ch_next".to_owned())
    }
}

/// A takeover rolled back under its phase leaves the key as it was, lease over: the next taker
/// takes it over from the same token. Where the fence is drawn inside the transaction (MariaDB,
/// SQLite), it draws the very token the rolled-back takeover drew. The first taker, asking the
/// row whether its takeover committed under the phase, must not take the next taker's hold for
/// its own: before, it did, and recorded its 500 over the key the next taker was running, whose
/// own result was then refused.
async fn a_takeover_rolled_back_under_its_phase_never_records_over_the_next_takers_key<E: Lab>(
    pool: PoolOf<E>,
) {
    E::create_orders(&pool).await;
    let handover = Arc::new(Handover::default());
    let workflow = Arc::new(
        Workflow::<E>::builder_on::<Checkout>("handover.v1")
            .local(RollsBackItsTakeover(Arc::clone(&handover)))
            .foreign(HeldCall(Arc::clone(&handover)))
            .local(Answer)
            .lease(std::time::Duration::from_secs(30))
            .build()
            .unwrap(),
    );
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("handed-over").unwrap();
    let postponed = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(
        matches!(postponed, Ok(Outcome::Interrupted { .. })),
        "{postponed:?}"
    );
    E::lapse_leases(&pool, None).await.unwrap();
    let take = |runner: Runner<E>| {
        let workflow = Arc::clone(&workflow);
        let key = key.clone();
        tokio::spawn(async move { runner.run(&workflow, &tenant(), &key, request(BODY)).await })
    };
    let first = take(runner.clone());
    handover.rolled_back.notified().await;
    let next = take(Runner::<E>::on(pool.clone(), RunnerConfig::default()));
    handover.next_holds.notified().await;
    handover.release_first.notify_one();
    let first = first.await.unwrap();
    handover.release_next.notify_one();
    let next = next.await.unwrap();
    assert!(
        matches!(&first, Ok(Outcome::Forgotten(response)) if response.status == 500),
        "the first taker lost the key: answered, nothing recorded: {first:?}"
    );
    assert!(
        matches!(&next, Ok(Outcome::Executed(response)) if response.status == 201),
        "the next taker's run is the key's: {next:?}"
    );
    let replayed = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(
        matches!(&replayed, Ok(Outcome::Replayed(response)) if response.status == 201),
        "{replayed:?}"
    );
}

/// On MariaDB, the phase commits and then fails as a lock wait does (1205): the connection is in
/// no transaction. By default InnoDB undoes a waiting statement alone, so the transaction ended
/// before it: the phase's `COMMIT`. Taken for a rollback (as 1205 was), the claim was made again
/// (and lost to the committed one) and the committed order ran again, 8 times here.
#[tokio::test]
async fn on_mariadb_a_phase_that_commits_and_then_waits_out_a_lock_ends_its_key_with_a_500() {
    let pool = crate::support::mariadb::fresh("ended_commit_then_lock_wait").await;
    <idemflow_mysql::MySqlStore as Lab>::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first = run_to_the_end::<idemflow_mysql::MySqlStore>(
        &pool,
        &provider,
        At::First,
        Ending::Commit,
        After::Signals(1205),
    )
    .await;
    assert_transaction_ended(&first, 1, 0);
}

/// On MariaDB, the phase commits and then fails as a deadlock's victim (1213): read from the
/// connection, a rollback whole. But the phase's `COMMIT` committed the claim with the order, and
/// the key's row, asked by the claim's token and holder, says so. Before, taken for a rollback,
/// the claim was made again (and lost to the committed one) and the committed order ran again.
#[tokio::test]
async fn on_mariadb_a_phase_that_commits_and_then_dies_as_a_deadlock_victim_ends_its_key_with_a_500()
 {
    let pool = crate::support::mariadb::fresh("ended_commit_then_deadlock").await;
    <idemflow_mysql::MySqlStore as Lab>::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let first = run_to_the_end::<idemflow_mysql::MySqlStore>(
        &pool,
        &provider,
        At::First,
        Ending::Commit,
        After::Signals(1213),
    )
    .await;
    assert_transaction_ended(&first, 1, 0);
}

/// The key ended with the stored 500 that names the ended transaction, with `orders` applied
/// once each and the charge called `charges` times.
fn assert_transaction_ended(ended: &Ended, orders: i64, charges: usize) {
    assert_eq!(ended.status, 500, "{ended:?}");
    assert!(ended.body.contains("transaction_ended"), "{ended:?}");
    assert_eq!(ended.orders, orders, "each order once: {ended:?}");
    assert_eq!(ended.charges, charges, "{ended:?}");
}

/// Dies as a deadlock's victim on its first run: it locks one row, another transaction (heavier,
/// so InnoDB picks this one) locks a second and waits for the first, and this one then asks for
/// the second. It returns the error, as a phase should. Later runs succeed.
struct DeadlockVictim {
    pool: sqlx::MySqlPool,
    once: AtomicBool,
}

#[async_trait]
impl LocalPhase<idemflow_mysql::MySqlStore> for DeadlockVictim {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut sqlx::MySqlConnection,
        checkout: Checkout,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        use idemflow_mysql::MySqlStore;
        MySqlStore::insert_order(connection, context.key.as_str(), checkout.amount).await?;
        if self.once.swap(false, std::sync::atomic::Ordering::SeqCst) {
            let lock =
                |id: i64| sqlx::query("UPDATE test_locks SET n = n + 1 WHERE id = ?").bind(id);
            lock(1).execute(&mut *connection).await?;
            let mut other = self.pool.begin().await.unwrap();
            for row in 0..50 {
                MySqlStore::insert_order(&mut *other, "heavier", row)
                    .await
                    .unwrap();
            }
            // The other session waits as long as this test needs: a wait ended by the server's
            // limits (the statement time is half the lock wait) before this phase asks for the
            // second row would leave no deadlock to make.
            sqlx::query("SET SESSION max_statement_time = 0, innodb_lock_wait_timeout = 60")
                .execute(&mut *other)
                .await
                .unwrap();
            lock(2).execute(&mut *other).await.unwrap();
            let waiting = tokio::spawn(async move {
                let locked = lock(1).execute(&mut *other).await;
                other.commit().await.unwrap();
                locked
            });
            // Whichever of the two requests closes the cycle, InnoDB rolls back the lighter
            // transaction: this one (a claim and an order against the other's 51 rows). So
            // nothing waits for the other to be seen waiting: the phase asks at once.
            let deadlocked = lock(2).execute(&mut *connection).await;
            waiting.await.unwrap().unwrap();
            deadlocked?;
            panic!("the other transaction was the deadlock's victim");
        }
        Ok(StoredResponse::new(201, "ordered"))
    }
}

/// MariaDB rolls a deadlock's victim back whole, the claim with it. A phase that returns the
/// error, as it should, has nothing committed: its transaction is run again at once, its claim
/// made again (docs/runner.md, "Choosing an isolation level"), not counted as an attempt, and
/// never the 500 of a transaction that ended under it. (The engine tells the two apart by the
/// diagnostics of the phase's last statement, 1213.)
#[tokio::test]
async fn on_mariadb_a_deadlock_victim_that_returns_its_error_is_tried_again() {
    use idemflow_mysql::MySqlStore;
    let pool = crate::support::mariadb::fresh("ended_deadlock_victim").await;
    MySqlStore::create_orders(&pool).await;
    for statement in [
        "CREATE TABLE test_locks (id BIGINT PRIMARY KEY, n BIGINT NOT NULL) ENGINE = InnoDB",
        "INSERT INTO test_locks (id, n) VALUES (1, 0), (2, 0)",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let workflow = Workflow::<MySqlStore>::builder_on::<Checkout>("deadlock.v1")
        .local(DeadlockVictim {
            pool: pool.clone(),
            once: AtomicBool::new(true),
        })
        .lease(std::time::Duration::from_secs(30))
        .build()
        .unwrap();
    let runner = Runner::new(pool.clone());
    let key = Key::parse("deadlocked").unwrap();
    let first = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(
        matches!(&first, Ok(Outcome::Executed(response)) if response.status == 201),
        "{first:?}"
    );
    assert_eq!(MySqlStore::orders(&pool, "deadlocked").await, 1);
    let attempts: i64 =
        sqlx::query_scalar("SELECT attempts FROM idempotency_keys WHERE `key` = 'deadlocked'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1, "the victim's run is no attempt");
}
