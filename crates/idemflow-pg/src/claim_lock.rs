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
//! All three must compute the same id, hence one function in a module of its own.

use idemflow_core::{Key, TenantId};
use sha2::{Digest, Sha256};

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
}
