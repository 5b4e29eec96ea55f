//! The commands on a SQLite database (`sqlite://path`), their answers the same as on
//! PostgreSQL: `migrate`, `expire`, the key-level ones (`inspect`, `list --stuck`, `end-lease`)
//! and `stats`. `partitions` answers that it is PostgreSQL's only: the partitioned layout has no
//! SQLite form (docs/engines.md).

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use sqlx::SqlitePool;
use sqlx::sqlite::SqliteConnectOptions;

use idemflow_pg::{KeyBodies, KeyReport};

use crate::{
    Answer, CliError, Format, InspectOptions, Keys, Output, emit, end_lease_answer, expired,
    inspect_answer, list_stuck_answer, migrated, stats_of,
};

/// Whether `url` names a SQLite database.
pub fn is_sqlite(url: &str) -> bool {
    url.starts_with("sqlite:")
}

/// The file a SQLite URL names.
fn file_of(url: &str) -> Result<PathBuf, CliError> {
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|error| CliError::Usage(format!("invalid database URL: {error}")))?;
    Ok(options.get_filename().to_path_buf())
}

/// Opens the database `url` names with the engine's settings (migrating it). Only `migrate`
/// creates a file: any other command on a path with no database is a mistyped path.
async fn open(url: &str, create: bool) -> Result<SqlitePool, CliError> {
    let path = file_of(url)?;
    if !create && !path.exists() {
        return Err(CliError::Usage(format!(
            "no SQLite database at {} (idemflow migrate creates one)",
            path.display()
        )));
    }
    idemflow_sqlite::open_file(Path::new(&path), &idemflow_sqlite::OpenOptions::default())
        .await
        .map_err(|error| CliError::Database(format!("cannot open {}: {error}", path.display())))
}

/// `idemflow migrate` on SQLite: creates the file if need be and applies every migration.
pub async fn migrate(url: &str, format: Format) -> Output {
    emit(format, migrate_answer(url).await)
}

async fn migrate_answer(url: &str) -> Result<Answer, CliError> {
    let pool = open(url, true).await?;
    pool.close().await;
    Ok(migrated(
        format!(
            "schema up to date ({}); migrations applied:\n",
            file_of(url)?.display()
        ),
        &idemflow_sqlite::MIGRATOR,
    ))
}

/// `idemflow expire` on SQLite: deletes every key finished more than `older_than` ago,
/// `batch_size` keys per write transaction, so requests' writes interleave with it.
pub async fn expire(url: &str, format: Format, older_than: Duration, batch_size: i64) -> Output {
    emit(format, expire_answer(url, older_than, batch_size).await)
}

async fn expire_answer(
    url: &str,
    older_than: Duration,
    batch_size: i64,
) -> Result<Answer, CliError> {
    if batch_size < 1 {
        return Err(CliError::Usage(
            "--batch-size must be at least 1".to_owned(),
        ));
    }
    let pool = open(url, false).await?;
    let mut deleted = 0;
    loop {
        let connection = pool.acquire().await.map_err(database)?;
        let (batch, _) = idemflow_sqlite::expire_batch(connection, older_than, batch_size)
            .await
            .map_err(|error| CliError::Database(error.to_string()))?;
        deleted += batch;
        if batch < u64::try_from(batch_size).unwrap_or(u64::MAX) {
            break;
        }
    }
    pool.close().await;
    Ok(expired(deleted, older_than, batch_size))
}

fn database(error: sqlx::Error) -> CliError {
    CliError::Database(error.to_string())
}

/// The key-level commands' access to a SQLite database.
struct SqliteKeys(SqlitePool);

fn store_error(error: idemflow_sqlite::StoreError) -> CliError {
    CliError::Database(error.to_string())
}

impl Keys for SqliteKeys {
    async fn key_report(&mut self, tenant: &str, key: &str) -> Result<Option<KeyReport>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_sqlite::key_report(&mut connection, tenant, key)
            .await
            .map_err(store_error)
    }

    async fn key_bodies(&mut self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_sqlite::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(store_error)
    }

    async fn stuck_keys(
        &mut self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_sqlite::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(store_error)
    }

    /// SQLite has no notifications: resumers find the key at their next poll.
    async fn end_lease(
        &mut self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, CliError> {
        let connection = self.0.acquire().await.map_err(database)?;
        let (ended, _) = idemflow_sqlite::end_lease(connection, tenant, key, lock_version)
            .await
            .map_err(store_error)?;
        Ok(ended)
    }
}

/// `idemflow inspect` on SQLite.
pub async fn inspect(
    url: &str,
    format: Format,
    tenant: &str,
    key: &str,
    options: &InspectOptions,
) -> Output {
    emit(
        format,
        async {
            let mut keys = SqliteKeys(open(url, false).await?);
            let answer = inspect_answer(&mut keys, tenant, key, options).await;
            keys.0.close().await;
            answer
        }
        .await,
    )
}

/// `idemflow list --stuck` on SQLite.
pub async fn list_stuck(url: &str, format: Format, min_attempts: i32, limit: i64) -> Output {
    emit(
        format,
        async {
            let mut keys = SqliteKeys(open(url, false).await?);
            let answer = list_stuck_answer(&mut keys, min_attempts, limit).await;
            keys.0.close().await;
            answer
        }
        .await,
    )
}

/// `idemflow end-lease` on SQLite.
pub async fn end_lease(url: &str, format: Format, tenant: &str, key: &str, force: bool) -> Output {
    emit(
        format,
        async {
            let mut keys = SqliteKeys(open(url, false).await?);
            let answer = end_lease_answer(&mut keys, tenant, key, force).await;
            keys.0.close().await;
            answer
        }
        .await,
    )
}

/// `idemflow stats` on SQLite.
pub async fn stats(url: &str, format: Format) -> Output {
    emit(
        format,
        async {
            let pool = open(url, false).await?;
            let mut connection = pool.acquire().await.map_err(database)?;
            let stats = idemflow_sqlite::table_stats(&mut connection)
                .await
                .map_err(store_error);
            drop(connection);
            pool.close().await;
            Ok(stats_of(&stats?))
        }
        .await,
    )
}

/// A command SQLite does not have.
pub fn not_yet(command: &str, format: Format) -> Output {
    CliError::Usage(format!(
        "`idemflow {command}` is PostgreSQL's only: the partitioned layout has no SQLite form \
         (docs/engines.md)"
    ))
    .output(format)
}
