//! The monitoring that ships under deploy/ (the Grafana dashboard, the Prometheus alert rules and
//! their promtool tests) stays true to the engine: it names only series a scrape of the engine's
//! metrics shows, the dashboard shows every metric, and every alert has its annotations, a runbook
//! in docs/operations.md, and a promtool test where it fires and one where it stays silent.
//! `scripts/check-deploy` runs promtool itself over the same files. No database.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use metrics_exporter_prometheus::PrometheusBuilder;
use serde_json::Value;

const DASHBOARD: &str = "deploy/grafana/idemflow.json";
const RULES: &str = "deploy/prometheus/idemflow.rules.yml";
const RULE_TESTS: &str = "deploy/prometheus/idemflow.rules.test.yml";
const OPERATIONS: &str = "docs/operations.md";

fn read(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|error| panic!("{path}: {error}"))
}

/// Every metric the engine, the HTTP layer, the consumer and the console record, with its kind.
fn catalogue() -> Vec<(&'static str, &'static str)> {
    idemflow::metrics::CATALOGUE
        .iter()
        .chain(idemflow_http::CATALOGUE)
        .chain(idemflow::consumer::CATALOGUE)
        .chain(idemflow_console::CATALOGUE)
        .map(|&(name, kind, _)| (name, kind))
        .collect()
}

/// The series names a scrape can show, each with the catalogue metric it belongs to: the
/// catalogue recorded through the exporter the example serves /metrics with, and rendered. Asked
/// of the exporter rather than assumed: counters keep their names (already ending in `_total`),
/// histograms are summaries by default (`_sum`, `_count`) and histograms with `_bucket` once an
/// application gives the exporter buckets. Both are rendered.
fn exported_series() -> BTreeMap<String, &'static str> {
    let builders = [
        PrometheusBuilder::new(),
        PrometheusBuilder::new().set_buckets(&[0.1, 1.0]).unwrap(),
    ];
    let mut series = BTreeMap::new();
    for builder in builders {
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // A recorder of this test's own: no global one is installed, whatever else runs.
        metrics::with_local_recorder(&recorder, || {
            for (name, kind) in catalogue() {
                match kind {
                    "counter" => metrics::counter!(name).increment(1),
                    "gauge" => metrics::gauge!(name).set(1.0),
                    "histogram" => metrics::histogram!(name).record(0.5),
                    other => panic!(
                        "{name} is of kind {other:?}: say here how the exporter renders that kind"
                    ),
                }
            }
        });
        for line in handle.render().lines() {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let name = line.split(['{', ' ']).next().unwrap();
            let metric = catalogue()
                .into_iter()
                .map(|(metric, _)| metric)
                .filter(|metric| name.starts_with(metric))
                .max_by_key(|metric| metric.len())
                .unwrap_or_else(|| {
                    panic!("the exporter rendered {name}, from no catalogue metric")
                });
            series.insert(name.to_owned(), metric);
        }
    }
    // The suffixes come from the exporter; make sure both renderings were had.
    for suffix in ["_sum", "_count", "_bucket"] {
        assert!(
            series
                .keys()
                .any(|name| name == &format!("idemflow_phase_duration_seconds{suffix}")),
            "the exporter rendered no idemflow_phase_duration_seconds{suffix}: {series:?}"
        );
    }
    series
}

/// Every `idemflow_…` identifier in `text`, with its line (1-based). Recording rules
/// (`idemflow:…`) and alert names (`Idemflow…`) are not metrics and do not match; a colon after
/// a name is the text's (`name: meaning`), since the engine's names have none.
fn metric_names(text: &str) -> Vec<(usize, String)> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut found = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let mut rest = line;
        let mut offset = 0;
        while let Some(at) = rest.find("idemflow_") {
            let start = offset + at;
            let before = line[..start].chars().next_back();
            let length = line[start..]
                .find(|c: char| !is_name(c))
                .unwrap_or(line.len() - start);
            if !before.is_some_and(|c| is_name(c) || c == ':') {
                found.push((number + 1, line[start..start + length].to_owned()));
            }
            offset = start + length;
            rest = &line[offset..];
        }
    }
    found
}

