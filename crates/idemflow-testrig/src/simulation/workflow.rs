//! The scripted workflow the schedules run: `reserve` (local) → `price` (local) → `charge`
//! (foreign, the mock provider over HTTP) → `complete` (local), with a failure path `cancel`.
//!
//! Each phase waits at its start for the schedule, which says what it does this time ([`Act`]):
//! succeed, take its time, fail (retryable or terminal, with an error of 100 KiB or holding
//! U+0000 too), panic, hang (outside the database, in a statement, in a write), return an output
//! the store cannot hold, break its transaction's commit, end the runner's transaction as phase
//! code can ([`TransactionEnd`]: a `COMMIT`, a `ROLLBACK`, the deadlock idiom's retry, MariaDB's DDL), or
//! (the charge) meet a provider fault. Every local
//! phase records its effect in `sim_effects` in the phase's own transaction, so the effects that
//! committed are exactly the rows there. The charge checks, as it starts, that its caller owns
//! the key (and registers the call, so two overlapping calls with one derived key are seen).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, StoredResponse};
use idemflow_runner::{
    ConnectionOf, Failure, FailurePhase, ForeignPhase, LocalPhase, PhaseContext, PhaseError,
    RetryPolicy, Workflow,
};
use serde::{Deserialize, Serialize};

use super::engine::SimEngine;

use super::scheduler::{Point, Verdict};
use super::world::Shared;
use idemflow_testkit::provider::Fault;
use idemflow_testkit::provider_client::{ChargeResult, ProviderError};

/// The workflow's name.
pub const WORKFLOW: &str = "sim.checkout.v1";

/// What a phase does on one run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Act {
    Succeed,
    /// Takes this long (really: the rest of the schedule goes on meanwhile).
    Slow(Duration),
    Retryable,
    Terminal,
    Panic,
    /// Never returns by itself: the phase's time limit stops it.
    Hang,
    /// Works outside the database until just before its time limit, then starts a statement
    /// that runs past it: the runner gives the transaction up, but its session lives on until
    /// the server's own statement timeout ends the statement.
    HangInDatabase,
    /// Returns an output holding U+0000, which the store cannot hold.
    Unstorable,
    /// Inserts a row that breaks a deferred constraint: its transaction's commit fails.
    BreakCommit,
    /// A write that runs past the phase's time limit: the engine's statement timeout ends it
    /// (SQLite then rolls the whole transaction back, the claim with it).
    HangInWrite,
    /// Ends the runner's transaction under it, as phase code can, then goes on.
    EndTransaction(TransactionEnd),
    /// Fails with an error of 100 KiB, as a provider's whole HTML error page would be.
    HugeError,
    /// Fails with an error holding U+0000, as a driver quoting binary data would.
    NulError,
    /// The provider meets this fault on the call (the charge only).
    Provider(ProviderFault),
}

/// How a phase ends the runner's transaction under it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum TransactionEnd {
    /// `COMMIT`, then succeeds.
    Commit,
    /// `COMMIT`, then fails (retryable).
    CommitThenFail,
    /// `ROLLBACK`, then succeeds as if nothing happened.
    Rollback,
    /// `ROLLBACK`, then writes its effect again and succeeds: the deadlock idiom ("try the
    /// statement again") after the database rolled a deadlock's victim back.
    RollbackThenWriteAgain,
    /// A statement the database commits around (MariaDB's DDL; `COMMIT` elsewhere).
    Implicit,
}

/// The provider faults a schedule uses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ProviderFault {
    Unavailable,
    Timeout,
    Reset,
    ExecuteThenDrop,
    Delay(Duration),
}

impl ProviderFault {
    fn fault(self) -> Fault {
        match self {
            Self::Unavailable => Fault::ServerError(503),
            Self::Timeout => Fault::Timeout,
            Self::Reset => Fault::ConnectionReset,
            Self::ExecuteThenDrop => Fault::ExecuteThenDrop,
            Self::Delay(delay) => Fault::Delay(delay),
        }
    }
}

