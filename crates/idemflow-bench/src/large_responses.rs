//! The large-responses workload: bodies in the key's row or apart
//! (`RunnerConfig::response_apart_above`).
//! For each body size (1 KiB, 64 KiB, 1 MiB) and each placement, in turn on the same tables: the
//! keys are executed through the engine (a one-phase workflow answering with a body of that
//! size), then measured: the bytes each key added to the keys table's heap, to its TOAST table
//! and to the table of bodies apart; replays per second through the engine against the raw select
//! of the same bytes, interleaved; and the time retention takes per key to delete them.

use idemflow::PgStore;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::{
    Key, LocalPhase, Outcome, PgConnection, PhaseContext, PhaseError, Runner, RunnerConfig,
    StoredResponse, TenantId, Workflow,
};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::Error;
use crate::config::Config;
use crate::report::{LargeResponse, Report};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "large-responses",
    number: Some(10),
    measures: "bodies of 1 KiB to 1 MiB in the row or apart: table bytes, replays, retention",
    runs: Runs::Once(run),
    targets: None,
    section: Some(section),
};

const WORKFLOW: &str = "large-response.v1";
const CLIENTS: usize = 8;
const BATCH: i64 = 500;

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Ask {
    bytes: usize,
}

/// Answers with `bytes` bytes that do not compress (a PDF or an image, say): what TOAST can do
/// with them is move them, not shrink them.
struct Render;

#[async_trait::async_trait]
impl LocalPhase<PgStore> for Render {
    const NAME: &'static str = "render";
    type Input = Ask;
    type Output = StoredResponse;

    async fn run(
        &self,
        _: &mut PgConnection,
        ask: Ask,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        Ok(StoredResponse::new(200, incompressible(ask.bytes)))
    }
}

/// Bytes from a xorshift generator: no compressor finds much in them.
fn incompressible(bytes: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    (0..bytes)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

fn workflow() -> Result<Workflow<PgStore>, Error> {
    Ok(Workflow::builder::<Ask>(WORKFLOW).local(Render).build()?)
}

/// The sizes measured and how many keys of each (fewer of the large ones: the run stays short).
fn sizes(config: &Config) -> Vec<(usize, u64)> {
    if config.quick {
        vec![(1 << 10, 40), (64 << 10, 10), (1 << 20, 4)]
    } else {
        vec![(1 << 10, 4000), (64 << 10, 1000), (1 << 20, 100)]
    }
}

/// Relation sizes in bytes, in `schema`: the keys heap, its TOAST table, and the bodies apart
/// (heap, TOAST and index).
async fn sizes_now(pool: &PgPool, schema: &str) -> Result<(i64, i64, i64), Error> {
    Ok(sqlx::query_as(
        "SELECT pg_relation_size(c.oid), \
                coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0), \
                pg_total_relation_size(format('%I.idempotency_responses', $1)::regclass) \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = 'idempotency_keys'",
    )
    .bind(schema)
    .fetch_one(pool)
    .await?)
}

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let prefix = ctx.prefix("large");
        let workflow = Arc::new(workflow()?);
        for (bytes, keys) in sizes(ctx.config) {
            for apart in [false, true] {
                let variant = Variant {
                    bytes,
                    keys,
                    apart,
                    prefix: &prefix,
                };
                let measured = variant.measure(ctx, &workflow).await?;
                report.large_responses.push(measured);
            }
        }
        Ok(())
    })
}

/// One body size in one placement.
struct Variant<'a> {
    bytes: usize,
    keys: u64,
    apart: bool,
    prefix: &'a str,
}

