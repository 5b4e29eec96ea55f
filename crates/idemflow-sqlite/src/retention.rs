//! Retention on SQLite: one batch at a time ([`expire_batch`]), each its own short write
//! transaction, so requests' writes interleave with a long expiry instead of waiting for it.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{Row, Sqlite};

use crate::claim::millis;
use crate::error::StoreError;
use crate::statements;
use crate::transaction::Transaction;

/// Deletes up to `batch` finished keys whose window (`keep_for`, from their finish) is over,
/// with their bodies stored apart, in one write transaction. Returns how many keys it deleted
/// (fewer than `batch`: nothing more is due) and the connection.
pub async fn expire_batch(
    connection: PoolConnection<Sqlite>,
    keep_for: Duration,
    batch: i64,
) -> Result<(u64, PoolConnection<Sqlite>), StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let deleted = sqlx::query(statements::EXPIRE_BATCH)
        .bind(millis(keep_for))
        .bind(batch)
        .fetch_all(transaction.connection())
        .await?;
    for row in &deleted {
        let (tenant, key, life): (String, String, i64) = (
            row.try_get("tenant")?,
            row.try_get("key")?,
            row.try_get("life")?,
        );
        sqlx::query(statements::DELETE_APART)
            .bind(tenant)
            .bind(key)
            .bind(life)
            .execute(transaction.connection())
            .await?;
    }
    let count = deleted.len() as u64;
    Ok((count, transaction.commit().await?))
}
