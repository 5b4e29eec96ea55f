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
    InProgress {
        /// What is left of the owner's lease; 1 s while the key is being claimed or changes hands.
        retry_after: Duration,
    },
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
        /// When the key may be tried again: the phase's backoff, or the wait its error asked for.
        retry_after: Duration,
        /// The error recorded as the key's `last_error`: the phase, and what it said.
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
    /// The idempotency key is not 1 to 255 bytes of printable ASCII (400).
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),
    /// The body is not JSON that canonicalizes (RFC 8785): invalid UTF-8, a syntax error, a
    /// duplicate member, a number beyond a double or one a double cannot hold as written (400).
    #[error("invalid JSON body: {0}")]
    InvalidBody(#[from] CanonicalError),
    /// The body is JSON but not the workflow's request: it does not decode into the request type,
    /// fails the workflow's check, or holds U+0000, which PostgreSQL's `jsonb` cannot store (422).
    #[error("the body does not fit the workflow's request: {0}")]
    InvalidInput(String),
}
