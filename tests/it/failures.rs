//! Every failure of an attempt counts, wherever it happens: in a phase run after a client retry
//! took the key over, in a phase that panics or hangs, and outside any phase (a stored output that
//! no longer decodes, an unknown recovery point, a commit the database refuses, an output the
//! store cannot hold). Each is recorded as the attempt it was, so no key is retried without bound:
//! after the policy's attempts the failure path runs and a response is stored.

use idemflow::PgStore;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;
use idemflow::{
    DerivedKey, ForeignPhase, LocalPhase, Outcome, PhaseContext, PhaseError, Registry, Resumer,
    ResumerConfig, RetryPolicy, RunError, Runner, RunnerConfig, StoredResponse, TerminalPolicy,
    Workflow,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

/// What a scripted phase does on one run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Act {
    Succeed,
    Retryable,
    Terminal,
    Panic,
    /// Waits forever outside the database.
    HangHere,
    /// Waits for a row lock the test holds.
    HangInDatabase,
    /// Works outside the database until just before its time limit (1 s), then starts a
    /// statement that runs past it: the server cancels it only at its own statement_timeout,
    /// well after the runner stopped waiting and closed the connection.
    HangInDatabaseLate,
    /// Returns an output holding U+0000, which jsonb cannot store.
    Unstorable,
    /// Inserts a row that breaks a deferred constraint: the statement succeeds, COMMIT fails.
    BreakAtCommit,
    /// A retryable failure asking for a wait of this many seconds (a provider's `Retry-After`).
    RetryAfterSecs(u64),
    /// As `BreakAtCommit`, and the claim lock the attempt holds outlives its refused `COMMIT` by
    /// [`LINGER`]: another session, waiting for the lock since before the `COMMIT`, gets it as
    /// the transaction aborts and keeps it that long. The refused transaction's own session
    /// does the same for a moment: PostgreSQL sends the `COMMIT`'s error before it aborts the
    /// transaction and releases its locks.
    BreakAtCommitLingering,
}

/// How long [`Act::BreakAtCommitLingering`] keeps the claim lock after the refused `COMMIT`.
const LINGER: Duration = Duration::from_millis(300);

/// The test's pool, for the session [`Act::BreakAtCommitLingering`] holds the lock on.
static LINGER_POOL: std::sync::OnceLock<PgPool> = std::sync::OnceLock::new();

/// Has another session wait for the advisory lock the phase's transaction (backend `pid`) holds,
/// and keep it for [`LINGER`] once it has it; returns when that session is waiting.
async fn linger_on_the_claim_lock(connection: &mut PgConnection) -> Result<(), sqlx::Error> {
    let (pid, lock): (i32, i64) = sqlx::query_as(
        "SELECT pid, (classid::bigint << 32) | objid::bigint FROM pg_locks \
         WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()",
    )
    .fetch_one(&mut *connection)
    .await?;
    let pool = LINGER_POOL.get().expect("set by the test").clone();
    tokio::spawn(async move {
        let mut other = pool.acquire().await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(lock)
            .execute(&mut *other)
            .await
            .unwrap();
        tokio::time::sleep(LINGER).await;
        sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(lock)
            .execute(&mut *other)
            .await
            .unwrap();
    });
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND pid <> $1",
        )
        .bind(pid)
        .fetch_one(&mut *connection)
        .await?;
        if waiting == 1 {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the other session never waited for the claim lock");
}

/// The acts of one phase, run by run; `Succeed` once the script is spent.
#[derive(Debug, Default)]
struct Script {
    acts: Mutex<VecDeque<Act>>,
    runs: AtomicUsize,
}

impl Script {
    fn then(&self, acts: &[Act]) {
        self.acts.lock().unwrap().extend(acts.iter().copied());
    }

