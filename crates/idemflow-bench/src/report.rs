//! The result: everything measured (written as JSON) and the tables printed from it. Each
//! workload prints its own section and judges its own targets (see `workloads`); what is here
//! is the report's shape, the table of timed runs, the targets table and what they share.

use std::fmt::Write as _;

use serde::Serialize;

use crate::config::Config;
use crate::db::ServerCounts;
use crate::load::LatencySummary;
use crate::machine;
use crate::wire_counts::WireCount;
use crate::workloads::WORKLOADS;

/// Workload identifiers, as they appear in the JSON and the tables: the workload's number, then
/// its name (the http workload has two, one per request it sends).
pub const CHECKOUT: &str = "1-checkout";
pub const LOCAL_ONLY: &str = "2-local-only";
pub const REPLAY: &str = "3-replay";
pub const STORM: &str = "4-storm";
pub const DRAIN: &str = "5-drain";
pub const RETENTION: &str = "6-retention";
pub const HTTP_CHECKOUT: &str = "7-http-checkout";
pub const HTTP_REPLAY: &str = "7-http-replay";
pub const PROVIDER_STORM: &str = "8-provider-storm";
pub const MASS_CRASH: &str = "9-mass-crash";
pub const LARGE_RESPONSES: &str = "10-large-responses";
pub const FLEET: &str = "11-fleet";
pub const PARTITIONED_EXPIRY: &str = "12-partitioned-expiry";

/// Variants of a workload.
pub const ENGINE: &str = "engine";
pub const ENGINE_HOOK: &str = "engine + never-firing crash hook";
pub const RAW: &str = "raw sqlx";
pub const HTTP: &str = "engine over HTTP";
pub const HTTP_RAW: &str = "raw sqlx over HTTP";
pub const PGBENCH_ENGINE: &str = "pgbench: engine statements";
pub const PGBENCH_REFERENCE: &str = "pgbench: reference shape";
pub const PGBENCH_RAW_SELECT: &str = "pgbench: raw select";

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub quick: bool,
    pub machine: Machine,
    pub settings: Settings,
    /// Every timed run.
    pub runs: Vec<Run>,
    /// Commits and round trips per request, counted on the wire (single client).
    pub wire: Vec<WireCount>,
    /// How often a crash hook is consulted per checkout request (a counting hook, on the wire
    /// run), and what one consultation costs (in process).
    pub hook_calls_per_request: Option<f64>,
    pub hook_nanos_per_call: Option<f64>,
    pub storm: Option<Storm>,
    pub drain: Vec<Drain>,
    pub retention: Option<Retention>,
    /// The provider-storm workload: the duplicate storm through the checkout workflow and the mock
    /// provider.
    pub provider_storm: Option<ProviderStorm>,
    /// The mass-crash workload: one run per number of recovering worker processes.
    pub mass_crash: Vec<MassCrash>,
    /// The large-responses workload: one row per body size and placement (in the row, apart).
    pub large_responses: Vec<LargeResponse>,
    /// The fleet workload: one process of each kind, then the fleet, then the fleet under kills.
    pub fleet: Vec<Fleet>,
    /// The partitioned-expiry workload: expiry by dropping partitions vs by deleting, and the
    /// partitioned layout's look-up and claim cost.
    pub partitioned_expiry: Option<PartitionedExpiry>,
    /// The sqlite workload: the SQLite store beside raw sqlx on SQLite, one row per operation and
    /// client count.
    pub sqlite: Vec<EngineRun>,
    /// The mariadb workload: the MariaDB engine beside raw sqlx on MariaDB.
    pub mariadb: Option<crate::mariadb::MariaDb>,
    /// The redis workload: the Redis engine beside PostgreSQL.
    pub redis: Option<crate::redis::RedisBeside>,
    /// Contended transfers at Serializable, engine and raw, at each client count.
    pub transfers: Vec<crate::transfers::TransferRun>,
    pub targets: Vec<Target>,
    /// The 1, 5 and 15 minute load averages as each workload began: other work on the machine.
    pub load_trace: Vec<(String, String)>,
    pub notes: Vec<String>,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: Option<String>,
    pub memory_gib: Option<f64>,
    pub kernel: Option<String>,
    pub load_average_start: Option<String>,
    pub load_average_end: Option<String>,
    /// server_version, fsync, synchronous_commit, …
    pub postgres: Vec<(String, String)>,
    /// "available", or why not.
    pub pg_stat_statements: String,
    /// pgbench's version, when installed (and used).
    pub pgbench: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    pub clients: Vec<usize>,
    pub duration_secs: f64,
    pub warm_up_secs: f64,
    pub replay_keys: u64,
    pub reference_clients: usize,
}

