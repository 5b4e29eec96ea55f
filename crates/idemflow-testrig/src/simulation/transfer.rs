//! Contended transfers: each schedule on PostgreSQL and MariaDB also sends a few keys whose local
//! phases move money between the same few accounts, at isolation levels the seed draws, so that
//! the database itself refuses some of their transactions (PostgreSQL's serialization failures,
//! 40001, and deadlocks, 40P01; InnoDB's deadlocks, 1213) and the runner runs them again in place.
//!
//! A transfer is two local phases in one transaction: `debit` (reads both balances, takes the
//! amount from one account) and `credit` (gives it to the other), each at its own drawn level (the
//! transaction runs at the stronger). Each writes a ledger row (key, account, change, token) in
//! its transaction. The ledger has no unique constraint on purpose: an effect applied twice shows
//! as a second row rather than being refused. On PostgreSQL the transfers draw the keys table's
//! layout too ([`layout`]): the partitioned one claims at Read Committed only, so there a claim
//! whose phases declare a stronger level is refused once, then commits alone before them. And
//! they draw the runner's bound on restarts in place (`RunnerConfig::most_restarts`), none
//! included: past it a conflict is an attempt, with its backoff.
//!
//! Checked after every client has its answer: the balances sum to what they began with; each
//! account's balance is its opening plus its ledger rows; each key has exactly one debit and one
//! credit row, of its amount, under one token; every key is done and answered with its transfer.
//! SQLite runs one writer at a time and every transaction as if serializable, so its schedules
//! have nothing to draw here and run no transfers.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_runner::{
    ConnectionOf, Isolation, LocalPhase, Outcome, PhaseContext, PhaseError, PoolOf, Request,
    RetryPolicy, Runner, RunnerConfig, SqlEngine, Workflow,
};
use serde::{Deserialize, Serialize};

use super::Layout;
use super::rng::Rng;

/// How many accounts the transfers share.
const ACCOUNTS: i64 = 3;
/// Each account's opening balance.
const OPENING: i64 = 1_000;
/// How long a client sends its request again before the key counts as never ending: far past
/// what contention alone costs (a few restarts, a few attempts of milliseconds each).
const PATIENCE: Duration = Duration::from_secs(30);

/// The SQL of the transfers, per engine.
#[async_trait]
pub(crate) trait Contended: SqlEngine {
    /// The accounts and ledger tables, if absent.
    async fn create(pool: &PoolOf<Self>) -> Result<(), sqlx::Error>;
    /// Opens the accounts of `tenant` afresh (and forgets its ledger).
    async fn open_accounts(pool: &PoolOf<Self>, tenant: &str) -> Result<(), sqlx::Error>;
    /// The balances of `tenant`'s accounts, by account.
    async fn balances(pool: &PoolOf<Self>, tenant: &str) -> Result<Vec<(i64, i64)>, sqlx::Error>;
    /// `tenant`'s ledger: key, account, change, token.
    async fn ledger(
        pool: &PoolOf<Self>,
        tenant: &str,
    ) -> Result<Vec<(String, i64, i64, i64)>, sqlx::Error>;
    /// Whether `tenant`'s `key` is done.
    async fn done(pool: &PoolOf<Self>, tenant: &str, key: &str) -> Result<bool, sqlx::Error>;
    /// Reads both accounts' balances (so a Serializable transaction depends on them).
    async fn read(
        connection: &mut ConnectionOf<Self>,
        tenant: &str,
        accounts: [i64; 2],
    ) -> Result<(), sqlx::Error>;
    /// Adds `change` to `account`, and writes its ledger row.
    async fn apply(
        connection: &mut ConnectionOf<Self>,
        tenant: &str,
        key: &str,
        account: i64,
        change: i64,
        token: i64,
    ) -> Result<(), sqlx::Error>;
}

