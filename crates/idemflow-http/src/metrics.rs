//! The metrics the HTTP layer records, through the `metrics` facade, beside the runner's
//! (`idemflow_runner::CATALOGUE`): what happens at the HTTP door before or around a run. Names are
//! documented in docs/operations.md.

use std::sync::Once;

use metrics::Unit;

/// Covered requests that came without a key, by `workflow`, `route` and `mode`.
pub(crate) const KEYLESS: &str = "idemflow_http_keyless_requests_total";
/// Duplicates that waited for the first attempt (`Prefer: wait`), by `workflow` and `outcome`.
pub(crate) const WAITS: &str = "idemflow_http_waits_total";

/// Every metric the HTTP layer records: name, kind, meaning. Given to the recorder as
/// descriptions (Prometheus prints them as `# HELP`); docs/operations.md lists them too.
pub const CATALOGUE: &[(&str, &str, &str)] = &[
    (
        KEYLESS,
        "counter",
        "Covered requests without an Idempotency-Key, by route and key mode (observe: run \
         unprotected; enforce: refused 400).",
    ),
    (
        WAITS,
        "counter",
        "Duplicates that waited for the first attempt's answer (Prefer: wait), by how the wait \
         ended (replayed, in_progress: 409 after the wait, other).",
    ),
];

static DESCRIBED: Once = Once::new();

/// Describes every metric to the installed recorder. Building a layer or a workflow route calls
/// it once per process; call it yourself if the recorder is installed later.
pub fn describe_metrics() {
    for &(name, _, help) in CATALOGUE {
        metrics::describe_counter!(name, Unit::Count, help);
    }
}

pub(crate) fn describe_once() {
    DESCRIBED.call_once(describe_metrics);
}

/// Counts a covered request that came without a key.
pub(crate) fn keyless(workflow: &str, route: Option<&str>, mode: crate::KeyMode) {
    metrics::counter!(
        KEYLESS,
        "workflow" => workflow.to_owned(),
        // The route as the router names it (`/v1/orders/{id}`), never the path sent: a label
        // per order id would be a series per order.
        "route" => route.unwrap_or(UNMATCHED).to_owned(),
        "mode" => mode.as_str()
    )
    .increment(1);
}

/// The route label of a request no router matched (a layer in a bare tower stack).
const UNMATCHED: &str = "unmatched";

/// How a duplicate's wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    /// The first attempt's response, replayed.
    Replayed,
    /// The wait ran out with the key still running: 409 as without it.
    InProgress,
    /// Anything else a retry can come to: the key freed and run anew, taken over after its
    /// lease, another request under it now (422), an error.
    Other,
}

pub(crate) fn waited(workflow: &str, end: WaitEnd) {
    let outcome = match end {
        WaitEnd::Replayed => "replayed",
        WaitEnd::InProgress => "in_progress",
        WaitEnd::Other => "other",
    };
    metrics::counter!(WAITS, "workflow" => workflow.to_owned(), "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The operations guide's metric table lists every metric here, with its kind, as it does
    /// the runner's (tests/it/metrics.rs).
    #[test]
    fn every_metric_is_in_the_operations_guide() {
        let guide = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/operations.md"
        ))
        .expect("docs/operations.md");
        for (name, kind, _) in CATALOGUE {
            assert!(
                guide.contains(&format!("| `{name}` | {kind} |")),
                "{name} ({kind}) is not in docs/operations.md's table"
            );
        }
    }
}