    fn next(&self) -> Act {
        self.runs.fetch_add(1, Ordering::SeqCst);
        self.acts
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Act::Succeed)
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Order {
    amount: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Placed {
    amount: i64,
    note: String,
}

/// What a script's act makes of a phase run.
async fn act(
    act: Act,
    connection: Option<&mut PgConnection>,
    context: &PhaseContext,
) -> Result<String, PhaseError> {
    match act {
        Act::Succeed => Ok("ok".to_owned()),
        Act::Retryable => Err(PhaseError::retryable("scripted failure")),
        Act::Terminal => Err(PhaseError::terminal_with(
            StoredResponse::new(409, "refused"),
            "scripted terminal failure",
        )),
        Act::Panic => panic!("scripted panic in {}", context.key),
        Act::HangHere => std::future::pending().await,
        Act::HangInDatabase => {
            let connection = connection.expect("a local phase");
            sqlx::query("SELECT 1 FROM blocker FOR UPDATE")
                .execute(connection)
                .await?;
            Ok("got the lock".to_owned())
        }
        Act::HangInDatabaseLate => {
            let connection = connection.expect("a local phase");
            tokio::time::sleep(Duration::from_millis(950)).await;
            sqlx::query("SELECT pg_sleep(30)")
                .execute(connection)
                .await?;
            Ok("slept".to_owned())
        }
        Act::RetryAfterSecs(seconds) => Err(PhaseError::retry_after(
            "the provider asked for a wait",
            Duration::from_secs(seconds),
        )),
        Act::Unstorable => Ok("nul \u{0} inside".to_owned()),
        Act::BreakAtCommit => {
            let connection = connection.expect("a local phase");
            sqlx::query("INSERT INTO orphans (parent) VALUES (42)")
                .execute(connection)
                .await?;
            Ok("broken".to_owned())
        }
        Act::BreakAtCommitLingering => {
            let connection = connection.expect("a local phase");
            linger_on_the_claim_lock(connection).await?;
            sqlx::query("INSERT INTO orphans (parent) VALUES (42)")
                .execute(connection)
                .await?;
            Ok("broken".to_owned())
        }
    }
}

struct Place(Arc<Script>, RetryPolicy);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for Place {
    const NAME: &'static str = "place";
    type Input = Order;
    type Output = Placed;

    fn retry_policy(&self) -> RetryPolicy {
        self.1
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        order: Order,
        context: &PhaseContext,
    ) -> Result<Placed, PhaseError> {
        sqlx::query("INSERT INTO effects (key, phase) VALUES ($1, 'place')")
            .bind(context.key.as_str())
            .execute(&mut *connection)
            .await?;
        let note = act(self.0.next(), Some(connection), context).await?;
        Ok(Placed {
            amount: order.amount,
            note,
        })
    }
}

struct Notify(Arc<Script>, RetryPolicy);

#[async_trait::async_trait]
impl ForeignPhase for Notify {
    const NAME: &'static str = "notify";
    type Input = Placed;
    type Output = Placed;

    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.1
    }

    async fn call(
        &self,
        _: &DerivedKey,
        placed: Placed,
        context: &PhaseContext,
    ) -> Result<Placed, PhaseError> {
        let note = act(self.0.next(), None, context).await?;
        Ok(Placed { note, ..placed })
    }
}

struct Answer(Arc<Script>, RetryPolicy);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for Answer {
    const NAME: &'static str = "answer";
    type Input = Placed;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        self.1
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        placed: Placed,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query("INSERT INTO effects (key, phase) VALUES ($1, 'answer')")
            .bind(context.key.as_str())
            .execute(&mut *connection)
            .await?;
        act(self.0.next(), Some(connection), context).await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"amount": placed.amount}),
        ))
    }
}

/// The scripts behind one test's workflows.
#[derive(Default, Clone)]
struct Scripts {
    place: Arc<Script>,
    notify: Arc<Script>,
    answer: Arc<Script>,
}

impl Scripts {
    /// place (local) only, with a lease of 2 s (so a local phase may take 1 s).
    fn local_only(&self, attempts: u32) -> Workflow<PgStore> {
        Workflow::builder::<Order>("place-only.v1")
            .local(PlaceAndAnswer(self.place.clone(), quick_retries(attempts)))
            .lease(Duration::from_secs(2))
            .build()
            .unwrap()
    }

    /// place (local) → notify (foreign) → answer (local).
    fn chain(&self, attempts: u32) -> Workflow<PgStore> {
        self.chain_with(quick_retries(attempts))
    }

    fn chain_with(&self, policy: RetryPolicy) -> Workflow<PgStore> {
        Workflow::builder::<Order>("chain.v1")
            .local(Place(self.place.clone(), policy))
            .foreign(Notify(self.notify.clone(), policy))
            .local(Answer(self.answer.clone(), policy))
            .lease(Duration::from_secs(2))
            .build()
            .unwrap()
    }
}

