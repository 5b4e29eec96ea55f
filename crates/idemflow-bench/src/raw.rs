//! The raw baseline: the statements and commits a request needs at minimum, issued directly
//! through sqlx with no engine (no canonical JSON, fingerprint, decision, typed phases, spans,
//! metrics or spawned BEGIN). Advance and finish are the engine's own texts
//! (`idemflow_pg::statements`), so the difference between the two is the engine's own cost. pgbench runs the same text.

use std::sync::LazyLock;

use sqlx::PgPool;
use sqlx::types::Json;

use crate::Error;
use crate::workflows::{CHECKOUT, INSERT_ORDER, MARK_PAID, PLACE, TENANT};

pub const LEASE_MS: i64 = 60_000;

pub const CLAIM: &str = "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, locked_until) \
     VALUES ($1, $2, $3, $4, $5, clock_timestamp() + $6::bigint * interval '1 millisecond') \
     ON CONFLICT (tenant, key) DO NOTHING \
     RETURNING lock_version";

/// The engine's own advance and finish, the very texts it sends, less the one predicate that
/// checks the engine's mark on its own transaction (`SET LOCAL idemflow.transaction`, set by the
/// engine's `BEGIN` message): a hand-written transaction has no such mark, and with the predicate
/// its writes would match no row. The raw baseline differs from the engine in everything around
/// the statements, not in them.
pub static ADVANCE: LazyLock<String> =
    LazyLock::new(|| without_mark(idemflow_pg::statements::ADVANCE));
pub static FINISH: LazyLock<String> =
    LazyLock::new(|| without_mark(idemflow_pg::statements::FINISH));

/// The predicate every owner's write of the engine carries (its own transaction's mark).
const MARK_PREDICATE: &str = "AND current_setting('idemflow.transaction', true) = 'open'";

/// `statement` without [`MARK_PREDICATE`], which it must carry exactly once.
fn without_mark(statement: &str) -> String {
    assert_eq!(
        statement.matches(MARK_PREDICATE).count(),
        1,
        "the engine's write no longer carries its mark as the baseline expects: {statement}"
    );
    statement.replacen(MARK_PREDICATE, "", 1)
}

/// The raw replay: one primary-key select of the stored response.
pub const SELECT_RESPONSE: &str = "SELECT response_status, response_headers, response_body \
     FROM idempotency_keys WHERE tenant = $1 AND key = $2";

/// What the raw requests store, fixed: the engine computes these per request.
#[derive(Debug, Clone)]
pub struct Shape {
    pub fingerprint: Vec<u8>,
    pub request: serde_json::Value,
}

fn headers() -> Json<Vec<(String, String)>> {
    Json(vec![(
        "content-type".to_owned(),
        "application/json".to_owned(),
    )])
}

async fn claim(
    connection: &mut sqlx::PgConnection,
    shape: &Shape,
    workflow: &str,
    key: &str,
) -> Result<i64, Error> {
    let row: Option<(i64,)> = sqlx::query_as(CLAIM)
        .bind(TENANT)
        .bind(key)
        .bind(shape.fingerprint.as_slice())
        .bind(workflow)
        .bind(Json(&shape.request))
        .bind(LEASE_MS)
        .fetch_optional(connection)
        .await?;
    Ok(row
        .ok_or_else(|| format!("raw claim of a fresh key {key} found it taken"))?
        .0)
}

/// The checkout workload, raw: BEGIN, claim, order insert, advance, COMMIT; (no-op); BEGIN, order
/// update, finish, COMMIT.
pub async fn checkout(pool: &PgPool, shape: &Shape, key: &str) -> Result<(), Error> {
    checkout_answer(pool, shape, key).await.map(drop)
}

