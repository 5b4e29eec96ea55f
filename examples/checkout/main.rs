//! The checkout example as a service: `POST /v1/checkouts` runs a three-phase workflow
//! (create_order, local → charge, foreign → finish, local) under the request's `Idempotency-Key`,
//! against SQLite, PostgreSQL or MySQL/MariaDB and a payment provider (the testkit's mock, in this process by
//! default).
//!
//! `scripts/checkout` (or `cargo run -p example-checkout`) starts the service with its provider and
//! a resumer, runs the demo against it, prints a curl line to try, and serves until Ctrl-C. With no
//! database named it runs on a SQLite file under `target/` (nothing to install);
//! `--database-url postgres://…` (or `DATABASE_URL`) runs it on PostgreSQL, `mysql://…` on MySQL
//! or MariaDB, `sqlite://path` on another file. The other commands run one piece each (processes
//! sharing one SQLite file, or one database on a server):
//!
//! ```text
//! checkout [all] [--bind ADDR] [--demo-only] ...   service + resumer + metrics, then the demo
//! checkout serve [--bind ADDR] [--allow-crash-header] ...   the HTTP service only
//! checkout worker [--metrics-bind ADDR] ...        the resumer, /metrics and /healthz
//! checkout demo [--url URL]                        the demo against a running service
//! checkout openapi                                 the OpenAPI document it serves at /openapi.json
//! ```

mod database;
mod demo;
mod openapi;
mod orders;
mod service;
mod worker;
mod workflow;

use std::future::Future;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand};
use idemflow::{MySqlStore, PgStore, PoolOf, Runner, RunnerConfig, SqliteStore};
use idemflow_testkit::provider::MockProvider;
use idemflow_testkit::provider_client::ProviderClient;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::database::Database as Opened;
use crate::orders::Shop;
use crate::service::Crashes;

/// The example's error type.
pub type Failure = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, Parser)]
#[command(
    name = "checkout",
    about = "The idemflow checkout example: an Idempotency-Key checkout service on SQLite or PostgreSQL",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Without a command: `all`.
    #[command(flatten)]
    all: AllArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The service, its mock provider, a resumer and /metrics + /healthz; runs the demo against
    /// itself, then serves until Ctrl-C (the default)
    All(AllArgs),
    /// The HTTP service only
    Serve(ServeArgs),
    /// The resumer, with /metrics (Prometheus) and /healthz
    Worker(WorkerArgs),
    /// The demo, against a running service
    Demo(DemoArgs),
    /// Print the service's OpenAPI document (the one it serves at /openapi.json)
    Openapi,
}

#[derive(Debug, Args)]
struct Database {
    /// postgres://…, mysql://… or sqlite://path [default: $DATABASE_URL, else the SQLite file
    /// target/idemflow-checkout/checkout.db]
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
    /// Change no schema at start-up: the engine's migrations and the example's table were
    /// created by the schema's owner (`idemflow migrate`), and this process runs as a role
    /// that may only read and write (docs/operations.md, Least privilege)
    #[arg(long)]
    no_migrate: bool,
    /// Connections this process may hold: size it so that every process's pool fits under the
    /// server's max_connections (docs/scaling.md)
    #[arg(long, value_name = "N", default_value_t = 24,
          value_parser = clap::value_parser!(u32).range(2..=1000))]
    pool_size: u32,
}

#[derive(Debug, Args)]
struct Provider {
    /// The payment provider (e.g. a standalone idemflow-mock-psp); without it, the testkit's mock
    /// provider is started in this process
    #[arg(long, value_name = "URL")]
    psp_url: Option<String>,
    /// The checkout workflow's lease: how long a crashed request waits before a retry or the
    /// resumer finishes it. The provider call's timeout is a few seconds shorter
    #[arg(long, value_name = "SECONDS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(2..=3600))]
    lease_seconds: u64,
}

