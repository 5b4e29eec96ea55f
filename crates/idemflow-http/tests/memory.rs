//! Peak memory of the plain-handler layer for large requests and a large response, counted by
//! a global allocator (bytes requested from the allocator, not pages): what one request costs
//! above what the process held before it. Figures in docs/benchmarks.md; the bounds here catch
//! a return of the JSON-array encoding (about 32 bytes of `serde_json::Value` per body byte).
#![allow(clippy::unwrap_used)]

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, header};
use axum::routing::post;
use idemflow_http::{BearerTenant, IdempotencyLayer};
use idemflow_runner::Runner;
use peak_alloc::PeakAlloc;
use sqlx::PgPool;
use tower::ServiceExt;

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

const MIB: usize = 1024 * 1024;

fn request(key: &str, body: Vec<u8>) -> Request<Body> {
    typed_request(key, "application/octet-stream", body)
}

fn typed_request(key: &str, content_type: &str, body: Vec<u8>) -> Request<Body> {
    Request::builder()
        .method("POST")
        .uri("/v1/blobs")
        .header(header::AUTHORIZATION, "Bearer acme")
        .header(header::CONTENT_TYPE, content_type)
        .header("idempotency-key", key)
        .body(Body::from(body))
        .unwrap()
}

/// Sends `request` through `router`, reads the answer whole, and returns the status and the
/// peak bytes held above the level before it.
async fn peak_of(router: &Router, request: Request<Body>) -> (StatusCode, usize, usize) {
    ALLOCATOR.reset_peak_usage();
    let before = ALLOCATOR.current_usage();
    let response = router.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let peak = ALLOCATOR.peak_usage().saturating_sub(before);
    (status, peak, body.len())
}

#[sqlx::test]
async fn a_large_request_and_a_large_response_cost_a_few_times_their_size(pool: PgPool) {
    idemflow_pg::migrate(&pool).await.unwrap();
    let response_size = 10 * MIB;
    let router = Router::new()
        .route(
            "/v1/blobs",
            post(move |body: Bytes| async move {
                let size = if body.len() == 1 { response_size } else { 16 };
                (StatusCode::CREATED, vec![0xA5u8; size])
            }),
        )
        .route_layer(
            IdempotencyLayer::builder(Runner::new(pool.clone()), "blobs.v1", BearerTenant)
                .max_response_bytes(16 * MIB)
                .build()
                .unwrap(),
        );
    // Warm up: connections opened, statements prepared.
    for key in ["warm-1", "warm-2"] {
        assert_eq!(
            peak_of(&router, request(key, vec![1, 2])).await.0,
            StatusCode::CREATED
        );
    }

    // 1 MiB of binary request (not UTF-8), a small response.
    let body: Vec<u8> = (0..MIB).map(|index| (index % 251) as u8).collect();
    let (status, request_peak, _) = peak_of(&router, request("big-request", body)).await;
    assert_eq!(status, StatusCode::CREATED);
    // 1 MiB of JSON in small values (`[0,0,…]`): canonicalized for the fingerprint, stored as
    // text.
    let mut json = b"[0".to_vec();
    while json.len() < MIB - 3 {
        json.extend_from_slice(b",0");
    }
    json.push(b']');
    let (status, json_peak, _) =
        peak_of(&router, typed_request("big-json", "application/json", json)).await;
    assert_eq!(status, StatusCode::CREATED);
    // A small request, a 10 MiB response.
    let (status, response_peak, read) = peak_of(&router, request("big-response", vec![1])).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(read, response_size);
    // Its replay.
    let (status, replay_peak, read) = peak_of(&router, request("big-response", vec![1])).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(read, response_size);

    let ratio = |peak: usize, size: usize| peak as f64 / size as f64;
    println!(
        "peak above the process's level: 1 MiB request {:.1} MiB ({:.2}× its size); \
         1 MiB JSON request of small values {:.1} MiB ({:.2}×); \
         10 MiB response {:.1} MiB ({:.2}×); its replay {:.1} MiB ({:.2}×)",
        request_peak as f64 / MIB as f64,
        ratio(request_peak, MIB),
        json_peak as f64 / MIB as f64,
        ratio(json_peak, MIB),
        response_peak as f64 / MIB as f64,
        ratio(response_peak, response_size),
        replay_peak as f64 / MIB as f64,
        ratio(replay_peak, response_size),
    );
    // Measured 12×, 9.0×, 6.1× and 3.4× (docs/benchmarks.md); a JSON array of numbers would be
    // 30×+, and a canonicalizer that builds a tree of values made the JSON request 24×.
    assert!(ratio(request_peak, MIB) < 16.0, "{request_peak}");
    assert!(ratio(json_peak, MIB) < 12.0, "{json_peak}");
    assert!(ratio(response_peak, response_size) < 8.0, "{response_peak}");
    assert!(ratio(replay_peak, response_size) < 5.0, "{replay_peak}");
}
