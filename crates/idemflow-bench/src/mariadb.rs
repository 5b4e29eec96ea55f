//! The mariadb workload: the engine on MariaDB (`Runner<MySqlStore>`, the checkout and one-phase
//! workflows of the checkout, local-only and replay workloads with their local phases in MySQL's
//! SQL) beside raw sqlx on MariaDB sending the statements a hand-written service would (the
//! engine's own claim, advance and finish, no look-up before a new key's claim, no savepoint), on
//! a scratch database of its own: checkout, local-only, run-replay, and through HTTP (the http
//! workload's route and a hand-written handler), at each client count, engine and raw alternating
//! in halves of the run.
//!
//! Then a storm of duplicates (each round, new keys sent by many clients at once, every copy at
//! the same moment) through both, counting what clients were answered and InnoDB's deadlocks;
//! and each operation's commits and round trips, counted on the wire
//! (`idemflow_testrig::wire::mysql`).

use std::fmt::Write as _;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing;
use idemflow::{Key, MySqlConnection, MySqlStore, Outcome, Runner, Workflow};
use idemflow_mysql::statements::{self, FENCES_PER_LIFE};
use idemflow_testrig::checkout::{self as reference, Orders};
use serde::Serialize;
use sqlx::mysql::{MySqlConnectOptions, MySqlDatabaseError, MySqlSslMode};
use sqlx::{Connection, Executor, MySqlPool};

use crate::Error;
use crate::config::Config;
use crate::http::{self, Server};
use crate::report::{EngineRun, Report, Target, engine_rows};
use crate::wire_counts::{self, WireCount};
use crate::workflows::{CHECKOUT, PATH, PLACE, TENANT, fingerprint_and_request, request, tenant};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "mariadb",
    number: Some(14),
    measures: "the MariaDB engine vs raw sqlx on MariaDB (a server at --mariadb-url)",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        report.mariadb = Some(on_a_scratch_database(ctx.config).await?);
        Ok(())
    })
}

/// What the mariadb workload measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct MariaDb {
    /// The server's version string.
    pub server: String,
    /// One row per operation and client count.
    pub runs: Vec<EngineRun>,
    /// The storm of duplicates, engine and raw.
    pub storm: Vec<StormRun>,
    /// Commits and round trips per request on the wire, engine and raw.
    pub wire: Vec<WireCount>,
}

/// A storm of duplicates on one side.
#[derive(Debug, Clone, Serialize)]
pub struct StormRun {
    /// `engine` or `raw`.
    pub side: String,
    pub clients: usize,
    pub keys_per_round: usize,
    pub rounds: usize,
    /// Copies answered per second (every copy of every round).
    pub per_second: f64,
    /// How the copies were answered.
    pub executed: u64,
    pub replayed: u64,
    pub in_progress: u64,
    /// Answered with an error: a deadlock, a lock wait timeout or anything else a client would
    /// see as a 500 or 503.
    pub failed: u64,
    /// Of those, the ones that were a deadlock (1213) reaching the client.
    pub deadlocks_seen_by_clients: u64,
    /// InnoDB's own count of deadlocks while this side ran (`Innodb_deadlocks`).
    pub deadlocks: u64,
}

use idemflow_testrig::checkout::mysql::{MARK_PAID, ORDERS_TABLE as ORDERS};
const SELECT_RESPONSE: &str = "SELECT response_status, response_headers, response_body \
     FROM idempotency_keys WHERE tenant = ? AND `key` = ? AND state = 'done'";
const LEASE_MS: i64 = 60_000;
const REPLAY_KEYS: u64 = 1_000;
/// MySQL's error numbers the raw side answers: another claim committed first, and a deadlock.
const DUPLICATE_KEY: u16 = 1062;
const DEADLOCK: u16 = 1213;

fn checkout() -> Result<Workflow<MySqlStore>, Error> {
    Ok(reference::checkout::<MySqlStore>(None)?)
}

fn place() -> Result<Workflow<MySqlStore>, Error> {
    Ok(reference::place::<MySqlStore>()?)
}

/// What the raw requests store, fixed: the engine computes these per request.
#[derive(Debug, Clone)]
struct Shape {
    fingerprint: Vec<u8>,
    request: String,
}

