//! The scratch database (created, migrated and dropped per invocation), what the server says
//! about itself, and the server-side counters: pg_stat_database's xact_commit and, where the
//! extension is loaded, pg_stat_statements' calls.

use std::str::FromStr;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgPool};

use crate::Error;
use crate::workflows::ORDERS_TABLE;

/// A database of its own for one invocation.
#[derive(Debug)]
pub struct Scratch {
    pub name: String,
    /// Connects to the database named in DATABASE_URL: creating and dropping the scratch
    /// database, and reading pg_stat_database from outside it (so reading adds no commit).
    admin: PgPool,
    pub connect: PgConnectOptions,
    /// The scratch database's URL, for pgbench (libpq takes a URI as its dbname).
    pub url: String,
    /// `None` when pg_stat_statements can be read; else why not.
    pub statements_unavailable: Option<String>,
}

/// Replaces the database of a `postgres://` URL.
fn with_database(url: &str, database: &str) -> Result<String, Error> {
    let scheme_end = url
        .find("://")
        .ok_or("DATABASE_URL must be a postgres:// URL")?
        + 3;
    let (head, query) = match url[scheme_end..].find('?') {
        Some(at) => url.split_at(scheme_end + at),
        None => (url, ""),
    };
    let authority_end = head[scheme_end..]
        .find('/')
        .map_or(head.len(), |at| scheme_end + at);
    Ok(format!("{}/{database}{query}", &head[..authority_end]))
}

