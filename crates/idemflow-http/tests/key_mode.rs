//! Keys optional, then required: a covered request without an `Idempotency-Key` is refused
//! (`KeyMode::Enforce`, the default) or run once, unprotected (`KeyMode::Observe`), by route,
//! and counted either way in `idemflow_http_keyless_requests_total`, so an operator sees when
//! requiring keys breaks no client. A real server on loopback, reqwest, a real PostgreSQL.
#![allow(clippy::unwrap_used)]

use idemflow_pg::PgStore;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idemflow_http::{BearerTenant, HttpConfig, IdempotencyLayer, KeyMode, WorkflowService};
use idemflow_runner::Runner;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sqlx::PgPool;

/// One recorder for the process (the facade takes one); every test counts under a workflow
/// name of its own, so tests run side by side read only their own series.
fn metrics() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| PrometheusBuilder::new().install_recorder().unwrap())
}

/// The value of the keyless counter for these labels, 0 when no such series was recorded.
fn keyless(workflow: &str, route: &str, mode: &str) -> u64 {
    let labels = [
        format!("workflow=\"{workflow}\""),
        format!("route=\"{route}\""),
        format!("mode=\"{mode}\""),
    ];
    metrics()
        .render()
        .lines()
        .filter(|line| line.starts_with("idemflow_http_keyless_requests_total{"))
        .filter(|line| labels.iter().all(|label| line.contains(label.as_str())))
        .map(|line| line.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum()
}

/// Every series of the keyless counter of `workflow`, as rendered.
fn keyless_series(workflow: &str) -> Vec<String> {
    metrics()
        .render()
        .lines()
        .filter(|line| line.starts_with("idemflow_http_keyless_requests_total{"))
        .filter(|line| line.contains(&format!("workflow=\"{workflow}\"")))
        .map(str::to_owned)
        .collect()
}

async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    address
}

fn post_to(address: SocketAddr, path: &str, key: Option<&str>) -> reqwest::RequestBuilder {
    let request = reqwest::Client::new()
        .post(format!("http://{address}{path}"))
        .header("authorization", "Bearer acme")
        .header("content-type", "application/json")
        .body(r#"{"note": "hello"}"#);
    match key {
        Some(key) => request.header("idempotency-key", format!("\"{key}\"")),
        None => request,
    }
}

async fn keys(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Two routes behind one layer: `/v1/notes` counts its handler's runs, `/v1/strict` too.
fn router(pool: &PgPool, workflow: &str, config: HttpConfig, runs: &Arc<AtomicUsize>) -> Router {
    let handler = |runs: Arc<AtomicUsize>| {
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "noted")
        }
    };
    let layer = IdempotencyLayer::builder(Runner::new(pool.clone()), workflow, BearerTenant)
        .http(config)
        .build()
        .unwrap();
    Router::new()
        .route(
            "/v1/notes",
            post(handler(runs.clone())).get(|| async { "list" }),
        )
        .route("/v1/strict/{id}", post(handler(runs.clone())))
        .route_layer(layer)
}

