//! Local phases at a stronger isolation level, and their transactions run again in place when the
//! database rolls them back to keep transactions apart: each case written once, run on
//! PostgreSQL and MariaDB (the engines that state a level; SQLite runs its transactions one at a
//! time whatever is declared). The conflicts are the database's own: a row changed under a
//! Serializable snapshot (PostgreSQL's 40001), a cycle of row locks (InnoDB's deadlock, 1213).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse};
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_runner::{
    ConnectionOf, Engine, Isolation, LocalPhase, Outcome, PhaseContext, PhaseError, PoolOf, Runner,
    RunnerConfig, SqlEngine, Workflow,
};
use serde::{Deserialize, Serialize};

use crate::engines::{request, tenant};

/// A transfer between two accounts, in each engine's SQL, and a way to make its transaction meet
/// a real conflict once.
#[async_trait]
trait Contended: SqlEngine {
    /// Accounts 1 and 2, each holding 100.
    async fn create_accounts(pool: &PoolOf<Self>);
    /// Accounts 1 and 2's balances.
    async fn balances(pool: &PoolOf<Self>) -> (i64, i64);
    /// The isolation level of the transaction `connection` is in, as the engine names it, in
    /// lower case with spaces (`serializable`, `repeatable read`, `read committed`).
    async fn level(connection: &mut ConnectionOf<Self>) -> Result<String, sqlx::Error>;
    /// Moves `amount` from account 1 to account 2.
    async fn transfer(connection: &mut ConnectionOf<Self>, amount: i64) -> Result<(), sqlx::Error>;
    /// Ends the session of `connection` from another session on `pool`, as an operator or a
    /// failover would: the transaction on it is rolled back by the server.
    async fn end_session(connection: &mut ConnectionOf<Self>, pool: &PoolOf<Self>);
    /// Makes the transaction on `connection` meet the database's refusal to keep transactions
    /// apart, caused by another session on `pool`, and returns it.
    async fn meet_a_conflict(
        connection: &mut ConnectionOf<Self>,
        pool: &PoolOf<Self>,
    ) -> Result<(), sqlx::Error>;
}

#[async_trait]
impl Contended for PgStore {
    async fn create_accounts(pool: &sqlx::PgPool) {
        sqlx::raw_sql(
            "CREATE TABLE test_accounts (id int PRIMARY KEY, balance bigint NOT NULL); \
             INSERT INTO test_accounts VALUES (1, 100), (2, 100)",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn balances(pool: &sqlx::PgPool) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT balance FROM test_accounts WHERE id = 1), \
                    (SELECT balance FROM test_accounts WHERE id = 2)",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    async fn level(connection: &mut sqlx::PgConnection) -> Result<String, sqlx::Error> {
        sqlx::query_scalar("SHOW transaction_isolation")
            .fetch_one(connection)
            .await
    }

    async fn transfer(connection: &mut sqlx::PgConnection, amount: i64) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE test_accounts SET balance = balance - $1 WHERE id = 1")
            .bind(amount)
            .execute(&mut *connection)
            .await?;
        sqlx::query("UPDATE test_accounts SET balance = balance + $1 WHERE id = 2")
            .bind(amount)
            .execute(connection)
            .await
            .map(drop)
    }

    async fn end_session(connection: &mut sqlx::PgConnection, pool: &sqlx::PgPool) {
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(connection)
            .await
            .unwrap();
        let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
            .bind(pid)
            .fetch_one(pool)
            .await
            .unwrap();
        assert!(ended);
    }

    /// The transaction's snapshot was taken by its first statement; another session changes
    /// account 1 and commits; the transaction's own change of it is then a serialization
    /// failure (40001).
    async fn meet_a_conflict(
        connection: &mut sqlx::PgConnection,
        pool: &sqlx::PgPool,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT balance FROM test_accounts WHERE id = 1")
            .fetch_one(&mut *connection)
            .await?;
        sqlx::query("UPDATE test_accounts SET balance = balance WHERE id = 1")
            .execute(pool)
            .await?;
        sqlx::query("UPDATE test_accounts SET balance = balance WHERE id = 1")
            .execute(connection)
            .await
            .map(drop)
    }
}

