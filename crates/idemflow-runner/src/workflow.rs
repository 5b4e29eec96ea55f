//! A workflow: its name, its typed phases in order, its lease, and its failure path; built by a
//! [`WorkflowBuilder`] that checks at compile time that each phase takes the previous one's
//! output and at build time what the type system cannot (names, timeouts against the lease).

use std::collections::HashSet;
use std::marker::PhantomData;
use std::time::Duration;

use idemflow_core::{PhaseName, PhaseNameError, StoredResponse};
use serde_json::Value;

use crate::engine::{Engine, Isolation, Limits, SqlEngine};
use crate::erased::{Carry, ErasedFailure, ErasedLocal, Step, decode, failure_step};
use crate::heartbeat::overrun_grace;
use crate::panic::{Panic, catch_panic_now};
use crate::phase::{FailurePhase, ForeignPhase, LocalPhase, PhaseValue};
use crate::retry::RetryPolicy;

/// A workflow's request check, its type erased.
type Validator = Box<dyn Fn(&Carry) -> Result<(), String> + Send + Sync>;

/// A workflow's request redaction, its type erased: the request as it is stored.
type RequestRedaction = Box<dyn Fn(&Value) -> Result<Value, serde_json::Error> + Send + Sync>;

/// A workflow's response redaction.
type ResponseRedaction = Box<dyn Fn(&mut StoredResponse) + Send + Sync>;

/// Why a workflow cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// The workflow's name is not 1 to 128 bytes of printable ASCII without spaces.
    #[error("workflow name {0:?} must be 1 to 128 bytes of printable ASCII without spaces")]
    InvalidWorkflowName(String),
    /// No phase was added (which compiles only when the request type is a [`StoredResponse`]).
    #[error("a workflow needs at least one phase")]
    NoPhases,
    /// A phase's `NAME` is not a valid [`PhaseName`].
    #[error(transparent)]
    InvalidPhaseName(#[from] PhaseNameError),
    /// Two phases share this name: names are recovery points, so each must be unique.
    #[error("phase name {0:?} is used twice; phase names are recovery points and must be unique")]
    DuplicatePhaseName(&'static str),
    /// A foreign phase's timeout is not shorter than the lease: its owner could still be waiting
    /// on the call after another took the key over.
    #[error(
        "foreign phase {phase:?} may take {timeout:?}, not shorter than the lease of {lease:?}"
    )]
    TimeoutNotShorterThanLease {
        /// The foreign phase.
        phase: &'static str,
        /// Its timeout ([`ForeignPhase::timeout`]).
        timeout: Duration,
        /// The workflow's lease.
        lease: Duration,
    },
    /// A local phase declares an isolation level its engine cannot keep the protocol's
    /// guarantees at, in the transaction the phase runs in.
    #[error("local phase {phase:?} declares {isolation}, which this engine refuses: {reason}")]
    IsolationRefused {
        /// The local phase.
        phase: &'static str,
        /// The level it declares ([`LocalPhase::isolation`]).
        isolation: Isolation,
        /// Why the engine cannot keep it (`Engine::isolation_refused`).
        reason: &'static str,
    },
}

