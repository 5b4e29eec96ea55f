//! The metrics the consumer records, through the `metrics` facade, each labelled with its
//! `subscriber`.

use std::sync::Once;

use metrics::Unit;

pub(crate) const PROCESSED: &str = "idemflow_consumer_processed_total";
pub(crate) const DUPLICATES: &str = "idemflow_consumer_duplicates_total";
pub(crate) const REFUSED: &str = "idemflow_consumer_refused_total";
pub(crate) const FAILED: &str = "idemflow_consumer_failed_total";
pub(crate) const EXPIRED: &str = "idemflow_consumer_expired_total";

/// Every metric the consumer records: name, kind, meaning. Given to the recorder as descriptions
/// (Prometheus prints them as `# HELP`); docs/consumer.md lists them too.
pub const CATALOGUE: &[(&str, &str, &str)] = &[
    (
        PROCESSED,
        "counter",
        "Messages applied: the handler's effects committed with the message's identity.",
    ),
    (
        DUPLICATES,
        "counter",
        "Deliveries of a message already applied by this subscriber: acknowledged, not run.",
    ),
    (
        REFUSED,
        "counter",
        "Deliveries refused: a message id already applied with another payload.",
    ),
    (
        FAILED,
        "counter",
        "Deliveries rolled back (the handler or the database failed): to be redelivered.",
    ),
    (
        EXPIRED,
        "counter",
        "Processed-message records deleted by retention.",
    ),
];

static DESCRIBED: Once = Once::new();

/// Describes every metric to the installed recorder. [`crate::Consumer::new`] calls it once per
/// process; call it yourself if the recorder is installed later.
pub fn describe_metrics() {
    for &(name, _, help) in CATALOGUE {
        metrics::describe_counter!(name, Unit::Count, help);
    }
}

pub(crate) fn describe_once() {
    DESCRIBED.call_once(describe_metrics);
}

pub(crate) fn count(name: &'static str, subscriber: &str) {
    metrics::counter!(name, "subscriber" => subscriber.to_owned()).increment(1);
}
