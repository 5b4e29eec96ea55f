//! [`Owner`]: the key and fencing token every fenced write names. Only the store makes one (a
//! claim or a takeover that committed its token), so a caller can hold a fence but never forge
//! one.

use idemflow_core::{Key, TenantId};

/// The owner of a key: whoever holds its current fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    tenant: TenantId,
    key: Key,
    lock_version: i64,
}

impl Owner {
    /// Only the store makes owners: a fence is what a claim or a takeover committed, never a
    /// value a caller writes.
    pub(crate) fn new(tenant: TenantId, key: Key, lock_version: i64) -> Self {
        Self {
            tenant,
            key,
            lock_version,
        }
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
