//! The `idemflow` binary on the Redis store (`redis://…`, the server at `REDIS_URL`, default
//! `redis://127.0.0.1:6379`; each test's keys under a prefix of its own, given in
//! `IDEMFLOW_REDIS_PREFIX`): `expire` of finished keys past their window and nothing else, and the
//! operator's commands answering as on PostgreSQL. No Redis is a failure, never a skip.
#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::time::Duration;

use idemflow_core::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_redis::redis;
use idemflow_redis::{RedisPool, RedisStore};
use idemflow_store::{Claim, Store};
use serde_json::json;

fn server() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A store for `test` under a prefix of its own, emptied first; the prefix.
async fn scratch(test: &str) -> (RedisPool, String) {
    let prefix = format!("idemflow-cli-test:{test}");
    let pool = RedisPool::connect_with_prefix(&server(), &prefix)
        .await
        .unwrap_or_else(|error| panic!("no Redis at {} ({error})", server()));
    let stale: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    if !stale.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&stale)
            .query_async(&mut pool.connection())
            .await
            .unwrap();
    }
    (pool, prefix)
}

fn idemflow(prefix: &str, arguments: &[&str]) -> (i32, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_idemflow"))
        .arg("--database-url")
        .arg(server())
        .args(arguments)
        .env_remove("DATABASE_URL")
        .env("IDEMFLOW_REDIS_PREFIX", prefix)
        .output()
        .unwrap();
    (
        output.status.code().unwrap(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// Claims `key` and, when `finished`, finishes it (its body stored apart).
async fn seed(pool: &RedisPool, key: &str, finished: bool) {
    let (tenant, key) = (TenantId::new("t-1").unwrap(), Key::parse(key).unwrap());
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let request = json!({});
    let claim = Claim {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: "checkout@1",
        request: &request,
        lease: Duration::from_secs(30),
    };
    let (mut transaction, owner) = RedisStore::begin_claim(pool, claim, ())
        .await
        .unwrap()
        .expect("new");
    if finished {
        RedisStore::finish(
            &mut transaction,
            &owner,
            "complete",
            &StoredResponse::new(200, b"{}".to_vec()),
            0,
        )
        .await
        .unwrap();
    }
}

/// Moves a field of `key`'s row (`lu` the lease end, `fa` the finish) `by` ms back, in its row
/// and in the sorted set that orders it.
async fn rewind(pool: &RedisPool, key: &str, field: &str, by: i64) {
    let row = pool.row("t-1", key);
    let set = if field == "lu" {
        pool.leases("checkout@1")
    } else {
        pool.finishes()
    };
    let _: () = redis::Script::new(
        "local at = tonumber(redis.call('HGET', KEYS[1], ARGV[1])) - tonumber(ARGV[2]) \
         redis.call('HSET', KEYS[1], ARGV[1], at) \
         redis.call('ZADD', KEYS[2], at, KEYS[1])",
    )
    .key(&row)
    .key(set)
    .arg(field)
    .arg(by)
    .invoke_async(&mut pool.connection())
    .await
    .unwrap();
}

#[tokio::test]
async fn expire_deletes_only_finished_keys_past_their_window() {
    let (pool, prefix) = scratch("expire").await;
    let (code, stdout, stderr) = idemflow(&prefix, &["migrate"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("nothing to migrate"), "{stdout}");
    for key in ["old-1", "old-2", "old-3", "recent"] {
        seed(&pool, key, true).await;
    }
    seed(&pool, "started", false).await;
    for key in ["old-1", "old-2", "old-3"] {
        rewind(&pool, key, "fa", 2 * 86_400_000).await;
    }
    rewind(&pool, "started", "lu", 2 * 86_400_000).await;

    let (code, stdout, stderr) = idemflow(
        &prefix,
        &[
            "--json",
            "expire",
            "--older-than",
            "1d",
            "--batch-size",
            "2",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["deleted"], 3, "{report}");
    for (key, there) in [("old-1", false), ("recent", true), ("started", true)] {
        let exists: bool = redis::cmd("EXISTS")
            .arg(pool.row("t-1", key))
            .query_async(&mut pool.connection())
            .await
            .unwrap();
        assert_eq!(exists, there, "{key}");
    }
    let bodies: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:key:*:body:*"))
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    assert_eq!(bodies.len(), 1, "the expired keys' bodies went with them");
}

/// The operator's commands answer on Redis as on PostgreSQL: a lapsed key is listed as stuck
/// and counted in the resumer's lag, a key is inspected with its journal, a live lease is not
/// ended without `--force`, and an ended one advances the fence.
#[tokio::test]
async fn inspect_list_stats_and_end_lease_work_on_redis() {
    let (pool, prefix) = scratch("keys").await;
    seed(&pool, "lapsed", false).await;
    seed(&pool, "live", false).await;
    seed(&pool, "done", true).await;
    rewind(&pool, "lapsed", "lu", 3_600_000 + 30_000).await;

    let (code, stdout, stderr) = idemflow(&prefix, &["--json", "list", "--stuck"]);
    assert_eq!(code, 0, "{stderr}");
    let listed: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|key| key["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["lapsed"], "{listed}");

    let (code, stdout, stderr) = idemflow(&prefix, &["--json", "stats"]);
    assert_eq!(code, 0, "{stderr}");
    let stats: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        stats["counts"],
        json!([
            {"workflow": "checkout@1", "state": "started", "keys": 2},
            {"workflow": "*", "state": "done", "keys": 1},
        ]),
        "{stats}"
    );
    let lag = stats["resumer_lag_ms"].as_i64().unwrap();
    assert!(
        (3_500_000..3_700_000).contains(&lag),
        "the lapsed key's lag: {lag}"
    );

    let (code, stdout, stderr) = idemflow(
        &prefix,
        &["--json", "inspect", "--tenant", "t-1", "--key", "done"],
    );
    assert_eq!(code, 0, "{stderr}");
    let done: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(done["state"], "done", "{done}");
    assert_eq!(done["response_status"], 200);
    assert_eq!(done["response_bytes"], 2, "the body apart is counted");
    assert_eq!(done["fingerprint_hex"], "01".repeat(32));
    let events: Vec<&str> = done["journal"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["claimed", "finished"], "{done}");

    let (code, _, stderr) = idemflow(&prefix, &["inspect", "--tenant", "t-1", "--key", "nope"]);
    assert_eq!(code, 1, "{stderr}");

    let (code, stdout, _) = idemflow(
        &prefix,
        &["--json", "end-lease", "--tenant", "t-1", "--key", "live"],
    );
    assert_eq!(
        code, 1,
        "a live lease is not ended without --force: {stdout}"
    );
    let before: i64 = redis::cmd("HGET")
        .arg(pool.row("t-1", "live"))
        .arg("lv")
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    let (code, stdout, stderr) = idemflow(
        &prefix,
        &[
            "--json",
            "end-lease",
            "--tenant",
            "t-1",
            "--key",
            "live",
            "--force",
        ],
    );
    assert_eq!(code, 0, "{stderr}");
    let ended: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(ended["outcome"], "ended", "{ended}");
    let report = idemflow_redis::key_report(&pool, "t-1", "live")
        .await
        .unwrap()
        .unwrap();
    assert_ne!(report.lock_version, before, "the fence advanced");
    assert_eq!(ended["new_lock_version"], report.lock_version);
    assert!(report.lease_left_ms.unwrap() <= 0, "due now: {report:?}");

    let (code, _, stderr) = idemflow(&prefix, &["partitions", "list"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no Redis form"), "{stderr}");
}
