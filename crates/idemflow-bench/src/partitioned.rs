//! The partitioned-expiry workload (`idemflow::postgres::partitions`). Every variant runs in a schema
//! of its own (first on the search path, as the large-responses workload does), created, measured
//! and dropped in turn, so no variant inherits another's bloat or free space.
//!
//! 1. **Expiry.** `keys` finished keys, created over the day partition wholly past the 24-hour
//!    window (finished when created), are expired by the worker's retention as configured by
//!    default (`Retention::default().expire`): on the partitioned layout (the default plan:
//!    partitions of a day, one ahead; 4 live) it drops the partition; unpartitioned it deletes
//!    in batches of 500 at most 20,000 rows/s. Unpartitioned also flat out (`idemflow::expire`,
//!    batches of 500 back to back), for the time. Meanwhile 8 clients send new one-local-phase
//!    requests through the engine; their claim latency during the expiry is compared with the
//!    same load just before it. Afterwards, with every backend gone (so its statistics are
//!    published): the dead tuples of the keys table and its partitions (`n_dead_tup`), the rows
//!    the load updated and the rows deleted one by one (`n_tup_upd`, `n_tup_del`), the size of
//!    the whole tree, and the time a manual `VACUUM` of the keys table takes: the work the expiry
//!    left to autovacuum.
//!    Autovacuum is off on the keys table's heaps for this part (`autovacuum_enabled = false`), so
//!    those figures are what the expiry left, not what autovacuum happened to clean meanwhile.
//! 2. **The layout's cost.** The same finished keys in four schemas, unpartitioned and on 2, 8 and
//!    31 live partitions (1-hour partitions, one ahead, the keys spread over the rest): replays
//!    (the look-up of a done key) and new claims (one local phase) per second through
//!    `Runner::run`, at 32 clients, interleaved (A B C D D C B A, half the duration each).
//!
//! The bench writes the keys table directly only where the engine's statements are not what is
//! measured: seeding finished keys in bulk and reading the statistics and sizes of the table.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemflow::postgres::partitions::{self, PartitionPlan};
use idemflow::{Retention, Runner, TenantId};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

use crate::Error;
use crate::config::Config;
use crate::db::{Scratch, literal};
use crate::load::{Latencies, Measured, Until, closed_loop};
use crate::report::{self, Expiry, LayoutCost, PartitionedExpiry, Report, Run, Target, ms};
use crate::requests::{Engine, engine_request};
use crate::timed::run_row;
use crate::workflows::{self, ORDERS_TABLE};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "partitioned-expiry",
    number: Some(12),
    measures: "expiry by dropping partitions vs deleting, and the partitioned layout's cost",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

/// The retention window of part 1: keys finished longer ago than this expire.
const KEEP_FOR: Duration = Duration::from_secs(24 * 60 * 60);
/// The batch of the flat-out delete: `Retention`'s default batch, so only the pacing differs.
const UNPACED_BATCH: i64 = 500;
/// Part 2's partitions: one hour wide, one ahead of the current one.
const COST_WIDTH: Duration = Duration::from_secs(60 * 60);
const COST_AHEAD: u32 = 1;

/// How a variant of part 1 expires its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum How {
    /// `Retention::default().expire` on the partitioned layout: partitions dropped.
    Drop,
    /// `Retention::default().expire` unpartitioned: batches of 500, at most 20,000 rows/s.
    Paced,
    /// `idemflow::expire`, batches of 500 back to back.
    Unpaced,
}

