//! Driving an owned key through its phases, committing at the right points, and recording every
//! failure of the attempt as the attempt it was.
//!
//! A drive ends in one of three ways: the key finishes (its response stored); the drive stops
//! because it is not the owner any more (fenced) or a crash hook stopped it (tests); or the
//! attempt fails. A failure is anything that goes wrong while this owner holds the key: a phase's
//! error, panic or overrun, and equally a stored output that no longer decodes, an output the
//! store cannot hold, or a database error in the engine's own statements (a commit refused by a
//! deferred constraint). Each is recorded (see `failure.rs`) so the key's attempts count and its
//! retry policy decides what comes next.

//! The drive is split by what each part does: this module holds where a drive starts and the
//! loop over the phases; `entry.rs` decides the first phase to run (and whether the attempt is
//! within its budget); `steps.rs` runs local and foreign phases and commits at the right points;
//! `failure.rs` records a failed attempt.

mod entry;
mod failure;
mod restart;
mod steps;

use std::time::{Duration, Instant};

use idemflow_core::{Fingerprint, StoredResponse};

use serde_json::Value;

use crate::deadline::Within;
use crate::engine::{Engine, EngineError, Isolation, KeyOwner, Standing, Taken};
use crate::erased::{Carry, Step};
use crate::error::RunError;
use crate::heartbeat::overrun_grace;
use crate::live_connection::begin_live;
use crate::metrics;
use crate::outcome::Outcome;
use crate::phase::{PhaseContext, PhaseError};
use crate::retry::RetryPolicy;
use crate::runner::Runner;
use crate::sealing::Sealer;
use crate::workflow::Workflow;

pub(crate) type Tx<E> = <E as Engine>::Transaction;

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
pub(crate) struct Start<E: Engine> {
    owner: E::Owner,
    /// The claim's or takeover's open transaction; `None` for a key a resumer took over, which
    /// begins one only when a local phase or a record needs it (so it may call out at once).
    tx: Option<Tx<E>>,
    hold: Hold,
    /// The level `tx` began at.
    hold_level: Isolation,
    entry: Entry,
    /// The recovery point the row holds.
    recorded_point: String,
    context: PhaseContext,
    /// The request as stored, for the failure path.
    request: Value,
    /// The error the previous attempt recorded, for a give-up's message.
    last_error: Option<String>,
    /// When the statement that wrote this owner's lease was sent (this process's monotonic
    /// clock). Before a call to another system the owner must hold a lease that outlasts the
    /// call's timeout; after a wait (a key a resumer took over and could not start at once, a
    /// paused process) it confirms its fence first, with a fenced renewal.
    lease_from: Instant,
}

impl<E: Engine> Start<E> {
    /// A new key, claimed by this request in `tx`, begun at `level` (uncommitted until the first
    /// commit).
    pub(crate) fn claimed(
        owner: E::Owner,
        tx: Tx<E>,
        level: Isolation,
        fingerprint: Fingerprint,
        input: Carry,
        request: Value,
        claimed_at: Instant,
    ) -> Self {
        Self {
            context: context_of(&owner, 1),
            owner,
            tx: Some(tx),
            hold: Hold::Claim(fingerprint),
            hold_level: level,
            entry: Entry::Decoded { position: 0, input },
            recorded_point: idemflow_core::RecoveryPoint::START.to_owned(),
            request,
            last_error: None,
            lease_from: claimed_at,
        }
    }

    /// A key taken over from an expired lease, to go on from its recovery point: by a resumer
    /// (`tx` is `None`, the takeover committed) or by a client retry (in `tx`, uncommitted,
    /// begun at `level`). The stored request is decoded as a resumer would, whoever took it
    /// over.
    pub(crate) fn taken_over(
        taken: Taken<E::Owner>,
        tx: Option<Tx<E>>,
        level: Isolation,
        hold: Hold,
    ) -> Self {
        Self {
            hold_level: level,
            context: context_of(&taken.owner, attempt_of(taken.attempts)),
            owner: taken.owner,
            tx,
            hold,
            entry: Entry::Stored {
                recovery_point: taken.recovery_point.clone(),
                output: taken.phase_output,
            },
            recorded_point: taken.recovery_point,
            request: taken.request,
            last_error: taken.last_error,
            lease_from: taken.lease_from,
        }
    }
}

