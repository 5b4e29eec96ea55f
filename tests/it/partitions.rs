//! The partitioned layout (`idemflow_pg::partitions`): `(tenant, key)` stays unique across
//! partitions, a retry finds its key after the key's partition rolled over, and maintenance drops
//! whole partitions once every key in them is past its window, never one that holds a started
//! key, and never a body apart of a key's later life.
//!
//! Time moves the way the other tests move it: by rewinding columns in SQL (`created_at` moves a
//! key into an older partition, `finished_at` ages its window), never by waiting.
#![allow(clippy::unwrap_used)]

use idemflow::PgStore;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idemflow::{Fingerprint, Key, Outcome, Registry, Resumer, Retention, Runner, RunnerConfig};
use idemflow_pg as store;
use idemflow_pg::partitions::{self, Maintained, PartitionPlan};
use idemflow_pg::{ClaimRequest, Claimed, Limits, LookUp};
use idemflow_testrig::simulation::Rng;
use sqlx::PgPool;

use crate::support::report::{CrashBeforeFinish, setup, workflow};
use crate::support::{count, expire_all_leases, request, tenant};

const HOUR: Duration = Duration::from_secs(60 * 60);

/// A runner that stores bodies above 1 KiB apart.
fn runner(pool: &PgPool) -> Runner<PgStore> {
    Runner::with_config(
        pool.clone(),
        RunnerConfig::default().with_response_apart_above(1024),
    )
}

async fn send(runner: &Runner<PgStore>, key: &str, bytes: usize) -> Outcome {
    let body = format!(r#"{{"bytes": {bytes}}}"#).into_bytes();
    runner
        .run(
            &workflow(),
            &tenant(1),
            &Key::parse(key).unwrap(),
            request(&body),
        )
        .await
        .unwrap()
}

/// Adopts the partitioned layout with partitions reaching back `back` widths before now: a key
/// created that long ago is inserted first, so the adoption covers it, and deleted after.
async fn adopt(pool: &PgPool, width: Duration, ahead: u32, back: u32) {
    setup(pool).await;
    insert_raw(pool, "reach-back", -(i64::from(back) * millis(width)))
        .await
        .unwrap();
    partitions::adopt(pool, &PartitionPlan { width, ahead })
        .await
        .unwrap();
    sqlx::query("DELETE FROM idempotency_keys WHERE key = 'reach-back'")
        .execute(pool)
        .await
        .unwrap();
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap()
}

/// Inserts a started key with `created_at` shifted by `shift_ms` from now, as any writer might
/// (no claim lock taken by the caller: the trigger takes it).
async fn insert_raw<'c, E>(executor: E, key: &str, shift_ms: i64) -> Result<(), sqlx::Error>
where
    E: sqlx::PgExecutor<'c>,
{
    sqlx::query(
        "INSERT INTO idempotency_keys \
             (tenant, key, fingerprint, workflow, request, locked_until, created_at) \
         VALUES ('1', $1, sha256('x'), 'report.v1', '{\"bytes\": 1}', now() + interval '1 hour', \
                 now() + $2::bigint * interval '1 millisecond')",
    )
    .bind(key)
    .bind(shift_ms)
    .execute(executor)
    .await
    .map(|_| ())
}

/// Moves a key `by` into the past: into an older partition, as if its partition had rolled over.
/// Its body apart, if any, names the key's life by `created_at`, and moves with it.
async fn rewind_created(pool: &PgPool, key: &str, by: Duration) {
    let moved = sqlx::query(
        "WITH body AS ( \
             UPDATE idempotency_responses \
             SET created_at = created_at - $2::bigint * interval '1 millisecond' WHERE key = $1) \
         UPDATE idempotency_keys SET created_at = created_at - $2::bigint * interval '1 millisecond' \
         WHERE key = $1",
    )
    .bind(key)
    .bind(millis(by))
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(moved.rows_affected(), 1);
}

/// The name of the partition that holds `key`.
async fn partition_of(pool: &PgPool, key: &str) -> String {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn is_pkey_violation(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(e)
        if e.code().as_deref() == Some("23505") && e.constraint() == Some("idempotency_keys_pkey"))
}

fn claim_request<'a>(
    tenant: &'a idemflow::TenantId,
    key: &'a Key,
    lock_version: i64,
    fingerprint: &'a Fingerprint,
    request: &'a serde_json::Value,
) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant,
        key,
        lock_version,
        fingerprint,
        workflow: "report.v1",
        request,
        lease: Duration::from_secs(60),
    }
}

