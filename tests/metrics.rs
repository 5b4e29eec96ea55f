//! The engine's metrics reach whatever recorder the application installs. Each test runs in its
//! own process under nextest, so installing a global recorder here is safe.
#![allow(clippy::unwrap_used)]

mod support;

use std::sync::atomic::Ordering;

use idemflow::{Outcome, RetryPolicy, Runner};
use metrics_exporter_prometheus::PrometheusBuilder;
use sqlx::PgPool;
use support::*;

fn value(rendered: &str, series: &str) -> Option<f64> {
    rendered
        .lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|number| number.parse().ok())
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn every_protocol_event_is_counted(pool: PgPool) {
    let metrics = PrometheusBuilder::new().install_recorder().unwrap();
    create_orders(&pool).await;
    let harness = Harness::default();
    *harness.provider.retry.lock().unwrap() = Some(RetryPolicy {
        max_attempts: 2,
        ..patient()
    });
    let (runner, workflow) = (Runner::new(pool.clone()), harness.checkout());
    let one = tenant(1);

    executed(&run(&runner, &workflow, &one, "a", &body(1)).await); // claim
    assert!(matches!(
        run(&runner, &workflow, &one, "a", &body(1)).await,
        Outcome::Replayed(_)
    ));
    assert_eq!(
        run(&runner, &workflow, &one, "a", &body(2)).await,
        Outcome::Mismatch
    );
    assert!(matches!(
        run(&runner, &workflow, &one, "", &body(2)).await,
        Outcome::Rejected(_)
    ));
    harness.provider.script.fail_next.store(2, Ordering::SeqCst);
    assert!(matches!(
        run(&runner, &workflow, &one, "b", &body(1)).await,
        Outcome::Interrupted { .. }
    )); // retry
    assert!(matches!(
        run(&runner, &workflow, &one, "b", &body(1)).await,
        Outcome::InProgress { .. }
    )); // conflict
    expire_lease(&pool, "b").await;
    let gave_up = run(&runner, &workflow, &one, "b", &body(1)).await; // takeover, then give up
    assert_eq!(executed(&gave_up).status, 500);

    let rendered = metrics.render();
    let workflow_label = r#"{workflow="checkout.v1"}"#;
    for (name, expected) in [
        ("idemflow_claims_total", 2.0),
        ("idemflow_replays_total", 1.0),
        ("idemflow_mismatches_total", 1.0),
        ("idemflow_rejections_total", 1.0),
        ("idemflow_conflicts_total", 1.0),
        ("idemflow_takeovers_total", 1.0),
        ("idemflow_finished_total", 2.0),
    ] {
        assert_eq!(
            value(&rendered, &format!("{name}{workflow_label}")),
            Some(expected),
            "{name} in\n{rendered}"
        );
    }
    let charge = r#"{workflow="checkout.v1",phase="charge"}"#;
    assert_eq!(
        value(&rendered, &format!("idemflow_retries_total{charge}")),
        Some(1.0),
        "{rendered}"
    );
    assert_eq!(
        value(&rendered, &format!("idemflow_give_ups_total{charge}")),
        Some(1.0),
        "{rendered}"
    );
    assert!(
        rendered.contains("idemflow_phase_duration_seconds"),
        "{rendered}"
    );
}
