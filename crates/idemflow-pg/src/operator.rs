//! [`PgOperator`]: what operators' tools read and do on PostgreSQL ([`Operator`]), and how they
//! open it by URL ([`OperatorEngine`] for [`PgStore`]).

use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::layout::{Adopted, Maintained, Partition, PartitionPlan};
use idemflow_store::{
    EngineError, KeyBodies, KeyReport, Migration, Operator, OperatorEngine, OperatorError,
    OperatorOptions, Overview, Partitions, ScanFrom, SqlEngine, TableStats,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Postgres};

use crate::{PgStore, StoreError};

/// A PostgreSQL database, as operators' tools use it.
#[derive(Debug, Clone)]
pub struct PgOperator {
    pool: PgPool,
}

impl PgOperator {
    /// The tools' door to `pool`'s database.
    pub fn new(pool: PgPool) -> Self {
        Self { pool }
    }

    async fn connection(&self) -> Result<PoolConnection<Postgres>, OperatorError> {
        Ok(self.pool.acquire().await.map_err(PgStore::engine_error)?)
    }
}

fn failed(error: StoreError) -> OperatorError {
    match error {
        StoreError::Layout(message) => OperatorError::Usage(message),
        other => OperatorError::Engine(EngineError::from(other)),
    }
}

#[async_trait]
impl Operator for PgOperator {
    fn engine(&self) -> &'static str {
        "PostgreSQL"
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

    /// Idle resumers wake for the key now rather than at their next interval (`NOTIFY`).
    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, OperatorError> {
        let mut connection = self.connection().await?;
        let advanced = crate::end_lease(&mut connection, tenant, key, lock_version)
            .await
            .map_err(failed)?;
        if advanced.is_some() {
            crate::notify_due(&mut connection).await.map_err(failed)?;
        }
        Ok(advanced)
    }

    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, OperatorError> {
        let mut connection = self.connection().await?;
        crate::expire_key(&mut connection, tenant, key, lock_version, state)
            .await
            .map_err(failed)
    }

    async fn expire_batch(&self, older_than: Duration, batch: i64) -> Result<u64, OperatorError> {
        let mut connection = self.connection().await?;
        crate::expire_batch(&mut connection, older_than, batch)
            .await
            .map_err(failed)
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

    fn partitions(&self) -> Option<&dyn Partitions> {
        Some(self)
    }

    async fn close(&self) {
        self.pool.close().await;
    }
}

#[async_trait]
impl Partitions for PgOperator {
    async fn adopt(&self, plan: &PartitionPlan) -> Result<Adopted, OperatorError> {
        crate::partitions::adopt(&self.pool, plan)
            .await
            .map_err(failed)
    }

    async fn maintain(&self, keep_for: Duration) -> Result<Maintained, OperatorError> {
        crate::partitions::maintain(&self.pool, keep_for)
            .await
            .map_err(failed)
    }

    async fn list(&self) -> Result<Option<Vec<Partition>>, OperatorError> {
        let mut connection = self.connection().await?;
        if !crate::partitions::is_partitioned(&mut connection)
            .await
            .map_err(failed)?
        {
            return Ok(None);
        }
        crate::partitions::partitions(&mut connection)
            .await
            .map(Some)
            .map_err(failed)
    }
}

fn cannot_connect(why: String) -> OperatorError {
    OperatorError::Connect(format!("cannot connect to the database: {why}"))
}

#[async_trait]
impl OperatorEngine for PgStore {
    fn schemes(&self) -> &'static [&'static str] {
        &["postgres", "postgresql"]
    }

    /// One connection is opened first on its own: a pool that cannot connect reports only that
    /// it timed out, while a single connection says why (refused, authentication, no such
    /// database). The pool then opens its own.
    async fn open(
        &self,
        url: &str,
        options: &OperatorOptions,
    ) -> Result<Box<dyn Operator>, OperatorError> {
        let mut connect = PgConnectOptions::from_str(url)
            .map_err(|error| OperatorError::Usage(format!("invalid database URL: {error}")))?
            .application_name(&options.application_name);
        if options.read_only {
            connect = connect.options([("default_transaction_read_only", "on")]);
        }
        let timeout = options.connect_timeout;
        let probe = tokio::time::timeout(timeout, PgConnection::connect_with(&connect))
            .await
            .map_err(|_| cannot_connect(format!("no answer within {timeout:?}")))?
            .map_err(|error| cannot_connect(error.to_string()))?;
        // Closing politely is a courtesy; the pool opens its own connections.
        let _ = probe.close().await;
        let pool = PgPoolOptions::new()
            .max_connections(options.connections.max(1))
            .acquire_timeout(timeout)
            .test_before_acquire(false)
            .connect_lazy_with(connect);
        Ok(Box::new(PgOperator::new(pool)))
    }
}
