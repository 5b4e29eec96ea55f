//! Warm connections: connections the runner keeps checked out of the pool between requests.
//!
//! Why: sqlx tests every connection that comes back to its pool with a round trip of its own
//! (a `Sync` and its `ReadyForQuery`, in a task spawned for it), whatever the pool's options. A
//! request that hands its connection back pays that round trip on the server and in the kernel,
//! and on a small machine it costs as much as the request's own statement (a primary-key select
//! from a pool runs at about half the rate it runs on connections held by each client). The
//! runner knows when its connection is clean: right after a statement of its own completed
//! outside any transaction (the look-up that answered a retry) or right after its `COMMIT`
//! succeeded. Only then is a connection kept here, and the next request takes it without asking
//! the pool. Every other release (an error, a cancelled request, a transaction dropped open) goes
//! back to the pool, tested as before.
//!
//! Kept connections are still the pool's: it counts them as in use. So that a caller waiting on
//! the pool itself (a handler of the service sharing it, a resumer's takeover, a heartbeat) is not
//! left waiting while the runner is busy, one release in [`THROUGH_POOL_EVERY`] goes back
//! through the pool, and a connection kept idle for [`IDLE_LIMIT`] goes back too (as do all of
//! them when the pool closes). Such a caller is served first even when a request of the runner
//! looks at the pool at the same moment: `try_acquire` passes over a connection while a caller
//! waits on the pool's semaphore, which is fair. A kept connection skips the pool's
//! `before_acquire` and `after_release` hooks as well as its test; keeping is off (every
//! connection from the pool and back) under [`crate::RunnerConfig::warm_connections`] `false`.
//!
//! A request that finds no connection kept takes one idle in the pool, or has the pool open one
//! while it may. When neither, it waits: a release is kept for the next request (most often the
//! releasing request's own next, which then needs no hand-over: the connection never sits idle)
//! until a request has waited [`HAND_OVER_AFTER`]; from then on releases are handed straight to
//! the longest-waiting request, first come first served, with no test. A waiting request also
//! looks for a kept or pooled connection every [`HAND_OVER_AFTER`]. Two designs were measured
//! and dropped: handing every release to whichever request comes next (requests that waited were
//! passed over again and again: HTTP replays at a quarter of the raw handler's rate), and sending
//! releases back to the pool while a request waits there (fair, but one wait made the next, and a
//! busy runner ran as if it kept nothing). A waiting request never races the pool's `acquire`
//! against a hand-over: a connection the pool was opening for it would be abandoned, closed, and
//! opened again for the next.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::engine::{ConnectionPool, EngineError};

/// One release in this many goes back through the pool rather than to the next request.
pub(crate) const THROUGH_POOL_EVERY: u64 = 16;

/// A request waiting this long is handed the next connection released; until then a release is
/// kept for the next request (most often the releasing one's own next, which then needs no
/// hand-over), and the waiting request looks for one every this long.
pub(crate) const HAND_OVER_AFTER: Duration = Duration::from_millis(1);

/// A connection kept idle this long goes back to the pool.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_millis(250);

/// The connections a runner keeps warm, shared by its clones.
pub(crate) struct Warm<P: ConnectionPool> {
    pool: P,
    /// At most this many kept idle: the pool's size, which they cannot exceed anyway; 0 when
    /// keeping is off ([`crate::RunnerConfig::warm_connections`]).
    capacity: usize,
    state: Mutex<State<P>>,
}

struct State<P: ConnectionPool> {
    /// Idle connections, the most recently kept last (taken first: its socket and its server
    /// process are the likeliest to be in cache).
    idle: Vec<(P::Pooled, Instant)>,
    /// Requests waiting for a connection, the longest-waiting first, with when they began.
    waiting: VecDeque<(Instant, oneshot::Sender<P::Pooled>)>,
    /// Releases so far, for [`THROUGH_POOL_EVERY`].
    released: u64,
    /// Whether the task returning idle connections to the pool runs.
    reaping: bool,
}

impl<P: ConnectionPool> Default for State<P> {
    fn default() -> Self {
        Self {
            idle: Vec::new(),
            waiting: VecDeque::new(),
            released: 0,
            reaping: false,
        }
    }
}

impl<P: ConnectionPool> fmt::Debug for Warm<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("Warm")
            .field("idle", &state.idle.len())
            .field("waiting", &state.waiting.len())
            .finish_non_exhaustive()
    }
}

impl<P: ConnectionPool> Warm<P> {
    pub(crate) fn new(pool: P, keeping: bool) -> Self {
        let capacity = if keeping { pool.max_size() as usize } else { 0 };
        Self {
            pool,
            capacity,
            state: Mutex::new(State::default()),
        }
    }

