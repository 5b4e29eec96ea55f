//! The sqlite workload, the runner's part: the engine on SQLite (`Runner<SqliteStore>`, the same
//! checkout and one-phase workflows as the checkout, local-only and replay workloads, their local
//! phases in SQLite's SQL) beside raw sqlx on SQLite sending the statements a hand-written service
//! would, on one database file; and through HTTP (the http workload's route and hand-written
//! handler, on SQLite). Engine and raw alternate in halves of the run, as in the store's part
//! (`sqlite.rs`).
//!
//! Statements per request (read off the code, SQLite has no wire to count): a checkout, engine 13
//! (look-up; BEGIN IMMEDIATE, exists, fence, claim, savepoint, order, advance, COMMIT; BEGIN
//! IMMEDIATE, order, finish, COMMIT) vs raw 11 (no look-up, no savepoint); one local phase, engine
//! 9 vs raw 7; a replay, 1 and 1. Two write transactions a checkout, one a local-only request, on
//! both sides.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing;
use idemflow::{Key, Outcome, Runner, SqliteConnection, SqliteStore, Workflow};
use idemflow_sqlite::statements;
use idemflow_testrig::checkout as reference;
use sqlx::SqlitePool;

use crate::Error;
use crate::http::{self, Server};
use crate::report::EngineRun;
use crate::workflows::{CHECKOUT, PATH, PLACE, TENANT, fingerprint_and_request, request, tenant};

use idemflow_testrig::checkout::sqlite::{INSERT_ORDER, MARK_PAID, ORDERS_TABLE as ORDERS};

const SELECT_RESPONSE: &str = "SELECT response_status, response_headers, response_body \
     FROM idempotency_keys WHERE tenant = ?1 AND key = ?2";
const LEASE_MS: i64 = 60_000;
const REPLAY_KEYS: u64 = 1_000;

fn checkout() -> Result<Workflow<SqliteStore>, Error> {
    Ok(reference::checkout::<SqliteStore>(None)?)
}

fn place() -> Result<Workflow<SqliteStore>, Error> {
    Ok(reference::place::<SqliteStore>()?)
}

/// What the raw requests store, fixed: the engine computes these per request.
#[derive(Debug, Clone)]
struct Shape {
    fingerprint: Vec<u8>,
    request: String,
}

fn headers() -> String {
    r#"[["content-type","application/json"]]"#.to_owned()
}

/// The raw claim in an open write transaction: its token.
async fn raw_claim(
    connection: &mut SqliteConnection,
    shape: &Shape,
    workflow: &str,
    key: &str,
) -> Result<i64, Error> {
    let exists = sqlx::query(statements::EXISTS)
        .bind(TENANT)
        .bind(key)
        .fetch_optional(&mut *connection)
        .await?;
    if exists.is_some() {
        return Err(format!("raw claim of a fresh key {key} found it taken").into());
    }
    let token: i64 = sqlx::query_scalar(statements::NEXT_FENCE)
        .fetch_one(&mut *connection)
        .await?;
    sqlx::query(statements::CLAIM)
        .bind(TENANT)
        .bind(key)
        .bind(shape.fingerprint.as_slice())
        .bind(workflow)
        .bind(&shape.request)
        .bind(LEASE_MS)
        .bind(token)
        // The holder: this claim never asks the row whether it committed (docs/engines.md).
        .bind(1_i64)
        .execute(&mut *connection)
        .await?;
    Ok(token)
}

async fn raw_finish(
    connection: &mut SqliteConnection,
    key: &str,
    token: i64,
    point: &str,
    body: &str,
) -> Result<(), Error> {
    let finished: Option<i64> = sqlx::query_scalar(statements::FINISH)
        .bind(TENANT)
        .bind(key)
        .bind(token)
        .bind(point)
        .bind(201_i64)
        .bind(headers())
        .bind(body.as_bytes())
        .fetch_optional(connection)
        .await?;
    crate::raw::wrote_the_row("finish", key, u64::from(finished.is_some()))
}

