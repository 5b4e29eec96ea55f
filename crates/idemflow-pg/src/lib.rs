//! Every SQL statement idemflow sends to PostgreSQL, and its embedded migrations.
//!
//! The store knows keys, leases and fencing tokens; it knows nothing of workflows beyond their
//! names. Each function is one statement (one round trip) on a connection the caller provides, so
//! the caller decides which statements share a transaction; [`begin_claim`] is the one exception,
//! a `BEGIN` and the claim in one message. docs/protocol.md explains why each is
//! safe at Read Committed.
//!
//! Inside, a module per part of a key's life: `look_up` (reading a key before deciding on it),
//! `claim` and `claim_lock` (claiming a new one), `take_over` (a new owner for an expired lease),
//! `fenced_writes` (the owner's writes) and `maintenance` (resumers, retention, operators), over
//! `owner`, `error`, `millis`, `transaction` and `statements`, which they share; `pool` builds the
//! pool the engine runs best on ([`PoolSettings`]).

#![deny(missing_docs)]

mod claim;
mod claim_lock;
mod console;
mod consumer;
mod error;
mod fenced_writes;
mod look_up;
mod maintenance;
mod millis;
mod operator;
pub mod partitions;
mod pool;
pub mod statements;
mod store;
mod take_over;
mod tamper;
mod transaction;

pub use claim::{ClaimRequest, Claimed, begin_claim, begin_claim_knowing};
pub use claim_lock::wait_for_claim_lock;
pub use console::{expire_key, overview, scan_keys};
pub use transaction::{BEGIN, Limits, Transaction};

pub use maintenance::{
    DUE_CHANNEL, KeyReport, TableStats, count_due_unknown, end_lease, expire_batch, key_report,
    notify_due, resumer_lag, stuck_keys, table_stats, take_over_due,
};
pub use maintenance::{KeyBodies, KeyResponse, key_bodies};

pub use error::StoreError;
pub use fenced_writes::{advance, delete_owned, finish, postpone, renew_lease};
/// The owner of a key: the boundary's, shared by the SQL engines.
pub use idemflow_store::Owner;
pub use look_up::{FoundKey, KeyRow, LookUp, inspect, look_up, next_lock_version, response_apart};
pub use operator::PgOperator;
pub use pool::PoolSettings;
pub use store::PgStore;
pub use take_over::{TakenOver, take_over};

/// The schema migrations, embedded at build time from this crate's `migrations/` folder (the
/// workspace's `migrations/postgres` links to it).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Opens a pool on `url` with `settings` (one connection opened now, to fail early) and applies
/// every pending migration: the same call, in the same shape, as `idemflow_sqlite::open` and
/// `idemflow_mysql::open`. A role that may not change the schema connects with
/// [`PoolSettings::connect`] instead, once an operator has migrated (docs/operations.md).
pub async fn open(url: &str, settings: &PoolSettings) -> Result<sqlx::PgPool, sqlx::Error> {
    let pool = settings.connect(url).await?;
    migrate(&pool).await?;
    Ok(pool)
}

/// Applies every pending migration. Safe to call from many processes at once: sqlx serializes
/// migrators with an advisory lock.
pub async fn migrate(pool: &sqlx::PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