impl Scratch {
    pub async fn create(database_url: &str) -> Result<Self, Error> {
        let base = PgConnectOptions::from_str(database_url)?;
        let admin = PgPoolOptions::new()
            .max_connections(2)
            .connect_with(base.clone())
            .await?;
        let name = format!("idemflow_bench_{}", std::process::id());
        let drop = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&admin)
            .await?;
        let create = format!("CREATE DATABASE {name}");
        sqlx::query(sqlx::AssertSqlSafe(create))
            .execute(&admin)
            .await?;
        let connect = base.database(&name);
        let url = with_database(database_url, &name)?;
        let mut scratch = Self {
            name,
            admin,
            connect,
            url,
            statements_unavailable: None,
        };
        let setup = scratch.pool(1).await?;
        idemflow::migrate(&setup).await?;
        sqlx::query(ORDERS_TABLE).execute(&setup).await?;
        scratch.statements_unavailable = statements_unavailable(&setup).await;
        setup.close().await;
        Ok(scratch)
    }

    /// Drops the scratch database (its connections are ended by force).
    pub async fn drop_database(&self) -> Result<(), Error> {
        let drop = format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name);
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&self.admin)
            .await?;
        self.admin.close().await;
        Ok(())
    }

    /// A pool of `size` connections to the scratch database, as a service would build it for
    /// these measurements: no ping before each acquire.
    pub async fn pool(&self, size: usize) -> Result<PgPool, Error> {
        let size = u32::try_from(size.max(1))?;
        Ok(PgPoolOptions::new()
            .max_connections(size)
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(60))
            .connect_with(self.connect.clone())
            .await?)
    }

    /// A pool of one connection through `connect` (the wire proxy).
    pub async fn pool_via(&self, connect: PgConnectOptions) -> Result<PgPool, Error> {
        Ok(PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .connect_with(connect)
            .await?)
    }

    pub async fn execute(&self, sql: &str) -> Result<u64, Error> {
        let mut connection = self.connect.connect().await?;
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut connection)
            .await?;
        connection.close().await?;
        Ok(done.rows_affected())
    }

    pub async fn scalar(&self, sql: &str) -> Result<i64, Error> {
        let mut connection = self.connect.connect().await?;
        let value: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&mut connection)
            .await?;
        connection.close().await?;
        Ok(value)
    }

    /// One admin query for a text setting.
    pub async fn show(&self, setting: &str) -> Result<String, Error> {
        let value: String = sqlx::query_scalar("SELECT current_setting($1)")
            .bind(setting)
            .fetch_one(&self.admin)
            .await?;
        Ok(value)
    }

    /// pg_stat_database's xact_commit for the scratch database, once no client backend is
    /// connected to it and the figure stopped moving. PostgreSQL 15 publishes a backend's
    /// counters lazily (at most once a second while busy, up to 10 s when idle), and at exit;
    /// callers close their pools first so every backend has exited and published.
    pub async fn xact_commit(&self) -> Result<i64, Error> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let connected: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = $1 AND backend_type = 'client backend'",
            )
            .bind(&self.name)
            .fetch_one(&self.admin)
            .await?;
            if connected == 0 || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut last = self.read_xact_commit().await?;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = self.read_xact_commit().await?;
            if now == last || Instant::now() > deadline {
                return Ok(now);
            }
            last = now;
        }
    }

    async fn read_xact_commit(&self) -> Result<i64, Error> {
        let value: i64 =
            sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
                .bind(&self.name)
                .fetch_one(&self.admin)
                .await?;
        Ok(value)
    }

    /// Statements executed in the scratch database so far, by pg_stat_statements (BEGIN and
    /// COMMIT included: track_utility), read on a connection of its own; the reading statement
    /// itself is counted in the next reading. `None` when unavailable.
    pub async fn statements(&self) -> Result<Option<i64>, Error> {
        if self.statements_unavailable.is_some() {
            return Ok(None);
        }
        let value = self
            .scalar(
                "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements \
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .await?;
        Ok(Some(value))
    }

    /// Marks the counters before a measured pool is opened.
    pub async fn mark(&self) -> Result<Mark, Error> {
        let statements = self.statements().await?;
        let commits = self.xact_commit().await?;
        Ok(Mark {
            commits,
            statements,
        })
    }

    /// Counters per request since `mark`; the measured pools must be closed by now.
    pub async fn since(&self, mark: Mark, requests: u64) -> Result<ServerCounts, Error> {
        let commits = self.xact_commit().await?;
        let statements = self.statements().await?;
        let requests = requests.max(1) as f64;
        Ok(ServerCounts {
            commits_per_request: (commits - mark.commits) as f64 / requests,
            // The reading statement of `mark` is the one extra call.
            statements_per_request: statements
                .zip(mark.statements)
                .map(|(after, before)| (after - before - 1) as f64 / requests),
        })
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Mark {
    commits: i64,
    statements: Option<i64>,
}

/// What the server counted, per request.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct ServerCounts {
    pub commits_per_request: f64,
    pub statements_per_request: Option<f64>,
}

async fn statements_unavailable(pool: &PgPool) -> Option<String> {
    let preloaded: Result<String, _> =
        sqlx::query_scalar("SELECT current_setting('shared_preload_libraries')")
            .fetch_one(pool)
            .await;
    match preloaded {
        Ok(libraries) if libraries.contains("pg_stat_statements") => {}
        Ok(_) => {
            return Some("pg_stat_statements is not in shared_preload_libraries".to_owned());
        }
        Err(error) => return Some(format!("cannot read shared_preload_libraries: {error}")),
    }
    match sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        .execute(pool)
        .await
    {
        Ok(_) => None,
        Err(error) => Some(format!(
            "CREATE EXTENSION pg_stat_statements failed: {error}"
        )),
    }
}

/// `text` as an SQL string literal.
pub fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// Connects once, for the machine description.
pub async fn server_facts(scratch: &Scratch) -> Result<Vec<(String, String)>, Error> {
    let mut facts = Vec::new();
    for setting in [
        "server_version",
        "fsync",
        "synchronous_commit",
        "wal_sync_method",
        "shared_buffers",
        "max_connections",
        "shared_preload_libraries",
    ] {
        facts.push((setting.to_owned(), scratch.show(setting).await?));
    }
    Ok(facts)
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database_of_a_url() {
        let cases = [
            (
                "postgres://postgres@127.0.0.1:5432/postgres",
                "postgres://postgres@127.0.0.1:5432/x",
            ),
            (
                "postgres://u:p@h:1/db?sslmode=disable",
                "postgres://u:p@h:1/x?sslmode=disable",
            ),
            ("postgresql://h", "postgresql://h/x"),
            (
                "postgres://h?sslmode=disable",
                "postgres://h/x?sslmode=disable",
            ),
        ];
        for (url, expected) in cases {
            assert_eq!(with_database(url, "x").ok().as_deref(), Some(expected));
        }
    }
}
