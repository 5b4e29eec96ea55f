//! The schedule explorer's foreign-only world: workflows whose phases are all foreign, the kind
//! every engine runs, Redis included. Two of them: a payment (charge the card, then send the
//! receipt, each a call to the mock provider with its derived key) and a payout (one call, under
//! a derived key of its own). Its schedules are drawn by a seed as the checkout world's are
//! (`world.rs`), over the same scheduler: actors wait at the engine's crash points and at the
//! start of each phase until the schedule grants them a step.
//!
//! A schedule has two tenants sharing 2 to 3 key names (so a key's row must never answer another
//! tenant), and these actors: clients sending first attempts, retries and bursts of copies, an
//! impostor sending another body, or the same body for the other workflow, under a key that holds
//! a request (it must get 422), 1 to 3 resumers with their own batch sizes, each serving both
//! workflows or one, and an operator running retention. Chaos: leases ended by rewinding them
//! (only where the row is as it was one sample ago and no owner relies on it), finishes aged past
//! the retention window, a key's row lost alone (a Redis eviction, a stray delete: a finished
//! row, or a started one no owner relies on, its lease ended first as a cold row's has), the
//! engine's connections closed by the server, and provider faults (503, a timeout, a reset, a
//! charge whose response is lost, a delay). A key whose row was lost is new to the store, so its
//! client's next request may be for the other workflow: a claim of the key anew under it.
//! Phases are told to succeed, be slow, fail retryably or panic; any engine point may crash its
//! run.
//!
//! After the schedule every actor is let go, faults heal, and client retries (with the resumers
//! and leases ended for them) must bring every key to a response. Then the checks:
//! - a foreign call starts only by the key's owner, on a live lease, at the recovery point
//!   before its phase, for a key whose life was claimed under the phase's workflow; never two
//!   calls with one derived key at once;
//! - a key is finished at most once per life: once, plus once for each time it was deleted
//!   (retention after its window, or lost) — an execution beyond that ran a request twice;
//! - every 2xx a client got is for its own tenant, key, amount and workflow; distinct responses
//!   for a key are at most its lives; an impostor gets 422, never a response;
//! - the store's own bookkeeping is whole (`ForeignSimEngine::audit`: Redis's sorted sets, each
//!   naming only rows it should).

mod engines;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, StoredResponse, TenantId};
use idemflow_runner::{
    CrashHook, CrashPoint, ForeignPhase, Keyring, Outcome, PhaseContext, PhaseError, PoolOf,
    Registry, Request, Resumer, ResumerConfig, RetryPolicy, RunError, Runner, RunnerConfig,
    Workflow,
};
use serde::{Deserialize, Serialize};
use tokio::task::JoinSet;

pub use engines::{ForeignSimEngine, RowSample};

#[cfg(feature = "redis")]
pub(crate) use engines::redis_store::forget_prefix;

use super::rng::Rng;
use super::scheduler::{ACTOR, ActorId, Point, Scheduler, Verdict};
use super::{Counts, ScheduleReport};
use idemflow_testkit::provider::{Fault, MockProvider};
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};

/// The payment: `charge`, then `receipt`.
const PAY: &str = "sim.pay.v1";

/// The payout: `payout`, one call under a derived key of its own.
const PAYOUT: &str = "sim.payout.v1";

/// The workflows, as a slot names them (its index here).
const WORKFLOWS: [&str; 2] = [PAY, PAYOUT];

/// Long: leases end only when the schedule says so.
const LEASE: Duration = Duration::from_secs(30);

/// The operator's retention window (finishes are aged two days back).
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

const QUIET: Duration = Duration::from_millis(8);
const LONGEST_SETTLE: Duration = Duration::from_millis(250);
const WIND_DOWN: Duration = Duration::from_secs(30);

/// Rounds of client retries (each after ending every lease and draining) that must end every key.
const END_ROUNDS: usize = 8;

/// What a phase does, as its grant says.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Act {
    Succeed,
    Slow(Duration),
    Retryable,
    Panic,
}

/// The request: what to charge, for whom (echoed in the response, so a response shows whose it
/// is).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Payment {
    tenant: String,
    key: String,
    amount: u64,
}

/// The charge's output, the receipt's input.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Charged {
    payment: Payment,
    charge: String,
}

/// One tenant's key.
#[derive(Debug, Clone)]
struct Slot {
    tenant: TenantId,
    key: String,
    amount: u64,
    /// The workflow its client's requests are for (an index of `WORKFLOWS`): the one its row
    /// names whenever a sample saw a row, and after a loss maybe the other.
    workflow: usize,
    /// Last two samples of its row, newest first.
    seen: [Option<RowSample>; 2],
    /// Finished and aged past the window since it was last seen claimed.
    aged: bool,
}

impl Slot {
    fn name(&self) -> String {
        format!("{}/{}", self.tenant.as_str(), self.key)
    }

