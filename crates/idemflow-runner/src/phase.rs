use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, Key, StoredResponse, TenantId};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::engine::{ConnectionOf, Isolation, SqlEngine};

use crate::retry::RetryPolicy;

/// A value that can cross a phase boundary: stored as a recovery point's output, read back by a
/// resumer in another process.
pub trait PhaseValue: Serialize + DeserializeOwned + Send + 'static {}
impl<T: Serialize + DeserializeOwned + Send + 'static> PhaseValue for T {}

/// Where a phase runs: which key, for which tenant, in which execution.
#[derive(Debug, Clone)]
pub struct PhaseContext {
    /// The tenant the key belongs to.
    pub tenant: TenantId,
    /// The client's idempotency key.
    pub key: Key,
    /// Executions begun at the key's current recovery point, this one included: 1 for the first,
    /// +1 for each takeover (by a client retry or a resumer).
    pub attempt: u32,
    /// The fencing token this execution holds the key with (unique: it never repeats for the
    /// key). A downstream system that can refuse stale writers may be given it.
    pub lock_version: i64,
}

/// A phase whose effects are statements in this database: the engine `E`'s (PostgreSQL unless
/// named), whose connection `run` receives. Only a [`SqlEngine`] has local phases: on an engine
/// without transactions to share, the effects could not commit with the recovery point.
///
/// `run` receives the runner's open transaction. The statements it issues, the advance of the
/// key's recovery point past this phase and this phase's serialized output commit together, in
/// one transaction fenced by the key's lock_version, or not at all. So `run` must do nothing
/// outside that connection that it could not do twice (no calls to other systems: those are
/// [`ForeignPhase`]s), and it may run again after a crash only if its transaction did not commit.
#[async_trait]
pub trait LocalPhase<E: SqlEngine>: Send + Sync + 'static {
    /// The durable name of this phase, stored as the recovery point. Never rename it while keys
    /// may be left at it.
    const NAME: &'static str;
    /// What the phase takes: the request for the first phase, the previous phase's output
    /// otherwise.
    type Input: PhaseValue;
    /// What the phase hands on: the next phase's input, or the response for the last phase.
    type Output: PhaseValue;

    /// How retryable errors of this phase are retried.
    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    /// The longest this phase may run; past it the attempt fails (retryably) and its transaction
    /// rolls back. `None`: half the workflow's lease. PostgreSQL enforces it too, on every
    /// statement (`statement_timeout`), so a phase stuck in a lock wait cannot hold the key, its
    /// claim and its locks any longer. SQLite has no such setting: there the runner's own stop,
    /// which closes the phase's connection (rolling it back), is the limit.
    fn timeout(&self) -> Option<Duration> {
        None
    }

    /// The isolation level this phase's statements need: Read Committed (the default), or a
    /// stronger one where what the phase keeps true spans several rows (a balance that must not
    /// go negative, a transfer between two rows). The transaction the phase runs in, shared with
    /// the local phases next to it (the first ones with the key's claim), runs at the strongest
    /// level any of them declares. A serialization failure or a deadlock there makes the runner
    /// run the whole transaction again at once, a few times, before it counts a failed attempt:
    /// docs/runner.md, "Choosing an isolation level".
    fn isolation(&self) -> Isolation {
        Isolation::ReadCommitted
    }

    /// Runs the phase's statements on `connection`, the runner's open transaction, and returns
    /// its output. An error rolls the transaction back; [`PhaseError`] says what happens next.
    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
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
    /// What the phase takes: the request for the first phase, the previous phase's output
    /// otherwise.
    type Input: PhaseValue;
    /// What the other system answered: the next phase's input, or the response for the last
    /// phase. Once it is committed (before the next foreign call at the latest), the call is
    /// never made again for the key.
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

    /// Calls the other system, sending `key` as its idempotency key, and returns its answer. An
    /// error, or no answer within [`ForeignPhase::timeout`], fails the attempt: see
    /// [`PhaseError`].
    async fn call(
        &self,
        key: &DerivedKey,
        input: Self::Input,
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
    /// The last completed phase (`start` before any), to know what to undo.
    pub recovery_point: String,
    /// The output stored with `recovery_point`, whichever attempt recorded it (a foreign call's
    /// result committed with the give-up, or a phase an earlier attempt completed): what the
    /// failure path may have to undo (a charge to refund). `None` at `start`.
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
pub trait FailurePhase<E: SqlEngine>: Send + Sync + 'static {
    /// The workflow's request type.
    type Request: PhaseValue;

    /// Runs in the transaction that finishes the key, and returns the response to store and
    /// replay. An error here stores a generic 500 problem instead.
    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        failure: Failure<Self::Request>,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError>;
}

