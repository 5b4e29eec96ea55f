//! Restart in place: a transaction the database rolled back to keep transactions apart (a
//! serialization failure, SQLSTATE 40001; a deadlock's victim, PostgreSQL 40P01, MySQL/MariaDB
//! 1213) runs again at once, from its first phase, under the same key and hold: the same owner
//! and token for a committed hold, the claim made again with its token, a client retry's
//! takeover made again from the token it took over. The phases get the same input, decoded again
//! from what the drive holds encoded (the request, the recorded output, a foreign result not yet
//! committed). What the database asks for is a new run of the transaction, not a new attempt:
//! none is counted and no backoff is waited, only a short jittered pause so that the
//! transactions that crossed do not cross again in step. Past the runner's
//! [`crate::RunnerConfig::most_restarts`] the failure is an ordinary retryable one
//! (`failure.rs`).
//!
//! A transaction is run again only when the engine says it is still its own or was rolled back
//! whole with nothing committed since (`idemflow_store::Standing`): a phase that ended it and
//! may have committed is never run again, and its record says so.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::failure::in_progress;
use super::{Drive, FailedAttempt, Hold, Stop};
use crate::deadline::Within;
use crate::engine::{Engine, KeyOwner, Standing};
use crate::erased::{Carry, Step};
use crate::metrics;
use crate::panic::catch_panic_now;

/// The pause before restart `n` (0-based): up to 2^n ms, at most 64 ms, at random. Long enough
/// for the transaction that won to commit, short next to a backoff of a second.
pub(crate) fn restart_pause(n: u32) -> Duration {
    let ceiling = f64::from(1_u32 << n.min(6));
    Duration::from_secs_f64(ceiling * idemflow_core::backoff::unit() / 1000.0)
}

