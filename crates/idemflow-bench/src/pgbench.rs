//! The pgbench workload, where pgbench is installed: the checkout, local-only and replay
//! workloads' statements from a C client (libpq), as the physical limit of this machine, at the
//! same client counts for the same duration. Scripts are written into a temporary directory.
//!
//! The engine's new-request scripts send the engine's very messages, so they run in pgbench's
//! simple query mode: the claim is `BEGIN; EXECUTE idemflow_claim_v4(…)` in one message, which
//! prepared mode refuses. In simple mode the server also parses the statements the engine sends
//! prepared (the look-up, the phases' statements, advance and finish), so these figures
//! understate what a C client could do, and the engine's ratio to them flatters the engine; the
//! reference shape, the engine's replay (the look-up) and the raw select run prepared.

use idemflow_pg::statements;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::Error;
use crate::load::LatencySummary;
use crate::raw::{self, LEASE_MS};
use crate::report::{
    CHECKOUT as CHECKOUT_ID, ENGINE, LOCAL_ONLY, PGBENCH_ENGINE, PGBENCH_RAW_SELECT,
    PGBENCH_REFERENCE, REPLAY, Report, Run, Target, over,
};
use crate::timed::progress;
use crate::workflows::{CHECKOUT, PLACE, TENANT};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "pgbench",
    number: None,
    measures: "the checkout, local-only and replay statements from C (pgbench), where installed",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: None,
};

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        if !ctx.config.pgbench {
            report
                .notes
                .push("pgbench skipped (quick mode or --no-pgbench)".to_owned());
            return Ok(());
        }
        let Some(version) = version() else {
            report
                .notes
                .push("pgbench is not installed: no C-client limit measured".to_owned());
            return Ok(());
        };
        report.machine.pgbench = Some(version);
        report.runs.extend(runs(ctx).await?);
        Ok(())
    })
}

/// Every script at each client count, for the run's duration.
async fn runs(ctx: &Ctx<'_>) -> Result<Vec<Run>, Error> {
    let dir = std::env::temp_dir().join(format!("idemflow-bench-{}", std::process::id()));
    let scripts = write_scripts(
        &dir,
        &ctx.shape.fingerprint,
        &ctx.shape.request,
        ctx.config.replay_keys,
        // The checkout's and the local-only workflow's limits are the same: the default lease's.
        crate::workflows::checkout(None)?.limits(),
    )?;
    let mut runs = Vec::new();
    let result = async {
        for &clients in &ctx.config.clients {
            for script in &scripts {
                let tps =
                    run_script(script, clients, ctx.config.duration, &ctx.scratch.url).await?;
                let run = Run {
                    workload: script.workload.to_owned(),
                    variant: script.variant.to_owned(),
                    clients,
                    requests: tps.transactions,
                    seconds: ctx.config.duration.as_secs_f64(),
                    per_second: tps.tps,
                    latency: LatencySummary {
                        mean_ms: tps.latency_ms,
                        ..LatencySummary::default()
                    },
                    claim: None,
                    server: None,
                    spread: None,
                    client_cpu_us_per_request: None,
                };
                progress(&run);
                runs.push(run);
            }
        }
        Ok::<_, Error>(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    every_key_finished(ctx).await?;
    Ok(runs)
}

/// pgbench cannot check what a statement wrote: a script whose fenced writes matched no row
/// would be measured doing less than it says. Every key the new-request scripts claimed must
/// have been finished.
async fn every_key_finished(ctx: &Ctx<'_>) -> Result<(), Error> {
    let pool = sqlx::PgPool::connect_with(ctx.scratch.connect.clone()).await?;
    let unfinished: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE key LIKE 'pgb-%' AND state <> 'done'",
    )
    .fetch_one(&pool)
    .await?;
    pool.close().await;
    if unfinished > 0 {
        return Err(format!("pgbench's scripts left {unfinished} keys unfinished").into());
    }
    Ok(())
}

/// The checkout engine's rate ÷ pgbench sending the engine's messages ≥ 0.7×, and ÷ the
/// reference shape ≥ 1.2×.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let engine = report.rate(CHECKOUT_ID, ENGINE);
    for (variant, at_least) in [(PGBENCH_ENGINE, 0.7), (PGBENCH_REFERENCE, 1.2)] {
        targets.push(Target::ratio(
            report.target_name(CHECKOUT_ID, variant),
            over(engine, report.rate(CHECKOUT_ID, variant)),
            at_least,
        ));
    }
}

