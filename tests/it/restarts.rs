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
/// its runs as `conflicts` says; counts its runs and what each saw.
struct Transfer<E: Contended> {
    pool: PoolOf<E>,
    isolation: Isolation,
    conflicts: Arc<AtomicUsize>,
    runs: Arc<Mutex<Vec<Run>>>,
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
        self.runs.lock().unwrap().push(Run {
            token: context.lock_version,
            attempt: context.attempt,
            level,
            amount: input.amount,
        });
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
    let runs = Arc::new(Mutex::new(Vec::new()));
    let workflow = Workflow::<E>::builder_on::<Move>(format!("transfer.{}", isolation.as_str()))
        .local(Transfer::<E> {
            pool: pool.clone(),
            isolation,
            conflicts: Arc::new(AtomicUsize::new(conflicts)),
            runs: runs.clone(),
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
    for (isolation, named) in [
        (Isolation::ReadCommitted, "read committed"),
        (Isolation::RepeatableRead, "repeatable read"),
        (Isolation::Serializable, "serializable"),
    ] {
        let (workflow, runs) = transfer::<E>(&pool, isolation, 0);
        let key = Key::parse(&format!("level-{}", isolation.as_str())).unwrap();
        let outcome = runner
            .run(&workflow, &tenant(), &key, request(br#"{"amount": 1}"#))
            .await
            .unwrap();
        assert!(matches!(outcome, Outcome::Executed(_)), "{outcome:?}");
        let runs = runs.lock().unwrap().clone();
        assert_eq!(runs.len(), 1);
        if runs[0].level != UNREAD {
            assert_eq!(runs[0].level, named, "{isolation}");
        }
    }
    assert_eq!(E::balances(&pool).await, (97, 103));
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
    let (workflow, runs) = transfer::<E>(&pool, Isolation::Serializable, 1);
    let key = Key::parse("restart-1").unwrap();
    let outcome = runner
        .run(&workflow, &tenant(), &key, request(br#"{"amount": 10}"#))
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
        assert!(
            [UNREAD, "serializable"].contains(&run.level.as_str()),
            "{runs:?}"
        );
    }
    // The same token on both engines: PostgreSQL's look-up drew it; MariaDB's claim stores the
    // life its rolled-back insert drew.
    assert_eq!(runs[0].token, runs[1].token, "the same token");
    // The rolled-back run left nothing: the transfer is applied once.
    assert_eq!(E::balances(&pool).await, (90, 110));
    let report = report::<E>(&pool, &key).await;
    assert_eq!(report.attempts, 1);
    assert_eq!(report.last_error, None);
    assert_eq!(report.lock_version, runs[1].token);
}

/// A transaction refused on every run is run again a bounded number of times, then its failure
/// is an ordinary retryable attempt: counted, its error recorded, the key postponed.
async fn a_conflict_past_the_restarts_is_an_ordinary_failed_attempt<E: Contended>(pool: PoolOf<E>) {
    E::create_accounts(&pool).await;
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let (workflow, runs) = transfer::<E>(&pool, Isolation::Serializable, usize::MAX);
    let key = Key::parse("restart-spent").unwrap();
    let outcome = runner
        .run(&workflow, &tenant(), &key, request(br#"{"amount": 10}"#))
        .await
        .unwrap();
    assert!(
        matches!(outcome, Outcome::Interrupted { .. }),
        "{outcome:?}"
    );
    // The first run and eight more.
    assert_eq!(runs.lock().unwrap().len(), 9);
    assert_eq!(E::balances(&pool).await, (100, 100));
    let report = report::<E>(&pool, &key).await;
    assert_eq!((report.attempts, report.state.as_str()), (1, "started"));
    assert!(report.last_error.is_some());
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
