//! A Redis of its own per test: the server at `REDIS_URL` (default `redis://127.0.0.1:6379`),
//! every Redis key under a prefix named for the test, deleted at its start (left behind at its
//! end, to look at). No Redis is a failure, never a skip.

use idemflow_redis::RedisPool;

/// The server the tests use.
pub fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Every Redis key under `pool`'s prefix, on every primary (`SCAN` answers for one node).
pub async fn keys(pool: &RedisPool) -> Vec<String> {
    let mut found = Vec::new();
    for (node, mut connection) in pool.primaries().await.expect("the primaries") {
        let mut cursor: u64 = 0;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}:*", pool.prefix()))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut connection)
                .await
                .unwrap_or_else(|error| panic!("SCAN on {node}: {error}"));
            found.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    found
}

/// Deletes `names`: at once on one Redis; on a cluster, which refuses a `DEL` of keys in several
/// slots, at once for each hash tag (a bucket's keys).
async fn delete(pool: &RedisPool, names: &[String]) {
    let mut groups: std::collections::BTreeMap<&str, Vec<&String>> = Default::default();
    for name in names {
        let tag = if pool.is_cluster() {
            name.split_once('{')
                .and_then(|(_, rest)| rest.split_once('}'))
                .map_or(name.as_str(), |(tag, _)| tag)
        } else {
            ""
        };
        groups.entry(tag).or_default().push(name);
    }
    let mut connection = pool.connection();
    for group in groups.values() {
        let _: () = redis::cmd("DEL")
            .arg(group)
            .query_async(&mut connection)
            .await
            .expect("DEL");
    }
}

/// Every key row under `pool`'s prefix.
pub async fn rows(pool: &RedisPool) -> Vec<String> {
    keys(pool)
        .await
        .into_iter()
        .filter(|name| name.contains(":key:") && !name.contains(":body:"))
        .collect()
}

/// The server the tests' stores are on: `url` (one Redis), or the cluster at
/// `REDIS_CLUSTER_URLS` with `cluster`.
fn server(cluster: bool) -> String {
    if cluster { cluster_urls() } else { url() }
}

/// The Redis Cluster the tests use (`REDIS_CLUSTER_URLS`: its nodes' URLs, separated by commas),
/// started by `scripts/lib/redis-cluster.sh`. No cluster is a failure, never a skip.
pub fn cluster_urls() -> String {
    std::env::var("REDIS_CLUSTER_URLS").unwrap_or_else(|_| {
        panic!(
            "REDIS_CLUSTER_URLS is not set: the Redis Cluster tests need a cluster (scripts/test \
             starts one with scripts/lib/redis-cluster.sh; by hand: source \
             scripts/lib/redis-cluster.sh && idemflow_redis_cluster_up)"
        )
    })
}

/// A store for `test` under a prefix of its own, emptied first.
pub async fn fresh(test: &str) -> RedisPool {
    fresh_on(test, false).await
}

/// A store for `test` under a prefix of its own, emptied first, on one Redis or (`cluster`) on
/// the cluster.
pub async fn fresh_on(test: &str, cluster: bool) -> RedisPool {
    let prefix = format!("idemflow-test:{test}");
    let server = server(cluster);
    let pool = RedisPool::connect_with_prefix(&server, &prefix)
        .await
        .unwrap_or_else(|error| {
            panic!(
                "no Redis at {server} ({error}): the Redis tests need one (Debian: apt-get \
                 install redis-server), or REDIS_URL set to a server"
            )
        });
    assert_eq!(pool.is_cluster(), cluster, "{server}");
    let stale = keys(&pool).await;
    delete(&pool, &stale).await;
    pool
}

/// Ends every started key's lease: rewinds its end a day, in its row and its sorted set.
pub async fn lapse_leases(pool: &RedisPool) {
    <idemflow_redis::RedisStore as idemflow_store::Tamper>::lapse_leases(pool, None)
        .await
        .unwrap();
}

/// Moves every finished key's finish two days back, in its row and the sorted set of finishes.
pub async fn age_finished(pool: &RedisPool) {
    <idemflow_redis::RedisStore as idemflow_store::Tamper>::age_finished(
        pool,
        std::time::Duration::from_secs(2 * 86_400),
    )
    .await
    .unwrap();
}