impl How {
    fn describe(self) -> &'static str {
        match self {
            Self::Drop => "partitioned: Retention::default().expire (partitions dropped)",
            Self::Paced => {
                "unpartitioned: Retention::default().expire (500/batch, ≤ 20,000 rows/s)"
            }
            Self::Unpaced => "unpartitioned: idemflow::expire (500/batch, back to back)",
        }
    }

    fn schema(self) -> &'static str {
        match self {
            Self::Drop => "expiry_drop",
            Self::Paced => "expiry_paced",
            Self::Unpaced => "expiry_unpaced",
        }
    }
}

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let (config, scratch) = (ctx.config, ctx.scratch);
        let prefix = ctx.prefix("partitioned");
        let mut expiries = Vec::new();
        for how in [How::Unpaced, How::Paced, How::Drop] {
            expiries.push(expiry(config, scratch, &ctx.tenant, &prefix, how).await?);
        }
        let costs = layout_costs(config, scratch, &ctx.tenant, &prefix).await?;
        report.partitioned_expiry = Some(PartitionedExpiry {
            keys: config.partitioned_keys,
            clients: config.retention_clients,
            keep_for_hours: KEEP_FOR.as_secs_f64() / 3600.0,
            expiries,
            cost_clients: config.partitioned_clients,
            costs,
        });
        Ok(())
    })
}

// ------------------------------------------------------------------ schemas --

/// A pool of `size` connections whose search path starts with `schema`.
async fn schema_pool(scratch: &Scratch, schema: &str, size: usize) -> Result<PgPool, Error> {
    let connect = scratch.connect.clone().options([("search_path", schema)]);
    Ok(PgPoolOptions::new()
        .max_connections(u32::try_from(size.max(1))?)
        .test_before_acquire(false)
        .acquire_timeout(Duration::from_secs(60))
        .connect_with(connect)
        .await?)
}

/// Creates `schema` with the engine's tables (migrated) and the orders table.
async fn create_schema(scratch: &Scratch, schema: &str) -> Result<(), Error> {
    scratch
        .execute(&format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}"
        ))
        .await?;
    let pool = schema_pool(scratch, schema, 1).await?;
    idemflow::migrate(&pool).await?;
    sqlx::raw_sql(ORDERS_TABLE).execute(&pool).await?;
    pool.close().await;
    Ok(())
}

async fn execute(pool: &PgPool, sql: String) -> Result<u64, Error> {
    Ok(sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(pool)
        .await?
        .rows_affected())
}

/// Inserts finished one-phase keys `{name}{first..=last}` as the engine leaves them (the place
/// workflow's request and response), each created and finished at `at` (an SQL expression of
/// `g`, the key's number).
fn seed_sql(
    tenant: &TenantId,
    name: &str,
    first: u64,
    last: u64,
    at: &str,
) -> Result<String, Error> {
    let (fingerprint, request) = workflows::fingerprint_and_request()?;
    Ok(format!(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, state, \
             recovery_point, locked_until, response_status, response_headers, response_body, \
             created_at, updated_at, finished_at) \
         SELECT {tenant}, {name} || g, '\\x{fingerprint}'::bytea, {workflow}, {request}::jsonb, \
             'done', 'place_order', NULL, 201, '[[\"content-type\", \"application/json\"]]'::jsonb, \
             convert_to('{{\"order_id\":' || g || ',\"status\":\"created\"}}', 'UTF8'), \
             t.at, t.at, t.at \
         FROM generate_series({first}, {last}) AS g, LATERAL (SELECT {at} AS at) AS t",
        tenant = literal(tenant.as_str()),
        name = literal(name),
        fingerprint = idemflow::core::hex::encode(fingerprint.as_bytes()),
        workflow = literal(workflows::PLACE),
        request = literal(&request.to_string()),
    ))
}

/// Seeds `keys` keys in chunks (one transaction each), `at` as in [`seed_sql`].
async fn seed(
    pool: &PgPool,
    tenant: &TenantId,
    name: &str,
    keys: u64,
    at: &str,
) -> Result<(), Error> {
    let chunk = 250_000;
    let mut first = 1;
    while first <= keys {
        let last = (first + chunk - 1).min(keys);
        execute(pool, seed_sql(tenant, name, first, last, at)?).await?;
        first = last + 1;
    }
    Ok(())
}

/// The keys table's heaps: itself, or its partitions when partitioned (`pg_partition_tree` lists
/// nothing for a plain table).
const TREE: &str = "(SELECT relid FROM pg_partition_tree('idempotency_keys') WHERE isleaf \
                    UNION SELECT 'idempotency_keys'::regclass \
                    WHERE NOT EXISTS (SELECT FROM pg_partition_tree('idempotency_keys')))";