/// One timed run of one variant at one concurrency.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub workload: String,
    pub variant: String,
    pub clients: usize,
    pub requests: u64,
    pub seconds: f64,
    pub per_second: f64,
    /// Whole-request latency (pgbench: only its mean).
    pub latency: LatencySummary,
    /// Request start to the first local phase (BEGIN and the claim done), where measured.
    pub claim: Option<LatencySummary>,
    /// From pg_stat_database (and pg_stat_statements), warm-up included.
    pub server: Option<ServerCounts>,
    /// How far apart the rates of this variant's two halves were (|a - b| / mean): the noise
    /// floor of a comparison between variants.
    pub spread: Option<f64>,
    /// This process's CPU time per request during the run (user + system, 10 ms resolution
    /// over the run): the client side's own cost — engine, sqlx, tokio (and for HTTP rows the
    /// server and the client too). Not measured for pgbench.
    pub client_cpu_us_per_request: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Storm {
    pub clients: usize,
    pub keys_per_round: usize,
    pub rounds: usize,
    pub requests: u64,
    pub executed: u64,
    pub replayed: u64,
    pub in_progress: u64,
    pub other: u64,
    /// Every key ran each phase exactly once (orders rows, foreign calls, finished keys).
    pub one_execution_per_key: bool,
    pub winners: LatencySummary,
    pub in_progress_latency: LatencySummary,
    pub replayed_latency: LatencySummary,
}

/// The fleet workload: `requests` checkouts through `serves` serve and `workers` worker processes
/// of the checkout example, with or without processes SIGKILLed at random and replaced.
#[derive(Debug, Clone, Serialize)]
pub struct Fleet {
    pub serves: usize,
    pub workers: usize,
    pub kills: bool,
    pub clients: usize,
    pub requests: u64,
    pub seconds: f64,
    pub per_second: f64,
    /// Requests per second ÷ the single-process run's.
    pub ratio_to_single: f64,
    pub serve_kills: u64,
    pub worker_kills: u64,
    /// Client retries: connection errors (a killed service), 409 (a key in flight), 503.
    pub connection_errors: u64,
    pub in_progress: u64,
    pub unavailable: u64,
    pub all_done: bool,
    pub one_order_per_key: bool,
    pub one_charge_per_key: bool,
    pub sampled_replays_byte_equal: bool,
    /// The kill schedule's seed (`IDEMFLOW_SEED` replays it), when there were kills.
    pub seed: Option<u64>,
}

/// The partitioned-expiry workload: the partitioned layout (`idemflow::postgres::partitions`).
#[derive(Debug, Clone, Serialize)]
pub struct PartitionedExpiry {
    /// Finished keys each expiry variant expires, and the clients of the load meanwhile.
    pub keys: u64,
    pub clients: usize,
    pub keep_for_hours: f64,
    /// One per variant: delete flat out, delete paced (the default), drop partitions.
    pub expiries: Vec<Expiry>,
    /// Replays and claims per second on each layout, at `cost_clients` clients.
    pub cost_clients: usize,
    pub costs: Vec<LayoutCost>,
}

