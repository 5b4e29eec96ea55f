//! A primary failover under load. Two PostgreSQL clusters on loopback, made by the test with
//! `initdb` and `pg_basebackup`: a primary and a streaming standby. The service (a `Runner` for
//! the clients, a `Resumer` beside it) reaches the database only through the testkit's fault
//! proxy, which stands in for a virtual IP; the standby streams from the primary through a second
//! proxy, the network between the two. Clients send checkouts (the example's workflow, charging
//! the testkit's mock provider over HTTP) and retry each with its key until answered. Then the
//! primary is stopped hard (`pg_ctl stop -m immediate`), the standby promoted (`pg_ctl promote`)
//! and the address moved to it (`FaultProxy::retarget`), all at instants the test picks.
//!
//! With synchronous replication nothing a client was told is lost and nothing runs twice. With
//! asynchronous replication what the standby had not received when the primary died is lost;
//! the test makes that window explicit (the link to the standby goes quiet for a while before the
//! crash), measures it from the dead primary's WAL, and checks what the derived keys still
//! protect. docs/operations.md, "Failover", has the figures and what they mean.
//!
//! Run by `scripts/test-ha`, which names the server binaries (`IDEMFLOW_PG_BINDIR`) and, as
//! root, the system user the clusters run as (`IDEMFLOW_PG_OWNER`): PostgreSQL refuses to run as
//! root.

// The example's workflow, as explore_checkout.rs loads it too (its copy is private to it).
#[path = "../../examples/checkout/workflow.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod workflow;

#[path = "../../examples/checkout/orders.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod orders;

use idemflow::PgStore;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemflow::{
    LocalPhase, Outcome, PgConnection, PhaseContext, PhaseError, Registry, Resumer, ResumerConfig,
    Runner, StoredResponse, TenantId, Workflow,
};
use idemflow_testkit::provider::{Fault, MockProvider};
use idemflow_testkit::provider_client::ProviderClient;
use idemflow_testrig::faults::FaultProxy;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::example::charge_key;

/// Concurrent clients, each sending its keys one after another.
const CLIENTS: usize = 12;
/// Load before anything happens to the primary.
const WARM_UP: Duration = Duration::from_millis(1500);
/// Load after the address has moved, before the clients stop sending new keys.
const AFTER: Duration = Duration::from_millis(1500);
/// The checkout's lease: long enough that no key changes hands during the test unless its lease
/// is rewound (as the test does for the keys in flight at the crash).
const LEASE: Duration = Duration::from_secs(10);
/// No key waits longer than this for its answer.
const PATIENCE: Duration = Duration::from_secs(60);
/// Every third key's charge is held this long at the provider: more keys in flight at the crash.
const SLOW_CHARGE: Duration = Duration::from_millis(300);
/// Under asynchronous replication, how long the standby hears nothing before the primary dies.
const QUIET_LINK: Duration = Duration::from_millis(600);

// --------------------------------------------------------------------------------- clusters ---

/// How to run the server binaries: where they are, and as whom.
#[derive(Debug)]
struct Binaries {
    dir: PathBuf,
    /// The system user to run them as (`runuser`); `None` when not root.
    owner: Option<String>,
}

impl Binaries {
    /// From the environment `scripts/test-ha` sets; a missing setting fails the test, saying so.
    fn from_env() -> Self {
        let dir = std::env::var_os("IDEMFLOW_PG_BINDIR").map(PathBuf::from).unwrap_or_else(|| {
            panic!(
                "IDEMFLOW_PG_BINDIR is not set: the failover tests need PostgreSQL's server \
                 binaries (initdb, pg_ctl, pg_basebackup, pg_waldump); run them with scripts/test-ha"
            )
        });
        for tool in [
            "initdb",
            "pg_ctl",
            "pg_basebackup",
            "pg_waldump",
            "postgres",
        ] {
            assert!(
                dir.join(tool).is_file(),
                "IDEMFLOW_PG_BINDIR={}: no {tool} there",
                dir.display()
            );
        }
        let root = Command::new("id")
            .arg("-u")
            .output()
            .map(|output| String::from_utf8_lossy(&output.stdout).trim() == "0")
            .unwrap_or(false);
        let owner = match std::env::var("IDEMFLOW_PG_OWNER") {
            Ok(owner) if !owner.is_empty() => Some(owner),
            _ if root => panic!(
                "IDEMFLOW_PG_OWNER is not set: as root the failover tests run PostgreSQL as that \
                 system user (PostgreSQL refuses root); run them with scripts/test-ha"
            ),
            _ => None,
        };
        Self { dir, owner }
    }