/// Bytes of the keys table, its partitions, their indexes and TOAST.
async fn tree_bytes(pool: &PgPool) -> Result<i64, Error> {
    Ok(sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint FROM {TREE} AS t"
    )))
    .fetch_one(pool)
    .await?)
}

/// What pg_stat_user_tables says of the keys table's heaps, summed over the tree.
#[derive(Debug, Clone, Copy, Default)]
struct TableStats {
    dead: i64,
    updated: i64,
    deleted: i64,
    autovacuums: i64,
}

async fn table_stats(pool: &PgPool) -> Result<TableStats, Error> {
    let (dead, updated, deleted, autovacuums): (i64, i64, i64, i64) =
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT coalesce(sum(s.n_dead_tup), 0)::bigint, coalesce(sum(s.n_tup_upd), 0)::bigint, \
                    coalesce(sum(s.n_tup_del), 0)::bigint, \
                    coalesce(sum(s.autovacuum_count), 0)::bigint \
             FROM {TREE} AS t JOIN pg_stat_user_tables AS s ON s.relid = t.relid"
        )))
        .fetch_one(pool)
        .await?;
    Ok(TableStats {
        dead,
        updated,
        deleted,
        autovacuums,
    })
}

/// Statistics as published once every client backend of the scratch database has exited
/// (PostgreSQL 15 publishes a backend's counters lazily, and at exit): the callers close their
/// pools first. `Scratch::xact_commit` waits for exactly that.
async fn settled_stats(scratch: &Scratch, schema: &str) -> Result<TableStats, Error> {
    scratch.xact_commit().await?;
    let pool = schema_pool(scratch, schema, 1).await?;
    let stats = table_stats(&pool).await;
    pool.close().await;
    stats
}

async fn partition_count(pool: &PgPool) -> Result<usize, Error> {
    let mut connection = pool.acquire().await?;
    if partitions::is_partitioned(&mut connection).await? {
        Ok(partitions::partitions(&mut connection).await?.len())
    } else {
        Ok(0)
    }
}

// ----------------------------------------------------------------- requests --

/// The engine running the local-only workload's one-local-phase workflow for `tenant`.
fn engine(pool: &PgPool, tenant: &TenantId) -> Result<Engine, Error> {
    Ok(Engine {
        runner: Runner::new(pool.clone()),
        workflow: Arc::new(workflows::place()?),
        tenant: tenant.clone(),
    })
}

/// Closed-loop new requests (`{prefix}-{client}-{sequence}`) until `until`.
async fn claims(
    engine: &Engine,
    clients: usize,
    until: Until,
    prefix: &str,
) -> Result<Measured, Error> {
    let (engine, prefix) = (engine.clone(), prefix.to_owned());
    closed_loop(clients, until, move |client, sequence| {
        let engine = engine.clone();
        let key = format!("{prefix}-{client}-{sequence}");
        async move { engine_request(&engine, &key, false).await }
    })
    .await
}

/// Closed-loop replays of `replay-1` … `replay-{keys}` until `until`.
async fn replays(
    engine: &Engine,
    clients: usize,
    until: Until,
    keys: u64,
) -> Result<Measured, Error> {
    let engine = engine.clone();
    closed_loop(clients, until, move |client, sequence| {
        let engine = engine.clone();
        let spread = (client as u64)
            .wrapping_mul(2_654_435_761)
            .wrapping_add(sequence.wrapping_mul(40_503));
        let key = format!("replay-{}", spread % keys.max(1) + 1);
        async move { engine_request(&engine, &key, true).await }
    })
    .await
}

// ------------------------------------------------------------------- expiry --

/// The start of the day the window's horizon falls in: the partitions wholly before it are the
/// ones a drop may take.
const HORIZON_PERIOD: &str = "to_timestamp(floor(extract(epoch FROM now() - interval '24 hours') \
                              / 86400) * 86400)";

