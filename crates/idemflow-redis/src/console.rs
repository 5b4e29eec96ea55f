//! What operators read and do on the Redis store (the console, `inspect`): one key's report with
//! its journal, its stored bodies, the overview, a page of keys in `(tenant, key)` order, the
//! stuck keys, and expiring one key under the token it was shown. Each read goes through the
//! store's own indexes (the index of every key, the sorted sets of lease ends and of finishes),
//! never a scan of the keyspace.

use idemflow_core::FieldValue;
use idemflow_store::{
    JournalEntry, KeyBodies, KeyReport, KeyResponse, Overview, ScanFrom, StartedKeys,
    journal_from_json,
};
use serde_json::Value;

use crate::{BUCKETS, RedisPool, StoreError, scripts, workflow_of};

fn text(bytes: Option<Vec<u8>>) -> Result<Option<String>, StoreError> {
    bytes
        .map(|bytes| {
            String::from_utf8(bytes).map_err(|_| StoreError::Corrupt("non-UTF-8 field".into()))
        })
        .transpose()
}

fn number(bytes: Option<Vec<u8>>) -> Result<Option<i64>, StoreError> {
    text(bytes)?
        .map(|text| {
            text.parse::<i64>()
                .map_err(|_| StoreError::Corrupt(format!("not a number: {text}")))
        })
        .transpose()
}

/// A journal as the scripts store it (one JSON entry per line), as entries; unreadable, empty
/// (with a warning naming the key), as on every engine.
fn journal(tenant: &str, key: &str, stored: Option<String>) -> Vec<JournalEntry> {
    match stored {
        None => Vec::new(),
        Some(lines) => journal_from_json(tenant, key, &format!("[{}]", lines.replace('\n', ","))),
    }
}

type Reported = (i64, Vec<Option<Vec<u8>>>, Option<i64>);