#[async_trait]
impl Contended for PgStore {
    async fn create(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS sim_transfer_accounts \
                 (tenant text NOT NULL, id bigint NOT NULL, balance bigint NOT NULL, \
                  PRIMARY KEY (tenant, id)); \
             CREATE TABLE IF NOT EXISTS sim_transfer_ledger \
                 (tenant text NOT NULL, key text NOT NULL, account bigint NOT NULL, \
                  change bigint NOT NULL, lock_version bigint NOT NULL)",
        )
        .execute(pool)
        .await
        .map(drop)
    }

    async fn open_accounts(pool: &sqlx::PgPool, tenant: &str) -> Result<(), sqlx::Error> {
        let mut transaction = pool.begin().await?;
        for statement in [
            "DELETE FROM sim_transfer_accounts WHERE tenant = $1",
            "DELETE FROM sim_transfer_ledger WHERE tenant = $1",
            "DELETE FROM idempotency_keys WHERE tenant = $1",
        ] {
            sqlx::query(statement)
                .bind(tenant)
                .execute(&mut *transaction)
                .await?;
        }
        sqlx::query(
            "INSERT INTO sim_transfer_accounts (tenant, id, balance) \
             SELECT $1, id, $3 FROM generate_series(1, $2) AS id",
        )
        .bind(tenant)
        .bind(ACCOUNTS)
        .bind(OPENING)
        .execute(&mut *transaction)
        .await?;
        transaction.commit().await
    }

    async fn balances(pool: &sqlx::PgPool, tenant: &str) -> Result<Vec<(i64, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT id, balance FROM sim_transfer_accounts WHERE tenant = $1 ORDER BY id",
        )
        .bind(tenant)
        .fetch_all(pool)
        .await
    }

    async fn ledger(
        pool: &sqlx::PgPool,
        tenant: &str,
    ) -> Result<Vec<(String, i64, i64, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT key, account, change, lock_version FROM sim_transfer_ledger WHERE tenant = $1",
        )
        .bind(tenant)
        .fetch_all(pool)
        .await
    }

    async fn done(pool: &sqlx::PgPool, tenant: &str, key: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM idempotency_keys \
                            WHERE tenant = $1 AND key = $2 AND state = 'done')",
        )
        .bind(tenant)
        .bind(key)
        .fetch_one(pool)
        .await
    }

    async fn read(
        connection: &mut sqlx::PgConnection,
        tenant: &str,
        accounts: [i64; 2],
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "SELECT balance FROM sim_transfer_accounts WHERE tenant = $1 AND id IN ($2, $3)",
        )
        .bind(tenant)
        .bind(accounts[0])
        .bind(accounts[1])
        .fetch_all(connection)
        .await
        .map(drop)
    }

    async fn apply(
        connection: &mut sqlx::PgConnection,
        tenant: &str,
        key: &str,
        account: i64,
        change: i64,
        token: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE sim_transfer_accounts SET balance = balance + $3 WHERE tenant = $1 AND id = $2",
        )
        .bind(tenant)
        .bind(account)
        .bind(change)
        .execute(&mut *connection)
        .await?;
        sqlx::query(
            "INSERT INTO sim_transfer_ledger (tenant, key, account, change, lock_version) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(tenant)
        .bind(key)
        .bind(account)
        .bind(change)
        .bind(token)
        .execute(connection)
        .await
        .map(drop)
    }
}

