//! The engine's metrics reach whatever recorder the application installs. Each test runs in its
//! own process under nextest, so installing a global recorder here is safe.

use std::sync::atomic::Ordering;

use crate::support::*;
use idemflow::{Outcome, Runner};
use metrics_exporter_prometheus::PrometheusBuilder;
use sqlx::PgPool;

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
    *harness.provider.retry.lock().unwrap() = Some(patient().with_max_attempts(2));
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
    // A request the runner rejects: a body of the wrong shape under a new key.
    assert!(matches!(
        run(&runner, &workflow, &one, "r", br#"{"source": "x"}"#).await,
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

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn every_metric_is_described_for_the_recorder_and_in_the_operations_guide(pool: PgPool) {
    let metrics = PrometheusBuilder::new().install_recorder().unwrap();
    // Describing happens once per process, when the first runner is made.
    let runner = Runner::new(pool.clone());
    create_orders(&pool).await;
    let harness = Harness::default();
    executed(&run(&runner, &harness.checkout(), &tenant(1), "a", &body(1)).await);
    let rendered = metrics.render();
    assert!(
        rendered.contains("# HELP idemflow_claims_total New requests that won their key."),
        "{rendered}"
    );
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    for (name, kind, _) in idemflow::metrics::CATALOGUE {
        assert!(
            guide.contains(&format!("| `{name}` | {kind} |")),
            "{name} ({kind}) is not in docs/operations.md's table"
        );
    }
    // Every metric the engine's source records is in the catalogue.
    let catalogue: Vec<&str> = idemflow::metrics::CATALOGUE
        .iter()
        .map(|(name, _, _)| *name)
        .collect();
    for file in ["resumer.rs", "retention.rs", "metrics.rs"] {
        let path = format!(
            "{}/crates/idemflow-runner/src/{file}",
            env!("CARGO_MANIFEST_DIR")
        );
        let source = std::fs::read_to_string(&path).unwrap();
        for piece in source.split('"').skip(1).step_by(2) {
            if piece.starts_with("idemflow_") && !piece.contains(' ') {
                assert!(
                    catalogue.contains(&piece),
                    "{piece} ({file}) is not described"
                );
            }
        }
    }
}

/// Reads the rendered metrics until `series` shows `expected`, for up to 10 s.
async fn until_series(
    metrics: &metrics_exporter_prometheus::PrometheusHandle,
    series: &str,
    expected: f64,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let rendered = metrics.render();
        if value(&rendered, series) == Some(expected) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{series} never read {expected}:\n{rendered}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_unknown_workflow_gauge_falls_back_to_zero_once_its_keys_are_gone(pool: PgPool) {
    let metrics = PrometheusBuilder::new().install_recorder().unwrap();
    // A started key past its lease, of a workflow the resumer does not register.
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, locked_until) \
         VALUES ('1', 'ghost', sha256('ghost'), 'ghost.v1', '{}', now() - interval '1 minute')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let harness = Harness::default();
    let mut registry = idemflow::Registry::new();
    registry.register(harness.checkout()).unwrap();
    let config = idemflow::ResumerConfig::default()
        .with_idle_min(std::time::Duration::from_millis(10))
        .with_idle_max(std::time::Duration::from_millis(20))
        .with_report_every(std::time::Duration::from_millis(10))
        .with_retention(None);
    let resumer = idemflow::Resumer::with_config(Runner::new(pool.clone()), registry, config);
    let stop = std::sync::Arc::new(tokio::sync::Notify::new());
    let stopped = stop.clone();
    let worker = tokio::spawn(resumer.run(async move { stopped.notified().await }));
    let series = r#"idemflow_resumer_unknown_workflow_keys{workflow="ghost.v1"}"#;
    until_series(&metrics, series, 1.0).await;
    // The key is gone (the operator expired it): the gauge says so, without a restart.
    sqlx::query("DELETE FROM idempotency_keys WHERE key = 'ghost'")
        .execute(&pool)
        .await
        .unwrap();
    until_series(&metrics, series, 0.0).await;
    stop.notify_one();
    worker.await.unwrap();
}
