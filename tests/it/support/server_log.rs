//! The database server's own log, read through SQL, so a test can assert what an operator who
//! alerts on `ERROR` lines would see.
//!
//! Where the server writes its log to standard error redirected to a file (a packaged cluster,
//! `pg_ctl -l`, the throwaway cluster of `scripts/test`), a backend's `/proc/self/fd/2` is that
//! file; with `logging_collector` on, `pg_current_logfile()` names it. Either is read with
//! `pg_read_file`, which needs a superuser (the suite's own connections are). Anything else fails
//! the test loudly rather than pass it unread.

use sqlx::PgPool;

/// A position in the server's log: what was written after it is what a test caused (and what
/// tests running beside it caused, so a test looks for its own keys).
pub struct ServerLog {
    file: String,
    start: i64,
}

impl ServerLog {
    /// The log as it ends now.
    pub async fn from_now(pool: &PgPool) -> ServerLog {
        let collector: Option<String> = sqlx::query_scalar("SELECT pg_current_logfile('stderr')")
            .fetch_one(pool)
            .await
            .expect("pg_current_logfile");
        let file = collector.unwrap_or_else(|| "/proc/self/fd/2".to_owned());
        let start = size(pool, &file).await;
        ServerLog { file, start }
    }

    /// Everything the server logged since [`ServerLog::from_now`].
    pub async fn since(&self, pool: &PgPool) -> String {
        let end = size(pool, &self.file).await;
        sqlx::query_scalar("SELECT pg_read_file($1, $2, $3)")
            .bind(&self.file)
            .bind(self.start)
            .bind(end - self.start)
            .fetch_one(pool)
            .await
            .unwrap_or_else(|error| panic!("reading the server's log {}: {error}", self.file))
    }
}

async fn size(pool: &PgPool, file: &str) -> i64 {
    let (size, is_dir): (i64, bool) = sqlx::query_as("SELECT size, isdir FROM pg_stat_file($1)")
        .bind(file)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|error| {
            panic!(
                "the server's log is not readable as {file} ({error}): run the server with \
                     its standard error in a file or with logging_collector on"
            )
        });
    assert!(!is_dir, "{file} is a directory, not the server's log");
    size
}
