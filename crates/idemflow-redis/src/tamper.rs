//! [`Tamper`] on Redis: tests' writes behind the scripts' back, row by row over the index of
//! every key.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{EngineError, Tamper};

use crate::{BUCKETS, RedisPool, RedisStore, StoreError};

/// The row names of every key (of `only`, when given), from the index of every key.
async fn rows(
    pool: &RedisPool,
    only: Option<(&str, &str)>,
) -> Result<Vec<(u16, String)>, StoreError> {
    if let Some((tenant, key)) = only {
        return Ok(vec![(
            RedisPool::bucket(tenant, key),
            pool.row(tenant, key),
        )]);
    }
    let mut rows = Vec::new();
    for bucket in 0..BUCKETS {
        let members: Vec<String> = redis::cmd("ZRANGE")
            .arg(pool.index(bucket))
            .arg(0)
            .arg(-1)
            .query_async(&mut pool.connection())
            .await?;
        rows.extend(
            members
                .iter()
                .filter_map(|member| member.split_once('!'))
                .map(|(tenant, key)| {
                    (
                        bucket,
                        format!("{}{tenant}:{key}", pool.rows_prefix(bucket)),
                    )
                }),
        );
    }
    Ok(rows)
}

/// Moves a field holding a time `by` milliseconds back, with the row's entry in `set`, for rows
/// in `state`.
async fn move_back(
    pool: &RedisPool,
    row: &str,
    state: &str,
    field: &str,
    set: impl Fn(&str) -> String,
    by: i64,
) -> Result<(), StoreError> {
    let mut connection = pool.connection();
    let (stored, workflow, at): (Option<String>, Option<String>, Option<i64>) = redis::cmd("HMGET")
        .arg(row)
        .arg(&["st", "wf", field])
        .query_async(&mut connection)
        .await?;
    if let (Some(stored), Some(at)) = (stored, at)
        && stored == state
    {
        {
            let workflow = workflow.unwrap_or_default();
            let moved = at - by;
            let _: () = redis::pipe()
                .cmd("HSET")
                .arg(row)
                .arg(field)
                .arg(moved)
                .cmd("ZADD")
                .arg(set(&workflow))
                .arg(moved)
                .arg(row)
                .query_async(&mut connection)
                .await?;
        }
    }
    Ok(())
}

#[async_trait]
impl Tamper for RedisStore {
    async fn lapse_leases(pool: &RedisPool, only: Option<(&str, &str)>) -> Result<(), EngineError> {
        for (bucket, row) in rows(pool, only).await? {
            let leases = |workflow: &str| pool.leases(bucket, workflow);
            move_back(pool, &row, "started", "lu", leases, 86_400_000).await?;
        }
        Ok(())
    }

    async fn age_finished(pool: &RedisPool, by: Duration) -> Result<(), EngineError> {
        let by = i64::try_from(by.as_millis()).unwrap_or(i64::MAX);
        for (bucket, row) in rows(pool, None).await? {
            move_back(pool, &row, "done", "fa", |_| pool.finishes(bucket), by).await?;
        }
        Ok(())
    }

    async fn damage_journals(pool: &RedisPool) -> Result<(), EngineError> {
        for (_, row) in rows(pool, None).await? {
            let _: () = redis::cmd("HSET")
                .arg(&row)
                .arg("jr")
                .arg("{\"at\": oops")
                .query_async(&mut pool.connection())
                .await
                .map_err(StoreError::from)?;
        }
        Ok(())
    }
}
