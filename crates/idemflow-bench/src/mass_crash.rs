//! Workload 9: a mass crash. `crash_serves` checkout `serve` processes (examples/checkout) take
//! `crash_keys` requests spread over them and over `crash_ramp`, from a client per request; the
//! provider (the testkit's mock, in this process, so its ledger is read directly) slows every
//! call but a tenth: six in ten are held without an answer (never executed), three in ten are
//! executed a second after the end of the ramp, after the kill (their callers gone, as a real
//! provider would). Once every key's
//! call has reached the provider, all serve processes are SIGKILLed at once. When the provider
//! has nothing left in flight, the leases of the keys left started are ended in SQL (as the CLI's
//! `end-lease` does, with the same NOTIFY) so the recovery measures the workers, not the lease;
//! then the `worker` processes, started before the load, finish them. Checked: every claimed key
//! done, one paid order and one provider charge per key.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::core::PhaseName;
use idemflow::{DerivedKey, Key, TenantId};
use idemflow_testkit::provider::{Fault, MockProvider};
use tokio::sync::oneshot;

use crate::Error;
use crate::config::Config;
use crate::db::Scratch;
use crate::report::MassCrash;

/// The checkout example's tenant and request.
pub(crate) const TENANT: &str = "acme";
const BODY: &str = r#"{"amount": 1234, "currency": "usd", "source": "tok_visa"}"#;
/// Long enough that no lease runs out during a run by itself (it is ended in SQL instead).
const LEASE_SECONDS: &str = "30";
/// How long a process may take to say it is ready.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// A child process, SIGKILLed and reaped when dropped: nothing outlives a failed run.
#[derive(Debug)]
pub struct Process {
    name: String,
    child: Child,
}

impl Process {
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
    eprintln!("idemflow-bench: building the checkout example ({profile}) for workload 9");
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

fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// What the provider does with the first call of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Answered at once: the request finishes before the kill.
    Answered,
    /// Executed after a delay that outlasts the kill (its caller gone).
    Delayed,
    /// Held without an answer until the caller is gone; nothing executed.
    Held,
}

