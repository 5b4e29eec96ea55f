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
use sqlx::postgres::PgPoolOptions;

pub use rng::Rng;
pub use world::Counts;

use crate::provider::MockProvider;

/// The `application_name` of the engine's connections (the ones a schedule kills).
pub const ENGINE_APPLICATION: &str = "idemflow-sim-engine";

/// The `application_name` of the schedule's own connections (never killed).
pub const OBSERVER_APPLICATION: &str = "idemflow-sim-observer";

/// Runs schedules against one database.
pub struct Simulation {
    engine: PgPool,
    observer: PgPool,
    provider: Arc<MockProvider>,
}

impl fmt::Debug for Simulation {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.debug_struct("Simulation").finish_non_exhaustive()
    }
}

impl Simulation {
    /// Prepares schedules on the database `pool` reaches (migrated): the engine's own pool, an
    /// observer's, the tables the scripted workflow writes, and a mock provider on loopback.
    /// Schedules run one at a time; each has a tenant of its own.
    pub async fn new(pool: &PgPool) -> Result<Self, sqlx::Error> {
        let options = pool.connect_options().as_ref().clone();
        let engine = PgPoolOptions::new()
            .max_connections(40)
            .test_before_acquire(false)
            .connect_with(options.clone().application_name(ENGINE_APPLICATION))
            .await?;
        let observer = PgPoolOptions::new()
            .max_connections(4)
            .connect_with(options.application_name(OBSERVER_APPLICATION))
            .await?;
        for statement in [
            // claimed_at: the claim the effect was made under (a key deleted by the forget
            // policy and claimed again is another claim of the same request).
            "CREATE TABLE IF NOT EXISTS sim_effects (tenant text NOT NULL, key text NOT NULL, \
             life bigint NOT NULL, phase text NOT NULL, lock_version bigint NOT NULL, \
             claimed_at text)",
            "CREATE TABLE IF NOT EXISTS sim_parents (id int PRIMARY KEY)",
            "CREATE TABLE IF NOT EXISTS sim_orphans (parent int REFERENCES sim_parents (id) \
             DEFERRABLE INITIALLY DEFERRED)",
        ] {
            sqlx::query(statement).execute(&observer).await?;
        }
        let provider = MockProvider::builder()
            .start()
            .await
            .map_err(sqlx::Error::Io)?;
        Ok(Self {
            engine,
            observer,
            provider: Arc::new(provider),
        })
    }

    /// Runs the schedule `seed` names, and checks it.
    pub async fn run(&self, seed: u64) -> ScheduleReport {
        world::run(self, seed).await
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