impl Variant<'_> {
    fn place(&self) -> &'static str {
        if self.apart { "apart" } else { "row" }
    }

    /// Each variant in fresh tables of its own (a schema first on the search path), so the sizes
    /// are what its keys took, not space another variant freed.
    async fn measure(
        &self,
        ctx: &Ctx<'_>,
        workflow: &Arc<Workflow<PgStore>>,
    ) -> Result<LargeResponse, Error> {
        let schema = format!("large_{}_{}", self.bytes, self.place());
        ctx.scratch
            .execute(&format!("CREATE SCHEMA {schema}"))
            .await?;
        let connect = ctx
            .scratch
            .connect
            .clone()
            .options([("search_path", schema.as_str())]);
        let pool = PgPoolOptions::new()
            .max_connections(u32::try_from(CLIENTS + 2)?)
            .test_before_acquire(false)
            .connect_with(connect)
            .await?;
        idemflow::migrate(&pool).await?;
        let runner = Runner::with_config(
            pool.clone(),
            RunnerConfig::default().with_response_apart_above(if self.apart {
                0
            } else {
                usize::MAX
            }),
        );
        let engine = Engine {
            runner,
            workflow: workflow.clone(),
            tenant: ctx.tenant.clone(),
            body: serde_json::to_vec(&Ask { bytes: self.bytes })?,
        };
        let names: Vec<String> = (0..self.keys)
            .map(|i| format!("{}-{}-{}-{i}", self.prefix, self.bytes, self.place()))
            .collect();
        let result = self.measured(ctx, &pool, &schema, &engine, &names).await;
        pool.close().await;
        ctx.scratch
            .execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await?;
        result
    }

    /// The keys executed, then the bytes they took, replays against the raw select, retention.
    async fn measured(
        &self,
        ctx: &Ctx<'_>,
        pool: &PgPool,
        schema: &str,
        engine: &Engine,
        names: &[String],
    ) -> Result<LargeResponse, Error> {
        let duration = if ctx.config.quick {
            Duration::from_millis(300)
        } else {
            Duration::from_secs(3)
        };
        let before = sizes_now(pool, schema).await?;
        execute(engine, names).await?;
        let after = sizes_now(pool, schema).await?;
        let per_key = |from: i64, to: i64| (to - from) as f64 / self.keys as f64;
        let replays_per_second = replays(duration, names, engine.replay(self.bytes)).await?;
        let raw = replays(
            duration,
            names,
            raw_select(pool, &ctx.tenant, self.bytes, self.apart),
        )
        .await?;
        Ok(LargeResponse {
            body_bytes: self.bytes,
            apart: self.apart,
            keys: self.keys,
            heap_bytes_per_key: per_key(before.0, after.0),
            toast_bytes_per_key: per_key(before.1, after.1),
            apart_bytes_per_key: per_key(before.2, after.2),
            replays_per_second,
            raw_selects_per_second: raw,
            retention_micros_per_key: retention_micros_per_key(pool, self.keys).await?,
        })
    }
}

/// What the variant's requests run: the runner, the workflow, the tenant, the request's body.
#[derive(Clone)]
struct Engine {
    runner: Runner<PgStore>,
    workflow: Arc<Workflow<PgStore>>,
    tenant: TenantId,
    body: Vec<u8>,
}

impl Engine {
    async fn send(&self, name: &str) -> Result<Outcome, Error> {
        let key = Key::parse(name)?;
        let request = idemflow::Request {
            method: "POST",
            path: "/v1/reports",
            body: &self.body,
        };
        Ok(self
            .runner
            .run(&self.workflow, &self.tenant, &key, request)
            .await?)
    }

    /// A replay that must answer `bytes` bytes.
    fn replay(
        &self,
        bytes: usize,
    ) -> impl Fn(String) -> BoxFuture<'static, ()> + Clone + Send + 'static {
        let engine = self.clone();
        move |name: String| {
            let engine = engine.clone();
            Box::pin(async move {
                match engine.send(&name).await? {
                    Outcome::Replayed(response) if response.body.len() == bytes => Ok(()),
                    other => Err(format!("{name}: {other:?}").into()),
                }
            })
        }
    }
}

