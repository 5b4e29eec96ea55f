//! `idemflow-bench`: runs the benchmark against DATABASE_URL, prints the tables and writes the
//! JSON result file. See docs/benchmarks.md.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idemflow_bench::{Config, Report};

/// Benchmarks idemflow on PostgreSQL against a raw sqlx baseline and pgbench, in a scratch
/// database created and dropped by this run.
#[derive(Debug, Parser)]
#[command(name = "idemflow-bench")]
struct Args {
    /// Tiny counts, clients 1 and 8, no pgbench, 20,000 retention rows: a smoke test
    #[arg(long)]
    quick: bool,
    /// Where the JSON result goes
    #[arg(long, default_value = "target/idemflow-bench/results.json")]
    output: PathBuf,
    /// Concurrent clients, comma-separated (default 1,8,32,64; quick: 1,8)
    #[arg(long, value_delimiter = ',')]
    clients: Option<Vec<usize>>,
    /// Seconds per timed run (default 5; quick: 0.3)
    #[arg(long)]
    duration_secs: Option<f64>,
    /// Finished keys deleted by the retention workload (default 1,000,000; quick: 20,000)
    #[arg(long)]
    retention_rows: Option<u64>,
    /// Skip pgbench even where it is installed
    #[arg(long)]
    no_pgbench: bool,
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "WORKLOADS",
        help = only_help(),
        long_help = only_long_help()
    )]
    only: Option<Vec<String>>,
    /// The server (a scratch database is created on it); default $DATABASE_URL
    #[arg(long)]
    database_url: Option<String>,
    /// The MariaDB or MySQL server of the mariadb workload (a scratch database is created on
    /// it); default $MARIADB_URL, else mysql://root@127.0.0.1:3306/test
    #[arg(long)]
    mariadb_url: Option<String>,
    /// The Redis server of the redis workload (keys under a prefix of its own, deleted after);
    /// default $REDIS_URL, else redis://127.0.0.1:6379
    #[arg(long)]
    redis_url: Option<String>,
    /// The Redis Cluster of the redis workload's cluster rows (new keys and replays against the
    /// single node): its nodes' URLs, comma-separated; default $REDIS_CLUSTER_URLS, else the
    /// cluster rows are not run (scripts/lib/redis-cluster.sh starts a cluster)
    #[arg(long)]
    redis_cluster_urls: Option<String>,
}

/// `--only` in short: the workloads' names, from the registry.
fn only_help() -> String {
    let names: Vec<&str> = idemflow_bench::catalogue()
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    format!(
        "Run only these workloads, comma-separated: {} [default: $IDEMFLOW_BENCH_ONLY, else all]",
        names.join(", ")
    )
}

/// `--only` in full: each workload's name and what it measures, in the order they run.
fn only_long_help() -> String {
    let mut help = "Run only these workloads, comma-separated, by name (the numbers that begin \
                    their identifiers in the report, such as 8 in 8-provider-storm, are accepted \
                    too) [default: $IDEMFLOW_BENCH_ONLY, else all]. In the order they run:\n"
        .to_owned();
    for (name, measures) in idemflow_bench::catalogue() {
        help.push_str(&format!("\n  {name:<19} {measures}"));
    }
    help
}

#[tokio::main]
async fn main() -> ExitCode {
    // A child process of the sqlite workload's several-processes measurement: count, print, exit.
    if let Ok(spec) = std::env::var(idemflow_bench::SQLITE_CHILD) {
        return match idemflow_bench::sqlite_child(&spec).await {
            Ok(done) => {
                println!("{done}");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("idemflow-bench (sqlite child): {error}");
                ExitCode::FAILURE
            }
        };
    }
    let args = Args::parse();
    let output = args.output.clone();
    let config = match config(args) {
        Ok(config) => config,
        Err(message) => {
            eprintln!("idemflow-bench: {message}");
            return ExitCode::from(2);
        }
    };
    let report = match idemflow_bench::run(&config).await {
        Ok(report) => report,
        Err(error) => {
            eprintln!("idemflow-bench: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", report.table());
    match write(&report, &output) {
        Ok(()) => {
            println!("results written to {}", output.display());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("idemflow-bench: writing {}: {error}", output.display());
            ExitCode::FAILURE
        }
    }
}

/// The run the arguments ask for; else why they ask for none.
fn config(args: Args) -> Result<Config, String> {
    let database_url = args
        .database_url
        .or_else(|| std::env::var("DATABASE_URL").ok())
        .ok_or("set DATABASE_URL or pass --database-url (scripts/bench finds one)")?;
    let mut config = if args.quick {
        Config::quick(database_url)
    } else {
        Config::full(database_url)
    };
    if let Some(clients) = args.clients {
        config.clients = clients;
    }
    if let Some(url) = args.mariadb_url {
        config.mariadb_url = url;
    }
    if let Some(url) = args.redis_url {
        config.redis_url = url;
    }
    if let Some(urls) = args
        .redis_cluster_urls
        .filter(|urls| !urls.trim().is_empty())
    {
        config.redis_cluster_urls = Some(urls);
    }
    if let Some(seconds) = args.duration_secs {
        config.duration = Duration::from_secs_f64(seconds);
    }
    if let Some(rows) = args.retention_rows {
        config.retention_rows = rows;
    }
    if args.no_pgbench {
        config.pgbench = false;
    }
    let only = args.only.or_else(|| {
        std::env::var("IDEMFLOW_BENCH_ONLY")
            .ok()
            .filter(|names| !names.trim().is_empty())
            .map(|names| names.split(',').map(str::to_owned).collect())
    });
    if let Some(names) = only {
        config.select(&names)?;
    }
    Ok(config)
}

/// Writes the JSON result, creating its directory.
fn write(report: &Report, output: &std::path::Path) -> std::io::Result<()> {
    if let Some(directory) = output.parent() {
        std::fs::create_dir_all(directory)?;
    }
    let json = serde_json::to_vec_pretty(report).map_err(std::io::Error::other)?;
    std::fs::write(output, json)
}