#[async_trait]
impl Contended for MySqlStore {
    async fn create_accounts(pool: &sqlx::MySqlPool) {
        sqlx::raw_sql(
            "CREATE TABLE test_accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL) \
                 ENGINE = InnoDB; \
             INSERT INTO test_accounts VALUES (1, 100), (2, 100); \
             CREATE TABLE test_ballast (n INT NOT NULL) ENGINE = InnoDB",
        )
        .execute(pool)
        .await
        .unwrap();
    }

    async fn balances(pool: &sqlx::MySqlPool) -> (i64, i64) {
        sqlx::query_as(
            "SELECT (SELECT balance FROM test_accounts WHERE id = 1), \
                    (SELECT balance FROM test_accounts WHERE id = 2)",
        )
        .fetch_one(pool)
        .await
        .unwrap()
    }

    /// Not read: MariaDB names no running transaction's level (`@@tx_isolation` is the
    /// session's, and `information_schema.innodb_trx` is a cache that showed the connection's
    /// previous transaction under load). The statement the engine sends is
    /// `crates/idemflow-mysql`'s `Transaction::begin_at`; what the level does is what the
    /// conflicts below meet.
    async fn level(_: &mut sqlx::MySqlConnection) -> Result<String, sqlx::Error> {
        Ok(UNREAD.to_owned())
    }

    async fn transfer(
        connection: &mut sqlx::MySqlConnection,
        amount: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE test_accounts SET balance = balance - ? WHERE id = 1")
            .bind(amount)
            .execute(&mut *connection)
            .await?;
        sqlx::query("UPDATE test_accounts SET balance = balance + ? WHERE id = 2")
            .bind(amount)
            .execute(connection)
            .await
            .map(drop)
    }

    async fn end_session(connection: &mut sqlx::MySqlConnection, pool: &sqlx::MySqlPool) {
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(connection)
            .await
            .unwrap();
        // An integer the server gave: nothing to quote.
        sqlx::query(sqlx::AssertSqlSafe(format!("KILL CONNECTION {id}")))
            .execute(pool)
            .await
            .unwrap();
    }

    /// A lock cycle: this transaction holds account 1, another session holds account 2 (and
    /// has written more, so InnoDB picks this one as the victim) and waits for account 1; this
    /// one then asks for account 2: a deadlock (1213), this transaction rolled back whole.
    async fn meet_a_conflict(
        connection: &mut sqlx::MySqlConnection,
        pool: &sqlx::MySqlPool,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE test_accounts SET balance = balance + 1 WHERE id = 1")
            .execute(&mut *connection)
            .await?;
        let (holding, held) = tokio::sync::oneshot::channel();
        let other = tokio::spawn({
            let pool = pool.clone();
            async move {
                let mut other = pool.begin().await.unwrap();
                sqlx::query("UPDATE test_accounts SET balance = balance + 0 WHERE id = 2")
                    .execute(&mut *other)
                    .await
                    .unwrap();
                sqlx::query("INSERT INTO test_ballast (n) SELECT seq FROM seq_1_to_64")
                    .execute(&mut *other)
                    .await
                    .unwrap();
                holding.send(()).unwrap();
                sqlx::query("UPDATE test_accounts SET balance = balance + 0 WHERE id = 1")
                    .execute(&mut *other)
                    .await
                    .unwrap();
                other.commit().await.unwrap();
            }
        });
        held.await.unwrap();
        // Not a lease's expiry: time for the other session to wait on account 1.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let refused = sqlx::query("UPDATE test_accounts SET balance = balance WHERE id = 2")
            .execute(connection)
            .await;
        other.await.unwrap();
        refused.map(drop)
    }
}