/// An ordered chain of typed phases, checked by the compiler: each phase's input is the previous
/// phase's output (the first takes the request), and only a chain whose last output is a
/// [`StoredResponse`] can be built.
///
/// ```
/// # use idemflow_runner::{Workflow, LocalPhase, PhaseContext, PhaseError};
/// # use idemflow_core::StoredResponse;
/// # use sqlx::SqliteConnection;
/// # use idemflow_sqlite::SqliteStore;
/// struct Greet;
/// #[async_trait::async_trait]
/// impl LocalPhase<SqliteStore> for Greet {
///     const NAME: &'static str = "greet";
///     type Input = String;
///     type Output = StoredResponse;
///     async fn run(&self, _: &mut SqliteConnection, name: String, _: &PhaseContext) -> Result<StoredResponse, PhaseError> {
///         Ok(StoredResponse::new(200, format!("hello {name}")))
///     }
/// }
/// let workflow = Workflow::builder::<String>("greet.v1").local(Greet).build().expect("valid");
/// assert_eq!(workflow.name(), "greet.v1");
/// ```
///
/// A chain that does not end in a response does not compile:
///
/// ```compile_fail,E0599
/// # use idemflow_runner::{Workflow, LocalPhase, PhaseContext, PhaseError};
/// # use sqlx::SqliteConnection;
/// # use idemflow_sqlite::SqliteStore;
/// struct Count;
/// #[async_trait::async_trait]
/// impl LocalPhase<SqliteStore> for Count {
///     const NAME: &'static str = "count";
///     type Input = String;
///     type Output = usize;
///     async fn run(&self, _: &mut SqliteConnection, name: String, _: &PhaseContext) -> Result<usize, PhaseError> {
///         Ok(name.len())
///     }
/// }
/// // `build` exists only once the chain's output is a StoredResponse.
/// let workflow = Workflow::builder::<String>("count.v1").local(Count).build();
/// ```
///
/// Nor does a phase whose input is not the previous phase's output:
///
/// ```compile_fail,E0271
/// # use idemflow_runner::{Workflow, LocalPhase, PhaseContext, PhaseError};
/// # use idemflow_core::StoredResponse;
/// # use sqlx::SqliteConnection;
/// # use idemflow_sqlite::SqliteStore;
/// struct Answer;
/// #[async_trait::async_trait]
/// impl LocalPhase<SqliteStore> for Answer {
///     const NAME: &'static str = "answer";
///     type Input = u64;
///     type Output = StoredResponse;
///     async fn run(&self, _: &mut SqliteConnection, n: u64, _: &PhaseContext) -> Result<StoredResponse, PhaseError> {
///         Ok(StoredResponse::new(200, n.to_string()))
///     }
/// }
/// // The request is a String, but Answer wants a u64.
/// let workflow = Workflow::builder::<String>("answer.v1").local(Answer).build();
/// ```
///
/// A workflow runs on one engine, `E` (named, or inferred from its phases and its runner): its local phases receive that
/// engine's connection, and only a runner of that engine runs it. For SQLite:
/// `Workflow::<SqliteStore>::builder_on::<Checkout>("checkout.v1")`, then the same chain.
pub struct Workflow<E: Engine> {
    name: String,
    pub(crate) steps: Vec<Step<E>>,
    lease: Duration,
    /// What the server enforces on the transaction whose first phase is at each position (one
    /// past the last included: a finish alone): the time limits of the workflow's longest local
    /// phase, and the isolation level of the strongest local phase the transaction runs.
    limits: Vec<Limits>,
    decode_request: fn(&Value) -> Result<Carry, serde_json::Error>,
    validate: Option<Validator>,
    redact_request: Option<RequestRedaction>,
    redact_response: Option<ResponseRedaction>,
    pub(crate) failure: Option<Box<dyn ErasedFailure<E>>>,
    live_only: bool,
}

impl<E: Engine> std::fmt::Debug for Workflow<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Workflow")
            .field("name", &self.name)
            .field("steps", &self.steps)
            .field("lease", &self.lease)
            .field("redacts_requests", &self.redact_request.is_some())
            .field("redacts_responses", &self.redact_response.is_some())
            .finish_non_exhaustive()
    }
}

/// The lease a workflow gets unless [`WorkflowBuilder::lease`] says otherwise.
const DEFAULT_LEASE: Duration = Duration::from_secs(60);

impl<E: Engine> Workflow<E> {
    /// The lease a workflow gets unless [`WorkflowBuilder::lease`] says otherwise.
    pub const DEFAULT_LEASE: Duration = DEFAULT_LEASE;

