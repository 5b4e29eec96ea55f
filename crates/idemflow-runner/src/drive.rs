//! Driving an owned key through its phases, committing at the right points, and recording every
//! failure of the attempt as the attempt it was.
//!
//! A drive ends in one of three ways: the key finishes (its response stored); the drive stops
//! because it is not the owner any more (fenced) or a crash hook stopped it (tests); or the
//! attempt fails. A failure is anything that goes wrong while this owner holds the key: a phase's
//! error, panic or overrun, and equally a stored output that no longer decodes, an output the
//! store cannot hold, or a database error in the engine's own statements (a commit refused by a
//! deferred constraint). Each is recorded ([`Runner::fail`]) so the key's attempts count and its
//! retry policy decides what comes next.

use std::future::Future;
use std::time::{Duration, Instant};

use idemflow_core::{DerivedKey, Fingerprint, RecoveryPoint, StoredResponse};
use idemflow_pg::{self as store, ClaimRequest, Claimed, Owner, StoreError};
use serde_json::Value;
use sqlx::PgPool;
use tracing::Instrument;

use crate::config::TerminalPolicy;
use crate::crash::CrashPoint;
use crate::error::RunError;
use crate::metrics;
use crate::outcome::Outcome;
use crate::panic::{catch_panic, catch_panic_now};
use crate::phase::{PhaseContext, PhaseError, PhaseErrorKind};
use crate::retry::RetryPolicy;
use crate::runner::Runner;
use crate::storable::holds_nul;
use crate::workflow::{Carry, ErasedForeign, ErasedLocal, GiveUp, Step, Workflow};

pub(crate) type Tx = idemflow_pg::Transaction;

/// Whether this owner's hold on the key is durable yet. A claim or a takeover made by a request
/// commits with the request's first transaction (no commit of its own); until then, rolling that
/// transaction back undoes the hold too, and a failure record must take the key again first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Hold {
    /// Committed: the row holds this owner's token.
    Committed,
    /// The key's claim, with this fingerprint, is uncommitted: rolled back, the key is absent.
    Claim(Fingerprint),
    /// This request's takeover is uncommitted: rolled back, the row holds `seen` again.
    TakeOver { seen: i64 },
}

/// Where the first phase to run comes from.
pub(crate) enum Entry {
    /// Phase `position`, with its input already decoded (a new claim, or a takeover at `start`
    /// by the request that brought that same input).
    Decoded { position: usize, input: Carry },
    /// The row's recovery point and stored output, decoded here: a value that no longer decodes
    /// (a deploy changed its type) or a point the workflow does not have is a failed attempt.
    Stored {
        recovery_point: String,
        output: Option<Value>,
    },
}

/// Where a drive starts.
pub(crate) struct Start {
    pub owner: Owner,
    /// The claim's or takeover's open transaction; `None` for a key a resumer took over, which
    /// begins one only when a local phase or a record needs it (so it may call out at once).
    pub tx: Option<Tx>,
    pub hold: Hold,
    pub entry: Entry,
    /// The recovery point the row holds.
    pub recorded_point: String,
    pub context: PhaseContext,
    /// The request as stored, for the failure path.
    pub request: Value,
    /// The error the previous attempt recorded, for a give-up's message.
    pub last_error: Option<String>,
    /// When the statement that wrote this owner's lease was sent (this process's monotonic
    /// clock). Before a call to another system the owner must hold a lease that outlasts the
    /// call's timeout; after a wait (a key a resumer took over and could not start at once, a
    /// paused process) it confirms its fence first, with a fenced renewal.
    pub lease_from: Instant,
}

/// Why a drive stopped before finishing.
enum Stop {
    /// The attempt failed: record it.
    Failed(Box<Failure>),
    /// Not for this owner to record: it lost the key (fenced) or was stopped (crash point).
    Error(RunError),
}

