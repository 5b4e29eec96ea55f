//! Driving a claimed (or taken over) key through its phases, committing at the right points, and
//! recording failures.

use std::future::Future;
use std::time::{Duration, Instant};

use idemflow_core::{DerivedKey, Fingerprint, StoredResponse};
use idemflow_pg::{self as store, ClaimRequest, Claimed, Owner, StoreError};
use serde_json::Value;
use sqlx::PgPool;
use tracing::Instrument;

use crate::config::TerminalPolicy;
use crate::crash::CrashPoint;
use crate::error::{RunError, corrupt};
use crate::metrics;
use crate::outcome::Outcome;
use crate::phase::{PhaseContext, PhaseError, PhaseErrorKind};
use crate::runner::Runner;
use crate::workflow::{Carry, GiveUp, Step, Workflow};

pub(crate) type Tx = idemflow_pg::Transaction;

/// Where a drive starts: an owned key, its open transaction if any, and the next phase to run.
pub(crate) struct Start {
    pub owner: Owner,
    /// The claim's transaction (`Some`) or none yet: a resumed key begins one only when a local
    /// phase or a record needs it, so a key resumed before a foreign phase calls out at once.
    pub tx: Option<Tx>,
    pub position: usize,
    pub carry: Carry,
    /// The recovery point the row holds.
    pub recorded_point: String,
    pub context: PhaseContext,
    /// The request as stored, for the failure path.
    pub request: Value,
    /// `Some` while the claim itself is uncommitted in `tx`: rolling `tx` back erases the key,
    /// and this fingerprint lets the failure record claim it again.
    pub claim: Option<Fingerprint>,
}