    /// Starts a workflow taking requests of type `Request`, on engine `E` (named, or inferred
    /// from the phases and the runner it goes to). `name` is durable (stored on every
    /// key the workflow claims); version it (`checkout.v1`) and keep old versions registered
    /// while their keys may still be resumed.
    ///
    /// Each phase added takes the chain's current output; [`WorkflowBuilder::build`] exists once
    /// that output is a [`StoredResponse`]:
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use idemflow_core::{DerivedKey, StoredResponse};
    /// # use idemflow_runner::{ForeignPhase, LocalPhase, PhaseContext, PhaseError, Workflow};
    /// # use idemflow_sqlite::SqliteStore;
    /// # use sqlx::SqliteConnection;
    /// # #[derive(serde::Serialize, serde::Deserialize)]
    /// # struct Checkout { amount: u64 }
    /// # struct Charge;
    /// # #[async_trait::async_trait]
    /// # impl ForeignPhase for Charge {
    /// #     const NAME: &'static str = "charge";
    /// #     type Input = Checkout;
    /// #     type Output = String;
    /// #     async fn call(&self, _: &DerivedKey, _: Checkout, _: &PhaseContext) -> Result<String, PhaseError> {
    /// #         Ok("ch_1".to_owned())
    /// #     }
    /// # }
    /// # struct Record;
    /// # #[async_trait::async_trait]
    /// # impl LocalPhase<SqliteStore> for Record {
    /// #     const NAME: &'static str = "record";
    /// #     type Input = String;
    /// #     type Output = StoredResponse;
    /// #     async fn run(&self, _: &mut SqliteConnection, charge: String, _: &PhaseContext) -> Result<StoredResponse, PhaseError> {
    /// #         Ok(StoredResponse::new(201, charge))
    /// #     }
    /// # }
    /// // Charge: Checkout -> String (the provider's charge id); Record: String -> StoredResponse.
    /// let workflow = Workflow::builder::<Checkout>("checkout.v1")
    ///     .validate(|checkout| match checkout.amount {
    ///         0 => Err("the amount must be positive".to_owned()),
    ///         _ => Ok(()),
    ///     })
    ///     .foreign(Charge)
    ///     .local(Record)
    ///     .lease(Duration::from_secs(30))
    ///     .build()?;
    /// assert_eq!(workflow.phase_names(), ["charge", "record"]);
    /// # Ok::<(), idemflow_runner::BuildError>(())
    /// ```
    pub fn builder<Request: PhaseValue>(
        name: impl Into<String>,
    ) -> WorkflowBuilder<Request, Request, E> {
        Self::builder_on(name)
    }

    /// [`Workflow::builder`], named for code that spells the engine:
    /// `Workflow::<SqliteStore>::builder_on::<Checkout>("checkout.v1")`. Its local phases are
    /// `LocalPhase<SqliteStore>`s, receiving a `SqliteConnection`.
    pub fn builder_on<Request: PhaseValue>(
        name: impl Into<String>,
    ) -> WorkflowBuilder<Request, Request, E> {
        WorkflowBuilder {
            name: name.into(),
            steps: Vec::new(),
            lease: DEFAULT_LEASE,
            decode_request: decode::<Request>,
            validate: None,
            redact_request: None,
            redact_response: None,
            failure: None,
            live_only: false,
            _chain: PhantomData,
        }
    }

    /// The workflow's durable name (with version), stored on every key it claims.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether only the live request (or a client retry) may run this workflow's keys: see
    /// [`WorkflowBuilder::live_only`].
    pub fn live_only(&self) -> bool {
        self.live_only
    }