    fn body(&self, amount: u64) -> Vec<u8> {
        serde_json::to_vec(&Payment {
            tenant: self.tenant.as_str().to_owned(),
            key: self.key.clone(),
            amount,
        })
        .unwrap_or_default()
    }
}

/// What a schedule saw, for the checks.
#[derive(Default)]
struct Log {
    history: Vec<String>,
    violations: Vec<String>,
    /// Stores of a response (the engine's after-finish point), by slot name.
    finishes: HashMap<String, u32>,
    /// Deletions of a slot's row: retention after its window, or a loss.
    deletions: HashMap<String, u32>,
    /// Distinct 2xx bodies clients got, by slot name.
    responses: HashMap<String, Vec<Vec<u8>>>,
    counts: Counts,
}

/// What the actors and the hook share with the schedule.
struct Shared<E: ForeignSimEngine> {
    scheduler: Scheduler,
    observer: PoolOf<E>,
    provider: Arc<MockProvider>,
    client: ProviderClient,
    log: Mutex<Log>,
    /// Foreign calls in flight: (derived key, actor, id).
    calls: Mutex<Vec<(String, ActorId, u64)>>,
    next_call: AtomicU64,
    began: Instant,
}

impl<E: ForeignSimEngine> Shared<E> {
    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn event(&self, actor: ActorId, what: impl std::fmt::Display) {
        let line = format!(
            "+{:>6} ms {actor:>4} {what}",
            self.began.elapsed().as_millis()
        );
        if std::env::var_os("IDEMFLOW_SIM_TRACE").is_some() {
            eprintln!("{line}");
        }
        self.log().history.push(line);
    }

    fn violation(&self, what: String) {
        let line = format!("+{} ms: {what}", self.began.elapsed().as_millis());
        let mut log = self.log();
        log.history.push(format!("VIOLATION {what}"));
        log.violations.push(line);
    }

    /// Waits for the schedule at the start of `phase`; what this run does.
    async fn act(&self, phase: &'static str, context: &PhaseContext) -> Act {
        let actor = self.scheduler.current();
        let name = format!("{}/{}", context.tenant.as_str(), context.key.as_str());
        match self.scheduler.park(actor, &name, Point::Phase(phase)).await {
            Verdict::Act(super::workflow::Act::Retryable) => Act::Retryable,
            Verdict::Act(super::workflow::Act::Panic) => Act::Panic,
            Verdict::Act(super::workflow::Act::Slow(wait)) => Act::Slow(wait),
            _ => Act::Succeed,
        }
    }

    /// A foreign call may start only by the key's owner, on a live lease, at the recovery point
    /// before its phase, for a key whose life was claimed under the phase's workflow; and never
    /// while another call with its derived key is in flight.
    async fn begin_call(
        &self,
        workflow: &str,
        phase: &'static str,
        before: &str,
        context: &PhaseContext,
        derived: &str,
    ) -> CallGuard<'_, E> {
        let actor = self.scheduler.current();
        self.log().counts.calls += 1;
        let row = E::sample(&self.observer, &context.tenant, context.key.as_str()).await;
        let name = format!("{}/{}", context.tenant.as_str(), context.key.as_str());
        // Token, lease and recovery point can all agree while this does not: a resumer of one
        // workflow that took a key claimed under another (its row lost alone and claimed again)
        // runs its own phases, with their derived keys, on the other workflow's request.
        if let Ok(Some(row)) = &row
            && row.workflow != workflow
        {
            self.violation(format!(
                "{actor} called {derived}, a derived key of {workflow}, for {name}, whose life \
                 was claimed under {}: one workflow's phase ran on another's request",
                row.workflow
            ));
        }
        let problem = match row {
            Err(error) => Some(format!("reading the key failed: {error}")),
            Ok(None) => Some("the key does not exist".to_owned()),
            Ok(Some(row)) if row.state != "started" => Some(format!("the key is {}", row.state)),
            Ok(Some(row)) if row.token != context.lock_version => Some(format!(
                "the caller holds token {} but the key's is {}",
                context.lock_version, row.token
            )),
            Ok(Some(row)) if !row.live => Some("the caller's lease has expired".to_owned()),
            Ok(Some(row)) if row.point != before => {
                Some(format!("the key is at {}, not at {before}", row.point))
            }
            Ok(Some(_)) => None,
        };
        if let Some(problem) = problem {
            self.violation(format!(
                "{actor} called {phase} for {name} as a stale owner: {problem}"
            ));
        }
        let id = self.next_call.fetch_add(1, Ordering::SeqCst);
        let overlapping: Vec<ActorId> = {
            let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
            let overlapping = calls
                .iter()
                .filter(|(key, other, _)| key == derived && *other != actor)
                .map(|(_, other, _)| *other)
                .collect();
            calls.push((derived.to_owned(), actor, id));
            overlapping
        };
        self.event(actor, format!("calls {derived}"));
        for other in overlapping {
            self.violation(format!(
                "{actor} called {derived} while {other}'s call with it was in flight"
            ));
        }
        CallGuard {
            shared: self,
            actor,
            id,
        }
    }
}

