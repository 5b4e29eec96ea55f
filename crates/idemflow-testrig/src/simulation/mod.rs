//! The schedule explorer: the real engine on a real PostgreSQL, driven by a seeded schedule through
//! interleavings nobody designed, with a checker of what must hold at the end.
//!
//! A schedule (see `world.rs`) has 2 to 4 keys of a scripted checkout workflow (`workflow.rs`:
//! reserve → price → charge at the mock provider → complete, with a failure path) and these
//! actors: clients sending first attempts and retries (and, after a key was forgotten, the next
//! request under it), 1 to 4 resumers draining due keys with their own batch sizes and
//! concurrency, an operator ending leases (`end-lease`), expiring one key from the console (as it
//! was shown: its token and state) and running retention, and chaos: leases expired by rewinding
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
//! let simulation = idemflow_testrig::simulation::Simulation::new(&pool).await.unwrap();
//! for seed in 0..10 {
//!     let report = simulation.run(seed).await;
//!     assert!(report.passed(), "{report}");
//! }
//! # }
//! ```

mod check;
mod engine;
pub mod foreign;
mod observe;
mod rng;
mod scheduler;
mod transfer;
mod workflow;
mod world;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_sqlite::SqliteStore;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, MySqlPool, PgPool, SqlitePool};

pub use engine::SimEngine;
pub use rng::Rng;
pub use world::Counts;

use observe::{MySqlObserver, Observe, PgObserver, SqliteObserver};

use idemflow_runner::PoolOf;
use idemflow_testkit::provider::MockProvider;

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
    backend: Backend,
    provider: Arc<MockProvider>,
}

