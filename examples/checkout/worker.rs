//! The worker: a resumer for the checkout workflow, with its metrics for Prometheus and a health
//! endpoint. `worker` runs it alone; the `all` command runs the same pieces next to the service.

use std::future::Future;
use std::net::SocketAddr;

use crate::Failure;
use crate::orders::Shop;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use idemflow::{PoolOf, Registry, Resumer, Runner, Workflow};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

struct Observed<E: Shop> {
    pool: PoolOf<E>,
    metrics: PrometheusHandle,
}

impl<E: Shop> Clone for Observed<E> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            metrics: self.metrics.clone(),
        }
    }
}

/// Installs the process-wide Prometheus recorder (once per process).
pub fn install_metrics() -> Result<PrometheusHandle, Failure> {
    PrometheusBuilder::new()
        .install_recorder()
        .map_err(|error| format!("cannot install the metrics recorder: {error}").into())
}

/// `/metrics` (Prometheus text) and `/healthz` (200 while the database answers).
pub fn routes<E: Shop>(pool: PoolOf<E>, metrics: PrometheusHandle) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics::<E>))
        .route("/healthz", get(health::<E>))
        .with_state(Observed::<E> { pool, metrics })
}

/// A resumer that finishes abandoned checkouts.
pub fn resumer<E: Shop>(pool: PoolOf<E>, checkout: Workflow<E>) -> Result<Resumer<E>, Failure> {
    resumer_with(
        Runner::<E>::on(pool, idemflow::RunnerConfig::default()),
        checkout,
    )
}

/// A resumer of `checkout` keys running on `runner`.
fn resumer_with<E: Shop>(runner: Runner<E>, checkout: Workflow<E>) -> Result<Resumer<E>, Failure> {
    let mut registry = Registry::new();
    registry.register(checkout)?;
    Ok(Resumer::new(runner, registry))
}

/// The `worker` command: the resumer until `shutdown`, with `/metrics` and `/healthz` on `bind`.
pub async fn run<E: Shop>(
    pool: PoolOf<E>,
    checkout: Workflow<E>,
    bind: SocketAddr,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Failure> {
    let metrics = install_metrics()?;
    let listener = crate::bind(bind, "--metrics-bind").await?;
    let address = listener.local_addr()?;
    println!("worker: metrics on http://{address}/metrics, health on http://{address}/healthz");
    let server = tokio::spawn(
        idemflow::http::serve(
            listener,
            routes::<E>(pool.clone(), metrics),
            idemflow::http::ServeLimits::default(),
        )
        .into_future(),
    );
    let runner = Runner::<E>::on(pool, idemflow::RunnerConfig::default());
    // IDEMFLOW_CRASH_AT=<crash point>: the worker stops there for real too (tests kill it).
    let runner = match idemflow_testkit::crash::ProcessCrash::from_env(crate::service::CRASH_ENV) {
        Some(hook) => runner.with_crash_hook(hook),
        None => runner,
    };
    let resumer = resumer_with(runner, checkout)?;
    println!("worker: resuming abandoned checkouts; Ctrl-C or SIGTERM stops it gracefully");
    resumer.run(shutdown).await;
    server.abort();
    println!("worker: stopped");
    Ok(())
}

async fn render_metrics<E: Shop>(State(observed): State<Observed<E>>) -> String {
    observed.metrics.render()
}

/// Healthy while the database answers.
async fn health<E: Shop>(State(observed): State<Observed<E>>) -> (StatusCode, &'static str) {
    if E::ping(&observed.pool).await {
        (StatusCode::OK, "ok\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "database unreachable\n")
    }
}
