//! The engine boundary: what an engine provides for the protocol, whatever its database.
//!
//! - [`Engine`]: the protocol's operations (look-up, claim, advance, finish, postpone, take
//!   over, the resumer's scan, retention), in the engine's own types for what only it knows (its
//!   pool, transaction, connection and owner), with engine-neutral [`Limits`] and errors
//!   ([`EngineError`], whose [`DatabaseError`] keeps the driver's error as its source);
//!   [`SqlEngine`]: an engine whose transactions a local phase shares.
//! - The shared types the protocol decides on: [`LookUp`], [`FoundKey`], [`Claim`], [`Taken`],
//!   [`Owner`].
//! - What operators read: [`KeyReport`] and its [`JournalEntry`]s, [`KeyBodies`],
//!   [`TableStats`], [`Overview`].
//!
//! Each engine's crate implements these and nothing above this crate names an engine: the
//! runner, the HTTP layer, the consumer, the console and the CLI speak only the boundary. An
//! engine is proven by the one conformance suite (`tests/it/conformance.rs`), which runs every
//! case against each engine from one source. What each engine must keep, and how its database
//! keeps it, is in docs/engines.md.

#![deny(missing_docs)]

mod console;
mod consumer;
mod engine;
mod error;
mod last_error;
pub mod layout;
mod limits;
mod look_up;
mod operator;
mod owner;
mod pool;
mod report;
pub mod retention;
pub mod rows;
mod standing;
mod tamper;

pub use console::{Overview, ScanFrom, StartedKeys};
pub use consumer::ConsumerStore;
pub use engine::{
    Claim, Claimed, ConnectionOf, Engine, EnginePool, PoolOf, PooledOf, SqlEngine, Taken,
    stored_response,
};
pub use error::{DatabaseError, DatabaseErrorKind, EngineError};
pub use last_error::LastError;
pub use limits::{Isolation, Limits};
pub use look_up::{FoundKey, LookUp};
pub use operator::{
    Migration, Operator, OperatorEngine, OperatorError, OperatorOptions, Partitions, engine_for,
    migrations,
};
pub use owner::{KeyOwner, Owner, fresh_holder};
pub use pool::ConnectionPool;
pub use report::{
    JOURNAL_LIMIT, JournalEntry, KeyBodies, KeyReport, KeyResponse, SEALED_MARKER, TableStats,
    journal_from_json,
};
pub use standing::Standing;
pub use tamper::Tamper;

/// The sqlx this boundary is built with, without a driver: each SQL engine's crate brings its own.
pub use sqlx;
