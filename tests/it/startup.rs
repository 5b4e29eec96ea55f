//! Start-up is safe however many processes start at once, on every SQL engine: every step that
//! changes the schema (the engine's migrations, the example's own table) is serialized, so no
//! process dies of another's concurrent `CREATE`. Once on PostgreSQL: `duplicate key value violates
//! unique constraint "pg_type_typname_nsp_index"`, the example creating its table outside the
//! migrator's lock; on SQLite, `table idempotency_keys already exists` or `database is locked`
//! (sqlx's migrator takes no lock there); on MariaDB, 1062 on `_sqlx_migrations` (sqlx's lock,
//! `GET_LOCK(name, -1)`, waits for nothing on MariaDB, where a negative timeout is no wait).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use idemflow_testkit::provider::MockProvider;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::engines::Lab;
use crate::support::example::{database_url, example_binary};

/// Kills its processes however the test ends.
struct Processes(Vec<Child>);

impl Drop for Processes {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[sqlx::test(migrations = false)]
async fn services_and_workers_started_at_once_on_a_fresh_database_all_come_up(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    start_at_once(&database_url(&connect)).await;
}

#[tokio::test]
async fn on_sqlite_services_and_workers_started_at_once_on_a_fresh_database_all_come_up() {
    let directory = std::env::temp_dir().join("idemflow-startup-sqlite");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    start_at_once(&format!(
        "sqlite://{}",
        directory.join("checkout.db").display()
    ))
    .await;
}

#[tokio::test]
async fn on_mariadb_services_and_workers_started_at_once_on_a_fresh_database_all_come_up() {
    let database = crate::support::mariadb::empty("startup_at_once").await;
    start_at_once(&crate::support::mariadb::url_of(&database)).await;
}

/// Starts four services and four workers of the checkout example at once on the fresh database
/// at `url`, and waits for each to come up.
async fn start_at_once(url: &str) {
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let provider = MockProvider::start().await;
    let mut processes = Processes(Vec::new());
    // Four services and four workers, all started before any has migrated.
    for index in 0..8 {
        let mut command = Command::new(&binary);
        if index % 2 == 0 {
            command.args(["serve", "--bind", "127.0.0.1:0"]);
        } else {
            command.args(["worker", "--metrics-bind", "127.0.0.1:0"]);
        }
        command
            .args(["--database-url", url, "--psp-url", provider.url()])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        processes.0.push(command.spawn().unwrap());
    }
    // Each must come up: a service says "listening on", a worker "resuming abandoned checkouts"; a process
    // that dies first has its stderr shown.
    let mut waits = Vec::new();
    for child in &mut processes.0 {
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        waits.push(tokio::task::spawn_blocking(move || {
            let mut lines = BufReader::new(stdout).lines();
            for line in lines.by_ref() {
                let line = line.unwrap();
                if line.contains("listening on") || line.contains("resuming abandoned") {
                    return Ok(line);
                }
            }
            let mut error = String::new();
            for line in BufReader::new(stderr).lines() {
                error.push_str(&line.unwrap());
                error.push('\n');
            }
            Err(error)
        }));
    }
    for (index, wait) in waits.into_iter().enumerate() {
        let came_up = tokio::time::timeout(std::time::Duration::from_secs(60), wait)
            .await
            .expect("a process neither came up nor ended")
            .unwrap();
        if let Err(error) = came_up {
            panic!("process {index} died at start-up:\n{error}");
        }
    }
}

/// One call opens each SQL engine the same way (a URL and the engine's settings) and leaves the
/// database migrated: a fresh database takes a key at once.
#[sqlx::test(migrations = false)]
async fn each_engines_open_takes_a_fresh_database_to_a_migrated_pool(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let postgres = idemflow::postgres::open(
        &database_url(&connect),
        &idemflow::postgres::PoolSettings::default(),
    )
    .await
    .unwrap();
    assert_eq!(<idemflow_pg::PgStore as Lab>::keys(&postgres).await, 0);

    let directory = std::env::temp_dir().join("idemflow-startup-open-sqlite");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let sqlite = idemflow::sqlite::open(
        &format!("sqlite://{}", directory.join("fresh.db").display()),
        &idemflow::sqlite::OpenOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(
        <idemflow_sqlite::SqliteStore as Lab>::keys(&sqlite).await,
        0
    );

    let database = crate::support::mariadb::empty("startup_open").await;
    let mysql = idemflow::mysql::open(
        &crate::support::mariadb::url_of(&database),
        &idemflow::mysql::OpenOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(<idemflow_mysql::MySqlStore as Lab>::keys(&mysql).await, 0);
}
