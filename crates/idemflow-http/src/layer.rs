//! The plain-handler layer: any handler behind it gets idempotency. The key is claimed (and the
//! claim committed) before the handler runs; its response is stored, or not, by its status
//! ([`StatusRules`]); retries get the stored one back. The handler is one foreign phase: it runs
//! outside the key's transaction, so a crash while it runs means a client retry after the lease
//! runs it again (at least once), exactly as a foreign call would be repeated. Work that must be
//! exactly once belongs in a workflow's local phases.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{MatchedPath, OriginalUri};
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idemflow_runner::{BuildError, Engine, Outcome, Rejection, Runner, Workflow};
use tower::{Layer, Service, ServiceExt};

use crate::ProblemType;
use crate::config::{HttpConfig, KeyMode, Redaction, StatusRules};
use crate::extract::key_problem;
use crate::handler::{Handler, HandlerSettings, LIVE, Live};
use crate::key_header::KeyHeaderError;
use crate::prepare::{Refusal, prepare, target};
use crate::problem::{respond, seconds};
use crate::recorded::{RecordedRequest, Unread};
use crate::request_fingerprint::{FingerprintError, fingerprint};
use crate::tenant::TenantResolver;
use crate::wait::{Finishes, Waiting, ends_a_hold, run_or_wait};

/// Gives idempotency to the handlers it wraps. `name` is the workflow name its keys are stored
/// under (version it, like a workflow: `orders-api.v1`).
///
/// Mount it with `route_layer` (only matched routes pass through it); with `layer` it also
/// wraps the router's fallback, which it then lets through untouched (see docs/http.md).
///
/// ```no_run
/// use axum::Router;
/// use axum::routing::post;
/// use idemflow_http::{BearerTenant, IdempotencyLayer, ServeLimits};
/// use idemflow_runner::Runner;
///
/// async fn refund() -> &'static str {
///     "refunded" // stored with the key; a retry gets it back, `Idempotent-Replayed: true`
/// }
///
/// # async fn example(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let runner: Runner<idemflow_pg::PgStore> = Runner::new(pool);
/// let app: Router = Router::new()
///     .route("/v1/orders/{id}/refunds", post(refund))
///     .route_layer(IdempotencyLayer::new(runner, "orders-api.v1", BearerTenant)?);
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
/// idemflow_http::serve(listener, app, ServeLimits::default()).await?; // slow clients cut off
/// # Ok(())
/// # }
/// ```
///
/// On SQLite, pass a runner on a `SqlitePool`: the layer is `IdempotencyLayer<SqliteStore>`.
#[derive(Clone)]
pub struct IdempotencyLayer<E: Engine> {
    runner: Runner<E>,
    name: String,
    resolver: Arc<dyn TenantResolver>,
    config: Arc<HttpConfig>,
    settings: HandlerSettings,
    lease: Duration,
    finishes: Arc<Finishes>,
}

