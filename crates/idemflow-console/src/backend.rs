//! The console's one door to a database, whatever the engine: what it reads (the overview, a page
//! of keys, one key, the stuck keys) and the two things it does (end a lease, expire a key), each
//! a call of the engine crate's own function, so the console holds no SQL.

use async_trait::async_trait;
use idemflow_store::{KeyBodies, KeyReport, Overview, ScanFrom};
use sqlx::{MySqlPool, PgPool, SqlitePool};

/// A database call that failed, with the engine's message.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

fn failed(error: impl std::fmt::Display) -> BackendError {
    BackendError(error.to_string())
}

/// One engine's database, as the console uses it.
#[async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The engine's name, shown in the console's header.
    fn engine(&self) -> &'static str;
    /// The table at a glance.
    async fn overview(&self) -> Result<Overview, BackendError>;
    /// Up to `limit` keys from `from`, in key order.
    async fn scan(&self, from: &ScanFrom, limit: i64) -> Result<Vec<KeyReport>, BackendError>;
    /// One key.
    async fn key(&self, tenant: &str, key: &str) -> Result<Option<KeyReport>, BackendError>;
    /// One key's stored request and response, as stored (sealed where sealed).
    async fn bodies(&self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, BackendError>;
    /// Started keys past their lease or with `min_attempts` attempts, oldest lease first.
    async fn stuck(&self, min_attempts: i32, limit: i64) -> Result<Vec<KeyReport>, BackendError>;
    /// Ends a started key's lease if its token is still `lock_version`: the new token.
    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, BackendError>;
    /// Deletes a key if its token is still `lock_version` and its state `state` (as shown): the
    /// state of the key it deleted, `None` when it moved on.
    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, BackendError>;
}

/// PostgreSQL.
#[derive(Debug, Clone)]
pub struct Postgres(pub PgPool);

#[async_trait]
impl Backend for Postgres {
    fn engine(&self) -> &'static str {
        "PostgreSQL"
    }

    async fn overview(&self) -> Result<Overview, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_pg::overview(&mut connection).await.map_err(failed)
    }

    async fn scan(&self, from: &ScanFrom, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_pg::scan_keys(&mut connection, from, limit)
            .await
            .map_err(failed)
    }

    async fn key(&self, tenant: &str, key: &str) -> Result<Option<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_pg::key_report(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn bodies(&self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_pg::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck(&self, min_attempts: i32, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_pg::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(failed)
    }

    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        let advanced = idemflow_pg::end_lease(&mut connection, tenant, key, lock_version)
            .await
            .map_err(failed)?;
        if advanced.is_some() {
            // Idle resumers wake for the key now rather than at their next interval.
            idemflow_pg::notify_due(&mut connection)
                .await
                .map_err(failed)?;
        }
        Ok(advanced)
    }

    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_pg::expire_key(&mut connection, tenant, key, lock_version, state)
            .await
            .map_err(failed)
    }
}

/// SQLite.
#[derive(Debug, Clone)]
pub struct Sqlite(pub SqlitePool);

#[async_trait]
impl Backend for Sqlite {
    fn engine(&self) -> &'static str {
        "SQLite"
    }

    async fn overview(&self) -> Result<Overview, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_sqlite::overview(&mut connection)
            .await
            .map_err(failed)
    }

    async fn scan(&self, from: &ScanFrom, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_sqlite::scan_keys(&mut connection, from, limit)
            .await
            .map_err(failed)
    }

    async fn key(&self, tenant: &str, key: &str) -> Result<Option<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_sqlite::key_report(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn bodies(&self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_sqlite::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck(&self, min_attempts: i32, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_sqlite::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(failed)
    }

    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, BackendError> {
        let connection = self.0.acquire().await.map_err(failed)?;
        let (advanced, _connection) =
            idemflow_sqlite::end_lease(connection, tenant, key, lock_version)
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
    ) -> Result<Option<String>, BackendError> {
        let connection = self.0.acquire().await.map_err(failed)?;
        let (deleted, _connection) =
            idemflow_sqlite::expire_key(connection, tenant, key, lock_version, state)
                .await
                .map_err(failed)?;
        Ok(deleted)
    }
}

/// MariaDB (or MySQL).
#[derive(Debug, Clone)]
pub struct MySql(pub MySqlPool);

#[async_trait]
impl Backend for MySql {
    fn engine(&self) -> &'static str {
        "MariaDB"
    }

    async fn overview(&self) -> Result<Overview, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_mysql::overview(&mut connection)
            .await
            .map_err(failed)
    }

    async fn scan(&self, from: &ScanFrom, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_mysql::scan_keys(&mut connection, from, limit)
            .await
            .map_err(failed)
    }

    async fn key(&self, tenant: &str, key: &str) -> Result<Option<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_mysql::key_report(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn bodies(&self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_mysql::key_bodies(&mut connection, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck(&self, min_attempts: i32, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_mysql::stuck_keys(&mut connection, min_attempts, limit)
            .await
            .map_err(failed)
    }

    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, BackendError> {
        let mut connection = self.0.acquire().await.map_err(failed)?;
        idemflow_mysql::end_lease(&mut connection, tenant, key, lock_version)
            .await
            .map_err(failed)
    }

    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, BackendError> {
        let connection = self.0.acquire().await.map_err(failed)?;
        let (deleted, _connection) =
            idemflow_mysql::expire_key(connection, tenant, key, lock_version, state)
                .await
                .map_err(failed)?;
        Ok(deleted)
    }
}

/// Redis (the `redis` feature): the store's own indexes, never a scan of the keyspace.
#[cfg(feature = "redis")]
#[derive(Debug, Clone)]
pub struct Redis(pub idemflow_redis::RedisPool);

#[cfg(feature = "redis")]
#[async_trait]
impl Backend for Redis {
    fn engine(&self) -> &'static str {
        "Redis"
    }

    async fn overview(&self) -> Result<Overview, BackendError> {
        idemflow_redis::overview(&self.0).await.map_err(failed)
    }

    async fn scan(&self, from: &ScanFrom, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        idemflow_redis::scan_keys(&self.0, from, limit)
            .await
            .map_err(failed)
    }

    async fn key(&self, tenant: &str, key: &str) -> Result<Option<KeyReport>, BackendError> {
        idemflow_redis::key_report(&self.0, tenant, key)
            .await
            .map_err(failed)
    }

    async fn bodies(&self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, BackendError> {
        idemflow_redis::key_bodies(&self.0, tenant, key)
            .await
            .map_err(failed)
    }

    async fn stuck(&self, min_attempts: i32, limit: i64) -> Result<Vec<KeyReport>, BackendError> {
        idemflow_redis::stuck_keys(&self.0, min_attempts, limit)
            .await
            .map_err(failed)
    }

    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, BackendError> {
        use idemflow_store::Store as _;
        let tenant = idemflow_core::TenantId::new(tenant).map_err(failed)?;
        let key = idemflow_core::Key::parse(key).map_err(failed)?;
        idemflow_redis::RedisStore::end_lease(&self.0, &tenant, &key, lock_version)
            .await
            .map_err(failed)
    }

    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, BackendError> {
        idemflow_redis::expire_key(&self.0, tenant, key, lock_version, state)
            .await
            .map_err(failed)
    }
}
