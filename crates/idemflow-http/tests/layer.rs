//! The plain-handler layer as real services use it: a real axum server on loopback, reqwest, a
//! real PostgreSQL. Each test names what would break.
#![allow(clippy::unwrap_used)]

use idemflow_pg::PgStore;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Extension, MatchedPath, OriginalUri, Path};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::{Json, Router};
use idemflow_core::DerivedKey;
use idemflow_http::{
    BearerTenant, HttpConfig, IdempotencyKey, IdempotencyLayer, LayerError, RunResponse,
    StatusRules,
};
use idemflow_runner::{BuildError, Runner};
use sqlx::PgPool;

#[derive(Clone, Debug)]
struct User(&'static str);

async fn setup(pool: &PgPool) {
    idemflow_pg::migrate(pool).await.unwrap();
    sqlx::query("CREATE TABLE effects (id bigserial PRIMARY KEY, note text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
}

fn layer(pool: &PgPool) -> IdempotencyLayer<PgStore> {
    IdempotencyLayer::new(Runner::new(pool.clone()), "api.v1", BearerTenant).unwrap()
}

/// Serves `router` on a loopback port (with the peer address, for `ConnectInfo`).
async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            router.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
    });
    address
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

fn post_to(address: SocketAddr, path: &str, key: &str) -> reqwest::RequestBuilder {
    client()
        .post(format!("http://{address}{path}"))
        .header("authorization", "Bearer acme")
        .header("idempotency-key", format!("\"{key}\""))
}

async fn effects(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects")
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn key_row(pool: &PgPool, key: &str) -> Option<(String, i32)> {
    sqlx::query_as("SELECT state::text, attempts FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
}

/// Ends the key's lease (or next-attempt wait) now, as if it had run out.
async fn expire_lease(pool: &PgPool, key: &str) {
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' WHERE key = $1",
    )
    .bind(key)
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test]
async fn path_parameters_and_the_request_s_extensions_reach_the_handler(pool: PgPool) {
    setup(&pool).await;
    async fn refund(
        Path(id): Path<u64>,
        Extension(user): Extension<User>,
        matched: MatchedPath,
        OriginalUri(original): OriginalUri,
        ConnectInfo(peer): ConnectInfo<SocketAddr>,
        Extension(derived): Extension<DerivedKey>,
    ) -> impl IntoResponse {
        (
            StatusCode::CREATED,
            Json(serde_json::json!({
                "order": id,
                "user": user.0,
                "route": matched.as_str(),
                "uri": original.to_string(),
                "loopback": peer.ip().is_loopback(),
                "derived_key": derived.to_string(),
            })),
        )
    }
    let router = Router::new()
        .route("/v1/orders/{id}/refunds", post(refund))
        .route_layer(layer(&pool))
        // An authentication layer outside the idempotency layer, as docs/http.md advises.
        .layer(Extension(User("ada")));
    let address = serve(router).await;

    let send = || {
        post_to(address, "/v1/orders/42/refunds", "refund-1")
            .json(&serde_json::json!({"amount": 5}))
            .send()
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), 201);
    let body: serde_json::Value = first.json().await.unwrap();
    assert_eq!(body["order"], 42);
    assert_eq!(body["user"], "ada");
    assert_eq!(body["route"], "/v1/orders/{id}/refunds");
    assert_eq!(body["uri"], "/v1/orders/42/refunds");
    assert_eq!(body["loopback"], true);
    assert_eq!(body["derived_key"], "acme:refund-1:handler");

    let again = send().await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.json::<serde_json::Value>().await.unwrap(), body);
}

