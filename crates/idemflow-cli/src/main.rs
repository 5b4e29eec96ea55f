//! `idemflow`, the operator CLI: parses the command line, connects, runs one command from the
//! library and prints its answer. See `docs/cli.md`.

use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idemflow_cli::{CliError, Format, InspectOptions, Output, parse_duration};
use sqlx::{PgConnection, PgPool};

/// Operate idemflow's idempotency keys: inspect, list, end leases and expire them.
#[derive(Debug, Parser)]
#[command(name = "idemflow", version)]
struct Cli {
    /// Print one JSON document instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// PostgreSQL URL (postgres://…), SQLite file (sqlite://path), MySQL/MariaDB URL
    /// (mysql://…) or Redis URL (redis://…, keys under IDEMFLOW_REDIS_PREFIX, default
    /// idemflow); all but PostgreSQL: every command but partitions. Defaults to the
    /// DATABASE_URL environment variable.
    #[arg(long, global = true, value_name = "URL")]
    database_url: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply pending schema migrations.
    Migrate,
    /// Show everything about one key: state, lease, attempts, last error, response, expiry.
    Inspect {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        key: String,
        /// Also print the stored request (JSON), as stored: redacted, sealed values not opened.
        #[arg(long)]
        show_request: bool,
        /// Also print the stored response (status, headers, body), as stored.
        #[arg(long)]
        show_response: bool,
        /// The retention period finished keys are kept for, to tell when this one expires:
        /// 24h, 7d. Default: the runner's, 24 hours.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        retention: Option<Duration>,
    },
    /// Print the canonical form (RFC 8785) and fingerprint of a JSON body read on stdin.
    Fingerprint {
        /// The request method, exactly as the server passes it to the runner.
        #[arg(long)]
        method: String,
        /// The request path, exactly as the server passes it to the runner.
        #[arg(long)]
        path: String,
    },
    /// List started keys that look stuck.
    List {
        /// Started keys past their lease or with many attempts (the only listing, for now).
        #[arg(long, required = true)]
        stuck: bool,
        /// Also list started keys with at least this many attempts, even within their lease.
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i32).range(1..))]
        min_attempts: i32,
        /// List at most this many keys.
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
    },
    /// End a started key's lease now (fenced; the fence advances), so it is retried at once.
    /// (`release`, its old name, still works.)
    #[command(alias = "release")]
    EndLease {
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        key: String,
        /// End a live lease too: its owner is known to be gone. Its writes are refused from now
        /// on, but a phase it is in goes on, and a plain handler may run beside the next owner's.
        #[arg(long)]
        force: bool,
    },
    /// Delete finished keys older than a retention window (started keys are never deleted).
    Expire {
        /// Delete keys finished longer ago than this: 90s, 30m, 24h, 7d.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        older_than: Duration,
        /// Rows deleted per transaction.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        batch_size: i64,
    },
    /// Keys by workflow and state, the oldest started key, and the resumer lag.
    Stats,
    /// Serve the operator console (docs/console.md) until interrupted. Beyond loopback it asks
    /// for a basic-auth password, read from IDEMFLOW_CONSOLE_PASSWORD (never a flag).
    Console {
        /// The address to listen on.
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8089")]
        bind: std::net::SocketAddr,
        /// Refuse every action (end-lease, expire), on the server, over read-only connections.
        #[arg(long)]
        read_only: bool,
    },
    /// The partitioned layout of the keys table: expiry by dropping whole partitions.
    Partitions {
        #[command(subcommand)]
        command: PartitionsCommand,
    },
}

#[derive(Debug, Subcommand)]
enum PartitionsCommand {
    /// Convert the keys table to the partitioned layout, as the table's owner. It holds the table
    /// exclusively while it copies the keys: run it at a quiet time.
    Adopt {
        /// The range of creation times each partition holds: 30m, 6h, 1d.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "1d")]
        width: Duration,
        /// Partitions kept ready ahead of the current one.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
        ahead: u32,
    },
    /// Create the partitions due ahead, and drop those whose every key finished longer ago than
    /// the window (as the table's owner). Exits 1 when a partition is kept for started keys.
    Maintain {
        /// The retention window: keys finished longer ago than this are expired: 24h, 7d.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        keep_for: Duration,
    },
    /// List the partitions, oldest first.
    List,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = if cli.json {
        Format::Json
    } else {
        Format::Human
    };
    let output = run(cli, format).await;
    // Write errors (a closed pipe) are ignored: there is no one left to tell.
    let _ = std::io::stdout().write_all(output.stdout.as_bytes());
    let _ = std::io::stderr().write_all(output.stderr.as_bytes());
    ExitCode::from(output.code)
}