/// How a phase failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PhaseErrorKind {
    /// Try again later (the default): nothing is stored but the error; the key stays started and
    /// resumable once `retry_after` (or the runner's default) has passed.
    Retryable {
        /// The earliest the key may be tried again; `None`: the phase's backoff
        /// ([`RetryPolicy::backoff`]).
        retry_after: Option<Duration>,
    },
    /// Give up: the request ends here. Its response (the given one, or a 500 problem) is stored
    /// and replayed, unless the runner's policy forgets the key instead.
    Terminal {
        /// The response to store; `None`: a 500 problem naming the error.
        response: Option<StoredResponse>,
    },
    /// The phase did nothing, and says so: the request was not executed (a routing refusal, a
    /// rate limit, an overloaded dependency that refused it). When no phase of the key has
    /// completed yet, the key is deleted and `response` answered, not stored: the client may
    /// send the same key again, as a new request. After a completed phase the key has effects
    /// that must not run twice, so it is a retryable failure instead.
    NotExecuted {
        /// The answer when the key is deleted; never stored.
        response: StoredResponse,
    },
}

/// A phase's failure. Retryable unless made terminal explicitly.
///
/// Any error type converts into a retryable one, so `?` works in a phase on sqlx's errors, an
/// HTTP client's, serde's, your own: the attempt fails, the key resumes after its backoff. Say
/// otherwise where it matters, with [`PhaseResultExt`]:
///
/// ```
/// use idemflow_runner::{PhaseError, PhaseResultExt};
///
/// fn parse_amount(text: &str) -> Result<u64, PhaseError> {
///     // A malformed amount will not become well formed by retrying: terminal.
///     let amount = text.parse::<u64>().terminal()?;
///     Ok(amount)
/// }
///
/// fn read_config(path: &str) -> Result<String, PhaseError> {
///     // Retryable, as any error is by default.
///     Ok(std::fs::read_to_string(path)?)
/// }
///
/// assert!(!parse_amount("12x").unwrap_err().is_retryable());
/// assert!(read_config("/nonexistent").unwrap_err().is_retryable());
/// ```
///
/// `PhaseError` is not itself a `std::error::Error`: that is what lets every error convert into
/// it (a blanket conversion would otherwise overlap the conversion of a type into itself).
///
/// A retryable error converted from an error value keeps that value: the runner reads the
/// database's own error in its chain (sqlx's, through whatever wraps it) and, when the database
/// rolled the transaction back to keep transactions apart (a serialization failure, a
/// deadlock), runs the transaction again rather than counting the attempt ([`Self::restarts`]).
#[derive(Debug, Clone)]
pub struct PhaseError {
    /// What the failure does to the key.
    pub kind: PhaseErrorKind,
    /// What went wrong: recorded as the key's `last_error`, logged, and told to the failure path.
    pub message: String,
    /// The error it was converted from, for the runner to read the database's error in it.
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
    /// The database rolled the transaction back to keep transactions apart.
    restarts: bool,
}

/// Equal when they say the same: the source is how the message was found, not what it says.
impl PartialEq for PhaseError {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.message == other.message
    }
}

impl Eq for PhaseError {}

impl PhaseError {
    fn of(kind: PhaseErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
            restarts: false,
        }
    }

    /// A retryable failure: the key is tried again after the phase's backoff.
    pub fn retryable(message: impl Into<String>) -> Self {
        Self::of(PhaseErrorKind::Retryable { retry_after: None }, message)
    }

    /// A retryable failure, not tried again before `retry_after` (a provider's `Retry-After`).
    pub fn retry_after(message: impl Into<String>, retry_after: Duration) -> Self {
        Self::of(
            PhaseErrorKind::Retryable {
                retry_after: Some(retry_after),
            },
            message,
        )
    }

    /// A terminal failure answered with a generic 500 problem.
    pub fn terminal(message: impl Into<String>) -> Self {
        Self::of(PhaseErrorKind::Terminal { response: None }, message)
    }

    /// A terminal failure answered with `response`.
    pub fn terminal_with(response: StoredResponse, message: impl Into<String>) -> Self {
        Self::of(
            PhaseErrorKind::Terminal {
                response: Some(response),
            },
            message,
        )
    }

    /// The phase did nothing: see [`PhaseErrorKind::NotExecuted`].
    pub fn not_executed(response: StoredResponse, message: impl Into<String>) -> Self {
        Self::of(PhaseErrorKind::NotExecuted { response }, message)
    }

    /// Whether the key is tried again (while the phase's retries last).
    pub fn is_retryable(&self) -> bool {
        matches!(self.kind, PhaseErrorKind::Retryable { .. })
    }

    /// Whether the database rolled the phase's transaction back to keep transactions apart (a
    /// serialization failure, a deadlock's victim): the runner then runs the whole transaction
    /// again at once, under the same key, without counting an attempt (a few times, then it is
    /// an ordinary retryable failure). Read from the error the phase returned, by its engine.
    pub fn restarts(&self) -> bool {
        self.restarts
    }

    /// Marks the error as one the database asked to restart from, when it is retryable and
    /// `restartable` says so of an error in the chain it was converted from.
    pub(crate) fn read_restart(
        mut self,
        restartable: impl Fn(&(dyn std::error::Error + 'static)) -> bool,
    ) -> Self {
        if !self.is_retryable() || self.restarts {
            return self;
        }
        let mut cause = self
            .source
            .as_deref()
            .map(|source| source as &(dyn std::error::Error + 'static));
        while let Some(error) = cause {
            if restartable(error) {
                self.restarts = true;
                break;
            }
            cause = error.source();
        }
        self
    }

    /// This error, marked as one the database asked to restart from.
    pub(crate) fn restarting(mut self, restarts: bool) -> Self {
        self.restarts = restarts;
        self
    }
}

impl std::fmt::Display for PhaseError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.message)
    }
}

