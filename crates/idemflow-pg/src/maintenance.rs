//! The statements of the resumer, retention and operators: scanning for abandoned keys, expiring
//! old ones, and looking at the table.

use std::time::Duration;

use idemflow_core::{Key, TenantId};
use serde_json::Value;
use sqlx::{PgConnection, Row};

use crate::error::StoreError;
use crate::millis::{from_millis, millis};
use crate::take_over::TakenOver;
use idemflow_store::Owner;

/// The channel on which a key due now is announced (postponed, or its lease ended), so an idle resumer wakes early.
pub const DUE_CHANNEL: &str = "idemflow_due";

/// Takes over up to `batch_size` started keys whose lease expired, of the named workflows only,
/// in one statement: the due rows are locked `FOR UPDATE SKIP LOCKED` (so concurrent resumers
/// split the work instead of queueing on each other) and each gets a new fencing token and the
/// lease of its own workflow (`workflows`: each name with its lease), and a `taken_over` entry by
/// `resumer` in its journal; each with the name of the workflow that must finish it (the new token drawn per key, in the subquery that appends it). Keys
/// of workflows not named are left alone for a resumer that knows them.
pub async fn take_over_due(
    connection: &mut PgConnection,
    workflows: &[(String, Duration)],
    batch_size: i64,
) -> Result<Vec<(String, TakenOver)>, StoreError> {
    let lease_from = std::time::Instant::now();
    let names: Vec<&str> = workflows.iter().map(|(name, _)| name.as_str()).collect();
    let leases: Vec<i64> = workflows.iter().map(|(_, lease)| millis(*lease)).collect();
    let rows = sqlx::query(
        "WITH due AS ( \
             SELECT tenant, key FROM idempotency_keys \
             WHERE state = 'started' AND locked_until <= now() AND workflow = ANY($1) \
             ORDER BY locked_until \
             LIMIT $2 \
             FOR UPDATE SKIP LOCKED \
         ) \
         UPDATE idempotency_keys AS keys \
         SET (lock_version, journal) = ( \
                 SELECT fence.token, \
                        CASE WHEN jsonb_array_length(keys.journal) >= 64 THEN keys.journal - 1 \
                             ELSE keys.journal END \
                        || jsonb_build_object( \
                               'at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                               'event', 'taken_over', 'token', fence.token, 'by', 'resumer', \
                               'attempt', keys.attempts + 1) \
                 FROM (SELECT nextval('idempotency_keys_fence') AS token) AS fence), \
             attempts = keys.attempts + 1, \
             locked_until = clock_timestamp() \
                 + (SELECT lease.ms FROM unnest($1::text[], $3::bigint[]) AS lease (workflow, ms) \
                    WHERE lease.workflow = keys.workflow LIMIT 1) \
                   * interval '1 millisecond', \
             updated_at = now() \
         FROM due WHERE keys.tenant = due.tenant AND keys.key = due.key \
         RETURNING keys.tenant, keys.key, keys.workflow, keys.lock_version, keys.recovery_point, \
                   keys.phase_output, keys.request, keys.attempts, keys.last_error",
    )
    .bind(&names)
    .bind(batch_size)
    .bind(&leases)
    .fetch_all(connection)
    .await?;
    rows.into_iter()
        .map(|row| {
            let tenant: String = row.get("tenant");
            let key: String = row.get("key");
            let tenant =
                TenantId::new(tenant).map_err(|error| StoreError::Corrupt(error.to_string()))?;
            let key = Key::parse(&key).map_err(|error| StoreError::Corrupt(error.to_string()))?;
            let phase_output: Option<sqlx::types::Json<Value>> = row.get("phase_output");
            let request: sqlx::types::Json<Value> = row.get("request");
            let taken = TakenOver {
                owner: Owner::new(tenant, key, row.get("lock_version")),
                attempts: i64::from(row.get::<i32, _>("attempts")),
                recovery_point: row.get("recovery_point"),
                phase_output: phase_output.map(|json| json.0),
                request: request.0,
                last_error: row.get("last_error"),
                lease_from,
            };
            Ok((row.get("workflow"), taken))
        })
        .collect()
}

/// Due keys of workflows not in `workflows`, counted by workflow: what a resumer cannot finish.
pub async fn count_due_unknown(
    connection: &mut PgConnection,
    workflows: &[String],
) -> Result<Vec<(String, i64)>, StoreError> {
    let rows = sqlx::query_as(
        "SELECT workflow, count(*) FROM idempotency_keys \
         WHERE state = 'started' AND locked_until <= now() AND NOT (workflow = ANY($1)) \
         GROUP BY workflow ORDER BY workflow",
    )
    .bind(workflows)
    .fetch_all(connection)
    .await?;
    Ok(rows)
}

