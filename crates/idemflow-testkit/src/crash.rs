//! A crash hook that stops a whole process at one crash point, for tests that kill a real process
//! there (SIGKILL) and let another process finish the request.
//!
//! The explorer ([`crate::explorer`]) crashes a run inside one process. A service's own binary is
//! tested the harder way: start it with [`ProcessCrash::from_env`] installed
//! (`Runner::with_crash_hook`), send a request, wait for the line
//! `crash point reached: <point>` on its stdout, kill it, and check that a worker (or the client's
//! retry) finishes the request with every effect done once.
//!
//! ```no_run
//! # fn example(runner: idemflow_runner::Runner<idemflow_sqlite::SqliteStore>) {
//! use idemflow_testkit::crash::ProcessCrash;
//!
//! // IDEMFLOW_CRASH_AT=after_call:charge stops this process right after the provider answered.
//! let runner = match ProcessCrash::from_env("IDEMFLOW_CRASH_AT") {
//!     Some(hook) => runner.with_crash_hook(hook),
//!     None => runner,
//! };
//! # let _ = runner;
//! # }
//! ```

use std::io::Write;
use std::sync::Arc;

use idemflow_core::{Key, TenantId};
/// The runner's crash points and hooks, named here for tests: the testkit turns them on (the
/// runner's `crash-hooks` feature), while `idemflow::CrashHook` also needs idemflow's own
/// `crash-hooks` feature in your dev-dependencies.
pub use idemflow_runner::{CrashHook, CrashPoint};

/// Stops the process at one crash point: prints `crash point reached: <point>` and then makes no
/// further progress on that run, as a hung or dying process would, until the process is killed.
/// Other runs in the process go on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessCrash {
    point: String,
}

impl ProcessCrash {
    /// Stops at `point`, written as [`CrashPoint`] displays it (`after_call:charge`,
    /// `before_commit:create_order`, …).
    pub fn at(point: impl Into<String>) -> Self {
        Self {
            point: point.into(),
        }
    }

    /// The hook the environment variable `variable` asks for, if it is set.
    pub fn from_env(variable: &str) -> Option<Arc<Self>> {
        let point = std::env::var(variable).ok()?;
        Some(Arc::new(Self::at(point)))
    }

    /// The crash point this hook stops at.
    pub fn point(&self) -> &str {
        &self.point
    }
}

#[async_trait::async_trait]
impl CrashHook for ProcessCrash {
    async fn crash_at(&self, point: &CrashPoint, _: &TenantId, _: &Key) -> bool {
        if point.to_string() != self.point {
            return false;
        }
        {
            let mut stdout = std::io::stdout().lock();
            let _ = writeln!(stdout, "crash point reached: {point}");
            let _ = stdout.flush();
        }
        // Never returns: this run is frozen where it stands, its transaction open or its call
        // made, until the process is killed. Parking a thread of the runtime is the point: the
        // run must not make progress, as in a process that died there.
        loop {
            std::thread::park();
        }
    }
}
