//! A key's page and the two actions on it: ending its lease and expiring it.
//!
//! Each action is fenced by the token the operator was shown (a key that moved on since is
//! refused, not acted on), refused for a live owner unless forced, confirmed (a dialog with
//! JavaScript, a confirmation page without), refused in read-only mode and from another site,
//! and recorded: a tracing event on target `idemflow::console` and the counter
//! `idemflow_console_actions_total{action, outcome, principal}`.

use axum::Extension;
use axum::extract::{Form, OriginalUri, Query, State};
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{Html, IntoResponse, Response};
use idemflow_core::{Key, TenantId};
use idemflow_store::KeyReport;
use serde::Deserialize;

use crate::html::link;
use crate::{Console, Principal, base, failure, pages};

/// A key named in a query string.
#[derive(Debug, Deserialize)]
pub struct KeyQuery {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    key: String,
}

fn check(tenant: &str, key: &str) -> Result<(), String> {
    TenantId::new(tenant).map_err(|error| format!("tenant: {error}"))?;
    Key::parse(key).map_err(|error| format!("key: {error}"))?;
    Ok(())
}

/// `GET /key?tenant=…&key=…`: everything about one key.
pub async fn key_page(
    State(console): State<Console>,
    original: OriginalUri,
    uri: Uri,
    principal: Option<Extension<Principal>>,
    Query(query): Query<KeyQuery>,
) -> Response {
    let base = base(&original, &uri);
    let principal = principal.map(|Extension(p)| p);
    let frame = console.frame(&base, principal.as_ref());
    let fail = |status, text: &str| failure(&console, &base, principal.as_ref(), status, text);
    if let Err(reason) = check(&query.tenant, &query.key) {
        return fail(StatusCode::BAD_REQUEST, &reason);
    }
    // Another tenant's key reads as no key at all, and is not read: its page says nothing of
    // whether it exists.
    let report = if console.tenants_of(principal.as_ref()).allows(&query.tenant) {
        console.operator.key_report(&query.tenant, &query.key).await
    } else {
        Ok(None)
    };
    let report = match report {
        Ok(Some(report)) => report,
        Ok(None) => {
            let text = format!(
                "No key {:?} for tenant {:?}: never claimed, or expired.",
                query.key, query.tenant
            );
            return fail(StatusCode::NOT_FOUND, &text);
        }
        Err(error) => return fail(StatusCode::SERVICE_UNAVAILABLE, &error.to_string()),
    };
    let mut body = pages::summary(&report);
    body.push_str(&pages::timeline(&report));
    let workflow = console.workflows.get(&report.workflow).map(Vec::as_slice);
    body.push_str(&pages::phases(&report, workflow));
    body.push_str(&pages::actions(&frame, &report));
    match console.operator.key_bodies(&query.tenant, &query.key).await {
        Ok(Some(bodies)) => body.push_str(&pages::bodies(&bodies)),
        // Deleted between the two reads: the page shows the key as it was.
        Ok(None) => {}
        Err(error) => return fail(StatusCode::SERVICE_UNAVAILABLE, &error.to_string()),
    }
    Html(crate::html::page(
        &frame,
        &format!("Key {}", report.key),
        &body,
    ))
    .into_response()
}

/// An action's form.
#[derive(Debug, Deserialize)]
pub struct ActionForm {
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    key: String,
    #[serde(default)]
    lock_version: String,
    /// The state the page showed: a finish keeps the token, so the token alone cannot tell a key
    /// shown started from the same key finished since.
    #[serde(default)]
    state: String,
    #[serde(default)]
    force: String,
    #[serde(default)]
    confirmed: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    EndLease,
    Expire,
}

impl Action {
    fn name(self) -> &'static str {
        match self {
            Self::EndLease => "end_lease",
            Self::Expire => "expire",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Self::EndLease => "end-lease",
            Self::Expire => "expire",
        }
    }
}

/// What an action came to, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    AlreadyDue,
    RefusedReadOnly,
    RefusedCrossSite,
    RefusedTenant,
    RefusedLiveOwner,
    RefusedFinished,
    MovedOn,
    NotFound,
    Invalid,
    Failed,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::AlreadyDue => "already_due",
            Self::RefusedReadOnly => "refused_read_only",
            Self::RefusedCrossSite => "refused_cross_site",
            Self::RefusedTenant => "refused_tenant",
            Self::RefusedLiveOwner => "refused_live_owner",
            Self::RefusedFinished => "refused_finished",
            Self::MovedOn => "moved_on",
            Self::NotFound => "not_found",
            Self::Invalid => "invalid",
            Self::Failed => "failed",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Self::Done | Self::AlreadyDue => StatusCode::OK,
            Self::RefusedReadOnly | Self::RefusedCrossSite | Self::RefusedTenant => {
                StatusCode::FORBIDDEN
            }
            Self::RefusedLiveOwner | Self::RefusedFinished | Self::MovedOn => StatusCode::CONFLICT,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::Invalid => StatusCode::BAD_REQUEST,
            Self::Failed => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// A form posted from another site carries the operator's credentials (a browser sends basic
