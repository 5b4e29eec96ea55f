//! Beginning a transaction on a pooled connection that may have died while it sat idle.
//!
//! The engine's pools hand connections out untested (`test_before_acquire(false)`: a ping would be
//! a round trip per transaction), so a connection the server ended while it sat in the pool (a
//! `pg_terminate_backend`, an idle timeout, a restart) is only found dead by the first statement
//! sent on it. When that statement is a `BEGIN`, nothing has happened yet, and it goes again on
//! another connection: otherwise a resumed key, or a failed attempt's record, would fail for
//! nothing (a give-up lost this way left its key started until its lease ended, and the next
//! takeover counted one more attempt).

use std::sync::Arc;

use idemflow_pg::Limits;

use crate::engine::{ConnectionPool, Engine, EngineError};
use crate::warm::Warm;

/// Whether the connection died under the statement (the socket closed, or the server or a pooler
/// ended the session) rather than the statement failing on a live one.
pub(crate) fn is_connection_lost(error: &sqlx::Error) -> bool {
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

/// Begins a transaction under `limits` on a warm connection or one from the pool, on another one
/// each time the `BEGIN` finds its connection dead: at most once per connection the pool may
/// hold, and once more.
pub(crate) async fn begin_live<E: Engine>(
    warm: &Arc<Warm<E::Pool>>,
    limits: &Limits,
) -> Result<E::Transaction, EngineError> {
    let mut tries = warm.pool().size() as usize + 1;
    loop {
        match E::begin(warm.acquire().await?, limits).await {
            Err(EngineError::Database(error)) if tries > 0 && is_connection_lost(&error) => {
                tries -= 1;
                tracing::info!(%error, "a pooled connection was lost; beginning on another");
            }
            begun => return begun,
        }
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
            assert!(is_connection_lost(&coded(code)), "{code}");
        }
        for code in ["57014", "40001", "23505", "55P03", "25P02", "42501"] {
            assert!(!is_connection_lost(&coded(code)), "{code}");
        }
        let io = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed");
        assert!(is_connection_lost(&sqlx::Error::Io(io)));
    }
}