/// A local-only workflow's single phase.
struct PlaceAndAnswer(Arc<Script>, RetryPolicy);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for PlaceAndAnswer {
    const NAME: &'static str = "place";
    type Input = Order;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        self.1
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        order: Order,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query("INSERT INTO effects (key, phase) VALUES ($1, 'place')")
            .bind(context.key.as_str())
            .execute(&mut *connection)
            .await?;
        act(self.0.next(), Some(connection), context).await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"amount": order.amount}),
        ))
    }
}

async fn tables(pool: &PgPool) {
    for sql in [
        "CREATE TABLE effects (key text NOT NULL, phase text NOT NULL)",
        "CREATE TABLE blocker (id int PRIMARY KEY)",
        "INSERT INTO blocker VALUES (1)",
        "CREATE TABLE parents (id int PRIMARY KEY)",
        "CREATE TABLE orphans (parent int REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
    ] {
        sqlx::query(sql).execute(pool).await.unwrap();
    }
}

fn order(amount: i64) -> Vec<u8> {
    format!(r#"{{"amount": {amount}}}"#).into_bytes()
}

async fn effects(pool: &PgPool, key: &str, phase: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1 AND phase = $2")
        .bind(key)
        .bind(phase)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// (attempts, last_error) of a key.
async fn attempts(pool: &PgPool, key: &str) -> (i32, Option<String>) {
    sqlx::query_as("SELECT attempts, last_error FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn stored(pool: &PgPool, key: &str) -> Option<StoredResponse> {
    let row: Option<(i16, Vec<u8>)> = sqlx::query_as(
        "SELECT response_status, response_body FROM idempotency_keys \
         WHERE key = $1 AND state = 'done'",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap();
    row.map(|(status, body)| StoredResponse::new(status as u16, body))
}

/// Client retries after each lease, up to `rounds`; the outcome of each.
async fn retry_until_done(
    runner: &Runner<PgStore>,
    workflow: &Workflow<PgStore>,
    key: &str,
    rounds: usize,
) -> Vec<Result<Outcome, RunError>> {
    let pool = runner.pool().clone();
    let mut outcomes = Vec::new();
    for _ in 0..rounds {
        let outcome = runner
            .run(
                workflow,
                &tenant(1),
                &idemflow::Key::parse(key).unwrap(),
                request(&order(7)),
            )
            .await;
        let finished = matches!(outcome, Ok(Outcome::Executed(_) | Outcome::Replayed(_)));
        outcomes.push(outcome);
        if finished {
            break;
        }
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' \
             WHERE key = $1 AND state = 'started'",
        )
        .bind(key)
        .execute(&pool)
        .await
        .unwrap();
    }
    outcomes
}

// ---------------------------------------------------------------------------------------------
// A client retry that took the key over

/// The takeover is uncommitted in the transaction the failed phase rolls back: the failure is
/// still recorded as that attempt (last error, next attempt time, attempts counted).
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_client_retry_that_takes_over_and_fails_records_its_attempt(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::Retryable, Act::Retryable]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(8));

    let first = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    assert_eq!(attempts(&pool, "k").await.0, 1);
    expire_lease(&pool, "k").await;

    let second = runner
        .run(
            &workflow,
            &tenant(1),
            &idemflow::Key::parse("k").unwrap(),
            request(&order(7)),
        )
        .await;
    assert!(
        matches!(second, Ok(Outcome::Interrupted { .. })),
        "{second:?}"
    );
    let (count, last_error) = attempts(&pool, "k").await;
    assert_eq!(count, 2);
    assert!(last_error.unwrap().contains("place: scripted failure"));
    // The next attempt time is in the lease: a retry now is told to wait.
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "k", &order(7)).await,
        Outcome::InProgress { .. }
    ));
    assert_eq!(
        effects(&pool, "k", "place").await,
        0,
        "both inserts rolled back"
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_terminal_error_after_a_client_takeover_is_stored_and_replayed(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::Retryable, Act::Terminal]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(8));
    let outcomes = retry_until_done(&runner, &workflow, "k", 4).await;
    let refused = StoredResponse::new(409, "refused");
    assert!(
        matches!(outcomes.last(), Some(Ok(Outcome::Executed(response))) if *response == refused),
        "{outcomes:?}"
    );
    assert_eq!(
        run(&runner, &workflow, &tenant(1), "k", &order(7)).await,
        Outcome::Replayed(refused)
    );
    assert_eq!(scripts.place.runs(), 2);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_terminal_error_after_a_client_takeover_forgets_the_key_by_policy(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::Retryable, Act::Terminal]);
    let config = RunnerConfig::default().with_terminal_errors(TerminalPolicy::Forget);
    let (runner, workflow) = (Runner::with_config(pool.clone(), config), scripts.chain(8));
    let first = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    expire_lease(&pool, "k").await;
    let second = runner
        .run(
            &workflow,
            &tenant(1),
            &idemflow::Key::parse("k").unwrap(),
            request(&order(7)),
        )
        .await;
    assert_eq!(
        second.unwrap(),
        Outcome::Forgotten(StoredResponse::new(409, "refused"))
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        0
    );
}

