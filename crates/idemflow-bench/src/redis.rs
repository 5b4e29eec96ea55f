//! The redis workload: the Redis engine beside PostgreSQL, in one run and on one machine: what the
//! lever buys. The same foreign-only workflow (one foreign phase that answers at once: no provider,
//! so what is measured is the engine and its store) runs on `Runner<RedisStore>` and on
//! `Runner<PgStore>` (the scratch database), alternating in halves of the run:
//!
//! - `new`: a new key each request (look-up, claim, the phase, finish);
//! - `replay`: a finished key each request (the look-up answers);
//! - `http-new`: the plain-handler layer (`IdempotencyLayer`) on a real server, a new key each
//!   request.
//!
//! Then a storm of duplicates on each (new keys each round, every copy sent at once), counting what
//! the copies were answered; and Redis's commands per request (`INFO stats`, one client).

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing;
use idemflow::{
    DerivedKey, Engine, ForeignPhase, Key, Outcome, PgStore, PhaseContext, PhaseError, PoolOf,
    Runner, RunnerConfig, StoredResponse, Workflow,
};
use idemflow_http::{BearerTenant, IdempotencyLayer};
use idemflow_redis::RedisPool;
use idemflow_redis::RedisStore;
use serde::Serialize;

use crate::Error;
use crate::config::Config;
use crate::db::Scratch;
use crate::http::{self, Server};
use crate::report::{Report, Target};
use crate::workflows::{PATH, request, tenant};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "redis",
    number: Some(15),
    measures: "the Redis engine beside PostgreSQL (a server at --redis-url)",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        report.redis = Some(beside_postgres(ctx.config, ctx.scratch).await?);
        Ok(())
    })
}

/// What the redis workload measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RedisBeside {
    /// The Redis server's version.
    pub server: String,
    /// One row per operation and client count.
    pub runs: Vec<SideBySide>,
    /// The storm of duplicates on each engine.
    pub storm: Vec<StormRun>,
    /// Round trips to Redis per request, by operation (one client): scripts run (`EVALSHA`) and
    /// bodies read apart (`GET`), the only commands the engine sends on a request's path.
    pub round_trips: Vec<(String, f64)>,
    /// Commands Redis ran per request, by operation, those inside the scripts included.
    pub commands: Vec<(String, f64)>,
}

/// One operation at one client count on both engines.
#[derive(Debug, Clone, Serialize)]
pub struct SideBySide {
    pub operation: String,
    pub clients: usize,
    pub redis_per_second: f64,
    pub postgres_per_second: f64,
}

impl SideBySide {
    /// Redis ÷ PostgreSQL.
    pub fn ratio(&self) -> Option<f64> {
        (self.postgres_per_second > 0.0).then(|| self.redis_per_second / self.postgres_per_second)
    }
}

/// A storm of duplicates on one engine.
#[derive(Debug, Clone, Serialize)]
pub struct StormRun {
    /// `redis` or `postgres`.
    pub engine: String,
    pub clients: usize,
    pub keys_per_round: usize,
    pub rounds: usize,
    /// Copies answered per second.
    pub per_second: f64,
    pub executed: u64,
    pub replayed: u64,
    pub in_progress: u64,
    /// Answered with an error (a 500 or 503 to a client).
    pub failed: u64,
}

/// The operations, in the order of the report.
pub const OPERATIONS: [&str; 3] = ["new", "replay", "http-new"];
const REPLAY_KEYS: u64 = 1_000;

/// Answers at once: the engine's own cost is what is measured.
struct Pay;

#[async_trait::async_trait]
impl ForeignPhase for Pay {
    const NAME: &'static str = "pay";
    type Input = serde_json::Value;
    type Output = StoredResponse;