#[derive(Debug, Args)]
struct AllArgs {
    #[command(flatten)]
    database: Database,
    #[command(flatten)]
    provider: Provider,
    /// Where the service listens (port 0: any free port)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    /// Exit after the demo: 0 if every step behaved as expected, 1 otherwise
    #[arg(long)]
    demo_only: bool,
    /// Also honour `X-Crash-At: <crash point>` from clients (the demo crashes its own request
    /// without it). For demonstrations only
    #[arg(long)]
    allow_crash_header: bool,
}

#[derive(Debug, Args)]
struct ServeArgs {
    #[command(flatten)]
    database: Database,
    #[command(flatten)]
    provider: Provider,
    /// Where the service listens (port 0: any free port)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    bind: SocketAddr,
    /// Honour `X-Crash-At: <crash point>` (e.g. after_call:charge): the request's run stops
    /// there as a crash would. For demonstrations only
    #[arg(long)]
    allow_crash_header: bool,
}

#[derive(Debug, Args)]
struct WorkerArgs {
    #[command(flatten)]
    database: Database,
    #[command(flatten)]
    provider: Provider,
    /// Where /metrics and /healthz are served
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    metrics_bind: SocketAddr,
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// The running service
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The tenant the demo's requests are made for (sent as `Authorization: Bearer <tenant>`)
    #[arg(long, default_value = "acme")]
    tenant: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(
                    "warn,idemflow_runner::resumer=info,idemflow_client=error",
                )
            }),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        None => all(cli.all).await,
        Some(Command::All(args)) => all(args).await,
        Some(Command::Serve(args)) => serve(args).await,
        Some(Command::Worker(args)) => run_worker(args).await,
        Some(Command::Demo(args)) => run_demo(args).await,
        Some(Command::Openapi) => {
            println!("{}", openapi::json_text());
            Ok(ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("checkout: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The default: everything in one process, the demo, then serving until Ctrl-C.
async fn all(args: AllArgs) -> Result<ExitCode, Failure> {
    match connect(&args.database).await? {
        Opened::Postgres(pool) => all_on::<PgStore>(pool, args).await,
        Opened::Sqlite(pool) => all_on::<SqliteStore>(pool, args).await,
        Opened::MySql(pool) => all_on::<MySqlStore>(pool, args).await,
    }
}

async fn all_on<E: Shop>(pool: PoolOf<E>, args: AllArgs) -> Result<ExitCode, Failure> {
    let lease = Duration::from_secs(args.provider.lease_seconds);
    let listener = bind(args.bind, "--bind").await?;
    let (provider, mock) = provider(&args.provider).await?;
    let metrics = worker::install_metrics()?;
    let url = format!("http://{}", listener.local_addr()?);

    let checkout = workflow::checkout::<E>(provider.clone(), lease);
    // The demo arms its crash step in process; clients may ask for one only when allowed.
    let crashes = Crashes::new(&checkout);
    let runner = crashes.runner(Runner::<E>::on(pool.clone(), RunnerConfig::default()));
    let header = args.allow_crash_header.then(|| crashes.clone());
    let app = service::router(pool.clone(), runner, checkout, header)
        .merge(worker::routes::<E>(pool.clone(), metrics));
    let stop = Stop::on_signal();
    let server = tokio::spawn(
        idemflow::http::serve(listener, app, idemflow::http::ServeLimits::default())
            .with_graceful_shutdown(stop.stopped())
            .into_future(),
    );
    println!(
        "checkout: listening on {url} (lease {} s, provider timeout {:?}); /metrics and /healthz there too",
        lease.as_secs(),
        provider.timeout()
    );
    let resumer = worker::resumer(pool, workflow::checkout::<E>(provider.clone(), lease))?;
    let resumer = tokio::spawn(resumer.run(stop.stopped()));
    println!("checkout: resumer running (it finishes keys whose lease ended)\n");

    let demo = demo::run(demo::Target {
        url: url.clone(),
        tenant: "acme".to_owned(),
        provider: mock.as_ref(),
        delay: demo_delay(&provider),
        crashes: Some(crashes),
    });
    let passed = tokio::select! {
        result = demo => match result {
            Ok(passed) => passed,
            Err(error) => {
                println!("== demo FAILED: {error} ==");
                false
            }
        },
        () = stop.stopped() => {
            println!("== demo interrupted ==");
            false
        }
    };

    let code = if args.demo_only || stop.is_stopped() {
        stop.stop();
        if passed {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    } else {
        if !passed {
            println!("(the service keeps running; see the steps above for what went wrong)");
        }
        print_try_it(&url, args.allow_crash_header);
        ExitCode::SUCCESS
    };
    server.await??;
    resumer.await?;
    if let Some(mock) = mock {
        mock.shutdown().await;
    }
    println!("checkout: stopped");
    Ok(code)
}

fn print_try_it(url: &str, crash_header: bool) {
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| since.as_secs())
        .unwrap_or_default();
    println!("\nThe checkout service is running at {url}. Try it:\n");
    println!(
        "  curl -i {url}/v1/checkouts -H 'Authorization: Bearer acme' -H 'Content-Type: application/json' -H 'Idempotency-Key: try-{stamp}' -d '{{\"amount\": 2500, \"currency\": \"usd\", \"source\": \"tok_visa\"}}'\n"
    );
    println!(
        "Send it twice: the second answer is the stored one (Idempotent-Replayed: true). Change the amount: 422."
    );
    if crash_header {
        println!(
            "With a new key and -H 'X-Crash-At: after_call:charge': 503, then finished after the lease."
        );
    }
    println!(
        "Read an order back: curl -s {url}/v1/checkouts/<order_id> -H 'Authorization: Bearer acme'"
    );
    println!("Metrics: {url}/metrics, health: {url}/healthz. Ctrl-C or SIGTERM stops it.");
}

/// `serve`: the HTTP service only.
async fn serve(args: ServeArgs) -> Result<ExitCode, Failure> {
    match connect(&args.database).await? {
        Opened::Postgres(pool) => serve_on::<PgStore>(pool, args).await,
        Opened::Sqlite(pool) => serve_on::<SqliteStore>(pool, args).await,
        Opened::MySql(pool) => serve_on::<MySqlStore>(pool, args).await,
    }
}

async fn serve_on<E: Shop>(pool: PoolOf<E>, args: ServeArgs) -> Result<ExitCode, Failure> {
    let lease = Duration::from_secs(args.provider.lease_seconds);
    let listener = bind(args.bind, "--bind").await?;
    let (provider, mock) = provider(&args.provider).await?;
    let url = format!("http://{}", listener.local_addr()?);
    let checkout = workflow::checkout::<E>(provider, lease);
    let runner = Runner::<E>::on(pool.clone(), RunnerConfig::default());
    let (runner, crashes) = if args.allow_crash_header {
        let crashes = Crashes::new(&checkout);
        (crashes.runner(runner), Some(crashes))
    } else {
        (runner, None)
    };
    // IDEMFLOW_CRASH_AT=<crash point>: the process stops there for real (tests kill it).
    let runner = match idemflow_testkit::crash::ProcessCrash::from_env(service::CRASH_ENV) {
        Some(hook) => runner.with_crash_hook(hook),
        None => runner,
    };
    let app = service::router(pool, runner, checkout, crashes);
    println!(
        "serve: listening on {url} (POST /v1/checkouts, GET /v1/checkouts/{{order_id}}, GET /openapi.json){}; Ctrl-C stops it",
        if args.allow_crash_header {
            ", X-Crash-At honoured"
        } else {
            ""
        }
    );
    idemflow::http::serve(listener, app, idemflow::http::ServeLimits::default())
        .with_graceful_shutdown(idemflow::shutdown_signal())
        .await?;
    if let Some(mock) = mock {
        mock.shutdown().await;
    }
    println!("serve: stopped");
    Ok(ExitCode::SUCCESS)
}

/// `worker`: the resumer, with metrics and health.
async fn run_worker(args: WorkerArgs) -> Result<ExitCode, Failure> {
    match connect(&args.database).await? {
        Opened::Postgres(pool) => worker_on::<PgStore>(pool, args).await,
        Opened::Sqlite(pool) => worker_on::<SqliteStore>(pool, args).await,
        Opened::MySql(pool) => worker_on::<MySqlStore>(pool, args).await,
    }
}

async fn worker_on<E: Shop>(pool: PoolOf<E>, args: WorkerArgs) -> Result<ExitCode, Failure> {
    let lease = Duration::from_secs(args.provider.lease_seconds);
    let (provider, mock) = provider(&args.provider).await?;
    worker::run(
        pool,
        workflow::checkout::<E>(provider, lease),
        args.metrics_bind,
        idemflow::shutdown_signal(),
    )
    .await?;
    if let Some(mock) = mock {
        mock.shutdown().await;
    }
    Ok(ExitCode::SUCCESS)
}

/// `demo`: against a running service, whose provider is out of reach.
async fn run_demo(args: DemoArgs) -> Result<ExitCode, Failure> {
    let passed = demo::run(demo::Target {
        url: args.url,
        tenant: args.tenant,
        provider: None,
        delay: Duration::ZERO,
        crashes: None,
    })
    .await?;
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Opens the database (`--database-url`, else `DATABASE_URL`, else the default SQLite file), runs
/// idemflow's migrations and creates the example's table.
async fn connect(database: &Database) -> Result<Opened, Failure> {
    let url = database.database_url.clone().or_else(|| {
        std::env::var("DATABASE_URL")
            .ok()
            .filter(|url| !url.is_empty())
    });
    Opened::open(url.as_deref(), database.pool_size, !database.no_migrate).await
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
pub fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// The provider client, and the in-process mock provider when no `--psp-url` is given.
async fn provider(args: &Provider) -> Result<(ProviderClient, Option<MockProvider>), Failure> {
    let timeout = provider_timeout(Duration::from_secs(args.lease_seconds));
    match &args.psp_url {
        Some(url) => Ok((
            ProviderClient::builder(url.clone())
                .timeout(timeout)
                .build(),
            None,
        )),
        None => {
            let mock = MockProvider::builder().start().await?;
            println!(
                "checkout: mock payment provider on {} (in this process)",
                mock.url()
            );
            let client = ProviderClient::builder(mock.url()).timeout(timeout).build();
            Ok((client, Some(mock)))
        }
    }
}

/// The provider call's timeout: a few seconds shorter than the lease (the charge phase's own
/// timeout, one second longer, must stay below it).
fn provider_timeout(lease: Duration) -> Duration {
    if lease >= Duration::from_secs(4) {
        lease - Duration::from_secs(3)
    } else {
        lease / 4
    }
}

/// How long the demo's concurrent step holds a charge at the in-process provider.
fn demo_delay(provider: &ProviderClient) -> Duration {
    (provider.timeout() / 2).min(Duration::from_millis(1500))
}

/// Binds `address`, saying clearly when it is taken.
pub async fn bind(address: SocketAddr, flag: &str) -> Result<TcpListener, Failure> {
    TcpListener::bind(address).await.map_err(|error| {
        if error.kind() == std::io::ErrorKind::AddrInUse {
            format!(
                "cannot listen on {address}: the address is already in use (another checkout still running?). \
                 Stop it, or choose another address: {flag} 127.0.0.1:8081, or {flag} 127.0.0.1:0 for any free port"
            )
            .into()
        } else {
            format!("cannot listen on {address}: {error}").into()
        }
    })
}

/// A shutdown shared by the server and the resumer: Ctrl-C, SIGTERM, or [`Stop::stop`].
#[derive(Clone)]
struct Stop(Arc<watch::Sender<bool>>);

impl Stop {
    fn on_signal() -> Self {
        let stop = Self(Arc::new(watch::channel(false).0));
        let on_signal = stop.clone();
        tokio::spawn(async move {
            idemflow::shutdown_signal().await;
            println!("\ncheckout: stopping (finishing requests in flight)");
            on_signal.stop();
        });
        stop
    }

    fn stop(&self) {
        self.0.send_replace(true);
    }

    fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut receiver = self.0.subscribe();
        async move {
            let _ = receiver.wait_for(|stopped| *stopped).await;
        }
    }
}