/// Client retries alone reach the give-up: the attempts they begin are counted.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn client_retries_alone_spend_the_attempt_budget(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::Retryable; 10]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(3));
    let outcomes = retry_until_done(&runner, &workflow, "k", 6).await;
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 500);
    assert!(String::from_utf8_lossy(&response.body).contains("gave up after 3 attempts"));
    assert_eq!(scripts.place.runs(), 3);
}

// ---------------------------------------------------------------------------------------------
// Panics

/// A panic in a phase is a failed attempt: recorded, the key resumable, the caller told.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_panicking_phase_is_a_failed_attempt_and_the_key_stays_resumable(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.notify.then(&[Act::Panic]);
    let (runner, workflow) = (Runner::new(pool.clone()), Arc::new(scripts.chain(8)));
    let task = {
        let (runner, workflow) = (runner.clone(), workflow.clone());
        tokio::spawn(async move {
            runner
                .run(
                    &workflow,
                    &tenant(1),
                    &idemflow::Key::parse("k").unwrap(),
                    request(&order(7)),
                )
                .await
        })
    };
    let joined = task.await;
    assert!(
        matches!(&joined, Ok(Err(error)) if error.to_string().contains("panicked")),
        "the panic reached the caller's task: {joined:?}"
    );
    let (count, last_error) = attempts(&pool, "k").await;
    assert_eq!(count, 1);
    assert!(last_error.unwrap().contains("panicked"));
    expire_lease(&pool, "k").await;
    assert_eq!(
        executed(&run(&runner, &workflow, &tenant(1), "k", &order(7)).await).status,
        201
    );
    assert_eq!(effects(&pool, "k", "place").await, 1);
}

/// A phase that always panics is given up on after its attempts, like any failing phase.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_phase_that_always_panics_is_given_up_on(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.answer.then(&[Act::Panic; 10]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(2));
    let outcomes = retry_until_done(&runner, &workflow, "k", 5).await;
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 500);
    assert_eq!(scripts.answer.runs(), 2);
}

// ---------------------------------------------------------------------------------------------
// Hangs

/// A local phase stuck in a lock wait is stopped by its time limit (half the lease unless it
/// says otherwise): the attempt counts, the claim's lock is let go, and the key is resumable.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_local_phase_stuck_in_a_lock_wait_is_stopped_and_counts(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::HangInDatabase]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain_with(patient()));
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM blocker FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();

    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        runner.run(
            &workflow,
            &tenant(1),
            &idemflow::Key::parse("k").unwrap(),
            request(&order(7)),
        ),
    )
    .await
    .expect("the hung phase was never stopped");
    assert!(
        matches!(outcome, Ok(Outcome::Interrupted { .. })),
        "{outcome:?}"
    );
    let (count, last_error) = attempts(&pool, "k").await;
    assert_eq!(count, 1);
    assert!(last_error.unwrap().contains("place"));
    // A duplicate is told when to come back by the lease, not "being claimed" forever.
    assert!(matches!(
        run(&runner, &workflow, &tenant(1), "k", &order(7)).await,
        Outcome::InProgress { retry_after } if retry_after > Duration::from_secs(1)
    ));
    holder.rollback().await.unwrap();
    expire_lease(&pool, "k").await;
    executed(&run(&runner, &workflow, &tenant(1), "k", &order(7)).await);
}