/// Raw checkout: BEGIN IMMEDIATE, claim, order, advance, COMMIT; (no-op); BEGIN IMMEDIATE, order
/// update, finish, COMMIT. Returns the body stored.
async fn raw_checkout(pool: &SqlitePool, shape: &Shape, key: &str) -> Result<String, Error> {
    let mut connection = pool.acquire().await?;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut *connection)
        .await?;
    let token = raw_claim(&mut connection, shape, CHECKOUT, key).await?;
    let order_id: i64 = sqlx::query_scalar(INSERT_ORDER)
        .bind(TENANT)
        .bind(key)
        .bind(100_i64)
        .fetch_one(&mut *connection)
        .await?;
    let output = serde_json::json!({"order_id": order_id, "amount": 100, "source": "tok_visa"});
    let advanced = sqlx::query(statements::ADVANCE)
        .bind(TENANT)
        .bind(key)
        .bind(token)
        .bind("create_order")
        .bind(output.to_string())
        .bind(LEASE_MS)
        .execute(&mut *connection)
        .await?;
    crate::raw::wrote_the_row("advance", key, advanced.rows_affected())?;
    sqlx::query("COMMIT").execute(&mut *connection).await?;

    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut *connection)
        .await?;
    sqlx::query(MARK_PAID)
        .bind(order_id)
        .bind("paid")
        .bind("attempt-1")
        .execute(&mut *connection)
        .await?;
    let body = format!(r#"{{"charge_id":"ch_{order_id}","order_id":{order_id},"status":"paid"}}"#);
    raw_finish(&mut connection, key, token, "mark_paid", &body).await?;
    sqlx::query("COMMIT").execute(&mut *connection).await?;
    Ok(body)
}

