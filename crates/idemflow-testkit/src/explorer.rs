//! The explorer: proves a workflow crash-safe by crashing it at every step boundary (and by
//! breaking its provider calls the ways networks break), recovering each case twice over (by a
//! resumer, and by a client retry with the same key), and checking what must hold.
//!
//! For every case it checks:
//! - **nothing left started**: the key finished (its response stored);
//! - **replay**: a further retry returns the stored response, byte for byte;
//! - **one execution per derived key**: every call the mock provider executed during the case (a
//!   charge, a refund, any operation: [`crate::provider::MockProvider::executed_keys`]) carries
//!   one of the request's derived keys, and no derived key was executed twice;
//! - **no phase ended the runner's transaction**: the stored response is not the engine's 500
//!   `transaction_ended`, which the runner stores when a local phase committed or rolled back the
//!   transaction it shares (docs/runner.md);
//! - **your invariants**: checks you add, such as "exactly one order row for this key" (local
//!   effects exactly once).
//!
//! It prints a table of scenario × recovery path × outcome; [`Report::assert_all_passed`] fails
//! with the exact case that broke.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use idemflow_core::{DerivedKey, Key, PhaseName, StoredResponse, TenantId};
use idemflow_runner::{
    CrashHook, CrashPoint, Outcome, PoolOf, Registry, Request, Resumer, ResumerConfig, RunError,
    Runner, RunnerConfig, Workflow,
};
use idemflow_store::Tamper;

use crate::provider::{Fault, MockProvider};

/// How an abandoned case is finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// A resumer takes the key over once its lease is rewound.
    Resumer,
    /// The client retries with the same key once the lease is rewound.
    ClientRetry,
}

impl fmt::Display for Recovery {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            Self::Resumer => "resumer",
            Self::ClientRetry => "client retry",
        })
    }
}

/// What goes wrong in a case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scenario {
    /// The first attempt stops at this crash point, as if its process died.
    Crash(CrashPoint),
    /// The first provider call of the first attempt meets this fault.
    Fault(Fault),
}

impl fmt::Display for Scenario {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Crash(point) => write!(formatter, "crash {point}"),
            Self::Fault(fault) => write!(formatter, "fault {fault:?}"),
        }
    }
}

/// One case: its key, what went wrong and how it was recovered.
#[derive(Debug, Clone)]
pub struct Case {
    /// The tenant the request is sent as (the explorer's, the same for every case).
    pub tenant: TenantId,
    /// The case's own idempotency key (`explore-<n>-<scenario>-<recovery>`): what a check
    /// looks its rows up by.
    pub key: String,
    /// What went wrong in the first attempt.
    pub scenario: Scenario,
    /// How the case was then finished.
    pub recovery: Recovery,
}

impl Case {
    /// The case's key, parsed: the explorer makes only valid ones.
    pub fn parsed_key(&self) -> Key {
        Key::parse(&self.key).expect("the explorer makes valid keys")
    }
}

/// What a case came to.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// The case that ran.
    pub case: Case,
    /// What the first attempt returned.
    pub first_attempt: String,
    /// Every check that failed; empty when the case passed.
    pub failures: Vec<String>,
}

impl CaseResult {
    /// Whether every check held.
    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Every case's result.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// One per case run, in the order of [`Explorer::cases`].
    pub results: Vec<CaseResult>,
}

impl Report {
    /// The cases that did not pass, in order.
    pub fn failed(&self) -> Vec<&CaseResult> {
        self.results
            .iter()
            .filter(|result| !result.passed())
            .collect()
    }

