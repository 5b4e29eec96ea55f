use std::time::Duration;

use idemflow_core::{
    Decision, DerivedKey, Fingerprint, Key, KeyState, StoredKey, StoredResponse, TenantId,
    canonicalize, decide,
};
use idemflow_pg::{self as store, ClaimRequest, Owner, StoreError};
use serde_json::Value;
use sqlx::{PgPool, Postgres, Transaction};
use tracing::Instrument;

use crate::outcome::{Outcome, Rejection};
use crate::phase::{PhaseContext, PhaseError, PhaseErrorKind};
use crate::transaction::begin;
use crate::workflow::{Carry, Step, Workflow};

type Tx = Transaction<'static, Postgres>;

/// What a terminal phase error does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TerminalPolicy {
    /// Store the error response and replay it to every retry (Stripe's v1 rule: once execution
    /// started, the outcome is the outcome, errors included). The default.
    #[default]
    Store,
    /// Delete the key and answer the error without storing it, so the client may retry the same
    /// key as a new request. Only for workflows whose phases are safe to run again from the
    /// start; foreign phases are called again with the same derived keys.
    Release,
}

/// How a [`Runner`] treats failures.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    pub terminal_errors: TerminalPolicy,
    /// How long a key rests after a retryable error that named no delay of its own, before a
    /// retry or a resumer may take it over.
    pub retry_delay: Duration,
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            terminal_errors: TerminalPolicy::Store,
            retry_delay: Duration::from_secs(1),
        }
    }
}

/// A request as the runner fingerprints it: method, path and a JSON body.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub body: &'a [u8],
}

/// Why a run failed without an [`Outcome`]: the database, not the request.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// This owner lost its lease to a takeover while it ran: it committed nothing since, and the
    /// new owner finishes the request (answer 409).
    #[error("fenced: the lease on this key was taken over by another owner")]
    Fenced,
    #[error("corrupt key row: {0}")]
    Corrupt(String),
    /// The key is left at a recovery point this workflow does not have (a phase was renamed or
    /// removed while keys were left at it).
    #[error(
        "the key is left at recovery point {recovery_point:?}, which workflow {workflow:?} does not have"
    )]
    UnknownRecoveryPoint {
        workflow: String,
        recovery_point: String,
    },
}

impl From<StoreError> for RunError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Database(error) => Self::Database(error),
            StoreError::Corrupt(message) => Self::Corrupt(message),
        }
    }
}

fn corrupt(error: serde_json::Error) -> RunError {
    RunError::Corrupt(format!("a stored phase output does not decode: {error}"))
}

/// How many times a claim is retried when the key vanishes or changes owner between statements.
const CLAIM_ROUNDS: usize = 3;

/// Executes workflows under idempotency keys.
#[derive(Debug, Clone)]
pub struct Runner {
    pool: PgPool,
    config: RunnerConfig,
}

/// Where a drive starts: an owned key, its open transaction, and the next phase to run.
struct Start {
    owner: Owner,
    tx: Tx,
    position: usize,
    carry: Carry,
    recorded_point: String,
    context: PhaseContext,
    /// The claim itself is in `tx`: rolling `tx` back erases the key.
    claim: Option<ClaimRecord>,
}

/// Enough to claim a key again after the transaction holding its claim rolled back.
struct ClaimRecord {
    fingerprint: Fingerprint,
    request: Value,
}

impl Runner {
    pub fn new(pool: PgPool) -> Self {
        Self::with_config(pool, RunnerConfig::default())
    }

