//! `idemflow console`: the operator console served alone, on any engine this build has. In
//! read-only mode the console refuses every action itself, and its connections are read-only too
//! where the engine has read-only sessions (PostgreSQL's `default_transaction_read_only`,
//! MariaDB's `SESSION TRANSACTION READ ONLY`, SQLite's read-only open), so even a defect in the
//! console could not write; run it as a role that may only read (scripts/sql/grants.sql,
//! `readonly_role`) for a third wall.
//!
//! It records what the console does as an embedding application would: a tracing subscriber
//! writes the events to stderr (`RUST_LOG`, INFO by default), and a Prometheus recorder counts
//! them, served at `/metrics` beside the pages (behind the same password and `Host` checks).

use std::net::SocketAddr;
use std::sync::Arc;

use idemflow_console::{Console, PASSWORD_ENV, ServeOptions};
use idemflow_store::{OperatorEngine, OperatorOptions};

use crate::{CliError, Format, Output, exit};

/// Connections the console keeps: a handful of operators' page views at once.
const CONNECTIONS: u32 = 4;

/// Serves the console on `bind` until interrupted, over the database `url` names (opened with
/// the engine of its scheme among `engines`); the password, when set, is read from
/// `IDEMFLOW_CONSOLE_PASSWORD`.
pub async fn console(
    url: &str,
    engines: &[&dyn OperatorEngine],
    options: OperatorOptions,
    bind: SocketAddr,
    read_only: bool,
    format: Format,
) -> Output {
    let password = std::env::var(PASSWORD_ENV).ok();
    let options = options
        .with_connections(CONNECTIONS)
        .with_read_only(read_only)
        .with_application_name("idemflow console".to_owned());
    let operator = match crate::open(url, engines, &options).await {
        Ok(operator) => operator,
        Err(error) => return error.output(format),
    };
    observe();
    let console = Console::shared(Arc::from(operator)).read_only(read_only);
    let mut options = ServeOptions::new(bind).password(password);
    match metrics_recorder() {
        Some(handle) => {
            options = options.routes(axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let handle = handle.clone();
                    async move { handle.render() }
                }),
            ));
        }
        None => tracing::warn!(
            "another metrics recorder is installed in this process: the console's counter goes \
             to it, and /metrics is not served"
        ),
    }
    let served = idemflow_console::serve(console, options, |local| {
        let mode = if read_only { " (read-only)" } else { "" };
        eprintln!("idemflow console{mode} on http://{local}/");
    })
    .await;
    match served {
        Ok(()) => Output {
            code: exit::OK,
            stdout: String::new(),
            stderr: String::new(),
        },
        Err(error) => CliError::Usage(error.to_string()).output(format),
    }
}

/// Installs the process's tracing subscriber (stderr, `RUST_LOG`, INFO by default), unless the
/// process has one already (a program that runs the CLI in-process).
fn observe() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .try_init();
}

/// The process's Prometheus recorder, installed once (a second console in one process shares
/// it); `None` when another recorder was installed first.
fn metrics_recorder() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    static HANDLE: std::sync::OnceLock<Option<metrics_exporter_prometheus::PrometheusHandle>> =
        std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .ok()?;
            for (name, _, help) in idemflow_console::CATALOGUE {
                metrics::describe_counter!(*name, metrics::Unit::Count, *help);
            }
            Some(handle)
        })
        .clone()
}
