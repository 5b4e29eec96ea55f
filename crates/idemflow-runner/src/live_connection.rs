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

use crate::engine::{ConnectionPool, Engine, EngineError, Limits};
use crate::warm::Warm;

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
            Err(EngineError::Database(error)) if tries > 0 && error.is_connection_lost() => {
                tries -= 1;
                tracing::info!(%error, "a pooled connection was lost; beginning on another");
            }
            begun => return begun,
        }
    }
}