    pub fn with_config(pool: PgPool, config: RunnerConfig) -> Self {
        Self { pool, config }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs `request` under (`tenant`, `key`) through `workflow`: claims the key and executes it,
    /// or replays its stored response, or reports that it is in progress, used for another
    /// request, or invalid.
    ///
    /// The body must be JSON; it is canonicalized (RFC 8785) for the fingerprint and decoded
    /// into the workflow's request type. A request that fails either is rejected and stores
    /// nothing.
    pub async fn run(
        &self,
        workflow: &Workflow,
        tenant: &TenantId,
        key: &str,
        request: Request<'_>,
    ) -> Result<Outcome, RunError> {
        let key = match Key::parse(key) {
            Ok(key) => key,
            Err(error) => return Ok(Outcome::Rejected(error.into())),
        };
        let canonical = match canonicalize(request.body) {
            Ok(canonical) => canonical,
            Err(error) => return Ok(Outcome::Rejected(error.into())),
        };
        let fingerprint = Fingerprint::of_canonical_json(request.method, request.path, &canonical);
        let request_value: Value = match serde_json::from_slice(&canonical) {
            Ok(value) => value,
            Err(error) => {
                return Ok(Outcome::Rejected(Rejection::InvalidInput(
                    error.to_string(),
                )));
            }
        };
        // Decode now, before anything is stored: a body of the wrong shape is rejected.
        let input = match workflow.decode_request(request_value.clone()) {
            Ok(input) => input,
            Err(error) => {
                return Ok(Outcome::Rejected(Rejection::InvalidInput(
                    error.to_string(),
                )));
            }
        };
        if let Err(reason) = workflow.validate(&input) {
            return Ok(Outcome::Rejected(Rejection::InvalidInput(reason)));
        }
        let span = tracing::info_span!(
            "idemflow.request",
            tenant = %tenant,
            key = %key,
            workflow = workflow.name(),
            lock_version = tracing::field::Empty,
        );
        self.claim_and_drive(workflow, tenant, key, fingerprint, request_value, input)
            .instrument(span)
            .await
    }

    async fn claim_and_drive(
        &self,
        workflow: &Workflow,
        tenant: &TenantId,
        key: Key,
        fingerprint: Fingerprint,
        request: Value,
        mut input: Carry,
    ) -> Result<Outcome, RunError> {
        for _ in 0..CLAIM_ROUNDS {
            let mut tx = begin(&self.pool).await?;
            let claim = ClaimRequest {
                tenant,
                key: &key,
                fingerprint: &fingerprint,
                workflow: workflow.name(),
                request: &request,
                lease: workflow.lease(),
            };
            if let Some(owner) = store::claim(&mut tx, &claim).await? {
                tracing::Span::current().record("lock_version", owner.lock_version);
                let context = PhaseContext {
                    tenant: tenant.clone(),
                    key: key.clone(),
                    attempt: 1,
                };
                let start = Start {
                    owner,
                    tx,
                    position: 0,
                    carry: input,
                    recorded_point: idemflow_core::RecoveryPoint::START.to_owned(),
                    context,
                    claim: Some(ClaimRecord {
                        fingerprint,
                        request,
                    }),
                };
                return self.drive(workflow, start).await;
            }
            let Some(row) = store::inspect(&mut tx, tenant, &key).await? else {
                // Deleted between the claim and the read (retention): claim again.
                tx.rollback().await?;
                continue;
            };
            let state = if row.done {
                KeyState::Done
            } else {
                KeyState::Started {
                    lease_left: row.lease_left,
                }
            };
            let stored = StoredKey {
                fingerprint: &row.fingerprint,
                workflow: &row.workflow,
                state,
            };
            match decide(&stored, &fingerprint, workflow.name()) {
                Decision::Replay => {
                    tx.rollback().await?;
                    let response = row
                        .response
                        .ok_or_else(|| RunError::Corrupt("a done key without a response".into()))?;
                    tracing::debug!(status = response.status, "replayed");
                    return Ok(Outcome::Replayed(response));
                }
                Decision::InProgress { retry_after } => {
                    tx.rollback().await?;
                    tracing::debug!(?retry_after, "in progress");
                    return Ok(Outcome::InProgress { retry_after });
                }
                Decision::Mismatch => {
                    tx.rollback().await?;
                    tracing::debug!("mismatch");
                    return Ok(Outcome::Mismatch);
                }
                Decision::TakeOver => {
                    let Some(taken) =
                        store::take_over(&mut tx, tenant, &key, row.lock_version, workflow.lease())
                            .await?
                    else {
                        // Someone else took it over or finished it first: look again.
                        tx.rollback().await?;
                        continue;
                    };
                    tracing::Span::current().record("lock_version", taken.owner.lock_version);
                    tracing::info!(recovery_point = %taken.recovery_point, "took over an expired lease");
                    let position = match workflow.position_after(&taken.recovery_point) {
                        Some(position) => position,
                        None => {
                            tx.rollback().await?;
                            return Err(RunError::UnknownRecoveryPoint {
                                workflow: workflow.name().to_owned(),
                                recovery_point: taken.recovery_point,
                            });
                        }
                    };
                    let carry = if position == 0 {
                        // Reuse the request this call decoded; it has the stored fingerprint.
                        std::mem::replace(&mut input, Box::new(()))
                    } else {
                        let output = taken.phase_output.unwrap_or(Value::Null);
                        workflow.steps[position - 1]
                            .decode_output(output)
                            .map_err(corrupt)?
                    };
                    let context = PhaseContext {
                        tenant: tenant.clone(),
                        key: key.clone(),
                        attempt: row.attempts + 1,
                    };
                    let start = Start {
                        owner: taken.owner,
                        tx,
                        position,
                        carry,
                        recorded_point: taken.recovery_point,
                        context,
                        claim: None,
                    };
                    return self.drive(workflow, start).await;
                }
            }
        }
        // The key kept changing hands under us: tell the client to come back shortly.
        Ok(Outcome::InProgress {
            retry_after: Duration::from_secs(1),
        })
    }

    /// Runs the phases from `start.position` to the end.
    ///
    /// Local phases share the open transaction; before each foreign call the transaction commits
    /// (with the claim or takeover, and the last local output as the recovery point), and a new
    /// one begins after it. So a request commits 1 + (number of foreign phases) times, and the
    /// claim is durable before anything leaves the database.
    async fn drive(&self, workflow: &Workflow, start: Start) -> Result<Outcome, RunError> {
        let Start {
            owner,
            mut tx,
            mut position,
            mut carry,
            mut recorded_point,
            context,
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
                let span =
                    tracing::debug_span!("idemflow.phase", phase = local.name(), kind = "local");
                match local.run(&mut tx, carry, &context).instrument(span).await {
                    Ok(output) => {
                        carry = output;
                        unrecorded = Some(position);
                        position += 1;
                    }
                    Err(error) => {
                        tx.rollback().await?;
                        let failure = Failure {
                            phase: local.name(),
                            error,
                            claim,
                            pending_foreign,
                            recorded_point,
                        };
                        return self.fail(workflow, &owner, failure).await;
                    }
                }
            }

            let Some(Step::Foreign(foreign)) = workflow.steps.get(position) else {
                // The chain ended: its output is the response, stored with the last effects.
                let last = &workflow.steps[position - 1];
                let response = downcast_response(carry)?;
                if let Err(error) =
                    store::finish(&mut tx, &owner, last.name().as_str(), &response).await
                {
                    tx.rollback().await?;
                    return Err(error.into());
                }
                tx.commit().await?;
                tracing::info!(status = response.status, "finished");
                return Ok(Outcome::Executed(response));
            };

            // Make everything so far durable before calling out.
            if let Some(index) = unrecorded.take() {
                let step = &workflow.steps[index];
                let output = match pending_foreign.take() {
                    Some((name, output)) if name == step.name().as_str() => output,
                    _ => step.encode_output(&carry).map_err(corrupt)?,
                };
                if let Err(error) =
                    store::advance(&mut tx, &owner, step.name().as_str(), &output, lease).await
                {
                    tx.rollback().await?;
                    return Err(error.into());
                }
                recorded_point = step.name().as_str().to_owned();
            }
            tx.commit().await?;
            claim = None;

            let derived_key =
                DerivedKey::new(&owner.tenant, &owner.key, workflow.steps[position].name());
            let span = tracing::info_span!("idemflow.phase", phase = foreign.name(), kind = "foreign", derived_key = %derived_key);
            let called = tokio::time::timeout(
                foreign.timeout(),
                foreign.call(carry, &derived_key, &context),
            )
            .instrument(span)
            .await;
            let error = match called {
                Ok(Ok(output)) => {
                    carry = output;
                    let encoded = workflow.steps[position]
                        .encode_output(&carry)
                        .map_err(corrupt)?;
                    pending_foreign = Some((foreign.name(), encoded));
                    unrecorded = Some(position);
                    position += 1;
                    tx = begin(&self.pool).await?;
                    continue;
                }
                Ok(Err(error)) => error,
                Err(_elapsed) => {
                    PhaseError::retryable(format!("timed out after {:?}", foreign.timeout()))
                }
            };
            let failure = Failure {
                phase: foreign.name(),
                error,
                claim: None,
                pending_foreign: None,
                recorded_point,
            };
            return self.fail(workflow, &owner, failure).await;
        }
    }