    /// Panics, printing the table and the first case that broke, unless every case passed.
    #[track_caller]
    pub fn assert_all_passed(&self) {
        if let Some(broken) = self.failed().first() {
            panic!(
                "{self}\n{} of {} cases failed; the first: {} / {} (key {:?}): {}",
                self.failed().len(),
                self.results.len(),
                broken.case.scenario,
                broken.case.recovery,
                broken.case.key,
                broken.failures.join("; ")
            );
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scenario_width = self
            .results
            .iter()
            .map(|result| result.case.scenario.to_string().len())
            .max()
            .unwrap_or(8)
            .max(8);
        let first_width = self
            .results
            .iter()
            .map(|result| result.first_attempt.len())
            .max()
            .unwrap_or(13)
            .max(13);
        writeln!(
            formatter,
            "{:<scenario_width$}  {:<12}  {:<first_width$}  outcome",
            "scenario", "recovery", "first attempt"
        )?;
        for result in &self.results {
            let outcome = if result.passed() {
                "ok".to_owned()
            } else {
                format!("FAIL: {}", result.failures.join("; "))
            };
            writeln!(
                formatter,
                "{:<scenario_width$}  {:<12}  {:<first_width$}  {outcome}",
                result.case.scenario.to_string(),
                result.case.recovery.to_string(),
                result.first_attempt,
            )?;
        }
        Ok(())
    }
}

/// A check of your own, run after each case, on the engine's pool: `Err(why)` fails it.
pub type Check<E> = Box<dyn for<'a> Fn(&'a PoolOf<E>, &'a Case) -> CheckFuture<'a> + Send + Sync>;

/// What a [`Check`] returns: `Ok(())`, or `Err(why)` to fail the case.
pub type CheckFuture<'a> = Pin<Box<dyn Future<Output = Result<(), String>> + Send + 'a>>;

/// Explores one workflow with one request.
///
/// ```no_run
/// use idemflow_core::TenantId;
/// use idemflow_testkit::explorer::{Case, CheckFuture, Explorer};
/// use idemflow_testkit::provider::MockProvider;
/// use idemflow_sqlite::SqliteStore;
/// use sqlx::SqlitePool;
/// # fn checkout_workflow(
/// #     _: idemflow_testkit::provider_client::ProviderClient,
/// # ) -> idemflow_runner::Workflow<SqliteStore> {
/// #     unimplemented!()
/// # }
///
/// /// Local effects exactly once: one order per request.
/// fn one_order<'a>(pool: &'a SqlitePool, case: &'a Case) -> CheckFuture<'a> {
///     Box::pin(async move {
///         let orders: i64 =
///             sqlx::query_scalar("SELECT count(*) FROM orders WHERE request_key = ?1")
///                 .bind(&case.key)
///                 .fetch_one(pool)
///                 .await
///                 .map_err(|error| error.to_string())?;
///         if orders == 1 { Ok(()) } else { Err(format!("{orders} orders for one request")) }
///     })
/// }
///
/// # async fn example(pool: SqlitePool) {
/// let provider = MockProvider::start().await;
/// // Your workflow, charging through the mock provider.
/// let checkout = checkout_workflow(provider.client());
/// let body = br#"{"amount": 2500, "currency": "usd", "source": "tok_visa"}"#;
/// let report = Explorer::new(pool, checkout, TenantId::from(7_u64), "/v1/checkouts", body)
///     .check("one order per request", one_order)
///     .run(Some(&provider))
///     .await;
/// println!("{report}");
/// report.assert_all_passed();
/// # }
/// ```
///
/// On any engine: give it that engine's pool and a workflow on it (`PgPool` and
/// `Workflow<PgStore>` on PostgreSQL): the same cases, the same checks. It reads the key through
/// the engine's operator and rewinds leases with the engine's own [`Tamper`].
pub struct Explorer<E: Tamper> {
    pool: PoolOf<E>,
    workflow: Arc<Workflow<E>>,
    tenant: TenantId,
    method: String,
    path: String,
    body: Vec<u8>,
    checks: Vec<(String, Check<E>)>,
    faults: Vec<Fault>,
    recovery_rounds: usize,
}

impl<E: Tamper> fmt::Debug for Explorer<E> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Explorer")
            .field("workflow", &self.workflow.name())
            .finish_non_exhaustive()
    }
}

impl<E: Tamper> Explorer<E> {
    /// Explores `workflow` with a JSON `body` sent as `POST path` by `tenant`. Each case uses a
    /// fresh key, so one database serves every case.
    pub fn new(
        pool: PoolOf<E>,
        workflow: impl Into<Arc<Workflow<E>>>,
        tenant: TenantId,
        path: &str,
        body: &[u8],
    ) -> Self {
        Self {
            pool,
            workflow: workflow.into(),
            tenant,
            method: "POST".to_owned(),
            path: path.to_owned(),
            body: body.to_vec(),
            checks: Vec::new(),
            faults: Self::network_faults(),
            recovery_rounds: 8,
        }
    }

