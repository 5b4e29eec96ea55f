//! idemflow's keys in Redis: the protocol's claim, fence and owner writes as Redis scripts,
//! behind the engine boundary ([`idemflow_store::Engine`]).
//!
//! **What it is for.** Workflows whose phases are all foreign (each called with its derived key)
//! and plain handlers, where a rare duplicate is tolerable: Redis acknowledges a write before it
//! reaches a replica or the disk, so a failover or a restart can lose keys, and a retry of a lost
//! key runs again (its foreign calls carry the same derived keys, so the provider's own
//! idempotency decides). A local phase cannot run here: there is no transaction its effects could
//! share with the recovery point. docs/engines.md says when to choose it.
//!
//! **How the protocol maps.** The claim is one script: the key's row is created only if absent
//! (`EXISTS`, then `HSET`), with a fencing token from its bucket's counter (`INCR`), so a key's
//! token never repeats while Redis keeps its data. Every owner write is a script that checks the
//! token and writes in one atomic step. A started key sits in its workflow's sorted set of lease
//! ends of its bucket, which the resumer reads instead of scanning the keyspace; finished keys sit
//! in their bucket's sorted set of finish times, which retention reads in batches. Keys of tenants live under names built from the
//! tenant and the key in hex, so no tenant's key can name another's. Each write stands alone:
//! a [`Transaction`] groups nothing and its rollback undoes nothing (there are no local effects to
//! undo), and a claim is visible at once, which is what tells a concurrent duplicate 409.
//!
//! Every key falls in one of [`BUCKETS`] buckets, and every Redis key of a bucket carries the
//! bucket's hash tag, so each script touches one hash slot: the store runs on one Redis (with or
//! without replicas) or on a Redis Cluster, with the same scripts ([`RedisPool::connect`]).

#![deny(missing_docs)]

mod connection;
mod console;
mod layout;
mod operator;
mod scripts;
mod tamper;

pub use connection::RedisConnection;
pub use layout::{BUCKETS, bucket_slot};

pub use console::{
    MEMBERS_PER_SCRIPT, end_lease, expire_key, finished_keys, key_bodies, key_report, overview,
    scan_keys, stuck_keys,
};

pub use operator::RedisOperator;

/// The Redis client this store is built with.
pub use redis;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use idemflow_store::layout::Maintained;
use idemflow_store::{
    Claim, Claimed, ConnectionPool, DatabaseError, DatabaseErrorKind, Engine, EngineError,
    EnginePool, FoundKey, KeyOwner, LastError, Limits, LookUp, Standing, Taken,
};
use redis::aio::ConnectionManager;
use serde_json::Value;
use tokio::sync::Notify;

/// The store's errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A fenced write changed nothing: another owner holds the key.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// Redis refused a command, or the connection failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// A stored row breaks the store's promises.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
    /// A prefix holding `{` or `}`: the store's Redis keys carry a hash tag of their own after
    /// the prefix, which braces in the prefix would replace.
    #[error("a Redis key prefix may not hold `{{` or `}}`: {0:?}")]
    Prefix(String),
}

impl From<StoreError> for EngineError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Fenced => Self::Fenced,
            StoreError::Corrupt(message) => Self::Corrupt(message),
            StoreError::Prefix(prefix) => {
                Self::Database(DatabaseError::other(StoreError::Prefix(prefix)))
            }
            // A broken connection: the runner tries again where it would on a database.
            StoreError::Redis(error) if error.is_io_error() || error.is_connection_dropped() => {
                Self::Database(DatabaseError::new(DatabaseErrorKind::ConnectionLost, error))
            }
            StoreError::Redis(error) => Self::Database(DatabaseError::other(error)),
        }
    }
}

/// Where the keys live: one Redis, or a Redis Cluster, through one [`RedisConnection`] (commands
/// from every task share it, pipelined), under a prefix. On one Redis, a connection the server
/// closes (a restart, a failover's switch, `CLIENT KILL`) is replaced in the background: the
/// commands in flight then fail, as the database being unavailable, and the ones after reach
/// Redis again. On a cluster, the cluster client sends each command to the primary of its key's
/// slot, follows `MOVED` and `ASK` while slots move, and finds a promoted replica after a
/// failover.
///
/// It is also the store's connection: a multiplexed connection is shared, not taken, so the pool
/// and the connection a statement runs on are one thing (cloned cheaply).
#[derive(Clone)]
pub struct RedisPool {
    connection: RedisConnection,
    prefix: Arc<str>,
    /// The first URL connected to: where node-wide commands find the cluster's primaries.
    seed: Arc<str>,
}

