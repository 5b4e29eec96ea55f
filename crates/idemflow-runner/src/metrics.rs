//! The metrics the engine records, through the `metrics` facade: whichever recorder the
//! application installs (Prometheus, StatsD, none) receives them. Names are documented in
//! docs/operations.md.

use std::time::Duration;

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
pub(crate) const GIVE_UPS: &str = "idemflow_give_ups_total";
pub(crate) const FINISHED: &str = "idemflow_finished_total";
pub(crate) const NOT_EXECUTED: &str = "idemflow_not_executed_total";
