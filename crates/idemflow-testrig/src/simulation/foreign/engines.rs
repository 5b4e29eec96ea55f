//! What the foreign-only world does behind the runner's back, per engine: read a key's row, end
//! its lease, age its finish, lose it (finished, or started and cold), close the engine's
//! connections, and audit the store's own bookkeeping.

use async_trait::async_trait;
use idemflow_core::TenantId;
use idemflow_pg::PgStore;
use idemflow_runner::{Engine, PoolOf};

/// A key's row, as the world samples it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSample {
    /// `started` or `done`.
    pub state: String,
    /// The fencing token.
    pub token: i64,
    /// The lease end, as the engine writes it (compared, never read as a time).
    pub lease: String,
    /// The lease lives by the engine's clock.
    pub live: bool,
    /// The recovery point.
    pub point: String,
    /// The workflow its life was claimed under.
    pub workflow: String,
}

/// An engine the foreign-only world runs on.
#[async_trait]
pub trait ForeignSimEngine: Engine {
    /// The engine's name in reports and replay commands.
    const SIM_NAME: &'static str;

    /// Each write is made at once, with no transaction to commit: an owner waiting at a crash
    /// point "before the commit" has already written its lease (Redis).
    const WRITES_AT_ONCE: bool;

    /// The key's row, if there is one.
    async fn sample(
        observer: &PoolOf<Self>,
        tenant: &TenantId,
        key: &str,
    ) -> Result<Option<RowSample>, String>;

    /// Ends the key's lease (a day back) if its row is still as `seen` was: started, with the
    /// same token and lease end. Whether it did.
    async fn lapse(
        observer: &PoolOf<Self>,
        tenant: &TenantId,
        key: &str,
        seen: &RowSample,
    ) -> Result<bool, String>;

    /// Moves a finished key's finish two days back (past the retention window). Whether it did.
    async fn age(observer: &PoolOf<Self>, tenant: &TenantId, key: &str) -> Result<bool, String>;

    /// Loses a finished key's row alone, as an eviction or a stray `DEL` would (Redis), or an
    /// operator's delete (SQL). Whether it did.
    async fn lose(observer: &PoolOf<Self>, tenant: &TenantId, key: &str) -> Result<bool, String>;

    /// Loses a started key's row alone if it is still as `seen` was (started, with the same
    /// token and lease end), its lease ended a day back first, as an eviction takes a cold row
    /// (a crashed run's): on Redis its entry in its workflow's set of lease ends stays behind,
    /// due. Whether it did.
    async fn lose_started(
        observer: &PoolOf<Self>,
        tenant: &TenantId,
        key: &str,
        seen: &RowSample,
    ) -> Result<bool, String>;

    /// Closes the engine's connections from the server's side. How many.
    async fn kill(engine: &PoolOf<Self>, observer: &PoolOf<Self>) -> Result<u64, String>;

    /// What breaks the store's own bookkeeping (beside the rows: indexes, sorted sets), each as
    /// a sentence. Empty where the database keeps it (a SQL index).
    async fn audit(observer: &PoolOf<Self>) -> Vec<String>;
}

#[async_trait]
impl ForeignSimEngine for PgStore {
    const SIM_NAME: &'static str = "postgres";
    const WRITES_AT_ONCE: bool = false;

    async fn sample(
        observer: &sqlx::PgPool,
        tenant: &TenantId,
        key: &str,
    ) -> Result<Option<RowSample>, String> {
        let row: Option<(String, i64, String, bool, String, String)> = sqlx::query_as(
            "SELECT state, lock_version, locked_until::text, locked_until > now(), recovery_point, \
                    workflow \
             FROM idempotency_keys WHERE tenant = $1 AND key = $2",
        )
        .bind(tenant.as_str())
        .bind(key)
        .fetch_optional(observer)
        .await
        .map_err(|error| error.to_string())?;
        Ok(
            row.map(|(state, token, lease, live, point, workflow)| RowSample {
                state,
                token,
                lease,
                live,
                point,
                workflow,
            }),
        )
    }