/// A local phase that hangs outside the database is stopped the same way, and the connection
/// it held is not handed back into the pool mid-transaction.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_local_phase_that_hangs_outside_the_database_is_stopped_and_counts(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::HangHere]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.local_only(8));
    let outcome = tokio::time::timeout(
        Duration::from_secs(10),
        runner.run(
            &workflow,
            &tenant(1),
            &idemflow::Key::parse("k").unwrap(),
            request(&order(7)),
        ),
    )
    .await
    .expect("the hung phase was never stopped");
    assert!(
        matches!(outcome, Ok(Outcome::Interrupted { .. })),
        "{outcome:?}"
    );
    assert_eq!(attempts(&pool, "k").await.0, 1);
    eventually(
        &pool,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        0,
    )
    .await;
    expire_lease(&pool, "k").await;
    executed(&run(&runner, &workflow, &tenant(1), "k", &order(7)).await);
    assert_eq!(effects(&pool, "k", "place").await, 1);
}

/// A local phase that overruns inside the database, on the claim and on client retries that take
/// the key over. The claim's transaction is kept, and the statement's late answer (cancelled by
/// the server's statement_timeout) must not be taken for the claim's loss: the attempt is recorded
/// under the claim. A retry's takeover is given up with its connection (closed), but the server
/// does not notice while the statement runs, so that session holds the uncommitted takeover and
/// the claim lock until its statement_timeout ends it; the record must wait for it (bounded)
/// rather than find the lock taken and answer 409 with nothing recorded. Each attempt counts, and
/// the budget is spent.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn client_retries_whose_phase_overruns_in_the_database_spend_the_attempt_budget(
    pool: PgPool,
) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::HangInDatabaseLate; 10]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.local_only(3));
    let outcomes = retry_until_done(&runner, &workflow, "k", 6).await;
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 500, "{outcomes:?}");
    assert!(String::from_utf8_lossy(&response.body).contains("gave up after 3 attempts"));
    assert_eq!(scripts.place.runs(), 3, "{outcomes:?}");
    assert!(
        outcomes[..outcomes.len() - 1]
            .iter()
            .all(|outcome| matches!(outcome, Ok(Outcome::Interrupted { .. }))),
        "every overrun is a recorded attempt, none a 409: {outcomes:?}"
    );
    assert_eq!(effects(&pool, "k", "place").await, 0);
}

/// A wait a phase asks for (a provider's `Retry-After`) is bounded by the phase's policy: its
/// longest backoff. Unbounded, `Retry-After: 1000000000` left the key started for decades (every
/// client told 409 with that wait, no resumer taking it), and `10000000000000` made the database
/// refuse the lease ("interval out of range") after the phase had run, so it ran again later.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_retry_after_a_phase_asks_for_is_bounded_by_its_policy(pool: PgPool) {
    tables(&pool).await;
    let policy = patient()
        .with_max_attempts(5)
        .with_max_backoff(Duration::from_secs(30));
    for (key, asked) in [
        ("decades", 1_000_000_000),
        ("out-of-range", 10_000_000_000_000),
    ] {
        let scripts = Scripts::default();
        scripts.notify.then(&[Act::RetryAfterSecs(asked)]);
        let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain_with(policy));
        let outcome = runner
            .run(
                &workflow,
                &tenant(1),
                &idemflow::Key::parse(key).unwrap(),
                request(&order(7)),
            )
            .await;
        assert!(
            matches!(&outcome, Ok(Outcome::Interrupted { retry_after, .. })
                if *retry_after == policy.max_backoff),
            "{key}: {outcome:?}"
        );
        let due_in: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM locked_until - now())::float8 FROM idempotency_keys \
             WHERE key = $1 AND state = 'started'",
        )
        .bind(key)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(due_in <= 31.0, "{key}: due in {due_in} s");
        assert!(matches!(
            runner
                .run(
                    &workflow,
                    &tenant(1),
                    &idemflow::Key::parse(key).unwrap(),
                    request(&order(7)),
                )
                .await,
            Ok(Outcome::InProgress { retry_after }) if retry_after <= Duration::from_secs(31)
        ));
        expire_lease(&pool, key).await;
        executed(&run(&runner, &workflow, &tenant(1), key, &order(7)).await);
        assert_eq!(scripts.notify.runs(), 2, "{key}");
        assert_eq!(effects(&pool, key, "place").await, 1);
    }
}

// ---------------------------------------------------------------------------------------------
// Failures outside any phase

