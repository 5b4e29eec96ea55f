//! Running the checkout example's binary from a test.

use std::path::PathBuf;
use std::process::Command;

use sqlx::postgres::PgConnectOptions;

/// Builds the checkout example and returns its path ([`built_example`]).
pub fn example_binary() -> PathBuf {
    built_example("checkout")
}

/// Builds the example `name` (the binary `name` of the package `example-<name>`, under
/// `examples/<name>`: another package's binary gets no `CARGO_BIN_EXE_*`) and returns its path,
/// in this test binary's target directory (`<target>/<profile>/deps/<this test>`), so
/// `CARGO_TARGET_DIR` and the profile are respected.
pub fn built_example(name: &str) -> PathBuf {
    let test_binary = std::env::current_exe().unwrap();
    let profile_dir = test_binary
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(name) => name.to_owned(),
    };
    let target_dir = profile_dir.parent().unwrap();
    let status = Command::new(env!("CARGO"))
        .args(["build", "--quiet", "-p"])
        .arg(format!("example-{name}"))
        .args(["--bin", name, "--profile"])
        .arg(&profile)
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap();
    assert!(status.success(), "building the {name} example failed");
    profile_dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

/// The URL of the test's own database; the password, if any, comes from `DATABASE_URL` (the
/// connect options do not give it back).
pub fn database_url(connect: &PgConnectOptions) -> String {
    let password = std::env::var("DATABASE_URL").ok().and_then(|url| {
        let (_, rest) = url.split_once("://")?;
        let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
        let (user_info, _) = authority.rsplit_once('@')?;
        let (_, password) = user_info.split_once(':')?;
        Some(password.to_owned())
    });
    let user = match password {
        Some(password) => format!("{}:{password}", connect.get_username()),
        None => connect.get_username().to_owned(),
    };
    format!(
        "postgres://{user}@{}:{}/{}",
        connect.get_host(),
        connect.get_port(),
        connect.get_database().unwrap()
    )
}

/// What a finished demo run printed, and how it ended (`None`: it ran past its time and was
/// killed).
pub struct DemoRun {
    pub status: Option<std::process::ExitStatus>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the checkout example's demo (`all --demo-only` on a free port) against `url`, with extra
/// environment variables, for at most `timeout`.
pub async fn run_demo(
    binary: &std::path::Path,
    url: Option<&str>,
    lease_seconds: &str,
    env: &[(&str, &str)],
    timeout: std::time::Duration,
) -> DemoRun {
    use std::io::Read;
    use std::process::Stdio;

    let mut command = Command::new(binary);
    command
        .args([
            "all",
            "--demo-only",
            "--bind",
            "127.0.0.1:0",
            "--lease-seconds",
            lease_seconds,
        ])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // No URL: the example's default, a SQLite file it names (and no DATABASE_URL to find).
    match url {
        Some(url) => command.arg("--database-url").arg(url),
        None => command.env_remove("DATABASE_URL"),
    };
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().unwrap();
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
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > timeout {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    DemoRun {
        status,
        stdout: read_stdout.join().unwrap().unwrap(),
        stderr: read_stderr.join().unwrap().unwrap(),
    }
}

/// Every line a demo that behaved prints, in order of its steps.
pub const DEMO_STEPS: &[&str] = &[
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
];

/// A process of the example, SIGKILLed and reaped when dropped: a failing test leaves none behind.
pub struct Process {
    pub name: String,
    child: std::process::Child,
}

impl Process {
    /// SIGKILL now, without reaping: kill several at once, then [`Process::kill`] each.
    pub fn signal_kill(&mut self) {
        let _ = self.child.kill();
    }

    /// SIGKILL, then reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts the example's binary with `arguments` (`RUST_LOG=error`, stderr inherited) and waits
/// at most a minute for its first stdout line containing `marker`, which it returns; the rest of
/// stdout is read and dropped, so the process never blocks on a full pipe.
pub async fn start_process(
    binary: &std::path::Path,
    name: &str,
    arguments: &[&str],
    marker: &'static str,
) -> (Process, String) {
    use std::io::BufRead;
    use std::process::Stdio;

    let mut child = Command::new(binary)
        .args(arguments)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let process = Process {
        name: name.to_owned(),
        child,
    };
    let (ready, line) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut ready = Some(ready);
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(marker)
                && let Some(ready) = ready.take()
            {
                let _ = ready.send(line);
            }
        }
    });
    let line = tokio::time::timeout(std::time::Duration::from_secs(60), line)
        .await
        .unwrap_or_else(|_| panic!("{name} did not print {marker:?} within a minute"))
        .unwrap_or_else(|_| panic!("{name} ended before printing {marker:?}"));
    (process, line)
}