/// What a phase is told of the execution it runs in.
fn context_of(owner: &impl KeyOwner, attempt: u32) -> PhaseContext {
    PhaseContext {
        tenant: owner.tenant().clone(),
        key: owner.key().clone(),
        attempt,
        lock_version: owner.lock_version(),
    }
}

/// The store counts attempts in an integer; a phase is told a `u32`.
fn attempt_of(attempts: i64) -> u32 {
    u32::try_from(attempts).unwrap_or(u32::MAX)
}

/// Why a drive stopped before finishing.
enum Stop {
    /// The attempt failed: record it.
    Failed(Box<FailedAttempt>),
    /// Not for this owner to record: it lost the key (fenced) or was stopped (crash point).
    Error(RunError),
    /// Answered without a record: another request got the key while this one restarted its
    /// transaction (its uncommitted claim or takeover made again and found taken).
    Answered(Outcome),
}

impl Stop {
    fn failed(failure: FailedAttempt) -> Self {
        Self::Failed(Box::new(failure))
    }
}

impl From<RunError> for Stop {
    fn from(error: RunError) -> Self {
        Self::Error(error)
    }
}

/// A failed attempt, before it is recorded. (Not [`crate::Failure`], which is what a failure
/// path is told once the attempts ran out.)
struct FailedAttempt {
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

impl FailedAttempt {
    fn of(phase: &'static str, retry_policy: RetryPolicy, error: PhaseError) -> Self {
        // `error.restarts()` (a serialization failure, a deadlock) makes the drive run the
        // transaction again before it records this.
        Self {
            phase,
            retry_policy,
            error,
            panicked: false,
            spent: false,
        }
    }
}

/// Where the open transaction began, as a restart runs it again from there: the position of its
/// first phase (or of the write it began for), and the last completed phase not yet recorded
/// then (a foreign result whose commit rides with it).
#[derive(Debug, Clone, Copy)]
struct TxStart {
    position: usize,
    unrecorded: Option<usize>,
}

/// A drive in progress: the owner, its open transaction, and what is not yet recorded.
struct Drive<'r, E: Engine> {
    runner: &'r Runner<E>,
    workflow: &'r Workflow<E>,
    owner: E::Owner,
    tx: Option<Tx<E>>,
    hold: Hold,
    /// The level the uncommitted hold's transaction began at.
    hold_level: Isolation,
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
    /// The claim's first `COMMIT` was refused (a deferred constraint): the claim vanished at a
    /// moment this owner knows, one round trip before its failure record claims the key again.
    claim_refused: bool,
    /// The attempt's `COMMIT` was refused (a deferred constraint). PostgreSQL reports the error
    /// before it aborts the transaction, so for a moment after the error arrives its session
    /// still holds the transaction's locks: an uncommitted takeover's claim lock among them.
    commit_refused: bool,
    /// The attempt's transaction was given up past a phase's time limit, its connection closed
    /// with a statement perhaps still running: until the server ends that statement, its session
    /// holds whatever the transaction locked (an uncommitted takeover's row and claim lock).
    abandoned: bool,
    /// A phase overran its time limit with the claim's transaction kept (for its record): a
    /// statement may still be running on it, so nothing is asked of it but going back to the
    /// claim (bounded).
    overran: bool,
    /// The attempt's transaction was found no longer the one the engine began, and how it ended
    /// (`idemflow_store::Standing`): asked once, when a write over the phases' work changed
    /// nothing or the attempt failed, and kept for the record.
    ended: Option<Standing>,
    /// The engine could not say how the attempt's transaction stands (its connection lost as
    /// it was asked): a write that changed nothing may not have met another owner at all.
    standing_unread: bool,
    /// Where the open transaction (or the one about to begin) began: what a restart runs again.
    tx_start: Option<TxStart>,
    /// Times the current transaction was restarted after a serialization failure or a deadlock.
    restarts: u32,
    /// The request as the first phase was given it, encoded, where the request the drive holds
    /// is the redacted one (a claim of a workflow that redacts its request): what a restart of
    /// the claim's transaction decodes again.
    first_input: Option<Value>,
}

