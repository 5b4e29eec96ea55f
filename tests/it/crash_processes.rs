//! Real crashes: the checkout service process is killed with SIGKILL at a chosen crash point
//! (`IDEMFLOW_CRASH_AT`), then a separate worker process finishes the request (itself killed at a
//! crash point once, and another worker finishing after it). The database and the provider's
//! ledger must show one order, one charge and a stored response. On each engine: PostgreSQL, and
//! SQLite with every process on one file.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::support::example::{database_url, example_binary};
use idemflow::core::PhaseName;
use idemflow::{DerivedKey, Key, TenantId};
use idemflow_testkit::provider::MockProvider;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, SqlitePool};

/// The database the processes share, as the test reads it behind their back.
enum Db {
    Postgres(PgPool),
    Sqlite(SqlitePool),
    MySql(sqlx::MySqlPool),
}

impl Db {
    async fn state(&self, key: &str) -> String {
        let sql = "SELECT state FROM idempotency_keys WHERE key = $1";
        match self {
            Self::Postgres(pool) => sqlx::query_scalar(sql).bind(key).fetch_one(pool).await,
            Self::Sqlite(pool) => sqlx::query_scalar(sql).bind(key).fetch_one(pool).await,
            Self::MySql(pool) => {
                sqlx::query_scalar(
                    "SELECT CAST(state AS CHAR) FROM idempotency_keys WHERE `key` = ?",
                )
                .bind(key)
                .fetch_one(pool)
                .await
            }
        }
        .unwrap()
    }

    /// Ends the key's lease by rewinding it, rather than waiting for it.
    async fn lapse(&self, key: &str) {
        match self {
            Self::Postgres(pool) => {
                sqlx::query(
                    "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' \
                     WHERE key = $1",
                )
                .bind(key)
                .execute(pool)
                .await
                .unwrap();
            }
            Self::Sqlite(pool) => {
                sqlx::query(
                    "UPDATE idempotency_keys SET locked_until = locked_until - 86400000 \
                     WHERE key = $1",
                )
                .bind(key)
                .execute(pool)
                .await
                .unwrap();
            }
            Self::MySql(pool) => {
                sqlx::query(
                    "UPDATE idempotency_keys SET locked_until = locked_until - 86400000 \
                     WHERE `key` = ?",
                )
                .bind(key)
                .execute(pool)
                .await
                .unwrap();
            }
        }
    }

    async fn order_statuses(&self, key: &str) -> Vec<String> {
        let sql = "SELECT status FROM checkout_orders WHERE request_key = $1 ORDER BY id";
        match self {
            Self::Postgres(pool) => sqlx::query_scalar(sql).bind(key).fetch_all(pool).await,
            Self::Sqlite(pool) => sqlx::query_scalar(sql).bind(key).fetch_all(pool).await,
            Self::MySql(pool) => {
                sqlx::query_scalar(
                    "SELECT status FROM checkout_orders WHERE request_key = ? ORDER BY id",
                )
                .bind(key)
                .fetch_all(pool)
                .await
            }
        }
        .unwrap()
    }

    async fn response_status(&self, key: &str) -> i64 {
        match self {
            Self::Postgres(pool) => {
                sqlx::query_scalar(
                    "SELECT response_status::bigint FROM idempotency_keys WHERE key = $1",
                )
                .bind(key)
                .fetch_one(pool)
                .await
            }
            Self::Sqlite(pool) => {
                sqlx::query_scalar("SELECT response_status FROM idempotency_keys WHERE key = $1")
                    .bind(key)
                    .fetch_one(pool)
                    .await
            }
            Self::MySql(pool) => {
                sqlx::query_scalar(
                    "SELECT CAST(response_status AS SIGNED) FROM idempotency_keys WHERE `key` = ?",
                )
                .bind(key)
                .fetch_one(pool)
                .await
            }
        }
        .unwrap()
    }
}

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

