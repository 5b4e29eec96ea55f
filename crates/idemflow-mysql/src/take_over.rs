//! Taking over a started key whose lease is over ([`take_over`]), and the resumer's scan
//! ([`take_over_due`]), by polling (MySQL has no notifications between sessions).

use std::time::Duration;

use idemflow_core::{Key, TenantId};
use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection, Row};

use crate::claim::millis;
use crate::error::StoreError;
use crate::statements;
use crate::transaction::Transaction;
use idemflow_store::{Owner, fresh_holder};

/// A key taken over: its new owner and where its execution stands.
pub type TakenOver = idemflow_store::Taken<Owner>;

/// Takes `key` over from the owner holding `seen` (its lease over), with a fresh token and a
/// lease of `lease`, and commits. `None` when the key moved on (another taker, a renewal, done).
pub async fn take_over(
    connection: PoolConnection<MySql>,
    tenant: &TenantId,
    key: &Key,
    seen: i64,
    lease: Duration,
) -> Result<(Option<TakenOver>, PoolConnection<MySql>), StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let taken = take_over_in(transaction.connection(), tenant, key, seen, lease).await?;
    Ok((taken, transaction.commit().await?))
}

/// Takes `key` over as [`take_over`] does, inside the caller's transaction (a client retry's
/// takeover commits with its first phase): the fenced update, then the row it locked. The
/// journal names the taker a `retry`.
pub async fn take_over_in(
    connection: &mut MySqlConnection,
    tenant: &TenantId,
    key: &Key,
    seen: i64,
    lease: Duration,
) -> Result<Option<TakenOver>, StoreError> {
    take_over_by(connection, tenant, key, seen, lease, "retry").await
}

/// [`take_over_in`], the journal's entry naming the taker `by` (`retry` or `resumer`).
async fn take_over_by(
    connection: &mut MySqlConnection,
    tenant: &TenantId,
    key: &Key,
    seen: i64,
    lease: Duration,
    by: &str,
) -> Result<Option<TakenOver>, StoreError> {
    let lease_from = std::time::Instant::now();
    let holder = fresh_holder();
    let updated = sqlx::query(statements::TAKE_OVER)
        .bind(by)
        .bind(holder)
        .bind(millis(lease))
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(seen)
        .execute(&mut *connection)
        .await?
        .rows_affected();
    if updated != 1 {
        return Ok(None);
    }
    let row = sqlx::query(statements::TAKEN)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .fetch_one(connection)
        .await?;
    let json = |text: Option<String>| -> Result<Option<Value>, StoreError> {
        text.map(|text| serde_json::from_str(&text))
            .transpose()
            .map_err(|error| StoreError::Corrupt(format!("stored JSON: {error}")))
    };
    let request: Option<String> = row.try_get("request")?;
    let attempts: i32 = row.try_get("attempts")?;
    Ok(Some(TakenOver {
        owner: Owner::holding(
            tenant.clone(),
            key.clone(),
            row.try_get("lock_version")?,
            holder,
        ),
        recovery_point: row.try_get("recovery_point")?,
        phase_output: json(row.try_get("phase_output")?)?,
        request: json(request)?.unwrap_or(Value::Null),
        attempts: i64::from(attempts),
        last_error: row.try_get("last_error")?,
        lease_from,
    }))
}

/// Takes over up to `batch` started keys whose lease is over, of the named workflows only, each
/// with its workflow's lease, in one transaction: the scan locks the due rows, skipping any
/// another transaction holds (another resumer's scan, an owner's write), so two resumers never
/// wait for each other nor take the same key. Each comes with its workflow's name; the journal
/// names the taker a `resumer`.
pub async fn take_over_due(
    connection: PoolConnection<MySql>,
    workflows: &[(String, Duration)],
    batch: i64,
) -> Result<(Vec<(String, TakenOver)>, PoolConnection<MySql>), StoreError> {
    let names: Vec<&str> = workflows.iter().map(|(name, _)| name.as_str()).collect();
    let names = serde_json::to_string(&names)
        .map_err(|error| StoreError::Corrupt(format!("workflow names: {error}")))?;
    let mut transaction = Transaction::begin(connection).await?;
    let rows = sqlx::query(statements::DUE_OF)
        .bind(names)
        .bind(batch)
        .fetch_all(transaction.connection())
        .await?;
    let mut taken = Vec::with_capacity(rows.len());
    for row in rows {
        let tenant = text(&row, "tenant")?;
        let key = text(&row, "key")?;
        let seen: i64 = row.try_get("lock_version")?;
        let workflow: String = row.try_get("workflow")?;
        let tenant =
            TenantId::new(tenant).map_err(|error| StoreError::Corrupt(error.to_string()))?;
        let key = Key::parse(&key).map_err(|error| StoreError::Corrupt(error.to_string()))?;
        let lease = workflows
            .iter()
            .find(|(name, _)| *name == workflow)
            .map_or(Duration::ZERO, |(_, lease)| *lease);
        if let Some(one) = take_over_by(
            transaction.connection(),
            &tenant,
            &key,
            seen,
            lease,
            "resumer",
        )
        .await?
        {
            taken.push((workflow, one));
        }
    }
    Ok((taken, transaction.commit().await?))
}

/// A VARBINARY column read as the text it was written from.
pub(crate) fn text(row: &sqlx::mysql::MySqlRow, column: &str) -> Result<String, StoreError> {
    let bytes: Vec<u8> = row.try_get(column)?;
    String::from_utf8(bytes).map_err(|error| StoreError::Corrupt(format!("{column}: {error}")))
}

/// Started keys due now of workflows not in `workflows`, counted by workflow: keys no resumer
/// that knows only these can finish.
pub async fn count_due_unknown(
    connection: &mut MySqlConnection,
    workflows: &[String],
) -> Result<Vec<(String, i64)>, StoreError> {
    let names = serde_json::to_string(workflows)
        .map_err(|error| StoreError::Corrupt(format!("workflow names: {error}")))?;
    Ok(sqlx::query_as(statements::COUNT_DUE_UNKNOWN)
        .bind(names)
        .fetch_all(connection)
        .await?)
}

/// How long the oldest lapsed lease of a started key has been over: how far behind resumers are.
pub async fn resumer_lag(connection: &mut MySqlConnection) -> Result<Duration, StoreError> {
    let lag_ms: i64 = sqlx::query_scalar(statements::RESUMER_LAG)
        .fetch_one(connection)
        .await?;
    Ok(Duration::from_millis(u64::try_from(lag_ms).unwrap_or(0)))
}
