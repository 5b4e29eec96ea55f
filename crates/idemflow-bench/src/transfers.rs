//! The transfers workload: contended money transfers at Serializable. Each request moves 1
//! between two of a few accounts (a new key each), reading both balances and writing both, so
//! concurrent requests meet serialization failures (40001) and deadlocks (40P01). The engine
//! (`Runner<PgStore>`, one local phase declaring Serializable: the runner runs a refused
//! transaction again in place) against raw sqlx with the loop a careful team would write by hand
//! (the same statements and key row in one Serializable transaction, tried again on 40001/40P01
//! after a jittered pause of up to 2^n ms), taking turns at each client count. Checked, or the
//! run fails: the balances still sum to their opening, and every request was answered.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow::{
    Isolation, Key, LocalPhase, Outcome, PhaseContext, PhaseError, RetryPolicy, RunError, Runner,
    RunnerConfig, Workflow,
};
use idemflow_pg::PgStore;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::Error;
use crate::load::Latencies;
use crate::load::LatencySummary;
use crate::report::Report;
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "transfers",
    number: None,
    measures: "contended transfers at Serializable: the engine's restarts in place vs raw sqlx \
               with a hand-written retry loop",
    runs: Runs::AtEachClientCount(run),
    targets: None,
    section: Some(section),
};

/// How many accounts the transfers share.
const ACCOUNTS: i64 = 10;
/// Each account's opening balance.
const OPENING: i64 = 1_000_000;
/// Tries of one request before the raw loop gives up (the engine's are its own: 8 restarts per
/// attempt by default, then an attempt; its second side restarts as often as raw tries).
const RAW_TRIES: u32 = 30;

/// The engine with the default bound on restarts in place.
const ENGINE: &str = "engine";
/// The engine restarting as many times as the raw loop tries (`RunnerConfig::most_restarts`).
const ENGINE_AS_RAW: &str = "engine, 30 restarts";
/// The hand-written loop.
const RAW: &str = "raw";

/// One side's run at one client count.
#[derive(Debug, Clone, Serialize)]
pub struct TransferRun {
    pub side: &'static str,
    pub clients: usize,
    pub requests: u64,
    pub per_second: f64,
    /// Transactions run again (the engine's restarts in place and attempts; the raw loop's
    /// tries), per request answered.
    pub reruns_per_request: f64,
    /// Requests the engine's clients sent again (interrupted, in progress, busy), per request.
    pub resent_per_request: f64,
    pub latency: LatencySummary,
}

fn run<'a>(ctx: &'a Ctx<'a>, clients: usize, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let pool = ctx.scratch.pool(clients + 2).await?;
        prepare(&pool).await?;
        // Alternate which side goes first, so the drift falls on both alike.
        let engine_first = report.transfers.len().is_multiple_of(6);
        for side in if engine_first {
            [ENGINE, ENGINE_AS_RAW, RAW]
        } else {
            [RAW, ENGINE_AS_RAW, ENGINE]
        } {
            open_accounts(&pool).await?;
            let run = one_side(ctx, &pool, side, clients).await?;
            eprintln!(
                "  transfers ({side}, {clients} clients): {:.0}/s, {:.2} reruns per request, p99 {:.1} ms",
                run.per_second,
                run.reruns_per_request,
                run.latency.p99_ms.unwrap_or(f64::NAN)
            );
            report.transfers.push(run);
        }
        pool.close().await;
        Ok(())
    })
}

async fn prepare(pool: &PgPool) -> Result<(), Error> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bench_accounts (id bigint PRIMARY KEY, balance bigint NOT NULL); \
         CREATE TABLE IF NOT EXISTS bench_raw_transfer_keys \
             (key text PRIMARY KEY, status int, body bytea)",
    )
    .execute(pool)
    .await?;
    Ok(())
}

async fn open_accounts(pool: &PgPool) -> Result<(), Error> {
    sqlx::query(
        "INSERT INTO bench_accounts (id, balance) SELECT id, $2 FROM generate_series(1, $1) AS id \
         ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance",
    )
    .bind(ACCOUNTS)
    .bind(OPENING)
    .execute(pool)
    .await?;
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Move {
    from: i64,
    to: i64,
}

/// Two different accounts, drawn.
fn draw(state: &mut u64) -> Move {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    let high = (*state >> 33) as i64;
    let from = high % ACCOUNTS + 1;
    let to = (from + (high / ACCOUNTS) % (ACCOUNTS - 1)) % ACCOUNTS + 1;
    Move { from, to }
}

/// The transfer's statements, as both sides send them.
async fn transfer(connection: &mut sqlx::PgConnection, the: &Move) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT balance FROM bench_accounts WHERE id = $1 OR id = $2")
        .bind(the.from)
        .bind(the.to)
        .fetch_all(&mut *connection)
        .await?;
    sqlx::query("UPDATE bench_accounts SET balance = balance - 1 WHERE id = $1")
        .bind(the.from)
        .execute(&mut *connection)
        .await?;
    sqlx::query("UPDATE bench_accounts SET balance = balance + 1 WHERE id = $1")
        .bind(the.to)
        .execute(&mut *connection)
        .await?;
    Ok(())
}

