//! The replay workload: requests for the finished keys seeded before the first workload runs,
//! answered from the stored response; through the engine (`Runner::run`, its look-up) and the
//! raw baseline (one primary-key select of the stored response), interleaved at each client
//! count.

use crate::report::{ENGINE, RAW, REPLAY, Report, Target};
use crate::workloads::{Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "replay",
    number: Some(3),
    measures: "replays of finished keys: the engine vs a raw primary-key select",
    runs: Runs::Interleaved(PLAN),
    targets: Some(targets),
    section: None,
};

const PLAN: &[(&str, &str)] = &[(REPLAY, ENGINE), (REPLAY, RAW)];

/// Engine ÷ raw ≥ 1.0× at 8 and 32 clients; one round trip per replay (counted on the wire).
fn targets(report: &Report, targets: &mut Vec<Target>) {
    targets.extend(report.against_raw(REPLAY, ENGINE, RAW));
    targets.push(Target::exactly(
        "3 replay: round trips per request",
        report
            .wire(REPLAY, ENGINE)
            .map(|count| count.round_trips_per_request),
        1.0,
    ));
}