#[test]
fn the_dashboard_and_the_alert_rules_name_only_series_the_engine_exports() {
    let exported = exported_series();
    let mut unknown = Vec::new();
    // Whole files, not only their queries: a panel's description, an alert's annotation or a
    // test's fixture naming a series the engine never exports is as wrong as a query.
    for path in [DASHBOARD, RULES, RULE_TESTS] {
        for (line, name) in metric_names(&read(path)) {
            if !exported.contains_key(&name) {
                unknown.push(format!("{path}:{line}: {name}"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics the engine does not export (no catalogue in crates/idemflow-runner/src/metrics.rs, \
         crates/idemflow-http/src/metrics.rs or crates/idemflow-consumer/src/metrics.rs has them, \
         under the names the exporter gives):\n\
         {}\n\nwhat a scrape can show:\n{}",
        unknown.join("\n"),
        exported.keys().cloned().collect::<Vec<_>>().join("\n")
    );
}

/// The PromQL of every panel and variable of the dashboard.
fn dashboard_queries(dashboard: &Value) -> Vec<String> {
    fn walk(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(object) => {
                for (key, value) in object {
                    match (key.as_str(), value) {
                        ("expr" | "definition", Value::String(query)) => out.push(query.clone()),
                        _ => walk(value, out),
                    }
                }
            }
            Value::Array(values) => values.iter().for_each(|value| walk(value, out)),
            _ => {}
        }
    }
    let mut queries = Vec::new();
    walk(dashboard, &mut queries);
    queries
}

#[test]
fn every_metric_the_engine_records_is_on_the_dashboard() {
    let exported = exported_series();
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    let queries = dashboard_queries(&dashboard);
    let shown: BTreeSet<&str> = queries
        .iter()
        .flat_map(|query| metric_names(query))
        .filter_map(|(_, name)| exported.get(&name).copied())
        .collect();
    let missing: Vec<&str> = catalogue()
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !shown.contains(name))
        .collect();
    assert!(
        missing.is_empty(),
        "metrics no query of {DASHBOARD} shows: {missing:?}"
    );
}

#[test]
fn the_dashboard_takes_its_data_source_from_a_variable() {
    let dashboard: Value = serde_json::from_str(&read(DASHBOARD)).unwrap();
    assert!(
        dashboard["schemaVersion"].as_u64().is_some(),
        "{DASHBOARD} has no schemaVersion"
    );
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables
            .iter()
            .any(|variable| variable["name"] == "datasource"
                && variable["type"] == "datasource"
                && variable["query"] == "prometheus"),
        "{DASHBOARD} has no Prometheus data source variable named datasource"
    );
    // No UID of any Grafana's: every reference is to the variable, the dashboard's own is left
    // for Grafana to make.
    fn walk(value: &Value, at: &str, offences: &mut Vec<String>) {
        match value {
            Value::Object(object) => {
                for (key, value) in object {
                    let here = format!("{at}.{key}");
                    match key.as_str() {
                        "uid" if value != "${datasource}" => {
                            offences.push(format!("{here} = {value}"));
                        }
                        "datasource"
                            if value.is_object()
                                && (value["type"] != "prometheus"
                                    || value["uid"] != "${datasource}") =>
                        {
                            offences.push(format!("{here} = {value}"));
                        }
                        _ => walk(value, &here, offences),
                    }
                }
            }
            Value::Array(values) => {
                for (index, value) in values.iter().enumerate() {
                    walk(value, &format!("{at}[{index}]"), offences);
                }
            }
            _ => {}
        }
    }
    let mut offences = Vec::new();
    walk(&dashboard, "", &mut offences);
    assert!(
        offences.is_empty(),
        "{DASHBOARD}: a data source or UID not the ${{datasource}} variable's:\n{}",
        offences.join("\n")
    );
    let mut ids = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        let id = panel["id"].as_u64().unwrap();
        assert!(ids.insert(id), "{DASHBOARD}: two panels with id {id}");
    }
}

/// An alert of the rules file: its name and its annotations' keys and values.
struct Alert {
    name: String,
    line: usize,
    annotations: BTreeMap<String, String>,
}

