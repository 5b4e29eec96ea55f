//! [`StoreError`], the one error type of every store call: callers tell a lost fence (stop work
//! on the key) from a database failure (the transaction is lost) and from a row that breaks the
//! schema's promises, whichever statement reported it.

use idemflow_store::{DatabaseError, DatabaseErrorKind, EngineError};

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A fenced write updated no row: another owner took the key over (or it was finished or
    /// deleted). The caller must roll back its transaction and stop working on the key.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// A statement failed or the connection broke: sqlx's error, as it came. A transaction it
    /// happened in is lost.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A stored row breaks the schema's promises (for instance a fingerprint that is not 32
    /// bytes). Never expected; reported rather than guessed around.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
    /// The table's layout does not allow what was asked (adopting the partitioned layout twice,
    /// a partition plan that cannot work).
    #[error("layout: {0}")]
    Layout(String),
}

impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Database(error) => Self::Database(database_error(error)),
            StoreError::Corrupt(message) => Self::Corrupt(message),
            other @ StoreError::Layout(_) => Self::Database(DatabaseError::other(other)),
        }
    }
}

/// sqlx's error on PostgreSQL, classified for the boundary.
pub(crate) fn database_error(error: sqlx::Error) -> DatabaseError {
    let kind = if is_connection_lost(&error) {
        DatabaseErrorKind::ConnectionLost
    } else if has_code(&error, "42P01") {
        // undefined_table: the migrations have not run.
        DatabaseErrorKind::NoSchema
    } else if is_restartable(&error) {
        DatabaseErrorKind::Restartable
    } else if is_claim_level_refused(&error) {
        DatabaseErrorKind::ClaimLevelRefused
    } else {
        DatabaseErrorKind::Other
    };
    DatabaseError::new(kind, error)
}

/// serialization_failure (40001: Repeatable Read or Serializable refused a transaction whose
/// reads another one changed) or deadlock_detected (40P01: the victim of a lock cycle, at any
/// level): PostgreSQL has aborted the transaction, and running it again from its `BEGIN` is
/// what its documentation prescribes.
pub(crate) fn is_restartable(error: &sqlx::Error) -> bool {
    has_code(error, "40001") || has_code(error, "40P01")
}

/// The partitioned layout's trigger refusing an insert into the keys table above Read Committed
/// (feature_not_supported, 0A000, with the trigger's own message: a phase's statement may raise
/// 0A000 for reasons of its own, which stay ordinary failures).
pub(crate) fn is_claim_level_refused(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error)
        if error.code().as_deref() == Some("0A000")
            && error.message().starts_with(CLAIM_LEVEL_REFUSED))
}

/// How the trigger's refusal begins (crates/idemflow-pg/migrations/
/// 20261202000200_one_row_per_key_fixed_path.sql).
const CLAIM_LEVEL_REFUSED: &str = "a key is inserted into the partitioned keys table only at";

fn has_code(error: &sqlx::Error, code: &str) -> bool {
    matches!(error, sqlx::Error::Database(error) if error.code().as_deref() == Some(code))
}

/// Whether the connection died under the statement (the socket closed, or the server or a pooler
/// ended the session) rather than the statement failing on a live one.
fn is_connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(database) => database.code().is_some_and(|code| {
            // The connection_exception class (08: PgBouncer's own disconnects, client_idle_timeout
            // and the like, are 08P01); admin_shutdown (pg_terminate_backend, a fast shutdown),
            // crash_shutdown, idle_session_timeout (57P05), and a session ended for idling in a
            // transaction (25P03): each a FATAL the session sent as it ended.
            code.starts_with("08") || matches!(&*code, "57P01" | "57P02" | "57P05" | "25P03")
        }),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Coded(&'static str);

    impl std::fmt::Display for Coded {
        fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(formatter, "SQLSTATE {}", self.0)
        }
    }

    impl std::error::Error for Coded {}

    impl sqlx::error::DatabaseError for Coded {
        fn message(&self) -> &str {
            "coded"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    fn coded(code: &'static str) -> sqlx::Error {
        sqlx::Error::Database(Box::new(Coded(code)))
    }

    /// Every way a session ends under a statement is a lost connection; a statement that failed
    /// on a live session is not.
    #[test]
    fn sessions_the_server_or_a_pooler_ended_are_lost_connections() {
        for code in [
            "08000", "08003", "08006", "08P01", "57P01", "57P02", "57P05", "25P03",
        ] {
            assert!(database_error(coded(code)).is_connection_lost(), "{code}");
        }
        for code in [
            "57014", "40001", "23505", "55P03", "25P02", "42501", "42P01",
        ] {
            assert!(!database_error(coded(code)).is_connection_lost(), "{code}");
        }
        assert_eq!(
            database_error(coded("42P01")).kind(),
            DatabaseErrorKind::NoSchema
        );
        for code in ["40001", "40P01"] {
            assert!(database_error(coded(code)).is_restartable(), "{code}");
        }
        for code in ["55P03", "57014", "23505", "40002"] {
            assert!(!database_error(coded(code)).is_restartable(), "{code}");
        }
        let io = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed");
        assert!(database_error(sqlx::Error::Io(io)).is_connection_lost());
    }
}
