//! A duplicate that asks to wait (`Prefer: wait=N`, RFC 7240) while the first attempt runs is
//! held until that attempt stores its response, then gets it replayed as a retry would, or gets
//! 409 once N seconds (at most the server's `max_wait`) have passed; it holds no database
//! connection meanwhile. A real server on loopback, reqwest, a real PostgreSQL; the first
//! attempt's handler waits on a gate the test opens.
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use idemflow_http::{BearerTenant, HttpConfig, IdempotencyLayer};
use idemflow_runner::Runner;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio::sync::Semaphore;

/// Long enough for anything that should happen at once, on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(3);

/// The handler's side: how many times it ran, and the gate each run waits at.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

impl Handler {
    fn new() -> Self {
        Self {
            runs: Arc::new(AtomicUsize::new(0)),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn open(&self) {
        self.gate.add_permits(1000);
    }

    async fn until_running(&self, runs: usize) {
        let start = Instant::now();
        while self.runs.load(Ordering::SeqCst) < runs {
            assert!(start.elapsed() < PATIENCE, "the handler never ran");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A server whose `/v1/payments` handler waits at the gate, then answers 201 with a header of
/// its own and a body naming its run.
async fn serve(pool: &PgPool, handler: &Handler, config: HttpConfig) -> SocketAddr {
    let Handler { runs, gate } = handler.clone();
    let pay = move || async move {
        let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
        gate.acquire().await.unwrap().forget();
        (
            StatusCode::CREATED,
            [("x-payment", format!("pay-{run}"))],
            format!("{{\"payment\":\"pay-{run}\",\"run\":{run}}}"),
        )
    };
    let layer = IdempotencyLayer::builder(Runner::new(pool.clone()), "payments.v1", BearerTenant)
        .http(config)
        .build()
        .unwrap();
    let router = Router::new()
        .route("/v1/payments", post(pay))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    address
}

fn pay(address: SocketAddr, key: &str, amount: u32) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("http://{address}/v1/payments"))
        .header("authorization", "Bearer acme")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("\"{key}\""))
        .body(format!("{{\"amount\":{amount}}}"))
}

/// Status, headers and body of an answer.
async fn read(response: reqwest::Response) -> (u16, reqwest::header::HeaderMap, String) {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    (status, headers, response.text().await.unwrap())
}

async fn send(request: reqwest::RequestBuilder) -> (u16, reqwest::header::HeaderMap, String) {
    read(request.send().await.unwrap()).await
}

/// Answered within `PATIENCE`, or the test fails: for answers that must not wait.
async fn promptly(request: reqwest::RequestBuilder) -> (u16, reqwest::header::HeaderMap, String) {
    tokio::time::timeout(PATIENCE, send(request))
        .await
        .expect("answered at once, not after a wait")
}

fn code(body: &str) -> String {
    let problem: serde_json::Value = serde_json::from_str(body).unwrap();
    problem["code"].as_str().unwrap().to_owned()
}

#[sqlx::test]
async fn a_waiting_duplicate_gets_the_first_response_replayed_once_it_is_stored(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let handler = Handler::new();
    let address = serve(&pool, &handler, HttpConfig::default()).await;

    let first = tokio::spawn(send(pay(address, "p-1", 100)));
    handler.until_running(1).await;
    let waiter = tokio::spawn(send(pay(address, "p-1", 100).header("prefer", "wait=5")));

    // Another request under the same key is refused at once, waiting or not.
    let (status, headers, body) =
        promptly(pay(address, "p-1", 999).header("prefer", "wait=5")).await;
    assert_eq!(status, 422);
    assert_eq!(code(&body), "idempotency_key_reused");
    assert!(headers.get("preference-applied").is_none());

    // The duplicate is held while the first runs …
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the duplicate was answered before the first finished"
    );
    handler.open();

    // … and then answered with the first's response: the stored bytes and headers, marked as a
    // replay, and says its preference was applied.
    let (status, headers, body) = first.await.unwrap();
    assert_eq!(status, 201);
    assert!(headers.get("idempotent-replayed").is_none());
    let (replayed_status, replayed_headers, replayed_body) = tokio::time::timeout(PATIENCE, waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(replayed_status, 201);
    assert_eq!(replayed_body, body);
    assert_eq!(replayed_headers["x-payment"], headers["x-payment"]);
    assert_eq!(replayed_headers["idempotent-replayed"], "true");
    assert_eq!(replayed_headers["preference-applied"], "wait=5");
    assert_eq!(
        handler.runs.load(Ordering::SeqCst),
        1,
        "the handler ran once"
    );

    // What a retry now gets is the same, with no preference applied: nothing was waited for.
    let (status, headers, again) = send(pay(address, "p-1", 100).header("prefer", "wait=5")).await;
    assert_eq!((status, again), (201, body));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert!(headers.get("preference-applied").is_none());
}

#[sqlx::test]
async fn a_wait_ends_in_409_when_the_first_is_still_running(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let handler = Handler::new();
    let config = HttpConfig::default().max_wait(Duration::from_secs(2));
    let address = serve(&pool, &handler, config).await;
    let first = tokio::spawn(send(pay(address, "p-2", 100)));
    handler.until_running(1).await;

    // Waited for, then 409 as without a wait.
    let asked = Instant::now();
    let (status, headers, body) = send(pay(address, "p-2", 100).header("prefer", "wait=1")).await;
    assert!(
        asked.elapsed() >= Duration::from_secs(1),
        "{:?}",
        asked.elapsed()
    );
    assert_eq!(status, 409);
    assert_eq!(code(&body), "request_in_progress");
    assert!(headers.get("retry-after").is_some());
    assert_eq!(headers["preference-applied"], "wait=1");

    // A wait above the server's maximum is cut to it (2 s, not 30).
    let (status, headers, _) = tokio::time::timeout(
        Duration::from_secs(10),
        send(pay(address, "p-2", 100).header("prefer", "respond-async, wait=30")),
    )
    .await
    .expect("the wait was cut to the server's maximum");
    assert_eq!(status, 409);
    assert_eq!(headers["preference-applied"], "wait=2");

    // A Prefer that does not parse, or no valid wait, is ignored: 409 at once.
    for ignored in ["wait=5 x", "wait=\"5", "wait=soon, wait=5", "wait=0"] {
        let (status, headers, body) =
            promptly(pay(address, "p-2", 100).header("prefer", ignored)).await;
        assert_eq!(status, 409, "{ignored}");
        assert_eq!(code(&body), "request_in_progress");
        assert!(headers.get("preference-applied").is_none(), "{ignored}");
    }

    handler.open();
    assert_eq!(first.await.unwrap().0, 201);
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
}

#[sqlx::test]
async fn a_server_that_allows_no_wait_answers_409_at_once(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let handler = Handler::new();
    let address = serve(
        &pool,
        &handler,
        HttpConfig::default().max_wait(Duration::ZERO),
    )
    .await;
    let first = tokio::spawn(send(pay(address, "p-3", 100)));
    handler.until_running(1).await;
    let (status, headers, _) = promptly(pay(address, "p-3", 100).header("prefer", "wait=5")).await;
    assert_eq!(status, 409);
    assert!(headers.get("preference-applied").is_none());
    handler.open();
    assert_eq!(first.await.unwrap().0, 201);
}

/// A second pool on the same database, as another process would have.
async fn another_pool(pool: &PgPool, max_connections: u32) -> PgPool {
    PgPoolOptions::new()
        .max_connections(max_connections)
        .connect_with((*pool.connect_options()).clone())
        .await
        .unwrap()
}

/// The first attempt runs in one server, the duplicate waits in another (its own pool and its
/// own wake-ups, as another process): nothing wakes it but its own looks at the key.
#[sqlx::test]
async fn a_duplicate_waiting_in_another_process_sees_the_response_by_looking(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let handler = Handler::new();
    let owner = serve(&pool, &handler, HttpConfig::default()).await;
    let other_pool = another_pool(&pool, 4).await;
    let elsewhere = serve(&other_pool, &handler, HttpConfig::default()).await;

    let first = tokio::spawn(send(pay(owner, "p-4", 100)));
    handler.until_running(1).await;
    let waiter = tokio::spawn(send(pay(elsewhere, "p-4", 100).header("prefer", "wait=5")));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!waiter.is_finished());
    handler.open();

    let (_, _, body) = first.await.unwrap();
    let (status, headers, replayed) = tokio::time::timeout(PATIENCE, waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 201);
    assert_eq!(replayed, body);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["preference-applied"], "wait=5");
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
    // Its connections closed, so the test's database can be dropped at once.
    other_pool.close().await;
}