/// How far behind the resumers are: the age of the oldest expired lease of a started key, or
/// zero when none is due.
pub async fn resumer_lag(connection: &mut PgConnection) -> Result<Duration, StoreError> {
    let lag_ms: i64 = sqlx::query_scalar(
        "SELECT coalesce(ceil(extract(epoch FROM now() - min(locked_until)) * 1000), 0)::bigint \
         FROM idempotency_keys WHERE state = 'started' AND locked_until <= now()",
    )
    .fetch_one(connection)
    .await?;
    Ok(from_millis(lag_ms))
}

/// Announces that a key is due now, waking idle resumers (delivered when the transaction commits).
pub async fn notify_due(connection: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_notify($1, '')")
        .bind(DUE_CHANNEL)
        .execute(connection)
        .await?;
    Ok(())
}

/// Deletes up to `batch_size` keys finished more than `older_than` ago; returns how many. The
/// window starts at the finish, not the claim: a key that stayed started for a long time is kept
/// as long as any other after its response was stored. Never a started key. Rows are chosen
/// through the `finished_at` index and deleted by primary key (no `ctid`, so it also works where tuple ids are not stable, as on distributed
/// PostgreSQL); `SKIP LOCKED` keeps it off rows a retry is reading for update.
pub async fn expire_batch(
    connection: &mut PgConnection,
    older_than: Duration,
    batch_size: i64,
) -> Result<u64, StoreError> {
    // A response stored apart goes with its key, in the same statement: no body outlives its key.
    let deleted: i64 = sqlx::query_scalar(
        "WITH gone AS ( \
             DELETE FROM idempotency_keys AS keys USING ( \
                 SELECT tenant, key FROM idempotency_keys \
                 WHERE state = 'done' \
                   AND finished_at < now() - $1::bigint * interval '1 millisecond' \
                 ORDER BY finished_at \
                 LIMIT $2 \
                 FOR UPDATE SKIP LOCKED \
             ) AS old \
             WHERE keys.tenant = old.tenant AND keys.key = old.key \
             RETURNING keys.tenant, keys.key, keys.response_apart \
         ), bodies AS ( \
             DELETE FROM idempotency_responses AS apart USING gone \
             WHERE gone.response_apart AND apart.tenant = gone.tenant AND apart.key = gone.key \
         ) \
         SELECT count(*) FROM gone",
    )
    .bind(millis(older_than))
    .bind(batch_size)
    .fetch_one(connection)
    .await?;
    Ok(u64::try_from(deleted).unwrap_or(0))
}

/// Ends a started key's lease now, if its fencing token is still `lock_version`, so a resumer or
/// a retry takes it over at once, and advances its fence: the key gets a new token, which it
/// returns, so every write of the owner that held `lock_version` is refused from now on (its
/// renewal, its advance, its finish). The journal gets a `lease_ended` entry by `operator` with
/// the new token. `None` when the key is not started or the token moved on.
///
/// Ending a lease is for an owner believed gone. One still running is stopped at its next write,
/// but a phase it is in goes on meanwhile: a local phase's commit is refused, a foreign call goes
/// out with the same derived key, and a plain handler (which nothing fences) may run beside the
/// next owner's. Callers refuse a live lease unless told otherwise (`idemflow end-lease --force`).
pub async fn end_lease(
    connection: &mut PgConnection,
    tenant: &str,
    key: &str,
    lock_version: i64,
) -> Result<Option<i64>, StoreError> {
    Ok(sqlx::query_scalar(
        "UPDATE idempotency_keys \
         SET locked_until = least(locked_until, now()), \
             (lock_version, journal) = ( \
                 SELECT fence.token, \
                        CASE WHEN jsonb_array_length(journal) >= 64 THEN journal - 1 \
                             ELSE journal END \
                        || jsonb_build_object( \
                               'at', floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint, \
                               'event', 'lease_ended', 'token', fence.token, 'by', 'operator') \
                 FROM (SELECT nextval('idempotency_keys_fence') AS token) AS fence), \
             updated_at = now() \
         WHERE tenant = $1 AND key = $2 AND lock_version = $3 AND state <> 'done' \
         RETURNING lock_version",
    )
    .bind(tenant)
    .bind(key)
    .bind(lock_version)
    .fetch_optional(connection)
    .await?)
}

