//! The local-only workload: new requests of one local phase (place_order inserts an order), the
//! one-commit path; through the engine and the raw baseline, interleaved at each client count.

use crate::report::{ENGINE, LOCAL_ONLY, RAW, Report, Target, over};
use crate::workloads::{Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "local-only",
    number: Some(2),
    measures: "new requests of one local phase: the engine vs raw sqlx",
    runs: Runs::Interleaved(PLAN),
    targets: Some(targets),
    section: None,
};

const PLAN: &[(&str, &str)] = &[(LOCAL_ONLY, ENGINE), (LOCAL_ONLY, RAW)];

/// Engine ÷ raw ≥ 0.85×; one commit per request (counted on the wire).
fn targets(report: &Report, targets: &mut Vec<Target>) {
    targets.push(Target::ratio(
        report.target_name(LOCAL_ONLY, ENGINE),
        over(
            report.rate(LOCAL_ONLY, ENGINE),
            report.rate(LOCAL_ONLY, RAW),
        ),
        0.85,
    ));
    targets.push(Target::exactly(
        "2 one local phase: commits per request",
        report
            .wire(LOCAL_ONLY, ENGINE)
            .map(|count| count.commits_per_request),
        1.0,
    ));
}
