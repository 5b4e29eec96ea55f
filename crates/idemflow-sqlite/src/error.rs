//! [`StoreError`], the one error type of every store call, as the PostgreSQL store has it, plus
//! [`StoreError::Busy`]: SQLite's one writer at a time makes "the database is busy" an answer of
//! its own, one a caller retries later rather than a failure.

use idemflow_store::{DatabaseError, DatabaseErrorKind, EngineError};

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A fenced write updated no row: another owner took the key over (or it was finished or
    /// deleted). The caller must roll back its transaction and stop working on the key.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// Another connection held the database's write lock for longer than the busy timeout
    /// (`SQLITE_BUSY` or `SQLITE_LOCKED`). Nothing was written; the caller may try again later
    /// (over HTTP: 503 with `Retry-After`).
    #[error("busy: another writer held the database for longer than the busy timeout")]
    Busy,
    /// A statement failed or the connection broke: sqlx's error, as it came. A transaction it
    /// happened in is lost.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// A stored row breaks the schema's promises. Never expected; reported rather than guessed
    /// around.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
}

impl From<sqlx::Error> for StoreError {
    fn from(error: sqlx::Error) -> Self {
        if is_busy(&error) {
            Self::Busy
        } else {
            Self::Database(error)
        }
    }
}

/// `SQLITE_BUSY` (5) or `SQLITE_LOCKED` (6), with any extended code (`SQLITE_BUSY_SNAPSHOT` is
/// 517): the primary code is the extended one's low byte.
pub(crate) fn is_busy(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(error) = error else {
        return false;
    };
    error
        .code()
        .and_then(|code| code.parse::<i64>().ok())
        .is_some_and(|code| matches!(code & 0xff, 5 | 6))
}

/// The boundary's decoding of a row (`idemflow_store::rows`) fails only on a corrupt one.
impl From<EngineError> for StoreError {
    fn from(error: EngineError) -> Self {
        match error {
            EngineError::Corrupt(message) => Self::Corrupt(message),
            other => Self::Corrupt(other.to_string()),
        }
    }
}

impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Busy => Self::Busy,
            StoreError::Database(error) => Self::Database(database_error(error)),
            StoreError::Corrupt(message) => Self::Corrupt(message),
        }
    }
}

/// sqlx's error on SQLite, classified for the boundary: a file that went away under the
/// connection is a lost connection, a missing keys table a missing schema.
pub(crate) fn database_error(error: sqlx::Error) -> DatabaseError {
    let kind = match &error {
        sqlx::Error::Io(_) => DatabaseErrorKind::ConnectionLost,
        sqlx::Error::Database(database) if database.message().starts_with("no such table") => {
            DatabaseErrorKind::NoSchema
        }
        _ => DatabaseErrorKind::Other,
    };
    DatabaseError::new(kind, error)
}