/// The database a simulation's schedules run on.
enum Backend {
    Postgres {
        /// How to reach the database; each schedule opens the engine's pool from it with the
        /// settings it drew (layout, isolation), and closes it at its end. (Boxed: the
        /// options are large beside the other engine's.)
        options: Box<PgConnectOptions>,
        /// The schedule's own connections, by layout.
        observers: [PgPool; 2],
    },
    Sqlite {
        /// The database file; each schedule opens the engine's pool on it, and closes it at its
        /// end.
        path: PathBuf,
        /// The schedule's own connections.
        observer: SqlitePool,
    },
    MySql {
        /// How to reach the database; each schedule opens the engine's pool from it, and closes
        /// it at its end.
        options: Box<MySqlConnectOptions>,
        /// The schedule's own connections.
        observer: MySqlPool,
    },
    /// The foreign-only world (`foreign`) on PostgreSQL.
    PostgresForeign {
        options: Box<PgConnectOptions>,
        observer: PgPool,
    },
    /// The foreign-only world on Redis: each schedule's keys under a prefix of its own.
    #[cfg(feature = "redis")]
    Redis { url: String },
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
            // What a write that hangs writes.
            "CREATE TABLE IF NOT EXISTS sim_scratch (n bigint)",
        ] {
            sqlx::query(statement).execute(&plain).await?;
        }
        prepare_partitioned(&options).await?;
        let partitioned = observer(Layout::Partitioned).await?;
        Ok(Self {
            backend: Backend::Postgres {
                options: Box::new(options),
                observers: [plain, partitioned],
            },
            provider: Arc::new(start_provider().await?),
        })
    }

    /// Prepares schedules on the SQLite engine, on the database file at `path` (created and
    /// migrated if need be): the tables the scripted workflow writes, the observer's pool, and a
    /// mock provider on loopback. A schedule draws the busy timeout of its engine's pool from
    /// its seed: a short one (a quarter second) makes busy answers part of the schedule.
    /// PostgreSQL's layouts, isolation levels and killed connections have no SQLite form: a
    /// schedule draws them and they do nothing.
    pub async fn on_sqlite(path: &Path) -> Result<Self, sqlx::Error> {
        let observer = idemflow_sqlite::open_file(
            path,
            // The observer stands aside rather than wait for a writer (observe/sqlite.rs).
            &idemflow_sqlite::OpenOptions::default()
                .with_busy_timeout(Duration::from_millis(100))
                .with_max_connections(4),
        )
        .await?;
        for statement in [
            "CREATE TABLE IF NOT EXISTS sim_effects (tenant TEXT NOT NULL, key TEXT NOT NULL, \
             life INTEGER NOT NULL, phase TEXT NOT NULL, lock_version INTEGER NOT NULL, \
             claimed_at TEXT)",
            "CREATE TABLE IF NOT EXISTS sim_parents (id INTEGER PRIMARY KEY)",
            "CREATE TABLE IF NOT EXISTS sim_orphans (parent INTEGER REFERENCES sim_parents (id) \
             DEFERRABLE INITIALLY DEFERRED)",
            "CREATE TABLE IF NOT EXISTS sim_ledger (message_id TEXT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS sim_scratch (n INTEGER)",
        ] {
            sqlx::query(statement).execute(&observer).await?;
        }
        Ok(Self {
            backend: Backend::Sqlite {
                path: path.to_owned(),
                observer,
            },
            provider: Arc::new(start_provider().await?),
        })
    }

    /// Prepares schedules on the MySQL/MariaDB engine, on the database `pool` reaches (migrated
    /// with `idemflow_mysql::MIGRATOR`): the tables the scripted workflow writes, the observer's
    /// pool (its sessions marked, so the chaos never kills them), and a mock provider on
    /// loopback. A schedule draws the lock wait timeout of its engine's pool from its seed: a
    /// short one (one second, InnoDB's least) makes busy answers part of the schedule.
    /// PostgreSQL's layouts and isolation levels have no form here (the engine sets READ
    /// COMMITTED on its own sessions): a schedule draws them and they do nothing.
    pub async fn on_mysql(pool: &MySqlPool) -> Result<Self, sqlx::Error> {
        let options = pool.connect_options().as_ref().clone();
        for statement in [
            "CREATE TABLE IF NOT EXISTS sim_effects (tenant VARCHAR(128) NOT NULL, \
             `key` VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL, \
             life BIGINT NOT NULL, phase VARCHAR(64) NOT NULL, lock_version BIGINT NOT NULL, \
             claimed_at VARCHAR(32)) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS sim_parents (id INT PRIMARY KEY) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS sim_orphans (parent INT, \
             FOREIGN KEY (parent) REFERENCES sim_parents (id)) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS sim_ledger (message_id VARCHAR(255) CHARACTER SET utf8mb4 \
             COLLATE utf8mb4_bin NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS sim_scratch (n BIGINT) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS sim_ddl (x INT) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS sim_observers (id BIGINT UNSIGNED PRIMARY KEY) ENGINE = InnoDB",
        ] {
            sqlx::query(statement).execute(pool).await?;
        }
        let observer = MySqlPoolOptions::new()
            .max_connections(4)
            .after_connect(|connection, _| {
                Box::pin(async move {
                    connection
                        .execute("INSERT IGNORE INTO sim_observers (id) VALUES (CONNECTION_ID())")
                        .await?;
                    connection
                        .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .await
                        .map(drop)
                })
            })
            .connect_with(options.clone())
            .await?;
        Ok(Self {
            backend: Backend::MySql {
                options: Box::new(options),
                observer,
            },
            provider: Arc::new(start_provider().await?),
        })
    }

    /// Prepares schedules of the foreign-only world (`foreign`: a payment and a payout whose
    /// phases are all foreign, the workflows every engine runs) on the PostgreSQL database `pool`
    /// reaches (migrated): the reference its Redis schedules are read against.
    pub async fn foreign_on_postgres(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let options = pool.connect_options().as_ref().clone();
        // An owner parked before its commit holds its row's lock: the schedule's writes give
        // up on such a row at once rather than wait for a grant only the schedule can give.
        let observer = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(
                options
                    .clone()
                    .options([("lock_timeout", "100ms")])
                    .application_name(OBSERVER_APPLICATION),
            )
            .await?;
        Ok(Self {
            backend: Backend::PostgresForeign {
                options: Box::new(options),
                observer,
            },
            provider: Arc::new(start_provider().await?),
        })
    }

    /// Prepares schedules of the foreign-only world on the Redis at `url`: each schedule's keys
    /// live under the prefix `idemflow-sim:<seed>`, emptied at its start.
    #[cfg(feature = "redis")]
    pub async fn on_redis(url: &str) -> Result<Self, sqlx::Error> {
        // Reached once here, so a missing server fails at once rather than per schedule.
        idemflow_redis::RedisPool::connect(url)
            .await
            .map_err(|error| sqlx::Error::Protocol(format!("no Redis at {url}: {error}")))?;
        Ok(Self {
            backend: Backend::Redis {
                url: url.to_owned(),
            },
            provider: Arc::new(start_provider().await?),
        })
    }

    /// The engine this simulation runs on (`postgres`, `sqlite`, `mysql`, `postgres-foreign` or
    /// `redis`).
    pub fn engine(&self) -> &'static str {
        match self.backend {
            Backend::Postgres { .. } => "postgres",
            Backend::Sqlite { .. } => "sqlite",
            Backend::MySql { .. } => "mysql",
            Backend::PostgresForeign { .. } => "postgres-foreign",
            #[cfg(feature = "redis")]
            Backend::Redis { .. } => "redis",
        }
    }

    /// Runs the schedule `seed` names, and checks it.
    pub async fn run(&self, seed: u64) -> ScheduleReport {
        match &self.backend {
            Backend::Postgres { options, observers } => {
                self.schedule_on_postgres(seed, options, observers).await
            }
            Backend::Sqlite { path, observer } => {
                world::run::<SqliteStore, _, _>(&self.provider, seed, |_| async move {
                    let observer: Arc<dyn Observe> = Arc::new(SqliteObserver(observer.clone()));
                    Ok((sqlite_engine(path, seed).await?, observer))
                })
                .await
            }
            Backend::MySql { options, observer } => {
                self.schedule_on_mysql(seed, options, observer).await
            }
            Backend::PostgresForeign { options, observer } => {
                let engine = match PgPoolOptions::new()
                    .max_connections(20)
                    .connect_with(
                        options
                            .as_ref()
                            .clone()
                            .application_name(ENGINE_APPLICATION),
                    )
                    .await
                {
                    Ok(engine) => engine,
                    Err(error) => return unreachable_engine(seed, "postgres-foreign", &error),
                };
                // A schedule run before under this seed left its keys.
                if let Err(error) = sqlx::query("DELETE FROM idempotency_keys WHERE tenant LIKE $1")
                    .bind(format!("fsim-{seed}-%"))
                    .execute(observer)
                    .await
                {
                    return unreachable_engine(seed, "postgres-foreign", &error);
                }
                let report =
                    foreign::run::<PgStore>(&self.provider, seed, engine.clone(), observer.clone())
                        .await;
                engine.close().await;
                report
            }
            #[cfg(feature = "redis")]
            Backend::Redis { url } => {
                let prefix = format!("idemflow-sim:{seed}");
                let opened = async {
                    let engine =
                        idemflow_redis::RedisPool::connect_with_prefix(url, &prefix).await?;
                    let observer =
                        idemflow_redis::RedisPool::connect_with_prefix(url, &prefix).await?;
                    foreign::forget_prefix(&observer).await?;
                    Ok::<_, idemflow_redis::StoreError>((engine, observer))
                }
                .await;
                match opened {
                    Ok((engine, observer)) => {
                        foreign::run::<idemflow_redis::RedisStore>(
                            &self.provider,
                            seed,
                            engine,
                            observer,
                        )
                        .await
                    }
                    Err(error) => unreachable_engine(seed, "redis", &error),
                }
            }
        }
    }
}