/// Ends a call's registration however the call ends; its caller no longer relies on its lease.
struct CallGuard<'s, E: ForeignSimEngine> {
    shared: &'s Shared<E>,
    actor: ActorId,
    id: u64,
}

impl<E: ForeignSimEngine> Drop for CallGuard<'_, E> {
    fn drop(&mut self) {
        self.shared
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|(_, _, id)| *id != self.id);
        self.shared.scheduler.conceal(self.actor);
    }
}

/// Quick retries and no give-up: the schedule's faults are transient, and every key must end.
fn policy() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(1000)
        .with_initial_backoff(Duration::from_millis(1))
        .with_max_backoff(Duration::from_millis(1))
        .with_multiplier(1.0)
        .with_jitter(0.0)
}

async fn charge_at<E: ForeignSimEngine>(
    shared: &Shared<E>,
    act: Act,
    derived: &str,
    amount: u64,
) -> Result<String, PhaseError> {
    match act {
        Act::Retryable => return Err(PhaseError::retryable("scripted failure")),
        Act::Panic => panic!("scripted panic"),
        Act::Slow(wait) => tokio::time::sleep(wait).await,
        Act::Succeed => {}
    }
    match shared
        .client
        .charge(derived, amount, "usd", "tok_visa")
        .await
    {
        Ok(ChargeResult::Succeeded { charge_id }) => Ok(charge_id),
        Ok(other) => Err(PhaseError::retryable(format!("{other:?}"))),
        Err(error) => Err(PhaseError::retryable(error.to_string())),
    }
}

struct Charge<E: ForeignSimEngine>(Arc<Shared<E>>);

#[async_trait]
impl<E: ForeignSimEngine> ForeignPhase for Charge<E> {
    const NAME: &'static str = "charge";
    type Input = Payment;
    type Output = Charged;

    fn timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        payment: Payment,
        context: &PhaseContext,
    ) -> Result<Charged, PhaseError> {
        let act = self.0.act(Self::NAME, context).await;
        let _call = self
            .0
            .begin_call(PAY, Self::NAME, "start", context, key.as_str())
            .await;
        let charge = charge_at(&self.0, act, key.as_str(), payment.amount).await?;
        Ok(Charged { payment, charge })
    }
}

struct Receipt<E: ForeignSimEngine>(Arc<Shared<E>>);

#[async_trait]
impl<E: ForeignSimEngine> ForeignPhase for Receipt<E> {
    const NAME: &'static str = "receipt";
    type Input = Charged;
    type Output = StoredResponse;

    fn timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        charged: Charged,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let act = self.0.act(Self::NAME, context).await;
        let _call = self
            .0
            .begin_call(PAY, Self::NAME, "charge", context, key.as_str())
            .await;
        let receipt = charge_at(&self.0, act, key.as_str(), 1).await?;
        // The token makes each execution's response its own: a second execution of one life
        // shows as a second response. The workflow shows whose phases made it.
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({
                "workflow": PAY,
                "tenant": charged.payment.tenant,
                "key": charged.payment.key,
                "amount": charged.payment.amount,
                "charge": charged.charge,
                "receipt": receipt,
                "token": context.lock_version,
            }),
        ))
    }
}

/// The payout's one phase: a call under its own derived key (`<tenant>:<key>:payout`), so a
/// request run by the other workflow's phases shows in the derived keys it calls.
struct Payout<E: ForeignSimEngine>(Arc<Shared<E>>);

#[async_trait]
impl<E: ForeignSimEngine> ForeignPhase for Payout<E> {
    const NAME: &'static str = "payout";
    type Input = Payment;
    type Output = StoredResponse;

    fn timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        payment: Payment,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let act = self.0.act(Self::NAME, context).await;
        let _call = self
            .0
            .begin_call(PAYOUT, Self::NAME, "start", context, key.as_str())
            .await;
        let payout = charge_at(&self.0, act, key.as_str(), payment.amount).await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({
                "workflow": PAYOUT,
                "tenant": payment.tenant,
                "key": payment.key,
                "amount": payment.amount,
                "payout": payout,
                "token": context.lock_version,
            }),
        ))
    }
}

/// The engine's crash points, as the schedule's yield points.
struct Hook<E: ForeignSimEngine>(Arc<Shared<E>>);

impl<E: ForeignSimEngine> std::fmt::Debug for Hook<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("Hook")
    }
}

