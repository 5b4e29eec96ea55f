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

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

/// How [`open`] opens a database.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// How long a writer waits for SQLite's write lock before the store answers busy.
    pub busy_timeout: Duration,
    /// Connections in the pool (one writes at a time; the others read).
    pub max_connections: u32,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            busy_timeout: Duration::from_secs(5),
            max_connections: 8,
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
    let connect = connect_options(SqliteConnectOptions::from_str(url)?, options);
    let pool = SqlitePoolOptions::new()
        .max_connections(options.max_connections)
        .connect_with(connect)
        .await?;
    crate::MIGRATOR.run(&pool).await?;
    Ok(pool)
}

/// [`open`] for a file path.
pub async fn open_file(path: &Path, options: &OpenOptions) -> Result<SqlitePool, sqlx::Error> {
    let connect = connect_options(SqliteConnectOptions::new().filename(path), options);
    let pool = SqlitePoolOptions::new()
        .max_connections(options.max_connections)
        .connect_with(connect)
        .await?;
    crate::MIGRATOR.run(&pool).await?;
    Ok(pool)
}

fn connect_options(connect: SqliteConnectOptions, options: &OpenOptions) -> SqliteConnectOptions {
    connect
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Full)
        .busy_timeout(options.busy_timeout)
        .foreign_keys(true)
}
