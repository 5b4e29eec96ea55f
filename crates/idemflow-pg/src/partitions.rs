//! The partitioned layout (opt-in): `idempotency_keys` partitioned by `created_at` into ranges of
//! one width, so that retention drops whole partitions instead of deleting keys row by row.
//!
//! - [`adopt`] converts the table once (as the table's owner): the same columns, constraints and
//!   indexes, the keys copied over, and the trigger that keeps `(tenant, key)` unique across
//!   partitions.
//! - [`maintain`] (a worker's retention, or `idemflow partitions maintain` from a scheduler, as
//!   the owner) creates partitions ahead of the clock and drops those whose every key is past its
//!   window; a partition that still holds a started key is kept, and reported.
//!
//! Uniqueness across partitions. PostgreSQL enforces a unique index only within a partition (a
//! partitioned table's unique key must contain the partition key), so `(tenant, key, created_at)`
//! is the primary key and two claims of one key in two partitions would both insert. The
//! trigger `idempotency_keys_one_row_per_key` stands in for the index: before each insert it
//! takes the key's claim lock (the same `pg_advisory_xact_lock` id as the claim's own, computed
//! by the SQL function `idemflow_claim_lock`) and then looks for the key in every partition. The
//! look runs in a PL/pgSQL function, so at Read Committed it has a snapshot of its own, taken
//! after the lock was granted, and so after every earlier claim of the key committed or rolled
//! back (a claim holds the lock until its transaction ends, and a commit is visible before its
//! locks are released). A key found raises the error the unique index would have raised
//! (`23505` on `idempotency_keys_pkey`), so the claim loses exactly as it does unpartitioned.
//! docs/protocol.md, "Partitioned expiry", has the whole argument.
//!
//! Dropping. A partition can be dropped once its range ended more than the retention window ago,
//! it holds no started key, and its last key finished more than the window ago: then no key in
//! it is still recognised, and no key can enter it any more (a claim's `created_at` is its
//! transaction's start). It is detached `CONCURRENTLY` (a lock that claims and look-ups never wait
//! for), then the bodies stored apart of its keys are deleted, then it is dropped: bodies are
//! deleted only once no look-up can reach their keys, and only those of the same life of the key
//! (`created_at` matches), so a key claimed again meanwhile keeps its new body.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Executor, PgConnection, PgPool, Postgres, Row};

use crate::error::StoreError;
use crate::millis::millis;

pub use idemflow_store::layout::{Adopted, Dropped, Kept, Maintained, Partition, PartitionPlan};

/// A plan the layout can keep: partitions named to the millisecond, and at least one ahead.
fn check(plan: &PartitionPlan) -> Result<(), StoreError> {
    plan.check().map_err(StoreError::Layout)
}

/// Whether `idempotency_keys` is partitioned (the runtime role may ask: it reads the catalog).
pub async fn is_partitioned(connection: &mut PgConnection) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT relkind = 'p' FROM pg_class WHERE oid = 'idempotency_keys'::regclass",
    )
    .fetch_one(connection)
    .await?)
}