/// The plan the expiry runs on: the default (partitions of a day, one ahead). The seeding fills
/// the day wholly past the window; yesterday's, today's and tomorrow's partitions are the other
/// three, as a service running the default plan has them.
const EXPIRY_PLAN: PartitionPlan = PartitionPlan {
    width: Duration::from_secs(24 * 60 * 60),
    ahead: 1,
};

async fn expiry(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    prefix: &str,
    how: How,
) -> Result<Expiry, Error> {
    let keys = config.partitioned_keys;
    let clients = config.retention_clients.max(1);
    let schema = how.schema();
    eprintln!(
        "idemflow-bench: partitioned expiry: {keys} keys, {}",
        how.describe()
    );
    let before = prepare(scratch, tenant, how, keys).await?;
    let pool = schema_pool(scratch, schema, clients).await?;
    let engine = engine(&pool, tenant)?;
    let tag = format!("{prefix}-{schema}");
    let expired = expire_under_load(config, scratch, &engine, how, &tag).await;
    pool.close().await;
    let expired = expired?;
    let after = aftermath(scratch, schema).await?;
    let load_updates = after.stats.updated - before.stats.updated;
    let row = |variant: &str, measured: &Measured| {
        run_row(report::PARTITIONED_EXPIRY, variant, clients, measured, None)
    };
    let expiry = Expiry {
        how: how.describe().to_owned(),
        partitioned: how == How::Drop,
        partitions_before: before.partitions,
        partitions_after: expired.partitions_after,
        expired: expired.keys,
        seconds: expired.took.as_secs_f64(),
        seed_seconds: before.seed_seconds,
        before: row("claims before", &expired.before),
        during: row("claims during", &expired.during),
        dead_tuples_after: after.stats.dead,
        load_updates,
        rows_deleted: after.stats.deleted - before.stats.deleted,
        dead_tuples_left_by_expiry: after.stats.dead - before.stats.dead - load_updates,
        bytes_before: before.bytes,
        bytes_after: after.bytes,
        vacuum_seconds: after.vacuum_seconds,
        autovacuums: after.stats.autovacuums - before.stats.autovacuums,
    };
    expiry_progress(&expiry);
    Ok(expiry)
}

/// The keys table of a variant before its expiry.
struct Before {
    /// Seeding, adopting the layout and the VACUUM (ANALYZE) after.
    seed_seconds: f64,
    partitions: usize,
    bytes: i64,
    stats: TableStats,
}

/// Creates the variant's schema with its keys: created evenly over the 24 hours before the
/// horizon's day, the day partition a drop takes whole (partitioned, the adoption copies them
/// in); vacuumed as old rows would be, autovacuum off on the keys table's heaps.
async fn prepare(
    scratch: &Scratch,
    tenant: &TenantId,
    how: How,
    keys: u64,
) -> Result<Before, Error> {
    let schema = how.schema();
    create_schema(scratch, schema).await?;
    let setup = schema_pool(scratch, schema, 1).await?;
    let seeding = Instant::now();
    let at = format!(
        "{HORIZON_PERIOD} - interval '24 hours' + (g - 1) * (interval '24 hours' / {keys})"
    );
    seed(&setup, tenant, "expired-", keys, &at).await?;
    if how == How::Drop {
        partitions::adopt(&setup, &EXPIRY_PLAN).await?;
    }
    // Old rows are frozen and hinted in production; a fresh bulk insert is not.
    execute(&setup, "VACUUM (ANALYZE) idempotency_keys".to_owned()).await?;
    execute(&setup, "VACUUM (ANALYZE) orders".to_owned()).await?;
    execute(
        &setup,
        format!(
            "DO $off$ DECLARE heap regclass; BEGIN \
                 FOR heap IN SELECT relid FROM {TREE} AS t LOOP \
                     EXECUTE format('ALTER TABLE %s SET (autovacuum_enabled = false)', heap); \
                 END LOOP; \
             END $off$"
        ),
    )
    .await?;
    let seed_seconds = seeding.elapsed().as_secs_f64();
    let partitions = partition_count(&setup).await?;
    let bytes = tree_bytes(&setup).await?;
    setup.close().await;
    Ok(Before {
        seed_seconds,
        partitions,
        bytes,
        stats: settled_stats(scratch, schema).await?,
    })
}

