//! The CI smoke test: the benchmark's quick mode runs every workload against DATABASE_URL and
//! counts exactly the documented commits and round trips per request (docs/protocol.md,
//! tests/round_trips.rs). Times are asserted nowhere.
#![allow(clippy::unwrap_used)]

use idemflow_bench::report::{
    CHECKOUT, ENGINE, ENGINE_HOOK, HTTP, HTTP_CHECKOUT, HTTP_REPLAY, LOCAL_ONLY, RAW, REPLAY,
};
use idemflow_bench::{Config, Report};

fn assert_counts(report: &Report, workload: &str, variant: &str, commits: u64, round_trips: u64) {
    let count = report
        .wire(workload, variant)
        .unwrap_or_else(|| panic!("no wire count for {workload} / {variant}"));
    assert!(count.requests > 0, "{count:?}");
    assert_eq!(count.total_commits, commits * count.requests, "{count:?}");
    assert_eq!(
        count.total_round_trips,
        round_trips * count.requests,
        "{count:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quick_mode_completes_with_the_documented_counts() {
    let url = std::env::var("DATABASE_URL")
        .expect("DATABASE_URL must name a PostgreSQL server (scripts/test finds one)");
    let report = idemflow_bench::run(&Config::quick(url)).await.unwrap();
    wire_counts_are_the_documented_ones(&report);
    sqlite_ran_every_operation(&report);
    mariadb_ran_every_operation_and_storm(&report);
    redis_ran_every_operation_and_storm(&report);
    the_server_agrees(&report);
    storm_drain_retention_and_partitions_held(&report);
    assert!(!report.targets.is_empty());
    assert!(!report.table().is_empty());
    serde_json::to_string(&report).unwrap();
}

fn wire_counts_are_the_documented_ones(report: &Report) {
    // The numbers of docs/protocol.md, as tests/round_trips.rs asserts them: new local →
    // foreign → local: 2 commits, look-up, BEGIN with the claim, advance, COMMIT; BEGIN, finish,
    // COMMIT (7) + its two phase statements; one local phase: 1 commit, 4 + 1; a replay: the
    // look-up alone.
    assert_eq!(idemflow_bench::DOCUMENTED_CHECKOUT, (2, 9));
    assert_eq!(idemflow_bench::DOCUMENTED_LOCAL_ONLY, (1, 5));
    assert_eq!(idemflow_bench::DOCUMENTED_REPLAY, (0, 1));
    assert_counts(report, CHECKOUT, ENGINE, 2, 7 + 2);
    assert_counts(report, CHECKOUT, ENGINE_HOOK, 2, 7 + 2);
    assert_counts(report, LOCAL_ONLY, ENGINE, 1, 4 + 1);
    assert_counts(report, REPLAY, ENGINE, 0, 1);
    assert_counts(report, HTTP_CHECKOUT, HTTP, 2, 7 + 2);
    assert_counts(report, HTTP_REPLAY, HTTP, 0, 1);
    // The raw baseline: the same statements for new requests, one select for a replay.
    assert_counts(report, CHECKOUT, RAW, 2, 9);
    assert_counts(report, LOCAL_ONLY, RAW, 1, 5);
    assert_counts(report, REPLAY, RAW, 0, 1);
    assert_eq!(report.hook_calls_per_request, Some(6.0));
}

/// The sqlite workload: the store's two operations and the runner's five on SQLite, at every
/// client count, engine and raw.
fn sqlite_ran_every_operation(report: &Report) {
    assert_eq!(report.sqlite.len(), 7 * report.settings.clients.len());
    assert!(
        report
            .sqlite
            .iter()
            .all(|run| run.engine_per_second > 0.0 && run.raw_per_second > 0.0),
        "{:?}",
        report.sqlite
    );
}

/// The mariadb workload: the runner's five operations on MariaDB at every client count, engine
/// and raw; the storm answered every copy on both sides; the engine's wire counts as documented.
fn mariadb_ran_every_operation_and_storm(report: &Report) {
    let mariadb = report.mariadb.as_ref().expect("the mariadb workload ran");
    assert_eq!(mariadb.runs.len(), 5 * report.settings.clients.len());
    assert!(
        mariadb
            .runs
            .iter()
            .all(|run| run.engine_per_second > 0.0 && run.raw_per_second > 0.0),
        "{:?}",
        mariadb.runs
    );
    assert_eq!(mariadb.storm.len(), 2);
    assert!(
        mariadb
            .storm
            .iter()
            .all(|storm| storm.failed == 0 && storm.executed > 0),
        "{:?}",
        mariadb.storm
    );
    assert_eq!(mariadb.wire.len(), 6);
    assert!(
        mariadb.wire.iter().all(|count| count.as_documented()),
        "{:?}",
        mariadb.wire
    );
}

/// The redis workload: the three operations on Redis and PostgreSQL at every client count; the
/// storm answered every copy on both; round trips to Redis per request as docs/engines.md
/// documents: a new key is its look-up, its claim and its finish, a replay its look-up alone.
fn redis_ran_every_operation_and_storm(report: &Report) {
    let redis = report.redis.as_ref().expect("the redis workload ran");
    assert_eq!(redis.runs.len(), 3 * report.settings.clients.len());
    assert!(
        redis
            .runs
            .iter()
            .all(|run| run.redis_per_second > 0.0 && run.postgres_per_second > 0.0),
        "{:?}",
        redis.runs
    );
    assert_eq!(redis.storm.len(), 2);
    assert!(
        redis
            .storm
            .iter()
            .all(|storm| storm.failed == 0 && storm.executed > 0),
        "{:?}",
        redis.storm
    );
    let round_trips: Vec<(&str, f64)> = redis
        .round_trips
        .iter()
        .map(|(operation, round_trips)| (operation.as_str(), *round_trips))
        .collect();
    assert_eq!(
        round_trips,
        [("new", 3.0), ("replay", 1.0), ("http-new", 3.0)],
        "round trips to Redis per request"
    ); // The cluster rows: run where a cluster is given (scripts/test starts one), else said not run.
    if redis.cluster_server.is_some() {
        assert_eq!(redis.cluster.len(), 2 * report.settings.clients.len());
        assert!(
            redis
                .cluster
                .iter()
                .all(|run| run.single_per_second > 0.0 && run.cluster_per_second > 0.0),
            "{:?}",
            redis.cluster
        );
    } else {
        assert!(redis.cluster.is_empty() && redis.cluster_not_run.is_some());
    }
}

/// The server agrees: xact_commit per request. It also counts read-only autocommit statements
/// as commits (they write no WAL and wait for no flush): the engine's look-up is one, so a new
/// request shows its durable commits + 1 there, a replay 1.
fn the_server_agrees(report: &Report) {
    for (workload, variant, commits) in [
        (CHECKOUT, ENGINE, 3.0),
        (LOCAL_ONLY, ENGINE, 2.0),
        (REPLAY, ENGINE, 1.0),
        (REPLAY, RAW, 1.0),
    ] {
        for &clients in &report.settings.clients {
            let run = report.run(workload, variant, clients).unwrap();
            assert!(run.requests > 0, "{run:?}");
            let server = run.server.unwrap();
            // A sanity check only (the exact counts are the wire's, above): the server also
            // counts each new connection's setup and whatever autovacuum did, which in a
            // quick run of a few dozen requests on a loaded machine can add a tenth or more.
            let slack = 0.1 + (4.0 * clients as f64 + 4.0) / run.requests as f64;
            assert!(
                server.commits_per_request >= commits - 0.1
                    && server.commits_per_request <= commits + slack,
                "{workload} {variant} at {clients}: {server:?}"
            );
        }
    }
}

/// The storm executed each key once, the drains finished every key, retention deleted every
/// row; the partitioned-expiry workload's variants each expired every key, dropping partitions
/// deleted no row one by one and left no dead tuple, and each layout was measured.
fn storm_drain_retention_and_partitions_held(report: &Report) {
    let storm = report.storm.as_ref().unwrap();
    assert!(storm.one_execution_per_key);
    assert_eq!(storm.executed as usize, storm.rounds * storm.keys_per_round);
    assert_eq!(
        storm.executed + storm.in_progress + storm.replayed,
        storm.requests
    );
    for drain in &report.drain {
        assert_eq!(drain.finished, drain.keys, "{drain:?}");
    }
    let retention = report.retention.as_ref().unwrap();
    assert_eq!(retention.deleted, retention.rows);
    let partitioned = report.partitioned_expiry.as_ref().unwrap();
    assert_eq!(partitioned.expiries.len(), 3);
    for expiry in &partitioned.expiries {
        assert_eq!(expiry.expired, partitioned.keys, "{expiry:?}");
        if expiry.partitioned {
            assert!(
                expiry.partitions_after < expiry.partitions_before,
                "{expiry:?}"
            );
            assert_eq!(expiry.rows_deleted, 0, "{expiry:?}");
            assert_eq!(expiry.dead_tuples_left_by_expiry, 0, "{expiry:?}");
        } else {
            assert_eq!(expiry.rows_deleted, partitioned.keys as i64, "{expiry:?}");
        }
    }
    assert_eq!(partitioned.costs.len(), 4, "{:?}", partitioned.costs);
}
