//! The `idemflow` binary end to end (this crate's `cli` feature, built with every engine): it
//! reads stdin, connects by `--database-url` or `DATABASE_URL`, answers on stdout and stderr, and
//! exits with the documented codes. The commands themselves are tested in-process, on every
//! engine, by `crates/idemflow-cli/tests`; the snapshots named here are theirs.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use idemflow::Fingerprint;
use sqlx::PgPool;

/// Two keys, as the CLI's own tests seed them: `order-1` done two days ago, `order-2` started two
/// days ago and leased for an hour more.
async fn seed(pool: &PgPool) {
    for (key, body, state, recovery_point, lease, response) in [
        (
            "order-1",
            r#"{"amount":1200,"currency":"EUR"}"#,
            "done",
            "finish",
            None,
            Some(r#"{"order_id":41}"#),
        ),
        (
            "order-2",
            r#"{"order":"order-2"}"#,
            "started",
            "create_order",
            Some("1 hour"),
            None,
        ),
    ] {
        let fingerprint = Fingerprint::of_json("POST", "/v1/checkouts", body.as_bytes()).unwrap();
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, state, \
                 recovery_point, locked_until, lock_version, attempts, response_status, \
                 response_headers, response_body, created_at, updated_at, finished_at) \
             VALUES ('acme', $1, $2, 'checkout.v1', $3::text::jsonb, $4, $5, \
                     now() + $6::interval, 0, 1, CASE WHEN $4 = 'done' THEN 201 END, \
                     CASE WHEN $4 = 'done' THEN '[]'::jsonb END, $7, now() - interval '2 days', \
                     now() - interval '2 days', \
                     CASE WHEN $4 = 'done' THEN now() - interval '2 days' END)",
        )
        .bind(key)
        .bind(fingerprint.as_bytes().as_slice())
        .bind(body)
        .bind(state)
        .bind(recovery_point)
        .bind(lease)
        .bind(response.map(str::as_bytes))
        .execute(pool)
        .await
        .unwrap();
    }
}

/// Compares `actual` whole with the CLI's snapshot `name`.
#[track_caller]
fn assert_snapshot(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("crates/idemflow-cli/tests/snapshots")
        .join(name);
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("snapshot {}: {error}", path.display()));
    assert_eq!(
        actual, expected,
        "snapshot {name} differs\n--- actual ---\n{actual}"
    );
}

/// The URL of the test's own database: DATABASE_URL with its database name replaced.
async fn test_database_url(pool: &PgPool) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(pool)
        .await
        .unwrap();
    let base = std::env::var("DATABASE_URL").unwrap();
    let (base, query) = match base.split_once('?') {
        Some((base, query)) => (base.to_owned(), format!("?{query}")),
        None => (base, String::new()),
    };
    let authority_start = base.find("://").map_or(0, |at| at + 3);
    let server = match base[authority_start..].find('/') {
        Some(slash) => &base[..authority_start + slash],
        None => &base,
    };
    format!("{server}/{name}{query}")
}

