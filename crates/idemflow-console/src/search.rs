//! The search: filters an operator types (tenant, key or key prefix, workflow, state, age, last
//! error) applied to bounded pages of the primary key's range.
//!
//! Every page reads at most [`SCAN`] rows in key order from where the last one stopped, and shows
//! the first [`PAGE`] of them that match. With a tenant (and a key prefix) the scan walks only
//! that range; without, it walks the table in key order, and a rare match may take several pages
//! of "keep scanning". That is the price of never running a query an index does not bound: on a
//! table of millions of keys a page costs what it costs on a small one.

use idemflow_core::{Key, TenantId};
use idemflow_store::{KeyReport, ScanFrom};
use serde::Deserialize;

use idemflow_store::{Operator, OperatorError};

/// Rows read per page.
pub const SCAN: i64 = 500;
/// Matches shown per page.
pub const PAGE: usize = 50;

/// The search form, as the query string carries it. Empty fields are absent.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SearchForm {
    /// The tenant.
    #[serde(default)]
    pub tenant: String,
    /// A key, or a key's first characters with `prefix`.
    #[serde(default)]
    pub key: String,
    /// `on` when `key` is a prefix.
    #[serde(default)]
    pub prefix: String,
    /// A workflow's name.
    #[serde(default)]
    pub workflow: String,
    /// `started` or `done`.
    #[serde(default)]
    pub state: String,
    /// A minimum age: `90s`, `10m`, `2h`, `3d`.
    #[serde(default)]
    pub older_than: String,
    /// Text the last error contains (any case).
    #[serde(default)]
    pub error: String,
    /// Where the previous page stopped.
    #[serde(default)]
    pub after_tenant: String,
    /// Where the previous page stopped.
    #[serde(default)]
    pub after_key: String,
}

/// A search form that does not make sense, said plainly.
#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    /// A field's value is not one it takes.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The database failed.
    #[error("the database failed: {0}")]
    Database(#[from] OperatorError),
}

fn invalid(field: &'static str, reason: impl std::fmt::Display) -> SearchError {
    SearchError::Invalid {
        field,
        reason: reason.to_string(),
    }
}

/// A validated search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Search {
    tenant: Option<String>,
    key: Option<String>,
    prefix: bool,
    workflow: Option<String>,
    state: Option<String>,
    min_age_seconds: Option<i64>,
    error: Option<String>,
    after: Option<(String, String)>,
}

