//! [`Limits`]: what the database enforces on one transaction the engine begins, whatever the
//! engine; each engine applies those it can (docs/engines.md says which).

use std::time::Duration;

/// What the server enforces on one transaction, where the application cannot: a statement stuck
/// in a lock wait, or a process that stopped sending anything while it holds the transaction
/// (and with it the claim's exclusion and the key's row lock), are ended by the server.
///
/// PostgreSQL sets each with `SET LOCAL` in the message that begins the transaction (no round
/// trip of its own); MySQL/MariaDB and SQLite bound every statement by session settings made
/// when a connection opens, and take no per-transaction limit; Redis has no transaction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Limits {
    /// A statement of the transaction running longer is cancelled.
    pub statement_timeout: Option<Duration>,
    /// A session idle inside the transaction this long is ended by the server.
    pub idle_timeout: Option<Duration>,
    /// A statement waiting this long for a lock fails.
    pub lock_timeout: Option<Duration>,
}

idemflow_core::with_setters! {
    Limits {
        with_statement_timeout => statement_timeout: Option<Duration>,
        with_idle_timeout => idle_timeout: Option<Duration>,
        with_lock_timeout => lock_timeout: Option<Duration>,
    }
}
