//! The CLI's commands against a real PostgreSQL, one fresh database per test, each output
//! compared whole with a snapshot (text and JSON). The real binary is run end to end by the
//! `idemflow` crate's tests (`tests/it/cli_binary.rs`), which build it.
//!
//! Snapshots: each compared output is a file in `tests/snapshots/`, named at its assertion.
//! `UPDATE_SNAPSHOTS=1` makes the tests write what the commands print now to those files instead
//! of comparing (a missing file is created); review the diff before committing it. The exit code
//! and the other stream are still checked:
//!
//! ```text
//! UPDATE_SNAPSHOTS=1 DATABASE_URL=postgres://... cargo test -p idemflow-cli --test cli
//! ```
//!
//! Time: most tests seed and read inside one transaction, where `now()` stands still, so leases,
//! ages and lags are exact to the millisecond, in text and in JSON. The tests named
//! `..._on_the_real_clock` (and the binary test) seed committed rows and read them later, as an
//! operator would: their text output must not flicker either (leases left round up to whole
//! seconds, time elapsed rounds down, seeds sit hours away from a unit boundary).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use idemflow_cli::{Format, InspectOptions, Output};
use idemflow_core::Fingerprint;
use idemflow_pg::PgOperator;
use idemflow_store::{
    KeyBodies, KeyReport, Migration, Operator, OperatorError, Overview, ScanFrom, TableStats,
};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Mutex;

/// The operator's door to one connection the test holds, often inside its transaction (where
/// `now()` stands still, so leases and ages print exact): each read is the engine's own
/// function on that connection.
#[derive(Debug)]
struct Held<'a>(Mutex<&'a mut PgConnection>);

impl<'a> Held<'a> {
    fn new(connection: &'a mut PgConnection) -> Self {
        Self(Mutex::new(connection))
    }
}

fn failed(error: idemflow_pg::StoreError) -> OperatorError {
    OperatorError::Engine(error.into())
}

