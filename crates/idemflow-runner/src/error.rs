use crate::engine::{DatabaseError, EngineError};

use crate::sealing::SealError;

/// Why a run failed without an [`crate::Outcome`]: the database, not the request.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A statement failed or the database could not be reached. What the run had not committed
    /// is rolled back; the client retries with the same key (answer 503).
    #[error("database error: {0}")]
    Database(#[from] DatabaseError),
    /// The database did not answer one of the engine's statements (or hand over a connection)
    /// within [`crate::RunnerConfig::database_timeout`]: it is down, unreachable, or overloaded.
    /// Nothing uncommitted lands; the client retries with the same key (answer 503).
    #[error("the database did not answer within {0:?}")]
    DatabaseTimeout(std::time::Duration),
    /// This owner lost its lease to a takeover while it ran: it committed nothing since, and the
    /// new owner finishes the request (answer 409).
    #[error("fenced: the lease on this key was taken over by another owner")]
    Fenced,
    /// A phase panicked. The panic was caught and recorded as a failed attempt (the key stays
    /// resumable, its retry policy applies), so this is a bug to fix, not a request to repeat
    /// at once (answer 500).
    #[error("phase {phase} panicked: {message}")]
    Panicked {
        /// The phase that panicked.
        phase: String,
        /// The panic's message (its payload, when that is text).
        message: String,
    },
    /// The database was busy past its limit (SQLite's one writer held by others for longer than
    /// the busy timeout): nothing of this request was written, no key was left started by it;
    /// the client retries with the same key shortly (answer 503 with `Retry-After`).
    #[error("the database is busy: its writer was held past the busy timeout")]
    Busy,
    /// A crash hook stopped the run at this crash point (tests only).
    #[error("crashed at {0}")]
    Crashed(String),
    /// A stored row breaks the schema's or the workflow's promises (a finished key without a
    /// response, say), or the store failed in a way this runner does not know. Never expected;
    /// reported rather than guessed around.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
    /// A stored value did not open with the runner's keyring ([`crate::RunnerConfig::keyring`]),
    /// or could not be sealed: nothing is answered from it (answer 500). A replay of a response
    /// sealed under a key id the keyring no longer holds, or moved from another row, ends here.
    #[error(transparent)]
    Sealing(#[from] SealError),
}

impl From<EngineError> for RunError {
    fn from(error: EngineError) -> Self {
        match error {
            EngineError::Fenced => Self::Fenced,
            EngineError::Busy => Self::Busy,
            // A serialization failure or a deadlock's victim the runner could not run again
            // (outside a drive, or past its restarts): nothing was kept, try again later.
            EngineError::Database(error) if error.is_restartable() => Self::Busy,
            EngineError::Database(error) => Self::Database(error),
            EngineError::Corrupt(message) => Self::Corrupt(message),
            // A kind of engine error this runner was not built to know of.
            other => Self::Corrupt(other.to_string()),
        }
    }
}
