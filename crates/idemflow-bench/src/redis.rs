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
//!
//! The cluster rows, where a Redis Cluster is given (`--redis-cluster-urls`, else
//! `REDIS_CLUSTER_URLS`): `new` and `replay` at the same client counts on `Runner<RedisStore>` on
//! the cluster and on the single node, alternating in quarters, the single node the baseline. With
//! no cluster given the bench starts none: the report says the cluster rows were not run.

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
    /// The Redis Cluster of the cluster rows (its primaries, its Redis version); `None` when
    /// they were not run.
    pub cluster_server: Option<String>,
    /// The cluster rows: one per operation of [`CLUSTER_OPERATIONS`] and client count; empty
    /// when not run.
    pub cluster: Vec<ClusterRun>,
    /// Why the cluster rows were not run.
    pub cluster_not_run: Option<String>,
}

/// One operation at one client count on the Redis Cluster and on the single node, alternating.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterRun {
    pub operation: String,
    pub clients: usize,
    /// The single node (`--redis-url`): the baseline.
    pub single_per_second: f64,
    pub cluster_per_second: f64,
}

impl ClusterRun {
    /// Cluster ÷ single node.
    pub fn ratio(&self) -> Option<f64> {
        (self.single_per_second > 0.0).then(|| self.cluster_per_second / self.single_per_second)
    }
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
/// The operations of the cluster rows.
pub const CLUSTER_OPERATIONS: [&str; 2] = ["new", "replay"];
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

/// Timed runs that take turns on two sides, each at its own keys.
struct Turns<'a> {
    client: &'a reqwest::Client,
    duration: Duration,
    offset: u64,
}

impl Turns<'_> {
    /// Requests per second of `operation` by `clients` clients on `a` and on `b`, alternating in
    /// quarters of the duration (a, b, a, b), so drift over the run falls on both alike.
    async fn per_second<A: Engine, B: Engine>(
        &mut self,
        (a, b): (&Arc<Side<A>>, &Arc<Side<B>>),
        operation: &'static str,
        clients: usize,
    ) -> Result<(f64, f64), Error> {
        let quarter = self.duration / 4;
        let (mut on_a, mut on_b) = (0, 0);
        for _ in 0..2 {
            on_a += timed(a, self.client, operation, clients, quarter, self.offset).await?;
            on_b += timed(b, self.client, operation, clients, quarter, self.offset).await?;
            self.offset += 1 << 32;
        }
        let seconds = (quarter * 2).as_secs_f64();
        Ok((on_a as f64 / seconds, on_b as f64 / seconds))
    }
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

/// Measures on the Redis at `config.redis_url` and, where one is given, on the Redis Cluster at
/// `config.redis_cluster_urls` (under a prefix of their own, deleted before and after), and on the
/// scratch PostgreSQL database.
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
    let server = version(&redis).await?;
    let cluster = match &config.redis_cluster_urls {
        Some(urls) => {
            let pool = RedisPool::connect_with_prefix(urls, &prefix)
                .await
                .map_err(|error| {
                    format!(
                        "no Redis Cluster at {urls} ({error}): --redis-cluster-urls or \
                         REDIS_CLUSTER_URLS names one (scripts/lib/redis-cluster.sh starts one)"
                    )
                })?;
            if !pool.is_cluster() {
                return Err(format!("{urls} is one Redis, not a Redis Cluster").into());
            }
            Some(pool)
        }
        None => None,
    };
    let mut cluster_server = None;
    for pool in std::iter::once(&redis).chain(&cluster) {
        delete_prefix(pool).await?;
    }
    if let Some(pool) = &cluster {
        cluster_server = Some(format!(
            "{} primaries, Redis {}",
            pool.primaries().await?.len(),
            version(pool).await?
        ));
    }
    let result = measure(config, scratch, &redis, cluster.as_ref()).await;
    for pool in std::iter::once(&redis).chain(&cluster) {
        delete_prefix(pool).await?;
    }
    let mut report = result?;
    report.server = server;
    report.cluster_server = cluster_server;
    if cluster.is_none() {
        report.cluster_not_run = Some(
            "no Redis Cluster given (--redis-cluster-urls, REDIS_CLUSTER_URLS): the bench \
             starts none; scripts/lib/redis-cluster.sh does"
                .to_owned(),
        );
    }
    Ok(report)
}