    /// The faults explored by default: a 5xx, a 429, a timeout, a reset before execution, and a
    /// charge whose response is lost.
    pub fn network_faults() -> Vec<Fault> {
        vec![
            Fault::ServerError(503),
            Fault::TooManyRequests {
                retry_after: std::time::Duration::from_secs(1),
            },
            Fault::Timeout,
            Fault::ConnectionReset,
            Fault::ExecuteThenDrop,
        ]
    }

    /// Adds an invariant of yours, checked after every case (e.g. exactly one order row).
    pub fn check<F>(mut self, name: &str, check: F) -> Self
    where
        F: for<'a> Fn(&'a PoolOf<E>, &'a Case) -> CheckFuture<'a> + Send + Sync + 'static,
    {
        self.checks.push((name.to_owned(), Box::new(check)));
        self
    }

    /// Replaces the provider faults explored (none: crash points only).
    pub fn faults(mut self, faults: Vec<Fault>) -> Self {
        self.faults = faults;
        self
    }

    /// Every case this explorer runs: each crash point, then each fault, by each recovery path.
    pub fn cases(&self) -> Vec<(Scenario, Recovery)> {
        let mut scenarios: Vec<Scenario> = CrashPoint::all(&self.workflow)
            .into_iter()
            .map(Scenario::Crash)
            .collect();
        scenarios.extend(self.faults.iter().cloned().map(Scenario::Fault));
        scenarios
            .into_iter()
            .flat_map(|scenario| {
                [Recovery::Resumer, Recovery::ClientRetry]
                    .map(|recovery| (scenario.clone(), recovery))
            })
            .collect()
    }

    /// Runs every case, one after another. `provider` is the mock the workflow charges through
    /// (faults are pushed to it and its ledger checked); without one, only crash points run.
    pub async fn run(&self, provider: Option<&MockProvider>) -> Report {
        let mut report = Report::default();
        for (index, (scenario, recovery)) in self.cases().into_iter().enumerate() {
            if matches!(scenario, Scenario::Fault(_)) && provider.is_none() {
                continue;
            }
            let key = format!("explore-{index}-{}-{}", slug(&scenario), slug(&recovery));
            let case = Case {
                tenant: self.tenant.clone(),
                key,
                scenario,
                recovery,
            };
            let result = self.run_case(case, provider).await;
            tracing::info!(
                scenario = %result.case.scenario, recovery = %result.case.recovery,
                passed = result.passed(), "explored a case"
            );
            report.results.push(result);
        }
        report
    }

    async fn run_case(&self, case: Case, provider: Option<&MockProvider>) -> CaseResult {
        let mut failures = Vec::new();
        let charges_before = provider.map_or(0, |provider| provider.executed_keys().len());
        let first_attempt = self.first_attempt(&case, provider, &mut failures).await;

        // Recover: rewind the lease (never sleep for it) and let the recovery path finish it.
        let plain = Runner::<E>::on(self.pool.clone(), RunnerConfig::default());
        let mut finished = false;
        for _ in 0..self.recovery_rounds {
            let recovered = match self.state(&case).await {
                Ok(Some((state, _))) if state == "done" => {
                    finished = true;
                    break;
                }
                // No key: the crash came before the claim committed, so nothing happened and
                // there is nothing to resume. The client, never answered, retries: by either
                // path, that is the recovery.
                Ok(None) => plain
                    .run(
                        &self.workflow,
                        &case.tenant,
                        &case.parsed_key(),
                        self.request(),
                    )
                    .await
                    .map(|_| ()),
                Ok(Some(_)) => {
                    if let Err(error) = self.rewind_lease(&case).await {
                        failures.push(format!("rewinding the lease: {error}"));
                        break;
                    }
                    match case.recovery {
                        Recovery::Resumer => self.resumer().drain().await.map(|_| ()),
                        Recovery::ClientRetry => plain
                            .run(
                                &self.workflow,
                                &case.tenant,
                                &case.parsed_key(),
                                self.request(),
                            )
                            .await
                            .map(|_| ()),
                    }
                }
                Err(error) => {
                    failures.push(format!("reading the key: {error}"));
                    break;
                }
            };
            if let Err(error) = recovered {
                failures.push(format!("recovery failed: {error}"));
            }
        }
        if !finished {
            match self.state(&case).await {
                Ok(Some((state, recovery_point))) => failures.push(format!(
                    "left {state} at {recovery_point} after {} recovery rounds",
                    self.recovery_rounds
                )),
                Ok(None) => failures
                    .push("no key row: the request was never claimed, or was lost".to_owned()),
                Err(error) => failures.push(format!("reading the key: {error}")),
            }
        }

        if finished {
            self.check_replay(&case, &plain, &mut failures).await;
        }
        if let Some(provider) = provider {
            self.check_charges(&case, provider, charges_before, &mut failures);
        }
        for (name, check) in &self.checks {
            if let Err(why) = check(&self.pool, &case).await {
                failures.push(format!("{name}: {why}"));
            }
        }
        CaseResult {
            case,
            first_attempt,
            failures,
        }
    }

