//! One schedule: its actors, the actions the seed picks, what is observed on the way, and the
//! end: every actor let go, the keys brought to an end by client retries alone, replays read back,
//! and the checks of `check.rs`.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse, TenantId};
use idemflow_runner::{
    ConnectionOf, CrashHook, CrashPoint, Keyring, Outcome, PhaseContext, PoolOf, Registry, Request,
    Resumer, ResumerConfig, RunError, Runner, RunnerConfig, SealError, TerminalPolicy,
};
use serde_json::Value;
use tokio::task::JoinSet;

use super::engine::SimEngine;
use super::observe::{Lapse, Observe};
use super::rng::Rng;
use super::scheduler::{ACTOR, ActorId, Point, Scheduler, Verdict, Waiting};
use super::workflow::{self, Act, ProviderFault, SimRequest, TransactionEnd};
use super::{ScheduleReport, Settings};
use idemflow_testkit::provider::MockProvider;
use idemflow_testkit::provider_client::ProviderClient;

/// The lease of the sim workflow: long, so that leases end only when the schedule says so.
pub(crate) const LEASE: Duration = Duration::from_secs(30);

/// The retention window of the schedule's operator.
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// How far a time jump moves the clock, in hours: past the retention window.
const JUMP_HOURS: i64 = 25;

/// The schedule waits this long without an event before it acts again.
const QUIET: Duration = Duration::from_millis(8);
const LONGEST_SETTLE: Duration = Duration::from_millis(250);

/// How long the actors get to end once nobody waits any more.
const WIND_DOWN: Duration = Duration::from_secs(30);

/// What the seed chose for a schedule.
#[derive(Debug, Clone)]
pub(crate) struct Setup {
    pub keys: usize,
    pub steps: usize,
    pub terminal: TerminalPolicy,
    /// (batch size, concurrency) of each resumer.
    pub resumers: Vec<(i64, usize)>,
    /// Keys whose one phase always fails the same way (a poison request): (key, phase, act).
    pub poison: Vec<(usize, &'static str, Act)>,
    /// The settings around the engine: layout, isolation, bodies apart, sealing, a consumer.
    pub settings: Settings,
}

impl Setup {
    fn draw(rng: &mut Rng) -> Self {
        let keys = rng.between(2, 5) as usize;
        // The first resumer takes bigger batches than it runs at once, as a busy worker would.
        let resumers = (0..rng.between(1, 4))
            .map(|index| {
                let concurrency = if index == 0 || rng.chance(0.7) { 1 } else { 2 };
                let batch = rng.between(if index == 0 { 2 } else { 1 }, 4) as i64;
                (batch, concurrency)
            })
            .collect();
        let terminal = if rng.chance(0.4) {
            TerminalPolicy::Forget
        } else {
            TerminalPolicy::Store
        };
        let mut poison = Vec::new();
        for key in 0..keys {
            if rng.chance(0.15) {
                let (phase, act) = rng.weighted(&[
                    (2, ("reserve", Act::Unstorable)),
                    (2, ("charge", Act::Unstorable)),
                    (1, ("complete", Act::Panic)),
                    (1, ("price", Act::BreakCommit)),
                    (1, ("price", Act::HangInDatabase)),
                    (1, ("reserve", Act::HangInWrite)),
                    (1, ("price", Act::HugeError)),
                    (1, ("reserve", Act::NulError)),
                    (1, ("charge", Act::Provider(ProviderFault::Unavailable))),
                ]);
                poison.push((key, phase, act));
            }
        }
        let steps = rng.between(45, 70) as usize;
        Self {
            keys,
            steps,
            terminal,
            resumers,
            poison,
            settings: Settings::draw(rng),
        }
    }
}

/// What the actors and the hook share with the schedule.
pub(crate) struct Shared {
    pub scheduler: Scheduler,
    /// The schedule's reads and chaos on the engine it runs on.
    pub observer: Arc<dyn Observe>,
    pub provider: Arc<MockProvider>,
    pub provider_client: ProviderClient,
    pub tenant: TenantId,
    /// The keyring the schedule's runner seals with, if it drew sealing: what the observer opens
    /// stored values with.
    pub keyring: Option<Keyring>,
    pub calls: Calls,
    pub log: Mutex<Log>,
    poison: HashMap<String, (&'static str, Act)>,
    /// When each actor's last local phase ended, by the database clock (epoch seconds).
    phase_ends: Mutex<HashMap<ActorId, f64>>,
    /// Client requests running, by key and life.
    requests_running: Mutex<HashMap<(String, u32), usize>>,
    began: Instant,
}

/// What a schedule saw, for the checks.
#[derive(Default)]
pub(crate) struct Log {
    pub history: Vec<String>,
    pub violations: Vec<String>,
    /// The token each actor last ran a phase with, and for which key.
    pub tokens_of: HashMap<ActorId, (String, i64)>,
    /// Tokens seen committed on each key.
    pub committed: HashMap<String, HashSet<i64>>,
    /// Responses clients were given, by key and life.
    pub executed: Vec<(String, u32, StoredResponse)>,
    pub replayed: Vec<(String, u32, StoredResponse)>,
    /// Keys whose last answer was `Forgotten` (deleted by the forget policy), with that life.
    pub forgotten: HashMap<String, u32>,
    /// Keys retention deleted once their window was over: a request of the same life still in
    /// flight then runs it again, rightly (after its window a key is new).
    pub expired: HashSet<String>,
    /// Actors told they were fenced.
    pub fenced: Vec<(ActorId, String)>,
    /// The highest attempt each key's phases started at (the engine's count at the phase's
    /// recovery point, as the phase is told it), and that phase.
    pub phase_attempts: HashMap<String, (u32, &'static str)>,
    /// Every token seen on each key, with the claim (its time) it was seen on.
    pub tokens_seen: HashMap<(String, i64), String>,
    /// Runs whose phase ended the runner's transaction, by actor: the key and token they ran,
    /// whether the phase committed that transaction, and how many engine connections the world
    /// had killed by then.
    pub ended_runs: HashMap<ActorId, (String, i64, bool, u64)>,
    /// The (key, token) of every such run: its effects escaped the runner's transaction.
    pub escaped: HashSet<(String, i64)>,
    pub counts: Counts,
}

/// How much of each thing a schedule did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Turns granted to an actor waiting at a crash point or at the start of a phase.
    pub grants: u64,
    /// Runs stopped at a crash point, as if their process died.
    pub crashes: u64,
    /// Client requests sent: first attempts, retries, and new requests under a forgotten key.
    pub requests: u64,
    /// Resumer drains started.
    pub drains: u64,
    /// Leases expired by rewinding them in SQL.
    pub lease_expiries: u64,
    /// Leases an operator ended (`idemflow end-lease`).
    pub leases_ended: u64,
    /// Keys an operator expired from the console, one at a time.
    pub keys_expired: u64,
    /// Retention runs by the operator.
    pub expiries: u64,
    /// Clock jumps (25 hours, past the retention window).
    pub time_jumps: u64,
    /// Engine connections killed by the server.
    pub kills: u64,
    /// Deliveries to the consumer on the engine's pool.
    pub deliveries: u64,
    /// Stored phase outputs corrupted, as a deploy changing a type would.
    pub corruptions: u64,
    /// Foreign calls started (each checked: by the owner, on a live lease).
    pub calls: u64,
    /// Contended transfers sent (`transfer.rs`; PostgreSQL and MariaDB).
    pub transfers: u64,
    /// Their phases' runs past one per phase: transactions the database refused and the runner
    /// ran again (in place, or as a new attempt past the restarts).
    pub transfer_reruns: u64,
}

impl Shared {
    pub(crate) fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn running(&self) -> MutexGuard<'_, HashMap<(String, u32), usize>> {
        self.requests_running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn started_request(&self, key: &str, life: u32) {
        *self.running().entry((key.to_owned(), life)).or_default() += 1;
    }

    pub(crate) fn ended_request(&self, key: &str, life: u32) {
        if let Some(count) = self.running().get_mut(&(key.to_owned(), life)) {
            *count = count.saturating_sub(1);
        }
    }

