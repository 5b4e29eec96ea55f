//! The checkout example, run as a newcomer runs it: the built example binary starts the service
//! with its own mock provider and resumer on a free port, runs its demo against itself and exits.
//! Every step must behave as described, and the database must hold one order per request.

use std::time::Duration;

use crate::support::example::{DEMO_STEPS, DemoRun, database_url, example_binary, run_demo};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The lease the demo runs with: its crash step waits for it to end. 5 s gives the provider call a
/// 2 s timeout, so the concurrent step's held charge (1 s) leaves room on a loaded machine.
const LEASE_SECONDS: &str = "5";

/// How long the demo may take.
const DEMO_TIMEOUT: Duration = Duration::from_secs(120);

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_demo_runs_every_step_as_described(options: PgPoolOptions, connect: PgConnectOptions) {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let url = database_url(&connect);
    let DemoRun {
        status,
        stdout,
        stderr,
    } = run_demo(&binary, Some(&url), LEASE_SECONDS, &[], DEMO_TIMEOUT).await;
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
    for expected in DEMO_STEPS {
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

/// The main job on a machine with Rust alone: no database named, no `DATABASE_URL`. The example
/// runs on a SQLite file under the target directory, says where, and the demo passes there.
#[tokio::test]
async fn with_no_database_named_the_demo_runs_on_a_sqlite_file_it_names() {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let target = std::env::temp_dir().join("idemflow-checkout-default-target");
    let _ = std::fs::remove_dir_all(&target);
    let target_text = target.to_str().unwrap();
    let DemoRun {
        status,
        stdout,
        stderr,
    } = run_demo(
        &binary,
        None,
        LEASE_SECONDS,
        &[("CARGO_TARGET_DIR", target_text)],
        DEMO_TIMEOUT,
    )
    .await;
    println!("{stdout}");
    eprintln!("{stderr}");
    let status = status.unwrap_or_else(|| panic!("the demo took longer than {DEMO_TIMEOUT:?}"));
    assert!(status.success(), "the demo failed: {status}");
    let file = target.join("idemflow-checkout").join("checkout.db");
    assert!(
        stdout.contains(&format!("SQLite file {}", file.display())),
        "the file is named: {stdout}"
    );
    for expected in DEMO_STEPS {
        assert!(stdout.contains(expected), "the demo printed {expected:?}");
    }
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}", file.display()))
        .await
        .unwrap();
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM checkout_orders ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(statuses, ["paid", "paid", "declined", "paid"]);
    let done: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE state = 'done'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(done >= 4, "{done} keys done");
}

/// The main job on MySQL/MariaDB: `--database-url mysql://…`, a database of its own on the
/// server. The demo passes there, and the database holds one order per request that ran.
#[tokio::test]
async fn on_mariadb_the_demo_runs_every_step_as_described() {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let test = "checkout_example_demo";
    let pool = crate::support::mariadb::fresh(test).await;
    let url = crate::support::mariadb::url_of(&crate::support::mariadb::database_name(test));
    let DemoRun {
        status,
        stdout,
        stderr,
    } = run_demo(&binary, Some(&url), LEASE_SECONDS, &[], DEMO_TIMEOUT).await;
    println!("{stdout}");
    eprintln!("{stderr}");
    let status = status.unwrap_or_else(|| panic!("the demo took longer than {DEMO_TIMEOUT:?}"));
    assert!(status.success(), "the demo failed: {status}");
    for expected in DEMO_STEPS {
        assert!(stdout.contains(expected), "the demo printed {expected:?}");
    }
    let statuses: Vec<String> =
        sqlx::query_scalar("SELECT status FROM checkout_orders ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(statuses, ["paid", "paid", "declined", "paid"]);
}