    async fn first_attempt(
        &self,
        case: &Case,
        provider: Option<&MockProvider>,
        failures: &mut Vec<String>,
    ) -> String {
        let runner = match &case.scenario {
            Scenario::Crash(point) => {
                let hook = Arc::new(CrashOnce {
                    point: point.clone(),
                    key: case.key.clone(),
                    fired: AtomicBool::new(false),
                });
                let runner = Runner::<E>::on(self.pool.clone(), RunnerConfig::default())
                    .with_crash_hook(hook.clone());
                let result = runner
                    .run(
                        &self.workflow,
                        &case.tenant,
                        &case.parsed_key(),
                        self.request(),
                    )
                    .await;
                if !hook.fired.load(Ordering::SeqCst) {
                    failures.push(format!("the run never reached {point}"));
                }
                return describe(&result);
            }
            Scenario::Fault(fault) => {
                if let Some(provider) = provider {
                    provider.push_fault(fault.clone());
                }
                Runner::<E>::on(self.pool.clone(), RunnerConfig::default())
            }
        };
        let result = runner
            .run(
                &self.workflow,
                &case.tenant,
                &case.parsed_key(),
                self.request(),
            )
            .await;
        if let Some(provider) = provider
            && provider.pending_faults() > 0
        {
            failures.push(
                "the scripted fault was never met: the workflow made no provider call".to_owned(),
            );
        }
        describe(&result)
    }

