//! [`migrate`]: the engine's migrations, one process at a time.

use sqlx::migrate::MigrateError;
use sqlx::{Connection, SqlitePool};

/// Applies every pending migration. Safe to call from many processes at once: the migrator runs
/// inside `BEGIN IMMEDIATE` on one connection, so it holds SQLite's one write lock from its first
/// statement, and a second process starting together waits for it (up to its busy timeout), then
/// finds the migrations applied. Each migration is a savepoint inside it, and all of them commit
/// together.
///
/// sqlx's migrator takes no lock on SQLite: processes started together each found the tables
/// missing and raced their `CREATE`s, and all but one died at start-up ("table idempotency_keys
/// already exists", "database is locked").
pub async fn migrate(pool: &SqlitePool) -> Result<(), MigrateError> {
    let mut connection = pool.acquire().await?;
    let mut transaction = connection.begin_with("BEGIN IMMEDIATE").await?;
    // `run_direct`: `run` on a borrowed connection is not `Send` in an async trait's future.
    crate::MIGRATOR
        .run_direct(None, &mut *transaction, false)
        .await?;
    transaction.commit().await?;
    Ok(())
}
