//! What an operator's console reads beyond one key's report, whatever the engine: a page of keys
//! in key order ([`ScanFrom`], read by each engine's `scan_keys`) and the table's overview
//! ([`Overview`]).
//!
//! Both are bounded reads on an index: a scan walks the primary key `(tenant, key)` from a
//! position and stops after a set number of rows, and the overview reads only started keys (the
//! started-lease index) and keys finished in the last quarter hour (the finished index). Neither
//! counts the whole table, so both stay as cheap on a table of millions of keys as on a small one.

/// Where a scan of keys in `(tenant, key)` order starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanFrom {
    /// Only this tenant's keys, when given; otherwise every tenant's, in tenant order.
    pub tenant: Option<String>,
    /// The position: the `(tenant, key)` the scan starts at or after. With `tenant`, only the key
    /// counts (the scan stays in that tenant's keys); without, an empty tenant starts at the
    /// table's first key (a tenant is never empty).
    pub after: (String, String),
    /// Whether the position itself is included (a key prefix's first key) or not (the last
    /// key of the previous page).
    pub inclusive: bool,
}

/// Started keys of one workflow.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct StartedKeys {
    /// The workflow's name.
    pub workflow: String,
    /// Its started keys.
    pub keys: i64,
    /// Of those, the ones whose lease is over: due to be taken over.
    pub due: i64,
}

/// The table at a glance, from its indexes only.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Overview {
    /// Started keys by workflow, ordered by workflow.
    pub started: Vec<StartedKeys>,
    /// Age in whole seconds of the oldest started key.
    pub oldest_started_seconds: Option<i64>,
    /// Milliseconds since the oldest ended lease of a started key ended (0: none is due).
    pub resumer_lag_ms: i64,
    /// Keys finished in the last minute.
    pub finished_last_minute: i64,
    /// Keys finished in the last 15 minutes.
    pub finished_last_15_minutes: i64,
    /// The database's estimate of the table's rows, where it keeps one (PostgreSQL's and
    /// MariaDB's statistics; SQLite keeps none).
    pub estimated_keys: Option<i64>,
}