#[async_trait::async_trait]
impl Operator for Held<'_> {
    fn engine(&self) -> &'static str {
        "PostgreSQL"
    }

    async fn migrate(&self) -> Result<Option<Vec<Migration>>, OperatorError> {
        unreachable!("migrate runs on a pool: PgOperator")
    }

    async fn key_report(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<KeyReport>, OperatorError> {
        let mut connection = self.0.lock().await;
        idemflow_pg::key_report(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn key_bodies(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<KeyBodies>, OperatorError> {
        let mut connection = self.0.lock().await;
        idemflow_pg::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck_keys(
        &self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, OperatorError> {
        let mut connection = self.0.lock().await;
        idemflow_pg::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(failed)
    }

    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, OperatorError> {
        let mut connection = self.0.lock().await;
        let advanced = idemflow_pg::end_lease(&mut connection, tenant, key, lock_version)
            .await
            .map_err(failed)?;
        if advanced.is_some() {
            idemflow_pg::notify_due(&mut connection)
                .await
                .map_err(failed)?;
        }
        Ok(advanced)
    }

    async fn expire_key(
        &self,
        _: &str,
        _: &str,
        _: i64,
        _: &str,
    ) -> Result<Option<String>, OperatorError> {
        unreachable!("the CLI expires by age")
    }

    async fn expire_batch(&self, older_than: Duration, batch: i64) -> Result<u64, OperatorError> {
        let mut connection = self.0.lock().await;
        idemflow_pg::expire_batch(&mut connection, older_than, batch)
            .await
            .map_err(failed)
    }

    async fn table_stats(&self) -> Result<TableStats, OperatorError> {
        let mut connection = self.0.lock().await;
        idemflow_pg::table_stats(&mut connection)
            .await
            .map_err(failed)
    }

    async fn overview(&self) -> Result<Overview, OperatorError> {
        unreachable!("the console's")
    }

    async fn scan_keys(&self, _: &ScanFrom, _: i64) -> Result<Vec<KeyReport>, OperatorError> {
        unreachable!("the console's")
    }

    async fn close(&self) {}
}

/// One row of `idempotency_keys`; times are intervals relative to `now()`.
#[derive(Debug, Clone, Copy)]
struct Seed<'a> {
    tenant: &'a str,
    key: &'a str,
    workflow: &'a str,
    /// The request body the fingerprint is taken of (POST /v1/checkouts).
    body: &'a str,
    state: &'a str,
    recovery_point: &'a str,
    /// `locked_until = now() + lease`; `None` for a done key.
    lease: Option<&'a str>,
    lock_version: i64,
    attempts: i32,
    last_error: Option<&'a str>,
    /// Status and body of a done key's response.
    response: Option<(i16, &'a str)>,
    /// `created_at = now() - age` (and `finished_at`, for a done key).
    age: &'a str,
}

const DONE: Seed<'static> = Seed {
    tenant: "acme",
    key: "order-1",
    workflow: "checkout.v1",
    body: r#"{"amount":1200,"currency":"EUR"}"#,
    state: "done",
    recovery_point: "finish",
    lease: None,
    lock_version: 0,
    attempts: 1,
    last_error: None,
    response: Some((201, r#"{"order_id":41}"#)),
    age: "2 days",
};

/// Leased for an hour more: someone is working on it.
const LIVE: Seed<'static> = Seed {
    key: "order-2",
    body: r#"{"order":"order-2"}"#,
    state: "started",
    recovery_point: "create_order",
    lease: Some("1 hour"),
    response: None,
    ..DONE
};

/// Its lease ended an hour ago after a retryable error: stuck.
const EXPIRED: Seed<'static> = Seed {
    key: "order-3",
    body: r#"{"order":"order-3"}"#,
    lease: Some("-1 hour"),
    lock_version: 2,
    attempts: 3,
    last_error: Some("charge: provider unavailable (503)"),
    ..LIVE
};

/// Within its lease, but retried seven times: stuck too.
const RETRIED: Seed<'static> = Seed {
    tenant: "globex",
    key: "refund-9",
    workflow: "refund.v1",
    body: r#"{"order":"refund-9"}"#,
    recovery_point: "start",
    lease: Some("10 minutes"),
    lock_version: 6,
    attempts: 7,
    last_error: Some("refund: card\nexpired"),
    age: "3 days",
    ..LIVE
};

async fn seed(connection: &mut PgConnection, seed: Seed<'_>) {
    let fingerprint = Fingerprint::of_json("POST", "/v1/checkouts", seed.body.as_bytes()).unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, state, \
             recovery_point, locked_until, lock_version, attempts, last_error, response_status, \
             response_headers, response_body, created_at, updated_at, finished_at) \
         VALUES ($1, $2, $3, $4, $5::text::jsonb, $6, $7, now() + $8::interval, $9, $10, $11, $12, \
                 CASE WHEN $6 = 'done' THEN '[]'::jsonb END, $13, now() - $14::interval, \
                 now() - $14::interval, CASE WHEN $6 = 'done' THEN now() - $14::interval END)",
    )
    .bind(seed.tenant)
    .bind(seed.key)
    .bind(fingerprint.as_bytes().as_slice())
    .bind(seed.workflow)
    .bind(seed.body)
    .bind(seed.state)
    .bind(seed.recovery_point)
    .bind(seed.lease)
    .bind(seed.lock_version)
    .bind(seed.attempts)
    .bind(seed.last_error)
    .bind(seed.response.map(|(status, _)| status))
    .bind(seed.response.map(|(_, body)| body.as_bytes()))
    .bind(seed.age)
    .execute(connection)
    .await
    .unwrap();
}

async fn seed_all(connection: &mut PgConnection, seeds: &[Seed<'_>]) {
    for &one in seeds {
        seed(connection, one).await;
    }
}

/// Compares `actual` whole with the snapshot `tests/snapshots/<name>`; with `UPDATE_SNAPSHOTS=1`,
/// writes `actual` there instead.
#[track_caller]
fn assert_snapshot(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var("UPDATE_SNAPSHOTS").as_deref() == Ok("1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = match std::fs::read_to_string(&path) {
        Ok(expected) => expected,
        Err(error) => panic!(
            "snapshot {}: {error} (UPDATE_SNAPSHOTS=1 writes it)",
            path.display()
        ),
    };
    assert_eq!(
        actual, expected,
        "snapshot {name} differs (UPDATE_SNAPSHOTS=1 rewrites it)\n--- actual ---\n{actual}"
    );
}

/// The command exited `code`, printed the snapshot `name` on stdout, and nothing on stderr.
#[track_caller]
fn assert_stdout(output: Output, code: u8, name: &str) {
    assert_eq!(
        (output.code, output.stderr.as_str()),
        (code, ""),
        "\n--- stdout ---\n{}",
        output.stdout
    );
    assert_snapshot(name, &output.stdout);
}

/// The command exited `code`, printed nothing on stdout, and the snapshot `name` on stderr.
#[track_caller]
fn assert_stderr(output: Output, code: u8, name: &str) {
    assert_eq!(
        (output.code, output.stdout.as_str()),
        (code, ""),
        "\n--- stderr ---\n{}",
        output.stderr
    );
    assert_snapshot(name, &output.stderr);
}

// ---------------------------------------------------------------------------------------------
// inspect

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_shows_a_done_key(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed(&mut tx, DONE).await;

    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Human, "acme", "order-1").await;
    assert_stdout(output, 0, "inspect_done.txt");

    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Json, "acme", "order-1").await;
    assert_stdout(output, 0, "inspect_done.json");
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_shows_a_started_key_and_its_lease_left(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed(&mut tx, LIVE).await;

    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Human, "acme", "order-2").await;
    assert_stdout(output, 0, "inspect_started.txt");

    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Json, "acme", "order-2").await;
    assert_stdout(output, 0, "inspect_started.json");
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_shows_an_expired_lease_and_the_last_error(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed_all(&mut tx, &[EXPIRED, RETRIED]).await;

    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Human, "acme", "order-3").await;
    assert_stdout(output, 0, "inspect_expired.txt");

    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Json, "acme", "order-3").await;
    assert_stdout(output, 0, "inspect_expired.json");

    // A last error that spans lines stays on one line, escaped; JSON keeps it as it is.
    let output =
        idemflow_cli::inspect(&Held::new(&mut tx), Format::Human, "globex", "refund-9").await;
    assert!(
        output
            .stdout
            .contains("\nlast error      refund: card\\nexpired\n"),
        "{}",
        output.stdout
    );
    let output =
        idemflow_cli::inspect(&Held::new(&mut tx), Format::Json, "globex", "refund-9").await;
    assert!(
        output
            .stdout
            .contains(r#""last_error": "refund: card\nexpired","#),
        "{}",
        output.stdout
    );
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_of_a_missing_key_exits_1(pool: PgPool) {
    let mut connection = pool.acquire().await.unwrap();
    seed(&mut connection, DONE).await;

    let output = idemflow_cli::inspect(
        &Held::new(&mut connection),
        Format::Human,
        "acme",
        "order-9",
    )
    .await;
    assert_stderr(output, 1, "inspect_missing_key.txt");
    // The same key under another tenant is another key.
    let output = idemflow_cli::inspect(
        &Held::new(&mut connection),
        Format::Json,
        "globex",
        "order-1",
    )
    .await;
    assert_stdout(output, 1, "inspect_missing_key_other_tenant.json");
    // A tenant or key that could never exist is a usage error.
    let output = idemflow_cli::inspect(
        &Held::new(&mut connection),
        Format::Human,
        "ac me",
        "order-1",
    )
    .await;
    assert_eq!(output.code, 2);
    assert!(
        output.stderr.starts_with("error: the tenant id "),
        "{}",
        output.stderr
    );
    let output =
        idemflow_cli::inspect(&Held::new(&mut connection), Format::Human, "acme", "").await;
    assert_stderr(output, 2, "inspect_empty_key.txt");
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_does_not_flicker_on_the_real_clock(pool: PgPool) {
    seed_all(&mut pool.acquire().await.unwrap(), &[LIVE, EXPIRED]).await;
    // Time passes between the seed and the read, as it does for an operator.
    tokio::time::sleep(Duration::from_millis(20)).await;

    let mut connection = pool.acquire().await.unwrap();
    let live = idemflow_cli::inspect(
        &Held::new(&mut connection),
        Format::Human,
        "acme",
        "order-2",
    )
    .await;
    assert!(
        live.stdout.contains("\nlease           1h 0m left\n"),
        "{}",
        live.stdout
    );
    assert!(
        live.stdout
            .ends_with("\nage             2d 0h\nexpiry          not expired while started\n"),
        "{}",
        live.stdout
    );
    let expired = idemflow_cli::inspect(
        &Held::new(&mut connection),
        Format::Human,
        "acme",
        "order-3",
    )
    .await;
    assert!(
        expired
            .stdout
            .contains("\nlease           expired 1h 0m ago\n"),
        "{}",
        expired.stdout
    );
}

// ---------------------------------------------------------------------------------------------
// inspect --show-request --show-response, and when retention deletes a key

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Both bodies, against a week's retention.
fn show() -> InspectOptions {
    InspectOptions::default()
        .with_show_request(true)
        .with_show_response(true)
        .with_retention(Some(Duration::from_secs(7 * 24 * 60 * 60)))
}

/// Replaces the stored request of the seeded key `key` of tenant acme (JSON text).
async fn store_request(connection: &mut PgConnection, key: &str, request: &str) {
    sqlx::query(
        "UPDATE idempotency_keys SET request = $2::text::jsonb WHERE tenant = 'acme' AND key = $1",
    )
    .bind(key)
    .bind(request)
    .execute(connection)
    .await
    .unwrap();
}

/// Replaces the stored response of the done key `key` of tenant acme: headers (JSON text, as the
/// runner writes them) and body.
async fn store_response(connection: &mut PgConnection, key: &str, headers: &str, body: &[u8]) {
    sqlx::query(
        "UPDATE idempotency_keys SET response_headers = $2::text::jsonb, response_body = $3 \
         WHERE tenant = 'acme' AND key = $1",
    )
    .bind(key)
    .bind(headers)
    .bind(body)
    .execute(connection)
    .await
    .unwrap();
}

/// Moves the body of the done key `key` of tenant acme out of its row, as a finish stores a body
/// above `response_apart_above`: in `idempotency_responses`, under the key's life.
async fn store_apart(connection: &mut PgConnection, key: &str) {
    sqlx::query(
        "INSERT INTO idempotency_responses (tenant, key, body, created_at) \
         SELECT tenant, key, response_body, created_at FROM idempotency_keys \
         WHERE tenant = 'acme' AND key = $1",
    )
    .bind(key)
    .execute(&mut *connection)
    .await
    .unwrap();
    sqlx::query(
        "UPDATE idempotency_keys SET response_body = NULL, response_apart = true \
         WHERE tenant = 'acme' AND key = $1",
    )
    .bind(key)
    .execute(connection)
    .await
    .unwrap();
}

fn document(output: &Output) -> serde_json::Value {
    assert_eq!((output.code, output.stderr.as_str()), (0, ""), "{output:?}");
    serde_json::from_str(&output.stdout).unwrap()
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_shows_the_stored_request_and_response(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed_all(&mut tx, &[DONE, LIVE]).await;
    store_response(
        &mut tx,
        "order-1",
        r#"[["content-type", "application/json"], ["x-request-id", "req-7"]]"#,
        br#"{"order_id":41}"#,
    )
    .await;

    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-1",
        &show(),
    )
    .await;
    assert_stdout(output, 0, "inspect_bodies.txt");
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Json,
        "acme",
        "order-1",
        &show(),
    )
    .await;
    assert_stdout(output, 0, "inspect_bodies.json");

    // Only what is asked for.
    let request_only = show().with_show_response(false);
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-1",
        &request_only,
    )
    .await;
    assert!(
        output.stdout.contains("\nrequest\n{\n"),
        "{}",
        output.stdout
    );
    assert!(
        !output.stdout.contains("\nresponse 201"),
        "{}",
        output.stdout
    );
    let json = document(
        &idemflow_cli::inspect_with(
            &Held::new(&mut tx),
            Format::Json,
            "acme",
            "order-1",
            &request_only,
        )
        .await,
    );
    assert_eq!(json["request"]["json"]["currency"], "EUR");
    assert!(json.get("response").is_none(), "{json}");

    // A body stored apart is read from there, and said to be.
    store_apart(&mut tx, "order-1").await;
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-1",
        &show(),
    )
    .await;
    assert!(
        output.stdout.ends_with(
            "\nresponse 201, body 15 bytes, stored apart\ncontent-type: application/json\n\
             x-request-id: req-7\n\n{\"order_id\":41}\n"
        ),
        "{}",
        output.stdout
    );
    let json = document(
        &idemflow_cli::inspect_with(
            &Held::new(&mut tx),
            Format::Json,
            "acme",
            "order-1",
            &show(),
        )
        .await,
    );
    assert_eq!(json["response"]["body_apart"], true, "{json}");
    assert_eq!(json["response"]["body"], r#"{"order_id":41}"#);
    assert_eq!(json["response_bytes"], 15);

    // A started key has a request and no response yet.
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-2",
        &show(),
    )
    .await;
    assert_stdout(output, 0, "inspect_bodies_started.txt");
    let json = document(
        &idemflow_cli::inspect_with(
            &Held::new(&mut tx),
            Format::Json,
            "acme",
            "order-2",
            &show(),
        )
        .await,
    );
    assert_eq!(json["request"]["json"]["order"], "order-2");
    assert_eq!(json["response"], serde_json::Value::Null, "{json}");
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_shows_bodies_that_are_not_text_too_large_or_hostile(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    let large = Seed {
        key: "order-7",
        ..DONE
    };
    let hostile = Seed {
        key: "order-8",
        ..DONE
    };
    seed_all(&mut tx, &[DONE, large, hostile]).await;

    // Bytes that are not UTF-8: base64, said so; JSON says which encoding it used.
    store_response(
        &mut tx,
        "order-1",
        r#"[["content-type", "application/octet-stream"]]"#,
        &[0xde, 0xad, 0xbe, 0xef],
    )
    .await;
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-1",
        &show(),
    )
    .await;
    assert!(
        output.stdout.ends_with(
            "\nresponse 201, body 4 bytes, not UTF-8: shown as base64\n\
             content-type: application/octet-stream\n\n3q2+7w==\n"
        ),
        "{}",
        output.stdout
    );
    let json = document(
        &idemflow_cli::inspect_with(
            &Held::new(&mut tx),
            Format::Json,
            "acme",
            "order-1",
            &show(),
        )
        .await,
    );
    assert_eq!(json["response"]["body_encoding"], "base64");
    assert_eq!(json["response"]["body"], "3q2+7w==");
    assert_eq!(json["response"]["body_bytes"], 4);

    // A large body is cut in text, with its size; JSON has it whole.
    let body = "é".repeat(5000);
    store_response(&mut tx, "order-7", "[]", body.as_bytes()).await;
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-7",
        &show(),
    )
    .await;
    assert!(
        output.stdout.ends_with(&format!(
            "\nresponse 201, body 10000 bytes\n\n{}\n\
             ... truncated: 4096 of 10000 bytes shown (--json shows the whole body)\n",
            "é".repeat(2048)
        )),
        "{}",
        output.stdout
    );
    let json = document(
        &idemflow_cli::inspect_with(
            &Held::new(&mut tx),
            Format::Json,
            "acme",
            "order-7",
            &show(),
        )
        .await,
    );
    assert_eq!(json["response"]["body"], body.as_str());

    // Control characters from the database reach no terminal: escaped in the request, the
    // headers and the body (a body's newlines and tabs kept), and in JSON.
    store_request(&mut tx, "order-8", r#"{"note": "\u001b[31mred\u009b"}"#).await;
    store_response(
        &mut tx,
        "order-8",
        r#"[["x-note", "a\u001bb"], ["x-latin-1", {"bytes": "Y2Fm6Q=="}]]"#,
        b"line 1\n\tline 2\r\x1b[2J\xc2\x9b\x7f",
    )
    .await;
    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-8",
        &show(),
    )
    .await;
    assert!(
        output
            .stdout
            .contains("\n  \"note\": \"\\u001b[31mred\\u009b\"\n"),
        "{}",
        output.stdout
    );
    assert!(
        output.stdout.ends_with(
            "\nresponse 201, body 22 bytes\nx-note: a\\u{1b}b\nx-latin-1: caf\\xe9\n\n\
             line 1\n\tline 2\\r\\u{1b}[2J\\u{9b}\\u{7f}\n"
        ),
        "{}",
        output.stdout
    );
    let json_output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Json,
        "acme",
        "order-8",
        &show(),
    )
    .await;
    for output in [&output, &json_output] {
        assert!(
            !output.stdout.contains(['\u{1b}', '\u{9b}', '\u{7f}', '\r']),
            "{:?}",
            output.stdout
        );
    }
    let json = document(&json_output);
    assert_eq!(json["request"]["json"]["note"], "\u{1b}[31mred\u{9b}");
    assert_eq!(
        json["response"]["body"],
        "line 1\n\tline 2\r\u{1b}[2J\u{9b}\u{7f}"
    );
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_names_the_key_of_sealed_values_and_opens_none(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed(&mut tx, DONE).await;
    // As the runner stores them sealed (crates/idemflow-runner/src/sealing.rs).
    store_request(
        &mut tx,
        "order-1",
        r#"{"idemflow:sealed": "2026-12", "data": "AQBzZWNyZXQtcmVxdWVzdA=="}"#,
    )
    .await;
    store_response(
        &mut tx,
        "order-1",
        r#"[["idemflow:sealed", "2026-11"]]"#,
        b"\x02sealed-response-bytes",
    )
    .await;

    let output = idemflow_cli::inspect_with(
        &Held::new(&mut tx),
        Format::Human,
        "acme",
        "order-1",
        &show(),
    )
    .await;
    assert!(
        !output.stdout.contains("sealed-response"),
        "{}",
        output.stdout
    );
    assert!(!output.stdout.contains("AQBz"), "{}", output.stdout);
    assert_stdout(output, 0, "inspect_sealed.txt");
    let json = document(
        &idemflow_cli::inspect_with(
            &Held::new(&mut tx),
            Format::Json,
            "acme",
            "order-1",
            &show(),
        )
        .await,
    );
    assert_eq!(
        json["request"],
        serde_json::json!({"sealed_under": "2026-12", "json": null})
    );
    assert_eq!(
        json["response"],
        serde_json::json!({
            "status": 201,
            "sealed_under": "2026-11",
            "headers": null,
            "body_bytes": 22,
            "body_apart": false,
            "body_encoding": null,
            "body": null,
        })
    );
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn inspect_tells_when_retention_deletes_the_key(pool: PgPool) {
    use serde_json::json;

    let mut tx = pool.begin().await.unwrap();
    let fresh = Seed {
        key: "order-7",
        age: "1 hour",
        ..DONE
    };
    seed_all(&mut tx, &[DONE, LIVE, fresh]).await;
    let expiry = async |tx: &mut PgConnection, key: &str, retention: Option<Duration>| {
        let options = InspectOptions::default().with_retention(retention);
        let output =
            idemflow_cli::inspect_with(&Held::new(tx), Format::Human, "acme", key, &options).await;
        let line = output
            .stdout
            .lines()
            .find_map(|line| line.strip_prefix("expiry          "))
            .map(str::to_owned);
        let json = document(
            &idemflow_cli::inspect_with(&Held::new(tx), Format::Json, "acme", key, &options).await,
        );
        (
            line.unwrap_or_else(|| panic!("no expiry line: {}", output.stdout)),
            [
                json["finished_seconds_ago"].clone(),
                json["retention_seconds"].clone(),
                json["expires_in_seconds"].clone(),
            ],
        )
    };

    // Finished two days ago: a week's retention keeps it five days more.
    assert_eq!(
        expiry(&mut tx, "order-1", Some(7 * DAY)).await,
        (
            "expires in ~5d 0h (finished 2d 0h ago; retention 7d 0h)".to_owned(),
            [json!(172_800), json!(604_800), json!(432_000)]
        )
    );
    // A day's retention: the next run of retention deletes it.
    assert_eq!(
        expiry(&mut tx, "order-1", Some(DAY)).await,
        (
            "due for expiry (finished 2d 0h ago; retention 1d 0h)".to_owned(),
            [json!(172_800), json!(86_400), json!(-86_400)]
        )
    );
    // Not told the period, it says which one it assumed: the runner's default.
    assert_eq!(
        expiry(&mut tx, "order-7", None).await.0,
        "expires in ~23h 0m (finished 1h 0m ago; retention 1d 0h, the runner's default)"
    );
    // A started key is never expired.
    assert_eq!(
        expiry(&mut tx, "order-2", Some(DAY)).await,
        (
            "not expired while started".to_owned(),
            [json!(null), json!(86_400), json!(null)]
        )
    );
}

// ---------------------------------------------------------------------------------------------
// list --stuck

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn list_stuck_shows_expired_and_much_retried_keys(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed_all(&mut tx, &[DONE, LIVE, EXPIRED, RETRIED]).await;

    let output = idemflow_cli::list_stuck(&Held::new(&mut tx), Format::Human, 5, 100).await;
    assert_stdout(output, 0, "list_stuck.txt");

    let output = idemflow_cli::list_stuck(&Held::new(&mut tx), Format::Json, 5, 100).await;
    assert_stdout(output, 0, "list_stuck.json");

    // Fewer attempts make more keys stuck; a limit says when it cut the list.
    let output = idemflow_cli::list_stuck(&Held::new(&mut tx), Format::Human, 1, 2).await;
    assert_stdout(output, 0, "list_stuck_limited.txt");
    let output = idemflow_cli::list_stuck(&Held::new(&mut tx), Format::Human, 1, 100).await;
    assert!(
        output.stdout.contains("\nacme    order-2   "),
        "{}",
        output.stdout
    );
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn list_stuck_says_when_nothing_is_stuck(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed_all(&mut tx, &[DONE, LIVE]).await;

    let output = idemflow_cli::list_stuck(&Held::new(&mut tx), Format::Human, 5, 100).await;
    assert_stdout(output, 0, "list_stuck_none.txt");
    let output = idemflow_cli::list_stuck(&Held::new(&mut tx), Format::Json, 5, 100).await;
    assert_stdout(output, 0, "list_stuck_none.json");
}

// ---------------------------------------------------------------------------------------------
// end-lease

/// A live lease means its owner may be running: refused (exit 1, the row untouched) unless
/// forced. Forced, the lease ends and the fence advances, so the owner that held the old token
/// can write nothing more (on a plain-handler route its handler is not fenced, and a takeover could
/// otherwise have run it beside the live one with the owner's writes still landing).
#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn end_lease_refuses_a_live_owner_unless_forced_and_forcing_advances_the_fence(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed_all(&mut tx, &[DONE, LIVE]).await;

    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Human, "acme", "order-2", false).await;
    assert_stdout(output, 1, "end_lease_live_refused.txt");
    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Json, "acme", "order-2", false).await;
    assert_stdout(output, 1, "end_lease_live_refused.json");
    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Human, "acme", "order-2").await;
    assert!(
        output.stdout.contains("\nlease           1h 0m left\n"),
        "{}",
        output.stdout
    );
    assert!(output.stdout.contains("\nlock_version    0\n"));

    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Human, "acme", "order-2", true).await;
    assert_stdout(output, 0, "end_lease_live.txt");
    // The lease ended at now(), which stands still in this transaction.
    let output = idemflow_cli::inspect(&Held::new(&mut tx), Format::Human, "acme", "order-2").await;
    assert!(
        output.stdout.contains("\nlease           expired 0s ago\n"),
        "{}",
        output.stdout
    );
    assert!(
        !output.stdout.contains("\nlock_version    0\n"),
        "{}",
        output.stdout
    );
    // The owner holding token 0 is fenced out: every write of an owner names its token.
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys \
         WHERE tenant = 'acme' AND key = 'order-2' AND lock_version = 0",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(held, 0);

    // Ended again: its lease already ended, there is nothing to do (forced or not).
    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Json, "acme", "order-2", false).await;
    assert_stdout(output, 0, "end_lease_again.json");

    // A done key has no lease to end.
    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Human, "acme", "order-1", true).await;
    assert_stdout(output, 1, "end_lease_done.txt");
    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Json, "acme", "order-1", true).await;
    assert_stdout(output, 1, "end_lease_done.json");

    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Human, "acme", "order-9", true).await;
    assert_stdout(output, 1, "end_lease_missing.txt");
    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Json, "acme", "order-9", true).await;
    assert_stdout(output, 1, "end_lease_missing.json");
}

