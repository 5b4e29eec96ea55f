//! [`Tamper`]: what tests do behind the protocol's back, in each engine's own statements: time
//! passing without waiting for it (a lease running out, a key growing old), and a damaged row.
//! Never called by the engine; the conformance suite, the crash explorer and users' tests call
//! it, so that proving an engine needs no SQL outside its crate.

use std::time::Duration;

use async_trait::async_trait;

use crate::engine::Engine;
use crate::error::EngineError;

/// Test-only writes on an engine's keys.
#[async_trait]
pub trait Tamper: Engine {
    /// Moves the lease of every started key (of `only`, a tenant and a key, when given) a day
    /// into the past, its token kept: what its running out looks like. Leases are ended this
    /// way in tests, never by sleeping.
    async fn lapse_leases(pool: &Self::Pool, only: Option<(&str, &str)>)
    -> Result<(), EngineError>;

    /// Moves every finished key's finish `by` into the past.
    async fn age_finished(pool: &Self::Pool, by: Duration) -> Result<(), EngineError>;

    /// Writes over every key's journal what no report can read.
    async fn damage_journals(pool: &Self::Pool) -> Result<(), EngineError>;
}