impl fmt::Debug for RedisPool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RedisPool")
            .field("prefix", &self.prefix)
            .field("connection", &self.connection)
            .finish_non_exhaustive()
    }
}

/// The prefix of every Redis key the store writes, unless told otherwise.
pub const DEFAULT_PREFIX: &str = "idemflow";

impl RedisPool {
    /// Connects to the Redis at `url` (`redis://127.0.0.1:6379`), keys under [`DEFAULT_PREFIX`].
    /// A Redis Cluster is found by any of its nodes' URLs, or by several separated by commas
    /// (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`): see [`RedisPool::connect_with_prefix`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_prefix(url, DEFAULT_PREFIX).await
    }

    /// Connects, keys under `prefix` (two services, or two test cases, on one Redis). `url` is
    /// one URL, or several separated by commas or white space. Several URLs are a Redis
    /// Cluster's nodes (the cluster client learns the others from them); one URL is a cluster
    /// when the server there says it is a cluster node (`HELLO`'s `mode`), else one Redis. The
    /// prefix may hold no `{` or `}`: the store's names carry a hash tag of their own
    /// ([`StoreError::Prefix`]).
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        if prefix.contains(['{', '}']) {
            return Err(StoreError::Prefix(prefix.to_owned()));
        }
        let urls = connection::split(url);
        let Some(&seed) = urls.first() else {
            return Err(StoreError::Redis(redis::RedisError::from((
                redis::ErrorKind::InvalidClientConfig,
                "no Redis URL given",
            ))));
        };
        let connection = if urls.len() > 1 {
            RedisConnection::Cluster(connection::cluster(&urls).await?)
        } else {
            let client = redis::Client::open(seed)?;
            // A connection manager, not a bare multiplexed connection: a bare one stays broken
            // once the server closes it, and every request after a Redis restart would fail for
            // ever.
            let mut single = ConnectionManager::new(client).await?;
            if connection::is_cluster(&mut single).await {
                RedisConnection::Cluster(connection::cluster(&urls).await?)
            } else {
                RedisConnection::Single(single)
            }
        };
        let pool = Self {
            connection,
            prefix: Arc::from(prefix),
            seed: Arc::from(seed),
        };
        if let Ok(Some(policy)) = pool.evicting_policy().await {
            tracing::warn!(
                %policy,
                "Redis may evict idemflow's keys (maxmemory-policy {policy}): an evicted key runs \
                 again on its next retry; set maxmemory-policy noeviction (docs/engines.md)"
            );
        }
        Ok(pool)
    }

    /// The server's `maxmemory-policy` when it may evict the store's keys (an `allkeys-*`
    /// policy: the store's keys carry no expiry, so `volatile-*` policies never take them), else
    /// `None` (on a cluster, as one node answers). An evicted key is a key lost: its next retry
    /// runs the request again. `Err` where the server refuses `CONFIG GET` (as managed services
    /// may); [`RedisPool::connect`] then says nothing.
    pub async fn evicting_policy(&self) -> Result<Option<String>, StoreError> {
        let answer: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory-policy")
            .query_async(&mut self.connection())
            .await?;
        Ok(answer
            .get(1)
            .filter(|policy| policy.starts_with("allkeys-"))
            .cloned())
    }

    /// Whether the store is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.connection, RedisConnection::Cluster(_))
    }

    /// A connection of its own to each primary (on one Redis, to it), named `host:port`: for
    /// what is sent to every node rather than to a key's (a `SCAN` of the keyspace, `CLIENT
    /// KILL`), by tests and operators; the store itself never needs one.
    pub async fn primaries(
        &self,
    ) -> Result<Vec<(String, redis::aio::MultiplexedConnection)>, StoreError> {
        if self.is_cluster() {
            return Ok(connection::primaries(&self.seed, &mut self.connection()).await?);
        }
        let client = redis::Client::open(&*self.seed)?;
        Ok(vec![(
            self.seed.to_string(),
            client.get_multiplexed_async_connection().await?,
        )])
    }

    /// The connection every command goes through.
    pub fn connection(&self) -> RedisConnection {
        self.connection.clone()
    }

    /// The prefix of every Redis key the store writes.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The bucket a tenant's key lives in ([`BUCKETS`]).
    pub fn bucket(tenant: &str, key: &str) -> u16 {
        layout::bucket_of(tenant, key)
    }

    /// What every Redis key of bucket `bucket` starts with: the prefix and the bucket's hash tag
    /// (`idemflow:{3.7}:`).
    pub fn bucket_prefix(&self, bucket: u16) -> String {
        format!("{}:{}:", self.prefix, layout::tag(bucket))
    }

    /// The row of a tenant's key: tenant and key in hex, so neither can hold the separator, in
    /// the key's bucket (`<prefix>:{<tag>}:key:<tenant>:<key>`).
    pub fn row(&self, tenant: &str, key: &str) -> String {
        format!(
            "{}{}:{}",
            self.rows_prefix(Self::bucket(tenant, key)),
            idemflow_core::hex::encode(tenant.as_bytes()),
            idemflow_core::hex::encode(key.as_bytes())
        )
    }

    /// A row's body stored apart by the finish of token `apart`.
    pub fn body(row: &str, apart: i64) -> String {
        format!("{row}:body:{apart}")
    }

    /// The sorted set of a workflow's started keys of bucket `bucket`, by lease end.
    pub fn leases(&self, bucket: u16, workflow: &str) -> String {
        format!(
            "{}{}",
            self.leases_prefix(bucket),
            idemflow_core::hex::encode(workflow.as_bytes())
        )
    }

    /// The sorted set of bucket `bucket`'s finished keys, by finish time.
    pub fn finishes(&self, bucket: u16) -> String {
        format!("{}finishes", self.bucket_prefix(bucket))
    }

    /// The set of workflows (in hex) that have claimed keys in bucket `bucket`.
    pub fn workflows(&self, bucket: u16) -> String {
        format!("{}workflows", self.bucket_prefix(bucket))
    }

    /// The hash of bucket `bucket`'s rows that have an entry in a set of lease ends: the row's
    /// name, the workflow (in hex) whose set it is in. What lets a claim name, among its keys,
    /// the set an earlier row of its key, lost alone, left an entry in.
    pub fn leased(&self, bucket: u16) -> String {
        format!("{}leased", self.bucket_prefix(bucket))
    }

    /// The sorted set of every key of bucket `bucket` (all scores 0, so members sort byte by
    /// byte): the tenant and the key in hex joined by `!`, which sorts before every hex digit, so
    /// members sort as `(tenant, key)` pairs do. What the console's scan walks, every bucket's
    /// merged.
    pub fn index(&self, bucket: u16) -> String {
        format!("{}index", self.bucket_prefix(bucket))
    }

    /// A key's member of [`RedisPool::index`].
    pub(crate) fn member(tenant: &str, key: &str) -> String {
        format!(
            "{}!{}",
            idemflow_core::hex::encode(tenant.as_bytes()),
            idemflow_core::hex::encode(key.as_bytes())
        )
    }

    /// What every row's name in bucket `bucket` starts with.
    pub fn rows_prefix(&self, bucket: u16) -> String {
        format!("{}key:", self.bucket_prefix(bucket))
    }

    /// What every sorted set of lease ends of bucket `bucket` is named by, before its workflow
    /// in hex.
    pub(crate) fn leases_prefix(&self, bucket: u16) -> String {
        format!("{}leases:", self.bucket_prefix(bucket))
    }

    /// Bucket `bucket`'s fence: the counter its keys' tokens are drawn from.
    pub fn fence(&self, bucket: u16) -> String {
        format!("{}fence", self.bucket_prefix(bucket))
    }
}

