//! The sqlite workload: the SQLite store beside raw sqlx on SQLite sending the same statements, on
//! one database file (WAL, `synchronous = FULL`), at each client count: a new key's whole request
//! in one write transaction (claim, one phase's record, finish), and a replay's look-up. Engine and
//! raw alternate in halves of the run, so drift (the file growing, the page cache) falls on both.
//! The claims' requests per second across client counts show the single-writer ceiling: every write
//! transaction holds SQLite's one write lock, so unrelated keys queue on it.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemflow::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_sqlite::{ClaimRequest, Claimed, OpenOptions, statements};
use serde_json::json;
use sqlx::SqlitePool;

use crate::Error;
use crate::config::Config;
use crate::report::{EngineRun, Report, Target, engine_rows};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "sqlite",
    number: Some(13),
    measures: "the SQLite store and runner vs raw sqlx on SQLite",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

const LEASE: Duration = Duration::from_secs(30);
const REPLAY_KEYS: u64 = 1_000;

/// The workload's database file, in a directory of this run's own (removed at its end).
fn database() -> Result<PathBuf, Error> {
    let directory =
        std::env::temp_dir().join(format!("idemflow-bench-sqlite-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory)?;
    Ok(directory.join("bench.db"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Engine,
    Raw,
}

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        report.sqlite = measure(ctx.config).await?;
        Ok(())
    })
}

/// Runs both operations at each of the configured client counts, then the runner's.
async fn measure(config: &Config) -> Result<Vec<EngineRun>, Error> {
    let path = database()?;
    let pool =
        idemflow_sqlite::open_file(&path, &OpenOptions::default().with_max_connections(32)).await?;
    let tenant = TenantId::new("bench-sqlite")?;
    let next = Arc::new(AtomicU64::new(0));
    // Finished keys for the replays, written through the engine.
    for index in 0..REPLAY_KEYS {
        request(&pool, Side::Engine, &tenant, &format!("replay-{index}")).await?;
    }
    let mut runs = Vec::new();
    for &clients in &config.clients {
        for operation in ["request", "replay"] {
            let mut counts = [0_u64; 2];
            let half = config.duration / 2;
            for side in [Side::Engine, Side::Raw, Side::Engine, Side::Raw] {
                let done = timed(&pool, &tenant, &next, operation, side, clients, half / 2).await?;
                counts[usize::from(side == Side::Raw)] += done;
            }
            let seconds = half.as_secs_f64();
            runs.push(EngineRun {
                operation: operation.to_owned(),
                clients,
                engine_per_second: counts[0] as f64 / seconds,
                raw_per_second: counts[1] as f64 / seconds,
            });
        }
    }
    // The runner's operations, on the same file.
    runs.extend(crate::sqlite_runner::run(&pool, &config.clients, config.duration).await?);
    pool.close().await;
    // Several processes on the same file (the orders table exists now): processes of the bench
    // binary itself, so not from the quick test's binary.
    if !config.quick {
        runs.extend(crate::sqlite_runner::processes(&path, config.duration).await?);
    }
    let _ = std::fs::remove_dir_all(path.parent().unwrap_or(Path::new(".")));
    Ok(runs)
}

/// `clients` tasks doing `operation` on `side` for `duration`; how many they finished.
async fn timed(
    pool: &SqlitePool,
    tenant: &TenantId,
    next: &Arc<AtomicU64>,
    operation: &'static str,
    side: Side,
    clients: usize,
    duration: Duration,
) -> Result<u64, Error> {
    let until = Instant::now() + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let (pool, tenant, next) = (pool.clone(), tenant.clone(), next.clone());
        tasks.spawn(async move {
            let mut done = 0_u64;
            let mut replay = client as u64;
            while Instant::now() < until {
                if operation == "request" {
                    let key = format!("key-{}", next.fetch_add(1, Ordering::Relaxed));
                    request(&pool, side, &tenant, &key).await?;
                } else {
                    replay = (replay + 7) % REPLAY_KEYS;
                    look_up(&pool, side, &tenant, &format!("replay-{replay}")).await?;
                }
                done += 1;
            }
            Ok::<u64, Error>(done)
        });
    }
    let mut total = 0;
    while let Some(joined) = tasks.join_next().await {
        total += joined??;
    }
    Ok(total)
}

fn response() -> StoredResponse {
    StoredResponse::new(201, br#"{"order":"ord_1","status":"confirmed"}"#.to_vec())
}

/// A new key's request in one write transaction: claim, one phase's record, finish, commit.
async fn request(pool: &SqlitePool, side: Side, tenant: &TenantId, key: &str) -> Result<(), Error> {
    let key = Key::parse(key)?;
    let fingerprint = Fingerprint::from_slice(&[5; 32]).ok_or("a fingerprint")?;
    let input = json!({"amount": 1200, "currency": "usd"});
    let output = json!({"order": "ord_1"});
    let new = New {
        tenant,
        key: &key,
        fingerprint: &fingerprint,
        input: &input,
        output: &output,
    };
    match side {
        Side::Engine => new.through_store(pool).await,
        Side::Raw => new.raw(pool).await,
    }
}

/// What a new key's request stores.
struct New<'a> {
    tenant: &'a TenantId,
    key: &'a Key,
    fingerprint: &'a Fingerprint,
    input: &'a serde_json::Value,
    output: &'a serde_json::Value,
}

