//! The http workload: the checkout and the replay through the HTTP route (idemflow_http's
//! WorkflowService under axum) on 127.0.0.1, driven by a reqwest client over loopback, and the
//! same through a hand-written axum handler sending the raw statements (the HTTP baseline),
//! interleaved at each client count. The server and client here also serve the wire, sqlite,
//! mariadb and redis workloads.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing;
use axum::serve::ListenerExt;
use idemflow::{Engine, Runner, Workflow};
use idemflow_http::{BearerTenant, WorkflowService};
use sqlx::PgPool;
use tokio::task::JoinHandle;

use crate::Error;
use crate::raw::{self, Shape};
use crate::report::{HTTP, HTTP_CHECKOUT, HTTP_RAW, HTTP_REPLAY, Report, Target};
use crate::requests::{fresh_key, replay_key};
use crate::timed::{Op, Sample, interleaved, timed};
use crate::workflows::{self, BODY, PATH, TENANT};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "http",
    number: Some(7),
    measures: "checkout and replay through the HTTP route vs a hand-written axum handler",
    runs: Runs::AtEachClientCount(run),
    targets: Some(targets),
    section: None,
};

const PLAN: &[(&str, &str)] = &[
    (HTTP_CHECKOUT, HTTP),
    (HTTP_CHECKOUT, HTTP_RAW),
    (HTTP_REPLAY, HTTP),
    (HTTP_REPLAY, HTTP_RAW),
];

fn run<'a>(ctx: &'a Ctx<'a>, clients: usize, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        report
            .runs
            .extend(interleaved(ctx, clients, PLAN, sample).await?);
        Ok(())
    })
}

/// A timed sample: POSTs from `clients` clients to the engine's route, or to the hand-written
/// handler for [`HTTP_RAW`]; new keys, or the seeded finished keys for [`HTTP_REPLAY`].
fn sample<'a>(
    ctx: &'a Ctx<'a>,
    workload: &'static str,
    variant: &'static str,
    clients: usize,
    duration: Duration,
) -> BoxFuture<'a, Sample> {
    Box::pin(async move {
        let mark = ctx.scratch.mark().await?;
        let pool = ctx.scratch.pool(clients).await?;
        let server = if variant == HTTP_RAW {
            serve_raw(pool.clone(), ctx.shape.clone()).await?
        } else {
            serve(
                Runner::new(pool.clone()),
                Arc::new(workflows::checkout(None)?),
            )
            .await?
        };
        let client = client(clients)?;
        let replay_keys = (workload == HTTP_REPLAY).then_some(ctx.config.replay_keys);
        let prefix = ctx.prefix(workload);
        let shared = Arc::new((client, server.url.clone()));
        let op: Op = Arc::new(move |client_id, sequence| {
            let shared = shared.clone();
            let key = match replay_keys {
                Some(keys) => replay_key(client_id, sequence, keys),
                None => fresh_key(&prefix, client_id, sequence),
            };
            Box::pin(async move {
                let (client, url) = &*shared;
                post(client, url, &key, replay_keys.is_some()).await?;
                Ok(None)
            })
        });
        let sample = timed(ctx, clients, duration, pool, mark, op).await;
        drop(server);
        sample
    })
}

/// The engine's route ÷ the hand-written handler ≥ 1.0× at 8 and 32 clients, for the checkout
/// and the replay.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    for workload in [HTTP_CHECKOUT, HTTP_REPLAY] {
        targets.extend(report.against_raw(workload, HTTP, HTTP_RAW));
    }
}

/// The HTTP service, serving until dropped.
#[derive(Debug)]
pub struct Server {
    pub url: String,
    task: JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve<E: Engine>(
    runner: Runner<E>,
    workflow: Arc<Workflow<E>>,
) -> Result<Server, Error> {
    let service = WorkflowService::new(runner, workflow, BearerTenant);
    serve_router(Router::new().route_service(PATH, service)).await
}

/// The HTTP baseline: an axum handler as a service without the engine would write it (the body
/// parsed as JSON, the key from its header, the raw statements with sqlx), on the same server
/// and client as the engine's route.
pub async fn serve_raw(pool: PgPool, shape: Shape) -> Result<Server, Error> {
    let router = Router::new()
        .route(PATH, routing::post(raw_handler))
        .with_state(Arc::new((pool, shape)));
    serve_router(router).await
}

async fn raw_handler(
    State(state): State<Arc<(PgPool, Shape)>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = match raw_key(&headers, &body) {
        Ok(key) => key,
        Err(why) => return bad_request(why),
    };
    let (pool, shape) = &*state;
    match raw::answer(pool, shape, key).await {
        Ok((replayed, status, stored_headers, body)) => {
            let mut response = (
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                body,
            )
                .into_response();
            for (name, value) in stored_headers {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::try_from(name.as_str()),
                    HeaderValue::try_from(value.as_str()),
                ) {
                    response.headers_mut().insert(name, value);
                }
            }
            if replayed {
                response
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            response
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}

pub(crate) async fn serve_router(router: Router) -> Result<Server, Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let address = listener.local_addr()?;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(Server {
        url: format!("http://{address}{PATH}"),
        task,
    })
}

pub fn client(clients: usize) -> Result<reqwest::Client, Error> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(clients.max(1))
        .tcp_nodelay(true)
        .build()?)
}

/// One POST under `key`; `replayed` says which answer is expected.
pub async fn post(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    replayed: bool,
) -> Result<(), Error> {
    let response = client
        .post(url)
        .header("idempotency-key", key)
        .header("authorization", format!("Bearer {TENANT}"))
        .header("content-type", "application/json")
        .body(BODY)
        .send()
        .await?;
    let status = response.status().as_u16();
    let was_replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.bytes().await?;
    if status != 201 || was_replayed != replayed {
        return Err(format!(
            "POST {key}: {status} (replayed: {was_replayed}, expected {replayed}): {}",
            String::from_utf8_lossy(&body)
        )
        .into());
    }
    Ok(())
}

/// What a hand-written handler checks first: the key from its header, and a body that parses as
/// JSON; else why it answers 400 ([`bad_request`]).
pub(crate) fn raw_key<'a>(headers: &'a HeaderMap, body: &Bytes) -> Result<&'a str, &'static str> {
    let key = headers
        .get("idempotency-key")
        .and_then(|key| key.to_str().ok())
        .ok_or("no idempotency key")?;
    if serde_json::from_slice::<serde_json::Value>(body).is_err() {
        return Err("the body is not JSON");
    }
    Ok(key)
}

/// The 400 a hand-written handler answers with.
pub(crate) fn bad_request(why: &'static str) -> Response {
    (StatusCode::BAD_REQUEST, why).into_response()
}

/// A hand-written handler's answer: `(replayed, status, body)` as JSON, marked when replayed; an
/// error as a 500.
pub(crate) fn raw_answer(answer: Result<(bool, i64, Vec<u8>), Error>) -> Response {
    match answer {
        Ok((replayed, status, body)) => {
            let status = u16::try_from(status)
                .ok()
                .and_then(|status| StatusCode::from_u16(status).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = (status, body).into_response();
            response
                .headers_mut()
                .insert("content-type", HeaderValue::from_static("application/json"));
            if replayed {
                response
                    .headers_mut()
                    .insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            response
        }
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error.to_string()).into_response(),
    }
}
