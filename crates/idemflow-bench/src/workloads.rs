//! The workloads: the registry ([`WORKLOADS`], in the order they run), the loops that run and
//! judge them ([`all`], [`targets`]), and what every workload is given ([`Ctx`]).
//!
//! [`Ctx`] also holds the statements the workloads send to the keys table themselves: finished or
//! started keys seeded in bulk, and counts of what a run left. Those are set-up and checks, as a
//! test would write them, not what is measured; tests/it/tidy.rs allows this file that SQL.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use idemflow::TenantId;

use crate::config::Config;
use crate::db::{Scratch, literal};
use crate::raw::Shape;
use crate::report::{Report, Target};
use crate::timed::interleaved;
use crate::{
    Error, checkout, drain, fleet, http, large_responses, local_only, machine, mariadb, mass_crash,
    partitioned, pgbench, provider_storm, redis, replay, requests, retention, sqlite, storm,
    transfers, wire, workflows,
};

/// A future the registry stores behind a function pointer.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>>;

/// One workload: what `--only` and the documents call it, what it measures, how it runs, and how
/// it is judged and printed.
pub(crate) struct Workload {
    /// `checkout`, `provider-storm`, …: `--only` takes it, the documents use it.
    pub name: &'static str,
    /// The number its identifiers in the report start with (`8-provider-storm`); `--only` takes
    /// it too.
    pub number: Option<u8>,
    /// What it measures, in one line (`--help` lists it).
    pub measures: &'static str,
    pub runs: Runs,
    /// Adds the targets judged from what it measured to the targets table.
    pub targets: Option<fn(&Report, &mut Vec<Target>)>,
    /// Prints its section of the tables, after the table of timed runs.
    pub section: Option<fn(&Report, &mut String)>,
}

/// How a workload runs; either way it records what it measured in the report.
pub(crate) enum Runs {
    /// Once per invocation.
    Once(for<'a> fn(&'a Ctx<'a>, &'a mut Report) -> BoxFuture<'a, ()>),
    /// Once per client count (`--clients`). Workloads of this kind next to each other in the
    /// registry take turns at each count, so the drift over the invocation (the table grows,
    /// autovacuum, other load on the machine) falls on each of them alike.
    AtEachClientCount(for<'a> fn(&'a Ctx<'a>, usize, &'a mut Report) -> BoxFuture<'a, ()>),
    /// Once per client count, as the timed request loops of these (workload, variant) pairs,
    /// interleaved (`timed::interleaved`, one request each through `requests::sample`).
    Interleaved(&'static [(&'static str, &'static str)]),
}

impl Runs {
    fn at_each_client_count(&self) -> bool {
        matches!(self, Self::AtEachClientCount(_) | Self::Interleaved(_))
    }
}

/// Every workload, in the order they run.
pub(crate) const WORKLOADS: &[Workload] = &[
    wire::WORKLOAD,
    checkout::WORKLOAD,
    local_only::WORKLOAD,
    replay::WORKLOAD,
    pgbench::WORKLOAD,
    storm::WORKLOAD,
    drain::WORKLOAD,
    retention::WORKLOAD,
    http::WORKLOAD,
    provider_storm::WORKLOAD,
    mass_crash::WORKLOAD,
    large_responses::WORKLOAD,
    sqlite::WORKLOAD,
    mariadb::WORKLOAD,
    redis::WORKLOAD,
    fleet::WORKLOAD,
    partitioned::WORKLOAD,
    transfers::WORKLOAD,
];

/// The workload `--only` means by `name`: its name, its number, or its identifier in the report
/// (`provider-storm`, `8`, `8-provider-storm`).
pub(crate) fn find(name: &str) -> Option<&'static Workload> {
    WORKLOADS.iter().find(|workload| {
        let number = workload.number.map(|number| number.to_string());
        name == workload.name
            || number.as_deref() == Some(name)
            || name.split_once('-').is_some_and(|(head, rest)| {
                number.as_deref() == Some(head) && rest == workload.name
            })
    })
}

/// Every workload's name and what it measures, in the order they run.
pub fn catalogue() -> Vec<(&'static str, &'static str)> {
    WORKLOADS
        .iter()
        .map(|workload| (workload.name, workload.measures))
        .collect()
}

/// Runs the workloads `config` selects, in the registry's order, and judges them.
pub async fn all(config: &Config, scratch: &Scratch) -> Result<Report, Error> {
    let ctx = Ctx::new(config, scratch)?;
    let mut report = Report::new(config, machine::describe(scratch).await?);
    ctx.seed_replay_keys().await?;
    report.trace("start");
    for group in
        WORKLOADS.chunk_by(|a, b| a.runs.at_each_client_count() && b.runs.at_each_client_count())
    {
        let chosen: Vec<&Workload> = group
            .iter()
            .filter(|workload| config.runs(workload.name))
            .collect();
        run_group(&ctx, &chosen, &mut report).await?;
    }
    report.trace("end");
    report.hook_nanos_per_call = Some(workflows::hook_nanos_per_call().await);
    report.notes.extend(notes(config, scratch));
    report.targets = targets(&report);
    if config.only.is_some() {
        // Only what was measured.
        report.targets.retain(|target| target.met.is_some());
    }
    Ok(report)
}

