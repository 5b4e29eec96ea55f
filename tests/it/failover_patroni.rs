//! A failover as Patroni users see it. Two PostgreSQL nodes managed by Patroni (one etcd, on
//! loopback, `synchronous_mode: true`), HAProxy in front sending connections to whichever node
//! Patroni's REST API calls the primary; all started by `scripts/lib/patroni.sh`. The checkout
//! example runs as its own processes (`serve` and `worker`) against HAProxy, charging the testkit's
//! mock provider (in this process, so its ledger counts what was really charged). Clients send
//! checkouts over HTTP and retry each key until answered. Then, under that load, either the
//! leader's host dies (its Patroni and its postmaster SIGKILLed: Patroni elects the synchronous
//! standby once the leader key expires) or an operator runs `patronictl switchover --force`.
//!
//! Nothing a client was told is lost, nothing runs or is charged twice, every key is finished,
//! and the service answers again within a bound; the test measures how long it did not.
//! docs/operations.md, "Running behind Patroni", has the settings and the figures.
//!
//! tests/it/failover.rs measures the same guarantees with the promotion and the address move
//! done by hand, at instants it picks; here Patroni and HAProxy pick them, and the service is the
//! example's own processes.
//!
//! Run by `scripts/test-ha`, which installs Patroni, etcd and HAProxy when missing and names the
//! server binaries (`IDEMFLOW_PG_BINDIR`) and, as root, the user the nodes run as
//! (`IDEMFLOW_PG_OWNER`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemflow_testkit::provider::{Fault, MockProvider};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::support::example::{
    Answer, Process, charge_key, example_binary, post_checkout, start_serve, start_worker,
};

/// Concurrent clients, each sending its keys one after another.
const CLIENTS: usize = 12;
/// Load before the leader goes.
const WARM_UP: Duration = Duration::from_secs(3);
/// Load after the first request served by the new leader, before the clients stop sending new
/// keys.
const AFTER: Duration = Duration::from_secs(3);
/// The checkout's lease (`--lease-seconds`): no key changes hands during the test unless its
/// lease is rewound, as the test does for the keys the old leader's requests held.
const LEASE_SECONDS: u64 = 10;
/// No key waits longer than this for its answer.
const PATIENCE: Duration = Duration::from_secs(60);
/// The longest the service may answer nothing: Patroni's ttl (10 s here) plus its loop, the
/// promotion and HAProxy's checks stay well inside it.
const OUTAGE_BOUND: Duration = Duration::from_secs(60);
/// Every third key's charge is held this long at the provider: more keys in flight at the event.
const SLOW_CHARGE: Duration = Duration::from_millis(300);

// ---------------------------------------------------------------------------------- cluster ---

/// The cluster `scripts/lib/patroni.sh up` started: its directory and ports. Dropped, every
/// process it started is killed and the directory removed.
struct Cluster {
    dir: PathBuf,
    ports: HashMap<String, u16>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/lib/patroni.sh")
}

/// The script with `arguments`, to its end; a failure panics with what it said.
fn run_script(arguments: &[&str]) -> String {
    assert!(
        std::env::var_os("IDEMFLOW_PG_BINDIR").is_some(),
        "IDEMFLOW_PG_BINDIR is not set: the Patroni failover tests need PostgreSQL's server \
         binaries; run them with scripts/test-ha"
    );
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| String::from_utf8_lossy(&output.stdout).trim() == "0");
    assert!(
        !root || std::env::var_os("IDEMFLOW_PG_OWNER").is_some_and(|owner| !owner.is_empty()),
        "IDEMFLOW_PG_OWNER is not set: as root the nodes run as that system user (PostgreSQL \
         refuses root); run the tests with scripts/test-ha"
    );
    let output = Command::new("bash")
        .arg(script())
        .args(arguments)
        .output()
        .unwrap_or_else(|error| panic!("cannot run patroni.sh {arguments:?}: {error}"));
    assert!(
        output.status.success(),
        "patroni.sh {arguments:?} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

impl Cluster {
    async fn up() -> Self {
        let printed = tokio::task::spawn_blocking(|| run_script(&["up"]))
            .await
            .unwrap();
        let mut lines = printed.lines();
        let dir = PathBuf::from(lines.next().expect("the cluster's directory"));
        let ports = lines
            .filter_map(|line| line.split_once('='))
            .map(|(name, port)| (name.to_owned(), port.parse().unwrap()))
            .collect();
        Self { dir, ports }
    }

    fn port(&self, name: &str) -> u16 {
        self.ports[name]
    }

    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres",
            self.port("HAPROXY_PORT")
        )
    }

    /// A small pool through HAProxy: the test's own eyes, on whichever node leads.
    async fn observer(&self) -> PgPool {
        let options = PgConnectOptions::new()
            .host("127.0.0.1")
            .port(self.port("HAPROXY_PORT"))
            .username("postgres")
            .database("postgres");
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options)
            .await
            .unwrap()
    }

    /// The node Patroni's REST API calls the primary (`GET /primary` answers 200), if any.
    async fn leader(&self, http: &reqwest::Client) -> Option<&'static str> {
        for (node, api) in [("node1", "NODE1_API_PORT"), ("node2", "NODE2_API_PORT")] {
            let url = format!("http://127.0.0.1:{}/primary", self.port(api));
            if let Ok(response) = http.get(url).send().await
                && response.status() == 200
            {
                return Some(node);
            }
        }
        None
    }

    async fn script(&self, arguments: &[&str]) {
        let mut all = vec![arguments[0].to_owned(), self.dir.display().to_string()];
        all.extend(arguments[1..].iter().map(|argument| (*argument).to_owned()));
        tokio::task::spawn_blocking(move || {
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            run_script(&all)
        })
        .await
        .unwrap();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in ["node1", "node2", "haproxy", "etcd"] {
                let text = std::fs::read_to_string(self.dir.join(format!("{log}.log")))
                    .unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(20).collect();
                eprintln!("--- last lines of {log}.log:");
                for line in tail.iter().rev() {
                    eprintln!("{line}");
                }
            }
        }
        let dir = self.dir.display().to_string();
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", &dir])
            .output();
    }
}