/// A commit the database refuses (a deferred constraint) fails the attempt like a phase would.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_refused_commit_counts_and_the_key_is_given_up_on(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::BreakAtCommit; 10]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.local_only(3));
    let outcomes = retry_until_done(&runner, &workflow, "k", 6).await;
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 500);
    assert_eq!(scripts.place.runs(), 3, "{outcomes:?}");
    assert_eq!(effects(&pool, "k", "place").await, 0);
    assert_eq!(stored(&pool, "k").await.unwrap().status, 500);
}

/// A client retry that took the key over and whose `COMMIT` is refused records its attempt,
/// though the refused transaction's session still holds the claim lock for a moment after the
/// error reached the runner (PostgreSQL reports the error, then aborts): the record waits for
/// the lock rather than trying it once and answering 409 with the attempt unrecorded.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_takeover_whose_commit_is_refused_records_its_attempt_while_the_lock_lingers(
    pool: PgPool,
) {
    tables(&pool).await;
    LINGER_POOL.set(pool.clone()).unwrap();
    let scripts = Scripts::default();
    scripts
        .place
        .then(&[Act::Retryable, Act::BreakAtCommitLingering]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.local_only(5));
    let outcomes = retry_until_done(&runner, &workflow, "k", 3).await;
    assert!(
        matches!(outcomes[1], Ok(Outcome::Interrupted { .. })),
        "the takeover's refused attempt is recorded: {outcomes:?}"
    );
    let attempts: i32 = sqlx::query_scalar("SELECT attempts FROM idempotency_keys WHERE key = 'k'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(attempts, 3, "{outcomes:?}");
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 201);
    assert_eq!(scripts.place.runs(), 3, "{outcomes:?}");
    assert_eq!(effects(&pool, "k", "place").await, 1);
}

/// An output the store cannot hold (U+0000 in a string) fails its attempt before anything is
/// written, and is given up on like any failure.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_output_the_store_cannot_hold_counts_and_is_given_up_on(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.place.then(&[Act::Unstorable; 10]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(2));
    let outcomes = retry_until_done(&runner, &workflow, "k", 5).await;
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 500);
    assert_eq!(scripts.place.runs(), 2);
    assert_eq!(scripts.notify.runs(), 0, "nothing left the database");
}

/// The same for a foreign phase's output: the call is not recorded, and it is made again (with
/// the same derived key) until the budget is spent.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_foreign_output_the_store_cannot_hold_counts_and_is_given_up_on(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.notify.then(&[Act::Unstorable; 10]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(2));
    let outcomes = retry_until_done(&runner, &workflow, "k", 5).await;
    let Some(Ok(Outcome::Executed(response))) = outcomes.last() else {
        panic!("{outcomes:?}");
    };
    assert_eq!(response.status, 500);
    assert_eq!(scripts.notify.runs(), 2);
    assert_eq!(effects(&pool, "k", "place").await, 1);
}

fn drainer(pool: &PgPool, workflow: Workflow<PgStore>) -> Resumer<PgStore> {
    let mut registry = Registry::new();
    registry.register(workflow).unwrap();
    let config = ResumerConfig::default().with_retention(None);
    Resumer::with_config(Runner::new(pool.clone()), registry, config)
}

/// Resumers drain and rewind until the key is done, at most `rounds` times.
async fn drain_until_done(pool: &PgPool, resumer: &Resumer<PgStore>, key: &str, rounds: usize) {
    for _ in 0..rounds {
        if stored(pool, key).await.is_some() {
            return;
        }
        expire_all_leases(pool).await;
        let _ = resumer.drain().await;
    }
}

/// A stored output that no longer decodes (a deploy changed its type) fails each attempt; the
/// budget is spent and the key finishes with a 500.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_stored_output_that_no_longer_decodes_is_given_up_on(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.notify.then(&[Act::Retryable]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(3));
    let first = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    sqlx::query("UPDATE idempotency_keys SET phase_output = '{\"amount\": \"seven\"}'")
        .execute(&pool)
        .await
        .unwrap();
    drain_until_done(&pool, &drainer(&pool, scripts.chain(3)), "k", 8).await;
    let response = stored(&pool, "k").await.expect("given up on");
    assert_eq!(response.status, 500);
    assert!(attempts(&pool, "k").await.0 <= 4);
    assert_eq!(
        scripts.notify.runs(),
        1,
        "never called with a value it cannot read"
    );
}