fn class(index: usize) -> Class {
    match index % 10 {
        0 => Class::Answered,
        1..=3 => Class::Delayed,
        _ => Class::Held,
    }
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

pub async fn run(
    config: &Config,
    scratch: &Scratch,
    binary: &std::path::Path,
    workers: usize,
    prefix: &str,
) -> Result<MassCrash, Error> {
    let provider = MockProvider::builder().start().await?;
    let result = crash(config, scratch, binary, workers, prefix, &provider).await;
    provider.shutdown().await;
    result
}

async fn crash(
    config: &Config,
    scratch: &Scratch,
    binary: &std::path::Path,
    workers: usize,
    prefix: &str,
    provider: &MockProvider,
) -> Result<MassCrash, Error> {
    let keys = config.crash_keys.max(1);
    let serves = config.crash_serves.max(1);
    let ramp = config.crash_ramp;
    // The provider's delay counts from a call's arrival; shortened by its request's departure in
    // the ramp, every delayed charge is executed about `margin` after the end of the ramp (plus
    // the request's own way to the provider): after the kill, which comes as soon as every call
    // has reached the provider.
    let margin = Duration::from_secs(1);
    let delay_of = |index: usize| ramp.mul_f64(1.0 - index as f64 / keys as f64) + margin;
    let common = [
        "--database-url",
        &scratch.url,
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        LEASE_SECONDS,
        // The smoke test runs beside other tests on the same server: a smaller share there.
        "--pool-size",
        if config.quick { "6" } else { "24" },
    ];

    // One at a time: each creates the example's table if it is missing.
    let mut services = Vec::new();
    let mut urls = Vec::new();
    for index in 0..serves {
        let mut arguments = vec!["serve", "--bind", "127.0.0.1:0"];
        arguments.extend(common);
        let (process, line) = start(
            binary,
            &format!("serve {index}"),
            &arguments,
            "listening on",
        )
        .await?;
        urls.push(url_in(&line)?);
        services.push(process);
    }
    let mut recovering = Vec::new();
    for index in 0..workers {
        let mut arguments = vec!["worker", "--metrics-bind", "127.0.0.1:0"];
        arguments.extend(common);
        let (process, _) =
            start(binary, &format!("worker {index}"), &arguments, "resuming").await?;
        recovering.push(process);
    }

    // The provider's script, one fault per derived key.
    let tenant = TenantId::new(TENANT)?;
    let phase = PhaseName::new("charge")?;
    let names: Vec<String> = (0..keys).map(|i| format!("{prefix}-{i:05}")).collect();
    let mut derived = Vec::with_capacity(keys);
    for (index, name) in names.iter().enumerate() {
        let key = DerivedKey::new(&tenant, &Key::parse(name)?, phase).to_string();
        match class(index) {
            Class::Answered => {}
            Class::Delayed => provider.push_fault_for(key.clone(), Fault::Delay(delay_of(index))),
            Class::Held => provider.push_fault_for(key.clone(), Fault::Timeout),
        }
        derived.push(key);
    }
    let charged = |provider: &MockProvider| {
        let ours: std::collections::HashSet<&str> = derived.iter().map(String::as_str).collect();
        provider
            .charges()
            .iter()
            .filter(|charge| ours.contains(charge.idempotency_key.as_str()))
            .count() as u64
    };

    // One connection to look at the table with while the run goes.
    let watch = scratch.pool(1).await?;
    let like = literal(&format!("{prefix}-%"));

    // The load: request i leaves at i/keys of the ramp, for serve i % serves.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let urls = Arc::new(urls);
    let started = Instant::now();
    let mut requests = tokio::task::JoinSet::new();
    for (index, name) in names.iter().enumerate() {
        let (client, urls, name) = (client.clone(), urls.clone(), name.clone());
        let leave = started + ramp.mul_f64(index as f64 / keys as f64);
        requests.spawn(async move {
            tokio::time::sleep_until(leave.into()).await;
            post(&client, &urls[index % urls.len()], &name)
                .await
                .map(|(status, _)| status)
        });
    }

    // The kill, once every key's call has reached the provider.
    let deadline = started + ramp + Duration::from_secs(60);
    while provider.calls() < keys {
        if Instant::now() > deadline {
            return Err(format!(
                "mass crash: only {} of {keys} provider calls made in time",
                provider.calls()
            )
            .into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed = Instant::now();
    for service in &mut services {
        let _ = service.child.kill();
    }
    for service in &mut services {
        service.kill();
    }
    let charged_at_kill = charged(provider);
    let mut answered = 0_u64;
    let mut not_201 = 0_u64;
    while let Some(joined) = requests.join_next().await {
        if let Some(status) = joined? {
            answered += 1;
            if status != 201 {
                not_201 += 1;
            }
        }
    }
    let claimed = count(
        &watch,
        &format!("SELECT count(*) FROM idempotency_keys WHERE key LIKE {like}"),
    )
    .await?;
    let done_at_kill = count(
        &watch,
        &format!("SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state = 'done'"),
    )
    .await?;

    // The provider finishes what it was executing (callers gone), then the leases end.
    let delayed: Vec<&String> = derived
        .iter()
        .enumerate()
        .filter(|(index, _)| class(*index) == Class::Delayed)
        .map(|(_, key)| key)
        .collect();
    let settle_deadline = Instant::now() + ramp + margin + Duration::from_secs(30);
    while delayed.iter().any(|key| provider.is_in_flight(key)) {
        if Instant::now() > settle_deadline {
            return Err("mass crash: the provider still has calls in flight".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if provider.pending_faults() > 0 {
        return Err(format!(
            "mass crash: {} scripted provider faults left unconsumed",
            provider.pending_faults()
        )
        .into());
    }
    scratch
        .execute(&format!(
            "UPDATE idempotency_keys SET locked_until = least(locked_until, now()), \
                 updated_at = now() \
             WHERE state = 'started' AND key LIKE {like}; \
             SELECT pg_notify('{}', '')",
            idemflow::store::DUE_CHANNEL
        ))
        .await?;
    let rewound = Instant::now();
    let charged_after_kill = charged(provider) - charged_at_kill;

    // The workers' drain.
    let drain_deadline = rewound + Duration::from_secs(60 + keys as u64 / 20);
    let mut stuck = 0;
    let started_keys = format!(
        "SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state = 'started'"
    );
    loop {
        let left = count(&watch, &started_keys).await?;
        if left == 0 {
            break;
        }
        if Instant::now() > drain_deadline {
            stuck = left;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let finished = Instant::now();
    drop(recovering);

    // One paid order and one charge per claimed key; every stored answer a 201.
    let bad_orders = count(
        &watch,
        &format!(
            "SELECT count(*) FROM idempotency_keys AS k LEFT JOIN ( \
                 SELECT request_key, count(*) AS orders, \
                     count(*) FILTER (WHERE status = 'paid') AS paid \
                 FROM checkout_orders WHERE request_key LIKE {like} GROUP BY request_key \
             ) AS o ON o.request_key = k.key \
             WHERE k.key LIKE {like} \
                 AND (o.orders IS DISTINCT FROM 1 OR o.paid IS DISTINCT FROM 1)"
        ),
    )
    .await?;
    let orphan_orders = count(
        &watch,
        &format!(
            "SELECT count(*) FROM checkout_orders AS o WHERE o.request_key LIKE {like} \
             AND NOT EXISTS (SELECT 1 FROM idempotency_keys AS k \
                 WHERE k.tenant = o.tenant AND k.key = o.request_key)"
        ),
    )
    .await?;
    let not_created = count(
        &watch,
        &format!(
            "SELECT count(*) FROM idempotency_keys \
             WHERE key LIKE {like} AND state = 'done' AND response_status <> 201"
        ),
    )
    .await?;
    let claimed_names: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT key FROM idempotency_keys WHERE key LIKE {like}"
    )))
    .fetch_all(&watch)
    .await?;
    watch.close().await;
    let mut charges = std::collections::HashMap::<&str, u64>::new();
    let ledger = provider.charges();
    for charge in &ledger {
        *charges.entry(charge.idempotency_key.as_str()).or_default() += 1;
    }
    let mut max_calls = 0;
    let mut one_charge = true;
    for name in &claimed_names {
        let key = DerivedKey::new(&tenant, &Key::parse(name)?, phase).to_string();
        max_calls = max_calls.max(provider.calls_for(&key) as u64);
        one_charge &= charges.get(key.as_str()).copied() == Some(1);
    }
    let workers_seconds = finished.duration_since(rewound).as_secs_f64();
    let result = MassCrash {
        serves,
        workers,
        keys: keys as u64,
        ramp_secs: ramp.as_secs_f64(),
        held_keys: (0..keys).filter(|&i| class(i) == Class::Held).count() as u64,
        delayed_keys: delayed.len() as u64,
        delay_margin_ms: margin.as_secs_f64() * 1000.0,
        kill_at_secs: killed.duration_since(started).as_secs_f64(),
        answered_before_kill: answered,
        in_flight_at_kill: keys as u64 - answered,
        claimed,
        done_at_kill,
        charged_at_kill,
        charged_after_kill,
        settle_seconds: rewound.duration_since(killed).as_secs_f64(),
        drain_seconds: finished.duration_since(killed).as_secs_f64(),
        workers_seconds,
        keys_per_second: (claimed - done_at_kill) as f64 / workers_seconds.max(1e-9),
        max_provider_calls_per_key: max_calls,
        one_charge_per_key: one_charge,
        one_order_per_key: bad_orders == 0 && orphan_orders == 0,
        stuck,
    };
    eprintln!(
        "  mass crash: {serves} serves, {workers} worker(s): killed {:.2} s after the load began \
         with {} requests in flight, {} keys claimed, {} done then; drained in {:.2} s from the \
         kill ({:.2} s after the leases ended); charges {}+{}, most calls per key {}, stuck {}",
        result.kill_at_secs,
        result.in_flight_at_kill,
        result.claimed,
        result.done_at_kill,
        result.drain_seconds,
        result.workers_seconds,
        result.charged_at_kill,
        result.charged_after_kill,
        result.max_provider_calls_per_key,
        result.stuck
    );
    if stuck > 0
        || !one_charge
        || bad_orders != 0
        || orphan_orders != 0
        || not_created != 0
        || not_201 != 0
        || claimed != keys as u64
    {
        return Err(format!(
            "mass crash: {stuck} keys stuck, one charge per key: {one_charge}, {bad_orders} keys \
             without exactly one paid order, {orphan_orders} orders without a key, {not_created} \
             stored answers and {not_201} answers before the kill other than 201, {claimed} of \
             {keys} keys claimed"
        )
        .into());
    }
    Ok(result)
}