#[async_trait]
impl<E: ForeignSimEngine> CrashHook for Hook<E> {
    async fn crash_at(&self, point: &CrashPoint, tenant: &TenantId, key: &Key) -> bool {
        let shared = &self.0;
        let actor = shared.scheduler.current();
        let name = format!("{}/{}", tenant.as_str(), key.as_str());
        match point {
            // From the write that confirmed its lease to the end of its call, the owner relies
            // on that lease: the schedule does not end it there.
            CrashPoint::AfterCommit { .. } | CrashPoint::BeforeCall { .. } => {
                shared.scheduler.expose(actor, &name);
            }
            CrashPoint::AfterCall { .. } => shared.scheduler.conceal(actor),
            // Where writes are made at once, the write "before its commit" is made already: the
            // owner relies on the lease it wrote from here (on a SQL engine, from the commit).
            CrashPoint::BeforeCommit { .. } if E::WRITES_AT_ONCE => {
                shared.scheduler.expose(actor, &name);
            }
            CrashPoint::AfterFinish => {
                *shared.log().finishes.entry(name.clone()).or_default() += 1;
            }
            _ => {}
        }
        let point_name = point.to_string();
        shared.event(actor, format!("waits at {point_name} of {name}"));
        let verdict = shared
            .scheduler
            .park(actor, &name, Point::Engine(point_name))
            .await;
        if matches!(point, CrashPoint::BeforeCommit { .. }) && verdict != Verdict::Crash {
            shared.scheduler.expose(actor, &name);
        }
        verdict == Verdict::Crash
    }
}

/// The workflows a resumer serves.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Serves {
    Both,
    Pay,
    Payout,
}

impl Serves {
    fn serves(self, workflow: usize) -> bool {
        matches!(
            (self, workflow),
            (Self::Both, _) | (Self::Pay, 0) | (Self::Payout, 1)
        )
    }
}

/// What the seed chose.
#[derive(Debug)]
struct Setup {
    keys: usize,
    steps: usize,
    /// Each resumer's batch size and workflows; the first serves both (the end's drains are
    /// its).
    resumers: Vec<(i64, Serves)>,
    apart: bool,
    sealed: bool,
}