/// The request: what to charge, and which life of the key it is (a key deleted by the forget
/// policy may be sent again as a new request).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SimRequest {
    pub amount: u64,
    pub life: u32,
}

/// What flows from phase to phase.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Progress {
    pub amount: u64,
    pub life: u32,
    pub note: String,
    pub charge: Option<String>,
}

/// Every sim response carries the life and amount it was made for.
fn response(status: u16, life: u32, amount: u64, what: serde_json::Value) -> StoredResponse {
    StoredResponse::json(
        status,
        &serde_json::json!({"life": life, "amount": amount, "what": what}),
    )
}

/// The retry policy of every phase: quick, so keys come back at once.
pub(crate) fn policy() -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(3)
        .with_initial_backoff(Duration::from_millis(1))
        .with_max_backoff(Duration::from_millis(1))
        .with_multiplier(1.0)
        .with_jitter(0.0)
}

/// The time limit of the local phases (a hung one costs this much).
pub(crate) const LOCAL_TIMEOUT: Duration = Duration::from_millis(600);

/// How long the engine waits for the charge.
pub(crate) const CHARGE_TIMEOUT: Duration = Duration::from_secs(2);

pub(crate) fn workflow<E: SimEngine>(shared: &Arc<Shared>, lease: Duration) -> Workflow<E> {
    Workflow::<E>::builder_on::<SimRequest>(WORKFLOW)
        .local(Reserve(shared.clone()))
        .local(Price(shared.clone()))
        .foreign(Charge(shared.clone()))
        .local(Complete(shared.clone()))
        .on_failure(Cancel(shared.clone()))
        .lease(lease)
        .build()
        .unwrap_or_else(|error| unreachable!("the sim workflow is valid: {error}"))
}

/// Waits for the schedule at the start of `phase` and says what this run does.
async fn act_for(shared: &Shared, phase: &'static str, context: &PhaseContext) -> Act {
    let actor = shared.scheduler.current();
    shared.note_token(actor, context);
    shared.note_phase_attempt(phase, context);
    let key = context.key.as_str();
    match shared.scheduler.park(actor, key, Point::Phase(phase)).await {
        Verdict::Act(act) => act,
        _ => shared.settled_act(key, phase),
    }
}

/// Records a local phase's effect in its transaction.
async fn effect<E: SimEngine>(
    connection: &mut ConnectionOf<E>,
    context: &PhaseContext,
    life: u32,
    phase: &str,
) -> Result<(), PhaseError> {
    E::effect(
        connection,
        context.tenant.as_str(),
        context.key.as_str(),
        i64::from(life),
        phase,
        context.lock_version,
    )
    .await?;
    Ok(())
}

/// What a local phase's act makes of its run: the note it passes on, or its failure.
async fn local_act<E: SimEngine>(
    shared: &Shared,
    act: Act,
    connection: &mut ConnectionOf<E>,
    context: &PhaseContext,
    phase: &str,
    life: u32,
    amount: u64,
) -> Result<String, PhaseError> {
    match act {
        Act::Succeed | Act::Provider(_) => Ok(format!("{phase} ok")),
        Act::Slow(wait) => {
            tokio::time::sleep(wait).await;
            Ok(format!("{phase} slow"))
        }
        Act::Retryable => Err(PhaseError::retryable("scripted failure")),
        Act::Terminal => Err(PhaseError::terminal_with(
            response(409, life, amount, serde_json::json!({"refused": phase})),
            "scripted refusal",
        )),
        Act::Panic => panic!("scripted panic in {phase}"),
        Act::Hang => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok(format!("{phase} woke"))
        }
        Act::HangInDatabase => {
            tokio::time::sleep(LOCAL_TIMEOUT * 9 / 10).await;
            E::hang(connection).await?;
            Ok(format!("{phase} slept"))
        }
        Act::Unstorable => Ok(format!("{phase} \u{0} unstorable")),
        Act::BreakCommit => {
            E::break_commit(connection).await?;
            Ok(format!("{phase} broke"))
        }
        Act::HangInWrite => {
            E::hang_writing(connection).await?;
            Ok(format!("{phase} wrote for ever"))
        }
        Act::EndTransaction(ending) => {
            end_transaction::<E>(shared, connection, context, ending, phase, life).await?;
            Ok(format!("{phase} ended its transaction"))
        }
        Act::HugeError => Err(PhaseError::retryable(format!(
            "<html>{}</html>",
            "<p>the provider's error page</p>".repeat(3_200)
        ))),
        Act::NulError => Err(PhaseError::retryable("bytes \u{0} quoted by a driver")),
    }
}