#[async_trait]
impl Contended for MySqlStore {
    async fn create(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS sim_transfer_accounts \
                 (tenant VARCHAR(64) NOT NULL, id BIGINT NOT NULL, balance BIGINT NOT NULL, \
                  PRIMARY KEY (tenant, id)) ENGINE = InnoDB; \
             CREATE TABLE IF NOT EXISTS sim_transfer_ledger \
                 (tenant VARCHAR(64) NOT NULL, `key` VARCHAR(255) NOT NULL, \
                  account BIGINT NOT NULL, `change` BIGINT NOT NULL, \
                  lock_version BIGINT NOT NULL) ENGINE = InnoDB",
        )
        .execute(pool)
        .await
        .map(drop)
    }

    async fn open_accounts(pool: &sqlx::MySqlPool, tenant: &str) -> Result<(), sqlx::Error> {
        let mut transaction = pool.begin().await?;
        for statement in [
            "DELETE FROM sim_transfer_accounts WHERE tenant = ?",
            "DELETE FROM sim_transfer_ledger WHERE tenant = ?",
            "DELETE FROM idempotency_keys WHERE tenant = ?",
        ] {
            sqlx::query(statement)
                .bind(tenant)
                .execute(&mut *transaction)
                .await?;
        }
        for id in 1..=ACCOUNTS {
            sqlx::query("INSERT INTO sim_transfer_accounts (tenant, id, balance) VALUES (?, ?, ?)")
                .bind(tenant)
                .bind(id)
                .bind(OPENING)
                .execute(&mut *transaction)
                .await?;
        }
        transaction.commit().await
    }

    async fn balances(
        pool: &sqlx::MySqlPool,
        tenant: &str,
    ) -> Result<Vec<(i64, i64)>, sqlx::Error> {
        sqlx::query_as("SELECT id, balance FROM sim_transfer_accounts WHERE tenant = ? ORDER BY id")
            .bind(tenant)
            .fetch_all(pool)
            .await
    }

    async fn ledger(
        pool: &sqlx::MySqlPool,
        tenant: &str,
    ) -> Result<Vec<(String, i64, i64, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT `key`, account, `change`, lock_version FROM sim_transfer_ledger WHERE tenant = ?",
        )
        .bind(tenant)
        .fetch_all(pool)
        .await
    }

    async fn done(pool: &sqlx::MySqlPool, tenant: &str, key: &str) -> Result<bool, sqlx::Error> {
        let done: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM idempotency_keys \
             WHERE tenant = ? AND `key` = ? AND state = 'done'",
        )
        .bind(tenant.as_bytes())
        .bind(key.as_bytes())
        .fetch_one(pool)
        .await?;
        Ok(done == 1)
    }

    async fn read(
        connection: &mut sqlx::MySqlConnection,
        tenant: &str,
        accounts: [i64; 2],
    ) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT balance FROM sim_transfer_accounts WHERE tenant = ? AND id IN (?, ?)")
            .bind(tenant)
            .bind(accounts[0])
            .bind(accounts[1])
            .fetch_all(connection)
            .await
            .map(drop)
    }

    async fn apply(
        connection: &mut sqlx::MySqlConnection,
        tenant: &str,
        key: &str,
        account: i64,
        change: i64,
        token: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE sim_transfer_accounts SET balance = balance + ? WHERE tenant = ? AND id = ?",
        )
        .bind(change)
        .bind(tenant)
        .bind(account)
        .execute(&mut *connection)
        .await?;
        sqlx::query(
            "INSERT INTO sim_transfer_ledger (tenant, `key`, account, `change`, lock_version) \
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(tenant)
        .bind(key)
        .bind(account)
        .bind(change)
        .bind(token)
        .execute(connection)
        .await
        .map(drop)
    }
}

/// One transfer: the request of its key.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Move {
    key: String,
    from: i64,
    to: i64,
    amount: i64,
    /// How long each phase takes, in ms (so the transactions overlap).
    pause_ms: u64,
}

/// What the phases count across a schedule: their runs.
#[derive(Default)]
struct Runs(AtomicU64);

/// Takes the amount from one account.
struct Debit {
    tenant: String,
    isolation: Isolation,
    runs: Arc<Runs>,
}

/// Gives the amount to the other.
struct Credit {
    tenant: String,
    isolation: Isolation,
    runs: Arc<Runs>,
}

#[async_trait]
impl<E: Contended> LocalPhase<E> for Debit {
    const NAME: &'static str = "debit";
    type Input = Move;
    type Output = Move;

    fn isolation(&self) -> Isolation {
        self.isolation
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: Move,
        context: &PhaseContext,
    ) -> Result<Move, PhaseError> {
        self.runs.0.fetch_add(1, Ordering::Relaxed);
        E::read(connection, &self.tenant, [input.from, input.to]).await?;
        tokio::time::sleep(Duration::from_millis(input.pause_ms)).await;
        let token = context.lock_version;
        E::apply(
            connection,
            &self.tenant,
            &input.key,
            input.from,
            -input.amount,
            token,
        )
        .await?;
        Ok(input)
    }
}

#[async_trait]
impl<E: Contended> LocalPhase<E> for Credit {
    const NAME: &'static str = "credit";
    type Input = Move;
    type Output = StoredResponse;

    fn isolation(&self) -> Isolation {
        self.isolation
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: Move,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        self.runs.0.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(input.pause_ms)).await;
        let token = context.lock_version;
        E::apply(
            connection,
            &self.tenant,
            &input.key,
            input.to,
            input.amount,
            token,
        )
        .await?;
        Ok(StoredResponse::new(201, input.key.as_str()))
    }
}

/// Quick retries: a transaction refused past its restarts comes back at once, and enough
/// attempts that contention alone never ends a key in failure.
fn policy() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(50)
        .with_initial_backoff(Duration::from_millis(1))
        .with_max_backoff(Duration::from_millis(5))
        .with_multiplier(2.0)
        .with_jitter(0.5)
}

/// The layout of the keys table the schedule `seed`'s transfers run on (PostgreSQL): the
/// partitioned one in two schedules of five.
pub(crate) fn layout(seed: u64) -> Layout {
    if Rng::new(seed ^ 0x6c61_796f_7574).chance(0.4) {
        Layout::Partitioned
    } else {
        Layout::Unpartitioned
    }
}