/// The partitions of the keys table, oldest first.
pub async fn partitions(connection: &mut PgConnection) -> Result<Vec<Partition>, StoreError> {
    // The bounds as the catalog prints them, read back in the same session (so in the same time
    // zone and date style): the partition's own definition is the only truth about its range.
    let rows = sqlx::query(
        r#"WITH bounds AS (
               SELECT c.relname::text AS name, i.inhdetachpending AS detaching,
                      substring(pg_get_expr(c.relpartbound, c.oid)
                                FROM 'FROM \(''([^'']*)''\)')::timestamptz AS lower,
                      substring(pg_get_expr(c.relpartbound, c.oid)
                                FROM 'TO \(''([^'']*)''\)')::timestamptz AS upper
               FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
               WHERE i.inhparent = 'idempotency_keys'::regclass)
           SELECT name, detaching,
                  (extract(epoch FROM lower) * 1000)::bigint AS from_ms,
                  (extract(epoch FROM upper) * 1000)::bigint AS to_ms,
                  to_char(lower AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.MS"Z"') AS "from",
                  to_char(upper AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.MS"Z"') AS "to"
           FROM bounds
           ORDER BY lower"#,
    )
    .fetch_all(connection)
    .await?;
    Ok(rows
        .iter()
        .map(|row| Partition {
            name: row.get("name"),
            from_ms: row.get("from_ms"),
            to_ms: row.get("to_ms"),
            from: row.get("from"),
            to: row.get("to"),
            detaching: row.get("detaching"),
        })
        .collect())
}

/// Converts `idempotency_keys` to the partitioned layout, in one transaction that holds the
/// table exclusively while it copies the keys (a quiet moment, or a maintenance window, for a
/// large table). Run as the table's owner, after the migrations. Grants on the table are carried
/// over. Refused when the table is already partitioned.
pub async fn adopt(pool: &PgPool, plan: &PartitionPlan) -> Result<Adopted, StoreError> {
    check(plan)?;
    let mut transaction = pool.begin().await?;
    if is_partitioned(&mut transaction).await? {
        return Err(StoreError::Layout(
            "idempotency_keys is partitioned already".to_owned(),
        ));
    }
    (&mut *transaction).execute(ADOPT_TABLE).await?;
    sqlx::query("INSERT INTO idempotency_partitioning (width_ms, ahead) VALUES ($1, $2)")
        .bind(millis(plan.width))
        .bind(i32::try_from(plan.ahead).unwrap_or(i32::MAX))
        .execute(&mut *transaction)
        .await?;
    // Partitions for every key there is, then the current one and those ahead.
    let width_ms = millis(plan.width);
    let (oldest_ms, now_ms): (Option<i64>, i64) = sqlx::query_as(
        "SELECT (SELECT (floor(extract(epoch FROM min(created_at)) * 1000))::bigint \
                 FROM idempotency_keys_unpartitioned), \
                (floor(extract(epoch FROM now()) * 1000))::bigint",
    )
    .fetch_one(&mut *transaction)
    .await?;
    let last = period_start(now_ms, width_ms) + i64::from(plan.ahead) * width_ms;
    let mut from = period_start(oldest_ms.unwrap_or(now_ms).min(now_ms), width_ms);
    let mut created = 0;
    while from <= last {
        create_partition(&mut transaction, from, width_ms).await?;
        created += 1;
        from += width_ms;
    }
    let keys = (&mut *transaction)
        .execute("INSERT INTO idempotency_keys SELECT * FROM idempotency_keys_unpartitioned")
        .await?
        .rows_affected();
    // The keys are unique already; the trigger guards every insert from here on.
    (&mut *transaction).execute(ADOPT_DROP_OLD).await?;
    (&mut *transaction).execute(ONE_ROW_PER_KEY).await?;
    transaction.commit().await?;
    Ok(Adopted {
        partitions: created,
        keys,
    })
}

/// Creates the partitions due ahead of the clock and drops the partitions whose keys are all past
/// `keep_for` (the retention window, from each key's finish), as [`Partition`]s of the plan set
/// by [`adopt`]. Run as the table's owner. One maintenance at a time across every process (a
/// session advisory lock): a second finds it taken and returns [`Maintained::skipped`].
///
/// `keep_for` must be at least [`MIN_KEEP_FOR`]: a partition is detached once its range ended
/// `keep_for` ago, and that is safe only if no claim transaction that could still insert into it
/// (its `created_at` is its transaction's start) lives that long.
pub async fn maintain(pool: &PgPool, keep_for: Duration) -> Result<Maintained, StoreError> {
    if keep_for < MIN_KEEP_FOR {
        return Err(StoreError::Layout(format!(
            "partitions are kept for at least {MIN_KEEP_FOR:?} past their range (asked: \
             {keep_for:?}): a claim transaction begun in a partition's range may still insert \
             into it until then"
        )));
    }
    let mut connection = pool.acquire().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(MAINTENANCE_LOCK)
        .fetch_one(&mut *connection)
        .await?;
    if !locked {
        return Ok(Maintained {
            skipped: true,
            ..Maintained::default()
        });
    }
    match maintain_locked(&mut connection, keep_for).await {
        Ok(maintained) => {
            sqlx::query("SELECT pg_advisory_unlock($1)")
                .bind(MAINTENANCE_LOCK)
                .execute(&mut *connection)
                .await?;
            Ok(maintained)
        }
        Err(error) => {
            // Let go of explicitly, not left to the session's end: the connection closes in the
            // background, and a maintenance right after this one (another role's, a retry) would
            // find the lock still taken and skip. Where even that fails, the connection must not
            // return to the pool holding it: it is closed, and the session's end lets go.
            let unlocked: Result<bool, sqlx::Error> =
                sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
                    .bind(MAINTENANCE_LOCK)
                    .fetch_one(&mut *connection)
                    .await;
            if !matches!(unlocked, Ok(true)) {
                connection.close_on_drop();
            }
            Err(error)
        }
    }
}

/// The shortest `keep_for` [`maintain`] accepts: an hour, far longer than any claim transaction
/// runs (the engine bounds one by its database timeout and the workflow's longest local limit,
/// seconds to minutes), so none can still insert into a partition that is being detached.
pub const MIN_KEEP_FOR: Duration = Duration::from_secs(60 * 60);

/// The session advisory lock one maintenance holds: the first 8 bytes of "idemflow partitions".
const MAINTENANCE_LOCK: i64 = i64::from_be_bytes(*b"idemflow");

async fn maintain_locked(
    connection: &mut PoolConnection<Postgres>,
    keep_for: Duration,
) -> Result<Maintained, StoreError> {
    let (width_ms, ahead): (i64, i32) =
        sqlx::query_as("SELECT width_ms, ahead FROM idempotency_partitioning")
            .fetch_one(&mut **connection)
            .await?;
    let mut maintained = Maintained::default();
    finish_interrupted_drops(connection, &mut maintained).await?;

    // Ahead of the clock.
    let now_ms: i64 =
        sqlx::query_scalar("SELECT (floor(extract(epoch FROM now()) * 1000))::bigint")
            .fetch_one(&mut **connection)
            .await?;
    let existing = partitions(connection).await?;
    let current = period_start(now_ms, width_ms);
    for k in 0..=i64::from(ahead) {
        let from = current + k * width_ms;
        let taken = existing
            .iter()
            .any(|p| p.from_ms < from + width_ms && from < p.to_ms);
        if !taken {
            let mut transaction = sqlx::Connection::begin(&mut **connection).await?;
            let name = create_partition(&mut transaction, from, width_ms).await?;
            transaction.commit().await?;
            maintained.created.push(name);
        }
    }

    // Past the window.
    let horizon_ms = now_ms - millis(keep_for);
    for partition in partitions(connection).await? {
        if partition.to_ms > horizon_ms || partition.detaching {
            continue;
        }
        let table = quote_identifier(&partition.name);
        let (started, expired): (i64, bool) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {table} WHERE state = 'started'), \
                    coalesce((SELECT max(finished_at) FROM {table} WHERE state = 'done') \
                             < now() - $1::bigint * interval '1 millisecond', true)"
        )))
        .bind(millis(keep_for))
        .fetch_one(&mut **connection)
        .await?;
        if started > 0 {
            maintained.kept.push(Kept {
                name: partition.name,
                started_keys: u64::try_from(started).unwrap_or(0),
            });
        } else if expired {
            connection
                .execute(AssertSqlSafe(format!(
                    "ALTER TABLE idempotency_keys DETACH PARTITION {table} CONCURRENTLY"
                )))
                .await?;
            maintained
                .dropped
                .push(drop_detached(connection, &partition.name).await?);
        }
    }
    maintained.ahead = u32::try_from(
        partitions(connection)
            .await?
            .iter()
            .filter(|p| p.from_ms > current)
            .count(),
    )
    .unwrap_or(u32::MAX);
    Ok(maintained)
}

