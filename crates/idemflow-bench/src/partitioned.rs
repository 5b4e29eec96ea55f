//! Workload 12: partitioned expiry (`idemflow::store::partitions`). Every variant runs in a schema
//! of its own (first on the search path, as workload 10 does), created, measured and dropped in
//! turn, so no variant inherits another's bloat or free space.
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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemflow::store::partitions::{self, PartitionPlan};
use idemflow::{Retention, Runner, TenantId};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};

use crate::Error;
use crate::config::Config;
use crate::db::Scratch;
use crate::load::{Latencies, Measured, Until, closed_loop};
use crate::report::{self, Expiry, LayoutCost, PartitionedExpiry};
use crate::workflows::{self, ORDERS_TABLE};
use crate::workloads::{Engine, engine_request, run_row};

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

pub async fn run(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    prefix: &str,
) -> Result<PartitionedExpiry, Error> {
    let mut expiries = Vec::new();
    for how in [How::Unpaced, How::Paced, How::Drop] {
        expiries.push(expiry(config, scratch, tenant, prefix, how).await?);
    }
    let costs = layout_costs(config, scratch, tenant, prefix).await?;
    Ok(PartitionedExpiry {
        keys: config.partitioned_keys,
        clients: config.retention_clients,
        keep_for_hours: KEEP_FOR.as_secs_f64() / 3600.0,
        expiries,
        cost_clients: config.partitioned_clients,
        costs,
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

fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
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

/// The engine running workload 2's one-local-phase workflow for `tenant`.
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
    create_schema(scratch, schema).await?;
    let setup = schema_pool(scratch, schema, 1).await?;

    // The keys, created evenly over the 24 hours before the horizon's day: the day partition a
    // drop takes whole (partitioned, the adoption copies them in).
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
    let partitions_before = partition_count(&setup).await?;
    let bytes_before = tree_bytes(&setup).await?;
    setup.close().await;
    let stats_before = settled_stats(scratch, schema).await?;

    // The steady load, before.
    let pool = schema_pool(scratch, schema, clients).await?;
    let engine = engine(&pool, tenant)?;
    let tag = format!("{prefix}-{schema}");
    claims(
        &engine,
        clients,
        Until::Elapsed(config.warm_up),
        &format!("{tag}-warm"),
    )
    .await?;
    let before = claims(
        &engine,
        clients,
        Until::Elapsed(config.duration),
        &format!("{tag}-before"),
    )
    .await?;

    // The expiry, with the same load meanwhile.
    let expiring = schema_pool(scratch, schema, 1).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let job = {
        let (expiring, stop) = (expiring.clone(), stop.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let expired: Result<u64, Error> = match how {
                How::Drop | How::Paced => {
                    let retention = Retention::default().with_keep_for(KEEP_FOR);
                    retention.expire(&expiring).await.map_err(Error::from)
                }
                How::Unpaced => idemflow::expire(&expiring, KEEP_FOR, UNPACED_BATCH)
                    .await
                    .map_err(Error::from),
            };
            stop.store(true, Ordering::Release);
            (expired, started.elapsed())
        })
    };
    let during = claims(
        &engine,
        clients,
        Until::Flag(stop),
        &format!("{tag}-during"),
    )
    .await;
    let (expired, took) = job.await?;
    let during = during?;
    let expired = expired?;
    let partitions_after = partition_count(&expiring).await?;
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key LIKE 'expired-%'")
            .fetch_one(&expiring)
            .await?;
    if expired != keys || left != 0 {
        return Err(format!(
            "{}: expired {expired} of {keys} keys; {left} left",
            how.describe()
        )
        .into());
    }
    pool.close().await;
    expiring.close().await;

    // What it left, once every backend published its counters.
    let after = settled_stats(scratch, schema).await?;
    let pool = schema_pool(scratch, schema, 1).await?;
    let bytes_after = tree_bytes(&pool).await?;
    let vacuuming = Instant::now();
    execute(&pool, "VACUUM idempotency_keys".to_owned()).await?;
    let vacuum_seconds = vacuuming.elapsed().as_secs_f64();
    pool.close().await;
    scratch
        .execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await?;

    let load_updates = after.updated - stats_before.updated;
    let expiry = Expiry {
        how: how.describe().to_owned(),
        partitioned: how == How::Drop,
        partitions_before,
        partitions_after,
        expired,
        seconds: took.as_secs_f64(),
        seed_seconds,
        before: run_row(
            report::PARTITIONED_EXPIRY,
            "claims before",
            clients,
            &before,
            None,
        ),
        during: run_row(
            report::PARTITIONED_EXPIRY,
            "claims during",
            clients,
            &during,
            None,
        ),
        dead_tuples_after: after.dead,
        load_updates,
        rows_deleted: after.deleted - stats_before.deleted,
        dead_tuples_left_by_expiry: after.dead - stats_before.dead - load_updates,
        bytes_before,
        bytes_after,
        vacuum_seconds,
        autovacuums: after.autovacuums - stats_before.autovacuums,
    };
    let p = |run: &report::Run, percentile: fn(&crate::LatencySummary) -> Option<f64>| {
        run.claim.as_ref().and_then(percentile).unwrap_or(f64::NAN)
    };
    eprintln!(
        "  {}: {expired} keys in {:.2} s; claim p50/p99 before {:.2}/{:.2} ms, during {:.2}/{:.2} ms \
         ({} samples); dead tuples left {}; {} → {} MB; VACUUM after {:.2} s",
        how.describe(),
        expiry.seconds,
        p(&expiry.before, |s| s.p50_ms),
        p(&expiry.before, |s| s.p99_ms),
        p(&expiry.during, |s| s.p50_ms),
        p(&expiry.during, |s| s.p99_ms),
        expiry.during.claim.map_or(0, |s| s.samples),
        expiry.dead_tuples_left_by_expiry,
        bytes_before / 1_000_000,
        bytes_after / 1_000_000,
        vacuum_seconds,
    );
    Ok(expiry)
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
    let half = config.duration / 2;
    let mut samples: Vec<Vec<Measured>> = plan.iter().map(|_| Vec::new()).collect();
    for (round, index) in (0..plan.len()).chain((0..plan.len()).rev()).enumerate() {
        let (layout, replay) = plan[index];
        let pool = schema_pool(scratch, &cost_schema(layout), clients).await?;
        let engine = engine(&pool, tenant)?;
        let tag = format!("{prefix}-{layout}-{round}");
        let measured = if replay {
            replays(
                &engine,
                clients,
                Until::Elapsed(config.warm_up),
                config.replay_keys,
            )
            .await?;
            replays(&engine, clients, Until::Elapsed(half), config.replay_keys).await?
        } else {
            claims(
                &engine,
                clients,
                Until::Elapsed(config.warm_up),
                &format!("{tag}-warm"),
            )
            .await?;
            claims(&engine, clients, Until::Elapsed(half), &tag).await?
        };
        pool.close().await;
        samples[index].push(measured);
    }
    let merged: Vec<(f64, Latencies, Latencies, Option<f64>)> = samples
        .iter()
        .map(|halves| {
            let requests: u64 = halves.iter().map(|m| m.requests).sum();
            let elapsed: Duration = halves.iter().map(|m| m.elapsed).sum();
            let rates: Vec<f64> = halves.iter().map(Measured::per_second).collect();
            let spread = match rates[..] {
                [a, b] => Some((a - b).abs() / ((a + b) / 2.0).max(1e-9)),
                _ => None,
            };
            (
                requests as f64 / elapsed.as_secs_f64().max(1e-9),
                Latencies::merge(halves.iter().map(|m| &m.latencies)),
                Latencies::merge(halves.iter().map(|m| &m.inner)),
                spread,
            )
        })
        .collect();
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
        let cost = LayoutCost {
            partitions: live,
            replays_per_second: replay.0,
            replay_latency: replay.1.summary(),
            replay_spread: replay.3,
            replay_ratio: replay.0 / replay_base.0.max(1e-9),
            claims_per_second: claim.0,
            claim_latency: claim.1.summary(),
            claim_time: claim.2.summary(),
            claim_spread: claim.3,
            claim_ratio: claim.0 / claim_base.0.max(1e-9),
        };
        eprintln!(
            "  {:>2} partitions: replays {:>7.0}/s ({:.2}×), claims {:>6.0}/s ({:.2}×)",
            live,
            cost.replays_per_second,
            cost.replay_ratio,
            cost.claims_per_second,
            cost.claim_ratio
        );
        costs.push(cost);
    }
    for &layout in &layouts {
        scratch
            .execute(&format!("DROP SCHEMA {} CASCADE", cost_schema(layout)))
            .await?;
    }
    Ok(costs)
}