/// The runner of the schedule `seed`'s transfers, with the bound on restarts in place it draws:
/// none (every conflict an attempt with its backoff), one, the default, or many.
fn runner<E: Contended>(seed: u64, pool: PoolOf<E>, history: &mut Vec<String>) -> Runner<E> {
    let most_restarts =
        Rng::new(seed ^ 0x7265_7374_6172_7473).weighted(&[(1, 0), (1, 1), (4, 8), (1, 32)]);
    history.push(format!(
        "transfers: at most {most_restarts} restart(s) in place"
    ));
    Runner::<E>::on(
        pool,
        RunnerConfig::default().with_most_restarts(most_restarts),
    )
}

/// A level for a phase, drawn.
fn level(rng: &mut Rng) -> Isolation {
    rng.weighted(&[
        (2, Isolation::ReadCommitted),
        (3, Isolation::RepeatableRead),
        (5, Isolation::Serializable),
    ])
}

/// What the transfers of one schedule came to: what went wrong, and what happened.
pub(crate) struct Transfers {
    pub violations: Vec<String>,
    pub history: Vec<String>,
    /// Keys sent.
    pub keys: u64,
    /// Phase runs past one per phase of each key.
    pub reruns: u64,
}

/// Runs the schedule `seed`'s transfers on `pool` (the engine's), and checks them through
/// `observer` (never the engine's connections).
pub(crate) async fn run<E: Contended>(
    seed: u64,
    pool: PoolOf<E>,
    observer: &PoolOf<E>,
) -> Transfers {
    let mut rng = Rng::new(seed ^ 0x7472_616e_7366_6572);
    let tenant = format!("xfer-{seed}");
    let mut history = Vec::new();
    let mut violations = Vec::new();
    let prepared = async {
        E::create(observer).await?;
        E::open_accounts(observer, &tenant).await
    };
    if let Err(error) = prepared.await {
        violations.push(format!(
            "transfers: the accounts could not be opened: {error}"
        ));
        return Transfers {
            violations,
            history,
            keys: 0,
            reruns: 0,
        };
    }
    let runs = Arc::new(Runs::default());
    let workflow = Arc::new(workflow::<E>(&mut rng, &tenant, &runs, &mut history));
    let runner = Arc::new(runner::<E>(seed, pool, &mut history));
    let tenant_id = TenantId::new(tenant.clone())
        .unwrap_or_else(|error| unreachable!("a valid tenant: {error}"));
    let keys = rng.between(3, 6);
    let mut moves = Vec::new();
    let mut clients = Vec::new();
    for n in 0..keys {
        let transfer = draw_move(&mut rng, n);
        history.push(format!("transfers: {transfer:?}"));
        // One or two clients send each key's request at once.
        for _ in 0..rng.between(1, 2) {
            let (runner, workflow, tenant_id) =
                (runner.clone(), workflow.clone(), tenant_id.clone());
            let transfer = transfer.clone();
            clients.push(tokio::spawn(async move {
                send(&runner, &workflow, &tenant_id, &transfer).await
            }));
        }
        moves.push(transfer);
    }
    for client in clients {
        match client.await {
            Ok(Ok(line)) => history.push(line),
            Ok(Err(violation)) => violations.push(violation),
            Err(error) => violations.push(format!("transfers: a client panicked: {error}")),
        }
    }
    let runs = runs.0.load(Ordering::Relaxed);
    history.push(format!("transfers: {runs} phase run(s) for {keys} key(s)"));
    match check::<E>(observer, &tenant, &moves).await {
        Ok(found) => violations.extend(found),
        Err(error) => violations.push(format!("transfers: the check could not read: {error}")),
    }
    Transfers {
        violations,
        history,
        keys,
        reruns: runs.saturating_sub(2 * keys),
    }
}

/// The `n`th key's transfer: two different accounts, in either order (so the locks cross).
fn draw_move(rng: &mut Rng, n: u64) -> Move {
    let from = rng.between(1, ACCOUNTS as u64);
    let to = (from + rng.between(0, ACCOUNTS as u64 - 2)) % ACCOUNTS as u64 + 1;
    Move {
        key: format!("xfer-{n}"),
        from: from as i64,
        to: to as i64,
        amount: i64::try_from(rng.between(1, 50)).unwrap_or(1),
        pause_ms: rng.between(0, 4),
    }
}