/// Ends the runner's transaction under the phase, as `ending` says.
/// A committing end that succeeded is noted as such: one whose statement failed (its connection
/// killed, say) may have committed nothing.
async fn end_transaction<E: SimEngine>(
    shared: &Shared,
    connection: &mut ConnectionOf<E>,
    context: &PhaseContext,
    ending: TransactionEnd,
    phase: &str,
    life: u32,
) -> Result<(), PhaseError> {
    let committed = || shared.note_transaction_committed(shared.scheduler.current());
    match ending {
        TransactionEnd::Commit => {
            E::execute(connection, "COMMIT").await?;
            committed();
        }
        TransactionEnd::CommitThenFail => {
            E::execute(connection, "COMMIT").await?;
            committed();
            return Err(PhaseError::retryable("scripted failure after a COMMIT"));
        }
        TransactionEnd::Rollback => E::execute(connection, "ROLLBACK").await?,
        TransactionEnd::RollbackThenWriteAgain => {
            E::execute(connection, "ROLLBACK").await?;
            effect::<E>(connection, context, life, phase).await?;
        }
        TransactionEnd::Implicit => {
            E::execute(connection, E::IMPLICIT_COMMIT.unwrap_or("COMMIT")).await?;
            committed();
        }
    }
    Ok(())
}

/// A local phase before the charge, as the schedule says: its effect, its act, and when it ended
/// (the commit that records it is judged against that).
async fn scripted<E: SimEngine>(
    shared: &Shared,
    phase: &'static str,
    connection: &mut ConnectionOf<E>,
    context: &PhaseContext,
    request: &SimRequest,
) -> Result<String, PhaseError> {
    let act = act_for(shared, phase, context).await;
    if let Act::EndTransaction(_) = act {
        shared.note_transaction_ended(shared.scheduler.current(), context);
    }
    effect::<E>(connection, context, request.life, phase).await?;
    let note = local_act::<E>(
        shared,
        act,
        connection,
        context,
        phase,
        request.life,
        request.amount,
    )
    .await?;
    shared.note_phase_end::<E>(connection).await?;
    Ok(note)
}

struct Reserve(Arc<Shared>);

#[async_trait]
impl<E: SimEngine> LocalPhase<E> for Reserve {
    const NAME: &'static str = "reserve";
    type Input = SimRequest;
    type Output = Progress;

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    fn timeout(&self) -> Option<Duration> {
        Some(LOCAL_TIMEOUT)
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        request: SimRequest,
        context: &PhaseContext,
    ) -> Result<Progress, PhaseError> {
        let note = scripted::<E>(
            &self.0,
            <Self as LocalPhase<E>>::NAME,
            connection,
            context,
            &request,
        )
        .await?;
        Ok(Progress {
            amount: request.amount,
            life: request.life,
            note,
            charge: None,
        })
    }
}

struct Price(Arc<Shared>);