/// One way of expiring the keys, in a schema of its own, with new requests running meanwhile.
#[derive(Debug, Clone, Serialize)]
pub struct Expiry {
    pub how: String,
    pub partitioned: bool,
    /// Partitions of the keys table before and after (0: unpartitioned).
    pub partitions_before: usize,
    pub partitions_after: usize,
    pub expired: u64,
    /// The expiry's wall time.
    pub seconds: f64,
    /// Seeding, adopting the layout and the VACUUM (ANALYZE) after.
    pub seed_seconds: f64,
    /// The load (new one-local-phase requests) just before the expiry, and during it; their
    /// `claim` is request start → the phase began (look-up, BEGIN and the claim done).
    pub before: Run,
    pub during: Run,
    /// pg_stat_user_tables over the keys table's tree after the expiry (autovacuum off on it):
    /// dead tuples, of which the load's own updates (one dead version per request's finish),
    /// rows deleted one by one, and so the dead tuples the expiry itself left.
    pub dead_tuples_after: i64,
    pub load_updates: i64,
    pub rows_deleted: i64,
    pub dead_tuples_left_by_expiry: i64,
    /// pg_total_relation_size over the tree (heaps, indexes, TOAST) before and after.
    pub bytes_before: i64,
    pub bytes_after: i64,
    /// A manual VACUUM of the keys table after the expiry: the work it left to autovacuum.
    pub vacuum_seconds: f64,
    /// Autovacuum runs on the tree over the measurement (0: it was off, as meant).
    pub autovacuums: i64,
}

/// Replays and new claims through the engine on one layout (0 partitions: unpartitioned).
#[derive(Debug, Clone, Serialize)]
pub struct LayoutCost {
    pub partitions: usize,
    pub replays_per_second: f64,
    pub replay_latency: LatencySummary,
    pub replay_spread: Option<f64>,
    /// ÷ the unpartitioned table's, interleaved in the same run.
    pub replay_ratio: f64,
    pub claims_per_second: f64,
    pub claim_latency: LatencySummary,
    /// Request start → the phase began (look-up, BEGIN and the claim done).
    pub claim_time: LatencySummary,
    pub claim_spread: Option<f64>,
    pub claim_ratio: f64,
}

/// The large-responses workload: keys answered with `body_bytes` bytes, stored in the row or
/// apart.
#[derive(Debug, Clone, Serialize)]
pub struct LargeResponse {
    pub body_bytes: usize,
    pub apart: bool,
    pub keys: u64,
    /// What each key added to the keys table's heap (the hot table), its TOAST table, and the
    /// table of bodies apart (with its TOAST and index).
    pub heap_bytes_per_key: f64,
    pub toast_bytes_per_key: f64,
    pub apart_bytes_per_key: f64,
    /// Engine replays per second, and the raw primary-key select of the same bytes, interleaved.
    pub replays_per_second: f64,
    pub raw_selects_per_second: f64,
    /// Retention's time per key deleted (batches of 500, back to back).
    pub retention_micros_per_key: f64,
}

/// The sqlite and mariadb workloads: one operation at one client count on another engine (SQLite,
/// MariaDB), the engine and raw sqlx sending the same statements in alternating halves of the run.
#[derive(Debug, Clone, Serialize)]
pub struct EngineRun {
    /// `request` (a new key: claim, one phase, finish, in one write transaction), `replay` (the
    /// look-up of a finished key), or one of the runner's: `checkout`, `local-only`,
    /// `run-replay`, `http-checkout`, `http-replay`.
    pub operation: String,
    pub clients: usize,
    pub engine_per_second: f64,
    pub raw_per_second: f64,
}

/// The provider-storm workload: `keys` keys, each sent `duplicates` times by `clients` clients
/// taking the sends in order from one queue (a key's sends are consecutive, so they run at once on
/// different clients), through the engine with a checkout workflow whose foreign phase charges the
/// testkit's mock provider over HTTP.
#[derive(Debug, Clone, Serialize)]
pub struct ProviderStorm {
    pub clients: usize,
    pub keys: usize,
    pub duplicates: usize,
    pub requests: u64,
    pub seconds: f64,
    pub per_second: f64,
    /// Outcomes: first runs, stored answers, 409s (the key in progress), anything else.
    pub executed: u64,
    pub replayed: u64,
    pub in_progress: u64,
    pub other: u64,
    /// The most `Executed` outcomes any one key got (1 when every key ran once).
    pub max_executions_per_key: u64,
    /// Orders rows of the storm's keys; the provider's own ledger: charges and calls under the
    /// storm's derived keys.
    pub orders: u64,
    pub provider_charges: u64,
    pub provider_calls: u64,
    /// Every replayed body was byte-equal to its key's first answer.
    pub replays_byte_equal: bool,
    /// One Executed, one order, one provider call and charge, one finished key per key.
    pub one_execution_per_key: bool,
    pub executed_latency: LatencySummary,
    pub replayed_latency: LatencySummary,
    pub in_progress_latency: LatencySummary,
}