/// The store on Redis.
#[derive(Debug, Clone, Copy, Default)]
pub struct RedisStore;

/// A key's owner: tenant, key, the workflow (whose sorted set holds its lease) and the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    tenant: TenantId,
    key: Key,
    workflow: String,
    lock_version: i64,
}

impl Owner {
    /// The bucket the key lives in.
    fn bucket(&self) -> u16 {
        RedisPool::bucket(self.tenant.as_str(), self.key.as_str())
    }

    /// The tenant the key belongs to.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    /// The key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fencing token held.
    pub fn lock_version(&self) -> i64 {
        self.lock_version
    }
}

impl KeyOwner for Owner {
    fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    fn key(&self) -> &Key {
        &self.key
    }

    fn lock_version(&self) -> i64 {
        self.lock_version
    }
}

/// Writes on Redis stand alone (see the crate's documentation): a transaction is the connection
/// its writes go through.
#[derive(Debug)]
pub struct Transaction {
    pool: RedisPool,
}

impl Transaction {
    /// A transaction on `pool`'s connection.
    pub fn on(pool: RedisPool) -> Self {
        Self { pool }
    }

    /// The connection, back.
    pub fn into_pool(self) -> RedisPool {
        self.pool
    }
}

fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

fn fenced(changed: i64) -> Result<(), StoreError> {
    if changed == 1 {
        Ok(())
    } else {
        Err(StoreError::Fenced)
    }
}

