//! The lease is judged by the database's clock, never the application's: the checkout demo runs
//! in a process whose wall clock is an hour ahead, then an hour behind (libfaketime), and every
//! step behaves as it does on time. Were a lease compared with the process's clock, an hour ahead
//! would make the concurrent duplicate of step 3 take a live request over (not 409), and an hour
//! behind would keep the crashed request of step 6 from ever being resumed.
//!
//! libfaketime comes from the system's packages (Debian: `libfaketime`); `scripts/test` installs
//! it. Without it this test fails, naming the package: it never skips.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::example::{DEMO_STEPS, DemoRun, database_url, example_binary, run_demo};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const LEASE_SECONDS: &str = "5";
const DEMO_TIMEOUT: Duration = Duration::from_secs(120);

/// Where Debian, Ubuntu and Fedora put the library, or `IDEMFLOW_LIBFAKETIME`.
fn libfaketime() -> PathBuf {
    let candidates = std::env::var("IDEMFLOW_LIBFAKETIME").into_iter().chain(
        [
            "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
            "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
            "/usr/lib/faketime/libfaketime.so.1",
            "/usr/lib64/faketime/libfaketime.so.1",
        ]
        .map(str::to_owned),
    );
    candidates
        .map(PathBuf::from)
        .find(|path| path.exists())
        .unwrap_or_else(|| {
            panic!(
                "libfaketime is not installed (Debian/Ubuntu: apt-get install libfaketime; \
                 scripts/test installs it), or set IDEMFLOW_LIBFAKETIME to libfaketime.so.1"
            )
        })
}

/// The environment that shifts a process's wall clock by `offset` (`+1h`, `-1h`). Monotonic time
/// is left alone, as a wrong wall clock leaves it.
fn shifted(library: &Path, offset: &'static str) -> Vec<(&'static str, String)> {
    vec![
        ("LD_PRELOAD", library.display().to_string()),
        ("FAKETIME", offset.to_owned()),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
    ]
}

/// Seconds since the epoch as a process under `env` sees them.
fn clock_under(env: &[(&'static str, String)]) -> i64 {
    let mut command = Command::new("date");
    command.arg("+%s");
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().unwrap();
    String::from_utf8(output.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

async fn demo_with_clock(offset: &'static str, expected_shift: i64, connect: &PgConnectOptions) {
    let library = libfaketime();
    let env = shifted(&library, offset);
    // The shift is real: a process under this environment reads a clock an hour off.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let skew = clock_under(&env) - now;
    assert!(
        (skew - expected_shift).abs() < 60,
        "libfaketime did not shift the clock by {offset}: {skew} s"
    );

    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let url = database_url(connect);
    let env: Vec<(&str, &str)> = env
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    let DemoRun {
        status,
        stdout,
        stderr,
    } = run_demo(&binary, Some(&url), LEASE_SECONDS, &env, DEMO_TIMEOUT).await;
    println!("{stdout}");
    eprintln!("{stderr}");
    let status = status.unwrap_or_else(|| panic!("the demo took longer than {DEMO_TIMEOUT:?}"));
    assert!(
        status.success(),
        "the demo failed with the clock at {offset}: {status}"
    );
    for expected in DEMO_STEPS {
        assert!(
            stdout.contains(expected),
            "with the clock at {offset}, the demo did not print {expected:?}"
        );
    }
    // The 409's Retry-After is the lease left by the database's clock: at most the lease.
    let retry_after: u64 = stdout
        .split("-> 409 Conflict [Retry-After: ")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .and_then(|seconds| seconds.parse().ok())
        .expect("a 409 with Retry-After");
    assert!(
        (1..=5).contains(&retry_after),
        "Retry-After {retry_after} with the clock at {offset}"
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_protocol_keeps_time_by_the_database_when_the_process_clock_is_an_hour_ahead(
    _options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    demo_with_clock("+1h", 3600, &connect).await;
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_protocol_keeps_time_by_the_database_when_the_process_clock_is_an_hour_behind(
    _options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    demo_with_clock("-1h", -3600, &connect).await;
}
