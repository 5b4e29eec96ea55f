//! [`Owner`]: who may write a started key, named by its fencing token.

use idemflow_core::{Key, TenantId};

/// The holder of a key's lease: every fenced write names its token, and updates nothing once
/// another owner has taken the key over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    tenant: TenantId,
    key: Key,
    lock_version: i64,
}

impl Owner {
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

    /// The key owned.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fencing token this owner holds.
    pub fn lock_version(&self) -> i64 {
        self.lock_version
    }
}