/// The workflow a started row belongs to, read where a write needs its sorted set.
async fn workflow_of(
    connection: &mut RedisConnection,
    row: &str,
) -> Result<Option<String>, StoreError> {
    Ok(redis::cmd("HGET")
        .arg(row)
        .arg("wf")
        .query_async(connection)
        .await?)
}

type TakenFields = (
    i64,
    i64,
    String,
    String,
    String,
    Option<String>,
    String,
    Option<String>,
);

fn taken(
    fields: TakenFields,
    workflow: &str,
    lease_from: Instant,
) -> Result<Taken<Owner>, StoreError> {
    let (token, attempts, tenant, key, recovery_point, output, request, last_error) = fields;
    let tenant = TenantId::new(&tenant)
        .map_err(|error| StoreError::Corrupt(format!("stored tenant: {error}")))?;
    let key =
        Key::parse(&key).map_err(|error| StoreError::Corrupt(format!("stored key: {error}")))?;
    let json = |text: &str| {
        serde_json::from_str::<Value>(text)
            .map_err(|error| StoreError::Corrupt(format!("stored JSON: {error}")))
    };
    Ok(Taken {
        owner: Owner {
            tenant,
            key,
            workflow: workflow.to_owned(),
            lock_version: token,
        },
        recovery_point,
        phase_output: output.as_deref().map(json).transpose()?,
        request: json(&request)?,
        attempts,
        last_error,
        lease_from,
    })
}

type LookedUp = (i64, Vec<Option<Vec<u8>>>);

fn found(looked: LookedUp) -> Result<Option<FoundKey>, StoreError> {
    let (now, fields) = looked;
    let field = |index: usize| fields.get(index).cloned().flatten();
    let text = |index: usize| -> Result<Option<String>, StoreError> {
        field(index)
            .map(|bytes| {
                String::from_utf8(bytes).map_err(|_| StoreError::Corrupt("non-UTF-8 field".into()))
            })
            .transpose()
    };
    let number = |index: usize| -> Result<Option<i64>, StoreError> {
        text(index)?
            .map(|text| {
                text.parse::<i64>()
                    .map_err(|_| StoreError::Corrupt(format!("not a number: {text}")))
            })
            .transpose()
    };
    let Some(fingerprint) = field(0) else {
        return Ok(None);
    };
    let fingerprint = Fingerprint::from_slice(&fingerprint)
        .ok_or_else(|| StoreError::Corrupt("fingerprint".into()))?;
    let workflow = text(1)?.unwrap_or_default();
    let done = text(2)?.as_deref() == Some("done");
    let lease_left = match number(3)? {
        Some(ends) if !done && ends > now => Duration::from_millis((ends - now) as u64),
        _ => Duration::ZERO,
    };
    let lock_version = number(4)?.ok_or_else(|| StoreError::Corrupt("no token".into()))?;
    let response = if done {
        let status = number(5)?.ok_or_else(|| StoreError::Corrupt("no status".into()))?;
        let headers: Vec<(String, FieldValue)> =
            serde_json::from_str(&text(6)?.unwrap_or_default())
                .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
        Some(StoredResponse {
            status: u16::try_from(status)
                .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
            headers,
            body: field(7).unwrap_or_default(),
        })
    } else {
        None
    };
    Ok(Some(FoundKey {
        fingerprint,
        workflow,
        done,
        lease_left,
        lock_version,
        response,
        body_apart: number(8)?,
    }))
}

impl EnginePool<RedisStore> for RedisPool {
    fn into_pool(self) -> RedisPool {
        self
    }

    fn as_pool(&self) -> &RedisPool {
        self
    }
}

/// One multiplexed connection, shared: taking one is a clone, there is always one, and it never
/// closes under the runner.
#[async_trait]
impl ConnectionPool for RedisPool {
    type Connection = RedisPool;
    type Pooled = Box<RedisPool>;

