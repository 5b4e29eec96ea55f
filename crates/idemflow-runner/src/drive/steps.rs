//! Running the phases: a local phase in the open transaction, the commit that makes everything
//! durable before a foreign call, the fence confirmed before it, the call under a derived key,
//! and the last commit that stores the response.

use std::time::Instant;

use idemflow_core::{DerivedKey, StoredResponse};
use serde_json::Value;
use tracing::Instrument;

use super::{
    Drive, FailedAttempt, Hold, Stop, Tx, database_error, engine_failure, opened, store_stop,
    tx_limits,
};
use crate::crash::CrashPoint;
use crate::deadline::Within;
use crate::engine::{ConnectionPool, Engine, EngineError, KeyOwner};
use crate::erased::{Carry, ErasedForeign, ErasedLocal, Step};
use crate::error::RunError;
use crate::heartbeat::overrun_grace;
use crate::metrics;
use crate::outcome::Outcome;
use crate::panic::{catch_panic, catch_panic_now};
use crate::phase::PhaseError;
use crate::runner::Runner;
use crate::sealing::Slot;
use crate::storable::holds_nul;
use crate::workflow::Workflow;

impl<E: Engine> Drive<'_, E> {
    /// Runs a local phase in the open transaction (begun now if there is none), within its time
    /// limit, a panic caught as a failure.
    pub(super) async fn run_local(
        &mut self,
        local: &dyn ErasedLocal<E>,
        carry: Carry,
    ) -> Result<Carry, Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let failure = |error| FailedAttempt::of(local.name(), local.retry_policy(), error);
        let open = opened(&mut self.tx, runner, tx_limits(workflow, self.tx_start))
            .await?
            .map_err(|error| Stop::failed(failure(database_error("beginning", &error))))?;
        let span = tracing::debug_span!("idemflow.phase", phase = local.name(), kind = "local");
        let limit = workflow.local_timeout(local);
        let started = Instant::now();
        // An uncommitted claim or takeover cannot be taken over by anyone (a claim is invisible,
        // a takeover holds the row's lock and the claim's lock): no heartbeat. A heartbeat
        // would only wait for this very transaction's row lock. Nor in a transaction above Read
        // Committed: a renewal committed under its snapshot would make its own fenced write a
        // serialization failure (PostgreSQL), and the transaction run again for nothing.
        let heartbeat = self.hold == Hold::Committed
            && tx_limits(workflow, self.tx_start).isolation
                == crate::engine::Isolation::ReadCommitted;
        let work = tokio::time::timeout(
            limit + overrun_grace(limit),
            catch_panic(local.run(E::connection(open), carry, &self.context)),
        );
        let ran = runner
            .with_heartbeat(heartbeat, &self.owner, workflow.lease(), work)
            .instrument(span)
            .await;
        metrics::phase_duration(workflow.name(), local.name(), "local", started.elapsed());
        match ran {
            Ok(Ok(Ok(Ok(output)))) => Ok(output),
            Ok(Ok(Ok(Err(error)))) => Err(Stop::failed(failure(error))),
            Ok(Ok(Err(panic))) => Err(Stop::failed(FailedAttempt {
                panicked: true,
                ..failure(PhaseError::retryable(format!("panicked: {panic}")))
            })),
            Ok(Err(_elapsed)) => {
                // A statement may still be running on the connection: nobody can vouch for its
                // state, so it is closed rather than handed back, and the server rolls back.
                // A claim's transaction is kept: the failure record tries to go back to the claim
                // on it (bounded), and closes it if it cannot.
                if !matches!(self.hold, Hold::Claim(_))
                    && let Some(tx) = self.tx.take()
                {
                    E::abandon(tx);
                    self.abandoned = true;
                } else {
                    self.overran = true;
                }
                Err(Stop::failed(failure(PhaseError::retryable(format!(
                    "timed out after {limit:?}"
                )))))
            }
            Err(lost) => Err(Stop::Error(lost)),
        }
    }

    /// The last completed phase not yet recorded, with its output encoded for the store.
    pub(super) fn unrecorded_output(
        &mut self,
        carry: &Carry,
    ) -> Result<Option<(usize, Value)>, Stop> {
        let Some(index) = self.unrecorded.take() else {
            return Ok(None);
        };
        let step = &self.workflow.steps[index];
        let output = match &self.pending_foreign {
            Some((pending, output)) if *pending == step.raw_name() => output.clone(),
            _ => storable_output(step, carry).map_err(|error| {
                Stop::failed(FailedAttempt::of(
                    step.raw_name(),
                    step.retry_policy(),
                    error,
                ))
            })?,
        };
        Ok(Some((index, output)))
    }

    /// Makes everything so far durable before calling out (or before phases that begin a
    /// transaction at another level: `settle_level`): the last completed phase becomes the
    /// recovery point and the transaction commits. A key resumed right before a foreign phase
    /// has nothing to record and no transaction.
    pub(super) async fn record_before_call(
        &mut self,
        position: usize,
        unrecorded: Option<(usize, Value)>,
    ) -> Result<(), Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let mut committed = "claim";
        let mut committed_output = None;
        let mut advanced_at = None;
        // What this transaction commits is charged to the phase it records; a transaction that
        // records none (a takeover right before this call) to the phase about to be called.
        let mut charged = &workflow.steps[position];
        if let Some((index, output)) = unrecorded {
            let step = &workflow.steps[index];
            charged = step;
            let name = step.raw_name();
            let failure = |error| FailedAttempt::of(name, step.retry_policy(), error);
            let stored = self
                .sealer()
                .seal_value(Slot::Output(name), &output)
                .map_err(RunError::from)?;
            let open = opened(&mut self.tx, runner, tx_limits(workflow, self.tx_start))
                .await?
                .map_err(|error| Stop::failed(failure(database_error("beginning", &error))))?;
            advanced_at = Some(Instant::now());
            let advanced = E::advance(open, &self.owner, name, &stored, workflow.lease())
                .within(runner.config.database_timeout)
                .await?;
            self.written(advanced, "recording", failure).await?;
            committed = name;
            committed_output = Some(output);
        }
        if let Some(open) = self.tx.take() {
            let owner = self.owner.clone();
            runner
                .crash_points
                .check(
                    || CrashPoint::BeforeCommit { phase: committed },
                    owner.tenant(),
                    owner.key(),
                )
                .await?;
            if let Err(error) = commit_warm(open, runner).await? {
                self.claim_refused = matches!(self.hold, Hold::Claim(_));
                self.commit_refused = true;
                return Err(Stop::failed(FailedAttempt::of(
                    charged.raw_name(),
                    charged.retry_policy(),
                    engine_failure("committing", &error),
                )));
            }
            self.committed();
            if let Some(advanced_at) = advanced_at {
                self.lease_from = advanced_at;
            }
            if committed != "claim" {
                self.recorded_point = committed.to_owned();
                self.recorded_output = committed_output;
                self.context.attempt = 1;
            }
            // Recorded: a failure from here on must not record it again.
            self.pending_foreign = None;
            runner
                .crash_points
                .check(
                    || CrashPoint::AfterCommit { phase: committed },
                    owner.tenant(),
                    owner.key(),
                )
                .await?;
        }
        Ok(())
    }

    /// Before a call, the owner must hold a lease that outlasts the call's timeout (with a tenth of
    /// the lease to spare). It does right after its own commit or takeover; after a wait (a key a
    /// resumer took over and could not start at once, a process paused) it renews the lease,
    /// fenced: if another owner took the key over meanwhile, it stops here instead of calling as
    /// a stale one.
    pub(super) async fn confirm_fence(&mut self, foreign: &dyn ErasedForeign) -> Result<(), Stop> {
        let lease = self.workflow.lease();
        if self.lease_from.elapsed() + foreign.timeout() + lease / 10 <= lease {
            return Ok(());
        }
        let failure = |error| FailedAttempt::of(foreign.name(), foreign.retry_policy(), error);
        let wait = self.runner.config.database_timeout;
        // The renewal is the first statement on its connection: one the server ended while it sat
        // idle is replaced, as for the look-up. Sending it again is harmless: it is fenced and
        // never shortens the lease.
        let mut tries = self.runner.pool.size() as usize + 1;
        loop {
            let mut connection =
                self.runner
                    .warm
                    .acquire()
                    .within(wait)
                    .await?
                    .map_err(|error| {
                        Stop::failed(failure(database_error("confirming the fence", &error)))
                    })?;
            let renewing = Instant::now();
            match E::renew_lease(&mut connection, &self.owner, lease)
                .within(wait)
                .await?
            {
                Err(EngineError::Database(error)) if tries > 0 && error.is_connection_lost() => {
                    tries -= 1;
                    tracing::info!(%error, "a pooled connection was lost; renewing on another");
                    E::Pool::close_on_drop(&mut connection);
                }
                renewed => {
                    renewed.map_err(|error| store_stop(error, "confirming the fence", failure))?;
                    // The renewal ran outside any transaction: the connection is idle.
                    self.runner.warm.keep(connection);
                    self.lease_from = renewing;
                    return Ok(());
                }
            }
        }
    }

    /// Calls a foreign phase with its derived key, within its timeout, heartbeating the lease.
    pub(super) async fn call(
        &mut self,
        foreign: &dyn ErasedForeign,
        position: usize,
        carry: Carry,
    ) -> Result<Carry, Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let step = &workflow.steps[position];
        let failure = |error| FailedAttempt::of(foreign.name(), foreign.retry_policy(), error);
        let owner = self.owner.clone();
        runner
            .crash_points
            .check(
                || CrashPoint::BeforeCall {
                    phase: foreign.name(),
                },
                owner.tenant(),
                owner.key(),
            )
            .await?;
        let derived_key = DerivedKey::new(self.owner.tenant(), self.owner.key(), step.name());
        let span = tracing::info_span!(
            "idemflow.phase", phase = foreign.name(), kind = "foreign", derived_key = %derived_key
        );
        let started = Instant::now();
        let call = tokio::time::timeout(
            foreign.timeout(),
            catch_panic(foreign.call(&derived_key, carry, &self.context)),
        );
        let called = runner
            .with_heartbeat(true, &self.owner, workflow.lease(), call)
            .instrument(span)
            .await;
        metrics::phase_duration(
            workflow.name(),
            foreign.name(),
            "foreign",
            started.elapsed(),
        );
        let output = match called {
            Ok(Ok(Ok(Ok(output)))) => output,
            Ok(Ok(Ok(Err(error)))) => return Err(Stop::failed(failure(error))),
            Ok(Ok(Err(panic))) => {
                return Err(Stop::failed(FailedAttempt {
                    panicked: true,
                    ..failure(PhaseError::retryable(format!("panicked: {panic}")))
                }));
            }
            Ok(Err(_elapsed)) => {
                return Err(Stop::failed(failure(PhaseError::retryable(format!(
                    "timed out after {:?}",
                    foreign.timeout()
                )))));
            }
            Err(lost) => return Err(Stop::Error(lost)),
        };
        runner
            .crash_points
            .check(
                || CrashPoint::AfterCall {
                    phase: foreign.name(),
                },
                owner.tenant(),
                owner.key(),
            )
            .await?;
        // Encoded now, so a failure in the phases after it can still record the result (and
        // an output the store cannot hold fails this attempt before anything depends on it).
        // The last phase's output is the response: recorded redacted, as it is stored.
        let encoded = if position + 1 == workflow.steps.len() && workflow.redacts_responses() {
            recorded_response(workflow, &output)
        } else {
            storable_output(step, &output)
        };
        let encoded = encoded.map_err(|error| Stop::failed(failure(error)))?;
        self.pending_foreign = Some((foreign.name(), encoded));
        Ok(output)
    }

    /// Stores the response (redacted, sealed) with the last local effects and commits; the
    /// answer is the response as stored, before sealing.
    pub(super) async fn finish(&mut self, position: usize, carry: Carry) -> Result<Outcome, Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let last = &workflow.steps[position - 1];
        let failure = |error| FailedAttempt::of(last.raw_name(), last.retry_policy(), error);
        let response = workflow
            .redacted_response(downcast_response(carry)?)
            .map_err(|panic| {
                Stop::failed(failure(PhaseError::retryable(format!(
                    "redacting the response panicked: {panic}"
                ))))
            })?;
        let stored = self
            .sealer()
            .seal_response(&response, self.owner.lock_version())
            .map_err(RunError::from)?;
        let open = opened(&mut self.tx, runner, tx_limits(workflow, self.tx_start))
            .await?
            .map_err(|error| Stop::failed(failure(database_error("beginning", &error))))?;
        let apart_above = runner.config.response_apart_above;
        let finished = E::finish(open, &self.owner, last.raw_name(), &stored, apart_above)
            .within(runner.config.database_timeout)
            .await?;
        self.written(finished, "storing the response", failure)
            .await?;
        let owner = self.owner.clone();
        runner
            .crash_points
            .check(|| CrashPoint::BeforeFinish, owner.tenant(), owner.key())
            .await?;
        let Some(open) = self.tx.take() else {
            unreachable!("opened above")
        };
        if let Err(error) = commit_warm(open, runner).await? {
            // A deferred constraint, say: the effects, the response and an uncommitted hold
            // roll back together, and the attempt fails.
            self.claim_refused = matches!(self.hold, Hold::Claim(_));
            self.commit_refused = true;
            return Err(Stop::failed(failure(engine_failure("committing", &error))));
        }
        self.hold = Hold::Committed;
        runner
            .crash_points
            .check(|| CrashPoint::AfterFinish, owner.tenant(), owner.key())
            .await?;
        metrics::count(metrics::FINISHED, workflow.name());
        tracing::info!(status = response.status, "finished");
        Ok(Outcome::Executed(response))
    }
}