impl<E: Engine> Runner<E> {
    /// Runs the phases from the entry point to the end, and records the attempt's failure if it
    /// fails.
    ///
    /// Local phases share the open transaction; before each foreign call the transaction commits
    /// (with the claim or takeover, and the last local output as the recovery point), and a new
    /// one begins after it. So a request commits 1 + (number of foreign phases) times, and the
    /// claim is durable before anything leaves the database.
    ///
    /// Boxed: a drive's state is large (tens of kilobytes across its awaits), and inline it would
    /// make every request's future that size, a replay's and a 409's too, which never drive. One
    /// allocation per execution instead.
    pub(crate) fn drive<'a>(
        &'a self,
        workflow: &'a Workflow<E>,
        start: Start<E>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Outcome, RunError>> + Send + 'a>>
    {
        Box::pin(self.drive_inline(workflow, start))
    }

    async fn drive_inline(
        &self,
        workflow: &Workflow<E>,
        start: Start<E>,
    ) -> Result<Outcome, RunError> {
        let (mut drive, entry, last_error) = Drive::new(self, workflow, start);
        let ran = match drive.enter(entry, last_error) {
            Ok((position, carry)) => {
                drive.keep_first_input(position, &carry);
                match drive.settle_level(position).await {
                    Ok(()) => drive.run(position, carry).await,
                    Err(stop) => Err(stop),
                }
            }
            Err(stop) => Err(stop),
        };
        match ran {
            Ok(outcome) => Ok(outcome),
            Err(Stop::Answered(outcome)) => Ok(outcome),
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
            Err(Stop::Failed(failure)) => {
                // Recording takes a few statements and perhaps the failure path (a local phase):
                // bounded as a whole, so a database gone quiet cannot hold the request.
                // After an abandoned transaction, the wait for its session to end comes on top.
                let abandoned_wait = if drive.abandoned {
                    abandoned_session_wait(workflow)
                } else {
                    Duration::ZERO
                };
                let limit = 4 * self.config.database_timeout
                    + workflow.default_local_timeout()
                    + overrun_grace(workflow.default_local_timeout())
                    + abandoned_wait;
                drive.fail(*failure).within(limit).await?
            }
        }
    }
}

impl<'r, E: Engine> Drive<'r, E> {
    /// A drive from where it starts, with the entry and the previous attempt's error to begin
    /// with.
    fn new(
        runner: &'r Runner<E>,
        workflow: &'r Workflow<E>,
        start: Start<E>,
    ) -> (Self, Entry, Option<String>) {
        let Start {
            owner,
            tx,
            hold,
            hold_level,
            entry,
            recorded_point,
            context,
            request,
            last_error,
            lease_from,
        } = start;
        let drive = Drive {
            runner,
            workflow,
            owner,
            tx,
            hold,
            hold_level,
            recorded_point,
            recorded_output: None,
            context,
            request,
            unrecorded: None,
            pending_foreign: None,
            lease_from,
            claim_refused: false,
            commit_refused: false,
            abandoned: false,
            overran: false,
            ended: None,
            standing_unread: false,
            tx_start: None,
            restarts: 0,
            first_input: None,
        };
        (drive, entry, last_error)
    }
}