/// The first `http://…` word of a line (a service's "listening on" line).
pub fn url_in(line: &str) -> String {
    line.split_whitespace()
        .find(|word| word.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_owned()
}

/// The tenant the checkout example's clients send as (its bearer token).
pub const CHECKOUT_TENANT: &str = "acme";

/// The checkout body the process tests send.
pub const CHECKOUT_BODY: &str = r#"{"amount": 1234, "currency": "usd", "source": "tok_visa"}"#;

/// What a client of the checkout service got back.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// One checkout request under `key`; `None` when no answer came (the service died, or was never
/// there).
pub async fn post_checkout(client: &reqwest::Client, base: &str, key: &str) -> Option<Answer> {
    let response = client
        .post(format!("{base}/v1/checkouts"))
        .header("authorization", format!("Bearer {CHECKOUT_TENANT}"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(CHECKOUT_BODY)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header("idempotent-replayed").as_deref() == Some("true");
    let content_type = header("content-type");
    let body = response.bytes().await.ok()?.to_vec();
    Some(Answer {
        status,
        replayed,
        content_type,
        body,
    })
}

/// The derived key the checkout's charge phase calls the provider with, for `key`.
pub fn charge_key(key: &str) -> String {
    idemflow::DerivedKey::new(
        &idemflow::TenantId::new(CHECKOUT_TENANT).unwrap(),
        &idemflow::Key::parse(key).unwrap(),
        idemflow::core::PhaseName::new("charge").unwrap(),
    )
    .to_string()
}

/// Each example process's pool in the tests: small, so that the processes of tests running side by
/// side (and the benchmark's smoke test) fit under the server's max_connections of 100 together.
pub const POOL_SIZE: &str = "6";

/// `checkout serve` on a free port with `arguments`; returns it with its base URL.
pub async fn start_serve(
    binary: &std::path::Path,
    name: &str,
    arguments: &[&str],
) -> (Process, String) {
    let mut all = vec!["serve", "--bind", "127.0.0.1:0", "--pool-size", POOL_SIZE];
    all.extend(arguments);
    let (process, line) = start_process(binary, name, &all, "listening on").await;
    (process, url_in(&line))
}

/// `checkout worker` with `arguments`, once it resumes.
pub async fn start_worker(binary: &std::path::Path, name: &str, arguments: &[&str]) -> Process {
    let mut all = vec![
        "worker",
        "--metrics-bind",
        "127.0.0.1:0",
        "--pool-size",
        POOL_SIZE,
    ];
    all.extend(arguments);
    start_process(binary, name, &all, "resuming").await.0
}

/// What a checkout run must leave behind, whatever failed over under it: every key done, one paid
/// order per key (`keys` in all), and one charge per derived key at the provider, for each of the
/// `answered` keys and no other.
pub async fn each_key_ran_once<'a>(
    observer: &sqlx::PgPool,
    provider: &idemflow_testkit::provider::MockProvider,
    answered: impl Iterator<Item = &'a String>,
    keys: usize,
) {
    let undone: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE state <> 'done'")
            .fetch_one(observer)
            .await
            .unwrap();
    assert_eq!(undone, 0, "every key done");
    let orders: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT request_key, count(*), count(*) FILTER (WHERE status = 'paid') \
         FROM checkout_orders GROUP BY request_key",
    )
    .fetch_all(observer)
    .await
    .unwrap();
    assert_eq!(orders.len(), keys, "keys with an order");
    for (key, count, paid) in &orders {
        assert_eq!((*count, *paid), (1, 1), "{key}: one order, paid");
    }
    let mut charges: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for charge in provider.charges() {
        *charges.entry(charge.idempotency_key).or_default() += 1;
    }
    for key in answered {
        assert_eq!(charges.get(&charge_key(key)), Some(&1), "{key}: one charge");
    }
    assert_eq!(charges.len(), keys, "charges in all");
}