/// Finishes drops a crash or a lost connection interrupted: a detach begun concurrently is
/// finalized, and a detached partition (marked as one of ours) is dropped with its bodies apart.
async fn finish_interrupted_drops(
    connection: &mut PoolConnection<Postgres>,
    maintained: &mut Maintained,
) -> Result<(), StoreError> {
    for partition in partitions(connection).await? {
        if partition.detaching {
            connection
                .execute(AssertSqlSafe(format!(
                    "ALTER TABLE idempotency_keys DETACH PARTITION {} FINALIZE",
                    quote_identifier(&partition.name)
                )))
                .await?;
        }
    }
    let detached: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class AS c \
         JOIN pg_class AS parent ON parent.oid = 'idempotency_keys'::regclass \
         WHERE c.relkind = 'r' AND c.relnamespace = parent.relnamespace \
           AND NOT c.relispartition \
           AND obj_description(c.oid, 'pg_class') = $1",
    )
    .bind(PARTITION_COMMENT)
    .fetch_all(&mut **connection)
    .await?;
    for name in detached {
        maintained
            .dropped
            .push(drop_detached(connection, &name).await?);
    }
    Ok(())
}

/// Deletes the bodies stored apart of a detached partition's keys (of the same life of each key:
/// `created_at` matches), and drops it, in one transaction.
async fn drop_detached(
    connection: &mut PoolConnection<Postgres>,
    name: &str,
) -> Result<Dropped, StoreError> {
    let table = quote_identifier(name);
    let mut transaction = sqlx::Connection::begin(&mut **connection).await?;
    let keys: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(&mut *transaction)
        .await?;
    let bodies_apart = (&mut *transaction)
        .execute(AssertSqlSafe(format!(
            "DELETE FROM idempotency_responses AS apart USING {table} AS gone \
             WHERE gone.response_apart AND apart.tenant = gone.tenant AND apart.key = gone.key \
               AND apart.created_at = gone.created_at"
        )))
        .await?
        .rows_affected();
    (&mut *transaction)
        .execute(AssertSqlSafe(format!("DROP TABLE {table}")))
        .await?;
    transaction.commit().await?;
    Ok(Dropped {
        name: name.to_owned(),
        keys: u64::try_from(keys).unwrap_or(0),
        bodies_apart,
    })
}

