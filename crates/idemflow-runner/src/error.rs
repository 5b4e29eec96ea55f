use idemflow_pg::StoreError;

/// Why a run failed without an [`crate::Outcome`]: the database, not the request.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// This owner lost its lease to a takeover while it ran: it committed nothing since, and the
    /// new owner finishes the request (answer 409).
    #[error("fenced: the lease on this key was taken over by another owner")]
    Fenced,
    /// A crash hook stopped the run at this crash point (tests only).
    #[error("crashed at {0}")]
    Crashed(String),
    #[error("corrupt key row: {0}")]
    Corrupt(String),
    /// The key is left at a recovery point this workflow does not have (a phase was renamed or
    /// removed while keys were left at it).
    #[error(
        "the key is left at recovery point {recovery_point:?}, which workflow {workflow:?} does not have"
    )]
    UnknownRecoveryPoint {
        workflow: String,
        recovery_point: String,
    },
}

impl From<StoreError> for RunError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Database(error) => Self::Database(error),
            StoreError::Corrupt(message) => Self::Corrupt(message),
        }
    }
}

pub(crate) fn corrupt(error: serde_json::Error) -> RunError {
    RunError::Corrupt(format!("a stored value does not decode: {error}"))
}
