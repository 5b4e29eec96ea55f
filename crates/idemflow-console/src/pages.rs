//! The views: the overview, the search, a key's page, the stuck list, and the pages an action
//! answers with. Each takes what it shows and returns the page; none reads the database.

use std::fmt::Write as _;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use idemflow_core::{DerivedKey, Key, TenantId};
use idemflow_store::{KeyBodies, KeyReport, Overview};

use crate::html::{Frame, attr, duration_ms, escape, link, page, timestamp};
use crate::search::{Found, PAGE, SCAN, SearchForm};

/// `value` or a dash.
fn or_dash(value: Option<String>) -> String {
    value.unwrap_or_else(|| "—".to_owned())
}

/// What a key's lease means now.
pub fn lease_text(report: &KeyReport) -> String {
    match report.lease_left_ms {
        None => "— (done)".to_owned(),
        Some(ms) if ms > 0 => format!("live, {} left", duration_ms(ms)),
        Some(ms) => format!("over {} ago: due for takeover", duration_ms(ms)),
    }
}

fn state_badge(report: &KeyReport) -> String {
    let class = match (report.state.as_str(), report.lease_left_ms) {
        ("done", _) => "done",
        (_, Some(ms)) if ms <= 0 => "due",
        _ => "started",
    };
    format!(
        r#"<span class="badge {class}">{}</span>"#,
        escape(if class == "due" { "due" } else { &report.state })
    )
}

fn key_link(base: &str, report: &KeyReport) -> String {
    link(
        base,
        "key",
        &[("tenant", &report.tenant), ("key", &report.key)],
    )
}

/// A table of keys, one row each, linking to their pages.
fn key_table(base: &str, keys: &[KeyReport]) -> String {
    let mut rows = String::new();
    for report in keys {
        let _ = write!(
            rows,
            r#"<tr><td>{tenant}</td><td><a class="key" href="{href}">{key}</a></td><td>{workflow}</td><td>{state}</td><td>{point}</td><td>{attempts}</td><td>{lease}</td><td class="error">{error}</td><td>{age}</td></tr>"#,
            tenant = escape(&report.tenant),
            href = attr(&key_link(base, report)),
            key = escape(&report.key),
            workflow = escape(&report.workflow),
            state = state_badge(report),
            point = escape(&report.recovery_point),
            attempts = report.attempts,
            lease = escape(&lease_text(report)),
            error = escape(report.last_error.as_deref().unwrap_or("")),
            age = duration_ms(report.age_seconds.saturating_mul(1000)),
        );
    }
    format!(
        r#"<table class="keys"><thead><tr><th>Tenant</th><th>Key</th><th>Workflow</th><th>State</th><th>Recovery point</th><th>Attempts</th><th>Lease</th><th>Last error</th><th>Age</th></tr></thead><tbody>{rows}</tbody></table>"#
    )
}

