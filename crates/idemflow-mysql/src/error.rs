//! [`StoreError`], the one error type of every store call, as the other engines have it. InnoDB's
//! lock waits past `innodb_lock_wait_timeout` (1205) or `max_statement_time` (1969) are
//! [`StoreError::Busy`]: an answer to retry later, never a failure a client sees as a 500. A
//! deadlock's victim (1213) is a database error the boundary calls restartable
//! (`idemflow_store::DatabaseErrorKind::Restartable`): InnoDB rolled the whole transaction back,
//! and the runner runs it again at once (outside a transaction it can restart, it is busy too).

use idemflow_store::{DatabaseError, DatabaseErrorKind, EngineError};

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A fenced write updated no row: another owner took the key over (or it was finished or
    /// deleted). The caller must roll back its transaction and stop working on the key.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// A row lock was held for longer than the lock wait timeout (1205) or the statement timeout
    /// (1969, which ends a wait first). Nothing the statement wrote is kept. The caller may try
    /// again later (over HTTP: 503 with `Retry-After`).
    #[error("busy: a row lock was held for longer than the lock wait timeout")]
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
        // Not a deadlock (1213): InnoDB rolled its victim's whole transaction back, which the
        // runner answers by running it again at once (`is_restartable`). A lock wait timeout
        // undoes the waiting statement alone (unless `innodb_rollback_on_timeout`), and says a
        // lock is held long rather than that two transactions crossed: busy, tried later.
        if matches!(
            error_number(&error),
            Some(LOCK_WAIT_TIMEOUT | STATEMENT_TIMEOUT)
        ) {
            Self::Busy
        } else {
            Self::Database(error)
        }
    }
}

/// ER_DUP_ENTRY: a unique key already holds the value (a claim lost to a committed one).
pub(crate) const DUPLICATE_KEY: u16 = 1062;
/// ER_LOCK_WAIT_TIMEOUT.
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
/// ER_LOCK_DEADLOCK: the whole transaction was rolled back.
pub(crate) const DEADLOCK: u16 = 1213;
/// ER_STATEMENT_TIMEOUT: MariaDB's `max_statement_time` ended the statement. The engine's own
/// statements are short; one ends this way waiting for a row lock (the statement timeout is
/// shorter than the lock wait timeout, `crate::OpenOptions`), so it is busy, as 1205 is.
pub(crate) const STATEMENT_TIMEOUT: u16 = 1969;

/// The server's error number, for an error the server sent.
pub(crate) fn error_number(error: &sqlx::Error) -> Option<u16> {
    let sqlx::Error::Database(error) = error else {
        return None;
    };
    error
        .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
        .map(sqlx::mysql::MySqlDatabaseError::number)
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

/// ER_NO_SUCH_TABLE: the migrations have not run.
const NO_SUCH_TABLE: u16 = 1146;

/// Whether InnoDB chose the transaction as a deadlock's victim (1213) and rolled all of it back.
/// MySQL and MariaDB report a serialization conflict at Serializable the same way: their
/// Serializable is locking reads, so a conflict is a lock wait, and a cycle of them a deadlock.
pub(crate) fn is_restartable(error: &sqlx::Error) -> bool {
    error_number(error) == Some(DEADLOCK)
}

/// sqlx's error on MySQL/MariaDB, classified for the boundary.
pub(crate) fn database_error(error: sqlx::Error) -> DatabaseError {
    let kind = match (&error, error_number(&error)) {
        (sqlx::Error::Io(_), _) => DatabaseErrorKind::ConnectionLost,
        (_, Some(NO_SUCH_TABLE)) => DatabaseErrorKind::NoSchema,
        (_, Some(DEADLOCK)) => DatabaseErrorKind::Restartable,
        _ => DatabaseErrorKind::Other,
    };
    DatabaseError::new(kind, error)
}