/// Executes every key through the engine, [`CLIENTS`] at a time.
async fn execute(engine: &Engine, names: &[String]) -> Result<(), Error> {
    for chunk in names.chunks(CLIENTS) {
        let mut tasks = tokio::task::JoinSet::new();
        for name in chunk {
            let (engine, name) = (engine.clone(), name.clone());
            tasks.spawn(async move {
                match engine.send(&name).await? {
                    Outcome::Executed(_) => Ok::<(), Error>(()),
                    other => Err(format!("{name}: {other:?}").into()),
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done??;
        }
    }
    Ok(())
}

/// The raw baseline's read of a body of `bytes` bytes, from the row or from the table apart.
fn raw_select(
    pool: &PgPool,
    tenant: &TenantId,
    bytes: usize,
    apart: bool,
) -> impl Fn(String) -> BoxFuture<'static, ()> + Clone + Send + 'static {
    let (pool, tenant) = (pool.clone(), tenant.to_string());
    move |name: String| {
        let (pool, tenant) = (pool.clone(), tenant.clone());
        Box::pin(async move {
            let body: Option<Vec<u8>> = sqlx::query_scalar(if apart { RAW_APART } else { RAW_ROW })
                .bind(&tenant)
                .bind(&name)
                .fetch_optional(&pool)
                .await?;
            match body {
                Some(body) if body.len() == bytes => Ok(()),
                other => Err(format!("{name}: {:?} bytes", other.map(|b| b.len())).into()),
            }
        })
    }
}

/// Retention's time per key: the variant's keys made old, then deleted in batches of
/// [`BATCH`], back to back; their bodies apart must go with them.
async fn retention_micros_per_key(pool: &PgPool, keys: u64) -> Result<f64, Error> {
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = now() - interval '2 days' \
         WHERE workflow = $1",
    )
    .bind(WORKFLOW)
    .execute(pool)
    .await?;
    let began = Instant::now();
    let expired = idemflow::expire(pool, Duration::from_secs(86_400), BATCH).await?;
    let retention = began.elapsed();
    if expired != keys {
        return Err(format!("retention deleted {expired} of {keys} keys").into());
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_responses")
        .fetch_one(pool)
        .await?;
    if left != 0 {
        return Err(format!("{left} bodies apart outlived their keys").into());
    }
    Ok(retention.as_secs_f64() * 1e6 / keys as f64)
}

/// The raw baselines: the body by primary key, from the row or from the table of bodies apart.
const RAW_ROW: &str = "SELECT response_body FROM idempotency_keys WHERE tenant = $1 AND key = $2";
const RAW_APART: &str = "SELECT body FROM idempotency_responses WHERE tenant = $1 AND key = $2";

/// Requests per second of `op` over the keys in turn, from [`CLIENTS`] clients, for `duration`.
async fn replays<F, Fut>(duration: Duration, names: &[String], op: F) -> Result<f64, Error>
where
    F: Fn(String) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), Error>> + Send,
{
    let names = Arc::new(names.to_vec());
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..CLIENTS {
        let (names, op) = (names.clone(), op.clone());
        tasks.spawn(async move {
            let mut done = 0u64;
            let mut next = client;
            while began.elapsed() < duration {
                op(names[next % names.len()].clone()).await?;
                next += CLIENTS;
                done += 1;
            }
            Ok::<u64, Error>(done)
        });
    }
    let mut total = 0;
    while let Some(done) = tasks.join_next().await {
        total += done??;
    }
    Ok(total as f64 / began.elapsed().as_secs_f64())
}

fn section(report: &Report, out: &mut String) {
    if report.large_responses.is_empty() {
        return;
    }
    let _ = writeln!(
        out,
        "\nlarge responses (10): bytes per key added to the keys heap / its TOAST / the \
         bodies apart; replays/s (8 clients) engine vs raw select of the same bytes; retention µs per key"
    );
    for row in &report.large_responses {
        let _ = writeln!(
            out,
            "  {:>8} B {:<6} {:>5} keys: heap {:>7.0}  toast {:>8.0}  apart {:>8.0}   \
             replays {:>7.0}/s  raw {:>7.0}/s  ({:.2}×)   retention {:>6.1} µs/key",
            row.body_bytes,
            if row.apart { "apart" } else { "in row" },
            row.keys,
            row.heap_bytes_per_key,
            row.toast_bytes_per_key,
            row.apart_bytes_per_key,
            row.replays_per_second,
            row.raw_selects_per_second,
            row.replays_per_second / row.raw_selects_per_second,
            row.retention_micros_per_key
        );
    }
}
