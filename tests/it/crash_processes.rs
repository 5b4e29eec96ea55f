//! Real crashes: the checkout service process is killed with SIGKILL at a chosen crash point
//! (`IDEMFLOW_CRASH_AT`), then a separate worker process finishes the request. The database and
//! the provider's ledger must show one order, one charge and a stored response.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::example::{database_url, example_binary};
use idemflow::core::PhaseName;
use idemflow::{DerivedKey, Key, TenantId};
use idemflow_testkit::provider::MockProvider;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BODY: &str = r#"{"amount": 1234, "currency": "usd", "source": "tok_visa"}"#;

/// Starts `checkout <arguments>` and returns it with the first stdout line containing `marker`.
fn start(
    binary: &std::path::Path,
    arguments: &[&str],
    crash_at: Option<&str>,
) -> (Child, BufReader<std::process::ChildStdout>) {
    let mut command = Command::new(binary);
    command
        .args(arguments)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(point) = crash_at {
        command.env("IDEMFLOW_CRASH_AT", point);
    }
    let mut child = command.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (child, stdout)
}

/// Reads stdout lines until one contains `marker` (bounded by the child's own life).
fn wait_for_line(stdout: &mut BufReader<std::process::ChildStdout>, marker: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let read = stdout.read_line(&mut line).unwrap();
        assert!(read > 0, "the process ended before printing {marker:?}");
        if line.contains(marker) {
            return line.trim().to_owned();
        }
    }
}

/// Sends the checkout request; the crashing service never answers it, so this is fire-and-forget.
async fn send_checkout(base: &str, key: &str) {
    let client = reqwest::Client::new();
    let _ = client
        .post(format!("{base}/v1/checkouts"))
        .header("authorization", "Bearer acme")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("\"{key}\""))
        .body(BODY)
        .timeout(Duration::from_secs(30))
        .send()
        .await;
}

async fn crash_then_finish(pool: &PgPool, url: &str, provider: &MockProvider, point: &str) {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let key = format!("killed-at-{}", point.replace(':', "-"));
    let common = [
        "--database-url",
        url,
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        "30",
    ];

    // The service, told to stop for good at `point`.
    let mut arguments = vec![
        "serve",
        "--bind",
        "127.0.0.1:0",
        "--pool-size",
        crate::support::example::POOL_SIZE,
    ];
    arguments.extend(common);
    let (mut service, mut stdout) = start(&binary, &arguments, Some(point));
    let listening = wait_for_line(&mut stdout, "listening on");
    let base = listening
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .unwrap()
        .to_owned();
    let request = tokio::spawn({
        let key = key.clone();
        async move { send_checkout(&base, &key).await }
    });
    let reached =
        tokio::task::spawn_blocking(move || wait_for_line(&mut stdout, "crash point reached"))
            .await
            .unwrap();
    assert!(reached.ends_with(point), "{reached}");
    service.kill().unwrap(); // SIGKILL
    service.wait().unwrap();
    request.abort();

    // The key is left as the crash left it: started, with its lease. Rewind the lease rather
    // than wait for it, then let a separate worker process finish the request.
    let state: String = sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE key = $1")
        .bind(&key)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(state, "started", "{point}");
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' WHERE key = $1",
    )
    .bind(&key)
    .execute(pool)
    .await
    .unwrap();
    let mut arguments = vec![
        "worker",
        "--metrics-bind",
        "127.0.0.1:0",
        "--pool-size",
        crate::support::example::POOL_SIZE,
    ];
    arguments.extend(common);
    let (mut worker, _stdout) = start(&binary, &arguments, None);
    let mut done = false;
    for _ in 0..200 {
        let state: String = sqlx::query_scalar("SELECT state FROM idempotency_keys WHERE key = $1")
            .bind(&key)
            .fetch_one(pool)
            .await
            .unwrap();
        if state == "done" {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert!(
        done,
        "the worker did not finish the request killed at {point}"
    );

    // One order, paid; one charge under the derived key; the response stored.
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM checkout_orders WHERE request_key = $1")
            .bind(&key)
            .fetch_all(pool)
            .await
            .unwrap();
    assert_eq!(statuses, ["paid"], "{point}");
    let derived = DerivedKey::new(
        &TenantId::new("acme").unwrap(),
        &Key::parse(&key).unwrap(),
        PhaseName::new("charge").unwrap(),
    );
    let charges = provider
        .charges()
        .into_iter()
        .filter(|charge| charge.idempotency_key == derived.as_str())
        .count();
    assert_eq!(charges, 1, "{point}: one charge under {derived}");
    let status: i16 =
        sqlx::query_scalar("SELECT response_status FROM idempotency_keys WHERE key = $1")
            .bind(&key)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(status, 201);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_service_killed_at_a_crash_point_is_finished_by_a_worker_process(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let url = database_url(&connect);
    let pool = options
        .max_connections(2)
        .connect_with(connect)
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    // The service creates the example's table itself; these points are after the claim committed.
    for point in [
        "after_commit:create_order",
        "after_call:charge",
        "before_finish",
    ] {
        crash_then_finish(&pool, &url, &provider, point).await;
    }
    // Two of the three made the call before dying; the worker's call replayed it.
    assert_eq!(provider.charges().len(), 3);
}