#[sqlx::test]
async fn a_client_that_goes_away_does_not_stop_the_handler(pool: PgPool) {
    setup(&pool).await;
    let release = Arc::new(tokio::sync::Notify::new());
    let handler_pool = pool.clone();
    let gate = release.clone();
    let router = Router::new()
        .route(
            "/v1/payments",
            post(move || async move {
                // Past the point of no return: the charge is made, the insert is next.
                gate.notified().await;
                sqlx::query("INSERT INTO effects (note) VALUES ('charged')")
                    .execute(&handler_pool)
                    .await
                    .unwrap();
                (StatusCode::CREATED, "paid")
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;

    let gone = tokio::spawn(post_to(address, "/v1/payments", "pay-1").body("x").send());
    // The key is claimed and the handler waits; then the client hangs up.
    for _ in 0..200 {
        if key_row(&pool, "pay-1").await.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gone.abort();
    let _ = gone.await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    release.notify_one();

    // The handler runs to its end and its response is stored: no lease to wait out.
    let mut finished = None;
    for _ in 0..300 {
        finished = key_row(&pool, "pay-1").await;
        if finished.as_ref().is_some_and(|(state, _)| state == "done") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(finished, Some(("done".to_owned(), 1)));
    assert_eq!(effects(&pool).await, 1);
    let retry = post_to(address, "/v1/payments", "pay-1")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(retry.status(), 201);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(effects(&pool).await, 1);
}

#[sqlx::test]
async fn a_handler_that_always_panics_spends_the_attempt_budget_and_ends(pool: PgPool) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let router = Router::new()
        .route(
            "/v1/boom",
            post(move || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                if counted.load(Ordering::SeqCst) < 1000 {
                    panic!("a bug in the handler");
                }
                "unreachable"
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;

    let mut statuses = Vec::new();
    for _ in 0..12 {
        let response = post_to(address, "/v1/boom", "boom").send().await.unwrap();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status().as_u16();
        let body: serde_json::Value = response.json().await.unwrap();
        statuses.push((status, body["code"].as_str().unwrap_or("").to_owned()));
        if replayed {
            break;
        }
        expire_lease(&pool, "boom").await;
    }
    // Every attempt is a failed attempt with the budget (8); then a 500 is stored and replayed.
    assert_eq!(calls.load(Ordering::SeqCst), 8, "{statuses:?}");
    assert!(
        statuses[..7]
            .iter()
            .all(|(status, code)| *status == 500 && code == "internal_error"),
        "{statuses:?}"
    );
    assert_eq!(statuses[7], (500, "retries_exhausted".to_owned()));
    assert_eq!(statuses.last().unwrap().0, 500);
    assert_eq!(key_row(&pool, "boom").await, Some(("done".to_owned(), 8)));
}

#[sqlx::test]
async fn a_not_executed_status_is_answered_not_stored_and_the_key_is_free_again(pool: PgPool) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let router = Router::new()
        .route(
            "/v1/orders",
            post(move || async move {
                match counted.fetch_add(1, Ordering::SeqCst) {
                    0 => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        [(header::RETRY_AFTER, "2")],
                        "pool exhausted",
                    )
                        .into_response(),
                    1 => (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response(),
                    _ => (StatusCode::CREATED, "made").into_response(),
                }
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;
    let send = || post_to(address, "/v1/orders", "o-1").body("same").send();

    let first = send().await.unwrap();
    assert_eq!(first.status(), 503);
    assert_eq!(first.headers()[header::RETRY_AFTER], "2");
    assert!(!first.headers().contains_key("idempotent-replayed"));
    assert_eq!(first.text().await.unwrap(), "pool exhausted");
    assert_eq!(key_row(&pool, "o-1").await, None, "nothing kept for a 503");

    assert_eq!(send().await.unwrap().status(), 429);
    assert_eq!(key_row(&pool, "o-1").await, None);

    let third = send().await.unwrap();
    assert_eq!(third.status(), 201);
    assert!(!third.headers().contains_key("idempotent-replayed"));
    let fourth = send().await.unwrap();
    assert_eq!(fourth.status(), 201);
    assert_eq!(fourth.headers()["idempotent-replayed"], "true");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

#[sqlx::test]
async fn an_unknown_outcome_status_is_a_counted_attempt_and_runs_again(pool: PgPool) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let router = Router::new()
        .route(
            "/v1/orders",
            post(move || async move {
                if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                    (StatusCode::GATEWAY_TIMEOUT, "upstream timed out").into_response()
                } else {
                    (StatusCode::CREATED, "made").into_response()
                }
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;
    let send = || post_to(address, "/v1/orders", "o-2").body("same").send();

    let first = send().await.unwrap();
    assert_eq!(first.status(), 504);
    assert!(first.headers().contains_key(header::RETRY_AFTER));
    assert_eq!(first.text().await.unwrap(), "upstream timed out");
    assert_eq!(
        key_row(&pool, "o-2").await,
        Some(("started".to_owned(), 1)),
        "kept, with its attempt counted"
    );
    // Before the next attempt time: in progress.
    assert_eq!(send().await.unwrap().status(), 409);
    expire_lease(&pool, "o-2").await;
    assert_eq!(send().await.unwrap().status(), 201);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[sqlx::test]
async fn secrets_never_reach_the_database_and_cookies_are_not_replayed(pool: PgPool) {
    setup(&pool).await;
    let router = Router::new()
        .route(
            "/v1/notes",
            post(|headers: HeaderMap, body: Bytes| async move {
                // The live handler sees every credential it was sent.
                assert_eq!(headers["x-api-key"], "SECRET-1");
                let mut answer = axum::response::Response::new(Body::from(body));
                *answer.status_mut() = StatusCode::CREATED;
                let answered = answer.headers_mut();
                for (name, value) in [
                    ("set-cookie", "session=SECRET-5; HttpOnly"),
                    ("content-type", "text/plain"),
                    // A handler's own secrets in its answer: not for whoever replays it.
                    ("x-session-token", "SECRET-7"),
                    ("x-api-key", "SECRET-8"),
                    ("authorization", "Basic U0VDUkVULTk="),
                    ("x-upstream-signature", "SECRET-10"),
                    // Names holding a secret word that carry none: replayed.
                    ("www-authenticate", "Basic realm=\"notes\""),
                    ("access-control-allow-credentials", "true"),
                    ("x-trace", "visible"),
                ] {
                    answered.append(name, HeaderValue::from_static(value));
                }
                answer
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;
    let send = || {
        post_to(address, "/v1/notes?api_key=SECRET-4&draft=1", "n-1")
            .header("x-api-key", "SECRET-1")
            .header("stripe-signature", "t=1,v1=SECRET-2")
            .header("cookie", "sid=SECRET-3")
            .header("x-hub-signature-256", "sha256=SECRET-6")
            .header("x-trace", "visible")
            .body("note")
            .send()
    };
    let unreplayed = [
        "set-cookie",
        "x-session-token",
        "x-api-key",
        "authorization",
        "x-upstream-signature",
    ];
    let first = send().await.unwrap();
    assert_eq!(first.status(), 201);
    for name in unreplayed {
        assert!(
            first.headers().contains_key(name),
            "the live answer keeps {name}"
        );
    }
    let replay = send().await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    for name in unreplayed {
        assert!(!replay.headers().contains_key(name), "{name} replayed");
    }
    for (name, value) in [
        ("www-authenticate", "Basic realm=\"notes\""),
        ("access-control-allow-credentials", "true"),
        ("x-trace", "visible"),
        ("content-type", "text/plain"),
    ] {
        assert_eq!(replay.headers()[name], value, "{name}");
    }
    assert_eq!(replay.text().await.unwrap(), "note");

    let stored = everything_stored(&pool).await;
    for secret in [
        "SECRET-1",
        "SECRET-2",
        "SECRET-3",
        "SECRET-4",
        "SECRET-5",
        "SECRET-6",
        "SECRET-7",
        "SECRET-8",
        "U0VDUkVULTk=",
        "SECRET-9",
        "SECRET-10",
        "Bearer",
    ] {
        assert_nowhere(&stored, secret);
    }
    let request: String = sqlx::query_scalar("SELECT request::text FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(request.contains("x-trace"), "{request}");
    assert!(request.contains("draft=1"), "{request}");
    assert!(request.contains("api_key=REDACTED"), "{request}");
}

/// Every row of every table the migrations made, each as text (bytea columns show as hex).
async fn everything_stored(pool: &PgPool) -> Vec<String> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT format('%I.%I', table_schema, table_name) FROM information_schema.tables \
         WHERE table_type = 'BASE TABLE' \
           AND table_schema NOT IN ('pg_catalog', 'information_schema')",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(
        tables
            .iter()
            .any(|table| table.ends_with(".idempotency_keys"))
    );
    assert!(
        tables
            .iter()
            .any(|table| table.ends_with(".idempotency_responses"))
    );
    let mut rows = Vec::new();
    for table in tables {
        // The names come from the catalog, quoted by format's %I.
        let query = sqlx::AssertSqlSafe(format!("SELECT t::text FROM {table} t"));
        let text: Vec<String> = sqlx::query_scalar(query).fetch_all(pool).await.unwrap();
        rows.extend(text);
    }
    assert!(!rows.is_empty());
    rows
}

/// Asserts that no stored row holds `secret`: as text, as bytes (hex) or in base64 (bytes
/// inside JSON), at any alignment.
fn assert_nowhere(rows: &[String], secret: &str) {
    use base64::Engine as _;
    let hex: String = secret.bytes().map(|byte| format!("{byte:02x}")).collect();
    let mut forms = vec![secret.to_owned(), hex];
    for skip in 0..3 {
        let rest = &secret.as_bytes()[skip..];
        forms.push(base64::engine::general_purpose::STANDARD.encode(&rest[..rest.len() / 3 * 3]));
    }
    for row in rows {
        for form in &forms {
            assert!(
                !row.contains(form.as_str()),
                "{form} (for {secret}) in {row}"
            );
        }
    }
}

/// A header value with obs-text (bytes 0x80-0xFF: legal in HTTP, not UTF-8) is stored as its
/// bytes and replayed byte for byte.
#[sqlx::test]
async fn header_values_that_are_not_utf8_are_replayed_byte_for_byte(pool: PgPool) {
    setup(&pool).await;
    const LATIN_1: &[u8] = b"caf\xe9 cr\xe8me \xff";
    const UTF_8: &str = "café crème";
    let router = Router::new()
        .route(
            "/v1/notes",
            post(|| async {
                let mut answer = (StatusCode::CREATED, "ok").into_response();
                let headers = answer.headers_mut();
                headers.insert("x-latin-1", HeaderValue::from_bytes(LATIN_1).unwrap());
                headers.insert(
                    "x-utf-8",
                    HeaderValue::from_bytes(UTF_8.as_bytes()).unwrap(),
                );
                headers.append("x-utf-8", HeaderValue::from_static("second"));
                answer
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;
    let send = || post_to(address, "/v1/notes", "obs-text").body("x").send();
    for (round, replayed) in [("first", false), ("replay", true)] {
        let answer = send().await.unwrap();
        assert_eq!(answer.status(), 201, "{round}");
        assert_eq!(
            answer.headers().contains_key("idempotent-replayed"),
            replayed,
            "{round}"
        );
        assert_eq!(
            answer.headers().get("x-latin-1").map(HeaderValue::as_bytes),
            Some(LATIN_1),
            "{round}"
        );
        let utf_8: Vec<&[u8]> = answer
            .headers()
            .get_all("x-utf-8")
            .iter()
            .map(HeaderValue::as_bytes)
            .collect();
        assert_eq!(utf_8, [UTF_8.as_bytes(), b"second"], "{round}");
    }
}

#[sqlx::test]
async fn binary_bodies_are_stored_as_bytes_and_replayed_exactly(pool: PgPool) {
    setup(&pool).await;
    let router = Router::new()
        .route(
            "/v1/blobs",
            post(|body: Bytes| async move {
                let mut answer = body.to_vec();
                answer.reverse();
                (StatusCode::CREATED, answer)
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;

    // Valid UTF-8 holding a NUL (a protobuf message, say): jsonb cannot hold it as text.
    let protobuf = b"\x08\x00\x12\x03abc".to_vec();
    // Not UTF-8, 256 KiB.
    let binary: Vec<u8> = (0..256 * 1024).map(|index| (index % 251) as u8).collect();
    for (key, body) in [("pb", protobuf), ("bin", binary)] {
        let send = || {
            post_to(address, "/v1/blobs", key)
                .header("content-type", "application/x-protobuf")
                .body(body.clone())
                .send()
        };
        let first = send().await.unwrap();
        assert_eq!(first.status(), 201, "{key}");
        let mut reversed = body.clone();
        reversed.reverse();
        assert_eq!(first.bytes().await.unwrap().as_ref(), reversed.as_slice());
        let replay = send().await.unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.bytes().await.unwrap().as_ref(), reversed.as_slice());
    }
    // Stored as base64 (4/3), not as a JSON array of numbers (about 3.6 bytes a byte).
    let stored: i32 = sqlx::query_scalar(
        "SELECT octet_length(request::text) FROM idempotency_keys WHERE key = 'bin'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(stored < 256 * 1024 * 14 / 10, "{stored} bytes of request");
}

#[sqlx::test]
async fn responses_past_the_limit_or_streamed_end_with_a_stored_problem(pool: PgPool) {
    setup(&pool).await;
    let router = Router::new()
        .route(
            "/v1/big",
            post(|| async { (StatusCode::OK, vec![b'x'; 64 * 1024]) }),
        )
        .route(
            "/v1/events",
            post(|| async {
                (
                    [(header::CONTENT_TYPE, "text/event-stream")],
                    Body::from_stream(futures_stream()),
                )
            }),
        )
        .route_layer(
            IdempotencyLayer::builder(Runner::new(pool.clone()), "api.v1", BearerTenant)
                .max_response_bytes(16 * 1024)
                .build()
                .unwrap(),
        );
    let address = serve(router).await;
    for (path, code) in [
        ("/v1/big", "response_too_large"),
        ("/v1/events", "response_not_storable"),
    ] {
        let response = post_to(address, path, path).send().await.unwrap();
        assert_eq!(response.status(), 500, "{path}");
        let problem: serde_json::Value = response.json().await.unwrap();
        assert_eq!(problem["code"], code);
        let replay = post_to(address, path, path).send().await.unwrap();
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(
            replay.json::<serde_json::Value>().await.unwrap()["code"],
            code
        );
    }
}

/// An event stream that never ends.
fn futures_stream() -> impl futures_core::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    struct Forever;
    impl futures_core::Stream for Forever {
        type Item = Result<Bytes, std::io::Error>;
        fn poll_next(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Pending
        }
    }
    Forever
}

#[sqlx::test]
async fn a_multipart_form_sent_again_with_a_new_boundary_is_the_same_request(pool: PgPool) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let router = Router::new()
        .route(
            "/v1/uploads",
            post(move || async move {
                counted.fetch_add(1, Ordering::SeqCst);
                StatusCode::CREATED
            }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;
    let form = |content: &'static [u8]| {
        reqwest::multipart::Form::new()
            .text("title", "invoice")
            .part(
                "file",
                reqwest::multipart::Part::bytes(content).file_name("invoice.pdf"),
            )
    };
    let send = |content: &'static [u8]| {
        post_to(address, "/v1/uploads", "up-1")
            .multipart(form(content))
            .send()
    };
    assert_eq!(send(b"%PDF-1.7 \x00\xff").await.unwrap().status(), 201);
    let again = send(b"%PDF-1.7 \x00\xff").await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(send(b"%PDF-1.7 other").await.unwrap().status(), 422);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A handler that reads the `amount` field of a form, as a multipart parser reading the
/// content type's real boundary would (here: the first field of that name), and counts its
/// calls.
fn amount_router(pool: &PgPool, calls: &Arc<AtomicUsize>) -> Router {
    let counted = calls.clone();
    Router::new()
        .route(
            "/v1/payments",
            post(move |body: Bytes| async move {
                counted.fetch_add(1, Ordering::SeqCst);
                let text = String::from_utf8_lossy(&body);
                let field = "name=\"amount\"\r\n\r\n";
                let amount = text
                    .split_once(field)
                    .and_then(|(_, rest)| rest.split_once("\r\n"))
                    .map_or("", |(amount, _)| amount)
                    .to_owned();
                (StatusCode::CREATED, format!("charged {amount}"))
            }),
        )
        .route_layer(layer(pool))
}

/// The content type's real boundary is `BBBB-2`; a parameter before it holds `;boundary=` in a
/// quoted string. Split on `;` without honouring the quotes, it reads `AAAA-1"`, and the form
/// the handler reads (the `BBBB-2` parts, ahead of the `AAAA-1"` ones) was left out of the
/// fingerprint as a preamble: two payments of different amounts under one key replayed each
/// other.
#[sqlx::test]
async fn a_boundary_quoted_inside_another_parameter_cannot_hide_the_form_from_the_fingerprint(
    pool: PgPool,
) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let address = serve(amount_router(&pool, &calls)).await;
    let content_type = r#"multipart/form-data; x="y;boundary=AAAA-1"; boundary=BBBB-2"#;
    let form = |amount: &str| {
        format!(
            "--BBBB-2\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n{amount}\r\n\
             --BBBB-2--\r\n\
             \r\n--AAAA-1\"\r\nContent-Disposition: form-data; name=\"note\"\r\n\r\nsame\r\n\
             --AAAA-1\"--\r\n"
        )
    };
    let send = |amount: &str| {
        post_to(address, "/v1/payments", "pay-1")
            .header("content-type", content_type)
            .body(form(amount))
            .send()
    };
    let first = send("100").await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.text().await.unwrap(), "charged 100");
    let replay = send("100").await.unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    let other = send("999").await.unwrap();
    assert_eq!(other.status(), 422, "another amount under the same key");
    let problem: serde_json::Value = other.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_key_reused");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A multipart content type whose boundary cannot be told for sure (given twice, in any case,
/// or in another spelling; not a valid boundary; parameters that do not parse) or a content
/// type sent twice is refused 400 before anything is stored: the handler's parser and the
/// fingerprint could read two different forms from it.
#[sqlx::test]
async fn an_ambiguous_or_invalid_boundary_is_refused_and_stores_nothing(pool: PgPool) {
    setup(&pool).await;
    let calls = Arc::new(AtomicUsize::new(0));
    let address = serve(amount_router(&pool, &calls)).await;
    let body = "--BBBB\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n1\r\n--BBBB--\r\n";
    let too_long = format!("multipart/form-data; boundary={}", "b".repeat(71));
    for (index, content_types) in [
        vec!["multipart/form-data; boundary=BBBB; boundary=CCCC"],
        vec!["multipart/form-data; Boundary=BBBB; BOUNDARY=BBBB"],
        vec!["multipart/form-data; boundary=BBBB; boundary*=utf-8''CCCC"],
        vec!["multipart/form-data; boundary*0=BB; boundary*1=BB"],
        vec![r#"multipart/form-data; boundary="BB\"BB""#],
        vec![r#"multipart/form-data; boundary="""#],
        vec![r#"multipart/form-data; boundary="BBBB ""#],
        vec!["multipart/form-data; boundary=BB{}BB"],
        vec![too_long.as_str()],
        vec![r#"multipart/form-data; x="unterminated; boundary=BBBB"#],
        vec!["multipart/form-data; boundary = BBBB"],
        vec![
            "multipart/form-data; boundary=BBBB",
            "multipart/form-data; boundary=CCCC",
        ],
    ]
    .into_iter()
    .enumerate()
    {
        let mut request = post_to(address, "/v1/payments", &format!("ambiguous-{index}"));
        for content_type in &content_types {
            request = request.header("content-type", *content_type);
        }
        let answer = request.body(body).send().await.unwrap();
        assert_eq!(answer.status(), 400, "{content_types:?}");
        let problem: serde_json::Value = answer.json().await.unwrap();
        assert_eq!(problem["code"], "content_type_invalid", "{content_types:?}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "nothing stored for a refused request");

    // The same key, sent with a content type that says one thing, runs.
    let answer = post_to(address, "/v1/payments", "ambiguous-0")
        .header("content-type", "multipart/form-data; boundary=\"BBBB\"")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.text().await.unwrap(), "charged 1");
}

#[sqlx::test]
async fn nested_routers_fingerprint_the_path_the_client_sent(pool: PgPool) {
    setup(&pool).await;
    let transfers = Router::new()
        .route("/transfers", post(|| async { StatusCode::CREATED }))
        .route_layer(layer(&pool));
    let router = Router::new().nest("/accounts/{account}", transfers);
    let address = serve(router).await;
    let send = |account: &str| {
        post_to(address, &format!("/accounts/{account}/transfers"), "t-1")
            .json(&serde_json::json!({"amount": 1}))
            .send()
    };
    assert_eq!(send("A").await.unwrap().status(), 201);
    assert_eq!(
        send("B").await.unwrap().status(),
        422,
        "another account's transfer is another request"
    );
}

#[sqlx::test]
async fn routing_refusals_are_never_stored_however_the_layer_is_mounted(pool: PgPool) {
    setup(&pool).await;
    for mounted_with_layer in [true, false] {
        let routes = Router::new()
            .route("/v1/notes", post(|| async { StatusCode::CREATED }))
            .route("/v1/list", get(|| async { "listing" }));
        let router = if mounted_with_layer {
            routes.layer(layer(&pool))
        } else {
            routes.route_layer(layer(&pool))
        };
        let address = serve(router).await;
        let key = format!("typo-{mounted_with_layer}");

        // A typo'd path: 404, not 401, even without credentials.
        let typo = client()
            .post(format!("http://{address}/v1/nots"))
            .header("idempotency-key", format!("\"{key}\""))
            .send()
            .await
            .unwrap();
        assert_eq!(typo.status(), 404, "layer: {mounted_with_layer}");
        let typo = post_to(address, "/v1/nots", &key).send().await.unwrap();
        assert_eq!(typo.status(), 404);
        // The wrong method on a route that exists: 405.
        let wrong = post_to(address, "/v1/list", &key).send().await.unwrap();
        assert_eq!(wrong.status(), 405);
        // The key is not burnt: the right request under it runs.
        let right = post_to(address, "/v1/notes", &key).send().await.unwrap();
        assert_eq!(right.status(), 201, "layer: {mounted_with_layer}");
        assert!(!right.headers().contains_key("idempotent-replayed"));
    }
}

#[sqlx::test]
async fn json_media_types_are_part_of_the_request(pool: PgPool) {
    setup(&pool).await;
    let router = Router::new()
        .route(
            "/v1/items/{id}",
            axum::routing::patch(|| async { "patched" }),
        )
        .route_layer(layer(&pool));
    let address = serve(router).await;
    let send = |content_type: &'static str| {
        client()
            .patch(format!("http://{address}/v1/items/7"))
            .header("authorization", "Bearer acme")
            .header("idempotency-key", "\"p-1\"")
            .header("content-type", content_type)
            .body(r#"{"name":null}"#)
            .send()
    };
    assert_eq!(
        send("application/merge-patch+json").await.unwrap().status(),
        200
    );
    assert_eq!(send("application/json").await.unwrap().status(), 422);
}

#[sqlx::test]
async fn keys_merged_by_a_proxy_or_with_parameters_are_refused(pool: PgPool) {
    setup(&pool).await;
    let router = Router::new()
        .route("/v1/notes", post(|| async { StatusCode::CREATED }))
        .route_layer(layer(&pool));
    let address = serve(router).await;
    for key in ["a, b", "k;a=1"] {
        let response = client()
            .post(format!("http://{address}/v1/notes"))
            .header("authorization", "Bearer acme")
            .header("idempotency-key", key)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{key}");
        let problem: serde_json::Value = response.json().await.unwrap();
        assert_eq!(problem["code"], "idempotency_key_invalid");
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 0);
}

#[sqlx::test]
async fn settings_that_cannot_work_are_refused_when_the_layer_is_built(pool: PgPool) {
    let runner = Runner::new(pool.clone());
    let built = IdempotencyLayer::builder(runner.clone(), "api.v1", BearerTenant)
        .lease(Duration::from_secs(10))
        .handler_timeout(Duration::from_secs(10))
        .build();
    assert!(matches!(
        built,
        Err(LayerError::Workflow(
            BuildError::TimeoutNotShorterThanLease { .. }
        ))
    ));
    assert!(matches!(
        IdempotencyLayer::new(runner.clone(), "bad name", BearerTenant),
        Err(LayerError::Workflow(BuildError::InvalidWorkflowName(_)))
    ));
    assert!(matches!(
        IdempotencyLayer::builder(runner, "api.v1", BearerTenant)
            .max_response_bytes(0)
            .build(),
        Err(LayerError::NoResponseRoom)
    ));
    // Status rules and methods are the caller's to choose.
    let custom = StatusRules::default()
        .with_not_executed(vec![StatusCode::NOT_FOUND])
        .with_retried(vec![]);
    IdempotencyLayer::builder(Runner::new(pool), "api.v1", BearerTenant)
        .statuses(custom)
        .http(HttpConfig::default().methods([axum::http::Method::POST]))
        .build()
        .unwrap();
}

#[sqlx::test]
async fn a_handler_that_runs_the_runner_itself_needs_no_glue(pool: PgPool) {
    setup(&pool).await;
    let runner = Runner::new(pool.clone());
    let workflow = Arc::new(
        idemflow_runner::Workflow::builder::<serde_json::Value>("echo.v1")
            .local(Echo)
            .build()
            .unwrap(),
    );
    let router = Router::new().route(
        "/v1/echo",
        post(
            move |IdempotencyKey(key): IdempotencyKey, body: Bytes| async move {
                let tenant = idemflow_core::TenantId::new("acme").unwrap();
                let request = idemflow_runner::Request {
                    method: "POST",
                    path: "/v1/echo",
                    body: &body,
                };
                RunResponse(runner.run(&workflow, &tenant, &key, request).await)
            },
        ),
    );
    let address = serve(router).await;
    let response = client()
        .post(format!("http://{address}/v1/echo"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let problem: serde_json::Value = response.json().await.unwrap();
    assert_eq!(problem["code"], "idempotency_key_missing");

    for replayed in [false, true] {
        let response = post_to(address, "/v1/echo", "e-1")
            .json(&serde_json::json!({"say": "hi"}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers().contains_key("idempotent-replayed"),
            replayed
        );
    }
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

#[sqlx::test]
async fn the_layer_s_workflow_is_refused_by_a_resumer(pool: PgPool) {
    // The handler needs its live request (extensions, credentials), never stored: a resumer
    // would run it without them. The refusal is the registry's, for any live-only workflow.
    let workflow = idemflow_runner::Workflow::builder::<serde_json::Value>("live.v1")
        .local(Echo)
        .live_only()
        .build()
        .unwrap();
    let mut registry = idemflow_runner::Registry::new();
    assert!(matches!(
        registry.register(workflow),
        Err(idemflow_runner::RegisterError::LiveOnly(name)) if name == "live.v1"
    ));
    drop(pool);
}

#[sqlx::test]
async fn a_workflow_route_covers_post_only_by_default(pool: PgPool) {
    setup(&pool).await;
    let workflow = idemflow_runner::Workflow::builder::<serde_json::Value>("echo.v1")
        .local(Echo)
        .build()
        .unwrap();
    let service =
        idemflow_http::WorkflowService::new(Runner::new(pool.clone()), workflow, BearerTenant);
    let router = Router::new().route_service("/v1/echo", service);
    let address = serve(router).await;
    let response = client()
        .patch(format!("http://{address}/v1/echo"))
        .header("authorization", "Bearer acme")
        .header("idempotency-key", "\"w-1\"")
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 405);
    assert_eq!(response.headers()[header::ALLOW], "POST");
}

#[sqlx::test]
async fn a_body_that_cannot_be_read_is_a_400_not_a_413(pool: PgPool) {
    use tower::ServiceExt;
    setup(&pool).await;
    struct Broken;
    impl futures_core::Stream for Broken {
        type Item = Result<Bytes, std::io::Error>;
        fn poll_next(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Self::Item>> {
            std::task::Poll::Ready(Some(Err(std::io::Error::other("connection reset"))))
        }
    }
    let router = Router::new()
        .route("/v1/notes", post(|| async { StatusCode::CREATED }))
        .route_layer(layer(&pool));
    let request = axum::http::Request::builder()
        .method("POST")
        .uri("/v1/notes")
        .header("authorization", "Bearer acme")
        .header("idempotency-key", "\"broken\"")
        .body(Body::from_stream(Broken))
        .unwrap();
    let response = router.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    let body = axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["code"], "body_unreadable");
    assert_eq!(key_row(&pool, "broken").await, None);
}

/// The handler reads the body's bytes itself (exactly), while the fingerprint reads numbers as
/// RFC 8785 doubles: 9007199254740993 and 9007199254740992 were once the same request, so the
/// second amount under the key was answered with the first one's response. A number a double
/// cannot hold as written is refused before anything is stored.
#[sqlx::test]
async fn a_number_a_double_cannot_hold_is_refused_not_confused_with_its_neighbour(pool: PgPool) {
    setup(&pool).await;
    async fn pay(pool: axum::extract::State<PgPool>, body: Bytes) -> impl IntoResponse {
        let text = String::from_utf8(body.to_vec()).unwrap();
        sqlx::query("INSERT INTO effects (note) VALUES ($1)")
            .bind(&text)
            .execute(&pool.0)
            .await
            .unwrap();
        (StatusCode::CREATED, text)
    }
    let router = Router::new()
        .route("/v1/payments", post(pay))
        .route_layer(layer(&pool))
        .with_state(pool.clone());
    let address = serve(router).await;
    let send = |amount: &'static str| {
        post_to(address, "/v1/payments", "pay-1")
            .header("content-type", "application/json")
            .body(format!(r#"{{"amount": {amount}}}"#))
            .send()
    };

    let refused = send("9007199254740993").await.unwrap();
    assert_eq!(refused.status(), 400);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(key_row(&pool, "pay-1").await, None, "nothing stored");
    assert_eq!(effects(&pool).await, 0, "the handler never ran");

    let neighbour = send("9007199254740992").await.unwrap();
    assert_eq!(neighbour.status(), 201);
    assert!(neighbour.headers().get("idempotent-replayed").is_none());
    assert_eq!(
        neighbour.text().await.unwrap(),
        r#"{"amount": 9007199254740992}"#
    );
    assert_eq!(effects(&pool).await, 1);
}
