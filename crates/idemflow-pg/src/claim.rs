//! The claim of a new key, sent in the same message as the `BEGIN` of its transaction.
//!
//! A new request's first transaction is `BEGIN`, the claim, the leading local phases, and the
//! commit. Sent one by one, `BEGIN` costs a round trip of its own; here it shares one with the
//! claim: the message is `BEGIN; SELECT pg_advisory_xact_lock(…); INSERT …` in PostgreSQL's
//! simple query protocol, which takes no bind parameters, so the values travel as hex literals
//! (`decode('…', 'hex')`): only the digits 0-9a-f and integers this module formats ever enter the
//! SQL text, whatever the key, tenant or request holds.
//!
//! The insert has no `ON CONFLICT`: losing the race for a key is an error (unique violation) that
//! aborts the transaction, and [`Transaction`] rolls it back and hands the connection back. The
//! caller then looks the key up again and answers from the winner's row.
//!
//! The advisory lock (on a 64-bit hash of tenant and key, held until the claim's transaction
//! ends) is what lets [`crate::look_up`] tell "no such key" from "being claimed right now"
//! without waiting: a concurrent duplicate gets its 409 from one statement.

use std::fmt::Write;

use sha2::{Digest, Sha256};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Postgres, SqlSafeStr};

use idemflow_core::{Key, TenantId};

use crate::store::{ClaimRequest, Owner, StoreError};
use crate::transaction::Transaction;

/// The lock_version a freshly claimed key starts at (the column's default).
const FIRST_LOCK_VERSION: i64 = 0;

/// What [`begin_claim`] did.
#[derive(Debug)]
pub enum Claimed {
    /// The key is ours: the transaction holds the uncommitted claim (and its advisory lock).
    Owned(Transaction, Owner),
    /// Another request's claim of this key committed first. Nothing was written; the connection
    /// is idle and ready for the look-up that finds the winner's row.
    Lost(PoolConnection<Postgres>),
}

/// Begins a transaction holding the claim of a new key, in one round trip.
pub async fn begin_claim(
    connection: PoolConnection<Postgres>,
    claim: &ClaimRequest<'_>,
) -> Result<Claimed, StoreError> {
    let statement = AssertSqlSafe(claim_statement(claim)).into_sql_str();
    match Transaction::begin_with(connection, Some(statement)).await {
        Ok(transaction) => Ok(Claimed::Owned(
            transaction,
            Owner {
                tenant: claim.tenant.clone(),
                key: claim.key.clone(),
                lock_version: FIRST_LOCK_VERSION,
            },
        )),
        Err((error, connection)) if is_claim_conflict(&error) => Ok(Claimed::Lost(connection)),
        Err((error, _connection)) => Err(StoreError::Database(error)),
    }
}

fn is_claim_conflict(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(error) => {
            error.code().as_deref() == Some("23505")
                && error.constraint() == Some("idempotency_keys_pkey")
        }
        _ => false,
    }
}

/// The advisory lock a claim holds until its transaction ends: the first 8 bytes of
/// SHA-256("idemflow claim", tenant, key). Two keys sharing a hash would only see each other's
/// claims as in flight (a 409 the client retries), never each other's rows.
pub(crate) fn claim_lock(tenant: &TenantId, key: &Key) -> i64 {
    let mut hash = Sha256::new();
    hash.update(b"idemflow claim\0");
    hash.update(tenant.as_str().as_bytes());
    hash.update(b"\0");
    hash.update(key.as_str().as_bytes());
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    i64::from_be_bytes(first)
}

/// `BEGIN; SELECT pg_advisory_xact_lock(…); INSERT …` with every value as a hex literal.
fn claim_statement(claim: &ClaimRequest<'_>) -> String {
    let request = serde_json::to_string(claim.request).unwrap_or_else(|_| "null".to_owned());
    let lease_ms = i64::try_from(claim.lease.as_millis()).unwrap_or(i64::MAX);
    let mut sql = String::with_capacity(256 + 2 * request.len());
    let _ = write!(
        sql,
        "BEGIN; SELECT pg_advisory_xact_lock({}); \
         INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, locked_until) \
         VALUES (",
        claim_lock(claim.tenant, claim.key)
    );
    text_literal(&mut sql, claim.tenant.as_str());
    sql.push_str(", ");
    text_literal(&mut sql, claim.key.as_str());
    sql.push_str(", ");
    bytes_literal(&mut sql, claim.fingerprint.as_bytes());
    sql.push_str(", ");
    text_literal(&mut sql, claim.workflow);
    sql.push_str(", ");
    text_literal(&mut sql, &request);
    let _ = write!(
        sql,
        "::jsonb, now() + {lease_ms} * interval '1 millisecond')"
    );
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
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    sql.push_str("decode('");
    sql.reserve(bytes.len() * 2 + 9);
    for byte in bytes {
        sql.push(char::from(DIGITS[usize::from(byte >> 4)]));
        sql.push(char::from(DIGITS[usize::from(byte & 0x0f)]));
    }
    sql.push_str("', 'hex')");
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idemflow_core::Fingerprint;
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
            fingerprint: &fingerprint,
            workflow: "checkout'v1",
            request: &request,
            lease: Duration::from_millis(30_000),
        };
        let sql = claim_statement(&claim);
        // Every quoted span is hex digits or one of the fixed words.
        let quoted: Vec<&str> = sql.split('\'').skip(1).step_by(2).collect();
        for span in &quoted {
            assert!(
                span.bytes().all(|b| b.is_ascii_hexdigit())
                    || ["hex", "UTF8", "1 millisecond"].contains(span),
                "unexpected literal {span:?} in {sql}"
            );
        }
        assert!(!sql.contains("DROP"));
        assert!(sql.contains("30000 * interval"));
    }

    #[test]
    fn claim_lock_depends_on_tenant_and_key() {
        let a = TenantId::new("a").expect("tenant");
        let b = TenantId::new("b").expect("tenant");
        let k = Key::parse("k").expect("key");
        assert_ne!(claim_lock(&a, &k), claim_lock(&b, &k));
        assert_eq!(claim_lock(&a, &k), claim_lock(&a, &k));
    }
}