impl New<'_> {
    /// Through the store's functions.
    async fn through_store(&self, pool: &SqlitePool) -> Result<(), Error> {
        let claim = ClaimRequest {
            tenant: self.tenant,
            key: self.key,
            fingerprint: self.fingerprint,
            workflow: "bench@1",
            request: self.input,
            lease: LEASE,
        };
        let Claimed::Owned(mut transaction, owner) =
            idemflow_sqlite::begin_claim(pool.acquire().await?, &claim).await?
        else {
            return Err("a new key was found claimed".into());
        };
        idemflow_sqlite::advance(
            transaction.connection(),
            &owner,
            "reserve",
            self.output,
            LEASE,
        )
        .await?;
        idemflow_sqlite::finish(
            transaction.connection(),
            &owner,
            "complete",
            &response(),
            usize::MAX,
        )
        .await?;
        transaction.commit().await?;
        Ok(())
    }

    /// The store's statements sent by plain sqlx code.
    async fn raw(&self, pool: &SqlitePool) -> Result<(), Error> {
        let (tenant, key) = (self.tenant.as_str(), self.key.as_str());
        let mut connection = pool.acquire().await?;
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut *connection)
            .await?;
        let exists = sqlx::query(statements::EXISTS)
            .bind(tenant)
            .bind(key)
            .fetch_optional(&mut *connection)
            .await?;
        if exists.is_some() {
            return Err("a new key was found claimed".into());
        }
        let token: i64 = sqlx::query_scalar(statements::NEXT_FENCE)
            .fetch_one(&mut *connection)
            .await?;
        sqlx::query(statements::CLAIM)
            .bind(tenant)
            .bind(key)
            .bind(self.fingerprint.as_bytes().as_slice())
            .bind("bench@1")
            .bind(self.input.to_string())
            .bind(30_000_i64)
            .bind(token)
            // The holder: this claim never asks the row whether it committed (docs/engines.md).
            .bind(1_i64)
            .execute(&mut *connection)
            .await?;
        let advanced = sqlx::query(statements::ADVANCE)
            .bind(tenant)
            .bind(key)
            .bind(token)
            .bind("reserve")
            .bind(self.output.to_string())
            .bind(30_000_i64)
            .execute(&mut *connection)
            .await?;
        crate::raw::wrote_the_row("advance", key, advanced.rows_affected())?;
        let response = response();
        let finished: Option<i64> = sqlx::query_scalar(statements::FINISH)
            .bind(tenant)
            .bind(key)
            .bind(token)
            .bind("complete")
            .bind(i64::from(response.status))
            .bind(serde_json::to_string(&response.headers)?)
            .bind(response.body.as_slice())
            .fetch_optional(&mut *connection)
            .await?;
        crate::raw::wrote_the_row("finish", key, u64::from(finished.is_some()))?;
        sqlx::query("COMMIT").execute(&mut *connection).await?;
        Ok(())
    }
}

/// A replay's read: the engine's look-up, or the raw select of the same row.
async fn look_up(pool: &SqlitePool, side: Side, tenant: &TenantId, key: &str) -> Result<(), Error> {
    let key = Key::parse(key)?;
    let mut connection = pool.acquire().await?;
    match side {
        Side::Engine => {
            let idemflow_sqlite::LookUp::Found(found) =
                idemflow_sqlite::look_up(&mut connection, tenant, &key).await?
            else {
                return Err("a finished key is missing".into());
            };
            if !found.done {
                return Err("a finished key is started".into());
            }
        }
        Side::Raw => {
            // The engine's own statement, its row read as it comes.
            let row = sqlx::query(statements::LOOK_UP)
                .bind(tenant.as_str())
                .bind(key.as_str())
                .fetch_optional(&mut *connection)
                .await?;
            if row.is_none() {
                return Err("a finished key is missing".into());
            }
        }
    }
    Ok(())
}

/// Engine ÷ raw for each operation on SQLite, judged at the largest client count it ran (the
/// single writer holds both sides there), and the several processes at the most processes: ≥ 1.0×
/// for the runner's requests (checkout, one local phase, replay, and both over HTTP), ≥ 0.9× for
/// the store's own and the processes.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let runs = &report.sqlite;
    let mut operations: Vec<&str> = Vec::new();
    for run in runs {
        let judged_by = if run.operation.ends_with("-processes") {
            "processes"
        } else {
            run.operation.as_str()
        };
        if !operations.contains(&judged_by) {
            operations.push(judged_by);
        }
    }
    for operation in operations {
        let judged = runs
            .iter()
            .filter(|run| {
                run.operation == operation
                    || (operation == "processes" && run.operation.ends_with("-processes"))
            })
            .max_by_key(|run| run.clients);
        if let Some(run) = judged {
            targets.push(Target::ratio(
                format!("13 sqlite {} @{}: engine ÷ raw", run.operation, run.clients),
                (run.raw_per_second > 0.0).then(|| run.engine_per_second / run.raw_per_second),
                if RUNNER_OPERATIONS.contains(&operation) {
                    crate::report::AT_LEAST_RAW
                } else {
                    0.9
                },
            ));
        }
    }
}

/// The runner's operations, judged against [`crate::report::AT_LEAST_RAW`].
const RUNNER_OPERATIONS: [&str; 5] = [
    "checkout",
    "local-only",
    "run-replay",
    "http-checkout",
    "http-replay",
];

fn section(report: &Report, out: &mut String) {
    if report.sqlite.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nsqlite (13): one file, WAL, synchronous = FULL; per second, engine vs raw sqlx. \
         The store: request (claim, one phase, finish, one write transaction) and replay \
         (the look-up), the same statements; the runner: checkout, local-only and \
         run-replay (Runner<SqliteStore>) and http-checkout, http-replay (WorkflowService) \
         vs what a hand-written service sends"
    );
    engine_rows(out, &report.sqlite);
}