fn given(text: &str) -> Option<String> {
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

impl Search {
    /// Checks the form's fields: a tenant and key as the engine accepts them, a known state, an
    /// age it can read.
    pub fn parse(form: &SearchForm) -> Result<Self, SearchError> {
        let tenant = given(&form.tenant);
        if let Some(tenant) = &tenant {
            TenantId::new(tenant).map_err(|error| invalid("tenant", error))?;
        }
        // A key is kept as typed (keys are not trimmed), but a field of spaces is no key.
        let key = (!form.key.trim().is_empty()).then(|| form.key.clone());
        if let Some(key) = &key {
            Key::parse(key).map_err(|error| invalid("key", error))?;
        }
        let state = given(&form.state);
        if let Some(state) = &state
            && state != "started"
            && state != "done"
        {
            return Err(invalid("state", "started or done"));
        }
        let min_age_seconds = given(&form.older_than)
            .map(|text| {
                age_seconds(&text).ok_or_else(|| invalid("older than", "e.g. 90s, 10m, 2h, 3d"))
            })
            .transpose()?;
        let after = match (given(&form.after_tenant), form.after_key.is_empty()) {
            (Some(tenant), false) => Some((tenant, form.after_key.clone())),
            (None, true) => None,
            _ => return Err(invalid("after", "a position names a tenant and a key")),
        };
        Ok(Self {
            tenant,
            key,
            prefix: form.prefix == "on",
            workflow: given(&form.workflow),
            state,
            min_age_seconds,
            error: given(&form.error).map(|text| text.to_lowercase()),
            after,
        })
    }

    fn matches(&self, report: &KeyReport) -> bool {
        let key_matches = match (&self.key, self.prefix) {
            (None, _) => true,
            (Some(key), true) => report.key.starts_with(key.as_str()),
            (Some(key), false) => report.key == *key,
        };
        key_matches
            && self.workflow.as_ref().is_none_or(|w| report.workflow == *w)
            && self.state.as_ref().is_none_or(|s| report.state == *s)
            && self
                .min_age_seconds
                .is_none_or(|age| report.age_seconds >= age)
            && self.error.as_ref().is_none_or(|needle| {
                report
                    .last_error
                    .as_ref()
                    .is_some_and(|error| error.to_lowercase().contains(needle.as_str()))
            })
    }

    /// Where this page's scan starts.
    fn from(&self) -> ScanFrom {
        match (&self.after, &self.tenant) {
            (Some(after), tenant) => ScanFrom {
                tenant: tenant.clone(),
                after: after.clone(),
                inclusive: false,
            },
            (None, Some(tenant)) => ScanFrom {
                tenant: Some(tenant.clone()),
                // A tenant's keys from the prefix on (or the key itself): the range the index has.
                after: (tenant.clone(), self.key.clone().unwrap_or_default()),
                inclusive: true,
            },
            (None, None) => ScanFrom {
                tenant: None,
                after: (String::new(), String::new()),
                inclusive: true,
            },
        }
    }

    /// Whether a scan in key order is past every key that can match: a tenant's range is over
    /// once its keys no longer start with the prefix (or pass the exact key).
    fn past_the_range(&self, report: &KeyReport) -> bool {
        match (&self.tenant, &self.key) {
            (Some(tenant), Some(key)) => {
                report.tenant != *tenant
                    || (self.prefix && !report.key.starts_with(key.as_str()))
                    || (!self.prefix && report.key != *key)
            }
            _ => false,
        }
    }
}

/// A page of results.
#[derive(Debug, Clone)]
pub struct Found {
    /// The matches, in key order.
    pub keys: Vec<KeyReport>,
    /// Rows read for them.
    pub scanned: usize,
    /// Where the next page starts, when there may be more.
    pub next: Option<(String, String)>,
}

/// Runs one page of `search`, showing the keys of `tenants` only (another tenant's key is read,
/// as any row of the range is, and passed over).
pub async fn run(
    operator: &dyn Operator,
    search: &Search,
    tenants: &crate::Tenants,
) -> Result<Found, SearchError> {
    let rows = operator.scan_keys(&search.from(), SCAN).await?;
    let mut keys = Vec::new();
    let mut next = None;
    let mut scanned = 0;
    let mut ended = false;
    for report in &rows {
        if search.past_the_range(report) {
            ended = true;
            break;
        }
        scanned += 1;
        if search.matches(report) && tenants.allows(&report.tenant) {
            keys.push(report.clone());
            if keys.len() == PAGE {
                next = Some((report.tenant.clone(), report.key.clone()));
                break;
            }
        }
    }
    if next.is_none() && !ended && rows.len() as i64 == SCAN {
        next = rows
            .last()
            .map(|last| (last.tenant.clone(), last.key.clone()));
    }
    Ok(Found {
        keys,
        scanned,
        next,
    })
}

/// `90s`, `10m`, `2h`, `3d` in seconds.
fn age_seconds(text: &str) -> Option<i64> {
    let unit_at = text.find(|c: char| !c.is_ascii_digit())?;
    let (number, unit) = text.split_at(unit_at);
    let number: i64 = number.parse().ok()?;
    let scale = match unit.trim() {
        "s" => 1,
        "m" | "min" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return None,
    };
    number.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(fields: &[(&str, &str)]) -> SearchForm {
        let query: String = fields
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join("&");
        serde_json::from_value(serde_json::Value::Object(
            fields
                .iter()
                .map(|(n, v)| ((*n).to_owned(), serde_json::Value::String((*v).to_owned())))
                .collect(),
        ))
        .unwrap_or_else(|error| panic!("{query}: {error}"))
    }

    #[test]
    fn ages_read_in_their_units() {
        assert_eq!(age_seconds("90s"), Some(90));
        assert_eq!(age_seconds("10m"), Some(600));
        assert_eq!(age_seconds("2h"), Some(7200));
        assert_eq!(age_seconds("3d"), Some(259_200));
        assert_eq!(age_seconds("3"), None);
        assert_eq!(age_seconds("h"), None);
        assert_eq!(age_seconds("99999999999999999999d"), None);
    }

    #[test]
    fn bad_fields_are_named() {
        let bad = |fields: &[(&str, &str)]| match Search::parse(&form(fields)) {
            Err(SearchError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(bad(&[("state", "running")]), "state");
        assert_eq!(bad(&[("older_than", "soon")]), "older than");
        assert_eq!(bad(&[("key", "k\u{7f}")]), "key");
        assert_eq!(bad(&[("after_key", "k")]), "after");
    }

    #[test]
    fn a_tenants_prefix_scans_its_range_from_the_prefix() {
        let search = Search::parse(&form(&[("tenant", "t"), ("key", "ord-"), ("prefix", "on")]))
            .expect("ok");
        assert_eq!(
            search.from(),
            ScanFrom {
                tenant: Some("t".into()),
                after: ("t".into(), "ord-".into()),
                inclusive: true
            }
        );
    }
}
