//! The checkout example, run as a newcomer runs it: the built example binary starts the service
//! with its own mock provider and resumer on a free port, runs its demo against itself and exits.
//! Every step must behave as described, and the database must hold one order per request.
#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use support::example::{database_url, example_binary};

mod support;

/// The lease the demo runs with: its crash step waits for it to end. 5 s gives the provider call a
/// 2 s timeout, so the concurrent step's held charge (1 s) leaves room on a loaded machine.
const LEASE_SECONDS: &str = "5";

/// How long the demo may take.
const DEMO_TIMEOUT: Duration = Duration::from_secs(120);

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_demo_runs_every_step_as_described(options: PgPoolOptions, connect: PgConnectOptions) {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let url = database_url(&connect);
    let mut child = Command::new(&binary)
        .args([
            "all",
            "--demo-only",
            "--bind",
            "127.0.0.1:0",
            "--lease-seconds",
            LEASE_SECONDS,
        ])
        .arg("--database-url")
        .arg(&url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    let read_stdout = std::thread::spawn(move || {
        let mut text = String::new();
        stdout.read_to_string(&mut text).map(|_| text)
    });
    let read_stderr = std::thread::spawn(move || {
        let mut text = String::new();
        stderr.read_to_string(&mut text).map(|_| text)
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > DEMO_TIMEOUT {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let stdout = read_stdout.join().unwrap().unwrap();
    let stderr = read_stderr.join().unwrap().unwrap();
    println!("{stdout}");
    eprintln!("{stderr}");
    let status = status.unwrap_or_else(|| panic!("the demo took longer than {DEMO_TIMEOUT:?}"));
    assert!(status.success(), "the demo failed: {status}");

    let listening = stdout
        .lines()
        .find_map(|line| line.strip_prefix("checkout: listening on http://127.0.0.1:"))
        .expect("the bound address is printed");
    assert!(
        !listening.starts_with("0 "),
        "the bound port is printed: {listening}"
    );
    for expected in [
        "1. A first request",
        "-> 201 Created {",
        "2. The same intent again",
        "-> 201 Created [Idempotent-Replayed: true]",
        "3. A concurrent duplicate",
        "-> 409 Conflict [Retry-After:",
        "4. The key of step 1 reused",
        "-> 422 Unprocessable Entity {\"code\":\"idempotency_key_reused\"",
        "5. A declined card",
        "-> 402 Payment Required",
        "6. A crash",
        "-> 503 Service Unavailable",
        "GET /v1/checkouts/",
        "-> 200 OK {",
        "1 charge(s)",
        "== demo passed: every step behaved as expected ==",
        "checkout: stopped",
    ] {
        assert!(stdout.contains(expected), "the demo printed {expected:?}");
    }
    assert!(!stdout.contains("UNEXPECTED"));

    // One order per request that ran (first, concurrent, declined, crash): the crashed request was
    // finished from its recovery point, not created again.
    let pool = options.connect_with(connect).await.unwrap();
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM checkout_orders ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(statuses, ["paid", "paid", "declined", "paid"]);
}