    /// How long an owner holds the key between commits before another may take it over.
    /// Default [`Workflow::DEFAULT_LEASE`] (60 s).
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The phase names in order.
    pub fn phase_names(&self) -> Vec<&'static str> {
        self.steps.iter().map(|step| step.name().as_str()).collect()
    }

    /// The phases in order, each with whether it is foreign (it calls another system with its
    /// derived key) or local: what an operator's tools show of a workflow they do not run.
    pub fn phase_kinds(&self) -> Vec<(&'static str, bool)> {
        self.steps
            .iter()
            .map(|step| (step.name().as_str(), matches!(step, Step::Foreign(_))))
            .collect()
    }

    /// A local phase's time limit when it sets none: half the lease.
    pub fn default_local_timeout(&self) -> Duration {
        self.lease / 2
    }

    /// The time limit of a local phase.
    pub(crate) fn local_timeout(&self, local: &dyn ErasedLocal<E>) -> Duration {
        local
            .timeout()
            .unwrap_or_else(|| self.default_local_timeout())
    }

    /// What the server enforces on the claim's transaction (the one its leading local phases
    /// share): statements cancelled at its longest local phase's time limit, a session idle
    /// inside a transaction ended a little after it (see docs/runner.md, "Defaults"), and the
    /// isolation level its leading local phases declare.
    pub fn limits(&self) -> &Limits {
        &self.limits[0]
    }

    /// What the server enforces on the transaction whose first phase is at `position`: the
    /// workflow's time limits, and the strongest level the local phases from there to the next
    /// foreign phase declare (Read Committed where none runs: a record, a finish, a commit before
    /// a call).
    pub(crate) fn limits_at(&self, position: usize) -> &Limits {
        &self.limits[position.min(self.steps.len())]
    }

    /// What the server enforces on a transaction that runs no phase of this workflow (a failed
    /// attempt's record, a failure path): its time limits, at Read Committed.
    pub(crate) fn record_limits(&self) -> &Limits {
        &self.limits[self.steps.len()]
    }

    /// The name of the phase at `position` (the last one past the end).
    pub(crate) fn step_name(&self, position: usize) -> &'static str {
        self.steps[position.min(self.steps.len() - 1)].raw_name()
    }

    /// The retry policy that judges attempts at the phase at `position` (the last one past the
    /// end).
    pub(crate) fn retry_policy_at(&self, position: usize) -> RetryPolicy {
        self.steps[position.min(self.steps.len() - 1)].retry_policy()
    }

    /// Decodes the request from a borrowed value: a large request is not copied to be read.
    pub(crate) fn decode_request(&self, request: &Value) -> Result<Carry, serde_json::Error> {
        (self.decode_request)(request)
    }

    /// Runs the workflow's request check, if it has one.
    pub(crate) fn validate(&self, request: &Carry) -> Result<(), String> {
        self.validate
            .as_ref()
            .map_or(Ok(()), |validate| validate(request))
    }

    /// The request as it is stored, redacted by [`WorkflowBuilder::redact_request`]; `None`
    /// when the workflow redacts nothing (the request is stored as sent).
    pub(crate) fn redacted_request(
        &self,
        request: &Value,
    ) -> Option<Result<Value, serde_json::Error>> {
        self.redact_request.as_ref().map(|redact| redact(request))
    }

    /// A response as it is stored and answered, redacted by
    /// [`WorkflowBuilder::redact_response`]; `Err` if the redaction panicked.
    pub(crate) fn redacted_response(
        &self,
        mut response: StoredResponse,
    ) -> Result<StoredResponse, Panic> {
        let Some(redact) = &self.redact_response else {
            return Ok(response);
        };
        catch_panic_now(|| redact(&mut response))?;
        Ok(response)
    }

    /// Whether the workflow redacts its requests.
    pub(crate) fn redacts_requests(&self) -> bool {
        self.redact_request.is_some()
    }

    /// Whether the workflow redacts its responses.
    pub(crate) fn redacts_responses(&self) -> bool {
        self.redact_response.is_some()
    }

    /// The index of the first phase to run for a key left at `recovery_point`; `None` for a name
    /// this workflow does not have.
    pub(crate) fn position_after(&self, recovery_point: &str) -> Option<usize> {
        if recovery_point == idemflow_core::RecoveryPoint::START {
            return Some(0);
        }
        self.steps
            .iter()
            .position(|step| step.name().as_str() == recovery_point)
            .map(|index| index + 1)
    }
}

/// Builds a [`Workflow`]; `Chain` is the output type of the last phase added.
pub struct WorkflowBuilder<Request, Chain, E: Engine> {
    name: String,
    steps: Vec<Step<E>>,
    lease: Duration,
    decode_request: fn(&Value) -> Result<Carry, serde_json::Error>,
    validate: Option<Validator>,
    redact_request: Option<RequestRedaction>,
    redact_response: Option<ResponseRedaction>,
    failure: Option<Box<dyn ErasedFailure<E>>>,
    live_only: bool,
    _chain: PhantomData<fn(Request) -> Chain>,
}

impl<Request, Chain, E: Engine> std::fmt::Debug for WorkflowBuilder<Request, Chain, E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("WorkflowBuilder")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<Request: PhaseValue, E: Engine> WorkflowBuilder<Request, Request, E> {
    /// Checks each request before its key is claimed. A request that fails is rejected
    /// ([`crate::Outcome::Rejected`]) and leaves nothing behind, so the client may fix it and
    /// send it again under the same key. Only at the start of the chain, where the request is.
    pub fn validate(mut self, check: fn(&Request) -> Result<(), String>) -> Self {
        self.validate = Some(Box::new(move |carry: &Carry| {
            match carry.downcast_ref::<Request>() {
                Some(request) => check(request),
                None => Err("the request has an unexpected type".to_owned()),
            }
        }));
        self
    }