impl Stop {
    fn failed(failure: Failure) -> Self {
        Self::Failed(Box::new(failure))
    }
}

impl From<RunError> for Stop {
    fn from(error: RunError) -> Self {
        Self::Error(error)
    }
}

/// A failed attempt.
struct Failure {
    /// The phase the attempt is charged to: the one that failed, or whose work could not be
    /// recorded.
    phase: &'static str,
    retry_policy: RetryPolicy,
    error: PhaseError,
    /// The failure was a panic: the caller hears of it as an error once it is recorded.
    panicked: bool,
    /// The attempt ran nothing: earlier attempts spent the budget without recording an outcome.
    spent: bool,
}

impl Failure {
    fn of(phase: &'static str, retry_policy: RetryPolicy, error: PhaseError) -> Self {
        Self {
            phase,
            retry_policy,
            error,
            panicked: false,
            spent: false,
        }
    }
}

/// A drive in progress: the owner, its open transaction, and what is not yet recorded.
struct Drive<'r> {
    runner: &'r Runner,
    workflow: &'r Workflow,
    owner: Owner,
    tx: Option<Tx>,
    hold: Hold,
    recorded_point: String,
    /// The output stored with `recorded_point` (none at the start): what a failure path is told
    /// it may have to undo.
    recorded_output: Option<Value>,
    context: PhaseContext,
    request: Value,
    /// The last completed phase whose output `carry` holds and the row does not yet.
    unrecorded: Option<usize>,
    /// A foreign output not yet committed, kept encoded so a failure after it can still record
    /// it (and the call is not repeated).
    pending_foreign: Option<(&'static str, Value)>,
    lease_from: Instant,
}

impl Runner {
    /// Runs the phases from the entry point to the end, and records the attempt's failure if it
    /// fails.
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
            tx,
            hold,
            entry,
            recorded_point,
            context,
            request,
            last_error,
            lease_from,
        } = start;
        let mut drive = Drive {
            runner: self,
            workflow,
            owner,
            tx,
            hold,
            recorded_point,
            recorded_output: None,
            context,
            request,
            unrecorded: None,
            pending_foreign: None,
            lease_from,
        };
        let ran = match drive.enter(entry, last_error) {
            Ok((position, carry)) => drive.run(position, carry).await,
            Err(stop) => Err(stop),
        };
        match ran {
            Ok(outcome) => Ok(outcome),
            Err(Stop::Error(error)) => {
                // The open transaction rolls back as it is dropped: nothing of it lands.
                if matches!(error, RunError::Fenced) {
                    metrics::count(metrics::FENCED, workflow.name());
                    tracing::warn!(
                        "fenced: the lease was lost to another owner; nothing committed"
                    );
                }
                Err(error)
            }
            Err(Stop::Failed(failure)) => drive.fail(*failure).await,
        }
    }
}