/// The expiry, and the load just before and during it.
struct Expired {
    keys: u64,
    took: Duration,
    partitions_after: usize,
    before: Measured,
    during: Measured,
}

/// The steady load (new one-local-phase requests) for the run's duration, then the same load
/// while the variant expires the keys; fails unless every key expired.
async fn expire_under_load(
    config: &Config,
    scratch: &Scratch,
    engine: &Engine,
    how: How,
    tag: &str,
) -> Result<Expired, Error> {
    let keys = config.partitioned_keys;
    let clients = config.retention_clients.max(1);
    let warm_up = Until::Elapsed(config.warm_up);
    claims(engine, clients, warm_up, &format!("{tag}-warm")).await?;
    let before = Until::Elapsed(config.duration);
    let before = claims(engine, clients, before, &format!("{tag}-before")).await?;
    let expiring = schema_pool(scratch, how.schema(), 1).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let job = tokio::spawn(expire(expiring.clone(), how, stop.clone()));
    let during = claims(engine, clients, Until::Flag(stop), &format!("{tag}-during")).await;
    let (expired, took) = job.await?;
    let during = during?;
    let expired = expired?;
    let partitions_after = partition_count(&expiring).await?;
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key LIKE 'expired-%'")
            .fetch_one(&expiring)
            .await?;
    expiring.close().await;
    if expired != keys || left != 0 {
        return Err(format!(
            "{}: expired {expired} of {keys} keys; {left} left",
            how.describe()
        )
        .into());
    }
    Ok(Expired {
        keys: expired,
        took,
        partitions_after,
        before,
        during,
    })
}

/// Expires the keys as the variant does, then raises `stop`: (keys expired, the time it took).
async fn expire(pool: PgPool, how: How, stop: Arc<AtomicBool>) -> (Result<u64, Error>, Duration) {
    let started = Instant::now();
    let expired: Result<u64, Error> = match how {
        How::Drop | How::Paced => {
            let retention = Retention::default().with_keep_for(KEEP_FOR);
            retention.expire(&pool).await.map_err(Error::from)
        }
        How::Unpaced => idemflow::expire(&pool, KEEP_FOR, UNPACED_BATCH)
            .await
            .map_err(Error::from),
    };
    stop.store(true, Ordering::Release);
    (expired, started.elapsed())
}

/// What an expiry left, read once every backend has published its counters.
struct After {
    stats: TableStats,
    bytes: i64,
    /// A manual VACUUM of the keys table: the work the expiry left to autovacuum.
    vacuum_seconds: f64,
}

/// Reads what the expiry left, then drops the variant's schema.
async fn aftermath(scratch: &Scratch, schema: &str) -> Result<After, Error> {
    let stats = settled_stats(scratch, schema).await?;
    let pool = schema_pool(scratch, schema, 1).await?;
    let bytes = tree_bytes(&pool).await?;
    let vacuuming = Instant::now();
    execute(&pool, "VACUUM idempotency_keys".to_owned()).await?;
    let vacuum_seconds = vacuuming.elapsed().as_secs_f64();
    pool.close().await;
    scratch
        .execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await?;
    Ok(After {
        stats,
        bytes,
        vacuum_seconds,
    })
}