/// [`checkout`], returning the response body it stored.
async fn checkout_answer(pool: &PgPool, shape: &Shape, key: &str) -> Result<String, Error> {
    let mut tx = pool.begin().await?;
    let lock_version = claim(&mut tx, shape, CHECKOUT, key).await?;
    let (order_id,): (i64,) = sqlx::query_as(INSERT_ORDER)
        .bind(TENANT)
        .bind(key)
        .bind(100_i64)
        .fetch_one(&mut *tx)
        .await?;
    let output = serde_json::json!({"order_id": order_id, "amount": 100, "source": "tok_visa"});
    let advanced = sqlx::query(ADVANCE.as_str())
        .bind(TENANT)
        .bind(key)
        .bind(lock_version)
        .bind("create_order")
        .bind(Json(&output))
        .bind(LEASE_MS)
        .execute(&mut *tx)
        .await?;
    wrote_the_row("advance", key, advanced.rows_affected())?;
    tx.commit().await?;

    let mut tx = pool.begin().await?;
    sqlx::query(MARK_PAID)
        .bind(order_id)
        .bind("paid")
        .bind("attempt-1")
        .execute(&mut *tx)
        .await?;
    let body = format!(r#"{{"charge_id":"ch_{order_id}","order_id":{order_id},"status":"paid"}}"#);
    let finished = sqlx::query(FINISH.as_str())
        .bind(TENANT)
        .bind(key)
        .bind(lock_version)
        .bind("mark_paid")
        .bind(201_i16)
        .bind(headers())
        .bind(body.as_bytes())
        .execute(&mut *tx)
        .await?;
    wrote_the_row("finish", key, finished.rows_affected())?;
    tx.commit().await?;
    Ok(body)
}

/// What the raw HTTP handler answers: whether it is a replay, the status, headers and body.
pub type Answer = (bool, u16, Vec<(String, String)>, Vec<u8>);

/// The http workload, raw: what a hand-written handler does for one POST under `key`: the stored
/// response by primary key if there is one (a replay), else the raw checkout and its response.
pub async fn answer(pool: &PgPool, shape: &Shape, key: &str) -> Result<Answer, Error> {
    let stored: Option<StoredRow> = sqlx::query_as(SELECT_RESPONSE)
        .bind(TENANT)
        .bind(key)
        .fetch_optional(pool)
        .await?;
    if let Some((status, headers, body)) = stored {
        return Ok((true, u16::try_from(status)?, headers.0, body));
    }
    let body = checkout_answer(pool, shape, key).await?;
    Ok((false, 201, headers().0, body.into_bytes()))
}

/// The local-only workload, raw: BEGIN, claim, order insert, finish, COMMIT.
pub async fn place(pool: &PgPool, shape: &Shape, key: &str) -> Result<(), Error> {
    let mut tx = pool.begin().await?;
    let lock_version = claim(&mut tx, shape, PLACE, key).await?;
    let (order_id,): (i64,) = sqlx::query_as(INSERT_ORDER)
        .bind(TENANT)
        .bind(key)
        .bind(100_i64)
        .fetch_one(&mut *tx)
        .await?;
    let body = format!(r#"{{"order_id":{order_id},"status":"created"}}"#);
    let finished = sqlx::query(FINISH.as_str())
        .bind(TENANT)
        .bind(key)
        .bind(lock_version)
        .bind("place_order")
        .bind(201_i16)
        .bind(headers())
        .bind(body.as_bytes())
        .execute(&mut *tx)
        .await?;
    wrote_the_row("finish", key, finished.rows_affected())?;
    tx.commit().await?;
    Ok(())
}

/// A baseline that writes nothing measures nothing: a fenced write of the raw shape that matched
/// no row fails the run.
pub(crate) fn wrote_the_row(statement: &str, key: &str, rows: u64) -> Result<(), Error> {
    if rows == 1 {
        Ok(())
    } else {
        Err(format!("the raw {statement} of {key} wrote {rows} rows, not its key's one").into())
    }
}

/// A stored response: status, headers, body.
type StoredRow = (i16, Json<Vec<(String, String)>>, Vec<u8>);

/// The replay workload, raw: the primary-key select of the stored response, on a pooled connection.
pub async fn replay(pool: &PgPool, key: &str) -> Result<(), Error> {
    let row: Option<StoredRow> = sqlx::query_as(SELECT_RESPONSE)
        .bind(TENANT)
        .bind(key)
        .fetch_optional(pool)
        .await?;
    match row {
        Some((201, _, _)) => Ok(()),
        other => Err(format!("raw replay of {key}: {other:?}").into()),
    }
}
