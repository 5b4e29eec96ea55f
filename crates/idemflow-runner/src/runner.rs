use std::sync::Arc;
use std::time::Duration;

use idemflow_core::{
    Decision, Fingerprint, Key, KeyState, RecoveryPoint, StoredKey, TenantId, canonicalize_parsed,
    decide,
};
use idemflow_pg::{self as store, ClaimRequest, Claimed, LookUp, TakenOver};
use serde_json::Value;
use sqlx::PgPool;
use tracing::Instrument;

use crate::config::RunnerConfig;
use crate::crash::{CrashHook, CrashPoints};
use crate::drive::{Entry, Hold, Start, Tx};
use crate::error::RunError;
use crate::metrics;
use crate::outcome::{Outcome, Rejection};
use crate::phase::PhaseContext;
use crate::storable::holds_nul;
use crate::workflow::{Carry, Workflow};

/// A request as the runner fingerprints it: method, path and a JSON body.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// The HTTP method, compared byte for byte: pass it as the server received it.
    pub method: &'a str,
    /// The request's path, compared byte for byte: the same body sent to another path is
    /// another request.
    pub path: &'a str,
    /// The JSON body, canonicalized (RFC 8785) before it is fingerprinted, so whitespace and
    /// member order do not matter.
    pub body: &'a [u8],
}

/// How many times a request looks its key up again when the key changes hands between statements.
const CLAIM_ROUNDS: usize = 3;

/// Executes workflows under idempotency keys.
#[derive(Debug, Clone)]
pub struct Runner {
    pub(crate) pool: PgPool,
    pub(crate) config: RunnerConfig,
    pub(crate) crash_points: CrashPoints,
}

impl Runner {
    /// A runner on `pool`, with the default [`RunnerConfig`] (terminal errors are stored). The
    /// first runner of a process describes the engine's metrics to the installed recorder.
    pub fn new(pool: PgPool) -> Self {
        Self::with_config(pool, RunnerConfig::default())
    }

    /// As [`Runner::new`], with `config`.
    pub fn with_config(pool: PgPool, config: RunnerConfig) -> Self {
        metrics::describe_once();
        Self {
            pool,
            config,
            crash_points: CrashPoints::default(),
        }
    }

    /// Installs a crash hook: at each [`crate::CrashPoint`] the hook may stop the run as a crash would.
    /// For tests (see the testkit's explorer); without one, each point costs a branch.
    pub fn with_crash_hook(mut self, hook: Arc<dyn CrashHook>) -> Self {
        self.crash_points = CrashPoints::new(hook);
        self
    }