fn expiry_progress(expiry: &Expiry) {
    let p = |run: &Run, percentile: fn(&crate::LatencySummary) -> Option<f64>| {
        run.claim.as_ref().and_then(percentile).unwrap_or(f64::NAN)
    };
    eprintln!(
        "  {}: {} keys in {:.2} s; claim p50/p99 before {:.2}/{:.2} ms, during {:.2}/{:.2} ms \
         ({} samples); dead tuples left {}; {} → {} MB; VACUUM after {:.2} s",
        expiry.how,
        expiry.expired,
        expiry.seconds,
        p(&expiry.before, |s| s.p50_ms),
        p(&expiry.before, |s| s.p99_ms),
        p(&expiry.during, |s| s.p50_ms),
        p(&expiry.during, |s| s.p99_ms),
        expiry.during.claim.map_or(0, |s| s.samples),
        expiry.dead_tuples_left_by_expiry,
        expiry.bytes_before / 1_000_000,
        expiry.bytes_after / 1_000_000,
        expiry.vacuum_seconds,
    );
}

// -------------------------------------------------------------- layout cost --

/// The schema of a layout: 0 partitions is the unpartitioned table.
fn cost_schema(partitions: usize) -> String {
    if partitions == 0 {
        "cost_unpartitioned".to_owned()
    } else {
        format!("cost_p{partitions}")
    }
}

/// A schema with `replay_keys` finished keys, unpartitioned (`partitions` 0) or on `partitions`
/// live partitions: the keys spread over the current one and those behind it, one ahead.
async fn cost_layout(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    partitions: usize,
) -> Result<usize, Error> {
    let schema = cost_schema(partitions);
    create_schema(scratch, &schema).await?;
    let pool = schema_pool(scratch, &schema, 1).await?;
    // Partitions: those behind the current one, the current one, and those ahead.
    let behind = partitions.saturating_sub(1 + COST_AHEAD as usize) as u64;
    let width = COST_WIDTH.as_secs();
    let at = format!("now() - (g % {}) * interval '{width} seconds'", behind + 1);
    seed(&pool, tenant, "replay-", config.replay_keys.max(1), &at).await?;
    if partitions > 0 {
        partitions::adopt(
            &pool,
            &PartitionPlan {
                width: COST_WIDTH,
                ahead: COST_AHEAD,
            },
        )
        .await?;
    }
    execute(&pool, "VACUUM (ANALYZE) idempotency_keys".to_owned()).await?;
    // One more than asked when an hour began between the seeding and the adoption.
    let live = partition_count(&pool).await?;
    pool.close().await;
    Ok(live)
}

async fn layout_costs(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    prefix: &str,
) -> Result<Vec<LayoutCost>, Error> {
    let clients = config.partitioned_clients.max(1);
    let mut layouts = vec![0];
    layouts.extend(config.partition_counts.iter().copied());
    eprintln!(
        "idemflow-bench: partitioned layout: replays and claims at {clients} clients, unpartitioned \
         and on {:?} partitions, interleaved",
        config.partition_counts
    );
    let mut live = Vec::new();
    for &partitions in &layouts {
        live.push(cost_layout(config, scratch, tenant, partitions).await?);
    }
    // (layout, replay?) in the order A B C … … C B A.
    let plan: Vec<(usize, bool)> = [true, false]
        .iter()
        .flat_map(|&replay| layouts.iter().map(move |&layout| (layout, replay)))
        .collect();
    let samples = interleave(config, scratch, tenant, prefix, &plan).await?;
    let merged: Vec<Merged> = samples.iter().map(|halves| Merged::of(halves)).collect();
    let find = |layout: usize, replay: bool| {
        plan.iter()
            .position(|&entry| entry == (layout, replay))
            .map(|index| &merged[index])
    };
    let mut costs = Vec::new();
    for (&layout, &live) in layouts.iter().zip(&live) {
        let (Some(replay), Some(claim), Some(replay_base), Some(claim_base)) = (
            find(layout, true),
            find(layout, false),
            find(0, true),
            find(0, false),
        ) else {
            continue;
        };
        costs.push(cost(live, [replay, claim], [replay_base, claim_base]));
    }
    for &layout in &layouts {
        scratch
            .execute(&format!("DROP SCHEMA {} CASCADE", cost_schema(layout)))
            .await?;
    }
    Ok(costs)
}