pub use idemflow_store::KeyReport;

pub(crate) const REPORT_COLUMNS: &str = "tenant, key, workflow, state, recovery_point, \
    CASE WHEN state = 'started' THEN ceil(extract(epoch FROM locked_until - now()) * 1000)::bigint END \
        AS lease_left_ms, \
    lock_version, attempts::bigint AS attempts, last_error, \
    response_status::bigint AS response_status, \
    coalesce(octet_length(response_body), \
             (SELECT octet_length(body) FROM idempotency_responses AS apart \
              WHERE apart.tenant = idempotency_keys.tenant AND apart.key = idempotency_keys.key) \
    )::bigint AS response_bytes, \
    encode(fingerprint, 'hex') AS fingerprint_hex, \
    floor(extract(epoch FROM now() - created_at))::bigint AS age_seconds, \
    journal::text AS journal";

/// A key's report from its row of [`REPORT_COLUMNS`]: the boundary's decoding, every engine's
/// (integers read as `bigint`, as the columns above cast them).
pub(crate) fn report(row: &sqlx::postgres::PgRow) -> Result<KeyReport, StoreError> {
    idemflow_store::rows::key_report(row).map_err(|error| StoreError::Corrupt(error.to_string()))
}

/// Everything about one key ([`KeyReport`]), for operators; `None` if there is none. Tenant and
/// key are plain text here: the caller validates them (or not) as it sees fit.
pub async fn key_report(
    connection: &mut PgConnection,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyReport>, StoreError> {
    let sql =
        format!("SELECT {REPORT_COLUMNS} FROM idempotency_keys WHERE tenant = $1 AND key = $2");
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(tenant)
        .bind(key)
        .fetch_optional(connection)
        .await?;
    row.as_ref().map(report).transpose()
}

/// Started keys that look stuck: past their lease, or with at least `min_attempts` attempts.
/// Oldest lease first.
pub async fn stuck_keys(
    connection: &mut PgConnection,
    min_attempts: i32,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let sql = format!(
        "SELECT {REPORT_COLUMNS} FROM idempotency_keys \
         WHERE state = 'started' AND (locked_until <= now() OR attempts >= $1) \
         ORDER BY locked_until, tenant, key LIMIT $2"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(min_attempts)
        .bind(limit)
        .fetch_all(connection)
        .await?;
    rows.iter().map(report).collect()
}

pub use idemflow_store::TableStats;

/// The table at a glance ([`TableStats`]), for operators. Three statements, not one snapshot; the
/// counts read every row of the table.
pub async fn table_stats(connection: &mut PgConnection) -> Result<TableStats, StoreError> {
    let counts: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT workflow, state, count(*) FROM idempotency_keys GROUP BY workflow, state ORDER BY workflow, state",
    )
    .fetch_all(&mut *connection)
    .await?;
    let oldest_started_seconds: Option<i64> = sqlx::query_scalar(
        "SELECT floor(extract(epoch FROM now() - min(created_at)))::bigint FROM idempotency_keys WHERE state = 'started'",
    )
    .fetch_one(&mut *connection)
    .await?;
    let lag = resumer_lag(connection).await?;
    Ok(TableStats {
        counts,
        oldest_started_seconds,
        resumer_lag_ms: millis(lag),
    })
}

pub use idemflow_store::{KeyBodies, KeyResponse};

/// A key's stored request and response as stored ([`KeyBodies`]), for operators; `None` if there
/// is none. One statement: a body stored apart is read in the same snapshot as its key's row, and
/// only the one of the key's current life (by `created_at`, as a replay reads it). Nothing sealed
/// is opened. Tenant and key are plain text, as for [`key_report`].
pub async fn key_bodies(
    connection: &mut PgConnection,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyBodies>, StoreError> {
    let row = sqlx::query(
        "SELECT request::text AS request, response_status::bigint AS response_status, \
                response_headers::text AS response_headers, \
                response_apart::int::bigint AS response_apart, \
                coalesce(response_body, \
                         (SELECT body FROM idempotency_responses AS apart \
                          WHERE apart.tenant = keys.tenant AND apart.key = keys.key \
                            AND apart.created_at = keys.created_at)) AS response_body, \
                CASE WHEN state = 'done' \
                     THEN floor(extract(epoch FROM now() - finished_at))::bigint END \
                    AS finished_seconds_ago \
         FROM idempotency_keys AS keys WHERE tenant = $1 AND key = $2",
    )
    .bind(tenant)
    .bind(key)
    .fetch_optional(connection)
    .await?;
    row.as_ref()
        .map(idemflow_store::rows::key_bodies)
        .transpose()
        .map_err(|error| StoreError::Corrupt(error.to_string()))
}

#[cfg(test)]
mod tests {
    use idemflow_core::Fingerprint;
    use serde_json::json;

    use super::*;
    use crate::{
        ClaimRequest, Claimed, Limits, advance, begin_claim, next_lock_version, postpone, take_over,
    };

    /// Every column the takeovers and the reports read by name is there under that name.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn takeovers_and_reports_read_every_column_by_name(pool: sqlx::PgPool) {
        let tenant = TenantId::new("t-1").expect("tenant");
        let key = Key::parse("k").expect("key");
        let fingerprint = Fingerprint::from_slice(&[9; 32]).expect("fingerprint");
        let request = json!({"amount": 2});
        let mut connection = pool.acquire().await.expect("connection");
        let lock_version = next_lock_version(&mut connection).await.expect("token");
        let claim = ClaimRequest {
            tenant: &tenant,
            key: &key,
            lock_version,
            fingerprint: &fingerprint,
            workflow: "w.v1",
            request: &request,
            lease: Duration::ZERO,
        };
        let claimer = pool.acquire().await.expect("connection");
        let Ok(Claimed::Owned(transaction, _)) =
            begin_claim(claimer, &claim, &Limits::default()).await
        else {
            panic!("a new key is ours");
        };
        transaction.commit().await.expect("commit");

        let report = key_report(&mut connection, "t-1", "k")
            .await
            .expect("report")
            .expect("row");
        assert_eq!((report.tenant.as_str(), report.key.as_str()), ("t-1", "k"));
        assert_eq!(report.workflow, "w.v1");
        assert_eq!(report.state, "started");
        assert_eq!(report.recovery_point, "start");
        assert!(report.lease_left_ms.is_some_and(|left| left <= 0));
        assert_eq!(report.lock_version, lock_version);
        assert_eq!(report.attempts, 1);
        assert_eq!(report.last_error, None);
        assert_eq!(
            (report.response_status, report.response_bytes),
            (None, None)
        );
        assert_eq!(report.fingerprint_hex, "09".repeat(32));
        assert!(report.age_seconds >= 0);
        let stuck = stuck_keys(&mut connection, 100, 10).await.expect("stuck");
        let [stuck] = stuck.as_slice() else {
            panic!("one key is stuck: {stuck:?}");
        };
        assert_eq!(
            (
                stuck.key.as_str(),
                stuck.lock_version,
                &stuck.fingerprint_hex
            ),
            ("k", lock_version, &report.fingerprint_hex)
        );

        let taken = take_over(&mut connection, &tenant, &key, lock_version, Duration::ZERO)
            .await
            .expect("take over")
            .expect("an expired lease is taken over");
        assert!(taken.owner.lock_version() > lock_version);
        assert_eq!(taken.attempts, 2);
        assert_eq!(taken.recovery_point, "start");
        assert_eq!(taken.phase_output, None);
        assert_eq!(taken.request, request);
        assert_eq!(taken.last_error, None);

        let output = json!({"order_id": 1});
        let mut transaction = crate::Transaction::begin(&pool).await.expect("begin");
        advance(
            &mut transaction,
            &taken.owner,
            "first",
            &output,
            Duration::ZERO,
        )
        .await
        .expect("advance");
        transaction.commit().await.expect("commit");
        postpone(&mut connection, &taken.owner, Duration::ZERO, "boom")
            .await
            .expect("postpone");
        let due = take_over_due(
            &mut connection,
            &[("w.v1".to_owned(), Duration::from_secs(30))],
            10,
        )
        .await
        .expect("take over due");
        let [(workflow, due)] = due.as_slice() else {
            panic!("one key is due: {due:?}");
        };
        assert_eq!(workflow, "w.v1");
        assert_eq!((due.owner.tenant(), due.owner.key()), (&tenant, &key));
        assert!(due.owner.lock_version() > taken.owner.lock_version());
        assert_eq!(due.attempts, 2);
        assert_eq!(due.recovery_point, "first");
        assert_eq!(due.phase_output, Some(output));
        assert_eq!(due.request, request);
        assert_eq!(due.last_error.as_deref(), Some("boom"));
    }
}
