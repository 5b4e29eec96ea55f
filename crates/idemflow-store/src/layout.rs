//! The partitioned layout's plan and reports, whatever engine keeps one (PostgreSQL's
//! partitions of the keys table, by creation time): what retention's maintenance did
//! ([`Maintained`]) and what operators see ([`Partition`], [`Adopted`]).

use std::time::Duration;

/// How the partitioned layout cuts time: set once when the layout is adopted, kept in the table
/// `idempotency_partitioning`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionPlan {
    /// The range of `created_at` each partition holds, aligned on multiples of it since the Unix
    /// epoch (UTC). Default a day: with a 24-hour window, 3 partitions are live (yesterday's,
    /// today's and tomorrow's), and a look-up probes each, the empty one ahead included
    /// (docs/operations.md, "Choosing the layout").
    pub width: Duration,
    /// How many partitions exist ahead of the current one. A claim whose `created_at` no
    /// partition covers fails, so this is how long maintenance may stop before claims do.
    /// Default 1 (a day, at the default width): each costs every look-up a probe.
    pub ahead: u32,
}

impl Default for PartitionPlan {
    fn default() -> Self {
        Self {
            width: Duration::from_secs(24 * 60 * 60),
            ahead: 1,
        }
    }
}

impl PartitionPlan {
    /// The narrowest width: partitions are named to the millisecond.
    pub const MIN_WIDTH: Duration = Duration::from_millis(10);

    /// Why the layout cannot keep this plan, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if self.width < Self::MIN_WIDTH {
            return Err(format!(
                "a partition width of {:?} is below the narrowest, {:?}",
                self.width,
                Self::MIN_WIDTH
            ));
        }
        if self.ahead == 0 {
            return Err("at least one partition must exist ahead of the current one".to_owned());
        }
        Ok(())
    }
}

/// What adopting the partitioned layout did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Adopted {
    /// The partitions created: those the existing keys fall in, the current one and those ahead.
    pub partitions: usize,
    /// Keys copied into them.
    pub keys: u64,
}

/// One partition of the keys table.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Partition {
    /// The table's name, `idempotency_keys_p<start, UTC>`.
    pub name: String,
    /// The start of its `created_at` range, in ms since the Unix epoch (included).
    pub from_ms: i64,
    /// The end of its range, in ms since the Unix epoch (excluded).
    pub to_ms: i64,
    /// The start of its range, UTC, as `2026-12-01 18:00:00.000Z`.
    pub from: String,
    /// The end of its range, UTC.
    pub to: String,
    /// Detached concurrently but not finalized (an interrupted drop): the next maintenance
    /// finishes it.
    pub detaching: bool,
}

/// A partition maintenance dropped.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Dropped {
    /// Its name.
    pub name: String,
    /// The keys it held.
    pub keys: u64,
    /// The bodies stored apart deleted with them.
    pub bodies_apart: u64,
}

/// A partition past the window that maintenance kept because it holds started keys: they are
/// still being run (or nobody runs them: a workflow no resumer knows), and dropping them would
/// forget a request that has not answered. Alert on it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Kept {
    /// Its name.
    pub name: String,
    /// Its started keys.
    pub started_keys: u64,
}

/// What one maintenance run did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Maintained {
    /// Partitions created ahead of the clock.
    pub created: Vec<String>,
    /// Partitions dropped, with their keys.
    pub dropped: Vec<Dropped>,
    /// Partitions past the window kept for their started keys.
    pub kept: Vec<Kept>,
    /// Partitions that exist ahead of the current one after this run.
    pub ahead: u32,
    /// Another maintenance was running (on another worker): this one did nothing.
    pub skipped: bool,
}
