//! [`SqliteOperator`]: what operators' tools read and do on SQLite ([`Operator`]), and how they
//! open a database file by URL ([`OperatorEngine`] for [`SqliteStore`]).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{
    EngineError, KeyBodies, KeyReport, Migration, Operator, OperatorEngine, OperatorError,
    OperatorOptions, Overview, ScanFrom, TableStats,
};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{Sqlite, SqlitePool};

use crate::{OpenOptions, SqliteStore, StoreError};

/// A SQLite database, as operators' tools use it.
#[derive(Debug, Clone)]
pub struct SqliteOperator {
    pool: SqlitePool,
}

impl SqliteOperator {
    /// The tools' door to `pool`'s database.
    pub fn new(pool: SqlitePool) -> Self {
        Self { pool }
    }

    async fn connection(&self) -> Result<PoolConnection<Sqlite>, OperatorError> {
        self.pool.acquire().await.map_err(failed_sqlx)
    }
}

fn failed(error: StoreError) -> OperatorError {
    OperatorError::Engine(EngineError::from(error))
}

fn failed_sqlx(error: sqlx::Error) -> OperatorError {
    failed(StoreError::from(error))
}

#[async_trait]
impl Operator for SqliteOperator {
    fn engine(&self) -> &'static str {
        "SQLite"
    }

    async fn migrate(&self) -> Result<Option<Vec<Migration>>, OperatorError> {
        crate::migrate(&self.pool)
            .await
            .map_err(|error| OperatorError::Migrate(error.to_string()))?;
        Ok(Some(idemflow_store::migrations(&crate::MIGRATOR)))
    }

    async fn key_report(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<KeyReport>, OperatorError> {
        let mut connection = self.connection().await?;
        crate::key_report(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn key_bodies(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<KeyBodies>, OperatorError> {
        let mut connection = self.connection().await?;
        crate::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck_keys(
        &self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, OperatorError> {
        let mut connection = self.connection().await?;
        crate::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(failed)
    }

    /// Nothing announces due keys between processes on SQLite: resumers find it at their next
    /// scan.
    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, OperatorError> {
        let connection = self.connection().await?;
        let (advanced, _connection) = crate::end_lease(connection, tenant, key, lock_version)
            .await
            .map_err(failed)?;
        Ok(advanced)
    }

    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, OperatorError> {
        let connection = self.connection().await?;
        let (deleted, _connection) =
            crate::expire_key(connection, tenant, key, lock_version, state)
                .await
                .map_err(failed)?;
        Ok(deleted)
    }

    async fn expire_batch(&self, older_than: Duration, batch: i64) -> Result<u64, OperatorError> {
        let connection = self.connection().await?;
        let (deleted, _connection) = crate::expire_batch(connection, older_than, batch)
            .await
            .map_err(failed)?;
        Ok(deleted)
    }

    async fn table_stats(&self) -> Result<TableStats, OperatorError> {
        let mut connection = self.connection().await?;
        crate::table_stats(&mut connection).await.map_err(failed)
    }

    async fn overview(&self) -> Result<Overview, OperatorError> {
        let mut connection = self.connection().await?;
        crate::overview(&mut connection).await.map_err(failed)
    }

    async fn scan_keys(
        &self,
        from: &ScanFrom,
        limit: i64,
    ) -> Result<Vec<KeyReport>, OperatorError> {
        let mut connection = self.connection().await?;
        crate::scan_keys(&mut connection, from, limit)
            .await
            .map_err(failed)
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}

/// The file a SQLite URL names.
fn file_of(url: &str) -> Result<PathBuf, OperatorError> {
    let options = SqliteConnectOptions::from_str(url)
        .map_err(|error| OperatorError::Usage(format!("invalid database URL: {error}")))?;
    Ok(options.get_filename().to_path_buf())
}

#[async_trait]
impl OperatorEngine for SqliteStore {
    fn schemes(&self) -> &'static [&'static str] {
        &["sqlite"]
    }

    /// Opens the file with the engine's settings, migrating it; read-only, as it is, without
    /// migrating (a read-only open cannot write). Only `create` makes a file: otherwise a path
    /// with no database is a mistyped path.
    async fn open(
        &self,
        url: &str,
        options: &OperatorOptions,
    ) -> Result<Box<dyn Operator>, OperatorError> {
        let path = file_of(url)?;
        if !options.create && !path.exists() {
            return Err(OperatorError::Usage(format!(
                "no SQLite database at {} (idemflow migrate creates one)",
                path.display()
            )));
        }
        let cannot = |error: sqlx::Error| {
            OperatorError::Connect(format!("cannot open {}: {error}", path.display()))
        };
        let pool = if options.read_only {
            let connect = SqliteConnectOptions::new()
                .filename(&path)
                .create_if_missing(false)
                .read_only(true);
            SqlitePoolOptions::new()
                .max_connections(options.connections.max(1))
                .connect_with(connect)
                .await
                .map_err(cannot)?
        } else {
            let open = OpenOptions::default().with_max_connections(options.connections.max(1));
            crate::open_file(&path, &open).await.map_err(cannot)?
        };
        Ok(Box::new(SqliteOperator::new(pool)))
    }
}
