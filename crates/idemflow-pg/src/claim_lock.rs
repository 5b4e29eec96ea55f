//! [`claim_lock`]: the advisory lock id of a key, shared by the claim, the look-up and the
//! takeover because it is how each learns, without waiting, that another request is writing the
//! key right now.
//!
//! - The claim ([`crate::begin_claim`]) takes `pg_advisory_xact_lock` on it, exclusive, in the
//!   statement that inserts the row: held until the claim's transaction ends, while its row is
//!   still invisible to everyone else.
//! - The look-up ([`look_up`](fn@crate::look_up)) runs outside any transaction, and when its
//!   snapshot holds no row for the key it tries `pg_try_advisory_xact_lock_shared` on the same
//!   id, in the same statement. The try never waits: it fails only while a claim's transaction
//!   holds the lock, and then the answer is [`crate::LookUp::Claiming`], so a duplicate of a
//!   claim in flight is told "being claimed" (409) at once rather than queueing behind the
//!   claim's local phases. When it succeeds, the shared lock lasts only as long as the look-up's
//!   own statement, and look-ups never block each other (shared against shared).
//! - The takeover ([`take_over`](fn@crate::take_over)) tries the lock exclusive
//!   (`pg_try_advisory_xact_lock`) for its transaction, so a second takeover of the same key
//!   while the first is uncommitted gets `None` at once instead of waiting on the row lock.
//!
//! - A failure record after an abandoned transaction ([`wait_for_claim_lock`]) waits for it,
//!   bounded: the abandoned session may still hold it while its last statement runs.
//!
//! All must compute the same id, hence one function in a module of its own.

use std::time::Duration;

use idemflow_core::{Key, TenantId};
use sha2::{Digest, Sha256};
use sqlx::{AssertSqlSafe, PgConnection};

use crate::error::StoreError;
use crate::millis::millis;

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

/// Waits at most `wait` for the key's claim lock and holds it until the transaction ends: `false`
/// when the wait ran out (the transaction is then aborted, and must be rolled back).
///
/// For the record of an attempt whose transaction was abandoned past its time limit: the client
/// closed that connection, but the server does not notice while a statement runs, so the session
/// lives on, holding the uncommitted takeover (its row lock and this lock), until its statement
/// ends, which its `statement_timeout` bounds. Trying the lock, as a takeover does, fails all that
/// time, and the attempt would go unrecorded. One message: the two limits (integers formatted
/// here) and the lock, so the wait is the server's, and holding the lock lets the takeover's own
/// try succeed (advisory locks are re-entrant within a session).
pub async fn wait_for_claim_lock(
    connection: &mut PgConnection,
    tenant: &TenantId,
    key: &Key,
    wait: Duration,
) -> Result<bool, StoreError> {
    let wait_ms = millis(wait).clamp(1, i64::from(i32::MAX));
    let sql = format!(
        "SET LOCAL lock_timeout = {wait_ms}; SET LOCAL statement_timeout = {}; \
         SELECT pg_advisory_xact_lock({})",
        wait_ms.saturating_mul(2).min(i64::from(i32::MAX)),
        claim_lock(tenant, key)
    );
    match sqlx::raw_sql(AssertSqlSafe(sql)).execute(connection).await {
        Ok(_) => Ok(true),
        // lock_not_available: the lock_timeout ran out.
        Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("55P03") => Ok(false),
        Err(error) => Err(StoreError::Database(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_lock_depends_on_tenant_and_key() {
        let a = TenantId::new("a").expect("tenant");
        let b = TenantId::new("b").expect("tenant");
        let k = Key::parse("k").expect("key");
        assert_ne!(claim_lock(&a, &k), claim_lock(&b, &k));
        assert_eq!(claim_lock(&a, &k), claim_lock(&a, &k));
    }

    /// The wait is bounded by the server (lock_timeout): past it, `false`, not an error; once the
    /// holder's transaction ends, the lock is taken and held.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn waiting_for_the_claim_lock_is_bounded(pool: sqlx::PgPool) {
        let (tenant, key) = (
            TenantId::new("t").expect("tenant"),
            Key::parse("k").expect("key"),
        );
        let mut holder = pool.begin().await.expect("holder");
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(claim_lock(&tenant, &key))
            .execute(&mut *holder)
            .await
            .expect("hold");
        let mut waiter = pool.begin().await.expect("waiter");
        let wait = Duration::from_millis(100);
        let got = wait_for_claim_lock(&mut waiter, &tenant, &key, wait).await;
        assert!(matches!(got, Ok(false)), "{got:?}");
        waiter.rollback().await.expect("rollback");
        holder.rollback().await.expect("let go");
        let mut waiter = pool.begin().await.expect("waiter");
        let got = wait_for_claim_lock(&mut waiter, &tenant, &key, wait).await;
        assert!(matches!(got, Ok(true)), "{got:?}");
    }
}