/// The mass-crash workload: `serves` checkout `serve` processes SIGKILLed at once with requests in
/// flight, then recovered by `workers` checkout `worker` processes (started before the load).
#[derive(Debug, Clone, Serialize)]
pub struct MassCrash {
    pub serves: usize,
    pub workers: usize,
    /// Keys sent (one request each), spread over the serves and over the ramp.
    pub keys: u64,
    pub ramp_secs: f64,
    /// The provider's script: calls held without an answer (never executed), and calls
    /// executed `delay_margin_ms` after the end of the ramp (after the kill, their callers gone).
    pub held_keys: u64,
    pub delayed_keys: u64,
    pub delay_margin_ms: f64,
    /// Load start → the kill (every key's call had reached the provider by then).
    pub kill_at_secs: f64,
    /// Requests answered before the kill, and sent but not answered when it came.
    pub answered_before_kill: u64,
    pub in_flight_at_kill: u64,
    /// Keys the engine had claimed by the kill (the rest never reached it).
    pub claimed: u64,
    pub done_at_kill: u64,
    /// Charges the provider executed for the run's keys by the kill, and after it.
    pub charged_at_kill: u64,
    pub charged_after_kill: u64,
    /// Kill → the provider had nothing in flight and the leases were ended in SQL.
    pub settle_seconds: f64,
    /// Kill → every claimed key done (the drain time).
    pub drain_seconds: f64,
    /// Leases ended → every claimed key done: the workers' own time.
    pub workers_seconds: f64,
    /// Keys the workers finished per second of `workers_seconds`.
    pub keys_per_second: f64,
    /// The provider's ledger per derived key of a claimed key: the most calls, and whether each
    /// holds exactly one charge.
    pub max_provider_calls_per_key: u64,
    pub one_charge_per_key: bool,
    /// One order, paid, per claimed key.
    pub one_order_per_key: bool,
    /// Claimed keys not done by the deadline.
    pub stuck: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Drain {
    pub resumers: usize,
    pub concurrency_per_resumer: usize,
    pub keys: u64,
    pub finished: u64,
    pub seconds: f64,
    pub keys_per_second: f64,
    pub keys_per_second_per_resumer: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Retention {
    pub rows: u64,
    pub batch: i64,
    pub deleted: u64,
    pub seconds: f64,
    pub rows_per_second: f64,
    pub seed_seconds: f64,
    /// The checkout workload just before, and while retention ran.
    pub idle: Run,
    pub during: Run,
    /// The same rows again, deleted by the engine's paced retention (`expire_paced`).
    pub paced: Option<Paced>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Paced {
    pub batch: i64,
    pub budget_rows_per_second: f64,
    pub deleted: u64,
    pub seconds: f64,
    pub rows_per_second: f64,
    pub during: Run,
}

#[derive(Debug, Clone, Serialize)]
pub struct Target {
    pub name: String,
    pub measured: String,
    pub target: String,
    /// `None`: not measured in this run.
    pub met: Option<bool>,
}

impl Target {
    /// A ratio judged against a floor: `measured ≥ at_least×`.
    pub(crate) fn ratio(name: String, ratio: Option<f64>, at_least: f64) -> Self {
        Self {
            name,
            measured: ratio.map_or("-".to_owned(), |ratio| format!("{ratio:.2}×")),
            target: format!("≥ {at_least}×"),
            met: ratio.map(|ratio| ratio >= at_least),
        }
    }

    /// A count that must be exactly `expected` (commits or round trips per request).
    pub(crate) fn exactly(name: &str, measured: Option<f64>, expected: f64) -> Self {
        Self {
            name: name.to_owned(),
            measured: measured.map_or("-".to_owned(), |value| format!("{value:.2}")),
            target: format!("{expected}"),
            met: measured.map(|value| (value - expected).abs() < 1e-9),
        }
    }

    /// Something that must happen exactly once per key (an execution, a charge).
    pub(crate) fn exactly_once(name: String, once: bool) -> Self {
        Self {
            name,
            measured: if once { "exactly 1" } else { "not 1" }.to_owned(),
            target: "exactly 1".to_owned(),
            met: Some(once),
        }
    }
}

/// The floor of every throughput target against a raw baseline: the engine as fast as the code a
/// careful team would write by hand for the same guarantees.
pub(crate) const AT_LEAST_RAW: f64 = 1.0;

/// `a ÷ b`, where both were measured.
pub(crate) fn over(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    a.zip(b).map(|(a, b)| a / b)
}

impl Report {
    /// An empty report of a run with `config` on `machine`: the workloads fill it in.
    pub(crate) fn new(config: &Config, machine: Machine) -> Self {
        Self {
            quick: config.quick,
            machine,
            settings: Settings {
                clients: config.clients.clone(),
                duration_secs: config.duration.as_secs_f64(),
                warm_up_secs: config.warm_up.as_secs_f64(),
                replay_keys: config.replay_keys,
                reference_clients: config.reference_clients(),
            },
            runs: Vec::new(),
            wire: Vec::new(),
            hook_calls_per_request: None,
            hook_nanos_per_call: None,
            storm: None,
            drain: Vec::new(),
            retention: None,
            provider_storm: None,
            mass_crash: Vec::new(),
            large_responses: Vec::new(),
            fleet: Vec::new(),
            partitioned_expiry: None,
            sqlite: Vec::new(),
            mariadb: None,
            redis: None,
            transfers: Vec::new(),
            targets: Vec::new(),
            load_trace: Vec::new(),
            notes: Vec::new(),
            seconds: 0.0,
        }
    }

    /// Notes the load average as `section` begins.
    pub(crate) fn trace(&mut self, section: &str) {
        self.load_trace.push((
            section.to_owned(),
            machine::load_average().unwrap_or_default(),
        ));
    }

    pub fn run(&self, workload: &str, variant: &str, clients: usize) -> Option<&Run> {
        self.runs.iter().find(|run| {
            run.workload == workload && run.variant == variant && run.clients == clients
        })
    }

    pub fn wire(&self, workload: &str, variant: &str) -> Option<&WireCount> {
        self.wire
            .iter()
            .find(|count| count.workload == workload && count.variant == variant)
    }

    /// The requests per second of a variant at the client count the targets are judged at.
    pub(crate) fn rate(&self, workload: &str, variant: &str) -> Option<f64> {
        self.run(workload, variant, self.settings.reference_clients)
            .map(|run| run.per_second)
    }

    /// The client counts the throughput targets against raw are judged at: 8 and 32 where this
    /// run measured them (a payments endpoint's usual concurrency, and a busy one), else the
    /// reference count alone.
    pub(crate) fn judged_clients(&self) -> Vec<usize> {
        let judged: Vec<usize> = [8, 32]
            .into_iter()
            .filter(|clients| self.settings.clients.contains(clients))
            .collect();
        if judged.is_empty() {
            vec![self.settings.reference_clients]
        } else {
            judged
        }
    }

    /// Engine ÷ raw ≥ [`AT_LEAST_RAW`] for `variant` of `workload`, at each judged client count:
    /// the engine is to cost nothing a hand-written implementation of the same guarantees would
    /// not. Where a run falls short, the table says so; the floor is never lowered to pass.
    pub(crate) fn against_raw(&self, workload: &str, variant: &str, raw: &str) -> Vec<Target> {
        self.judged_clients()
            .into_iter()
            .map(|clients| {
                let rate = |variant| {
                    self.run(workload, variant, clients)
                        .map(|run| run.per_second)
                };
                Target::ratio(
                    target_name(workload, variant, clients).unwrap_or_default(),
                    over(rate(variant), rate(raw)),
                    AT_LEAST_RAW,
                )
            })
            .collect()
    }

    /// The server's transactions per request of the engine ≤ the raw baseline's, at each judged
    /// client count (pg_stat_database's `xact_commit`, read-only transactions included).
    pub(crate) fn transactions_against_raw(&self, workload: &str, name: &str) -> Vec<Target> {
        self.judged_clients()
            .into_iter()
            .map(|clients| {
                let count = |variant| {
                    self.run(workload, variant, clients)
                        .and_then(|run| run.server.as_ref())
                        .map(|server| server.commits_per_request)
                };
                let (engine, raw) = (count(ENGINE), count(RAW));
                Target {
                    name: format!("{name}: server transactions per request @{clients}"),
                    measured: engine.map_or("-".to_owned(), |engine| format!("{engine:.2}")),
                    target: raw.map_or("-".to_owned(), |raw| format!("≤ raw {raw:.2}")),
                    // Warm-up requests are counted too: a hundredth is noise, not a transaction.
                    met: engine.zip(raw).map(|(engine, raw)| engine <= raw + 0.01),
                }
            })
            .collect()
    }

    /// The name of the target judged from a variant's row at the reference client count.
    pub(crate) fn target_name(&self, workload: &str, variant: &str) -> String {
        target_name(workload, variant, self.settings.reference_clients).unwrap_or_default()
    }

    /// The ratio printed beside a run: engine variants against the raw baseline of the same
    /// workload; pgbench runs as the engine's rate over theirs.
    fn ratio(&self, run: &Run) -> Option<f64> {
        let base = match run.workload.as_str() {
            HTTP_CHECKOUT => CHECKOUT,
            HTTP_REPLAY => REPLAY,
            other => other,
        };
        if run.variant.starts_with("pgbench") {
            let engine = self.run(base, ENGINE, run.clients)?;
            Some(engine.per_second / run.per_second)
        } else if run.variant == RAW || run.variant == HTTP_RAW {
            None
        } else if let Some(raw) = self.run(&run.workload, HTTP_RAW, run.clients) {
            // Over HTTP, against the hand-written handler over HTTP when it ran: like with like.
            Some(run.per_second / raw.per_second)
        } else {
            let raw = self.run(base, RAW, run.clients)?;
            Some(run.per_second / raw.per_second)
        }
    }

    fn target_for(&self, run: &Run) -> Option<&Target> {
        let name = target_name(&run.workload, &run.variant, run.clients)?;
        self.targets.iter().find(|target| target.name == name)
    }

    /// The tables, as printed: the machine, every timed run, each workload's section in the
    /// order they ran, the targets.
    pub fn table(&self) -> String {
        let mut out = String::new();
        self.machine_lines(&mut out);
        if !self.runs.is_empty() {
            self.runs_table(&mut out);
        }
        for section in WORKLOADS.iter().filter_map(|workload| workload.section) {
            section(self, &mut out);
        }
        self.targets_table(&mut out);
        out
    }

    fn machine_lines(&self, out: &mut String) {
        let m = &self.machine;
        let _ = writeln!(
            out,
            "machine: {} cpus ({}), {:.1} GiB, load {} → {}; PostgreSQL {}",
            m.cpus,
            m.cpu_model.as_deref().unwrap_or("?"),
            m.memory_gib.unwrap_or(0.0),
            m.load_average_start.as_deref().unwrap_or("?"),
            m.load_average_end.as_deref().unwrap_or("?"),
            m.postgres
                .iter()
                .map(|(name, value)| format!("{name}={value}"))
                .collect::<Vec<_>>()
                .join(" "),
        );
        let _ = writeln!(
            out,
            "pg_stat_statements: {}; pgbench: {}; {} s per run after {} s warm-up{}",
            m.pg_stat_statements,
            m.pgbench.as_deref().unwrap_or("not used"),
            self.settings.duration_secs,
            self.settings.warm_up_secs,
            if self.quick {
                " (quick: smoke test, figures not meaningful)"
            } else {
                ""
            },
        );
    }

    /// Every timed run (the checkout, local-only, replay, pgbench and http workloads'), with its
    /// ratio to the baseline and the target judged from it.
    fn runs_table(&self, out: &mut String) {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<16} {:<33} {:>3} {:>9} {:>7} {:>7} {:>7} {:>7} {:>6} {:>6} {:>6} {:>7} {:>5}",
            "workload",
            "variant",
            "cl",
            "req/s",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "ratio",
            "cpu µs",
            "xc/req",
            "st/req",
            "target",
            "met?"
        );
        for run in &self.runs {
            self.run_line(out, run);
        }
        let _ = writeln!(
            out,
            "ratio: engine rows ÷ raw sqlx at the same clients; pgbench rows: engine ÷ pgbench. \
             cpu µs: this process's CPU time per request (engine + sqlx + tokio; HTTP rows: + server and client). \
             xc/req: pg_stat_database xact_commit per request (read-only transactions included); \
             st/req: pg_stat_statements calls per request."
        );
    }

    fn run_line(&self, out: &mut String, run: &Run) {
        let target = self.target_for(run);
        let _ = writeln!(
            out,
            "{:<16} {:<33} {:>3} {:>9.0} {:>7} {:>7} {:>7} {:>7} {:>6} {:>6} {:>6} {:>7} {:>5}",
            run.workload,
            run.variant,
            run.clients,
            run.per_second,
            ms(run.latency.p50_ms.or(run.latency.mean_ms)),
            ms(run.latency.p95_ms),
            ms(run.latency.p99_ms),
            self.ratio(run)
                .map_or("".to_owned(), |ratio| format!("{ratio:.2}")),
            run.client_cpu_us_per_request
                .map_or("".to_owned(), |us| format!("{us:.0}")),
            run.server
                .map_or("".to_owned(), |s| format!("{:.2}", s.commits_per_request)),
            run.server
                .and_then(|s| s.statements_per_request)
                .map_or("".to_owned(), |s| format!("{s:.2}")),
            target.map_or("", |target| target.target.as_str()),
            target.map_or("", |target| met(target.met)),
        );
    }

    /// The targets, the load average at each workload's start, and the notes.
    fn targets_table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\ntargets (against raw at {} clients, the rest at {}; each names its own):",
            self.judged_clients()
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(" and "),
            self.settings.reference_clients
        );
        let _ = writeln!(
            out,
            "{:<58} {:>22} {:>14} {:>5}",
            "target", "measured", "target", "met?"
        );
        for target in &self.targets {
            let _ = writeln!(
                out,
                "{:<58} {:>22} {:>14} {:>5}",
                target.name,
                target.measured,
                target.target,
                met(target.met)
            );
        }
        let _ = writeln!(
            out,
            "load average by section: {}",
            self.load_trace
                .iter()
                .map(|(section, load)| format!("{section}: {load}"))
                .collect::<Vec<_>>()
                .join("; ")
        );
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
    }
}

