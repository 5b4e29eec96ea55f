//! The claim cycle: look the key up, then claim it, answer from its row, or take it over.
//!
//! One round trip answers a retry, a 409 or a 422 (the look-up, outside any transaction). A new
//! key costs one more before the first phase runs: `BEGIN` and the claim travel in one message
//! ([`crate::Engine::begin_claim`]; on PostgreSQL one message), on the connection the look-up used. Between the look-up and the
//! claim (or takeover) the key may change hands; the cycle then looks again, a few times, and
//! otherwise tells the client to come back shortly. Every way into a drive starts here or at
//! [`Runner::resume`].

use std::time::{Duration, Instant};

use idemflow_core::{Decision, KeyState, StoredKey, StoredResponse, TenantId, decide};
use idemflow_store::{Claim as ClaimRequest, FoundKey, LookUp};

use crate::admission::{Accepted, decode_and_validate};
use crate::crash::CrashPoint;
use crate::deadline::Within;
use crate::drive::{Hold, Start};
use crate::engine::{Claimed, ConnectionPool, Engine, EngineError, KeyOwner, PooledOf};
use crate::erased::Carry;
use crate::error::RunError;
use crate::metrics;
use crate::outcome::Outcome;
use crate::runner::Runner;
use crate::sealing::{Sealer, Slot};
use crate::workflow::Workflow;

/// How many times a request looks its key up again when the key changes hands between statements.
const CLAIM_ROUNDS: usize = 3;

/// Retry-After for a key being claimed (or changing hands) right now: its lease is not visible
/// yet, and the claim's first transaction is usually over in milliseconds.
const CLAIMING_RETRY_AFTER: Duration = Duration::from_secs(1);

type Connection<E> = PooledOf<E>;

/// What a claim of an absent key came to.
enum Claim<E: Engine> {
    /// Owned, in an open transaction: drive it.
    Owned(Box<Start<E>>),
    /// A claim committed between the look-up and ours: look again, with what was decoded.
    Lost {
        connection: Connection<E>,
        accepted: Accepted,
        input: Carry,
    },
    /// The layout refused the claim at the leading phases' level, writing nothing: look again,
    /// and claim at Read Committed (`crate::claim_level`).
    LevelRefused { accepted: Accepted, input: Carry },
}

/// The claim cycle's state between rounds: the request, its input once decoded (only for a key
/// about to be claimed, and only once), and the idle connection kept for the next look-up.
struct Cycle<E: Engine> {
    accepted: Accepted,
    decoded: Option<Carry>,
    kept: Option<Connection<E>>,
}

/// What one round of the cycle came to.
enum Step<E: Engine> {
    /// The request's answer.
    Done(Outcome),
    /// The key changed hands between statements: look again.
    Again(Cycle<E>),
}

impl<E: Engine> Runner<E> {
    /// Looks the key up, then claims it, answers from its row, or takes it over.
    pub(crate) async fn claim_or_decide(
        &self,
        workflow: &Workflow<E>,
        tenant: &TenantId,
        accepted: Accepted,
    ) -> Result<Outcome, RunError> {
        let mut cycle = Cycle {
            accepted,
            decoded: None,
            kept: None,
        };
        for _ in 0..CLAIM_ROUNDS {
            let kept: Option<Connection<E>> = cycle.kept.take();
            let (connection, looked) = match kept {
                Some(mut connection) => {
                    let looked = E::look_up(&mut connection, tenant, &cycle.accepted.key)
                        .within(self.config.database_timeout)
                        .await??;
                    (connection, looked)
                }
                None => self.look_up_fresh(tenant, &cycle.accepted).await?,
            };
            let step = match looked {
                LookUp::Found(row) => {
                    self.decide_found(workflow, tenant, cycle, connection, row)
                        .await?
                }
                LookUp::Claiming => {
                    // Another request holds this key's uncommitted claim: it is in flight.
                    metrics::count(metrics::CONFLICTS, workflow.name());
                    tracing::debug!("in progress: being claimed");
                    // The look-up ran outside any transaction: the connection is idle.
                    self.warm.keep(connection);
                    return Ok(being_claimed());
                }
                LookUp::Absent(ticket) => {
                    self.claim_absent(workflow, tenant, cycle, connection, ticket)
                        .await?
                }
            };
            match step {
                Step::Done(outcome) => return Ok(outcome),
                Step::Again(next) => cycle = next,
            }
        }
        // The key kept changing hands under us: tell the client to come back shortly.
        Ok(being_claimed())
    }

