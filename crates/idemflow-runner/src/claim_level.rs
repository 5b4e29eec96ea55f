//! The isolation level a new key's claim is made at. A claim shares the transaction of the
//! workflow's leading local phases, at their level, where the keys table's layout keeps the
//! claim's guarantee there. PostgreSQL's partitioned layout does not above Read Committed (its
//! uniqueness check needs a snapshot taken after the claim lock) and says so by refusing the
//! claim ([`idemflow_store::DatabaseErrorKind::ClaimLevelRefused`]). The layout is the database's
//! and may change under a running process (a table adopted into partitions), so the runner learns
//! it from that refusal rather than asking up front: from then on, such a claim is made at Read
//! Committed and committed alone, and the phases' transaction begins after it at their level, as
//! after a takeover (`drive::restart::settle_level`). The refused claim wrote nothing; its request
//! looks its key up again.

use std::sync::atomic::{AtomicBool, Ordering};

use idemflow_store::{Isolation, Limits};

/// What this runner has learnt of the layout's claim level.
#[derive(Debug, Default)]
pub(crate) struct ClaimLevel {
    /// A claim above Read Committed was refused: claim at Read Committed from now on.
    read_committed_only: AtomicBool,
}

impl ClaimLevel {
    /// The limits to claim under, for leading phases that run under `leading`.
    pub(crate) fn claim_limits(&self, leading: &Limits) -> Limits {
        if leading.isolation != Isolation::ReadCommitted
            && self.read_committed_only.load(Ordering::Relaxed)
        {
            leading.with_isolation(Isolation::ReadCommitted)
        } else {
            *leading
        }
    }

    /// The layout refused a claim above Read Committed.
    pub(crate) fn refused(&self) {
        if !self.read_committed_only.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "the keys table claims at Read Committed only (a partitioned layout): a claim \
                 whose leading local phases declare a stronger level now commits alone first"
            );
        }
    }
}