/// A layout's replays and claims, against the unpartitioned table's (`base`).
fn cost(
    partitions: usize,
    [replay, claim]: [&Merged; 2],
    [replay_base, claim_base]: [&Merged; 2],
) -> LayoutCost {
    let cost = LayoutCost {
        partitions,
        replays_per_second: replay.per_second,
        replay_latency: replay.latencies.summary(),
        replay_spread: replay.spread,
        replay_ratio: replay.per_second / replay_base.per_second.max(1e-9),
        claims_per_second: claim.per_second,
        claim_latency: claim.latencies.summary(),
        claim_time: claim.claim_time.summary(),
        claim_spread: claim.spread,
        claim_ratio: claim.per_second / claim_base.per_second.max(1e-9),
    };
    eprintln!(
        "  {:>2} partitions: replays {:>7.0}/s ({:.2}×), claims {:>6.0}/s ({:.2}×)",
        partitions,
        cost.replays_per_second,
        cost.replay_ratio,
        cost.claims_per_second,
        cost.claim_ratio
    );
    cost
}

/// Each entry of `plan` (a layout, replays or claims) for half the duration, in the order given
/// and then reversed, after a warm-up on a fresh pool: each entry's two halves.
async fn interleave(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    prefix: &str,
    plan: &[(usize, bool)],
) -> Result<Vec<Vec<Measured>>, Error> {
    let clients = config.partitioned_clients.max(1);
    let half = config.duration / 2;
    let warm_up = Until::Elapsed(config.warm_up);
    let mut samples: Vec<Vec<Measured>> = plan.iter().map(|_| Vec::new()).collect();
    for (round, index) in (0..plan.len()).chain((0..plan.len()).rev()).enumerate() {
        let (layout, replay) = plan[index];
        let pool = schema_pool(scratch, &cost_schema(layout), clients).await?;
        let engine = engine(&pool, tenant)?;
        let tag = format!("{prefix}-{layout}-{round}");
        let measured = if replay {
            replays(&engine, clients, warm_up.clone(), config.replay_keys).await?;
            replays(&engine, clients, Until::Elapsed(half), config.replay_keys).await?
        } else {
            claims(&engine, clients, warm_up.clone(), &format!("{tag}-warm")).await?;
            claims(&engine, clients, Until::Elapsed(half), &tag).await?
        };
        pool.close().await;
        samples[index].push(measured);
    }
    Ok(samples)
}

/// One entry's halves merged: requests per second, latencies, claim times, and how far apart
/// the halves' rates were.
struct Merged {
    per_second: f64,
    latencies: Latencies,
    claim_time: Latencies,
    spread: Option<f64>,
}

impl Merged {
    fn of(halves: &[Measured]) -> Self {
        let requests: u64 = halves.iter().map(|m| m.requests).sum();
        let elapsed: Duration = halves.iter().map(|m| m.elapsed).sum();
        let rates: Vec<f64> = halves.iter().map(Measured::per_second).collect();
        let spread = match rates[..] {
            [a, b] => Some((a - b).abs() / ((a + b) / 2.0).max(1e-9)),
            _ => None,
        };
        Self {
            per_second: requests as f64 / elapsed.as_secs_f64().max(1e-9),
            latencies: Latencies::merge(halves.iter().map(|m| &m.latencies)),
            claim_time: Latencies::merge(halves.iter().map(|m| &m.inner)),
            spread,
        }
    }
}