/// pgbench's version line, or `None` when it is not installed.
fn version() -> Option<String> {
    let output = Command::new("pgbench").arg("--version").output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// A script and what it stands for.
#[derive(Debug, Clone)]
pub struct Script {
    pub workload: &'static str,
    pub variant: &'static str,
    pub path: PathBuf,
    /// pgbench's `-M`: "prepared", or "simple" for a script with multi-statement messages.
    pub protocol: &'static str,
}

fn hex(bytes: &[u8]) -> String {
    idemflow::core::hex::encode(bytes)
}

fn sql_text(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// `text` as an SQL expression decoding its hex: safe in a message of several statements.
fn text_hex(text: &str) -> String {
    format!(
        "convert_from(decode('{}', 'hex'), 'UTF8')",
        hex(text.as_bytes())
    )
}

/// A new request's key in the scripts: `pgb-` and the random `:k`.
const KEY: &str = "'pgb-' || :k::text";
/// A fresh random `:k` per transaction.
const UNIQUE: &str = "\\set k random(1, 1000000000000000)\n";
/// The fencing token the look-up drew for this session's claim (the engine binds it).
const TOKEN: &str = statements::LAST_FENCE;
const MARK_PAID: &str =
    "UPDATE orders SET status = 'paid', paid_by = 'attempt-1' WHERE id = :id::bigint;\n";
const PAID_BODY: &str = "'{\"charge_id\":\"ch_' || :id::text || '\",\"order_id\":' || :id::text || ',\"status\":\"paid\"}'";
const CREATED_BODY: &str = "'{\"order_id\":' || :id::text || ',\"status\":\"created\"}'";
const REPLAY_KEY: &str = "'replay-' || :r::text";

/// The scripts' statements, values in place of parameters: the engine's own
/// (idemflow_pg::statements), and the reference shape's claim.
struct Statements {
    /// How the engine begins each transaction of these workflows (its mark and its limits).
    begin: String,
    tenant: String,
    fingerprint_hex: String,
    /// The fingerprint as a bytea literal.
    fingerprint: String,
    request_json: String,
    /// The request as a jsonb literal.
    request: String,
}

impl Statements {
    fn new(fingerprint: &[u8], request: &serde_json::Value, limits: &idemflow_pg::Limits) -> Self {
        Self {
            begin: statements::begin_message(limits),
            tenant: sql_text(TENANT),
            fingerprint_hex: hex(fingerprint),
            fingerprint: format!("'\\x{}'::bytea", hex(fingerprint)),
            request_json: request.to_string(),
            request: format!("{}::jsonb", sql_text(&request.to_string())),
        }
    }

    fn look_up(&self, key: &str, lock: &str) -> String {
        format!(
            "{};\n",
            statements::with_values(statements::LOOK_UP, &[&self.tenant, key, lock])
        )
    }

    /// The engine's claim message: BEGIN and the connection's prepared claim (the advisory lock
    /// and the insert), values as hex; prepared once per pgbench connection, as the engine does.
    fn begin_claim(&self, workflow: &str) -> String {
        format!(
            "\\if :prepared = 0\n\
             {prepare};\n\
             \\set prepared 1\n\
             \\endif\n\
             {begin} \\; EXECUTE {name}(:k, {tenant_hex}, {KEY}, decode('{fingerprint_hex}', 'hex'), \
             {workflow_hex}, {request_hex}::jsonb, {LEASE_MS}, {TOKEN}) \\; {savepoint};\n",
            prepare = statements::PREPARE_CLAIM,
            begin = self.begin.replace(';', " \\;"),
            savepoint = statements::CLAIMED_SAVEPOINT,
            name = statements::CLAIM_NAME,
            tenant_hex = text_hex(TENANT),
            fingerprint_hex = self.fingerprint_hex,
            workflow_hex = text_hex(workflow),
            request_hex = text_hex(&self.request_json),
        )
    }

    /// The reference shape's claim: an insert committed alone.
    fn claim(&self, workflow: &str) -> String {
        format!(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, locked_until) \
             VALUES ({tenant}, {KEY}, {fingerprint}, {workflow}, {request}, \
             clock_timestamp() + {LEASE_MS}::bigint * interval '1 millisecond') \
             ON CONFLICT (tenant, key) DO NOTHING RETURNING lock_version;\n",
            tenant = self.tenant,
            fingerprint = self.fingerprint,
            workflow = sql_text(workflow),
            request = self.request,
        )
    }

    fn insert_order(&self) -> String {
        format!(
            "INSERT INTO orders (tenant, key, amount) VALUES ({}, {KEY}, 100) RETURNING id \\gset\n",
            self.tenant
        )
    }

    /// `text`: the engine's advance, or the reference shape's ([`raw::ADVANCE`]).
    fn advance(&self, text: &str) -> String {
        format!(
            "{};\n",
            statements::with_values(
                text,
                &[
                    &self.tenant,
                    KEY,
                    TOKEN,
                    "'create_order'",
                    "jsonb_build_object('order_id', :id::bigint, 'amount', 100, 'source', 'tok_visa')",
                    &LEASE_MS.to_string(),
                ],
            )
        )
    }

    /// `text`: the engine's finish, or the reference shape's ([`raw::FINISH`]).
    fn finish(&self, text: &str, point: &str, body: &str) -> String {
        format!(
            "{};\n",
            statements::with_values(
                text,
                &[
                    &self.tenant,
                    KEY,
                    TOKEN,
                    &format!("'{point}'"),
                    "201",
                    "'[[\"content-type\", \"application/json\"]]'::jsonb",
                    &format!("convert_to({body}, 'UTF8')"),
                ],
            )
        )
    }

    /// The checkout as the engine sends it: 2 commits, 9 round trips.
    fn checkout(&self) -> String {
        format!(
            "{UNIQUE}{look_up}{claim}{insert_order}{advance}COMMIT;\n{begin} \\; {begun};\n\
             {MARK_PAID}{finish}COMMIT;\n",
            look_up = self.look_up(KEY, ":k"),
            claim = self.begin_claim(CHECKOUT),
            insert_order = self.insert_order(),
            advance = self.advance(statements::ADVANCE),
            begin = self.begin.replace(';', " \\;"),
            begun = statements::BEGUN_SAVEPOINT,
            finish = self.finish(statements::FINISH, "mark_paid", PAID_BODY),
        )
    }

    /// The reference shape: the claim committed alone, then one transaction per phase: 3
    /// commits, 9 round trips.
    fn reference(&self) -> String {
        format!(
            "{UNIQUE}{claim}BEGIN;\n{insert_order}{advance}COMMIT;\nBEGIN;\n{MARK_PAID}{finish}COMMIT;\n",
            claim = self.claim(CHECKOUT),
            insert_order = self.insert_order(),
            advance = self.advance(&raw::ADVANCE),
            finish = self.finish(&raw::FINISH, "mark_paid", PAID_BODY),
        )
    }

    /// One local phase as the engine sends it: 1 commit, 5 round trips.
    fn place(&self) -> String {
        format!(
            "{UNIQUE}{look_up}{claim}{insert_order}{finish}COMMIT;\n",
            look_up = self.look_up(KEY, ":k"),
            claim = self.begin_claim(PLACE),
            insert_order = self.insert_order(),
            finish = self.finish(statements::FINISH, "place_order", CREATED_BODY),
        )
    }

    /// A replay as the engine sends it (the look-up): 1 implicit commit, 1 round trip.
    fn replay_engine(&self, replay_keys: u64) -> String {
        format!("{}{}", pick(replay_keys), self.look_up(REPLAY_KEY, ":r"))
    }

    /// A replay as plain code would read it (the primary-key select): 1 implicit commit, 1
    /// round trip.
    fn replay_raw(&self, replay_keys: u64) -> String {
        format!(
            "{}SELECT response_status, response_headers, response_body FROM idempotency_keys \
             WHERE tenant = {} AND key = {REPLAY_KEY};\n",
            pick(replay_keys),
            self.tenant
        )
    }
}

/// A random `:r` among the seeded finished keys.
fn pick(replay_keys: u64) -> String {
    format!("\\set r random(0, {})\n", replay_keys.saturating_sub(1))
}

/// Writes the scripts: the checkout workload as the engine sends it (look-up, `BEGIN` with the
/// claim, …), and the reference shape (the claim committed alone, then one transaction per phase:
/// 3 commits); the local-only workload as the engine sends it; the replay workload as the engine
/// sends it (the look-up) and the raw primary-key select.
fn write_scripts(
    dir: &Path,
    fingerprint: &[u8],
    request: &serde_json::Value,
    replay_keys: u64,
    limits: &idemflow_pg::Limits,
) -> Result<Vec<Script>, Error> {
    std::fs::create_dir_all(dir)?;
    let statements = Statements::new(fingerprint, request, limits);
    let scripts = [
        (
            CHECKOUT_ID,
            PGBENCH_ENGINE,
            "checkout.sql",
            statements.checkout(),
            "simple",
        ),
        (
            CHECKOUT_ID,
            PGBENCH_REFERENCE,
            "reference.sql",
            statements.reference(),
            "prepared",
        ),
        (
            LOCAL_ONLY,
            PGBENCH_ENGINE,
            "place.sql",
            statements.place(),
            "simple",
        ),
        (
            REPLAY,
            PGBENCH_ENGINE,
            "replay-engine.sql",
            statements.replay_engine(replay_keys),
            "prepared",
        ),
        (
            REPLAY,
            PGBENCH_RAW_SELECT,
            "replay-raw.sql",
            statements.replay_raw(replay_keys),
            "prepared",
        ),
    ];
    let mut written = Vec::new();
    for (workload, variant, file, text, protocol) in scripts {
        let path = dir.join(file);
        std::fs::write(&path, text)?;
        written.push(Script {
            workload,
            variant,
            path,
            protocol,
        });
    }
    Ok(written)
}

/// What one pgbench run reported.
#[derive(Debug, Clone, Copy)]
pub struct Tps {
    pub transactions: u64,
    pub tps: f64,
    pub latency_ms: Option<f64>,
}

/// Runs `script` with `clients` clients for `duration` against `url`.
async fn run_script(
    script: &Script,
    clients: usize,
    duration: Duration,
    url: &str,
) -> Result<Tps, Error> {
    let threads = clients.clamp(
        1,
        std::thread::available_parallelism().map_or(2, |n| n.get()),
    );
    let mut command = Command::new("pgbench");
    command
        // `prepared`: the engine's scripts prepare the claim once per connection (see above).
        .args(["-n", "-D", "prepared=0", "-M", script.protocol, "-c"])
        .arg(clients.to_string())
        .arg("-j")
        .arg(threads.to_string())
        .arg("-T")
        .arg(duration.as_secs().max(1).to_string())
        .arg("-f")
        .arg(&script.path)
        .arg(url);
    let output = tokio::task::spawn_blocking(move || command.output()).await??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(format!(
            "pgbench {} failed: {}{}",
            script.path.display(),
            stdout,
            String::from_utf8_lossy(&output.stderr)
        )
        .into());
    }
    let field = |prefix: &str| {
        stdout.lines().find_map(|line| {
            line.trim()
                .strip_prefix(prefix)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|number| number.parse::<f64>().ok())
        })
    };
    let tps = field("tps = ").ok_or_else(|| format!("no tps in pgbench's output: {stdout}"))?;
    let transactions = field("number of transactions actually processed: ").unwrap_or(0.0);
    // pgbench counts failed transactions apart (PostgreSQL 15); any is a broken script.
    if let Some(failed) = field("number of failed transactions: ")
        && failed > 0.0
    {
        return Err(format!(
            "pgbench {}: {failed} failed transactions: {stdout}",
            script.path.display()
        )
        .into());
    }
    Ok(Tps {
        transactions: transactions as u64,
        tps,
        latency_ms: field("latency average = "),
    })
}
