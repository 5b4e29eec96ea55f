//! The worker: a resumer for the checkout workflow, with its metrics for Prometheus and a health
//! endpoint. `worker` runs it alone; the `all` command runs the same pieces next to the service.

use std::future::Future;
use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use idemflow::{Registry, Resumer, Runner, Workflow};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

use crate::Failure;

#[derive(Clone)]
struct Observed {
    pool: PgPool,
    metrics: PrometheusHandle,
}

/// Installs the process-wide Prometheus recorder (once per process).
pub fn install_metrics() -> Result<PrometheusHandle, Failure> {
    PrometheusBuilder::new()
        .install_recorder()
        .map_err(|error| format!("cannot install the metrics recorder: {error}").into())
}

/// `/metrics` (Prometheus text) and `/healthz` (200 while the database answers).
pub fn routes(pool: PgPool, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(health))
        .with_state(Observed { pool, metrics })
}

/// A resumer that finishes abandoned checkouts.
pub fn resumer(pool: PgPool, checkout: Workflow) -> Result<Resumer, Failure> {
    let mut registry = Registry::new();
    registry.register(checkout)?;
    Ok(Resumer::new(Runner::new(pool), registry))
}

/// The `worker` command: the resumer until `shutdown`, with `/metrics` and `/healthz` on `bind`.
pub async fn run(
    pool: PgPool,
    checkout: Workflow,
    bind: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Failure> {
    let metrics = install_metrics()?;
    let listener = crate::bind(bind, "--metrics-bind").await?;
    let address = listener.local_addr()?;
    println!("worker: metrics on http://{address}/metrics, health on http://{address}/healthz");
    let server = tokio::spawn(
        idemflow_http::serve(
            listener,
            routes(pool.clone(), metrics),
            idemflow_http::ServeLimits::default(),
        )
        .into_future(),
    );
    let resumer = resumer(pool, checkout)?;
    println!("worker: resuming abandoned checkouts; Ctrl-C or SIGTERM stops it gracefully");
    resumer.run(shutdown).await;
    server.abort();
    println!("worker: stopped");
    Ok(())
}

async fn render_metrics(State(observed): State<Observed>) -> String {
    observed.metrics.render()
}

/// Healthy while the database answers.
async fn health(State(observed): State<Observed>) -> (StatusCode, &'static str) {
    match sqlx::query("SELECT 1").execute(&observed.pool).await {
        Ok(_) => (StatusCode::OK, "ok\n"),
        Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "database unreachable\n"),
    }
}