    /// Client requests of `key`'s `life` still running.
    pub(crate) fn in_flight(&self, key: &str, life: u32) -> usize {
        self.running()
            .get(&(key.to_owned(), life))
            .copied()
            .unwrap_or(0)
    }

    /// The life a stored request names (opened first when the schedule seals).
    pub(crate) fn life_of(&self, key: &str, request: Value) -> Option<i64> {
        let request = match (&self.keyring, Key::parse(key)) {
            (Some(keyring), Ok(key)) => keyring.open_request(&self.tenant, &key, request).ok()?,
            _ => request,
        };
        request.get("life").and_then(Value::as_i64)
    }

    pub(crate) fn event(&self, actor: ActorId, what: impl std::fmt::Display) {
        let line = format!(
            "+{:>6} ms {actor:>4} {what}",
            self.began.elapsed().as_millis()
        );
        if std::env::var_os("IDEMFLOW_SIM_TRACE").is_some() {
            eprintln!("{} {line}", self.tenant.as_str());
        }
        self.log().history.push(line);
    }

    pub(crate) fn violation(&self, what: String) {
        let line = format!("+{} ms: {what}", self.began.elapsed().as_millis());
        self.log().history.push(format!("VIOLATION {what}"));
        self.log().violations.push(line);
    }

    /// A phase of `actor`'s run is about to end the runner's transaction under it.
    pub(crate) fn note_transaction_ended(&self, actor: ActorId, context: &PhaseContext) {
        let (key, token) = (context.key.as_str().to_owned(), context.lock_version);
        let mut log = self.log();
        log.escaped.insert((key.clone(), token));
        let kills = log.counts.kills;
        log.ended_runs.insert(actor, (key, token, false, kills));
    }

    /// The phase of `actor`'s run committed the runner's transaction: the claim or takeover and
    /// every effect so far with it, outside the runner's care.
    pub(crate) fn note_transaction_committed(&self, actor: ActorId) {
        if let Some(run) = self.log().ended_runs.get_mut(&actor) {
            run.2 = true;
        }
    }

    pub(crate) fn note_token(&self, actor: ActorId, context: &PhaseContext) {
        self.log().tokens_of.insert(
            actor,
            (context.key.as_str().to_owned(), context.lock_version),
        );
    }

    /// A phase of a key starts at the attempt its context names: what the policy's budget
    /// bounds (check.rs). Not the key's row: its count may go higher (see check.rs).
    pub(crate) fn note_phase_attempt(&self, phase: &'static str, context: &PhaseContext) {
        let mut log = self.log();
        let most = log
            .phase_attempts
            .entry(context.key.as_str().to_owned())
            .or_insert((0, phase));
        if context.attempt > most.0 {
            *most = (context.attempt, phase);
        }
    }

    /// What a phase does when the schedule is winding down: it heals, unless the key is poison.
    pub(crate) fn settled_act(&self, key: &str, phase: &'static str) -> Act {
        match self.poison.get(key) {
            Some((poisoned, act)) if *poisoned == phase => *act,
            _ => Act::Succeed,
        }
    }

    /// A foreign call may start only by the key's owner, on a live lease, before the phase's
    /// result was recorded, for the request the key holds.
    pub(crate) async fn check_caller(
        &self,
        actor: ActorId,
        context: &PhaseContext,
        life: u32,
        phase: &str,
    ) {
        self.log().counts.calls += 1;
        let row = self
            .observer
            .caller_view(&context.tenant, context.key.as_str())
            .await;
        let key = context.key.as_str();
        let problem = match row {
            Err(error) => Some(format!("reading the key failed: {error}")),
            Ok(None) => Some("the key does not exist".to_owned()),
            Ok(Some(view)) => {
                let (token, state, point, live) = (
                    view.lock_version,
                    view.state,
                    view.recovery_point,
                    view.live,
                );
                let row_life = self.life_of(key, view.request);
                if state != "started" {
                    Some(format!("the key is {state}"))
                } else if token != context.lock_version {
                    Some(format!(
                        "the caller holds token {} but the key's is {token}",
                        context.lock_version
                    ))
                } else if live != Some(true) {
                    Some("the caller's lease has expired".to_owned())
                } else if !["start", "reserve", "price"].contains(&point.as_str()) {
                    Some(format!(
                        "the {phase} result is already recorded (at {point})"
                    ))
                } else if row_life != Some(i64::from(life)) {
                    Some(format!(
                        "the caller works for life {life}, the key holds life {row_life:?}"
                    ))
                } else {
                    None
                }
            }
        };
        if let Some(problem) = problem {
            self.violation(format!(
                "{actor} called {phase} for key {key} as a stale owner: {problem}"
            ));
        }
    }

    /// Notes, in the phase's transaction, when a local phase ended by the database clock. The
    /// engine records the phase right after (no wait in between), so a lease measured from that
    /// record ends no earlier than this plus the lease.
    pub(crate) async fn note_phase_end<E: SimEngine>(
        &self,
        connection: &mut ConnectionOf<E>,
    ) -> Result<(), idemflow_runner::PhaseError> {
        let ended = E::clock(connection).await?;
        let actor = self.scheduler.current();
        self.phase_ends
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(actor, ended);
        Ok(())
    }

    /// At a commit that recorded a phase before a call: the lease must be whole, measured from
    /// the record (that is, no earlier than the end of the phase it records), however long the
    /// transaction had run.
    async fn check_fresh_lease(&self, actor: ActorId, key: &str, recorded: bool) {
        let ended = self
            .phase_ends
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&actor);
        let Some((until, token)) = self.observer.started_lease(&self.tenant, key).await else {
            return;
        };
        self.log()
            .committed
            .entry(key.to_owned())
            .or_default()
            .insert(token);
        if let (true, Some(ended)) = (recorded, ended) {
            // Allowing for the clock's rounding.
            let short = ended + LEASE.as_secs_f64() - until;
            if short > self.observer.clock_resolution() {
                self.violation(format!(
                    "{actor} committed key {key} with a lease {short:.3} s short of a whole one \
                     (measured from before its last phase ended)"
                ));
            }
        }
    }

    async fn note_committed(&self, key: &str) {
        if let Some(token) = self.observer.token(&self.tenant, key).await {
            self.log()
                .committed
                .entry(key.to_owned())
                .or_default()
                .insert(token);
        }
    }

    fn record(&self, actor: ActorId, key: &str, life: u32, result: &Result<Outcome, RunError>) {
        let what = describe(result);
        self.event(actor, format!("answered {key} (life {life}): {what}"));
        let mut log = self.log();
        let ended = log
            .ended_runs
            .remove(&actor)
            .filter(|(ran, _, _, _)| ran == key);
        // 201 is the workflow's success; a 500 (the ended transaction, a give-up) or the failure
        // path's 502 are what such a run may end with.
        if ended.is_some()
            && let Ok(Outcome::Executed(response)) = result
            && response.status == 201
        {
            drop(log);
            self.violation(format!(
                "{actor}'s run of key {key} (life {life}) ended the runner's transaction in a \
                 phase, and was answered {} as if it had succeeded: its work was recorded over a \
                 transaction that had ended",
                response.status
            ));
            return;
        }
        // A phase that committed the runner's transaction committed its effects: a retry would
        // apply them again. Only a rollback the database made whole leaves such a run to be
        // tried again. Unless a connection was killed since: one lost with its transaction's
        // end unread can no longer tell (docs/runner.md), and the row tells only of a claim or
        // takeover.
        if let Some((_, _, true, kills)) = ended
            && kills == log.counts.kills
            && let Ok(Outcome::Interrupted { error, .. }) = result
        {
            drop(log);
            self.violation(format!(
                "{actor}'s run of key {key} (life {life}) committed the runner's transaction in \
                 a phase, and was left to be tried again ({error}): its committed effects would \
                 be applied twice"
            ));
            return;
        }
        match result {
            Ok(Outcome::Executed(response)) => {
                log.executed.push((key.to_owned(), life, response.clone()));
            }
            Ok(Outcome::Replayed(response)) => {
                log.replayed.push((key.to_owned(), life, response.clone()));
            }
            Ok(Outcome::Forgotten(_)) => {
                log.forgotten.insert(key.to_owned(), life);
            }
            Err(RunError::Fenced) => log.fenced.push((actor, key.to_owned())),
            // No schedule alters a stored response: one that does not open was read with a row
            // it does not belong to (a body apart of another life of the key, say).
            Err(RunError::Sealing(SealError::NotAuthentic { what })) if what == "response" => {
                drop(log);
                self.violation(format!(
                    "a replay of key {key} (life {life}) read a stored response that does not open \
                     under its row (a body of another row or life)"
                ));
            }
            _ => {}
        }
    }
}

/// Foreign calls in flight, by derived key: two at once with one key means two owners believed
/// they held the key at the same time.
#[derive(Default)]
pub(crate) struct Calls {
    in_flight: Mutex<Vec<(String, ActorId, u64)>>,
    next: AtomicU64,
}

impl Calls {
    pub(crate) fn begin<'s>(
        &'s self,
        shared: &'s Shared,
        actor: ActorId,
        derived_key: &str,
    ) -> CallGuard<'s> {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let overlapping: Vec<ActorId> = {
            let mut in_flight = self
                .in_flight
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let overlapping = in_flight
                .iter()
                .filter(|(key, other, _)| key == derived_key && *other != actor)
                .map(|(_, other, _)| *other)
                .collect();
            in_flight.push((derived_key.to_owned(), actor, id));
            overlapping
        };
        shared.event(actor, format!("calls {derived_key}"));
        for other in overlapping {
            shared.violation(format!(
                "{actor} called {derived_key} while {other}'s call with it was in flight"
            ));
        }
        CallGuard { shared, actor, id }
    }
}

