//! A Redis of its own per test: the server at `REDIS_URL` (default `redis://127.0.0.1:6379`),
//! every Redis key under a prefix named for the test, deleted at its start (left behind at its
//! end, to look at). No Redis is a failure, never a skip.

use idemflow_redis::RedisPool;

/// The server the tests use.
pub fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// Every Redis key under `pool`'s prefix.
async fn keys(pool: &RedisPool) -> Vec<String> {
    let mut connection = pool.connection();
    let mut found = Vec::new();
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
            .expect("SCAN");
        found.extend(batch);
        if next == 0 {
            return found;
        }
        cursor = next;
    }
}

/// Every key row under `pool`'s prefix.
pub async fn rows(pool: &RedisPool) -> Vec<String> {
    let rows = format!("{}:key:", pool.prefix());
    keys(pool)
        .await
        .into_iter()
        .filter(|name| name.starts_with(&rows) && !name.contains(":body:"))
        .collect()
}

/// A store for `test` under a prefix of its own, emptied first.
pub async fn fresh(test: &str) -> RedisPool {
    let prefix = format!("idemflow-test:{test}");
    let pool = RedisPool::connect_with_prefix(&url(), &prefix)
        .await
        .unwrap_or_else(|error| {
            panic!(
                "no Redis at {} ({error}): the Redis tests need one (Debian: apt-get install \
                 redis-server), or REDIS_URL set to a server",
                url()
            )
        });
    let stale = keys(&pool).await;
    if !stale.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&stale)
            .query_async(&mut pool.connection())
            .await
            .expect("DEL");
    }
    pool
}

/// Ends every started key's lease: rewinds its end a day, in its row and its sorted set.
pub async fn lapse_leases(pool: &RedisPool) {
    for row in rows(pool).await {
        let mut connection = pool.connection();
        let (state, workflow, ends): (Option<String>, Option<String>, Option<i64>) =
            redis::cmd("HMGET")
                .arg(&row)
                .arg(&["st", "wf", "lu"])
                .query_async(&mut connection)
                .await
                .unwrap();
        if let (Some("started"), Some(workflow), Some(ends)) = (state.as_deref(), workflow, ends) {
            let ended = ends - 86_400_000;
            let _: () = redis::pipe()
                .cmd("HSET")
                .arg(&row)
                .arg("lu")
                .arg(ended)
                .cmd("ZADD")
                .arg(pool.leases(&workflow))
                .arg(ended)
                .arg(&row)
                .query_async(&mut connection)
                .await
                .unwrap();
        }
    }
}

/// Moves every finished key's finish two days back, in its row and the sorted set of finishes.
pub async fn age_finished(pool: &RedisPool) {
    for row in rows(pool).await {
        let mut connection = pool.connection();
        let (state, finished): (Option<String>, Option<i64>) = redis::cmd("HMGET")
            .arg(&row)
            .arg(&["st", "fa"])
            .query_async(&mut connection)
            .await
            .unwrap();
        if let (Some("done"), Some(finished)) = (state.as_deref(), finished) {
            let aged = finished - 2 * 86_400_000;
            let _: () = redis::pipe()
                .cmd("HSET")
                .arg(&row)
                .arg("fa")
                .arg(aged)
                .cmd("ZADD")
                .arg(pool.finishes())
                .arg(aged)
                .arg(&row)
                .query_async(&mut connection)
                .await
                .unwrap();
        }
    }
}

/// What a Redis restart without persistence (or a failover to a replica that missed the last
/// writes) does to the store: every key under `pool`'s prefix is gone, the fence's counter too.
/// Only this prefix: other tests share the server.
pub async fn lose_everything(pool: &RedisPool) {
    let all = keys(pool).await;
    if !all.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&all)
            .query_async(&mut pool.connection())
            .await
            .expect("DEL");
    }
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