    /// A connection: a kept one, an idle one of the pool, a new one the pool opens, else the
    /// first of one handed over by a request that ends and one that comes back to the pool.
    pub(crate) async fn acquire(self: &Arc<Self>) -> Result<P::Pooled, EngineError> {
        if self.capacity == 0 {
            // Keeping is off: every connection comes from the pool, through its hooks.
            return self.pool.acquire().await;
        }
        if let Some(connection) = self.take() {
            return Ok(connection);
        }
        let max = self.pool.max_size();
        if self.pool.size() < max {
            // The pool opens one: awaited to the end, never raced against a hand-over (a
            // connection half-opened and abandoned would be closed, and opened again).
            return self.pool.acquire().await;
        }
        let mut handed = {
            let (sender, receiver) = oneshot::channel();
            self.state().waiting.push_back((Instant::now(), sender));
            receiver
        };
        loop {
            tokio::select! {
                biased;
                Ok(connection) = &mut handed => return Ok(connection),
                () = tokio::time::sleep(HAND_OVER_AFTER) => {
                    // Releases while this request waited less than that were kept, not handed
                    // over, and connections come back to the pool: look at both.
                    let found = self.take();
                    let opening = found.is_none() && self.pool.size() < max;
                    if found.is_some() || opening {
                        handed.close();
                        if let Ok(other) = handed.try_recv() {
                            self.keep(other);
                        }
                    }
                    if let Some(connection) = found {
                        return Ok(connection);
                    }
                    if opening {
                        return self.pool.acquire().await;
                    }
                }
            }
        }
    }

    /// The connection kept last, else one idle in the pool; without waiting.
    fn take(&self) -> Option<P::Pooled> {
        let mut state = self.state();
        if let Some((connection, _)) = state.idle.pop() {
            return Some(connection);
        }
        drop(state);
        self.pool.try_acquire()
    }

    /// Takes back a connection that is idle outside any transaction, with nothing queued on
    /// it: hands it to the request that has waited longest if that one has waited
    /// [`HAND_OVER_AFTER`], else keeps it for the next request; or hands it back to the pool
    /// (see the module's notes).
    pub(crate) fn keep(self: &Arc<Self>, connection: P::Pooled) {
        let spare = self.keep_or_spare(connection);
        // Dropped outside the lock: the pool may do work to take it back (sqlx spawns a task).
        drop(spare);
    }

    fn keep_or_spare(self: &Arc<Self>, mut connection: P::Pooled) -> Option<P::Pooled> {
        if self.pool.is_closed() || self.capacity == 0 {
            return Some(connection);
        }
        let mut state = self.state();
        state.released = state.released.wrapping_add(1);
        if state.released.is_multiple_of(THROUGH_POOL_EVERY) {
            return Some(connection);
        }
        loop {
            match state.waiting.front() {
                Some((_, waiter)) if waiter.is_closed() => {
                    // It found one itself, or was cancelled.
                    state.waiting.pop_front();
                }
                Some((since, _)) if since.elapsed() >= HAND_OVER_AFTER => {
                    let Some((_, waiter)) = state.waiting.pop_front() else {
                        unreachable!("looked at above")
                    };
                    match waiter.send(connection) {
                        Ok(()) => return None,
                        Err(back) => connection = back,
                    }
                }
                _ => break,
            }
        }
        if state.idle.len() >= self.capacity {
            return Some(connection);
        }
        state.idle.push((connection, Instant::now()));
        if !state.reaping {
            state.reaping = true;
            tokio::spawn(reap(Arc::downgrade(self), self.pool.clone()));
        }
        None
    }

    /// Gives back to the pool every connection kept idle since before `since` (all of them
    /// for `None`).
    fn give_back(&self, since: Option<Instant>) {
        let stale: Vec<(P::Pooled, Instant)> = {
            let mut state = self.state();
            match since {
                None => std::mem::take(&mut state.idle),
                Some(since) => {
                    // Kept in order, the oldest first.
                    let fresh = state.idle.partition_point(|(_, kept)| *kept < since);
                    state.idle.drain(..fresh).collect()
                }
            }
        };
        drop(stale);
    }

    /// The pool the connections belong to.
    pub(crate) fn pool(&self) -> &P {
        &self.pool
    }

    fn state(&self) -> MutexGuard<'_, State<P>> {
        // Nothing panics while holding it; a poisoned lock still holds consistent state.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Returns connections kept idle too long to the pool, and all of them once the pool closes
/// (its `close` waits for every connection to come back). Ends with the runner.
async fn reap<P: ConnectionPool>(warm: Weak<Warm<P>>, pool: P) {
    let closed = pool.closed();
    tokio::pin!(closed);
    loop {
        let closing = tokio::select! {
            _ = &mut closed => true,
            () = tokio::time::sleep(IDLE_LIMIT / 2) => false,
        };
        let Some(warm) = warm.upgrade() else {
            return;
        };
        if closing {
            warm.give_back(None);
            return;
        }
        warm.give_back(Some(Instant::now() - IDLE_LIMIT));
    }
}
