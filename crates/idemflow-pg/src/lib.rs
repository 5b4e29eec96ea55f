//! Every SQL statement idemflow sends to PostgreSQL, and its embedded migrations.
//!
//! The store knows keys, leases and fencing tokens; it knows nothing of workflows beyond their
//! names. Each function is one statement (one round trip) on a connection the caller provides, so
//! the caller decides which statements share a transaction; [`begin_claim`] is the one exception,
//! a `BEGIN` and the claim in one message. docs/protocol.md explains why each is
//! safe at Read Committed.

#![deny(missing_docs)]

mod claim;
mod maintenance;
pub mod statements;
mod store;
mod transaction;

pub use claim::{Claimed, begin_claim};
pub use transaction::{Limits, Transaction};

pub use maintenance::{
    DUE_CHANNEL, DueKey, KeyReport, TableStats, count_due_unknown, end_lease, expire_batch,
    key_report, notify_due, resumer_lag, stuck_keys, table_stats, take_over_due,
};

pub use store::{
    ClaimRequest, FoundKey, KeyRow, LookUp, Owner, StoreError, TakenOver, advance, delete_owned,
    finish, inspect, look_up, next_lock_version, postpone, renew_lease, take_over,
};

/// The schema migrations, embedded at build time from the workspace's `migrations/` folder.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Applies every pending migration. Safe to call from many processes at once: sqlx serializes
/// migrators with an advisory lock.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
