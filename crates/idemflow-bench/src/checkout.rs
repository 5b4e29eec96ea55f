//! The checkout workload: new requests through local → foreign → local (create_order inserts an
//! order, charge is an in-process no-op, mark_paid updates it), on unique random-looking keys;
//! through the engine, the engine with a crash hook installed that never fires, and the raw
//! baseline sending the same statements, interleaved at each client count.

use crate::report::{CHECKOUT, ENGINE, ENGINE_HOOK, RAW, Report, Target, over};
use crate::workloads::{Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "checkout",
    number: Some(1),
    measures: "new requests, local → foreign → local: engine, engine + crash hook, raw sqlx",
    runs: Runs::Interleaved(PLAN),
    targets: Some(targets),
    section: None,
};

const PLAN: &[(&str, &str)] = &[(CHECKOUT, ENGINE), (CHECKOUT, ENGINE_HOOK), (CHECKOUT, RAW)];

/// Engine ÷ raw ≥ 1.0× at 8 and 32 clients; 2 commits per request, no more round trips than raw
/// (counted on the wire) and no more server transactions; the crash hook costs < 1%.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    targets.extend(report.against_raw(CHECKOUT, ENGINE, RAW));
    targets.extend(report.transactions_against_raw(CHECKOUT, "1 checkout"));
    let wire = report.wire(CHECKOUT, ENGINE);
    targets.push(Target::exactly(
        "1 checkout: commits per request",
        wire.map(|count| count.commits_per_request),
        2.0,
    ));
    let trips = wire.map(|count| count.round_trips_per_request);
    let raw_trips = report
        .wire(CHECKOUT, RAW)
        .map(|count| count.round_trips_per_request);
    targets.push(Target {
        name: "1 checkout: round trips per request (phases' own included)".to_owned(),
        measured: trips.map_or("-".to_owned(), |trips| format!("{trips:.2}")),
        target: raw_trips.map_or("-".to_owned(), |trips| format!("≤ raw {trips:.0}")),
        met: trips.zip(raw_trips).map(|(engine, raw)| engine <= raw),
    });
    targets.push(crash_hook(report));
}

/// What a never-firing crash hook costs. End to end, the difference drowns in the run-to-run
/// noise (shown as the larger half-to-half spread of the two variants); the direct estimate is
/// calls × cost per call over the machine's CPU time per request at the measured rate (cores ÷
/// requests per second).
fn crash_hook(report: &Report) -> Target {
    let engine = report.rate(CHECKOUT, ENGINE);
    let hook_cost = over(report.rate(CHECKOUT, ENGINE_HOOK), engine).map(|ratio| 1.0 - ratio);
    let at = report.settings.reference_clients;
    let spread = [ENGINE, ENGINE_HOOK]
        .iter()
        .filter_map(|variant| report.run(CHECKOUT, variant, at).and_then(|run| run.spread))
        .reduce(f64::max);
    let cores = report.machine.cpus.max(1) as f64;
    let direct = report
        .hook_calls_per_request
        .zip(report.hook_nanos_per_call)
        .zip(engine)
        .map(|((calls, nanos), per_second)| calls * nanos * 1e-9 / (cores / per_second));
    let percent = |value: Option<f64>, digits: usize| {
        value.map_or("-".to_owned(), |value| {
            format!("{:.digits$}%", value * 100.0)
        })
    };
    Target {
        name: report.target_name(CHECKOUT, ENGINE_HOOK),
        measured: format!(
            "{} (noise {}), direct {}",
            percent(hook_cost, 1),
            percent(spread, 1),
            percent(direct, 4)
        ),
        target: "< 1%".to_owned(),
        met: direct.map(|direct| direct < 0.01),
    }
}