    async fn lapse(
        observer: &sqlx::PgPool,
        tenant: &TenantId,
        key: &str,
        seen: &RowSample,
    ) -> Result<bool, String> {
        sqlx::query(
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 day' \
             WHERE tenant = $1 AND key = $2 AND state = 'started' AND lock_version = $3 \
               AND locked_until::text = $4",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(seen.token)
        .bind(&seen.lease)
        .execute(observer)
        .await
        .map(|done| done.rows_affected() == 1)
        .map_err(|error| error.to_string())
    }

    async fn age(observer: &sqlx::PgPool, tenant: &TenantId, key: &str) -> Result<bool, String> {
        sqlx::query(
            "UPDATE idempotency_keys SET finished_at = finished_at - interval '2 days' \
             WHERE tenant = $1 AND key = $2 AND state = 'done'",
        )
        .bind(tenant.as_str())
        .bind(key)
        .execute(observer)
        .await
        .map(|done| done.rows_affected() == 1)
        .map_err(|error| error.to_string())
    }

    async fn lose(observer: &sqlx::PgPool, tenant: &TenantId, key: &str) -> Result<bool, String> {
        sqlx::query(
            "DELETE FROM idempotency_keys WHERE tenant = $1 AND key = $2 AND state = 'done'",
        )
        .bind(tenant.as_str())
        .bind(key)
        .execute(observer)
        .await
        .map(|done| done.rows_affected() == 1)
        .map_err(|error| error.to_string())
    }

    async fn lose_started(
        observer: &sqlx::PgPool,
        tenant: &TenantId,
        key: &str,
        seen: &RowSample,
    ) -> Result<bool, String> {
        sqlx::query(
            "DELETE FROM idempotency_keys \
             WHERE tenant = $1 AND key = $2 AND state = 'started' AND lock_version = $3 \
               AND locked_until::text = $4",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(seen.token)
        .bind(&seen.lease)
        .execute(observer)
        .await
        .map(|done| done.rows_affected() == 1)
        .map_err(|error| error.to_string())
    }

    async fn kill(_: &sqlx::PgPool, observer: &sqlx::PgPool) -> Result<u64, String> {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE application_name = $1 AND datname = current_database()) killed",
        )
        .bind(crate::simulation::ENGINE_APPLICATION)
        .fetch_one(observer)
        .await
        .map(|killed| u64::try_from(killed).unwrap_or(0))
        .map_err(|error| error.to_string())
    }

    async fn audit(_: &sqlx::PgPool) -> Vec<String> {
        Vec::new()
    }
}

#[cfg(feature = "redis")]
pub(crate) mod redis_store {
    use async_trait::async_trait;
    use idemflow_core::TenantId;
    use idemflow_redis::RedisPool;
    use idemflow_redis::RedisStore;
    use idemflow_redis::redis;
    use idemflow_redis::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
    use idemflow_redis::{BUCKETS, RedisConnection};

    use super::{ForeignSimEngine, RowSample};