    async fn call(
        &self,
        key: &DerivedKey,
        _request: serde_json::Value,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        Ok(StoredResponse::new(
            201,
            format!(r#"{{"charge":"ch_{}"}}"#, key.as_str().len()),
        ))
    }
}

/// One engine's side: its runner, workflow and plain-handler server.
struct Side<E: Engine> {
    name: &'static str,
    runner: Runner<E>,
    workflow: Arc<Workflow<E>>,
    server: Server,
}

impl<E: Engine> Side<E> {
    async fn new(name: &'static str, pool: PoolOf<E>) -> Result<Self, Error> {
        let runner = Runner::<E>::on(pool, RunnerConfig::default());
        let workflow = Arc::new(
            Workflow::<E>::builder_on::<serde_json::Value>("pay.v1")
                .foreign(Pay)
                .build()?,
        );
        let layer = IdempotencyLayer::new(runner.clone(), "pay-http.v1", BearerTenant)?;
        let router = Router::new()
            .route(
                PATH,
                routing::post(|| async { (axum::http::StatusCode::CREATED, "{\"ok\":true}") }),
            )
            .route_layer(layer);
        let server = http::serve_router(router).await?;
        Ok(Self {
            name,
            runner,
            workflow,
            server,
        })
    }

    async fn run(&self, key: &str) -> Result<Outcome, Error> {
        let key = Key::parse(key)?;
        Ok(self
            .runner
            .run(&self.workflow, &tenant(), &key, request())
            .await?)
    }

