//! The schedule explorer: the real engine on a real PostgreSQL, driven by a seeded schedule through
//! interleavings nobody designed, with a checker of what must hold at the end.
//!
//! A schedule (see `world.rs`) has 2 to 4 keys of a scripted checkout workflow (`workflow.rs`:
//! reserve → price → charge at the mock provider → complete, with a failure path) and these
//! actors: clients sending first attempts and retries (and, after a key was forgotten, the next
//! request under it), 1 to 4 resumers draining due keys with their own batch sizes and
//! concurrency, an operator ending leases (`end-lease`) and retention, and chaos: leases expired by rewinding
//! them in SQL, a clock jump of a day for retention, connections of the engine killed by the
//! server, a stored phase output corrupted as a deploy would. Phases are told by the schedule what
//! to do on each run: succeed, be slow, fail (retryable or terminal), panic, hang past their time
//! limit, return an output the store refuses, break their commit; the charge may also meet a
//! provider fault (503, a timeout, a reset, a charge whose response is lost, a delay). The engine's
//! crash points and the start of every phase are where actors wait for their turn, and where the
//! schedule may crash a run.
//!
//! The seed decides everything the schedule does; the database and the timing are real, so a
//! replay repeats the same decisions and, as far as real time allows, the same interleaving.
//! After the schedule, every actor is let go, faults heal (a poison request stays poison), client
//! retries alone must bring every key to an end within its attempt budget, and the checker runs
//! (`check.rs` lists what it asserts).
//!
//! ```no_run
//! # async fn run(pool: sqlx::PgPool) {
//! let simulation = idemflow_testkit::simulation::Simulation::new(&pool).await.unwrap();
//! for seed in 0..10 {
//!     let report = simulation.run(seed).await;
//!     assert!(report.passed(), "{report}");
//! }
//! # }
//! ```

mod check;
mod rng;
mod scheduler;
mod workflow;
mod world;

use std::fmt;
use std::sync::Arc;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

pub use rng::Rng;
pub use world::Counts;

use crate::provider::MockProvider;

/// The `application_name` of the engine's connections (the ones a schedule kills).
pub const ENGINE_APPLICATION: &str = "idemflow-sim-engine";

/// The `application_name` of the schedule's own connections (never killed).
pub const OBSERVER_APPLICATION: &str = "idemflow-sim-observer";

/// How long the observer waits on a row lock before it calls the row stuck.
const OBSERVER_LOCK_TIMEOUT: &str = "10s";

/// The schema that holds the engine's tables on the partitioned layout, beside the unpartitioned
/// ones in the database's own schema: each schedule draws its layout, and its connections find
/// the tables through their search path.
pub const PARTITIONED_SCHEMA: &str = "idemflow_sim_partitioned";

/// Runs schedules against one database.
pub struct Simulation {
    /// How to reach the database; each schedule opens the engine's pool from it with the
    /// settings it drew (layout, isolation), and closes it at its end.
    options: PgConnectOptions,
    /// The schedule's own connections, by layout.
    observers: [PgPool; 2],
    provider: Arc<MockProvider>,
}

impl fmt::Debug for Simulation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("Simulation").finish_non_exhaustive()
    }
}

impl Simulation {
    /// Prepares schedules on the database `pool` reaches (migrated): both layouts (the
    /// partitioned one in a schema of its own, [`PARTITIONED_SCHEMA`], daily partitions reaching a
    /// month back, so the schedules' day-long jumps of the clock move keys between partitions),
    /// the observers' pools, the tables the scripted workflow writes, and a mock provider on
    /// loopback. Schedules run one at a time; each has a tenant of its own.
    pub async fn new(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let options = pool.connect_options().as_ref().clone();
        let observer = |layout: Layout| {
            // The observer never waits on a lock for long: a row some session keeps locked (a
            // transaction no one ends) fails its statement, and the schedule says so, instead
            // of hanging the run.
            PgPoolOptions::new().max_connections(4).connect_with(
                layout
                    .options(options.clone())
                    .options([("lock_timeout", OBSERVER_LOCK_TIMEOUT)])
                    .application_name(OBSERVER_APPLICATION),
            )
        };
        let plain = observer(Layout::Unpartitioned).await?;
        for statement in [
            // claimed_at: the claim the effect was made under (a key deleted by the forget
            // policy and claimed again is another claim of the same request).
            "CREATE TABLE IF NOT EXISTS sim_effects (tenant text NOT NULL, key text NOT NULL, \
             life bigint NOT NULL, phase text NOT NULL, lock_version bigint NOT NULL, \
             claimed_at text)",
            "CREATE TABLE IF NOT EXISTS sim_parents (id int PRIMARY KEY)",
            "CREATE TABLE IF NOT EXISTS sim_orphans (parent int REFERENCES sim_parents (id) \
             DEFERRABLE INITIALLY DEFERRED)",
            // The consumer's ledger: one row per message applied.
            "CREATE TABLE IF NOT EXISTS sim_ledger (message_id text NOT NULL)",
        ] {
            sqlx::query(statement).execute(&plain).await?;
        }
        prepare_partitioned(&options).await?;
        let partitioned = observer(Layout::Partitioned).await?;
        let provider = MockProvider::builder()
            .start()
            .await
            .map_err(sqlx::Error::Io)?;
        Ok(Self {
            options,
            observers: [plain, partitioned],
            provider: Arc::new(provider),
        })
    }

    /// Runs the schedule `seed` names, and checks it.
    pub async fn run(&self, seed: u64) -> ScheduleReport {
        world::run(self, seed).await
    }

    /// The observer's pool on `layout`.
    pub(crate) fn observer(&self, layout: Layout) -> &PgPool {
        &self.observers[layout as usize]
    }