    /// Redacts the request before it is stored: drop or mask what must never be written to the
    /// database (a card number, say). The value stored is the redacted request as its type
    /// serializes it, so members the type does not know are not stored either; the fingerprint
    /// is still taken over the request as sent, so a retry with the same card matches.
    ///
    /// **What the phases see.** The phases of the attempt that claims the key get the request
    /// as sent, in memory. Everything that reads the request back from the row gets the
    /// redacted one: a resumer or a client retry taking the key over from `start` (no phase
    /// completed, or the first failed and is retried), and the failure path. So a redacted
    /// field may be needed only until the first phase that uses it completes, and that phase's
    /// output (its recovery point, stored) must not hold it: turn the card into a token there.
    /// A phase that may run again after a crash must tolerate the redacted value, and should
    /// answer (for instance `PhaseError::terminal_with` a 422 asking for the details again)
    /// rather than act on a mask. The redaction runs before the claim, like
    /// [`WorkflowBuilder::validate`].
    ///
    /// ```
    /// # use idemflow_runner::{Workflow, LocalPhase, PhaseContext, PhaseError};
    /// # use idemflow_core::StoredResponse;
    /// # use sqlx::SqliteConnection;
    /// # use idemflow_sqlite::SqliteStore;
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Payment { amount: u64, card: String }
    /// # struct Pay;
    /// # #[async_trait::async_trait]
    /// # impl LocalPhase<SqliteStore> for Pay {
    /// #     const NAME: &'static str = "pay";
    /// #     type Input = Payment;
    /// #     type Output = StoredResponse;
    /// #     async fn run(&self, _: &mut SqliteConnection, _: Payment, _: &PhaseContext) -> Result<StoredResponse, PhaseError> {
    /// #         Ok(StoredResponse::new(201, "paid"))
    /// #     }
    /// # }
    /// let workflow = Workflow::builder::<Payment>("pay.v1")
    ///     .redact_request(|payment| {
    ///         let digits = payment.card.chars().count();
    ///         let last4: String = payment.card.chars().skip(digits.saturating_sub(4)).collect();
    ///         payment.card = format!("****{last4}");
    ///     })
    ///     .local(Pay)
    ///     .build()?;
    /// # Ok::<(), idemflow_runner::BuildError>(())
    /// ```
    pub fn redact_request(mut self, redact: impl Fn(&mut Request) + Send + Sync + 'static) -> Self {
        self.redact_request = Some(Box::new(move |value: &Value| {
            let mut request = Request::deserialize(value)?;
            redact(&mut request);
            serde_json::to_value(&request)
        }));
        self
    }
}

impl<Request, Chain: PhaseValue, E: Engine> WorkflowBuilder<Request, Chain, E> {
    /// Appends a local phase taking the chain's current output.
    pub fn local<P: LocalPhase<E, Input = Chain>>(
        mut self,
        phase: P,
    ) -> WorkflowBuilder<Request, <P as LocalPhase<E>>::Output, E>
    where
        E: SqlEngine,
    {
        self.steps.push(Step::local(phase));
        self.retype()
    }

    /// Appends a foreign phase taking the chain's current output.
    pub fn foreign<P: ForeignPhase<Input = Chain>>(
        mut self,
        phase: P,
    ) -> WorkflowBuilder<Request, P::Output, E> {
        self.steps.push(Step::foreign(phase));
        self.retype()
    }

    /// Sets the lease: how long an owner may hold the key between two commits. It must exceed
    /// the worst-case time of any phase, including foreign calls (whose timeouts are checked).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets the failure path: what runs, in one transaction with the stored response, when a
    /// phase's retries run out. Without one, a 500 problem naming the last error is stored.
    pub fn on_failure<F: FailurePhase<E, Request = Request>>(mut self, failure: F) -> Self
    where
        Request: PhaseValue,
        E: SqlEngine,
    {
        self.failure = Some(failure_step(failure));
        self
    }

    /// Redacts every response before it is stored: mask what must not be written to the
    /// database (a card number echoed in a body, a header).
    ///
    /// **What is answered.** The redacted response is the answer, the first time and on every
    /// replay: [`crate::Outcome::Executed`] carries it too, so a client that lost the first
    /// answer and retries gets the same bytes as one that did not. It applies to every stored
    /// response: the last phase's, a terminal error's, the failure path's and a give-up's. It
    /// may run more than once on one response (a response recorded as a foreign phase's result
    /// is redacted when recorded and again when stored), so it must leave a redacted response
    /// as it is: masking does. A panic in it fails the attempt (retried as any failure is); on
    /// the failure path, a 500 problem is stored in its place. Never the unredacted response.
    pub fn redact_response(
        mut self,
        redact: impl Fn(&mut StoredResponse) + Send + Sync + 'static,
    ) -> Self {
        self.redact_response = Some(Box::new(redact));
        self
    }

