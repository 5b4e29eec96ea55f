//! Who acts when. Every actor (a client's request, a resumer's task, a phase) stops at its yield
//! points (the engine's crash points and the start of every scripted phase) and waits there until
//! the schedule grants it a step. Between two grants everything else stands still, except what is
//! genuinely running: a slow phase, a provider call, a statement waiting for a lock.
//!
//! The scheduler also knows which keys are **exposed**: an owner between the write that confirmed
//! its lease and the end of its foreign call relies on that lease (the protocol's one timing
//! assumption), so the schedule never expires such a key's lease. Expiring it there would model an
//! owner frozen between its check and its call, which no protocol can tell from a live one.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::workflow::Act;

tokio::task_local! {
    /// The actor a future runs as, for futures the schedule started.
    pub(crate) static ACTOR: ActorId;
}

/// An actor of a schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ActorId(pub u64);

impl std::fmt::Display for ActorId {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "a{}", self.0)
    }
}

/// Where an actor waits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Point {
    /// One of the engine's crash points (`after_commit:reserve`, …).
    Engine(String),
    /// The start of a scripted phase: the grant says what the phase does.
    Phase(&'static str),
}

impl std::fmt::Display for Point {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Engine(point) => formatter.write_str(point),
            Self::Phase(phase) => write!(formatter, "phase:{phase}"),
        }
    }
}

/// What a waiting actor is told.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Verdict {
    /// Go on.
    Go,
    /// Stop here as if the process died (an engine point only).
    Crash,
    /// Run the phase this way (a phase point only).
    Act(Act),
}

struct Parked {
    key: String,
    point: Point,
    reply: oneshot::Sender<Verdict>,
}

#[derive(Default)]
struct State {
    parked: BTreeMap<ActorId, Parked>,
    exposed: HashMap<ActorId, String>,
    task_actors: HashMap<tokio::task::Id, ActorId>,
    /// Actors the engine started itself (a resumer's tasks), not the schedule.
    engine_actors: std::collections::HashSet<ActorId>,
    next_actor: u64,
    /// Set for the end of a schedule: nobody waits any more.
    free_running: bool,
    /// Bumped by every park, grant and end: how the schedule tells that things settled.
    events: u64,
}

/// The schedule's bookkeeping of actors.
#[derive(Default)]
pub(crate) struct Scheduler {
    state: Mutex<State>,
}

/// A parked actor, as the schedule sees it.
#[derive(Debug, Clone)]
pub(crate) struct Waiting {
    pub actor: ActorId,
    pub key: String,
    pub point: Point,
}

impl Scheduler {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new actor's name.
    pub(crate) fn new_actor(&self) -> ActorId {
        let mut state = self.state();
        state.next_actor += 1;
        ActorId(state.next_actor)
    }

    /// The actor running now: the one the schedule started this future as, or, for a task the
    /// engine spawned itself (a resumer's per-key task), a name given to that task.
    pub(crate) fn current(&self) -> ActorId {
        if let Ok(actor) = ACTOR.try_with(|actor| *actor) {
            return actor;
        }
        let Some(task) = tokio::task::try_id() else {
            return ActorId(0);
        };
        let mut state = self.state();
        if let Some(actor) = state.task_actors.get(&task) {
            return *actor;
        }
        state.next_actor += 1;
        let actor = ActorId(state.next_actor);
        state.task_actors.insert(task, actor);
        state.engine_actors.insert(actor);
        actor
    }

    /// Whether the engine started this actor (a resumer's task for one key).
    pub(crate) fn is_engine_actor(&self, actor: ActorId) -> bool {
        self.state().engine_actors.contains(&actor)
    }

    /// Waits at `point` until the schedule grants a step (at once when free running).
    pub(crate) async fn park(&self, actor: ActorId, key: &str, point: Point) -> Verdict {
        let (reply, granted) = oneshot::channel();
        {
            let mut state = self.state();
            if state.free_running {
                return Verdict::Go;
            }
            state.parked.insert(
                actor,
                Parked {
                    key: key.to_owned(),
                    point,
                    reply,
                },
            );
            state.events += 1;
        }
        // Dropped while waiting (its run was cancelled): it waits no more.
        let guard = Unpark {
            scheduler: self,
            actor,
        };
        let verdict = granted.await.unwrap_or(Verdict::Go);
        std::mem::forget(guard);
        verdict
    }

    /// Everyone waiting, in a fixed order.
    pub(crate) fn waiting(&self) -> Vec<Waiting> {
        self.state()
            .parked
            .iter()
            .map(|(actor, parked)| Waiting {
                actor: *actor,
                key: parked.key.clone(),
                point: parked.point.clone(),
            })
            .collect()
    }

    /// Lets a waiting actor go on with `verdict`.
    pub(crate) fn grant(&self, actor: ActorId, verdict: Verdict) {
        let mut state = self.state();
        if let Some(parked) = state.parked.remove(&actor) {
            let _ = parked.reply.send(verdict);
        }
        if verdict == Verdict::Crash {
            state.exposed.remove(&actor);
        }
        state.events += 1;
    }

    /// From now on nobody waits; everyone waiting goes on.
    pub(crate) fn run_free(&self) {
        let mut state = self.state();
        state.free_running = true;
        for (_, parked) in std::mem::take(&mut state.parked) {
            let _ = parked.reply.send(Verdict::Go);
        }
        state.events += 1;
    }

    /// `actor` relies on its lease on `key` from now until [`Scheduler::conceal`].
    pub(crate) fn expose(&self, actor: ActorId, key: &str) {
        self.state().exposed.insert(actor, key.to_owned());
    }

    pub(crate) fn conceal(&self, actor: ActorId) {
        self.state().exposed.remove(&actor);
    }

    /// Whether some actor relies on its lease on `key` right now.
    pub(crate) fn is_exposed(&self, key: &str) -> bool {
        self.state().exposed.values().any(|exposed| exposed == key)
    }

    /// An actor the schedule started has ended.
    pub(crate) fn ended(&self, actor: ActorId) {
        let mut state = self.state();
        state.exposed.remove(&actor);
        state.parked.remove(&actor);
        state.events += 1;
    }

    fn events(&self) -> u64 {
        self.state().events
    }

    /// Waits until nothing parked, was granted or ended for `quiet`, or `longest` passed: what is
    /// still moving then is running for real (a slow phase, a call, a lock wait).
    pub(crate) async fn settle(&self, quiet: Duration, longest: Duration) {
        let began = Instant::now();
        let mut seen = self.events();
        let mut changed = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let now = self.events();
            if now != seen {
                seen = now;
                changed = Instant::now();
            }
            if changed.elapsed() >= quiet || began.elapsed() >= longest {
                return;
            }
        }
    }
}

/// Removes a parked actor whose wait was cancelled.
struct Unpark<'s> {
    scheduler: &'s Scheduler,
    actor: ActorId,
}

impl Drop for Unpark<'_> {
    fn drop(&mut self) {
        let mut state = self.scheduler.state();
        state.parked.remove(&self.actor);
        state.events += 1;
    }
}
