//! The commands on the Redis store (`redis://…`; its keys under the prefix in
//! `IDEMFLOW_REDIS_PREFIX`, default `idemflow`), their answers the same as on PostgreSQL:
//! `expire`, the key-level ones (`inspect`, `list --stuck`, `end-lease`) and `stats`. `migrate`
//! answers that Redis has no schema; `partitions` that it is PostgreSQL's only.

use std::time::Duration;

use idemflow_core::{Key, TenantId};
use idemflow_pg::{KeyBodies, KeyReport};
use idemflow_redis::{RedisPool, RedisStore};
use idemflow_store::{Store, TableStats};
use serde::Serialize;

use crate::{
    Answer, CliError, Format, InspectOptions, Keys, Output, emit, end_lease_answer, exit, expired,
    inspect_answer, list_stuck_answer, stats_of,
};

/// The environment variable naming the prefix of the store's keys.
pub const PREFIX_ENV: &str = "IDEMFLOW_REDIS_PREFIX";

/// Whether `url` names a Redis server.
pub fn is_redis(url: &str) -> bool {
    url.starts_with("redis:") || url.starts_with("rediss:")
}

/// Connects to the store `url` names, under the prefix of [`PREFIX_ENV`].
pub async fn open(url: &str) -> Result<RedisPool, CliError> {
    let prefix =
        std::env::var(PREFIX_ENV).unwrap_or_else(|_| idemflow_redis::DEFAULT_PREFIX.to_owned());
    RedisPool::connect_with_prefix(url, &prefix)
        .await
        .map_err(|error| CliError::Database(format!("cannot connect to Redis: {error}")))
}

fn store_error(error: idemflow_redis::StoreError) -> CliError {
    CliError::Database(error.to_string())
}

#[derive(Serialize)]
struct NoSchema {
    migrations: [(); 0],
}

/// `idemflow migrate` on Redis: there is nothing to migrate.
pub async fn migrate(url: &str, format: Format) -> Output {
    emit(
        format,
        async {
            open(url).await?;
            Ok(Answer::new(
                exit::OK,
                "Redis keeps no schema: nothing to migrate\n".to_owned(),
                &NoSchema { migrations: [] },
            ))
        }
        .await,
    )
}

/// `idemflow expire` on Redis: deletes every key finished more than `older_than` ago,
/// `batch_size` keys per script.
pub async fn expire(url: &str, format: Format, older_than: Duration, batch_size: i64) -> Output {
    emit(
        format,
        async {
            if batch_size < 1 {
                return Err(CliError::Usage(
                    "--batch-size must be at least 1".to_owned(),
                ));
            }
            let pool = open(url).await?;
            let mut deleted = 0;
            loop {
                let batch = RedisStore::expire_batch(&pool, older_than, batch_size)
                    .await
                    .map_err(store_error)?;
                deleted += batch;
                if batch < u64::try_from(batch_size).unwrap_or(u64::MAX) {
                    break;
                }
            }
            Ok(expired(deleted, older_than, batch_size))
        }
        .await,
    )
}

/// The key-level commands' access to the Redis store.
struct RedisKeys(RedisPool);

impl Keys for RedisKeys {
    async fn key_report(&mut self, tenant: &str, key: &str) -> Result<Option<KeyReport>, CliError> {
        idemflow_redis::key_report(&self.0, tenant, key)
            .await
            .map_err(store_error)
    }

    async fn key_bodies(&mut self, tenant: &str, key: &str) -> Result<Option<KeyBodies>, CliError> {
        idemflow_redis::key_bodies(&self.0, tenant, key)
            .await
            .map_err(store_error)
    }

    async fn stuck_keys(
        &mut self,
        min_attempts: i32,
        limit: i64,
    ) -> Result<Vec<KeyReport>, CliError> {
        idemflow_redis::stuck_keys(&self.0, min_attempts, limit)
            .await
            .map_err(store_error)
    }

    /// Redis has no notifications here: resumers find the key at their next poll.
    async fn end_lease(
        &mut self,
        tenant: &str,
        key: &str,
        lock_version: i64,
    ) -> Result<Option<i64>, CliError> {
        let tenant = TenantId::new(tenant).map_err(|error| CliError::Usage(error.to_string()))?;
        let key = Key::parse(key).map_err(|error| CliError::Usage(error.to_string()))?;
        RedisStore::end_lease(&self.0, &tenant, &key, lock_version)
            .await
            .map_err(store_error)
    }
}

/// `idemflow inspect` on Redis.
pub async fn inspect(
    url: &str,
    format: Format,
    tenant: &str,
    key: &str,
    options: &InspectOptions,
) -> Output {
    emit(
        format,
        async {
            let mut keys = RedisKeys(open(url).await?);
            inspect_answer(&mut keys, tenant, key, options).await
        }
        .await,
    )
}

/// `idemflow list --stuck` on Redis.
pub async fn list_stuck(url: &str, format: Format, min_attempts: i32, limit: i64) -> Output {
    emit(
        format,
        async {
            let mut keys = RedisKeys(open(url).await?);
            list_stuck_answer(&mut keys, min_attempts, limit).await
        }
        .await,
    )
}

/// `idemflow end-lease` on Redis.
pub async fn end_lease(url: &str, format: Format, tenant: &str, key: &str, force: bool) -> Output {
    emit(
        format,
        async {
            let mut keys = RedisKeys(open(url).await?);
            end_lease_answer(&mut keys, tenant, key, force).await
        }
        .await,
    )
}

/// `idemflow stats` on Redis: started keys by workflow (the sorted sets of lease ends) and
/// finished keys in all (the set of finishes, which does not keep workflows: counted under
/// `*`), the oldest started key and the resumer's lag.
pub async fn stats(url: &str, format: Format) -> Output {
    emit(
        format,
        async {
            let pool = open(url).await?;
            let overview = idemflow_redis::overview(&pool).await.map_err(store_error)?;
            let finished = idemflow_redis::finished_keys(&pool)
                .await
                .map_err(store_error)?;
            let mut counts: Vec<(String, String, i64)> = overview
                .started
                .into_iter()
                .map(|started| (started.workflow, "started".to_owned(), started.keys))
                .collect();
            counts.push(("*".to_owned(), "done".to_owned(), finished));
            Ok(stats_of(&TableStats {
                counts,
                oldest_started_seconds: overview.oldest_started_seconds,
                resumer_lag_ms: overview.resumer_lag_ms,
            }))
        }
        .await,
    )
}

/// A command Redis does not have.
pub fn not_yet(command: &str, format: Format) -> Output {
    CliError::Usage(format!(
        "`idemflow {command}` is PostgreSQL's only: the partitioned layout has no Redis form \
         (docs/engines.md)"
    ))
    .output(format)
}
