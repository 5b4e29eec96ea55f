//! A route that runs a registered multi-phase workflow: its JSON body is the workflow's request.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::MatchedPath;
use axum::http::{HeaderValue, Request, header};
use axum::response::{IntoResponse, Response};
use idemflow_runner::{Engine, Request as RunRequest, Runner, Workflow};

use crate::ProblemType;
use crate::config::{HttpConfig, KeyMode};
use crate::extract::key_problem;
use crate::key_header::KeyHeaderError;
use crate::layer::{answered, preference_applied, wait_limit};
use crate::prepare::{Prepared, Refusal, prepare, target};
use crate::problem::respond;
use crate::tenant::TenantResolver;
use crate::wait::{Finishes, Waiting, ends_a_hold, run_or_wait};

/// A tower service (use with `Router::route_service`) that runs `workflow` for each covered
/// request under its `Idempotency-Key`, and answers with the outcome.
///
/// ```no_run
/// use axum::Router;
/// use idemflow_http::{BearerTenant, WorkflowService};
/// use idemflow_pg::PgStore;
/// use idemflow_runner::{Runner, Workflow};
///
/// # fn example(runner: Runner<PgStore>, checkout: Workflow<PgStore>) {
/// // `checkout` takes the route's JSON body as its request; POST only.
/// let app: Router = Router::new()
///     .route_service("/v1/checkouts", WorkflowService::new(runner, checkout, BearerTenant));
/// # }
/// ```
#[derive(Clone)]
pub struct WorkflowService<E: Engine> {
    runner: Runner<E>,
    workflow: Arc<Workflow<E>>,
    resolver: Arc<dyn TenantResolver>,
    config: Arc<HttpConfig>,
    finishes: Arc<Finishes>,
}

impl<E: Engine> std::fmt::Debug for WorkflowService<E> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("WorkflowService")
            .field("workflow", &self.workflow.name())
            .finish_non_exhaustive()
    }
}

impl<E: Engine> WorkflowService<E> {
    /// A service with [`HttpConfig::for_workflow`]: POST only, 1 MiB bodies, key required.
    pub fn new(
        runner: Runner<E>,
        workflow: impl Into<Arc<Workflow<E>>>,
        resolver: impl TenantResolver,
    ) -> Self {
        Self::with_config(runner, workflow, resolver, HttpConfig::for_workflow())
    }

    /// A service with its own settings: which methods run the workflow (others get 405), the
    /// body limit, how long a duplicate may wait. The key is required whatever the key mode
    /// says: a workflow's run is its key's, and there is no handler to pass a request without
    /// one to.
    pub fn with_config(
        runner: Runner<E>,
        workflow: impl Into<Arc<Workflow<E>>>,
        resolver: impl TenantResolver,
        config: HttpConfig,
    ) -> Self {
        crate::metrics::describe_once();
        Self {
            runner,
            workflow: workflow.into(),
            resolver: Arc::new(resolver),
            config: Arc::new(config),
            finishes: Arc::default(),
        }
    }

    async fn handle(self, request: Request<Body>) -> Response {
        if !self.config.covers(request.method()) {
            let allow = self
                .config
                .methods
                .iter()
                .map(|method| method.as_str())
                .collect::<Vec<_>>()
                .join(", ");
            let mut response = ProblemType::METHOD_NOT_ALLOWED
                .problem(format!("this endpoint takes {allow}"))
                .into_response();
            if let Ok(allow) = HeaderValue::try_from(allow) {
                response.headers_mut().insert(header::ALLOW, allow);
            }
            return response;
        }
        let prepared = match prepare(request, &self.config, self.resolver.as_ref(), true).await {
            Ok(prepared) => prepared,
            Err(Refusal::Answer(problem)) => return problem.into_response(),
            Err(Refusal::NoKey(request)) => {
                let route = request.extensions().get::<MatchedPath>();
                let route = route.map(MatchedPath::as_str);
                crate::metrics::keyless(self.workflow.name(), route, KeyMode::Enforce);
                return key_problem(&KeyHeaderError::Missing).into_response();
            }
        };
        let target = Arc::<str>::from(target(&prepared.parts));
        let limit = wait_limit(&prepared.parts.headers, &self.config);
        let Self {
            runner,
            workflow,
            finishes,
            ..
        } = self;
        let Prepared {
            parts,
            key,
            tenant,
            body,
            place,
        } = prepared;
        // Held by every run of this request and by the request itself.
        let place = place.map(Arc::new);
        let run = || {
            let (runner, workflow, finishes) = (runner.clone(), workflow.clone(), finishes.clone());
            let (tenant, key, place) = (tenant.clone(), key.clone(), place.clone());
            let (method, target, body) = (parts.method.clone(), target.clone(), body.clone());
            // Once claimed, the run goes on to its end whatever the client does (hyper drops
            // this future when the client goes away): a run stopped halfway waits out its lease.
            tokio::spawn(async move {
                let request = RunRequest {
                    method: method.as_str(),
                    path: &target,
                    body: &body,
                };
                let result = runner.run(&workflow, &tenant, &key, request).await;
                if ends_a_hold(&result) {
                    finishes.finished(&tenant, &key);
                }
                drop(place); // the run is over, its client there or not
                result
            })
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
            Ok(result) => answered(&tenant, &key, result.is_err(), || respond(result)),
            Err(error) => {
                tracing::error!(%error, "the request's task failed");
                crate::problem::internal_error().into_response()
            }
        };
        preference_applied(response, limit.filter(|_| waited))
    }
}

impl<E: Engine> tower::Service<Request<Body>> for WorkflowService<E> {
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