/// A workload that runs once, or the workloads that take turns at each client count.
async fn run_group(ctx: &Ctx<'_>, group: &[&Workload], report: &mut Report) -> Result<(), Error> {
    for workload in group {
        if let Runs::Once(run) = workload.runs {
            report.trace(workload.name);
            eprintln!("idemflow-bench: {}: {}", workload.name, workload.measures);
            run(ctx, report).await?;
        }
    }
    let names: Vec<&str> = group
        .iter()
        .filter(|workload| workload.runs.at_each_client_count())
        .map(|workload| workload.name)
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    for &clients in &ctx.config.clients {
        report.trace(&format!("{} at {clients} clients", names.join(", ")));
        for workload in group {
            match workload.runs {
                Runs::AtEachClientCount(run) => run(ctx, clients, report).await?,
                Runs::Interleaved(plan) => report
                    .runs
                    .extend(interleaved(ctx, clients, plan, requests::sample).await?),
                Runs::Once(_) => {}
            }
        }
    }
    Ok(())
}

/// What the tables cannot say by themselves.
fn notes(config: &Config, scratch: &Scratch) -> Vec<String> {
    let mut notes = Vec::new();
    if scratch.statements_unavailable.is_some() {
        notes.push(
            "statements per request come from the wire counts only: pg_stat_statements is not loaded"
                .to_owned(),
        );
    }
    notes.push(
        "xc/req counts every committed transaction in the scratch database (read-only ones too, as \
         pg_stat_database does), warm-up included, read after the run's pool closed: PostgreSQL 15 \
         publishes a backend's counters lazily, at exit at the latest"
            .to_owned(),
    );
    if config.quick {
        notes.push("quick mode: a smoke test; only the counts are meaningful".to_owned());
    }
    if let Some(only) = &config.only {
        notes.push(format!("only these ran (--only): {}", only.join(", ")));
    }
    notes
}

/// The targets table: each workload's targets, in the registry's order; a target whose figures
/// were not measured has `met: None`.
pub(crate) fn targets(report: &Report) -> Vec<Target> {
    let mut targets = Vec::new();
    for judge in WORKLOADS.iter().filter_map(|workload| workload.targets) {
        judge(report, &mut targets);
    }
    targets
}

// ------------------------------------------------------------------ context --

/// What every workload is given: the run's settings, the scratch database, and the request the
/// in-process workloads send.
pub(crate) struct Ctx<'a> {
    pub config: &'a Config,
    pub scratch: &'a Scratch,
    /// The fingerprint and canonical request the engine computes for [`workflows::request`]:
    /// what the raw baseline and the seeded keys store.
    pub shape: Shape,
    pub tenant: TenantId,
    next_tag: AtomicU64,
}

impl<'a> Ctx<'a> {
    fn new(config: &'a Config, scratch: &'a Scratch) -> Result<Self, Error> {
        let (fingerprint, request) = workflows::fingerprint_and_request()?;
        Ok(Self {
            config,
            scratch,
            shape: Shape {
                fingerprint: fingerprint.as_bytes().to_vec(),
                request,
            },
            tenant: workflows::tenant(),
            next_tag: AtomicU64::new(0),
        })
    }

    /// A fresh prefix for the keys of one run, so no run meets another's keys.
    pub fn prefix(&self, name: &str) -> String {
        format!("{name}-{}", self.next_tag.fetch_add(1, Ordering::Relaxed))
    }

    /// The finished keys the replay workloads read: `replay-0` … `replay-{n-1}`.
    async fn seed_replay_keys(&self) -> Result<(), Error> {
        let last = self.config.replay_keys.max(1) - 1;
        self.seed_finished("replay-", 0, last, "1 second").await?;
        self.scratch.execute("ANALYZE idempotency_keys").await?;
        Ok(())
    }

