//! The MySQL/MariaDB engine's store: every SQL statement idemflow sends to MySQL or MariaDB
//! (InnoDB), its migrations, and how its pools are opened.
//!
//! The same protocol as the PostgreSQL store (`idemflow-pg`), with InnoDB's means: keys compared
//! byte for byte (`VARBINARY`); the claim arbitrated by the primary key, a duplicate-key error
//! (1062) being the answer "another claim won"; fencing tokens made of the key's life (the
//! claim's AUTO_INCREMENT, never handed out twice) and a fence counted within it; leases by the
//! server's clock in UTC; lock waits past their timeout and deadlock victims as
//! [`StoreError::Busy`], an answer to retry later, never a failure.

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
pub mod statements;
mod store;
mod take_over;
mod tamper;
mod transaction;

pub use claim::{ClaimRequest, Claimed, begin_claim, begin_claim_at, claim_again_at};
pub use connect::{OpenOptions, open, pool_options};
pub use console::{expire_key, overview, scan_keys};
pub use error::StoreError;
pub use fenced_writes::{
    advance, delete_owned, end_lease, finish, postpone, postpone_in, renew_lease,
};
/// The owner of a key: the boundary's, shared by the SQL engines.
pub use idemflow_store::Owner;
pub use look_up::{FoundKey, LookUp, look_up, response_apart};
pub use migrate::migrate;
pub use operator::MySqlOperator;
pub use report::{KeyBodies, KeyResponse, key_bodies};
pub use report::{key_report, stuck_keys, table_stats};
pub use retention::expire_batch;
pub use store::MySqlStore;
pub use take_over::{
    TakenOver, count_due_unknown, resumer_lag, take_over, take_over_due, take_over_in,
};
pub use transaction::Transaction;

/// The MySQL/MariaDB engine's migrations, embedded from this crate's `migrations/` folder.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
