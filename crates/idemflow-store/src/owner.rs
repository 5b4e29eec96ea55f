//! Who holds a key: [`KeyOwner`], what the runner reads of any engine's owner, and [`Owner`],
//! the owner of the engines that need nothing more than the key and its fencing token.

use std::fmt::Debug;

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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    tenant: TenantId,
    key: Key,
    lock_version: i64,
}

impl Owner {
    /// The owner holding `lock_version` on (`tenant`, `key`): for an engine's claim and takeover.
    pub fn new(tenant: TenantId, key: Key, lock_version: i64) -> Self {
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