/// Commits, bounded by the database timeout; a connection whose `COMMIT` succeeded is idle
/// outside any transaction, so the runner keeps it warm for the next (see `crate::warm`).
async fn commit_warm<E: Engine>(
    open: Tx<E>,
    runner: &Runner<E>,
) -> Result<Result<(), EngineError>, RunError> {
    let committed = E::commit_keeping(open)
        .within(runner.config.database_timeout)
        .await?;
    Ok(committed.map(|connection| runner.warm.keep(connection)))
}

/// A phase's output encoded for its recovery point; an error if it cannot be encoded or stored.
fn storable_output<E: Engine>(step: &Step<E>, carry: &Carry) -> Result<Value, PhaseError> {
    let encoded = match catch_panic_now(|| step.encode_output(carry)) {
        Ok(Ok(encoded)) => encoded,
        Ok(Err(error)) => {
            return Err(PhaseError::retryable(format!(
                "its output does not encode: {error}"
            )));
        }
        Err(panic) => {
            return Err(PhaseError::retryable(format!(
                "encoding its output panicked: {panic}"
            )));
        }
    };
    if holds_nul(&encoded) {
        return Err(PhaseError::retryable(
            "its output cannot be stored: a string holds U+0000",
        ));
    }
    Ok(encoded)
}

/// The last phase's output when it is foreign, encoded for its recovery point as the response
/// is stored: redacted.
fn recorded_response<E: Engine>(
    workflow: &Workflow<E>,
    carry: &Carry,
) -> Result<Value, PhaseError> {
    let Some(response) = carry.downcast_ref::<StoredResponse>() else {
        return Err(PhaseError::retryable(
            "the last phase did not produce a response",
        ));
    };
    let redacted = workflow
        .redacted_response(response.clone())
        .map_err(|panic| {
            PhaseError::retryable(format!("redacting the response panicked: {panic}"))
        })?;
    let encoded = serde_json::to_value(&redacted)
        .map_err(|error| PhaseError::retryable(format!("its output does not encode: {error}")))?;
    if holds_nul(&encoded) {
        return Err(PhaseError::retryable(
            "its output cannot be stored: a string holds U+0000",
        ));
    }
    Ok(encoded)
}

fn downcast_response(carry: Carry) -> Result<StoredResponse, RunError> {
    carry
        .downcast::<StoredResponse>()
        .map(|response| *response)
        .map_err(|_| RunError::Corrupt("the last phase did not produce a response".into()))
}