    /// The pool the runner takes its connections from.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs `request` under (`tenant`, `key`) through `workflow`: claims the key and executes it,
    /// or replays its stored response, or reports that it is in progress, used for another
    /// request, or invalid. A started key whose lease expired is taken over and finished from
    /// its recovery point.
    ///
    /// The key is parsed by the caller (`Key::parse`: 1 to 255 bytes of printable ASCII), so
    /// a malformed one never gets this far. The body must be JSON; it is canonicalized (RFC 8785)
    /// for the fingerprint and, for a key not yet claimed, decoded into the workflow's request
    /// type and checked by the workflow's `validate`. A request that fails any of these is
    /// rejected and stores nothing.
    ///
    /// ```no_run
    /// # async fn example(runner: idemflow_runner::Runner, workflow: idemflow_runner::Workflow)
    /// # -> Result<(), Box<dyn std::error::Error>> {
    /// use idemflow_core::{Key, TenantId};
    /// use idemflow_runner::{Outcome, Request};
    ///
    /// let key = Key::parse("order-7f3a")?;
    /// let body = br#"{"amount": 2500, "currency": "usd"}"#;
    /// let request = Request { method: "POST", path: "/v1/checkouts", body };
    /// match runner.run(&workflow, &TenantId::new("acme")?, &key, request).await? {
    ///     Outcome::Executed(response) | Outcome::Replayed(response) => { /* send it */ }
    ///     other => { /* 409, 422, 400, 503: see the HTTP layer's `respond` */ }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn run(
        &self,
        workflow: &Workflow,
        tenant: &TenantId,
        key: &Key,
        request: Request<'_>,
    ) -> Result<Outcome, RunError> {
        let prepared = canonical_request(request);
        self.run_accepted(workflow, tenant, key, prepared).await
    }

    /// Runs a request whose fingerprint the caller computed (an HTTP layer fingerprinting a
    /// non-JSON body by its bytes and content type, say). `request` is what the workflow's
    /// request type decodes from, and what is stored for a resumer.
    pub async fn run_fingerprinted(
        &self,
        workflow: &Workflow,
        tenant: &TenantId,
        key: &Key,
        fingerprint: Fingerprint,
        request: Value,
    ) -> Result<Outcome, RunError> {
        self.run_accepted(workflow, tenant, key, Ok((fingerprint, request)))
            .await
    }

    async fn run_accepted(
        &self,
        workflow: &Workflow,
        tenant: &TenantId,
        key: &Key,
        prepared: Result<(Fingerprint, Value), Rejection>,
    ) -> Result<Outcome, RunError> {
        let accepted = match prepared.and_then(|prepared| accept(key, prepared)) {
            Ok(accepted) => accepted,
            Err(rejection) => {
                metrics::count(metrics::REJECTIONS, workflow.name());
                return Ok(Outcome::Rejected(rejection));
            }
        };
        let span = tracing::info_span!(
            "idemflow.request",
            tenant = %tenant,
            key = %accepted.key,
            workflow = workflow.name(),
            lock_version = tracing::field::Empty,
        );
        self.claim_or_decide(workflow, tenant, accepted)
            .instrument(span)
            .await
    }

    /// Finishes a key a resumer took over (see [`idemflow_pg::take_over_due`]), from its
    /// recovery point. The takeover is already committed; however long ago that was, the key's
    /// fence is confirmed before any call to another system.
    pub async fn resume(&self, workflow: &Workflow, taken: TakenOver) -> Result<Outcome, RunError> {
        let span = tracing::info_span!(
            "idemflow.resume",
            tenant = %taken.owner.tenant(),
            key = %taken.owner.key(),
            workflow = workflow.name(),
            lock_version = taken.owner.lock_version(),
            attempt = taken.attempts,
        );
        async {
            metrics::count(metrics::TAKEOVERS, workflow.name());
            let context = PhaseContext {
                tenant: taken.owner.tenant().clone(),
                key: taken.owner.key().clone(),
                attempt: u32::try_from(taken.attempts).unwrap_or(u32::MAX),
                lock_version: taken.owner.lock_version(),
            };
            let start = Start {
                owner: taken.owner,
                tx: None,
                hold: Hold::Committed,
                entry: Entry::Stored {
                    recovery_point: taken.recovery_point.clone(),
                    output: taken.phase_output,
                },
                recorded_point: taken.recovery_point,
                context,
                request: taken.request,
                last_error: taken.last_error,
                // However long it waited since its batch took it over, the call checks.
                lease_from: taken.lease_from,
            };
            self.drive(workflow, start).await
        }
        .instrument(span)
        .await
    }

    /// Looks the key up, then claims it, answers from its row, or takes it over.
    ///
    /// One round trip answers a retry, a 409 or a 422 (the look-up, outside any transaction).
    /// A new key costs one more before the first phase runs: `BEGIN` and the claim travel in one
    /// message ([`store::begin_claim`]), on the connection the look-up used.
    async fn claim_or_decide(
        &self,
        workflow: &Workflow,
        tenant: &TenantId,
        accepted: Accepted,
    ) -> Result<Outcome, RunError> {
        let Accepted {
            key,
            fingerprint,
            request,
        } = accepted;
        let mut decoded: Option<Carry> = None;
        let mut held = None;
        for _ in 0..CLAIM_ROUNDS {
            let mut connection = match held.take() {
                Some(connection) => connection,
                None => self.pool.acquire().await?,
            };
            let row = match store::look_up(&mut connection, tenant, &key).await? {
                LookUp::Found(row) => row,
                LookUp::Claiming => {
                    // Another request holds this key's uncommitted claim: it is in flight.
                    metrics::count(metrics::CONFLICTS, workflow.name());
                    tracing::debug!("in progress: being claimed");
                    return Ok(Outcome::InProgress {
                        retry_after: CLAIMING_RETRY_AFTER,
                    });
                }
                LookUp::Absent { lock_version } => {
                    let input = match decoded.take() {
                        Some(input) => input,
                        None => match decode_and_validate(workflow, &request) {
                            Ok(input) => input,
                            Err(rejection) => {
                                metrics::count(metrics::REJECTIONS, workflow.name());
                                return Ok(Outcome::Rejected(rejection));
                            }
                        },
                    };
                    let claim = ClaimRequest {
                        tenant,
                        key: &key,
                        lock_version,
                        fingerprint: &fingerprint,
                        workflow: workflow.name(),
                        request: &request,
                        lease: workflow.lease(),
                    };
                    let claimed_at = std::time::Instant::now();
                    match store::begin_claim(connection, &claim, workflow.limits()).await? {
                        Claimed::Owned(tx, owner) => {
                            tracing::Span::current().record("lock_version", owner.lock_version());
                            metrics::count(metrics::CLAIMS, workflow.name());
                            let context = PhaseContext {
                                tenant: tenant.clone(),
                                key: key.clone(),
                                attempt: 1,
                                lock_version: owner.lock_version(),
                            };
                            let start = Start {
                                owner,
                                tx: Some(tx),
                                hold: Hold::Claim(fingerprint),
                                entry: Entry::Decoded { position: 0, input },
                                recorded_point: RecoveryPoint::START.to_owned(),
                                context,
                                request,
                                last_error: None,
                                lease_from: claimed_at,
                            };
                            return self.drive(workflow, start).await;
                        }
                        Claimed::Lost(connection) => {
                            // A claim committed between the look-up and ours: look again.
                            decoded = Some(input);
                            held = Some(connection);
                            continue;
                        }
                    }
                }
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
            let decision = decide(&stored, &fingerprint, workflow.name());
            if decision != Decision::TakeOver {
                drop(connection);
                return answer(workflow, decision, row.response);
            }
            let mut tx = Tx::begin_limited(connection, workflow.limits()).await?;
            let lease = workflow.lease();
            let Some(taken) =
                store::take_over(&mut tx, tenant, &key, row.lock_version, lease).await?
            else {
                // Someone else took it over, finished it, or is taking it over right now: look
                // again.
                tx.rollback().await?;
                continue;
            };
            tracing::Span::current().record("lock_version", taken.owner.lock_version());
            tracing::info!(recovery_point = %taken.recovery_point, "took over an expired lease");
            metrics::count(metrics::TAKEOVERS, workflow.name());
            // From the start, the stored request is decoded as a resumer would (the same
            // fingerprint as this call's).
            let entry = Entry::Stored {
                recovery_point: taken.recovery_point.clone(),
                output: taken.phase_output,
            };
            let context = PhaseContext {
                tenant: tenant.clone(),
                key: key.clone(),
                attempt: u32::try_from(taken.attempts).unwrap_or(u32::MAX),
                lock_version: taken.owner.lock_version(),
            };
            let start = Start {
                owner: taken.owner,
                tx: Some(tx),
                hold: Hold::TakeOver {
                    seen: row.lock_version,
                },
                entry,
                recorded_point: taken.recovery_point,
                context,
                request: taken.request,
                last_error: taken.last_error,
                lease_from: taken.lease_from,
            };
            return self.drive(workflow, start).await;
        }
        // The key kept changing hands under us: tell the client to come back shortly.
        Ok(Outcome::InProgress {
            retry_after: CLAIMING_RETRY_AFTER,
        })
    }
}