/// The comment every partition carries: what marks a detached table as one of ours to drop.
const PARTITION_COMMENT: &str = "idemflow partition of idempotency_keys";

/// Creates the partition of `[from_ms, from_ms + width_ms)` and attaches it: created on its own
/// and then attached, because `ATTACH PARTITION` takes a lock on the parent that claims and
/// look-ups do not wait for (`CREATE TABLE … PARTITION OF` would take an exclusive one). Returns
/// its name.
async fn create_partition(
    connection: &mut PgConnection,
    from_ms: i64,
    width_ms: i64,
) -> Result<String, StoreError> {
    let (name, ddl): (String, String) = sqlx::query_as(
        r#"WITH bounds AS (
               SELECT timestamptz 'epoch' + $1::bigint * interval '1 millisecond' AS lower,
                      timestamptz 'epoch' + $2::bigint * interval '1 millisecond' AS upper),
           named AS (
               SELECT lower, upper,
                      'idempotency_keys_p'
                      || to_char(lower AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS"_"MS') AS name
               FROM bounds)
           SELECT name,
                  format('SET LOCAL lock_timeout = 5000; '
                         'CREATE TABLE %1$I (LIKE idempotency_keys '
                         'INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE); '
                         'COMMENT ON TABLE %1$I IS %2$L; '
                         'ALTER TABLE idempotency_keys ATTACH PARTITION %1$I '
                         'FOR VALUES FROM (%3$L) TO (%4$L)',
                         name, $3::text, lower, upper)
           FROM named"#,
    )
    .bind(from_ms)
    .bind(from_ms + width_ms)
    .bind(PARTITION_COMMENT)
    .fetch_one(&mut *connection)
    .await?;
    connection.execute(AssertSqlSafe(ddl)).await?;
    Ok(name)
}

/// The start of the period `at_ms` falls in.
fn period_start(at_ms: i64, width_ms: i64) -> i64 {
    at_ms.div_euclid(width_ms) * width_ms
}

/// `"name"`, with any `"` doubled: a catalog name as an SQL identifier.
fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The table's conversion, before the partitions and the copy: the old table renamed aside, the
/// new one with the same columns, defaults and check constraints, the primary key widened to the
/// partition key (the only unique key PostgreSQL can enforce on a partitioned table), the same
/// indexes, the fencing sequence owned by the new column, the grants carried over, and the
/// layout's own table.
const ADOPT_TABLE: &str = r#"
LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE;
ALTER TABLE idempotency_keys RENAME TO idempotency_keys_unpartitioned;
ALTER INDEX idempotency_keys_pkey RENAME TO idempotency_keys_unpartitioned_pkey;
ALTER INDEX idempotency_keys_started_lease RENAME TO idempotency_keys_unpartitioned_started_lease;
ALTER INDEX idempotency_keys_finished_at RENAME TO idempotency_keys_unpartitioned_finished_at;

