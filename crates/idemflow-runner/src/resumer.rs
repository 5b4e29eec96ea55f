//! The resumer: finds started keys whose lease expired (their owner crashed, or a retryable error
//! set the lease to the next attempt time) and finishes them from their recovery point.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::deadline::Within;
use crate::engine::{Engine, KeyOwner, Taken};
use crate::error::RunError;
use crate::outcome::Outcome;
use crate::registry::Registry;
use crate::retention::Retention;
use crate::runner::Runner;

/// How a [`Resumer`] scans and how much it runs at once.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ResumerConfig {
    /// Keys taken over per scan (one statement); never more than the free slots. Default 64.
    pub batch_size: i64,
    /// Keys resumed at once. Default 16.
    pub concurrency: usize,
    /// The wait after an empty scan; it doubles up to `idle_max` while nothing is due, and drops
    /// back when work appears or a key due now is announced. Default 100 ms.
    pub idle_min: Duration,
    /// The longest wait between scans while nothing is due: how late a key whose lease simply
    /// ran out (nothing announced it) may be noticed. Default 5 s.
    pub idle_max: Duration,
    /// The longest wait after a database error; waits double from `idle_min` up to it. Default
    /// 30 s.
    pub error_backoff_max: Duration,
    /// On shutdown, how long keys in flight may take to finish before they are stopped. Default
    /// 30 s.
    pub shutdown_grace: Duration,
    /// How often the resumer reports its lag and counts due keys of workflows it does not know.
    /// Default 15 s.
    pub report_every: Duration,
    /// Deletes old finished keys periodically; `None` leaves retention to someone else. Default
    /// [`Retention::default`].
    pub retention: Option<Retention>,
    /// Wake at once when a key is announced due (`LISTEN` on a connection of its own, from the
    /// pool's options). Default `true`. Turn it off when the pool reaches PostgreSQL through a
    /// pooler in transaction mode: there `LISTEN` hears nothing and leaves a shared server
    /// connection subscribed, so a notification breaks another client's statement
    /// (docs/operations.md). Without it the resumer polls, at most `idle_max` apart.
    pub listen: bool,
}

impl Default for ResumerConfig {
    fn default() -> Self {
        Self {
            batch_size: 64,
            concurrency: 16,
            idle_min: Duration::from_millis(100),
            idle_max: Duration::from_secs(5),
            error_backoff_max: Duration::from_secs(30),
            shutdown_grace: Duration::from_secs(30),
            report_every: Duration::from_secs(15),
            retention: Some(Retention::default()),
            listen: true,
        }
    }
}

/// What one pass of [`Resumer::drain`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DrainReport {
    /// Keys taken over.
    pub taken: usize,
    /// Keys finished (a response stored).
    pub finished: usize,
    /// Keys that failed again and wait for their next attempt.
    pub interrupted: usize,
    /// Keys that could not be resumed (lost to another owner, or a database error).
    pub failed: usize,
}

/// Finishes abandoned keys of the registered workflows. Run one or many, in one process or many:
/// `FOR UPDATE SKIP LOCKED` splits the due keys between them, and the fencing token makes a slow
/// one harmless.
///
/// A worker registers every workflow (every version) whose keys it may finish, and runs until it
/// is told to stop:
///
/// ```no_run
/// # async fn example(
/// #     pool: sqlx::SqlitePool,
/// #     checkout_v1: idemflow_runner::Workflow<idemflow_sqlite::SqliteStore>,
/// #     checkout_v2: idemflow_runner::Workflow<idemflow_sqlite::SqliteStore>,
/// # ) -> Result<(), idemflow_runner::RegisterError> {
/// use idemflow_runner::{Registry, Resumer, Runner, shutdown_signal};
///
/// let mut registry = Registry::new();
/// registry.register(checkout_v1)?.register(checkout_v2)?;
/// let resumer = Resumer::new(Runner::new(pool), registry);
/// // Until Ctrl-C or SIGTERM; keys in flight then get `shutdown_grace` to finish.
/// resumer.run(shutdown_signal()).await;
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct Resumer<E: Engine> {
    runner: Runner<E>,
    registry: Arc<Registry<E>>,
    config: ResumerConfig,
    wake: Arc<Notify>,
}

