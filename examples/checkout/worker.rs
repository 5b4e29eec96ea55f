//! The worker process: a resumer for the checkout workflow, with its metrics for Prometheus and
//! a health endpoint.

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use idemflow::{Registry, Resumer, Runner, Workflow};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

#[derive(Clone)]
struct Observed {
    pool: PgPool,
    metrics: PrometheusHandle,
}

/// Runs the resumer until Ctrl-C or SIGTERM, serving `/metrics` and `/healthz` on `bind`.
pub async fn run(
    pool: PgPool,
    checkout: Workflow,
    bind: SocketAddr,
) -> Result<(), Box<dyn std::error::Error>> {
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let observed = Observed {
        pool: pool.clone(),
        metrics,
    };
    let app = Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(health))
        .with_state(observed);
    let listener = tokio::net::TcpListener::bind(bind).await?;
    println!(
        "worker: metrics on http://{}/metrics, health on http://{}/healthz",
        listener.local_addr()?,
        listener.local_addr()?
    );
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let mut registry = Registry::new();
    registry.register(checkout)?;
    let resumer = Resumer::new(Runner::new(pool), registry);
    println!("worker: resuming abandoned checkouts; Ctrl-C or SIGTERM stops it gracefully");
    resumer.run(idemflow::shutdown_signal()).await;
    server.abort();
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