    /// `tool` with `arguments`, as the owner, from `cwd` (the owner may not enter ours).
    fn command(&self, cwd: &Path, tool: &str, arguments: &[&str]) -> Command {
        let program = self.dir.join(tool);
        let mut command = match &self.owner {
            Some(owner) => {
                let mut command = Command::new("runuser");
                command.args(["-u", owner, "--"]).arg(program);
                command
            }
            None => Command::new(program),
        };
        command.args(arguments).current_dir(cwd);
        command
    }

    /// Runs `tool` to its end; a failure panics with what it said.
    async fn run(&self, cwd: &Path, tool: &str, arguments: &[&str]) -> Output {
        let output = self.try_run(cwd, tool, arguments).await;
        assert!(
            output.status.success(),
            "{tool} {arguments:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }

    /// Runs `tool` to its end, whatever its exit status.
    async fn try_run(&self, cwd: &Path, tool: &str, arguments: &[&str]) -> Output {
        let mut command = self.command(cwd, tool, arguments);
        let what = format!("{tool} {arguments:?}");
        tokio::task::spawn_blocking(move || command.output())
            .await
            .unwrap()
            .unwrap_or_else(|error| panic!("cannot run {what}: {error}"))
    }
}

/// A port nothing listens on now (the kernel's pick).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One cluster: its data directory and port. Dropped, it is stopped at once (immediate), so a
/// failing test leaves no server behind.
#[derive(Debug)]
struct Cluster {
    name: &'static str,
    binaries: Arc<Binaries>,
    home: PathBuf,
    data: PathBuf,
    port: u16,
}

impl Cluster {
    fn address(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    fn connect_options(&self) -> PgConnectOptions {
        PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port)
            .username("postgres")
            .database("postgres")
    }

    /// A small pool straight to this cluster, past every proxy: the test's own eyes.
    async fn observer(&self) -> PgPool {
        PgPoolOptions::new()
            .max_connections(2)
            .connect_with(self.connect_options())
            .await
            .unwrap()
    }

    fn log(&self) -> PathBuf {
        self.home.join(format!("{}.log", self.name))
    }

    /// Starts the server with `settings` on the command line (not in its files: a standby copies
    /// the primary's files, and must not inherit `synchronous_standby_names`).
    async fn start(&self, settings: &[&str]) {
        let mut options = format!(
            "-c listen_addresses=127.0.0.1 -p {} -c unix_socket_directories={} \
             -c max_connections=100 -c fsync=off",
            self.port,
            self.home.display()
        );
        for setting in settings {
            options.push_str(" -c ");
            options.push_str(setting);
        }
        let (data, log) = (self.data.display().to_string(), self.log());
        let log = log.display().to_string();
        let arguments = [
            "start", "-D", &data, "-l", &log, "-w", "-t", "60", "-o", &options,
        ];
        let output = self
            .binaries
            .try_run(&self.home, "pg_ctl", &arguments)
            .await;
        assert!(
            output.status.success(),
            "{} did not start: {}\n{}",
            self.name,
            String::from_utf8_lossy(&output.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// The crash: SIGQUIT to the postmaster, every backend gone at once, nothing flushed or
    /// shut down cleanly (what a killed host looks like to the clients and to the standby).
    async fn stop_immediately(&self) {
        let data = self.data.display().to_string();
        self.binaries
            .run(
                &self.home,
                "pg_ctl",
                &["stop", "-D", &data, "-m", "immediate", "-w"],
            )
            .await;
    }

    /// Ends recovery; returns once the cluster accepts writes.
    async fn promote(&self) {
        let data = self.data.display().to_string();
        self.binaries
            .run(
                &self.home,
                "pg_ctl",
                &["promote", "-D", &data, "-w", "-t", "60"],
            )
            .await;
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.log()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!("--- last lines of the {} log:", self.name);
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
        let data = self.data.display().to_string();
        let _ = self
            .binaries
            .command(
                &self.home,
                "pg_ctl",
                &["stop", "-D", &data, "-m", "immediate", "-w"],
            )
            .output();
    }
}

/// The clusters' directory under /tmp (the owner must reach it; sockets need a short path),
/// removed when dropped, after the clusters it holds are stopped.
#[derive(Debug)]
struct Home(PathBuf);

impl Home {
    fn new(binaries: &Binaries) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let path = PathBuf::from(format!(
            "/tmp/idemflow-failover-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir(&path).unwrap();
        if let Some(owner) = &binaries.owner {
            let status = Command::new("chown")
                .arg(format!("{owner}:"))
                .arg(&path)
                .status()
                .unwrap();
            assert!(status.success(), "chown {owner} {}", path.display());
        }
        Self(path)
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The primary, its standby and the link between them. Field order is drop order: both
/// clusters are stopped before their directory goes.
#[derive(Debug)]
struct Pair {
    primary: Cluster,
    standby: Cluster,
    /// The network from the standby to the primary.
    link: FaultProxy,
    _home: Home,
}

/// Replication as the test wants it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replication {
    /// `synchronous_standby_names` names the standby: a commit returns once the standby has
    /// flushed it (`synchronous_commit = on`).
    Synchronous,
    /// No synchronous standby: a commit returns once it is on the primary's disk.
    Asynchronous,
}

/// After promoting a standby that may have missed commits: every sequence moved past any value the
/// old primary may have handed out (it logs 32 values ahead; a million covers far more than any
/// window of lost commits). The same statement is in docs/operations.md, "Failover".
const ADVANCE_SEQUENCES: &str = "DO $$
DECLARE s record;
BEGIN
  FOR s IN SELECT schemaname, sequencename, coalesce(last_value, start_value) AS at
           FROM pg_sequences LOOP
    PERFORM setval(format('%I.%I', s.schemaname, s.sequencename), s.at + 1000000);
  END LOOP;
END $$";

/// The standby's name, as it connects (`application_name`) and as the primary waits for it.
const STANDBY_NAME: &str = "standby1";

/// initdb, start, pg_basebackup through nothing, then the standby streaming through `link`.
async fn start_pair(replication: Replication) -> Pair {
    let binaries = Arc::new(Binaries::from_env());
    let home = Home::new(&binaries);
    let cluster = |name: &'static str| Cluster {
        name,
        binaries: binaries.clone(),
        home: home.0.clone(),
        data: home.0.join(name),
        port: free_port(),
    };
    let (primary, standby) = (cluster("primary"), cluster("standby"));

    let data = primary.data.display().to_string();
    binaries
        .run(
            &home.0,
            "initdb",
            &[
                "-D",
                &data,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        )
        .await;
    let synchronous = format!("synchronous_standby_names={STANDBY_NAME}");
    let settings: Vec<&str> = match replication {
        Replication::Synchronous => vec![&synchronous, "synchronous_commit=on"],
        Replication::Asynchronous => vec![],
    };
    primary.start(&settings).await;

    let (standby_data, port) = (standby.data.display().to_string(), primary.port.to_string());
    binaries
        .run(
            &home.0,
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                &standby_data,
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
                "-R",
            ],
        )
        .await;
    // The standby streams through the link, under the name the primary waits for. Appended:
    // the last setting in the file wins over what `-R` wrote.
    let link = FaultProxy::start(primary.address()).await;
    let conninfo = format!(
        "\nprimary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={STANDBY_NAME}'\n",
        link.port()
    );
    let auto = standby.data.join("postgresql.auto.conf");
    let mut text = std::fs::read_to_string(&auto).unwrap();
    text.push_str(&conninfo);
    std::fs::write(&auto, text).unwrap();
    standby.start(&[]).await;

    // Streaming, and (synchronous) counted as the synchronous standby.
    let observer = primary.observer().await;
    let expected = match replication {
        Replication::Synchronous => "sync",
        Replication::Asynchronous => "async",
    };
    let started = Instant::now();
    loop {
        let state: Option<(String, String)> = sqlx::query_as(
            "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(STANDBY_NAME)
        .fetch_optional(&observer)
        .await
        .unwrap();
        if let Some((state, sync_state)) = &state
            && state == "streaming"
            && sync_state == expected
        {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the standby never streamed as {expected}: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    observer.close().await;
    Pair {
        primary,
        standby,
        link,
        _home: home,
    }
}

/// What the standby had received (and flushed) when asked: where its WAL ends.
async fn received(standby: &PgPool) -> String {
    // Read until it stops moving: the last bytes from a dying primary may still be landing.
    let mut last = String::new();
    loop {
        let now: String = sqlx::query_scalar("SELECT pg_last_wal_receive_lsn()::text")
            .fetch_one(standby)
            .await
            .unwrap();
        if now == last {
            return now;
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the dead primary's WAL holds past `from`: transactions it committed that the standby never
/// received.
#[derive(Debug, Default)]
struct Unstreamed {
    commits: usize,
    /// The first and last of those commits' times, as the primary wrote them.
    first: Option<String>,
    last: Option<String>,
}

/// Reads the dead primary's WAL from `from` with `pg_waldump`.
async fn unstreamed(primary: &Cluster, from: &str) -> Unstreamed {
    let wal = primary.data.join("pg_wal").display().to_string();
    // It ends with an error at the end of the WAL ("invalid record length"): expected.
    let output = primary
        .binaries
        .try_run(&primary.home, "pg_waldump", &["-p", &wal, "-s", from])
        .await;
    let mut found = Unstreamed::default();
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some((_, description)) = line.split_once("desc: COMMIT ") else {
            continue;
        };
        // "2026-12-01 14:30:00.123456 UTC; ..." : the commit's time.
        let time: String = description.split(';').next().unwrap_or("").to_owned();
        found.commits += 1;
        found.first.get_or_insert(time.clone());
        found.last = Some(time);
    }
    found
}

// ---------------------------------------------------------------------------------- service ---

/// The checkout's last phase, as the resumer runs it: the example's, noting which keys the
/// resumer finished.
struct NotedFinish(Arc<Mutex<HashSet<String>>>);

#[idemflow::async_trait]
impl LocalPhase<PgStore> for NotedFinish {
    const NAME: &'static str = "finish";
    type Input = workflow::ChargeOutcome;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut PgConnection,
        outcome: workflow::ChargeOutcome,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let response =
            LocalPhase::<idemflow::PgStore>::run(&workflow::Finish, connection, outcome, context)
                .await?;
        self.0
            .lock()
            .unwrap()
            .insert(context.key.as_str().to_owned());
        Ok(response)
    }
}

fn provider_client(provider: &MockProvider) -> ProviderClient {
    ProviderClient::builder(provider.url())
        .timeout(Duration::from_secs(2))
        .build()
}

/// An answer a client got, and when.
#[derive(Debug, Clone)]
struct Answer {
    response: StoredResponse,
    at: Instant,
}

/// What the clients went through.
#[derive(Debug, Default)]
struct Tally {
    answers: Mutex<BTreeMap<String, Vec<Answer>>>,
    /// Attempts that ended in an error or an interrupted phase: told to come back.
    failed: AtomicUsize,
    /// Attempts answered 409: the key's owner (gone with the primary) still held its lease.
    in_progress: AtomicUsize,
    /// Set once the primary is gone.
    crash: Mutex<Option<Instant>>,
    /// The first answer a client got after the crash.
    first_after_crash: Mutex<Option<Instant>>,
    /// Failed attempts after the crash and before that answer.
    failed_in_window: AtomicUsize,
}

impl Tally {
    fn after_crash(&self, at: Instant) -> bool {
        self.crash.lock().unwrap().is_some_and(|crash| at >= crash)
    }
}

/// The `sent`-th key of client `number`.
fn key_of(number: usize, sent: usize) -> String {
    format!("failover-{number:02}-{sent:04}")
}

/// A key's request: its amount follows from its name, so a retry sends the same body.
fn body_of(key: &str) -> Vec<u8> {
    let sent: u64 = key[key.rfind('-').unwrap() + 1..].parse().unwrap();
    let amount = 100 + sent;
    format!(r#"{{"amount": {amount}, "currency": "usd", "source": "tok_visa"}}"#).into_bytes()
}

fn tenant() -> TenantId {
    TenantId::new(crate::support::example::CHECKOUT_TENANT).unwrap()
}

/// One client: new keys one after another until `stop`, each sent until answered.
async fn client(
    runner: Runner<PgStore>,
    checkout: Arc<Workflow<PgStore>>,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
    number: usize,
) {
    let mut sent = 0;
    while !stop.load(Ordering::SeqCst) {
        let key = key_of(number, sent);
        sent += 1;
        let body = body_of(&key);
        let response = answer(&runner, &checkout, &tally, &key, &body).await;
        let at = Instant::now();
        if tally.after_crash(at) {
            tally.first_after_crash.lock().unwrap().get_or_insert(at);
        }
        tally
            .answers
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .push(Answer { response, at });
    }
}

/// Sends `key` until a final answer comes, as a client does: after an error or a 503 in a
/// moment, after a 409 when its `Retry-After` says (at most a second).
async fn answer(
    runner: &Runner<PgStore>,
    checkout: &Workflow<PgStore>,
    tally: &Tally,
    key: &str,
    body: &[u8],
) -> StoredResponse {
    let started = Instant::now();
    let parsed = idemflow::Key::parse(key).unwrap();
    loop {
        assert!(
            started.elapsed() < PATIENCE,
            "{key}: no answer in {PATIENCE:?}"
        );
        let request = crate::support::request(body);
        let wait = match runner.run(checkout, &tenant(), &parsed, request).await {
            Ok(Outcome::Executed(response) | Outcome::Replayed(response)) => return response,
            Ok(Outcome::InProgress { retry_after }) => {
                tally.in_progress.fetch_add(1, Ordering::Relaxed);
                retry_after.min(Duration::from_secs(1))
            }
            Ok(Outcome::Interrupted { .. }) | Err(_) => {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                if tally.after_crash(Instant::now())
                    && tally.first_after_crash.lock().unwrap().is_none()
                {
                    tally.failed_in_window.fetch_add(1, Ordering::Relaxed);
                }
                Duration::from_millis(100)
            }
            Ok(other) => panic!("{key}: unexpected {other:?}"),
        };
        tokio::time::sleep(wait).await;
    }
}

/// What one failover did, for the report and the checks.
#[derive(Debug)]
struct Failover {
    /// Keys sent, each answered.
    keys: usize,
    /// Keys started on the standby when it was promoted: in flight at the crash.
    in_flight: Vec<String>,
    /// Of those, the keys the resumer finished (the others, their clients' retries).
    finished_by_resumer: usize,
    /// Every key the standby held when it was promoted.
    promoted_with: HashSet<String>,
    /// The last order id the promoted standby's sequence had logged: every id above it that a
    /// client was given, it would have handed out again.
    orders_from: i64,
    /// When the primary was gone (`pg_ctl stop -m immediate` returned).
    crash: Instant,
    /// How long that took.
    stop_took: Duration,
    unstreamed: Unstreamed,
    /// The largest lag seen before the crash (bytes not yet replayed on the standby).
    max_lag_bytes: i64,
    /// The largest `replay_lag` seen before the crash.
    max_lag: Duration,
    /// From the crash: the standby promoted, the address moved, the first answer a client got.
    promoted: Duration,
    moved: Duration,
    first_served: Duration,
    /// Client attempts that failed between the crash and that first answer; in all; 409s.
    failed_in_window: usize,
    failed: usize,
    in_progress: usize,
    /// Every answer each key's client got.
    answers: BTreeMap<String, Vec<Answer>>,
    /// The new primary, seen directly.
    observer: PgPool,
    provider: MockProvider,
    runner: Runner<PgStore>,
    checkout: Arc<Workflow<PgStore>>,
    // Kept to the end: dropping them stops the clusters.
    _pair: Pair,
}

/// Load, crash, promote, move the address, load again; then waits until every key is done.
async fn fail_over(replication: Replication) -> Failover {
    crate::support::logs();
    let pair = start_pair(replication).await;
    let provider = MockProvider::start().await;
    let address = FaultProxy::start(pair.primary.address()).await;
    let settings = idemflow::PoolSettings::default().with_max_connections(20);
    let pool = settings
        .pool_options()
        .connect_with(settings.connect_options(pair.primary.connect_options().port(address.port())))
        .await
        .unwrap();
    idemflow::migrate(&pool).await.unwrap();
    sqlx::query(orders::PG_ORDERS_TABLE)
        .execute(&pool)
        .await
        .unwrap();
    let standby = pair.standby.observer().await;
    let primary = pair.primary.observer().await;

    let runner = Runner::new(pool.clone());
    let checkout = Arc::new(workflow::checkout(provider_client(&provider), LEASE));
    let by_resumer = Arc::new(Mutex::new(HashSet::new()));
    let mut registry = Registry::new();
    registry
        .register(
            Workflow::builder::<workflow::CheckoutRequest>("checkout.v1")
                .local(workflow::CreateOrder)
                .foreign(workflow::Charge {
                    provider: provider_client(&provider),
                })
                .local(NotedFinish(by_resumer.clone()))
                .lease(LEASE)
                .build()
                .unwrap(),
        )
        .unwrap();
    let resumer = Resumer::with_config(
        runner.clone(),
        registry,
        ResumerConfig::default()
            .with_idle_max(Duration::from_millis(200))
            .with_error_backoff_max(Duration::from_millis(500))
            .with_shutdown_grace(Duration::from_secs(5))
            .with_retention(None),
    );
    let waker = resumer.clone();
    let (stop_resumer, resumer_stopped) = tokio::sync::oneshot::channel::<()>();
    let resuming = tokio::spawn(resumer.run(async {
        let _ = resumer_stopped.await;
    }));

    // Every third key of every client is charged slowly: many keys are in their call at the
    // crash.
    for number in 0..CLIENTS {
        for sent in (1..400).step_by(3) {
            let key = key_of(number, sent);
            provider.push_fault_for(charge_key(&key), Fault::Delay(SLOW_CHARGE));
        }
    }

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for number in 0..CLIENTS {
        clients.spawn(client(
            runner.clone(),
            checkout.clone(),
            tally.clone(),
            stop.clone(),
            number,
        ));
    }

    // The lag as a monitor sees it, while the load runs.
    let (mut max_lag_bytes, mut max_lag) = (0_i64, Duration::ZERO);
    let warm = Instant::now();
    while warm.elapsed() < WARM_UP {
        let lag: Option<(Option<i64>, Option<f64>)> = sqlx::query_as(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint, \
                    extract(epoch FROM replay_lag)::float8 \
             FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(STANDBY_NAME)
        .fetch_optional(&primary)
        .await
        .unwrap();
        if let Some((bytes, seconds)) = lag {
            max_lag_bytes = max_lag_bytes.max(bytes.unwrap_or(0));
            max_lag = max_lag.max(Duration::from_secs_f64(seconds.unwrap_or(0.0)));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    primary.close().await;
    if replication == Replication::Asynchronous {
        // The standby hears nothing more (the link swallows every byte): everything the primary
        // commits from now on is the window a crash loses.
        pair.link.blackhole(true);
        tokio::time::sleep(QUIET_LINK).await;
    }

    let stopping = Instant::now();
    pair.primary.stop_immediately().await;
    // From here on the primary is gone: an answer can only come from the new one. (An answer
    // while `pg_ctl stop` ran may still be the old primary's.)
    let crash = Instant::now();
    *tally.crash.lock().unwrap() = Some(crash);
    let stop_took = crash.duration_since(stopping);
    let received = received(&standby).await;
    pair.standby.promote().await;
    let promoted = crash.elapsed();
    // The keys the standby holds started: their owners' work died with the primary.
    let in_flight: Vec<String> =
        sqlx::query_scalar("SELECT key FROM idempotency_keys WHERE state = 'started' ORDER BY key")
            .fetch_all(&standby)
            .await
            .unwrap();
    let promoted_with: HashSet<String> = sqlx::query_scalar("SELECT key FROM idempotency_keys")
        .fetch_all(&standby)
        .await
        .unwrap()
        .into_iter()
        .collect();
    // The order ids the promoted standby's sequence would hand out next.
    let orders_from: i64 = sqlx::query_scalar(
        "SELECT coalesce(last_value, start_value) FROM pg_sequences \
                            WHERE sequencename = 'checkout_orders_id_seq'",
    )
    .fetch_one(&standby)
    .await
    .unwrap();
    if replication == Replication::Asynchronous {
        // The old primary may have handed out values the standby never heard of: fencing tokens
        // and order ids. Past all of them before anything is served (docs/operations.md).
        sqlx::query(ADVANCE_SEQUENCES)
            .execute(&standby)
            .await
            .unwrap();
    }
    address.retarget(pair.standby.address());
    let moved = crash.elapsed();
    // Their owners are gone: rather than wait out their leases, end them (as an operator would
    // with `idemflow end-lease`) and wake the resumer.
    sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' \
         WHERE state = 'started' AND key = ANY($1)",
    )
    .bind(&in_flight)
    .execute(&standby)
    .await
    .unwrap();
    waker.wake();
    let unstreamed = unstreamed(&pair.primary, &received).await;

    tokio::time::sleep(AFTER).await;
    stop.store(true, Ordering::SeqCst);
    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }
    let first_served = tally
        .first_after_crash
        .lock()
        .unwrap()
        .expect("a request was served after the crash")
        .duration_since(crash);

    // Whatever is still started (a key whose failed attempt was recorded on the new primary)
    // is finished by the resumer too.
    let draining = Instant::now();
    loop {
        let started: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE state = 'started'")
                .fetch_one(&standby)
                .await
                .unwrap();
        if started == 0 {
            break;
        }
        assert!(
            draining.elapsed() < Duration::from_secs(30),
            "{started} keys left started"
        );
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = least(locked_until, now()) \
             WHERE state = 'started'",
        )
        .execute(&standby)
        .await
        .unwrap();
        waker.wake();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop_resumer.send(());
    resuming.await.unwrap();

    let finished_by_resumer = {
        let noted = by_resumer.lock().unwrap();
        in_flight.iter().filter(|key| noted.contains(*key)).count()
    };
    let answers = std::mem::take(&mut *tally.answers.lock().unwrap());
    Failover {
        keys: answers.len(),
        in_flight,
        promoted_with,
        orders_from,
        crash,
        stop_took,
        finished_by_resumer,
        unstreamed,
        max_lag_bytes,
        max_lag,
        promoted,
        moved,
        first_served,
        failed_in_window: tally.failed_in_window.load(Ordering::Relaxed),
        failed: tally.failed.load(Ordering::Relaxed),
        in_progress: tally.in_progress.load(Ordering::Relaxed),
        answers,
        observer: standby,
        provider,
        runner,
        checkout,
        _pair: pair,
    }
}

impl Failover {
    fn report(&self, name: &str) {
        let answered_before = self
            .answers
            .values()
            .filter(|answers| answers[0].at < self.crash)
            .count();
        println!(
            "failover ({name}): {} keys, {answered_before} answered before the crash; \
             the primary stopped in {:?}, the standby promoted {:?} after, address moved at {:?}, first request served at {:?}; \
             {} attempts failed between the crash and that answer ({} in all), {} answered 409; \
             {} keys in flight at the crash, {} of them finished by the resumer (the others by \
             their clients' retries, once their leases ended); \
             {} commits on the dead primary the standby never received ({:?} .. {:?}); \
             largest replay lag before the crash {} bytes, {:?}",
            self.keys,
            self.stop_took,
            self.promoted,
            self.moved,
            self.first_served,
            self.failed_in_window,
            self.failed,
            self.in_progress,
            self.in_flight.len(),
            self.finished_by_resumer,
            self.unstreamed.commits,
            self.unstreamed.first,
            self.unstreamed.last,
            self.max_lag_bytes,
            self.max_lag,
        );
    }

    /// The state of every key on the new primary. (Their responses are read as a client reads
    /// them: by sending the key again.)
    async fn states(&self) -> HashMap<String, String> {
        let rows: Vec<(String, String)> = sqlx::query_as("SELECT key, state FROM idempotency_keys")
            .fetch_all(&self.observer)
            .await
            .unwrap();
        rows.into_iter().collect()
    }

    /// One order per key, paid; one charge per derived key at the provider; every key done.
    async fn each_key_ran_once(&self) {
        crate::support::example::each_key_ran_once(
            &self.observer,
            &self.provider,
            self.answers.keys(),
            self.keys,
        )
        .await;
    }

    /// Sends `key` once more, as its client would.
    async fn again(&self, key: &str) -> Outcome {
        let body = body_of(key);
        let parsed = idemflow::Key::parse(key).unwrap();
        self.runner
            .run(
                &self.checkout,
                &tenant(),
                &parsed,
                crate::support::request(&body),
            )
            .await
            .unwrap()
    }
}

/// A field of a checkout's JSON answer.
fn field(response: &StoredResponse, name: &str) -> serde_json::Value {
    let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
    body[name].clone()
}

/// Synchronous replication: a commit returns only once the standby has it, so every answer a
/// client got survives the crash of the primary, byte for byte; nothing is run or charged twice;
/// what was in flight is finished by the resumer on the new primary; every client gets its
/// answer by retrying.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by scripts/test-ha (needs initdb and pg_basebackup)"]
async fn failover_with_synchronous_replication_loses_no_answer_and_runs_nothing_twice() {
    let failover = fail_over(Replication::Synchronous).await;
    failover.report("synchronous");
    assert!(
        !failover.in_flight.is_empty(),
        "no key was in flight at the crash: the test proved nothing about them"
    );

    let states = failover.states().await;
    for (key, answers) in &failover.answers {
        let state = states
            .get(key)
            .unwrap_or_else(|| panic!("{key}: answered, and gone from the new primary"));
        assert_eq!(state, "done", "{key}");
        let replayed = match failover.again(key).await {
            Outcome::Replayed(replayed) => replayed,
            other => panic!("{key}: a retry got {other:?}, not the replay"),
        };
        for answer in answers {
            assert_eq!(
                replayed, answer.response,
                "{key}: the replay differs, byte for byte, from an answer a client got"
            );
        }
    }
    failover.each_key_ran_once().await;
    // Keys in flight are finished on the new primary: by the resumer; or by their own request,
    // still running at the crash, whose next transaction found its pooled connection dead and
    // began again on a new one, through the moved address (a BEGIN on a dead connection goes
    // again: live_connection.rs); or by their client's retry, after the request recorded its
    // failure there. Which one wins is the race's; that each is finished, once, is not.
    for key in &failover.in_flight {
        assert_eq!(
            states.get(key).map(String::as_str),
            Some("done"),
            "{key}: in flight at the crash, and not finished on the new primary"
        );
    }
    for key in &failover.in_flight {
        assert!(
            failover.answers.contains_key(key),
            "{key}: no client got an answer"
        );
    }
}

/// Asynchronous replication: a commit returns once it is on the primary, and what the standby
/// had not received when the primary died is lost. The link to the standby goes quiet for a
/// while before the crash, so that window is not empty; the dead primary's WAL says how many
/// commits it held. What was lost is a key's whole history from its claim (local effects and key
/// rows commit together): a client that had its answer gets a new execution on retry, with a
/// new order, and the provider, called again with the same derived key, answers with the first
/// charge. Nothing is charged twice and no key has two orders; a key whose claim survived is
/// finished and answered as before, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by scripts/test-ha (needs initdb and pg_basebackup)"]
async fn failover_with_asynchronous_replication_loses_the_unstreamed_window_and_charges_once() {
    let failover = fail_over(Replication::Asynchronous).await;
    failover.report("asynchronous");
    assert!(
        failover.unstreamed.commits > 0,
        "the quiet link left nothing unstreamed: the test proved nothing about the window"
    );

    let states = failover.states().await;
    let mut lost = Vec::new();
    for (key, answers) in &failover.answers {
        let first = &answers[0].response;
        if answers[0].at < failover.crash && !failover.promoted_with.contains(key) {
            // Answered by the old primary, and its claim never reached the standby.
            assert!(!states.contains_key(key), "{key}: lost, yet stored again");
            lost.push(key.clone());
            continue;
        }
        let state = states
            .get(key)
            .unwrap_or_else(|| panic!("{key}: its claim reached the standby, and it is gone"));
        assert_eq!(state, "done", "{key}");
        match failover.again(key).await {
            Outcome::Replayed(replayed) => assert_eq!(
                &replayed, first,
                "{key}: its claim survived, and its answer changed"
            ),
            other => panic!("{key}: a retry got {other:?}, not the replay"),
        }
    }
    assert!(
        !lost.is_empty(),
        "no answered key was lost in the window: the test proved nothing about it"
    );

    // The lost keys, retried by their clients: each runs again on the new primary. The provider
    // is called again with the same derived key and answers with the first charge.
    let mut reissuable = 0;
    for key in &lost {
        let first = &failover.answers[key][0].response;
        let order_id = field(first, "order_id").as_i64().unwrap();
        if order_id > failover.orders_from {
            reissuable += 1;
        }
        let again = match failover.again(key).await {
            Outcome::Executed(again) => again,
            other => panic!("{key}: lost, and a retry got {other:?}"),
        };
        assert_eq!(
            field(&again, "charge_id"),
            field(first, "charge_id"),
            "{key}: charged again"
        );
        assert_eq!(field(&again, "amount"), field(first, "amount"), "{key}");
        assert_eq!(
            failover.provider.calls_for(&charge_key(key)),
            2,
            "{key}: the first call and the re-run's"
        );
        // The order id the client was given is nobody else's: the sequences were advanced on
        // promotion.
        let taken: Option<String> =
            sqlx::query_scalar("SELECT request_key FROM checkout_orders WHERE id = $1")
                .bind(order_id)
                .fetch_optional(&failover.observer)
                .await
                .unwrap();
        assert_eq!(
            taken, None,
            "{key}: its order id {order_id} was handed out again"
        );
        match failover.again(key).await {
            Outcome::Replayed(replayed) => assert_eq!(replayed, again, "{key}"),
            other => panic!("{key}: a second retry got {other:?}"),
        }
    }
    println!(
        "failover (asynchronous): {} keys answered before the crash were lost with their \
         orders and ran again on retry, charged once each (the provider called twice with \
         their derived keys); {reissuable} of the order ids their clients had been given lay \
         past the promoted standby's sequence, and would have been handed out again had the \
         sequences not been advanced",
        lost.len()
    );
    failover.each_key_ran_once().await;
}
