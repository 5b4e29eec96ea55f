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
    /// The transaction's isolation level, stated as it begins.
    pub isolation: Isolation,
}

/// The isolation level a transaction the engine begins runs at: the strongest any local phase
/// in it declares. Read Committed by default, the level the protocol is argued at
/// (docs/protocol.md); a stronger one only where the engine keeps the protocol's guarantees
/// there too (docs/runner.md, "Choosing an isolation level").
///
/// Ordered: a transaction holding phases of two levels runs at the stronger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Isolation {
    /// Each statement sees what was committed before it began.
    #[default]
    ReadCommitted,
    /// Every statement sees one snapshot, taken by the transaction's first.
    RepeatableRead,
    /// As if the transactions ran one at a time; the database refuses (serialization failure)
    /// what would break that, and the runner runs the transaction again.
    Serializable,
}

impl Isolation {
    /// Every level, weakest first.
    pub const ALL: [Isolation; 3] = [
        Isolation::ReadCommitted,
        Isolation::RepeatableRead,
        Isolation::Serializable,
    ];

    /// The level as SQL names it (`READ COMMITTED`, `REPEATABLE READ`, `SERIALIZABLE`).
    pub fn sql(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "READ COMMITTED",
            Isolation::RepeatableRead => "REPEATABLE READ",
            Isolation::Serializable => "SERIALIZABLE",
        }
    }

    /// The level as metrics and logs name it (`read_committed`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::ReadCommitted => "read_committed",
            Isolation::RepeatableRead => "repeatable_read",
            Isolation::Serializable => "serializable",
        }
    }
}

impl std::fmt::Display for Isolation {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(self.sql())
    }
}

idemflow_core::with_setters! {
    Limits {
        with_statement_timeout => statement_timeout: Option<Duration>,
        with_idle_timeout => idle_timeout: Option<Duration>,
        with_lock_timeout => lock_timeout: Option<Duration>,
        with_isolation => isolation: Isolation,
    }
}