    async fn acquire(&self) -> Result<Box<RedisPool>, EngineError> {
        Ok(Box::new(self.clone()))
    }

    fn try_acquire(&self) -> Option<Box<RedisPool>> {
        Some(Box::new(self.clone()))
    }

    fn size(&self) -> u32 {
        1
    }

    fn max_size(&self) -> u32 {
        1
    }

    fn is_closed(&self) -> bool {
        false
    }

    async fn closed(&self) {
        std::future::pending::<()>().await;
    }

    /// One shared connection, closed when its last clone is dropped.
    async fn close(&self) {}

    fn close_on_drop(_pooled: &mut Box<RedisPool>) {}
}

/// Each step a script, each standing alone. There is no transaction to share, so a workflow on
/// Redis has foreign phases only (it is no [`idemflow_store::SqlEngine`]); `begin`, `commit` and
/// `rollback` only carry the connection, and `back_to_claim` has nothing to undo. A claim is
/// visible at once, so a concurrent duplicate's look-up finds it (409) and no claim lock is
/// needed.
#[async_trait]
impl Engine for RedisStore {
    type Pool = RedisPool;
    type Transaction = Transaction;
    type Owner = Owner;
    type Ticket = ();
    const NAME: &'static str = "redis";

    fn connection(transaction: &mut Transaction) -> &mut RedisPool {
        &mut transaction.pool
    }

    fn operator(pool: &RedisPool) -> Box<dyn idemflow_store::Operator> {
        Box::new(RedisOperator::new(pool.clone()))
    }

    async fn begin(
        connection: Box<RedisPool>,
        _limits: &Limits,
    ) -> Result<Transaction, EngineError> {
        Ok(Transaction::on(*connection))
    }

    async fn commit_keeping(transaction: Transaction) -> Result<Box<RedisPool>, EngineError> {
        Ok(Box::new(transaction.into_pool()))
    }

    async fn rollback(_transaction: Transaction) -> Result<(), EngineError> {
        Ok(())
    }

    fn abandon(_transaction: Transaction) {}

    /// No local phase ran: nothing to undo.
    async fn back_to_claim(_transaction: &mut Transaction) -> Result<(), EngineError> {
        Ok(())
    }

    /// No local phase runs on Redis: nothing can end the engine's work under it.
    async fn standing(_transaction: &mut Transaction) -> Result<Standing, EngineError> {
        Ok(Standing::Open)
    }

