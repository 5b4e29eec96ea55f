use std::sync::Arc;

use idemflow_core::{Fingerprint, Key, TenantId};
use serde_json::Value;
use tracing::Instrument;

use crate::admission::{accept, canonical_request};
use crate::claim_level::ClaimLevel;
use crate::config::RunnerConfig;
#[cfg(feature = "crash-hooks")]
use crate::crash::CrashHook;
use crate::crash::CrashPoints;
use crate::drive::{Hold, Start};
use crate::engine::{Engine, EnginePool, Isolation, KeyOwner, PoolOf, Taken};
use crate::error::RunError;
use crate::metrics;
use crate::outcome::{Outcome, Rejection};
use crate::sealing::Sealer;
use crate::warm::Warm;
use crate::workflow::Workflow;

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

/// Executes workflows under idempotency keys, on one engine's database: `E`. [`Runner::new`]
/// takes any engine's pool and knows the engine from it.
#[derive(Debug)]
pub struct Runner<E: Engine> {
    pub(crate) pool: PoolOf<E>,
    /// Connections kept between requests (see [`crate::warm`]).
    pub(crate) warm: Arc<Warm<E::Pool>>,
    pub(crate) config: RunnerConfig,
    pub(crate) crash_points: CrashPoints,
    /// The level new keys are claimed at, as the layout allows (see [`crate::claim_level`]).
    pub(crate) claim_level: Arc<ClaimLevel>,
}

impl<E: Engine> Clone for Runner<E> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            warm: Arc::clone(&self.warm),
            config: self.config.clone(),
            crash_points: self.crash_points.clone(),
            claim_level: Arc::clone(&self.claim_level),
        }
    }
}

impl<E: Engine> Runner<E> {
    /// A runner on `pool` (a `PgPool`, a `SqlitePool`, a `MySqlPool`, a Redis pool: the engine
    /// follows from it, in generic code too), with the default [`RunnerConfig`] (terminal errors
    /// are stored). The first runner of a process describes the engine's metrics to the
    /// installed recorder.
    pub fn new(pool: impl EnginePool<E>) -> Self {
        Self::on(pool.into_pool(), RunnerConfig::default())
    }

    /// As [`Runner::new`], with `config`.
    pub fn with_config(pool: impl EnginePool<E>, config: RunnerConfig) -> Self {
        Self::on(pool.into_pool(), config)
    }

    /// A runner of engine `E` on its pool, with `config`. [`Runner::new`] and
    /// [`Runner::with_config`] take the same pool, in generic code too (`Runner::<E>::new(pool)`
    /// with `pool: PoolOf<E>`: docs/runner.md, "One workflow, several engines").
    pub fn on(pool: PoolOf<E>, config: RunnerConfig) -> Self {
        metrics::describe_once();
        Self {
            warm: Arc::new(Warm::new(pool.clone(), config.warm_connections)),
            pool,
            config,
            crash_points: CrashPoints::default(),
            claim_level: Arc::default(),
        }
    }

    /// Installs a crash hook: at each [`crate::CrashPoint`] the hook may stop the run as a crash
    /// would. For tests (see the testkit's explorer), with the `crash-hooks` feature; without
    /// one, each point costs a branch, and without the feature nothing.
    #[cfg(feature = "crash-hooks")]
    pub fn with_crash_hook(mut self, hook: Arc<dyn CrashHook>) -> Self {
        self.crash_points = CrashPoints::new(hook);
        self
    }

    /// The pool the runner takes its connections from.
    pub fn pool(&self) -> &PoolOf<E> {
        &self.pool
    }

    /// The runner's keyring applied to one key's values.
    pub(crate) fn sealer<'a>(&'a self, tenant: &'a TenantId, key: &'a Key) -> Sealer<'a> {
        Sealer {
            keyring: self.config.keyring.as_ref(),
            tenant,
            key,
        }
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
    /// # use idemflow_sqlite::SqliteStore;
    /// # async fn example(runner: idemflow_runner::Runner<SqliteStore>, workflow: idemflow_runner::Workflow<SqliteStore>)
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
        workflow: &Workflow<E>,
        tenant: &TenantId,
        key: &Key,
        request: Request<'_>,
    ) -> Result<Outcome, RunError> {
        let prepared = canonical_request(request);
        self.run_accepted(workflow, tenant, key, prepared).await
    }

    /// Runs a request whose fingerprint the caller computed (an HTTP layer fingerprinting a
    /// non-JSON body by its bytes and content type, say). `request` is what the workflow's
    /// request type decodes from, and what is stored for a resumer (redacted by the workflow,
    /// sealed by the runner's keyring, if they say so).
    pub async fn run_fingerprinted(
        &self,
        workflow: &Workflow<E>,
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
        workflow: &Workflow<E>,
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

    /// Finishes a key a resumer took over ([`Engine::take_over_due`]), from its
    /// recovery point. The takeover is already committed; however long ago that was, the key's
    /// fence is confirmed before any call to another system.
    pub async fn resume(
        &self,
        workflow: &Workflow<E>,
        taken: Taken<E::Owner>,
    ) -> Result<Outcome, RunError> {
        let span = tracing::info_span!(
            "idemflow.resume",
            tenant = %taken.owner.tenant(),
            key = %taken.owner.key(),
            workflow = workflow.name(),
            lock_version = taken.owner.lock_version(),
            attempt = taken.attempts,
        );
        async {
            // At INFO, in the span naming the tenant and key: a resumer's takeover is the one
            // sign, without polling, that a request's process died under it.
            tracing::info!(
                recovery_point = %taken.recovery_point,
                "a resumer took over the key to finish it"
            );
            metrics::count(metrics::TAKEOVERS, workflow.name());
            // However long it waited since its batch took it over, the call checks its fence.
            let start = Start::taken_over(taken, None, Isolation::ReadCommitted, Hold::Committed);
            self.drive(workflow, start).await
        }
        .instrument(span)
        .await
    }
}
