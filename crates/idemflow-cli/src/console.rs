//! `idemflow console`: the operator console served alone, on any engine this build has. In
//! read-only mode the console refuses every action itself, and its connections are read-only too
//! where the engine has read-only sessions (PostgreSQL's `default_transaction_read_only`,
//! MariaDB's `SESSION TRANSACTION READ ONLY`, SQLite's read-only open), so even a defect in the
//! console could not write; run it as a role that may only read (scripts/sql/grants.sql,
//! `readonly_role`) for a third wall.

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
    let console = Console::shared(Arc::from(operator)).read_only(read_only);
    let options = ServeOptions::new(bind).password(password);
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
