//! The command line: its arguments (clap), and [`run`], which opens the database the URL names
//! with the engine of its scheme and answers one command.

use std::ffi::OsString;
use std::io::{IsTerminal, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use idemflow_store::{Operator, OperatorEngine, OperatorOptions};

use crate::{CliError, Format, InspectOptions, Output, exit, parse_duration};

/// Operate idemflow's idempotency keys: inspect, list, end leases and expire them.
#[derive(Debug, Parser)]
#[command(name = "idemflow", version)]
struct Cli {
    /// Print one JSON document instead of text.
    #[arg(long, global = true)]
    json: bool,
    /// PostgreSQL URL (postgres://…), SQLite file (sqlite://path), MySQL/MariaDB URL
    /// (mysql://…) or Redis URL (redis://…, keys under IDEMFLOW_REDIS_PREFIX, default
    /// idemflow), for the engines this build has; all but PostgreSQL: every command but
    /// partitions. Defaults to the DATABASE_URL environment variable.
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

/// Parses `args` (the program's name first), opens the database its URL names with the engine
/// of that URL's scheme among `engines`, and answers the command: what to print, and the exit
/// code. `--help` and `--version` answer on stdout, a bad command line on stderr (exit 2).
pub async fn run(
    args: impl IntoIterator<Item = impl Into<OsString> + Clone>,
    engines: &[&dyn OperatorEngine],
) -> Output {
    run_with(args, engines, crate::command_options()).await
}

/// [`run`], opening the database with `options` (its key prefix, say) rather than those of the
/// environment.
pub async fn run_with(
    args: impl IntoIterator<Item = impl Into<OsString> + Clone>,
    engines: &[&dyn OperatorEngine],
    options: OperatorOptions,
) -> Output {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(error) => {
            let text = error.render().to_string();
            return if error.use_stderr() {
                Output {
                    code: exit::USAGE,
                    stdout: String::new(),
                    stderr: text,
                }
            } else {
                Output {
                    code: exit::OK,
                    stdout: text,
                    stderr: String::new(),
                }
            };
        }
    };
    let format = if cli.json {
        Format::Json
    } else {
        Format::Human
    };
    command(cli, format, engines, options).await
}

/// The program: [`run`] on the process's arguments, its answer printed, its code the exit
/// status. What a binary built with `engines` calls from `main`.
pub async fn main(engines: &[&dyn OperatorEngine]) -> ExitCode {
    let output = run(std::env::args_os(), engines).await;
    // Write errors (a closed pipe) are ignored: there is no one left to tell.
    let _ = std::io::stdout().write_all(output.stdout.as_bytes());
    let _ = std::io::stderr().write_all(output.stderr.as_bytes());
    ExitCode::from(output.code)
}

async fn command(
    cli: Cli,
    format: Format,
    engines: &[&dyn OperatorEngine],
    options: OperatorOptions,
) -> Output {
    if let Command::Fingerprint { method, path } = &cli.command {
        return fingerprint(format, method, path);
    }
    let url = match crate::database_url(cli.database_url, std::env::var("DATABASE_URL").ok()) {
        Ok(url) => url,
        Err(error) => return error.output(format),
    };
    if let Command::Console { bind, read_only } = &cli.command {
        return crate::console::console(&url, engines, options, *bind, *read_only, format).await;
    }
    // Only `migrate` creates a database (where the engine keeps one in a file of its own).
    let options = options.with_create(matches!(cli.command, Command::Migrate));
    let operator = match crate::open(&url, engines, &options).await {
        Ok(operator) => operator,
        Err(error) => return error.output(format),
    };
    let output = on(operator.as_ref(), cli.command, format).await;
    operator.close().await;
    output
}

/// One command on an open database.
async fn on(operator: &dyn Operator, command: Command, format: Format) -> Output {
    match command {
        Command::Migrate => crate::migrate(operator, format).await,
        Command::Expire {
            older_than,
            batch_size,
        } => crate::expire(operator, format, older_than, batch_size).await,
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
            crate::inspect_with(operator, format, &tenant, &key, &options).await
        }
        Command::List {
            min_attempts,
            limit,
            ..
        } => crate::list_stuck(operator, format, min_attempts, limit).await,
        Command::EndLease { tenant, key, force } => {
            crate::end_lease(operator, format, &tenant, &key, force).await
        }
        Command::Stats => crate::stats(operator, format).await,
        Command::Partitions { command } => match command {
            PartitionsCommand::Adopt { width, ahead } => {
                crate::partitions_adopt(operator, format, width, ahead).await
            }
            PartitionsCommand::Maintain { keep_for } => {
                crate::partitions_maintain(operator, format, keep_for).await
            }
            PartitionsCommand::List => crate::partitions_list(operator, format).await,
        },
        Command::Fingerprint { .. } | Command::Console { .. } => {
            unreachable!("answered before connecting")
        }
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
    crate::fingerprint(format, method, path, &body)
}