impl<E: Engine> Drive<'_, E> {
    /// Runs the phases from `position`; a transaction the database rolled back to keep
    /// transactions apart (a serialization failure, a deadlock) runs again from its start, at
    /// once and under the same hold (`restart.rs`), before its failure counts.
    async fn run(&mut self, mut position: usize, mut carry: Carry) -> Result<Outcome, Stop> {
        loop {
            match self.run_from(position, carry).await {
                Err(Stop::Failed(failure)) if failure.error.restarts() => {
                    match self.restart(&failure).await? {
                        Some((from, input)) => (position, carry) = (from, input),
                        None => return Err(Stop::Failed(failure)),
                    }
                }
                ran => return ran,
            }
        }
    }

    async fn run_from(&mut self, mut position: usize, mut carry: Carry) -> Result<Outcome, Stop> {
        let steps = &self.workflow.steps;
        loop {
            // The transaction the next phases (or the write that follows them) run in begins
            // here, unless one is open already.
            self.tx_start.get_or_insert(TxStart {
                position,
                unrecorded: self.unrecorded,
            });
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

    /// The open transaction committed: the hold with it, and the next transaction is a new one,
    /// with restarts of its own.
    fn committed(&mut self) {
        self.hold = Hold::Committed;
        self.tx_start = None;
        self.restarts = 0;
    }
}

/// What the server enforces on the transaction the drive begins or goes on in (the one that
/// began at `tx_start`).
fn tx_limits<E: Engine>(
    workflow: &Workflow<E>,
    tx_start: Option<TxStart>,
) -> &idemflow_store::Limits {
    workflow.limits_at(tx_start.map_or(0, |start| start.position))
}

impl<E: Engine> Drive<'_, E> {
    /// Checks a write over the phases' work. One that changed nothing is either fenced (another
    /// owner holds the key) or ran outside the engine's transaction, which a phase ended (it then
    /// wrote nothing: `idemflow_store::Standing`). The engine tells which; an ended transaction
    /// fails the attempt, and its record decides what the ending means (`failure.rs`).
    async fn written(
        &mut self,
        written: Result<(), EngineError>,
        doing: &str,
        failure: impl FnOnce(PhaseError) -> FailedAttempt,
    ) -> Result<(), Stop> {
        let Err(error) = written else {
            return Ok(());
        };
        if matches!(error, EngineError::Fenced) {
            if let Some(ended) = self.ended_under().await {
                return Err(Stop::failed(failure(PhaseError::retryable(
                    ended.describe(),
                ))));
            }
            if self.standing_unread {
                // Fenced, or the transaction ended under a phase and the connection was lost
                // before the engine could say: not a fence to answer, but a failed attempt,
                // whose record finds out from the key's row.
                return Err(Stop::failed(failure(PhaseError::retryable(format!(
                    "{doing}: changed nothing, and the transaction's standing could not be read"
                )))));
            }
        }
        Err(store_stop(error, doing, failure))
    }

    /// How the open transaction ended, when it is no longer the one the engine began; `None`
    /// while it is (or when the engine cannot say within the database timeout: the record then
    /// goes on as for an open one, and fails where the transaction is gone). Asked once.
    async fn ended_under(&mut self) -> Option<Standing> {
        if self.ended.is_some() {
            return self.ended;
        }
        let tx = self.tx.as_mut()?;
        let asked = E::standing(tx)
            .within(self.runner.config.database_timeout)
            .await;
        match asked {
            Ok(Ok(Standing::Open)) => None,
            Ok(Ok(ended)) => {
                self.ended = Some(ended);
                self.ended
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, "the transaction's standing could not be read");
                self.standing_unread = true;
                None
            }
            Err(error) => {
                tracing::warn!(%error, "the transaction's standing could not be read in time");
                self.standing_unread = true;
                None
            }
        }
    }

    /// The runner's keyring applied to this key's values.
    fn sealer(&self) -> Sealer<'_> {
        self.runner.sealer(self.owner.tenant(), self.owner.key())
    }
}