/// What [`Contended::level`] answers where the engine cannot say.
const UNREAD: &str = "unread";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Move {
    amount: i64,
}

/// Moves money between the two accounts at its declared level, meeting a conflict on as many of
/// its runs as `conflicts` says; counts its runs and what each saw. Its `upset` does something
/// worse on one run.
struct Transfer<E: Contended> {
    pool: PoolOf<E>,
    isolation: Isolation,
    conflicts: Arc<AtomicUsize>,
    runs: Arc<Mutex<Vec<Run>>>,
    upset: Upset,
}

/// What a transfer does on one of its runs (numbered from 1), besides what `conflicts` says.
#[derive(Clone, Default)]
enum Upset {
    #[default]
    Nothing,
    /// Its session is ended by the server before it moves the money.
    SessionEnded { on_run: usize },
    /// It says so on `entered`, then never returns: the request is dropped there.
    Hangs {
        on_run: usize,
        entered: Arc<tokio::sync::Notify>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Run {
    token: i64,
    attempt: u32,
    level: String,
    amount: i64,
}

#[async_trait]
impl<E: Contended> LocalPhase<E> for Transfer<E> {
    const NAME: &'static str = "transfer";
    type Input = Move;
    type Output = StoredResponse;

    fn isolation(&self) -> Isolation {
        self.isolation
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: Move,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let level = E::level(connection).await?;
        let run = {
            let mut runs = self.runs.lock().unwrap();
            runs.push(Run {
                token: context.lock_version,
                attempt: context.attempt,
                level,
                amount: input.amount,
            });
            runs.len()
        };
        match &self.upset {
            Upset::SessionEnded { on_run } if *on_run == run => {
                E::end_session(connection, &self.pool).await;
            }
            Upset::Hangs { on_run, entered } if *on_run == run => {
                E::transfer(connection, input.amount).await?;
                entered.notify_one();
                std::future::pending::<()>().await;
            }
            _ => {}
        }
        let conflict = self
            .conflicts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok();
        if conflict {
            E::meet_a_conflict(connection, &self.pool).await?;
        }
        E::transfer(connection, input.amount).await?;
        Ok(StoredResponse::new(201, "moved"))
    }
}

fn transfer<E: Contended>(
    pool: &PoolOf<E>,
    isolation: Isolation,
    conflicts: usize,
) -> (Workflow<E>, Arc<Mutex<Vec<Run>>>) {
    upset_transfer(pool, isolation, conflicts, Upset::Nothing)
}

fn upset_transfer<E: Contended>(
    pool: &PoolOf<E>,
    isolation: Isolation,
    conflicts: usize,
    upset: Upset,
) -> (Workflow<E>, Arc<Mutex<Vec<Run>>>) {
    let runs = Arc::new(Mutex::new(Vec::new()));
    let workflow = Workflow::<E>::builder_on::<Move>(format!("transfer.{}", isolation.as_str()))
        .local(Transfer::<E> {
            pool: pool.clone(),
            isolation,
            conflicts: Arc::new(AtomicUsize::new(conflicts)),
            runs: runs.clone(),
            upset,
        })
        .build()
        .unwrap();
    (workflow, runs)
}

macro_rules! at_levels {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[sqlx::test(migrator = "idemflow::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    super::$case::<idemflow_pg::PgStore>(pool).await;
                }
            )*
        }
        mod mariadb {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::mariadb::fresh(
                        concat!("restarts_", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_mysql::MySqlStore>(pool).await;
                }
            )*
        }
    };
}

at_levels!(
    each_transaction_runs_at_the_level_its_phases_declare,
    a_conflict_runs_the_transaction_again_under_the_same_key_without_an_attempt,
    a_conflict_past_the_restarts_is_an_ordinary_failed_attempt,
    a_request_dropped_in_a_restarted_transaction_leaves_nothing_of_it,
    a_session_ended_in_a_restarted_transaction_is_a_failed_attempt_not_a_restart,
);