impl<E: Engine> Clone for Resumer<E> {
    fn clone(&self) -> Self {
        Self {
            runner: self.runner.clone(),
            registry: Arc::clone(&self.registry),
            config: self.config.clone(),
            wake: Arc::clone(&self.wake),
        }
    }
}

/// A key a scan took over, with its workflow's name.
type Due<E> = (String, Taken<<E as Engine>::Owner>);

/// When the next scan is due: at once while scans find keys, backing off (doubling to
/// `idle_max`) while they find none, and (doubling to `error_backoff_max`) while they fail.
struct Pace {
    idle: Duration,
    error_backoff: Duration,
    next_scan_at: Instant,
    idle_min: Duration,
    idle_max: Duration,
    error_backoff_max: Duration,
}

impl Pace {
    fn new(config: &ResumerConfig) -> Self {
        Self {
            idle: config.idle_min,
            error_backoff: config.idle_min,
            next_scan_at: Instant::now(),
            idle_min: config.idle_min,
            idle_max: config.idle_max,
            error_backoff_max: config.error_backoff_max,
        }
    }

    fn scan_due(&self) -> bool {
        Instant::now() >= self.next_scan_at
    }

    fn until_next_scan(&self) -> Duration {
        self.next_scan_at.saturating_duration_since(Instant::now())
    }

    /// A scan took `taken` keys of the `free` slots it was offered.
    fn scanned(&mut self, taken: usize, free: i64) {
        if taken == 0 {
            self.next_scan_at = Instant::now() + self.idle;
            self.idle = (self.idle * 2).min(self.idle_max);
        } else {
            // Short of the free slots: every due key was taken; look again shortly.
            let short = i64::try_from(taken).unwrap_or(i64::MAX) < free;
            self.next_scan_at = if short {
                Instant::now() + self.idle_min
            } else {
                Instant::now()
            };
            self.idle = self.idle_min;
        }
        self.error_backoff = self.idle_min;
    }

    fn failed(&mut self, error: &RunError) {
        let retry_in = self.error_backoff;
        tracing::error!(%error, ?retry_in, "resumer scan failed; retrying");
        metrics::counter!("idemflow_resumer_errors_total").increment(1);
        self.next_scan_at = Instant::now() + self.error_backoff;
        self.error_backoff = (self.error_backoff * 2).min(self.error_backoff_max);
    }

    /// A key was announced due: scan now.
    fn woken(&mut self) {
        self.idle = self.idle_min;
        self.next_scan_at = Instant::now();
    }
}

/// The periodic chores' state: when each last ran, and what the last report said.
#[derive(Default)]
struct Chores {
    last_report: Option<Instant>,
    /// Due keys of workflows this resumer does not register, by workflow, as last reported.
    unknown: HashMap<String, i64>,
    last_retention: Option<Instant>,
    retention_task: Option<tokio::task::JoinHandle<()>>,
}

impl<E: Engine> Resumer<E> {
    /// A resumer of `registry`'s workflows, running their keys with `runner`, with the default
    /// [`ResumerConfig`].
    pub fn new(runner: Runner<E>, registry: Registry<E>) -> Self {
        Self::with_config(runner, registry, ResumerConfig::default())
    }

    /// As [`Resumer::new`], with `config`.
    pub fn with_config(runner: Runner<E>, registry: Registry<E>, config: ResumerConfig) -> Self {
        Self {
            runner,
            registry: Arc::new(registry),
            config,
            wake: Arc::new(Notify::new()),
        }
    }

    /// Wakes an idle resumer at once (in process); other processes are woken by notifications.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Takes over due keys until none is left and finishes them; for tests and one-shot jobs.
    /// Like [`Resumer::run`], it takes over only as many keys as it has free slots.
    pub async fn drain(&self) -> Result<DrainReport, RunError> {
        let mut report = DrainReport::default();
        let mut running: JoinSet<Option<Outcome>> = JoinSet::new();
        let mut owners: HashMap<tokio::task::Id, E::Owner> = HashMap::new();
        // A scan that came back short took every key due: the next waits for the keys running.
        let mut took_all_due = false;
        loop {
            let free = self.free_slots(running.len());
            let scan =
                (running.is_empty() || !took_all_due) && self.worth_a_scan(free, running.len());
            let due = if scan {
                self.scan(free).await?
            } else {
                Vec::new()
            };
            if due.is_empty() && running.is_empty() {
                return Ok(report);
            }
            if scan {
                took_all_due = i64::try_from(due.len()).unwrap_or(i64::MAX) < free;
            }
            report.taken += due.len();
            for due in due {
                self.start(&mut running, &mut owners, due);
            }
            if let Some(joined) = running.join_next_with_id().await {
                let outcome = self.joined(&mut owners, joined).await;
                tally(&mut report, outcome);
            }
        }
    }

