//! Reading a key before deciding on it ([`look_up`]), and the body of a response stored apart
//! ([`response_apart`]).

use std::time::Duration;

use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use sqlx::mysql::MySqlRow;
use sqlx::{MySqlConnection, Row};

use crate::error::StoreError;
use crate::statements;

/// What [`look_up`] found.
#[derive(Debug, Clone)]
pub enum LookUp {
    /// The key exists (committed).
    Found(FoundKey),
    /// No committed row. A claim in flight is invisible here (a consistent read); the claim's
    /// own insert finds out ([`crate::begin_claim`]), after waiting for that claim to end.
    Absent,
}

/// A key as the look-up sees it: the store boundary's, shared by every engine.
pub use idemflow_store::FoundKey;

/// Reads the key outside any transaction (a consistent read: it never waits for a writer).
pub async fn look_up(
    connection: &mut MySqlConnection,
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

fn found(row: &MySqlRow) -> Result<FoundKey, StoreError> {
    let bytes: Vec<u8> = row.try_get("fingerprint")?;
    let fingerprint = Fingerprint::from_slice(&bytes)
        .ok_or_else(|| StoreError::Corrupt(format!("fingerprint of {} bytes", bytes.len())))?;
    let done = row.try_get::<i64, _>("done")? == 1;
    let lease_left_ms: i64 = row.try_get("lease_left_ms")?;
    let (response, body_apart) = if done {
        let status: i64 = row.try_get("response_status")?;
        let status = u16::try_from(status)
            .map_err(|_| StoreError::Corrupt(format!("response status {status}")))?;
        let headers: String = row.try_get("response_headers")?;
        let headers: Vec<(String, FieldValue)> = serde_json::from_str(&headers)
            .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
        let body: Option<Vec<u8>> = row.try_get("response_body")?;
        let life: Option<i64> = row.try_get("life")?;
        let apart = if body.is_none() { life } else { None };
        let response = StoredResponse {
            status,
            headers,
            body: body.unwrap_or_default(),
        };
        (Some(response), apart)
    } else {
        (None, None)
    };
    Ok(FoundKey {
        fingerprint,
        workflow: row.try_get("workflow")?,
        done,
        lease_left: Duration::from_millis(u64::try_from(lease_left_ms).unwrap_or(0)),
        lock_version: row.try_get("lock_version")?,
        response,
        body_apart,
    })
}

/// The body of a response stored apart, for the life of its key the look-up found. `None` when
/// that life is gone (retention deleted the key since, and a new claim may have made another
/// life, whose body this never is): look the key up again.
pub async fn response_apart(
    connection: &mut MySqlConnection,
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
