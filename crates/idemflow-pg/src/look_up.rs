//! Reading a key before deciding on it: [`look_up`], the first statement of every request (and
//! the fencing token a new key's claim will hold), [`next_lock_version`] for claims made without
//! a look-up, and [`inspect`], the same row with every column an operator looks at. They live
//! together because they decode the same columns the same way (the fingerprint, the lease left,
//! the stored response), each read by the name its statement gives it.

use std::time::Duration;

use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::claim_lock::claim_lock;
use crate::error::StoreError;
use crate::millis::from_millis;
use crate::statements;

/// What [`look_up`] found.
#[derive(Debug, Clone)]
pub enum LookUp {
    /// The key exists (committed).
    Found(FoundKey),
    /// No committed row, but a claim of this key is in flight: its transaction has not
    /// committed yet. The request is concurrent with it.
    Claiming,
    /// No row and no claim in flight: the key is new.
    Absent {
        /// A fresh fencing token for its claim, drawn from the `idempotency_keys_fence` sequence
        /// in the same statement.
        lock_version: i64,
        /// Whether this connection holds the prepared claim (`idemflow_claim_v4`): a claim on
        /// the same connection that does not prepares it in its own message
        /// ([`crate::begin_claim_knowing`]), so no message fails for it.
        claim_prepared: bool,
    },
}

/// A key as the look-up sees it: the engine boundary's, shared by every engine.
pub use idemflow_store::FoundKey;

/// The first statement of every request: reads the key outside any transaction, in one round
/// trip. A retry of a finished key, a concurrent duplicate and a reused key all get their answer
/// from it alone (a replay whose body is stored apart reads it with a second statement,
/// [`response_apart`]).
///
/// A claim in flight is invisible to this snapshot, so when no row is found the statement tries
/// the claim's advisory lock (shared, released as the statement ends): if a claim holds it, the
/// key is being claimed right now. `UNION ALL … LIMIT 1` runs the second branch only when the
/// first found nothing: one index probe either way, and cheaper on the server than a left join
/// of the same columns (pgbench, 32 clients: 0.91× a plain select of the response, against 0.84×).
/// That second branch also draws the claim's fencing token, so a new key's claim knows its token
/// without a round trip of its own; a replay, a 409 or a 422 never reaches it.
pub async fn look_up(
    connection: &mut PgConnection,
    tenant: &TenantId,
    key: &Key,
) -> Result<LookUp, StoreError> {
    let row = sqlx::query(statements::LOOK_UP)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(claim_lock(tenant, key))
        .fetch_one(&mut *connection)
        .await?;
    let fingerprint: Option<Vec<u8>> = row.get("fingerprint");
    let Some(fingerprint) = fingerprint else {
        let claiming: bool = row.get("claiming");
        return Ok(if claiming {
            LookUp::Claiming
        } else {
            LookUp::Absent {
                lock_version: row.get("new_lock_version"),
                claim_prepared: row.get("claim_prepared"),
            }
        });
    };
    let fingerprint = fingerprint_of(&fingerprint)?;
    let done: bool = row.get("done");
    let lease_left_ms: Option<i64> = row.get("lease_left_ms");
    let (response, body_apart) = if done {
        let (response, in_row) = stored_response(&row)?;
        // Stored apart (a done key has its body in the row or apart: the schema says so): the
        // life the row is, for reading it ([`response_apart`]).
        let life: Option<i64> = row.get("life");
        (Some(response), if in_row { None } else { life })
    } else {
        (None, None)
    };
    Ok(LookUp::Found(FoundKey {
        fingerprint,
        workflow: row.get("workflow"),
        done,
        lease_left: if done {
            Duration::ZERO
        } else {
            from_millis(lease_left_ms.unwrap_or(0))
        },
        lock_version: row.get("lock_version"),
        response,
        body_apart,
    }))
}