/// Ends a call's registration however the call ends (returned, failed, or dropped by a timeout
/// or a lost lease); the caller no longer relies on its lease.
pub(crate) struct CallGuard<'s> {
    shared: &'s Shared,
    actor: ActorId,
    id: u64,
}

impl Drop for CallGuard<'_> {
    fn drop(&mut self) {
        self.shared
            .calls
            .in_flight
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(_, _, id)| *id != self.id);
        self.shared.scheduler.conceal(self.actor);
    }
}

/// The engine's crash points, as the schedule's yield points.
#[derive(Debug)]
struct Hook(Arc<Shared>);

impl std::fmt::Debug for Shared {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Shared")
            .field("tenant", &self.tenant)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl CrashHook for Hook {
    async fn crash_at(&self, point: &CrashPoint, _: &TenantId, key: &Key) -> bool {
        let shared = &self.0;
        let actor = shared.scheduler.current();
        let key = key.as_str();
        match point {
            CrashPoint::AfterCommit { phase } => {
                // From here to the end of its call, the owner relies on the lease it just wrote.
                shared.scheduler.expose(actor, key);
                shared
                    .check_fresh_lease(actor, key, *phase != "claim")
                    .await;
            }
            CrashPoint::BeforeCall { .. } => shared.scheduler.expose(actor, key),
            CrashPoint::AfterCall { .. } => shared.scheduler.conceal(actor),
            CrashPoint::AfterFinish => shared.note_committed(key).await,
            _ => {}
        }
        let name = point.to_string();
        shared.event(actor, format!("waits at {name} of {key}"));
        let verdict = shared.scheduler.park(actor, key, Point::Engine(name)).await;
        if matches!(point, CrashPoint::BeforeCommit { .. }) && verdict != Verdict::Crash {
            // Let go to commit, the owner relies on its lease from here: the commit writes the
            // lease it goes on with, and the after-commit hook (where it is read back and where
            // exposure began before) comes only once the commit has returned. A lease the world
            // expired between the two, when a slow commit let a step run there, was read back as
            // the commit's own (a false "lease short of a whole one") and left the owner calling
            // under a lease its clock says is fresh. Held at before-commit, the owner is still
            // fair game: the world expires leases of owners parked there.
            shared.scheduler.expose(actor, key);
        }
        verdict == Verdict::Crash
    }
}

/// A key as the schedule sees it.
#[derive(Debug, Clone, Default)]
struct KeySeen {
    /// The request life its client sends now.
    life: u32,
    /// From the last sample: present, its state, token and lease end (as text, to compare).
    row: Option<RowSeen>,
    /// The token and lease end were the same in the sample before: no owner wrote its lease
    /// just now. A lease written a moment ago may belong to an owner on its way to its call
    /// (between the write and the point where it says it relies on it); expiring it then would
    /// model an owner frozen between its check and its call.
    settled: bool,
    /// Deleted by retention once its window was over: nothing more is asked of it.
    retired: bool,
}

#[derive(Debug, Clone)]
struct RowSeen {
    state: String,
    lock_version: i64,
    locked_until: Option<String>,
    recovery_point: String,
    created_at: String,
    life: Option<i64>,
    /// Started with its lease over.
    due: bool,
}

/// What the seed picks next.
#[derive(Debug, Clone, Copy)]
enum Action {
    Grant,
    Request,
    /// A client sends one request two or three times at once (a double click, a retry fired
    /// before the first attempt answered, duplicate deliveries).
    Burst,
    /// A message is delivered to the consumer sharing the engine's pool (settings: consumer),
    /// and the delivery is sometimes dropped part-way (a timeout, a shutdown).
    Deliver,
    Drain,
    ExpireLease,
    ExpireAll,
    Stall,
    EndLease,
    /// An operator expires one key from the console, as it was shown (token and state).
    ExpireKey,
    Retention,
    TimeJump,
    Kill,
    Corrupt,
}

pub(crate) struct World<E: SimEngine> {
    /// The engine's pool, opened for this schedule's settings and closed at its end.
    engine: PoolOf<E>,
    /// When each actor may be granted a step again: a few are frozen for a while (a paused
    /// process, a long garbage collection), so others overtake them.
    frozen_until: HashMap<ActorId, usize>,
    /// Replays held before their body apart that wait until no newer life of their key runs.
    patient: HashMap<ActorId, bool>,
    /// The life each client actor sent.
    lives: HashMap<ActorId, u32>,
    step: usize,
    /// Keys whose lease the schedule expired lately: a client is likelier to retry them now.
    lapsed: Vec<usize>,
    /// Per resumer, each key's token as last sampled when its latest drain began. While that
    /// drain runs, a key whose token has changed since may be one it took over: its owner relies
    /// on the lease it wrote from the takeover on, before it reaches any point that says so (the
    /// takeover is the drain's, not the key's run's), so its lease is not the world's to expire.
    drain_tokens: Vec<Vec<Option<i64>>>,
    /// Where the server's log ended when the schedule began (PostgreSQL): what it logs for the
    /// schedule's keys is checked at the end.
    server_log: Option<Result<crate::server_log::ServerLog, String>>,
    /// The key page an operator has open in the console, as it was when read: an action on it
    /// comes later, when the key may have moved on.
    page: Option<(usize, RowSeen)>,
    shared: Arc<Shared>,
    rng: Rng,
    setup: Setup,
    runner: Runner<E>,
    workflow: Arc<idemflow_runner::Workflow<E>>,
    resumers: Vec<(Resumer<E>, Arc<AtomicBool>)>,
    /// The consumer on the engine's pool (used when the settings say so).
    consumer: Arc<idemflow_consumer::Consumer<E>>,
    keys: Vec<KeySeen>,
    actors: JoinSet<()>,
}

/// Runs the schedule `seed` names on the engine `open` opens for the settings the seed draws
/// (its pool, and the observer beside it).
pub(crate) async fn run<E, Open, Opening>(
    provider: &Arc<MockProvider>,
    seed: u64,
    open: Open,
) -> ScheduleReport
where
    E: SimEngine,
    Open: FnOnce(Settings) -> Opening,
    Opening: Future<Output = Result<(PoolOf<E>, Arc<dyn Observe>), sqlx::Error>>,
{
    let mut rng = Rng::new(seed);
    let setup = Setup::draw(&mut rng);
    let tenant = TenantId::new(format!("sim-{seed}"))
        .unwrap_or_else(|error| unreachable!("a valid tenant: {error}"));
    let poison = setup
        .poison
        .iter()
        .map(|(key, phase, act)| (key_name(*key), (*phase, *act)))
        .collect();
    let settings = setup.settings;
    let (engine, observer) = match open(settings).await {
        Ok(opened) => opened,
        Err(error) => {
            return ScheduleReport {
                seed,
                engine: E::NAME,
                violations: vec![format!("the engine's pool could not connect: {error}")],
                history: Vec::new(),
                counts: Counts::default(),
            };
        }
    };
    let keyring = settings
        .sealed
        .then(|| Keyring::new("sim", [7; 32]).unwrap_or_else(|_| unreachable!("a valid key id")));
    let shared = Arc::new(Shared {
        scheduler: Scheduler::default(),
        observer,
        provider: provider.clone(),
        provider_client: ProviderClient::builder(provider.url())
            .timeout(Duration::from_millis(400))
            .build(),
        tenant,
        keyring: keyring.clone(),
        calls: Calls::default(),
        log: Mutex::new(Log::default()),
        poison,
        phase_ends: Mutex::new(HashMap::new()),
        requests_running: Mutex::new(HashMap::new()),
        began: Instant::now(),
    });
    let hook = Arc::new(Hook(shared.clone()));
    let config = RunnerConfig::default()
        .with_terminal_errors(setup.terminal)
        .with_keyring(keyring)
        .with_response_apart_above(if settings.apart {
            0
        } else {
            RunnerConfig::DEFAULT_RESPONSE_APART_ABOVE
        });
    let runner = Runner::<E>::on(engine.clone(), config).with_crash_hook(hook);
    let workflow = Arc::new(workflow::workflow::<E>(&shared, LEASE));
    let resumers = setup
        .resumers
        .iter()
        .map(|&(batch_size, concurrency)| {
            let mut registry = Registry::<E>::new();
            registry
                .register(workflow.clone())
                .unwrap_or_else(|_| unreachable!("one workflow"));
            let config = ResumerConfig::default()
                .with_batch_size(batch_size)
                .with_concurrency(concurrency)
                .with_retention(None);
            (
                Resumer::with_config(runner.clone(), registry, config),
                Arc::new(AtomicBool::new(false)),
            )
        })
        .collect();
    shared.event(
        ActorId(0),
        format!("seed {seed} on {}: {setup:?}", shared.observer.engine()),
    );
    let server_log = shared.observer.server_log_start().await;
    let mut world = World {
        server_log,
        engine: engine.clone(),
        frozen_until: HashMap::new(),
        patient: HashMap::new(),
        lives: HashMap::new(),
        step: 0,
        lapsed: Vec::new(),
        drain_tokens: Vec::new(),
        page: None,
        shared,
        rng,
        keys: vec![
            KeySeen {
                life: 1,
                ..KeySeen::default()
            };
            setup.keys
        ],
        setup,
        consumer: Arc::new(
            idemflow_consumer::Consumer::<E>::on(
                engine.clone(),
                idemflow_consumer::Subscriber::new("sim-ledger")
                    .unwrap_or_else(|error| unreachable!("a valid subscriber: {error}")),
            )
            .with_wait_limit(Duration::from_millis(500)),
        ),
        runner,
        workflow,
        resumers,
        actors: JoinSet::new(),
    };
    for _ in 0..world.setup.steps {
        world.shared.scheduler.settle(QUIET, LONGEST_SETTLE).await;
        world.sample().await;
        world.step().await;
        world.step += 1;
    }
    world.wind_down().await;
    let engine = world.engine.clone();
    let report = world.finish(seed).await;
    idemflow_store::ConnectionPool::close(&engine).await;
    report
}

pub(crate) fn key_name(index: usize) -> String {
    format!("k{index}")
}

/// The index [`key_name`] made `name` from.
fn key_index(name: &str) -> Option<usize> {
    name.strip_prefix('k')?.parse().ok()
}

fn describe(result: &Result<Outcome, RunError>) -> String {
    match result {
        Ok(Outcome::Executed(response)) => format!("executed {}", response.status),
        Ok(Outcome::Replayed(response)) => format!("replayed {}", response.status),
        Ok(Outcome::InProgress { .. }) => "in progress".to_owned(),
        Ok(Outcome::Mismatch) => "mismatch".to_owned(),
        Ok(Outcome::Rejected(why)) => format!("rejected: {why}"),
        Ok(Outcome::Interrupted { error, .. }) => format!("interrupted: {error}"),
        Ok(Outcome::Forgotten(response)) => format!("forgotten {}", response.status),
        Ok(other) => format!("{other:?}"),
        Err(error) => format!("error: {error}"),
    }
}

impl<E: SimEngine> World<E> {
    /// Reads every key of the schedule: what the next action chooses from, the tokens seen
    /// committed.
    async fn sample(&mut self) {
        let rows = match self.shared.observer.rows(&self.shared.tenant).await {
            Ok(rows) => rows,
            Err(_) => return,
        };
        let before: Vec<Option<RowSeen>> = self.keys.iter_mut().map(|key| key.row.take()).collect();
        let mut log = self.shared.log();
        let mut repeated = Vec::new();
        for row in rows {
            let super::observe::SampledRow {
                key,
                state,
                lock_version,
                locked_until,
                recovery_point,
                created_at,
                request,
                due,
            } = row;
            let life = self.shared.life_of(&key, request);
            log.committed
                .entry(key.clone())
                .or_default()
                .insert(lock_version);
            // A token names one owner of one claim: seen on another claim of the key, it
            // repeated. (Under the store policy clock jumps move claim times: not compared.)
            if self.setup.terminal == TerminalPolicy::Forget {
                let first = log
                    .tokens_seen
                    .entry((key.clone(), lock_version))
                    .or_insert_with(|| created_at.clone());
                if *first != created_at {
                    repeated.push(format!(
                        "fencing token {lock_version} of key {key} was seen on two claims of it \
                         ({first} and {created_at})"
                    ));
                    // Reported once.
                    *first = created_at.clone();
                }
            }
            if let Some(index) = (0..self.keys.len()).find(|index| key_name(*index) == key) {
                self.keys[index].row = Some(RowSeen {
                    state,
                    lock_version,
                    locked_until,
                    recovery_point,
                    created_at,
                    life,
                    due,
                });
            }
        }
        drop(log);
        for repeat in repeated {
            self.shared.violation(repeat);
        }
        for (seen, before) in self.keys.iter_mut().zip(before.iter()) {
            seen.settled = match (&seen.row, before) {
                (Some(now), Some(before)) => {
                    now.lock_version == before.lock_version
                        && now.locked_until == before.locked_until
                }
                _ => false,
            };
        }
        // Under the forget policy, a started key that is gone, or claimed anew, was deleted: its
        // client's next request is a new one. (No other policy deletes a started key, and only
        // the store policy's schedules move the clock.)
        if self.setup.terminal != TerminalPolicy::Forget {
            return;
        }
        for (seen, before) in self.keys.iter_mut().zip(before) {
            let Some(before) = before else { continue };
            let claimed_anew = seen
                .row
                .as_ref()
                .is_none_or(|row| row.created_at != before.created_at);
            if before.state == "started" && claimed_anew && !seen.retired {
                let highest = before.life.unwrap_or_default().max(i64::from(seen.life));
                seen.life = u32::try_from(highest + 1).unwrap_or(seen.life);
            }
        }
    }

