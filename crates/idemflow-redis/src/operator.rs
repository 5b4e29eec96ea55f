//! [`RedisOperator`]: what operators' tools read and do on the Redis store ([`Operator`]), and
//! how they open it by URL ([`OperatorEngine`] for [`RedisStore`]). Every read goes through the
//! store's own indexes, never a scan of the keyspace.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{
    Engine, EngineError, KeyBodies, KeyReport, Migration, Operator, OperatorEngine, OperatorError,
    OperatorOptions, Overview, ScanFrom, TableStats,
};

use crate::{DEFAULT_PREFIX, RedisPool, RedisStore, StoreError};

/// The Redis store, as operators' tools use it.
#[derive(Debug, Clone)]
pub struct RedisOperator {
    pool: RedisPool,
}

impl RedisOperator {
    /// The tools' door to `pool`'s keys.
    pub fn new(pool: RedisPool) -> Self {
        Self { pool }
    }
}

fn failed(error: StoreError) -> OperatorError {
    OperatorError::Engine(EngineError::from(error))
}

#[async_trait]
impl Operator for RedisOperator {
    fn engine(&self) -> &'static str {
        "Redis"
    }

    /// Redis has no schema: nothing to migrate.
    async fn migrate(&self) -> Result<Option<Vec<Migration>>, OperatorError> {
        Ok(None)
    }

    async fn key_report(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<KeyReport>, OperatorError> {
        crate::key_report(&self.pool, tenant, key)
            .await
            .map_err(failed)
    }

    async fn key_bodies(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<KeyBodies>, OperatorError> {
        crate::key_bodies(&self.pool, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck_keys(
        &self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, OperatorError> {
        crate::stuck_keys(&self.pool, min_attempts, limit)
            .await
            .map_err(failed)
    }

    /// Nothing announces due keys on Redis: resumers find the key at their next scan.
    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, OperatorError> {
        crate::end_lease(&self.pool, tenant, key, lock_version)
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
        crate::expire_key(&self.pool, tenant, key, lock_version, state)
            .await
            .map_err(failed)
    }

    async fn expire_batch(&self, older_than: Duration, batch: i64) -> Result<u64, OperatorError> {
        Ok(RedisStore::expire_batch(&self.pool, older_than, batch).await?)
    }

    /// Started keys by workflow (the sorted sets of lease ends) and finished keys in all (the
    /// set of finishes, which does not keep workflows: counted under `*`), the oldest started
    /// key and the resumer's lag.
    async fn table_stats(&self) -> Result<TableStats, OperatorError> {
        let overview = crate::overview(&self.pool).await.map_err(failed)?;
        let finished = crate::finished_keys(&self.pool).await.map_err(failed)?;
        let mut counts: Vec<(String, String, i64)> = overview
            .started
            .into_iter()
            .map(|started| (started.workflow, "started".to_owned(), started.keys))
            .collect();
        counts.push(("*".to_owned(), "done".to_owned(), finished));
        Ok(TableStats {
            counts,
            oldest_started_seconds: overview.oldest_started_seconds,
            resumer_lag_ms: overview.resumer_lag_ms,
        })
    }

    async fn overview(&self) -> Result<Overview, OperatorError> {
        crate::overview(&self.pool).await.map_err(failed)
    }

    async fn scan_keys(
        &self,
        from: &ScanFrom,
        limit: i64,
    ) -> Result<Vec<KeyReport>, OperatorError> {
        crate::scan_keys(&self.pool, from, limit)
            .await
            .map_err(failed)
    }

    /// One shared connection, closed when the last clone goes.
    async fn close(&self) {}
}

#[async_trait]
impl OperatorEngine for RedisStore {
    fn schemes(&self) -> &'static [&'static str] {
        &["redis", "rediss"]
    }

    /// Connects, the keys under `options.key_prefix` (default [`DEFAULT_PREFIX`]), to one Redis or
    /// a Redis Cluster (one node's URL, or several separated by commas). Redis has no read-only
    /// session: a read-only
    /// tool refuses its writes itself, and a read-only Redis user refuses them too.
    async fn open(
        &self,
        url: &str,
        options: &OperatorOptions,
    ) -> Result<Box<dyn Operator>, OperatorError> {
        let prefix = options.key_prefix.as_deref().unwrap_or(DEFAULT_PREFIX);
        let pool =
            RedisPool::connect_with_prefix(url, prefix)
                .await
                .map_err(|error| match error {
                    StoreError::Prefix(_) => OperatorError::Unsupported(error.to_string()),
                    error => OperatorError::Connect(format!("cannot connect to Redis: {error}")),
                })?;
        Ok(Box::new(RedisOperator::new(pool)))
    }
}