    async fn one(
        &self,
        client: &reqwest::Client,
        operation: &str,
        client_index: usize,
        sequence: u64,
    ) -> Result<(), Error> {
        match operation {
            "new" => {
                let outcome = self
                    .run(&format!("new-{}-{client_index}-{sequence}", self.name))
                    .await?;
                if !matches!(outcome, Outcome::Executed(_)) {
                    return Err(format!("a new key was answered {outcome:?}").into());
                }
            }
            "replay" => {
                let index = (client_index as u64 * 7919 + sequence) % REPLAY_KEYS;
                let outcome = self.run(&format!("pay-replay-{index}")).await?;
                if !matches!(outcome, Outcome::Replayed(_)) {
                    return Err(format!(
                        "on {}, finished key pay-replay-{index} was answered {outcome:?}",
                        self.name
                    )
                    .into());
                }
            }
            _ => {
                let response = client
                    .post(&self.server.url)
                    .header("authorization", "Bearer bench")
                    .header(
                        "idempotency-key",
                        format!("\"http-{}-{client_index}-{sequence}\"", self.name),
                    )
                    .body("{\"amount\":1200}")
                    .send()
                    .await?;
                if response.status() != 201 {
                    return Err(format!("the layer answered {}", response.status()).into());
                }
                response.bytes().await?;
            }
        }
        Ok(())
    }
}

/// Requests done by `clients` clients for `duration`.
async fn timed<E: Engine>(
    side: &Arc<Side<E>>,
    client: &reqwest::Client,
    operation: &'static str,
    clients: usize,
    duration: Duration,
    offset: u64,
) -> Result<u64, Error> {
    let until = Instant::now() + duration;
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..clients {
        let (side, client) = (Arc::clone(side), client.clone());
        tasks.spawn(async move {
            let mut done = 0_u64;
            while Instant::now() < until {
                side.one(&client, operation, index, offset + done).await?;
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

/// `config.storm_rounds` rounds of `config.storm_keys` new keys, each round's copies sent by
/// `config.storm_clients` clients released at once.
async fn storm<E: Engine>(side: &Arc<Side<E>>, config: &Config) -> Result<StormRun, Error> {
    let (clients, keys) = (config.storm_clients, config.storm_keys.max(1));
    let mut answers = Vec::new();
    let mut elapsed = Duration::ZERO;
    for round in 0..config.storm_rounds {
        let barrier = Arc::new(tokio::sync::Barrier::new(clients));
        let mut tasks = tokio::task::JoinSet::new();
        for copy in 0..clients {
            let (side, barrier) = (Arc::clone(side), barrier.clone());
            let key = format!("storm-{}-{round}-{}", side.name, copy % keys);
            tasks.spawn(async move {
                barrier.wait().await;
                side.run(&key).await.ok()
            });
        }
        let started = Instant::now();
        while let Some(answer) = tasks.join_next().await {
            answers.push(answer?);
        }
        elapsed += started.elapsed();
    }
    let count = |wanted: fn(&Option<Outcome>) -> bool| {
        answers.iter().filter(|answer| wanted(answer)).count() as u64
    };
    Ok(StormRun {
        engine: side.name.to_owned(),
        clients,
        keys_per_round: keys,
        rounds: config.storm_rounds,
        per_second: answers.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        executed: count(|answer| matches!(answer, Some(Outcome::Executed(_)))),
        replayed: count(|answer| matches!(answer, Some(Outcome::Replayed(_)))),
        in_progress: count(|answer| matches!(answer, Some(Outcome::InProgress { .. }))),
        failed: count(|answer| {
            !matches!(
                answer,
                Some(Outcome::Executed(_) | Outcome::Replayed(_) | Outcome::InProgress { .. })
            )
        }),
    })
}

/// Redis's counts since it started: commands processed (those inside scripts included), and the
/// calls of the commands a request sends itself (`EVALSHA`, `GET`: neither runs inside a script
/// of the engine's).
async fn counts(pool: &RedisPool) -> Result<(u64, u64), Error> {
    let info: String = idemflow_redis::redis::cmd("INFO")
        .arg("all")
        .query_async(&mut pool.connection())
        .await?;
    let field = |prefix: &str| -> u64 {
        info.lines()
            .find_map(|line| line.strip_prefix(prefix))
            .and_then(|rest| {
                let calls = rest.split(',').next()?;
                calls.trim_start_matches("calls=").trim().parse().ok()
            })
            .unwrap_or(0)
    };
    let processed = field("total_commands_processed:");
    let sent = field("cmdstat_evalsha:") + field("cmdstat_get:");
    Ok((processed, sent))
}

/// Round trips and commands per request of `operation`, one client, `requests` requests (the
/// `INFO` that reads the counts is not counted).
async fn per_request(
    side: &Arc<Side<RedisStore>>,
    pool: &RedisPool,
    client: &reqwest::Client,
    operation: &str,
    requests: u64,
) -> Result<(f64, f64), Error> {
    let (processed_before, sent_before) = counts(pool).await?;
    for sequence in 0..requests {
        side.one(client, operation, 9_999, (1 << 40) + sequence)
            .await?;
    }
    let (processed_after, sent_after) = counts(pool).await?;
    let requests = requests.max(1) as f64;
    Ok((
        (sent_after - sent_before) as f64 / requests,
        (processed_after - processed_before).saturating_sub(1) as f64 / requests,
    ))
}

/// Measures on the Redis at `config.redis_url` (under a prefix of its own, deleted before and
/// after) and on the scratch PostgreSQL database.
async fn beside_postgres(config: &Config, scratch: &Scratch) -> Result<RedisBeside, Error> {
    let prefix = format!("idemflow-bench-{}", std::process::id());
    let redis = RedisPool::connect_with_prefix(&config.redis_url, &prefix)
        .await
        .map_err(|error| {
            format!(
                "no Redis at {} ({error}): the redis workload needs one (--redis-url or \
                 REDIS_URL), or leave it out with --only",
                config.redis_url
            )
        })?;
    let info: String = idemflow_redis::redis::cmd("INFO")
        .arg("server")
        .query_async(&mut redis.connection())
        .await?;
    let server = info
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned();
    delete_prefix(&redis).await?;
    let result = measure(config, scratch, &redis).await;
    delete_prefix(&redis).await?;
    let mut report = result?;
    report.server = server;
    Ok(report)
}

async fn delete_prefix(pool: &RedisPool) -> Result<(), Error> {
    let mut connection = pool.connection();
    let mut cursor: u64 = 0;
    loop {
        let (next, keys): (u64, Vec<String>) = idemflow_redis::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{}:*", pool.prefix()))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connection)
            .await?;
        if !keys.is_empty() {
            let () = idemflow_redis::redis::cmd("DEL")
                .arg(&keys)
                .query_async(&mut connection)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

async fn measure(
    config: &Config,
    scratch: &Scratch,
    redis: &RedisPool,
) -> Result<RedisBeside, Error> {
    let most = config.clients.iter().copied().max().unwrap_or(1);
    let postgres = scratch.pool(most.max(config.storm_clients) + 8).await?;
    idemflow::migrate(&postgres).await?;
    let on_redis = Arc::new(Side::<RedisStore>::new("redis", redis.clone()).await?);
    let on_postgres = Arc::new(Side::<PgStore>::new("postgres", postgres.clone()).await?);
    for index in 0..REPLAY_KEYS {
        let key = format!("pay-replay-{index}");
        on_redis.run(&key).await?;
        on_postgres.run(&key).await?;
    }
    let client = http::client(most)?;
    let mut report = RedisBeside::default();
    let mut offset = 0_u64;
    for &clients in &config.clients {
        for operation in OPERATIONS {
            let quarter = config.duration / 4;
            let (mut on_r, mut on_p) = (0, 0);
            for _ in 0..2 {
                on_r += timed(&on_redis, &client, operation, clients, quarter, offset).await?;
                on_p += timed(&on_postgres, &client, operation, clients, quarter, offset).await?;
                offset += 1 << 32;
            }
            let seconds = (quarter * 2).as_secs_f64();
            report.runs.push(SideBySide {
                operation: operation.to_owned(),
                clients,
                redis_per_second: on_r as f64 / seconds,
                postgres_per_second: on_p as f64 / seconds,
            });
        }
    }
    report.storm.push(storm(&on_redis, config).await?);
    report.storm.push(storm(&on_postgres, config).await?);
    for operation in OPERATIONS {
        let (round_trips, commands) =
            per_request(&on_redis, redis, &client, operation, config.wire_requests).await?;
        report.round_trips.push((operation.to_owned(), round_trips));
        report.commands.push((operation.to_owned(), commands));
    }
    postgres.close().await;
    Ok(report)
}

/// Redis faster than PostgreSQL for each operation and the storm at the largest client count,
/// and no copy in either storm answered with a failure.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let Some(redis) = &report.redis else {
        return;
    };
    let most = redis.runs.iter().map(|run| run.clients).max().unwrap_or(0);
    for run in redis.runs.iter().filter(|run| run.clients == most) {
        targets.push(Target::ratio(
            format!(
                "15 redis {} @{}: redis ÷ postgres",
                run.operation, run.clients
            ),
            run.ratio(),
            1.0,
        ));
    }
    let storm = |engine: &str| redis.storm.iter().find(|run| run.engine == engine);
    if let (Some(on_redis), Some(on_postgres)) = (storm("redis"), storm("postgres")) {
        targets.push(Target::ratio(
            format!("15 redis storm @{}: redis ÷ postgres", on_redis.clients),
            (on_postgres.per_second > 0.0).then(|| on_redis.per_second / on_postgres.per_second),
            1.0,
        ));
    }
    let failed: u64 = redis.storm.iter().map(|run| run.failed).sum();
    targets.push(Target {
        name: "15 redis storm: failures clients saw".to_owned(),
        measured: failed.to_string(),
        target: "0".to_owned(),
        met: Some(failed == 0),
    });
}

/// Redis beside PostgreSQL per operation, the storms, the round trips to Redis.
fn section(report: &Report, out: &mut String) {
    let Some(redis) = &report.redis else {
        return;
    };
    let _ = writeln!(
        out,
        "\nredis (15): Redis {} beside PostgreSQL, the same foreign-only workflow (one phase that \
         answers at once) and plain-handler layer; per second",
        redis.server
    );
    let _ = writeln!(
        out,
        "  {:<10} {:>7} {:>12} {:>12} {:>8}",
        "operation", "clients", "redis", "postgres", "ratio"
    );
    for run in &redis.runs {
        let _ = writeln!(
            out,
            "  {:<10} {:>7} {:>12.0} {:>12.0} {:>8}",
            run.operation,
            run.clients,
            run.redis_per_second,
            run.postgres_per_second,
            run.ratio()
                .map_or("-".to_owned(), |ratio| format!("{ratio:.2}×")),
        );
    }
    for storm in &redis.storm {
        let _ = writeln!(
            out,
            "  storm on {:<8} {} clients, {} keys a round, {} rounds: {:.0} copies/s; executed {}, \
             replayed {}, in progress {}, failed {}",
            storm.engine,
            storm.clients,
            storm.keys_per_round,
            storm.rounds,
            storm.per_second,
            storm.executed,
            storm.replayed,
            storm.in_progress,
            storm.failed
        );
    }
    for ((operation, round_trips), (_, commands)) in redis.round_trips.iter().zip(&redis.commands) {
        let _ = writeln!(
            out,
            "  per {operation} request: {round_trips:.2} round trips to Redis, {commands:.2} \
             commands run there (inside the scripts included)"
        );
    }
}