    async fn step(&mut self) {
        let waiting = self.shared.scheduler.waiting().len() as u32;
        // Resumers are likelier to scan when keys are due (as a worker's idle backoff makes them).
        let due = self
            .keys
            .iter()
            .filter(|key| key.row.as_ref().is_some_and(|row| row.due))
            .count() as u32;
        // A replay held between reading its key's row and its body stored apart is the window
        // where the key can end its window, be deleted and live again: while one is held, the
        // clock, retention and new requests are likelier.
        let held = u32::from(self.replay_held());
        // An operator's open page that the key has moved on from (the world saw it; the page did
        // not) is the page whose action must be refused: the operator acts on it likelier.
        let stale = u32::from(self.page_is_stale());
        let actions = [
            (
                if waiting > 0 { 12 + 2 * waiting } else { 0 },
                Action::Grant,
            ),
            (4 + 6 * held, Action::Request),
            (1, Action::Burst),
            (3 * u32::from(self.setup.settings.consumer), Action::Deliver),
            (2 + 3 * due, Action::Drain),
            (4, Action::ExpireLease),
            (2, Action::ExpireAll),
            (u32::from(waiting > 0), Action::Stall),
            (1, Action::EndLease),
            (2 + 8 * stale, Action::ExpireKey),
            (1 + 5 * held, Action::Retention),
            (
                u32::from(self.setup.terminal == TerminalPolicy::Store) * (1 + 5 * held),
                Action::TimeJump,
            ),
            (1, Action::Kill),
            (1, Action::Corrupt),
        ];
        match self.rng.weighted(&actions) {
            Action::Grant => self.grant(),
            Action::Request => self.request(),
            Action::Burst => self.burst(),
            Action::Deliver => self.deliver(),
            Action::Drain => self.drain(),
            Action::ExpireLease => self.expire_lease().await,
            Action::Stall => self.stall(),
            Action::ExpireAll => {
                // A fleet went down: every lease no live owner relies on lapses at once.
                for (index, row) in self.all_unexposed_started() {
                    self.expire_lease_of(index, row).await;
                }
                // The workers that are left start recovering at once.
                if self.rng.chance(0.5) {
                    self.drain();
                }
            }
            Action::EndLease => self.end_lease().await,
            Action::ExpireKey => self.expire_key().await,
            Action::Retention => self.retention().await,
            Action::TimeJump => self.time_jump().await,
            Action::Kill => self.kill().await,
            Action::Corrupt => self.corrupt().await,
        }
    }