/// The conversion keeps the table as the migrations made it, except for what partitioning
/// requires: the same columns, defaults and check constraints, the same indexes, the primary key
/// widened by `created_at`, the grants, every key; and the runner works on it unchanged.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn adopting_keeps_the_keys_the_schema_and_the_grants(pool: PgPool) {
    // Roles are cluster-wide: a name of this run's own.
    let reader: String = sqlx::query_scalar(
        "SELECT 'idemflow_it_reader_' || substr(md5(random()::text || clock_timestamp()::text), 1, 12)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    for statement in [
        format!("CREATE ROLE \"{reader}\""),
        format!("GRANT SELECT, UPDATE ON idempotency_keys TO \"{reader}\""),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&pool)
            .await
            .unwrap();
    }
    let columns = "SELECT string_agg(format('%s %s %s %s %s', attname, format_type(atttypid, atttypmod), \
                          attnotnull, attcollation, pg_get_expr(d.adbin, d.adrelid)), ', ' ORDER BY attnum) \
                   FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
                   WHERE attrelid = 'idempotency_keys'::regclass AND attnum > 0 AND NOT attisdropped";
    let checks = "SELECT string_agg(format('%s %s', conname, pg_get_constraintdef(oid)), ', ' ORDER BY conname) \
                  FROM pg_constraint WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'c'";
    let indexes = "SELECT string_agg(regexp_replace(pg_get_indexdef(indexrelid), ' ON (ONLY )?public.idempotency_keys USING', ' ON idempotency_keys USING'), ', ' \
                   ORDER BY indexrelid::regclass::text) \
                   FROM pg_index WHERE indrelid = 'idempotency_keys'::regclass AND NOT indisprimary";
    let read = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let before = (read(columns).await, read(checks).await, read(indexes).await);
    setup(&pool).await;
    let runner = runner(&pool);
    send(&runner, "small", 10).await;
    send(&runner, "large", 5000).await;

    let adopted = partitions::adopt(
        &pool,
        &PartitionPlan {
            width: HOUR,
            ahead: 3,
        },
    )
    .await
    .unwrap();
    assert_eq!(adopted.keys, 2);
    assert_eq!(adopted.partitions, 4, "the current partition and 3 ahead");
    let after = (read(columns).await, read(checks).await, read(indexes).await);
    assert_eq!(before, after);
    let primary_key: String = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint \
         WHERE conrelid = 'idempotency_keys'::regclass AND contype = 'p'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(primary_key, "PRIMARY KEY (tenant, key, created_at)");
    let granted: (bool, bool, bool) = sqlx::query_as(
        "SELECT has_table_privilege($1, 'idempotency_keys', 'SELECT'), \
                has_table_privilege($1, 'idempotency_keys', 'UPDATE'), \
                has_table_privilege($1, 'idempotency_keys', 'INSERT')",
    )
    .bind(&reader)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(granted, (true, true, false));
    let mut connection = pool.acquire().await.unwrap();
    assert!(partitions::is_partitioned(&mut connection).await.unwrap());
    drop(connection);

    // Replays of keys copied over, byte for byte, and new keys, on the partitioned table.
    for (key, bytes) in [("small", 10), ("large", 5000)] {
        match send(&runner, key, bytes).await {
            Outcome::Replayed(response) => assert_eq!(response.body.len(), bytes),
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(matches!(
        send(&runner, "new", 3).await,
        Outcome::Executed(_)
    ));
    assert_eq!(count(&pool, "SELECT count(*) FROM renders").await, 3);

    // Once is enough.
    assert!(matches!(
        partitions::adopt(&pool, &PartitionPlan::default()).await,
        Err(store::StoreError::Layout(_))
    ));
    for statement in [
        format!("DROP OWNED BY \"{reader}\""),
        format!("DROP ROLE \"{reader}\""),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&pool)
            .await
            .unwrap();
    }
}

