//! The plain-handler layer: any handler behind it gets idempotency. The key is claimed (and the
//! claim committed) before the handler runs; its response, whatever it is, is stored; retries get
//! it back. The handler is one foreign phase: it runs outside the key's transaction, so a crash
//! while it runs means a retry after the lease runs it again (at least once), exactly as a
//! foreign call would be repeated. Work that must be exactly once belongs in a workflow's local
//! phases.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderName, Request};
use axum::response::{IntoResponse, Response};
use idemflow_core::{DerivedKey, Fingerprint, StoredResponse, canonicalize};
use idemflow_runner::{
    ForeignPhase, PhaseContext, PhaseError, Rejection, RetryPolicy, Runner, Workflow,
};
use serde::{Deserialize, Serialize};
use tower::{Layer, Service, ServiceExt};

use crate::config::HttpConfig;
use crate::prepare::{Refusal, prepare, target};
use crate::problem::respond;
use crate::tenant::TenantResolver;

/// Headers never stored with a request: credentials stay out of the database. On the live
/// attempt the handler gets them from the request itself.
const UNRECORDED_HEADERS: [&str; 4] = [
    "authorization",
    "cookie",
    "proxy-authorization",
    "idempotency-key",
];

/// Response headers not stored: they describe one transfer, not the response.
const TRANSFER_HEADERS: [&str; 5] = [
    "connection",
    "content-length",
    "date",
    "transfer-encoding",
    "keep-alive",
];

tokio::task_local! {
    /// The live request's credentials, visible to the handler phase of this very attempt.
    static LIVE_HEADERS: HeaderMap;
}

/// Gives idempotency to the handlers it wraps. `name` is the workflow name its keys are stored
/// under (version it, like a workflow: `orders-api.v1`).
#[derive(Clone)]
pub struct IdempotencyLayer {
    runner: Runner,
    name: String,
    resolver: Arc<dyn TenantResolver>,
    config: Arc<HttpConfig>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("IdempotencyLayer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    pub fn new(runner: Runner, name: impl Into<String>, resolver: impl TenantResolver) -> Self {
        Self::with_config(runner, name, resolver, HttpConfig::default())
    }

    pub fn with_config(
        runner: Runner,
        name: impl Into<String>,
        resolver: impl TenantResolver,
        config: HttpConfig,
    ) -> Self {
        Self {
            runner,
            name: name.into(),
            resolver: Arc::new(resolver),
            config: Arc::new(config),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let handler = Handler {
            inner: inner.clone(),
            timeout: self.config.handler_timeout,
        };
        let workflow = Workflow::builder::<RecordedRequest>(self.name.clone())
            .foreign(handler)
            .lease(self.config.lease)
            .build()
            .unwrap_or_else(|error| {
                panic!("the idempotency layer's configuration is invalid: {error}")
            });
        IdempotencyService {
            inner,
            runner: self.runner.clone(),
            workflow: Arc::new(workflow),
            resolver: self.resolver.clone(),
            config: self.config.clone(),
        }
    }
}

/// See [`IdempotencyLayer`].
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    runner: Runner,
    workflow: Arc<Workflow>,
    resolver: Arc<dyn TenantResolver>,
    config: Arc<HttpConfig>,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("IdempotencyService")
            .field("workflow", &self.workflow.name())
            .finish_non_exhaustive()
    }
}

impl<S> Service<Request<Body>> for IdempotencyService<S>
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

