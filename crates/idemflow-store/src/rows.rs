//! The rows the SQL engines' reports and look-ups read, decoded once for every engine: each
//! engine's statement names its columns alike (`tenant`, `key`, …, `journal` for a report;
//! `fingerprint`, `workflow`, `done`, … for a look-up), and these read them from any sqlx row.
//!
//! Integer columns are read as 64-bit whatever their width in the table (each engine's statement
//! says so where its database would answer narrower: PostgreSQL's casts), and checked into the
//! reports' narrower fields here; a value out of range is a corrupt row, never a wrapped number.
//! Every failure is [`EngineError::Corrupt`]: a row that breaks the schema's promises.

use std::time::Duration;

use idemflow_core::{FieldValue, Fingerprint, StoredResponse};
use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::error::EngineError;
use crate::look_up::FoundKey;
use crate::report::{KeyBodies, KeyReport, KeyResponse, journal_from_json};

/// A column that failed to decode: a row the schema does not promise.
fn undecoded(error: sqlx::Error) -> EngineError {
    EngineError::Corrupt(error.to_string())
}

/// A 64-bit integer column checked into a narrower field.
fn narrow<T: TryFrom<i64>>(column: &str, value: i64) -> Result<T, EngineError> {
    T::try_from(value).map_err(|_| EngineError::Corrupt(format!("{column} {value} out of range")))
}

/// A key's report from a row of the report's columns: `tenant`, `key`, `workflow`, `state`,
/// `recovery_point`, `lease_left_ms`, `lock_version`, `attempts`, `last_error`,
/// `response_status`, `response_bytes`, `fingerprint_hex`, `age_seconds`, `journal` (its JSON
/// text).
pub fn key_report<'r, R>(row: &'r R) -> Result<KeyReport, EngineError>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
{
    let text = |column: &'static str| row.try_get::<String, _>(column).map_err(undecoded);
    let number = |column: &'static str| row.try_get::<i64, _>(column).map_err(undecoded);
    let maybe = |column: &'static str| row.try_get::<Option<i64>, _>(column).map_err(undecoded);
    let (tenant, key) = (text("tenant")?, text("key")?);
    let journal = journal_from_json(&tenant, &key, &text("journal")?);
    Ok(KeyReport {
        workflow: text("workflow")?,
        state: text("state")?,
        recovery_point: text("recovery_point")?,
        lease_left_ms: maybe("lease_left_ms")?,
        lock_version: number("lock_version")?,
        attempts: narrow("attempts", number("attempts")?)?,
        last_error: row
            .try_get::<Option<String>, _>("last_error")
            .map_err(undecoded)?,
        response_status: maybe("response_status")?
            .map(|status| narrow("response_status", status))
            .transpose()?,
        // A body longer than 2 GiB is reported at the largest length the report holds.
        response_bytes: maybe("response_bytes")?
            .map(|bytes| i32::try_from(bytes).unwrap_or(i32::MAX)),
        fingerprint_hex: text("fingerprint_hex")?,
        age_seconds: number("age_seconds")?,
        journal,
        tenant,
        key,
    })
}

/// A key as a look-up sees it, from a row of the look-up's columns: `fingerprint` (32 bytes),
/// `workflow`, `done` (0 or 1), `lease_left_ms`, `lock_version`, `response_status`,
/// `response_headers` (JSON text), `response_body` (NULL when stored apart), `life` (the life
/// a body apart is stored under, NULL when the body is in the row).
pub fn found_key<'r, R>(row: &'r R) -> Result<FoundKey, EngineError>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    Option<Vec<u8>>: Decode<'r, R::Database> + Type<R::Database>,
{
    let number = |column: &'static str| row.try_get::<i64, _>(column).map_err(undecoded);
    let bytes: Vec<u8> = row.try_get("fingerprint").map_err(undecoded)?;
    let fingerprint = Fingerprint::from_slice(&bytes)
        .ok_or_else(|| EngineError::Corrupt(format!("fingerprint of {} bytes", bytes.len())))?;
    let done = number("done")? == 1;
    let lease_left_ms = number("lease_left_ms")?;
    let (response, body_apart) = if done {
        let status = narrow("response status", number("response_status")?)?;
        let headers: String = row.try_get("response_headers").map_err(undecoded)?;
        let headers: Vec<(String, FieldValue)> = serde_json::from_str(&headers)
            .map_err(|error| EngineError::Corrupt(format!("response headers: {error}")))?;
        let body: Option<Vec<u8>> = row.try_get("response_body").map_err(undecoded)?;
        let life: Option<i64> = row.try_get("life").map_err(undecoded)?;
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
        workflow: row.try_get("workflow").map_err(undecoded)?,
        done,
        lease_left: Duration::from_millis(u64::try_from(lease_left_ms).unwrap_or(0)),
        lock_version: number("lock_version")?,
        response,
        body_apart,
    })
}

/// A key's stored request and response as stored, from a row of: `request` (JSON text),
/// `response_status` (NULL while started), `response_headers` (JSON text), `response_body` (the
/// body, read apart when stored apart, in the same statement), `response_apart` (0 or 1),
/// `finished_seconds_ago` (NULL while started).
pub fn key_bodies<'r, R>(row: &'r R) -> Result<KeyBodies, EngineError>
where
    R: Row,
    &'static str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    Option<Vec<u8>>: Decode<'r, R::Database> + Type<R::Database>,
{
    let request: String = row.try_get("request").map_err(undecoded)?;
    let request = serde_json::from_str(&request)
        .map_err(|error| EngineError::Corrupt(format!("request: {error}")))?;
    let status: Option<i64> = row.try_get("response_status").map_err(undecoded)?;
    let response = match status {
        None => None,
        Some(status) => {
            let headers: String = row.try_get("response_headers").map_err(undecoded)?;
            let body: Option<Vec<u8>> = row.try_get("response_body").map_err(undecoded)?;
            let apart: i64 = row.try_get("response_apart").map_err(undecoded)?;
            Some(KeyResponse {
                status: narrow("response status", status)?,
                headers: serde_json::from_str(&headers)
                    .map_err(|error| EngineError::Corrupt(format!("response headers: {error}")))?,
                body: body.ok_or_else(|| {
                    EngineError::Corrupt("a done key's body stored apart is missing".to_owned())
                })?,
                apart: apart == 1,
            })
        }
    };
    Ok(KeyBodies {
        request,
        response,
        finished_seconds_ago: row.try_get("finished_seconds_ago").map_err(undecoded)?,
    })
}
