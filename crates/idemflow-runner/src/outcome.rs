use std::time::Duration;

use idemflow_core::{CanonicalError, KeyError, StoredResponse};

/// What became of a request. Each variant carries what an HTTP layer needs to answer.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// This call ran the request (or finished it after a takeover); the response is stored.
    /// A terminal phase error under [`crate::TerminalPolicy::Store`] ends here too.
    Executed(StoredResponse),
    /// The key had finished: this is its stored response, byte for byte (answer it with
    /// `Idempotent-Replayed: true`).
    Replayed(StoredResponse),
    /// Another owner holds a live lease on the key (409, `Retry-After` from `retry_after`).
    InProgress { retry_after: Duration },
    /// The key was used for a different request, or by another workflow (422).
    Mismatch,
    /// Rejected before execution: nothing was stored, the client may fix the request and send
    /// it again under the same key (400 for a bad key or body, 422 for an input of the wrong
    /// shape).
    Rejected(Rejection),
    /// A phase failed with a retryable error: the key stays started and resumable, its lease
    /// ends after `retry_after` (503 with `Retry-After`, or 202 for an API that resumes in the
    /// background).
    Interrupted {
        retry_after: Duration,
        error: String,
    },
    /// A phase failed terminally under [`crate::TerminalPolicy::Forget`]: the key was deleted,
    /// this response was not stored, and the same key may be sent again as a new request.
    Forgotten(StoredResponse),
}

/// Why a request was rejected before execution.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),
    #[error("invalid JSON body: {0}")]
    InvalidBody(#[from] CanonicalError),
    #[error("the body does not fit the workflow's request: {0}")]
    InvalidInput(String),
}
