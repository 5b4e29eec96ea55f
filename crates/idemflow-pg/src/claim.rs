//! The claim of a new key ([`begin_claim`], storing a [`ClaimRequest`]), sent in the same
//! message as the `BEGIN` of its transaction.
//!
//! A new request's first transaction is `BEGIN`, the claim, the leading local phases, and the
//! commit. Sent one by one, `BEGIN` costs a round trip of its own; here it shares one with the
//! claim: the message is `BEGIN; EXECUTE idemflow_claim_v4(…)` in PostgreSQL's simple query
//! protocol. That protocol takes no bind parameters, so the values travel as hex literals
//! (`decode('…', 'hex')`): only the digits 0-9a-f and integers this module formats ever enter the
//! SQL text, whatever the key, tenant or request holds.
//!
//! The claim itself is a function of the schema, `idemflow_claim` (its one definition is the
//! migration `claim_function`, [`statements::DEFINE_CLAIM`]): it takes the key's advisory lock
//! and inserts the key's row. `idemflow_claim_v4` is a prepared statement of the connection (SQL
//! `PREPARE`) calling it, so the server parses and plans the call once per connection. The
//! look-up says whether the connection holds it; where it does not, the claim's message prepares
//! it first ([`begin_claim_knowing`]), so a new connection's first claim fails no message (each
//! failure is an `ERROR` line in the server's log). A claim that was not told ([`begin_claim`])
//! finds out: on a connection without it the message fails with "prepared statement does not
//! exist", is rolled back, and goes again after a `PREPARE`. Where it cannot stick (a pooler that
//! hands each transaction another server connection), the claim calls the function by name.
//!
//! Losing the race for a key is an error (unique violation) that aborts the transaction, and
//! [`Transaction`] rolls it back and hands the connection back. The caller then looks the key up
//! again and answers from the winner's row. The error is the only way the message can say "lost"
//! (its `BEGIN` returns no results), so the function raises it without an `ERROR` line in the
//! server's log where its owner may set `log_min_messages` (the migration says how; an operator
//! who alerts on `ERROR` lines is not paged for a request that was served correctly).
//!
//! The advisory lock ([`crate::claim_lock`]: on a 64-bit hash of tenant and key, held until the
//! claim's transaction ends) is what lets [`look_up`](fn@crate::look_up) tell "no such key" from
//! "being claimed right now" without waiting: a concurrent duplicate gets its 409 from one
//! statement.
//!
//! The message can also carry the transaction's [`Limits`] (`SET LOCAL …`), still in one round
//! trip.

use crate::statements;
use std::fmt::Write;
use std::time::Duration;

use serde_json::Value;
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr};

use idemflow_core::{Fingerprint, Key, TenantId};

use crate::claim_lock::claim_lock;
use crate::error::StoreError;
use crate::millis::millis;
use crate::transaction::Transaction;
use idemflow_store::Limits;
use idemflow_store::Owner;

/// Everything a claim stores.
#[derive(Debug)]
pub struct ClaimRequest<'a> {
    /// The tenant the key belongs to.
    pub tenant: &'a TenantId,
    /// The idempotency key claimed.
    pub key: &'a Key,
    /// The claim's fencing token, drawn by the look-up that found the key absent
    /// ([`crate::LookUp::Absent`]): unique, so no owner of an earlier life of this key holds it.
    pub lock_version: i64,
    /// The request's fingerprint: a later request with the same key and another fingerprint is
    /// refused.
    pub fingerprint: &'a Fingerprint,
    /// The name (and version) of the workflow that runs the key: a resumer finds it by this name.
    pub workflow: &'a str,
    /// The workflow's input, stored so a resumer in another process can run the key from its
    /// first phase.
    pub request: &'a Value,
    /// How long the claim's lease lasts, from the insert, by the database clock; only the owner
    /// may advance the key before it ends. Stored in whole milliseconds (rounded down).
    pub lease: Duration,
}

/// What [`begin_claim`] did.
#[derive(Debug)]
pub enum Claimed {
    /// The key is ours: the transaction holds the uncommitted claim (and its advisory lock).
    Owned(Transaction, Owner),
    /// Another request's claim of this key committed first. Nothing was written; the connection
    /// is idle and ready for the look-up that finds the winner's row.
    Lost(PoolConnection<Postgres>),
}

/// Begins a transaction holding the claim of a new key, in one round trip, under `limits`.
pub async fn begin_claim(
    connection: PoolConnection<Postgres>,
    claim: &ClaimRequest<'_>,
    limits: &Limits,
) -> Result<Claimed, StoreError> {
    begin_claim_in(
        connection,
        claim,
        limits,
        &[Form::Prepared, Form::Prepared, Form::Inline],
    )
    .await
}

