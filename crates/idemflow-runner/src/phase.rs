use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, StoredResponse, TenantId};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::PgConnection;

/// A value that can cross a phase boundary: stored as a recovery point's output, read back by a
/// resumer in another process.
pub trait PhaseValue: Serialize + DeserializeOwned + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Send + 'static> PhaseValue for T {}

/// Where a phase runs: which key, for which tenant, in which execution.
#[derive(Debug, Clone)]
pub struct PhaseContext {
    pub tenant: TenantId,
    pub key: Key,
    /// Executions begun for this key: 1 for the claim, +1 for each takeover.
    pub attempt: i32,
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

    async fn call(
        &self,
        input: Self::Input,
        key: &DerivedKey,
        context: &PhaseContext,
    ) -> Result<Self::Output, PhaseError>;
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