impl Simulation {
    /// The schedule `seed` names on PostgreSQL, then its contended transfers (`transfer`).
    async fn schedule_on_postgres(
        &self,
        seed: u64,
        options: &PgConnectOptions,
        observers: &[PgPool; 2],
    ) -> ScheduleReport {
        let report = world::run::<PgStore, _, _>(&self.provider, seed, |settings| async move {
            let observer: Arc<dyn Observe> =
                Arc::new(PgObserver(observers[settings.layout as usize].clone()));
            Ok((pg_engine(options, &settings).await?, observer))
        })
        .await;
        // The transfers draw a layout of their own: on the partitioned one a claim above Read
        // Committed is refused, so a stronger leading phase's claim commits alone first.
        let layout = transfer::layout(seed);
        let engine = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(
                layout
                    .options(options.clone())
                    .application_name(ENGINE_APPLICATION),
            )
            .await;
        let mut report = report;
        report
            .history
            .push(format!("transfers: on the {layout:?} layout"));
        with_transfers::<PgStore>(report, engine, &observers[layout as usize]).await
    }

    /// The schedule `seed` names on MySQL/MariaDB, then its contended transfers (`transfer`).
    async fn schedule_on_mysql(
        &self,
        seed: u64,
        options: &MySqlConnectOptions,
        observer: &MySqlPool,
    ) -> ScheduleReport {
        let report = world::run::<MySqlStore, _, _>(&self.provider, seed, |_| async move {
            let observer: Arc<dyn Observe> = Arc::new(MySqlObserver(observer.clone()));
            Ok((mysql_engine(options, seed).await?, observer))
        })
        .await;
        let engine = mysql_engine(options, seed).await;
        with_transfers::<MySqlStore>(report, engine, observer).await
    }
}