    /// How many keys a scan may take over now: as many as can start at once, at most a batch.
    /// A key taken over and left waiting for a slot would lose its lease while it waits.
    fn free_slots(&self, running: usize) -> i64 {
        let free = self.config.concurrency.max(1).saturating_sub(running);
        i64::try_from(free)
            .unwrap_or(i64::MAX)
            .min(self.config.batch_size.max(1))
    }

    /// Whether to scan now: when nothing runs, or when at least half the slots are free, so that a
    /// busy resumer scans once per several keys rather than once per key.
    fn worth_a_scan(&self, free: i64, running: usize) -> bool {
        let half = i64::try_from(self.config.concurrency.max(1).div_ceil(2)).unwrap_or(1);
        free > 0 && (running == 0 || free >= half.min(self.config.batch_size.max(1)))
    }

    /// Starts resuming a key taken over, remembering whose it is until its task ends.
    fn start(
        &self,
        running: &mut JoinSet<Option<Outcome>>,
        owners: &mut HashMap<tokio::task::Id, E::Owner>,
        due: Due<E>,
    ) {
        let owner = due.1.owner.clone();
        let resumer = self.clone();
        let handle = running.spawn(async move { resumer.resume_one(due).await });
        owners.insert(handle.id(), owner);
    }

    /// Forgets a finished task's key. A task that panicked (a bug outside any phase: phases'
    /// panics are caught and recorded) left its key leased: its lease ends now, its attempt
    /// counted, so another attempt can run (and the attempt budget bounds how often).
    async fn joined(
        &self,
        owners: &mut HashMap<tokio::task::Id, E::Owner>,
        joined: Result<(tokio::task::Id, Option<Outcome>), tokio::task::JoinError>,
    ) -> Option<Outcome> {
        match joined {
            Ok((id, outcome)) => {
                owners.remove(&id);
                outcome
            }
            Err(error) => {
                if let Some(owner) = owners.remove(&error.id()) {
                    tracing::error!(tenant = %owner.tenant(), key = %owner.key(), %error, "a resumed key's task ended abnormally");
                    metrics::counter!("idemflow_resume_errors_total").increment(1);
                    self.give_back(&owner, "stopped: its task panicked").await;
                }
                None
            }
        }
    }

    /// Runs until `shutdown` completes: scans, resumes with bounded concurrency, backs off while
    /// idle or while the database is unreachable, runs retention. On shutdown it stops scanning,
    /// lets keys in flight finish within the grace period, and gives back those that did not
    /// (it never holds a key it has not started: it takes over only as many as it can start).
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let listener = self.config.listen.then(|| {
            tokio::spawn(E::listen_for_due(
                self.runner.pool().clone(),
                self.wake.clone(),
            ))
        });
        let mut running: JoinSet<Option<Outcome>> = JoinSet::new();
        let mut owners: HashMap<tokio::task::Id, E::Owner> = HashMap::new();
        let mut pace = Pace::new(&self.config);
        let mut chores = Chores::default();
        let concurrency = self.config.concurrency.max(1);
        tracing::info!(workflows = ?self.registry.names(), concurrency, "resumer started");