    /// Inserts finished checkout keys `{prefix}{first..=last}` created `age` ago (an SQL
    /// interval), as the engine leaves them.
    pub async fn seed_finished(
        &self,
        prefix: &str,
        first: u64,
        last: u64,
        age: &str,
    ) -> Result<(), Error> {
        let sql = format!(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, state, \
                 recovery_point, locked_until, response_status, response_headers, response_body, \
                 created_at, updated_at, finished_at) \
             SELECT {tenant}, {prefix} || g, '\\x{fingerprint}'::bytea, {workflow}, {request}::jsonb, \
                 'done', 'mark_paid', NULL, 201, '[[\"content-type\", \"application/json\"]]'::jsonb, \
                 convert_to('{{\"charge_id\":\"ch_' || g || '\",\"order_id\":' || g || ',\"status\":\"paid\"}}', 'UTF8'), \
                 now() - interval '{age}', now() - interval '{age}', now() - interval '{age}' \
             FROM generate_series({first}, {last}) AS g",
            tenant = literal(workflows::TENANT),
            prefix = literal(prefix),
            fingerprint = idemflow::core::hex::encode(&self.shape.fingerprint),
            workflow = literal(workflows::CHECKOUT),
            request = literal(&self.shape.request.to_string()),
        );
        self.scratch.execute(&sql).await?;
        Ok(())
    }

    /// Inserts `keys` checkout keys `{prefix}1` … at the recovery point after create_order with
    /// expired leases, as a crash right after the first commit leaves them (orders rows
    /// included).
    pub async fn seed_started(&self, prefix: &str, keys: u64) -> Result<(), Error> {
        let sql = format!(
            "WITH o AS ( \
                 INSERT INTO orders (tenant, key, amount) \
                 SELECT {tenant}, {prefix} || g, 100 FROM generate_series(1, {keys}) AS g \
                 RETURNING id, key) \
             INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, \
                 recovery_point, phase_output, locked_until, lock_version, attempts) \
             SELECT {tenant}, o.key, '\\x{fingerprint}'::bytea, {workflow}, {request}::jsonb, \
                 'create_order', jsonb_build_object('order_id', o.id, 'amount', 100, 'source', 'tok_visa'), \
                 now() - interval '1 minute', 0, 1 \
             FROM o",
            tenant = literal(workflows::TENANT),
            prefix = literal(prefix),
            fingerprint = idemflow::core::hex::encode(&self.shape.fingerprint),
            workflow = literal(workflows::CHECKOUT),
            request = literal(&self.shape.request.to_string()),
        );
        self.scratch.execute(&sql).await?;
        Ok(())
    }

    /// Fresh statistics for the keys table, after a bulk insert.
    pub async fn analyze_keys(&self) -> Result<(), Error> {
        self.scratch.execute("ANALYZE idempotency_keys").await?;
        Ok(())
    }

    /// Freezes, hints and analyzes the keys and orders tables after a bulk insert of old rows:
    /// in production such rows are frozen and hinted; a fresh bulk insert is not.
    pub async fn vacuum_keys(&self) -> Result<(), Error> {
        self.scratch
            .execute("VACUUM (ANALYZE) idempotency_keys")
            .await?;
        self.scratch.execute("VACUUM (ANALYZE) orders").await?;
        Ok(())
    }

    /// Keys whose key matches the SQL `LIKE` pattern `like`, whatever their state.
    pub async fn keys_like(&self, like: &str) -> Result<i64, Error> {
        self.scratch
            .scalar(&format!(
                "SELECT count(*) FROM idempotency_keys WHERE key LIKE {}",
                literal(like)
            ))
            .await
    }

    /// Finished keys whose key matches the SQL `LIKE` pattern `like`.
    pub async fn done_keys_like(&self, like: &str) -> Result<i64, Error> {
        self.scratch
            .scalar(&format!(
                "SELECT count(*) FROM idempotency_keys WHERE key LIKE {} AND state = 'done'",
                literal(like)
            ))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::{WORKLOADS, find};
    use crate::report;

    #[test]
    fn names_and_numbers_name_one_workload_each() {
        for (index, workload) in WORKLOADS.iter().enumerate() {
            assert!(
                WORKLOADS[..index]
                    .iter()
                    .all(|other| other.name != workload.name
                        && (workload.number.is_none() || other.number != workload.number)),
                "{} is named or numbered twice",
                workload.name
            );
            assert_eq!(
                find(workload.name).map(|found| found.name),
                Some(workload.name)
            );
        }
    }

    #[test]
    fn report_identifiers_are_number_then_name() {
        for identifier in [
            report::CHECKOUT,
            report::LOCAL_ONLY,
            report::REPLAY,
            report::STORM,
            report::DRAIN,
            report::RETENTION,
            report::PROVIDER_STORM,
            report::MASS_CRASH,
            report::LARGE_RESPONSES,
            report::FLEET,
            report::PARTITIONED_EXPIRY,
        ] {
            let workload = find(identifier).unwrap_or_else(|| panic!("{identifier}"));
            let number = workload.number.map(|number| number.to_string());
            assert_eq!(
                Some(identifier.to_owned()),
                number.map(|number| format!("{number}-{}", workload.name))
            );
        }
    }
}
