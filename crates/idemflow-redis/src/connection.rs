//! [`RedisConnection`]: one Redis through a connection manager, or a Redis Cluster through the
//! cluster client, behind one type the scripts and commands go through.

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, IntoConnectionInfo, Pipeline, RedisFuture, Value};

/// The store's connection: to one Redis (a connection manager: one multiplexed connection,
/// replaced in the background when the server closes it), or to a Redis Cluster (the cluster
/// client: a connection to each node, each command sent to the primary of its key's slot,
/// following `MOVED` and `ASK` while slots move, and finding the new primary after a failover).
/// Cloned cheaply: every clone shares the same connections.
#[derive(Clone)]
pub enum RedisConnection {
    /// One Redis (with or without replicas).
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(match self {
            Self::Single(_) => "RedisConnection::Single",
            Self::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// The URLs of `urls`: one URL, or several separated by commas or white space (a cluster's
/// nodes, any of which tells the client of the others).
pub(crate) fn split(urls: &str) -> Vec<&str> {
    urls.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|url| !url.is_empty())
        .collect()
}

/// Opens the cluster client on `urls` (its seed nodes).
pub(crate) async fn cluster(urls: &[&str]) -> redis::RedisResult<ClusterConnection> {
    redis::cluster::ClusterClient::builder(urls.iter().copied())
        .connection_timeout(std::time::Duration::from_secs(2))
        .response_timeout(std::time::Duration::from_secs(5))
        .build()?
        .get_async_connection()
        .await
}

/// Whether the server behind `connection` is a Redis Cluster node: `HELLO`'s `mode` (which any
/// user may ask for), else `INFO cluster`'s `cluster_enabled`; `false` when it answers neither.
pub(crate) async fn is_cluster(connection: &mut ConnectionManager) -> bool {
    let hello: redis::RedisResult<Value> = redis::cmd("HELLO").query_async(connection).await;
    if let Ok(hello) = hello {
        let fields: Vec<(Value, Value)> = match hello {
            Value::Map(fields) => fields,
            Value::Array(flat) => {
                let mut flat = flat.into_iter();
                std::iter::from_fn(|| Some((flat.next()?, flat.next()?))).collect()
            }
            _ => Vec::new(),
        };
        let text = |value: &Value| match value {
            Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
            Value::SimpleString(text) => Some(text.clone()),
            _ => None,
        };
        if let Some((_, mode)) = fields
            .iter()
            .find(|(name, _)| text(name).as_deref() == Some("mode"))
        {
            return text(mode).as_deref() == Some("cluster");
        }
    }
    let info: redis::RedisResult<String> = redis::cmd("INFO")
        .arg("cluster")
        .query_async(connection)
        .await;
    info.is_ok_and(|info| info.lines().any(|line| line.trim() == "cluster_enabled:1"))
}

/// A connection of its own to each primary of the cluster `seed` belongs to (`CLUSTER SLOTS`,
/// asked of `seed`), with `seed`'s credentials: for what is sent to every node (a `SCAN` of the
/// keyspace, `CLIENT KILL`), never for the store's own commands.
pub(crate) async fn primaries(
    seed: &str,
    connection: &mut impl ConnectionLike,
) -> redis::RedisResult<Vec<(String, MultiplexedConnection)>> {
    let slots: Vec<Vec<Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(connection)
        .await?;
    let mut addresses: Vec<(String, u16)> = Vec::new();
    for range in slots {
        // start, end, then the primary: [host, port, id, …].
        let Some(Value::Array(primary)) = range.get(2) else {
            continue;
        };
        let host = match primary.first() {
            Some(Value::BulkString(bytes)) => String::from_utf8_lossy(bytes).into_owned(),
            Some(Value::SimpleString(text)) => text.clone(),
            _ => continue,
        };
        let Some(Value::Int(port)) = primary.get(1) else {
            continue;
        };
        let address = (host, u16::try_from(*port).unwrap_or(0));
        if !addresses.contains(&address) {
            addresses.push(address);
        }
    }
    let info = seed.into_connection_info()?;
    let mut connections = Vec::new();
    for (host, port) in addresses {
        let name = format!("{host}:{port}");
        let client = redis::Client::open(
            info.clone()
                .set_addr(redis::ConnectionAddr::Tcp(host, port)),
        )?;
        connections.push((name, client.get_multiplexed_async_connection().await?));
    }
    Ok(connections)
}
