//! What operators' tools read and do, whatever the engine ([`Operator`]): a key's report and
//! bodies, the stuck keys, ending a lease, expiring keys, the table's statistics and overview, a
//! page of keys, and the schema's migrations. The CLI and the console speak only this; each
//! engine's crate implements it once, and opens it by URL ([`OperatorEngine`]), so a tool picks
//! the engine by the URL's scheme among those it was built with.

use std::fmt::Debug;
use std::time::Duration;

use async_trait::async_trait;

use crate::console::{Overview, ScanFrom};
use crate::error::{DatabaseError, DatabaseErrorKind, EngineError};
use crate::layout::{Adopted, Maintained, Partition, PartitionPlan};
use crate::report::{KeyBodies, KeyReport, TableStats};

/// Why an operator's call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OperatorError {
    /// The URL or an argument cannot be used as given (nothing was sent).
    #[error("{0}")]
    Usage(String),
    /// The database could not be reached (or opened): why, in the engine's words.
    #[error("{0}")]
    Connect(String),
    /// The schema's migrations could not be applied.
    #[error("migration failed: {0}")]
    Migrate(String),
    /// The engine has no such thing (partitions outside PostgreSQL, say).
    #[error("{0}")]
    Unsupported(String),
    /// The engine's call failed.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

impl From<DatabaseError> for OperatorError {
    fn from(error: DatabaseError) -> Self {
        Self::Engine(EngineError::Database(error))
    }
}

impl OperatorError {
    /// Whether the failure is the engine's tables missing: its migrations have not run.
    pub fn is_no_schema(&self) -> bool {
        matches!(
            self,
            Self::Engine(EngineError::Database(error)) if error.kind() == DatabaseErrorKind::NoSchema
        )
    }
}

/// One applied migration of an engine's schema.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Migration {
    /// Its version (a timestamp, by convention).
    pub version: i64,
    /// What it does.
    pub description: String,
}

/// The migrations `migrator` holds, in order: what an engine's `migrate` answers once they ran.
pub fn migrations(migrator: &sqlx::migrate::Migrator) -> Vec<Migration> {
    migrator
        .iter()
        .filter(|migration| migration.migration_type.is_up_migration())
        .map(|migration| Migration {
            version: migration.version,
            description: migration.description.to_string(),
        })
        .collect()
}

/// How a tool opens an engine's database.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OperatorOptions {
    /// Connections kept open at most.
    pub connections: u32,
    /// Open read-only connections where the engine can (PostgreSQL's
    /// `default_transaction_read_only`, MariaDB's `SESSION TRANSACTION READ ONLY`, SQLite's
    /// read-only open), so even a defect in the tool could not write. Redis has none: the tool
    /// refuses its writes itself.
    pub read_only: bool,
    /// The name the connections carry where the engine shows one (`pg_stat_activity`).
    pub application_name: String,
    /// The prefix of the engine's keys, where it namespaces them by one (Redis); `None`: the
    /// engine's default.
    pub key_prefix: Option<String>,
    /// How long to wait for the database to answer the first connection.
    pub connect_timeout: Duration,
    /// Create the database where the engine keeps it in a file of its own (SQLite), for
    /// `migrate`; otherwise a path with no database is refused as mistyped.
    pub create: bool,
}

impl Default for OperatorOptions {
    fn default() -> Self {
        Self {
            connections: 2,
            read_only: false,
            application_name: "idemflow".to_owned(),
            key_prefix: None,
            connect_timeout: Duration::from_secs(10),
            create: false,
        }
    }
}

idemflow_core::with_setters! {
    OperatorOptions {
        with_connections => connections: u32,
        with_read_only => read_only: bool,
        with_application_name => application_name: String,
        with_key_prefix => key_prefix: Option<String>,
        with_connect_timeout => connect_timeout: Duration,
        with_create => create: bool,
    }
}

/// An engine's database, as operators' tools use it.
#[async_trait]
pub trait Operator: Debug + Send + Sync {
    /// The engine's name, as operators read it (`PostgreSQL`, `SQLite`, `MariaDB`, `Redis`).
    fn engine(&self) -> &'static str;

