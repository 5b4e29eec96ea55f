//! A built workflow's phases with their types erased, as the runner drives them.
//!
//! The builder ([`crate::WorkflowBuilder`]) checks at compile time that each phase takes the
//! previous one's output; once built, the runner walks a list of [`Step`]s whose values travel as
//! [`Carry`] (a boxed `Any`) and are encoded to JSON only where a recovery point stores them.
//! A value of an unexpected type here would be a defect of the builder, and is a terminal error
//! rather than a panic.

use std::any::Any;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, PhaseName, StoredResponse};
use serde_json::Value;

use crate::engine::{ConnectionOf, DatabaseError, Engine, EngineError, Isolation, SqlEngine};
use crate::heartbeat::overrun_grace;
use crate::panic::catch_panic;

use crate::phase::{
    Failure, FailurePhase, ForeignPhase, LocalPhase, PhaseContext, PhaseError, PhaseValue,
};
use crate::retry::RetryPolicy;

/// A phase's output on its way to the next phase, its type erased. Values cross a phase boundary
/// in memory as they are; they are serialized only where a recovery point stores them.
pub(crate) type Carry = Box<dyn Any + Send>;

/// Decodes from a borrowed value: a request or a stored output is read, never copied to be read.
pub(crate) fn decode<T: PhaseValue>(value: &Value) -> Result<Carry, serde_json::Error> {
    Ok(Box::new(T::deserialize(value)?))
}

fn encode<T: PhaseValue>(carry: &Carry) -> Result<Value, serde_json::Error> {
    match carry.downcast_ref::<T>() {
        Some(value) => serde_json::to_value(value),
        None => Err(serde::ser::Error::custom(
            "phase output of an unexpected type",
        )),
    }
}

fn downcast<T: 'static>(carry: Carry, phase: &str) -> Result<T, PhaseError> {
    carry.downcast::<T>().map(|boxed| *boxed).map_err(|_| {
        PhaseError::terminal(format!(
            "phase {phase} received an input of an unexpected type"
        ))
    })
}

/// One phase of a built workflow, its types erased.
#[derive(Debug)]
pub(crate) enum Step<E: Engine> {
    Local(Box<dyn ErasedLocal<E>>),
    Foreign(Box<dyn ErasedForeign>),
}

impl<E: Engine> Step<E> {
    pub(crate) fn local<P: LocalPhase<E>>(phase: P) -> Self
    where
        E: SqlEngine,
    {
        Self::Local(Box::new(LocalStep {
            name: <P as LocalPhase<E>>::NAME,
            phase,
        }))
    }

    pub(crate) fn foreign<P: ForeignPhase>(phase: P) -> Self {
        Self::Foreign(Box::new(ForeignStep {
            name: P::NAME,
            phase,
        }))
    }

    pub(crate) fn raw_name(&self) -> &'static str {
        match self {
            Self::Local(local) => local.name(),
            Self::Foreign(foreign) => foreign.name(),
        }
    }

    /// Valid once the workflow is built.
    pub(crate) fn name(&self) -> PhaseName {
        PhaseName::new(self.raw_name())
            .unwrap_or_else(|_| unreachable!("checked by WorkflowBuilder::build"))
    }

    pub(crate) fn retry_policy(&self) -> RetryPolicy {
        match self {
            Self::Local(local) => local.retry_policy(),
            Self::Foreign(foreign) => foreign.retry_policy(),
        }
    }

    pub(crate) fn encode_output(&self, carry: &Carry) -> Result<Value, serde_json::Error> {
        match self {
            Self::Local(local) => local.encode_output(carry),
            Self::Foreign(foreign) => foreign.encode_output(carry),
        }
    }

    pub(crate) fn decode_output(&self, value: &Value) -> Result<Carry, serde_json::Error> {
        match self {
            Self::Local(local) => local.decode_output(value),
            Self::Foreign(foreign) => foreign.decode_output(value),
        }
    }
}