/// A response the failure path stores (and answers): redacted by the workflow, or, if the
/// redaction panicked, a 500 problem in its place. Never the response unredacted.
fn redacted_or_problem<E: Engine>(
    workflow: &Workflow<E>,
    response: StoredResponse,
) -> StoredResponse {
    workflow
        .redacted_response(response)
        .unwrap_or_else(|panic| {
            tracing::error!(%panic, "redacting the response panicked; storing a problem instead");
            problem(
                500,
                "response_not_redacted",
                "the response could not be redacted, so it was not stored",
            )
        })
}

/// The open transaction, begun now (under `limits`: the workflow's, at the level of the phases
/// it runs) if there is none yet; the wait for a connection and for `BEGIN` bounded by the
/// runner's database timeout.
async fn opened<'t, E: Engine>(
    tx: &'t mut Option<Tx<E>>,
    runner: &Runner<E>,
    limits: &idemflow_store::Limits,
) -> Result<Result<&'t mut Tx<E>, EngineError>, RunError> {
    let open = match tx.take() {
        Some(open) => open,
        None => {
            let begin = begin_live::<E>(&runner.warm, limits);
            match begin.within(runner.config.database_timeout).await? {
                Ok(open) => open,
                Err(error) => return Ok(Err(error)),
            }
        }
    };
    Ok(Ok(tx.insert(open)))
}

/// A database error in the engine's own statements, as the attempt's failure.
fn database_error(doing: &str, error: &impl std::fmt::Display) -> PhaseError {
    PhaseError::retryable(format!("{doing} failed: {error}"))
}

/// [`database_error`] of an engine's error, marked for a restart where the database rolled the
/// transaction back to keep transactions apart (a serialization failure at `COMMIT`, say).
fn engine_failure(doing: &str, error: &EngineError) -> PhaseError {
    database_error(doing, error).restarting(error.is_restartable())
}

/// A store error while the drive writes: fenced stops the drive; anything else fails the
/// attempt.
fn store_stop(
    error: EngineError,
    doing: &str,
    failure: impl FnOnce(PhaseError) -> FailedAttempt,
) -> Stop {
    match error {
        EngineError::Fenced => Stop::Error(RunError::Fenced),
        EngineError::Database(error) => Stop::failed(failure(
            database_error(doing, &error).restarting(error.is_restartable()),
        )),
        other => Stop::Error(other.into()),
    }
}

/// Passes the transaction on after a successful fenced write; rolls it back on failure.
async fn fenced<E: Engine>(result: Result<(), EngineError>, tx: Tx<E>) -> Result<Tx<E>, RunError> {
    match result {
        Ok(()) => Ok(tx),
        Err(error) => {
            E::rollback(tx).await?;
            Err(error.into())
        }
    }
}

/// Commits, handing the connection back to the pool.
async fn commit<E: Engine>(tx: Tx<E>) -> Result<(), RunError> {
    E::commit_keeping(tx).await?;
    Ok(())
}

/// A problem the engine stores itself, in the one shape (`code` names it in a word).
fn problem(status: u16, code: &str, detail: &str) -> StoredResponse {
    let title = if status == 500 {
        "Internal Server Error"
    } else {
        "Error"
    };
    StoredResponse::problem_of(status, title, code, detail)
}

/// How long a session abandoned past a phase's time limit may live on: its last statement began
/// before the runner gave it up, and the server cancels it at the workflow's longest local limit
/// (the transaction's `statement_timeout`); then it reads the closed socket and ends.
pub(crate) fn abandoned_session_wait<E: Engine>(workflow: &Workflow<E>) -> Duration {
    let limit = workflow
        .limits()
        .statement_timeout
        .unwrap_or_else(|| workflow.default_local_timeout());
    limit + overrun_grace(limit)
}