/// A due key may be of a workflow no resumer runs: a live-only one (a plain-handler route's),
/// which only the request's next retry can finish. Nothing in the database says which it is, so
/// the answer names the retry first and promises no resumer.
#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn end_lease_says_who_takes_a_due_key_over(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    let plain_handler = Seed {
        workflow: "orders-route",
        ..EXPIRED
    };
    seed_all(&mut tx, &[plain_handler, LIVE]).await;
    let takes_over = |workflow: &str| {
        format!(
            "it is due now: the next retry of the request takes it over, or a resumer that runs \
             workflow \"{workflow}\" (none runs a live-only workflow, such as a plain-handler \
             route's: its keys wait for that retry)\n"
        )
    };

    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Human, "acme", "order-3", false).await;
    assert_eq!(
        (output.code, output.stdout.as_str()),
        (
            0,
            format!(
                "nothing to end: the lease of key \"order-3\" of tenant \"acme\" expired 1h 0m \
                 ago; {}",
                takes_over("orders-route")
            )
            .as_str()
        )
    );
    let output =
        idemflow_cli::end_lease(&Held::new(&mut tx), Format::Human, "acme", "order-2", true).await;
    assert_eq!(output.code, 0, "{output:?}");
    assert!(
        output.stdout.ends_with(&format!(
            "the owner's writes are refused from now on; {}",
            takes_over("checkout.v1")
        )),
        "{}",
        output.stdout
    );
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn ending_a_lease_is_fenced_by_the_lock_version_it_read(pool: PgPool) {
    seed(&mut pool.acquire().await.unwrap(), LIVE).await;
    // A takeover in flight: the row is locked and its lock_version bumped, not yet committed.
    let mut takeover = pool.begin().await.unwrap();
    sqlx::query(
        "UPDATE idempotency_keys SET lock_version = lock_version + 1, attempts = attempts + 1 \
         WHERE tenant = 'acme' AND key = 'order-2'",
    )
    .execute(&mut *takeover)
    .await
    .unwrap();

    // end-lease reads lock_version 0 (the committed one), then waits for the takeover's row lock.
    let release = tokio::spawn({
        let pool = pool.clone();
        async move {
            let mut connection = pool.acquire().await.unwrap();
            idemflow_cli::end_lease(
                &Held::new(&mut connection),
                Format::Human,
                "acme",
                "order-2",
                true,
            )
            .await
        }
    });
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND wait_event_type = 'Lock'",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            if waiting == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap();
    takeover.commit().await.unwrap();

    // Its fenced update then matches no row: the new owner's lease is left alone.
    assert_stdout(release.await.unwrap(), 1, "end_lease_fenced.txt");
    let output = idemflow_cli::inspect(
        &Held::new(&mut pool.acquire().await.unwrap()),
        Format::Human,
        "acme",
        "order-2",
    )
    .await;
    assert!(
        output.stdout.contains("\nlease           1h 0m left\n"),
        "{}",
        output.stdout
    );
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn ending_a_lease_wakes_idle_resumers(pool: PgPool) {
    seed(&mut pool.acquire().await.unwrap(), LIVE).await;
    let mut listener = sqlx::postgres::PgListener::connect_with(&pool)
        .await
        .unwrap();
    listener.listen(idemflow_pg::DUE_CHANNEL).await.unwrap();

    let output = idemflow_cli::end_lease(
        &Held::new(&mut pool.acquire().await.unwrap()),
        Format::Human,
        "acme",
        "order-2",
        true,
    )
    .await;
    assert_eq!(output.code, 0, "{output:?}");
    let notification = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(notification.channel(), idemflow_pg::DUE_CHANNEL);
}

// ---------------------------------------------------------------------------------------------
// expire

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn expire_deletes_only_old_finished_keys(pool: PgPool) {
    let old_done = [
        DONE,
        Seed {
            key: "order-7",
            age: "25 hours",
            ..DONE
        },
    ];
    let fresh_done = Seed {
        key: "order-8",
        age: "23 hours",
        ..DONE
    };
    let old_started = Seed {
        age: "3 days",
        ..EXPIRED
    };
    let mut connection = pool.acquire().await.unwrap();
    seed_all(&mut connection, &old_done).await;
    seed_all(&mut connection, &[fresh_done, old_started, LIVE]).await;
    drop(connection);

    let day = Duration::from_secs(24 * 60 * 60);
    // One row per batch: expire goes on until nothing old is left.
    let output = idemflow_cli::expire(&PgOperator::new(pool.clone()), Format::Human, day, 1).await;
    assert_stdout(output, 0, "expire_old.txt");
    let output =
        idemflow_cli::expire(&PgOperator::new(pool.clone()), Format::Json, day, 1000).await;
    assert_stdout(output, 0, "expire_nothing_left.json");

    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys ORDER BY key")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["order-2", "order-3", "order-8"]);

    let output = idemflow_cli::expire(
        &PgOperator::new(pool.clone()),
        Format::Human,
        Duration::from_secs(60),
        1000,
    )
    .await;
    assert_stdout(output, 0, "expire_one_minute.txt");
}

// ---------------------------------------------------------------------------------------------
// stats

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn stats_counts_keys_and_measures_the_resumer_lag(pool: PgPool) {
    let mut tx = pool.begin().await.unwrap();
    seed_all(&mut tx, &[DONE, LIVE, EXPIRED, RETRIED]).await;

    let output = idemflow_cli::stats(&Held::new(&mut tx), Format::Human).await;
    assert_stdout(output, 0, "stats.txt");
    let output = idemflow_cli::stats(&Held::new(&mut tx), Format::Json).await;
    assert_stdout(output, 0, "stats.json");
}

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn stats_of_an_empty_table(pool: PgPool) {
    let mut connection = pool.acquire().await.unwrap();
    let output = idemflow_cli::stats(&Held::new(&mut connection), Format::Human).await;
    assert_stdout(output, 0, "stats_empty.txt");
    let output = idemflow_cli::stats(&Held::new(&mut connection), Format::Json).await;
    assert_stdout(output, 0, "stats_empty.json");
}

// ---------------------------------------------------------------------------------------------
// migrate

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn migrate_again_changes_nothing_and_lists_the_migrations(pool: PgPool) {
    let output = idemflow_cli::migrate(&PgOperator::new(pool.clone()), Format::Human).await;
    assert_stdout(output, 0, "migrate.txt");
    let output = idemflow_cli::migrate(&PgOperator::new(pool.clone()), Format::Json).await;
    assert_stdout(output, 0, "migrate.json");
}

// ---------------------------------------------------------------------------------------------
// fingerprint (no database)

#[test]
fn fingerprint_is_the_same_for_bodies_that_differ_only_in_form() {
    let compact = br#"{"amount":1200,"currency":"EUR"}"#;
    let shuffled = b"{ \"currency\": \"EUR\",\n  \"amount\": 12e2 }\n";
    let [output, other_form] = [&compact[..], &shuffled[..]]
        .map(|body| idemflow_cli::fingerprint(Format::Human, "POST", "/v1/checkouts", body));
    assert_eq!(output, other_form);
    assert_stdout(output, 0, "fingerprint.txt");
    let output = idemflow_cli::fingerprint(Format::Json, "POST", "/v1/checkouts", shuffled);
    assert_stdout(output, 0, "fingerprint.json");

    // Another value, path or method is another request.
    let other = idemflow_cli::fingerprint(
        Format::Human,
        "POST",
        "/v1/checkouts",
        br#"{"amount":1201,"currency":"EUR"}"#,
    );
    assert!(!other.stdout.contains("5a674104820e"), "{}", other.stdout);
    let other = idemflow_cli::fingerprint(Format::Human, "PUT", "/v1/checkouts", compact);
    assert!(!other.stdout.contains("5a674104820e"), "{}", other.stdout);
}

#[test]
fn fingerprint_prints_the_canonical_json_text_safe_for_a_terminal() {
    // Non-ASCII text, DEL and a C1 control (RFC 8785 writes them as they are), and C0 controls
    // (RFC 8785 escapes them: `\n`, `\u0007`); sent escaped, and one key sent as it is.
    let body = r#"{"text": "caf\u00e9 \u0080\u007f", "note": "line\nbreak\u0007", "é": 1}"#;
    let body = body.as_bytes();
    let canonical = "{\"note\":\"line\\nbreak\\u0007\",\"text\":\"café \u{80}\u{7f}\",\"é\":1}";
    assert_eq!(
        idemflow_core::canonicalize(body).unwrap(),
        canonical.as_bytes()
    );
    let fingerprint = Fingerprint::of_json("POST", "/v1/checkouts", body).unwrap();
    // Printed for a terminal: DEL and C1 controls escaped as JSON would (the same JSON value,
    // and nothing a terminal acts on); everything else exactly as hashed.
    let printed = "{\"note\":\"line\\nbreak\\u0007\",\"text\":\"café \\u0080\\u007f\",\"é\":1}";
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(printed).unwrap(),
        serde_json::from_str::<serde_json::Value>(canonical).unwrap()
    );
    let expected = format!(
        "method       POST\npath         /v1/checkouts\n\
         canonical    {printed}\nfingerprint  {fingerprint}\n"
    );

    let output = idemflow_cli::fingerprint(Format::Human, "POST", "/v1/checkouts", body);
    assert_eq!(
        output,
        Output {
            code: 0,
            stdout: expected.clone(),
            stderr: String::new()
        }
    );
    // JSON carries the same text as a JSON string.
    let output = idemflow_cli::fingerprint(Format::Json, "POST", "/v1/checkouts", body);
    let document: serde_json::Value = serde_json::from_str(&output.stdout).unwrap();
    assert_eq!(document["canonical"], canonical);
}