    fn retype<Next>(self) -> WorkflowBuilder<Request, Next, E> {
        WorkflowBuilder {
            name: self.name,
            steps: self.steps,
            lease: self.lease,
            decode_request: self.decode_request,
            validate: self.validate,
            redact_request: self.redact_request,
            redact_response: self.redact_response,
            failure: self.failure,
            live_only: self.live_only,
            _chain: PhantomData,
        }
    }

    /// Marks the workflow as runnable only by the request that claimed its key (or a client
    /// retry of it), never by a resumer: its phases need what the live request carries and the
    /// key does not store. [`crate::Registry::register`] refuses such a workflow. Its keys are
    /// finished by client retries after the lease.
    pub fn live_only(mut self) -> Self {
        self.live_only = true;
        self
    }
}

/// The isolation level of the transaction whose first phase is at each position (and one past
/// the last): the strongest level of the local phases from there to the next foreign phase. A
/// level the engine refuses for one of those phases, in the transaction it shares (the claim's,
/// for a phase before any foreign one), refuses the workflow.
fn transaction_levels<E: Engine>(steps: &[Step<E>]) -> Result<Vec<Isolation>, BuildError> {
    let mut levels = vec![Isolation::ReadCommitted; steps.len() + 1];
    for position in (0..steps.len()).rev() {
        if let Step::Local(local) = &steps[position] {
            levels[position] = local.isolation().max(levels[position + 1]);
        }
    }
    let mut with_claim = true;
    for step in steps {
        match step {
            Step::Local(local) => {
                let isolation = local.isolation();
                if let Some(reason) = E::isolation_refused(isolation, with_claim) {
                    return Err(BuildError::IsolationRefused {
                        phase: local.name(),
                        isolation,
                        reason,
                    });
                }
            }
            Step::Foreign(_) => with_claim = false,
        }
    }
    Ok(levels)
}

impl<Request, E: Engine> WorkflowBuilder<Request, StoredResponse, E> {
    /// Checks what the types cannot: names valid and unique, foreign timeouts shorter than the
    /// lease.
    pub fn build(self) -> Result<Workflow<E>, BuildError> {
        let name_ok = !self.name.is_empty()
            && self.name.len() <= 128
            && self.name.bytes().all(|byte| (0x21..=0x7e).contains(&byte));
        if !name_ok {
            return Err(BuildError::InvalidWorkflowName(self.name));
        }
        if self.steps.is_empty() {
            return Err(BuildError::NoPhases);
        }
        let mut seen = HashSet::new();
        for step in &self.steps {
            let name = step.raw_name();
            PhaseName::new(name)?;
            if !seen.insert(name) {
                return Err(BuildError::DuplicatePhaseName(name));
            }
            if let Step::Foreign(foreign) = step {
                let timeout = foreign.timeout();
                if timeout >= self.lease {
                    return Err(BuildError::TimeoutNotShorterThanLease {
                        phase: name,
                        timeout,
                        lease: self.lease,
                    });
                }
            }
        }
        let longest_local = self
            .steps
            .iter()
            .filter_map(|step| match step {
                Step::Local(local) => Some(local.timeout().unwrap_or(self.lease / 2)),
                Step::Foreign(_) => None,
            })
            .max();
        // Statements are cancelled at the longest local limit (no single statement of a phase
        // may outlast the phase); a session left idle inside a transaction for longer than the
        // runner itself waits is ended by the server.
        let base = Limits::default()
            .with_statement_timeout(longest_local)
            .with_idle_timeout(longest_local.map(|limit| limit + 2 * overrun_grace(limit)))
            .with_lock_timeout(None);
        let limits = transaction_levels::<E>(&self.steps)?
            .into_iter()
            .map(|isolation| base.with_isolation(isolation))
            .collect();
        Ok(Workflow {
            name: self.name,
            steps: self.steps,
            lease: self.lease,
            limits,
            decode_request: self.decode_request,
            validate: self.validate,
            redact_request: self.redact_request,
            redact_response: self.redact_response,
            failure: self.failure,
            live_only: self.live_only,
        })
    }
}