/// [`begin_claim`] on the connection whose look-up said whether it holds the prepared claim
/// ([`crate::LookUp::Absent`]'s `claim_prepared`): one that does not prepares it in the claim's
/// own message, so a new connection's first claim costs no failed message (and no ERROR line in
/// the server's log) and no round trip more.
pub async fn begin_claim_knowing(
    connection: PoolConnection<Postgres>,
    claim: &ClaimRequest<'_>,
    limits: &Limits,
    claim_prepared: bool,
) -> Result<Claimed, StoreError> {
    let forms: &[Form] = if claim_prepared {
        &[Form::Prepared, Form::Prepared, Form::Inline]
    } else {
        &[Form::PrepareFirst, Form::Prepared, Form::Inline]
    };
    begin_claim_in(connection, claim, limits, forms).await
}

/// Tries the claim's message in each form in turn, going on to the next only when the prepared
/// statement is missing.
async fn begin_claim_in(
    connection: PoolConnection<Postgres>,
    claim: &ClaimRequest<'_>,
    limits: &Limits,
    forms: &[Form],
) -> Result<Claimed, StoreError> {
    let mut connection = connection;
    let mut last_error = None;
    for &form in forms {
        let statement = AssertSqlSafe(claim_statement(claim, limits, form)).into_sql_str();
        match Transaction::begin_with(connection, statement).await {
            Ok(transaction) => {
                return Ok(Claimed::Owned(
                    transaction,
                    Owner::new(claim.tenant.clone(), claim.key.clone(), claim.lock_version),
                ));
            }
            Err((error, returned)) if is_claim_conflict(&error) => {
                return Ok(Claimed::Lost(returned));
            }
            // Prepared after all (behind a pooler, the look-up may have asked another server
            // connection): the message was rolled back; execute it as prepared.
            Err((error, returned)) if form == Form::PrepareFirst && has_code(&error, "42P05") => {
                connection = returned;
                last_error = Some(error);
            }
            Err((error, mut returned)) if form == Form::Prepared && is_unprepared(&error) => {
                // A new connection (or one whose statements were discarded): prepare, go again.
                // "Already exists" means it exists on some other server connection (a pooler):
                // the next form will tell.
                match sqlx::Executor::execute(&mut *returned, statements::PREPARE_CLAIM).await {
                    Ok(_) => {}
                    Err(error) if has_code(&error, "42P05") => {}
                    Err(error) => return Err(StoreError::Database(error)),
                }
                connection = returned;
                last_error = Some(error);
            }
            Err((error, _returned)) => return Err(StoreError::Database(error)),
        }
    }
    Err(StoreError::Database(last_error.unwrap_or_else(|| {
        sqlx::Error::Protocol("the claim was tried in no form".to_owned())
    })))
}

/// How the claim's message carries the insert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    /// `EXECUTE idemflow_claim_v4(…)`.
    Prepared,
    /// `PREPARE idemflow_claim_v4 … ; EXECUTE idemflow_claim_v4(…)`: on a connection without it.
    PrepareFirst,
    /// The claim's function called by name.
    Inline,
}

fn is_claim_conflict(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(error) => {
            (error.code().as_deref() == Some("23505")
                && error.constraint() == Some("idempotency_keys_pkey"))
                // A claim at Serializable that meets a row of its key committed after its
                // snapshot is refused as a serialization failure, not a unique violation
                // (docs/protocol.md, "A local phase at a stronger level"): nothing was written,
                // and looking again finds the row, or an absent key to claim anew.
                || error.code().as_deref() == Some("40001")
        }
        _ => false,
    }
}

/// "prepared statement does not exist" (invalid_sql_statement_name).
fn is_unprepared(error: &sqlx::Error) -> bool {
    has_code(error, "26000")
}

fn has_code(error: &sqlx::Error, code: &str) -> bool {
    matches!(error, sqlx::Error::Database(error) if error.code().as_deref() == Some(code))
}

/// `BEGIN; [SET LOCAL …;] EXECUTE idemflow_claim_v4(…); SAVEPOINT idemflow_claimed` (or the claim's
/// function called by name), every value a hex literal or an integer formatted here.
fn claim_statement(claim: &ClaimRequest<'_>, limits: &Limits, form: Form) -> String {
    let request = serde_json::to_string(claim.request).unwrap_or_else(|_| "null".to_owned());
    let lease_ms = millis(claim.lease);
    let lock = claim_lock(claim.tenant, claim.key);
    let token = claim.lock_version;
    let mut sql = crate::transaction::begin_statement(limits);
    sql.reserve(320 + 2 * request.len());
    match form {
        Form::Prepared | Form::PrepareFirst => {
            if form == Form::PrepareFirst {
                let _ = write!(sql, "; {}", statements::PREPARE_CLAIM);
            }
            let _ = write!(sql, "; EXECUTE {}({lock}, ", statements::CLAIM_NAME);
        }
        Form::Inline => {
            let _ = write!(sql, "; SELECT {}({lock}, ", statements::CLAIM_FUNCTION);
        }
    }
    text_literal(&mut sql, claim.tenant.as_str());
    sql.push_str(", ");
    text_literal(&mut sql, claim.key.as_str());
    sql.push_str(", ");
    bytes_literal(&mut sql, claim.fingerprint.as_bytes());
    sql.push_str(", ");
    text_literal(&mut sql, claim.workflow);
    sql.push_str(", ");
    text_literal(&mut sql, &request);
    let _ = write!(sql, "::jsonb, {lease_ms}, {token})");
    let _ = write!(sql, "; {}", statements::CLAIMED_SAVEPOINT);
    sql
}

