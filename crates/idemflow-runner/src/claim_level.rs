//! The isolation level a new key's claim is made at. A claim shares the transaction of the
//! workflow's leading local phases, at their level, where the keys table's layout keeps the
//! claim's guarantee there. PostgreSQL's partitioned layout does not above Read Committed (its
//! uniqueness check needs a snapshot taken after the claim lock). A runner asks the engine once,
//! before its first claim above Read Committed (`Engine::claims_at_read_committed_only`); and as
//! the layout may change under a running process (a table adopted into partitions), a claim the
//! layout refuses ([`idemflow_store::DatabaseErrorKind::ClaimLevelRefused`], nothing written, its
//! request looks its key up again) teaches it too. Where the layout needs it, such a claim is made
//! at Read Committed and committed alone, and the phases' transaction begins after it at their
//! level, as after a takeover (`drive::restart::settle_level`).

use std::sync::atomic::{AtomicU8, Ordering};

use idemflow_store::{Isolation, Limits};

/// Not asked yet.
const UNKNOWN: u8 = 0;
/// The claim shares its phases' transaction at any level.
const SHARES: u8 = 1;
/// The claim is made at Read Committed only.
const READ_COMMITTED_ONLY: u8 = 2;

/// What this runner (and its clones) knows of the layout's claim level.
#[derive(Debug, Default)]
pub(crate) struct ClaimLevel(AtomicU8);

impl ClaimLevel {
    /// Whether a claim for leading phases under `leading` must ask the engine first.
    pub(crate) fn unknown_for(&self, leading: &Limits) -> bool {
        leading.isolation != Isolation::ReadCommitted && self.0.load(Ordering::Relaxed) == UNKNOWN
    }

    /// What the engine answered: whether the layout claims at Read Committed only.
    pub(crate) fn learnt(&self, read_committed_only: bool) {
        if read_committed_only {
            self.refused();
        } else {
            // A refusal learnt meanwhile stands.
            let _ = self
                .0
                .compare_exchange(UNKNOWN, SHARES, Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The limits to claim under, for leading phases that run under `leading`.
    pub(crate) fn claim_limits(&self, leading: &Limits) -> Limits {
        if leading.isolation != Isolation::ReadCommitted
            && self.0.load(Ordering::Relaxed) == READ_COMMITTED_ONLY
        {
            leading.with_isolation(Isolation::ReadCommitted)
        } else {
            *leading
        }
    }

    /// The layout claims at Read Committed only: said by the engine, or by a refused claim.
    pub(crate) fn refused(&self) {
        if self.0.swap(READ_COMMITTED_ONLY, Ordering::Relaxed) != READ_COMMITTED_ONLY {
            tracing::info!(
                "the keys table claims at Read Committed only (a partitioned layout): a claim \
                 whose leading local phases declare a stronger level commits alone first"
            );
        }
    }
}