/// `report` with the schedule's contended transfers (`transfer`) run after it on `engine`, a pool
/// of the engine's own, and checked through `observer`.
async fn with_transfers<E: transfer::Contended>(
    mut report: ScheduleReport,
    engine: Result<PoolOf<E>, sqlx::Error>,
    observer: &PoolOf<E>,
) -> ScheduleReport {
    let engine = match engine {
        Ok(engine) => engine,
        Err(error) => {
            report.violations.push(format!(
                "transfers: the engine could not be reached: {error}"
            ));
            return report;
        }
    };
    let transfers = transfer::run::<E>(report.seed, engine.clone(), observer).await;
    idemflow_store::ConnectionPool::close(&engine).await;
    report.counts.transfers = transfers.keys;
    report.counts.transfer_reruns = transfers.reruns;
    report.violations.extend(transfers.violations);
    report.history.extend(transfers.history);
    report
}

/// The report of a schedule whose engine could not be reached.
fn unreachable_engine(
    seed: u64,
    engine: &'static str,
    error: &dyn std::fmt::Display,
) -> ScheduleReport {
    ScheduleReport {
        seed,
        engine,
        violations: vec![format!("the engine could not be reached: {error}")],
        history: Vec::new(),
        counts: Counts::default(),
    }
}

/// The engine's pool for a schedule on PostgreSQL: its layout, and the database default
/// isolation its sessions get (the engine states its own in every transaction it begins).
async fn pg_engine(options: &PgConnectOptions, settings: &Settings) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(40)
        .test_before_acquire(false)
        .connect_with(
            settings
                .layout
                .options(options.clone())
                .options([("default_transaction_isolation", settings.isolation.as_sql())])
                .application_name(ENGINE_APPLICATION),
        )
        .await
}

/// The engine's pool for a schedule on SQLite: a busy timeout drawn from the seed (one schedule
/// in three waits a quarter second for the write lock, then answers busy), and the statement
/// timeout that follows it.
async fn sqlite_engine(path: &Path, seed: u64) -> Result<SqlitePool, sqlx::Error> {
    let busy_timeout = if seed.is_multiple_of(3) {
        Duration::from_millis(250)
    } else {
        Duration::from_secs(3)
    };
    idemflow_sqlite::open_file(
        path,
        &idemflow_sqlite::OpenOptions::default()
            .with_busy_timeout(busy_timeout)
            .with_max_connections(16)
            .with_statement_timeout(None),
    )
    .await
}

/// The engine's pool for a schedule on MySQL/MariaDB: a lock wait timeout drawn from the seed
/// (one schedule in three waits one second for a row lock, then answers busy), and the statement
/// timeout that follows it (half that).
async fn mysql_engine(options: &MySqlConnectOptions, seed: u64) -> Result<MySqlPool, sqlx::Error> {
    let lock_wait_timeout = if seed.is_multiple_of(3) {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(3)
    };
    idemflow_mysql::pool_options(
        &idemflow_mysql::OpenOptions::default()
            .with_lock_wait_timeout(lock_wait_timeout)
            .with_statement_timeout(None)
            .with_max_connections(40),
    )
    .connect_with(options.clone())
    .await
}

/// The mock provider a simulation's schedules charge.
async fn start_provider() -> Result<MockProvider, sqlx::Error> {
    MockProvider::builder()
        .start()
        .await
        .map_err(sqlx::Error::Io)
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
    /// The engine it ran on (`postgres` or `sqlite`).
    pub engine: &'static str,
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
            "scripts/simulate --engine {} --seed {} --schedules 1 --verbose",
            self.engine, self.seed
        )
    }
}

impl fmt::Display for ScheduleReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.passed() {
            return write!(
                formatter,
                "seed {} on {}: ok ({:?})",
                self.seed, self.engine, self.counts
            );
        }
        writeln!(
            formatter,
            "seed {} on {}: {} violation(s); replay with: {}",
            self.seed,
            self.engine,
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