    /// Every Redis key under `pool`'s prefix matching `pattern` (after the prefix's `:`), on
    /// every primary (`SCAN` answers for one node).
    async fn scan(pool: &RedisPool, pattern: &str) -> Result<Vec<String>, redis::RedisError> {
        let mut found = Vec::new();
        let primaries = pool.primaries().await.map_err(|error| match error {
            idemflow_redis::StoreError::Redis(error) => error,
            other => {
                redis::RedisError::from((redis::ErrorKind::Client, "primaries", other.to_string()))
            }
        })?;
        for (_, mut connection) in primaries {
            let mut cursor: u64 = 0;
            loop {
                let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(format!("{}:{pattern}", pool.prefix()))
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut connection)
                    .await?;
                found.extend(batch);
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok(found)
    }

    /// Deletes every Redis key under `pool`'s prefix: a schedule starts on an empty store.
    pub(crate) async fn forget_prefix(pool: &RedisPool) -> Result<(), redis::RedisError> {
        let mut connection = pool.connection();
        for name in scan(pool, "*").await? {
            redis::cmd("DEL")
                .arg(&name)
                .query_async::<()>(&mut connection)
                .await?;
        }
        Ok(())
    }

    fn failed(error: redis::RedisError) -> String {
        error.to_string()
    }

    /// Rewinds a started row's lease end, in its row and its workflow's sorted set, when token
    /// and lease end are still the ones seen. KEYS: row. ARGV: token, lease end, leases prefix.
    const LAPSE: &str = "local held = redis.call('HMGET', KEYS[1], 'st', 'lv', 'lu', 'wf') \
        if held[1] ~= 'started' or held[2] ~= ARGV[1] or held[3] ~= ARGV[2] then return 0 end \
        local ended = tonumber(held[3]) - 86400000 \
        redis.call('HSET', KEYS[1], 'lu', ended) \
        local workflow = held[4]:gsub('.', function(c) return string.format('%02x', c:byte()) end) \
        redis.call('ZADD', ARGV[3] .. workflow, ended, KEYS[1]) \
        return 1";

    /// KEYS: row, finishes. Moves a done row's finish two days back.
    const AGE: &str = "local held = redis.call('HMGET', KEYS[1], 'st', 'fa') \
        if held[1] ~= 'done' then return 0 end \
        local aged = tonumber(held[2]) - 172800000 \
        redis.call('HSET', KEYS[1], 'fa', aged) \
        redis.call('ZADD', KEYS[2], aged, KEYS[1]) \
        return 1";

    /// KEYS: row. Deletes a done row alone (its entries in sorted sets stay, as after an
    /// eviction).
    const LOSE: &str = "if redis.call('HGET', KEYS[1], 'st') ~= 'done' then return 0 end \
        redis.call('DEL', KEYS[1]) \
        return 1";

    /// KEYS: row. ARGV: token, lease end, leases prefix. Rewinds a started row's lease end, in
    /// its row's workflow's sorted set too, as `LAPSE` does, when token and lease end are still
    /// the ones seen; then deletes the row alone (its entry in that set stays, due, as after an
    /// eviction of a crashed run's row).
    const LOSE_STARTED: &str = "local held = redis.call('HMGET', KEYS[1], 'st', 'lv', 'lu', 'wf') \
        if held[1] ~= 'started' or held[2] ~= ARGV[1] or held[3] ~= ARGV[2] then return 0 end \
        local workflow = held[4]:gsub('.', function(c) return string.format('%02x', c:byte()) end) \
        redis.call('ZADD', ARGV[3] .. workflow, tonumber(held[3]) - 86400000, KEYS[1]) \
        redis.call('DEL', KEYS[1]) \
        return 1";

    #[async_trait]
    impl ForeignSimEngine for RedisStore {
        const SIM_NAME: &'static str = "redis";
        const WRITES_AT_ONCE: bool = true;

        async fn sample(
            observer: &RedisPool,
            tenant: &TenantId,
            key: &str,
        ) -> Result<Option<RowSample>, String> {
            let row = observer.row(tenant.as_str(), key);
            let (time, fields): ((i64, i64), Vec<Option<String>>) = redis::pipe()
                .cmd("TIME")
                .cmd("HMGET")
                .arg(&row)
                .arg(&["st", "lv", "lu", "rp", "wf"])
                .query_async(&mut observer.connection())
                .await
                .map_err(failed)?;
            let now = time.0 * 1000 + time.1 / 1000;
            let [state, token, lease, point, workflow] = <[Option<String>; 5]>::try_from(fields)
                .map_err(|fields| format!("HMGET answered {} fields", fields.len()))?;
            let Some(state) = state else {
                return Ok(None);
            };
            let lease = lease.unwrap_or_default();
            Ok(Some(RowSample {
                live: lease.parse::<i64>().is_ok_and(|ends| ends > now),
                token: token.and_then(|token| token.parse().ok()).unwrap_or(-1),
                state,
                lease,
                point: point.unwrap_or_default(),
                workflow: workflow.unwrap_or_default(),
            }))
        }

        async fn lapse(
            observer: &RedisPool,
            tenant: &TenantId,
            key: &str,
            seen: &RowSample,
        ) -> Result<bool, String> {
            let leases = observer.leases(RedisPool::bucket(tenant.as_str(), key), "");
            redis::Script::new(LAPSE)
                .key(observer.row(tenant.as_str(), key))
                .arg(seen.token)
                .arg(&seen.lease)
                .arg(leases)
                .invoke_async::<i64>(&mut observer.connection())
                .await
                .map(|done| done == 1)
                .map_err(failed)
        }

        async fn age(observer: &RedisPool, tenant: &TenantId, key: &str) -> Result<bool, String> {
            redis::Script::new(AGE)
                .key(observer.row(tenant.as_str(), key))
                .key(observer.finishes(RedisPool::bucket(tenant.as_str(), key)))
                .invoke_async::<i64>(&mut observer.connection())
                .await
                .map(|done| done == 1)
                .map_err(failed)
        }

        async fn lose(observer: &RedisPool, tenant: &TenantId, key: &str) -> Result<bool, String> {
            redis::Script::new(LOSE)
                .key(observer.row(tenant.as_str(), key))
                .invoke_async::<i64>(&mut observer.connection())
                .await
                .map(|done| done == 1)
                .map_err(failed)
        }

        async fn lose_started(
            observer: &RedisPool,
            tenant: &TenantId,
            key: &str,
            seen: &RowSample,
        ) -> Result<bool, String> {
            redis::Script::new(LOSE_STARTED)
                .key(observer.row(tenant.as_str(), key))
                .arg(seen.token)
                .arg(&seen.lease)
                .arg(observer.leases(RedisPool::bucket(tenant.as_str(), key), ""))
                .invoke_async::<i64>(&mut observer.connection())
                .await
                .map(|done| done == 1)
                .map_err(failed)
        }

        /// The engine's connection (on a cluster, its connection to each primary), closed by the
        /// server: `CLIENT KILL ID` with the id the engine's own connection reports.
        async fn kill(engine: &RedisPool, observer: &RedisPool) -> Result<u64, String> {
            let mut killed = 0;
            for (node, mut admin) in observer.primaries().await.map_err(|e| e.to_string())? {
                let id_of = redis::cmd("CLIENT").arg("ID").to_owned();
                let id: i64 = match engine.connection() {
                    RedisConnection::Single(mut connection) => {
                        id_of.query_async(&mut connection).await.map_err(failed)?
                    }
                    RedisConnection::Cluster(mut connection) => {
                        let (host, port) = node
                            .rsplit_once(':')
                            .ok_or_else(|| format!("node {node}"))?;
                        let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                            host: host.to_owned(),
                            port: port.parse().map_err(|_| format!("node {node}"))?,
                        });
                        let answer = connection
                            .route_command(id_of, route)
                            .await
                            .map_err(failed)?;
                        redis::from_redis_value(answer).map_err(|e| e.to_string())?
                    }
                };
                killed += redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("ID")
                    .arg(id)
                    .query_async::<u64>(&mut admin)
                    .await
                    .map_err(failed)?;
            }
            Ok(killed)
        }