/// The interleaving the trigger exists for: a request looks the key up and finds nothing, another
/// claims the key and commits, and its row is in another partition than the one the first
/// request's claim inserts into. The primary key cannot see it (it holds within a partition);
/// the claim must lose all the same, as it does unpartitioned.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_loses_to_a_key_committed_in_another_partition(pool: PgPool) {
    adopt(&pool, HOUR, 2, 3).await;
    let tenant = tenant(1);
    let key = Key::parse("k").unwrap();
    let fingerprint = Fingerprint::from_slice(&[7; 32]).unwrap();
    let body = serde_json::json!({"bytes": 1});

    // Request B looks the key up: absent.
    let mut b = pool.acquire().await.unwrap();
    let LookUp::Absent {
        lock_version: b_token,
        ..
    } = store::look_up(&mut b, &tenant, &key).await.unwrap()
    else {
        panic!("a new key is absent");
    };
    // Request A looks it up, claims it, commits; its row is in the previous hour's partition.
    let mut a = pool.acquire().await.unwrap();
    let LookUp::Absent {
        lock_version: a_token,
        ..
    } = store::look_up(&mut a, &tenant, &key).await.unwrap()
    else {
        panic!("still absent");
    };
    let Claimed::Owned(transaction, _) = store::begin_claim(
        a,
        &claim_request(&tenant, &key, a_token, &fingerprint, &body),
        &Limits::default(),
    )
    .await
    .unwrap() else {
        panic!("A claims the key");
    };
    transaction.commit().await.unwrap();
    rewind_created(&pool, "k", HOUR).await;

    // B's claim would insert into the current partition: it loses.
    let claimed = store::begin_claim(
        b,
        &claim_request(&tenant, &key, b_token, &fingerprint, &body),
        &Limits::default(),
    )
    .await
    .unwrap();
    assert!(matches!(claimed, Claimed::Lost(_)), "{claimed:?}");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        1
    );
}

