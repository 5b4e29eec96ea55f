//! Reading a key before deciding on it ([`look_up`]), and the body of a response stored apart
//! ([`response_apart`]).

use idemflow_core::{Key, TenantId};
use sqlx::SqliteConnection;
use sqlx::sqlite::SqliteRow;

use crate::error::StoreError;
use crate::statements;

/// What [`look_up`] found.
#[derive(Debug, Clone)]
pub enum LookUp {
    /// The key exists (committed).
    Found(FoundKey),
    /// No committed row. A claim in flight is invisible here (SQLite has no lock a reader could
    /// try); the claim's own transaction finds out ([`crate::begin_claim`]), after waiting for
    /// the write lock such a claim holds.
    Absent,
}

/// A key as the look-up sees it: the engine boundary's, shared by every engine.
pub use idemflow_store::FoundKey;

/// Reads the key outside any transaction (a WAL snapshot: it never waits for a writer).
pub async fn look_up(
    connection: &mut SqliteConnection,
    tenant: &TenantId,
    key: &Key,
) -> Result<LookUp, StoreError> {
    let row = sqlx::query(statements::LOOK_UP)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .fetch_optional(connection)
        .await?;
    Ok(match row {
        None => LookUp::Absent,
        Some(row) => LookUp::Found(found(&row)?),
    })
}

/// The key from its look-up's row: the boundary's decoding, every engine's.
fn found(row: &SqliteRow) -> Result<FoundKey, StoreError> {
    idemflow_store::rows::found_key(row).map_err(StoreError::from)
}

/// The body of a response stored apart, for the life of its key the look-up found. `None` when
/// that life is gone (retention deleted the key since, and a new claim may have made another
/// life, whose body this never is): look the key up again.
pub async fn response_apart(
    connection: &mut SqliteConnection,
    tenant: &TenantId,
    key: &Key,
    life: i64,
) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(sqlx::query_scalar(statements::RESPONSE_APART)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(life)
        .fetch_optional(connection)
        .await?)
}