        loop {
            self.chores(&mut chores).await;
            // Take over what can start now, when a scan is due: never more than the free slots.
            let free = self.free_slots(running.len());
            if self.worth_a_scan(free, running.len()) && pace.scan_due() {
                match self.scan(free).await {
                    Ok(due) => {
                        let taken = due.len();
                        for due in due {
                            self.start(&mut running, &mut owners, due);
                        }
                        pace.scanned(taken, free);
                    }
                    Err(error) => pace.failed(&error),
                }
            }
            // Wait for a free slot, the next scan, a wake-up, or shutdown.
            let wait = if running.len() >= concurrency {
                Duration::MAX
            } else {
                pace.until_next_scan()
            };
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                Some(joined) = running.join_next_with_id(), if !running.is_empty() => {
                    self.joined(&mut owners, joined).await;
                }
                () = self.wake.notified() => pace.woken(),
                () = sleep_unless_max(wait) => {}
            }
        }

        tracing::info!(running = running.len(), "resumer shutting down");
        if let Some(listener) = listener {
            listener.abort();
        }
        self.stop(running, owners).await;
        if let Some(task) = chores.retention_task {
            task.abort();
        }
        tracing::info!("resumer stopped");
    }

    /// The periodic chores between scans: the report of due keys no resumer here knows, and
    /// retention (one run at a time, in a task of its own).
    async fn chores(&self, chores: &mut Chores) {
        if due(chores.last_report, self.config.report_every) {
            self.report(&mut chores.unknown).await;
            chores.last_report = Some(Instant::now());
        }
        if let Some(retention) = self.config.retention
            && due(chores.last_retention, retention.every)
            && chores
                .retention_task
                .as_ref()
                .is_none_or(|task| task.is_finished())
        {
            let pool = self.runner.pool().clone();
            chores.retention_task = Some(tokio::spawn(async move {
                if let Err(error) = retention.expire_on::<E>(&pool).await {
                    tracing::error!(%error, "retention failed; it runs again next time");
                }
            }));
            chores.last_retention = Some(Instant::now());
        }
    }

    /// On shutdown: lets keys in flight finish within the grace period, stops those that did
    /// not, and gives every stopped key back.
    async fn stop(
        &self,
        mut running: JoinSet<Option<Outcome>>,
        mut owners: HashMap<tokio::task::Id, E::Owner>,
    ) {
        let grace = tokio::time::sleep(self.config.shutdown_grace);
        tokio::pin!(grace);
        while !running.is_empty() {
            tokio::select! {
                Some(joined) = running.join_next_with_id() => {
                    self.joined(&mut owners, joined).await;
                }
                () = &mut grace => {
                    tracing::warn!(running = running.len(), "grace period over: stopping keys in flight");
                    running.abort_all();
                    while running.join_next().await.is_some() {}
                    break;
                }
            }
        }
        // Whatever was stopped rolled back its open transaction; its lease ends now too. Its
        // attempt counts: it had started.
        for owner in owners.values() {
            self.give_back(owner, "stopped: the resumer shut down")
                .await;
        }
    }

    /// Takes over up to `limit` due keys of the registered workflows (one statement).
    async fn scan(&self, limit: i64) -> Result<Vec<Due<E>>, RunError> {
        if self.registry.is_empty() {
            return Ok(Vec::new());
        }
        let wait = self.runner.config.database_timeout;
        // Each key gets its own workflow's lease. Unanswered, the scan may still have taken keys
        // over: their leases run out and the next scan takes them again (the fence keeps this
        // scan's tokens from ever writing).
        let due = E::take_over_due(self.runner.pool(), &self.registry.leases(), limit)
            .within(wait)
            .await??;
        if !due.is_empty() {
            tracing::debug!(taken = due.len(), "resumer took over due keys");
        }
        Ok(due)
    }

    async fn resume_one(&self, (name, taken): Due<E>) -> Option<Outcome> {
        let Some(workflow) = self.registry.get(&name) else {
            // take_over_due only returns registered workflows; kept for safety.
            tracing::error!(workflow = name, "no such workflow registered");
            return None;
        };
        let started = Instant::now();
        let owner = &taken.owner;
        let (tenant, key) = (owner.tenant().clone(), owner.key().clone());
        match self.runner.resume(workflow, taken).await {
            Ok(outcome) => {
                metrics::histogram!("idemflow_resume_duration_seconds")
                    .record(started.elapsed().as_secs_f64());
                Some(outcome)
            }
            Err(error) => {
                tracing::error!(%tenant, %key, %error, "could not resume key");
                metrics::counter!("idemflow_resume_errors_total").increment(1);
                None
            }
        }
    }

    /// Ends the lease of a key whose run was stopped, now; its attempt counts (it had started).
    async fn give_back(&self, owner: &E::Owner, why: &str) {
        let why = idemflow_store::LastError::new(why);
        let giving_back = E::postpone_alone(self.runner.pool(), owner, Duration::ZERO, &why);
        let given_back = match giving_back
            .within(self.runner.config.database_timeout)
            .await
        {
            Ok(given_back) => given_back.map_err(RunError::from),
            Err(timeout) => Err(timeout),
        };
        match given_back {
            Ok(()) => {
                tracing::info!(tenant = %owner.tenant(), key = %owner.key(), "stopped key given back")
            }
            Err(error) => {
                tracing::warn!(tenant = %owner.tenant(), key = %owner.key(), %error, "stopped key not given back")
            }
        }
    }

    /// Reports the lag, and due keys no registered workflow can finish: logged and counted, and
    /// left for a resumer that knows their workflow. `unknown` holds what the last report found.
    async fn report(&self, unknown: &mut HashMap<String, i64>) {
        // A report is worth nothing late: bounded as a whole.
        let limit = 3 * self.runner.config.database_timeout;
        if self.report_within(unknown).within(limit).await.is_err() {
            tracing::warn!("the resumer's report got no answer from the database");
        }
    }

    async fn report_within(&self, reported: &mut HashMap<String, i64>) {
        let pool = self.runner.pool();
        match E::resumer_lag(pool).await {
            Ok(lag) => metrics::gauge!("idemflow_resumer_lag_seconds").set(lag.as_secs_f64()),
            Err(error) => tracing::warn!(%error, "could not read the resumer lag"),
        }
        match E::count_due_unknown(pool, &self.registry.names()).await {
            Ok(unknown) => {
                let now: HashMap<String, i64> = unknown.into_iter().collect();
                for (workflow, &count) in &now {
                    // Said once at WARN when such keys appear; every report after only counts
                    // them (the gauge), so a standing condition does not fill the log.
                    if reported.contains_key(workflow) {
                        tracing::debug!(workflow, count, "due keys of an unregistered workflow");
                    } else {
                        tracing::warn!(
                            workflow,
                            count,
                            "keys past their lease belong to a workflow this resumer does not \
                             register: left for a resumer that registers it"
                        );
                    }
                    metrics::gauge!("idemflow_resumer_unknown_workflow_keys", "workflow" => workflow.clone())
                        .set(count as f64);
                }
                // A workflow whose keys are gone (finished elsewhere, expired) reads 0 again, or
                // its alert would stand until the process restarts.
                for workflow in reported
                    .keys()
                    .filter(|workflow| !now.contains_key(*workflow))
                {
                    tracing::info!(workflow, "no more due keys of an unregistered workflow");
                    metrics::gauge!("idemflow_resumer_unknown_workflow_keys", "workflow" => workflow.clone())
                        .set(0.0);
                }
                *reported = now;
            }
            Err(error) => tracing::warn!(%error, "could not count keys of unknown workflows"),
        }
    }
}