/// The alerts of a rules file, read crudely: an alert runs from its `- alert:` line to the next
/// rule or group; its annotations are the keys one level under its `annotations:` line.
fn alerts(rules: &str) -> Vec<Alert> {
    let mut alerts = Vec::new();
    let mut current: Option<Alert> = None;
    let mut annotations_indent: Option<usize> = None;
    for (number, line) in rules.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if trimmed.starts_with("- alert:")
            || trimmed.starts_with("- record:")
            || trimmed.starts_with("- name:")
        {
            alerts.extend(current.take());
            annotations_indent = None;
            if let Some(name) = trimmed.strip_prefix("- alert:") {
                current = Some(Alert {
                    name: name.trim().to_owned(),
                    line: number + 1,
                    annotations: BTreeMap::new(),
                });
            }
        } else if trimmed == "annotations:" {
            annotations_indent = Some(indent);
        } else if let Some(under) = annotations_indent {
            if indent <= under {
                annotations_indent = None;
            } else if indent == under + 2
                && let Some((key, value)) = trimmed.split_once(':')
                && let Some(alert) = current.as_mut()
            {
                alert
                    .annotations
                    .insert(key.to_owned(), value.trim().to_owned());
            }
        }
    }
    alerts.extend(current);
    alerts
}

/// GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of the `###` headings of a `##` section of a Markdown text.
fn section_anchors(markdown: &str, section: &str) -> Vec<String> {
    let mut inside = false;
    let mut anchors = Vec::new();
    for line in markdown.lines() {
        if let Some(title) = line.strip_prefix("## ") {
            inside = title.trim() == section;
        } else if inside && let Some(title) = line.strip_prefix("### ") {
            anchors.push(anchor(title));
        }
    }
    anchors
}

#[test]
fn every_alert_has_its_annotations_and_a_runbook_in_the_operations_guide() {
    let alerts = alerts(&read(RULES));
    assert!(!alerts.is_empty(), "no alert found in {RULES}");
    let runbooks = section_anchors(&read(OPERATIONS), "Alerts");
    let mut offences = Vec::new();
    let mut used = BTreeSet::new();
    for alert in &alerts {
        let at = format!("{RULES}:{} {}", alert.line, alert.name);
        for key in ["summary", "description", "runbook"] {
            if alert.annotations.get(key).is_none_or(String::is_empty) {
                offences.push(format!("{at}: no {key} annotation"));
            }
        }
        let Some(runbook) = alert.annotations.get("runbook") else {
            continue;
        };
        match runbook.split_once('#') {
            Some((OPERATIONS, anchor)) if runbooks.iter().any(|known| known == anchor) => {
                used.insert(anchor.to_owned());
            }
            _ => offences.push(format!(
                "{at}: runbook {runbook:?} is no heading of {OPERATIONS}'s \"Alerts\" section \
                 (its runbooks: {runbooks:?})"
            )),
        }
    }
    for runbook in &runbooks {
        if !used.contains(runbook) {
            offences.push(format!(
                "{OPERATIONS}#{runbook}: a runbook in \"Alerts\" that no alert names"
            ));
        }
    }
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}

#[test]
fn every_alert_is_tested_firing_and_silent() {
    let names: BTreeSet<String> = alerts(&read(RULES))
        .into_iter()
        .map(|alert| alert.name)
        .collect();
    let tests = read(RULE_TESTS);
    let lines: Vec<&str> = tests.lines().map(str::trim).collect();
    let (mut firing, mut silent) = (BTreeSet::new(), BTreeSet::new());
    let mut offences = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        let Some(name) = line.strip_prefix("alertname:").map(str::trim) else {
            continue;
        };
        if !names.contains(name) {
            // promtool passes a test of an alert that does not exist when it expects silence.
            offences.push(format!("{RULE_TESTS}:{}: no alert {name}", index + 1));
        }
        match lines.get(index + 1) {
            Some(&"exp_alerts: []") => silent.insert(name.to_owned()),
            Some(&"exp_alerts:") => firing.insert(name.to_owned()),
            _ => {
                offences.push(format!(
                    "{RULE_TESTS}:{}: {name}'s test names no exp_alerts on the next line",
                    index + 1
                ));
                continue;
            }
        };
    }
    for name in &names {
        if !firing.contains(name) {
            offences.push(format!("{name}: no test where it fires"));
        }
        if !silent.contains(name) {
            offences.push(format!("{name}: no test where it stays silent"));
        }
    }
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}