/// auth and cookies with it): only the console's own pages may post. Browsers say where a form
/// came from in `Sec-Fetch-Site`, and older ones in `Origin`; a client that sends neither (curl)
/// is not a browser another site can drive.
fn same_origin(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        return matches!(site.to_str(), Ok("same-origin" | "none"));
    }
    match (headers.get(header::ORIGIN), headers.get(header::HOST)) {
        (None, _) => true,
        (Some(origin), Some(host)) => {
            let origin = origin.to_str().unwrap_or("");
            let authority = origin.split_once("://").map_or("", |(_, rest)| rest);
            Some(authority) == host.to_str().ok()
        }
        (Some(_), None) => false,
    }
}

/// `POST /key/end-lease`.
pub async fn end_lease(
    State(console): State<Console>,
    original: OriginalUri,
    uri: Uri,
    headers: HeaderMap,
    principal: Option<Extension<Principal>>,
    Form(form): Form<ActionForm>,
) -> Response {
    act(
        Action::EndLease,
        &console,
        &original,
        &uri,
        &headers,
        principal.map(|Extension(p)| p),
        form,
    )
    .await
}

/// `POST /key/expire`.
pub async fn expire(
    State(console): State<Console>,
    original: OriginalUri,
    uri: Uri,
    headers: HeaderMap,
    principal: Option<Extension<Principal>>,
    Form(form): Form<ActionForm>,
) -> Response {
    act(
        Action::Expire,
        &console,
        &original,
        &uri,
        &headers,
        principal.map(|Extension(p)| p),
        form,
    )
    .await
}

async fn act(
    action: Action,
    console: &Console,
    original: &OriginalUri,
    uri: &Uri,
    headers: &HeaderMap,
    principal: Option<Principal>,
    form: ActionForm,
) -> Response {
    let base = base(original, uri);
    let frame = console.frame(&base, principal.as_ref());
    let back = link(
        &base,
        "key",
        &[("tenant", &form.tenant), ("key", &form.key)],
    );
    let (outcome, text) = decide(action, console, headers, principal.as_ref(), &form).await;
    let Some(outcome) = outcome else {
        // Not confirmed yet: ask, and record nothing.
        let fields = [
            ("tenant", form.tenant.clone()),
            ("key", form.key.clone()),
            ("lock_version", form.lock_version.clone()),
            ("state", form.state.clone()),
            ("force", form.force.clone()),
        ];
        return Html(pages::confirm(&frame, action.path(), &text, &fields)).into_response();
    };
    record(action, outcome, &form, principal.as_ref());
    let title = match outcome {
        Outcome::Done | Outcome::AlreadyDue => "Done",
        _ => "Refused",
    };
    let back = (outcome != Outcome::Done || action != Action::Expire).then_some(back.as_str());
    (
        outcome.status(),
        Html(pages::message(&frame, title, outcome.name(), &text, back)),
    )
        .into_response()
}

/// What the action comes to; `None` with the question to ask when it is not confirmed yet.
async fn decide(
    action: Action,
    console: &Console,
    headers: &HeaderMap,
    principal: Option<&Principal>,
    form: &ActionForm,
) -> (Option<Outcome>, String) {
    if !same_origin(headers) {
        return (
            Some(Outcome::RefusedCrossSite),
            "refused: the form was not posted from this console's own pages".to_owned(),
        );
    }
    if console.read_only {
        return (
            Some(Outcome::RefusedReadOnly),
            "refused: this console is read-only; it ends no lease and expires no key".to_owned(),
        );
    }
    if let Err(reason) = check(&form.tenant, &form.key) {
        return (Some(Outcome::Invalid), reason);
    }
    if !console.tenants_of(principal).allows(&form.tenant) {
        return (
            Some(Outcome::RefusedTenant),
            format!(
                "refused: this console does not show tenant {:?}'s keys to you",
                form.tenant
            ),
        );
    }
    let Ok(seen) = form.lock_version.parse::<i64>() else {
        return (
            Some(Outcome::Invalid),
            "lock_version: the token shown on the key's page, a whole number".to_owned(),
        );
    };
    let who = format!("key {:?} of tenant {:?}", form.key, form.tenant);
    let report = match console.operator.key_report(&form.tenant, &form.key).await {
        Ok(Some(report)) => report,
        Ok(None) => return (Some(Outcome::NotFound), format!("no {who}: it was deleted")),
        Err(error) => return (Some(Outcome::Failed), error.to_string()),
    };
    if form.state != "started" && form.state != "done" {
        return (
            Some(Outcome::Invalid),
            "state: the state shown on the key's page, started or done".to_owned(),
        );
    }
    if report.lock_version != seen || report.state != form.state {
        return (
            Some(Outcome::MovedOn),
            format!(
                "refused: {who} moved on since its page was read (token {seen}, {}; now {}, {}); \
                 look at it again",
                form.state, report.lock_version, report.state
            ),
        );
    }
    let live = report.lease_left_ms.is_some_and(|ms| ms > 0);
    let forced = form.force == "on";
    if form.confirmed != "yes" {
        return (None, question(action, &who, &report, live && forced));
    }
    match action {
        Action::EndLease => end_lease_of(console, &who, &report, live, forced).await,
        Action::Expire => expire_of(console, &who, &report, live, forced).await,
    }
}