    /// A key the look-up found absent: its input decoded and validated (once), then claimed and
    /// driven; or, when another claim committed first, looked up again.
    async fn claim_absent(
        &self,
        workflow: &Workflow<E>,
        tenant: &TenantId,
        cycle: Cycle<E>,
        connection: Connection<E>,
        ticket: E::Ticket,
    ) -> Result<Step<E>, RunError> {
        let Cycle {
            accepted, decoded, ..
        } = cycle;
        let input = match decoded {
            Some(input) => input,
            None => match decode_and_validate(workflow, &accepted.request) {
                Ok(input) => input,
                Err(rejection) => {
                    metrics::count(metrics::REJECTIONS, workflow.name());
                    return Ok(Step::Done(Outcome::Rejected(rejection)));
                }
            },
        };
        // Boxed, as the drive: only a new key pays for the claim's state.
        let claim = Box::pin(claim(
            self, connection, workflow, tenant, accepted, ticket, input,
        ))
        // The claim may wait behind a concurrent claim of this key, for as long as that one's
        // local phases may run (the server ends it there).
        .within(self.config.database_timeout + longest_local(workflow));
        Ok(match claim.await?? {
            Claim::Owned(start) => Step::Done(self.drive(workflow, *start).await?),
            Claim::Lost {
                connection,
                accepted,
                input,
            } => Step::Again(Cycle {
                accepted,
                decoded: Some(input),
                kept: Some(connection),
            }),
            // Its connection went with the refused statement.
            Claim::LevelRefused { accepted, input } => Step::Again(Cycle {
                accepted,
                decoded: Some(input),
                kept: None,
            }),
        })
    }

    /// A key the look-up found: answered from its row (its body apart read for the row's life),
    /// or taken over when its lease ended; looked up again when it changed hands meanwhile.
    async fn decide_found(
        &self,
        workflow: &Workflow<E>,
        tenant: &TenantId,
        mut cycle: Cycle<E>,
        mut connection: Connection<E>,
        mut row: FoundKey,
    ) -> Result<Step<E>, RunError> {
        let accepted = &cycle.accepted;
        let decision = decide(&stored_key(&row), &accepted.fingerprint, workflow.name());
        if let (Decision::Replay, Some(life)) = (&decision, row.body_apart) {
            // The body stored apart, for the life of the key the row is: a second statement,
            // and retention may have deleted the key in between (a new request may even have
            // claimed and finished it anew). Then it is not there, and the key is looked up
            // again.
            self.crash_points
                .check(|| CrashPoint::BeforeReplayBody, tenant, &accepted.key)
                .await?;
            let body = E::response_apart(&mut connection, tenant, &accepted.key, life)
                .within(self.config.database_timeout)
                .await??;
            let Some(body) = body else {
                cycle.kept = Some(connection);
                return Ok(Step::Again(cycle));
            };
            if let Some(response) = row.response.as_mut() {
                response.body = body;
            }
        }
        if decision != Decision::TakeOver {
            // The look-up ran outside any transaction: the connection is idle.
            self.warm.keep(connection);
            let sealer = self.sealer(tenant, &accepted.key);
            let answered = answer(workflow, decision, row.response, row.lock_version, &sealer)?;
            return Ok(Step::Done(answered));
        }
        let wait = self.config.database_timeout;
        let taken = Box::pin(take_over(
            connection,
            workflow,
            tenant,
            accepted,
            row.lock_version,
            wait,
        ))
        .await?;
        Ok(match taken {
            Some(start) => Step::Done(self.drive(workflow, start).await?),
            // Someone else took it over, finished it, or is taking it over right now.
            None => Step::Again(cycle),
        })
    }
}

impl<E: Engine> Runner<E> {
    /// The look-up, on a connection from the pool. A pooled connection the database dropped
    /// while it sat idle (a restart, a pooler recycling it, a killed backend) fails its first
    /// statement, and the pool only learns of it then: such a connection is discarded and the
    /// look-up sent on another, as many times as the pool has connections and once more, so the
    /// request is served by the first live one. Only this first statement is sent again: the
    /// look-up changes nothing (it draws a fencing token at most, and tokens are never reused).
    /// A failure of any later statement keeps its answer.
    async fn look_up_fresh(
        &self,
        tenant: &TenantId,
        accepted: &Accepted,
    ) -> Result<(Connection<E>, LookUp<E::Ticket>), RunError> {
        let wait = self.config.database_timeout;
        let mut tries = self.pool.size() as usize + 1;
        loop {
            // Boxed: sqlx's acquire future is kilobytes (it may open a connection), and inline it
            // would be copied with every request's future.
            let mut connection = Box::pin(self.warm.acquire()).within(wait).await??;
            let looked = E::look_up(&mut connection, tenant, &accepted.key)
                .within(wait)
                .await
                .inspect_err(|_| E::Pool::close_on_drop(&mut connection))?;
            match looked {
                Ok(looked) => return Ok((connection, looked)),
                Err(EngineError::Database(error)) if tries > 0 && error.is_connection_lost() => {
                    tries -= 1;
                    tracing::info!(%error, "a pooled connection was lost; looking up on another");
                    // Closed rather than handed back: the pool would ping it, fail, and close it
                    // anyway.
                    E::Pool::close_on_drop(&mut connection);
                }
                Err(error) => return Err(error.into()),
            }
        }
    }
}