CREATE TABLE idempotency_keys (
    LIKE idempotency_keys_unpartitioned
    INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS
) PARTITION BY RANGE (created_at);
ALTER TABLE idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (tenant, key, created_at);
CREATE INDEX idempotency_keys_started_lease ON idempotency_keys (locked_until)
    WHERE state = 'started';
CREATE INDEX idempotency_keys_finished_at ON idempotency_keys (finished_at)
    WHERE state = 'done';
ALTER SEQUENCE idempotency_keys_fence OWNED BY idempotency_keys.lock_version;

DO $grants$
DECLARE
    granted record;
BEGIN
    FOR granted IN
        SELECT acl.privilege_type,
               CASE WHEN acl.grantee = 0 THEN 'PUBLIC' ELSE acl.grantee::regrole::text END AS role
        FROM pg_class AS c, aclexplode(c.relacl) AS acl
        WHERE c.oid = 'idempotency_keys_unpartitioned'::regclass AND acl.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON TABLE idempotency_keys TO %s',
                       granted.privilege_type, granted.role);
    END LOOP;
END
$grants$;

CREATE TABLE idempotency_partitioning (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    width_ms bigint  NOT NULL CHECK (width_ms > 0),
    ahead    integer NOT NULL CHECK (ahead > 0)
);
"#;

/// After the copy: the old table goes, and the trigger that keeps `(tenant, key)` unique across
/// partitions guards every insert (see the module's documentation for why it is enough).
const ADOPT_DROP_OLD: &str = "DROP TABLE idempotency_keys_unpartitioned";

