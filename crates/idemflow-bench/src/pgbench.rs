//! pgbench, where installed: the same statements from a C client (libpq), as the physical limit
//! of this machine. Scripts are written into a temporary directory.
//!
//! The engine's new-request scripts send the engine's very messages, so they run in pgbench's
//! simple query mode: the claim is `BEGIN; EXECUTE idemflow_claim_v3(…)` in one message, which
//! prepared mode refuses. In simple mode the server also parses the statements the engine sends
//! prepared (the look-up, the phases' statements, advance and finish), so these figures
//! understate what a C client could do, and the engine's ratio to them flatters the engine; the
//! reference shape, the engine's replay (the look-up) and the raw select run prepared.

use idemflow_pg::statements;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::Error;
use crate::raw::LEASE_MS;
use crate::report::{
    CHECKOUT as CHECKOUT_ID, LOCAL_ONLY, PGBENCH_ENGINE, PGBENCH_RAW_SELECT, PGBENCH_REFERENCE,
    REPLAY,
};
use crate::workflows::{CHECKOUT, PLACE, TENANT};

/// pgbench's version line, or `None` when it is not installed.
pub fn version() -> Option<String> {
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

/// Writes the scripts: workload 1 as the engine sends it (look-up, `BEGIN` with the claim, …),
/// the reference shape (the claim committed alone, then one transaction per phase: 3 commits);
/// workload 2 as the engine sends it; workload 3 as the engine sends it (the look-up) and the
/// raw primary-key select.
pub fn write_scripts(
    dir: &Path,
    fingerprint: &[u8],
    request: &serde_json::Value,
    replay_keys: u64,
) -> Result<Vec<Script>, Error> {
    std::fs::create_dir_all(dir)?;
    let tenant = sql_text(TENANT);
    let request_json = request.to_string();
    let fingerprint_hex = hex(fingerprint);
    let fingerprint = format!("'\\x{}'::bytea", hex(fingerprint));
    let request = format!("{}::jsonb", sql_text(&request.to_string()));
    let lease = format!("clock_timestamp() + {LEASE_MS}::bigint * interval '1 millisecond'");
    // The fencing token the look-up drew for this session's claim (the engine binds it).
    let token = statements::LAST_FENCE;
    let key = "'pgb-' || :k::text";
    let text_hex = |text: &str| {
        format!(
            "convert_from(decode('{}', 'hex'), 'UTF8')",
            hex(text.as_bytes())
        )
    };
    // The engine's own statements (idemflow_pg::statements), values in place of parameters.
    let look_up = |key: &str, lock: &str| {
        format!(
            "{};\n",
            statements::with_values(statements::LOOK_UP, &[&tenant, key, lock])
        )
    };
    // The engine's claim message: BEGIN and the connection's prepared claim (the advisory lock
    // and the insert), values as hex; prepared once per pgbench connection, as the engine does.
    let begin_claim = |workflow: &str, fingerprint_hex: &str| {
        format!(
            "\\if :prepared = 0\n\
             {prepare};\n\
             \\set prepared 1\n\
             \\endif\n\
             BEGIN \\; EXECUTE {name}(:k, {tenant_hex}, {key}, decode('{fingerprint_hex}', 'hex'), \
             {workflow_hex}, {request_hex}::jsonb, {LEASE_MS}, {token}) \\; {savepoint};\n",
            prepare = statements::PREPARE_CLAIM,
            savepoint = statements::CLAIMED_SAVEPOINT,
            name = statements::CLAIM_NAME,
            tenant_hex = text_hex(TENANT),
            workflow_hex = text_hex(workflow),
            request_hex = text_hex(&request_json),
        )
    };
    let claim = |workflow: &str| {
        format!(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, locked_until) \
             VALUES ({tenant}, {key}, {fingerprint}, {workflow}, {request}, {lease}) \
             ON CONFLICT (tenant, key) DO NOTHING RETURNING lock_version;\n",
            workflow = sql_text(workflow)
        )
    };
    let insert_order = format!(
        "INSERT INTO orders (tenant, key, amount) VALUES ({tenant}, {key}, 100) RETURNING id \\gset\n"
    );
    let lease_ms = LEASE_MS.to_string();
    let advance = format!(
        "{};\n",
        statements::with_values(
            statements::ADVANCE,
            &[
                &tenant,
                key,
                token,
                "'create_order'",
                "jsonb_build_object('order_id', :id::bigint, 'amount', 100, 'source', 'tok_visa')",
                &lease_ms,
            ],
        )
    );
    let mark_paid =
        "UPDATE orders SET status = 'paid', paid_by = 'attempt-1' WHERE id = :id::bigint;\n";
    let finish = |point: &str, body: &str| {
        format!(
            "{};\n",
            statements::with_values(
                statements::FINISH,
                &[
                    &tenant,
                    key,
                    token,
                    &format!("'{point}'"),
                    "201",
                    "'[[\"content-type\", \"application/json\"]]'::jsonb",
                    &format!("convert_to({body}, 'UTF8')"),
                ],
            )
        )
    };
    let paid_body = "'{\"charge_id\":\"ch_' || :id::text || '\",\"order_id\":' || :id::text || ',\"status\":\"paid\"}'";
    let created_body = "'{\"order_id\":' || :id::text || ',\"status\":\"created\"}'";
    let unique = "\\set k random(1, 1000000000000000)\n";

    let checkout = format!(
        "{unique}{look_up}{claim}{insert_order}{advance}COMMIT;\nBEGIN;\n{mark_paid}{finish}COMMIT;\n",
        look_up = look_up(key, ":k"),
        claim = begin_claim(CHECKOUT, &fingerprint_hex),
        finish = finish("mark_paid", paid_body),
    );
    let reference = format!(
        "{unique}{claim}BEGIN;\n{insert_order}{advance}COMMIT;\nBEGIN;\n{mark_paid}{finish}COMMIT;\n",
        claim = claim(CHECKOUT),
        finish = finish("mark_paid", paid_body),
    );
    let place = format!(
        "{unique}{look_up}{claim}{insert_order}{finish}COMMIT;\n",
        look_up = look_up(key, ":k"),
        claim = begin_claim(PLACE, &fingerprint_hex),
        finish = finish("place_order", created_body),
    );
    let replay_key = "'replay-' || :r::text";
    let pick = format!("\\set r random(0, {})\n", replay_keys.saturating_sub(1));
    let replay_engine = format!("{pick}{}", look_up(replay_key, ":r"));
    let replay_raw = format!(
        "{pick}SELECT response_status, response_headers, response_body FROM idempotency_keys \
         WHERE tenant = {tenant} AND key = {replay_key};\n"
    );

    let scripts = [
        // 2 commits, 9 round trips.
        (
            CHECKOUT_ID,
            PGBENCH_ENGINE,
            "checkout.sql",
            checkout,
            "simple",
        ),
        // 3 commits, 9 round trips.
        (
            CHECKOUT_ID,
            PGBENCH_REFERENCE,
            "reference.sql",
            reference,
            "prepared",
        ),
        // 1 commit, 5 round trips.
        (LOCAL_ONLY, PGBENCH_ENGINE, "place.sql", place, "simple"),
        // 1 implicit commit, 1 round trip.
        (
            REPLAY,
            PGBENCH_ENGINE,
            "replay-engine.sql",
            replay_engine,
            "prepared",
        ),
        // 1 implicit commit, 1 round trip.
        (
            REPLAY,
            PGBENCH_RAW_SELECT,
            "replay-raw.sql",
            replay_raw,
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
pub async fn run(
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
