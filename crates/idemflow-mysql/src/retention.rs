//! Retention on MySQL/MariaDB: one batch at a time ([`expire_batch`]), each its own short
//! transaction, so requests' writes interleave with a long expiry instead of waiting for it.

use std::time::Duration;

use sqlx::MySql;
use sqlx::pool::PoolConnection;

use crate::claim::millis;
use crate::error::StoreError;
use crate::statements;
use crate::transaction::Transaction;

/// Deletes up to `batch` finished keys whose window (`keep_for`, from their finish) is over,
/// with their bodies stored apart, in one transaction of three statements. The batch's rows are
/// locked first, skipping any another transaction holds, so two workers' retention never wait
/// for each other. Returns how many keys it deleted (fewer than `batch`: nothing more is due, or
/// the rest were locked) and the connection.
pub async fn expire_batch(
    connection: PoolConnection<MySql>,
    keep_for: Duration,
    batch: i64,
) -> Result<(u64, PoolConnection<MySql>), StoreError> {
    let mut transaction = Transaction::begin(connection).await?;
    let lives: Vec<i64> = sqlx::query_scalar(statements::EXPIRE_DUE)
        .bind(millis(keep_for))
        .bind(batch)
        .fetch_all(transaction.connection())
        .await?;
    if lives.is_empty() {
        return Ok((0, transaction.commit().await?));
    }
    let keys = statements::lives(statements::DELETE_DONE_LIVES, lives.len());
    let mut delete = sqlx::query(sqlx::AssertSqlSafe(keys));
    for life in &lives {
        delete = delete.bind(life);
    }
    let deleted = delete
        .execute(transaction.connection())
        .await?
        .rows_affected();
    let bodies = statements::lives(statements::DELETE_APART_LIVES, lives.len());
    let mut delete = sqlx::query(sqlx::AssertSqlSafe(bodies));
    for life in &lives {
        delete = delete.bind(life);
    }
    delete.execute(transaction.connection()).await?;
    Ok((deleted, transaction.commit().await?))
}