    /// Records a phase's failure in a transaction of its own. A retryable error leaves the key
    /// started with its lease set to the next attempt; a terminal one stores (or, by policy,
    /// releases) the key. The failed transaction has already rolled back.
    async fn fail(
        &self,
        workflow: &Workflow,
        owner: &Owner,
        failure: Failure,
    ) -> Result<Outcome, RunError> {
        let Failure {
            phase,
            error,
            claim,
            pending_foreign,
            recorded_point,
        } = failure;
        tracing::warn!(phase, retryable = error.is_retryable(), error = %error.message, "phase failed");
        let terminal_response = match &error.kind {
            PhaseErrorKind::Terminal { response } => {
                Some(response.clone().unwrap_or_else(|| failed_response(&error)))
            }
            PhaseErrorKind::Retryable { .. } => None,
        };
        if let (Some(response), TerminalPolicy::Release) =
            (&terminal_response, self.config.terminal_errors)
        {
            if claim.is_none() {
                let mut tx = begin(&self.pool).await?;
                fenced(store::delete_owned(&mut tx, owner).await, tx)
                    .await?
                    .commit()
                    .await?;
            }
            return Ok(Outcome::Released(response.clone()));
        }

        let mut tx = begin(&self.pool).await?;
        // The claim rolled back with the failed phase: claim again so the key stays resumable
        // (or holds its terminal response).
        let owner = match &claim {
            Some(record) => {
                let claim_request = ClaimRequest {
                    tenant: &owner.tenant,
                    key: &owner.key,
                    fingerprint: &record.fingerprint,
                    workflow: workflow.name(),
                    request: &record.request,
                    lease: workflow.lease(),
                };
                match store::claim(&mut tx, &claim_request).await? {
                    Some(owner) => owner,
                    None => {
                        // Another request claimed the key meanwhile; it owns the outcome.
                        tx.rollback().await?;
                        return Ok(Outcome::InProgress {
                            retry_after: Duration::from_secs(1),
                        });
                    }
                }
            }
            None => owner.clone(),
        };
        let mut recovery_point = recorded_point;
        if let Some((name, output)) = &pending_foreign {
            tx = fenced(
                store::advance(&mut tx, &owner, name, output, workflow.lease()).await,
                tx,
            )
            .await?;
            recovery_point = (*name).to_owned();
        }
        let outcome = match (terminal_response, &error.kind) {
            (Some(response), _) => {
                tx = fenced(
                    store::finish(&mut tx, &owner, &recovery_point, &response).await,
                    tx,
                )
                .await?;
                Outcome::Executed(response)
            }
            (None, PhaseErrorKind::Retryable { retry_after }) => {
                let retry_after = retry_after.unwrap_or(self.config.retry_delay);
                let message = format!("{phase}: {}", error.message);
                tx = fenced(
                    store::release(&mut tx, &owner, retry_after, &message).await,
                    tx,
                )
                .await?;
                Outcome::Interrupted {
                    retry_after,
                    error: message,
                }
            }
            (None, PhaseErrorKind::Terminal { .. }) => {
                unreachable!("a terminal error always has a response")
            }
        };
        tx.commit().await?;
        Ok(outcome)
    }
}

struct Failure {
    phase: &'static str,
    error: PhaseError,
    claim: Option<ClaimRecord>,
    pending_foreign: Option<(&'static str, Value)>,
    recorded_point: String,
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

/// The stored answer to a terminal error that named no response: a 500 problem.
fn failed_response(error: &PhaseError) -> StoredResponse {
    let problem = serde_json::json!({
        "type": "about:blank",
        "title": "Internal Server Error",
        "status": 500,
        "detail": error.message,
    });
    StoredResponse {
        status: 500,
        headers: vec![(
            "content-type".to_owned(),
            "application/problem+json".to_owned(),
        )],
        body: problem.to_string().into_bytes(),
    }
}