    /// The engine's pool for a schedule: its layout, and the database default isolation its
    /// sessions get (the engine states its own in every transaction it begins).
    pub(crate) async fn engine(&self, settings: &Settings) -> Result<PgPool, sqlx::Error> {
        PgPoolOptions::new()
            .max_connections(40)
            .test_before_acquire(false)
            .connect_with(
                settings
                    .layout
                    .options(self.options.clone())
                    .options([("default_transaction_isolation", settings.isolation.as_sql())])
                    .application_name(ENGINE_APPLICATION),
            )
            .await
    }
}

/// Migrates [`PARTITIONED_SCHEMA`] and adopts the partitioned layout there, once per database.
async fn prepare_partitioned(options: &PgConnectOptions) -> Result<(), sqlx::Error> {
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(Layout::Partitioned.options(options.clone()))
        .await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA IF NOT EXISTS {PARTITIONED_SCHEMA}"
    )))
    .execute(&pool)
    .await?;
    idemflow_pg::migrate(&pool).await.map_err(|error| {
        sqlx::Error::Protocol(format!("migrating the partitioned schema: {error}"))
    })?;
    let mut connection = pool.acquire().await?;
    if !idemflow_pg::partitions::is_partitioned(&mut connection)
        .await
        .map_err(store_error)?
    {
        // A key a month old first, so the partitions reach back that far.
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, \
                 locked_until, created_at) \
             VALUES ('reach-back', 'k', sha256('k'), 'w', '{}', now(), now() - interval '30 days')",
        )
        .execute(&mut *connection)
        .await?;
        idemflow_pg::partitions::adopt(
            &pool,
            &idemflow_pg::partitions::PartitionPlan {
                width: std::time::Duration::from_secs(24 * 60 * 60),
                ahead: 2,
            },
        )
        .await
        .map_err(store_error)?;
        sqlx::query("DELETE FROM idempotency_keys WHERE tenant = 'reach-back'")
            .execute(&mut *connection)
            .await?;
    }
    drop(connection);
    pool.close().await;
    Ok(())
}

fn store_error(error: idemflow_pg::StoreError) -> sqlx::Error {
    match error {
        idemflow_pg::StoreError::Database(error) => error,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// Which layout of the keys table a schedule runs on (docs/operations.md, "Choosing the layout").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    Unpartitioned = 0,
    Partitioned = 1,
}

impl Layout {
    /// `options` reaching this layout's tables (the scripted workflow's own stay in the
    /// database's schema, after it on the path).
    fn options(self, options: PgConnectOptions) -> PgConnectOptions {
        match self {
            Self::Unpartitioned => options,
            Self::Partitioned => {
                options.options([("search_path", format!("{PARTITIONED_SCHEMA}, public"))])
            }
        }
    }
}

/// The database default isolation level of a schedule's engine sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isolation {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Isolation {
    fn as_sql(self) -> &'static str {
        match self {
            Self::ReadCommitted => "read committed",
            Self::RepeatableRead => "repeatable read",
            Self::Serializable => "serializable",
        }
    }
}

/// The settings around the engine a schedule draws, beside its actors: the layout, the
/// database's default isolation, where response bodies are stored, sealing, and a consumer
/// sharing the engine's pool.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub layout: Layout,
    pub isolation: Isolation,
    /// Every response body stored apart (`response_apart_above` 0), not in its row.
    pub apart: bool,
    /// A keyring seals the stored request, outputs and responses.
    pub sealed: bool,
    /// An idempotent consumer runs deliveries on the engine's own pool, some of them dropped
    /// part-way (a timeout, a shutdown).
    pub consumer: bool,
}

impl Settings {
    pub(crate) fn draw(rng: &mut Rng) -> Self {
        Self {
            layout: if rng.chance(0.3) {
                Layout::Partitioned
            } else {
                Layout::Unpartitioned
            },
            isolation: rng.weighted(&[
                (5, Isolation::ReadCommitted),
                (3, Isolation::RepeatableRead),
                (2, Isolation::Serializable),
            ]),
            apart: rng.chance(0.4),
            sealed: rng.chance(0.3),
            consumer: rng.chance(0.3),
        }
    }
}

/// What one schedule came to.
#[derive(Debug, Clone)]
pub struct ScheduleReport {
    /// The seed that decided the schedule; [`ScheduleReport::replay_command`] runs it again.
    pub seed: u64,
    /// Every invariant that failed, as it was seen; empty when the schedule passed.
    pub violations: Vec<String>,
    /// Every step: actions, waits, grants, calls, answers.
    pub history: Vec<String>,
    /// How much of each thing the schedule did.
    pub counts: Counts,
}

impl ScheduleReport {
    /// Whether no invariant failed.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// The command that runs this schedule again.
    pub fn replay_command(&self) -> String {
        format!(
            "scripts/simulate --seed {} --schedules 1 --verbose",
            self.seed
        )
    }
}

impl fmt::Display for ScheduleReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.passed() {
            return write!(formatter, "seed {}: ok ({:?})", self.seed, self.counts);
        }
        writeln!(
            formatter,
            "seed {}: {} violation(s); replay with: {}",
            self.seed,
            self.violations.len(),
            self.replay_command()
        )?;
        for violation in &self.violations {
            writeln!(formatter, "  violation: {violation}")?;
        }
        let shown = self.history.len().saturating_sub(120);
        writeln!(
            formatter,
            "  history (last {} of {} steps):",
            self.history.len() - shown,
            self.history.len()
        )?;
        for line in &self.history[shown..] {
            writeln!(formatter, "    {line}")?;
        }
        Ok(())
    }
}