/// An insert of a key whose claim is uncommitted in another partition waits for that claim (the
/// claim lock), then fails if it committed and goes in if it rolled back: the unique index's own
/// behaviour, across partitions. Whoever inserts, the trigger takes the lock.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_insert_waits_for_a_claim_in_another_partition_then_loses_only_if_it_committed(
    pool: PgPool,
) {
    adopt(&pool, HOUR, 2, 3).await;
    for commit in [true, false] {
        sqlx::query("DELETE FROM idempotency_keys")
            .execute(&pool)
            .await
            .unwrap();
        let mut first = pool.begin().await.unwrap();
        insert_raw(&mut *first, "k", -2 * millis(HOUR))
            .await
            .unwrap();
        let second = tokio::spawn({
            let pool = pool.clone();
            async move { insert_raw(&pool, "k", 0).await }
        });
        // The second waits on the claim lock (observed on the server, not guessed from time).
        let mut waited = false;
        for _ in 0..400 {
            let waiting = count(
                &pool,
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            )
            .await;
            if waiting == 1 {
                waited = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(waited, "the second insert never waited for the first");
        assert!(!second.is_finished());
        if commit {
            first.commit().await.unwrap();
            let error = second.await.unwrap().unwrap_err();
            assert!(is_pkey_violation(&error), "{error:?}");
        } else {
            first.rollback().await.unwrap();
            second.await.unwrap().unwrap();
        }
        assert_eq!(
            count(&pool, "SELECT count(*) FROM idempotency_keys").await,
            1
        );
    }
}

/// Claims racing across partition boundaries, generated: partitions 50 ms wide, and requests
/// that look a key up, wait a random while (so others claim and commit meanwhile, often in the
/// next partition), then claim. Each key ends with one row and one owner, whatever the timing.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn claims_racing_across_partition_boundaries_leave_one_row_per_key(pool: PgPool) {
    let width = Duration::from_millis(50);
    // 400 partitions ahead: 20 s of them. The claims need well under a second, but a loaded
    // machine has stretched them past 5 s, and an insert past the last partition finds none.
    adopt(&pool, width, 400, 1).await;
    let tenant = tenant(1);
    let fingerprint = Fingerprint::from_slice(&[7; 32]).unwrap();
    let mut rng = Rng::new(20_261_201);
    let mut tasks = Vec::new();
    for (n, delays) in (0..24).map(|n| (n, [rng.below(80), rng.below(80), rng.below(80)])) {
        for delay in delays {
            let (pool, tenant) = (pool.clone(), tenant.clone());
            let key = Key::parse(&format!("k{n}")).unwrap();
            tasks.push(tokio::spawn(async move {
                let body = serde_json::json!({"bytes": 1});
                let mut connection = pool.acquire().await.unwrap();
                let LookUp::Absent { lock_version, .. } =
                    store::look_up(&mut connection, &tenant, &key)
                        .await
                        .unwrap()
                else {
                    return (key, None);
                };
                tokio::time::sleep(Duration::from_millis(delay)).await;
                let attempted_at: f64 =
                    sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                        .fetch_one(&mut *connection)
                        .await
                        .unwrap();
                let claim = claim_request(&tenant, &key, lock_version, &fingerprint, &body);
                match store::begin_claim(connection, &claim, &Limits::default())
                    .await
                    .unwrap()
                {
                    Claimed::Owned(transaction, _) => {
                        transaction.commit().await.unwrap();
                        (key, Some(Ok(())))
                    }
                    Claimed::Lost(_) => (key, Some(Err(attempted_at))),
                }
            }));
        }
    }
    let mut owners: HashMap<String, usize> = HashMap::new();
    let mut lost_across = 0;
    let mut lost = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            (key, Some(Ok(()))) => *owners.entry(key.as_str().to_owned()).or_default() += 1,
            (key, Some(Err(at))) => lost.push((key, at)),
            (_, None) => {}
        }
    }
    for (key, at) in &lost {
        let created: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM created_at)::float8 FROM idempotency_keys WHERE key = $1",
        )
        .bind(key.as_str())
        .fetch_one(&pool)
        .await
        .unwrap();
        let period = |seconds: f64| (seconds * 1000.0 / 50.0).floor();
        if period(created) != period(*at) {
            lost_across += 1;
        }
    }
    assert_eq!(owners.len(), 24, "{owners:?}");
    assert!(owners.values().all(|&n| n == 1), "{owners:?}");
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT key, count(*) FROM idempotency_keys GROUP BY key HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(rows.is_empty(), "keys with more than one row: {rows:?}");
    assert!(
        lost_across > 0,
        "no claim lost to a key in another partition ({} lost in all): the race was not exercised",
        lost.len()
    );
}

