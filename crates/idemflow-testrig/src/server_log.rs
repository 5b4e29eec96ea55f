//! PostgreSQL's own log, read through SQL: what an operator who alerts on `ERROR` lines sees, for
//! the tests and the schedule explorer to check.
//!
//! Where the server writes its log to standard error redirected to a file (a packaged cluster,
//! `pg_ctl -l`, the throwaway cluster of `scripts/test`), a backend's `/proc/self/fd/2` is that
//! file; with `logging_collector` on, `pg_current_logfile()` names it. Either is read with
//! `pg_read_file`, which needs a superuser (or `pg_read_server_files`). Anything else is an error
//! the caller reports: a reading that could not be made never passes for a quiet log.

use std::collections::HashMap;

use sqlx::PgPool;

/// A position in the server's log: what was written after it is what a test caused (and what
/// tests running beside it caused: a reader looks for its own keys).
#[derive(Debug, Clone)]
pub struct ServerLog {
    file: String,
    start: i64,
}

impl ServerLog {
    /// The log as it ends now.
    pub async fn from_now(pool: &PgPool) -> Result<ServerLog, String> {
        let collector: Option<String> = sqlx::query_scalar("SELECT pg_current_logfile('stderr')")
            .fetch_one(pool)
            .await
            .map_err(|error| format!("pg_current_logfile: {error}"))?;
        let file = collector.unwrap_or_else(|| "/proc/self/fd/2".to_owned());
        let start = size(pool, &file).await?;
        Ok(ServerLog { file, start })
    }

    /// Everything the server logged since [`ServerLog::from_now`].
    pub async fn since(&self, pool: &PgPool) -> Result<String, String> {
        let end = size(pool, &self.file).await?;
        sqlx::query_scalar("SELECT pg_read_file($1, $2, $3)")
            .bind(&self.file)
            .bind(self.start)
            .bind((end - self.start).max(0))
            .fetch_one(pool)
            .await
            .map_err(|error| format!("reading the server's log {}: {error}", self.file))
    }
}

async fn size(pool: &PgPool, file: &str) -> Result<i64, String> {
    let (size, is_dir): (i64, bool) = sqlx::query_as("SELECT size, isdir FROM pg_stat_file($1)")
        .bind(file)
        .fetch_one(pool)
        .await
        .map_err(|error| {
            format!(
                "the server's log is not readable as {file} ({error}): run the server with its \
                 standard error in a file or with logging_collector on, and read it as a superuser"
            )
        })?;
    if is_dir {
        return Err(format!("{file} is a directory, not the server's log"));
    }
    Ok(size)
}

/// The `ERROR` lines in `log` of claims that lost the race for their key
/// (`duplicate key value violates unique constraint "idempotency_keys_pkey"`) whose statement
/// names `marker` (a tenant's or key's bytes in hex, as the claim's message carries them). An
/// error's `STATEMENT` line comes after it, from the same server process: lines are paired by the
/// process id of the log line prefix (`[pid]`, in PostgreSQL's default prefix).
pub fn lost_claims(log: &str, marker: &str) -> Vec<String> {
    let mut last_error: HashMap<&str, &str> = HashMap::new();
    let mut found = Vec::new();
    for line in log.lines() {
        let Some(pid) = process_of(line) else {
            continue;
        };
        if line.contains(" ERROR: ") {
            last_error.insert(pid, line);
        } else if line.contains(" STATEMENT: ")
            && line.contains("idemflow_claim")
            && line.contains(marker)
            && let Some(error) = last_error.remove(pid)
            && error.contains(
                "duplicate key value violates unique constraint \"idempotency_keys_pkey\"",
            )
        {
            found.push(error.to_owned());
        }
    }
    found
}

/// The `[pid]` of a log line's prefix.
fn process_of(line: &str) -> Option<&str> {
    let open = line.find('[')?;
    let close = open + line[open..].find(']')?;
    let pid = &line[open + 1..close];
    (!pid.is_empty() && pid.bytes().all(|byte| byte.is_ascii_digit())).then_some(pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_claim_is_its_error_paired_with_its_statement_by_process() {
        let log = "\
2026-12-04 11:24:08.430 UTC [11] u@d ERROR:  duplicate key value violates unique constraint \"idempotency_keys_pkey\"
2026-12-04 11:24:08.430 UTC [12] u@d ERROR:  canceling statement due to lock timeout
2026-12-04 11:24:08.431 UTC [11] u@d DETAIL:  Key (tenant, key)=(t, k) already exists.
2026-12-04 11:24:08.431 UTC [12] u@d STATEMENT:  BEGIN; EXECUTE idemflow_claim_v4(1, convert_from(decode('7a7a', 'hex'), 'UTF8'))
2026-12-04 11:24:08.432 UTC [11] u@d STATEMENT:  BEGIN; EXECUTE idemflow_claim_v4(1, convert_from(decode('7a7a', 'hex'), 'UTF8'))
2026-12-04 11:24:08.433 UTC [13] u@d ERROR:  duplicate key value violates unique constraint \"idempotency_keys_pkey\"
2026-12-04 11:24:08.433 UTC [13] u@d STATEMENT:  BEGIN; EXECUTE idemflow_claim_v4(1, convert_from(decode('7979', 'hex'), 'UTF8'))
";
        let found = lost_claims(log, "7a7a");
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("[11]"));
        assert_eq!(lost_claims(log, "7979").len(), 1);
        assert!(lost_claims(log, "7878").is_empty());
    }
}
