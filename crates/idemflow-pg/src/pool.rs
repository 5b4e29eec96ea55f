//! The pool the engine runs best on, with every wait bounded.
//!
//! sqlx's defaults suit many applications and not this one: it tests each connection before
//! handing it out (a round trip per request: the engine replaces a dead connection itself, see
//! the runner's look-up), waits 30 s for a connection, and sets no server-side limits. A
//! [`PoolSettings`] builds a pool whose connections carry the server-side half of the engine's
//! timeouts (the runner's `database_timeout` is the client-side half):
//!
//! - `statement_timeout` and `idle_in_transaction_session_timeout` as session defaults, so a
//!   statement outside the engine's transactions (the look-up, your handlers' queries) is ended by
//!   the server too, and a session that stopped talking inside a transaction frees its locks. The
//!   engine's own transactions set their own limits with `SET LOCAL` (the workflow's local time
//!   limits), which take precedence inside them.
//! - an acquire timeout: no request waits longer than this for a connection.
//!
//! ```no_run
//! # async fn example() -> Result<(), sqlx::Error> {
//! let pool = idemflow_pg::PoolSettings::default()
//!     .connect("postgres://app@127.0.0.1/shop")
//!     .await?;
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// How to build the engine's pool. Every limit is a `Duration`; `None` leaves the server's own
/// setting.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolSettings {
    /// The most connections the pool opens. Default 10.
    pub max_connections: u32,
    /// How long a request waits for a connection (opening one included). Default 5 s, as the
    /// runner's database timeout.
    pub acquire_timeout: Duration,
    /// The session's `statement_timeout`. Default 30 s: below the default lease (60 s), above any
    /// statement the engine sends. Transactions of workflows with local phases set their own.
    pub statement_timeout: Option<Duration>,
    /// The session's `idle_in_transaction_session_timeout`. Default 30 s.
    pub idle_in_transaction_timeout: Option<Duration>,
    /// The `application_name` the server shows for these sessions. Default `idemflow`.
    pub application_name: String,
}

impl Default for PoolSettings {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Some(Duration::from_secs(30)),
            idle_in_transaction_timeout: Some(Duration::from_secs(30)),
            application_name: "idemflow".to_owned(),
        }
    }
}

impl PoolSettings {
    /// `connect` with these settings added: the session limits as startup options.
    pub fn connect_options(&self, connect: PgConnectOptions) -> PgConnectOptions {
        let mut limits = Vec::new();
        for (name, limit) in [
            ("statement_timeout", self.statement_timeout),
            (
                "idle_in_transaction_session_timeout",
                self.idle_in_transaction_timeout,
            ),
        ] {
            if let Some(limit) = limit {
                limits.push((name, format!("{}ms", limit.as_millis())));
            }
        }
        connect
            .application_name(&self.application_name)
            .options(limits)
    }

    /// The pool options: the acquire timeout, the size, and no test before each acquire.
    pub fn pool_options(&self) -> PgPoolOptions {
        PgPoolOptions::new()
            .max_connections(self.max_connections)
            .acquire_timeout(self.acquire_timeout)
            .test_before_acquire(false)
    }

    /// Opens a pool on `url` with these settings (one connection opened now, to fail early).
    pub async fn connect(&self, url: &str) -> Result<PgPool, sqlx::Error> {
        let connect: PgConnectOptions = url.parse()?;
        self.pool_options()
            .connect_with(self.connect_options(connect))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[sqlx::test(migrations = false)]
    async fn the_session_limits_are_set_on_every_connection(
        _: PgPoolOptions,
        connect: PgConnectOptions,
    ) {
        let settings = PoolSettings {
            statement_timeout: Some(Duration::from_millis(1500)),
            idle_in_transaction_timeout: None,
            ..PoolSettings::default()
        };
        let pool = settings
            .pool_options()
            .connect_with(settings.connect_options(connect))
            .await
            .expect("connects");
        let (statement, application): (String, String) = sqlx::query_as(
            "SELECT current_setting('statement_timeout'), current_setting('application_name')",
        )
        .fetch_one(&pool)
        .await
        .expect("reads the settings");
        assert_eq!(statement, "1500ms");
        assert_eq!(application, "idemflow");
        // The server ends a statement past the session's limit by itself.
        let slow = sqlx::query("SELECT pg_sleep(3)").execute(&pool).await;
        let code = slow
            .expect_err("cancelled by the server")
            .as_database_error()
            .and_then(|error| error.code().map(|code| code.into_owned()));
        assert_eq!(code.as_deref(), Some("57014"));
    }
}

idemflow_core::with_setters! {
    PoolSettings {
        with_max_connections => max_connections: u32,
        with_acquire_timeout => acquire_timeout: Duration,
        with_statement_timeout => statement_timeout: Option<Duration>,
        with_idle_in_transaction_timeout => idle_in_transaction_timeout: Option<Duration>,
        with_application_name => application_name: String,
    }
}