    async fn look_up(
        pool: &mut RedisPool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, EngineError> {
        let looked: LookedUp = scripts::look_up()
            .key(pool.row(tenant.as_str(), key.as_str()))
            .invoke_async(&mut pool.connection())
            .await
            .map_err(StoreError::from)?;
        Ok(match found(looked)? {
            Some(found) => LookUp::Found(found),
            None => LookUp::Absent(()),
        })
    }

    async fn response_apart(
        pool: &mut RedisPool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        let body_key = RedisPool::body(&pool.row(tenant.as_str(), key.as_str()), life);
        Ok(redis::cmd("GET")
            .arg(body_key)
            .query_async(&mut pool.connection())
            .await
            .map_err(StoreError::from)?)
    }

    async fn begin_claim(
        connection: Box<RedisPool>,
        claim: Claim<'_>,
        (): (),
        _limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        let pool = &*connection;
        let request = serde_json::to_string(claim.request)
            .map_err(|error| StoreError::Corrupt(format!("request: {error}")))?;
        let bucket = RedisPool::bucket(claim.tenant.as_str(), claim.key.as_str());
        let workflow_hex = idemflow_core::hex::encode(claim.workflow.as_bytes());
        // The set an earlier row of the key, lost alone, left an entry in, once the script named
        // it: the claim's keys are all declared (Redis Cluster's rule), so that set is one.
        let mut stale = String::new();
        let token = loop {
            let script = scripts::claim();
            let mut invocation = script.prepare_invoke();
            invocation
                .key(pool.row(claim.tenant.as_str(), claim.key.as_str()))
                .key(pool.fence(bucket))
                .key(pool.leases(bucket, claim.workflow))
                .key(pool.workflows(bucket))
                .key(pool.finishes(bucket))
                .key(pool.index(bucket))
                .key(pool.leased(bucket));
            if !stale.is_empty() {
                invocation.key(format!("{}{stale}", pool.leases_prefix(bucket)));
            }
            let (token, named): (i64, String) = invocation
                .arg(claim.tenant.as_str())
                .arg(claim.key.as_str())
                .arg(claim.fingerprint.as_bytes())
                .arg(claim.workflow)
                .arg(&request)
                .arg(millis(claim.lease))
                .arg(&workflow_hex)
                .arg(RedisPool::member(claim.tenant.as_str(), claim.key.as_str()))
                .arg(&stale)
                .invoke_async(&mut pool.connection())
                .await
                .map_err(StoreError::from)?;
            if token != -1 {
                break token;
            }
            if named == stale {
                return Err(StoreError::Corrupt(format!("claim: stale entry in {named}")).into());
            }
            stale = named;
        };
        if token == 0 {
            return Ok(Claimed::Lost(connection));
        }
        let owner = Owner {
            tenant: claim.tenant.clone(),
            key: claim.key.clone(),
            workflow: claim.workflow.to_owned(),
            lock_version: token,
        };
        Ok(Claimed::Owned(Transaction::on(*connection), owner))
    }

    /// Never reached on Redis (a commit is never refused); a fresh claim if it were.
    async fn claim_again(
        connection: Box<RedisPool>,
        claim: Claim<'_>,
        _token: i64,
        limits: &Limits,
    ) -> Result<Claimed<Self>, EngineError> {
        Self::begin_claim(connection, claim, (), limits).await
    }

    async fn take_over(
        transaction: &mut Transaction,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<Taken<Owner>>, EngineError> {
        let lease_from = Instant::now();
        let pool = &transaction.pool;
        let mut connection = pool.connection();
        let row = pool.row(tenant.as_str(), key.as_str());
        let Some(workflow) = workflow_of(&mut connection, &row).await? else {
            return Ok(None);
        };
        let bucket = RedisPool::bucket(tenant.as_str(), key.as_str());
        let fields: Option<TakenFields> = scripts::take_over()
            .key(&row)
            .key(pool.fence(bucket))
            .key(pool.leases(bucket, &workflow))
            .arg(seen)
            .arg(millis(lease))
            .invoke_async(&mut connection)
            .await
            .map_err(StoreError::from)?;
        Ok(fields
            .map(|fields| taken(fields, &workflow, lease_from))
            .transpose()?)
    }

    /// A claim is one script: no session can be half-way through one.
    async fn wait_for_claim_lock(
        _transaction: &mut Transaction,
        _tenant: &TenantId,
        _key: &Key,
        _wait: Duration,
    ) -> Result<bool, EngineError> {
        Ok(true)
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), EngineError> {
        let pool = &transaction.pool;
        let output = serde_json::to_string(output)
            .map_err(|error| StoreError::Corrupt(format!("phase output: {error}")))?;
        let changed: i64 = scripts::advance()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(owner.bucket(), &owner.workflow))
            .arg(owner.lock_version)
            .arg(recovery_point)
            .arg(output)
            .arg(millis(lease))
            .invoke_async(&mut pool.connection())
            .await
            .map_err(StoreError::from)?;
        Ok(fenced(changed)?)
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), EngineError> {
        let pool = &transaction.pool;
        let headers = serde_json::to_string(&response.headers)
            .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
        let apart = if response.body.len() > apart_above {
            "1"
        } else {
            "0"
        };
        let row = pool.row(owner.tenant.as_str(), owner.key.as_str());
        let changed: i64 = scripts::finish()
            .key(&row)
            .key(pool.leases(owner.bucket(), &owner.workflow))
            .key(pool.finishes(owner.bucket()))
            .key(pool.leased(owner.bucket()))
            .key(RedisPool::body(&row, owner.lock_version))
            .arg(owner.lock_version)
            .arg(recovery_point)
            .arg(response.status)
            .arg(headers)
            .arg(response.body.as_slice())
            .arg(apart)
            .invoke_async(&mut pool.connection())
            .await
            .map_err(StoreError::from)?;
        Ok(fenced(changed)?)
    }

    async fn postpone(
        transaction: &mut Transaction,
        owner: &Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError> {
        Ok(postpone(&transaction.pool, owner, retry_after, last_error.as_str()).await?)
    }

    async fn postpone_alone(
        pool: &RedisPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &LastError,
    ) -> Result<(), EngineError> {
        Ok(postpone(pool, owner, retry_after, last_error.as_str()).await?)
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), EngineError> {
        let pool = &transaction.pool;
        let changed: i64 = scripts::delete_owned()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(owner.bucket(), &owner.workflow))
            .key(pool.index(owner.bucket()))
            .key(pool.leased(owner.bucket()))
            .arg(owner.lock_version)
            .arg(RedisPool::member(owner.tenant.as_str(), owner.key.as_str()))
            .invoke_async(&mut pool.connection())
            .await
            .map_err(StoreError::from)?;
        Ok(fenced(changed)?)
    }

    async fn renew_lease(
        pool: &mut RedisPool,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        let changed: i64 = scripts::renew_lease()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(owner.bucket(), &owner.workflow))
            .arg(owner.lock_version)
            .arg(millis(lease))
            .invoke_async(&mut pool.connection())
            .await
            .map_err(StoreError::from)?;
        Ok(fenced(changed)?)
    }