/// The body of a response stored apart, for the life of its key the look-up found
/// ([`FoundKey::body_apart`]): the second statement of such a replay, on the same connection.
/// `None` when that life is gone: retention deleted the key between the two statements (and a new
/// request may have claimed it anew, whose body this never is): look the key up again.
pub async fn response_apart(
    connection: &mut PgConnection,
    tenant: &TenantId,
    key: &Key,
    life: i64,
) -> Result<Option<Vec<u8>>, StoreError> {
    Ok(sqlx::query_scalar(statements::RESPONSE_APART)
        .bind(tenant.as_str())
        .bind(key.as_str())
        .bind(life)
        .fetch_optional(connection)
        .await?)
}

/// Draws a fencing token for a claim from the fence sequence, in a statement of its own. A
/// request gets its token from the look-up ([`LookUp::Absent`]) instead; this is for claims
/// made without one (tests, tools).
pub async fn next_lock_version(connection: &mut PgConnection) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(statements::NEXT_FENCE)
        .fetch_one(connection)
        .await?)
}

/// A key row as an operator sees it ([`inspect`]).
#[derive(Debug, Clone)]
pub struct KeyRow {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: Fingerprint,
    /// The name of the workflow that claimed the key.
    pub workflow: String,
    /// Whether the key is finished (its response stored); otherwise it is started.
    pub done: bool,
    /// The name of the last completed phase, `start` before any.
    pub recovery_point: String,
    /// Time left on the lease by the database clock; zero when expired (or done).
    pub lease_left: Duration,
    /// The current fencing token.
    pub lock_version: i64,
    /// Executions begun at this recovery point (the claim, each takeover); back to 1 when a
    /// phase completes.
    pub attempts: i32,
    /// The error the last failed attempt recorded; cleared when a phase completes.
    pub last_error: Option<String>,
    /// Present when `done`.
    pub response: Option<StoredResponse>,
}

/// Reads a key row with every column an operator (or a test tool) looks at; `None` if there is
/// none. Requests use [`look_up`].
pub async fn inspect(
    connection: &mut PgConnection,
    tenant: &TenantId,
    key: &Key,
) -> Result<Option<KeyRow>, StoreError> {
    let row = sqlx::query(
        "SELECT fingerprint, workflow, state = 'done' AS done, recovery_point, \
                CASE WHEN state = 'started' \
                     THEN greatest(0, ceil(extract(epoch FROM locked_until - now()) * 1000))::bigint \
                     ELSE 0 END AS lease_left_ms, \
                lock_version, attempts, last_error, response_status, response_headers, \
                coalesce(response_body, \
                         (SELECT body FROM idempotency_responses AS apart \
                          WHERE apart.tenant = keys.tenant AND apart.key = keys.key \
                            AND apart.created_at = keys.created_at)) \
                    AS response_body \
         FROM idempotency_keys AS keys WHERE tenant = $1 AND key = $2",
    )
    .bind(tenant.as_str())
    .bind(key.as_str())
    .fetch_optional(connection)
    .await?;
    row.as_ref().map(key_row).transpose()
}

fn key_row(row: &PgRow) -> Result<KeyRow, StoreError> {
    let fingerprint_bytes: Vec<u8> = row.get("fingerprint");
    let fingerprint = fingerprint_of(&fingerprint_bytes)?;
    let done: bool = row.get("done");
    let lease_left_ms: i64 = row.get("lease_left_ms");
    let response = if done {
        // The statement reads a body stored apart in the same snapshot.
        Some(stored_response(row)?.0)
    } else {
        None
    };
    Ok(KeyRow {
        fingerprint,
        workflow: row.get("workflow"),
        done,
        recovery_point: row.get("recovery_point"),
        lease_left: from_millis(lease_left_ms),
        lock_version: row.get("lock_version"),
        attempts: row.get("attempts"),
        last_error: row.get("last_error"),
        response,
    })
}

/// The `fingerprint` column, which the schema keeps at 32 bytes.
fn fingerprint_of(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    Fingerprint::from_slice(bytes)
        .ok_or_else(|| StoreError::Corrupt(format!("fingerprint of {} bytes", bytes.len())))
}