async fn report<E: Engine>(pool: &PoolOf<E>, key: &Key) -> idemflow_store::KeyReport {
    E::operator(pool)
        .key_report(tenant().as_str(), key.as_str())
        .await
        .unwrap()
        .unwrap()
}

async fn each_transaction_runs_at_the_level_its_phases_declare<E: Contended>(pool: PoolOf<E>) {
    E::create_accounts(&pool).await;
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let weakest_first = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];
    each_level_moves_once(&runner, &pool, "level", weakest_first).await;
}

/// A transfer of 1 at each of `levels`, in that order, each a key of its own: each runs once, at
/// its level (where the engine names it), and is done after one attempt. Accounts opened afresh
/// end at 97 and 103.
async fn each_level_moves_once<E: Contended>(
    runner: &Runner<E>,
    pool: &PoolOf<E>,
    prefix: &str,
    levels: [Isolation; 3],
) {
    for isolation in levels {
        let (workflow, runs) = transfer::<E>(pool, isolation, 0);
        let key = Key::parse(&format!("{prefix}-{}", isolation.as_str())).unwrap();
        let outcome = runner
            .run(&workflow, &tenant(), &key, request(br#"{"amount": 1}"#))
            .await
            .unwrap();
        assert_eq!(
            outcome,
            Outcome::Executed(StoredResponse::new(201, "moved"))
        );
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), 1, "{isolation}: {runs:?}");
        if runs[0].level != UNREAD {
            let named = isolation.sql().to_lowercase();
            assert_eq!(runs[0].level, named, "{isolation}");
        }
        let report = report::<E>(pool, &key).await;
        assert_eq!((report.attempts, report.state.as_str()), (1, "done"));
    }
    assert_eq!(E::balances(pool).await, (97, 103));
}

/// The database refuses the claim's transaction once (PostgreSQL: a serialization failure;
/// MariaDB: a deadlock's victim). The runner rolls it back and runs it again at once: the same
/// key, the claim made again with the same token, the same input, no attempt
/// counted, no backoff; the transfer is applied once. The old runner answered `Interrupted`
/// and left the key to wait out a backoff of a second.
async fn a_conflict_runs_the_transaction_again_under_the_same_key_without_an_attempt<
    E: Contended,
>(
    pool: PoolOf<E>,
) {
    E::create_accounts(&pool).await;
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("restart-1").unwrap();
    // The same token on both engines: PostgreSQL's look-up drew it; MariaDB's claim stores the
    // life its rolled-back insert drew.
    let runs = a_conflict_runs_it_again_once(&runner, &pool, &key).await;
    for run in &runs {
        assert!(
            [UNREAD, "serializable"].contains(&run.level.as_str()),
            "{runs:?}"
        );
    }
    // The rolled-back run left nothing: the transfer is applied once.
    assert_eq!(E::balances(&pool).await, (90, 110));
    assert_eq!(report::<E>(&pool, &key).await.last_error, None);
}

/// A transfer of 10 under `key` whose transaction meets one conflict: run again once, under the
/// same token, with the same input, one attempt, answered with its transfer. Its two runs.
async fn a_conflict_runs_it_again_once<E: Contended>(
    runner: &Runner<E>,
    pool: &PoolOf<E>,
    key: &Key,
) -> Vec<Run> {
    let (workflow, runs) = transfer::<E>(pool, Isolation::Serializable, 1);
    let outcome = runner
        .run(&workflow, &tenant(), key, request(br#"{"amount": 10}"#))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Executed(StoredResponse::new(201, "moved"))
    );
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "run again once: {runs:?}");
    for run in &runs {
        assert_eq!((run.attempt, run.amount), (1, 10), "{runs:?}");
    }
    assert_eq!(runs[0].token, runs[1].token, "the same token");
    let report = report::<E>(pool, key).await;
    assert_eq!((report.attempts, report.lock_version), (1, runs[1].token));
    runs
}

