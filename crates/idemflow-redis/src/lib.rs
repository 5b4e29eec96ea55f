//! idemflow's keys in Redis: the protocol's claim, fence and owner writes as Redis scripts,
//! behind the store boundary ([`idemflow_store::Store`]).
//!
//! **What it is for.** Workflows whose phases are all foreign (each called with its derived key)
//! and plain handlers, where a rare duplicate is tolerable: Redis acknowledges a write before it
//! reaches a replica or the disk, so a failover or a restart can lose keys, and a retry of a lost
//! key runs again (its foreign calls carry the same derived keys, so the provider's own
//! idempotency decides). A local phase cannot run here: there is no transaction its effects could
//! share with the recovery point. docs/engines.md says when to choose it.
//!
//! **How the protocol maps.** The claim is one script: the key's row is created only if absent
//! (`EXISTS`, then `HSET`), with a fencing token from one counter (`INCR`), so a token never
//! repeats while Redis keeps its data. Every owner write is a script that checks the token and
//! writes in one atomic step. A started key sits in its workflow's sorted set of lease ends, which
//! the resumer reads instead of scanning the keyspace; finished keys sit in a sorted set of
//! finish times, which retention reads in batches. Keys of tenants live under names built from the
//! tenant and the key in hex, so no tenant's key can name another's. Each write stands alone:
//! a [`Transaction`] groups nothing and its rollback undoes nothing (there are no local effects to
//! undo), and a claim is visible at once, which is what tells a concurrent duplicate 409.
//!
//! The scripts touch several Redis keys that are not in one hash slot: this store runs on a single
//! Redis (with or without replicas), not on Redis Cluster.

#![deny(missing_docs)]

mod console;
mod scripts;

pub use console::{
    expire_key, finished_keys, key_bodies, key_report, overview, scan_keys, stuck_keys,
};

/// The Redis client this store is built with.
pub use redis;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use idemflow_store::{Claim, Failure, FoundKey, LookUp, Store, TakenOver};
use redis::aio::ConnectionManager;
use serde_json::Value;

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
}

/// Where the keys live: one Redis, through one multiplexed connection (commands from every task
/// share it, pipelined), under a prefix. A connection the server closes (a restart, a failover's
/// switch, `CLIENT KILL`) is replaced in the background: the commands in flight then fail, as the
/// database being unavailable, and the ones after reach Redis again.
///
/// It is also the store's connection: a multiplexed connection is shared, not taken, so the pool
/// and the connection a statement runs on are one thing (cloned cheaply).
#[derive(Clone)]
pub struct RedisPool {
    connection: ConnectionManager,
    prefix: Arc<str>,
}

impl fmt::Debug for RedisPool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RedisPool")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The prefix of every Redis key the store writes, unless told otherwise.
pub const DEFAULT_PREFIX: &str = "idemflow";