fn tally(report: &mut DrainReport, outcome: Option<Outcome>) {
    match outcome {
        Some(Outcome::Executed(_) | Outcome::Forgotten(_)) => report.finished += 1,
        Some(Outcome::Interrupted { .. }) => report.interrupted += 1,
        _ => report.failed += 1,
    }
}

fn due(last: Option<Instant>, every: Duration) -> bool {
    last.is_none_or(|last| last.elapsed() >= every)
}

async fn sleep_unless_max(wait: Duration) {
    if wait == Duration::MAX {
        std::future::pending::<()>().await;
    } else {
        tokio::time::sleep(wait).await;
    }
}

/// Completes on Ctrl-C or SIGTERM: pass it to [`Resumer::run`] from a worker's `main`.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(signal) => signal,
            Err(error) => {
                tracing::error!(%error, "cannot listen for SIGTERM; only Ctrl-C stops this worker");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

idemflow_core::with_setters! {
    ResumerConfig {
        with_batch_size => batch_size: i64,
        with_concurrency => concurrency: usize,
        with_idle_min => idle_min: Duration,
        with_idle_max => idle_max: Duration,
        with_error_backoff_max => error_backoff_max: Duration,
        with_shutdown_grace => shutdown_grace: Duration,
        with_report_every => report_every: Duration,
        with_retention => retention: Option<Retention>,
        with_listen => listen: bool,
    }
}
