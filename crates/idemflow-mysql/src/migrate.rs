//! [`migrate`]: the engine's migrations, one process at a time.

use std::time::Duration;

use sqlx::MySqlPool;
use sqlx::migrate::MigrateError;

/// How long a process starting while another migrates waits for it.
const WAIT: Duration = Duration::from_secs(60);

/// The named lock the migrator runs under: one per database (a server holds many), its name
/// within the server's 64 characters whatever the database's.
const LOCK: &str = "CONCAT('idemflow-migrate:', SHA1(DATABASE()))";

/// Applies every pending migration. Safe to call from many processes at once: the migrator runs
/// on one session holding the database's named lock (`GET_LOCK`), so a second process starting
/// together waits for it (up to a minute), then finds the migrations applied.
///
/// sqlx's migrator has a lock of its own, `GET_LOCK(name, -1)`, meant to wait for ever: MariaDB
/// reads a negative timeout as no wait at all, and goes on without the lock. Processes started
/// together then each applied the migrations, and all but one died at start-up (1062, a duplicate
/// version in `_sqlx_migrations`).
pub async fn migrate(pool: &MySqlPool) -> Result<(), MigrateError> {
    let mut connection = pool.acquire().await?;
    let locked: Option<i64> =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT GET_LOCK({LOCK}, ?)")))
            .bind(WAIT.as_secs())
            .fetch_one(&mut *connection)
            .await?;
    if locked != Some(1) {
        return Err(MigrateError::Execute(sqlx::Error::Protocol(format!(
            "another process held the migration lock for {WAIT:?}"
        ))));
    }
    // `run_direct`: `run` on a borrowed connection is not `Send` in an async trait's future.
    let migrated = crate::MIGRATOR
        .run_direct(None, &mut *connection, false)
        .await;
    let released = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT RELEASE_LOCK({LOCK})")))
        .execute(&mut *connection)
        .await;
    migrated?;
    released?;
    Ok(())
}