    async fn take_over_due(
        pool: &RedisPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, Taken<Owner>)>, EngineError> {
        Ok(take_over_due(pool, workflows, batch).await?)
    }

    async fn resumer_lag(pool: &RedisPool) -> Result<Duration, EngineError> {
        Ok(resumer_lag(pool).await?)
    }

    async fn count_due_unknown(
        pool: &RedisPool,
        workflows: &[String],
    ) -> Result<Vec<(String, i64)>, EngineError> {
        Ok(count_due_unknown(pool, workflows).await?)
    }

    async fn expire_batch(
        pool: &RedisPool,
        older_than: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        let deleted = expire_batch(pool, older_than, batch).await?;
        Ok(deleted)
    }

    /// Sorted sets: retention deletes in batches.
    async fn maintain_layout(
        _pool: &RedisPool,
        _keep_for: Duration,
    ) -> Result<Option<Maintained>, EngineError> {
        Ok(None)
    }

    /// Nothing announces due keys between processes on Redis yet: the resumer polls.
    async fn listen_for_due(_pool: RedisPool, _wake: Arc<Notify>) {
        std::future::pending::<()>().await;
    }
}

/// Postpones a key after a failed attempt (fenced): its lease ends `retry_after` from now, the
/// error is recorded, and the fence advances.
async fn postpone(
    pool: &RedisPool,
    owner: &Owner,
    retry_after: Duration,
    last_error: &str,
) -> Result<(), StoreError> {
    let changed: i64 = scripts::postpone()
        .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
        .key(pool.fence(owner.bucket()))
        .key(pool.leases(owner.bucket(), &owner.workflow))
        .arg(owner.lock_version)
        .arg(millis(retry_after))
        .arg(last_error)
        .invoke_async(&mut pool.connection())
        .await?;
    fenced(changed)
}

/// Takes over up to `batch` due keys of the named workflows, each with its workflow's lease: the
/// resumer's scan. First a look at every bucket (a read-only script over the bucket's sets of
/// lease ends of those workflows: its due entries, the longest-lapsed first), then the `batch`
/// longest-lapsed of all taken one by one, each by a script given the row, its bucket's fence
/// and the set that named it, which takes it only if it is still due and of that workflow.
async fn take_over_due(
    pool: &RedisPool,
    workflows: &[(String, Duration)],
    batch: i64,
) -> Result<Vec<(String, Taken<Owner>)>, StoreError> {
    if workflows.is_empty() || batch <= 0 {
        return Ok(Vec::new());
    }
    let lease_from = Instant::now();
    let looks = (0..BUCKETS).map(|bucket| async move {
        let script = scripts::due();
        let mut invocation = script.key(pool.leases(bucket, &workflows[0].0));
        for (workflow, _) in &workflows[1..] {
            invocation.key(pool.leases(bucket, workflow));
        }
        invocation.arg(batch);
        let found: Vec<(i64, usize, String)> =
            invocation.invoke_async(&mut pool.connection()).await?;
        Ok::<_, StoreError>(
            found
                .into_iter()
                .map(move |(ends, index, row)| (ends, bucket, index, row)),
        )
    });
    let mut due: Vec<(i64, u16, usize, String)> = futures_util::future::try_join_all(looks)
        .await?
        .into_iter()
        .flatten()
        .collect();
    due.sort();
    due.truncate(usize::try_from(batch).unwrap_or(usize::MAX));
    let takes = due.into_iter().map(|(_, bucket, index, row)| async move {
        let (workflow, lease) = workflows
            .get(index.wrapping_sub(1))
            .ok_or_else(|| StoreError::Corrupt(format!("workflow index {index}")))?;
        let fields: Option<TakenFields> = scripts::take_due()
            .key(&row)
            .key(pool.fence(bucket))
            .key(pool.leases(bucket, workflow))
            .key(pool.leased(bucket))
            .arg(millis(*lease))
            .arg(workflow.as_str())
            .arg(idemflow_core::hex::encode(workflow.as_bytes()))
            .invoke_async(&mut pool.connection())
            .await?;
        fields
            .map(|fields| {
                Ok::<_, StoreError>((workflow.clone(), taken(fields, workflow, lease_from)?))
            })
            .transpose()
    });
    Ok(futures_util::future::try_join_all(takes)
        .await?
        .into_iter()
        .flatten()
        .collect())
}