fn question(action: Action, who: &str, report: &KeyReport, forced: bool) -> String {
    let force = if forced {
        " Its lease is live: you say its owner is gone."
    } else {
        ""
    };
    match action {
        Action::EndLease => format!(
            "End the lease of {who} (token {})? Its owner's writes are refused from then on, and \
             a resumer or the next retry takes it over.{force}",
            report.lock_version
        ),
        Action::Expire if report.state == "done" => format!(
            "Expire {who} now? Its stored response is deleted: the next request with this key \
             runs as a new one."
        ),
        Action::Expire => format!(
            "Expire {who} now, unfinished at recovery point {:?}? The next request with this key \
             runs from the first phase, and a foreign phase is called again with its derived \
             key.{force}",
            report.recovery_point
        ),
    }
}

async fn end_lease_of(
    console: &Console,
    who: &str,
    report: &KeyReport,
    live: bool,
    forced: bool,
) -> (Option<Outcome>, String) {
    if report.state == "done" {
        return (
            Some(Outcome::RefusedFinished),
            format!("refused: {who} is done; every retry replays its stored response"),
        );
    }
    if !live {
        return (
            Some(Outcome::AlreadyDue),
            format!(
                "nothing to end: the lease of {who} is over; it is due, and a resumer or the next \
                 retry takes it over"
            ),
        );
    }
    if !forced {
        return (
            Some(Outcome::RefusedLiveOwner),
            format!(
                "refused: the lease of {who} is live, so its owner may be running; tick \"the \
                 owner is gone\" only if it is"
            ),
        );
    }
    match console
        .operator
        .end_lease(&report.tenant, &report.key, report.lock_version)
        .await
    {
        Ok(Some(token)) => (
            Some(Outcome::Done),
            format!(
                "ended the lease of {who}: token {} -> {token}; the owner's writes are refused \
                 from now on, and a resumer or the next retry takes it over",
                report.lock_version
            ),
        ),
        Ok(None) => (
            Some(Outcome::MovedOn),
            format!("refused: {who} moved on meanwhile; look at it again"),
        ),
        Err(error) => (Some(Outcome::Failed), error.to_string()),
    }
}

async fn expire_of(
    console: &Console,
    who: &str,
    report: &KeyReport,
    live: bool,
    forced: bool,
) -> (Option<Outcome>, String) {
    if live && !forced {
        return (
            Some(Outcome::RefusedLiveOwner),
            format!(
                "refused: the lease of {who} is live, so its owner may be running; tick \"the \
                 owner is gone\" only if it is"
            ),
        );
    }
    match console
        .operator
        .expire_key(
            &report.tenant,
            &report.key,
            report.lock_version,
            &report.state,
        )
        .await
    {
        Ok(Some(_)) => (
            Some(Outcome::Done),
            format!("expired {who}: the next request with this key runs as a new one"),
        ),
        Ok(None) => (
            Some(Outcome::MovedOn),
            format!(
                "refused: {who} moved on meanwhile, or an owner is writing it right now; look at \
                 it again"
            ),
        ),
        Err(error) => (Some(Outcome::Failed), error.to_string()),
    }
}

/// Records an action. The form's fields are recorded as they came, valid or not (an invalid
/// one is what an operator looks for), so they are written escaped (`Debug`): a field holding a
/// line break would otherwise write a log line of its own, forged by whoever posted the form.
fn record(action: Action, outcome: Outcome, form: &ActionForm, principal: Option<&Principal>) {
    let principal = principal.map_or("unknown", |p| p.0.as_str());
    tracing::info!(
        target: "idemflow::console",
        action = action.name(),
        outcome = outcome.name(),
        tenant = ?form.tenant,
        key = ?form.key,
        lock_version = ?form.lock_version,
        forced = form.force == "on",
        principal = ?principal,
        "console action"
    );
    metrics::counter!(
        "idemflow_console_actions_total",
        "action" => action.name(),
        "outcome" => outcome.name(),
        "principal" => principal.to_owned(),
    )
    .increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().expect("header"));
        }
        map
    }

    #[test]
    fn only_the_consoles_own_pages_may_post() {
        assert!(same_origin(&headers(&[])));
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "same-site")])));
        assert!(same_origin(&headers(&[
            ("origin", "http://127.0.0.1:8080"),
            ("host", "127.0.0.1:8080")
        ])));
        assert!(!same_origin(&headers(&[
            ("origin", "https://evil.example"),
            ("host", "127.0.0.1:8080")
        ])));
        assert!(!same_origin(&headers(&[("origin", "null")])));
    }
}