/// What the failure record needs to know about where the drive stood.
struct Failure {
    phase: &'static str,
    retry_policy: crate::RetryPolicy,
    error: PhaseError,
    claim: Option<Fingerprint>,
    /// A foreign result not yet committed: committed with the failure so the call is not repeated.
    pending_foreign: Option<(&'static str, Value)>,
    recorded_point: String,
    request: Value,
}

impl Runner {
    /// Runs the phases from `start.position` to the end.
    ///
    /// Local phases share the open transaction; before each foreign call the transaction commits
    /// (with the claim or takeover, and the last local output as the recovery point), and a new
    /// one begins after it. So a request commits 1 + (number of foreign phases) times, and the
    /// claim is durable before anything leaves the database.
    pub(crate) async fn drive(
        &self,
        workflow: &Workflow,
        start: Start,
    ) -> Result<Outcome, RunError> {
        let Start {
            owner,
            mut tx,
            mut position,
            mut carry,
            mut recorded_point,
            mut context,
            request,
            mut claim,
        } = start;
        let lease = workflow.lease();
        // The last completed phase whose output `carry` holds and the row does not yet.
        let mut unrecorded: Option<usize> = None;
        // A foreign output not yet committed, kept encoded so an error in the phases after it
        // can still record it (and the foreign call is not repeated).
        let mut pending_foreign: Option<(&'static str, Value)> = None;

        loop {
            while let Some(Step::Local(local)) = workflow.steps.get(position) {
                let open = opened(&mut tx, &self.pool).await?;
                let span =
                    tracing::debug_span!("idemflow.phase", phase = local.name(), kind = "local");
                let started = Instant::now();
                // An uncommitted claim cannot be taken over (nobody else sees it): no heartbeat.
                let heartbeat = claim.is_none();
                let ran = self
                    .with_heartbeat(heartbeat, &owner, lease, local.run(open, carry, &context))
                    .await;
                metrics::phase_duration(workflow.name(), local.name(), "local", started.elapsed());
                match ran {
                    Ok(Ok(output)) => {
                        carry = output;
                        unrecorded = Some(position);
                        position += 1;
                    }
                    Ok(Err(error)) => {
                        rolled_back(tx).await?;
                        let failure = Failure {
                            phase: local.name(),
                            retry_policy: local.retry_policy(),
                            error,
                            claim,
                            pending_foreign,
                            recorded_point,
                            request,
                        };
                        return self
                            .fail(workflow, &owner, &context, failure)
                            .instrument(span)
                            .await;
                    }
                    Err(lost) => {
                        rolled_back(tx).await?;
                        metrics::count(metrics::FENCED, workflow.name());
                        return Err(lost);
                    }
                }
            }

            let Some(Step::Foreign(foreign)) = workflow.steps.get(position) else {
                // The chain ended: its output is the response, stored with the last effects.
                let last = &workflow.steps[position - 1];
                let response = downcast_response(carry)?;
                let mut open = match tx {
                    Some(open) => open,
                    None => Tx::begin(&self.pool).await?,
                };
                if let Err(error) =
                    store::finish(&mut open, &owner, last.name().as_str(), &response).await
                {
                    open.rollback().await?;
                    return Err(self.fenced_or(workflow, error));
                }
                self.crash_points
                    .check(|| CrashPoint::BeforeFinish, &owner.key)?;
                open.commit().await?;
                self.crash_points
                    .check(|| CrashPoint::AfterFinish, &owner.key)?;
                metrics::count(metrics::FINISHED, workflow.name());
                tracing::info!(status = response.status, "finished");
                return Ok(Outcome::Executed(response));
            };

            // Make everything so far durable before calling out. A key resumed right before this
            // phase has nothing to make durable, and no transaction: it calls out at once.
            let mut committed = "claim";
            if let Some(index) = unrecorded.take() {
                let step = &workflow.steps[index];
                let output = match pending_foreign.take() {
                    Some((name, output)) if name == step.name().as_str() => output,
                    _ => step.encode_output(&carry).map_err(corrupt)?,
                };
                let open = opened(&mut tx, &self.pool).await?;
                if let Err(error) =
                    store::advance(open, &owner, step.name().as_str(), &output, lease).await
                {
                    rolled_back(tx).await?;
                    return Err(self.fenced_or(workflow, error));
                }
                recorded_point = step.name().as_str().to_owned();
                context.attempt = 1;
                committed = step.name().as_str();
            }
            if let Some(open) = tx.take() {
                self.crash_points
                    .check(|| CrashPoint::BeforeCommit { phase: committed }, &owner.key)?;
                open.commit().await?;
                claim = None;
                self.crash_points
                    .check(|| CrashPoint::AfterCommit { phase: committed }, &owner.key)?;
            }
            self.crash_points.check(
                || CrashPoint::BeforeCall {
                    phase: foreign.name(),
                },
                &owner.key,
            )?;

            let derived_key =
                DerivedKey::new(&owner.tenant, &owner.key, workflow.steps[position].name());
            let span = tracing::info_span!(
                "idemflow.phase", phase = foreign.name(), kind = "foreign", derived_key = %derived_key
            );
            let started = Instant::now();
            let call = tokio::time::timeout(
                foreign.timeout(),
                foreign.call(carry, &derived_key, &context),
            );
            let called = self
                .with_heartbeat(true, &owner, lease, call)
                .instrument(span.clone())
                .await;
            metrics::phase_duration(
                workflow.name(),
                foreign.name(),
                "foreign",
                started.elapsed(),
            );
            let error = match called {
                Ok(Ok(Ok(output))) => {
                    self.crash_points.check(
                        || CrashPoint::AfterCall {
                            phase: foreign.name(),
                        },
                        &owner.key,
                    )?;
                    carry = output;
                    let encoded = workflow.steps[position]
                        .encode_output(&carry)
                        .map_err(corrupt)?;
                    pending_foreign = Some((foreign.name(), encoded));
                    unrecorded = Some(position);
                    position += 1;
                    continue;
                }
                Ok(Ok(Err(error))) => error,
                Ok(Err(_elapsed)) => {
                    PhaseError::retryable(format!("timed out after {:?}", foreign.timeout()))
                }
                Err(lost) => {
                    metrics::count(metrics::FENCED, workflow.name());
                    return Err(lost);
                }
            };
            let failure = Failure {
                phase: foreign.name(),
                retry_policy: foreign.retry_policy(),
                error,
                claim: None,
                pending_foreign: None,
                recorded_point,
                request,
            };
            return self
                .fail(workflow, &owner, &context, failure)
                .instrument(span)
                .await;
        }
    }

    /// Runs `work`, renewing the owner's lease every third of it while `work` runs. If a renewal
    /// finds the lease lost (fenced), `work` is dropped and `Fenced` returned: an owner that lost
    /// its lease stops and commits nothing.
    async fn with_heartbeat<T>(
        &self,
        enabled: bool,
        owner: &Owner,
        lease: Duration,
        work: impl Future<Output = T>,
    ) -> Result<T, RunError> {
        if !enabled {
            return Ok(work.await);
        }
        tokio::select! {
            biased;
            output = work => Ok(output),
            lost = heartbeat(&self.pool, owner, lease) => Err(lost),
        }
    }

    fn fenced_or(&self, workflow: &Workflow, error: StoreError) -> RunError {
        if matches!(error, StoreError::Fenced) {
            metrics::count(metrics::FENCED, workflow.name());
            tracing::warn!("fenced: the lease was lost to another owner; nothing committed");
        }
        error.into()
    }

    /// Records a phase's failure in a transaction of its own (the failed one has rolled back).
    /// A retryable error leaves the key started, its lease set to the next attempt time, unless
    /// the phase's retries ran out: then the failure path runs and its response is stored. A
    /// terminal error stores its response (or, by policy, releases the key).
    async fn fail(
        &self,
        workflow: &Workflow,
        owner: &Owner,
        context: &PhaseContext,
        failure: Failure,
    ) -> Result<Outcome, RunError> {
        let Failure {
            phase,
            retry_policy,
            error,
            claim,
            pending_foreign,
            recorded_point,
            request,
        } = failure;
        tracing::warn!(phase, attempt = context.attempt, retryable = error.is_retryable(), error = %error.message, "phase failed");
        let terminal_response = match &error.kind {
            PhaseErrorKind::Terminal { response } => Some(
                response
                    .clone()
                    .unwrap_or_else(|| problem(500, &error.message)),
            ),
            PhaseErrorKind::Retryable { .. } => None,
        };
        if let (Some(response), TerminalPolicy::Release) =
            (&terminal_response, self.config.terminal_errors)
        {
            if claim.is_none() {
                let mut tx = Tx::begin(&self.pool).await?;
                let deleted = store::delete_owned(&mut tx, owner).await;
                fenced(deleted, tx).await?.commit().await?;
            }
            return Ok(Outcome::Released(response.clone()));
        }

        // The claim rolled back with the failed phase: claim again so the key stays resumable
        // (or holds its final response).
        let (mut tx, owner) = match &claim {
            Some(fingerprint) => {
                let claim_request = ClaimRequest {
                    tenant: &owner.tenant,
                    key: &owner.key,
                    fingerprint,
                    workflow: workflow.name(),
                    request: &request,
                    lease: workflow.lease(),
                };
                let connection = self.pool.acquire().await?;
                match store::begin_claim(connection, &claim_request).await? {
                    Claimed::Owned(tx, owner) => (tx, owner),
                    Claimed::Lost(_) => {
                        // Another request claimed the key meanwhile; it owns the outcome.
                        return Ok(Outcome::InProgress {
                            retry_after: Duration::from_secs(1),
                        });
                    }
                }
            }
            None => (Tx::begin(&self.pool).await?, owner.clone()),
        };
        let mut recovery_point = recorded_point;
        let mut recovery_output = None;
        let mut attempt = context.attempt;
        if let Some((name, output)) = pending_foreign {
            let advanced = store::advance(&mut tx, &owner, name, &output, workflow.lease()).await;
            tx = fenced(advanced, tx).await?;
            recovery_point = name.to_owned();
            recovery_output = Some(output);
            // The phase that failed is the first execution after that foreign result.
            attempt = 1;
        }

        let message = format!("{phase}: {}", error.message);
        let (response, outcome) = match (terminal_response, &error.kind) {
            (Some(response), _) => (response.clone(), Outcome::Executed(response)),
            (None, PhaseErrorKind::Retryable { retry_after })
                if !retry_policy.exhausted(attempt) =>
            {
                let retry_after = retry_after.unwrap_or_else(|| retry_policy.backoff(attempt));
                let released = store::release(&mut tx, &owner, retry_after, &message).await;
                tx = fenced(released, tx).await?;
                store::notify_due(&mut tx).await?;
                tx.commit().await?;
                metrics::count_phase(metrics::RETRIES, workflow.name(), phase);
                return Ok(Outcome::Interrupted {
                    retry_after,
                    error: message,
                });
            }
            (None, _) => {
                metrics::count_phase(metrics::GIVE_UPS, workflow.name(), phase);
                tracing::error!(phase, attempt, error = %message, "retries exhausted: giving up");
                let give_up = GiveUp {
                    request,
                    phase,
                    recovery_point: recovery_point.clone(),
                    recovery_output,
                    error: message.clone(),
                    attempts: attempt,
                };
                let response = self
                    .failure_path(workflow, &mut tx, give_up, context)
                    .await?;
                (response.clone(), Outcome::Executed(response))
            }
        };
        let finished = store::finish(&mut tx, &owner, &recovery_point, &response).await;
        fenced(finished, tx).await?.commit().await?;
        metrics::count(metrics::FINISHED, workflow.name());
        Ok(outcome)
    }

    /// Runs the workflow's failure path in a savepoint of `tx`; if there is none, or it fails
    /// itself, the response is a 500 problem naming the last error.
    async fn failure_path(
        &self,
        workflow: &Workflow,
        tx: &mut Tx,
        give_up: GiveUp,
        context: &PhaseContext,
    ) -> Result<StoredResponse, RunError> {
        let detail = format!(
            "gave up after {} attempts: {}",
            give_up.attempts, give_up.error
        );
        let Some(failure) = &workflow.failure else {
            return Ok(problem(500, &detail));
        };
        let mut savepoint = sqlx::Connection::begin(&mut **tx).await?;
        match failure.run(&mut savepoint, give_up, context).await {
            Ok(response) => {
                savepoint.commit().await?;
                Ok(response)
            }
            Err(error) => {
                savepoint.rollback().await?;
                tracing::error!(error = %error.message, "the failure path failed; storing a generic response");
                Ok(problem(500, &detail))
            }
        }
    }
}

/// Renews the lease every third of it until a renewal is fenced; returns that.
async fn heartbeat(pool: &PgPool, owner: &Owner, lease: Duration) -> RunError {
    let interval = lease / 3;
    loop {
        tokio::time::sleep(interval).await;
        let renewed = match pool.acquire().await {
            Ok(mut connection) => store::renew_lease(&mut connection, owner, lease).await,
            Err(error) => Err(StoreError::Database(error)),
        };
        match renewed {
            Ok(()) => tracing::debug!("lease renewed"),
            Err(StoreError::Fenced) => {
                tracing::warn!("lease lost while a phase ran: stopping it");
                return RunError::Fenced;
            }
            // The phase goes on; the next renewal tries again, and the fence still protects.
            Err(error) => tracing::warn!(%error, "lease renewal failed"),
        }
    }
}

/// The open transaction, begun now if there is none yet.
async fn opened<'t>(tx: &'t mut Option<Tx>, pool: &PgPool) -> Result<&'t mut Tx, RunError> {
    let open = match tx.take() {
        Some(open) => open,
        None => Tx::begin(pool).await?,
    };
    Ok(tx.insert(open))
}

/// Rolls back the transaction, if one was begun.
async fn rolled_back(tx: Option<Tx>) -> Result<(), RunError> {
    if let Some(open) = tx {
        open.rollback().await?;
    }
    Ok(())
}

/// Passes the transaction on after a successful fenced write; rolls it back on failure.
async fn fenced(result: Result<(), StoreError>, tx: Tx) -> Result<Tx, RunError> {
    match result {
        Ok(()) => Ok(tx),
        Err(error) => {
            tx.rollback().await?;
            Err(error.into())
        }
    }
}

fn downcast_response(carry: Carry) -> Result<StoredResponse, RunError> {
    carry
        .downcast::<StoredResponse>()
        .map(|response| *response)
        .map_err(|_| RunError::Corrupt("the last phase did not produce a response".into()))
}

/// An RFC 9457 problem response.
fn problem(status: u16, detail: &str) -> StoredResponse {
    let title = if status == 500 {
        "Internal Server Error"
    } else {
        "Error"
    };
    StoredResponse::problem(
        status,
        &serde_json::json!({"type": "about:blank", "title": title, "status": status, "detail": detail}),
    )
}