/// Runs `query` until it succeeds (the pool's connections die with a leader), for at most
/// `PATIENCE`.
async fn until_answered<T, F, Fut>(what: &str, mut query: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, sqlx::Error>>,
{
    let started = Instant::now();
    loop {
        match query().await {
            Ok(value) => return value,
            Err(error) => assert!(
                started.elapsed() < PATIENCE,
                "{what}: no answer in {PATIENCE:?}: {error}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------- clients ---

/// What a client got for one key: the answer, when it came, when the key was first sent and
/// when the attempt that got it was.
#[derive(Debug, Clone)]
struct Answered {
    answer: Answer,
    at: Instant,
    first_sent: Instant,
    sent: Instant,
}

/// What the clients went through.
#[derive(Debug, Default)]
struct Tally {
    answers: Mutex<BTreeMap<String, Answered>>,
    /// Attempts that got no answer (the service's connection cut) or a 5xx: told to come back.
    failed: AtomicUsize,
    /// Attempts answered 409: the key's lease was held by a request the old leader ran.
    in_progress: AtomicUsize,
}

/// The `sent`-th key of client `number`.
fn key_of(number: usize, sent: usize) -> String {
    format!("patroni-{number:02}-{sent:04}")
}

/// One client: new keys one after another until `stop`, each sent until answered.
async fn client(base: String, tally: Arc<Tally>, stop: Arc<AtomicBool>, number: usize) {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    let mut sent = 0;
    while !stop.load(Ordering::SeqCst) {
        let key = key_of(number, sent);
        sent += 1;
        let answered = answer(&http, &base, &tally, &key).await;
        tally.answers.lock().unwrap().insert(key, answered);
    }
}

/// Sends `key` until a 201 comes, as a client does: after a 409 or a 503 (or no answer at all)
/// in a moment.
async fn answer(http: &reqwest::Client, base: &str, tally: &Tally, key: &str) -> Answered {
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < PATIENCE,
            "{key}: no answer in {PATIENCE:?}"
        );
        let sent = Instant::now();
        let wait = match post_checkout(http, base, key).await {
            Some(answer) if answer.status == 201 => {
                return Answered {
                    answer,
                    at: Instant::now(),
                    first_sent: started,
                    sent,
                };
            }
            Some(answer) if answer.status == 409 => {
                tally.in_progress.fetch_add(1, Ordering::Relaxed);
                Duration::from_millis(250)
            }
            Some(answer) if answer.status >= 500 => {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                Duration::from_millis(100)
            }
            None => {
                tally.failed.fetch_add(1, Ordering::Relaxed);
                Duration::from_millis(100)
            }
            Some(other) => panic!("{key}: unexpected {other:?}"),
        };
        tokio::time::sleep(wait).await;
    }
}

// ---------------------------------------------------------------------------------- service ---

/// What happens to the leader under load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    /// Its host dies: Patroni and the postmaster SIGKILLed at once.
    Crash,
    /// `patronictl switchover --force` to the synchronous standby.
    Switchover,
}

/// The example's processes against HAProxy, and the provider they charge.
struct Service {
    base: String,
    provider: MockProvider,
    _serve: Process,
    _worker: Process,
}

/// `serve` (which migrates), then `worker`, both through HAProxy.
async fn start_service(cluster: &Cluster) -> Service {
    let provider = MockProvider::start().await;
    // Every third key of every client is charged slowly: many keys are in their call at the
    // event.
    for number in 0..CLIENTS {
        for sent in (1..600).step_by(3) {
            provider.push_fault_for(charge_key(&key_of(number, sent)), Fault::Delay(SLOW_CHARGE));
        }
    }
    let binary = tokio::task::spawn_blocking(example_binary).await.unwrap();
    let url = cluster.url();
    let lease = LEASE_SECONDS.to_string();
    let common = [
        "--database-url",
        url.as_str(),
        "--psp-url",
        provider.url(),
        "--lease-seconds",
        lease.as_str(),
    ];
    let (serve, base) = start_serve(&binary, "serve", &common).await;
    let worker = start_worker(&binary, "worker", &common).await;
    Service {
        base,
        provider,
        _serve: serve,
        _worker: worker,
    }
}

/// What one event did, for the report and the checks.
struct Switch {
    event: Event,
    /// When the leader had been killed, or the switchover command began.
    at: Instant,
    /// The leader before and after.
    from: &'static str,
    to: &'static str,
    /// From the event: Patroni's REST API names the new leader.
    elected: Duration,
    /// From the event: the first 201 to an attempt sent after it.
    first_served: Duration,
    /// The longest stretch, around the event, in which no client got a 201.
    longest_silence: Duration,
    /// Keys started on the new leader when it was first reached: in flight at the event.
    in_flight: Vec<String>,
    /// The last answer to a key sent before the event and answered after it, from the event.
    last_in_flight_answered: Duration,
    answers: BTreeMap<String, Answered>,
    failed: usize,
    in_progress: usize,
    observer: PgPool,
    service: Service,
    // Kept to the end: dropping it stops the nodes.
    _cluster: Cluster,
}

/// Load, the event, load again; then every key's client has its answer.
async fn switch(event: Event) -> Switch {
    crate::support::logs();
    let cluster = Cluster::up().await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let from = cluster.leader(&http).await.expect("a leader");
    let observer = cluster.observer().await;
    idemflow::migrate(&observer).await.unwrap();
    let service = start_service(&cluster).await;

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = tokio::task::JoinSet::new();
    for number in 0..CLIENTS {
        clients.spawn(client(
            service.base.clone(),
            tally.clone(),
            stop.clone(),
            number,
        ));
    }
    tokio::time::sleep(WARM_UP).await;

    // The crash's instant is when the kill has been sent (a SIGKILLed postmaster answers
    // nothing more; before it, the script's own start-up may still let requests through); the
    // switchover's is when the operator asked for it.
    let at = match event {
        Event::Crash => {
            cluster.script(&["crash", from]).await;
            Instant::now()
        }
        Event::Switchover => {
            let at = Instant::now();
            cluster.script(&["switchover"]).await;
            at
        }
    };
    let to = loop {
        match cluster.leader(&http).await {
            Some(node) if node != from => break node,
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
        assert!(at.elapsed() < PATIENCE, "no new leader in {PATIENCE:?}");
    };
    let elected = at.elapsed();
    let in_flight = end_old_leases(&observer).await;

    // Load until the new leader has served for a while.
    let served_again = loop {
        if let Some(first) = first_sent_after(&tally.answers.lock().unwrap(), at) {
            break first;
        }
        assert!(at.elapsed() < PATIENCE, "nothing served in {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(AFTER).await;
    stop.store(true, Ordering::SeqCst);
    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }
    let answers = std::mem::take(&mut *tally.answers.lock().unwrap());
    let last_in_flight_answered = answers
        .values()
        .filter(|answered| answered.first_sent < at && answered.at >= at)
        .map(|answered| answered.at.duration_since(at))
        .max()
        .unwrap_or_default();
    Switch {
        event,
        at,
        from,
        to,
        elected,
        first_served: served_again.duration_since(at),
        longest_silence: longest_silence(&answers, at),
        in_flight,
        last_in_flight_answered,
        answers,
        failed: tally.failed.load(Ordering::Relaxed),
        in_progress: tally.in_progress.load(Ordering::Relaxed),
        observer,
        service,
        _cluster: cluster,
    }
}

/// The keys started on the new leader, their leases ended. Their requests ran on the old leader
/// (the ones still running began their transactions again on the new one, through HAProxy, and
/// are fenced): rather than wait out the leases, end them, as an operator would with
/// `idemflow end-lease`, so that a client's retry or the worker finishes them at once. Only
/// leases taken before the new leader was reached: one taken on it runs `LEASE_SECONDS` from
/// now, past the bound.
async fn end_old_leases(observer: &PgPool) -> Vec<String> {
    let in_flight: Vec<String> = until_answered("the keys in flight", || {
        sqlx::query_scalar(
            "SELECT key FROM idempotency_keys WHERE state = 'started' \
             AND locked_until < now() + make_interval(secs => $1) ORDER BY key",
        )
        .bind(LEASE_SECONDS as f64 - 1.0)
        .fetch_all(observer)
    })
    .await;
    until_answered("ending their leases", || {
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' \
             WHERE state = 'started' AND key = ANY($1)",
        )
        .bind(&in_flight)
        .execute(observer)
    })
    .await;
    in_flight
}

/// The first 201 to an attempt sent after `at`.
fn first_sent_after(answers: &BTreeMap<String, Answered>, at: Instant) -> Option<Instant> {
    answers
        .values()
        .filter(|answered| answered.sent >= at)
        .map(|answered| answered.at)
        .min()
}

/// The longest gap between two consecutive 201s (any client's), among those from a second
/// before `at` on.
fn longest_silence(answers: &BTreeMap<String, Answered>, at: Instant) -> Duration {
    let from = at - Duration::from_secs(1);
    let mut times: Vec<Instant> = answers
        .values()
        .map(|answered| answered.at)
        .filter(|time| *time >= from)
        .collect();
    times.sort();
    times
        .windows(2)
        .map(|pair| pair[1].duration_since(pair[0]))
        .max()
        .unwrap_or_default()
}

impl Switch {
    fn report(&self) {
        let before = self
            .answers
            .values()
            .filter(|answered| answered.at < self.at)
            .count();
        println!(
            "patroni failover ({:?}, {} -> {}): {} keys, {before} answered before the event; \
             new leader named by Patroni at {:?}, first request sent after the event served at \
             {:?}, longest stretch with no request served {:?}; {} keys in flight (their leases \
             ended), the last key sent before the event answered at {:?}; {} attempts got no \
             answer or a 5xx, {} a 409",
            self.event,
            self.from,
            self.to,
            self.answers.len(),
            self.elected,
            self.first_served,
            self.longest_silence,
            self.in_flight.len(),
            self.last_in_flight_answered,
            self.failed,
            self.in_progress,
        );
    }

    /// Every answer a client got is the one a retry gets now, byte for byte, replayed.
    async fn nothing_answered_is_lost(&self) {
        let http = reqwest::Client::new();
        for (key, answered) in &self.answers {
            let again = post_checkout(&http, &self.service.base, key)
                .await
                .unwrap_or_else(|| panic!("{key}: no answer to the retry"));
            assert_eq!(again.status, 201, "{key}: {again:?}");
            assert!(again.replayed, "{key}: ran again, not replayed");
            assert_eq!(
                again.body, answered.answer.body,
                "{key}: the replay differs from the answer its client got"
            );
        }
    }

    /// Every key done, one order each, paid; one charge per derived key at the provider.
    async fn each_key_ran_once(&self) {
        crate::support::example::each_key_ran_once(
            &self.observer,
            &self.service.provider,
            self.answers.keys(),
            self.answers.len(),
        )
        .await;
    }

    async fn check(&self) {
        assert!(
            self.answers.values().any(|answered| answered.at < self.at),
            "nothing was answered before the event: the test proved nothing about losing it"
        );
        assert!(
            self.longest_silence < OUTAGE_BOUND && self.first_served < OUTAGE_BOUND,
            "the service answered nothing for {:?} (first served {:?} after the event)",
            self.longest_silence,
            self.first_served
        );
        assert!(
            self.last_in_flight_answered < OUTAGE_BOUND,
            "a key in flight at the event was answered only {:?} after it",
            self.last_in_flight_answered
        );
        self.nothing_answered_is_lost().await;
        self.each_key_ran_once().await;
    }
}

/// The leader's host dies under load: Patroni promotes the synchronous standby once the leader
/// key expires, HAProxy follows its REST API; no answer is lost, nothing runs twice, every key is
/// finished, and the service answers again within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by scripts/test-ha (needs Patroni, etcd, HAProxy and PostgreSQL's binaries)"]
async fn failover_under_patroni_after_the_leader_dies_loses_no_answer_and_runs_nothing_twice() {
    let switch = switch(Event::Crash).await;
    switch.report();
    switch.check().await;
}

/// `patronictl switchover --force` under load: the same guarantees, and a shorter outage (the
/// old leader stops cleanly and hands over at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "run by scripts/test-ha (needs Patroni, etcd, HAProxy and PostgreSQL's binaries)"]
async fn failover_under_patroni_by_switchover_loses_no_answer_and_runs_nothing_twice() {
    let switch = switch(Event::Switchover).await;
    switch.report();
    switch.check().await;
}