/// Any error is a retryable failure: a database error rolls the phase's transaction back and the
/// key resumes; a provider's error is retried with the same derived key. The message is the
/// error and its sources, as the key's `last_error` shows them.
impl<E: std::error::Error + Send + Sync + 'static> From<E> for PhaseError {
    fn from(error: E) -> Self {
        let mut converted = Self::retryable(describe(&error));
        converted.source = Some(Arc::new(error));
        converted
    }
}

/// An error and its chain of sources, one line: `outer: inner: innermost`.
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = if error.is::<sqlx::Error>() {
        format!("database error: {error}")
    } else {
        error.to_string()
    };
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Many errors repeat their source in their own message already.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Says what a failure means, on any `Result` whose error is a `std::error::Error`, or text
/// (`&str`, `String`): whatever converts into a boxed error. See [`PhaseError`].
pub trait PhaseResultExt<T> {
    /// A failure retrying cannot fix: the request ends, answered with a 500 problem.
    fn terminal(self) -> Result<T, PhaseError>;
    /// A failure retrying cannot fix, answered with `response`.
    fn terminal_with(self, response: StoredResponse) -> Result<T, PhaseError>;
    /// Retryable (what `?` makes of it too), said explicitly.
    fn retryable(self) -> Result<T, PhaseError>;
    /// Retryable, not before `wait` (a provider's `Retry-After`).
    fn retry_after(self, wait: std::time::Duration) -> Result<T, PhaseError>;
}

impl<T, E> PhaseResultExt<T> for Result<T, E>
where
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    fn terminal(self) -> Result<T, PhaseError> {
        self.map_err(|error| PhaseError::terminal(describe(&*error.into())))
    }

    fn terminal_with(self, response: StoredResponse) -> Result<T, PhaseError> {
        self.map_err(|error| PhaseError::terminal_with(response, describe(&*error.into())))
    }

    fn retryable(self) -> Result<T, PhaseError> {
        self.map_err(|error| {
            let error: Box<dyn std::error::Error + Send + Sync + 'static> = error.into();
            let mut converted = PhaseError::retryable(describe(&*error));
            converted.source = Some(Arc::from(error));
            converted
        })
    }

    fn retry_after(self, wait: std::time::Duration) -> Result<T, PhaseError> {
        self.map_err(|error| PhaseError::retry_after(describe(&*error.into()), wait))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Outer(std::io::Error);

    impl std::fmt::Display for Outer {
        fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            formatter.write_str("calling the provider")
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    fn fails() -> Result<(), Outer> {
        Err(Outer(std::io::Error::other("connection reset")))
    }

    #[test]
    fn any_error_becomes_a_retryable_failure_naming_its_sources() {
        let question_mark = || -> Result<(), PhaseError> {
            fails()?;
            Ok(())
        };
        let error = question_mark().expect_err("fails");
        assert!(error.is_retryable());
        assert_eq!(error.message, "calling the provider: connection reset");
        let database: PhaseError = sqlx::Error::RowNotFound.into();
        assert!(
            database.message.starts_with("database error: "),
            "{database}"
        );
    }

    /// A phase's own refusals are often text: `Err("card declined")`, `Err(format!(…))`. Saying
    /// what they mean must work on them as on any error (it did not compile before).
    #[test]
    fn a_text_error_says_what_its_failure_means() {
        let declined: Result<(), &str> = Err("card declined");
        let response = StoredResponse::new(402, "declined");
        let error = declined.terminal_with(response.clone()).expect_err("fails");
        assert_eq!(
            error.kind,
            PhaseErrorKind::Terminal {
                response: Some(response)
            }
        );
        assert_eq!(error.message, "card declined");
        let later: Result<(), String> = Err(format!("provider busy ({} in queue)", 3));
        let error = later
            .retry_after(std::time::Duration::from_secs(2))
            .expect_err("fails");
        assert!(error.is_retryable());
        assert_eq!(error.message, "provider busy (3 in queue)");
    }

    #[test]
    fn a_result_says_what_its_failure_means() {
        assert_eq!(
            fails().terminal().expect_err("fails").kind,
            PhaseErrorKind::Terminal { response: None }
        );
        let response = StoredResponse::new(502, "bad gateway");
        assert_eq!(
            fails()
                .terminal_with(response.clone())
                .expect_err("fails")
                .kind,
            PhaseErrorKind::Terminal {
                response: Some(response)
            }
        );
        assert_eq!(
            fails()
                .retry_after(Duration::from_secs(3))
                .expect_err("fails")
                .kind,
            PhaseErrorKind::Retryable {
                retry_after: Some(Duration::from_secs(3))
            }
        );
        assert!(fails().retryable().expect_err("fails").is_retryable());
    }
}