#[async_trait]
impl<E: SimEngine> LocalPhase<E> for Price {
    const NAME: &'static str = "price";
    type Input = Progress;
    type Output = Progress;

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    fn timeout(&self) -> Option<Duration> {
        Some(LOCAL_TIMEOUT)
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        progress: Progress,
        context: &PhaseContext,
    ) -> Result<Progress, PhaseError> {
        let request = SimRequest {
            amount: progress.amount,
            life: progress.life,
        };
        let note = scripted::<E>(
            &self.0,
            <Self as LocalPhase<E>>::NAME,
            connection,
            context,
            &request,
        )
        .await?;
        Ok(Progress { note, ..progress })
    }
}

/// The workflow's one foreign phase; the others are local.
pub(crate) const FOREIGN_PHASE: &str = "charge";

struct Charge(Arc<Shared>);

#[async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = FOREIGN_PHASE;
    type Input = Progress;
    type Output = Progress;

    fn timeout(&self) -> Duration {
        CHARGE_TIMEOUT
    }

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        progress: Progress,
        context: &PhaseContext,
    ) -> Result<Progress, PhaseError> {
        let shared = &self.0;
        let act = act_for(shared, Self::NAME, context).await;
        let actor = shared.scheduler.current();
        // Who may call out: the key's current owner, holding a live lease, before the charge's
        // result was recorded, for this very request.
        shared
            .check_caller(actor, context, progress.life, Self::NAME)
            .await;
        let _call = shared.calls.begin(shared, actor, key.as_str());
        match act {
            Act::Retryable => return Err(PhaseError::retryable("scripted failure")),
            Act::Panic => panic!("scripted panic in charge"),
            Act::Slow(wait) => tokio::time::sleep(wait).await,
            Act::Provider(fault) => shared.provider.push_fault_for(key.as_str(), fault.fault()),
            _ => {}
        }
        let charged = shared
            .provider_client
            .charge(key.as_str(), progress.amount, "usd", "tok_visa")
            .await;
        let charge = match charged {
            Ok(ChargeResult::Succeeded { charge_id }) => charge_id,
            Ok(ChargeResult::Declined { code, .. }) => format!("declined:{code}"),
            Err(error) => return Err(provider_error(&error)),
        };
        let note = if act == Act::Unstorable {
            "charge \u{0} unstorable".to_owned()
        } else {
            progress.note.clone()
        };
        Ok(Progress {
            note,
            charge: Some(charge),
            ..progress
        })
    }
}

fn provider_error(error: &ProviderError) -> PhaseError {
    if error.is_retryable() {
        PhaseError::retryable(error.to_string())
    } else {
        PhaseError::terminal(error.to_string())
    }
}

struct Complete(Arc<Shared>);

#[async_trait]
impl<E: SimEngine> LocalPhase<E> for Complete {
    const NAME: &'static str = "complete";
    type Input = Progress;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        policy()
    }

    fn timeout(&self) -> Option<Duration> {
        Some(LOCAL_TIMEOUT)
    }

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        progress: Progress,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let act = act_for(&self.0, <Self as LocalPhase<E>>::NAME, context).await;
        if let Act::EndTransaction(_) = act {
            self.0
                .note_transaction_ended(self.0.scheduler.current(), context);
        }
        effect::<E>(connection, context, progress.life, "complete").await?;
        let act = if act == Act::Unstorable {
            Act::Succeed
        } else {
            act
        };
        local_act::<E>(
            &self.0,
            act,
            connection,
            context,
            "complete",
            progress.life,
            progress.amount,
        )
        .await?;
        Ok(response(
            201,
            progress.life,
            progress.amount,
            serde_json::json!({"charge": progress.charge}),
        ))
    }
}

struct Cancel(Arc<Shared>);

#[async_trait]
impl<E: SimEngine> FailurePhase<E> for Cancel {
    type Request = SimRequest;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        failure: Failure<SimRequest>,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let _ = &self.0;
        effect::<E>(connection, context, failure.request.life, "cancel").await?;
        Ok(response(
            502,
            failure.request.life,
            failure.request.amount,
            serde_json::json!({"gave_up": failure.phase, "attempts": failure.attempts}),
        ))
    }
}