/// A key left at a recovery point its workflow no longer has is given up on the same way
/// (judged by the default policy: it cannot tell which phase comes next).
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_key_at_an_unknown_recovery_point_is_given_up_on(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.notify.then(&[Act::Retryable]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(3));
    let first = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    sqlx::query("UPDATE idempotency_keys SET recovery_point = 'renamed'")
        .execute(&pool)
        .await
        .unwrap();
    let attempts_allowed = RetryPolicy::default().max_attempts as usize;
    drain_until_done(
        &pool,
        &drainer(&pool, scripts.chain(3)),
        "k",
        attempts_allowed + 3,
    )
    .await;
    let response = stored(&pool, "k").await.expect("given up on");
    assert_eq!(response.status, 500);
}

/// Attempts that never record anything (a process killed mid-phase, again and again) still
/// count: the takeover past the budget gives up without running the phase again.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn attempts_that_recorded_nothing_still_spend_the_budget(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.notify.then(&[Act::Retryable]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(3));
    let first = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    // Three takeovers whose owners died before recording anything.
    sqlx::query("UPDATE idempotency_keys SET attempts = 3, locked_until = now() - interval '1 s'")
        .execute(&pool)
        .await
        .unwrap();
    let outcome = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    let response = executed(&outcome);
    assert_eq!(response.status, 500);
    assert_eq!(scripts.notify.runs(), 1, "not called again past the budget");
}

/// A takeover past the budget (a resumer's, committed by its scan) whose give-up meets a pooled
/// connection the server killed while it sat idle: the give-up begins again on another
/// connection, and the key ends with its 500 at once. Before, the give-up was lost with the dead
/// connection, the key stayed started until its lease ended, and the next takeover counted one
/// more and gave up in its place (the schedule explorer's seed 79 under load). No phase ran past
/// the budget either way; a give-up lost mid-statement still goes that way.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_give_up_meeting_a_connection_that_died_idle_is_made_on_another(pool: PgPool) {
    tables(&pool).await;
    let scripts = Scripts::default();
    scripts.notify.then(&[Act::Retryable]);
    let (runner, workflow) = (Runner::new(pool.clone()), scripts.chain(3));
    let first = run(&runner, &workflow, &tenant(1), "k", &order(7)).await;
    assert!(matches!(first, Outcome::Interrupted { .. }), "{first:?}");
    // Two more takeovers whose owners died before recording anything: the budget is spent.
    sqlx::query("UPDATE idempotency_keys SET attempts = 3, locked_until = now() - interval '1 s'")
        .execute(&pool)
        .await
        .unwrap();

    // A resumer with one pooled connection, handed out untested as the engine's pools are. Its
    // scan takes the key over (committed); the connection then dies while idle in the pool.
    let resumer_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap();
    let (taken, backend) = {
        let mut connection = resumer_pool.acquire().await.unwrap();
        let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
        let names = vec![(workflow.name().to_owned(), workflow.lease())];
        let mut due = idemflow_pg::take_over_due(&mut connection, &names, 10)
            .await
            .unwrap();
        (due.pop().unwrap().1, backend)
    };
    assert_eq!(taken.attempts, 4, "the takeover past the budget");
    // Killed only once back in the pool: sqlx pings a connection as it returns, and would drop
    // one killed before that, and open a live one for the give-up.
    tokio::time::timeout(Duration::from_secs(10), async {
        while resumer_pool.num_idle() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the connection is back in the pool");
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1, 10000)")
        .bind(backend)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(terminated, "the resumer's connection is gone");
    let resumed = Runner::new(resumer_pool.clone())
        .resume(&workflow, taken)
        .await;
    let response = match &resumed {
        Ok(outcome) => executed(outcome).clone(),
        Err(error) => panic!("the give-up was lost with the dead connection: {error:?}"),
    };
    assert_eq!(response.status, 500);
    assert!(
        String::from_utf8_lossy(&response.body).contains("gave up"),
        "{response:?}"
    );
    assert_eq!(
        key_row(&pool, "k")
            .await
            .map(|(state, _, _, attempts)| (state, attempts)),
        Some(("done".to_owned(), 4)),
        "given up by the takeover past the budget"
    );
    assert_eq!(scripts.notify.runs(), 1, "no phase ran past the budget");
    assert_eq!(effects(&pool, "k", "place").await, 1);
}
