//! Who holds a key: [`KeyOwner`], what the runner reads of any engine's owner, and [`Owner`],
//! the owner of the SQL engines: the key, its fencing token and, where a token can be drawn
//! twice, the holder that tells two owners of one token apart.

use std::fmt::Debug;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use idemflow_core::{Key, TenantId};

/// The holder of a key's lease, as the runner reads it.
pub trait KeyOwner: Clone + Debug + Send + Sync + 'static {
    /// The tenant the key belongs to.
    fn tenant(&self) -> &TenantId;
    /// The key.
    fn key(&self) -> &Key;
    /// The fencing token the owner holds.
    fn lock_version(&self) -> i64;
}

/// The owner of a key: whoever holds its current fencing token. Every fenced write names it,
/// and updates nothing once another owner has taken the key over.
///
/// Made by an engine, from what a claim or a takeover committed: a fence is never a value a
/// caller writes. (One made by hand with a stale token is only fenced out by the database.)
///
/// Where the engine draws a token inside the claim's or takeover's transaction (MariaDB's fence
/// column, SQLite's fence row), a draw that rolls back is drawn again by the next taker: two
/// owners, one token. Writes stay fenced by the token alone, since an owner writes only in a
/// transaction it knows is its own (docs/ARCHITECTURE.md). But the one question asked of the row
/// itself, "did my uncommitted claim or takeover commit after all?", is answered by the token
/// *and* the holder, a random number each such claim or takeover writes beside its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    tenant: TenantId,
    key: Key,
    lock_version: i64,
    holder: i64,
}

impl Owner {
    /// The owner holding `lock_version` on (`tenant`, `key`), a token never drawn twice: for an
    /// engine's claim and takeover. Its holder is 0, the column's default.
    pub fn new(tenant: TenantId, key: Key, lock_version: i64) -> Self {
        Self::holding(tenant, key, lock_version, 0)
    }

    /// The owner holding `lock_version` on (`tenant`, `key`), written beside `holder` (drawn
    /// with [`fresh_holder`]): for a claim or takeover whose token can be drawn again.
    pub fn holding(tenant: TenantId, key: Key, lock_version: i64, holder: i64) -> Self {
        Self {
            tenant,
            key,
            lock_version,
            holder,
        }
    }

    /// Who, among the owners that drew this token, this one is (0: the token's only owner).
    pub fn holder(&self) -> i64 {
        self.holder
    }

    /// The tenant the key belongs to.
    pub fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    /// The idempotency key owned.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fencing token: every write of this owner is refused once the row holds another.
    pub fn lock_version(&self) -> i64 {
        self.lock_version
    }
}

impl KeyOwner for Owner {
    fn tenant(&self) -> &TenantId {
        &self.tenant
    }

    fn key(&self) -> &Key {
        &self.key
    }

    fn lock_version(&self) -> i64 {
        self.lock_version
    }
}

/// A holder for a new claim or takeover: random, positive, never 0 (the column's default, which
/// names the owner of a token never drawn twice). Two owners that drew one token are told apart
/// unless they draw the same 63 bits.
pub fn fresh_holder() -> i64 {
    // Each `RandomState` is keyed from the operating system's randomness (then stepped per
    // thread); the count makes two holders of one process differ whatever the keys.
    static DRAWN: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(DRAWN.fetch_add(1, Ordering::Relaxed));
    let bits = hasher.finish() >> 1;
    i64::try_from(bits).unwrap_or(i64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    #[test]
    fn holders_are_positive_and_differ() {
        let drawn: std::collections::HashSet<i64> =
            (0..10_000).map(|_| super::fresh_holder()).collect();
        assert_eq!(drawn.len(), 10_000);
        assert!(drawn.iter().all(|holder| *holder > 0));
    }
}