/// A retry after its key's partition rolled over (the key is in an older partition than new
/// claims go to) gets the first response; another request under the key gets 422; a started key
/// there is taken over where it is and finished once.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_retry_after_its_keys_partition_rolled_over_is_answered_from_it(pool: PgPool) {
    adopt(&pool, HOUR, 2, 3).await;
    let runner = runner(&pool);
    let first = match send(&runner, "done", 2000).await {
        Outcome::Executed(response) => response,
        other => panic!("{other:?}"),
    };
    let crashed = runner
        .clone()
        .with_crash_hook(Arc::new(CrashBeforeFinish))
        .run(
            &workflow(),
            &tenant(1),
            &Key::parse("started").unwrap(),
            request(br#"{"bytes": 5}"#),
        )
        .await;
    assert!(matches!(crashed, Err(idemflow::RunError::Crashed(_))));
    let current = partition_of(&pool, "done").await;
    rewind_created(&pool, "done", 2 * HOUR).await;
    rewind_created(&pool, "started", 2 * HOUR).await;
    assert_ne!(partition_of(&pool, "done").await, current);

    match send(&runner, "done", 2000).await {
        Outcome::Replayed(response) => assert_eq!(response, first),
        other => panic!("{other:?}"),
    }
    assert!(matches!(send(&runner, "done", 7).await, Outcome::Mismatch));
    expire_all_leases(&pool).await;
    match send(&runner, "started", 5).await {
        Outcome::Executed(response) => assert_eq!(response.body.len(), 5),
        other => panic!("{other:?}"),
    }
    let old = partition_of(&pool, "started").await;
    assert_ne!(old, current, "taken over where it is");
    assert_eq!(
        count(&pool, "SELECT count(*) FROM renders WHERE key = 'done'").await,
        1
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM renders WHERE key = 'started'").await,
        1
    );
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        2
    );
}

/// Maintenance: partitions ahead of the clock are created; a partition past the window is
/// dropped whole, with the bodies apart of its keys; one holding a started key is kept and
/// reported (however old), and dropped once that key finished and its window passed.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn maintenance_drops_expired_partitions_and_keeps_those_with_started_keys(pool: PgPool) {
    adopt(&pool, HOUR, 2, 6).await;
    let runner = runner(&pool);
    send(&runner, "old-done", 3000).await;
    send(&runner, "fresh", 3000).await;
    let crashed = runner
        .clone()
        .with_crash_hook(Arc::new(CrashBeforeFinish))
        .run(
            &workflow(),
            &tenant(1),
            &Key::parse("old-started").unwrap(),
            request(br#"{"bytes": 5}"#),
        )
        .await;
    assert!(crashed.is_err());
    // Two keys five hours old, one finished four hours ago; the window is one hour.
    rewind_created(&pool, "old-done", 5 * HOUR).await;
    rewind_created(&pool, "old-started", 5 * HOUR).await;
    sqlx::query(
        "UPDATE idempotency_keys SET finished_at = now() - interval '4 hours' WHERE key = 'old-done'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let old = partition_of(&pool, "old-done").await;
    let partitions_before = {
        let mut connection = pool.acquire().await.unwrap();
        partitions::partitions(&mut connection).await.unwrap()
    };
    assert_eq!(partitions_before.len(), 6 + 1 + 2);

    let maintained = partitions::maintain(&pool, HOUR).await.unwrap();
    assert!(maintained.created.is_empty(), "{maintained:?}");
    assert_eq!(maintained.ahead, 2);
    assert_eq!(
        maintained
            .kept
            .iter()
            .map(|k| (k.name.as_str(), k.started_keys))
            .collect::<Vec<_>>(),
        vec![(old.as_str(), 1)],
    );
    // The empty partitions older than the window went; the current one, the last hour's and
    // those ahead stay.
    assert_eq!(maintained.dropped.len(), 4, "{maintained:?}");
    assert!(maintained.dropped.iter().all(|d| d.keys == 0));
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        3
    );

    // The started key is finished (by the resumer) and its window passes: the partition goes,
    // with both keys and the body apart of the finished one.
    expire_all_leases(&pool).await;
    let mut registry = Registry::new();
    registry.register(workflow()).unwrap();
    let drained = Resumer::new(runner.clone(), registry)
        .drain()
        .await
        .unwrap();
    assert_eq!(drained.finished, 1);
    sqlx::query("UPDATE idempotency_keys SET finished_at = now() - interval '2 hours' WHERE key = 'old-started'")
        .execute(&pool)
        .await
        .unwrap();
    let maintained = partitions::maintain(&pool, HOUR).await.unwrap();
    assert!(maintained.kept.is_empty(), "{maintained:?}");
    let dropped: Vec<_> = maintained
        .dropped
        .iter()
        .map(|d| (d.name.as_str(), d.keys, d.bodies_apart))
        .collect();
    assert_eq!(dropped, vec![(old.as_str(), 2, 1)]);
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_responses").await,
        1,
        "the fresh key's body stays"
    );
    match send(&runner, "old-done", 3000).await {
        Outcome::Executed(_) => {}
        other => panic!("an expired key runs anew: {other:?}"),
    }
    match send(&runner, "fresh", 3000).await {
        Outcome::Replayed(response) => assert_eq!(response.body.len(), 3000),
        other => panic!("{other:?}"),
    }

    // The worker's retention does the same on this layout: nothing left to drop.
    let retention = Retention::default().with_keep_for(HOUR);
    assert_eq!(retention.expire(&pool).await.unwrap(), 0);
}