/// `convert_from(decode('<hex>', 'hex'), 'UTF8')`: text whose bytes never reach the SQL parser.
fn text_literal(sql: &mut String, text: &str) {
    sql.push_str("convert_from(");
    bytes_literal(sql, text.as_bytes());
    sql.push_str(", 'UTF8')");
}

/// `decode('<hex>', 'hex')`.
fn bytes_literal(sql: &mut String, bytes: &[u8]) {
    sql.push_str("decode('");
    idemflow_core::hex::encode_into(sql, bytes);
    sql.push_str("', 'hex')");
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn no_caller_text_reaches_the_sql() {
        let tenant = TenantId::new("t-1").expect("tenant");
        let key = Key::parse("k'; DROP TABLE x; --\\\"$$").expect("key");
        let fingerprint = Fingerprint::from_slice(&[0xab; 32]).expect("fingerprint");
        let request = json!({"note": "it's $$ \\ ' \u{e9}"});
        let claim = ClaimRequest {
            tenant: &tenant,
            key: &key,
            lock_version: 4_294_967_296,
            fingerprint: &fingerprint,
            workflow: "checkout'v1",
            request: &request,
            lease: Duration::from_millis(30_000),
        };
        let limits = Limits::default()
            .with_statement_timeout(Some(Duration::from_millis(1500)))
            .with_idle_timeout(Some(Duration::from_secs(2)));
        for form in [Form::Prepared, Form::PrepareFirst, Form::Inline] {
            let sql = claim_statement(&claim, &limits, form);
            // Every quoted span is hex digits or one of the fixed words.
            let quoted: Vec<&str> = sql.split('\'').skip(1).step_by(2).collect();
            for span in &quoted {
                assert!(
                    span.bytes().all(|b| b.is_ascii_hexdigit())
                        || ["hex", "UTF8", "open"].contains(span),
                    "unexpected literal {span:?} in {sql}"
                );
            }
            assert!(!sql.contains("DROP"));
            assert!(sql.contains("30000"));
            assert!(sql.contains("4294967296"));
            assert!(sql.starts_with(
                "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL idemflow.transaction = 'open'; \
                 SET LOCAL statement_timeout = 1500; \
                 SET LOCAL idle_in_transaction_session_timeout = 2000; "
            ));
        }
    }

    /// The fallback where the prepared statement cannot stick: the claim's function called by
    /// name claims the same way (the prepared form is what every other test exercises).
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn the_inline_form_claims_and_loses_like_the_prepared_one(pool: sqlx::PgPool) {
        let tenant = TenantId::new("t-1").expect("tenant");
        let key = Key::parse("k").expect("key");
        let fingerprint = Fingerprint::from_slice(&[3; 32]).expect("fingerprint");
        let request = json!({"amount": 1});
        let claim = ClaimRequest {
            tenant: &tenant,
            key: &key,
            lock_version: 4_294_967_296,
            fingerprint: &fingerprint,
            workflow: "w.v1",
            request: &request,
            lease: Duration::from_secs(30),
        };
        let limits = Limits::default();
        let connection = pool.acquire().await.expect("connection");
        let Ok(Claimed::Owned(transaction, owner)) =
            begin_claim_in(connection, &claim, &limits, &[Form::Inline]).await
        else {
            panic!("a new key is ours");
        };
        assert_eq!(owner.lock_version(), claim.lock_version);
        transaction.commit().await.expect("commit");
        let connection = pool.acquire().await.expect("connection");
        assert!(matches!(
            begin_claim_in(connection, &claim, &limits, &[Form::Inline]).await,
            Ok(Claimed::Lost(_))
        ));
        let stored: (Vec<u8>, serde_json::Value, serde_json::Value) =
            sqlx::query_as("SELECT fingerprint, request, journal FROM idempotency_keys")
                .fetch_one(&pool)
                .await
                .expect("row");
        assert_eq!((&stored.0, &stored.1), (&vec![3; 32], &request));
        // The journal starts with the claim, as the prepared form's does.
        let [claimed] = stored.2.as_array().expect("an array").as_slice() else {
            panic!("one entry: {}", stored.2);
        };
        assert_eq!(claimed["event"], "claimed");
        assert_eq!(claimed["token"], claim.lock_version);
        assert!(
            claimed["at"]
                .as_i64()
                .is_some_and(|at| at > 1_700_000_000_000)
        );
    }
}