    fn grant(&mut self) {
        let waiting = self.shared.scheduler.waiting();
        if waiting.is_empty() {
            return;
        }
        let step = self.step;
        let weights: Vec<(u32, usize)> = waiting
            .iter()
            .enumerate()
            .map(|(index, parked)| {
                let rng = &mut self.rng;
                // Most held replays are patient: they read their body only once no newer life
                // of their key is running or claimed and not done, so a new life claimed
                // meanwhile (the key deleted by retention) has finished first.
                let replay = is_replay_body(&parked.point);
                if replay
                    && newer_life_unfinished(&self.keys, &self.lives, &self.shared, parked)
                    && *self
                        .patient
                        .entry(parked.actor)
                        .or_insert_with(|| rng.chance(0.7))
                {
                    return (0, index);
                }
                // A resumer's tasks stall more often: the keys its batch holds wait on them. A
                // replay about to read its body apart stalls most, and longest: the key may end
                // its window and live again meanwhile.
                let (stalls, shortest, longest) = if replay {
                    (0.8, 20, 80)
                } else if self.shared.scheduler.is_engine_actor(parked.actor) {
                    (0.4, 5, 25)
                } else {
                    (0.15, 5, 25)
                };
                let until = *self.frozen_until.entry(parked.actor).or_insert_with(|| {
                    if rng.chance(stalls) {
                        step + rng.between(shortest, longest) as usize
                    } else {
                        0
                    }
                });
                (u32::from(step >= until), index)
            })
            .collect();
        if weights.iter().all(|(weight, _)| *weight == 0) {
            return;
        }
        let chosen = &waiting[self.rng.weighted(&weights)];
        self.grant_to(chosen);
    }

    /// Lets a waiting actor go on, drawing what it does at its point.
    fn grant_to(&mut self, parked: &Waiting) {
        let verdict = match &parked.point {
            Point::Engine(point) => {
                // Around a call crashes are likelier: they leave keys whose next step is the
                // call, the ones a late or stale owner could call twice.
                let near_a_call = point.starts_with("after_commit") || point.contains("_call:");
                if self.rng.chance(if near_a_call { 0.2 } else { 0.08 }) {
                    self.shared.log().counts.crashes += 1;
                    Verdict::Crash
                } else {
                    Verdict::Go
                }
            }
            Point::Phase(phase) => Verdict::Act(self.draw_act(&parked.key, phase)),
        };
        self.shared.log().counts.grants += 1;
        self.shared.event(
            parked.actor,
            format!("granted at {} of {}: {verdict:?}", parked.point, parked.key),
        );
        self.shared.scheduler.grant(parked.actor, verdict);
    }