const HEADERS: &str = r#"[["content-type","application/json"]]"#;

/// MySQL's error number of a database error.
fn error_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(error) => error
            .try_downcast_ref::<MySqlDatabaseError>()
            .map(MySqlDatabaseError::number),
        _ => None,
    }
}

/// The raw claim in an open transaction: the engine's insert; its token.
async fn raw_claim(
    connection: &mut MySqlConnection,
    shape: &Shape,
    workflow: &str,
    key: &str,
) -> Result<i64, sqlx::Error> {
    let done = sqlx::query(statements::CLAIM)
        .bind(TENANT)
        .bind(key)
        .bind(shape.fingerprint.as_slice())
        .bind(workflow)
        .bind(&shape.request)
        .bind(LEASE_MS)
        .execute(connection)
        .await?;
    let life = i64::try_from(done.last_insert_id()).unwrap_or(i64::MAX / FENCES_PER_LIFE);
    Ok(life * FENCES_PER_LIFE)
}

async fn raw_finish(
    connection: &mut MySqlConnection,
    key: &str,
    token: i64,
    point: &str,
    body: &str,
) -> Result<(), Error> {
    let updated = sqlx::query(statements::FINISH)
        .bind(201_i64)
        .bind(point)
        .bind(201_i64)
        .bind(HEADERS)
        .bind(body.as_bytes())
        .bind(false)
        .bind(TENANT)
        .bind(key)
        .bind(token)
        .execute(connection)
        .await?
        .rows_affected();
    if updated != 1 {
        return Err(format!("raw finish of {key} updated {updated} rows").into());
    }
    Ok(())
}

/// Raw checkout: BEGIN, claim, order, advance, COMMIT; (the charge); BEGIN, order update, finish,
/// COMMIT. Returns the body stored.
async fn raw_checkout(pool: &MySqlPool, shape: &Shape, key: &str) -> Result<String, Error> {
    let mut connection = pool.acquire().await?;
    let mut transaction = connection.begin().await?;
    let token = raw_claim(&mut transaction, shape, CHECKOUT, key).await?;
    let order_id = MySqlStore::insert_order(&mut transaction, TENANT, key, 100).await?;
    let output = serde_json::json!({"order_id": order_id, "amount": 100, "source": "tok_visa"});
    let advanced = sqlx::query(statements::ADVANCE)
        .bind("create_order")
        .bind("create_order")
        .bind(output.to_string())
        .bind(LEASE_MS)
        .bind(TENANT)
        .bind(key)
        .bind(token)
        .execute(&mut *transaction)
        .await?;
    crate::raw::wrote_the_row("advance", key, advanced.rows_affected())?;
    transaction.commit().await?;

    let mut transaction = connection.begin().await?;
    sqlx::query(MARK_PAID)
        .bind("paid")
        .bind("attempt-1")
        .bind(order_id)
        .execute(&mut *transaction)
        .await?;
    let body = format!(r#"{{"charge_id":"ch_{order_id}","order_id":{order_id},"status":"paid"}}"#);
    raw_finish(&mut transaction, key, token, "mark_paid", &body).await?;
    transaction.commit().await?;
    Ok(body)
}

/// What a raw one-phase request did.
enum RawPlaced {
    Executed,
    /// Another claim of the key committed first.
    Lost,
    /// Chosen as a deadlock's victim (its transaction is rolled back).
    Deadlocked,
}

/// Raw one-phase request: BEGIN, claim, order, finish, COMMIT.
async fn raw_place(pool: &MySqlPool, shape: &Shape, key: &str) -> Result<RawPlaced, Error> {
    let mut connection = pool.acquire().await?;
    let mut transaction = connection.begin().await?;
    let token = match raw_claim(&mut transaction, shape, PLACE, key).await {
        Ok(token) => token,
        Err(error) if error_number(&error) == Some(DUPLICATE_KEY) => {
            transaction.rollback().await?;
            return Ok(RawPlaced::Lost);
        }
        Err(error) if error_number(&error) == Some(DEADLOCK) => {
            transaction.rollback().await?;
            return Ok(RawPlaced::Deadlocked);
        }
        Err(error) => return Err(error.into()),
    };
    let order_id = MySqlStore::insert_order(&mut transaction, TENANT, key, 100).await?;
    let body = format!(r#"{{"order_id":{order_id},"status":"created"}}"#);
    raw_finish(&mut transaction, key, token, "place_order", &body).await?;
    transaction.commit().await?;
    Ok(RawPlaced::Executed)
}

type StoredRow = (i64, String, Vec<u8>);

async fn raw_stored(pool: &MySqlPool, key: &str) -> Result<Option<StoredRow>, Error> {
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

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Engine => "engine",
            Side::Raw => "raw",
        }
    }
}

