//! The checkout example's processes (examples/checkout), as the mass-crash and fleet workloads
//! run them: its binary (built when not given), `serve` and `worker` processes started and
//! waited for, killed and reaped, and a checkout POST to a `serve`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::Error;

/// The checkout example's tenant and request.
pub(crate) const TENANT: &str = "acme";
const BODY: &str = r#"{"amount": 1234, "currency": "usd", "source": "tok_visa"}"#;
/// How long a process may take to say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A child process, SIGKILLed and reaped when dropped: nothing outlives a failed run.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
}

impl Process {
    /// SIGKILL without reaping: several processes are killed at the same moment, then reaped.
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

/// The checkout example's binary: `$IDEMFLOW_CHECKOUT_BIN`, or built now (`cargo build -p
/// example-checkout`) with this binary's profile into its target directory.
pub fn checkout_binary() -> Result<PathBuf, Error> {
    if let Some(path) = std::env::var_os("IDEMFLOW_CHECKOUT_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    let mut profile_dir = exe
        .parent()
        .ok_or("this binary has no directory")?
        .to_path_buf();
    if profile_dir.file_name().is_some_and(|name| name == "deps") {
        profile_dir.pop();
    }
    let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(name) => name.to_owned(),
    };
    let target_dir = profile_dir
        .parent()
        .ok_or("this binary is not in a target directory")?;
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if !workspace.join("examples/checkout/main.rs").exists() {
        return Err(format!(
            "the checkout example is not at {}: set IDEMFLOW_CHECKOUT_BIN to its binary",
            workspace.display()
        )
        .into());
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| env!("CARGO").into());
    eprintln!("idemflow-bench: building the checkout example ({profile})");
    let status = Command::new(cargo)
        .args([
            "build",
            "--quiet",
            "-p",
            "example-checkout",
            "--bin",
            "checkout",
        ])
        .arg("--profile")
        .arg(&profile)
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(&workspace)
        .status()?;
    if !status.success() {
        return Err("building the checkout example failed".into());
    }
    Ok(profile_dir.join(format!("checkout{}", std::env::consts::EXE_SUFFIX)))
}

/// Starts `binary arguments` and waits for the stdout line containing `marker` (returned);
/// stdout is drained afterwards, stderr inherited (`RUST_LOG=error`).
pub async fn start(
    binary: &std::path::Path,
    name: &str,
    arguments: &[&str],
    marker: &'static str,
) -> Result<(Process, String), Error> {
    let mut child = Command::new(binary)
        .args(arguments)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let process = Process {
        name: name.to_owned(),
        child,
    };
    let (ready, line) = oneshot::channel();
    std::thread::spawn(move || {
        let mut ready = Some(ready);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(marker)
                && let Some(ready) = ready.take()
            {
                let _ = ready.send(line);
            }
        }
    });
    match tokio::time::timeout(READY_TIMEOUT, line).await {
        Ok(Ok(line)) => Ok((process, line)),
        Ok(Err(_)) => Err(format!("{} ended before printing {marker:?}", process.name).into()),
        Err(_) => Err(format!("{} did not print {marker:?} in time", process.name).into()),
    }
}

/// The first `http://…` word of a line.
pub(crate) fn url_in(line: &str) -> Result<String, Error> {
    Ok(line
        .split_whitespace()
        .find(|word| word.starts_with("http://"))
        .ok_or_else(|| format!("no URL in {line:?}"))?
        .to_owned())
}

/// One count from the table.
pub(crate) async fn count(pool: &sqlx::PgPool, sql: &str) -> Result<u64, Error> {
    let value: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await?;
    Ok(u64::try_from(value)?)
}

/// One checkout POST under `key`: the status and body, or `None` when the connection failed.
pub(crate) async fn post(client: &reqwest::Client, url: &str, key: &str) -> Option<(u16, Vec<u8>)> {
    let response = client
        .post(format!("{url}/v1/checkouts"))
        .header("authorization", format!("Bearer {TENANT}"))
        .header("content-type", "application/json")
        .header("idempotency-key", key)
        .body(BODY)
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    let body = response.bytes().await.ok()?;
    Some((status, body.to_vec()))
}