/// Starts a worker and waits until it has finished `key`; kills it then.
async fn finish_with_a_worker(
    db: &Db,
    binary: &std::path::Path,
    common: &[&str],
    key: &str,
    point: &str,
) {
    let mut arguments = vec![
        "worker",
        "--metrics-bind",
        "127.0.0.1:0",
        "--pool-size",
        crate::support::example::POOL_SIZE,
    ];
    arguments.extend(common);
    let (mut worker, _stdout) = start(binary, &arguments, None);
    let mut done = false;
    for _ in 0..200 {
        if db.state(key).await == "done" {
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
}

/// Kills the service at `point`, then (with `worker_point`) a first worker at that point of its
/// resumption, and lets a worker finish the request.
async fn crash_then_finish(
    db: &Db,
    url: &str,
    provider: &MockProvider,
    point: &str,
    worker_point: Option<&str>,
) {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let key = format!(
        "killed-at-{}{}",
        point.replace(':', "-"),
        worker_point.map_or(String::new(), |then| format!(
            "-then-{}",
            then.replace(':', "-")
        ))
    );
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
    assert_eq!(db.state(&key).await, "started", "{point}");
    db.lapse(&key).await;
    if let Some(worker_point) = worker_point {
        // A first worker takes it over and is killed too, mid-resumption.
        let mut arguments = vec![
            "worker",
            "--metrics-bind",
            "127.0.0.1:0",
            "--pool-size",
            crate::support::example::POOL_SIZE,
        ];
        arguments.extend(common);
        let (mut worker, mut stdout) = start(&binary, &arguments, Some(worker_point));
        let reached =
            tokio::task::spawn_blocking(move || wait_for_line(&mut stdout, "crash point reached"))
                .await
                .unwrap();
        assert!(reached.ends_with(worker_point), "{reached}");
        worker.kill().unwrap(); // SIGKILL, inside its run
        worker.wait().unwrap();
        assert_eq!(
            db.state(&key).await,
            "started",
            "{point}, then {worker_point}"
        );
        db.lapse(&key).await;
    }
    finish_with_a_worker(db, &binary, &common, &key, point).await;

    // One order, paid; one charge under the derived key; the response stored.
    assert_eq!(db.order_statuses(&key).await, ["paid"], "{point}");
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
    assert_eq!(db.response_status(&key).await, 201);
}

/// The crash points, and the one where a first worker dies too: the service dies after the
/// claim committed (so the key is left), before and after the call, inside the finish; a worker
/// dies inside its finish, its write transaction open.
const SERVICE_POINTS: [&str; 3] = [
    "after_commit:create_order",
    "after_call:charge",
    "before_finish",
];
const WORKER_POINT: (&str, &str) = ("after_call:charge", "before_finish");

async fn every_crash<F: std::future::Future<Output = ()>>(
    run: impl Fn(&'static str, Option<&'static str>) -> F,
) {
    for point in SERVICE_POINTS {
        run(point, None).await;
    }
    run(WORKER_POINT.0, Some(WORKER_POINT.1)).await;
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
    let db = Db::Postgres(pool);
    let provider = MockProvider::start().await;
    // The service creates the example's table itself.
    every_crash(|point, worker_point| crash_then_finish(&db, &url, &provider, point, worker_point))
        .await;
    // Three of the four made the call before dying; the worker's call replayed it.
    assert_eq!(provider.charges().len(), 4);
}

/// The same on SQLite: the service and the workers are processes sharing one database file; a
/// process killed inside its write transaction leaves the write lock with it.
#[tokio::test]
async fn on_sqlite_a_service_killed_at_a_crash_point_is_finished_by_a_worker_process_on_the_same_file()
 {
    let directory = std::env::temp_dir().join("idemflow-crash-processes-sqlite");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let file = directory.join("checkout.db");
    let url = format!("sqlite://{}", file.display());
    // Created (and migrated) here first, so the test can read it from the start.
    let pool = idemflow_sqlite::open(&url, &idemflow_sqlite::OpenOptions::default())
        .await
        .unwrap();
    let db = Db::Sqlite(pool);
    let provider = MockProvider::start().await;
    every_crash(|point, worker_point| crash_then_finish(&db, &url, &provider, point, worker_point))
        .await;
    assert_eq!(provider.charges().len(), 4);
}

/// The same on MariaDB: the service and the workers are processes on one database of the server;
/// a process killed inside its transaction leaves it to the server, which rolls it back as the
/// connection drops.
#[tokio::test]
async fn on_mariadb_a_service_killed_at_a_crash_point_is_finished_by_a_worker_process() {
    let test = "crash_processes";
    let pool = crate::support::mariadb::fresh(test).await;
    let url = crate::support::mariadb::url_of(&crate::support::mariadb::database_name(test));
    let db = Db::MySql(pool);
    let provider = MockProvider::start().await;
    every_crash(|point, worker_point| crash_then_finish(&db, &url, &provider, point, worker_point))
        .await;
    assert_eq!(provider.charges().len(), 4);
}
