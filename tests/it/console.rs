//! The operator console against a real PostgreSQL, mounted under a prefix as an application
//! mounts it: over HTTP (search, a key's page, the actions and every refusal, read-only mode, the
//! standalone server's password) and in a real browser (headless Chromium through
//! `idemflow_testrig::browser`), which also makes the screenshots in docs/console.md. What each
//! engine must answer the console with is proven by the conformance suite's console cases.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use idemflow::{Keyring, Outcome, Registry, Resumer, Runner, RunnerConfig};
use idemflow_console::{Console, ServeOptions};
use idemflow_testrig::browser::Browser;
use reqwest::StatusCode;
use serde_json::json;
use sqlx::PgPool;

use crate::support::*;

/// Serves `console` nested under `/ops` (with a page of the application's own beside it) on
/// loopback: the console's root URL.
async fn serve(console: Console) -> String {
    let app = Router::new()
        .route("/", axum::routing::get(|| async { "the application" }))
        .nest("/ops", console.router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}/ops")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

async fn page(url: &str) -> (StatusCode, String) {
    let response = client().get(url).send().await.unwrap();
    (response.status(), response.text().await.unwrap())
}

async fn post(url: &str, form: &[(&str, &str)]) -> (StatusCode, String) {
    let response = client().post(url).form(form).send().await.unwrap();
    (response.status(), response.text().await.unwrap())
}

/// The keys the tests look at, made by the runner and the resumer as a service makes them.
struct Seeded {
    harness: Harness,
}

const TENANT: &str = "1";
const CRASHED: &str = "order-crashed";
const LIVE: &str = "order-live";
const SEALED: &str = "order-sealed";

/// Two finished checkouts; one whose owner vanished during the charge and that a resumer
/// finished; one whose owner is still on its charge (its lease live); one stored sealed.
async fn seed(pool: &PgPool) -> Seeded {
    create_orders(pool).await;
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let one = tenant(1);
    for key in ["order-1", "order-2"] {
        assert!(matches!(
            run(&runner, &workflow, &one, key, &body(10)).await,
            Outcome::Executed(_)
        ));
    }
    // The owner vanishes during the charge (the task is dropped there, as a killed process).
    let twenty = body(20);
    for key in [CRASHED, LIVE] {
        harness
            .provider
            .script
            .hang_next
            .store(true, Ordering::SeqCst);
        let crashed = tokio::time::timeout(
            Duration::from_millis(300),
            run(&runner, &workflow, &one, key, &twenty),
        );
        assert!(crashed.await.is_err());
    }
    // The crashed key's lease ends (rewound, as if a minute had passed) and a resumer finishes it.
    expire_lease(pool, CRASHED).await;
    let mut registry = Registry::new();
    registry.register(harness.checkout()).unwrap();
    let report = Resumer::new(runner, registry).drain().await.unwrap();
    assert_eq!(report.finished, 1, "{report:?}");
    // A key whose request and response are sealed at rest.
    let sealing = Runner::with_config(
        pool.clone(),
        RunnerConfig::default().with_keyring(Some(Keyring::new("2026-12", [7; 32]).unwrap())),
    );
    let secret = br#"{"amount": 30, "source": "tok_secret_card"}"#;
    assert!(matches!(
        run(&sealing, &workflow, &one, SEALED, secret).await,
        Outcome::Executed(_)
    ));
    Seeded { harness }
}

fn key_url(root: &str, key: &str) -> String {
    format!("{root}/key?tenant={TENANT}&key={key}")
}

async fn token(pool: &PgPool, key: &str) -> i64 {
    key_row(pool, key).await.unwrap().2
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_keys_page_shows_its_timeline_derived_keys_and_what_is_stored(pool: PgPool) {
    let seeded = seed(&pool).await;
    let root = serve(
        Console::new(idemflow_pg::PgOperator::new(pool.clone()))
            .workflow(&seeded.harness.checkout()),
    )
    .await;
    let (status, html) = page(&key_url(&root, CRASHED)).await;
    assert_eq!(status, StatusCode::OK, "{html}");
    // The timeline: the claim, the first phase, the takeover by the resumer, the rest, the finish.
    let events: Vec<&str> = html
        .match_indices("data-event=\"")
        .map(|(at, _)| {
            let rest = &html[at + 12..];
            &rest[..rest.find('"').unwrap()]
        })
        .collect();
    // The charge's result is recorded with the last phase, in the finish's transaction.
    assert_eq!(
        events,
        ["claimed", "phase", "taken_over", "finished"],
        "{html}"
    );
    assert!(html.contains("taken over by resumer (attempt 2)"), "{html}");
    // The workflow's phases, all completed, and the derived key its charge used, as the provider
    // saw it.
    assert_eq!(html.matches("<td>completed</td>").count(), 3, "{html}");
    assert!(
        html.contains(&format!(
            "<td>foreign</td><td>completed</td><td><code>{TENANT}:{CRASHED}:charge</code>"
        )),
        "{html}"
    );
    assert!(
        seeded
            .harness
            .provider
            .keys()
            .contains(&format!("{TENANT}:{CRASHED}:charge"))
    );
    assert!(
        html.contains("tok_visa"),
        "the stored request, in the clear here"
    );
    assert!(html.contains(r#"id="response-status">201<"#), "{html}");
    // Links are written under the prefix the application chose.
    assert!(html.contains(r#"href="/ops/keys""#));
    // A key sealed at rest: never opened, never shown.
    let (status, html) = page(&key_url(&root, SEALED)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(!html.contains("tok_secret_card"), "{html}");
    assert!(html.contains("sealed under key 2026-12"), "{html}");
    assert!(html.contains(r#"id="request-sealed""#) && html.contains(r#"id="response-sealed""#));
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_search_finds_keys_by_tenant_prefix_and_state_and_pages_through_them(pool: PgPool) {
    let harness = Harness::default();
    let (runner, workflow) = (Runner::new(pool.clone()), harness.local_only());
    create_orders(&pool).await;
    for n in 0..55 {
        run(
            &runner,
            &workflow,
            &tenant(1),
            &format!("batch-{n:03}"),
            &body(n),
        )
        .await;
    }
    run(&runner, &workflow, &tenant(2), "batch-000", &body(1)).await;
    let root = serve(Console::new(idemflow_pg::PgOperator::new(pool.clone()))).await;
    // A tenant's prefix: the first page of 50, then the rest.
    let (status, html) = page(&format!("{root}/keys?tenant=1&key=batch-&prefix=on")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(html.matches(r#"class="key""#).count(), 50);
    let next = html
        .split(r#"id="next" href=""#)
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a next page")
        .replace("&amp;", "&");
    assert!(next.starts_with("/ops/keys?"), "{next}");
    let (_, rest) = page(&format!("{}{next}", root.trim_end_matches("/ops"))).await;
    assert_eq!(rest.matches(r#"class="key""#).count(), 5, "{rest}");
    assert!(rest.contains("batch-054") && !rest.contains(r#"id="next""#));
    // The exact key of another tenant, and a filter that matches nothing.
    let (_, other) = page(&format!("{root}/keys?tenant=2&key=batch-000")).await;
    assert_eq!(other.matches(r#"class="key""#).count(), 1);
    let (_, none) = page(&format!("{root}/keys?tenant=1&state=started")).await;
    assert!(none.contains(r#"id="no-match""#), "{none}");
    // Bad input: a clear error, 400.
    let (status, html) = page(&format!("{root}/keys?state=running")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(html.contains("state: started or done"), "{html}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn actions_are_confirmed_fenced_and_refused_for_a_live_owner_unless_forced(pool: PgPool) {
    let _seeded = seed(&pool).await;
    let root =
        serve(Console::new(idemflow_pg::PgOperator::new(pool.clone())).allow_actions()).await;
    let live = token(&pool, LIVE).await;
    let shown = live.to_string();
    let end = format!("{root}/key/end-lease");
    let fields = |confirmed: &'static str, force: &'static str, token: &str| {
        vec![
            ("tenant", TENANT.to_owned()),
            ("key", LIVE.to_owned()),
            ("lock_version", token.to_owned()),
            ("state", "started".to_owned()),
            ("force", force.to_owned()),
            ("confirmed", confirmed.to_owned()),
        ]
    };
    let send = |form: Vec<(&'static str, String)>| {
        let end = end.clone();
        async move {
            let response = client().post(&end).form(&form).send().await.unwrap();
            (response.status(), response.text().await.unwrap())
        }
    };
    // Unconfirmed: a page that asks, and nothing done.
    let (status, html) = send(fields("", "on", &shown)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(html.contains(r#"id="confirm""#), "{html}");
    assert_eq!(token(&pool, LIVE).await, live);
    // A live owner without force: refused.
    let (status, html) = send(fields("yes", "", &shown)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{html}");
    assert!(html.contains("is live"));
    assert_eq!(token(&pool, LIVE).await, live);
    // A token the key no longer holds: refused, nothing done.
    let (status, _) = send(fields("yes", "on", &(live - 1).to_string())).await;
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(token(&pool, LIVE).await, live);
    // Confirmed and forced: the fence advances and the lease is over.
    let (status, html) = send(fields("yes", "on", &shown)).await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(html.contains("ended the lease"), "{html}");
    let (state, _, ended, _) = key_row(&pool, LIVE).await.unwrap();
    assert_eq!(state, "started");
    assert!(ended > live);
    // Expire: a done key goes, and the next request with it runs as a new one.
    let done = token(&pool, "order-1").await.to_string();
    let (status, html) = post(
        &format!("{root}/key/expire"),
        &[
            ("tenant", TENANT),
            ("key", "order-1"),
            ("lock_version", &done),
            ("state", "started"),
            ("confirmed", "yes"),
        ],
    )
    .await;
    // Shown started, done now (a finish keeps the token): refused, its response kept.
    assert_eq!(status, StatusCode::CONFLICT, "{html}");
    assert!(key_row(&pool, "order-1").await.is_some());
    let (status, html) = post(
        &format!("{root}/key/expire"),
        &[
            ("tenant", TENANT),
            ("key", "order-1"),
            ("lock_version", &done),
            ("state", "done"),
            ("confirmed", "yes"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(key_row(&pool, "order-1").await.is_none());
    // Bad input: 400 and nothing written.
    let (status, _) = post(
        &format!("{root}/key/expire"),
        &[
            ("tenant", TENANT),
            ("key", "order-2"),
            ("lock_version", "x"),
            ("confirmed", "yes"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(key_row(&pool, "order-2").await.is_some());
    // A form posted from another site (a browser says so): refused.
    let token2 = token(&pool, "order-2").await.to_string();
    let response = client()
        .post(format!("{root}/key/expire"))
        .header("sec-fetch-site", "cross-site")
        .form(&[
            ("tenant", TENANT),
            ("key", "order-2"),
            ("lock_version", token2.as_str()),
            ("state", "done"),
            ("confirmed", "yes"),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert!(key_row(&pool, "order-2").await.is_some());
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_read_only_console_refuses_every_action_on_the_server(pool: PgPool) {
    let _seeded = seed(&pool).await;
    let root =
        serve(Console::new(idemflow_pg::PgOperator::new(pool.clone())).read_only(true)).await;
    let (_, html) = page(&key_url(&root, LIVE)).await;
    assert!(html.contains(r#"id="actions-off""#) && !html.contains("<form method=\"post\""));
    let live = token(&pool, LIVE).await.to_string();
    let done = token(&pool, "order-1").await.to_string();
    for (action, key, shown, state) in [
        ("end-lease", LIVE, &live, "started"),
        ("expire", "order-1", &done, "done"),
    ] {
        let (status, html) = post(
            &format!("{root}/key/{action}"),
            &[
                ("tenant", TENANT),
                ("key", key),
                ("lock_version", shown),
                ("state", state),
                ("force", "on"),
                ("confirmed", "yes"),
            ],
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{action}: {html}");
        assert!(html.contains("read-only"));
        assert_eq!(token(&pool, key).await.to_string(), *shown, "{action}");
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_standalone_console_asks_for_its_password_and_never_binds_beyond_loopback_without_one(
    pool: PgPool,
) {
    let anywhere: SocketAddr = "0.0.0.0:0".parse().unwrap();
    let refused = idemflow_console::serve(
        Console::new(idemflow_pg::PgOperator::new(pool.clone())),
        ServeOptions::new(anywhere),
        |_| {},
    )
    .await;
    assert!(
        matches!(refused, Err(idemflow_console::ServeError::NoPassword(_))),
        "{refused:?}"
    );
    let (sender, bound) = tokio::sync::oneshot::channel();
    let console = Console::new(idemflow_pg::PgOperator::new(pool.clone()));
    tokio::spawn(async move {
        idemflow_console::serve(
            console,
            ServeOptions::new(anywhere).password(Some("s3cret".to_owned())),
            move |local| {
                let _ = sender.send(local);
            },
        )
        .await
        .unwrap();
    });
    let port = bound.await.unwrap().port();
    let url = format!("http://127.0.0.1:{port}/");
    let asked = client().get(&url).send().await.unwrap();
    assert_eq!(asked.status(), StatusCode::UNAUTHORIZED);
    assert!(asked.headers().contains_key("www-authenticate"));
    let wrong = client()
        .get(&url)
        .basic_auth("ana", Some("guess"))
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
    let right = client()
        .get(&url)
        .basic_auth("ana", Some("s3cret"))
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), StatusCode::OK);
    // The principal is named in the page (and in every action recorded).
    assert!(
        right
            .text()
            .await
            .unwrap()
            .contains(r#"<span class="who">ana</span>"#)
    );
}

/// Serves `console` alone (`idemflow_console::serve`, as `idemflow console` does): the address it
/// listens on.
async fn serve_alone(console: Console, options: ServeOptions) -> SocketAddr {
    let (sender, bound) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        idemflow_console::serve(console, options, move |local| {
            let _ = sender.send(local);
        })
        .await
        .unwrap();
    });
    bound.await.unwrap()
}

/// One HTTP/1.1 exchange written by hand (a browser on a rebound name sends a Host no HTTP client
/// library lets a test forge): the status and the body.
async fn exchange(address: SocketAddr, request: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer[9..12].parse().unwrap();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned());
    (status, body.unwrap_or_default())
}

fn get_with_host(path: &str, host: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn without_a_password_the_standalone_console_answers_loopback_host_names_only(pool: PgPool) {
    let _seeded = seed(&pool).await;
    let loopback: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let console = Console::new(idemflow_pg::PgOperator::new(pool.clone())).read_only(false);
    let address = serve_alone(console, ServeOptions::new(loopback)).await;
    let port = address.port();
    for host in [
        format!("127.0.0.1:{port}"),
        "127.0.0.1".to_owned(),
        format!("localhost:{port}"),
        "localhost".to_owned(),
        format!("LocalHost:{port}"),
        format!("[::1]:{port}"),
        "[::1]".to_owned(),
    ] {
        let (status, html) = exchange(address, &get_with_host("/", &host)).await;
        assert_eq!(status, 200, "Host {host}: {html}");
    }
    for host in [
        format!("rebound.example:{port}"),
        "rebound.example".to_owned(),
        format!("127.0.0.1.rebound.example:{port}"),
        format!("localhost.rebound.example:{port}"),
        format!("127.0.0.1:{}", port.wrapping_add(1)),
        format!("localhost:{port}@rebound.example"),
    ] {
        let (status, html) = exchange(address, &get_with_host("/", &host)).await;
        assert_eq!(status, 421, "Host {host}: {html}");
    }
    // The attack: a page on a name rebound to 127.0.0.1 reads a key's stored request and expires
    // it, with Host and Origin both its own name (so the cross-site check alone lets it through).
    let rebound = format!("rebound.example:{port}");
    let (status, html) = exchange(
        address,
        &get_with_host(&format!("/key?tenant={TENANT}&key=order-1"), &rebound),
    )
    .await;
    assert_eq!(status, 421, "{html}");
    assert!(!html.contains("amount"), "{html}");
    let done = token(&pool, "order-1").await.to_string();
    let form = format!("tenant={TENANT}&key=order-1&lock_version={done}&state=done&confirmed=yes");
    let post = format!(
        "POST /key/expire HTTP/1.1\r\nHost: {rebound}\r\nOrigin: http://{rebound}\r\n\
         Connection: close\r\nContent-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: {}\r\n\r\n{form}",
        form.len()
    );
    assert_eq!(exchange(address, &post).await.0, 421);
    assert!(key_row(&pool, "order-1").await.is_some(), "the key is kept");
    // A request with no Host at all (HTTP/1.0) names no loopback host either.
    let (status, _) = exchange(address, "GET / HTTP/1.0\r\n\r\n").await;
    assert_eq!(status, 421);

    // With a password, any Host is answered to whoever knows it, as before.
    let console = Console::new(idemflow_pg::PgOperator::new(pool.clone()));
    let address = serve_alone(
        console,
        ServeOptions::new(loopback).password(Some("s3cret".to_owned())),
    )
    .await;
    let (status, html) = exchange(
        address,
        &format!(
            "GET / HTTP/1.1\r\nHost: console.internal.example\r\nAuthorization: Basic {}\r\n\
             Connection: close\r\n\r\n",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "ana:s3cret")
        ),
    )
    .await;
    assert_eq!(status, 200, "{html}");
}

/// The values of `name="…"` attributes in `html`, as a browser reads them (character references
/// decoded).
fn attribute_values(html: &str, name: &str) -> Vec<String> {
    let marker = format!(" {name}=\"");
    html.split(&marker)
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(value, _)| value))
        .map(|value| {
            value
                .replace("&quot;", "\"")
                .replace("&#39;", "'")
                .replace("&lt;", "<")
                .replace("&gt;", ">")
                .replace("&amp;", "&")
        })
        .collect()
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_mount_prefix_is_written_escaped_and_every_link_under_it_works(pool: PgPool) {
    let _seeded = seed(&pool).await;
    // A prefix a request path may hold, with a quote and what reads as a character reference.
    let prefix = "/it's&amp;ops";
    let app = Router::new().nest(
        prefix,
        Console::new(idemflow_pg::PgOperator::new(pool.clone())).router(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let host = address.to_string();
    for path in ["", "/keys?tenant=1", "/stuck", "/key?tenant=1&key=order-1"] {
        let (status, html) =
            exchange(address, &get_with_host(&format!("{prefix}{path}"), &host)).await;
        assert_eq!(status, 200, "{path}: {html}");
        assert!(
            !html.contains("=\"/it's"),
            "{path}: a raw quote in an attribute: {html}"
        );
        let links: Vec<String> = attribute_values(&html, "href")
            .into_iter()
            .chain(attribute_values(&html, "src"))
            .collect();
        assert!(links.iter().any(|link| link.ends_with("/stuck")), "{html}");
        for link in links {
            assert!(link.starts_with(prefix), "{path}: {link}");
            let (status, page) = exchange(address, &get_with_host(&link, &host)).await;
            assert_eq!(status, 200, "{path}: the link {link}: {page}");
        }
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_embedded_console_is_read_only_until_its_actions_are_allowed(pool: PgPool) {
    let _seeded = seed(&pool).await;
    let done = token(&pool, "order-1").await.to_string();
    let expire = [
        ("tenant", TENANT),
        ("key", "order-1"),
        ("lock_version", done.as_str()),
        ("state", "done"),
        ("confirmed", "yes"),
    ];
    let root = serve(Console::new(idemflow_pg::PgOperator::new(pool.clone()))).await;
    let (_, html) = page(&key_url(&root, "order-1")).await;
    assert!(html.contains(r#"id="actions-off""#), "{html}");
    let (status, html) = post(&format!("{root}/key/expire"), &expire).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{html}");
    assert!(key_row(&pool, "order-1").await.is_some());

    let root =
        serve(Console::new(idemflow_pg::PgOperator::new(pool.clone())).allow_actions()).await;
    let (_, html) = page(&key_url(&root, "order-1")).await;
    assert!(html.contains(r#"id="expire""#), "{html}");
    let (status, html) = post(&format!("{root}/key/expire"), &expire).await;
    assert_eq!(status, StatusCode::OK, "{html}");
    assert!(key_row(&pool, "order-1").await.is_none());
}

/// Serves `console` under `/ops` with every request signed in as `who` (none: signed out).
async fn serve_as(console: Console, who: Option<&'static str>) -> String {
    let console = console.router().layer(axum::middleware::from_fn(
        move |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
            if let Some(who) = who {
                request
                    .extensions_mut()
                    .insert(idemflow_console::Principal(who.to_owned()));
            }
            next.run(request).await
        },
    ));
    let app = Router::new().nest("/ops", console);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}/ops")
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_operator_limited_to_some_tenants_sees_and_acts_on_theirs_only(pool: PgPool) {
    let seeded = seed(&pool).await;
    // Tenant 2 has keys of the same names as tenant 1's.
    let (runner, workflow) = (Runner::new(pool.clone()), seeded.harness.checkout());
    for key in ["order-1", "order-2"] {
        run(&runner, &workflow, &tenant(2), key, &body(10)).await;
    }
    let theirs: i64 = sqlx::query_scalar(
        "SELECT lock_version FROM idempotency_keys WHERE tenant = '2' AND key = 'order-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let console = || {
        Console::new(idemflow_pg::PgOperator::new(pool.clone()))
            .allow_actions()
            .tenants(|principal| match principal.map(|p| p.0.as_str()) {
                Some("ana@example.com") => idemflow_console::Tenants::only(["1"]),
                _ => idemflow_console::Tenants::none(),
            })
    };
    let root = serve_as(console(), Some("ana@example.com")).await;
    let (status, _) = page(&key_url(&root, "order-1")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, html) = page(&format!("{root}/key?tenant=2&key=order-1")).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{html}");
    assert!(!html.contains("amount"), "{html}");
    for search in [
        format!("{root}/keys?key=order-1"),
        format!("{root}/keys?tenant=2"),
    ] {
        let (status, html) = page(&search).await;
        assert_eq!(status, StatusCode::OK, "{html}");
        assert!(!html.contains("tenant=2&amp;"), "{search}: {html}");
    }
    let (_, html) = page(&format!("{root}/keys?key=order-1")).await;
    assert!(html.contains("tenant=1&amp;key=order-1"), "{html}");
    let (status, html) = post(
        &format!("{root}/key/expire"),
        &[
            ("tenant", "2"),
            ("key", "order-1"),
            ("lock_version", &theirs.to_string()),
            ("state", "done"),
            ("confirmed", "yes"),
        ],
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{html}");
    assert!(html.contains("refused_tenant"), "{html}");
    let kept: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE tenant = '2' AND key = 'order-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kept, 1, "another tenant's key was expired");

    // Signed out: the hook answers no tenant, and no key is shown.
    let root = serve_as(console(), None).await;
    let (status, _) = page(&key_url(&root, "order-1")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, html) = page(&format!("{root}/stuck")).await;
    assert!(!html.contains("order-"), "{html}");
}

/// Where the browser test saves its screenshots: `IDEMFLOW_SCREENSHOTS` (docs/console/ to remake
/// the documentation's), else a temporary directory.
fn screenshots() -> std::path::PathBuf {
    let directory = std::env::var_os("IDEMFLOW_SCREENSHOTS").map_or_else(
        || std::env::temp_dir().join("idemflow-console-screenshots"),
        std::path::PathBuf::from,
    );
    std::fs::create_dir_all(&directory).unwrap();
    directory
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn in_a_browser_an_operator_finds_a_crashed_key_reads_its_timeline_and_ends_a_lease(
    pool: PgPool,
) {
    let seeded = seed(&pool).await;
    // Another key's owner on its charge, so the stuck list and the overview have a due key.
    expire_lease(&pool, LIVE).await;
    seeded
        .harness
        .provider
        .script
        .hang_next
        .store(false, Ordering::SeqCst);
    let shots = screenshots();
    let root = serve(
        Console::new(idemflow_pg::PgOperator::new(pool.clone()))
            .workflow(&seeded.harness.checkout())
            .allow_actions(),
    )
    .await;
    let read_only =
        serve(Console::new(idemflow_pg::PgOperator::new(pool.clone())).read_only(true)).await;
    let browser = Browser::start().await.unwrap();
    let wait = Duration::from_secs(10);

    // The overview.
    browser.goto(&root).await.unwrap();
    let due = browser.wait_for("#due .value", wait).await.unwrap();
    assert_eq!(due.text().await.unwrap(), "1");
    browser
        .screenshot_png(shots.join("overview.png"))
        .await
        .unwrap();

    // The search finds the crashed key by its prefix.
    browser.goto(&format!("{root}/keys")).await.unwrap();
    browser
        .find("input[name=tenant]")
        .await
        .unwrap()
        .send_keys(TENANT)
        .await
        .unwrap();
    browser
        .find("input[name=key]")
        .await
        .unwrap()
        .send_keys("order-cr")
        .await
        .unwrap();
    browser
        .find("input[name=prefix]")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    browser
        .find("#search button")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let found = browser.wait_for("a.key", wait).await.unwrap();
    assert_eq!(browser.find_all("a.key").await.unwrap().len(), 1);
    assert_eq!(found.text().await.unwrap(), CRASHED);
    browser
        .screenshot_png(shots.join("search.png"))
        .await
        .unwrap();

    // Its page: the timeline of a key that crashed and was resumed.
    found.click().await.unwrap();
    browser.wait_for("#timeline", wait).await.unwrap();
    let takeover = browser.find("li[data-event=taken_over]").await.unwrap();
    assert!(
        takeover
            .text()
            .await
            .unwrap()
            .contains("taken over by resumer (attempt 2)")
    );
    assert_eq!(browser.find_all("#timeline li").await.unwrap().len(), 4);
    assert_eq!(
        browser
            .find_all("#phases tr[data-phase]")
            .await
            .unwrap()
            .len(),
        3
    );
    browser.screenshot_png(shots.join("key.png")).await.unwrap();

    // The stuck list holds the key whose owner is gone; its page ends its lease after a dialog.
    browser.goto(&format!("{root}/stuck")).await.unwrap();
    browser
        .screenshot_png(shots.join("stuck.png"))
        .await
        .unwrap();
    let stuck = browser.find("a.key").await.unwrap();
    assert_eq!(stuck.text().await.unwrap(), LIVE);
    stuck.click().await.unwrap();
    let before = token(&pool, LIVE).await;
    browser
        .wait_for("#end-lease button", wait)
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    assert!(
        browser
            .alert_text()
            .await
            .unwrap()
            .contains("End the lease of key order-live")
    );
    // Dismissed: nothing is done.
    browser.dismiss_alert().await.unwrap();
    assert_eq!(token(&pool, LIVE).await, before);
    browser
        .find("#end-lease button")
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    browser.accept_alert().await.unwrap();
    let message = browser.wait_for("#message", wait).await.unwrap();
    // Its lease was over already: nothing to end, said so.
    assert!(
        message.text().await.unwrap().contains("nothing to end"),
        "{}",
        message.text().await.unwrap()
    );

    // Expire a finished key, confirmed in the dialog.
    browser.goto(&key_url(&root, "order-2")).await.unwrap();
    browser
        .wait_for("#expire button", wait)
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    browser.accept_alert().await.unwrap();
    let message = browser.wait_for("#message", wait).await.unwrap();
    assert!(message.text().await.unwrap().starts_with("expired key"));
    assert!(key_row(&pool, "order-2").await.is_none());

    // The read-only console offers no action, and the server refuses one posted all the same.
    browser.goto(&key_url(&read_only, LIVE)).await.unwrap();
    browser.wait_for("#actions-off", wait).await.unwrap();
    assert!(
        browser
            .find_all("form[method=post]")
            .await
            .unwrap()
            .is_empty()
    );
    // A form made in the page (the console's policy lets a page post only to itself, and run
    // no script but its own: a crafted form is what is left) is refused by the server.
    let token_now = token(&pool, LIVE).await;
    browser
        .execute(
            "const form = document.createElement('form'); \
             form.method = 'post'; form.action = '/ops/key/end-lease'; \
             for (const [name, value] of Object.entries(arguments[0])) { \
                 const input = document.createElement('input'); \
                 input.type = 'hidden'; input.name = name; input.value = value; \
                 form.appendChild(input); \
             } \
             document.body.appendChild(form); form.submit();",
            &[json!({"tenant": TENANT, "key": LIVE, "lock_version": token_now.to_string(), "state": "started", "force": "on", "confirmed": "yes"})],
        )
        .await
        .unwrap();
    let refused = browser.wait_for("#message", wait).await.unwrap();
    assert!(refused.text().await.unwrap().contains("read-only"));
    assert_eq!(token(&pool, LIVE).await, token_now);
    browser
        .screenshot_png(shots.join("read-only.png"))
        .await
        .unwrap();

    // A sealed key's page never shows its plaintext.
    browser.goto(&key_url(&root, SEALED)).await.unwrap();
    browser.wait_for("#request-sealed", wait).await.unwrap();
    assert!(
        !browser
            .page_source()
            .await
            .unwrap()
            .contains("tok_secret_card")
    );
    browser
        .screenshot_png(shots.join("sealed.png"))
        .await
        .unwrap();
    browser.quit().await.unwrap();
}

/// The read-only grants file with its psql variable replaced, as `psql -v readonly_role=NAME`
/// replaces it.
fn read_only_grants_for(role: &str) -> String {
    let file = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/sql/grants-read-only.sql"),
    )
    .unwrap();
    let grants = file.replace(":\"readonly_role\"", &format!("\"{role}\""));
    assert!(!grants.contains(":\"") && !grants.contains(":'"));
    grants
}

#[sqlx::test(migrations = false)]
async fn the_console_runs_as_the_runtime_role_and_read_only_as_the_read_only_role(
    _: sqlx::postgres::PgPoolOptions,
    connect: sqlx::postgres::PgConnectOptions,
) {
    crate::roles::deployed(connect.clone(), |deployment| async move {
        let (admin, runtime) = (deployment.admin.clone(), deployment.runtime.clone());
        // Keys made by the runtime role, as a service makes them.
        create_orders(&deployment.owner).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "GRANT SELECT, INSERT, UPDATE ON orders TO \"{0}\"; \
             GRANT USAGE ON SEQUENCE orders_id_seq TO \"{0}\"",
            deployment.roles.runtime.name
        )))
        .execute(&deployment.owner)
        .await
        .unwrap();
        let harness = Harness::default();
        let workflow = harness.checkout();
        let runner = Runner::new(runtime.clone());
        run(&runner, &workflow, &tenant(1), "order-1", &body(5)).await;
        let (forty, one) = (body(40), tenant(1));
        harness
            .provider
            .script
            .hang_next
            .store(true, Ordering::SeqCst);
        let gone = tokio::time::timeout(
            Duration::from_millis(300),
            run(&runner, &workflow, &one, LIVE, &forty),
        );
        assert!(gone.await.is_err());
        // The full console as the runtime role: it reads, and its actions write.
        let root =
            serve(Console::new(idemflow_pg::PgOperator::new(runtime.clone())).allow_actions())
                .await;
        assert_eq!(page(&root).await.0, StatusCode::OK);
        assert_eq!(page(&key_url(&root, "order-1")).await.0, StatusCode::OK);
        let shown: i64 =
            sqlx::query_scalar("SELECT lock_version FROM idempotency_keys WHERE key = $1")
                .bind(LIVE)
                .fetch_one(&admin)
                .await
                .unwrap();
        let (status, html) = post(
            &format!("{root}/key/end-lease"),
            &[
                ("tenant", TENANT),
                ("key", LIVE),
                ("lock_version", &shown.to_string()),
                ("state", "started"),
                ("force", "on"),
                ("confirmed", "yes"),
            ],
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{html}");
        // The read-only role: every view works, and the database refuses it any write.
        let name = format!("{}_read", deployment.roles.runtime.name);
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE ROLE \"{name}\" LOGIN PASSWORD 'read'"
        )))
        .execute(&admin)
        .await
        .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(read_only_grants_for(&name)))
            .execute(&deployment.owner)
            .await
            .unwrap();
        let reader = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(connect.clone().username(&name).password("read"))
            .await
            .unwrap();
        let root =
            serve(Console::new(idemflow_pg::PgOperator::new(reader.clone())).read_only(true)).await;
        for url in [
            root.clone(),
            format!("{root}/keys?tenant=1"),
            format!("{root}/stuck"),
            key_url(&root, "order-1"),
        ] {
            let (status, html) = page(&url).await;
            assert_eq!(status, StatusCode::OK, "{url}: {html}");
        }
        assert!(
            page(&key_url(&root, "order-1"))
                .await
                .1
                .contains(r#"id="response-status">201<"#)
        );
        let refused = sqlx::query("UPDATE idempotency_keys SET attempts = attempts")
            .execute(&reader)
            .await
            .unwrap_err();
        assert_eq!(crate::roles::sqlstate(&refused), "42501", "{refused}");
        reader.close().await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{name}'; \
             DROP OWNED BY \"{name}\"; DROP ROLE \"{name}\""
        )))
        .execute(&admin)
        .await
        .unwrap();
    })
    .await;
}
