//! The SQLite engine's store: every SQL statement idemflow sends to SQLite, its migrations, and
//! how its database files are opened.
//!
//! The same protocol as the PostgreSQL store (`idemflow-pg`), with SQLite's means: one writer at
//! a time (`BEGIN IMMEDIATE`, [`Transaction`]), so a claim's exclusion is the write lock itself;
//! fencing tokens from a counter row ([`statements::NEXT_FENCE`]); leases on one machine's clock;
//! `SQLITE_BUSY` as [`StoreError::Busy`], an answer to retry later, never a failure.

#![deny(missing_docs)]

mod claim;
mod connect;
mod console;
mod consumer;
mod error;
mod fenced_writes;
mod look_up;
mod migrate;
mod operator;
mod report;
mod retention;
mod statement_timeout;
pub mod statements;
mod store;
mod take_over;
mod tamper;
mod transaction;

pub use claim::{ClaimRequest, Claimed, begin_claim};
pub use connect::{OpenOptions, open, open_file};
pub use console::{expire_key, overview, scan_keys};
pub use error::StoreError;
pub use fenced_writes::{
    advance, delete_owned, end_lease, finish, postpone, postpone_in, renew_lease,
};
/// The owner of a key: the boundary's, shared by the SQL engines.
pub use idemflow_store::Owner;
pub use look_up::{FoundKey, LookUp, look_up, response_apart};
pub use migrate::migrate;
pub use operator::SqliteOperator;
pub use report::{KeyBodies, KeyResponse, key_bodies};
pub use report::{key_report, stuck_keys, table_stats};
pub use retention::expire_batch;
pub use store::SqliteStore;
pub use take_over::{
    DueKey, TakenOver, count_due_unknown, due, resumer_lag, take_over, take_over_due, take_over_in,
};
pub use transaction::Transaction;

/// The SQLite engine's migrations, embedded from this crate's `migrations/` folder.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