    /// Applies every pending migration, then lists the schema's migrations; `None` for an
    /// engine with no schema (Redis).
    async fn migrate(&self) -> Result<Option<Vec<Migration>>, OperatorError>;

    /// Everything about one key; `None` if there is none.
    async fn key_report(&self, tenant: &str, key: &str)
    -> Result<Option<KeyReport>, OperatorError>;

    /// One key's stored request and response, as stored (sealed where sealed), and how long ago
    /// it finished; `None` if there is no such key.
    async fn key_bodies(&self, tenant: &str, key: &str)
    -> Result<Option<KeyBodies>, OperatorError>;

    /// Started keys past their lease or with at least `min_attempts` attempts, oldest lease
    /// first, at most `limit`.
    async fn stuck_keys(
        &self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, OperatorError>;

    /// Ends a started key's lease now if its token is still `lock_version`, advancing the fence,
    /// and wakes resumers where the engine can: the new token, or `None` when the key is not
    /// started or its token moved on.
    async fn end_lease(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, OperatorError>;

    /// Deletes a key if its token is still `lock_version` and its state `state` (as an operator
    /// was shown it): the state of the key deleted, `None` when it moved on.
    async fn expire_key(
        &self,
        tenant: &str,
        key: &str,
        lock_version: i64,
        state: &str,
    ) -> Result<Option<String>, OperatorError>;

    /// Deletes up to `batch` keys finished more than `older_than` ago; how many. Started keys
    /// are never deleted.
    async fn expire_batch(&self, older_than: Duration, batch: i64) -> Result<u64, OperatorError>;

    /// Keys by workflow and state, the oldest started key and the resumer lag.
    async fn table_stats(&self) -> Result<TableStats, OperatorError>;

    /// The table at a glance, from its indexes only.
    async fn overview(&self) -> Result<Overview, OperatorError>;

    /// Up to `limit` keys from `from`, in key order.
    async fn scan_keys(&self, from: &ScanFrom, limit: i64)
    -> Result<Vec<KeyReport>, OperatorError>;

    /// The engine's partitioned layout, where it has one (PostgreSQL).
    fn partitions(&self) -> Option<&dyn Partitions> {
        None
    }

    /// Closes the connections.
    async fn close(&self);
}

/// The partitioned layout of an engine that has one, for operators.
#[async_trait]
pub trait Partitions: Send + Sync {
    /// Converts the keys table to the partitioned layout, as its owner.
    async fn adopt(&self, plan: &PartitionPlan) -> Result<Adopted, OperatorError>;
    /// Creates the partitions due ahead and drops those whose every key finished more than
    /// `keep_for` ago, as the table's owner.
    async fn maintain(&self, keep_for: Duration) -> Result<Maintained, OperatorError>;
    /// The partitions, oldest first; `None` when the table is not partitioned.
    async fn list(&self) -> Result<Option<Vec<Partition>>, OperatorError>;
}

/// An engine as tools open it: by a URL of one of its schemes.
#[async_trait]
pub trait OperatorEngine: Send + Sync {
    /// The URL schemes it opens (`postgres`, `postgresql`; `sqlite`; `mysql`, `mariadb`; `redis`,
    /// `rediss`).
    fn schemes(&self) -> &'static [&'static str];

    /// Opens the database `url` names.
    async fn open(
        &self,
        url: &str,
        options: &OperatorOptions,
    ) -> Result<Box<dyn Operator>, OperatorError>;
}

/// The engine among `engines` whose scheme `url` has; `None` when none has it.
pub fn engine_for<'a>(
    engines: &[&'a dyn OperatorEngine],
    url: &str,
) -> Option<&'a dyn OperatorEngine> {
    let scheme = url.split_once(':').map(|(scheme, _)| scheme)?;
    engines.iter().copied().find(|engine| {
        engine
            .schemes()
            .iter()
            .any(|known| known.eq_ignore_ascii_case(scheme))
    })
}