impl<E: Engine> std::fmt::Debug for IdempotencyLayer<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("IdempotencyLayer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Why a layer's settings were refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayerError {
    /// The workflow the layer runs its handler as cannot be built from them (an invalid name,
    /// a handler timeout not shorter than the lease).
    #[error(transparent)]
    Workflow(#[from] BuildError),
    /// [`IdempotencyLayerBuilder::max_response_bytes`] is zero: no response could be stored.
    #[error("max_response_bytes must be above zero")]
    NoResponseRoom,
}

/// Builds an [`IdempotencyLayer`]; its settings are checked by [`IdempotencyLayerBuilder::build`].
#[derive(Debug)]
pub struct IdempotencyLayerBuilder<E: Engine> {
    layer: IdempotencyLayer<E>,
    redaction: Redaction,
    statuses: StatusRules,
}

impl<E: Engine> IdempotencyLayer<E> {
    /// A layer with the default settings: POST and PATCH covered, 1 MiB bodies, 4 MiB
    /// responses, a 30 s handler timeout under a 60 s lease.
    pub fn new(
        runner: Runner<E>,
        name: impl Into<String>,
        resolver: impl TenantResolver,
    ) -> Result<Self, LayerError> {
        Self::builder(runner, name, resolver).build()
    }

    /// A builder starting from the defaults of [`IdempotencyLayer::new`], to change them.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// use idemflow_http::{BearerTenant, HttpConfig, IdempotencyLayer};
    /// # fn example(runner: idemflow_runner::Runner<idemflow_pg::PgStore>) -> Result<(), idemflow_http::LayerError> {
    /// let layer = IdempotencyLayer::builder(runner, "orders-api.v1", BearerTenant)
    ///     .http(HttpConfig::default().max_body_bytes(64 * 1024))
    ///     .handler_timeout(Duration::from_secs(10))
    ///     .lease(Duration::from_secs(30))
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(
        runner: Runner<E>,
        name: impl Into<String>,
        resolver: impl TenantResolver,
    ) -> IdempotencyLayerBuilder<E> {
        IdempotencyLayerBuilder {
            layer: Self {
                runner,
                name: name.into(),
                resolver: Arc::new(resolver),
                config: Arc::new(HttpConfig::default()),
                settings: HandlerSettings {
                    timeout: Duration::from_secs(30),
                    max_response_bytes: 4 * 1024 * 1024,
                    redaction: Arc::new(Redaction::default()),
                    statuses: Arc::new(StatusRules::default()),
                },
                lease: Duration::from_secs(60),
                finishes: Arc::default(),
            },
            redaction: Redaction::default(),
            statuses: StatusRules::default(),
        }
    }

    fn workflow<S>(&self, inner: S) -> Result<Workflow<E>, BuildError>
    where
        S: Service<Request<Body>, Response = Response, Error = Infallible>
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let handler = Handler {
            inner,
            settings: self.settings.clone(),
        };
        Workflow::<E>::builder_on::<Unread>(self.name.clone())
            .foreign(handler)
            .lease(self.lease)
            .live_only()
            .build()
    }
}

impl<E: Engine> IdempotencyLayerBuilder<E> {
    /// What a covered request must be (methods, body size, what a request without a key gets,
    /// how long a duplicate may wait).
    pub fn http(mut self, config: HttpConfig) -> Self {
        self.layer.config = Arc::new(config);
        self
    }

    /// How long the handler may take before its attempt counts as failed. Shorter than the lease.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.layer.settings.timeout = timeout;
        self
    }

    /// How long a claim holds the key against duplicates while the handler runs.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.layer.lease = lease;
        self
    }

    /// The largest response stored; a larger one ends the request with a stored 500 problem
    /// (`response_too_large`), since the handler ran and its answer cannot be replayed.
    pub fn max_response_bytes(mut self, limit: usize) -> Self {
        self.layer.settings.max_response_bytes = limit;
        self
    }

    /// What of requests and responses is never stored.
    pub fn redaction(mut self, redaction: Redaction) -> Self {
        self.redaction = redaction;
        self
    }

    /// Which handler statuses are stored, and which mean "send it again".
    pub fn statuses(mut self, statuses: StatusRules) -> Self {
        self.statuses = statuses;
        self
    }

    /// Checks the settings: the name is a valid workflow name, the handler timeout is shorter
    /// than the lease, the response limit is not zero.
    pub fn build(self) -> Result<IdempotencyLayer<E>, LayerError> {
        let Self {
            mut layer,
            redaction,
            statuses,
        } = self;
        layer.settings.redaction = Arc::new(redaction);
        layer.settings.statuses = Arc::new(statuses);
        if layer.settings.max_response_bytes == 0 {
            return Err(LayerError::NoResponseRoom);
        }
        layer.workflow(Unreachable)?;
        crate::metrics::describe_once();
        Ok(layer)
    }
}

/// Stands in for the wrapped handler when the settings are checked, before there is one.
#[derive(Debug, Clone, Copy)]
struct Unreachable;

impl Service<Request<Body>> for Unreachable {
    type Response = Response;
    type Error = Infallible;
    type Future = std::future::Ready<Result<Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<Body>) -> Self::Future {
        std::future::ready(Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response()))
    }
}

impl<S, E: Engine> Layer<S> for IdempotencyLayer<E>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Service = IdempotencyService<S, E>;

    fn layer(&self, inner: S) -> Self::Service {
        let workflow = self.workflow(inner.clone()).unwrap_or_else(|error| {
            // The same settings built with a stand-in handler in `build`.
            unreachable!("the layer's settings were checked when it was built: {error}")
        });
        IdempotencyService {
            inner,
            runner: self.runner.clone(),
            workflow: Arc::new(workflow),
            resolver: self.resolver.clone(),
            config: self.config.clone(),
            redaction: self.settings.redaction.clone(),
            finishes: self.finishes.clone(),
        }
    }
}