struct Transfer {
    runs: Arc<AtomicU64>,
}

#[async_trait]
impl LocalPhase<PgStore> for Transfer {
    const NAME: &'static str = "transfer";
    type Input = Move;
    type Output = idemflow::StoredResponse;

    fn isolation(&self) -> Isolation {
        Isolation::Serializable
    }

    /// An attempt past its restarts comes back at once, as the raw loop tries again.
    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
            .with_max_attempts(1_000)
            .with_initial_backoff(Duration::from_millis(1))
            .with_max_backoff(Duration::from_millis(64))
    }

    async fn run(
        &self,
        connection: &mut sqlx::PgConnection,
        input: Move,
        _: &PhaseContext,
    ) -> Result<idemflow::StoredResponse, PhaseError> {
        self.runs.fetch_add(1, Ordering::Relaxed);
        transfer(connection, &input).await?;
        Ok(idemflow::StoredResponse::new(201, "moved"))
    }
}

/// The engine's runner for `side`: the default bound on restarts in place, or raw's tries.
fn engine_runner(pool: &PgPool, side: &str) -> Runner<PgStore> {
    let most_restarts = if side == ENGINE_AS_RAW {
        RAW_TRIES
    } else {
        RunnerConfig::DEFAULT_MOST_RESTARTS
    };
    Runner::<PgStore>::with_config(
        pool.clone(),
        RunnerConfig::default().with_most_restarts(most_restarts),
    )
}

/// One side's clients, each sending new keys until the run's time is up.
async fn one_side(
    ctx: &Ctx<'_>,
    pool: &PgPool,
    side: &'static str,
    clients: usize,
) -> Result<TransferRun, Error> {
    let runs = Arc::new(AtomicU64::new(0));
    let workflow = Arc::new(
        Workflow::<PgStore>::builder_on::<Move>("bench.transfer.v1")
            .local(Transfer { runs: runs.clone() })
            .build()?,
    );
    let runner = Arc::new(engine_runner(pool, side));
    let prefix = ctx.prefix("transfers");
    let duration = ctx.config.duration;
    let reruns = Arc::new(AtomicU64::new(0));
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let (runner, workflow, pool, reruns) = (
            runner.clone(),
            workflow.clone(),
            pool.clone(),
            reruns.clone(),
        );
        let (tenant, prefix) = (ctx.tenant.clone(), prefix.clone());
        tasks.spawn(async move {
            let mut state = client as u64 + 1;
            let mut latencies = Vec::new();
            let mut n = 0_u64;
            while began.elapsed() < duration {
                n += 1;
                let key = format!("{prefix}-{client}-{n}");
                let the = draw(&mut state);
                let sent = Instant::now();
                if side != RAW {
                    engine_request(&runner, &workflow, &tenant, &key, &the, &reruns).await?;
                } else {
                    raw_request(&pool, &key, &the, &reruns).await?;
                }
                latencies.push(u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX));
            }
            Ok::<_, Error>(latencies)
        });
    }
    let mut latencies = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        latencies.extend(joined??);
    }
    let elapsed = began.elapsed().as_secs_f64();
    conserved(pool, side).await?;
    let requests = latencies.len() as u64;
    let (reruns, resent) = counted(side, &runs, &reruns, requests);
    Ok(TransferRun {
        side,
        clients,
        requests,
        per_second: requests as f64 / elapsed,
        reruns_per_request: reruns as f64 / requests.max(1) as f64,
        resent_per_request: resent as f64 / requests.max(1) as f64,
        latency: Latencies::from_unsorted(latencies).summary(),
    })
}

/// Transactions run again and requests sent again: the engine's phase runs past one per request
/// and its clients' resends; raw's tries past one.
fn counted(side: &str, runs: &AtomicU64, counter: &AtomicU64, requests: u64) -> (u64, u64) {
    let counter = counter.load(Ordering::Relaxed);
    if side != RAW {
        (
            runs.load(Ordering::Relaxed).saturating_sub(requests),
            counter,
        )
    } else {
        (counter, 0)
    }
}

