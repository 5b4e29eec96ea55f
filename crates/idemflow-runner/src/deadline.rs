//! A bound on every wait for the database, kept by the engine itself.
//!
//! The server's own limits (`statement_timeout`, `idle_in_transaction_session_timeout`) end what
//! the server sees; they do nothing when the server is gone without a word: a network that drops
//! packets, a host powered off, a failover in progress. Then a statement waits until the
//! operating system gives up on the socket, for minutes. So each of the engine's own statements,
//! and each wait for a connection, is bounded here by [`crate::RunnerConfig::database_timeout`]:
//! past it the request ends with [`RunError::DatabaseTimeout`] (503), and the key is left as the
//! last commit left it, for a retry or the resumer. Dropping the statement's future drops its
//! transaction, which the server rolls back when it hears of it; nothing is half-committed.

use std::future::Future;
use std::time::Duration;

use crate::error::RunError;

/// Bounds a wait for the database.
pub(crate) trait Within: Future + Sized {
    /// This future's output, or [`RunError::DatabaseTimeout`] once `limit` has passed.
    fn within(self, limit: Duration) -> impl Future<Output = Result<Self::Output, RunError>> {
        async move {
            tokio::time::timeout(limit, self)
                .await
                .map_err(|_| RunError::DatabaseTimeout(limit))
        }
    }
}

impl<F: Future> Within for F {}