/// A transaction refused on every run is run again a bounded number of times (the runner's
/// `most_restarts`), then its failure is an ordinary retryable attempt: counted, its error
/// recorded, the key postponed.
async fn a_conflict_past_the_restarts_is_an_ordinary_failed_attempt<E: Contended>(pool: PoolOf<E>) {
    E::create_accounts(&pool).await;
    // The first run and eight more.
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let spent = every_run_conflicts(&runner, &pool, "restart-spent", 9).await;
    assert_eq!(spent.state, "started");
    assert!(spent.last_error.is_some());
    // The bound is the runner's: none at all makes the first conflict the attempt's failure.
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default().with_most_restarts(0));
    every_run_conflicts(&runner, &pool, "restart-none", 1).await;
    assert_eq!(E::balances(&pool).await, (100, 100));
}

/// A transfer under `key` whose every run meets a conflict: `runs` runs, then an interrupted
/// attempt, one counted. The key's report.
async fn every_run_conflicts<E: Contended>(
    runner: &Runner<E>,
    pool: &PoolOf<E>,
    key: &str,
    runs: usize,
) -> idemflow_store::KeyReport {
    let (workflow, ran) = transfer::<E>(pool, Isolation::Serializable, usize::MAX);
    let key = Key::parse(key).unwrap();
    let outcome = runner
        .run(&workflow, &tenant(), &key, request(br#"{"amount": 10}"#))
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::Interrupted { .. }),
        "{outcome:?}"
    );
    assert_eq!(ran.lock().unwrap().len(), runs);
    let report = report::<E>(pool, &key).await;
    assert_eq!(report.attempts, 1);
    report
}

/// A request dropped while its restarted transaction runs (a client gone, a shutdown's deadline)
/// leaves nothing of that transaction, whose claim was made again: the money moved in it is not
/// moved, the key is free, and the pool's connections are sound. The next request of the key
/// runs it once.
async fn a_request_dropped_in_a_restarted_transaction_leaves_nothing_of_it<E: Contended>(
    pool: PoolOf<E>,
) {
    E::create_accounts(&pool).await;
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let entered = Arc::new(tokio::sync::Notify::new());
    let upset = Upset::Hangs {
        on_run: 2,
        entered: entered.clone(),
    };
    let (workflow, runs) = upset_transfer::<E>(&pool, Isolation::Serializable, 1, upset);
    let key = Key::parse("restart-dropped").unwrap();
    let body = br#"{"amount": 10}"#;
    let tenant = tenant();
    tokio::select! {
        outcome = runner.run(&workflow, &tenant, &key, request(body)) => {
            panic!("the hung run answered: {outcome:?}")
        }
        () = entered.notified() => {}
    }
    assert_eq!(runs.lock().unwrap().len(), 2);
    // The dropped transaction's session may take a moment to end: until then the key's claim
    // is in flight and a request of it is told so.
    let (workflow, runs) = transfer::<E>(&pool, Isolation::Serializable, 0);
    let mut outcome = None;
    for _ in 0..200 {
        let answered = runner
            .run(&workflow, &tenant, &key, request(body))
            .await
            .unwrap();
        if !matches!(answered, Outcome::InProgress { .. }) {
            outcome = Some(answered);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        outcome,
        Some(Outcome::Executed(StoredResponse::new(201, "moved")))
    );
    assert_eq!(runs.lock().unwrap().len(), 1);
    assert_eq!(E::balances(&pool).await, (90, 110), "moved once");
    assert_eq!(report::<E>(&pool, &key).await.attempts, 1);
}

/// A session the server ends in a restarted transaction (an operator's kill, a failover) is not
/// the database keeping transactions apart: no restart, but a failed attempt as any lost
/// connection is. Its claim went with the session, so the key is free and nothing of either run
/// is kept; the client's retry runs the transfer once.
async fn a_session_ended_in_a_restarted_transaction_is_a_failed_attempt_not_a_restart<
    E: Contended,
>(
    pool: PoolOf<E>,
) {
    E::create_accounts(&pool).await;
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let upset = Upset::SessionEnded { on_run: 2 };
    let (workflow, runs) = upset_transfer::<E>(&pool, Isolation::Serializable, 1, upset);
    let key = Key::parse("restart-session-ended").unwrap();
    let body = br#"{"amount": 10}"#;
    let answered = runner.run(&workflow, &tenant(), &key, request(body)).await;
    assert!(
        !matches!(
            answered,
            Ok(Outcome::Executed(_)) | Ok(Outcome::Replayed(_))
        ),
        "{answered:?}"
    );
    assert_eq!(runs.lock().unwrap().len(), 2, "no third run");
    assert_eq!(E::balances(&pool).await, (100, 100), "nothing moved");
    let (workflow, runs) = transfer::<E>(&pool, Isolation::Serializable, 0);
    let outcome = runner
        .run(&workflow, &tenant(), &key, request(body))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Executed(StoredResponse::new(201, "moved"))
    );
    assert_eq!(runs.lock().unwrap().len(), 1);
    assert_eq!(E::balances(&pool).await, (90, 110), "moved once");
}