impl<E: Engine> Drive<'_, E> {
    /// Rolls the failed transaction back and makes the hold again, then says where to run from
    /// and with what input; `None` when it may not run again (the restarts are spent, the
    /// transaction ended in a way that may have committed, its start or input is unknown): the
    /// failure is then recorded as any other.
    pub(super) async fn restart(
        &mut self,
        failure: &FailedAttempt,
    ) -> Result<Option<(usize, Carry)>, Stop> {
        if self.restarts >= self.runner.config.most_restarts
            || failure.panicked
            || failure.spent
            || self.overran
            || self.abandoned
        {
            return Ok(None);
        }
        let Some(start) = self.tx_start else {
            return Ok(None);
        };
        // Asked before anything is undone: a transaction a phase ended is the record's to judge.
        let ended = if self.tx.is_some() {
            self.ended_under().await
        } else {
            None
        };
        if self.standing_unread || ended == Some(Standing::Ended) {
            return Ok(None);
        }
        if ended == Some(Standing::RolledBack) && self.hold_committed_under_a_phase().await {
            // A phase committed the claim or takeover before the rollback: not a restart.
            return Ok(None);
        }
        let Some(input) = self.input_at(start.position) else {
            return Ok(None);
        };
        if let Some(tx) = self.tx.take() {
            let wait = self.runner.config.database_timeout;
            match E::rollback(tx).within(wait).await {
                Ok(Ok(())) => {}
                // The connection is not reused; the server rolls back as it closes.
                Ok(Err(error)) => tracing::warn!(%error, "rolling back before a restart failed"),
                Err(error) => tracing::warn!(%error, "rolling back before a restart timed out"),
            }
        }
        tokio::time::sleep(restart_pause(self.restarts)).await;
        self.restarts += 1;
        let workflow = self.workflow;
        self.hold_again(*workflow.limits_at(start.position)).await?;
        self.unrecorded = start.unrecorded;
        self.ended = None;
        self.standing_unread = false;
        self.claim_refused = false;
        self.commit_refused = false;
        metrics::count_phase(metrics::RESTARTS, workflow.name(), failure.phase);
        tracing::debug!(
            phase = failure.phase,
            restart = self.restarts,
            error = %failure.error,
            "the database rolled the transaction back to keep transactions apart; running it again"
        );
        Ok(Some((start.position, input)))
    }

    /// The hold made again after the whole transaction rolled back, in a transaction under
    /// `limits`: a committed hold is kept; the claim, rolled back with everything at a moment
    /// this owner knows, is claimed again at once with its token, as after a refused first
    /// commit; a client retry's takeover is taken over again from the token it took over.
    /// Another request that got the key meanwhile owns its outcome: this one answers 409.
    async fn hold_again(&mut self, limits: idemflow_store::Limits) -> Result<(), Stop> {
        let wait = self.runner.config.database_timeout;
        let holding = Instant::now();
        let held = match self.hold.clone() {
            Hold::Committed => return Ok(()),
            Hold::Claim(fingerprint) => {
                self.claim_again(&fingerprint, &limits)
                    .within(wait)
                    .await??
            }
            Hold::TakeOver { seen } => self.take_over_again(seen, &limits).within(wait).await??,
        };
        let Some(held) = held else {
            return Err(Stop::Answered(in_progress()));
        };
        self.lease_from = holding;
        self.tx = Some(held.tx);
        self.set_owner(held.owner);
        if matches!(self.hold, Hold::TakeOver { .. }) {
            self.context.attempt = held.attempt;
        }
        Ok(())
    }

    /// A claim made again keeps its token (PostgreSQL's drawn by the look-up, MySQL/MariaDB's
    /// life stored again by the insert); one an engine could not keep is the new one's. A
    /// takeover made again always has a new one.
    fn set_owner(&mut self, owner: E::Owner) {
        self.context.lock_version = owner.lock_version();
        self.owner = owner;
    }

    /// The input of the phase at `position`, decoded again from what the drive holds: the
    /// request for the first phase, else the output of the phase before it (a foreign result not
    /// yet committed, or the recorded output). `None` when the drive holds neither.
    fn input_at(&self, position: usize) -> Option<Carry> {
        let workflow = self.workflow;
        let decoded = if position == 0 {
            let request = self.first_input.as_ref().unwrap_or(&self.request);
            catch_panic_now(|| workflow.decode_request(request))
        } else {
            let before = &workflow.steps[position - 1];
            let value = match &self.pending_foreign {
                Some((phase, value)) if *phase == before.raw_name() => value,
                _ if self.recorded_point == before.raw_name() => {
                    self.recorded_output.as_ref().unwrap_or(&Value::Null)
                }
                _ => return None,
            };
            catch_panic_now(|| before.decode_output(value))
        };
        match decoded {
            Ok(Ok(carry)) => Some(carry),
            _ => None,
        }
    }

    /// Where the first phase shares the claim's transaction, the workflow redacts its request
    /// and the key was just claimed, the input as given is kept (encoded) for a restart: the
    /// request the drive holds is the redacted one.
    pub(super) fn keep_first_input(&mut self, position: usize, carry: &Carry) {
        let workflow = self.workflow;
        if position == 0
            && matches!(self.hold, Hold::Claim(_))
            && workflow.redacts_requests()
            && let Some(Step::Local(local)) = workflow.steps.first()
        {
            self.first_input = local.encode_input(carry).ok();
        }
    }

    /// An uncommitted hold (a client retry's takeover, begun at the claim's level since the
    /// look-up cannot say where the key stands; a claim the layout would keep only at Read
    /// Committed, `crate::claim_level`) whose transaction began at another level than the phases
    /// it goes on with declare commits first, as a resumer's takeover does: their transaction
    /// then begins at theirs.
    pub(super) async fn settle_level(&mut self, position: usize) -> Result<(), Stop> {
        let level = self.workflow.limits_at(position).isolation;
        if self.hold == Hold::Committed || self.tx.is_none() || self.hold_level == level {
            return Ok(());
        }
        self.record_before_call(position, None).await
    }
}