/// Claims an absent key: `BEGIN` and the claim in one message, on the look-up's connection, at
/// the leading local phases' level where the layout allows (`crate::claim_level`). The request
/// is stored redacted by the workflow and sealed by the keyring.
async fn claim<E: Engine>(
    runner: &Runner<E>,
    mut connection: Connection<E>,
    workflow: &Workflow<E>,
    tenant: &TenantId,
    accepted: Accepted,
    ticket: E::Ticket,
    input: Carry,
) -> Result<Claim<E>, RunError> {
    let keyring = runner.config.keyring.as_ref();
    let redacted = workflow
        .redacted_request(&accepted.request)
        .transpose()
        .map_err(|error| RunError::Corrupt(format!("the request does not redact: {error}")))?;
    let sealer = Sealer {
        keyring,
        tenant,
        key: &accepted.key,
    };
    let stored = sealer.seal_value(
        Slot::Request,
        redacted.as_ref().unwrap_or(&accepted.request),
    )?;
    let claim = ClaimRequest {
        tenant,
        key: &accepted.key,
        fingerprint: &accepted.fingerprint,
        workflow: workflow.name(),
        request: &stored,
        lease: workflow.lease(),
    };
    if runner.claim_level.unknown_for(workflow.limits()) {
        let only = E::claims_at_read_committed_only(&mut connection)
            .within(runner.config.database_timeout)
            .await??;
        runner.claim_level.learnt(only);
    }
    let claimed_at = Instant::now();
    let limits = runner.claim_level.claim_limits(workflow.limits());
    let claimed = match E::begin_claim(connection, claim, ticket, &limits).await {
        Err(EngineError::Database(error)) if error.is_claim_level_refused() => {
            runner.claim_level.refused();
            return Ok(Claim::LevelRefused { accepted, input });
        }
        claimed => claimed?,
    };
    match claimed {
        Claimed::Owned(tx, owner) => {
            tracing::Span::current().record("lock_version", owner.lock_version());
            metrics::count(metrics::CLAIMS, workflow.name());
            let Accepted {
                fingerprint,
                request,
                ..
            } = accepted;
            // The phases of this attempt get `input`, as sent; the rest of the drive (a failure
            // path, a claim made again) the request as stored, before sealing.
            let request = redacted.unwrap_or(request);
            let level = limits.isolation;
            let start = Start::claimed(owner, tx, level, fingerprint, input, request, claimed_at);
            Ok(Claim::Owned(Box::new(start)))
        }
        Claimed::Lost(connection) => Ok(Claim::Lost {
            connection,
            accepted,
            input,
        }),
    }
}

/// Takes over a started key whose lease expired, in a transaction that commits with the
/// request's first one. `None` when the key changed since the look-up saw token `seen`.
async fn take_over<E: Engine>(
    connection: Connection<E>,
    workflow: &Workflow<E>,
    tenant: &TenantId,
    accepted: &Accepted,
    seen: i64,
    wait: Duration,
) -> Result<Option<Start<E>>, RunError> {
    let mut tx = E::begin(connection, workflow.limits())
        .within(wait)
        .await??;
    let taken = E::take_over(&mut tx, tenant, &accepted.key, seen, workflow.lease())
        .within(wait)
        .await??;
    let Some(taken) = taken else {
        E::rollback(tx).within(wait).await??;
        return Ok(None);
    };
    tracing::Span::current().record("lock_version", taken.owner.lock_version());
    tracing::info!(recovery_point = %taken.recovery_point, "took over an expired lease");
    metrics::count(metrics::TAKEOVERS, workflow.name());
    // The stored request (the same fingerprint as this call's) is decoded as a resumer would.
    Ok(Some(Start::taken_over(
        taken,
        Some(tx),
        workflow.limits().isolation,
        Hold::TakeOver { seen },
    )))
}

/// The longest time limit of the workflow's local phases (what the server allows a statement of
/// its transactions).
fn longest_local<E: Engine>(workflow: &Workflow<E>) -> Duration {
    workflow.limits().statement_timeout.unwrap_or_default()
}

/// The key as the decision reads it.
fn stored_key(row: &FoundKey) -> StoredKey<'_> {
    let state = if row.done {
        KeyState::Done
    } else {
        KeyState::Started {
            lease_left: row.lease_left,
        }
    };
    StoredKey {
        fingerprint: &row.fingerprint,
        workflow: &row.workflow,
        state,
    }
}

fn being_claimed() -> Outcome {
    Outcome::InProgress {
        retry_after: CLAIMING_RETRY_AFTER,
    }
}

/// The answer to a request whose key is someone else's: a replay (its response opened), a 409
/// or a 422.
fn answer<E: Engine>(
    workflow: &Workflow<E>,
    decision: Decision,
    response: Option<StoredResponse>,
    lock_version: i64,
    sealer: &Sealer<'_>,
) -> Result<Outcome, RunError> {
    match decision {
        Decision::Replay => {
            let response = response
                .ok_or_else(|| RunError::Corrupt("a done key without a response".into()))?;
            // The done row's token is the token of the owner that stored the response.
            let response = sealer.open_response(response, lock_version)?;
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