#[async_trait]
pub(crate) trait ErasedLocal<E: Engine>: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn retry_policy(&self) -> RetryPolicy;
    fn timeout(&self) -> Option<Duration>;
    fn isolation(&self) -> Isolation;
    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: Carry,
        context: &PhaseContext,
    ) -> Result<Carry, PhaseError>;
    fn encode_input(&self, carry: &Carry) -> Result<Value, serde_json::Error>;
    fn encode_output(&self, carry: &Carry) -> Result<Value, serde_json::Error>;
    fn decode_output(&self, value: &Value) -> Result<Carry, serde_json::Error>;
}

#[async_trait]
pub(crate) trait ErasedForeign: Send + Sync + std::fmt::Debug {
    fn name(&self) -> &'static str;
    fn retry_policy(&self) -> RetryPolicy;
    fn timeout(&self) -> Duration;
    async fn call(
        &self,
        key: &DerivedKey,
        input: Carry,
        context: &PhaseContext,
    ) -> Result<Carry, PhaseError>;
    fn encode_output(&self, carry: &Carry) -> Result<Value, serde_json::Error>;
    fn decode_output(&self, value: &Value) -> Result<Carry, serde_json::Error>;
}

struct LocalStep<P> {
    name: &'static str,
    phase: P,
}

impl<P> std::fmt::Debug for LocalStep<P> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "LocalStep({})", self.name)
    }
}

#[async_trait]
impl<E: SqlEngine, P: LocalPhase<E>> ErasedLocal<E> for LocalStep<P> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn retry_policy(&self) -> RetryPolicy {
        LocalPhase::<E>::retry_policy(&self.phase)
    }

    fn timeout(&self) -> Option<Duration> {
        LocalPhase::<E>::timeout(&self.phase)
    }

    fn isolation(&self) -> Isolation {
        LocalPhase::<E>::isolation(&self.phase)
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: Carry,
        context: &PhaseContext,
    ) -> Result<Carry, PhaseError> {
        let input = downcast::<<P as LocalPhase<E>>::Input>(input, self.name)?;
        let output = LocalPhase::<E>::run(&self.phase, connection, input, context)
            .await
            .map_err(|error| error.read_restart(restartable::<E>))?;
        Ok(Box::new(output))
    }

    fn encode_input(&self, carry: &Carry) -> Result<Value, serde_json::Error> {
        encode::<<P as LocalPhase<E>>::Input>(carry)
    }

    fn encode_output(&self, carry: &Carry) -> Result<Value, serde_json::Error> {
        encode::<<P as LocalPhase<E>>::Output>(carry)
    }

    fn decode_output(&self, value: &Value) -> Result<Carry, serde_json::Error> {
        decode::<<P as LocalPhase<E>>::Output>(value)
    }
}

/// Whether `error`, one link of a phase's error chain, is the database rolling the transaction
/// back to keep transactions apart, as engine `E` classifies its errors: sqlx's error (what `?`
/// on a statement gives), or the boundary's (a phase that called the engine's functions).
fn restartable<E: SqlEngine>(error: &(dyn std::error::Error + 'static)) -> bool {
    if let Some(error) = error.downcast_ref::<sqlx::Error>() {
        return E::is_restartable(error);
    }
    if let Some(error) = error.downcast_ref::<DatabaseError>() {
        return error.is_restartable();
    }
    error
        .downcast_ref::<EngineError>()
        .is_some_and(EngineError::is_restartable)
}

struct ForeignStep<P> {
    name: &'static str,
    phase: P,
}

impl<P> std::fmt::Debug for ForeignStep<P> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "ForeignStep({})", self.name)
    }
}