/// See [`IdempotencyLayer`].
#[derive(Clone)]
pub struct IdempotencyService<S, E: Engine> {
    inner: S,
    runner: Runner<E>,
    workflow: Arc<Workflow<E>>,
    resolver: Arc<dyn TenantResolver>,
    config: Arc<HttpConfig>,
    redaction: Arc<Redaction>,
    finishes: Arc<Finishes>,
}

impl<S, E: Engine> std::fmt::Debug for IdempotencyService<S, E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("IdempotencyService")
            .field("workflow", &self.workflow.name())
            .finish_non_exhaustive()
    }
}

impl<S, E: Engine> Service<Request<Body>> for IdempotencyService<S, E>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let service = self.clone();
        Box::pin(async move { Ok(service.handle(request).await) })
    }
}

impl<S, E: Engine> IdempotencyService<S, E>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    async fn handle(self, request: Request<Body>) -> Response {
        if !self.config.covers(request.method()) || routed_to_fallback(&request) {
            return self.pass_through(request).await;
        }
        let prepared = match prepare(request, &self.config, self.resolver.as_ref(), false).await {
            Ok(prepared) => prepared,
            Err(Refusal::Answer(problem)) => return problem.into_response(),
            Err(Refusal::NoKey(request)) => return self.keyless(request).await,
        };
        let parts = &prepared.parts;
        let target = target(parts);
        let fingerprint = match fingerprint(parts.method.as_str(), &target, parts, &prepared.body) {
            Ok(fingerprint) => fingerprint,
            Err(FingerprintError::Body(error)) => {
                return respond(Ok(Outcome::Rejected(Rejection::InvalidBody(error))));
            }
            Err(FingerprintError::ContentType(why)) => {
                return ProblemType::CONTENT_TYPE_INVALID
                    .problem(why)
                    .into_response();
            }
        };
        let recorded = RecordedRequest::new(parts, &target, &prepared.body, &self.redaction);
        let request_value = match serde_json::to_value(&recorded) {
            Ok(value) => value,
            Err(error) => {
                return respond(Ok(Outcome::Rejected(Rejection::InvalidInput(
                    error.to_string(),
                ))));
            }
        };
        drop(recorded);
        let limit = wait_limit(&prepared.parts.headers, &self.config);
        let live = Live::new(prepared.parts, prepared.body);
        let Self {
            runner,
            workflow,
            finishes,
            ..
        } = self;
        let (tenant, key) = (prepared.tenant, prepared.key);
        // Held by every run of this request and by the request itself: released once the
        // last run is over, its client there or not.
        let place = prepared.place.map(Arc::new);
        // A request that may wait can be sent again once the first attempt is over: it keeps a
        // copy of what it would store, made only for it.
        let spare = limit.is_some().then(|| request_value.clone());
        let mut request_value = Some(request_value);
        let run = || {
            let (runner, workflow, finishes) = (runner.clone(), workflow.clone(), finishes.clone());
            let (tenant, key, place) = (tenant.clone(), key.clone(), place.clone());
            // Sent again only by a request that waits (run_or_wait): it has its spare.
            let request_value = request_value
                .take()
                .or_else(|| spare.clone())
                .unwrap_or_default();
            // Once claimed, the handler runs to its end whatever the client does: hyper drops
            // this future when the client goes away, and a handler stopped halfway (after a
            // charge, before its insert) would be run again from the start after the lease.
            tokio::spawn(LIVE.scope(live.clone(), async move {
                let result = runner
                    .run_fingerprinted(&workflow, &tenant, &key, fingerprint, request_value)
                    .await;
                if ends_a_hold(&result) {
                    finishes.finished(&tenant, &key);
                }
                drop(place);
                result
            }))
        };
        let waiting = Waiting {
            runner: &runner,
            finishes: &finishes,
            workflow: workflow.name(),
            tenant: &tenant,
            key: &key,
            limit,
        };
        let (ran, waited) = run_or_wait(waiting, run).await;
        let response = match ran {
            Ok(result) => answered(&tenant, &key, result.is_err(), || answer(result, &live)),
            Err(error) => {
                // Phases' panics are caught by the runner; this is the runner's own.
                tracing::error!(%error, "the request's task failed");
                crate::problem::internal_error().into_response()
            }
        };
        preference_applied(response, limit.filter(|_| waited))
    }

    /// A covered request without a key: counted, then refused or let through by its route's
    /// key mode.
    async fn keyless(self, request: Request<Body>) -> Response {
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map(|matched| matched.as_str().to_owned());
        let mode = self.config.key_mode_of(route.as_deref());
        crate::metrics::keyless(self.workflow.name(), route.as_deref(), mode);
        match mode {
            KeyMode::Enforce => key_problem(&KeyHeaderError::Missing).into_response(),
            KeyMode::Observe => self.pass_through(request).await,
        }
    }

    async fn pass_through(self, request: Request<Body>) -> Response {
        self.inner
            .oneshot(request)
            .await
            .unwrap_or_else(|never| match never {})
    }
}