/// One key's report, its journal included: `idemflow inspect`'s and the console's key page.
pub async fn key_report(
    pool: &RedisPool,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyReport>, StoreError> {
    let row = pool.row(tenant, key);
    let (now, fields, bytes): Reported = scripts::report()
        .key(&row)
        .key(format!("{row}:body:"))
        .invoke_async(&mut pool.connection())
        .await?;
    let mut fields = fields.into_iter();
    let mut next = || fields.next().flatten();
    let (stored_tenant, stored_key, workflow, state, point) =
        (next(), next(), next(), next(), next());
    let (lease, token, attempts, error, status) = (next(), next(), next(), next(), next());
    let (fingerprint, created, stored_journal) = (next(), next(), next());
    let Some(state) = text(state)? else {
        return Ok(None);
    };
    let tenant = text(stored_tenant)?.unwrap_or_else(|| tenant.to_owned());
    let key = text(stored_key)?.unwrap_or_else(|| key.to_owned());
    let done = state == "done";
    let journal = journal(&tenant, &key, text(stored_journal)?);
    Ok(Some(KeyReport {
        workflow: text(workflow)?.unwrap_or_default(),
        recovery_point: text(point)?.unwrap_or_default(),
        lease_left_ms: if done {
            None
        } else {
            number(lease)?.map(|ends| ends - now)
        },
        lock_version: number(token)?.ok_or_else(|| StoreError::Corrupt("no token".into()))?,
        attempts: number(attempts)?
            .and_then(|attempts| i32::try_from(attempts).ok())
            .unwrap_or(1),
        last_error: text(error)?,
        response_status: number(status)?.and_then(|status| i16::try_from(status).ok()),
        response_bytes: bytes.and_then(|bytes| i32::try_from(bytes).ok()),
        fingerprint_hex: idemflow_core::hex::encode(&fingerprint.unwrap_or_default()),
        age_seconds: number(created)?.map_or(0, |created| (now - created).max(0) / 1000),
        journal,
        state,
        tenant,
        key,
    }))
}

/// One key's stored request and response, as stored (sealed where sealed).
pub async fn key_bodies(
    pool: &RedisPool,
    tenant: &str,
    key: &str,
) -> Result<Option<KeyBodies>, StoreError> {
    let row = pool.row(tenant, key);
    let (now, fields): (i64, Vec<Option<Vec<u8>>>) = scripts::bodies()
        .key(&row)
        .invoke_async(&mut pool.connection())
        .await?;
    let mut fields = fields.into_iter();
    let mut next = || fields.next().flatten();
    let (request, state, status, headers, body, apart, finished) =
        (next(), next(), next(), next(), next(), next(), next());
    let Some(request) = text(request)? else {
        return Ok(None);
    };
    let request: Value = serde_json::from_str(&request)
        .map_err(|error| StoreError::Corrupt(format!("stored request: {error}")))?;
    if text(state)?.as_deref() != Some("done") {
        return Ok(Some(KeyBodies {
            request,
            response: None,
            finished_seconds_ago: None,
        }));
    }
    let apart = number(apart)?;
    let body = match apart {
        Some(apart) => redis::cmd("GET")
            .arg(RedisPool::body(&row, apart))
            .query_async::<Option<Vec<u8>>>(&mut pool.connection())
            .await?
            .unwrap_or_default(),
        None => body.unwrap_or_default(),
    };
    let headers: Vec<(String, FieldValue)> =
        serde_json::from_str(&text(headers)?.unwrap_or_else(|| "[]".to_owned()))
            .map_err(|error| StoreError::Corrupt(format!("response headers: {error}")))?;
    let status = number(status)?.ok_or_else(|| StoreError::Corrupt("no status".into()))?;
    Ok(Some(KeyBodies {
        request,
        response: Some(KeyResponse {
            status: u16::try_from(status)
                .map_err(|_| StoreError::Corrupt(format!("status {status}")))?,
            headers,
            body,
            apart: apart.is_some(),
        }),
        finished_seconds_ago: number(finished)?.map(|finished| (now - finished).max(0) / 1000),
    }))
}

/// Members of a sorted set one script reads at most: a script blocks every other client while it
/// runs, so what an operator's page costs Redis is paid in pages of this many, never in one walk
/// of every started key.
pub const MEMBERS_PER_SCRIPT: i64 = 256;

type Overviewed = (i64, Vec<(String, i64, i64)>, i64, i64);

/// The store at a glance: started keys by workflow (its sorted set of lease ends), the oldest
/// started key, the resumer's lag, and keys finished lately (the set of finishes). The count of
/// keys is the index's, exact. The counts are one script of `ZCARD` and `ZCOUNT`; the oldest
/// started key is read off the started rows in pages of [`MEMBERS_PER_SCRIPT`].
pub async fn overview(pool: &RedisPool) -> Result<Overview, StoreError> {
    let mut connection = pool.connection();
    let mut now = 0;
    let (mut last_minute, mut last_15) = (0, 0);
    let mut counts: std::collections::BTreeMap<String, (i64, i64)> =
        std::collections::BTreeMap::new();
    let mut oldest: Option<i64> = None;
    let mut keys: i64 = 0;
    for bucket in 0..BUCKETS {
        let (bucket_now, started, minute, quarter): Overviewed = scripts::overview()
            .key(pool.workflows(bucket))
            .key(pool.finishes(bucket))
            .arg(pool.leases_prefix(bucket))
            .invoke_async(&mut connection)
            .await?;
        now = now.max(bucket_now);
        last_minute += minute;
        last_15 += quarter;
        for (workflow, started_keys, due) in started {
            let leases = format!("{}{workflow}", pool.leases_prefix(bucket));
            let count = counts.entry(workflow).or_default();
            count.0 += started_keys;
            count.1 += due;
            if let Some(created) = oldest_started(&mut connection, &leases).await? {
                oldest = Some(oldest.map_or(created, |oldest| oldest.min(created)));
            }
        }
        keys += redis::cmd("ZCARD")
            .arg(pool.index(bucket))
            .query_async::<i64>(&mut connection)
            .await?;
    }
    let mut started = counts
        .into_iter()
        .map(|(workflow, (keys, due))| {
            let workflow = idemflow_core::hex::decode(&workflow)
                .and_then(|bytes| String::from_utf8(bytes).ok())
                .ok_or_else(|| StoreError::Corrupt(format!("workflow {workflow}")))?;
            Ok(StartedKeys {
                workflow,
                keys,
                due,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    started.sort_by(|a, b| a.workflow.cmp(&b.workflow));
    let lag = crate::resumer_lag(pool).await?;
    Ok(Overview {
        started,
        oldest_started_seconds: oldest.map(|created| (now - created).max(0) / 1000),
        resumer_lag_ms: i64::try_from(lag.as_millis()).unwrap_or(i64::MAX),
        finished_last_minute: last_minute,
        finished_last_15_minutes: last_15,
        estimated_keys: Some(keys),
    })
}

/// The oldest claim among the started keys of one set of lease ends, read page by page.
async fn oldest_started(
    connection: &mut crate::RedisConnection,
    leases: &str,
) -> Result<Option<i64>, StoreError> {
    let mut oldest: Option<i64> = None;
    let (mut score, mut member) = (String::new(), String::new());
    loop {
        let (created, read, last_score, last_member): (Option<i64>, i64, String, String) =
            scripts::oldest_started()
                .key(leases)
                .arg(&score)
                .arg(&member)
                .arg(MEMBERS_PER_SCRIPT)
                .invoke_async(connection)
                .await?;
        if let Some(created) = created {
            oldest = Some(oldest.map_or(created, |oldest| oldest.min(created)));
        }
        if read < MEMBERS_PER_SCRIPT {
            return Ok(oldest);
        }
        (score, member) = (last_score, last_member);
    }
}

/// A member of the index back to its tenant and key.
fn unmember(member: &str) -> Option<(String, String)> {
    let (tenant, key) = member.split_once('!')?;
    let text = |hex: &str| String::from_utf8(idemflow_core::hex::decode(hex)?).ok();
    Some((text(tenant)?, text(key)?))
}

/// Up to `limit` keys from `from`, in `(tenant, key)` order: the index of every key, walked by
/// `ZRANGEBYLEX` from the position. A member whose row was lost (evicted) is passed over.
pub async fn scan_keys(
    pool: &RedisPool,
    from: &ScanFrom,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let bound = if from.inclusive { "[" } else { "(" };
    let (mut min, max) = match &from.tenant {
        Some(tenant) => {
            let hex = idemflow_core::hex::encode(tenant.as_bytes());
            (
                format!("{bound}{}", RedisPool::member(tenant, &from.after.1)),
                // `"` follows `!`: the end of this tenant's members.
                format!("({hex}\""),
            )
        }
        None if from.after.0.is_empty() => ("-".to_owned(), "+".to_owned()),
        None => (
            format!("{bound}{}", RedisPool::member(&from.after.0, &from.after.1)),
            "+".to_owned(),
        ),
    };
    // Each bucket's index from the position, merged: the next `wanted` members of all are among
    // the next `wanted` of each.
    let mut reports = Vec::new();
    while (reports.len() as i64) < limit {
        let wanted = limit - reports.len() as i64;
        let mut members: Vec<String> = Vec::new();
        for bucket in 0..BUCKETS {
            let found: Vec<String> = redis::cmd("ZRANGEBYLEX")
                .arg(pool.index(bucket))
                .arg(&min)
                .arg(&max)
                .arg("LIMIT")
                .arg(0)
                .arg(wanted)
                .query_async(&mut pool.connection())
                .await?;
            members.extend(found);
        }
        members.sort();
        members.dedup();
        members.truncate(usize::try_from(wanted).unwrap_or(0));
        let Some(last) = members.last() else {
            break;
        };
        min = format!("({last}");
        let fetched = members.len() as i64;
        for member in members {
            let (tenant, key) = unmember(&member)
                .ok_or_else(|| StoreError::Corrupt(format!("index member {member}")))?;
            if let Some(report) = key_report(pool, &tenant, &key).await? {
                reports.push(report);
            }
        }
        if fetched < wanted {
            break;
        }
    }
    Ok(reports)
}

/// Started keys whose lease is over or with `min_attempts` attempts or more, the oldest lease
/// first, at most `limit`: read from the sorted sets of lease ends (started keys only), in pages
/// of [`MEMBERS_PER_SCRIPT`], each workflow's until it gave `limit` (later ones end later).
pub async fn stuck_keys(
    pool: &RedisPool,
    min_attempts: i32,
    limit: i64,
) -> Result<Vec<KeyReport>, StoreError> {
    let mut connection = pool.connection();
    let mut sets = Vec::new();
    for bucket in 0..BUCKETS {
        let workflows: Vec<String> = redis::cmd("SMEMBERS")
            .arg(pool.workflows(bucket))
            .query_async(&mut connection)
            .await?;
        sets.extend(
            workflows
                .into_iter()
                .map(|workflow| format!("{}{workflow}", pool.leases_prefix(bucket))),
        );
    }
    let mut stuck: Vec<(i64, String, String)> = Vec::new();
    for leases in sets {
        let (mut score, mut member) = (String::new(), String::new());
        let mut found = 0;
        loop {
            type Page = (i64, String, String, Vec<(i64, String, String)>);
            let (read, last_score, last_member, page): Page = scripts::stuck_page()
                .key(&leases)
                .arg(&score)
                .arg(&member)
                .arg(MEMBERS_PER_SCRIPT)
                .arg(min_attempts)
                .invoke_async(&mut connection)
                .await?;
            found += page.len() as i64;
            stuck.extend(page);
            if read < MEMBERS_PER_SCRIPT || found >= limit {
                break;
            }
            (score, member) = (last_score, last_member);
        }
    }
    stuck.sort();
    let mut seen = std::collections::HashSet::new();
    let mut reports = Vec::new();
    for (_, tenant, key) in stuck {
        if reports.len() as i64 >= limit {
            break;
        }
        if seen.insert((tenant.clone(), key.clone()))
            && let Some(report) = key_report(pool, &tenant, &key).await?
        {
            reports.push(report);
        }
    }
    Ok(reports)
}

/// Deletes a key (with its body apart) if it still holds `lock_version` and is in `state`, as the
/// console showed it: the state it had, `None` when it moved on. A started key's owner is fenced
/// out of every write after.
pub async fn expire_key(
    pool: &RedisPool,
    tenant: &str,
    key: &str,
    lock_version: i64,
    state: &str,
) -> Result<Option<String>, StoreError> {
    let mut connection = pool.connection();
    let row = pool.row(tenant, key);
    let bucket = RedisPool::bucket(tenant, key);
    let (workflow, apart): (Option<String>, Option<String>) = redis::cmd("HMGET")
        .arg(&row)
        .arg(&["wf", "apart"])
        .query_async(&mut connection)
        .await?;
    let Some(workflow) = workflow else {
        return Ok(None);
    };
    let apart = apart.unwrap_or_default();
    Ok(scripts::expire_key()
        .key(&row)
        .key(pool.index(bucket))
        .key(pool.finishes(bucket))
        .key(pool.leases(bucket, &workflow))
        .key(pool.leased(bucket))
        .key(format!("{row}:body:{apart}"))
        .arg(lock_version)
        .arg(state)
        .arg(RedisPool::member(tenant, key))
        .arg(apart)
        .invoke_async(&mut connection)
        .await?)
}

/// Finished keys in all: the sets of finishes' sizes, every bucket's.
pub async fn finished_keys(pool: &RedisPool) -> Result<i64, StoreError> {
    let mut finished = 0;
    for bucket in 0..BUCKETS {
        finished += redis::cmd("ZCARD")
            .arg(pool.finishes(bucket))
            .query_async::<i64>(&mut pool.connection())
            .await?;
    }
    Ok(finished)
}

/// Ends a started key's lease now if its token is still `seen`, advancing the fence (an
/// operator's `end-lease`): the new token, or `None` when the key is not started or its token
/// moved on.
pub async fn end_lease(
    pool: &RedisPool,
    tenant: &str,
    key: &str,
    seen: i64,
) -> Result<Option<i64>, StoreError> {
    let mut connection = pool.connection();
    let row = pool.row(tenant, key);
    let Some(workflow) = workflow_of(&mut connection, &row).await? else {
        return Ok(None);
    };
    let bucket = RedisPool::bucket(tenant, key);
    let token: i64 = scripts::end_lease()
        .key(&row)
        .key(pool.fence(bucket))
        .key(pool.leases(bucket, &workflow))
        .arg(seen)
        .invoke_async(&mut connection)
        .await?;
    Ok((token != 0).then_some(token))
}