/// MariaDB's claim made again stores the life its rolled-back insert drew, so the token is the
/// same; only a life another row holds (the counter gone back below it, which a crash can do) is
/// drawn again, and the duplicate of the life is not read as a claim lost to another request.
#[tokio::test]
async fn a_mariadb_claim_made_again_keeps_its_life_unless_another_row_holds_it() {
    use idemflow_mysql::{ClaimRequest, Claimed, begin_claim, claim_again_at};

    let pool = crate::support::mariadb::fresh("restarts_claim_keeps_its_life").await;
    let (tenant, fingerprint) = (
        tenant(),
        idemflow_core::Fingerprint::of_raw("POST", "/t", "text/plain", b"x"),
    );
    let request = serde_json::json!({"amount": 1});
    let (kept, taken) = (
        Key::parse("life-kept").unwrap(),
        Key::parse("life-taken").unwrap(),
    );
    let claim = |key| ClaimRequest {
        tenant: &tenant,
        key,
        fingerprint: &fingerprint,
        workflow: "transfer",
        request: &request,
        lease: Duration::from_secs(30),
    };
    let owned = |claimed| match claimed {
        Ok(Claimed::Owned(transaction, owner)) => (transaction, owner.lock_version()),
        other => panic!("not owned: {other:?}"),
    };
    let (claim_kept, claim_taken) = (claim(&kept), claim(&taken));
    let (transaction, token) = owned(begin_claim(pool.acquire().await.unwrap(), &claim_kept).await);
    transaction.rollback().await.unwrap();
    let again = claim_again_at(
        pool.acquire().await.unwrap(),
        &claim_kept,
        token,
        Isolation::Serializable,
    );
    let (transaction, again) = owned(again.await);
    assert_eq!(again, token, "the same life, so the same token");
    transaction.commit().await.unwrap();
    let life: i64 = sqlx::query_scalar("SELECT life FROM idempotency_keys WHERE `key` = ?")
        .bind(kept.as_str().as_bytes())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(life << 20, token);

    // Another key's claim made again with the committed key's token: that life is taken.
    let drawn = claim_again_at(
        pool.acquire().await.unwrap(),
        &claim_taken,
        token,
        Isolation::ReadCommitted,
    );
    let (transaction, drawn) = owned(drawn.await);
    assert!(drawn > token, "a new life drawn: {drawn} after {token}");
    transaction.rollback().await.unwrap();
}

