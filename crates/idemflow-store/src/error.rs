//! What a failed engine call means to the protocol ([`EngineError`]), whatever the engine: the
//! engine classifies its own errors (a lost connection, a busy database, a missing schema) and
//! keeps the original as the source, so nothing above the boundary names a driver's error type.

use std::error::Error as StdError;
use std::fmt;

/// Why an engine call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A fenced write changed nothing: another owner holds the key. Stop working on it.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// The database was busy past its limit (SQLite's one writer held past the busy timeout,
    /// InnoDB's lock wait timeout or a deadlock's victim); nothing was written. Try again later.
    #[error("busy: the database's writer or a row lock was held for longer than its limit")]
    Busy,
    /// A statement failed or the connection broke; a transaction it happened in is lost.
    #[error("database error: {0}")]
    Database(#[from] DatabaseError),
    /// A stored row breaks the schema's promises. Never expected; reported rather than guessed
    /// around.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
}

impl EngineError {
    /// Whether the database rolled the transaction back to keep transactions apart
    /// ([`DatabaseErrorKind::Restartable`]).
    pub fn is_restartable(&self) -> bool {
        matches!(self, EngineError::Database(error) if error.is_restartable())
    }
}

/// What kind of database failure a [`DatabaseError`] is, as its engine classified it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DatabaseErrorKind {
    /// The connection died under the statement (the socket closed, or the server or a pooler
    /// ended the session), rather than the statement failing on a live one: a statement that
    /// began nothing may go again on another connection.
    ConnectionLost,
    /// The engine's tables are not there: its migrations have not run.
    NoSchema,
    /// The database rolled the whole transaction back to keep transactions apart: a
    /// serialization failure (SQLSTATE 40001) or a deadlock's victim (PostgreSQL 40P01,
    /// MySQL/MariaDB 1213). Nothing of the transaction is kept, and the same transaction run
    /// again at once may well pass: the runner restarts it in place.
    Restartable,
    /// The keys table's layout refused a new key's claim at its transaction's isolation level:
    /// PostgreSQL's partitioned layout claims at Read Committed only (its uniqueness check needs
    /// a snapshot taken after the claim lock). Nothing was claimed; the runner claims the key
    /// again at Read Committed, committed alone, and the phases' transaction follows at theirs.
    ClaimLevelRefused,
    /// Anything else.
    Other,
}

/// A database's own error, classified by its engine and kept whole as the source: the
/// driver's error type (sqlx's, redis's) is reachable with [`DatabaseError::downcast_ref`], never
/// named by the boundary.
pub struct DatabaseError {
    kind: DatabaseErrorKind,
    source: Box<dyn StdError + Send + Sync + 'static>,
}

impl DatabaseError {
    /// `source`, of `kind`.
    pub fn new(
        kind: DatabaseErrorKind,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self {
            kind,
            source: source.into(),
        }
    }

    /// `source`, neither a lost connection nor a missing schema.
    pub fn other(source: impl Into<Box<dyn StdError + Send + Sync>>) -> Self {
        Self::new(DatabaseErrorKind::Other, source)
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> DatabaseErrorKind {
        self.kind
    }

    /// Whether the connection died under the statement.
    pub fn is_connection_lost(&self) -> bool {
        self.kind == DatabaseErrorKind::ConnectionLost
    }

    /// Whether the database rolled the transaction back to keep transactions apart
    /// ([`DatabaseErrorKind::Restartable`]).
    pub fn is_restartable(&self) -> bool {
        self.kind == DatabaseErrorKind::Restartable
    }

    /// Whether the layout refused a claim at its transaction's isolation level
    /// ([`DatabaseErrorKind::ClaimLevelRefused`]).
    pub fn is_claim_level_refused(&self) -> bool {
        self.kind == DatabaseErrorKind::ClaimLevelRefused
    }

    /// The driver's error, when it is a `T`.
    pub fn downcast_ref<T: StdError + 'static>(&self) -> Option<&T> {
        self.source.downcast_ref()
    }

    /// The driver's error.
    pub fn into_source(self) -> Box<dyn StdError + Send + Sync + 'static> {
        self.source
    }
}

impl fmt::Debug for DatabaseError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("DatabaseError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for DatabaseError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, formatter)
    }
}

impl StdError for DatabaseError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&*self.source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_drivers_error_stays_reachable_and_is_what_it_says() {
        let io = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed");
        let error = EngineError::from(DatabaseError::new(DatabaseErrorKind::ConnectionLost, io));
        let EngineError::Database(database) = &error else {
            panic!("{error:?}");
        };
        assert!(database.is_connection_lost());
        assert_eq!(
            database
                .downcast_ref::<std::io::Error>()
                .map(std::io::Error::kind),
            Some(std::io::ErrorKind::UnexpectedEof)
        );
        assert_eq!(error.to_string(), "database error: closed");
        assert!(StdError::source(database).is_some());
    }
}