impl<S> IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    async fn handle(self, request: Request<Body>) -> Response {
        if !self.config.covers(request.method()) {
            return self
                .inner
                .oneshot(request)
                .await
                .unwrap_or_else(|never| match never {});
        }
        let prepared = match prepare(request, &self.config, self.resolver.as_ref(), false).await {
            Ok(prepared) => prepared,
            Err(Refusal::Answer(problem)) => return problem.into_response(),
            Err(Refusal::PassThrough(request)) => {
                return self
                    .inner
                    .oneshot(request)
                    .await
                    .unwrap_or_else(|never| match never {});
            }
        };
        let method = prepared.parts.method.as_str();
        let path = target(&prepared.parts);
        let fingerprint = if prepared.json {
            match canonicalize(&prepared.body) {
                Ok(canonical) => Fingerprint::of_canonical_json(method, path, &canonical),
                Err(error) => {
                    return respond(Ok(idemflow_runner::Outcome::Rejected(
                        Rejection::InvalidBody(error),
                    )));
                }
            }
        } else {
            let content_type = prepared
                .parts
                .headers
                .get(axum::http::header::CONTENT_TYPE)
                .and_then(|value| value.to_str().ok())
                .unwrap_or("");
            Fingerprint::of_raw(method, path, content_type, &prepared.body)
        };
        let recorded = RecordedRequest::new(&prepared.parts, &prepared.body);
        let request_value = match serde_json::to_value(&recorded) {
            Ok(value) => value,
            Err(error) => {
                return respond(Ok(idemflow_runner::Outcome::Rejected(
                    Rejection::InvalidInput(error.to_string()),
                )));
            }
        };
        let live = live_credentials(&prepared.parts.headers);
        let run = self.runner.run_fingerprinted(
            &self.workflow,
            &prepared.tenant,
            prepared.key.as_str(),
            fingerprint,
            request_value,
        );
        respond(LIVE_HEADERS.scope(live, run).await)
    }
}

fn live_credentials(headers: &HeaderMap) -> HeaderMap {
    let mut live = HeaderMap::new();
    for name in UNRECORDED_HEADERS {
        for value in headers.get_all(name) {
            live.append(HeaderName::from_static(name), value.clone());
        }
    }
    live
}

/// A request as stored with its key: what the handler phase rebuilds it from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordedRequest {
    method: String,
    uri: String,
    headers: Vec<(String, String)>,
    body: RecordedBody,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum RecordedBody {
    Text(String),
    Bytes(Vec<u8>),
}

impl RecordedRequest {
    fn new(parts: &axum::http::request::Parts, body: &[u8]) -> Self {
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| !UNRECORDED_HEADERS.contains(&name.as_str()))
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect();
        let body = match std::str::from_utf8(body) {
            Ok(text) => RecordedBody::Text(text.to_owned()),
            Err(_) => RecordedBody::Bytes(body.to_vec()),
        };
        Self {
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            headers,
            body,
        }
    }

    fn rebuild(self) -> Result<Request<Body>, PhaseError> {
        let mut builder = Request::builder()
            .method(self.method.as_str())
            .uri(self.uri.as_str());
        for (name, value) in &self.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let body = match self.body {
            RecordedBody::Text(text) => Body::from(text),
            RecordedBody::Bytes(bytes) => Body::from(bytes),
        };
        let mut request = builder
            .body(body)
            .map_err(|error| PhaseError::terminal(format!("stored request: {error}")))?;
        // The live attempt's credentials; a resumed attempt has none.
        let _ = LIVE_HEADERS.try_with(|live| {
            for (name, value) in live {
                request.headers_mut().append(name.clone(), value.clone());
            }
        });
        Ok(request)
    }
}

/// The wrapped handler, as a foreign phase.
struct Handler<S> {
    inner: S,
    timeout: Duration,
}

#[async_trait::async_trait]
impl<S> ForeignPhase for Handler<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    const NAME: &'static str = "handler";
    type Input = RecordedRequest;
    type Output = StoredResponse;

    fn timeout(&self) -> Duration {
        self.timeout
    }

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    async fn call(
        &self,
        recorded: RecordedRequest,
        _: &DerivedKey,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let request = recorded.rebuild()?;
        let response = self
            .inner
            .clone()
            .oneshot(request)
            .await
            .unwrap_or_else(|never| match never {});
        let (parts, body) = response.into_parts();
        let body = axum::body::to_bytes(body, usize::MAX)
            .await
            .map_err(|error| {
                PhaseError::retryable(format!("reading the handler's response: {error}"))
            })?;
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| !TRANSFER_HEADERS.contains(&name.as_str()))
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect();
        Ok(StoredResponse {
            status: parts.status.as_u16(),
            headers,
            body: body.to_vec(),
        })
    }
}