/// A drop interrupted after the detach (a crash, a lost connection) is finished by the next
/// maintenance, and the bodies it deletes are only those of the detached keys' own life: a key
/// claimed again after its partition was detached keeps its new body.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_interrupted_drop_is_finished_and_spares_a_later_life_of_its_keys(pool: PgPool) {
    adopt(&pool, HOUR, 2, 4).await;
    let runner = runner(&pool);
    send(&runner, "k", 4000).await;
    rewind_created(&pool, "k", 3 * HOUR).await;
    sqlx::query("UPDATE idempotency_keys SET finished_at = now() - interval '3 hours'")
        .execute(&pool)
        .await
        .unwrap();
    let old = partition_of(&pool, "k").await;
    // The drop got as far as the detach.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "ALTER TABLE idempotency_keys DETACH PARTITION {old}"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // The key is gone for look-ups, and is claimed again, with another body, stored apart.
    let second = match send(&runner, "k", 5000).await {
        Outcome::Executed(response) => response,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_responses").await,
        1
    );

    let maintained: Maintained = partitions::maintain(&pool, HOUR).await.unwrap();
    let finished: Vec<_> = maintained
        .dropped
        .iter()
        .filter(|d| d.name == old)
        .map(|d| (d.keys, d.bodies_apart))
        .collect();
    assert_eq!(finished, vec![(1, 0)], "{maintained:?}");
    match send(&runner, "k", 5000).await {
        Outcome::Replayed(response) => assert_eq!(response, second),
        other => panic!("{other:?}"),
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_class WHERE relname = $1")
        .bind(&old)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
}

/// Maintenance creates the partitions a new period needs before claims need them, one run at a
/// time across processes.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn maintenance_keeps_partitions_ahead_of_the_clock_one_run_at_a_time(pool: PgPool) {
    adopt(&pool, HOUR, 2, 0).await;
    // Lose the last partition ahead, as if maintenance had stopped for an hour.
    let last = {
        let mut connection = pool.acquire().await.unwrap();
        partitions::partitions(&mut connection)
            .await
            .unwrap()
            .pop()
            .unwrap()
    };
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {}", last.name)))
        .execute(&pool)
        .await
        .unwrap();

    // Held by another worker: this run does nothing.
    let mut other = pool.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(i64::from_be_bytes(*b"idemflow"))
        .execute(&mut *other)
        .await
        .unwrap();
    let skipped = partitions::maintain(&pool, HOUR).await.unwrap();
    assert!(skipped.skipped && skipped.created.is_empty(), "{skipped:?}");
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(i64::from_be_bytes(*b"idemflow"))
        .execute(&mut *other)
        .await
        .unwrap();

    let maintained = partitions::maintain(&pool, HOUR).await.unwrap();
    assert_eq!(maintained.created, vec![last.name.clone()]);
    assert_eq!(maintained.ahead, 2);
    // The new partition is a full member: an index, the trigger, the constraints.
    let attached: (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM pg_index WHERE indrelid = $1::regclass), \
                (SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::regclass)",
    )
    .bind(&last.name)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(attached, (3, 1));
    assert!(
        partitions::maintain(&pool, HOUR)
            .await
            .unwrap()
            .created
            .is_empty()
    );
}