/// The `response_status`, `response_headers` and `response_body` columns of a done key, and
/// whether the body was in the row: when it is stored apart the body is left empty here.
fn stored_response(row: &PgRow) -> Result<(StoredResponse, bool), StoreError> {
    let status: i16 = row.get("response_status");
    let headers: sqlx::types::Json<Vec<(String, FieldValue)>> = row.get("response_headers");
    let status = u16::try_from(status)
        .map_err(|_| StoreError::Corrupt(format!("response status {status}")))?;
    let body: Option<Vec<u8>> = row.get("response_body");
    let in_row = body.is_some();
    Ok((
        StoredResponse {
            status,
            headers: headers.0,
            body: body.unwrap_or_default(),
        },
        in_row,
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::{ClaimRequest, Claimed, Limits, begin_claim, finish};

    /// Every column the look-up and the inspection read by name is there under that name: a new
    /// key, a claim in flight, a started key and a finished one.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_look_up_and_the_inspection_read_every_column_by_name(pool: sqlx::PgPool) {
        let tenant = TenantId::new("t-1").expect("tenant");
        let key = Key::parse("k").expect("key");
        let fingerprint = Fingerprint::from_slice(&[7; 32]).expect("fingerprint");
        let request = json!({"amount": 1});
        let mut connection = pool.acquire().await.expect("connection");
        let LookUp::Absent { lock_version, .. } = look_up(&mut connection, &tenant, &key)
            .await
            .expect("look-up")
        else {
            panic!("a new key is absent");
        };
        let claim = ClaimRequest {
            tenant: &tenant,
            key: &key,
            lock_version,
            fingerprint: &fingerprint,
            workflow: "w.v1",
            request: &request,
            lease: Duration::from_secs(30),
        };
        let claimer = pool.acquire().await.expect("connection");
        let Ok(Claimed::Owned(transaction, owner)) =
            begin_claim(claimer, &claim, &Limits::default()).await
        else {
            panic!("a new key is ours");
        };
        assert!(matches!(
            look_up(&mut connection, &tenant, &key).await,
            Ok(LookUp::Claiming)
        ));
        transaction.commit().await.expect("commit");

        let Ok(LookUp::Found(found)) = look_up(&mut connection, &tenant, &key).await else {
            panic!("a committed key is found");
        };
        assert!(found.fingerprint == fingerprint);
        assert_eq!(found.workflow, "w.v1");
        assert!(!found.done);
        assert!(found.lease_left > Duration::ZERO && found.lease_left <= Duration::from_secs(30));
        assert_eq!(found.lock_version, lock_version);
        assert!(found.response.is_none());
        let row = inspect(&mut connection, &tenant, &key)
            .await
            .expect("inspect")
            .expect("row");
        assert!(row.fingerprint == fingerprint);
        assert_eq!(row.workflow, "w.v1");
        assert!(!row.done);
        assert_eq!(row.recovery_point, "start");
        assert!(row.lease_left > Duration::ZERO && row.lease_left <= Duration::from_secs(30));
        assert_eq!(row.lock_version, lock_version);
        assert_eq!(row.attempts, 1);
        assert_eq!(row.last_error, None);
        assert!(row.response.is_none());

        let response = StoredResponse {
            status: 201,
            headers: vec![("content-type".to_owned(), "application/json".into())],
            body: b"{\"ok\":true}".to_vec(),
        };
        let mut transaction = crate::Transaction::begin(&pool).await.expect("begin");
        finish(&mut transaction, &owner, "last", &response, usize::MAX)
            .await
            .expect("finish");
        transaction.commit().await.expect("commit");
        let Ok(LookUp::Found(found)) = look_up(&mut connection, &tenant, &key).await else {
            panic!("a finished key is found");
        };
        assert!(found.done);
        assert_eq!(found.lease_left, Duration::ZERO);
        assert_eq!(found.response.as_ref(), Some(&response));
        let row = inspect(&mut connection, &tenant, &key)
            .await
            .expect("inspect")
            .expect("row");
        assert!(row.done);
        assert_eq!(row.recovery_point, "last");
        assert_eq!(row.lease_left, Duration::ZERO);
        assert_eq!(row.response, Some(response));
        assert!(
            inspect(&mut connection, &tenant, &Key::parse("other").expect("key"))
                .await
                .expect("inspect")
                .is_none()
        );
    }
}