    /// On an engine with one writer, an operator's write waits (its busy timeout) for the run
    /// whose transaction holds the database, and that run goes on meanwhile: runs held inside a
    /// write transaction are let go until none is (bounded). Without this, the operator's writes
    /// would only ever meet a held writer and fail busy, and retention would rarely delete a key
    /// while a replay of it is held, the window a new life of the key is made in. Some of the
    /// time the writer stays held, and the operator's write fails busy, as it may.
    async fn let_the_writer_finish(&mut self) {
        if !E::ONE_WRITER || self.rng.chance(0.2) {
            return;
        }
        for _ in 0..100 {
            let holding: Vec<Waiting> = self
                .shared
                .scheduler
                .waiting()
                .into_iter()
                .filter(|parked| holds_the_writer(&parked.point))
                .collect();
            if holding.is_empty() {
                return;
            }
            for parked in &holding {
                self.grant_to(parked);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// How a phase that ends the runner's transaction ends it.
    fn transaction_end(&mut self) -> TransactionEnd {
        self.rng.weighted(&[
            (1, TransactionEnd::Commit),
            (1, TransactionEnd::CommitThenFail),
            (1, TransactionEnd::Rollback),
            (1, TransactionEnd::RollbackThenWriteAgain),
            (1, TransactionEnd::Implicit),
        ])
    }

    fn draw_act(&mut self, key: &str, phase: &'static str) -> Act {
        if let Some((poisoned, act)) = self.shared.poison.get(key)
            && *poisoned == phase
        {
            return *act;
        }
        let slow = Duration::from_millis(self.rng.between(350, 700));
        let delay = Duration::from_millis(self.rng.between(100, 500));
        let end = self.transaction_end();
        if phase == "charge" {
            self.rng.weighted(&[
                (60, Act::Succeed),
                (8, Act::Provider(ProviderFault::Delay(delay))),
                (5, Act::Provider(ProviderFault::Unavailable)),
                (2, Act::Provider(ProviderFault::Timeout)),
                (3, Act::Provider(ProviderFault::Reset)),
                (5, Act::Provider(ProviderFault::ExecuteThenDrop)),
                (4, Act::Retryable),
                (2, Act::Panic),
                (3, Act::Unstorable),
                (3, Act::Slow(slow)),
            ])
        } else {
            // Under the forget policy a terminal error deletes the key: the way to its next life.
            let terminal = if self.setup.terminal == TerminalPolicy::Forget {
                15
            } else {
                3
            };
            self.rng.weighted(&[
                (80, Act::Succeed),
                (7, Act::Slow(slow)),
                (5, Act::Retryable),
                (terminal, Act::Terminal),
                (2, Act::Panic),
                (1, Act::Hang),
                (1, Act::HangInDatabase),
                (1, Act::HangInWrite),
                (2, Act::EndTransaction(end)),
                (1, Act::HugeError),
                (1, Act::NulError),
                (if phase == "complete" { 0 } else { 2 }, Act::Unstorable),
                (if phase == "complete" { 2 } else { 0 }, Act::BreakCommit),
            ])
        }
    }

    /// Patient replays keep holding while every other actor goes on, until no newer life of
    /// their key runs (bounded): the wind-down would otherwise free them all at once, before the
    /// new life they were waiting for has finished.
    async fn let_newer_lives_finish(&mut self) {
        for _ in 0..200 {
            let waiting = self.shared.scheduler.waiting();
            let mut holding = false;
            for parked in &waiting {
                let held = is_replay_body(&parked.point)
                    && newer_life_running(&self.keys, &self.lives, &self.shared, parked)
                    && *self
                        .patient
                        .entry(parked.actor)
                        .or_insert_with(|| self.rng.chance(0.7));
                if held {
                    holding = true;
                } else {
                    self.shared.scheduler.grant(parked.actor, Verdict::Go);
                }
            }
            if !holding {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Some replay waits between reading its key's row and reading its body stored apart.
    fn replay_held(&self) -> bool {
        self.shared
            .scheduler
            .waiting()
            .iter()
            .any(|parked| is_replay_body(&parked.point))
    }

    /// Keys a held replay waits on: a newer life of the key is claimed and not done, and no
    /// request of it runs.
    fn awaited_lives(&self) -> Vec<usize> {
        let mut keys: Vec<usize> = self
            .shared
            .scheduler
            .waiting()
            .iter()
            .filter(|parked| {
                is_replay_body(&parked.point)
                    && newer_life_unfinished(&self.keys, &self.lives, &self.shared, parked)
                    && !newer_life_running(&self.keys, &self.lives, &self.shared, parked)
            })
            .filter_map(|parked| key_index(&parked.key))
            .collect();
        keys.dedup();
        keys
    }

    /// A waiting actor's process stalls (a pause, a long garbage collection): it is granted
    /// nothing for a while, whatever it holds.
    fn stall(&mut self) {
        let waiting = self.shared.scheduler.waiting();
        if waiting.is_empty() {
            return;
        }
        let chosen = &waiting[self.rng.below(waiting.len() as u64) as usize];
        let until = self.step + self.rng.between(10, 30) as usize;
        self.frozen_until.insert(chosen.actor, until);
        self.shared.event(
            chosen.actor,
            format!(
                "stalls at {} of {} until step {until}",
                chosen.point, chosen.key
            ),
        );
    }

    /// A client sends its request (a first attempt or a retry; after the key was forgotten, the
    /// next request under it).
    fn request(&mut self) {
        // A client whose request was forgotten sends its next one soon.
        let forgotten: Vec<usize> = {
            let log = self.shared.log();
            (0..self.keys.len())
                .filter(|index| log.forgotten.contains_key(&key_name(*index)))
                .collect()
        };
        // While a replay is held, a retired key's client is likelier to come back, and so is
        // the client of a newer life the replay waits for.
        let retired: Vec<usize> = (0..self.keys.len())
            .filter(|index| self.keys[*index].retired)
            .collect();
        let awaited = self.awaited_lives();
        let held = self.replay_held();
        let index = match (forgotten.first(), self.lapsed.pop()) {
            _ if held && !retired.is_empty() && self.rng.chance(0.7) => {
                retired[self.rng.below(retired.len() as u64) as usize]
            }
            _ if !awaited.is_empty() && self.rng.chance(0.6) => {
                awaited[self.rng.below(awaited.len() as u64) as usize]
            }
            (Some(forgotten), _) if self.rng.chance(0.7) => *forgotten,
            (_, Some(lapsed)) if self.rng.chance(0.6) => lapsed,
            _ => self.rng.below(self.keys.len() as u64) as usize,
        };
        if self.keys[index].retired {
            // Its window is over and retention deleted it: the client may come back with a new
            // request under the key, another life of it (a replay of the old one may still be
            // between its two statements).
            if !self.rng.chance(if held { 0.9 } else { 0.5 }) {
                return;
            }
            self.keys[index].retired = false;
            self.keys[index].life += 1;
        }
        let life = self.next_life(index);
        self.shared.log().counts.requests += 1;
        self.spawn_request(index, life);
    }

    /// The life a client of key `index` sends now. Forgotten, its next request is a new one;
    /// unless another copy of the same request (a burst) is still in flight or claimed the key
    /// again meanwhile: then that life goes on.
    fn next_life(&mut self, index: usize) -> u32 {
        let key = key_name(index);
        let life = self.keys[index].life;
        let forgotten = self.shared.log().forgotten.get(&key).copied();
        if forgotten == Some(life) {
            let claimed_again = self.keys[index]
                .row
                .as_ref()
                .is_some_and(|row| row.life == Some(i64::from(life)));
            let in_flight = self.shared.in_flight(&key, life) > 0;
            if !claimed_again && !in_flight {
                self.shared.log().forgotten.remove(&key);
                self.keys[index].life += 1;
            }
        }
        self.keys[index].life
    }

    /// A delivery to the consumer that shares the engine's pool: one of a few messages (so
    /// duplicates come), dropped after a few turns of the runtime about one time in two, as a
    /// timeout around it or a shutdown would: mid-`BEGIN`, mid-handler, or after its commit.
    fn deliver(&mut self) {
        let id = format!("{}-m{}", self.shared.tenant, self.rng.below(4));
        let drop_after = self.rng.chance(0.5).then(|| self.rng.below(6));
        let (consumer, shared) = (self.consumer.clone(), self.shared.clone());
        let actor = shared.scheduler.new_actor();
        shared.event(
            actor,
            format!("delivers {id} (dropped after {drop_after:?} turns)"),
        );
        self.shared.log().counts.deliveries += 1;
        self.actors.spawn(ACTOR.scope(actor, async move {
            let delivery = {
                let (consumer, id) = (consumer.clone(), id.clone());
                tokio::spawn(async move {
                    let message = idemflow_consumer::Message::new(&id, id.as_bytes().to_vec())
                        .unwrap_or_else(|error| unreachable!("a valid message: {error}"));
                    consumer.process(&Ledger, &message).await
                })
            };
            let outcome = match drop_after {
                Some(turns) => {
                    for _ in 0..turns {
                        tokio::task::yield_now().await;
                    }
                    delivery.abort();
                    delivery.await.map(|result| format!("{result:?}"))
                }
                None => delivery.await.map(|result| format!("{result:?}")),
            };
            shared.event(actor, format!("delivery of {id}: {outcome:?}"));
            shared.scheduler.ended(actor);
        }));
    }

    /// The same request, two or three times at once: their look-ups may all find the key absent,
    /// and their claims race.
    fn burst(&mut self) {
        let index = self.rng.below(self.keys.len() as u64) as usize;
        if self.keys[index].retired {
            return;
        }
        let life = self.next_life(index);
        let copies = self.rng.between(2, 3);
        self.shared.log().counts.requests += copies;
        for _ in 0..copies {
            self.spawn_request(index, life);
        }
    }

    fn spawn_request(&mut self, index: usize, life: u32) {
        let actor = self.shared.scheduler.new_actor();
        let (runner, workflow, shared) = (
            self.runner.clone(),
            self.workflow.clone(),
            self.shared.clone(),
        );
        let key = key_name(index);
        let body = serde_json::to_vec(&SimRequest {
            amount: 1000 + index as u64,
            life,
        })
        .unwrap_or_default();
        self.lives.insert(actor, life);
        shared.event(actor, format!("sends {key} (life {life})"));
        shared.started_request(&key, life);
        self.actors.spawn(ACTOR.scope(actor, async move {
            let request = Request {
                method: "POST",
                path: "/v1/sim",
                body: &body,
            };
            let parsed = idemflow_core::Key::parse(&key).expect("the world makes valid keys");
            let result = runner
                .run(&workflow, &shared.tenant, &parsed, request)
                .await;
            shared.record(actor, &key, life, &result);
            shared.ended_request(&key, life);
            shared.scheduler.ended(actor);
        }));
    }

    fn drain(&mut self) {
        let choices: Vec<(u32, usize)> = (0..self.resumers.len())
            .map(|index| (if index == 0 { 3 } else { 1 }, index))
            .collect();
        let index = self.rng.weighted(&choices);
        let (resumer, busy) = &self.resumers[index];
        if busy.swap(true, Ordering::SeqCst) {
            return;
        }
        let (resumer, busy, shared) = (resumer.clone(), busy.clone(), self.shared.clone());
        let tokens = self.sampled_tokens();
        if self.drain_tokens.len() <= index {
            self.drain_tokens.resize(index + 1, Vec::new());
        }
        self.drain_tokens[index] = tokens;
        let actor = shared.scheduler.new_actor();
        shared.log().counts.drains += 1;
        shared.event(actor, format!("resumer {index} drains"));
        self.actors.spawn(ACTOR.scope(actor, async move {
            let report = resumer.drain().await;
            shared.event(actor, format!("resumer {index} drained: {report:?}"));
            busy.store(false, Ordering::SeqCst);
            shared.scheduler.ended(actor);
        }));
    }

    /// A started key no live owner relies on, chosen by the seed: its lease, row lock free, and
    /// its lease end as last sampled (so a write since then is never undone).
    /// One of them, chosen by the seed; a key held by an owner no actor is seen working for
    /// (its process died, or its resumer has not got to it yet) is likelier: its lease is the one
    /// that would lapse.
    fn unexposed_started(&mut self) -> Option<(usize, RowSeen)> {
        let candidates = self.all_unexposed_started();
        if candidates.is_empty() {
            return None;
        }
        let worked_on: HashSet<String> = self
            .shared
            .scheduler
            .waiting()
            .into_iter()
            .map(|waiting| waiting.key)
            .collect();
        let weights: Vec<(u32, usize)> = candidates
            .iter()
            .enumerate()
            .map(|(pick, (index, row))| {
                let idle = !row.due && !worked_on.contains(&key_name(*index));
                (if idle { 4 } else { 1 }, pick)
            })
            .collect();
        let pick = self.rng.weighted(&weights);
        Some(candidates[pick].clone())
    }

    fn all_unexposed_started(&self) -> Vec<(usize, RowSeen)> {
        self.keys
            .iter()
            .enumerate()
            .filter(|(_, key)| key.settled)
            .filter_map(|(index, key)| Some((index, key.row.clone()?)))
            .filter(|(index, row)| {
                row.state == "started"
                    && !self.shared.scheduler.is_exposed(&key_name(*index))
                    && !self.maybe_taken_by_a_drain(*index, row)
            })
            .collect()
    }

    /// Each key's token as last sampled.
    fn sampled_tokens(&self) -> Vec<Option<i64>> {
        self.keys
            .iter()
            .map(|key| key.row.as_ref().map(|row| row.lock_version))
            .collect()
    }

    /// Whether a drain still running may have taken the key over since it began
    /// ([`World::drain_tokens`]).
    fn maybe_taken_by_a_drain(&self, index: usize, row: &RowSeen) -> bool {
        self.resumers
            .iter()
            .zip(&self.drain_tokens)
            .any(|((_, busy), tokens)| {
                busy.load(Ordering::SeqCst)
                    && tokens.get(index).copied().flatten() != Some(row.lock_version)
            })
    }

    /// The owner of a key is presumed gone: its lease is rewound, as if it had lapsed.
    async fn expire_lease(&mut self) {
        if let Some((index, row)) = self.unexposed_started() {
            self.expire_lease_of(index, row).await;
        }
    }

    async fn expire_lease_of(&mut self, index: usize, row: RowSeen) {
        let expired = self
            .shared
            .observer
            .expire_lease(
                &self.shared.tenant,
                &key_name(index),
                row.lock_version,
                row.locked_until.as_deref(),
            )
            .await;
        if expired {
            self.lapsed.push(index);
            self.shared.log().counts.lease_expiries += 1;
            self.shared
                .event(ActorId(0), format!("lease of {} expired", key_name(index)));
        }
    }

    /// An operator runs `idemflow end-lease` on a key whose owner it believes gone.
    async fn end_lease(&mut self) {
        let Some((index, row)) = self.unexposed_started() else {
            return;
        };
        let key = key_name(index);
        if self
            .shared
            .observer
            .end_lease(&self.shared.tenant, &key, row.locked_until.as_deref())
            .await
        {
            self.lapsed.push(index);
            self.shared.log().counts.leases_ended += 1;
            self.shared
                .event(ActorId(0), format!("operator ended the lease of {key}"));
        }
    }

    /// An operator works in the console: opens a key's page, and later expires the key from that
    /// page (forced, when its lease is live), under the token and state it showed, which may be
    /// stale by then: the owner may have finished meanwhile (a finish keeps the token), or a
    /// resumer taken the key over. The engine must delete a key only as it was shown.
    async fn expire_key(&mut self) {
        let act = self.page_is_stale() || self.rng.chance(0.6);
        let Some((index, row)) = self.page.take().filter(|_| act) else {
            self.open_page();
            return;
        };
        let key = key_name(index);
        // The operator acts only on a key whose owner it believes gone: one no actor is between
        // its check and its call on now (the schedule's model of "gone", as for end-lease).
        if self.keys[index].retired || self.shared.scheduler.is_exposed(&key) {
            return;
        }
        let deleted = self
            .shared
            .observer
            .expire_key(&self.shared.tenant, &key, row.lock_version, &row.state)
            .await;
        match deleted {
            None => self.shared.event(
                ActorId(0),
                format!(
                    "operator's expiry of {key} refused: it moved on, or an owner holds its row"
                ),
            ),
            Some(state) if state != row.state => self.shared.violation(format!(
                "the console expired key {key} shown {} under token {}, but it was {state} by \
                 then",
                row.state, row.lock_version
            )),
            Some(_) => {
                // Gone as retention would take it: a request of its life still in flight (or the
                // client coming back) runs it again, rightly.
                self.keys[index].retired = true;
                let mut log = self.shared.log();
                log.expired.insert(key.clone());
                log.counts.keys_expired += 1;
                drop(log);
                self.shared.event(
                    ActorId(0),
                    format!("operator expired {key} ({}) from the console", row.state),
                );
            }
        }
    }

    /// Whether the operator's open page shows its key as it no longer is (by the world's last
    /// sample), while no actor relies on the key's lease: acting on it now is the stale action
    /// the engine must refuse.
    fn page_is_stale(&self) -> bool {
        let Some((index, shown)) = &self.page else {
            return false;
        };
        let seen = &self.keys[*index];
        !seen.retired
            && seen.row.as_ref().is_some_and(|now| {
                now.lock_version != shown.lock_version || now.state != shown.state
            })
            && !self.shared.scheduler.is_exposed(&key_name(*index))
    }

    /// The operator opens a key's page, any key's: what it shows is the key's last sample. (Reading
    /// is harmless; whether the operator may act is decided when it does.)
    fn open_page(&mut self) {
        let candidates: Vec<(usize, RowSeen)> = self
            .keys
            .iter()
            .enumerate()
            .filter(|(_, seen)| !seen.retired)
            .filter_map(|(index, seen)| Some((index, seen.row.clone()?)))
            .collect();
        if candidates.is_empty() {
            return;
        }
        // Most often a started key whose owner is still at work: the page the operator acts on
        // later is then the likeliest to be stale (finished, or taken over, since).
        let weights: Vec<(u32, usize)> = candidates
            .iter()
            .enumerate()
            .map(|(pick, (_, row))| match (row.state.as_str(), row.due) {
                ("started", false) => (4, pick),
                ("started", true) => (2, pick),
                _ => (1, pick),
            })
            .collect();
        let picked = candidates[self.rng.weighted(&weights)].clone();
        self.shared.event(
            ActorId(0),
            format!("operator opened the console page of {}", key_name(picked.0)),
        );
        self.page = Some(picked);
    }

    /// An operator runs retention. Keys within their window must all be there afterwards.
    async fn retention(&mut self) {
        self.let_the_writer_finish().await;
        let protected = self
            .shared
            .observer
            .done_within(&self.shared.tenant, RETENTION)
            .await;
        // What a worker runs: batched deletes, or on the partitioned layout partition drops.
        let retention = idemflow_runner::Retention::default()
            .with_keep_for(RETENTION)
            .with_batch_size(100)
            .with_max_rows_per_second(None);
        let deleted = retention.expire_on::<E>(&self.engine).await;
        self.shared.log().counts.expiries += 1;
        self.shared
            .event(ActorId(0), format!("operator ran retention: {deleted:?}"));
        let present = self.shared.observer.present(&self.shared.tenant).await;
        for key in protected {
            if !present.contains(&key) {
                self.shared.violation(format!(
                    "retention deleted key {key} within its window after it finished"
                ));
            }
        }
        // Keys seen done and gone now ended their window: nothing more is asked of them.
        for (index, seen) in self.keys.iter_mut().enumerate() {
            let done = seen.row.as_ref().is_some_and(|row| row.state == "done");
            if done && !present.contains(&key_name(index)) {
                seen.retired = true;
                self.shared.log().expired.insert(key_name(index));
            }
        }
    }

    /// A day passes for retention: the schedule's keys were claimed and finished a day earlier.
    /// Leases are left alone (their owners' heartbeats would have kept them).
    async fn time_jump(&mut self) {
        self.let_the_writer_finish().await;
        let jumped = self
            .shared
            .observer
            .time_jump(&self.shared.tenant, JUMP_HOURS)
            .await;
        if jumped {
            self.shared.log().counts.time_jumps += 1;
            self.shared
                .event(ActorId(0), format!("the clock jumped {JUMP_HOURS} hours"));
        }
    }

    /// One of the engine's connections is killed by the server.
    async fn kill(&mut self) {
        let offset = self.rng.below(8) as i64;
        let killed = self.shared.observer.kill(offset).await;
        if killed {
            self.shared.log().counts.kills += 1;
            self.shared
                .event(ActorId(0), "an engine connection was killed");
        }
    }

    /// A deploy changes the type of the charge's input: the output stored at `price` no longer
    /// decodes. The key can only end by giving up.
    async fn corrupt(&mut self) {
        let Some((index, row)) = self.unexposed_started() else {
            return;
        };
        if row.recovery_point != "price" {
            return;
        }
        let corrupted = self
            .shared
            .observer
            .corrupt(&self.shared.tenant, &key_name(index))
            .await;
        if corrupted {
            self.shared.log().counts.corruptions += 1;
            self.shared.event(
                ActorId(0),
                format!(
                    "the stored input of {}'s charge was corrupted",
                    key_name(index)
                ),
            );
        }
    }

    /// The end of the schedule: nobody waits any more, faults heal (poison stays), every actor
    /// ends, and then client retries alone must bring every key to an end within its attempt
    /// budget.
    async fn wind_down(&mut self) {
        self.let_newer_lives_finish().await;
        self.shared.scheduler.run_free();
        let deadline = tokio::time::sleep(WIND_DOWN);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                joined = self.actors.join_next() => match joined {
                    None => break,
                    Some(Err(error)) if error.is_panic() => {
                        self.shared.violation(format!("an actor's task panicked: {error}"));
                    }
                    Some(_) => {}
                },
                () = &mut deadline => {
                    self.shared.violation(format!(
                        "{} actors still running {} s after the schedule ended (a hang)",
                        self.actors.len(),
                        WIND_DOWN.as_secs()
                    ));
                    self.actors.abort_all();
                    while self.actors.join_next().await.is_some() {}
                    break;
                }
            }
        }
        let rounds = workflow::policy().max_attempts + 2;
        for _ in 0..rounds {
            self.sample().await;
            let open: Vec<usize> = (0..self.keys.len())
                .filter(|index| self.needs_a_retry(*index))
                .collect();
            if open.is_empty() {
                break;
            }
            for index in open {
                let lapsed = self
                    .shared
                    .observer
                    .lapse(&self.shared.tenant, &key_name(index))
                    .await;
                if lapsed == Lapse::Stuck {
                    self.shared.violation(format!(
                        "key {} stayed locked after the schedule ended (a transaction no one \
                         ends holds it)",
                        key_name(index)
                    ));
                }
                // A started key holding an older life's request (a late request of that life
                // claimed it again after retention deleted it, and the client had moved on) is
                // retried by that life's client, which still waits on the error it was given:
                // the newer life's would only be told its request does not match.
                let seen = &self.keys[index];
                let life = seen
                    .row
                    .as_ref()
                    .filter(|row| row.state == "started")
                    .and_then(|row| row.life)
                    .and_then(|life| u32::try_from(life).ok())
                    .unwrap_or(seen.life);
                self.spawn_request(index, life);
                while let Some(joined) = self.actors.join_next().await {
                    if let Err(error) = joined
                        && error.is_panic()
                    {
                        self.shared
                            .violation(format!("an actor's task panicked: {error}"));
                    }
                }
            }
        }
        // The operator's retention runs once more, over keys that have all ended: none still
        // within its window may go.
        self.retention().await;
        self.sample().await;
        for index in 0..self.keys.len() {
            if self.needs_a_retry(index) {
                let row = self.keys[index].row.clone();
                self.shared.violation(format!(
                    "key {} did not end within {rounds} client retries (its budget is {} \
                     attempts): {row:?}",
                    key_name(index),
                    workflow::policy().max_attempts
                ));
            }
        }
    }

    /// A key its client still waits on: not done, not retired, not forgotten for good.
    fn needs_a_retry(&self, index: usize) -> bool {
        let seen = &self.keys[index];
        if seen.retired {
            return false;
        }
        let forgotten = self.shared.log().forgotten.get(&key_name(index)) == Some(&seen.life);
        match &seen.row {
            Some(row) => row.state != "done",
            None => !forgotten,
        }
    }

    async fn finish(mut self, seed: u64) -> ScheduleReport {
        super::check::replays_and_ends(&mut self).await;
        super::check::messages_applied_once(&self.shared).await;
        super::check::no_connection_left_in_a_transaction(&self.shared).await;
        super::check::no_lost_claim_logged(&self.shared, self.server_log.take()).await;
        let log = std::mem::take(&mut *self.shared.log());
        ScheduleReport {
            seed,
            engine: E::NAME,
            violations: log.violations,
            history: log.history,
            counts: log.counts,
        }
    }
}

/// What the final checks read of a world.
pub(crate) struct Ending<'w, E: SimEngine> {
    pub shared: &'w Shared,
    pub forget_policy: bool,
    pub runner: &'w Runner<E>,
    pub workflow: &'w idemflow_runner::Workflow<E>,
    pub keys: Vec<(String, u32, bool)>,
}

impl<E: SimEngine> World<E> {
    pub(crate) fn ending(&self) -> Ending<'_, E> {
        Ending {
            shared: &self.shared,
            forget_policy: self.setup.terminal == TerminalPolicy::Forget,
            runner: &self.runner,
            workflow: &self.workflow,
            keys: self
                .keys
                .iter()
                .enumerate()
                .map(|(index, seen)| (key_name(index), seen.life, seen.retired))
                .collect(),
        }
    }
}

/// The consumer's handler: one ledger row per message applied, in the delivery's transaction.
struct Ledger;

#[async_trait]
impl<E: SimEngine> idemflow_consumer::Handler<E> for Ledger {
    async fn handle(
        &self,
        connection: &mut ConnectionOf<E>,
        message: &idemflow_consumer::Message,
    ) -> Result<(), idemflow_consumer::HandlerError> {
        E::apply(connection, message.id()).await?;
        Ok(())
    }
}

/// The point a replay reaches after reading its key's row and before reading its body apart.
/// A run waiting here is inside a write transaction: a local phase's body, or about to commit.
fn holds_the_writer(point: &Point) -> bool {
    match point {
        Point::Engine(point) => point.starts_with("before_commit:") || point == "before_finish",
        Point::Phase(phase) => *phase != workflow::FOREIGN_PHASE,
    }
}

fn is_replay_body(point: &Point) -> bool {
    matches!(point, Point::Engine(point) if point.as_str() == "before_replay_body")
}

/// A request of a newer life of `parked`'s key than the one its client sent is running.
fn newer_life_running(
    keys: &[KeySeen],
    lives: &HashMap<ActorId, u32>,
    shared: &Shared,
    parked: &Waiting,
) -> bool {
    let Some(sent) = lives.get(&parked.actor) else {
        return false;
    };
    let Some(seen) = key_index(&parked.key).and_then(|index| keys.get(index)) else {
        return false;
    };
    seen.life > *sent && shared.in_flight(&parked.key, seen.life) > 0
}

/// A newer life of `parked`'s key than the one its client sent is running, or claimed and not
/// done (its request crashed or gave up for now: a retry or a resumer finishes it).
fn newer_life_unfinished(
    keys: &[KeySeen],
    lives: &HashMap<ActorId, u32>,
    shared: &Shared,
    parked: &Waiting,
) -> bool {
    if newer_life_running(keys, lives, shared, parked) {
        return true;
    }
    let (Some(sent), Some(seen)) = (
        lives.get(&parked.actor),
        key_index(&parked.key).and_then(|index| keys.get(index)),
    ) else {
        return false;
    };
    seen.row.as_ref().is_some_and(|row| {
        row.state == "started" && row.life.is_some_and(|life| life > i64::from(*sent))
    })
}
