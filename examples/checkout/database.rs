//! Which database a process runs on: `--database-url postgres://…`, `mysql://…` (MySQL or
//! MariaDB) or `sqlite://…`; without one
//! (and no `DATABASE_URL`), a SQLite file under `target/` ([`default_sqlite_file`]), so the
//! example runs on a machine with Rust alone.

use std::path::PathBuf;

use idemflow::{MySqlStore, PgStore, SqliteStore, sqlx};

use crate::Failure;
use crate::orders::Shop;

/// The database a process runs on.
pub enum Database {
    /// PostgreSQL, at a server.
    Postgres(sqlx::PgPool),
    /// SQLite, in a file on this machine (shared by every process on it).
    Sqlite(sqlx::SqlitePool),
    /// MySQL or MariaDB, at a server.
    MySql(sqlx::MySqlPool),
}

/// Where the example keeps its SQLite file when no database is named: under the workspace's
/// `target/` (never committed, removed by `cargo clean`).
pub fn default_sqlite_file() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("idemflow-checkout").join("checkout.db")
}

impl Database {
    /// Opens `url` (`postgres://…`, `postgresql://…`, `mysql://…` or `sqlite://path`), or, for
    /// `None`, the
    /// default SQLite file (created, with its directory). Runs idemflow's migrations and creates
    /// the orders table unless `migrate` is false.
    pub async fn open(url: Option<&str>, pool_size: u32, migrate: bool) -> Result<Self, Failure> {
        let url = match url {
            Some(url) => url.to_owned(),
            None => {
                let path = default_sqlite_file();
                if let Some(directory) = path.parent() {
                    std::fs::create_dir_all(directory)?;
                }
                println!(
                    "checkout: no database named: SQLite file {} (pass --database-url or set DATABASE_URL for another)",
                    path.display()
                );
                format!("sqlite://{}", path.display())
            }
        };
        if url.starts_with("sqlite:") {
            let options = idemflow::sqlite::OpenOptions::default();
            let pool = idemflow::sqlite::open(&url, &options)
                .await
                .map_err(|error| format!("cannot open SQLite at {url}: {error}"))?;
            if migrate {
                SqliteStore::create_orders(&pool).await?;
            }
            return Ok(Self::Sqlite(pool));
        }
        if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let options = idemflow::mysql::OpenOptions::default().with_max_connections(pool_size);
            let pool = idemflow::mysql::open(&url, &options)
                .await
                .map_err(|error| {
                    format!(
                        "cannot open MySQL/MariaDB at {}: {error}",
                        crate::redact_password(&url)
                    )
                })?;
            if migrate {
                MySqlStore::create_orders(&pool).await?;
            }
            return Ok(Self::MySql(pool));
        }
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(format!(
                "unknown database URL {}: postgres://…, mysql://… or sqlite://path",
                crate::redact_password(&url)
            )
            .into());
        }
        // The engine's pool: no test before acquire, bounded waits, server-side session limits.
        let settings = idemflow::PoolSettings::default().with_max_connections(pool_size);
        let pool = settings.connect(&url).await.map_err(|error| {
            format!(
                "cannot connect to PostgreSQL at {}: {error}",
                crate::redact_password(&url)
            )
        })?;
        if migrate {
            idemflow::migrate(&pool).await?;
            PgStore::create_orders(&pool).await?;
        }
        Ok(Self::Postgres(pool))
    }
}