/// Expiry by dropping partitions costs the claim nothing measurable and leaves no dead tuples,
/// and the look-up on 8 partitions stays within 10% of the unpartitioned table's.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let Some(partitioned) = &report.partitioned_expiry else {
        return;
    };
    for expiry in partitioned.expiries.iter().filter(|e| e.partitioned) {
        let p99 = |run: &Run| run.claim.and_then(|claim| claim.p99_ms);
        let ratio = p99(&expiry.during)
            .zip(p99(&expiry.before))
            .map(|(during, before)| during / before);
        targets.push(Target {
            name: format!(
                "12 partition drop: claim p99 during ÷ before (@{})",
                partitioned.clients
            ),
            measured: ratio.map_or("-".to_owned(), |ratio| format!("{ratio:.2}×")),
            target: "≤ 1.2×".to_owned(),
            met: ratio.map(|ratio| ratio <= 1.2),
        });
        targets.push(Target {
            name: "12 partition drop: dead tuples left".to_owned(),
            measured: format!("{}", expiry.dead_tuples_left_by_expiry),
            target: "0".to_owned(),
            met: Some(expiry.dead_tuples_left_by_expiry <= 0),
        });
    }
    if let Some(cost) = partitioned.costs.iter().find(|cost| cost.partitions == 8) {
        targets.push(Target::ratio(
            format!(
                "12 look-up on 8 partitions ÷ unpartitioned @{}",
                partitioned.cost_clients
            ),
            Some(cost.replay_ratio),
            0.9,
        ));
    }
}

fn section(report: &Report, out: &mut String) {
    let Some(p) = &report.partitioned_expiry else {
        return;
    };
    let _ = writeln!(
        out,
        "\npartitioned expiry (12): {} finished keys past a {:.0} h window, expired while {} clients \
         send new one-local-phase requests (claim p50/p99 ms before → during, samples during)",
        p.keys, p.keep_for_hours, p.clients
    );
    let _ = writeln!(
        out,
        "  {:<72} {:>5} {:>8} {:>17} {:>17} {:>6} {:>9} {:>9} {:>13} {:>8}",
        "expiry",
        "parts",
        "seconds",
        "claim before",
        "claim during",
        "n",
        "dead left",
        "dead all",
        "MB bef→aft",
        "VACUUM s"
    );
    for expiry in &p.expiries {
        expiry_line(out, expiry);
    }
    let _ = writeln!(
        out,
        "  dead left: n_dead_tup after, minus the load's own updates (one per request); autovacuum \
         off on the keys table meanwhile (runs: {}); VACUUM s: a manual VACUUM after, the work left",
        p.expiries
            .iter()
            .map(|e| e.autovacuums.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    costs_table(out, p);
}

fn expiry_line(out: &mut String, e: &Expiry) {
    let pair = |run: &Run| {
        run.claim.as_ref().map_or("-".to_owned(), |claim| {
            format!("{}/{}", ms(claim.p50_ms), ms(claim.p99_ms))
        })
    };
    let _ = writeln!(
        out,
        "  {:<72} {:>5} {:>8.2} {:>17} {:>17} {:>6} {:>9} {:>9} {:>13} {:>8.2}",
        e.how,
        format!("{}→{}", e.partitions_before, e.partitions_after),
        e.seconds,
        pair(&e.before),
        pair(&e.during),
        e.during.claim.map_or(0, |claim| claim.samples),
        e.dead_tuples_left_by_expiry,
        e.dead_tuples_after,
        format!(
            "{}→{}",
            e.bytes_before / 1_000_000,
            e.bytes_after / 1_000_000
        ),
        e.vacuum_seconds
    );
}

fn costs_table(out: &mut String, p: &PartitionedExpiry) {
    let _ = writeln!(
        out,
        "  layout cost at {} clients, interleaved: {:>10} {:>8} {:>8} {:>10} {:>8} {:>8} {:>10}",
        p.cost_clients, "replays/s", "ratio", "p99 ms", "claims/s", "ratio", "p99 ms", "claim p99"
    );
    for cost in &p.costs {
        let label = if cost.partitions == 0 {
            "unpartitioned".to_owned()
        } else {
            format!("{} partitions", cost.partitions)
        };
        let _ = writeln!(
            out,
            "  {:<36} {:>10.0} {:>7.2}× {:>8} {:>10.0} {:>7.2}× {:>8} {:>10}",
            label,
            cost.replays_per_second,
            cost.replay_ratio,
            ms(cost.replay_latency.p99_ms),
            cost.claims_per_second,
            cost.claim_ratio,
            ms(cost.claim_latency.p99_ms),
            ms(cost.claim_time.p99_ms)
        );
    }
}