/// The overview.
pub fn overview(frame: &Frame<'_>, overview: &Overview) -> String {
    let started: i64 = overview.started.iter().map(|w| w.keys).sum();
    let due: i64 = overview.started.iter().map(|w| w.due).sum();
    let card = |id: &str, label: &str, value: String| {
        format!(
            r#"<div class="card" id="{id}"><div class="label">{}</div><div class="value">{}</div></div>"#,
            escape(label),
            escape(&value)
        )
    };
    let mut body = String::from(r#"<section class="cards">"#);
    body.push_str(&card("started", "Started keys", started.to_string()));
    body.push_str(&card("due", "Due (lease over)", due.to_string()));
    body.push_str(&card(
        "lag",
        "Resumer lag",
        duration_ms(overview.resumer_lag_ms),
    ));
    body.push_str(&card(
        "oldest",
        "Oldest started key",
        overview
            .oldest_started_seconds
            .map_or_else(|| "—".to_owned(), |s| duration_ms(s.saturating_mul(1000))),
    ));
    body.push_str(&card(
        "rate",
        "Finished, last minute",
        overview.finished_last_minute.to_string(),
    ));
    body.push_str(&card(
        "rate-15",
        "Finished, last 15 minutes",
        overview.finished_last_15_minutes.to_string(),
    ));
    body.push_str(&card(
        "estimate",
        "Keys (estimate)",
        overview
            .estimated_keys
            .map_or_else(|| "—".to_owned(), |n| n.to_string()),
    ));
    body.push_str("</section>");
    body.push_str("<h2>Started keys by workflow</h2>");
    if overview.started.is_empty() {
        body.push_str(r#"<p class="empty">No key is started: every key is done.</p>"#);
    } else {
        body.push_str(
            r#"<table class="workflows"><thead><tr><th>Workflow</th><th>Started</th><th>Due</th></tr></thead><tbody>"#,
        );
        for workflow in &overview.started {
            let href = link(
                frame.base,
                "keys",
                &[("workflow", &workflow.workflow), ("state", "started")],
            );
            let _ = write!(
                body,
                r#"<tr><td><a href="{}">{}</a></td><td>{}</td><td>{}</td></tr>"#,
                attr(&href),
                escape(&workflow.workflow),
                workflow.keys,
                workflow.due
            );
        }
        body.push_str("</tbody></table>");
    }
    if due > 0 {
        let _ = write!(
            body,
            r#"<p>{due} started keys are past their lease: <a href="{}/stuck">see the stuck list</a>.</p>"#,
            attr(frame.base)
        );
    }
    page(frame, "Overview", &body)
}

/// The search form, filled with what was asked.
fn search_form(frame: &Frame<'_>, form: &SearchForm) -> String {
    let selected = |value: &str| if form.state == value { " selected" } else { "" };
    format!(
        r#"<form class="search" method="get" action="{base}/keys" id="search">
<label>Tenant <input name="tenant" value="{tenant}"></label>
<label>Key <input name="key" value="{key}"></label>
<label class="check"><input type="checkbox" name="prefix" value="on"{prefix}> prefix</label>
<label>Workflow <input name="workflow" value="{workflow}"></label>
<label>State <select name="state"><option value="">any</option><option value="started"{started}>started</option><option value="done"{done}>done</option></select></label>
<label>Older than <input name="older_than" value="{older}" placeholder="10m"></label>
<label>Last error has <input name="error" value="{error}"></label>
<button type="submit">Search</button>
</form>"#,
        base = attr(frame.base),
        tenant = attr(&form.tenant),
        key = attr(&form.key),
        prefix = if form.prefix == "on" { " checked" } else { "" },
        workflow = attr(&form.workflow),
        started = selected("started"),
        done = selected("done"),
        older = attr(&form.older_than),
        error = attr(&form.error),
    )
}

/// The search page: the form, and a page of results when one was run.
pub fn search(frame: &Frame<'_>, form: &SearchForm, found: Option<&Found>) -> String {
    let mut body = search_form(frame, form);
    if let Some(found) = found {
        if found.keys.is_empty() {
            let _ = write!(
                body,
                r#"<p class="empty" id="no-match">No match among {} keys read.</p>"#,
                found.scanned
            );
        } else {
            body.push_str(&key_table(frame.base, &found.keys));
        }
        if let Some((tenant, key)) = &found.next {
            let href = link(
                frame.base,
                "keys",
                &[
                    ("tenant", &form.tenant),
                    ("key", &form.key),
                    ("prefix", &form.prefix),
                    ("workflow", &form.workflow),
                    ("state", &form.state),
                    ("older_than", &form.older_than),
                    ("error", &form.error),
                    ("after_tenant", tenant),
                    ("after_key", key),
                ],
            );
            let _ = write!(
                body,
                r#"<p class="more"><a id="next" href="{}">Next page</a> <span class="hint">(each page reads at most {SCAN} keys in key order and shows up to {PAGE} matches)</span></p>"#,
                attr(&href)
            );
        }
    }
    page(frame, "Search", &body)
}

/// The stuck list: what `idemflow list --stuck` shows.
pub fn stuck(frame: &Frame<'_>, keys: &[KeyReport], min_attempts: i32) -> String {
    let mut body = format!(
        "<p>Started keys past their lease, or with at least {min_attempts} attempts at their \
         recovery point, oldest lease first.</p>"
    );
    if keys.is_empty() {
        body.push_str(r#"<p class="empty" id="none-stuck">No key is stuck.</p>"#);
    } else {
        body.push_str(&key_table(frame.base, keys));
    }
    page(frame, "Stuck keys", &body)
}

/// A page that says one thing: an action's outcome, a refusal, an error.
pub fn message(
    frame: &Frame<'_>,
    title: &str,
    class: &str,
    text: &str,
    back: Option<&str>,
) -> String {
    let back = back
        .map(|href| {
            format!(
                r#"<p><a id="back" href="{}">Back to the key</a></p>"#,
                attr(href)
            )
        })
        .unwrap_or_default();
    page(
        frame,
        title,
        &format!(
            r#"<p class="message {}" id="message">{}</p>{back}"#,
            attr(class),
            escape(text)
        ),
    )
}

/// A key's summary: every column an operator asks about.
pub fn summary(report: &KeyReport) -> String {
    let rows: [(&str, String); 12] = [
        ("Tenant", escape(&report.tenant)),
        ("Key", escape(&report.key)),
        ("Workflow", escape(&report.workflow)),
        ("State", state_badge(report)),
        ("Recovery point", escape(&report.recovery_point)),
        ("Lease", escape(&lease_text(report))),
        (
            "Fencing token",
            format!(
                "{} <span class=\"hint\">(lock_version: the lease holder's; every write of an earlier holder is refused)</span>",
                report.lock_version
            ),
        ),
        ("Attempts", report.attempts.to_string()),
        ("Last error", escape(&or_dash(report.last_error.clone()))),
        (
            "Response",
            match (report.response_status, report.response_bytes) {
                (Some(status), Some(bytes)) => format!("{status}, {bytes} bytes"),
                (Some(status), None) => status.to_string(),
                _ => "— (not yet)".to_owned(),
            },
        ),
        (
            "Fingerprint",
            format!("<code>{}</code>", escape(&report.fingerprint_hex)),
        ),
        ("Age", duration_ms(report.age_seconds.saturating_mul(1000))),
    ];
    let mut out = String::from(r#"<table class="summary" id="summary"><tbody>"#);
    for (name, value) in rows {
        let _ = write!(out, "<tr><th>{name}</th><td>{value}</td></tr>");
    }
    out.push_str("</tbody></table>");
    out
}

/// The forms of a key's actions. In read-only mode they are not shown; the server refuses
/// them all the same.
pub fn actions(frame: &Frame<'_>, report: &KeyReport) -> String {
    if frame.read_only {
        return r#"<p class="hint" id="actions-off">This console is read-only: it ends no lease and expires no key.</p>"#.to_owned();
    }
    let live = report.lease_left_ms.is_some_and(|ms| ms > 0);
    let hidden = format!(
        r#"<input type="hidden" name="tenant" value="{}"><input type="hidden" name="key" value="{}"><input type="hidden" name="lock_version" value="{}"><input type="hidden" name="state" value="{}"><input type="hidden" name="confirmed" value="">"#,
        attr(&report.tenant),
        attr(&report.key),
        report.lock_version,
        attr(&report.state)
    );
    let force = if live {
        r#"<label class="check"><input type="checkbox" name="force" value="on"> the owner is gone (force: its lease is live)</label>"#
    } else {
        ""
    };
    let mut out = String::from(r#"<section class="actions"><h2>Actions</h2>"#);
    if report.state == "started" {
        let _ = write!(
            out,
            r#"<form method="post" action="{base}/key/end-lease" id="end-lease" data-confirm="End the lease of key {key} (token {token})? Its owner's writes are refused from then on, and a resumer or the next retry takes it over.">{hidden}{force}<button type="submit" class="danger">End lease</button></form>"#,
            base = attr(frame.base),
            key = attr(&report.key),
            token = report.lock_version,
        );
    }
    let consequence = if report.state == "done" {
        "Its stored response is deleted: the next request with this key runs as a new one."
    } else {
        "It is deleted unfinished: the next request with this key runs from the first phase, and a foreign phase is called again with its derived key."
    };
    let _ = write!(
        out,
        r#"<form method="post" action="{base}/key/expire" id="expire" data-confirm="Expire key {key} now? {consequence}">{hidden}{force}<button type="submit" class="danger">Expire key</button></form>"#,
        base = attr(frame.base),
        key = attr(&report.key),
        consequence = attr(consequence),
    );
    out.push_str("</section>");
    out
}

/// The page that asks to confirm an action (for browsers without JavaScript, which answer the
/// form's `data-confirm` themselves).
pub fn confirm(
    frame: &Frame<'_>,
    action: &str,
    question: &str,
    fields: &[(&str, String)],
) -> String {
    let mut hidden = String::new();
    for (name, value) in fields {
        let _ = write!(
            hidden,
            r#"<input type="hidden" name="{name}" value="{}">"#,
            attr(value)
        );
    }
    page(
        frame,
        "Confirm",
        &format!(
            r#"<form method="post" action="{base}/key/{action}" id="confirm"><p class="message">{q}</p>{hidden}<input type="hidden" name="confirmed" value="yes"><button type="submit" class="danger">Yes, {action}</button></form>"#,
            base = attr(frame.base),
            q = escape(question),
        ),
    )
}

/// A key's timeline from its journal.
pub fn timeline(report: &KeyReport) -> String {
    let mut out = String::from(r#"<section><h2>Timeline</h2><ol class="timeline" id="timeline">"#);
    for entry in &report.journal {
        let what = match entry.event.as_str() {
            "claimed" => "claimed by a request".to_owned(),
            "phase" => format!(
                "phase {} completed (its recovery point)",
                entry.point.as_deref().unwrap_or("?")
            ),
            "failed" => format!(
                "attempt failed at {}: {}",
                entry.point.as_deref().unwrap_or("?"),
                entry.error.as_deref().unwrap_or("")
            ),
            "taken_over" => format!(
                "taken over by {} (attempt {})",
                entry.by.as_deref().unwrap_or("?"),
                entry
                    .attempt
                    .map_or_else(|| "?".to_owned(), |a| a.to_string())
            ),
            "lease_ended" => format!("lease ended by {}", entry.by.as_deref().unwrap_or("?")),
            "finished" => format!(
                "finished: response {} stored",
                entry
                    .status
                    .map_or_else(|| "?".to_owned(), |s| s.to_string())
            ),
            other => other.to_owned(),
        };
        let _ = write!(
            out,
            r#"<li class="event {class}" data-event="{class}"><time>{at}</time> <span class="what">{what}</span> <span class="token">token {token}</span></li>"#,
            class = attr(&entry.event),
            at = escape(&timestamp(entry.at_ms)),
            what = escape(&what),
            token = entry.token,
        );
    }
    if report.state == "started" && report.lease_left_ms.is_some_and(|ms| ms <= 0) {
        let _ = write!(
            out,
            r#"<li class="event now due" data-event="due"><span class="what">now: the lease is over; the owner is presumed gone, and a resumer or the next retry takes it over</span></li>"#
        );
    }
    out.push_str("</ol></section>");
    out
}

/// The derived key of `phase` for this key.
fn derived(report: &KeyReport, phase: &str) -> Option<String> {
    let tenant = TenantId::new(&report.tenant).ok()?;
    let key = Key::parse(&report.key).ok()?;
    Some(
        DerivedKey::of_recorded(&tenant, &key, phase)
            .as_str()
            .to_owned(),
    )
}

/// The workflow's phases, where the key stands in them, and the derived key each foreign phase
/// sends (`<tenant>:<key>:<phase>`, hashed when long) — when the console was given the workflow.
/// Without it, which phases are foreign only the application knows, and the page says how the
/// derived keys are made instead.
pub fn phases(report: &KeyReport, workflow: Option<&[(String, bool)]>) -> String {
    let mut out = String::from(r#"<section id="phases"><h2>Phases</h2>"#);
    let Some(phases) = workflow else {
        let _ = write!(
            out,
            r#"<p class="hint" id="phases-unknown">This console was not given workflow {} (<code>Console::workflow</code>), so it cannot tell its foreign phases. A foreign phase named <em>phase</em> sends the derived key <code>{}</code>.</p></section>"#,
            escape(&report.workflow),
            escape(&format!("{}:{}:<phase>", report.tenant, report.key))
        );
        return out;
    };
    let reached = phases
        .iter()
        .position(|(name, _)| *name == report.recovery_point)
        .map_or(0, |index| index + 1);
    out.push_str(r#"<table class="phases"><thead><tr><th>#</th><th>Phase</th><th>Kind</th><th>Status</th><th>Derived key</th></tr></thead><tbody>"#);
    for (index, (name, foreign)) in phases.iter().enumerate() {
        let status = if index < reached {
            "completed".to_owned()
        } else if index == reached && report.state == "started" {
            format!("next (attempt {})", report.attempts)
        } else {
            "not yet".to_owned()
        };
        let derived = if *foreign {
            derived(report, name)
                .map(|key| format!("<code>{}</code>", escape(&key)))
                .unwrap_or_default()
        } else {
            String::new()
        };
        let _ = write!(
            out,
            r#"<tr data-phase="{name}"><td>{n}</td><td>{name}</td><td>{kind}</td><td>{status}</td><td>{derived}</td></tr>"#,
            n = index + 1,
            name = escape(name),
            kind = if *foreign { "foreign" } else { "local" },
            status = escape(&status),
        );
    }
    out.push_str("</tbody></table></section>");
    out
}

/// The longest body shown on a page; the rest is counted, not shown.
const SHOWN_BYTES: usize = 64 * 1024;

fn sealed(key_id: &str) -> String {
    format!(
        r#"<span class="sealed">sealed under key {}: the console opens nothing sealed</span>"#,
        escape(key_id)
    )
}

/// The request and response as stored: after redaction (which happened before storage), and
/// sealed parts shown as sealed, never opened.
pub fn bodies(bodies: &KeyBodies) -> String {
    let mut out = String::from(r#"<section id="stored"><h2>Request, as stored</h2>"#);
    match bodies.request_sealed_under() {
        Some(key_id) => {
            let _ = write!(out, r#"<p id="request-sealed">{}</p>"#, sealed(key_id));
        }
        None => {
            let pretty = serde_json::to_string_pretty(&bodies.request).unwrap_or_default();
            let _ = write!(out, r#"<pre id="request">{}</pre>"#, escape(&pretty));
        }
    }
    out.push_str("<h2>Response, as stored</h2>");
    let Some(response) = &bodies.response else {
        out.push_str(
            r#"<p class="empty" id="no-response">None yet: the key is started.</p></section>"#,
        );
        return out;
    };
    let where_ = if response.apart {
        " (body stored apart from the key's row)"
    } else {
        ""
    };
    let _ = write!(
        out,
        r#"<p>Status <strong id="response-status">{}</strong>, {} bytes{where_}</p>"#,
        response.status,
        response.body.len()
    );
    if let Some(key_id) = response.sealed_under() {
        let _ = write!(
            out,
            r#"<p id="response-sealed">{}</p></section>"#,
            sealed(key_id)
        );
        return out;
    }
    out.push_str(r#"<table class="summary" id="response-headers"><tbody>"#);
    for (name, value) in &response.headers {
        let value = value.to_str().map_or_else(
            || format!("(not UTF-8) base64 {}", STANDARD.encode(value.as_bytes())),
            str::to_owned,
        );
        let _ = write!(
            out,
            "<tr><th>{}</th><td>{}</td></tr>",
            escape(name),
            escape(&value)
        );
    }
    out.push_str("</tbody></table>");
    let shown = &response.body[..response.body.len().min(SHOWN_BYTES)];
    let more = if shown.len() < response.body.len() {
        format!(
            r#"<p class="hint">The first {} of {} bytes.</p>"#,
            shown.len(),
            response.body.len()
        )
    } else {
        String::new()
    };
    // A body cut at the limit may end inside a character: the text up to it is still shown.
    let text = match std::str::from_utf8(shown) {
        Ok(text) => Some(text),
        Err(error) if error.error_len().is_none() => {
            std::str::from_utf8(&shown[..error.valid_up_to()]).ok()
        }
        Err(_) => None,
    };
    match text {
        Some(text) => {
            let _ = write!(
                out,
                r#"<pre id="response-body">{}</pre>{more}"#,
                escape(text)
            );
        }
        None => {
            let _ = write!(
                out,
                r#"<p class="hint">The body is not UTF-8; base64:</p><pre id="response-body">{}</pre>{more}"#,
                STANDARD.encode(shown)
            );
        }
    }
    out.push_str("</section>");
    out
}
