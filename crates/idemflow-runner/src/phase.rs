use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, StoredResponse, TenantId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgConnection;

use crate::retry::RetryPolicy;

/// A value that can cross a phase boundary: stored as a recovery point's output, read back by a
/// resumer in another process.
pub trait PhaseValue: Serialize + DeserializeOwned + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Send + 'static> PhaseValue for T {}

/// Where a phase runs: which key, for which tenant, in which execution.
#[derive(Debug, Clone)]
pub struct PhaseContext {
    pub tenant: TenantId,
    pub key: Key,
    /// Executions begun at the key's current recovery point, this one included: 1 for the first,
    /// +1 for each takeover (by a client retry or a resumer).
    pub attempt: u32,
    /// The fencing token this execution holds the key with (unique: it never repeats for the
    /// key). A downstream system that can refuse stale writers may be given it.
    pub lock_version: i64,
}

/// A phase whose effects are statements in this database.
///
/// `run` receives the runner's open transaction. The statements it issues, the advance of the
/// key's recovery point past this phase and this phase's serialized output commit together, in
/// one transaction fenced by the key's lock_version, or not at all. So `run` must do nothing
/// outside that connection that it could not do twice (no calls to other systems: those are
/// [`ForeignPhase`]s), and it may run again after a crash only if its transaction did not commit.
#[async_trait]
pub trait LocalPhase: Send + Sync + 'static {
    /// The durable name of this phase, stored as the recovery point. Never rename it while keys
    /// may be left at it.
    const NAME: &'static str;
    type Input: PhaseValue;
    type Output: PhaseValue;

    /// How retryable errors of this phase are retried.
    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    /// The longest this phase may run; past it the attempt fails (retryably) and its transaction
    /// rolls back. `None`: half the workflow's lease. The database enforces it too, on every
    /// statement (`statement_timeout`), so a phase stuck in a lock wait cannot hold the key, its
    /// claim and its locks any longer.
    fn timeout(&self) -> Option<Duration> {
        None
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        input: Self::Input,
        context: &PhaseContext,
    ) -> Result<Self::Output, PhaseError>;
}

/// A phase that calls another system (a payment provider, say).
///
/// No transaction is open during the call. It receives a [`DerivedKey`] to send as that system's
/// idempotency key: the same on every attempt and after every takeover, so a repeated call after
/// a crash is answered with the first result instead of acting twice. Its output is committed,
/// fenced, before the next foreign phase is called.
#[async_trait]
pub trait ForeignPhase: Send + Sync + 'static {
    /// The durable name of this phase; also part of the derived key.
    const NAME: &'static str;
    type Input: PhaseValue;
    type Output: PhaseValue;

    /// The longest the runner waits for `call` before treating it as a retryable failure. Must be
    /// shorter than the workflow's lease (checked when the workflow is built), so an owner never
    /// keeps calling after its lease could have been taken over.
    fn timeout(&self) -> Duration {
        Duration::from_secs(20)
    }

    /// How retryable errors (and timeouts) of this phase are retried.
    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    async fn call(
        &self,
        input: Self::Input,
        key: &DerivedKey,
        context: &PhaseContext,
    ) -> Result<Self::Output, PhaseError>;
}

/// What a workflow's failure path is told when the workflow gives up on a key.
#[derive(Debug, Clone)]
pub struct Failure<Request> {
    /// The request, as first accepted.
    pub request: Request,
    /// The phase whose retries ran out.
    pub phase: &'static str,
    /// The last completed phase (`start` before any) and its stored output, to know what to undo.
    pub recovery_point: String,
    pub recovery_output: Option<serde_json::Value>,
    /// The last error.
    pub error: String,
    /// Executions of `phase` that failed.
    pub attempts: u32,
}

/// A workflow's failure path: a local phase that runs when a phase's retries run out (mark the
/// order failed, say). Its statements and the response it returns commit together with the key's
/// finish, so no key stays started forever. If it fails itself, a generic 500 problem is stored.
#[async_trait]
pub trait FailurePhase: Send + Sync + 'static {
    type Request: PhaseValue;

    async fn run(
        &self,
        connection: &mut PgConnection,
        failure: Failure<Self::Request>,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError>;
}

/// How a phase failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PhaseErrorKind {
    /// Try again later (the default): nothing is stored but the error; the key stays started and
    /// resumable once `retry_after` (or the runner's default) has passed.
    Retryable { retry_after: Option<Duration> },
    /// Give up: the request ends here. Its response (the given one, or a 500 problem) is stored
    /// and replayed, unless the runner's policy releases the key instead.
    Terminal { response: Option<StoredResponse> },
    /// The phase did nothing, and says so: the request was not executed (a routing refusal, a
    /// rate limit, an overloaded dependency that refused it). When no phase of the key has
    /// completed yet, the key is deleted and `response` answered, not stored: the client may
    /// send the same key again, as a new request. After a completed phase the key has effects
    /// that must not run twice, so it is a retryable failure instead.
    NotExecuted { response: StoredResponse },
}

/// A phase's failure. Retryable unless made terminal explicitly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct PhaseError {
    pub kind: PhaseErrorKind,
    pub message: String,
}

impl PhaseError {
    pub fn retryable(message: impl Into<String>) -> Self {
        Self {
            kind: PhaseErrorKind::Retryable { retry_after: None },
            message: message.into(),
        }
    }

    pub fn retry_after(message: impl Into<String>, retry_after: Duration) -> Self {
        Self {
            kind: PhaseErrorKind::Retryable {
                retry_after: Some(retry_after),
            },
            message: message.into(),
        }
    }

    /// A terminal failure answered with a generic 500 problem.
    pub fn terminal(message: impl Into<String>) -> Self {
        Self {
            kind: PhaseErrorKind::Terminal { response: None },
            message: message.into(),
        }
    }

    /// A terminal failure answered with `response`.
    pub fn terminal_with(response: StoredResponse, message: impl Into<String>) -> Self {
        Self {
            kind: PhaseErrorKind::Terminal {
                response: Some(response),
            },
            message: message.into(),
        }
    }

    /// The phase did nothing: see [`PhaseErrorKind::NotExecuted`].
    pub fn not_executed(response: StoredResponse, message: impl Into<String>) -> Self {
        Self {
            kind: PhaseErrorKind::NotExecuted { response },
            message: message.into(),
        }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, PhaseErrorKind::Retryable { .. })
    }
}

/// Database errors inside a phase are retryable: the transaction rolls back and the key resumes.
impl From<sqlx::Error> for PhaseError {
    fn from(error: sqlx::Error) -> Self {
        Self::retryable(format!("database error: {error}"))
    }
}