/// The Redis version of `pool`'s (first) primary.
async fn version(pool: &RedisPool) -> Result<String, Error> {
    let mut primaries = pool.primaries().await?;
    let Some((_, connection)) = primaries.first_mut() else {
        return Ok("unknown".to_owned());
    };
    let info: String = idemflow_redis::redis::cmd("INFO")
        .arg("server")
        .query_async(connection)
        .await?;
    Ok(info
        .lines()
        .find_map(|line| line.strip_prefix("redis_version:"))
        .unwrap_or("unknown")
        .trim()
        .to_owned())
}

/// Deletes every Redis key under `pool`'s prefix, on every primary (`SCAN` answers for one node),
/// a key at a time (a cluster refuses a `DEL` of keys in several slots).
async fn delete_prefix(pool: &RedisPool) -> Result<(), Error> {
    for (_, mut connection) in pool.primaries().await? {
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
                let mut pipeline = idemflow_redis::redis::pipe();
                for key in &keys {
                    pipeline.cmd("DEL").arg(key).ignore();
                }
                let () = pipeline.query_async(&mut connection).await?;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(())
}

async fn measure(
    config: &Config,
    scratch: &Scratch,
    redis: &RedisPool,
    cluster: Option<&RedisPool>,
) -> Result<RedisBeside, Error> {
    let most = config.clients.iter().copied().max().unwrap_or(1);
    let postgres = scratch.pool(most.max(config.storm_clients) + 8).await?;
    idemflow::migrate(&postgres).await?;
    let on_redis = Arc::new(Side::<RedisStore>::new("redis", redis.clone()).await?);
    let on_postgres = Arc::new(Side::<PgStore>::new("postgres", postgres.clone()).await?);
    let mut on_cluster = None;
    if let Some(pool) = cluster {
        on_cluster = Some(Arc::new(
            Side::<RedisStore>::new("cluster", pool.clone()).await?,
        ));
    }
    for index in 0..REPLAY_KEYS {
        let key = format!("pay-replay-{index}");
        on_redis.run(&key).await?;
        on_postgres.run(&key).await?;
        if let Some(on_cluster) = &on_cluster {
            on_cluster.run(&key).await?;
        }
    }
    let client = http::client(most)?;
    let mut report = RedisBeside::default();
    let mut turns = Turns {
        client: &client,
        duration: config.duration,
        offset: 0,
    };
    for &clients in &config.clients {
        for operation in OPERATIONS {
            let (redis_per_second, postgres_per_second) = turns
                .per_second((&on_redis, &on_postgres), operation, clients)
                .await?;
            report.runs.push(SideBySide {
                operation: operation.to_owned(),
                clients,
                redis_per_second,
                postgres_per_second,
            });
        }
        let Some(on_cluster) = &on_cluster else {
            continue;
        };
        for operation in CLUSTER_OPERATIONS {
            let (single_per_second, cluster_per_second) = turns
                .per_second((&on_redis, on_cluster), operation, clients)
                .await?;
            report.cluster.push(ClusterRun {
                operation: operation.to_owned(),
                clients,
                single_per_second,
                cluster_per_second,
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
    cluster_section(redis, out);
}

/// The cluster rows against the single node, or why they were not run.
fn cluster_section(redis: &RedisBeside, out: &mut String) {
    let Some(cluster) = &redis.cluster_server else {
        let _ = writeln!(
            out,
            "\nredis cluster (15): not run: {}",
            redis
                .cluster_not_run
                .as_deref()
                .unwrap_or("no cluster given")
        );
        return;
    };
    let _ = writeln!(
        out,
        "\nredis cluster (15): a Redis Cluster ({cluster}) against the single node (Redis {}, the \
         baseline), the same workflow, alternating in quarters; per second; ratio = cluster ÷ \
         single node",
        redis.server
    );
    let _ = writeln!(
        out,
        "  {:<10} {:>7} {:>12} {:>12} {:>8}",
        "operation", "clients", "single", "cluster", "ratio"
    );
    for run in &redis.cluster {
        let _ = writeln!(
            out,
            "  {:<10} {:>7} {:>12.0} {:>12.0} {:>8}",
            run.operation,
            run.clients,
            run.single_per_second,
            run.cluster_per_second,
            run.ratio()
                .map_or("-".to_owned(), |ratio| format!("{ratio:.2}×")),
        );
    }
}