/// Makes the answer to a request with `make`. A run that failed (`failed`) is answered in a span
/// naming its tenant and key, as the runner's own span does, so what the answer logs (a busy
/// database, at WARN) names the key; an outcome is answered without one, so no request pays
/// for a span it would not log in.
pub(crate) fn answered<R>(
    tenant: &idemflow_core::TenantId,
    key: &idemflow_core::Key,
    failed: bool,
    make: impl FnOnce() -> R,
) -> R {
    if failed {
        tracing::info_span!("idemflow.answer", tenant = %tenant, key = %key).in_scope(make)
    } else {
        make()
    }
}

/// The answer to the attempt: the handler's own response where this attempt ran the handler
/// (its `Set-Cookie` and other unstored headers included), else the outcome's.
fn answer(result: Result<Outcome, idemflow_runner::RunError>, live: &Live) -> Response {
    let Some(kept) = live.take_answer() else {
        return respond(result);
    };
    match result {
        Ok(Outcome::Executed(stored)) => match kept.stored(stored) {
            Ok(response) => response,
            Err(stored) => respond(Ok(Outcome::Executed(stored))),
        },
        Ok(Outcome::Forgotten(forgotten)) => kept
            .unstored()
            .unwrap_or_else(|| respond(Ok(Outcome::Forgotten(forgotten)))),
        Ok(Outcome::Interrupted { retry_after, error }) => match kept.unstored() {
            Some(mut response) => {
                if !response.headers().contains_key(header::RETRY_AFTER) {
                    response
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from(seconds(retry_after)));
                }
                response
            }
            None => respond(Ok(Outcome::Interrupted { retry_after, error })),
        },
        other => respond(other),
    }
}

/// How long a duplicate of this request may wait for the first attempt's answer: what its
/// `Prefer: wait` asks, bounded by the server's maximum; `None` if it asks for no wait, or the
/// server allows none.
pub(crate) fn wait_limit(headers: &axum::http::HeaderMap, config: &HttpConfig) -> Option<Duration> {
    let asked = Duration::from_secs(crate::prefer::wait(headers)?);
    Some(asked.min(config.max_wait)).filter(|limit| !limit.is_zero())
}

/// `Preference-Applied: wait=N` on the answer to a request that waited (`limit`: how long it
/// could), in whole seconds as it was asked.
pub(crate) fn preference_applied(mut response: Response, limit: Option<Duration>) -> Response {
    if let Some(limit) = limit
        && let Ok(applied) = HeaderValue::try_from(format!("wait={}", seconds(limit)))
    {
        response
            .headers_mut()
            .insert(crate::prefer::PREFERENCE_APPLIED, applied);
    }
    response
}

/// Under a router mounted with `.layer(…)`, a request no route matched reaches the layer on
/// its way to the fallback: axum has set `OriginalUri` but no `MatchedPath`. Such a request is
/// a routing refusal (404), not a request to make idempotent; a key sent with it is not spent.
fn routed_to_fallback(request: &Request<Body>) -> bool {
    let extensions = request.extensions();
    extensions.get::<OriginalUri>().is_some() && extensions.get::<MatchedPath>().is_none()
}