#[test]
fn fingerprint_refuses_what_the_runner_refuses() {
    let output = idemflow_cli::fingerprint(
        Format::Human,
        "POST",
        "/v1/checkouts",
        br#"{"amount":1,"amount":2}"#,
    );
    assert_stderr(output, 1, "fingerprint_duplicate_key.txt");
    let output = idemflow_cli::fingerprint(Format::Human, "POST", "/v1/checkouts", b"{\"a\":");
    assert_eq!(output.code, 1);
    assert!(
        output
            .stderr
            .starts_with("error: the body is not valid JSON: "),
        "{}",
        output.stderr
    );
    let output = idemflow_cli::fingerprint(Format::Json, "POST", "/v1/checkouts", b"\xff");
    assert_stdout(output, 1, "fingerprint_invalid_utf8.json");
}

// ---------------------------------------------------------------------------------------------
// partitions
//
// Partition names and ranges follow the clock, so these outputs are checked field by field, not
// against snapshots.

#[sqlx::test(migrator = "idemflow_pg::MIGRATOR")]
async fn partitions_adopt_list_and_maintain(pool: PgPool) {
    let mut connection = pool.acquire().await.unwrap();
    // A key finished two days ago and one started three days ago (a lease that ended).
    seed_all(
        &mut connection,
        &[
            DONE,
            Seed {
                age: "3 days",
                ..EXPIRED
            },
        ],
    )
    .await;
    let output = idemflow_cli::partitions_list(&PgOperator::new(pool.clone()), Format::Human).await;
    assert_eq!(output.code, idemflow_cli::exit::USAGE, "{output:?}");
    assert!(output.stderr.contains("not partitioned"), "{output:?}");
    drop(connection);

    let hour = Duration::from_secs(60 * 60);
    let output =
        idemflow_cli::partitions_adopt(&PgOperator::new(pool.clone()), Format::Json, 6 * hour, 2)
            .await;
    assert_eq!((output.code, output.stderr.as_str()), (0, ""), "{output:?}");
    let adopted: serde_json::Value = serde_json::from_str(&output.stdout).unwrap();
    assert_eq!(adopted["keys"], 2);
    // From three days back to two partitions ahead, six hours each.
    let partitions = adopted["partitions"].as_u64().unwrap();
    assert!((13..=15).contains(&partitions), "{partitions}");

    let output =
        idemflow_cli::partitions_adopt(&PgOperator::new(pool.clone()), Format::Human, hour, 2)
            .await;
    assert_eq!(output.code, idemflow_cli::exit::USAGE);
    assert!(output.stderr.contains("partitioned already"), "{output:?}");

    let output = idemflow_cli::partitions_list(&PgOperator::new(pool.clone()), Format::Human).await;
    assert_eq!(output.code, 0, "{output:?}");
    let lines: Vec<&str> = output.stdout.lines().collect();
    assert!(lines[0].starts_with("PARTITION"), "{}", output.stdout);
    assert_eq!(lines.len() as u64, partitions + 1);
    assert!(
        lines[1].starts_with("idempotency_keys_p"),
        "{}",
        output.stdout
    );
    assert!(lines[1].ends_with("attached"), "{}", output.stdout);

    // A day's window: the partition of the started key is kept (exit 1, an alert), the done
    // key's and the empty ones older than a day go.
    let output =
        idemflow_cli::partitions_maintain(&PgOperator::new(pool.clone()), Format::Human, 24 * hour)
            .await;
    assert_eq!(output.code, idemflow_cli::exit::NO, "{output:?}");
    assert!(
        output
            .stdout
            .lines()
            .any(|line| line.starts_with("kept idempotency_keys_p")
                && line.ends_with("it holds 1 started keys")),
        "{}",
        output.stdout
    );
    assert!(
        output.stdout.contains("(1 keys, 0 bodies apart)"),
        "{}",
        output.stdout
    );
    assert!(
        output.stdout.ends_with("2 partitions ahead\n"),
        "{}",
        output.stdout
    );
    let left: Vec<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(left, ["order-3"]);

    let output =
        idemflow_cli::partitions_maintain(&PgOperator::new(pool.clone()), Format::Json, 24 * hour)
            .await;
    let maintained: serde_json::Value = serde_json::from_str(&output.stdout).unwrap();
    assert_eq!(maintained["kept"][0]["started_keys"], 1);
    assert_eq!(maintained["dropped"], serde_json::json!([]));
    assert_eq!(maintained["created"], serde_json::json!([]));
}