/// The balances still sum to their opening; else the run fails.
async fn conserved(pool: &PgPool, side: &str) -> Result<(), Error> {
    let total: i64 = sqlx::query_scalar("SELECT sum(balance)::bigint FROM bench_accounts")
        .fetch_one(pool)
        .await?;
    if total != ACCOUNTS * OPENING {
        return Err(format!("transfers ({side}): the balances sum to {total}").into());
    }
    Ok(())
}

/// The engine's request, sent again while it is interrupted (an attempt past its restarts).
async fn engine_request(
    runner: &Runner<PgStore>,
    workflow: &Workflow<PgStore>,
    tenant: &idemflow::TenantId,
    key: &str,
    the: &Move,
    resent: &AtomicU64,
) -> Result<(), Error> {
    let key = Key::parse(key)?;
    let body = serde_json::to_vec(the)?;
    let began = Instant::now();
    let mut last = String::new();
    while began.elapsed() < Duration::from_secs(30) {
        let request = idemflow::Request {
            method: "POST",
            path: "/transfers",
            body: &body,
        };
        match runner.run(workflow, tenant, &key, request).await {
            Ok(Outcome::Executed(_) | Outcome::Replayed(_)) => return Ok(()),
            // Sent again, as a client would: an attempt past its restarts, the key held by
            // that attempt, the engine busy (a lock wait past its timeout).
            Ok(answer @ (Outcome::Interrupted { .. } | Outcome::InProgress { .. })) => {
                last = format!("{answer:?}");
                resent.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Err(RunError::Busy) => {
                last = "busy".to_owned();
                resent.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            Ok(other) => return Err(format!("transfers: answered {other:?}").into()),
            Err(error) => return Err(error.into()),
        }
    }
    Err(format!("transfers: an engine request never ended (last: {last})").into())
}

/// What a careful team writes by hand: the key row, the transfer and the response in one
/// Serializable transaction; a serialization failure or a deadlock rolls it back and tries
/// again after a jittered pause.
async fn raw_request(
    pool: &PgPool,
    key: &str,
    the: &Move,
    reruns: &AtomicU64,
) -> Result<(), Error> {
    for tries in 0..RAW_TRIES {
        match raw_once(pool, key, the).await {
            Ok(()) => return Ok(()),
            Err(sqlx::Error::Database(error))
                if matches!(error.code().as_deref(), Some("40001" | "40P01")) =>
            {
                reruns.fetch_add(1, Ordering::Relaxed);
                let ceiling = f64::from(1_u32 << tries.min(6));
                let pause = ceiling * idemflow::core::backoff::unit();
                tokio::time::sleep(Duration::from_secs_f64(pause / 1000.0)).await;
            }
            Err(error) => return Err(error.into()),
        }
    }
    Err("transfers: a raw request never ended".into())
}

async fn raw_once(pool: &PgPool, key: &str, the: &Move) -> Result<(), sqlx::Error> {
    let mut connection = pool.acquire().await?;
    sqlx::raw_sql("BEGIN ISOLATION LEVEL SERIALIZABLE")
        .execute(&mut *connection)
        .await?;
    let done = async {
        let claimed = sqlx::query(
            "INSERT INTO bench_raw_transfer_keys (key) VALUES ($1) ON CONFLICT DO NOTHING",
        )
        .bind(key)
        .execute(&mut *connection)
        .await?;
        if claimed.rows_affected() == 1 {
            transfer(&mut connection, the).await?;
            sqlx::query(
                "UPDATE bench_raw_transfer_keys SET status = 201, body = 'moved' WHERE key = $1",
            )
            .bind(key)
            .execute(&mut *connection)
            .await?;
        }
        sqlx::raw_sql("COMMIT").execute(&mut *connection).await?;
        Ok::<_, sqlx::Error>(())
    }
    .await;
    if done.is_err() {
        let _ = sqlx::raw_sql("ROLLBACK").execute(&mut *connection).await;
    }
    done
}

fn section(report: &Report, out: &mut String) {
    if report.transfers.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\ntransfers: {ACCOUNTS} accounts, each request a new key moving 1 between two of them \
         at SERIALIZABLE; engine (restarts in place: 8, the default, or 30) vs raw sqlx \
         (hand-written retry loop, 30 tries)\n\
         | side | clients | requests | per second | reruns per request | resent per request | p50 ms | p99 ms |\n\
         |---|---|---|---|---|---|---|---|"
    );
    for run in &report.transfers {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.0} | {:.2} | {:.3} | {:.1} | {:.1} |",
            run.side,
            run.clients,
            run.requests,
            run.per_second,
            run.reruns_per_request,
            run.resent_per_request,
            run.latency.p50_ms.unwrap_or(f64::NAN),
            run.latency.p99_ms.unwrap_or(f64::NAN)
        );
    }
}
