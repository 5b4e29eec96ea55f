//! Every status path through an axum router, in process (`oneshot`) and over loopback, against a
//! real PostgreSQL.
#![allow(clippy::unwrap_used)]

use idemflow_pg::PgStore;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use idemflow_core::{DerivedKey, StoredResponse};
use idemflow_http::{BearerTenant, HttpConfig, IdempotencyLayer, WorkflowService};
use idemflow_runner::{ForeignPhase, LocalPhase, PhaseContext, PhaseError, Runner, Workflow};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tower::ServiceExt;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Checkout {
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: i64,
    amount: i64,
}

struct CreateOrder;

#[async_trait::async_trait]
impl LocalPhase<PgStore> for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = Order;
    async fn run(
        &self,
        connection: &mut PgConnection,
        input: Checkout,
        _: &PhaseContext,
    ) -> Result<Order, PhaseError> {
        let (id,): (i64,) = sqlx::query_as("INSERT INTO orders (amount) VALUES ($1) RETURNING id")
            .bind(input.amount)
            .fetch_one(connection)
            .await?;
        Ok(Order {
            id,
            amount: input.amount,
        })
    }
}

#[derive(Default)]
struct Provider {
    calls: AtomicUsize,
    fail_next: AtomicUsize,
    panic_next: AtomicUsize,
    delay_ms: AtomicUsize,
}

struct Charge(Arc<Provider>);

#[async_trait::async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = "charge";
    type Input = Order;
    type Output = Order;
    fn timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
    async fn call(
        &self,
        _: &DerivedKey,
        order: Order,
        _: &PhaseContext,
    ) -> Result<Order, PhaseError> {
        self.0.calls.fetch_add(1, Ordering::SeqCst);
        let delay = self.0.delay_ms.load(Ordering::SeqCst) as u64;
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if self.0.panic_next.swap(0, Ordering::SeqCst) > 0 {
            panic!("a bug in the charge phase");
        }
        if self.0.fail_next.swap(0, Ordering::SeqCst) > 0 {
            return Err(PhaseError::retry_after(
                "provider unavailable",
                Duration::from_secs(5),
            ));
        }
        Ok(order)
    }
}

struct MarkPaid;

#[async_trait::async_trait]
impl LocalPhase<PgStore> for MarkPaid {
    const NAME: &'static str = "mark_paid";
    type Input = Order;
    type Output = StoredResponse;
    async fn run(
        &self,
        connection: &mut PgConnection,
        order: Order,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query("UPDATE orders SET paid = true WHERE id = $1")
            .bind(order.id)
            .execute(connection)
            .await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"order_id": order.id, "amount": order.amount}),
        ))
    }
}

async fn setup(pool: &PgPool) {
    idemflow_pg::migrate(pool).await.unwrap();
    sqlx::query("CREATE TABLE orders (id bigserial PRIMARY KEY, amount bigint NOT NULL, paid boolean NOT NULL DEFAULT false)")
        .execute(pool)
        .await
        .unwrap();
}

fn checkout_router(pool: &PgPool, provider: &Arc<Provider>, config: HttpConfig) -> Router {
    let workflow = Workflow::builder::<Checkout>("checkout.v1")
        .validate(|checkout| {
            if checkout.amount > 0 {
                Ok(())
            } else {
                Err("amount must be positive".into())
            }
        })
        .local(CreateOrder)
        .foreign(Charge(provider.clone()))
        .local(MarkPaid)
        .build()
        .unwrap();
    let service =
        WorkflowService::with_config(Runner::new(pool.clone()), workflow, BearerTenant, config);
    Router::new().route_service("/v1/checkouts", service)
}