/// The trigger and its claim-lock function: one definition, the migration's, which also redefines
/// them on tables adopted before it (a fixed search path, READ COMMITTED only; the file says why).
const ONE_ROW_PER_KEY: &str =
    include_str!("../migrations/20261202000200_one_row_per_key_fixed_path.sql");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_start_on_multiples_of_the_width_also_before_the_epoch() {
        assert_eq!(period_start(12_345, 1_000), 12_000);
        assert_eq!(period_start(-1, 1_000), -1_000);
        assert_eq!(period_start(3_000, 1_000), 3_000);
    }

    /// The trigger's lock is the claim's lock: otherwise a claim and an insert of the same key
    /// would not wait for each other.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_triggers_claim_lock_is_the_engines(pool: PgPool) {
        use idemflow_core::{Key, TenantId};
        adopt(&pool, &PartitionPlan::default())
            .await
            .expect("adopt");
        for (tenant, key) in [
            ("1", "k"),
            ("tenant-9", "order:2026/12/01~a"),
            ("t", "0123456789abcdef0123456789abcdef0123456789abcdef"),
        ] {
            let in_sql: i64 = sqlx::query_scalar("SELECT idemflow_claim_lock($1, $2)")
                .bind(tenant)
                .bind(key)
                .fetch_one(&pool)
                .await
                .expect("lock");
            let tenant = TenantId::new(tenant).expect("tenant");
            let key = Key::parse(key).expect("key");
            assert_eq!(in_sql, crate::claim_lock::claim_lock(&tenant, &key));
        }
    }

    /// Whether PostgreSQL writes `idemflow_claim_lock`'s body into an expression that calls it,
    /// as it does in the trigger, rather than running it as a SQL function on each insert.
    async fn claim_lock_is_inlined(pool: &PgPool) -> bool {
        let plan: Vec<String> = sqlx::query_scalar(
            "EXPLAIN (VERBOSE, COSTS OFF) \
             SELECT pg_advisory_xact_lock(idemflow_claim_lock(tenant, key)) FROM idempotency_keys",
        )
        .fetch_all(pool)
        .await
        .expect("explain");
        let plan = plan.join("\n");
        assert!(plan.contains("pg_advisory_xact_lock"), "{plan}");
        !plan.contains("idemflow_claim_lock") && plan.contains("sha256")
    }

    /// The trigger's claim lock costs an insert an expression, not a SQL function call: a function
    /// PostgreSQL cannot write in is set up again in every transaction (a third of a bare insert,
    /// measured in docs/benchmarks.md). Adopted now, and adopted before the migration that fixed
    /// the function's volatility and migrated since.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_triggers_claim_lock_is_written_into_its_expression(pool: PgPool) {
        adopt(&pool, &PartitionPlan::default())
            .await
            .expect("adopt");
        assert!(claim_lock_is_inlined(&pool).await);

        // As adopted before: IMMUTABLE over a STABLE body, which PostgreSQL will not write in.
        sqlx::query("ALTER FUNCTION idemflow_claim_lock(text, text) IMMUTABLE")
            .execute(&pool)
            .await
            .expect("as before");
        assert!(!claim_lock_is_inlined(&pool).await);
        sqlx::raw_sql(include_str!(
            "../migrations/20261202000100_claim_lock_inlined.sql"
        ))
        .execute(&pool)
        .await
        .expect("the migration");
        assert!(claim_lock_is_inlined(&pool).await);
    }

    /// The trigger's functions as [`adopt`] defined them before the migration
    /// `one_row_per_key_fixed_path`: the search path of the adopting session, names unqualified.
    const ADOPTED_BEFORE_FIXED_PATH: &str = r#"
        CREATE OR REPLACE FUNCTION idemflow_claim_lock(tenant text, key text) RETURNS bigint
            LANGUAGE sql STABLE STRICT PARALLEL SAFE
            RETURN ('x' || encode(substr(sha256('\x6964656d666c6f7720636c61696d00'::bytea
                                                || convert_to(tenant, 'UTF8') || '\x00'::bytea
                                                || convert_to(key, 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint;
        CREATE OR REPLACE FUNCTION idempotency_keys_one_row_per_key() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $body$
        BEGIN
            PERFORM pg_advisory_xact_lock(idemflow_claim_lock(NEW.tenant, NEW.key));
            IF EXISTS (SELECT 1 FROM idempotency_keys WHERE tenant = NEW.tenant AND key = NEW.key) THEN
                RAISE EXCEPTION 'duplicate key value violates unique constraint "idempotency_keys_pkey"'
                    USING ERRCODE = 'unique_violation', CONSTRAINT = 'idempotency_keys_pkey';
            END IF;
            RETURN NEW;
        END
        $body$;
    "#;

    /// The definitions of the engine's functions, as the catalog prints them, and the settings
    /// they run with.
    async fn functions(pool: &PgPool) -> Vec<(String, Option<Vec<String>>)> {
        sqlx::query_as(
            "SELECT pg_get_functiondef(oid), proconfig FROM pg_proc \
             WHERE proname IN ('idemflow_claim_lock', 'idempotency_keys_one_row_per_key') \
             ORDER BY proname",
        )
        .fetch_all(pool)
        .await
        .expect("functions")
    }

    /// Every function the engine creates resolves names on a fixed path that searches the
    /// session's temporary schema last (the SECURITY DEFINER trigger's SET clause), or names
    /// everything qualified (the claim lock, which a SET clause would keep out of the trigger's
    /// expression); and a table adopted before that was so, once migrated, has exactly the
    /// functions a table adopted now has.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_triggers_functions_resolve_names_on_a_fixed_path_adopted_now_or_before(
        pool: PgPool,
    ) {
        adopt(&pool, &PartitionPlan::default())
            .await
            .expect("adopt");
        let adopted_now = functions(&pool).await;
        assert_eq!(adopted_now.len(), 2);
        assert_eq!(adopted_now[0].1, None, "the claim lock takes no SET clause");
        assert_eq!(
            adopted_now[1].1.as_deref(),
            Some(&["search_path=pg_catalog, public, pg_temp".to_owned()][..])
        );
        let body = &adopted_now[1].0;
        assert!(
            body.contains("public.idempotency_keys") && body.contains("public.idemflow_claim_lock"),
            "{body}"
        );

        sqlx::raw_sql(ADOPTED_BEFORE_FIXED_PATH)
            .execute(&pool)
            .await
            .expect("as adopted before");
        assert_ne!(functions(&pool).await, adopted_now);
        sqlx::raw_sql(ONE_ROW_PER_KEY)
            .execute(&pool)
            .await
            .expect("the migration");
        assert_eq!(functions(&pool).await, adopted_now);
        assert!(claim_lock_is_inlined(&pool).await);
    }

    /// On the unpartitioned layout the migration does nothing: no function, no trigger.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_trigger_migration_leaves_an_unpartitioned_table_alone(pool: PgPool) {
        sqlx::raw_sql(ONE_ROW_PER_KEY)
            .execute(&pool)
            .await
            .expect("the migration");
        assert!(functions(&pool).await.is_empty());
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
    }
}