/// What one measured operation needs.
struct Bench {
    pool: MySqlPool,
    shape: Shape,
    runner: Runner<MySqlStore>,
    checkout: Arc<Workflow<MySqlStore>>,
    place: Workflow<MySqlStore>,
    /// Keys are `<operation>-<prefix><n>`: the prefix keeps the counted runs' keys apart.
    prefix: String,
    next: AtomicU64,
    http_client: reqwest::Client,
    engine_url: String,
    raw_url: String,
}

impl Bench {
    fn new(pool: MySqlPool, shape: Shape, prefix: &str) -> Result<Self, Error> {
        Ok(Self {
            runner: Runner::new(pool.clone()),
            pool,
            shape,
            checkout: Arc::new(checkout()?),
            place: place()?,
            prefix: prefix.to_owned(),
            next: AtomicU64::new(0),
            http_client: http::client(1)?,
            engine_url: String::new(),
            raw_url: String::new(),
        })
    }

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
            ("local-only", Side::Raw) => {
                match raw_place(&self.pool, &self.shape, &fresh()).await? {
                    RawPlaced::Executed => Ok(()),
                    _ => Err("a raw request of a fresh key lost its claim".into()),
                }
            }
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

/// Measures on a scratch database on `config.mariadb_url`'s server, dropped at the end whatever
/// happens.
async fn on_a_scratch_database(config: &Config) -> Result<MariaDb, Error> {
    let name = format!("idemflow_bench_{}", std::process::id());
    let server_url = &config.mariadb_url;
    let mut server = sqlx::MySqlConnection::connect(server_url)
        .await
        .map_err(|error| {
            format!(
                "no MariaDB at {server_url} ({error}): the mariadb workload needs one \
                 (--mariadb-url or MARIADB_URL; scripts/bench checks for it), or leave it out \
                 with --only"
            )
        })?;
    let version: String = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&mut server)
        .await?;
    server
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS `{name}`"
        )))
        .await?;
    server
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{name}`")))
        .await?;
    let url = database_url(server_url, &name);
    let result = measure(config, &url).await;
    server
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS `{name}`"
        )))
        .await?;
    server.close().await?;
    let mut report = result?;
    report.server = version;
    Ok(report)
}

/// The server's URL with `database` in place of its own.
fn database_url(server: &str, database: &str) -> String {
    let (base, query) = server.split_once('?').unwrap_or((server, ""));
    let base = base
        .strip_prefix("mysql://")
        .and_then(|rest| rest.split_once('/').map(|(host, _)| host))
        .map_or_else(|| base.to_owned(), |host| format!("mysql://{host}"));
    if query.is_empty() {
        format!("{base}/{database}")
    } else {
        format!("{base}/{database}?{query}")
    }
}

async fn measure(config: &Config, url: &str) -> Result<MariaDb, Error> {
    let most = config.clients.iter().copied().max().unwrap_or(1);
    let pool = idemflow_mysql::open(
        url,
        &idemflow_mysql::OpenOptions::default()
            .with_max_connections(u32::try_from(most.max(config.storm_clients) + 8).unwrap_or(64)),
    )
    .await?;
    sqlx::query(ORDERS).execute(&pool).await?;
    let (fingerprint, canonical) = fingerprint_and_request()?;
    let shape = Shape {
        fingerprint: fingerprint.as_bytes().to_vec(),
        request: canonical.to_string(),
    };
    let mut bench = Bench::new(pool.clone(), shape.clone(), "")?;
    // Finished checkouts for the replays (the engine's and the raw HTTP handler's alike).
    for index in 0..REPLAY_KEYS {
        let key = Key::parse(&format!("replay-{index}"))?;
        let outcome = bench
            .runner
            .run(&bench.checkout, &tenant(), &key, request())
            .await?;
        expect_executed(&outcome)?;
    }
    let engine_server = http::serve(bench.runner.clone(), bench.checkout.clone()).await?;
    let raw_server = serve_raw(pool.clone(), shape.clone()).await?;
    bench.http_client = http::client(most)?;
    bench.engine_url = engine_server.url.clone();
    bench.raw_url = raw_server.url.clone();
    let bench = Arc::new(bench);

    let mut report = MariaDb::default();
    for &clients in &config.clients {
        for operation in OPERATIONS {
            let mut counts = [0_u64; 2];
            let half = config.duration / 2;
            for side in [Side::Engine, Side::Raw, Side::Engine, Side::Raw] {
                let done = timed(&bench, operation, side, clients, half / 2).await?;
                counts[usize::from(side == Side::Raw)] += done;
            }
            let seconds = half.as_secs_f64();
            report.runs.push(EngineRun {
                operation: operation.to_owned(),
                clients,
                engine_per_second: counts[0] as f64 / seconds,
                raw_per_second: counts[1] as f64 / seconds,
            });
        }
    }
    drop((engine_server, raw_server));

    for side in [Side::Engine, Side::Raw] {
        report.storm.push(storm(&bench, config, side).await?);
    }
    report.wire = wire(url, shape, config.wire_requests).await?;
    pool.close().await;
    Ok(report)
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

/// How one copy in a storm was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Executed,
    Replayed,
    InProgress,
    Failed { deadlock: bool },
}

/// One copy through the engine: the one-phase workflow.
async fn engine_copy(bench: &Bench, key: &str) -> Answer {
    let Ok(key) = Key::parse(key) else {
        return Answer::Failed { deadlock: false };
    };
    match bench
        .runner
        .run(&bench.place, &tenant(), &key, request())
        .await
    {
        Ok(Outcome::Executed(_)) => Answer::Executed,
        Ok(Outcome::Replayed(_)) => Answer::Replayed,
        Ok(Outcome::InProgress { .. }) => Answer::InProgress,
        Ok(_) => Answer::Failed { deadlock: false },
        Err(error) => Answer::Failed {
            deadlock: error.to_string().contains("1213") || error.to_string().contains("eadlock"),
        },
    }
}

/// One copy the way a hand-written service answers it: the stored response if there is one,
/// else the claim; a claim another committed first is answered from what it stored (409 while
/// it is not done), and a deadlock victim is tried again, up to three times, as the engine does.
async fn raw_copy(bench: &Bench, key: &str) -> Answer {
    let answer = async {
        if raw_stored(&bench.pool, key).await?.is_some() {
            return Ok::<_, Error>(Answer::Replayed);
        }
        for _ in 0..3 {
            match raw_place(&bench.pool, &bench.shape, key).await? {
                RawPlaced::Executed => return Ok(Answer::Executed),
                RawPlaced::Lost => {
                    return Ok(if raw_stored(&bench.pool, key).await?.is_some() {
                        Answer::Replayed
                    } else {
                        Answer::InProgress
                    });
                }
                RawPlaced::Deadlocked => {}
            }
        }
        Ok(Answer::Failed { deadlock: true })
    };
    answer.await.unwrap_or_else(|error| Answer::Failed {
        deadlock: error.to_string().contains("1213"),
    })
}

/// InnoDB's count of deadlocks since the server started.
async fn deadlocks(pool: &MySqlPool) -> Result<u64, Error> {
    let (_, value): (String, String) = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
        .fetch_one(pool)
        .await?;
    Ok(value.parse()?)
}

/// `config.storm_rounds` rounds of `config.storm_keys` new keys, each round's copies sent by
/// `config.storm_clients` clients released at once (copy `i` is key `i % keys`).
async fn storm(bench: &Arc<Bench>, config: &Config, side: Side) -> Result<StormRun, Error> {
    let (clients, keys) = (config.storm_clients, config.storm_keys.max(1));
    let deadlocks_before = deadlocks(&bench.pool).await?;
    let mut answers = Vec::new();
    let mut elapsed = Duration::ZERO;
    for round in 0..config.storm_rounds {
        let barrier = Arc::new(tokio::sync::Barrier::new(clients));
        let mut tasks = tokio::task::JoinSet::new();
        for copy in 0..clients {
            let (bench, barrier) = (Arc::clone(bench), barrier.clone());
            let key = format!("storm-{}-{round}-{}", side.name(), copy % keys);
            tasks.spawn(async move {
                barrier.wait().await;
                match side {
                    Side::Engine => engine_copy(&bench, &key).await,
                    Side::Raw => raw_copy(&bench, &key).await,
                }
            });
        }
        let started = Instant::now();
        while let Some(answer) = tasks.join_next().await {
            answers.push(answer?);
        }
        elapsed += started.elapsed();
    }
    let count = |wanted: fn(&Answer) -> bool| answers.iter().filter(|a| wanted(a)).count() as u64;
    Ok(StormRun {
        side: side.name().to_owned(),
        clients,
        keys_per_round: keys,
        rounds: config.storm_rounds,
        per_second: answers.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        executed: count(|answer| *answer == Answer::Executed),
        replayed: count(|answer| *answer == Answer::Replayed),
        in_progress: count(|answer| *answer == Answer::InProgress),
        failed: count(|answer| matches!(answer, Answer::Failed { .. })),
        deadlocks_seen_by_clients: count(|answer| *answer == Answer::Failed { deadlock: true }),
        deadlocks: deadlocks(&bench.pool).await? - deadlocks_before,
    })
}

/// Each operation's commits and round trips on the wire: a pool of one connection through the
/// counting proxy, no ping before acquire, no TLS (the proxy reads the packets).
async fn wire(url: &str, shape: Shape, requests: u64) -> Result<Vec<WireCount>, Error> {
    let connect = MySqlConnectOptions::from_str(url)?;
    let upstream = tokio::net::lookup_host((connect.get_host(), connect.get_port()))
        .await?
        .next()
        .ok_or("the MariaDB host resolves to no address")?;
    let (port, counts) = idemflow_testrig::wire::mysql::start_proxy(upstream).await;
    let pool = idemflow_mysql::pool_options(
        &idemflow_mysql::OpenOptions::default().with_max_connections(1),
    )
    .test_before_acquire(false)
    .connect_with(
        connect
            .host("127.0.0.1")
            .port(port)
            .ssl_mode(MySqlSslMode::Disabled),
    )
    .await?;
    let bench = Bench::new(pool.clone(), shape, "wire-")?;
    let mut wire = Vec::new();
    for (operation, expected) in [
        ("checkout", [Some((2, 8 + 2)), Some((2, 7 + 2))]),
        ("local-only", [Some((1, 5 + 1)), Some((1, 4 + 1))]),
        ("run-replay", [Some((0, 1)), Some((0, 1))]),
    ] {
        for (side, expected) in [Side::Engine, Side::Raw].into_iter().zip(expected) {
            let bench = &bench;
            wire.push(
                wire_counts::count(
                    &counts,
                    operation,
                    side.name(),
                    3,
                    requests,
                    expected,
                    |i| async move { bench.one(operation, side, 0, i).await },
                )
                .await?,
            );
        }
    }
    pool.close().await;
    Ok(wire)
}

/// The HTTP baseline on MariaDB: a hand-written axum handler (the key from its header, the body
/// parsed as JSON, the stored response by primary key, else the raw checkout).
async fn serve_raw(pool: MySqlPool, shape: Shape) -> Result<Server, Error> {
    let router = Router::new()
        .route(PATH, routing::post(raw_handler))
        .with_state(Arc::new((pool, shape)));
    http::serve_router(router).await
}

async fn raw_handler(
    State(state): State<Arc<(MySqlPool, Shape)>>,
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

/// Engine ÷ raw ≥ 1.0× for each operation at 8 and 32 clients (where this run measured them, else
/// at the largest count it ran), ≥ 0.9× in the storm of duplicates; no deadlock ever reaches a
/// client; the engine's wire counts are the documented ones.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let Some(mariadb) = &report.mariadb else {
        return;
    };
    for operation in OPERATIONS {
        let runs = || mariadb.runs.iter().filter(|run| run.operation == operation);
        let mut judged: Vec<_> = runs()
            .filter(|run| [8, 32].contains(&run.clients))
            .collect();
        if judged.is_empty() {
            judged.extend(runs().max_by_key(|run| run.clients));
        }
        for run in judged {
            targets.push(Target::ratio(
                format!("14 mariadb {operation} @{}: engine ÷ raw", run.clients),
                (run.raw_per_second > 0.0).then(|| run.engine_per_second / run.raw_per_second),
                crate::report::AT_LEAST_RAW,
            ));
        }
    }
    storm_targets(mariadb, targets);
    wire_target(mariadb, targets);
}

fn storm_targets(mariadb: &MariaDb, targets: &mut Vec<Target>) {
    let side = |name: &str| mariadb.storm.iter().find(|run| run.side == name);
    let (Some(engine), Some(raw)) = (side("engine"), side("raw")) else {
        return;
    };
    targets.push(Target::ratio(
        format!("14 mariadb storm @{}: engine ÷ raw", engine.clients),
        (raw.per_second > 0.0).then(|| engine.per_second / raw.per_second),
        0.9,
    ));
    targets.push(Target {
        name: "14 mariadb storm: failures clients saw (engine)".to_owned(),
        measured: format!(
            "{} ({} deadlocks; InnoDB counted {})",
            engine.failed, engine.deadlocks_seen_by_clients, engine.deadlocks
        ),
        target: "0".to_owned(),
        met: Some(engine.failed == 0),
    });
}

fn wire_target(mariadb: &MariaDb, targets: &mut Vec<Target>) {
    let engine_wire: Vec<_> = mariadb
        .wire
        .iter()
        .filter(|count| count.variant == "engine")
        .collect();
    if engine_wire.is_empty() {
        return;
    }
    targets.push(Target {
        name: "14 mariadb wire: commits and round trips as documented".to_owned(),
        measured: engine_wire
            .iter()
            .map(|count| {
                format!(
                    "{} {:.0}/{:.0}",
                    count.workload, count.commits_per_request, count.round_trips_per_request
                )
            })
            .collect::<Vec<_>>()
            .join(", "),
        target: "2/10, 1/6, 0/1".to_owned(),
        met: Some(engine_wire.iter().all(|count| count.as_documented())),
    });
}

/// Engine vs raw per operation, the storm, the wire counts.
fn section(report: &Report, out: &mut String) {
    let Some(mariadb) = &report.mariadb else {
        return;
    };
    let _ = writeln!(
        out,
        "\nmariadb (14): {}, READ COMMITTED; per second, engine vs raw sqlx with the same \
         statements: checkout, local-only and run-replay (Runner<MySqlStore>), http-checkout and \
         http-replay (WorkflowService) vs what a hand-written service sends",
        mariadb.server
    );
    engine_rows(out, &mariadb.runs);
    for storm in &mariadb.storm {
        let _ = writeln!(
            out,
            "  storm {:<6} {} clients on {} keys × {} rounds: {:>6.0} copies/s; executed {}, \
             replayed {}, 409 {}, failed {} (deadlocks seen {}); InnoDB deadlocks {}",
            storm.side,
            storm.clients,
            storm.keys_per_round,
            storm.rounds,
            storm.per_second,
            storm.executed,
            storm.replayed,
            storm.in_progress,
            storm.failed,
            storm.deadlocks_seen_by_clients,
            storm.deadlocks
        );
    }
    for count in &mariadb.wire {
        let _ = writeln!(
            out,
            "  wire  {:<11} {:<6}: {:.2} commits, {:.2} round trips, {:.2} pings per request{}",
            count.workload,
            count.variant,
            count.commits_per_request,
            count.round_trips_per_request,
            count.pings_per_request,
            if count.as_documented() {
                ""
            } else {
                " (NOT as documented)"
            }
        );
    }
}

#[cfg(test)]
mod tests {
    use super::database_url;

    #[test]
    fn the_scratch_database_replaces_the_urls_own() {
        assert_eq!(
            database_url("mysql://root@127.0.0.1:3306/test", "scratch"),
            "mysql://root@127.0.0.1:3306/scratch"
        );
        assert_eq!(
            database_url("mysql://root@127.0.0.1:3306", "scratch"),
            "mysql://root@127.0.0.1:3306/scratch"
        );
        assert_eq!(
            database_url("mysql://u:p@db/test?ssl-mode=disabled", "scratch"),
            "mysql://u:p@db/scratch?ssl-mode=disabled"
        );
    }
}