/// Deletes up to `batch` keys finished longer ago than `older_than`, with their bodies apart:
/// bucket after bucket, a look at the bucket's set of finishes (read-only), then each row by a
/// script given the row, its bucket's sets and its body apart, which deletes it only if it is
/// still finished past the window with that body. How many.
async fn expire_batch(
    pool: &RedisPool,
    older_than: Duration,
    batch: i64,
) -> Result<u64, StoreError> {
    let mut deleted: u64 = 0;
    for bucket in 0..BUCKETS {
        let left = batch - i64::try_from(deleted).unwrap_or(i64::MAX);
        if left <= 0 {
            break;
        }
        let found: Vec<(String, String)> = scripts::expired()
            .key(pool.finishes(bucket))
            .arg(millis(older_than))
            .arg(left)
            .invoke_async(&mut pool.connection())
            .await?;
        let rows_prefix = pool.rows_prefix(bucket);
        let deletes = found.into_iter().map(|(row, apart)| {
            let member = row
                .strip_prefix(&rows_prefix)
                .map(|rest| rest.replacen(':', "!", 1))
                .unwrap_or_default();
            let body = format!("{row}:body:{apart}");
            async move {
                let one: u64 = scripts::expire_one()
                    .key(&row)
                    .key(pool.finishes(bucket))
                    .key(pool.index(bucket))
                    .key(body)
                    .arg(millis(older_than))
                    .arg(member)
                    .arg(apart)
                    .invoke_async(&mut pool.connection())
                    .await?;
                Ok::<_, StoreError>(one)
            }
        });
        deleted += futures_util::future::try_join_all(deletes)
            .await?
            .into_iter()
            .sum::<u64>();
    }
    Ok(deleted)
}

/// How long the oldest lapsed lease of a started key has been over (zero when none has): the
/// resumer's lag, the longest of every bucket's.
pub async fn resumer_lag(pool: &RedisPool) -> Result<Duration, StoreError> {
    let mut lag: i64 = 0;
    for bucket in 0..BUCKETS {
        let bucket_lag: i64 = scripts::resumer_lag()
            .key(pool.workflows(bucket))
            .arg(pool.leases_prefix(bucket))
            .invoke_async(&mut pool.connection())
            .await?;
        lag = lag.max(bucket_lag);
    }
    Ok(Duration::from_millis(u64::try_from(lag).unwrap_or(0)))
}

/// Due keys of workflows not in `known`, by workflow: keys no worker of these workflows resumes,
/// every bucket's added up.
pub async fn count_due_unknown(
    pool: &RedisPool,
    known: &[String],
) -> Result<Vec<(String, i64)>, StoreError> {
    let mut totals: std::collections::BTreeMap<String, i64> = std::collections::BTreeMap::new();
    for bucket in 0..BUCKETS {
        let script = scripts::count_due_unknown();
        let mut invocation = script.key(pool.workflows(bucket));
        invocation.arg(pool.leases_prefix(bucket));
        for workflow in known {
            invocation.arg(idemflow_core::hex::encode(workflow.as_bytes()));
        }
        let counts: Vec<(String, i64)> = invocation.invoke_async(&mut pool.connection()).await?;
        for (hex, due) in counts {
            *totals.entry(hex).or_default() += due;
        }
    }
    totals
        .into_iter()
        .map(|(hex, due)| {
            let bytes = idemflow_core::hex::decode(&hex)
                .ok_or_else(|| StoreError::Corrupt(format!("workflow {hex}")))?;
            let workflow = String::from_utf8(bytes)
                .map_err(|_| StoreError::Corrupt(format!("workflow {hex}")))?;
            Ok((workflow, due))
        })
        .collect()
}