/// PostgreSQL's partitioned layout claims at Read Committed only (its uniqueness trigger needs a
/// snapshot taken after the claim lock, and refuses an insert at any other level). A workflow
/// whose first local phase declares a stronger level still runs there: the runner learns the
/// layout from the first refused claim (which wrote nothing), then claims at Read Committed,
/// commits the claim alone, and runs the phases' transaction at their level. Keys racing from
/// many clients still get one row and one transfer each; a conflict restarts the phases'
/// transaction under the committed claim's token. The old runner answered every such request
/// with the trigger's error.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn on_the_partitioned_layout_a_stronger_first_phase_runs_after_its_claim_commits_alone(
    pool: sqlx::PgPool,
) {
    use idemflow_pg::partitions::{self, PartitionPlan};

    partitions::adopt(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    PgStore::create_accounts(&pool).await;
    let runner = Runner::<PgStore>::on(pool.clone(), RunnerConfig::default());
    // The strongest first: the first claim is the one refused.
    let strongest_first = [
        Isolation::Serializable,
        Isolation::RepeatableRead,
        Isolation::ReadCommitted,
    ];
    each_level_moves_once(&runner, &pool, "partitioned", strongest_first).await;

    // A conflict in the phases' transaction: run again under the committed claim's token.
    let key = Key::parse("partitioned-restart").unwrap();
    a_conflict_runs_it_again_once(&runner, &pool, &key).await;
    assert_eq!(PgStore::balances(&pool).await, (87, 113));

    // Clients racing on a few keys, each a fresh runner (one that has not learnt the layout
    // yet): one row and one transfer per key, whatever each client was answered.
    let (workflow, _) = transfer::<PgStore>(&pool, Isolation::Serializable, 0);
    let workflow = Arc::new(workflow);
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..12 {
        let (pool, workflow) = (pool.clone(), Arc::clone(&workflow));
        clients.spawn(async move {
            let runner = Runner::<PgStore>::on(pool, RunnerConfig::default());
            let key = Key::parse(&format!("partitioned-race-{}", client % 3)).unwrap();
            runner
                .run(&workflow, &tenant(), &key, request(br#"{"amount": 1}"#))
                .await
                .unwrap()
        });
    }
    while let Some(outcome) = clients.join_next().await {
        let outcome = outcome.unwrap();
        assert!(
            matches!(
                outcome,
                Outcome::Executed(_) | Outcome::Replayed(_) | Outcome::InProgress { .. }
            ),
            "{outcome:?}"
        );
    }
    let rows: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE key LIKE 'partitioned-race-%'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(rows, 3);
    // Each key's transfer once: every key's claimer ran it to the end.
    assert_eq!(PgStore::balances(&pool).await, (84, 116));
}

/// A table adopted into partitions under a running runner, which had learnt that its claims
/// share their phases' transaction at any level: the first claim the new layout refuses (it
/// writes nothing) teaches the runner otherwise, and that very request is served, its claim
/// made alone at Read Committed and its phase run at Serializable.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_table_adopted_under_a_running_runner_is_learnt_from_the_first_refused_claim(
    pool: sqlx::PgPool,
) {
    use idemflow_pg::partitions::{self, PartitionPlan};

    PgStore::create_accounts(&pool).await;
    let runner = Runner::<PgStore>::on(pool.clone(), RunnerConfig::default());
    let levels = |runs: &Mutex<Vec<Run>>| {
        let runs = runs.lock().unwrap();
        runs.iter().map(|run| run.level.clone()).collect::<Vec<_>>()
    };
    let (workflow, runs) = transfer::<PgStore>(&pool, Isolation::Serializable, 0);
    let before = Key::parse("before-adoption").unwrap();
    let outcome = runner
        .run(&workflow, &tenant(), &before, request(br#"{"amount": 1}"#))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Executed(StoredResponse::new(201, "moved"))
    );

    partitions::adopt(&pool, &PartitionPlan::default())
        .await
        .unwrap();
    let after = Key::parse("after-adoption").unwrap();
    let outcome = runner
        .run(&workflow, &tenant(), &after, request(br#"{"amount": 1}"#))
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Executed(StoredResponse::new(201, "moved"))
    );
    assert_eq!(levels(&runs), ["serializable", "serializable"]);
    assert_eq!(report::<PgStore>(&pool, &after).await.attempts, 1);
    assert_eq!(PgStore::balances(&pool).await, (98, 102));
}
