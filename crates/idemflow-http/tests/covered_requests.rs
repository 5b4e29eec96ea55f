//! `idemflow_http::serve`'s limit on covered requests (those the idempotency layer or a
//! workflow route takes a key for), over loopback: past `max_covered_requests` a request waits
//! up to `covered_request_wait` for a place, then is answered 503 problem+json with
//! `Retry-After`, having read no body and stored nothing; other routes are not held back.
#![allow(clippy::unwrap_used)]

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::{get, post};
use idemflow_http::{BearerTenant, IdempotencyLayer, ServeLimits, serve};
use idemflow_runner::Runner;
use sqlx::PgPool;
use tokio::sync::Semaphore;

const LIMIT: usize = 2;
const WAIT: Duration = Duration::from_millis(500);
const MARGIN: Duration = Duration::from_secs(3);

fn post_hold(address: SocketAddr, key: &str) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("http://{address}/v1/holds"))
        .header("authorization", "Bearer acme")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("\"{key}\""))
        .body(format!("{{\"hold\":\"{key}\"}}"))
}

async fn stored_keys(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE state = 'done' ORDER BY key")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn until(what: &str, condition: impl Fn() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < MARGIN, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[sqlx::test]
async fn covered_requests_past_the_limit_wait_briefly_then_get_503_and_store_nothing(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let entered = Arc::new(AtomicUsize::new(0));
    let release = Arc::new(Semaphore::new(0));
    let hold = {
        let (entered, release) = (entered.clone(), release.clone());
        move || async move {
            entered.fetch_add(1, Ordering::SeqCst);
            release.acquire().await.unwrap().forget();
            StatusCode::CREATED
        }
    };
    let router = Router::new()
        .route("/v1/holds", post(hold))
        .route_layer(
            IdempotencyLayer::new(Runner::new(pool.clone()), "holds.v1", BearerTenant).unwrap(),
        )
        .route("/healthz", get(|| async { "ok" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let limits = ServeLimits::default()
        .with_max_covered_requests(LIMIT)
        .with_covered_request_wait(WAIT);
    tokio::spawn(serve(listener, router, limits).into_future());

    // Two requests take both places and stay in their handler.
    let first = tokio::spawn(post_hold(address, "a").send());
    let second = tokio::spawn(post_hold(address, "b").send());
    until("two handlers entered", || {
        entered.load(Ordering::SeqCst) == 2
    })
    .await;

    // A third waits its while, then is refused: 503, Retry-After, nothing stored.
    let asked = Instant::now();
    let refused = tokio::time::timeout(WAIT + MARGIN, post_hold(address, "c").send())
        .await
        .expect("a request past the limit is answered, not held")
        .unwrap();
    let waited = asked.elapsed();
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let problem: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(problem["code"], "overloaded", "{problem}");
    assert!(waited >= WAIT, "refused after {waited:?}, before its wait");
    assert_eq!(entered.load(Ordering::SeqCst), 2, "its handler never ran");

    // Routes the limit does not cover are served meanwhile.
    let health = reqwest::get(format!("http://{address}/healthz"))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    // A fourth waits for a place, and takes the first to come free within its wait.
    let fourth = tokio::spawn(post_hold(address, "d").send());
    tokio::time::sleep(WAIT / 3).await;
    assert_eq!(
        entered.load(Ordering::SeqCst),
        2,
        "the fourth waits its turn"
    );
    release.add_permits(1);
    until("the fourth took the place freed", || {
        entered.load(Ordering::SeqCst) == 3
    })
    .await;
    release.add_permits(2);
    for (key, request) in [("a", first), ("b", second), ("d", fourth)] {
        let answer = tokio::time::timeout(MARGIN, request)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(answer.status(), 201, "{key}");
    }
    assert_eq!(stored_keys(&pool).await, ["a", "b", "d"]);

    // The refused key was never claimed: sent again now, it runs.
    release.add_permits(1);
    assert_eq!(post_hold(address, "c").send().await.unwrap().status(), 201);
    assert_eq!(stored_keys(&pool).await, ["a", "b", "c", "d"]);
}