impl RedisPool {
    /// Connects to the Redis at `url` (`redis://127.0.0.1:6379`), keys under [`DEFAULT_PREFIX`].
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        Self::connect_with_prefix(url, DEFAULT_PREFIX).await
    }

    /// Connects, keys under `prefix` (two services, or two test cases, on one Redis).
    pub async fn connect_with_prefix(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)?;
        // A connection manager, not a bare multiplexed connection: a bare one stays broken once
        // the server closes it, and every request after a Redis restart would fail for ever.
        let connection = ConnectionManager::new(client).await?;
        let pool = Self {
            connection,
            prefix: Arc::from(prefix),
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
    /// `None`. An evicted key is a key lost: its next retry runs the request again. `Err` where
    /// the server refuses `CONFIG GET` (as managed services may); [`RedisPool::connect`] then
    /// says nothing.
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

    /// The connection every command goes through.
    pub fn connection(&self) -> ConnectionManager {
        self.connection.clone()
    }

    /// The prefix of every Redis key the store writes.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The row of a tenant's key: tenant and key in hex, so neither can hold the separator.
    pub fn row(&self, tenant: &str, key: &str) -> String {
        format!(
            "{}:key:{}:{}",
            self.prefix,
            idemflow_core::hex::encode(tenant.as_bytes()),
            idemflow_core::hex::encode(key.as_bytes())
        )
    }

    /// The sorted set of a workflow's started keys by lease end.
    pub fn leases(&self, workflow: &str) -> String {
        format!(
            "{}:leases:{}",
            self.prefix,
            idemflow_core::hex::encode(workflow.as_bytes())
        )
    }

    /// The sorted set of finished keys by finish time.
    pub fn finishes(&self) -> String {
        format!("{}:finishes", self.prefix)
    }

    /// The set of workflows (in hex) that have claimed keys.
    pub(crate) fn workflows(&self) -> String {
        format!("{}:workflows", self.prefix)
    }

    /// The sorted set of every key (all scores 0, so members sort byte by byte): the tenant and
    /// the key in hex joined by `!`, which sorts before every hex digit, so members sort as
    /// `(tenant, key)` pairs do. What the console's scan walks.
    pub(crate) fn index(&self) -> String {
        format!("{}:index", self.prefix)
    }

    /// A key's member of [`RedisPool::index`].
    pub(crate) fn member(tenant: &str, key: &str) -> String {
        format!(
            "{}!{}",
            idemflow_core::hex::encode(tenant.as_bytes()),
            idemflow_core::hex::encode(key.as_bytes())
        )
    }

    /// What every row's name starts with.
    pub(crate) fn rows_prefix(&self) -> String {
        format!("{}:key:", self.prefix)
    }

    /// What every sorted set of lease ends is named by, before its workflow in hex.
    pub(crate) fn leases_prefix(&self) -> String {
        format!("{}:leases:", self.prefix)
    }

    pub(crate) fn fence(&self) -> String {
        format!("{}:fence", self.prefix)
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
    connection: &mut ConnectionManager,
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

fn taken(fields: TakenFields, workflow: &str) -> Result<TakenOver<Owner>, StoreError> {
    let (token, attempts, tenant, key, recovery_point, output, request, last_error) = fields;
    let tenant = TenantId::new(&tenant)
        .map_err(|error| StoreError::Corrupt(format!("stored tenant: {error}")))?;
    let key =
        Key::parse(&key).map_err(|error| StoreError::Corrupt(format!("stored key: {error}")))?;
    let json = |text: &str| {
        serde_json::from_str::<Value>(text)
            .map_err(|error| StoreError::Corrupt(format!("stored JSON: {error}")))
    };
    Ok(TakenOver {
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

#[async_trait]
impl Store for RedisStore {
    type Pool = RedisPool;
    type Transaction = Transaction;
    type Connection = RedisPool;
    type Owner = Owner;
    type Ticket = ();
    type Error = StoreError;

    fn failure(error: &StoreError) -> Failure {
        match error {
            StoreError::Fenced => Failure::Fenced,
            _ => Failure::Other,
        }
    }

    fn token(owner: &Owner) -> i64 {
        owner.lock_version
    }

    fn connection(transaction: &mut Transaction) -> &mut RedisPool {
        &mut transaction.pool
    }

    async fn look_up(
        pool: &RedisPool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<()>, StoreError> {
        let looked: LookedUp = scripts::look_up()
            .key(pool.row(tenant.as_str(), key.as_str()))
            .invoke_async(&mut pool.connection())
            .await?;
        Ok(match found(looked)? {
            Some(found) => LookUp::Found(found),
            None => LookUp::Absent(()),
        })
    }

    async fn begin_claim(
        pool: &RedisPool,
        claim: Claim<'_>,
        (): (),
    ) -> Result<Option<(Transaction, Owner)>, StoreError> {
        let request = serde_json::to_string(claim.request)
            .map_err(|error| StoreError::Corrupt(format!("request: {error}")))?;
        let mut connection = pool.connection();
        let token: i64 = scripts::claim()
            .key(pool.row(claim.tenant.as_str(), claim.key.as_str()))
            .key(pool.fence())
            .key(pool.leases(claim.workflow))
            .key(pool.workflows())
            .key(pool.finishes())
            .key(pool.index())
            .arg(claim.tenant.as_str())
            .arg(claim.key.as_str())
            .arg(claim.fingerprint.as_bytes())
            .arg(claim.workflow)
            .arg(request)
            .arg(millis(claim.lease))
            .arg(idemflow_core::hex::encode(claim.workflow.as_bytes()))
            .arg(RedisPool::member(claim.tenant.as_str(), claim.key.as_str()))
            .invoke_async(&mut connection)
            .await?;
        if token == 0 {
            return Ok(None);
        }
        let owner = Owner {
            tenant: claim.tenant.clone(),
            key: claim.key.clone(),
            workflow: claim.workflow.to_owned(),
            lock_version: token,
        };
        Ok(Some((Transaction::on(pool.clone()), owner)))
    }

    async fn begin(pool: &RedisPool) -> Result<Transaction, StoreError> {
        Ok(Transaction::on(pool.clone()))
    }

    async fn commit(_transaction: Transaction) -> Result<(), StoreError> {
        Ok(())
    }

    async fn rollback(_transaction: Transaction) -> Result<(), StoreError> {
        Ok(())
    }

    async fn advance(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        output: &Value,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let pool = &transaction.pool;
        let output = serde_json::to_string(output)
            .map_err(|error| StoreError::Corrupt(format!("phase output: {error}")))?;
        let changed: i64 = scripts::advance()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(&owner.workflow))
            .arg(owner.lock_version)
            .arg(recovery_point)
            .arg(output)
            .arg(millis(lease))
            .invoke_async(&mut pool.connection())
            .await?;
        fenced(changed)
    }

    async fn finish(
        transaction: &mut Transaction,
        owner: &Owner,
        recovery_point: &str,
        response: &StoredResponse,
        apart_above: usize,
    ) -> Result<(), StoreError> {
        let pool = &transaction.pool;
        let headers = serde_json::to_string(&response.headers)
            .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
        let apart = if response.body.len() > apart_above {
            "1"
        } else {
            "0"
        };
        let changed: i64 = scripts::finish()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(&owner.workflow))
            .key(pool.finishes())
            .arg(owner.lock_version)
            .arg(recovery_point)
            .arg(response.status)
            .arg(headers)
            .arg(response.body.as_slice())
            .arg(apart)
            .invoke_async(&mut pool.connection())
            .await?;
        fenced(changed)
    }

    async fn renew_lease(
        pool: &RedisPool,
        owner: &Owner,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let changed: i64 = scripts::renew_lease()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(&owner.workflow))
            .arg(owner.lock_version)
            .arg(millis(lease))
            .invoke_async(&mut pool.connection())
            .await?;
        fenced(changed)
    }

    async fn postpone(
        pool: &RedisPool,
        owner: &Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), StoreError> {
        let changed: i64 = scripts::postpone()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.fence())
            .key(pool.leases(&owner.workflow))
            .arg(owner.lock_version)
            .arg(millis(retry_after))
            .arg(last_error)
            .invoke_async(&mut pool.connection())
            .await?;
        fenced(changed)
    }

    async fn delete_owned(transaction: &mut Transaction, owner: &Owner) -> Result<(), StoreError> {
        let pool = &transaction.pool;
        let changed: i64 = scripts::delete_owned()
            .key(pool.row(owner.tenant.as_str(), owner.key.as_str()))
            .key(pool.leases(&owner.workflow))
            .key(pool.index())
            .arg(owner.lock_version)
            .arg(RedisPool::member(owner.tenant.as_str(), owner.key.as_str()))
            .invoke_async(&mut pool.connection())
            .await?;
        fenced(changed)
    }

    async fn end_lease(
        pool: &RedisPool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
    ) -> Result<Option<i64>, StoreError> {
        let mut connection = pool.connection();
        let row = pool.row(tenant.as_str(), key.as_str());
        let Some(workflow) = workflow_of(&mut connection, &row).await? else {
            return Ok(None);
        };
        let token: i64 = scripts::end_lease()
            .key(&row)
            .key(pool.fence())
            .key(pool.leases(&workflow))
            .arg(seen)
            .invoke_async(&mut connection)
            .await?;
        Ok((token != 0).then_some(token))
    }

    async fn take_over(
        pool: &RedisPool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<TakenOver<Owner>>, StoreError> {
        let mut connection = pool.connection();
        let row = pool.row(tenant.as_str(), key.as_str());
        let Some(workflow) = workflow_of(&mut connection, &row).await? else {
            return Ok(None);
        };
        let fields: Option<TakenFields> = scripts::take_over()
            .key(&row)
            .key(pool.fence())
            .key(pool.leases(&workflow))
            .arg(seen)
            .arg(millis(lease))
            .invoke_async(&mut connection)
            .await?;
        fields.map(|fields| taken(fields, &workflow)).transpose()
    }

    async fn take_over_due(
        pool: &RedisPool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, TakenOver<Owner>)>, StoreError> {
        if workflows.is_empty() || batch <= 0 {
            return Ok(Vec::new());
        }
        let script = scripts::take_over_due();
        let mut invocation = script.key(pool.fence());
        invocation.arg(batch);
        for (workflow, lease) in workflows {
            invocation.key(pool.leases(workflow)).arg(millis(*lease));
        }
        let rows: Vec<(
            i64,
            i64,
            i64,
            String,
            String,
            String,
            Option<String>,
            String,
            Option<String>,
        )> = invocation.invoke_async(&mut pool.connection()).await?;
        rows.into_iter()
            .map(
                |(index, token, attempts, tenant, key, point, output, request, error)| {
                    let workflow = usize::try_from(index)
                        .ok()
                        .and_then(|index| workflows.get(index.checked_sub(1)?))
                        .map(|(workflow, _)| workflow.clone())
                        .ok_or_else(|| StoreError::Corrupt(format!("workflow index {index}")))?;
                    let taken = taken(
                        (token, attempts, tenant, key, point, output, request, error),
                        &workflow,
                    )?;
                    Ok((workflow, taken))
                },
            )
            .collect()
    }

    async fn response_apart(
        pool: &RedisPool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, StoreError> {
        let body_key = format!("{}:body:{life}", pool.row(tenant.as_str(), key.as_str()));
        Ok(redis::cmd("GET")
            .arg(body_key)
            .query_async(&mut pool.connection())
            .await?)
    }

    async fn expire_batch(
        pool: &RedisPool,
        keep_for: Duration,
        batch: i64,
    ) -> Result<u64, StoreError> {
        let deleted: u64 = scripts::expire_batch()
            .key(pool.finishes())
            .key(pool.index())
            .arg(millis(keep_for))
            .arg(batch)
            .arg(pool.rows_prefix())
            .invoke_async(&mut pool.connection())
            .await?;
        Ok(deleted)
    }
}

/// How long the oldest lapsed lease of a started key has been over (zero when none has): the
/// resumer's lag.
pub async fn resumer_lag(pool: &RedisPool) -> Result<Duration, StoreError> {
    let lag: i64 = scripts::resumer_lag()
        .key(pool.workflows())
        .arg(pool.leases_prefix())
        .invoke_async(&mut pool.connection())
        .await?;
    Ok(Duration::from_millis(u64::try_from(lag).unwrap_or(0)))
}

/// Due keys of workflows not in `known`, by workflow: keys no worker of these workflows resumes.
pub async fn count_due_unknown(
    pool: &RedisPool,
    known: &[String],
) -> Result<Vec<(String, i64)>, StoreError> {
    let script = scripts::count_due_unknown();
    let mut invocation = script.key(pool.workflows());
    invocation.arg(pool.leases_prefix());
    for workflow in known {
        invocation.arg(idemflow_core::hex::encode(workflow.as_bytes()));
    }
    let counts: Vec<(String, i64)> = invocation.invoke_async(&mut pool.connection()).await?;
    counts
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
