//! Opening a database file the way the engine needs it ([`open`]).
//!
//! - **WAL**: readers (look-ups, replays) never wait for the writer, and the writer never waits
//!   for readers. Several processes on one machine may share the file; WAL does not work over a
//!   network file system.
//! - **`synchronous = FULL`**: every commit is on disk before it returns. `NORMAL` (the usual
//!   WAL pairing) keeps the file consistent but may lose the last commits on power loss: a
//!   charge the provider made whose recorded result then vanishes, run again after the crash.
//!   A payments engine takes the fsync per commit.
//! - **A busy timeout** ([`OpenOptions::busy_timeout`], 5 s by default): a writer waits that long
//!   for the write lock, then the store answers [`crate::StoreError::Busy`].
//! - **A statement timeout** ([`OpenOptions::statement_timeout`], half the busy timeout by
//!   default, and always shorter than it), which SQLite lacks: a statement still running that long
//!   is interrupted (`SQLITE_INTERRUPT`) by a progress handler every connection gets when it
//!   opens ([`crate::statement_timeout`]). A statement that never ends (a runaway query in a local phase) would otherwise hold
//!   the one write lock for good, long after the runner gave the phase up and closed its
//!   connection. Installed once per connection, it costs a request nothing: arming a limit per
//!   phase took a round trip to the connection's thread, 15% of a checkout.
//!   Shorter than the busy timeout because of what follows a phase given up at its time limit:
//!   the runner records the failed attempt in a new write transaction, which waits for the hung
//!   statement to be interrupted. A statement allowed to outlast that wait left the attempt
//!   unrecorded (busy), and a key whose phase always hangs was retried for ever, every retry
//!   answered 503, instead of giving up at its budget.

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// How [`open`] opens a database.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OpenOptions {
    /// How long a writer waits for SQLite's write lock before the store answers busy.
    pub busy_timeout: Duration,
    /// Connections in the pool (one writes at a time; the others read).
    pub max_connections: u32,
    /// How long one statement may run before SQLite interrupts it; `None`: half the busy
    /// timeout. Shorter than the busy timeout, or [`open`] refuses it (see the module's docs).
    /// On SQLite one statement holds every writer of the file: a local phase's statements are
    /// each bounded by this, its whole run by its time limit.
    pub statement_timeout: Option<Duration>,
}

impl OpenOptions {
    /// The statement timeout in force: the one set, or half the busy timeout.
    pub fn statement_limit(&self) -> Duration {
        self.statement_timeout.unwrap_or(self.busy_timeout / 2)
    }

    /// Refuses a statement timeout the busy timeout does not outlast.
    fn check(&self) -> Result<(), sqlx::Error> {
        if self.statement_limit() >= self.busy_timeout {
            return Err(sqlx::Error::Configuration(
                format!(
                    "statement_timeout ({:?}) must be shorter than busy_timeout ({:?}): a phase \
                     given up at its time limit records its attempt only once its hung \
                     statement is interrupted",
                    self.statement_limit(),
                    self.busy_timeout
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
            busy_timeout: Duration::from_secs(5),
            max_connections: 8,
            statement_timeout: None,
        }
    }
}

/// Opens (creating it if missing) the database at `url` (`sqlite://path`) with the engine's
/// settings, and runs its migrations. An in-memory database is refused: a key's record must
/// outlive the process, and the resumer runs in another.
pub async fn open(url: &str, options: &OpenOptions) -> Result<SqlitePool, sqlx::Error> {
    if url.contains(":memory:") || url.contains("mode=memory") {
        return Err(sqlx::Error::Configuration(
            "an in-memory SQLite database keeps nothing past its process: give a file".into(),
        ));
    }
    options.check()?;
    let connect = connect_options(SqliteConnectOptions::from_str(url)?, options);
    let pool = pool_options(options).connect_with(connect).await?;
    crate::migrate(&pool).await?;
    Ok(pool)
}

/// [`open`] for a file path.
pub async fn open_file(path: &Path, options: &OpenOptions) -> Result<SqlitePool, sqlx::Error> {
    options.check()?;
    let connect = connect_options(SqliteConnectOptions::new().filename(path), options);
    let pool = pool_options(options).connect_with(connect).await?;
    crate::migrate(&pool).await?;
    Ok(pool)
}

/// The pool: every connection it opens gets the statement timeout.
fn pool_options(options: &OpenOptions) -> SqlitePoolOptions {
    let limit = options.statement_limit();
    SqlitePoolOptions::new()
        .max_connections(options.max_connections)
        .after_connect(move |connection, _| {
            Box::pin(crate::statement_timeout::install(connection, limit))
        })
}

fn connect_options(connect: SqliteConnectOptions, options: &OpenOptions) -> SqliteConnectOptions {
    connect
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(options.busy_timeout)
        .foreign_keys(true)
}

idemflow_core::with_setters! {
    OpenOptions {
        with_busy_timeout => busy_timeout: Duration,
        with_max_connections => max_connections: u32,
        with_statement_timeout => statement_timeout: Option<Duration>,
    }
}