#[sqlx::test]
async fn observe_runs_a_keyless_request_unprotected_and_counts_it_by_route(pool: PgPool) {
    metrics(); // installed before anything is counted
    idemflow_pg::migrate(&pool).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let config = HttpConfig::default()
        .key_mode(KeyMode::Observe)
        .route_key_mode("/v1/strict/{id}", KeyMode::Enforce);
    let address = serve(router(&pool, "observe.v1", config, &runs)).await;

    // Without a key: the handler runs, its answer is the handler's, nothing is stored; sent
    // again, it runs again (nothing protects it), and both are counted.
    for sent in 1..=2 {
        let answer = post_to(address, "/v1/notes", None).send().await.unwrap();
        assert_eq!(answer.status(), 201);
        assert!(answer.headers().get("idempotent-replayed").is_none());
        assert_eq!(answer.text().await.unwrap(), "noted");
        assert_eq!(runs.load(Ordering::SeqCst), sent);
    }
    assert_eq!(keys(&pool).await, 0, "a keyless request stores nothing");
    assert_eq!(keyless("observe.v1", "/v1/notes", "observe"), 2);

    // A route of its own mode refuses one, counted under its route (as the router names it,
    // not the path sent) and its mode.
    let refused = post_to(address, "/v1/strict/42", None)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 400);
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_key_missing");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "the refused request ran nothing"
    );
    assert_eq!(keyless("observe.v1", "/v1/strict/{id}", "enforce"), 1);

    // A request with a key is protected as ever, and not counted; nor is a method the layer
    // does not cover.
    for _ in 0..2 {
        let keyed = post_to(address, "/v1/notes", Some("n-1"))
            .send()
            .await
            .unwrap();
        assert_eq!(keyed.status(), 201);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 3, "the retry was replayed");
    let listed = reqwest::get(format!("http://{address}/v1/notes"))
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    assert_eq!(keys(&pool).await, 1);
    let series = keyless_series("observe.v1");
    assert_eq!(series.len(), 2, "{series:?}");
    assert_eq!(keyless("observe.v1", "/v1/notes", "observe"), 2);
}

#[sqlx::test]
async fn enforce_is_the_default_and_counts_what_it_refuses(pool: PgPool) {
    metrics(); // installed before anything is counted
    idemflow_pg::migrate(&pool).await.unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let address = serve(router(&pool, "enforce.v1", HttpConfig::default(), &runs)).await;

    let refused = post_to(address, "/v1/notes", None).send().await.unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_key_missing");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(keys(&pool).await, 0);
    assert_eq!(keyless("enforce.v1", "/v1/notes", "enforce"), 1);
    assert_eq!(keyless("enforce.v1", "/v1/notes", "observe"), 0);

    let keyed = post_to(address, "/v1/notes", Some("n-1"))
        .send()
        .await
        .unwrap();
    assert_eq!(keyed.status(), 201);
    assert_eq!(keyless("enforce.v1", "/v1/notes", "enforce"), 1);
}

struct Echo;

#[async_trait::async_trait]
impl idemflow_runner::LocalPhase<PgStore> for Echo {
    const NAME: &'static str = "echo";
    type Input = serde_json::Value;
    type Output = idemflow_core::StoredResponse;
    async fn run(
        &self,
        _: &mut sqlx::PgConnection,
        input: serde_json::Value,
        _: &idemflow_runner::PhaseContext,
    ) -> Result<idemflow_core::StoredResponse, idemflow_runner::PhaseError> {
        Ok(idemflow_core::StoredResponse::json(200, &input))
    }
}

/// A workflow route has no handler to pass a request without a key to: it refuses it whatever
/// its configuration says, and counts it as refused.
#[sqlx::test]
async fn a_workflow_route_enforces_whatever_its_mode_and_counts(pool: PgPool) {
    metrics(); // installed before anything is counted
    idemflow_pg::migrate(&pool).await.unwrap();
    let workflow = idemflow_runner::Workflow::builder::<serde_json::Value>("echo-route.v1")
        .local(Echo)
        .build()
        .unwrap();
    let service = WorkflowService::with_config(
        Runner::new(pool.clone()),
        workflow,
        BearerTenant,
        HttpConfig::for_workflow().key_mode(KeyMode::Observe),
    );
    let address = serve(Router::new().route_service("/v1/echo", service)).await;

    let refused = post_to(address, "/v1/echo", None).send().await.unwrap();
    assert_eq!(refused.status(), 400);
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_key_missing");
    assert_eq!(keyless("echo-route.v1", "/v1/echo", "enforce"), 1);
    assert_eq!(keyless("echo-route.v1", "/v1/echo", "observe"), 0);
    assert_eq!(keys(&pool).await, 0);
}
