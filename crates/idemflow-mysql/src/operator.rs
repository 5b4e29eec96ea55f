//! [`MySqlOperator`]: what operators' tools read and do on MySQL/MariaDB ([`Operator`]), and how
//! they open it by URL ([`OperatorEngine`] for [`MySqlStore`]).

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{
    EngineError, KeyBodies, KeyReport, Migration, Operator, OperatorEngine, OperatorError,
    OperatorOptions, Overview, ScanFrom, TableStats,
};
use sqlx::Executor;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlPool};

use crate::{MySqlStore, OpenOptions, StoreError};

/// A MySQL or MariaDB database, as operators' tools use it.
#[derive(Debug, Clone)]
pub struct MySqlOperator {
    pool: MySqlPool,
}

impl MySqlOperator {
    /// The tools' door to `pool`'s database.
    pub fn new(pool: MySqlPool) -> Self {
        Self { pool }
    }

    async fn connection(&self) -> Result<PoolConnection<MySql>, OperatorError> {
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
impl Operator for MySqlOperator {
    fn engine(&self) -> &'static str {
        "MariaDB"
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

    /// Nothing announces due keys between sessions on MySQL: resumers find it at their next
    /// scan.
    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, OperatorError> {
        let mut connection = self.connection().await?;
        crate::end_lease(&mut connection, tenant, key, lock_version)
            .await
            .map_err(failed)
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

#[async_trait]
impl OperatorEngine for MySqlStore {
    fn schemes(&self) -> &'static [&'static str] {
        &["mysql", "mariadb"]
    }

    /// Connects with the engine's session settings, migrating the schema; read-only, with
    /// read-only sessions and without migrating (a read-only session cannot write).
    async fn open(
        &self,
        url: &str,
        options: &OperatorOptions,
    ) -> Result<Box<dyn Operator>, OperatorError> {
        let url = url.replacen("mariadb:", "mysql:", 1);
        let connect = MySqlConnectOptions::from_str(&url)
            .map_err(|error| OperatorError::Usage(format!("invalid database URL: {error}")))?;
        let cannot = |error: sqlx::Error| {
            OperatorError::Connect(format!("cannot open the MySQL database: {error}"))
        };
        let connections = options.connections.max(1);
        let pool = if options.read_only {
            MySqlPoolOptions::new()
                .max_connections(connections)
                .acquire_timeout(options.connect_timeout)
                .after_connect(|connection, _| {
                    Box::pin(async move {
                        connection
                            .execute("SET SESSION TRANSACTION READ ONLY")
                            .await?;
                        Ok(())
                    })
                })
                .connect_with(connect)
                .await
                .map_err(cannot)?
        } else {
            let open = OpenOptions::default().with_max_connections(connections);
            crate::open(&url, &open).await.map_err(cannot)?
        };
        Ok(Box::new(MySqlOperator::new(pool)))
    }
}