/// The owner and its duplicate share a pool of one connection. While the duplicate waits, the
/// test takes that connection and keeps it a while: were the duplicate holding it, the test
/// could not have it, and the owner could not finish either.
#[sqlx::test]
async fn a_waiting_duplicate_holds_no_connection(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let one = another_pool(&pool, 1).await;
    let handler = Handler::new();
    let address = serve(&one, &handler, HttpConfig::default()).await;

    let first = tokio::spawn(send(pay(address, "p-5", 100)));
    handler.until_running(1).await;
    let waiter = tokio::spawn(send(pay(address, "p-5", 100).header("prefer", "wait=10")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());

    let held = tokio::time::timeout(PATIENCE, one.acquire())
        .await
        .expect("the pool's one connection is free while the duplicate waits")
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    drop(held);
    assert!(!waiter.is_finished(), "the duplicate waits on");

    handler.open();
    let (_, _, body) = tokio::time::timeout(PATIENCE, first)
        .await
        .unwrap()
        .unwrap();
    let (status, headers, replayed) = tokio::time::timeout(PATIENCE, waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 201);
    assert_eq!(replayed, body);
    assert_eq!(headers["idempotent-replayed"], "true");
    one.close().await;
}

/// A workflow's one phase, a call that waits at the test's gate.
struct Gated(Handler);

#[async_trait::async_trait]
impl idemflow_runner::ForeignPhase for Gated {
    const NAME: &'static str = "gated";
    type Input = serde_json::Value;
    type Output = idemflow_core::StoredResponse;
    async fn call(
        &self,
        _: &idemflow_core::DerivedKey,
        input: serde_json::Value,
        _: &idemflow_runner::PhaseContext,
    ) -> Result<idemflow_core::StoredResponse, idemflow_runner::PhaseError> {
        self.0.runs.fetch_add(1, Ordering::SeqCst);
        self.0.gate.acquire().await.unwrap().forget();
        Ok(idemflow_core::StoredResponse::json(201, &input))
    }
}

/// A workflow route's duplicates wait the same way.
#[sqlx::test]
async fn a_workflow_route_s_duplicate_waits_too(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let handler = Handler::new();
    let workflow = idemflow_runner::Workflow::builder::<serde_json::Value>("gated.v1")
        .foreign(Gated(handler.clone()))
        .build()
        .unwrap();
    let service =
        idemflow_http::WorkflowService::new(Runner::new(pool.clone()), workflow, BearerTenant);
    let router = Router::new().route_service("/v1/payments", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });

    let first = tokio::spawn(send(pay(address, "w-1", 100)));
    handler.until_running(1).await;
    let waiter = tokio::spawn(send(pay(address, "w-1", 100).header("prefer", "wait=5")));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished());
    handler.open();

    let (status, _, body) = first.await.unwrap();
    assert_eq!(status, 201);
    let (status, headers, replayed) = tokio::time::timeout(PATIENCE, waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((status, replayed), (201, body));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["preference-applied"], "wait=5");
    assert_eq!(handler.runs.load(Ordering::SeqCst), 1);
}