/// When maintenance stopped long enough that no partition covers the clock, a new request fails
/// with the database's error (a 503 over HTTP), runs no phase and stores nothing; replays of keys
/// in older partitions still work. The next maintenance heals it.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn with_no_partition_for_now_a_claim_fails_and_stores_nothing(pool: PgPool) {
    adopt(&pool, HOUR, 1, 2).await;
    let runner = runner(&pool);
    let first = match send(&runner, "old", 10).await {
        Outcome::Executed(response) => response,
        other => panic!("{other:?}"),
    };
    rewind_created(&pool, "old", 2 * HOUR).await;
    let mut connection = pool.acquire().await.unwrap();
    let now_ms: i64 =
        sqlx::query_scalar("SELECT (floor(extract(epoch FROM now()) * 1000))::bigint")
            .fetch_one(&mut *connection)
            .await
            .unwrap();
    for partition in partitions::partitions(&mut connection).await.unwrap() {
        if partition.to_ms > now_ms {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP TABLE {}",
                partition.name
            )))
            .execute(&mut *connection)
            .await
            .unwrap();
        }
    }
    drop(connection);

    let body = br#"{"bytes": 3}"#;
    let failed = runner
        .run(
            &workflow(),
            &tenant(1),
            &Key::parse("new").unwrap(),
            request(body),
        )
        .await;
    match failed {
        Err(idemflow::RunError::Database(error)) => {
            assert!(error.to_string().contains("no partition"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        count(&pool, "SELECT count(*) FROM idempotency_keys").await,
        1
    );
    assert_eq!(count(&pool, "SELECT count(*) FROM renders").await, 1);
    match send(&runner, "old", 10).await {
        Outcome::Replayed(response) => assert_eq!(response, first),
        other => panic!("{other:?}"),
    }

    let maintained = partitions::maintain(&pool, HOUR).await.unwrap();
    assert_eq!(maintained.created.len(), 2, "{maintained:?}");
    assert!(matches!(
        send(&runner, "new", 3).await,
        Outcome::Executed(_)
    ));
}

/// The uniqueness trigger's look needs a snapshot taken after the claim lock, which only Read
/// Committed gives. With the database's `default_transaction_isolation` at Repeatable Read, a
/// second claim of a key once took its snapshot before waiting on the first claim's lock, did not
/// see the committed row, and inserted another (its `created_at` differs, so the primary key let
/// it): the key ran twice. The engine states READ COMMITTED in every transaction it begins, and the
/// trigger refuses an insert at any other level, whoever sends it.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn claims_racing_under_a_repeatable_read_default_leave_one_row_and_one_effect_per_key(
    pool: PgPool,
) {
    adopt(&pool, HOUR, 2, 1).await;
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "ALTER DATABASE \"{database}\" SET default_transaction_isolation = 'repeatable read'"
    )))
    .execute(&pool)
    .await
    .unwrap();
    // New connections take the database's default.
    let repeatable = sqlx::postgres::PgPoolOptions::new()
        .max_connections(24)
        .connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap();
    let level: String = sqlx::query_scalar("SHOW transaction_isolation")
        .fetch_one(&repeatable)
        .await
        .unwrap();
    assert_eq!(level, "repeatable read");

    let runner = Arc::new(runner(&repeatable));
    let mut tasks = Vec::new();
    for n in 0..20 {
        for _ in 0..3 {
            let runner = runner.clone();
            tasks.push(tokio::spawn(async move {
                send(&runner, &format!("rr-{n}"), 8).await
            }));
        }
    }
    for task in tasks {
        // 409 (in progress), an execution or a replay; never an error.
        task.await.unwrap();
    }
    let doubled: Vec<(String, i64)> = sqlx::query_as(
        "SELECT key, count(*) FROM idempotency_keys GROUP BY key HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(doubled.is_empty(), "keys with two rows: {doubled:?}");
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM renders GROUP BY key HAVING count(*) > 1")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert!(effects.is_empty(), "keys run twice: {effects:?}");

    // A writer that is not the engine, at the default Repeatable Read, is refused by the trigger.
    let refused = insert_raw(&repeatable, "not-the-engine", 0)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, sqlx::Error::Database(e) if e.code().as_deref() == Some("0A000")),
        "{refused:?}"
    );
    let mut connection = repeatable.acquire().await.unwrap();
    sqlx::raw_sql("SET default_transaction_isolation = 'read committed'")
        .execute(&mut *connection)
        .await
        .unwrap();
    insert_raw(&mut *connection, "not-the-engine", 0)
        .await
        .unwrap();
}

