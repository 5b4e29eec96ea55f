//! `idemflow-bench`: runs the benchmark against DATABASE_URL, prints the tables and writes the
//! JSON result file. See docs/benchmarks.md.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use idemflow_bench::Config;

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
    /// Run only these, comma-separated: workload numbers or names (1 checkout, 2 local-only,
    /// 3 replay, 4 storm, 5 drain, 6 retention, 7 http, 8 provider-storm, 9 mass-crash,
    /// 10 large-responses, 11 fleet, 12 partitioned-expiry, 13 sqlite, 14 mariadb, 15 redis), wire, pgbench [default: $IDEMFLOW_BENCH_ONLY, else all]
    #[arg(long, value_delimiter = ',', value_name = "WORKLOADS")]
    only: Option<Vec<String>>,
    /// The server (a scratch database is created on it); default $DATABASE_URL
    #[arg(long)]
    database_url: Option<String>,
    /// The MariaDB or MySQL server of workload 14 (a scratch database is created on it);
    /// default $MARIADB_URL, else mysql://root@127.0.0.1:3306/test
    #[arg(long)]
    mariadb_url: Option<String>,
    /// The Redis server of workload 15 (keys under a prefix of its own, deleted after);
    /// default $REDIS_URL, else redis://127.0.0.1:6379
    #[arg(long)]
    redis_url: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    // A child process of workload 13's several-processes measurement: count, print, exit.
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
    let Some(database_url) = args
        .database_url
        .or_else(|| std::env::var("DATABASE_URL").ok())
    else {
        eprintln!(
            "idemflow-bench: set DATABASE_URL or pass --database-url (scripts/bench finds one)"
        );
        return ExitCode::from(2);
    };
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
    if let Some(names) = only
        && let Err(message) = config.select(&names)
    {
        eprintln!("idemflow-bench: {message}");
        return ExitCode::from(2);
    }
    let report = match idemflow_bench::run(&config).await {
        Ok(report) => report,
        Err(error) => {
            eprintln!("idemflow-bench: {error}");
            return ExitCode::FAILURE;
        }
    };
    println!("{}", report.table());
    let written = args
        .output
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| {
            let json = serde_json::to_vec_pretty(&report).map_err(std::io::Error::other)?;
            std::fs::write(&args.output, json)
        });
    match written {
        Ok(()) => {
            println!("results written to {}", args.output.display());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("idemflow-bench: writing {}: {error}", args.output.display());
            ExitCode::FAILURE
        }
    }
}
