//! Recording a failed attempt, in a transaction of its own (the failed one has rolled back).
//!
//! A retryable error leaves the key started, its lease set to the next attempt time; once the
//! attempts at a recovery point ran out, the workflow's failure path runs and its response is
//! stored. A terminal error stores its response (or, by policy, forgets the key). If this
//! owner's hold was never committed, the key is claimed or taken over again first, so the record
//! lands on a key this owner holds, or not at all when another request got the key meanwhile.

use std::time::Duration;

use idemflow_core::{Fingerprint, RecoveryPoint, StoredResponse};
use idemflow_store::{Claim as ClaimRequest, LastError, Limits};
use serde_json::Value;

use super::{
    Drive, FailedAttempt, Hold, Tx, abandoned_session_wait, attempt_of, commit, fenced, problem,
    redacted_or_problem,
};
use crate::config::TerminalPolicy;
use crate::deadline::Within;
use crate::engine::{Claimed, ConnectionPool, Engine, EngineError, KeyOwner, Standing};
use crate::erased::GiveUp;
use crate::error::RunError;
use crate::live_connection::begin_live;
use crate::metrics;
use crate::outcome::Outcome;
use crate::phase::{PhaseError, PhaseErrorKind};
use crate::sealing::Slot;

impl<E: Engine> Drive<'_, E> {
    /// Records a failed attempt; see the module's documentation for what is recorded when.
    pub(super) async fn fail(mut self, failure: FailedAttempt) -> Result<Outcome, RunError> {
        let FailedAttempt {
            phase,
            retry_policy,
            mut error,
            panicked,
            spent,
        } = failure;
        log_failure(phase, self.context.attempt, &error, panicked);
        if self.undo_attempt().await == Some(Standing::Ended) {
            // What the phases wrote may have committed: never run them again.
            return self.end_after_transaction_ended(phase).await;
        }

        if let PhaseErrorKind::NotExecuted { response } = &error.kind {
            // Nothing of the key's request has run if no phase completed: the key goes, and
            // the same key may come again as a new request. Otherwise its effects must not run
            // twice: an ordinary retryable failure.
            if self.recorded_point == RecoveryPoint::START && self.pending_foreign.is_none() {
                let response = response.clone();
                metrics::count_phase(metrics::NOT_EXECUTED, self.workflow.name(), phase);
                return self.forget(response).await;
            }
            error.kind = PhaseErrorKind::Retryable { retry_after: None };
        }
        let terminal_response = terminal_response(&error);
        if let (Some(response), TerminalPolicy::Forget) =
            (&terminal_response, self.runner.config.terminal_errors)
        {
            return self.forget(response.clone()).await;
        }
        // A give-up for a spent budget carries the last recorded error, already named.
        let message = if spent {
            error.message.clone()
        } else {
            format!("{phase}: {}", error.message)
        };

        let Some(held) = self.take_again().await? else {
            if matches!(self.hold, Hold::Claim(_)) {
                // The claim vanished with its session (killed, or closed past a time limit):
                // nothing of the attempt was kept and the key is free. Answered, not recorded.
                return Ok(match terminal_response {
                    Some(response) => Outcome::Forgotten(response),
                    None => Outcome::Interrupted {
                        retry_after: retry_policy.backoff(1),
                        error: message,
                    },
                });
            }
            return Ok(in_progress());
        };
        let (held, recorded) = self.record_pending_foreign(held).await?;
        let failed = Failed {
            phase,
            retry_policy,
            error,
            panicked,
            spent,
            message,
        };
        self.record(held, recorded, terminal_response, failed).await
    }

    /// Undoes what the failed attempt wrote, and says how its transaction ended when a phase or
    /// the database ended it under the attempt (`None`: it was open, or there was none).
    ///
    /// An ended transaction's connection is closed: whatever is open on it now (a transaction
    /// the phase began, or none) is not the engine's, and closing rolls it back. Otherwise, a
    /// claim never committed goes back to the savepoint its message ended with: the phases'
    /// effects are undone and the claim kept, so the failure is recorded under it. (Rolled back
    /// entirely, the claim would free the key, and it may not be taken again: meanwhile another
    /// request may have run under it and been told it is free.) Bounded: after a phase overran
    /// its limit a statement may still be running on it.
    async fn undo_attempt(&mut self) -> Option<Standing> {
        let (mut ended, lost) = self.undo_attempts_transaction().await;
        // A takeover given up past a phase's limit was lost with its connection too.
        let lost = lost || (self.abandoned && matches!(self.hold, Hold::TakeOver { .. }));
        if ended.is_none() && lost && self.hold_committed_under_a_phase().await {
            ended = Some(Standing::Ended);
        }
        // A rollback the engine read from the connection is the last thing that happened on it,
        // not the only one: a phase may have committed first (a claim or takeover committed with
        // its effects) and failed after. The row tells, where this owner's hold is uncommitted.
        if ended == Some(Standing::RolledBack) && self.hold_committed_under_a_phase().await {
            ended = Some(Standing::Ended);
        }
        if ended == Some(Standing::RolledBack) && matches!(self.hold, Hold::Claim(_)) {
            // Everything is undone, the uncommitted claim too, at a moment this owner knows: it
            // is made again with its token for the record, as after a refused first commit.
            self.claim_refused = true;
        }
        ended
    }

    /// [`Self::undo_attempt`]'s work on the attempt's transaction: how it ended, when the engine
    /// said so, and whether it was lost with its connection without a word on how.
    async fn undo_attempts_transaction(&mut self) -> (Option<Standing>, bool) {
        let ended = if self.overran {
            None
        } else {
            self.ended_under().await
        };
        match (self.tx.take(), &self.hold) {
            (Some(tx), _) if ended.is_some() => {
                E::abandon(tx);
                (ended, false)
            }
            (Some(mut tx), Hold::Claim(_)) => {
                let wait = self.runner.config.database_timeout;
                match E::back_to_claim(&mut tx).within(wait).await {
                    Ok(Ok(())) => {
                        self.tx = Some(tx);
                        (None, false)
                    }
                    Ok(Err(lost)) => {
                        // SQLite rolls the whole transaction back when a write in it is
                        // interrupted: the statement the phase overran in, ended at the engine's
                        // statement timeout while this waited. Then the claim is undone with
                        // everything else, at a moment this owner knows, and is made again.
                        let ended = E::standing(&mut tx).within(wait).await;
                        E::abandon(tx);
                        if let Ok(Ok(ended @ (Standing::RolledBack | Standing::Ended))) = ended {
                            return (Some(ended), false);
                        }
                        tracing::warn!(%lost, "the failed attempt's claim is gone with its connection");
                        (None, true)
                    }
                    Err(timeout) => {
                        tracing::warn!(%timeout, "the failed attempt's claim is gone with its connection");
                        E::abandon(tx);
                        (None, true)
                    }
                }
            }
            (Some(tx), _) => match E::rollback(tx).await {
                Ok(()) => (None, false),
                Err(rollback) => {
                    // The connection is not reused; the server rolls back as it closes.
                    tracing::warn!(%rollback, "rolling back the failed attempt failed");
                    (None, true)
                }
            },
            (None, _) => (None, false),
        }
    }

    /// Whether this owner's claim or takeover, which the runner never committed, is in the row
    /// all the same: then a phase committed it (ending the runner's transaction), and what the
    /// phases wrote before may have committed with it. Asked when the attempt's transaction was
    /// lost without a word on how it ended (its connection gone): the engine can no longer say,
    /// the row still can. A fenced lease renewal finds this very owner's hold (its token, and
    /// where a token can be drawn twice, its holder), or changes nothing.
    pub(super) async fn hold_committed_under_a_phase(&mut self) -> bool {
        if self.hold == Hold::Committed {
            return false;
        }
        let wait = self.runner.config.database_timeout;
        let Ok(Ok(mut connection)) = self.runner.warm.acquire().within(wait).await else {
            return false;
        };
        let renewed = E::renew_lease(&mut connection, &self.owner, self.workflow.lease())
            .within(wait)
            .await;
        match renewed {
            Ok(Ok(())) => {
                self.runner.warm.keep(connection);
                tracing::error!(
                    "the claim or takeover committed under a phase that ended the transaction"
                );
                true
            }
            Ok(Err(EngineError::Fenced)) => {
                self.runner.warm.keep(connection);
                false
            }
            _ => false,
        }
    }

    /// A local phase ended the runner's transaction, and what the phases wrote may have committed
    /// without its recovery point: running them again could apply their effects twice. So the
    /// key is not retried: it ends with a stored 500 naming the cause (whatever the terminal
    /// policy: forgotten, the key would run again), recorded at the last recovery point.
    async fn end_after_transaction_ended(
        &mut self,
        phase: &'static str,
    ) -> Result<Outcome, RunError> {
        let workflow = self.workflow;
        metrics::count_phase(metrics::TRANSACTIONS_ENDED, workflow.name(), phase);
        tracing::error!(
            phase,
            "a local phase ended the runner's transaction; its key ends with a 500 and is not run \
             again (docs/runner.md: what a local phase must not do)"
        );
        let detail = format!(
            "{phase} (or a local phase before it in the same transaction): {}",
            Standing::Ended.describe()
        );
        let response = redacted_or_problem(workflow, problem(500, "transaction_ended", &detail));
        self.hold_after_end().await?;
        let Some(held) = self.take_again().await? else {
            // Another request got the key meanwhile (the claim was rolled back): it owns the
            // key's outcome; this request is answered, nothing recorded.
            return Ok(Outcome::Forgotten(response));
        };
        let (mut held, recorded) = self.record_pending_foreign(held).await?;
        let stored = self
            .sealer()
            .seal_response(&response, held.owner.lock_version())?;
        let apart_above = self.runner.config.response_apart_above;
        let finished = E::finish(
            &mut held.tx,
            &held.owner,
            &recorded.point,
            &stored,
            apart_above,
        )
        .await;
        commit::<E>(fenced::<E>(finished, held.tx).await?).await?;
        metrics::count(metrics::FINISHED, workflow.name());
        Ok(Outcome::Executed(response))
    }

    /// After the transaction ended under a phase, whether this owner's uncommitted claim or
    /// takeover committed with it: then the row carries this owner's hold (its token and
    /// holder), which a fenced lease renewal finds, and the key is held as any committed hold.
    /// A later taker that drew the same token after this owner's draw rolled back holds another
    /// holder: its key is never taken for this owner's. Otherwise the claim is made
    /// again with its token (nobody else ever saw it) and the takeover made again from the
    /// token it took over, as after a refused commit.
    async fn hold_after_end(&mut self) -> Result<(), RunError> {
        if self.hold == Hold::Committed {
            return Ok(());
        }
        let wait = self.runner.config.database_timeout;
        let mut connection = self.runner.warm.acquire().within(wait).await??;
        let renewed = E::renew_lease(&mut connection, &self.owner, self.workflow.lease())
            .within(wait)
            .await?;
        self.runner.warm.keep(connection);
        match renewed {
            Ok(()) => self.hold = Hold::Committed,
            Err(EngineError::Fenced) => {
                if matches!(self.hold, Hold::Claim(_)) {
                    self.claim_refused = true;
                }
            }
            Err(error) => return Err(error.into()),
        }
        Ok(())
    }

    /// Records the failed attempt on the key held again: its terminal response stored, the key
    /// postponed to its next attempt, or, the attempts spent, the failure path run.
    async fn record(
        &mut self,
        mut held: Held<E>,
        recorded: Recorded,
        terminal_response: Option<StoredResponse>,
        failed: Failed,
    ) -> Result<Outcome, RunError> {
        let exhausted = failed.spent || failed.retry_policy.exhausted(held.attempt);
        match (terminal_response, failed.error.kind) {
            (Some(response), _) => {
                let response = redacted_or_problem(self.workflow, response);
                let stored = self
                    .sealer()
                    .seal_response(&response, held.owner.lock_version())?;
                let finished = E::finish(
                    &mut held.tx,
                    &held.owner,
                    &recorded.point,
                    &stored,
                    self.runner.config.response_apart_above,
                )
                .await;
                commit::<E>(fenced::<E>(finished, held.tx).await?).await?;
                metrics::count(metrics::FINISHED, self.workflow.name());
                Ok(Outcome::Executed(response))
            }
            (None, PhaseErrorKind::Retryable { retry_after }) if !exhausted => {
                let retry_after = failed.retry_policy.wait(retry_after, held.attempt);
                let message = &failed.message;
                let recorded = LastError::new(message);
                let postponed =
                    E::postpone(&mut held.tx, &held.owner, retry_after, &recorded).await;
                commit::<E>(fenced::<E>(postponed, held.tx).await?).await?;
                metrics::count_phase(metrics::RETRIES, self.workflow.name(), failed.phase);
                if failed.panicked {
                    return Err(RunError::Panicked {
                        phase: failed.phase.to_owned(),
                        message: failed.error.message,
                    });
                }
                Ok(Outcome::Interrupted {
                    retry_after,
                    error: failed.message,
                })
            }
            (None, _) => {
                let attempts = if failed.spent {
                    held.attempt - 1
                } else {
                    held.attempt
                };
                self.give_up(held, recorded, failed.phase, attempts, failed.message)
                    .await
            }
        }
    }

    /// Deletes the key (fenced), answering with `response`: nothing of it remains to replay.
    async fn forget(&mut self, response: StoredResponse) -> Result<Outcome, RunError> {
        if !self.delete_held().await? {
            return Ok(in_progress());
        }
        Ok(Outcome::Forgotten(response))
    }

    /// Records a foreign result the failed attempt obtained but did not commit, so the call is
    /// not repeated; the recovery point the record leaves the key at.
    async fn record_pending_foreign(
        &mut self,
        held: Held<E>,
    ) -> Result<(Held<E>, Recorded), RunError> {
        let Some((name, output)) = self.pending_foreign.take() else {
            let recorded = Recorded {
                point: self.recorded_point.clone(),
                output: None,
            };
            return Ok((held, recorded));
        };
        let Held { mut tx, owner, .. } = held;
        let stored = self.sealer().seal_value(Slot::Output(name), &output)?;
        let advanced = E::advance(&mut tx, &owner, name, &stored, self.workflow.lease()).await;
        let held = Held {
            tx: fenced::<E>(advanced, tx).await?,
            owner,
            // The phase that failed is the first execution after that foreign result.
            attempt: 1,
        };
        let recorded = Recorded {
            point: name.to_owned(),
            output: Some(output),
        };
        Ok((held, recorded))
    }

    /// The attempts ran out: runs the failure path and finishes the key with its response; if
    /// its effects break the commit, with a plain problem and no effects, so the key still ends.
    async fn give_up(
        &mut self,
        mut held: Held<E>,
        recorded: Recorded,
        phase: &'static str,
        attempts: u32,
        message: String,
    ) -> Result<Outcome, RunError> {
        let workflow = self.workflow;
        metrics::count_phase(metrics::GIVE_UPS, workflow.name(), phase);
        tracing::error!(phase, attempts, error = %message, "retries exhausted: giving up");
        let give_up = GiveUp {
            request: self.request.clone(),
            phase,
            recovery_point: recorded.point.clone(),
            // What to undo: the output recorded now, or by an earlier attempt.
            recovery_output: recorded
                .output
                .clone()
                .or_else(|| self.recorded_output.clone()),
            error: message.clone(),
            attempts,
        };
        let response = self.failure_path(&mut held.tx, give_up).await?;
        let response = redacted_or_problem(workflow, response);
        let stored = self
            .sealer()
            .seal_response(&response, held.owner.lock_version())?;
        let finished = E::finish(
            &mut held.tx,
            &held.owner,
            &recorded.point,
            &stored,
            self.runner.config.response_apart_above,
        )
        .await;
        if let Err(EngineError::Fenced) = finished
            && let Ok(Ok(ended @ (Standing::Ended | Standing::RolledBack))) =
                E::standing(&mut held.tx)
                    .within(self.runner.config.database_timeout)
                    .await
        {
            // The failure path ended the transaction under it: whatever it wrote is not relied
            // on, and the key ends with the generic response alone.
            E::abandon(held.tx);
            tracing::error!("the failure path ended the runner's transaction");
            self.hold_after_end().await?;
            let detail = format!(
                "{}; {}",
                give_up_detail(attempts, &message),
                ended.describe()
            );
            return self.store_generic_give_up(recorded, &detail).await;
        }
        if let Err(error) = commit::<E>(fenced::<E>(finished, held.tx).await?).await {
            // A deferred constraint broken by the failure path's effects, say.
            tracing::error!(%error, "the give-up did not commit");
            return self
                .store_generic_give_up(recorded, &give_up_detail(attempts, &message))
                .await;
        }
        metrics::count(metrics::FINISHED, workflow.name());
        Ok(Outcome::Executed(response))
    }

    /// Deletes the key this owner holds, fenced, after its attempt rolled back. An
    /// uncommitted claim rolled back with the attempt: there is nothing to delete. False when
    /// another owner holds the key by now: it is theirs to finish.
    async fn delete_held(&mut self) -> Result<bool, RunError> {
        if matches!(self.hold, Hold::Claim(_)) {
            // The claim, kept after the failure or already gone: rolled back entirely, the key
            // is free.
            if let Some(tx) = self.tx.take() {
                E::rollback(tx).await?;
            }
            return Ok(true);
        }
        let Some(Held { mut tx, owner, .. }) = self.take_again().await? else {
            return Ok(false);
        };
        let deleted = E::delete_owned(&mut tx, &owner).await;
        commit::<E>(fenced::<E>(deleted, tx).await?).await?;
        Ok(true)
    }

    /// Stores the generic give-up response (a 500 problem with `detail`) alone, when the
    /// failure path's own work could not be kept.
    async fn store_generic_give_up(
        &mut self,
        recorded: Recorded,
        detail: &str,
    ) -> Result<Outcome, RunError> {
        tracing::error!("storing a generic response for the give-up");
        let workflow = self.workflow;
        let response = redacted_or_problem(workflow, problem(500, "retries_exhausted", detail));
        self.store_give_up(&recorded.point, recorded.output, &response)
            .await?;
        metrics::count(metrics::FINISHED, workflow.name());
        Ok(Outcome::Executed(response))
    }

    /// Stores a give-up's response alone (no failure path), in a transaction of its own.
    async fn store_give_up(
        &mut self,
        recovery_point: &str,
        recovery_output: Option<Value>,
        response: &StoredResponse,
    ) -> Result<(), RunError> {
        let Some(Held { mut tx, owner, .. }) = self.take_again().await? else {
            return Err(RunError::Fenced);
        };
        if let Some(output) = recovery_output {
            let stored = self
                .sealer()
                .seal_value(Slot::Output(recovery_point), &output)?;
            let advanced = E::advance(
                &mut tx,
                &owner,
                recovery_point,
                &stored,
                self.workflow.lease(),
            )
            .await;
            tx = fenced::<E>(advanced, tx).await?;
        }
        let stored = self
            .sealer()
            .seal_response(response, owner.lock_version())?;
        let apart_above = self.runner.config.response_apart_above;
        let finished = E::finish(&mut tx, &owner, recovery_point, &stored, apart_above).await;
        commit::<E>(fenced::<E>(finished, tx).await?).await?;
        Ok(())
    }

    /// A transaction holding the key for this owner again after its failed attempt rolled back:
    /// the same owner when its hold was committed; otherwise the claim made again (same token,
    /// which nobody else ever saw) or the takeover made again (compare-and-set on the token it
    /// took over from). `None` when another request got the key meanwhile: it owns the outcome.
    async fn take_again(&mut self) -> Result<Option<Held<E>>, RunError> {
        let workflow = self.workflow;
        match &self.hold {
            // A record runs no phase: Read Committed, whatever the phases declare.
            Hold::Committed => Ok(Some(Held {
                tx: begin_live::<E>(&self.runner.warm, workflow.record_limits()).await?,
                owner: self.owner.clone(),
                attempt: self.context.attempt,
            })),
            // The claim kept after the failure (see `fail`). Gone with its session (killed,
            // closed), it is never claimed again: the key was free from then on, and another
            // request may have run under it and been told so. Only a refused first `COMMIT`
            // is answered by claiming again at once (same token, nobody else ever saw it),
            // one round trip after the claim vanished.
            Hold::Claim(fingerprint) => {
                if let Some(tx) = self.tx.take() {
                    return Ok(Some(Held {
                        tx,
                        owner: self.owner.clone(),
                        attempt: 1,
                    }));
                }
                if !self.claim_refused {
                    return Ok(None);
                }
                let fingerprint = *fingerprint;
                self.claim_again(&fingerprint, workflow.record_limits())
                    .await
            }
            Hold::TakeOver { seen } => {
                let seen = *seen;
                self.take_over_again(seen, workflow.record_limits()).await
            }
        }
    }

    /// The claim made again after its first `COMMIT` was refused, or its transaction was rolled
    /// back whole to be run again (`restart.rs`), with the same token, in a transaction under
    /// `limits`. Its BEGIN is the first statement on its connection: one the server ended while
    /// it sat idle is replaced (nothing ran on it; the server rolled back whatever did).
    pub(super) async fn claim_again(
        &self,
        fingerprint: &Fingerprint,
        limits: &Limits,
    ) -> Result<Option<Held<E>>, RunError> {
        let workflow = self.workflow;
        let request = self.sealer().seal_value(Slot::Request, &self.request)?;
        let claim = ClaimRequest {
            tenant: self.owner.tenant(),
            key: self.owner.key(),
            fingerprint,
            workflow: workflow.name(),
            request: &request,
            lease: workflow.lease(),
        };
        let mut tries = self.runner.pool.size() as usize + 1;
        loop {
            let connection = self.runner.warm.acquire().await?;
            let token = self.owner.lock_version();
            match E::claim_again(connection, claim, token, limits).await {
                Ok(Claimed::Owned(tx, owner)) => {
                    return Ok(Some(Held {
                        tx,
                        owner,
                        attempt: 1,
                    }));
                }
                Ok(Claimed::Lost(_)) => return Ok(None),
                Err(EngineError::Database(error)) if tries > 0 && error.is_connection_lost() => {
                    tries -= 1;
                    tracing::info!(%error, "a pooled connection was lost; claiming on another");
                }
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// The takeover made again (compare-and-set on the token it took over from). The attempt's
    /// transaction was given up mid-statement, or its COMMIT refused: its session still holds
    /// the uncommitted takeover's claim lock until the server ends the statement, or aborts the
    /// transaction (it reports a refused COMMIT first). Waiting for the lock (bounded) is what
    /// lets this attempt be counted; trying it once, as a takeover does, found it taken, and
    /// such a retry answered 409 with nothing recorded.
    pub(super) async fn take_over_again(
        &self,
        seen: i64,
        limits: &Limits,
    ) -> Result<Option<Held<E>>, RunError> {
        let workflow = self.workflow;
        let mut tx = begin_live::<E>(&self.runner.warm, limits).await?;
        let (tenant, key) = (self.owner.tenant(), self.owner.key());
        if self.abandoned || self.commit_refused {
            let wait = if self.abandoned {
                abandoned_session_wait(workflow)
            } else {
                self.runner.config.database_timeout
            };
            if !E::wait_for_claim_lock(&mut tx, tenant, key, wait).await? {
                E::rollback(tx).await?;
                return Ok(None);
            }
        }
        match E::take_over(&mut tx, tenant, key, seen, workflow.lease()).await? {
            Some(taken) => Ok(Some(Held {
                tx,
                attempt: attempt_of(taken.attempts),
                owner: taken.owner,
            })),
            None => {
                E::rollback(tx).await?;
                Ok(None)
            }
        }
    }

    /// Runs the workflow's failure path in a savepoint of `tx`, within the local time limit; if
    /// there is none, or it fails or panics itself, the response is a 500 problem naming the
    /// last error.
    async fn failure_path(
        &self,
        tx: &mut Tx<E>,
        give_up: GiveUp,
    ) -> Result<StoredResponse, RunError> {
        let detail = give_up_detail(give_up.attempts, &give_up.error);
        let Some(failure) = &self.workflow.failure else {
            return Ok(problem(500, "retries_exhausted", &detail));
        };
        let limit = self.workflow.default_local_timeout();
        match failure
            .run_in_savepoint(tx, give_up, &self.context, limit)
            .await?
        {
            Ok(response) => Ok(response),
            Err(why) => {
                tracing::error!(error = %why, "the failure path failed; storing a generic response");
                Ok(problem(500, "retries_exhausted", &detail))
            }
        }
    }
}

pub(super) fn in_progress() -> Outcome {
    // Another request took the key while this one was recording its failure: it owns the
    // outcome now.
    Outcome::InProgress {
        retry_after: Duration::from_secs(1),
    }
}

fn give_up_detail(attempts: u32, error: &str) -> String {
    format!("gave up after {attempts} attempts: {error}")
}

/// The key held again for this owner, in an open transaction, to record a failed attempt.
pub(super) struct Held<E: Engine> {
    pub(super) tx: Tx<E>,
    pub(super) owner: E::Owner,
    /// The attempt being recorded, counted at the key's recovery point.
    pub(super) attempt: u32,
}

/// The recovery point a failure record leaves the key at, and the output recorded with it now
/// (`None` when the record adds nothing to what the row held).
struct Recorded {
    point: String,
    output: Option<Value>,
}

/// How loud a failed attempt is logged. A phase that answers the request itself (a declined
/// card as a 402, a handler's 404, a refusal before anything ran) chose a business outcome: the
/// request did what it should, and an operator alerting on WARN must not be paged for it. A
/// failure that will be retried, or ends the request with a 500, is WARN; a panic is a bug.
pub(crate) fn failure_level(error: &PhaseError, panicked: bool) -> tracing::Level {
    match &error.kind {
        _ if panicked => tracing::Level::ERROR,
        PhaseErrorKind::Terminal { response: Some(_) } | PhaseErrorKind::NotExecuted { .. } => {
            tracing::Level::INFO
        }
        PhaseErrorKind::Terminal { response: None } | PhaseErrorKind::Retryable { .. } => {
            tracing::Level::WARN
        }
    }
}

/// A failed attempt, as it is recorded.
struct Failed {
    phase: &'static str,
    retry_policy: crate::retry::RetryPolicy,
    error: PhaseError,
    panicked: bool,
    spent: bool,
    /// The error as recorded: named by its phase, unless the budget was spent.
    message: String,
}

/// The response a terminal error ends the request with: its own, or a 500 problem.
fn terminal_response(error: &PhaseError) -> Option<StoredResponse> {
    match &error.kind {
        PhaseErrorKind::Terminal { response } => Some(
            response
                .clone()
                .unwrap_or_else(|| problem(500, "request_failed", &error.message)),
        ),
        PhaseErrorKind::Retryable { .. } | PhaseErrorKind::NotExecuted { .. } => None,
    }
}

/// Logs a failed attempt at the level its meaning calls for ([`failure_level`]).
fn log_failure(phase: &str, attempt: u32, error: &PhaseError, panicked: bool) {
    let retryable = error.is_retryable();
    match failure_level(error, panicked) {
        tracing::Level::ERROR => {
            tracing::error!(phase, attempt, error = %error.message, "a phase panicked");
        }
        tracing::Level::WARN => {
            tracing::warn!(phase, attempt, retryable, error = %error.message, "attempt failed");
        }
        _ => {
            tracing::info!(phase, attempt, outcome = %error.message, "the phase answered the request itself");
        }
    }
}

#[cfg(test)]
mod level_tests {
    use super::*;

    #[test]
    fn business_outcomes_are_not_warnings() {
        let declined = StoredResponse::new(402, b"declined".to_vec());
        let info = [
            PhaseError::terminal_with(declined.clone(), "card declined"),
            PhaseError::not_executed(declined, "no such route"),
        ];
        for error in &info {
            assert_eq!(
                failure_level(error, false),
                tracing::Level::INFO,
                "{error:?}"
            );
        }
        let warn = [
            PhaseError::retryable("provider timed out"),
            PhaseError::terminal("invariant broken"),
        ];
        for error in &warn {
            assert_eq!(
                failure_level(error, false),
                tracing::Level::WARN,
                "{error:?}"
            );
        }
        assert_eq!(
            failure_level(&PhaseError::retryable("boom"), true),
            tracing::Level::ERROR
        );
    }
}