/// Retry-After for a key being claimed (or changing hands) right now: its lease is not visible
/// yet, and the claim's first transaction is usually over in milliseconds.
const CLAIMING_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The answer to a request whose key is someone else's: a replay, a 409 or a 422.
fn answer(
    workflow: &Workflow,
    decision: Decision,
    response: Option<idemflow_core::StoredResponse>,
) -> Result<Outcome, RunError> {
    match decision {
        Decision::Replay => {
            let response = response
                .ok_or_else(|| RunError::Corrupt("a done key without a response".into()))?;
            metrics::count(metrics::REPLAYS, workflow.name());
            tracing::debug!(status = response.status, "replayed");
            Ok(Outcome::Replayed(response))
        }
        Decision::InProgress { retry_after } => {
            metrics::count(metrics::CONFLICTS, workflow.name());
            tracing::debug!(?retry_after, "in progress");
            Ok(Outcome::InProgress { retry_after })
        }
        Decision::Mismatch => {
            metrics::count(metrics::MISMATCHES, workflow.name());
            tracing::debug!("mismatch");
            Ok(Outcome::Mismatch)
        }
        Decision::TakeOver => unreachable!("a takeover makes the request ours"),
    }
}

/// A request that passed every check before execution.
struct Accepted {
    key: Key,
    fingerprint: Fingerprint,
    request: Value,
}

/// Canonicalizes a JSON body and fingerprints it.
fn canonical_request(request: Request<'_>) -> Result<(Fingerprint, Value), Rejection> {
    // Parsed once: the value is the canonical form read back, so `1e2` is the integer 100 the
    // fingerprint says it is.
    let canonical = canonicalize_parsed(request.body)?;
    let fingerprint =
        Fingerprint::of_canonical_json(request.method, request.path, &canonical.bytes);
    Ok((fingerprint, canonical.value))
}

fn accept(key: &Key, (fingerprint, value): (Fingerprint, Value)) -> Result<Accepted, Rejection> {
    let key = key.clone();
    if holds_nul(&value) {
        // PostgreSQL's jsonb cannot store U+0000: refuse it here, before anything is stored,
        // rather than fail the claim with a database error.
        return Err(Rejection::InvalidInput(
            "strings may not contain U+0000".to_owned(),
        ));
    }
    Ok(Accepted {
        key,
        fingerprint,
        request: value,
    })
}

/// Decodes the request into the workflow's type and runs its check: only for a key about to be
/// claimed. A retry of a finished key is answered from the look-up without it: the same
/// fingerprint passed this check when the key was claimed.
fn decode_and_validate(workflow: &Workflow, request: &Value) -> Result<Carry, Rejection> {
    let input = workflow
        .decode_request(request)
        .map_err(|error| Rejection::InvalidInput(error.to_string()))?;
    workflow.validate(&input).map_err(Rejection::InvalidInput)?;
    Ok(input)
}
