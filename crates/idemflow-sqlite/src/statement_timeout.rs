//! The statement timeout SQLite lacks, installed on every connection the engine opens
//! ([`install`]).
//!
//! SQLite calls a connection's progress handler every [`PROGRESS_STEPS`] virtual machine steps,
//! but it counts a prepared statement's steps across all its runs, and tells the handler nothing
//! about which statement is stepping. A handler that guessed where a statement starts from the
//! pauses between its calls took a connection kept busy by short statements, one after another,
//! for one statement that never ends, and interrupted a healthy service (a bench's seeding, a
//! steady load) once the stream had lasted the timeout. So the start is not guessed: SQLite's
//! statement trace (`SQLITE_TRACE_STMT`) marks it, and the handler measures from there.
//!
//! Both callbacks run on the thread that steps the statement, inside `sqlite3_step`: sqlx gives
//! every connection a worker thread of its own, so the statement a thread last started is the
//! one its progress handler is called for. The start is kept in a thread-local, which needs no
//! pointer handed to SQLite and nothing to free when the connection closes.

// The one place the engine calls SQLite's C interface itself: sqlx offers the progress handler
// but not the statement trace.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void};
use std::time::{Duration, Instant};

use libsqlite3_sys::{SQLITE_OK, SQLITE_TRACE_STMT, sqlite3_trace_v2};
use sqlx::SqliteConnection;

/// Virtual machine steps between two calls of the progress handler: tens of microseconds of
/// work.
const PROGRESS_STEPS: i32 = 4_000;

/// A statement that goes this long without stepping (waiting for the disk, or for the write lock
/// within its busy timeout) starts its clock again: the timeout limits a statement's work, which
/// is what holds the write lock for good, not its waits.
const WAIT: Duration = Duration::from_millis(50);

/// When the statement this thread steps started, and when its clock last moved.
#[derive(Clone, Copy)]
struct Clock {
    started: Instant,
    last: Instant,
}

thread_local! {
    static STATEMENT: Cell<Option<Clock>> = const { Cell::new(None) };
}

/// Gives `connection` the statement timeout `limit`: a statement that steps for that long is
/// interrupted (`SQLITE_INTERRUPT`), and the connection serves on.
pub(crate) async fn install(
    connection: &mut SqliteConnection,
    limit: Duration,
) -> Result<(), sqlx::Error> {
    let mut handle = connection.lock_handle().await?;
    let database = handle.as_raw_handle();
    // SAFETY: `database` is this open connection's handle, held locked for the call. The
    // callback is a plain function that touches only a thread-local, and its context pointer is
    // null, so nothing SQLite keeps can dangle when the connection closes.
    let code = unsafe {
        sqlite3_trace_v2(
            database.as_ptr(),
            SQLITE_TRACE_STMT,
            Some(statement_started),
            std::ptr::null_mut(),
        )
    };
    if code != SQLITE_OK {
        return Err(sqlx::Error::Configuration(
            format!("the statement trace could not be installed (SQLite error {code})").into(),
        ));
    }
    handle.set_progress_handler(PROGRESS_STEPS, move || within(limit, Instant::now()));
    Ok(())
}

/// SQLite's statement trace: a statement (or a trigger's program within it) starts running.
unsafe extern "C" fn statement_started(
    event: c_uint,
    _context: *mut c_void,
    _statement: *mut c_void,
    _sql: *mut c_void,
) -> c_int {
    if event == SQLITE_TRACE_STMT {
        let now = Instant::now();
        STATEMENT.set(Some(Clock {
            started: now,
            last: now,
        }));
    }
    0
}

/// The progress handler: `false` (interrupt) once the statement stepping has run `limit`.
fn within(limit: Duration, now: Instant) -> bool {
    let mut clock = STATEMENT.get().unwrap_or(Clock {
        started: now,
        last: now,
    });
    if now.duration_since(clock.last) > WAIT {
        clock.started = now;
    }
    clock.last = now;
    STATEMENT.set(Some(clock));
    now.duration_since(clock.started) < limit
}