impl Drive<'_> {
    /// The first phase to run and its input. A takeover past its attempt budget runs nothing:
    /// the attempts before it ended without recording an outcome (crashes, kills), and one more
    /// would only repeat that.
    fn enter(&mut self, entry: Entry, last_error: Option<String>) -> Result<(usize, Carry), Stop> {
        let workflow = self.workflow;
        let (position, carry) = match entry {
            Entry::Decoded { position, input } => (position, input),
            Entry::Stored {
                recovery_point,
                output,
            } => {
                let Some(position) = workflow.position_after(&recovery_point) else {
                    return Err(Stop::failed(Failure::of(
                        "resume",
                        RetryPolicy::default(),
                        PhaseError::retryable(format!(
                            "the key is left at recovery point {recovery_point:?}, which \
                             workflow {:?} does not have",
                            workflow.name()
                        )),
                    )));
                };
                // Kept (not copied) for a failure path: what it may have to undo.
                self.recorded_output = output;
                let (request, output) = (&self.request, &self.recorded_output);
                let decoded = catch_panic_now(|| {
                    if position == 0 {
                        workflow.decode_request(request)
                    } else {
                        workflow.steps[position - 1]
                            .decode_output(output.as_ref().unwrap_or(&Value::Null))
                    }
                });
                let why = match decoded {
                    Ok(Ok(carry)) => return self.within_budget(position, carry, last_error),
                    Ok(Err(error)) => error.to_string(),
                    Err(panic) => format!("decoding it panicked: {panic}"),
                };
                return Err(Stop::failed(Failure::of(
                    workflow.step_name(position),
                    workflow.retry_policy_at(position),
                    PhaseError::retryable(format!(
                        "the stored input of this phase does not decode: {why}"
                    )),
                )));
            }
        };
        self.within_budget(position, carry, last_error)
    }

    /// `Ok` unless this attempt is past the attempt budget of the phase it would run first.
    fn within_budget(
        &self,
        position: usize,
        carry: Carry,
        last_error: Option<String>,
    ) -> Result<(usize, Carry), Stop> {
        let workflow = self.workflow;
        let policy = workflow.retry_policy_at(position);
        if self.context.attempt > policy.max_attempts.max(1) {
            let earlier = last_error.unwrap_or_else(|| {
                "the earlier attempts recorded no outcome (crashed, killed or stopped)".to_owned()
            });
            return Err(Stop::failed(Failure {
                spent: true,
                ..Failure::of(
                    workflow.step_name(position),
                    policy,
                    PhaseError::retryable(earlier),
                )
            }));
        }
        Ok((position, carry))
    }

    async fn run(&mut self, mut position: usize, mut carry: Carry) -> Result<Outcome, Stop> {
        let steps = &self.workflow.steps;
        loop {
            while let Some(Step::Local(local)) = steps.get(position) {
                carry = self.run_local(local.as_ref(), carry).await?;
                self.unrecorded = Some(position);
                position += 1;
            }
            let Some(Step::Foreign(foreign)) = steps.get(position) else {
                return self.finish(position, carry).await;
            };
            let unrecorded = self.unrecorded_output(&carry)?;
            self.record_before_call(position, unrecorded).await?;
            self.confirm_fence(foreign.as_ref()).await?;
            carry = self.call(foreign.as_ref(), position, carry).await?;
            self.unrecorded = Some(position);
            position += 1;
        }
    }

    /// Runs a local phase in the open transaction (begun now if there is none), within its time
    /// limit, a panic caught as a failure.
    async fn run_local(&mut self, local: &dyn ErasedLocal, carry: Carry) -> Result<Carry, Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let failure = |error| Failure::of(local.name(), local.retry_policy(), error);
        let open = opened(&mut self.tx, runner.pool(), workflow)
            .await
            .map_err(|error| Stop::failed(failure(database_error("beginning", &error))))?;
        let span = tracing::debug_span!("idemflow.phase", phase = local.name(), kind = "local");
        let limit = workflow.local_timeout(local);
        let started = Instant::now();
        // An uncommitted claim or takeover cannot be taken over by anyone (a claim is invisible,
        // a takeover holds the row's lock and the claim's lock): no heartbeat. A heartbeat
        // would only wait for this very transaction's row lock.
        let heartbeat = self.hold == Hold::Committed;
        let work = tokio::time::timeout(
            limit + overrun_grace(limit),
            catch_panic(local.run(open, carry, &self.context)),
        );
        let ran = runner
            .with_heartbeat(heartbeat, &self.owner, workflow.lease(), work)
            .instrument(span)
            .await;
        metrics::phase_duration(workflow.name(), local.name(), "local", started.elapsed());
        match ran {
            Ok(Ok(Ok(Ok(output)))) => Ok(output),
            Ok(Ok(Ok(Err(error)))) => Err(Stop::failed(failure(error))),
            Ok(Ok(Err(panic))) => Err(Stop::failed(Failure {
                panicked: true,
                ..failure(PhaseError::retryable(format!("panicked: {panic}")))
            })),
            Ok(Err(_elapsed)) => {
                // A statement may still be running on the connection: nobody can vouch for its
                // state, so it is closed rather than handed back, and the server rolls back.
                if let Some(tx) = self.tx.take() {
                    tx.abandon();
                }
                Err(Stop::failed(failure(PhaseError::retryable(format!(
                    "timed out after {limit:?}"
                )))))
            }
            Err(lost) => Err(Stop::Error(lost)),
        }
    }

    /// The last completed phase not yet recorded, with its output encoded for the store.
    fn unrecorded_output(&mut self, carry: &Carry) -> Result<Option<(usize, Value)>, Stop> {
        let Some(index) = self.unrecorded.take() else {
            return Ok(None);
        };
        let step = &self.workflow.steps[index];
        let output = match &self.pending_foreign {
            Some((pending, output)) if *pending == step.raw_name() => output.clone(),
            _ => storable_output(step, carry).map_err(|error| {
                Stop::failed(Failure::of(step.raw_name(), step.retry_policy(), error))
            })?,
        };
        Ok(Some((index, output)))
    }

    /// Makes everything so far durable before calling out: the last completed phase becomes the
    /// recovery point and the transaction commits. A key resumed right before a foreign phase
    /// has nothing to record and no transaction.
    async fn record_before_call(
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
            let failure = |error| Failure::of(name, step.retry_policy(), error);
            let open = opened(&mut self.tx, runner.pool(), workflow)
                .await
                .map_err(|error| Stop::failed(failure(database_error("beginning", &error))))?;
            advanced_at = Some(Instant::now());
            store::advance(open, &self.owner, name, &output, workflow.lease())
                .await
                .map_err(|error| store_stop(error, "recording", failure))?;
            committed = name;
            committed_output = Some(output);
        }
        if let Some(open) = self.tx.take() {
            let key = self.owner.key().clone();
            runner
                .crash_points
                .check(|| CrashPoint::BeforeCommit { phase: committed }, &key)
                .await?;
            if let Err(error) = open.commit().await {
                return Err(Stop::failed(Failure::of(
                    charged.raw_name(),
                    charged.retry_policy(),
                    database_error("committing", &error),
                )));
            }
            self.hold = Hold::Committed;
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
                .check(|| CrashPoint::AfterCommit { phase: committed }, &key)
                .await?;
        }
        Ok(())
    }

    /// Before a call, the owner must hold a lease that outlasts the call's timeout (with a tenth of
    /// the lease to spare). It does right after its own commit or takeover; after a wait (a key a
    /// resumer took over and could not start at once, a process paused) it renews the lease,
    /// fenced: if another owner took the key over meanwhile, it stops here instead of calling as
    /// a stale one.
    async fn confirm_fence(&mut self, foreign: &dyn ErasedForeign) -> Result<(), Stop> {
        let lease = self.workflow.lease();
        if self.lease_from.elapsed() + foreign.timeout() + lease / 10 <= lease {
            return Ok(());
        }
        let failure = |error| Failure::of(foreign.name(), foreign.retry_policy(), error);
        let mut connection = self.runner.pool().acquire().await.map_err(|error| {
            Stop::failed(failure(database_error("confirming the fence", &error)))
        })?;
        let renewing = Instant::now();
        store::renew_lease(&mut connection, &self.owner, lease)
            .await
            .map_err(|error| store_stop(error, "confirming the fence", failure))?;
        self.lease_from = renewing;
        Ok(())
    }

    /// Calls a foreign phase with its derived key, within its timeout, heartbeating the lease.
    async fn call(
        &mut self,
        foreign: &dyn ErasedForeign,
        position: usize,
        carry: Carry,
    ) -> Result<Carry, Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let step = &workflow.steps[position];
        let failure = |error| Failure::of(foreign.name(), foreign.retry_policy(), error);
        let key = self.owner.key().clone();
        runner
            .crash_points
            .check(
                || CrashPoint::BeforeCall {
                    phase: foreign.name(),
                },
                &key,
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
                return Err(Stop::failed(Failure {
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
                &key,
            )
            .await?;
        // Encoded now, so a failure in the phases after it can still record the result (and
        // an output the store cannot hold fails this attempt before anything depends on it).
        let encoded =
            storable_output(step, &output).map_err(|error| Stop::failed(failure(error)))?;
        self.pending_foreign = Some((foreign.name(), encoded));
        Ok(output)
    }

    /// Stores the response with the last local effects and commits.
    async fn finish(&mut self, position: usize, carry: Carry) -> Result<Outcome, Stop> {
        let workflow = self.workflow;
        let runner = self.runner;
        let last = &workflow.steps[position - 1];
        let failure = |error| Failure::of(last.raw_name(), last.retry_policy(), error);
        let response = downcast_response(carry)?;
        let open = opened(&mut self.tx, runner.pool(), workflow)
            .await
            .map_err(|error| Stop::failed(failure(database_error("beginning", &error))))?;
        store::finish(open, &self.owner, last.raw_name(), &response)
            .await
            .map_err(|error| store_stop(error, "storing the response", failure))?;
        let key = self.owner.key().clone();
        runner
            .crash_points
            .check(|| CrashPoint::BeforeFinish, &key)
            .await?;
        let Some(open) = self.tx.take() else {
            unreachable!("opened above")
        };
        if let Err(error) = open.commit().await {
            // A deferred constraint, say: the effects, the response and an uncommitted hold
            // roll back together, and the attempt fails.
            return Err(Stop::failed(failure(database_error("committing", &error))));
        }
        self.hold = Hold::Committed;
        runner
            .crash_points
            .check(|| CrashPoint::AfterFinish, &key)
            .await?;
        metrics::count(metrics::FINISHED, workflow.name());
        tracing::info!(status = response.status, "finished");
        Ok(Outcome::Executed(response))
    }

    /// Records a failed attempt in a transaction of its own (the failed one has rolled back).
    ///
    /// A retryable error leaves the key started, its lease set to the next attempt time, unless
    /// the attempts at this recovery point ran out: then the failure path runs and its response
    /// is stored. A terminal error stores its response (or, by policy, deletes the key). If this
    /// owner's hold was not yet committed, the key is claimed or taken over again first, in the
    /// same transaction, so the record lands on a key this owner holds.
    async fn fail(mut self, failure: Failure) -> Result<Outcome, RunError> {
        let workflow = self.workflow;
        let Failure {
            phase,
            retry_policy,
            mut error,
            panicked,
            spent,
        } = failure;
        tracing::warn!(phase, attempt = self.context.attempt, retryable = error.is_retryable(), error = %error.message, "attempt failed");
        if let Some(tx) = self.tx.take()
            && let Err(rollback) = tx.rollback().await
        {
            // The connection is not reused; the server rolls back as it closes.
            tracing::warn!(%rollback, "rolling back the failed attempt failed");
        }

        if let PhaseErrorKind::NotExecuted { response } = &error.kind {
            // Nothing of the key's request has run if no phase completed: the key goes, and
            // the same key may come again as a new request. Otherwise its effects must not run
            // twice: an ordinary retryable failure.
            if self.recorded_point == RecoveryPoint::START && self.pending_foreign.is_none() {
                let response = response.clone();
                if !self.delete_held().await? {
                    return Ok(in_progress());
                }
                metrics::count_phase(metrics::NOT_EXECUTED, workflow.name(), phase);
                return Ok(Outcome::Forgotten(response));
            }
            error.kind = PhaseErrorKind::Retryable { retry_after: None };
        }

        let terminal_response = match &error.kind {
            PhaseErrorKind::Terminal { response } => Some(
                response
                    .clone()
                    .unwrap_or_else(|| problem(500, "request_failed", &error.message)),
            ),
            PhaseErrorKind::Retryable { .. } | PhaseErrorKind::NotExecuted { .. } => None,
        };
        // A give-up for a spent budget carries the last recorded error, already named.
        let message = if spent {
            error.message.clone()
        } else {
            format!("{phase}: {}", error.message)
        };

        if let (Some(response), TerminalPolicy::Forget) =
            (&terminal_response, self.runner.config.terminal_errors)
        {
            if !self.delete_held().await? {
                return Ok(in_progress());
            }
            return Ok(Outcome::Forgotten(response.clone()));
        }

        let Some((mut tx, owner, mut attempt)) = self.take_again().await? else {
            return Ok(in_progress());
        };
        let mut recovery_point = self.recorded_point.clone();
        let mut recovery_output = None;
        if let Some((name, output)) = self.pending_foreign.take() {
            let advanced = store::advance(&mut tx, &owner, name, &output, workflow.lease()).await;
            tx = fenced(advanced, tx).await?;
            recovery_point = name.to_owned();
            recovery_output = Some(output);
            // The phase that failed is the first execution after that foreign result.
            attempt = 1;
        }

        let exhausted = spent || retry_policy.exhausted(attempt);
        let (response, outcome) = match (terminal_response, &error.kind) {
            (Some(response), _) => (response.clone(), Outcome::Executed(response)),
            (None, PhaseErrorKind::Retryable { retry_after }) if !exhausted => {
                let retry_after = retry_after.unwrap_or_else(|| retry_policy.backoff(attempt));
                let postponed = store::postpone(&mut tx, &owner, retry_after, &message).await;
                tx = fenced(postponed, tx).await?;
                store::notify_due(&mut tx).await?;
                tx.commit().await?;
                metrics::count_phase(metrics::RETRIES, workflow.name(), phase);
                if panicked {
                    return Err(RunError::Panicked {
                        phase: phase.to_owned(),
                        message: error.message,
                    });
                }
                return Ok(Outcome::Interrupted {
                    retry_after,
                    error: message,
                });
            }
            (None, _) => {
                metrics::count_phase(metrics::GIVE_UPS, workflow.name(), phase);
                let attempts = if spent { attempt - 1 } else { attempt };
                tracing::error!(phase, attempts, error = %message, "retries exhausted: giving up");
                let give_up = GiveUp {
                    request: self.request.clone(),
                    phase,
                    recovery_point: recovery_point.clone(),
                    // What to undo: the output recorded now, or by an earlier attempt.
                    recovery_output: recovery_output
                        .clone()
                        .or_else(|| self.recorded_output.clone()),
                    error: message.clone(),
                    attempts,
                };
                let response = self.failure_path(&mut tx, give_up).await?;
                let finished = store::finish(&mut tx, &owner, &recovery_point, &response).await;
                match fenced(finished, tx).await?.commit().await {
                    Ok(()) => {}
                    Err(error) => {
                        // The failure path's effects broke the commit (a deferred constraint):
                        // store a plain problem without them, so the key still ends.
                        tracing::error!(%error, "the give-up did not commit; storing a generic response");
                        let response = problem(
                            500,
                            "retries_exhausted",
                            &give_up_detail(attempts, &message),
                        );
                        self.store_give_up(&recovery_point, recovery_output, &response)
                            .await?;
                        metrics::count(metrics::FINISHED, workflow.name());
                        return Ok(Outcome::Executed(response));
                    }
                }
                metrics::count(metrics::FINISHED, workflow.name());
                return Ok(Outcome::Executed(response));
            }
        };
        let finished = store::finish(&mut tx, &owner, &recovery_point, &response).await;
        fenced(finished, tx).await?.commit().await?;
        metrics::count(metrics::FINISHED, workflow.name());
        Ok(outcome)
    }

    /// Deletes the key this owner holds, fenced, after its attempt rolled back. An
    /// uncommitted claim rolled back with the attempt: there is nothing to delete. False when
    /// another owner holds the key by now: it is theirs to finish.
    async fn delete_held(&self) -> Result<bool, RunError> {
        if matches!(self.hold, Hold::Claim(_)) {
            return Ok(true);
        }
        let Some((mut tx, owner, _)) = self.take_again().await? else {
            return Ok(false);
        };
        let deleted = store::delete_owned(&mut tx, &owner).await;
        fenced(deleted, tx).await?.commit().await?;
        Ok(true)
    }

    /// Stores a give-up's response alone (no failure path), in a transaction of its own.
    async fn store_give_up(
        &self,
        recovery_point: &str,
        recovery_output: Option<Value>,
        response: &StoredResponse,
    ) -> Result<(), RunError> {
        let Some((mut tx, owner, _)) = self.take_again().await? else {
            return Err(RunError::Fenced);
        };
        if let Some(output) = recovery_output {
            let advanced = store::advance(
                &mut tx,
                &owner,
                recovery_point,
                &output,
                self.workflow.lease(),
            )
            .await;
            tx = fenced(advanced, tx).await?;
        }
        let finished = store::finish(&mut tx, &owner, recovery_point, response).await;
        fenced(finished, tx).await?.commit().await?;
        Ok(())
    }

    /// A transaction holding the key for this owner again after its failed attempt rolled back:
    /// the same owner when its hold was committed; otherwise the claim made again (same token,
    /// which nobody else ever saw) or the takeover made again (compare-and-set on the token it
    /// took over from). `None` when another request got the key meanwhile: it owns the outcome.
    async fn take_again(&self) -> Result<Option<(Tx, Owner, u32)>, RunError> {
        let workflow = self.workflow;
        let pool = self.runner.pool();
        match &self.hold {
            Hold::Committed => Ok(Some((
                Tx::begin_limited(pool.acquire().await?, workflow.limits()).await?,
                self.owner.clone(),
                self.context.attempt,
            ))),
            Hold::Claim(fingerprint) => {
                let claim = ClaimRequest {
                    tenant: self.owner.tenant(),
                    key: self.owner.key(),
                    lock_version: self.owner.lock_version(),
                    fingerprint,
                    workflow: workflow.name(),
                    request: &self.request,
                    lease: workflow.lease(),
                };
                let connection = pool.acquire().await?;
                match store::begin_claim(connection, &claim, workflow.limits()).await? {
                    Claimed::Owned(tx, owner) => Ok(Some((tx, owner, 1))),
                    Claimed::Lost(_) => Ok(None),
                }
            }
            Hold::TakeOver { seen } => {
                let mut tx = Tx::begin_limited(pool.acquire().await?, workflow.limits()).await?;
                let taken = store::take_over(
                    &mut tx,
                    self.owner.tenant(),
                    self.owner.key(),
                    *seen,
                    workflow.lease(),
                )
                .await?;
                match taken {
                    Some(taken) => {
                        let attempt = u32::try_from(taken.attempts).unwrap_or(u32::MAX);
                        Ok(Some((tx, taken.owner, attempt)))
                    }
                    None => {
                        tx.rollback().await?;
                        Ok(None)
                    }
                }
            }
        }
    }

    /// Runs the workflow's failure path in a savepoint of `tx`, within the local time limit; if
    /// there is none, or it fails or panics itself, the response is a 500 problem naming the
    /// last error.
    async fn failure_path(&self, tx: &mut Tx, give_up: GiveUp) -> Result<StoredResponse, RunError> {
        let detail = give_up_detail(give_up.attempts, &give_up.error);
        let Some(failure) = &self.workflow.failure else {
            return Ok(problem(500, "retries_exhausted", &detail));
        };
        let limit = self.workflow.default_local_timeout();
        let mut savepoint = sqlx::Connection::begin(&mut **tx).await?;
        let ran = tokio::time::timeout(
            limit + overrun_grace(limit),
            catch_panic(failure.run(&mut savepoint, give_up, &self.context)),
        )
        .await;
        match ran {
            Ok(Ok(Ok(response))) => {
                savepoint.commit().await?;
                Ok(response)
            }
            failed => {
                let why = match failed {
                    Ok(Ok(Err(error))) => error.message,
                    Ok(Err(panic)) => format!("panicked: {panic}"),
                    _ => format!("timed out after {limit:?}"),
                };
                // A savepoint rollback needs the connection in a known state: after an overrun
                // it is not, and the whole record fails (the key stays due and is retried).
                savepoint.rollback().await?;
                tracing::error!(error = %why, "the failure path failed; storing a generic response");
                Ok(problem(500, "retries_exhausted", &detail))
            }
        }
    }
}

impl Runner {
    /// Runs `work`, renewing the owner's lease every third of it while `work` runs. If a renewal
    /// finds the lease lost (fenced), `work` is dropped and `Fenced` returned: an owner that lost
    /// its lease stops and commits nothing.
    pub(crate) async fn with_heartbeat<T>(
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
}

/// How far past its time limit a local phase may run before the runner stops it. The database
/// cancels a statement at the limit itself (`statement_timeout`), a clean error the phase sees;
/// the runner's own stop, a little later, covers a phase stuck outside the database.
pub(crate) fn overrun_grace(limit: Duration) -> Duration {
    (limit / 10).clamp(Duration::from_millis(50), Duration::from_secs(1))
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

/// The open transaction, begun now (under the workflow's limits) if there is none yet.
async fn opened<'t>(
    tx: &'t mut Option<Tx>,
    pool: &PgPool,
    workflow: &Workflow,
) -> Result<&'t mut Tx, sqlx::Error> {
    let open = match tx.take() {
        Some(open) => open,
        None => Tx::begin_limited(pool.acquire().await?, workflow.limits()).await?,
    };
    Ok(tx.insert(open))
}

/// A phase's output encoded for its recovery point; an error if it cannot be encoded or stored.
fn storable_output(step: &Step, carry: &Carry) -> Result<Value, PhaseError> {
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

/// A database error in the engine's own statements, as the attempt's failure.
fn database_error(doing: &str, error: &sqlx::Error) -> PhaseError {
    PhaseError::retryable(format!("{doing} failed: {error}"))
}

/// A store error while the drive writes: fenced stops the drive; anything else fails the
/// attempt.
fn store_stop(error: StoreError, doing: &str, failure: impl FnOnce(PhaseError) -> Failure) -> Stop {
    match error {
        StoreError::Fenced => Stop::Error(RunError::Fenced),
        StoreError::Database(error) => Stop::failed(failure(database_error(doing, &error))),
        other => Stop::Error(other.into()),
    }
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

fn in_progress() -> Outcome {
    // Another request took the key while this one was recording its failure: it owns the
    // outcome now.
    Outcome::InProgress {
        retry_after: Duration::from_secs(1),
    }
}

fn downcast_response(carry: Carry) -> Result<StoredResponse, RunError> {
    carry
        .downcast::<StoredResponse>()
        .map(|response| *response)
        .map_err(|_| RunError::Corrupt("the last phase did not produce a response".into()))
}

fn give_up_detail(attempts: u32, error: &str) -> String {
    format!("gave up after {attempts} attempts: {error}")
}

/// An RFC 9457 problem response.
/// A problem the engine stores itself, in the one shape (`code` names it in a word).
fn problem(status: u16, code: &str, detail: &str) -> StoredResponse {
    let title = if status == 500 {
        "Internal Server Error"
    } else {
        "Error"
    };
    StoredResponse::problem_of(status, title, code, detail)
}