/// Raw one-phase request: BEGIN IMMEDIATE, claim, order, finish, COMMIT.
async fn raw_place(pool: &SqlitePool, shape: &Shape, key: &str) -> Result<(), Error> {
    let mut connection = pool.acquire().await?;
    sqlx::query("BEGIN IMMEDIATE")
        .execute(&mut *connection)
        .await?;
    let token = raw_claim(&mut connection, shape, PLACE, key).await?;
    let order_id: i64 = sqlx::query_scalar(INSERT_ORDER)
        .bind(TENANT)
        .bind(key)
        .bind(100_i64)
        .fetch_one(&mut *connection)
        .await?;
    let body = format!(r#"{{"order_id":{order_id},"status":"created"}}"#);
    raw_finish(&mut connection, key, token, "place_order", &body).await?;
    sqlx::query("COMMIT").execute(&mut *connection).await?;
    Ok(())
}

type StoredRow = (i64, String, Vec<u8>);

async fn raw_stored(pool: &SqlitePool, key: &str) -> Result<Option<StoredRow>, Error> {
    Ok(sqlx::query_as(SELECT_RESPONSE)
        .bind(TENANT)
        .bind(key)
        .fetch_optional(pool)
        .await?)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Engine,
    Raw,
}

/// What one measured operation needs.
struct Bench {
    pool: SqlitePool,
    shape: Shape,
    runner: Runner<SqliteStore>,
    checkout: Arc<Workflow<SqliteStore>>,
    place: Workflow<SqliteStore>,
    /// Keys are `<operation>-<prefix><n>`: the prefix names the process, so processes sharing the
    /// file never draw one key twice.
    prefix: String,
    next: AtomicU64,
    http_client: reqwest::Client,
    engine_url: String,
    raw_url: String,
}

impl Bench {
    async fn one(&self, operation: &str, side: Side, client: u64, round: u64) -> Result<(), Error> {
        let fresh = || {
            let n = self.next.fetch_add(1, Ordering::Relaxed);
            format!("{operation}-{}{n}", self.prefix)
        };
        let replay_key = || format!("replay-{}", (client * 7 + round) % REPLAY_KEYS);
        match (operation, side) {
            ("checkout", Side::Engine) => {
                let key = Key::parse(&fresh())?;
                let outcome = self
                    .runner
                    .run(&self.checkout, &tenant(), &key, request())
                    .await?;
                expect_executed(&outcome)
            }
            ("checkout", Side::Raw) => raw_checkout(&self.pool, &self.shape, &fresh())
                .await
                .map(drop),
            ("local-only", Side::Engine) => {
                let key = Key::parse(&fresh())?;
                let outcome = self
                    .runner
                    .run(&self.place, &tenant(), &key, request())
                    .await?;
                expect_executed(&outcome)
            }
            ("local-only", Side::Raw) => raw_place(&self.pool, &self.shape, &fresh()).await,
            ("run-replay", Side::Engine) => {
                let key = Key::parse(&replay_key())?;
                match self
                    .runner
                    .run(&self.checkout, &tenant(), &key, request())
                    .await?
                {
                    Outcome::Replayed(_) => Ok(()),
                    other => Err(format!("a replay was {other:?}").into()),
                }
            }
            ("run-replay", Side::Raw) => match raw_stored(&self.pool, &replay_key()).await? {
                Some((201, _, _)) => Ok(()),
                other => Err(format!("raw replay: {other:?}").into()),
            },
            ("http-checkout", side) => {
                let url = self.url(side);
                http::post(&self.http_client, url, &fresh(), false).await
            }
            ("http-replay", side) => {
                let url = self.url(side);
                http::post(&self.http_client, url, &replay_key(), true).await
            }
            (other, _) => Err(format!("no operation {other}").into()),
        }
    }

    fn url(&self, side: Side) -> &str {
        match side {
            Side::Engine => &self.engine_url,
            Side::Raw => &self.raw_url,
        }
    }
}

fn expect_executed(outcome: &Outcome) -> Result<(), Error> {
    match outcome {
        Outcome::Executed(response) if response.status == 201 => Ok(()),
        other => Err(format!("a new request was {other:?}").into()),
    }
}

/// The operations measured, in order.
pub const OPERATIONS: [&str; 5] = [
    "checkout",
    "local-only",
    "run-replay",
    "http-checkout",
    "http-replay",
];

/// Runs every operation at each client count on `pool`'s file, engine and raw alternating.
pub async fn run(
    pool: &SqlitePool,
    clients: &[usize],
    duration: Duration,
) -> Result<Vec<EngineRun>, Error> {
    sqlx::query(ORDERS).execute(pool).await?;
    let (fingerprint, canonical) = fingerprint_and_request()?;
    let shape = Shape {
        fingerprint: fingerprint.as_bytes().to_vec(),
        request: canonical.to_string(),
    };
    let runner = Runner::new(pool.clone());
    let checkout = Arc::new(checkout()?);
    // Finished checkouts for the replays (the engine's and the raw HTTP handler's alike).
    for index in 0..REPLAY_KEYS {
        let key = Key::parse(&format!("replay-{index}"))?;
        let outcome = runner.run(&checkout, &tenant(), &key, request()).await?;
        expect_executed(&outcome)?;
    }
    let engine_server = http::serve(runner.clone(), checkout.clone()).await?;
    let raw_server = serve_raw(pool.clone(), shape.clone()).await?;
    let most = clients.iter().copied().max().unwrap_or(1);
    let bench = Arc::new(Bench {
        pool: pool.clone(),
        shape,
        runner,
        checkout,
        place: place()?,
        prefix: String::new(),
        next: AtomicU64::new(0),
        http_client: http::client(most)?,
        engine_url: engine_server.url.clone(),
        raw_url: raw_server.url.clone(),
    });
    let mut runs = Vec::new();
    for &clients in clients {
        for operation in OPERATIONS {
            let mut counts = [0_u64; 2];
            let half = duration / 2;
            for side in [Side::Engine, Side::Raw, Side::Engine, Side::Raw] {
                let done = timed(&bench, operation, side, clients, half / 2).await?;
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
    drop((engine_server, raw_server));
    Ok(runs)
}

async fn timed(
    bench: &Arc<Bench>,
    operation: &'static str,
    side: Side,
    clients: usize,
    duration: Duration,
) -> Result<u64, Error> {
    let until = Instant::now() + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let bench = Arc::clone(bench);
        tasks.spawn(async move {
            let mut done = 0_u64;
            while Instant::now() < until {
                bench.one(operation, side, client as u64, done).await?;
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

/// The HTTP baseline on SQLite: a hand-written axum handler (the key from its header, the body
/// parsed as JSON, the stored response by primary key, else the raw checkout).
async fn serve_raw(pool: SqlitePool, shape: Shape) -> Result<Server, Error> {
    let router = Router::new()
        .route(PATH, routing::post(raw_handler))
        .with_state(Arc::new((pool, shape)));
    http::serve_router(router).await
}

async fn raw_handler(
    State(state): State<Arc<(SqlitePool, Shape)>>,
    request_headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = match http::raw_key(&request_headers, &body) {
        Ok(key) => key,
        Err(why) => return http::bad_request(why),
    };
    let (pool, shape) = &*state;
    let answer = async {
        if let Some((status, _, body)) = raw_stored(pool, key).await? {
            return Ok::<_, Error>((true, status, body));
        }
        let body = raw_checkout(pool, shape, key).await?;
        Ok((false, 201, body.into_bytes()))
    };
    http::raw_answer(answer.await)
}

/// The environment variable that makes the bench binary a child process of the several-processes
/// measurement: `<file>|<engine or raw>|<seconds>|<clients>`.
pub const CHILD: &str = "IDEMFLOW_BENCH_SQLITE_CHILD";

/// Processes measured at once on one file.
pub const PROCESSES: [usize; 3] = [1, 2, 4];

/// Clients per process in the several-processes measurement.
const CLIENTS_PER_PROCESS: usize = 4;

/// A child process: checkouts on `side` for the given time on the file, the count printed.
pub async fn child(spec: &str) -> Result<u64, Error> {
    let parts: Vec<&str> = spec.split('|').collect();
    let [path, side, seconds, clients] = parts.as_slice() else {
        return Err(
            format!("{CHILD}: {spec}: want <file>|<engine|raw>|<seconds>|<clients>").into(),
        );
    };
    let side = if *side == "raw" {
        Side::Raw
    } else {
        Side::Engine
    };
    let pool = idemflow_sqlite::open_file(
        std::path::Path::new(path),
        &idemflow_sqlite::OpenOptions::default().with_max_connections(8),
    )
    .await?;
    let (fingerprint, canonical) = fingerprint_and_request()?;
    let bench = Arc::new(Bench {
        pool: pool.clone(),
        shape: Shape {
            fingerprint: fingerprint.as_bytes().to_vec(),
            request: canonical.to_string(),
        },
        runner: Runner::new(pool.clone()),
        checkout: Arc::new(checkout()?),
        place: place()?,
        prefix: format!("p{}-", std::process::id()),
        next: AtomicU64::new(0),
        http_client: http::client(1)?,
        engine_url: String::new(),
        raw_url: String::new(),
    });
    let duration = Duration::from_secs_f64(seconds.parse()?);
    let done = timed(&bench, "checkout", side, clients.parse()?, duration).await?;
    pool.close().await;
    Ok(done)
}

/// Several processes on one file: 1, 2 and 4 processes of [`CLIENTS_PER_PROCESS`] clients each
/// doing checkouts, the engine's and raw alternating; requests per second across all of them.
pub async fn processes(
    path: &std::path::Path,
    duration: Duration,
) -> Result<Vec<EngineRun>, Error> {
    let binary = std::env::current_exe()?;
    let mut runs = Vec::new();
    for processes in PROCESSES {
        let mut counts = [0_u64; 2];
        let quarter = duration / 4;
        for side in [Side::Engine, Side::Raw, Side::Engine, Side::Raw] {
            let name = if side == Side::Raw { "raw" } else { "engine" };
            let spec = format!(
                "{}|{name}|{}|{CLIENTS_PER_PROCESS}",
                path.display(),
                quarter.as_secs_f64()
            );
            let children: Vec<_> = (0..processes)
                .map(|_| {
                    std::process::Command::new(&binary)
                        .env(CHILD, &spec)
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::inherit())
                        .spawn()
                })
                .collect::<Result<_, _>>()?;
            for child in children {
                let output =
                    tokio::task::spawn_blocking(move || child.wait_with_output()).await??;
                if !output.status.success() {
                    return Err(format!("a bench child process failed: {}", output.status).into());
                }
                counts[usize::from(side == Side::Raw)] += String::from_utf8_lossy(&output.stdout)
                    .trim()
                    .parse::<u64>()?;
            }
        }
        let seconds = (duration / 2).as_secs_f64();
        runs.push(EngineRun {
            operation: format!("{processes}-processes"),
            clients: processes * CLIENTS_PER_PROCESS,
            engine_per_second: counts[0] as f64 / seconds,
            raw_per_second: counts[1] as f64 / seconds,
        });
    }
    Ok(runs)
}