        /// Every started row is in its workflow's sorted set at its lease end, every finished
        /// row in the set of finishes at its finish and in no set of leases, no finish names a
        /// row that is not finished (retention would delete it), and a workflow's set of lease
        /// ends names only started rows of that workflow.
        async fn audit(observer: &RedisPool) -> Vec<String> {
            match audit(observer).await {
                Ok(problems) => problems,
                Err(error) => vec![format!("the audit could not read Redis: {error}")],
            }
        }
    }

    async fn audit(observer: &RedisPool) -> Result<Vec<String>, redis::RedisError> {
        let mut connection = observer.connection();
        let mut problems = Vec::new();
        let names = scan(observer, "*:key:*").await?;
        let names: Vec<String> = names
            .into_iter()
            .filter(|name| !name.contains(":body:"))
            .collect();
        let finishes = all_finishes(observer, &mut connection).await?;
        for (row, _) in &finishes {
            let state: Option<String> = redis::cmd("HGET")
                .arg(row)
                .arg("st")
                .query_async(&mut connection)
                .await?;
            if state.as_deref() == Some("started") {
                problems.push(format!(
                    "the set of finishes names {row}, which is started: retention would delete it"
                ));
            }
        }
        problems.extend(stale_leases(observer, &mut connection).await?);
        for row in names {
            type Fields = (
                Option<String>,
                Option<String>,
                Option<i64>,
                Option<i64>,
                Option<String>,
                Option<String>,
            );
            let (state, workflow, lease, finished, tenant, key): Fields = redis::cmd("HMGET")
                .arg(&row)
                .arg(&["st", "wf", "lu", "fa", "t", "k"])
                .query_async(&mut connection)
                .await?;
            let Some(workflow) = workflow else { continue };
            let bucket = RedisPool::bucket(
                tenant.as_deref().unwrap_or_default(),
                key.as_deref().unwrap_or_default(),
            );
            let in_leases: Option<i64> = redis::cmd("ZSCORE")
                .arg(observer.leases(bucket, &workflow))
                .arg(&row)
                .query_async(&mut connection)
                .await?;
            let in_finishes = finishes
                .iter()
                .find(|(name, _)| *name == row)
                .map(|(_, at)| *at);
            match state.as_deref() {
                Some("started") if in_leases != lease => problems.push(format!(
                    "started {row} has lease end {lease:?} but its sorted set says {in_leases:?}"
                )),
                Some("done") if in_leases.is_some() => problems.push(format!(
                    "finished {row} is still in its workflow's sorted set of leases"
                )),
                Some("done") if in_finishes != finished => problems.push(format!(
                    "finished {row} at {finished:?} but the set of finishes says {in_finishes:?}"
                )),
                _ => {}
            }
        }
        Ok(problems)
    }

    /// Every bucket's set of finishes, with the finish times.
    async fn all_finishes(
        observer: &RedisPool,
        connection: &mut RedisConnection,
    ) -> Result<Vec<(String, i64)>, redis::RedisError> {
        let mut finishes: Vec<(String, i64)> = Vec::new();
        for bucket in 0..BUCKETS {
            let bucket_finishes: Vec<(String, i64)> = redis::cmd("ZRANGE")
                .arg(observer.finishes(bucket))
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query_async(connection)
                .await?;
            finishes.extend(bucket_finishes);
        }
        Ok(finishes)
    }

    /// The entries of every workflow's set of lease ends that name no started row of that
    /// workflow. Once every key has ended, each is an entry left for good: the resumer's lag
    /// and the count of due keys hold it, and while the key runs again under the other
    /// workflow, that workflow's resumer would take it for its own.
    async fn stale_leases(
        observer: &RedisPool,
        connection: &mut RedisConnection,
    ) -> Result<Vec<String>, redis::RedisError> {
        let sets = scan(observer, "*:leases:*").await?;
        let mut problems = Vec::new();
        for set in sets {
            let named = set
                .rsplit_once(":leases:")
                .map(|(_, hex)| hex)
                .unwrap_or_default();
            let workflow = idemflow_core::hex::decode(named)
                .and_then(|bytes| String::from_utf8(bytes).ok())
                .unwrap_or_else(|| named.to_owned());
            let entries: Vec<String> = redis::cmd("ZRANGE")
                .arg(&set)
                .arg(0)
                .arg(-1)
                .query_async(connection)
                .await?;
            for row in entries {
                let (state, claimed_under): (Option<String>, Option<String>) = redis::cmd("HMGET")
                    .arg(&row)
                    .arg(&["st", "wf"])
                    .query_async(connection)
                    .await?;
                let stale = match (state.as_deref(), claimed_under) {
                    (Some(_), Some(other)) if other != workflow => format!(
                        "which was claimed since under {other}: a resumer of {workflow} would \
                         take it and run {workflow}'s phases on {other}'s request"
                    ),
                    (Some("started"), _) => continue,
                    (None, _) => "whose row is gone".to_owned(),
                    (Some(state), _) => format!("which is {state}"),
                };
                problems.push(format!(
                    "{workflow}'s set of lease ends still names {row}, {stale}; the entry stays \
                     for good, and the resumer's lag counts it"
                ));
            }
        }
        Ok(problems)
    }
}