impl Setup {
    fn draw(rng: &mut Rng) -> Self {
        let keys = rng.between(2, 4) as usize;
        let steps = rng.between(40, 90) as usize;
        let mut resumers = Vec::new();
        for index in 0..rng.between(1, 4) {
            let batch = rng.between(1, 4) as i64;
            let serves = if index == 0 {
                Serves::Both
            } else {
                rng.weighted(&[(2, Serves::Both), (1, Serves::Pay), (1, Serves::Payout)])
            };
            resumers.push((batch, serves));
        }
        Self {
            keys,
            steps,
            resumers,
            apart: rng.chance(0.4),
            sealed: rng.chance(0.3),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Action {
    Grant,
    Send,
    Burst,
    Impostor,
    Drain,
    Lapse,
    Fault,
    Age,
    Retention,
    Lose,
    Kill,
}

struct World<E: ForeignSimEngine> {
    shared: Arc<Shared<E>>,
    engine: PoolOf<E>,
    rng: Rng,
    slots: Vec<Slot>,
    runner: Runner<E>,
    /// As `WORKFLOWS` names them.
    workflows: [Arc<Workflow<E>>; 2],
    resumers: Vec<(Arc<Resumer<E>>, Arc<AtomicBool>)>,
    /// Per resumer, each slot's token as last sampled when its latest drain began: while that
    /// drain runs, a slot whose token has changed since may be one it took over, whose owner
    /// relies on its lease before reaching any point that says so.
    drain_tokens: Vec<Vec<Option<i64>>>,
    actors: JoinSet<()>,
}

/// The schedule's workflows, as `WORKFLOWS` names them.
fn workflows<E: ForeignSimEngine>(shared: &Arc<Shared<E>>) -> [Arc<Workflow<E>>; 2] {
    [
        Workflow::<E>::builder_on::<Payment>(PAY)
            .foreign(Charge(shared.clone()))
            .foreign(Receipt(shared.clone()))
            .lease(LEASE)
            .build(),
        Workflow::<E>::builder_on::<Payment>(PAYOUT)
            .foreign(Payout(shared.clone()))
            .lease(LEASE)
            .build(),
    ]
    .map(|built| {
        Arc::new(built.unwrap_or_else(|error| unreachable!("the sim workflows are valid: {error}")))
    })
}

/// The schedule's resumers, each serving the workflows its setup draws, with the flag that says
/// whether it is draining.
fn resumers<E: ForeignSimEngine>(
    setup: &Setup,
    workflows: &[Arc<Workflow<E>>; 2],
    runner: &Runner<E>,
) -> Vec<(Arc<Resumer<E>>, Arc<AtomicBool>)> {
    setup
        .resumers
        .iter()
        .map(|&(batch_size, serves)| {
            let mut registry = Registry::<E>::new();
            for (index, workflow) in workflows.iter().enumerate() {
                if serves.serves(index) {
                    registry
                        .register(workflow.clone())
                        .unwrap_or_else(|_| unreachable!("two workflows of distinct names"));
                }
            }
            let config = ResumerConfig::default()
                .with_batch_size(batch_size)
                .with_concurrency(1)
                .with_retention(None);
            (
                Arc::new(Resumer::with_config(runner.clone(), registry, config)),
                Arc::new(AtomicBool::new(false)),
            )
        })
        .collect()
}

/// Runs the foreign-only schedule `seed` on `engine` (a pool of its own, closed by nobody here),
/// with `observer` for the schedule's own reads and chaos; keys under tenants named for the seed.
pub(crate) async fn run<E: ForeignSimEngine>(
    provider: &Arc<MockProvider>,
    seed: u64,
    engine: PoolOf<E>,
    observer: PoolOf<E>,
) -> ScheduleReport {
    let mut rng = Rng::new(seed);
    let setup = Setup::draw(&mut rng);
    let shared = Arc::new(Shared::<E> {
        scheduler: Scheduler::default(),
        observer,
        provider: provider.clone(),
        client: ProviderClient::builder(provider.url())
            .timeout(Duration::from_millis(400))
            .build(),
        log: Mutex::new(Log::default()),
        calls: Mutex::new(Vec::new()),
        next_call: AtomicU64::new(0),
        began: Instant::now(),
    });
    let keyring = setup
        .sealed
        .then(|| Keyring::new("sim", [7; 32]).unwrap_or_else(|_| unreachable!("a valid key id")));
    let config = RunnerConfig::default()
        .with_keyring(keyring)
        .with_response_apart_above(if setup.apart {
            0
        } else {
            RunnerConfig::DEFAULT_RESPONSE_APART_ABOVE
        });
    let runner =
        Runner::<E>::on(engine.clone(), config).with_crash_hook(Arc::new(Hook(shared.clone())));
    let workflows = workflows(&shared);
    let resumers = resumers(&setup, &workflows, &runner);
    let tenants = ["a", "b"].map(|name| {
        TenantId::new(format!("fsim-{seed}-{name}"))
            .unwrap_or_else(|error| unreachable!("a valid tenant: {error}"))
    });
    let slots = (0..setup.keys)
        .flat_map(|index| {
            tenants.iter().enumerate().map(move |(which, tenant)| Slot {
                tenant: tenant.clone(),
                key: format!("k{index}"),
                amount: 1000 + 10 * index as u64 + which as u64,
                workflow: 0,
                seen: [None, None],
                aged: false,
            })
        })
        .collect();
    shared.event(
        ActorId(0),
        format!("seed {seed} on {}: {setup:?}", E::SIM_NAME),
    );
    let mut world = World {
        shared: shared.clone(),
        engine,
        rng,
        slots,
        runner,
        workflows,
        resumers,
        drain_tokens: Vec::new(),
        actors: JoinSet::new(),
    };
    for _ in 0..setup.steps {
        world.step().await;
        shared.scheduler.settle(QUIET, LONGEST_SETTLE).await;
        world.sample().await;
    }
    world.end().await;
    let log = std::mem::take(&mut *shared.log());
    ScheduleReport {
        seed,
        engine: E::SIM_NAME,
        violations: log.violations,
        history: log.history,
        counts: log.counts,
    }
}

impl<E: ForeignSimEngine> World<E> {
    async fn sample(&mut self) {
        for slot in &mut self.slots {
            let Ok(now) = E::sample(&self.shared.observer, &slot.tenant, &slot.key).await else {
                continue;
            };
            if now.as_ref().is_some_and(|row| row.state == "started") {
                slot.aged = false;
            }
            // Its client asks for what its row holds: a row claimed under the other workflow
            // (a client's request that was under way when the row was lost) wins over the
            // client's intent.
            if let Some(held) = now.as_ref().and_then(|row| {
                WORKFLOWS
                    .iter()
                    .position(|workflow| *workflow == row.workflow)
            }) {
                slot.workflow = held;
            }
            slot.seen = [now, slot.seen[0].take()];
        }
    }

    fn pick(&mut self) -> usize {
        self.rng.below(self.slots.len() as u64) as usize
    }

    async fn step(&mut self) {
        let waiting = self.shared.scheduler.waiting();
        let mut choices = vec![
            (3, Action::Send),
            (1, Action::Burst),
            (1, Action::Impostor),
            (2, Action::Drain),
            (2, Action::Lapse),
            (1, Action::Fault),
            (1, Action::Age),
            (1, Action::Retention),
            (1, Action::Lose),
            (1, Action::Kill),
        ];
        if !waiting.is_empty() {
            choices.push((14, Action::Grant));
        }
        match self.rng.weighted(&choices) {
            Action::Grant => {
                let parked = &waiting[self.rng.below(waiting.len() as u64) as usize];
                let verdict = match parked.point {
                    Point::Engine(_) if self.rng.chance(0.12) => Verdict::Crash,
                    Point::Engine(_) => Verdict::Go,
                    Point::Phase(_) => {
                        let slow = Duration::from_millis(self.rng.between(20, 200));
                        Verdict::Act(self.rng.weighted(&[
                            (16, super::workflow::Act::Succeed),
                            (2, super::workflow::Act::Retryable),
                            (1, super::workflow::Act::Slow(slow)),
                            (1, super::workflow::Act::Panic),
                        ]))
                    }
                };
                let mut log = self.shared.log();
                log.counts.grants += 1;
                if verdict == Verdict::Crash {
                    log.counts.crashes += 1;
                }
                drop(log);
                self.shared.event(
                    parked.actor,
                    format!("granted {verdict:?} at {} of {}", parked.point, parked.key),
                );
                self.shared.scheduler.grant(parked.actor, verdict);
            }
            Action::Send => {
                let index = self.pick();
                self.send(index);
            }
            Action::Burst => {
                let index = self.pick();
                for _ in 0..self.rng.between(2, 4) {
                    self.send(index);
                }
            }
            Action::Impostor => self.impostor(),
            Action::Drain => self.drain(),
            Action::Lapse => self.lapse().await,
            Action::Fault => self.fault(),
            Action::Age => self.age().await,
            Action::Retention => self.retention().await,
            Action::Lose => self.lose().await,
            Action::Kill => {
                let killed = E::kill(&self.engine, &self.shared.observer).await;
                self.shared.log().counts.kills += 1;
                self.shared.event(
                    ActorId(0),
                    format!("closes the engine's connections: {killed:?}"),
                );
            }
        }
    }

    /// A client sends the slot's request, for its workflow.
    fn send(&mut self, index: usize) {
        let slot = &self.slots[index];
        self.send_as(index, slot.workflow, slot.amount, false);
    }

    /// A client sends `amount` under the slot's key, for the workflow `workflow` names (an
    /// impostor: a request the key does not hold).
    fn send_as(&mut self, index: usize, workflow: usize, amount: u64, impostor: bool) {
        let slot = self.slots[index].clone();
        let actor = self.shared.scheduler.new_actor();
        let (runner, workflow, shared) = (
            self.runner.clone(),
            self.workflows[workflow].clone(),
            self.shared.clone(),
        );
        shared.log().counts.requests += 1;
        shared.event(
            actor,
            format!(
                "sends {} (amount {amount}, {})",
                slot.name(),
                workflow.name()
            ),
        );
        self.actors.spawn(ACTOR.scope(actor, async move {
            let result = client_request(&runner, &workflow, &slot, amount).await;
            record(&shared, actor, &slot, amount, &workflow, impostor, &result);
            shared.scheduler.ended(actor);
        }));
    }

    /// Another request under a key that holds one (claimed, not aged, so retention cannot take
    /// it away before the impostor's look-up): another amount for the workflow its row names, or
    /// the same body for the other workflow (a key is bound to its workflow as to its body).
    fn impostor(&mut self) {
        let index = self.pick();
        let slot = &self.slots[index];
        let Some(held) = slot.seen[0].as_ref().filter(|_| !slot.aged) else {
            return;
        };
        let Some(workflow) = WORKFLOWS
            .iter()
            .position(|workflow| *workflow == held.workflow)
        else {
            return;
        };
        let amount = slot.amount;
        if self.rng.chance(0.5) {
            self.send_as(index, workflow, amount + 500, true);
        } else {
            self.send_as(index, 1 - workflow, amount, true);
        }
    }

    fn drain(&mut self) {
        let index = self.rng.below(self.resumers.len() as u64) as usize;
        let (resumer, busy) = &self.resumers[index];
        if busy.swap(true, Ordering::SeqCst) {
            return;
        }
        let (resumer, busy, shared) = (resumer.clone(), busy.clone(), self.shared.clone());
        let tokens = self
            .slots
            .iter()
            .map(|slot| slot.seen[0].as_ref().map(|seen| seen.token))
            .collect();
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

    /// Whether a drain still running may have taken slot `index` over since it began.
    fn maybe_taken_by_a_drain(&self, index: usize, token: i64) -> bool {
        self.resumers
            .iter()
            .zip(&self.drain_tokens)
            .any(|((_, busy), tokens)| {
                busy.load(Ordering::SeqCst) && tokens.get(index).copied().flatten() != Some(token)
            })
    }

    /// Whether slot `index` is a started key no owner relies on, whose row was the same in the
    /// last two samples (an owner that wrote its lease a moment ago may be on its way to its
    /// call): one whose lease the schedule may end, or whose row it may lose.
    fn unrelied(&self, index: usize) -> bool {
        let slot = &self.slots[index];
        matches!(&slot.seen, [Some(now), Some(before)]
            if now.state == "started" && now == before
                && !self.maybe_taken_by_a_drain(index, now.token))
            && !self.shared.scheduler.is_exposed(&slot.name())
    }

    /// Ends the lease of a started key no owner relies on.
    async fn lapse(&mut self) {
        let candidates: Vec<usize> = (0..self.slots.len())
            .filter(|&index| self.unrelied(index))
            .collect();
        if candidates.is_empty() {
            return;
        }
        let index = candidates[self.rng.below(candidates.len() as u64) as usize];
        let slot = &self.slots[index];
        let Some(seen) = slot.seen[0].clone() else {
            return;
        };
        let lapsed = E::lapse(&self.shared.observer, &slot.tenant, &slot.key, &seen).await;
        self.shared.log().counts.lease_expiries += 1;
        self.shared.event(
            ActorId(0),
            format!(
                "ends the lease of {} (token {}): {lapsed:?}",
                slot.name(),
                seen.token
            ),
        );
    }

    fn fault(&mut self) {
        let index = self.pick();
        let slot = &self.slots[index];
        let phase = self
            .rng
            .weighted(&[(3, "charge"), (2, "receipt"), (2, "payout")]);
        let fault = match self.rng.weighted(&[(2, 0), (1, 1), (1, 2), (2, 3), (1, 4)]) {
            0 => Fault::ServerError(503),
            1 => Fault::Timeout,
            2 => Fault::ConnectionReset,
            3 => Fault::ExecuteThenDrop,
            _ => Fault::Delay(Duration::from_millis(150)),
        };
        let derived = format!("{}:{}:{phase}", slot.tenant.as_str(), slot.key);
        self.shared.event(
            ActorId(0),
            format!("provider fault {fault:?} for {derived}"),
        );
        self.shared.provider.push_fault_for(derived, fault);
    }

    async fn age(&mut self) {
        let index = self.pick();
        let slot = &mut self.slots[index];
        if let Ok(true) = E::age(&self.shared.observer, &slot.tenant, &slot.key).await {
            slot.aged = true;
            self.shared.log().counts.time_jumps += 1;
            self.shared
                .event(ActorId(0), format!("ages the finish of {}", slot.name()));
        }
    }

    /// Retention over the window: the keys it deleted count as deletions, and it may delete only
    /// keys whose finish was aged past the window.
    async fn retention(&mut self) {
        let before: Vec<bool> = self
            .slots
            .iter()
            .map(|slot| slot.seen[0].is_some())
            .collect();
        let expired = idemflow_runner::expire(&self.engine, RETENTION, 100).await;
        self.shared.log().counts.expiries += 1;
        self.shared
            .event(ActorId(0), format!("retention: {expired:?}"));
        for (index, was) in before.into_iter().enumerate() {
            let slot = &self.slots[index];
            if !was {
                continue;
            }
            if let Ok(None) = E::sample(&self.shared.observer, &slot.tenant, &slot.key).await {
                if slot.aged {
                    *self.shared.log().deletions.entry(slot.name()).or_default() += 1;
                } else {
                    self.shared.violation(format!(
                        "retention deleted {}, which was not finished past its window",
                        slot.name()
                    ));
                }
                self.slots[index].aged = false;
                self.slots[index].seen[0] = None;
            }
        }
    }

    /// Loses a key's row alone, as an eviction does: it takes cold keys, so the key is old
    /// first, then gone. A finished key's finish is aged past the window (its entry in the
    /// store's index of finishes with it); a started key no owner relies on (a crashed run's,
    /// one postponed) has its lease ended first (its entry in its workflow's index of lease ends
    /// with it, due). A key whose row is gone is new to the store, so its client's next request
    /// may be another workflow's (half the time); it comes back at once most of the time: its
    /// retry claims the key anew, under the old row's index entries if the store left them.
    async fn lose(&mut self) {
        let index = self.pick();
        let slot = &self.slots[index];
        let observer = &self.shared.observer;
        let lost = match slot.seen[0].as_ref() {
            Some(seen) if self.unrelied(index) => {
                E::lose_started(observer, &slot.tenant, &slot.key, seen).await
            }
            _ => match E::age(observer, &slot.tenant, &slot.key).await {
                Ok(true) => E::lose(observer, &slot.tenant, &slot.key).await,
                other => other,
            },
        };
        if let Ok(true) = lost {
            *self.shared.log().deletions.entry(slot.name()).or_default() += 1;
            self.shared
                .event(ActorId(0), format!("evicts the old row of {}", slot.name()));
            let slot = &mut self.slots[index];
            slot.seen[0] = None;
            slot.aged = false;
            if self.rng.chance(0.5) {
                slot.workflow = 1 - slot.workflow;
            }
            if self.rng.chance(0.7) {
                self.send(index);
            }
        }
    }

    /// Lets everyone go, heals, brings every key to a response by client retries, and checks.
    async fn end(mut self) {
        self.shared.scheduler.run_free();
        let wind_down = tokio::time::timeout(WIND_DOWN, async {
            while self.actors.join_next().await.is_some() {}
        })
        .await;
        if wind_down.is_err() {
            self.shared.violation(format!(
                "actors still running {WIND_DOWN:?} after the schedule"
            ));
            self.actors.abort_all();
        }
        let mut ended = vec![false; self.slots.len()];
        // A client retries the request its key's row holds, whichever workflow's it is.
        self.sample().await;
        for round in 0..END_ROUNDS {
            for (slot, ended) in self.slots.iter().zip(ended.iter_mut()) {
                if *ended {
                    continue;
                }
                let actor = self.shared.scheduler.new_actor();
                let workflow = &self.workflows[slot.workflow];
                let result = client_request(&self.runner, workflow, slot, slot.amount).await;
                record(
                    &self.shared,
                    actor,
                    slot,
                    slot.amount,
                    workflow,
                    false,
                    &result,
                );
                *ended = matches!(
                    &result,
                    Ok(Outcome::Executed(response) | Outcome::Replayed(response))
                        if response.status == 201
                );
            }
            if ended.iter().all(|ended| *ended) {
                break;
            }
            // What keeps a key from its end now is a lease no one holds (a crashed run) or a
            // postponed retry: end them, and let a resumer finish them.
            self.sample().await;
            for slot in &self.slots {
                if let Some(seen) = slot.seen[0].as_ref().filter(|row| row.state == "started") {
                    let _ = E::lapse(&self.shared.observer, &slot.tenant, &slot.key, seen).await;
                }
            }
            if let Some((resumer, _)) = self.resumers.first() {
                let report = resumer.drain().await;
                self.shared.event(
                    ActorId(0),
                    format!("round {round}: resumer drained {report:?}"),
                );
            }
        }
        for (slot, ended) in self.slots.iter().zip(&ended) {
            if !ended {
                self.shared.violation(format!(
                    "{} has no response after {END_ROUNDS} rounds of client retries",
                    slot.name()
                ));
            }
        }
        self.check();
        for problem in E::audit(&self.shared.observer).await {
            self.shared.violation(problem);
        }
    }

    fn check(&self) {
        let log = self.shared.log();
        let mut found = Vec::new();
        for slot in &self.slots {
            let name = slot.name();
            let lives = 1 + log.deletions.get(&name).copied().unwrap_or(0);
            let finishes = log.finishes.get(&name).copied().unwrap_or(0);
            if finishes > lives {
                found.push(format!(
                    "{name} was finished {finishes} times in {lives} life(s): a request ran twice"
                ));
            }
            let responses = log.responses.get(&name).map_or(0, Vec::len);
            if responses > lives as usize {
                found.push(format!(
                    "{name}'s clients got {responses} different responses in {lives} life(s)"
                ));
            }
        }
        drop(log);
        for problem in found {
            self.shared.violation(problem);
        }
    }
}

async fn client_request<E: ForeignSimEngine>(
    runner: &Runner<E>,
    workflow: &Workflow<E>,
    slot: &Slot,
    amount: u64,
) -> Result<Outcome, RunError> {
    let body = slot.body(amount);
    let request = Request {
        method: "POST",
        path: "/v1/payments",
        body: &body,
    };
    let key = Key::parse(&slot.key).unwrap_or_else(|_| unreachable!("the world makes valid keys"));
    runner.run(workflow, &slot.tenant, &key, request).await
}

/// Records a client's answer, and checks it is for this client: its tenant, key, amount and
/// workflow.
fn record<E: ForeignSimEngine>(
    shared: &Shared<E>,
    actor: ActorId,
    slot: &Slot,
    amount: u64,
    workflow: &Workflow<E>,
    impostor: bool,
    result: &Result<Outcome, RunError>,
) {
    let what = match result {
        Ok(Outcome::Executed(response)) => format!("executed {}", response.status),
        Ok(Outcome::Replayed(response)) => format!("replayed {}", response.status),
        Ok(Outcome::InProgress { .. }) => "in progress".to_owned(),
        Ok(Outcome::Mismatch) => "mismatch".to_owned(),
        Ok(other) => format!("{other:?}"),
        Err(error) => format!("error: {error}"),
    };
    shared.event(actor, format!("answered {}: {what}", slot.name()));
    let response = match result {
        Ok(Outcome::Executed(response) | Outcome::Replayed(response)) => response,
        _ => return,
    };
    if impostor {
        shared.violation(format!(
            "an impostor under {} (amount {amount}, {}) was answered {what}, not 422",
            slot.name(),
            workflow.name()
        ));
        return;
    }
    let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap_or_default();
    let mine = body["tenant"] == slot.tenant.as_str()
        && body["key"] == slot.key.as_str()
        && body["amount"] == amount
        && body["workflow"] == workflow.name();
    if !mine {
        shared.violation(format!(
            "{} (amount {amount}, {}) was answered another's response: {body}",
            slot.name(),
            workflow.name()
        ));
    }
    let mut log = shared.log();
    let responses = log.responses.entry(slot.name()).or_default();
    if !responses.contains(&response.body) {
        responses.push(response.body.clone());
    }
}
