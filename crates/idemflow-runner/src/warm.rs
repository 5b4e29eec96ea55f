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
//! them when the pool closes). A request that finds none kept waits on the pool, and while any
//! does, every release goes back to the pool: requests contending for connections are served
//! by the pool, in order, as without this module (a connection kept here would go to whichever
//! request came next, and one waiting could be passed over again and again).

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

type Connection = PoolConnection<Postgres>;

/// One release in this many goes back through the pool rather than to the next request.
pub(crate) const THROUGH_POOL_EVERY: u64 = 16;

/// A connection kept idle this long goes back to the pool.
pub(crate) const IDLE_LIMIT: Duration = Duration::from_millis(250);

/// The connections a runner keeps warm, shared by its clones.
pub(crate) struct Warm {
    pool: PgPool,
    /// At most this many kept idle: the pool's size, which they cannot exceed anyway.
    capacity: usize,
    state: Mutex<State>,
}

/// A request of the runner waiting on the pool, counted until it stops (served or cancelled).
struct Waiting<'a>(&'a Warm);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.state().waiting -= 1;
    }
}

#[derive(Default)]
struct State {
    /// Idle connections, the most recently kept last (taken first: its socket and its server
    /// process are the likeliest to be in cache).
    idle: Vec<(Connection, Instant)>,
    /// Requests of this runner waiting on the pool.
    waiting: usize,
    /// Connections sent back to the pool that no request of this runner has got yet (one may
    /// have gone to another caller of the pool: then the count stays up until a request of this
    /// runner gets one).
    sent: usize,
    /// Releases so far, for [`THROUGH_POOL_EVERY`].
    released: u64,
    /// Whether the task returning idle connections to the pool runs.
    reaping: bool,
}

impl fmt::Debug for Warm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("Warm")
            .field("idle", &state.idle.len())
            .field("waiting", &state.waiting)
            .finish_non_exhaustive()
    }
}

impl Warm {
    pub(crate) fn new(pool: PgPool) -> Self {
        let capacity = pool.options().get_max_connections() as usize;
        Self {
            pool,
            capacity,
            state: Mutex::new(State::default()),
        }
    }

    /// A connection: a kept one, else one from the pool.
    pub(crate) async fn acquire(&self) -> Result<Connection, sqlx::Error> {
        {
            let mut state = self.state();
            if let Some((connection, _)) = state.idle.pop() {
                return Ok(connection);
            }
            // Counted under the same lock as the look above: a connection released from now on
            // goes to the pool, where this request waits, not to the idle ones it has passed.
            state.waiting += 1;
        }
        let waiting = Waiting(self);
        let acquired = self.pool.acquire().await;
        if acquired.is_ok() {
            // One of the connections sent to the pool (or another) has come.
            let mut state = self.state();
            state.sent = state.sent.saturating_sub(1);
        }
        drop(waiting);
        acquired
    }

    /// Takes back a connection that is idle outside any transaction, with nothing queued on
    /// it, for the next request; or hands it back to the pool (see the module's notes).
    pub(crate) fn keep(self: &Arc<Self>, connection: Connection) {
        let spare = self.keep_or_spare(connection);
        // Dropped outside the lock: sqlx spawns the return to the pool.
        drop(spare);
    }

    fn keep_or_spare(self: &Arc<Self>, connection: Connection) -> Option<Connection> {
        if self.pool.is_closed() {
            return Some(connection);
        }
        let mut state = self.state();
        state.released = state.released.wrapping_add(1);
        // Requests waiting on the pool are served by the pool, in order (a connection kept here
        // would go to whichever request comes next instead): one connection for each that none
        // sent there is on its way to yet. Counting those on their way is what keeps one
        // request that waits (its own connection went back to the pool) from sending every
        // other connection after it, each of their requests then waiting in turn.
        let owed = state.waiting > state.sent;
        if owed || state.released.is_multiple_of(THROUGH_POOL_EVERY) {
            state.sent += 1;
            return Some(connection);
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
        let stale: Vec<(Connection, Instant)> = {
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
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding it; a poisoned lock still holds consistent state.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Returns connections kept idle too long to the pool, and all of them once the pool closes
/// (its `close` waits for every connection to come back). Ends with the runner.
async fn reap(warm: Weak<Warm>, pool: PgPool) {
    let closed = pool.close_event();
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