    fn request(&self) -> Request<'_> {
        Request {
            method: &self.method,
            path: &self.path,
            body: &self.body,
        }
    }

    fn resumer(&self) -> Resumer<E> {
        let mut registry = Registry::new();
        registry
            .register(self.workflow.clone())
            .unwrap_or_else(|_| unreachable!("one workflow"));
        let config = ResumerConfig::default().with_retention(None);
        Resumer::with_config(
            Runner::<E>::on(self.pool.clone(), RunnerConfig::default()),
            registry,
            config,
        )
    }

    /// The key's state and recovery point; `None` when it has no row.
    async fn state(&self, case: &Case) -> Result<Option<(String, String)>, String> {
        let report = E::operator(&self.pool)
            .key_report(case.tenant.as_str(), &case.key)
            .await
            .map_err(|error| error.to_string())?;
        Ok(report.map(|report| (report.state, report.recovery_point)))
    }

    async fn rewind_lease(&self, case: &Case) -> Result<(), String> {
        E::lapse_leases(&self.pool, Some((case.tenant.as_str(), &case.key)))
            .await
            .map_err(|error| error.to_string())
    }

    /// A further retry must return the stored response, byte for byte.
    async fn check_replay(&self, case: &Case, runner: &Runner<E>, failures: &mut Vec<String>) {
        let stored = match self.stored_response(case).await {
            Ok(Some(stored)) => stored,
            Ok(None) => return failures.push("no stored response".to_owned()),
            Err(error) => return failures.push(format!("reading the key: {error}")),
        };
        if ended_its_transaction(&stored) {
            failures.push(
                "a local phase ended the runner's transaction (a COMMIT, a ROLLBACK, a statement \
                 that commits implicitly, or a statement retried after a deadlock): the key ended \
                 with the engine's 500 `transaction_ended` (docs/runner.md: what a local phase \
                 must not do)"
                    .to_owned(),
            );
        }
        match runner
            .run(
                &self.workflow,
                &case.tenant,
                &case.parsed_key(),
                self.request(),
            )
            .await
        {
            Ok(Outcome::Replayed(replayed)) if replayed == stored => {}
            Ok(Outcome::Replayed(_)) => {
                failures.push("the replay differs from the stored response".to_owned())
            }
            other => failures.push(format!(
                "a further retry was not a replay: {}",
                describe(&other)
            )),
        }
    }

    async fn stored_response(&self, case: &Case) -> Result<Option<StoredResponse>, String> {
        let key = Key::parse(&case.key).map_err(|error| error.to_string())?;
        idemflow_store::stored_response::<E>(&self.pool, &case.tenant, &key)
            .await
            .map_err(|error| error.to_string())
    }

    /// Every charge made during the case carries one of this request's derived keys, once.
    fn check_charges(
        &self,
        case: &Case,
        provider: &MockProvider,
        before: usize,
        failures: &mut Vec<String>,
    ) {
        let Ok(key) = Key::parse(&case.key) else {
            return;
        };
        let derived: Vec<String> = self
            .workflow
            .phase_names()
            .into_iter()
            .filter_map(|name| PhaseName::new(name).ok())
            .map(|phase| {
                DerivedKey::new(&case.tenant, &key, phase)
                    .as_str()
                    .to_owned()
            })
            .collect();
        // Charges and any other operation the provider executed (refunds, payouts, …).
        let executed = provider.executed_keys();
        let made = &executed[before.min(executed.len())..];
        let mut seen = std::collections::HashSet::new();
        for key in made {
            if !derived.contains(key) {
                failures.push(format!(
                    "executed under {key:?}, not a derived key of this request"
                ));
            } else if !seen.insert(key.clone()) {
                failures.push(format!("executed twice under {key:?}"));
            }
        }
    }
}

/// Crashes the first run of one key at one point.
#[derive(Debug)]
struct CrashOnce {
    point: CrashPoint,
    key: String,
    fired: AtomicBool,
}

#[async_trait::async_trait]
impl CrashHook for CrashOnce {
    async fn crash_at(&self, point: &CrashPoint, _: &TenantId, key: &Key) -> bool {
        *point == self.point && key.as_str() == self.key && !self.fired.swap(true, Ordering::SeqCst)
    }
}

fn describe(result: &Result<Outcome, RunError>) -> String {
    match result {
        Ok(Outcome::Executed(response)) => format!("executed {}", response.status),
        Ok(Outcome::Replayed(response)) => format!("replayed {}", response.status),
        Ok(Outcome::InProgress { .. }) => "in progress".to_owned(),
        Ok(Outcome::Mismatch) => "mismatch".to_owned(),
        Ok(Outcome::Rejected(rejection)) => format!("rejected: {rejection}"),
        Ok(Outcome::Interrupted { .. }) => "interrupted".to_owned(),
        Ok(Outcome::Forgotten(response)) => format!("forgotten {}", response.status),
        Ok(other) => format!("{other:?}"),
        Err(RunError::Crashed(point)) => format!("crashed at {point}"),
        Err(error) => format!("error: {error}"),
    }
}

fn slug(thing: &impl fmt::Display) -> String {
    thing
        .to_string()
        .chars()
        .map(|character| {
            if character.is_ascii_alphanumeric() {
                character
            } else {
                '-'
            }
        })
        .collect::<String>()
        .chars()
        .take(60)
        .collect()
}

/// Whether `response` is the problem the runner stores when a local phase ended its transaction.
fn ended_its_transaction(response: &StoredResponse) -> bool {
    response.status == 500
        && serde_json::from_slice::<serde_json::Value>(&response.body)
            .is_ok_and(|problem| problem["code"] == "transaction_ended")
}