async fn run(cli: Cli, format: Format) -> Output {
    if let Command::Fingerprint { method, path } = &cli.command {
        return fingerprint(format, method, path);
    }
    let url = match idemflow_cli::database_url(cli.database_url, std::env::var("DATABASE_URL").ok())
    {
        Ok(url) => url,
        Err(error) => return error.output(format),
    };
    if let Command::Console { bind, read_only } = &cli.command {
        return idemflow_cli::console::console(&url, *bind, *read_only, format).await;
    }
    if idemflow_cli::sqlite::is_sqlite(&url) {
        return run_on_sqlite(cli.command, &url, format).await;
    }
    if idemflow_cli::mysql::is_mysql(&url) {
        return run_on_mysql(cli.command, &url, format).await;
    }
    if idemflow_cli::redis::is_redis(&url) {
        return run_on_redis(cli.command, &url, format).await;
    }
    let pool = match idemflow_cli::connect(&url).await {
        Ok(pool) => pool,
        Err(error) => return error.output(format),
    };
    let output = match cli.command {
        Command::Migrate => idemflow_cli::migrate(&pool, format).await,
        Command::Expire {
            older_than,
            batch_size,
        } => idemflow_cli::expire(&pool, format, older_than, batch_size).await,
        Command::Inspect {
            tenant,
            key,
            show_request,
            show_response,
            retention,
        } => {
            let options = InspectOptions::default()
                .with_show_request(show_request)
                .with_show_response(show_response)
                .with_retention(retention);
            with_connection(&pool, format, async |connection| {
                idemflow_cli::inspect_with(connection, format, &tenant, &key, &options).await
            })
            .await
        }
        Command::List {
            min_attempts,
            limit,
            ..
        } => {
            with_connection(&pool, format, async |connection| {
                idemflow_cli::list_stuck(connection, format, min_attempts, limit).await
            })
            .await
        }
        Command::EndLease { tenant, key, force } => {
            with_connection(&pool, format, async |connection| {
                idemflow_cli::end_lease(connection, format, &tenant, &key, force).await
            })
            .await
        }
        Command::Stats => {
            with_connection(&pool, format, async |connection| {
                idemflow_cli::stats(connection, format).await
            })
            .await
        }
        Command::Partitions { command } => match command {
            PartitionsCommand::Adopt { width, ahead } => {
                idemflow_cli::partitions_adopt(&pool, format, width, ahead).await
            }
            PartitionsCommand::Maintain { keep_for } => {
                idemflow_cli::partitions_maintain(&pool, format, keep_for).await
            }
            PartitionsCommand::List => {
                with_connection(&pool, format, async |connection| {
                    idemflow_cli::partitions_list(connection, format).await
                })
                .await
            }
        },
        Command::Fingerprint { .. } | Command::Console { .. } => {
            unreachable!("answered before connecting")
        }
    };
    pool.close().await;
    output
}

/// The commands of an engine other than PostgreSQL, each a function of the same name in its
/// module of the library (`sqlite`, `mysql`, `redis`); `partitions` answers that the engine has
/// no partitioned layout.
macro_rules! run_on {
    ($engine:ident, $command:expr, $url:expr, $format:expr) => {{
        use idemflow_cli::$engine;
        let (url, format) = ($url, $format);
        match $command {
            Command::Migrate => $engine::migrate(url, format).await,
            Command::Expire {
                older_than,
                batch_size,
            } => $engine::expire(url, format, older_than, batch_size).await,
            Command::Inspect {
                tenant,
                key,
                show_request,
                show_response,
                retention,
            } => {
                let options = InspectOptions::default()
                    .with_show_request(show_request)
                    .with_show_response(show_response)
                    .with_retention(retention);
                $engine::inspect(url, format, &tenant, &key, &options).await
            }
            Command::List {
                min_attempts,
                limit,
                ..
            } => $engine::list_stuck(url, format, min_attempts, limit).await,
            Command::EndLease { tenant, key, force } => {
                $engine::end_lease(url, format, &tenant, &key, force).await
            }
            Command::Stats => $engine::stats(url, format).await,
            Command::Partitions { .. } => $engine::not_yet("partitions", format),
            Command::Fingerprint { .. } | Command::Console { .. } => {
                unreachable!("answered before connecting")
            }
        }
    }};
}

/// The commands SQLite has; the others say so.
async fn run_on_sqlite(command: Command, url: &str, format: Format) -> Output {
    run_on!(sqlite, command, url, format)
}

/// The commands MySQL/MariaDB has; the others say so.
async fn run_on_mysql(command: Command, url: &str, format: Format) -> Output {
    run_on!(mysql, command, url, format)
}

/// The commands Redis has; the others say so.
async fn run_on_redis(command: Command, url: &str, format: Format) -> Output {
    run_on!(redis, command, url, format)
}

async fn with_connection(
    pool: &PgPool,
    format: Format,
    command: impl AsyncFnOnce(&mut PgConnection) -> Output,
) -> Output {
    match pool.acquire().await {
        Ok(mut connection) => command(&mut connection).await,
        Err(error) => CliError::from(error).output(format),
    }
}

fn fingerprint(format: Format, method: &str, path: &str) -> Output {
    let mut stdin = std::io::stdin();
    if stdin.is_terminal() {
        eprintln!("reading the JSON body from stdin (end it with Ctrl-D)");
    }
    let mut body = Vec::new();
    if let Err(error) = stdin.read_to_end(&mut body) {
        return CliError::Usage(format!("cannot read the body from stdin: {error}")).output(format);
    }
    idemflow_cli::fingerprint(format, method, path, &body)
}
