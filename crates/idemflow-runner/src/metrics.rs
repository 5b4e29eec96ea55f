//! The metrics the engine records, through the `metrics` facade: whichever recorder the
//! application installs (Prometheus, StatsD, none) receives them. Names are documented in
//! docs/operations.md.

use std::sync::Once;
use std::time::Duration;

use metrics::Unit;

/// Every metric the engine records: name, kind, unit, meaning. Given to the recorder as
/// descriptions (Prometheus prints them as `# HELP`), and kept equal to docs/operations.md's
/// table by a test.
pub const CATALOGUE: &[(&str, &str, &str)] = &[
    (CLAIMS, "counter", "New requests that won their key."),
    (
        REPLAYS,
        "counter",
        "Retries answered with the stored response.",
    ),
    (
        CONFLICTS,
        "counter",
        "Requests answered 409: the key was in progress.",
    ),
    (
        MISMATCHES,
        "counter",
        "Requests answered 422: the key was used for another request.",
    ),
    (
        REJECTIONS,
        "counter",
        "Requests rejected before execution (nothing stored).",
    ),
    (
        TAKEOVERS,
        "counter",
        "Expired leases taken over, by a client retry or a resumer.",
    ),
    (
        FENCED,
        "counter",
        "Writes refused because the owner had lost the key.",
    ),
    (RETRIES, "counter", "Failed attempts that will be retried."),
    (
        RESTARTS,
        "counter",
        "Transactions run again at once after a serialization failure or a deadlock (not attempts).",
    ),
    (
        GIVE_UPS,
        "counter",
        "Keys whose retries ran out (the failure path ran).",
    ),
    (FINISHED, "counter", "Keys that stored their response."),
    (
        NOT_EXECUTED,
        "counter",
        "Keys deleted because their first phase said it did nothing.",
    ),
    (
        TRANSACTIONS_ENDED,
        "counter",
        "Keys ended with a stored 500 because a local phase ended the runner's transaction.",
    ),
    (
        "idemflow_phase_duration_seconds",
        "histogram",
        "Time in each phase, in seconds.",
    ),
    (
        "idemflow_resume_duration_seconds",
        "histogram",
        "Time to finish a resumed key, in seconds.",
    ),
    (
        "idemflow_resume_errors_total",
        "counter",
        "Resumed keys that failed with a database or fencing error.",
    ),
    (
        "idemflow_resumer_errors_total",
        "counter",
        "Resumer scans that failed.",
    ),
    (
        "idemflow_resumer_lag_seconds",
        "gauge",
        "Age of the oldest expired lease of a started key, in seconds.",
    ),
    (
        "idemflow_resumer_unknown_workflow_keys",
        "gauge",
        "Due keys of workflows no resumer here has registered.",
    ),
    (
        "idemflow_expired_total",
        "counter",
        "Finished keys deleted by retention (on the partitioned layout: the keys of the partitions it dropped).",
    ),
    (
        "idemflow_partitions_dropped_total",
        "counter",
        "Partitions of the keys table dropped by retention, every key in them past its window (partitioned layout).",
    ),
    (
        "idemflow_partitions_kept_for_started_keys",
        "gauge",
        "Partitions past the retention window kept because they hold started keys, at the last retention run: alert when above 0 (partitioned layout).",
    ),
    (
        "idemflow_partitions_ahead",
        "gauge",
        "Partitions of the keys table that exist ahead of the current one, at the last retention run: claims fail once none is left (partitioned layout).",
    ),
];

static DESCRIBED: Once = Once::new();

/// Describes every metric to the installed recorder (unit and meaning: Prometheus's `# HELP`).
/// [`crate::Runner::new`] calls it once; call it yourself if the recorder is installed later.
pub fn describe_metrics() {
    for &(name, kind, help) in CATALOGUE {
        let unit = if name.ends_with("_seconds") {
            Unit::Seconds
        } else {
            Unit::Count
        };
        match kind {
            "histogram" => metrics::describe_histogram!(name, unit, help),
            "gauge" => metrics::describe_gauge!(name, unit, help),
            _ => metrics::describe_counter!(name, unit, help),
        }
    }
}

/// [`describe_metrics`], once per process.
pub(crate) fn describe_once() {
    DESCRIBED.call_once(describe_metrics);
}

pub(crate) fn count(name: &'static str, workflow: &str) {
    metrics::counter!(name, "workflow" => workflow.to_owned()).increment(1);
}

pub(crate) fn count_phase(name: &'static str, workflow: &str, phase: &'static str) {
    metrics::counter!(name, "workflow" => workflow.to_owned(), "phase" => phase).increment(1);
}

pub(crate) fn phase_duration(
    workflow: &str,
    phase: &'static str,
    kind: &'static str,
    elapsed: Duration,
) {
    metrics::histogram!(
        "idemflow_phase_duration_seconds",
        "workflow" => workflow.to_owned(), "phase" => phase, "kind" => kind
    )
    .record(elapsed.as_secs_f64());
}

pub(crate) const CLAIMS: &str = "idemflow_claims_total";
pub(crate) const REPLAYS: &str = "idemflow_replays_total";
pub(crate) const CONFLICTS: &str = "idemflow_conflicts_total";
pub(crate) const MISMATCHES: &str = "idemflow_mismatches_total";
pub(crate) const REJECTIONS: &str = "idemflow_rejections_total";
pub(crate) const TAKEOVERS: &str = "idemflow_takeovers_total";
pub(crate) const FENCED: &str = "idemflow_fenced_total";
pub(crate) const RETRIES: &str = "idemflow_retries_total";
pub(crate) const RESTARTS: &str = "idemflow_restarts_total";
pub(crate) const GIVE_UPS: &str = "idemflow_give_ups_total";
pub(crate) const FINISHED: &str = "idemflow_finished_total";
pub(crate) const NOT_EXECUTED: &str = "idemflow_not_executed_total";
pub(crate) const TRANSACTIONS_ENDED: &str = "idemflow_transactions_ended_total";