/// The transfer workflow, each phase at a level drawn from `rng`.
fn workflow<E: Contended>(
    rng: &mut Rng,
    tenant: &str,
    runs: &Arc<Runs>,
    history: &mut Vec<String>,
) -> Workflow<E> {
    let (debit_level, credit_level) = (level(rng), level(rng));
    history.push(format!(
        "transfers: debit at {debit_level}, credit at {credit_level}"
    ));
    Workflow::<E>::builder_on::<Move>("sim.transfer.v1")
        .local(Debit {
            tenant: tenant.to_owned(),
            isolation: debit_level,
            runs: runs.clone(),
        })
        .local(Credit {
            tenant: tenant.to_owned(),
            isolation: credit_level,
            runs: runs.clone(),
        })
        .build()
        .unwrap_or_else(|error| unreachable!("the transfer workflow builds: {error}"))
}

/// Sends `transfer`'s request until it is answered with its transfer; a violation when it is
/// answered otherwise or never.
async fn send<E: Contended>(
    runner: &Runner<E>,
    workflow: &Workflow<E>,
    tenant: &TenantId,
    transfer: &Move,
) -> Result<String, String> {
    let key = Key::parse(&transfer.key).map_err(|error| error.to_string())?;
    let body = serde_json::to_vec(transfer).map_err(|error| error.to_string())?;
    let mut last = String::new();
    let began = std::time::Instant::now();
    let mut sent = 0_u64;
    while began.elapsed() < PATIENCE {
        sent += 1;
        let request = Request {
            method: "POST",
            path: "/transfers",
            body: &body,
        };
        match runner.run(workflow, tenant, &key, request).await {
            Ok(Outcome::Executed(response) | Outcome::Replayed(response)) => {
                if response.status != 201 || response.body != transfer.key.as_bytes() {
                    return Err(format!(
                        "transfers: {} answered another transfer: {response:?}",
                        transfer.key
                    ));
                }
                return Ok(format!(
                    "transfers: {} answered after {sent} send(s)",
                    transfer.key
                ));
            }
            Ok(other) => last = format!("{other:?}"),
            Err(error) => last = error.to_string(),
        }
        tokio::time::sleep(Duration::from_millis((5 * sent).min(100))).await;
    }
    Err(format!(
        "transfers: {} never ended in {sent} sends over {PATIENCE:?} (last: {last})",
        transfer.key
    ))
}

/// What the transfers left, read through the observer.
async fn check<E: Contended>(
    observer: &PoolOf<E>,
    tenant: &str,
    moves: &[Move],
) -> Result<Vec<String>, sqlx::Error> {
    let mut violations = Vec::new();
    let balances = E::balances(observer, tenant).await?;
    let ledger = E::ledger(observer, tenant).await?;
    let total: i64 = balances.iter().map(|(_, balance)| balance).sum();
    if total != ACCOUNTS * OPENING {
        violations.push(format!(
            "transfers: the balances sum to {total}, not {}: {balances:?}",
            ACCOUNTS * OPENING
        ));
    }
    for (account, balance) in &balances {
        let changes: i64 = ledger
            .iter()
            .filter(|row| row.1 == *account)
            .map(|row| row.2)
            .sum();
        if *balance != OPENING + changes {
            violations.push(format!(
                "transfers: account {account} holds {balance}, its ledger says {}",
                OPENING + changes
            ));
        }
    }
    for transfer in moves {
        let mut rows: Vec<(i64, i64)> = ledger
            .iter()
            .filter(|row| row.0 == transfer.key)
            .map(|row| (row.1, row.2))
            .collect();
        rows.sort_unstable();
        let mut expected = vec![
            (transfer.from, -transfer.amount),
            (transfer.to, transfer.amount),
        ];
        expected.sort_unstable();
        if rows != expected {
            violations.push(format!(
                "transfers: {} applied as {rows:?}, not once as {expected:?}",
                transfer.key
            ));
        }
        let tokens: std::collections::BTreeSet<i64> = ledger
            .iter()
            .filter(|row| row.0 == transfer.key)
            .map(|row| row.3)
            .collect();
        if tokens.len() > 1 {
            violations.push(format!(
                "transfers: {}'s effects were written under tokens {tokens:?}",
                transfer.key
            ));
        }
        if !E::done(observer, tenant, &transfer.key).await? {
            violations.push(format!("transfers: {} is not done", transfer.key));
        }
    }
    Ok(violations)
}