fn post_request(key: Option<&str>, body: &str) -> Request<Body> {
    let mut builder = Request::builder()
        .method("POST")
        .uri("/v1/checkouts")
        .header(header::AUTHORIZATION, "Bearer acme")
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

async fn send(
    router: &Router,
    request: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, serde_json::Value) {
    let response = router.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    let json = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (parts.status, parts.headers, json)
}

async fn rows(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[sqlx::test]
async fn a_first_request_executes_and_a_retry_replays_with_the_marker(pool: PgPool) {
    setup(&pool).await;
    let provider = Arc::new(Provider::default());
    let router = checkout_router(&pool, &provider, HttpConfig::default());
    let (status, headers, body) =
        send(&router, post_request(Some("\"k1\""), r#"{"amount": 100}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    let (status, headers, replayed) =
        send(&router, post_request(Some("k1"), r#"{ "amount" : 100 }"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(replayed, body);
    assert_eq!(provider.calls.load(Ordering::SeqCst), 1);
}

#[sqlx::test]
async fn every_refusal_is_a_problem_and_stores_nothing(pool: PgPool) {
    setup(&pool).await;
    let provider = Arc::new(Provider::default());
    let config = HttpConfig::default().max_body_bytes(64);
    let router = checkout_router(&pool, &provider, config);

    let no_key = post_request(None, r#"{"amount": 1}"#);
    let bad_key = post_request(Some("\"unterminated"), r#"{"amount": 1}"#);
    let long_key = post_request(Some(&"k".repeat(256)), r#"{"amount": 1}"#);
    let mut no_tenant = post_request(Some("k"), r#"{"amount": 1}"#);
    no_tenant.headers_mut().remove(header::AUTHORIZATION);
    let mut not_json = post_request(Some("k"), "amount=1");
    not_json.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/x-www-form-urlencoded".parse().unwrap(),
    );
    let too_large = post_request(
        Some("k"),
        &format!(r#"{{"amount": 1, "pad": "{}"}}"#, "x".repeat(100)),
    );
    let invalid_json = post_request(Some("k"), r#"{"amount": 1"#);
    let duplicate_member = post_request(Some("k"), r#"{"amount": 1, "amount": 2}"#);
    let wrong_shape = post_request(Some("k"), r#"{"amount": "one"}"#);
    let failed_check = post_request(Some("k"), r#"{"amount": -5}"#);
    let get = Request::builder()
        .uri("/v1/checkouts")
        .body(Body::empty())
        .unwrap();

    let cases = [
        (no_key, StatusCode::BAD_REQUEST, "idempotency_key_missing"),
        (bad_key, StatusCode::BAD_REQUEST, "idempotency_key_invalid"),
        (long_key, StatusCode::BAD_REQUEST, "idempotency_key_invalid"),
        (no_tenant, StatusCode::UNAUTHORIZED, "unauthorized"),
        (
            not_json,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (too_large, StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
        (invalid_json, StatusCode::BAD_REQUEST, "body_invalid"),
        (duplicate_member, StatusCode::BAD_REQUEST, "body_invalid"),
        (
            wrong_shape,
            StatusCode::UNPROCESSABLE_ENTITY,
            "request_invalid",
        ),
        (
            failed_check,
            StatusCode::UNPROCESSABLE_ENTITY,
            "request_invalid",
        ),
        (get, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
    ];
    for (request, status, code) in cases {
        let (got, headers, body) = send(&router, request).await;
        assert_eq!((got, body["code"].as_str()), (status, Some(code)), "{body}");
        assert_eq!(headers[header::CONTENT_TYPE], "application/problem+json");
        assert_eq!(body["status"], status.as_u16());
    }
    assert_eq!(
        rows(&pool).await,
        0,
        "nothing stored for any refused request"
    );
    assert_eq!(provider.calls.load(Ordering::SeqCst), 0);
}

#[sqlx::test]
async fn reuse_conflict_and_interruption_have_their_statuses(pool: PgPool) {
    setup(&pool).await;
    let provider = Arc::new(Provider::default());
    let router = checkout_router(&pool, &provider, HttpConfig::default());
    assert_eq!(
        send(&router, post_request(Some("k"), r#"{"amount": 1}"#))
            .await
            .0,
        StatusCode::CREATED
    );

    // Same key, another request.
    let (status, _, body) = send(&router, post_request(Some("k"), r#"{"amount": 2}"#)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("idempotency_key_reused")
        )
    );

    // Interrupted: the provider fails; the key is resumable, the client is told when to retry.
    provider.fail_next.store(1, Ordering::SeqCst);
    let (status, headers, body) =
        send(&router, post_request(Some("flaky"), r#"{"amount": 3}"#)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, Some("interrupted"))
    );
    assert_eq!(headers[header::RETRY_AFTER], "5");
    // In progress: retried before the retry time, it is 409 with the time left.
    let (status, headers, body) =
        send(&router, post_request(Some("flaky"), r#"{"amount": 3}"#)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::CONFLICT, Some("request_in_progress"))
    );
    let retry_after: u64 = headers[header::RETRY_AFTER]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=5).contains(&retry_after), "{retry_after}");
}

/// A phase that panics is answered 500 (a bug, not a state to wait out); the attempt was
/// recorded, the key stays resumable, and a later retry finishes it.
#[sqlx::test]
async fn a_panicking_phase_is_a_500_problem_and_the_key_stays_resumable(pool: PgPool) {
    setup(&pool).await;
    let provider = Arc::new(Provider::default());
    provider.panic_next.store(1, Ordering::SeqCst);
    let router = checkout_router(&pool, &provider, HttpConfig::default());
    let (status, _, body) = send(&router, post_request(Some("p"), r#"{"amount": 1}"#)).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (StatusCode::INTERNAL_SERVER_ERROR, Some("internal_error"))
    );
    let (state, last_error): (String, Option<String>) =
        sqlx::query_as("SELECT state, last_error FROM idempotency_keys WHERE key = 'p'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(state, "started");
    assert!(
        last_error
            .unwrap()
            .contains("panicked: a bug in the charge phase")
    );
    sqlx::query("UPDATE idempotency_keys SET locked_until = now() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(
        send(&router, post_request(Some("p"), r#"{"amount": 1}"#))
            .await
            .0,
        StatusCode::CREATED
    );
}

#[sqlx::test]
async fn a_concurrent_duplicate_gets_409_with_retry_after(pool: PgPool) {
    setup(&pool).await;
    let provider = Arc::new(Provider::default());
    provider.delay_ms.store(500, Ordering::SeqCst);
    let router = checkout_router(&pool, &provider, HttpConfig::default());
    let first = tokio::spawn({
        let router = router.clone();
        async move { send(&router, post_request(Some("slow"), r#"{"amount": 1}"#)).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, headers, _) = send(&router, post_request(Some("slow"), r#"{"amount": 1}"#)).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(
        headers[header::RETRY_AFTER],
        "60",
        "the lease left, by the database clock"
    );
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
}

/// A plain handler that counts its calls and echoes what it got.
fn plain_router(pool: &PgPool, calls: &Arc<AtomicUsize>, config: HttpConfig) -> Router {
    let calls = calls.clone();
    let handler = post(move |request: Request<Body>| {
        let calls = calls.clone();
        async move {
            let number = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let authorized = request.headers().contains_key(header::AUTHORIZATION);
            let body = axum::body::to_bytes(request.into_body(), usize::MAX)
                .await
                .unwrap();
            Response::builder()
                .status(StatusCode::ACCEPTED)
                .header("x-call", number.to_string())
                .header("x-authorized", authorized.to_string())
                .body(Body::from(body))
                .unwrap()
        }
    })
    .get(|| async { "listing" });
    let layer = IdempotencyLayer::builder(Runner::new(pool.clone()), "notes.v1", BearerTenant)
        .http(config)
        .build()
        .unwrap();
    Router::new().route("/v1/notes", handler).layer(layer)
}

fn note(key: Option<&str>, content_type: &str, body: &str) -> Request<Body> {
    let mut builder = Request::builder()
        .method("POST")
        .uri("/v1/notes?draft=false")
        .header(header::AUTHORIZATION, "Bearer acme")
        .header(header::CONTENT_TYPE, content_type);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body.to_owned())).unwrap()
}

async fn raw(
    router: &Router,
    request: Request<Body>,
) -> (StatusCode, axum::http::HeaderMap, Vec<u8>) {
    let response: Response = router
        .clone()
        .oneshot(request)
        .await
        .unwrap_or_else(|never: Infallible| match never {});
    let (parts, body) = response.into_parts();
    (
        parts.status,
        parts.headers,
        axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap()
            .to_vec(),
    )
}

#[sqlx::test]
async fn a_plain_handler_runs_once_and_its_response_is_replayed(pool: PgPool) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let router = plain_router(&pool, &calls, HttpConfig::default());

    let (status, headers, body) = raw(&router, note(Some("n1"), "text/plain", "hello")).await;
    assert_eq!(
        (status, headers["x-call"].to_str().unwrap(), body.as_slice()),
        (StatusCode::ACCEPTED, "1", &b"hello"[..])
    );
    assert_eq!(
        headers["x-authorized"], "true",
        "the live attempt keeps its credentials"
    );
    let (status, headers, body) = raw(&router, note(Some("n1"), "text/plain", "hello")).await;
    assert_eq!(
        (status, headers["x-call"].to_str().unwrap(), body.as_slice()),
        (StatusCode::ACCEPTED, "1", &b"hello"[..])
    );
    assert_eq!(headers["idempotent-replayed"], "true");
    // A non-JSON body is fingerprinted by its bytes and its content type.
    assert_eq!(
        raw(&router, note(Some("n1"), "text/plain", "hello!"))
            .await
            .0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    assert_eq!(
        raw(&router, note(Some("n1"), "text/markdown", "hello"))
            .await
            .0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // JSON bodies are compared canonically.
    assert_eq!(
        raw(
            &router,
            note(Some("j"), "application/json", r#"{"a":1,"b":2}"#)
        )
        .await
        .0,
        StatusCode::ACCEPTED
    );
    let (status, headers, _) = raw(
        &router,
        note(Some("j"), "application/json", r#"{ "b": 2, "a": 1.0 }"#),
    )
    .await;
    assert_eq!(
        (status, headers["idempotent-replayed"].to_str().unwrap()),
        (StatusCode::ACCEPTED, "true")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // Credentials are never stored with the request.
    let stored: String =
        sqlx::query_scalar("SELECT request::text FROM idempotency_keys WHERE key = 'n1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(!stored.to_ascii_lowercase().contains("bearer"), "{stored}");

    // Methods not covered pass through untouched.
    let get = Request::builder()
        .uri("/v1/notes")
        .body(Body::empty())
        .unwrap();
    assert_eq!(raw(&router, get).await.2, b"listing");
    // A covered request without a key is refused, unless its route observes.
    assert_eq!(
        raw(&router, note(None, "text/plain", "x")).await.0,
        StatusCode::BAD_REQUEST
    );
    let optional = plain_router(
        &pool,
        &calls,
        HttpConfig::default().key_mode(idemflow_http::KeyMode::Observe),
    );
    assert_eq!(
        raw(&optional, note(None, "text/plain", "x")).await.0,
        StatusCode::ACCEPTED
    );
}

/// One HTTP/1.1 request over a fresh loopback connection; returns the status code.
async fn post_over_tcp(address: std::net::SocketAddr, key: &str, body: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST /v1/checkouts HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer acme\r\n\
         Content-Type: application/json\r\nIdempotency-Key: \"{key}\"\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response.split(' ').nth(1).unwrap().parse().unwrap()
}

#[sqlx::test]
async fn fifty_concurrent_duplicate_clients_over_loopback_make_one_order_and_one_charge(
    pool: PgPool,
) {
    setup(&pool).await;
    let provider = Arc::new(Provider::default());
    provider.delay_ms.store(100, Ordering::SeqCst);
    let router = checkout_router(&pool, &provider, HttpConfig::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let clients: Vec<_> = (0..50)
        .map(|_| tokio::spawn(post_over_tcp(address, "same-intent", r#"{"amount": 4200}"#)))
        .collect();
    let mut statuses = Vec::new();
    for client in clients {
        statuses.push(client.await.unwrap());
    }
    server.abort();
    assert!(
        statuses.iter().all(|status| [201, 409].contains(status)),
        "{statuses:?}"
    );
    assert!(statuses.contains(&201));
    let orders: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(orders, 1);
    assert_eq!(provider.calls.load(Ordering::SeqCst), 1);
}
