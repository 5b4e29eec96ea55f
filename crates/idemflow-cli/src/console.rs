//! `idemflow console`: the operator console served alone, on any engine. In read-only mode the
//! console refuses every action itself, and its connections are read-only too (PostgreSQL's
//! `default_transaction_read_only`, MariaDB's `SESSION TRANSACTION READ ONLY`, SQLite's read-only
//! open), so even a defect in the console could not write; run it as a role that may only read
//! (scripts/sql/grants.sql, `readonly_role`) for a third wall.

use std::net::SocketAddr;
use std::str::FromStr;

use idemflow_console::{Console, PASSWORD_ENV, ServeOptions};
use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use crate::{CliError, Format, Output, exit};

/// Connections the console keeps: a handful of operators' page views at once.
const CONNECTIONS: u32 = 4;

async fn open(url: &str, read_only: bool) -> Result<Console, CliError> {
    let invalid = |error: sqlx::Error| CliError::Usage(format!("invalid database URL: {error}"));
    let cannot = |error: sqlx::Error| CliError::Database(format!("cannot connect: {error}"));
    if crate::sqlite::is_sqlite(url) {
        let options = SqliteConnectOptions::from_str(url)
            .map_err(invalid)?
            .create_if_missing(false)
            .read_only(read_only);
        let pool = SqlitePoolOptions::new()
            .max_connections(CONNECTIONS)
            .connect_with(options)
            .await
            .map_err(cannot)?;
        return Ok(Console::sqlite(pool));
    }
    if crate::redis::is_redis(url) {
        // Read-only is the console's own refusal here: Redis has no read-only session.
        let pool = crate::redis::open(url).await?;
        return Ok(Console::new(idemflow_console::backend::Redis(pool)));
    }
    if crate::mysql::is_mysql(url) {
        let url = url.replacen("mariadb:", "mysql:", 1);
        let options = MySqlConnectOptions::from_str(&url).map_err(invalid)?;
        let pool = MySqlPoolOptions::new()
            .max_connections(CONNECTIONS)
            .after_connect(move |connection, _| {
                Box::pin(async move {
                    if read_only {
                        connection
                            .execute("SET SESSION TRANSACTION READ ONLY")
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .map_err(cannot)?;
        return Ok(Console::mysql(pool));
    }
    let mut options = PgConnectOptions::from_str(url)
        .map_err(invalid)?
        .application_name("idemflow console");
    if read_only {
        options = options.options([("default_transaction_read_only", "on")]);
    }
    let pool = PgPoolOptions::new()
        .max_connections(CONNECTIONS)
        .connect_with(options)
        .await
        .map_err(cannot)?;
    Ok(Console::postgres(pool))
}

/// Serves the console on `bind` until interrupted; the password, when set, is read from
/// `IDEMFLOW_CONSOLE_PASSWORD`.
pub async fn console(url: &str, bind: SocketAddr, read_only: bool, format: Format) -> Output {
    let password = std::env::var(PASSWORD_ENV).ok();
    let console = match open(url, read_only).await {
        Ok(console) => console.read_only(read_only),
        Err(error) => return error.output(format),
    };
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
