//! The local-only workload: new requests of one local phase (place_order inserts an order), the
//! one-commit path; through the engine and the raw baseline, interleaved at each client count.

use crate::report::{ENGINE, LOCAL_ONLY, RAW, Report, Target};
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

/// Engine ÷ raw ≥ 1.0× at 8 and 32 clients; one commit per request (counted on the wire) and no
/// more server transactions than raw.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    targets.extend(report.against_raw(LOCAL_ONLY, ENGINE, RAW));
    targets.extend(report.transactions_against_raw(LOCAL_ONLY, "2 one local phase"));
    targets.push(Target::exactly(
        "2 one local phase: commits per request",
        report
            .wire(LOCAL_ONLY, ENGINE)
            .map(|count| count.commits_per_request),
        1.0,
    ));
}