/// The target shown on a run's row, by the name it has in the targets table.
pub fn target_name(workload: &str, variant: &str, clients: usize) -> Option<String> {
    let name = match (workload, variant) {
        (CHECKOUT, ENGINE) => "1 checkout: engine ÷ raw sqlx",
        (CHECKOUT, PGBENCH_ENGINE) => "1 checkout: engine ÷ pgbench (engine statements)",
        (CHECKOUT, PGBENCH_REFERENCE) => "1 checkout: engine ÷ pgbench (reference shape)",
        (CHECKOUT, ENGINE_HOOK) => "crash hook: throughput lost in workload 1",
        (LOCAL_ONLY, ENGINE) => "2 one local phase: engine ÷ raw sqlx",
        (REPLAY, ENGINE) => "3 replay: engine ÷ raw primary-key select",
        (HTTP_CHECKOUT, HTTP) => "7 checkout over HTTP: engine ÷ raw sqlx handler",
        (HTTP_REPLAY, HTTP) => "7 replay over HTTP: engine ÷ raw sqlx handler",
        _ => return None,
    };
    Some(format!("{name} @{clients}"))
}

/// Milliseconds, two decimals below 10 and one above; `-` when not measured.
pub(crate) fn ms(value: Option<f64>) -> String {
    value.map_or("-".to_owned(), |ms| {
        if ms < 10.0 {
            format!("{ms:.2}")
        } else {
            format!("{ms:.1}")
        }
    })
}

/// p50/p99/max in milliseconds.
pub(crate) fn triple(summary: &LatencySummary) -> String {
    format!(
        "{}/{}/{}",
        ms(summary.p50_ms),
        ms(summary.p99_ms),
        ms(summary.max_ms)
    )
}

pub(crate) fn met(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "yes",
        Some(false) => "NO",
        None => "n/a",
    }
}

/// The sqlite and mariadb workloads' rows: one operation at one client count, engine beside raw.
pub(crate) fn engine_rows(out: &mut String, rows: &[EngineRun]) {
    for row in rows {
        let _ = writeln!(
            out,
            "  {:<13} {:>3} clients: engine {:>8.0}/s  raw {:>8.0}/s  ({:.2}×)",
            row.operation,
            row.clients,
            row.engine_per_second,
            row.raw_per_second,
            row.engine_per_second / row.raw_per_second
        );
    }
}