/// Runs the real `idemflow` binary; returns (exit code, stdout, stderr).
fn idemflow(args: &[&str], stdin: &[u8], database_url: Option<&str>) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemflow"));
    command
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match database_url {
        Some(url) => command.env("DATABASE_URL", url),
        None => command.env_remove("DATABASE_URL"),
    };
    let mut child = command.spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let output = child.wait_with_output().unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_binary_reads_stdin_connects_and_exits_with_the_right_codes(pool: PgPool) {
    seed(&pool).await;
    let url = test_database_url(&pool).await;

    // fingerprint: the body on stdin, no database needed.
    let fingerprint = |body: &[u8]| {
        idemflow(
            &["fingerprint", "--method", "POST", "--path", "/v1/checkouts"],
            body,
            None,
        )
    };
    let (code, stdout, stderr) = fingerprint(br#"{"amount":1200,"currency":"EUR"}"#);
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert_snapshot("binary_fingerprint.txt", &stdout);
    assert_eq!(
        fingerprint(b"{\"currency\":\"EUR\", \"amount\":1200.0}"),
        (code, stdout, stderr)
    );
    assert_eq!(
        fingerprint(b"[1,]"),
        (
            1,
            String::new(),
            "error: the body is not valid JSON: expected a JSON value at byte 3\n".to_owned()
        )
    );

    // inspect, on the real clock, with --database-url (DATABASE_URL unset) or DATABASE_URL.
    let (code, stdout, stderr) = idemflow(
        &[
            "inspect",
            "--tenant",
            "acme",
            "--key",
            "order-2",
            "--database-url",
            &url,
        ],
        b"",
        None,
    );
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert_snapshot("binary_inspect.txt", &stdout);
    let (code, stdout, stderr) = idemflow(
        &["--json", "inspect", "--tenant", "acme", "--key", "order-1"],
        b"",
        Some(&url),
    );
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert!(
        stdout.contains("\n  \"response_status\": 201,\n"),
        "{stdout}"
    );

    // The stored bodies and the time left before expiry, on the real clock: finished two days
    // (and a few milliseconds) ago, so a retention of 72h 30m leaves a day and half an hour,
    // which a few seconds more or less does not change.
    let (code, stdout, stderr) = idemflow(
        &[
            "inspect",
            "--tenant",
            "acme",
            "--key",
            "order-1",
            "--show-request",
            "--show-response",
            "--retention",
            "4350m",
        ],
        b"",
        Some(&url),
    );
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert!(
        stdout.contains(
            "\nexpiry          expires in ~1d 0h (finished 2d 0h ago; retention 3d 0h)\n\n\
             request\n{\n  \"amount\": 1200,\n  \"currency\": \"EUR\"\n}\n"
        ),
        "{stdout}"
    );
    assert!(
        stdout.ends_with("\nresponse 201, body 15 bytes\n\n{\"order_id\":41}\n"),
        "{stdout}"
    );
    let (code, stdout, stderr) = idemflow(
        &[
            "inspect",
            "--tenant",
            "acme",
            "--key",
            "order-1",
            "--retention",
            "7",
        ],
        b"",
        Some(&url),
    );
    assert_eq!((code, stdout.as_str()), (2, ""));
    assert!(stderr.contains("invalid duration \"7\""), "{stderr}");

    // A missing key: exit 1, the reason on stderr.
    assert_eq!(
        idemflow(
            &["inspect", "--tenant", "acme", "--key", "order-9"],
            b"",
            Some(&url)
        ),
        (
            1,
            String::new(),
            "error: no key \"order-9\" for tenant \"acme\"\n".to_owned()
        )
    );
    // No database: exit 2.
    assert_eq!(
        idemflow(&["stats"], b"", None),
        (
            2,
            String::new(),
            "error: no database: pass --database-url postgres://... or set DATABASE_URL\n"
                .to_owned()
        )
    );
    // A bad duration is refused before connecting: exit 2 (clap's usage error).
    let (code, stdout, stderr) = idemflow(&["expire", "--older-than", "24"], b"", Some(&url));
    assert_eq!((code, stdout.as_str()), (2, ""));
    assert!(
        stderr.contains("invalid duration \"24\": the unit is missing"),
        "{stderr}"
    );
    // Nothing was deleted by all this.
    let (code, stdout, _) = idemflow(&["stats"], b"", Some(&url));
    assert_eq!(code, 0);
    assert!(
        stdout.starts_with(
            "WORKFLOW     STATE    KEYS\ncheckout.v1  done     1\ncheckout.v1  started  1\n"
        ),
        "{stdout}"
    );

    // A body whose canonical text holds what a terminal would act on prints as the library
    // answers it: DEL and the C1 controls escaped, the rest exactly as hashed.
    let body =
        r#"{"text": "caf\u00e9 \u0080\u007f", "note": "line\nbreak\u0007", "é": 1}"#.as_bytes();
    let printed =
        idemflow_cli::fingerprint(idemflow_cli::Format::Human, "POST", "/v1/checkouts", body);
    assert_eq!(fingerprint(body), (0, printed.stdout, String::new()));
}

/// `idemflow console` records what the documents promise: a tracing event on stderr (INFO by
/// default, `RUST_LOG` to change it) and the counter on `/metrics`, per action. A form field
/// holding a line break is written escaped, so it cannot forge a log line of its own.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_console_logs_and_counts_each_action_and_no_form_field_forges_a_log_line(pool: PgPool) {
    seed(&pool).await;
    let url = test_database_url(&pool).await;
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let console = Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .args([
            "console",
            "--database-url",
            &url,
            "--bind",
            &address.to_string(),
        ])
        .env_remove("RUST_LOG")
        .env_remove(idemflow_console::PASSWORD_ENV)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut console = Killed(Some(console));
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let root = format!("http://{address}");
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while client.get(&root).send().await.is_err() {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap();
    let token: i64 =
        sqlx::query_scalar("SELECT lock_version FROM idempotency_keys WHERE key = 'order-1'")
            .fetch_one(&pool)
            .await
            .unwrap();
    let forged = "acme\n2026-01-01T00:00:00.000000Z  INFO idemflow::console: console action \
                  action=\"expire\" outcome=\"done\" tenant=\"acme\" key=\"order-2\"";
    let post = |tenant: &'static str| {
        let client = client.clone();
        let url = format!("{root}/key/expire");
        let token = token.to_string();
        async move {
            client
                .post(url)
                .form(&[
                    ("tenant", tenant),
                    ("key", "order-1"),
                    ("lock_version", &token),
                    ("state", "done"),
                    ("confirmed", "yes"),
                ])
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(post(forged).await, reqwest::StatusCode::BAD_REQUEST);
    assert_eq!(post("acme").await, reqwest::StatusCode::OK);
    let metrics = client
        .get(format!("{root}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for outcome in ["done", "invalid"] {
        assert!(
            metrics.lines().any(|line| line.starts_with(&format!(
                "idemflow_console_actions_total{{action=\"expire\",outcome=\"{outcome}\""
            )) && line.ends_with(" 1")),
            "{metrics}"
        );
    }
    let output = console.stop();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let actions: Vec<&str> = stderr
        .lines()
        .filter(|line| line.contains("console action"))
        .collect();
    assert_eq!(actions.len(), 2, "{stderr}");
    assert!(
        actions[0].contains(r#"outcome="invalid""#) && actions[0].contains(r"acme\n2026-01-01"),
        "{stderr}"
    );
    assert!(actions[1].contains(r#"outcome="done""#), "{stderr}");
    assert!(
        !stderr.lines().any(|line| line.starts_with("2026-01-01")),
        "a form field forged a log line: {stderr}"
    );
}

/// A child process killed when the test ends, however it ends.
struct Killed(Option<std::process::Child>);

impl Killed {
    /// Kills it now: what it wrote.
    fn stop(&mut self) -> std::process::Output {
        let mut child = self.0.take().unwrap();
        child.kill().unwrap();
        child.wait_with_output().unwrap()
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
