//! One request of the in-process workloads: through the engine (checkout or one local phase,
//! new or replayed) or as the raw baseline's statements, and under which key. The checkout,
//! local-only and replay workloads time them; the wire, storm, retention and partitioned-expiry
//! workloads send them too.

use idemflow::PgStore;
use std::cell::Cell;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::{Outcome, Runner, RunnerConfig, TenantId, Workflow};
use sqlx::PgPool;

use crate::Error;
use crate::raw::{self, Shape};
use crate::report::{CHECKOUT, ENGINE_HOOK, LOCAL_ONLY, RAW, REPLAY};
use crate::timed::{Op, Sample, timed};
use crate::workflows::{self, CLAIMED_AT, NeverCrash};
use crate::workloads::{BoxFuture, Ctx};

/// What an engine request runs: the runner, the workflow, the tenant.
#[derive(Clone)]
pub(crate) struct Engine {
    pub(crate) runner: Runner<PgStore>,
    pub(crate) workflow: Arc<Workflow<PgStore>>,
    pub(crate) tenant: TenantId,
}

/// One engine request; `Some(claim time)` when a first local phase ran.
pub(crate) async fn engine_request(
    engine: &Engine,
    key: &str,
    replay: bool,
) -> Result<Option<Duration>, Error> {
    let sent = Instant::now();
    CLAIMED_AT
        .scope(Cell::new(None), async {
            // Parsing the key is part of what a request costs the engine (an HTTP layer does it).
            let key = idemflow::Key::parse(key)?;
            let outcome = engine
                .runner
                .run(&engine.workflow, &engine.tenant, &key, workflows::request())
                .await?;
            match (&outcome, replay) {
                (Outcome::Executed(response), false) | (Outcome::Replayed(response), true)
                    if response.status == 201 => {}
                _ => return Err(format!("{key}: unexpected outcome {outcome:?}").into()),
            }
            Ok(CLAIMED_AT.with(Cell::get).map(|at| at - sent))
        })
        .await
}

/// Engine requests: replays of the seeded finished keys when `replay_keys` is given, else new
/// keys under `prefix`.
pub(crate) fn engine_op(engine: Engine, prefix: String, replay_keys: Option<u64>) -> Op {
    let engine = Arc::new(engine);
    Arc::new(move |client, sequence| {
        let engine = engine.clone();
        let key = match replay_keys {
            Some(keys) => replay_key(client, sequence, keys),
            None => fresh_key(&prefix, client, sequence),
        };
        Box::pin(async move { engine_request(&engine, &key, replay_keys.is_some()).await })
    })
}

/// A new request's key: random-looking first (idempotency keys are usually random UUIDs, so
/// each claim lands on a random leaf of the primary key, as pgbench's random keys do), then
/// readable.
pub(crate) fn fresh_key(prefix: &str, client: usize, sequence: u64) -> String {
    let mut hasher = std::hash::DefaultHasher::new();
    (prefix, client, sequence).hash(&mut hasher);
    format!("{:016x}-{prefix}-{client}-{sequence}", hasher.finish())
}

/// One of the `keys` seeded finished keys (`replay-0` …), spread over clients and sequence.
pub(crate) fn replay_key(client: usize, sequence: u64, keys: u64) -> String {
    let spread = (client as u64)
        .wrapping_mul(2_654_435_761)
        .wrapping_add(sequence.wrapping_mul(40_503));
    format!("replay-{}", spread % keys.max(1))
}

/// The runner a variant runs: `hook` installed for the hook's.
pub(crate) fn runner_for(
    variant: &str,
    pool: PgPool,
    hook: Arc<dyn idemflow::CrashHook>,
) -> Runner<PgStore> {
    let runner = Runner::with_config(pool, RunnerConfig::default());
    if variant == ENGINE_HOOK {
        runner.with_crash_hook(hook)
    } else {
        runner
    }
}

/// The workflow of an in-process workload: one local phase for local-only, else the checkout.
pub(crate) fn workflow_for(workload: &str) -> Result<Workflow<PgStore>, Error> {
    match workload {
        LOCAL_ONLY => workflows::place(),
        _ => workflows::checkout(None),
    }
}

/// The raw baseline's requests: the same statements as the engine's, sent by plain sqlx code.
fn raw_op(pool: PgPool, shape: Shape, workload: &'static str, prefix: String, keys: u64) -> Op {
    let shared = Arc::new((pool, shape));
    Arc::new(move |client, sequence| {
        let shared = shared.clone();
        let key = match workload {
            REPLAY => replay_key(client, sequence, keys),
            _ => fresh_key(&prefix, client, sequence),
        };
        Box::pin(async move {
            let (pool, shape) = &*shared;
            match workload {
                CHECKOUT => raw::checkout(pool, shape, &key).await?,
                LOCAL_ONLY => raw::place(pool, shape, &key).await?,
                _ => raw::replay(pool, &key).await?,
            }
            Ok(None)
        })
    })
}

/// A timed sample of an in-process workload: the raw baseline for [`RAW`], else the engine.
pub(crate) fn sample<'a>(
    ctx: &'a Ctx<'a>,
    workload: &'static str,
    variant: &'static str,
    clients: usize,
    duration: Duration,
) -> BoxFuture<'a, Sample> {
    Box::pin(async move {
        let mark = ctx.scratch.mark().await?;
        let pool = ctx.scratch.pool(clients).await?;
        let op = if variant == RAW {
            raw_op(
                pool.clone(),
                ctx.shape.clone(),
                workload,
                ctx.prefix(&format!("raw-{workload}")),
                ctx.config.replay_keys,
            )
        } else {
            let engine = Engine {
                runner: runner_for(variant, pool.clone(), Arc::new(NeverCrash)),
                workflow: Arc::new(workflow_for(workload)?),
                tenant: ctx.tenant.clone(),
            };
            let replay = (workload == REPLAY).then_some(ctx.config.replay_keys);
            engine_op(engine, ctx.prefix(workload), replay)
        };
        timed(ctx, clients, duration, pool, mark, op).await
    })
}