/// Maintenance refuses a window shorter than the longest claim transaction could be (an hour, at
/// least): detaching a partition is safe only once no claim begun in its range can still insert.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn maintenance_refuses_a_window_a_claim_transaction_could_outlive(pool: PgPool) {
    adopt(&pool, HOUR, 2, 1).await;
    for keep_for in [Duration::ZERO, Duration::from_secs(60)] {
        assert!(
            matches!(
                partitions::maintain(&pool, keep_for).await,
                Err(store::StoreError::Layout(_))
            ),
            "{keep_for:?}"
        );
    }
    assert!(
        partitions::maintain(&pool, partitions::MIN_KEEP_FOR)
            .await
            .is_ok()
    );
}

/// A claim above Read Committed on this layout is refused by the trigger and writes nothing, and
/// the engine says which refusal it is (`ClaimLevelRefused`: the runner then claims such keys
/// alone at Read Committed); another statement's feature_not_supported (0A000) is not mistaken
/// for it. At Read Committed the same claim goes in.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_above_read_committed_is_refused_as_such_and_writes_nothing(pool: PgPool) {
    use idemflow::{EngineError, Isolation};

    adopt(&pool, HOUR, 2, 3).await;
    let tenant = tenant(1);
    let key = Key::parse("k").unwrap();
    let fingerprint = Fingerprint::from_slice(&[7; 32]).unwrap();
    let body = serde_json::json!({"bytes": 1});
    let classified = |error: store::StoreError| match EngineError::from(error) {
        EngineError::Database(error) => error,
        other => panic!("{other:?}"),
    };
    for isolation in Isolation::ALL {
        let mut connection = pool.acquire().await.unwrap();
        let LookUp::Absent { lock_version, .. } = store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap()
        else {
            panic!("a new key is absent");
        };
        let claimed = store::begin_claim(
            connection,
            &claim_request(&tenant, &key, lock_version, &fingerprint, &body),
            &Limits::default().with_isolation(isolation),
        )
        .await;
        if isolation == Isolation::ReadCommitted {
            let Ok(Claimed::Owned(transaction, _)) = claimed else {
                panic!("claimed at Read Committed: {claimed:?}");
            };
            transaction.rollback().await.unwrap();
            continue;
        }
        let error = classified(claimed.unwrap_err());
        assert!(error.is_claim_level_refused(), "{isolation}: {error}");
        assert_eq!(
            count(&pool, "SELECT count(*) FROM idempotency_keys").await,
            0
        );
    }
    let other = sqlx::query("SELECT count(*) FROM idempotency_keys FOR UPDATE")
        .fetch_one(&pool)
        .await
        .unwrap_err();
    let other = classified(store::StoreError::Database(other));
    assert!(!other.is_claim_level_refused(), "{other}");
}