/// What a Redis restart without persistence (or a failover to a replica that missed the last
/// writes) does to the store: every key under `pool`'s prefix is gone, the fences' counters too.
/// Only this prefix: other tests share the server.
pub async fn lose_everything(pool: &RedisPool) {
    let all = keys(pool).await;
    delete(pool, &all).await;
}

/// A `redis-server` of the test's own (`IDEMFLOW_REDIS_SERVER`, default `redis-server` on the
/// `PATH`), for what cannot share the server other tests use: a configuration of its own (a
/// cluster node), or a slow log no other test writes to. Killed when dropped.
pub struct OwnServer {
    child: std::process::Child,
    directory: std::path::PathBuf,
    /// Its URL.
    pub url: String,
}

impl OwnServer {
    /// Kills the server with SIGKILL, as a crash would: no shutdown, nothing saved.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.directory);
    }
}

/// Starts a `redis-server` with `arguments` beside the test's own (no persistence, loopback, a
/// free port), and waits until it answers.
pub async fn own_server(arguments: &[&str]) -> OwnServer {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let directory = std::env::temp_dir().join(format!("idemflow-redis-{port}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let binary = std::env::var("IDEMFLOW_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into());
    let child = std::process::Command::new(&binary)
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "no", "--dir"])
        .arg(&directory)
        .args(arguments)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|error| {
            panic!(
                "cannot start {binary} ({error}): these tests need a Redis server binary \
                 (Debian: apt-get install redis-server), or IDEMFLOW_REDIS_SERVER naming one"
            )
        });
    let server = OwnServer {
        child,
        directory,
        url: format!("redis://127.0.0.1:{port}"),
    };
    let client = redis::Client::open(server.url.as_str()).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            if let Ok(mut connection) = client.get_multiplexed_async_connection().await
                && redis::cmd("PING")
                    .query_async::<String>(&mut connection)
                    .await
                    .is_ok()
            {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the test's own redis-server answers");
    server
}

/// A Redis Cluster of the test's own: three primaries and three replicas, each an [`OwnServer`]
/// in cluster mode (`cluster-node-timeout` 1000 ms, so a killed primary's replica is promoted
/// within seconds), joined by `redis-cli --cluster create --cluster-replicas 1`. For what cannot
/// share the suite's cluster: a primary killed, slots moved. Killed when dropped.
pub struct OwnCluster {
    /// Its nodes, primaries first as `--cluster create` was given them.
    pub nodes: Vec<OwnServer>,
}

impl OwnCluster {
    /// Every node's URL, comma-separated: what [`RedisPool::connect`] takes.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|node| node.url.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `host:port` of each node.
    pub fn addresses(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|node| node.url.trim_start_matches("redis://").to_owned())
            .collect()
    }
}

/// A free port on loopback.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `CLUSTER INFO` of the node at `url` says `cluster_state:ok`, and, if it is a replica, its link
/// to its primary is up (a replica that never synced is never promoted).
pub async fn cluster_ok(url: &str) -> bool {
    let Ok(client) = redis::Client::open(url) else {
        return false;
    };
    let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    let state = redis::cmd("CLUSTER")
        .arg("INFO")
        .query_async::<String>(&mut connection)
        .await
        .is_ok_and(|info| info.contains("cluster_state:ok"));
    state
        && redis::cmd("INFO")
            .arg("replication")
            .query_async::<String>(&mut connection)
            .await
            .is_ok_and(|info| {
                !info.contains("role:slave") || info.contains("master_link_status:up")
            })
}

/// Starts a cluster of the test's own (see [`OwnCluster`]) and waits until every node says
/// `cluster_state:ok`.
pub async fn own_cluster() -> OwnCluster {
    let mut nodes = Vec::new();
    for _ in 0..6 {
        let bus = free_port().to_string();
        nodes.push(
            own_server(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "1000",
                "--cluster-port",
                &bus,
            ])
            .await,
        );
    }
    let cluster = OwnCluster { nodes };
    let created = std::process::Command::new("redis-cli")
        .arg("--cluster")
        .arg("create")
        .args(cluster.addresses())
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .output()
        .unwrap_or_else(|error| {
            panic!("cannot run redis-cli ({error}): Debian's redis-tools (redis-server brings it)")
        });
    assert!(
        created.status.success(),
        "redis-cli --cluster create: {}",
        String::from_utf8_lossy(&created.stdout)
    );
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        for node in &cluster.nodes {
            while !cluster_ok(&node.url).await {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        }
    })
    .await
    .expect("every node of the test's own cluster says cluster_state:ok, every replica synced");
    cluster
}
