//! Opening a pool the way the engine needs it ([`open`]). Every connection, as it opens:
//!
//! - **READ COMMITTED** for its transactions: each statement reads what is committed when it
//!   starts, and InnoDB takes no gap locks for searches, so a resumer's scan or retention never
//!   blocks a claim of an unrelated key by locking the gap it falls in (REPEATABLE READ, InnoDB's
//!   default, would). Every write is fenced on the row it changes, so nothing needs a snapshot
//!   older than its statement.
//! - **Times in UTC**: the session's `time_zone` is `+00:00` (sqlx's default), and the engine's
//!   statements read the clock with `UTC_TIMESTAMP`, which no time zone moves.
//! - **A lock wait timeout** ([`OpenOptions::lock_wait_timeout`], 5 s by default, whole seconds):
//!   a statement waits that long for a row lock, then the store answers
//!   [`crate::StoreError::Busy`] (a claim waiting for another claim of its key included).
//! - **A statement timeout** ([`OpenOptions::statement_timeout`], half the lock wait timeout by
//!   default, and always shorter): MariaDB's `max_statement_time` ends a statement still running
//!   that long. A local phase given up at its time limit has its connection closed, but the
//!   server goes on with a running statement, holding its locks, until it ends: the statement
//!   timeout ends it before the runner's record of the failed attempt, which waits for those
//!   locks, reaches its own lock wait timeout. MySQL has no such setting (its
//!   `max_execution_time` bounds `SELECT`s only), so the setting is written for MariaDB alone and
//!   MySQL opens without it: see docs/engines.md.
//! - **Strict SQL mode**: a value that does not fit is an error, never truncated.

use std::str::FromStr;
use std::time::Duration;

use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::{Executor, MySqlPool};

/// How [`open`] opens a pool.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OpenOptions {
    /// How long a statement waits for a row lock before the store answers busy; whole seconds
    /// (InnoDB's unit), at least one.
    pub lock_wait_timeout: Duration,
    /// How long one statement may run before the server ends it; `None`: half the lock wait
    /// timeout. Shorter than the lock wait timeout, or [`open`] refuses it.
    pub statement_timeout: Option<Duration>,
    /// Connections in the pool.
    pub max_connections: u32,
}

impl OpenOptions {
    /// The statement timeout in force: the one set, or half the lock wait timeout.
    pub fn statement_limit(&self) -> Duration {
        self.statement_timeout
            .unwrap_or(self.lock_wait_seconds() / 2)
    }

    fn lock_wait_seconds(&self) -> Duration {
        Duration::from_secs(self.lock_wait_timeout.as_secs_f64().ceil().max(1.0) as u64)
    }

    /// Refuses a statement timeout the lock wait timeout does not outlast.
    fn check(&self) -> Result<(), sqlx::Error> {
        if self.statement_limit() >= self.lock_wait_seconds() {
            return Err(sqlx::Error::Configuration(
                format!(
                    "statement_timeout ({:?}) must be shorter than lock_wait_timeout ({:?}): a \
                     phase given up at its time limit records its attempt only once its running \
                     statement has ended",
                    self.statement_limit(),
                    self.lock_wait_seconds()
                )
                .into(),
            ));
        }
        Ok(())
    }
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            lock_wait_timeout: Duration::from_secs(5),
            statement_timeout: None,
            max_connections: 10,
        }
    }
}

/// Connects to `url` (`mysql://user:password@host:port/database`) with the engine's session
/// settings, and runs its migrations.
pub async fn open(url: &str, options: &OpenOptions) -> Result<MySqlPool, sqlx::Error> {
    options.check()?;
    let connect = MySqlConnectOptions::from_str(url)?.timezone(Some("+00:00".to_owned()));
    let pool = pool_options(options).connect_with(connect).await?;
    crate::migrate(&pool).await?;
    Ok(pool)
}

/// The pool: every connection it opens gets the engine's session settings.
pub fn pool_options(options: &OpenOptions) -> MySqlPoolOptions {
    let lock_wait = options.lock_wait_seconds().as_secs();
    let statement = options.statement_limit().as_secs_f64();
    MySqlPoolOptions::new()
        .max_connections(options.max_connections)
        .after_connect(move |connection, _| {
            Box::pin(async move {
                connection
                    .execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    .await?;
                // `/*M! … */` is run by MariaDB only: MySQL reads it as a comment, and has no
                // `max_statement_time` (docs/engines.md: what MySQL 8.4 does instead). One
                // statement either way, so one round trip per new connection.
                let settings = format!(
                    "SET SESSION innodb_lock_wait_timeout = {lock_wait}, \
                     /*M! max_statement_time = {statement:.3}, */ \
                     sql_mode = CONCAT(@@sql_mode, ',STRICT_ALL_TABLES')"
                );
                connection.execute(sqlx::AssertSqlSafe(settings)).await?;
                Ok(())
            })
        })
}

idemflow_core::with_setters! {
    OpenOptions {
        with_lock_wait_timeout => lock_wait_timeout: Duration,
        with_statement_timeout => statement_timeout: Option<Duration>,
        with_max_connections => max_connections: u32,
    }
}
