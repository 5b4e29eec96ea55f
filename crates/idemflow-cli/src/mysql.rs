//! The commands on a MySQL or MariaDB database (`mysql://…`), their answers the same as on
//! PostgreSQL: `migrate`, `expire`, the key-level ones (`inspect`, `list --stuck`, `end-lease`)
//! and `stats`. `partitions` answers that it is PostgreSQL's only: the partitioned layout has no
//! MySQL form yet (docs/engines.md).

use std::time::Duration;

use sqlx::MySqlPool;

use idemflow_pg::{KeyBodies, KeyReport};

use crate::{
    Answer, CliError, Format, InspectOptions, Keys, Output, emit, end_lease_answer, expired,
    inspect_answer, list_stuck_answer, migrated, stats_of,
};

/// Whether `url` names a MySQL or MariaDB database.
pub fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql:") || url.starts_with("mariadb:")
}

/// Opens the database `url` names with the engine's session settings (migrating it).
async fn open(url: &str) -> Result<MySqlPool, CliError> {
    let url = url.replacen("mariadb:", "mysql:", 1);
    idemflow_mysql::open(&url, &idemflow_mysql::OpenOptions::default())
        .await
        .map_err(|error| CliError::Database(format!("cannot open the MySQL database: {error}")))
}

/// `idemflow migrate` on MySQL/MariaDB: applies every migration.
pub async fn migrate(url: &str, format: Format) -> Output {
    emit(format, migrate_answer(url).await)
}

async fn migrate_answer(url: &str) -> Result<Answer, CliError> {
    let pool = open(url).await?;
    pool.close().await;
    Ok(migrated(
        "schema up to date; migrations applied:\n".to_owned(),
        &idemflow_mysql::MIGRATOR,
    ))
}

/// `idemflow expire` on MySQL/MariaDB: deletes every key finished more than `older_than` ago,
/// `batch_size` keys per transaction, so requests' writes interleave with it.
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
    let pool = open(url).await?;
    let mut deleted = 0;
    loop {
        let connection = pool.acquire().await.map_err(database)?;
        let (batch, _) = idemflow_mysql::expire_batch(connection, older_than, batch_size)
            .await
            .map_err(store_error)?;
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

fn store_error(error: idemflow_mysql::StoreError) -> CliError {
    CliError::Database(error.to_string())
}

/// The key-level commands' access to a MySQL/MariaDB database.
struct MySqlKeys(MySqlPool);

impl Keys for MySqlKeys {
    async fn key_report(&mut self, tenant: &str, key: &str) -> Result<Option<KeyReport>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_mysql::key_report(&mut connection, tenant, key)
            .await
            .map_err(store_error)
    }

    async fn key_bodies(&mut self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_mysql::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(store_error)
    }

    async fn stuck_keys(
        &mut self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_mysql::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(store_error)
    }

    /// MySQL has no notifications: resumers find the key at their next poll.
    async fn end_lease(
        &mut self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, CliError> {
        let mut connection = self.0.acquire().await.map_err(database)?;
        idemflow_mysql::end_lease(&mut connection, tenant, key, lock_version)
            .await
            .map_err(store_error)
    }
}

/// `idemflow inspect` on MySQL/MariaDB.
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
            let mut keys = MySqlKeys(open(url).await?);
            let answer = inspect_answer(&mut keys, tenant, key, options).await;
            keys.0.close().await;
            answer
        }
        .await,
    )
}

/// `idemflow list --stuck` on MySQL/MariaDB.
pub async fn list_stuck(url: &str, format: Format, min_attempts: i32, limit: i64) -> Output {
    emit(
        format,
        async {
            let mut keys = MySqlKeys(open(url).await?);
            let answer = list_stuck_answer(&mut keys, min_attempts, limit).await;
            keys.0.close().await;
            answer
        }
        .await,
    )
}

/// `idemflow end-lease` on MySQL/MariaDB.
pub async fn end_lease(url: &str, format: Format, tenant: &str, key: &str, force: bool) -> Output {
    emit(
        format,
        async {
            let mut keys = MySqlKeys(open(url).await?);
            let answer = end_lease_answer(&mut keys, tenant, key, force).await;
            keys.0.close().await;
            answer
        }
        .await,
    )
}

/// `idemflow stats` on MySQL/MariaDB.
pub async fn stats(url: &str, format: Format) -> Output {
    emit(
        format,
        async {
            let pool = open(url).await?;
            let mut connection = pool.acquire().await.map_err(database)?;
            let stats = idemflow_mysql::table_stats(&mut connection)
                .await
                .map_err(store_error);
            drop(connection);
            pool.close().await;
            Ok(stats_of(&stats?))
        }
        .await,
    )
}

/// A command MySQL does not have.
pub fn not_yet(command: &str, format: Format) -> Output {
    CliError::Usage(format!(
        "`idemflow {command}` is PostgreSQL's only: the partitioned layout has no MySQL form \
         (docs/engines.md)"
    ))
    .output(format)
}
