//! A fresh MariaDB (or MySQL) database per test, as `#[sqlx::test]` gives PostgreSQL's: the
//! server at `MARIADB_URL` (default `mysql://root@127.0.0.1:3306/test`), a database named for the
//! test, dropped and created again at its start (left behind at its end, to look at).

use std::hash::{DefaultHasher, Hash, Hasher};

use sqlx::{Connection, Executor, MySqlConnection, MySqlPool};

/// The server the tests use.
pub fn url() -> String {
    std::env::var("MARIADB_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// The server's URL with `database` in place of its own.
pub fn url_of(database: &str) -> String {
    let base = url();
    let (server, _) = base.rsplit_once('/').unwrap_or((base.as_str(), ""));
    format!("{server}/{database}")
}

/// The database [`fresh`] makes for `test` (MySQL names are at most 64 characters).
pub fn database_name(test: &str) -> String {
    let mut hasher = DefaultHasher::new();
    test.hash(&mut hasher);
    let readable: String = test
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .take(40)
        .collect();
    format!("if_{readable}_{:08x}", hasher.finish() as u32)
}

/// A fresh, migrated database for `test`, opened with `options`.
pub async fn fresh_with(test: &str, options: &idemflow_mysql::OpenOptions) -> MySqlPool {
    let database = database_name(test);
    let mut server = MySqlConnection::connect(&url()).await.unwrap_or_else(|error| {
        panic!(
            "no MariaDB at {} ({error}): the MariaDB tests need one (scripts/test checks for it; \
             Debian: apt-get install mariadb-server), or MARIADB_URL set to a server",
            url()
        )
    });
    server
        .execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS `{database}`"
        )))
        .await
        .unwrap();
    server
        .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{database}`")))
        .await
        .unwrap();
    server.close().await.unwrap();
    idemflow_mysql::open(&url_of(&database), options)
        .await
        .unwrap()
}

/// A fresh, empty database for `test` (no migrations run): its name.
pub async fn empty(test: &str) -> String {
    let database = database_name(test);
    let mut server = MySqlConnection::connect(&url())
        .await
        .unwrap_or_else(|error| {
            panic!(
                "no MariaDB at {} ({error}): the MariaDB tests need one",
                url()
            )
        });
    for statement in [
        format!("DROP DATABASE IF EXISTS `{database}`"),
        format!("CREATE DATABASE `{database}`"),
    ] {
        server
            .execute(sqlx::AssertSqlSafe(statement))
            .await
            .unwrap();
    }
    server.close().await.unwrap();
    database
}

/// [`fresh_with`] the engine's default options.
pub async fn fresh(test: &str) -> MySqlPool {
    fresh_with(test, &idemflow_mysql::OpenOptions::default()).await
}
