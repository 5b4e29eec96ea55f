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

use idemflow_pg::{Limits, Transaction};

use crate::warm::Warm;

/// Whether the connection died under the statement (the socket closed, or the server said it is
/// terminating the session) rather than the statement failing on a live one.
pub(crate) fn is_connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) => true,
        sqlx::Error::Database(database) => matches!(
            database.code().as_deref(),
            // admin_shutdown (pg_terminate_backend, a fast shutdown), crash_shutdown, and the
            // connection_exception class.
            Some("57P01" | "57P02" | "08000" | "08003" | "08006")
        ),
        _ => false,
    }
}

/// Begins a transaction under `limits` on a warm connection or one from the pool, on another one
/// each time the `BEGIN` finds its connection dead: at most once per connection the pool may
/// hold, and once more.
pub(crate) async fn begin_live(
    warm: &Arc<Warm>,
    limits: &Limits,
) -> Result<Transaction, sqlx::Error> {
    let mut tries = warm.pool().size() as usize + 1;
    loop {
        match Transaction::begin_limited(warm.acquire().await?, limits).await {
            Err(error) if tries > 0 && is_connection_lost(&error) => {
                tries -= 1;
                tracing::info!(%error, "a pooled connection was lost; beginning on another");
            }
            begun => return begun,
        }
    }
}
