//! [`Standing`]: whether the transaction an engine began is still the one open on its connection
//! after a local phase ran in it.
//!
//! A local phase is handed the connection itself, so nothing stops its code from ending the
//! transaction under the runner: an explicit `COMMIT` or `ROLLBACK`, a statement the database
//! commits around (MariaDB's DDL, `LOCK TABLES`, `SET autocommit = 1`), or an error the database
//! answers by rolling the whole transaction back (a deadlock's victim on MariaDB, an interrupted
//! write, a full disk or an I/O error on SQLite). After that, statements run in autocommit, or in
//! a transaction the phase began: a recovery point written there would commit apart from the
//! effects it vouches for. So the engine's own writes refuse to run outside the transaction it
//! began (they change nothing, as a fenced write does), and the runner asks [`Engine::standing`]
//! what happened before it records anything.
//!
//! [`Engine::standing`]: crate::Engine::standing

/// How the transaction an engine began stands after a phase ran in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Standing {
    /// Still open: the transaction the engine began.
    Open,
    /// Ended by a rollback, and nothing has committed on the connection since: everything written
    /// in it, the phases' effects and any uncommitted claim or takeover, is undone, as if the
    /// attempt had failed before its first write. The engine says so only when it knows.
    RolledBack,
    /// Ended, and what the phases wrote may have committed (a `COMMIT`, a statement that
    /// commits implicitly, writes in autocommit after a rollback) without its recovery point.
    /// Running those phases again could apply their effects twice.
    Ended,
}

impl Standing {
    /// What happened, for a log line or a recorded error.
    pub fn describe(self) -> &'static str {
        match self {
            Standing::Open => "the transaction is open",
            Standing::RolledBack => {
                "the database rolled the transaction back under the phase: its writes are undone"
            }
            Standing::Ended => {
                "the transaction ended under the phase (a COMMIT, a ROLLBACK or a statement that \
                 commits implicitly): what it wrote may have committed without its recovery point"
            }
        }
    }
}