#[async_trait]
impl<P: ForeignPhase> ErasedForeign for ForeignStep<P> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.phase.retry_policy()
    }

    fn timeout(&self) -> Duration {
        self.phase.timeout()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        input: Carry,
        context: &PhaseContext,
    ) -> Result<Carry, PhaseError> {
        let input = downcast::<P::Input>(input, self.name)?;
        let output = self.phase.call(key, input, context).await?;
        Ok(Box::new(output))
    }

    fn encode_output(&self, carry: &Carry) -> Result<Value, serde_json::Error> {
        encode::<P::Output>(carry)
    }

    fn decode_output(&self, value: &Value) -> Result<Carry, serde_json::Error> {
        decode::<P::Output>(value)
    }
}

/// What the runner knows of a failure when it gives up, before the request is decoded.
#[derive(Debug)]
pub(crate) struct GiveUp {
    pub request: Value,
    pub phase: &'static str,
    pub recovery_point: String,
    pub recovery_output: Option<Value>,
    pub error: String,
    pub attempts: u32,
}

#[async_trait]
pub(crate) trait ErasedFailure<E: Engine>: Send + Sync {
    /// Runs the failure path in a savepoint of `tx`, within `limit` (and its grace): the
    /// savepoint is kept when the path answers, and rolled back (with why, to log) when it fails,
    /// panics or overruns.
    async fn run_in_savepoint(
        &self,
        tx: &mut E::Transaction,
        give_up: GiveUp,
        context: &PhaseContext,
        limit: Duration,
    ) -> Result<Result<StoredResponse, String>, EngineError>;
}

impl<E: Engine> std::fmt::Debug for dyn ErasedFailure<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("FailurePath")
    }
}

struct FailureStep<F> {
    failure: F,
}

impl<F> FailureStep<F> {
    async fn run<E: SqlEngine>(
        &self,
        connection: &mut ConnectionOf<E>,
        give_up: GiveUp,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError>
    where
        F: FailurePhase<E>,
    {
        let request = serde_json::from_value::<<F as FailurePhase<E>>::Request>(give_up.request)
            .map_err(|error| {
                PhaseError::terminal(format!("the stored request does not decode: {error}"))
            })?;
        let failure = Failure {
            request,
            phase: give_up.phase,
            recovery_point: give_up.recovery_point,
            recovery_output: give_up.recovery_output,
            error: give_up.error,
            attempts: give_up.attempts,
        };
        FailurePhase::<E>::run(&self.failure, connection, failure, context).await
    }
}

#[async_trait]
impl<E: SqlEngine, F: FailurePhase<E>> ErasedFailure<E> for FailureStep<F> {
    async fn run_in_savepoint(
        &self,
        tx: &mut E::Transaction,
        give_up: GiveUp,
        context: &PhaseContext,
        limit: Duration,
    ) -> Result<Result<StoredResponse, String>, EngineError> {
        let mut savepoint = sqlx::Connection::begin(E::connection(tx))
            .await
            .map_err(E::engine_error)?;
        let ran = tokio::time::timeout(
            limit + overrun_grace(limit),
            catch_panic(self.run::<E>(&mut savepoint, give_up, context)),
        )
        .await;
        match ran {
            Ok(Ok(Ok(response))) => {
                savepoint.commit().await.map_err(E::engine_error)?;
                Ok(Ok(response))
            }
            failed => {
                let why = match failed {
                    Ok(Ok(Err(error))) => error.message,
                    Ok(Err(panic)) => format!("panicked: {panic}"),
                    _ => format!("timed out after {limit:?}"),
                };
                // A savepoint rollback needs the connection in a known state: after an overrun
                // it is not, and the whole record fails (the key stays due and is retried).
                savepoint.rollback().await.map_err(E::engine_error)?;
                Ok(Err(why))
            }
        }
    }
}

/// A failure path, its request type erased.
pub(crate) fn failure_step<E: SqlEngine, F: FailurePhase<E>>(
    failure: F,
) -> Box<dyn ErasedFailure<E>> {
    Box::new(FailureStep { failure })
}
