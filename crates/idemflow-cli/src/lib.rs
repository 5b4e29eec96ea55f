//! The `idemflow` operator CLI as a library: each command is a function of an engine's
//! [`Operator`] that returns what to print and the exit code ([`Output`]), so tests call it
//! in-process; [`run`] parses a command line, opens the database its URL names with the engine
//! of that URL's scheme, and answers. The crate names no engine: the program that runs it (the
//! `idemflow` binary of the `idemflow` crate, feature `cli`) hands it the engines it was built
//! with. See `docs/cli.md`.
//!
//! Every command answers on stdout, in plain aligned text or, with [`Format::Json`], as one JSON
//! document. A command that cannot answer (bad input, no database, a database error) says why on
//! stderr in text mode, and as `{"error": {"kind", "message"}}` on stdout in JSON mode.
//!
//! Exit codes: [`exit::OK`] 0, [`exit::NO`] 1 (the key does not exist, its lease was not ended, or the
//! body is not JSON), [`exit::USAGE`] 2 (bad arguments, no database URL), [`exit::FAILURE`] 3 (the
//! database could not be reached or a statement failed).

#![deny(missing_docs)]

mod args;
pub mod console;
pub mod duration;
mod render;

use std::fmt;
use std::time::Duration;

use idemflow_core::FieldValue;
use idemflow_core::{CanonicalError, Fingerprint, Key, TenantId, canonicalize_exact};
use idemflow_store::layout::PartitionPlan;
use idemflow_store::{
    KeyBodies, KeyReport, KeyResponse, Operator, OperatorEngine, OperatorError, OperatorOptions,
    TableStats,
};
use serde::Serialize;

pub use args::{main, run, run_with};
pub use duration::{DurationError, parse_duration};

use duration::{human, human_elapsed_ms, lease};
use render::{fields, plain, table, truncate};

/// Exit codes.
pub mod exit {
    /// The command did what was asked.
    pub const OK: u8 = 0;
    /// The answer is no: the key does not exist, its lease was not ended, the body is not JSON, or
    /// partition maintenance kept a partition past the window for its started keys.
    pub const NO: u8 = 1;
    /// The command line is wrong: a bad argument, or no database URL.
    pub const USAGE: u8 = 2;
    /// The database could not be reached, or a statement or migration failed.
    pub const FAILURE: u8 = 3;
}

/// How a command answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Aligned plain text, no colours.
    Human,
    /// One JSON document.
    Json,
}

/// What a command prints, and how the process exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// The process's exit code: one of [`exit`]'s.
    pub code: u8,
    /// What to print on stdout: the answer, or in JSON mode the error document.
    pub stdout: String,
    /// What to print on stderr: the error, in text mode; empty otherwise.
    pub stderr: String,
}

/// Why a command could not answer.
#[derive(Debug)]
pub enum CliError {
    /// A bad argument, or no database URL.
    Usage(String),
    /// The key asked about does not exist.
    NotFound {
        /// The tenant asked about.
        tenant: String,
        /// The key asked about.
        key: String,
    },
    /// The body given to `fingerprint` is not canonicalizable JSON.
    InvalidBody(CanonicalError),
    /// The database could not be reached, or a statement failed.
    Database(String),
}

impl CliError {
    /// A stable name for scripts, the `kind` of the JSON error document.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Usage(_) => "usage",
            Self::NotFound { .. } => "not_found",
            Self::InvalidBody(_) => "invalid_body",
            Self::Database(_) => "database",
        }
    }

    /// The exit code it ends the process with: [`exit::USAGE`], [`exit::NO`] or
    /// [`exit::FAILURE`].
    pub fn code(&self) -> u8 {
        match self {
            Self::Usage(_) => exit::USAGE,
            Self::NotFound { .. } | Self::InvalidBody(_) => exit::NO,
            Self::Database(_) => exit::FAILURE,
        }
    }

    /// The error as a command's output.
    pub fn output(&self, format: Format) -> Output {
        match format {
            Format::Human => Output {
                code: self.code(),
                stdout: String::new(),
                stderr: format!("error: {self}\n"),
            },
            Format::Json => Output {
                code: self.code(),
                stdout: json(&serde_json::json!({
                    "error": { "kind": self.kind(), "message": self.to_string() }
                })),
                stderr: String::new(),
            },
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Usage(message) | Self::Database(message) => formatter.write_str(message),
            Self::NotFound { tenant, key } => {
                write!(formatter, "no key {key:?} for tenant {tenant:?}")
            }
            Self::InvalidBody(error) => write!(formatter, "{error}"),
        }
    }
}

impl std::error::Error for CliError {}

impl From<OperatorError> for CliError {
    fn from(error: OperatorError) -> Self {
        match error {
            OperatorError::Usage(message) | OperatorError::Unsupported(message) => {
                Self::Usage(message)
            }
            OperatorError::Connect(message) => Self::Database(message),
            error if error.is_no_schema() => Self::Database(format!(
                "{error} (run `idemflow migrate` to create the schema)"
            )),
            other => Self::Database(other.to_string()),
        }
    }
}

/// A command's answer in both formats; [`emit`] picks one.
struct Answer {
    code: u8,
    human: String,
    json: String,
}

impl Answer {
    fn new(code: u8, human: String, value: &impl Serialize) -> Self {
        Self {
            code,
            human,
            json: json(value),
        }
    }
}

/// One JSON document, safe for a terminal: serde_json escapes the C0 controls, and DEL and the
/// C1 controls (a stored body may hold them) are escaped too, so the document is still the same
/// JSON value and nothing in it can drive the terminal it is printed on.
fn json(value: &impl Serialize) -> String {
    let text = serde_json::to_string_pretty(value)
        .expect("the CLI's reports serialize: plain structs with string keys");
    let mut text = terminal_safe_json(&text);
    text.push('\n');
    text
}

fn emit(format: Format, answer: Result<Answer, CliError>) -> Output {
    match answer {
        Ok(answer) => Output {
            code: answer.code,
            stdout: match format {
                Format::Human => answer.human,
                Format::Json => answer.json,
            },
            stderr: String::new(),
        },
        Err(error) => error.output(format),
    }
}

/// The database URL: `--database-url` if given, else the `DATABASE_URL` environment variable.
pub fn database_url(flag: Option<String>, env: Option<String>) -> Result<String, CliError> {
    flag.or(env).filter(|url| !url.is_empty()).ok_or_else(|| {
        CliError::Usage(
            "no database: pass --database-url postgres://... or set DATABASE_URL".to_owned(),
        )
    })
}

/// The environment variable naming the prefix of the keys, on an engine that namespaces them by
/// one (Redis; default `idemflow`).
pub const PREFIX_ENV: &str = "IDEMFLOW_REDIS_PREFIX";

/// Opens the database `url` names, with the engine among `engines` whose scheme it has, for one
/// command: a small pool, its connections named `idemflow-cli` where the engine shows names.
pub async fn open(
    url: &str,
    engines: &[&dyn OperatorEngine],
    options: &OperatorOptions,
) -> Result<Box<dyn Operator>, CliError> {
    let Some(engine) = idemflow_store::engine_for(engines, url) else {
        let known: Vec<&str> = engines
            .iter()
            .flat_map(|engine| engine.schemes().iter().copied())
            .collect();
        return Err(CliError::Usage(format!(
            "no engine for this URL: it must start with one of {} (this build's engines)",
            known
                .iter()
                .map(|scheme| format!("{scheme}://"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    Ok(engine.open(url, options).await?)
}

/// The options one command opens its database with.
pub fn command_options() -> OperatorOptions {
    OperatorOptions::default()
        .with_application_name("idemflow-cli".to_owned())
        .with_key_prefix(std::env::var(PREFIX_ENV).ok())
}

fn validate(tenant: &str, key: &str) -> Result<(), CliError> {
    TenantId::new(tenant).map_err(|error| CliError::Usage(error.to_string()))?;
    Key::parse(key).map_err(|error| CliError::Usage(error.to_string()))?;
    Ok(())
}

fn who(tenant: &str, key: &str) -> String {
    format!("key {key:?} of tenant {tenant:?}")
}

// ---------------------------------------------------------------------------------------------
// migrate

/// `idemflow migrate`: applies every pending migration, then lists the schema's migrations.
pub async fn migrate(operator: &dyn Operator, format: Format) -> Output {
    emit(format, migrate_answer(operator).await)
}

async fn migrate_answer(operator: &dyn Operator) -> Result<Answer, CliError> {
    let Some(migrations) = operator.migrate().await? else {
        let human = format!("{} has no schema: nothing to migrate\n", operator.engine());
        return Ok(Answer::new(
            exit::OK,
            human,
            &serde_json::json!({ "migrations": [] }),
        ));
    };
    let mut human = "schema up to date; migrations applied:\n".to_owned();
    for migration in &migrations {
        human.push_str(&format!(
            "  {}  {}\n",
            migration.version, migration.description
        ));
    }
    Ok(Answer::new(
        exit::OK,
        human,
        &serde_json::json!({ "migrations": migrations }),
    ))
}

// ---------------------------------------------------------------------------------------------
// inspect

fn response_summary(report: &KeyReport) -> String {
    match (report.response_status, report.response_bytes) {
        (Some(status), Some(bytes)) => format!("{status}, {bytes} bytes"),
        (Some(status), None) => status.to_string(),
        _ => "-".to_owned(),
    }
}

fn lease_summary(report: &KeyReport) -> String {
    report.lease_left_ms.map_or_else(|| "-".to_owned(), lease)
}

fn age(report: &KeyReport) -> String {
    human(u64::try_from(report.age_seconds).unwrap_or(0))
}

fn inspect_text(report: &KeyReport, expiry: &Expiry) -> String {
    fields(&[
        ("tenant", plain(&report.tenant)),
        ("key", plain(&report.key)),
        ("workflow", plain(&report.workflow)),
        ("state", plain(&report.state)),
        ("recovery point", plain(&report.recovery_point)),
        ("lease", lease_summary(report)),
        ("lock_version", report.lock_version.to_string()),
        ("attempts", report.attempts.to_string()),
        (
            "last error",
            report
                .last_error
                .as_deref()
                .map_or_else(|| "-".to_owned(), plain),
        ),
        ("response", response_summary(report)),
        ("fingerprint", report.fingerprint_hex.clone()),
        ("age", age(report)),
        ("expiry", expiry.text.clone()),
    ])
}

/// What `inspect` shows beyond the key's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InspectOptions {
    /// Show the stored request (`--show-request`).
    pub show_request: bool,
    /// Show the stored response: status, headers and body (`--show-response`).
    pub show_response: bool,
    /// The retention period the time left before expiry is told against (`--retention`);
    /// `None`: the runner's default ([`idemflow_runner::Retention`], 24 hours), said as such.
    pub retention: Option<Duration>,
}

/// Bodies longer than this many bytes are cut in the text answer (JSON has them whole): a
/// terminal is no place for megabytes.
const SHOWN_BYTES: usize = 4096;

/// Where a key stands with retention.
struct Expiry {
    /// Seconds until retention may delete it (zero or less: due now); `None` while started.
    expires_in_seconds: Option<i64>,
    text: String,
}

/// When retention deletes the key: once it finished more than `retention` ago (its window starts
/// at the finish, not the claim). The CLI cannot know the period retention runs with, so it is
/// given (`--retention`), or the runner's default is said to be assumed.
fn expiry(bodies: &KeyBodies, retention: Option<Duration>) -> Expiry {
    let (period, assumed) = match retention {
        Some(period) => (period, ""),
        None => (
            idemflow_runner::Retention::default().keep_for,
            ", the runner's default",
        ),
    };
    let Some(finished) = bodies.finished_seconds_ago else {
        return Expiry {
            expires_in_seconds: None,
            text: "not expired while started".to_owned(),
        };
    };
    let period_seconds = i64::try_from(period.as_secs()).unwrap_or(i64::MAX);
    let left = period_seconds.saturating_sub(finished);
    let why = format!(
        "finished {} ago; retention {}{assumed}",
        human(u64::try_from(finished).unwrap_or(0)),
        human(period.as_secs())
    );
    Expiry {
        expires_in_seconds: Some(left),
        text: if left > 0 {
            format!("expires in ~{} ({why})", human(left.unsigned_abs()))
        } else {
            format!("due for expiry ({why})")
        },
    }
}

/// `inspect`'s JSON: the key's report, its expiry, and what was asked to be shown.
#[derive(Serialize)]
struct InspectReport<'a> {
    #[serde(flatten)]
    report: &'a KeyReport,
    finished_seconds_ago: Option<i64>,
    retention_seconds: u64,
    expires_in_seconds: Option<i64>,
    /// Present with `--show-request`.
    #[serde(skip_serializing_if = "Option::is_none")]
    request: Option<RequestView<'a>>,
    /// Present with `--show-response`: `null` while started.
    #[serde(skip_serializing_if = "Option::is_none")]
    response: Option<Option<ResponseView<'a>>>,
}

#[derive(Serialize)]
struct RequestView<'a> {
    /// The key id it is sealed under; its JSON is then not shown (never decrypted here).
    sealed_under: Option<&'a str>,
    json: Option<&'a serde_json::Value>,
}

#[derive(Serialize)]
struct ResponseView<'a> {
    status: u16,
    /// The key id headers and body are sealed under; they are then not shown.
    sealed_under: Option<&'a str>,
    headers: Option<&'a [(String, FieldValue)]>,
    /// The body's length as stored (sealed: the ciphertext's).
    body_bytes: usize,
    body_apart: bool,
    /// `utf8` (the body is the text itself) or `base64` (it is not UTF-8).
    body_encoding: Option<&'static str>,
    body: Option<String>,
}

fn request_view(bodies: &KeyBodies) -> RequestView<'_> {
    match bodies.request_sealed_under() {
        Some(key_id) => RequestView {
            sealed_under: Some(key_id),
            json: None,
        },
        None => RequestView {
            sealed_under: None,
            json: Some(&bodies.request),
        },
    }
}

fn response_view(response: &KeyResponse) -> ResponseView<'_> {
    let sealed_under = response.sealed_under();
    let (headers, body_encoding, body) = if sealed_under.is_some() {
        (None, None, None)
    } else {
        match std::str::from_utf8(&response.body) {
            Ok(text) => (
                Some(response.headers.as_slice()),
                Some("utf8"),
                Some(text.to_owned()),
            ),
            Err(_) => (
                Some(response.headers.as_slice()),
                Some("base64"),
                Some(base64(&response.body)),
            ),
        }
    };
    ResponseView {
        status: response.status,
        sealed_under,
        headers,
        body_bytes: response.body.len(),
        body_apart: response.apart,
        body_encoding,
        body,
    }
}

/// Standard padded base64, as the store writes bytes in JSON (`idemflow_core::bytes`).
fn base64(bytes: &[u8]) -> String {
    match idemflow_core::bytes::serialize(bytes, serde_json::value::Serializer) {
        Ok(serde_json::Value::String(text)) => text,
        _ => unreachable!("bytes serialize as one JSON string"),
    }
}

const NOT_DECRYPTED: &str = "not decrypted: this tool holds no keyring";

/// The stored request, for the text answer: its JSON, pretty, cut at [`SHOWN_BYTES`].
fn request_text(bodies: &KeyBodies) -> String {
    if let Some(key_id) = bodies.request_sealed_under() {
        return format!(
            "\nrequest\nsealed under key {} ({NOT_DECRYPTED})\n",
            plain(key_id)
        );
    }
    let pretty = serde_json::to_string_pretty(&bodies.request).expect("a JSON value serializes");
    let mut text = "\nrequest\n".to_owned();
    let shown = cut(&pretty, SHOWN_BYTES);
    // serde_json escaped every C0 control; DEL and the C1 controls are escaped as JSON would.
    text.push_str(&terminal_safe_json(shown));
    text.push('\n');
    if shown.len() < pretty.len() {
        text.push_str(&format!(
            "... truncated: {} of {} bytes shown (--json shows the whole request)\n",
            shown.len(),
            pretty.len()
        ));
    }
    text
}

/// The stored response, for the text answer: the status and what the body is, the headers, then
/// the body (text as it is, control characters but newlines and tabs escaped; bytes that are not
/// UTF-8 as base64), cut at [`SHOWN_BYTES`].
fn response_text(response: Option<&KeyResponse>) -> String {
    let Some(response) = response else {
        return "\nresponse\n- (started: no response is stored yet)\n".to_owned();
    };
    let bytes = response.body.len();
    let apart = if response.apart { ", stored apart" } else { "" };
    if let Some(key_id) = response.sealed_under() {
        return format!(
            "\nresponse {}, sealed under key {}: headers and body ({bytes} bytes{apart}), \
             {NOT_DECRYPTED}\n",
            response.status,
            plain(key_id)
        );
    }
    let text = std::str::from_utf8(&response.body).ok();
    let mut out = format!(
        "\nresponse {}, body {bytes} bytes{apart}{}\n",
        response.status,
        if text.is_none() {
            ", not UTF-8: shown as base64"
        } else {
            ""
        }
    );
    for (name, value) in &response.headers {
        out.push_str(&format!("{}: {}\n", plain(name), header_value(value)));
    }
    if bytes == 0 {
        return out;
    }
    out.push('\n');
    let shown = match text {
        Some(text) => {
            let shown = cut(text, SHOWN_BYTES);
            out.push_str(&body_text(shown));
            shown.len()
        }
        None => {
            let shown = &response.body[..bytes.min(SHOWN_BYTES)];
            let encoded = base64(shown);
            // Lines of 76 characters, as MIME writes base64.
            for line in encoded.as_bytes().chunks(76) {
                out.push_str(&String::from_utf8_lossy(line));
                out.push('\n');
            }
            shown.len()
        }
    };
    if !out.ends_with('\n') {
        out.push('\n');
    }
    if shown < bytes {
        out.push_str(&format!(
            "... truncated: {shown} of {bytes} bytes shown (--json shows the whole body)\n"
        ));
    }
    out
}

/// The longest start of `text` of at most `max` bytes that ends on a character boundary.
fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A body's text for a terminal: newlines and tabs kept (a body is often several lines), every
/// other control character (an escape sequence, a carriage return) shown escaped.
fn body_text(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A header value as stored: text with control characters escaped, or its bytes escaped when it
/// is not UTF-8 (HTTP allows bytes 0x80-0xFF in a value).
fn header_value(value: &FieldValue) -> String {
    match value.to_str() {
        Some(text) => plain(text),
        None => value.as_bytes().escape_ascii().to_string(),
    }
}

/// `idemflow inspect --tenant T --key K`: everything about one key. Exit 1 when it does not exist.
pub async fn inspect(operator: &dyn Operator, format: Format, tenant: &str, key: &str) -> Output {
    inspect_with(operator, format, tenant, key, &InspectOptions::default()).await
}

/// `idemflow inspect` with its options: the stored request and response
/// (`--show-request`, `--show-response`), and the retention period its expiry is told against.
pub async fn inspect_with(
    operator: &dyn Operator,
    format: Format,
    tenant: &str,
    key: &str,
    options: &InspectOptions,
) -> Output {
    emit(format, inspect_answer(operator, tenant, key, options).await)
}

async fn inspect_answer(
    keys: &dyn Operator,
    tenant: &str,
    key: &str,
    options: &InspectOptions,
) -> Result<Answer, CliError> {
    validate(tenant, key)?;
    let not_found = || CliError::NotFound {
        tenant: tenant.to_owned(),
        key: key.to_owned(),
    };
    let report = keys.key_report(tenant, key).await?.ok_or_else(not_found)?;
    // A second read: retention may delete the key in between, and then it is gone.
    let bodies = keys.key_bodies(tenant, key).await?.ok_or_else(not_found)?;
    let expiry = expiry(&bodies, options.retention);
    let mut human = inspect_text(&report, &expiry);
    if options.show_request {
        human.push_str(&request_text(&bodies));
    }
    if options.show_response {
        human.push_str(&response_text(bodies.response.as_ref()));
    }
    let document = InspectReport {
        report: &report,
        finished_seconds_ago: bodies.finished_seconds_ago,
        retention_seconds: options
            .retention
            .unwrap_or(idemflow_runner::Retention::default().keep_for)
            .as_secs(),
        expires_in_seconds: expiry.expires_in_seconds,
        request: options.show_request.then(|| request_view(&bodies)),
        response: options
            .show_response
            .then(|| bodies.response.as_ref().map(response_view)),
    };
    Ok(Answer::new(exit::OK, human, &document))
}

// ---------------------------------------------------------------------------------------------
// fingerprint

#[derive(Serialize)]
struct FingerprintReport<'a> {
    method: &'a str,
    path: &'a str,
    canonical: &'a str,
    fingerprint: String,
}

/// `idemflow fingerprint --method M --path P` with the body on stdin: its RFC 8785 canonical
/// form and the fingerprint a request with it gets. Two bodies that print the same fingerprint
/// are the same request; exit 1 when the body is not JSON the runner accepts.
pub fn fingerprint(format: Format, method: &str, path: &str, body: &[u8]) -> Output {
    emit(format, fingerprint_answer(method, path, body))
}

fn fingerprint_answer(method: &str, path: &str, body: &[u8]) -> Result<Answer, CliError> {
    // As the engine reads a request: a number the canonical form would change is refused.
    let canonical = canonicalize_exact(body).map_err(CliError::InvalidBody)?;
    let fingerprint = Fingerprint::of_canonical_json(method, path, &canonical);
    // canonicalize() accepts UTF-8 only and writes UTF-8.
    let canonical = String::from_utf8_lossy(&canonical);
    let report = FingerprintReport {
        method,
        path,
        canonical: &canonical,
        fingerprint: fingerprint.to_hex(),
    };
    let human = fields(&[
        ("method", plain(method)),
        ("path", plain(path)),
        // The canonical text, not `plain`'s Rust-style escapes: RFC 8785 has escaped every C0
        // control already (`\n`, `\u001b`); DEL and the C1 controls (U+0080 to U+009F), which
        // it writes as they are and a terminal may act on, are escaped as JSON would
        // (`\u007f`): still JSON text with the same value, and one line.
        ("canonical", terminal_safe_json(&canonical)),
        ("fingerprint", report.fingerprint.clone()),
    ]);
    Ok(Answer::new(exit::OK, human, &report))
}

// ---------------------------------------------------------------------------------------------
// list --stuck

/// `idemflow list --stuck`: started keys past their lease or with at least `min_attempts`
/// attempts, oldest lease first, at most `limit`.
pub async fn list_stuck(
    operator: &dyn Operator,
    format: Format,
    min_attempts: i32,
    limit: i64,
) -> Output {
    emit(
        format,
        list_stuck_answer(operator, min_attempts, limit).await,
    )
}

async fn list_stuck_answer(
    store: &dyn Operator,
    min_attempts: i32,
    limit: i64,
) -> Result<Answer, CliError> {
    let keys = store.stuck_keys(min_attempts, limit).await?;
    let human = if keys.is_empty() {
        format!(
            "no stuck keys (no started key is past its lease or has {min_attempts} attempts or more)\n"
        )
    } else {
        let rows: Vec<Vec<String>> = keys
            .iter()
            .map(|report| {
                vec![
                    plain(&report.tenant),
                    plain(&report.key),
                    plain(&report.workflow),
                    plain(&report.recovery_point),
                    lease_summary(report),
                    report.attempts.to_string(),
                    age(report),
                    report
                        .last_error
                        .as_deref()
                        .map_or_else(|| "-".to_owned(), |error| truncate(&plain(error), 60)),
                ]
            })
            .collect();
        let mut text = table(
            &[
                "TENANT",
                "KEY",
                "WORKFLOW",
                "RECOVERY POINT",
                "LEASE",
                "ATTEMPTS",
                "AGE",
                "LAST ERROR",
            ],
            &rows,
        );
        if i64::try_from(keys.len()).unwrap_or(i64::MAX) >= limit {
            text.push_str(&format!(
                "showing the first {limit}: more may be stuck (raise --limit)\n"
            ));
        }
        text
    };
    Ok(Answer::new(exit::OK, human, &keys))
}

// ---------------------------------------------------------------------------------------------
// end-lease

/// What `end-lease` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum EndLeaseOutcome {
    /// The lease ended now and the fence advanced; idle resumers were woken.
    Ended,
    /// The lease is live: its owner may be running. Refused without `--force`.
    LiveOwner,
    /// The lease had already expired: the key is due, nothing to do.
    AlreadyDue,
    NotFound,
    Done,
    /// Another owner took the key over between the read and the end of the lease.
    MovedOn,
}

#[derive(Serialize)]
struct EndLeaseReport<'a> {
    tenant: &'a str,
    key: &'a str,
    outcome: EndLeaseOutcome,
    /// The fencing token the lease was ended with (or refused for).
    lock_version: Option<i64>,
    /// The key's token after the lease was ended: the fence advanced past the old owner's.
    new_lock_version: Option<i64>,
    message: String,
}

/// `idemflow end-lease --tenant T --key K [--force]` (`release`, its old name, still works): ends a
/// started key's lease now, so a resumer or the next retry takes it over at once. A live lease
/// means its owner may be running: refused unless `force`, which asserts the owner is gone. Fenced:
/// the lease is ended only if the key's lock_version is still the one just read, and the fence
/// advances past it, so that owner's writes are refused from then on (a phase it is in goes on:
/// see docs/cli.md). Exit 1 when no lease was ended (no such key, done, taken over, a live owner
/// without `force`); exit 0 when it was, or when the lease had already expired.
pub async fn end_lease(
    operator: &dyn Operator,
    format: Format,
    tenant: &str,
    key: &str,
    force: bool,
) -> Output {
    emit(format, end_lease_answer(operator, tenant, key, force).await)
}

async fn end_lease_answer(
    keys: &dyn Operator,
    tenant: &str,
    key: &str,
    force: bool,
) -> Result<Answer, CliError> {
    validate(tenant, key)?;
    let who = who(tenant, key);
    let mut new_lock_version = None;
    let (outcome, lock_version, message) = match keys.key_report(tenant, key).await? {
        None => (
            EndLeaseOutcome::NotFound,
            None,
            format!("lease not ended: no key {key:?} for tenant {tenant:?}"),
        ),
        Some(report) if report.state == "done" => done(&who, &report),
        Some(report) if report.lease_left_ms.is_some_and(|ms| ms <= 0) => (
            EndLeaseOutcome::AlreadyDue,
            Some(report.lock_version),
            format!(
                "nothing to end: the lease of {who} {}; it is due now: {}",
                lease_summary(&report),
                who_takes_over(&report.workflow),
            ),
        ),
        Some(report) if !force => (
            EndLeaseOutcome::LiveOwner,
            Some(report.lock_version),
            format!(
                "lease not ended: the lease of {who} is live ({}), so its owner may be running \
                 now (lock_version {}). \
                 Wait for the lease to end, or pass --force if the owner is known to be gone: \
                 its writes are then refused, but a phase it is in goes on, and a plain handler \
                 may run beside the next owner's",
                lease_summary(&report),
                report.lock_version,
            ),
        ),
        Some(report) => {
            let lock_version = report.lock_version;
            if let Some(advanced) = keys.end_lease(tenant, key, lock_version).await? {
                new_lock_version = Some(advanced);
                (
                    EndLeaseOutcome::Ended,
                    Some(lock_version),
                    format!(
                        "ended the lease of {who} and advanced its fence (lock_version \
                         {lock_version} -> {advanced}): the owner's writes are refused from now \
                         on; it is due now: {}",
                        who_takes_over(&report.workflow),
                    ),
                )
            } else {
                // Refused: read the key again to say why.
                match keys.key_report(tenant, key).await? {
                    None => (
                        EndLeaseOutcome::NotFound,
                        Some(lock_version),
                        format!("lease not ended: {who} was deleted meanwhile"),
                    ),
                    Some(now) if now.state == "done" => done(&who, &now),
                    Some(now) => (
                        EndLeaseOutcome::MovedOn,
                        Some(lock_version),
                        format!(
                            "lease not ended: {who} was taken over meanwhile (lock_version \
                                 {lock_version}, now {}); inspect it again",
                            now.lock_version
                        ),
                    ),
                }
            }
        }
    };
    let code = match outcome {
        EndLeaseOutcome::Ended | EndLeaseOutcome::AlreadyDue => exit::OK,
        EndLeaseOutcome::NotFound
        | EndLeaseOutcome::Done
        | EndLeaseOutcome::MovedOn
        | EndLeaseOutcome::LiveOwner => exit::NO,
    };
    let human = format!("{message}\n");
    let report = EndLeaseReport {
        tenant,
        key,
        outcome,
        lock_version,
        new_lock_version,
        message,
    };
    Ok(Answer::new(code, human, &report))
}

/// Who takes a due key over. Nothing in the database says which workflows the resumers run, nor
/// whether a workflow is live-only (a plain-handler route's: no resumer may run it, as it needs
/// the live request), so the answer names both ways, and is true whichever holds: the request's
/// next retry always can, a resumer only for a workflow it runs.
fn who_takes_over(workflow: &str) -> String {
    format!(
        "the next retry of the request takes it over, or a resumer that runs workflow {:?} \
         (none runs a live-only workflow, such as a plain-handler route's: its keys wait for \
         that retry)",
        plain(workflow)
    )
}

fn done(who: &str, report: &KeyReport) -> (EndLeaseOutcome, Option<i64>, String) {
    (
        EndLeaseOutcome::Done,
        Some(report.lock_version),
        format!(
            "lease not ended: {who} is done; every retry replays its stored response ({})",
            response_summary(report)
        ),
    )
}

// ---------------------------------------------------------------------------------------------
// expire

#[derive(Serialize)]
struct ExpireReport {
    deleted: u64,
    older_than_seconds: u64,
    batch_size: i64,
}

/// `idemflow expire --older-than D`: deletes every key finished more than `older_than`
/// ago, `batch_size` rows per transaction (per script on Redis), back to back, so requests'
/// writes interleave with it. Started keys are never deleted.
pub async fn expire(
    operator: &dyn Operator,
    format: Format,
    older_than: Duration,
    batch_size: i64,
) -> Output {
    emit(
        format,
        expire_answer(operator, older_than, batch_size).await,
    )
}

async fn expire_answer(
    operator: &dyn Operator,
    older_than: Duration,
    batch_size: i64,
) -> Result<Answer, CliError> {
    if batch_size < 1 {
        return Err(CliError::Usage(
            "--batch-size must be at least 1".to_owned(),
        ));
    }
    let deleted = idemflow_store::retention::paced(batch_size, None, |batch| {
        operator.expire_batch(older_than, batch)
    })
    .await?;
    Ok(expired(deleted, older_than, batch_size))
}

/// `expire`'s answer, whatever the engine.
fn expired(deleted: u64, older_than: Duration, batch_size: i64) -> Answer {
    let noun = if deleted == 1 { "key" } else { "keys" };
    let human = format!(
        "deleted {deleted} {noun} finished more than {} ago\n",
        human(older_than.as_secs())
    );
    let report = ExpireReport {
        deleted,
        older_than_seconds: older_than.as_secs(),
        batch_size,
    };
    Answer::new(exit::OK, human, &report)
}

// ---------------------------------------------------------------------------------------------
// partitions

/// `idemflow partitions adopt`: converts the keys table to the partitioned layout (as its owner).
pub async fn partitions_adopt(
    operator: &dyn Operator,
    format: Format,
    width: Duration,
    ahead: u32,
) -> Output {
    emit(
        format,
        partitions_adopt_answer(operator, width, ahead).await,
    )
}

/// The engine's partitioned layout, or the answer that it has none.
fn partitions_of(operator: &dyn Operator) -> Result<&dyn idemflow_store::Partitions, CliError> {
    operator.partitions().ok_or_else(|| {
        CliError::Usage(format!(
            "`idemflow partitions` is PostgreSQL's only: the partitioned layout has no {} form \
             (docs/engines.md)",
            operator.engine()
        ))
    })
}

async fn partitions_adopt_answer(
    operator: &dyn Operator,
    width: Duration,
    ahead: u32,
) -> Result<Answer, CliError> {
    let plan = PartitionPlan { width, ahead };
    let adopted = partitions_of(operator)?.adopt(&plan).await?;
    let human = format!(
        "the keys table is partitioned by creation time, {} per partition: {} partitions, {} keys copied\n",
        human(width.as_secs()),
        adopted.partitions,
        adopted.keys
    );
    Ok(Answer::new(exit::OK, human, &adopted))
}

/// `idemflow partitions maintain --keep-for D`: creates the partitions due ahead and drops
/// those whose every key finished more than `keep_for` ago (as the table's owner). Exits with
/// [`exit::NO`] when a partition past the window is kept for its started keys: a scheduler that
/// runs it alerts on that.
pub async fn partitions_maintain(
    operator: &dyn Operator,
    format: Format,
    keep_for: Duration,
) -> Output {
    emit(format, partitions_maintain_answer(operator, keep_for).await)
}

async fn partitions_maintain_answer(
    operator: &dyn Operator,
    keep_for: Duration,
) -> Result<Answer, CliError> {
    let maintained = partitions_of(operator)?.maintain(keep_for).await?;
    let mut human = String::new();
    if maintained.skipped {
        human.push_str("another maintenance is running; nothing done\n");
    }
    for name in &maintained.created {
        human.push_str(&format!("created {name}\n"));
    }
    for dropped in &maintained.dropped {
        human.push_str(&format!(
            "dropped {} ({} keys, {} bodies apart)\n",
            dropped.name, dropped.keys, dropped.bodies_apart
        ));
    }
    for kept in &maintained.kept {
        human.push_str(&format!(
            "kept {}: past the window, it holds {} started keys\n",
            kept.name, kept.started_keys
        ));
    }
    if !maintained.skipped {
        human.push_str(&format!("{} partitions ahead\n", maintained.ahead));
    }
    let code = if maintained.kept.is_empty() {
        exit::OK
    } else {
        exit::NO
    };
    Ok(Answer::new(code, human, &maintained))
}

/// `idemflow partitions list`: the partitions of the keys table, oldest first.
pub async fn partitions_list(operator: &dyn Operator, format: Format) -> Output {
    emit(format, partitions_list_answer(operator).await)
}

async fn partitions_list_answer(operator: &dyn Operator) -> Result<Answer, CliError> {
    let Some(partitions) = partitions_of(operator)?.list().await? else {
        return Err(CliError::Usage(
            "the keys table is not partitioned (see `idemflow partitions adopt`)".to_owned(),
        ));
    };
    let rows: Vec<Vec<String>> = partitions
        .iter()
        .map(|partition| {
            vec![
                plain(&partition.name),
                partition.from.clone(),
                partition.to.clone(),
                if partition.detaching {
                    "detaching"
                } else {
                    "attached"
                }
                .to_owned(),
            ]
        })
        .collect();
    let human = table(&["PARTITION", "FROM", "TO", "STATE"], &rows);
    Ok(Answer::new(exit::OK, human, &partitions))
}

// ---------------------------------------------------------------------------------------------
// stats

fn stats_text(stats: &TableStats) -> String {
    let mut text = if stats.counts.is_empty() {
        "no keys\n".to_owned()
    } else {
        let rows: Vec<Vec<String>> = stats
            .counts
            .iter()
            .map(|(workflow, state, count)| vec![plain(workflow), plain(state), count.to_string()])
            .collect();
        table(&["WORKFLOW", "STATE", "KEYS"], &rows)
    };
    text.push('\n');
    text.push_str(&fields(&[
        (
            "oldest started key",
            stats.oldest_started_seconds.map_or_else(
                || "- (no started key)".to_owned(),
                |seconds| human(u64::try_from(seconds).unwrap_or(0)),
            ),
        ),
        (
            "resumer lag",
            if stats.resumer_lag_ms == 0 {
                "0s (no key is due)".to_owned()
            } else {
                human_elapsed_ms(stats.resumer_lag_ms)
            },
        ),
    ]));
    text
}

/// `idemflow stats`: keys by workflow and state, the age of the oldest started key, and how far
/// behind the resumers are (the oldest expired lease of a started key).
pub async fn stats(operator: &dyn Operator, format: Format) -> Output {
    emit(format, stats_answer(operator).await)
}

async fn stats_answer(operator: &dyn Operator) -> Result<Answer, CliError> {
    let stats = operator.table_stats().await?;
    Ok(stats_of(&stats))
}

/// `stats`' JSON: the library's [`TableStats`] with each count an object, so a script reads
/// `workflow`, `state` and `keys` by name rather than by position in a tuple.
#[derive(Serialize)]
struct StatsReport<'a> {
    counts: Vec<CountReport<'a>>,
    oldest_started_seconds: Option<i64>,
    resumer_lag_ms: i64,
}

#[derive(Serialize)]
struct CountReport<'a> {
    workflow: &'a str,
    state: &'a str,
    keys: i64,
}

/// `stats`' answer, whatever the engine.
fn stats_of(stats: &TableStats) -> Answer {
    let report = StatsReport {
        counts: stats
            .counts
            .iter()
            .map(|(workflow, state, keys)| CountReport {
                workflow,
                state,
                keys: *keys,
            })
            .collect(),
        oldest_started_seconds: stats.oldest_started_seconds,
        resumer_lag_ms: stats.resumer_lag_ms,
    };
    Answer::new(exit::OK, stats_text(stats), &report)
}

/// JSON text with DEL and the C1 controls written as `\u00XX` escapes (same JSON value).
fn terminal_safe_json(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for character in json.chars() {
        if matches!(character, '\u{7f}'..='\u{9f}') {
            out.push_str(&format!("\\u{:04x}", u32::from(character)));
        } else {
            out.push(character);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_database_url_comes_from_the_flag_then_the_environment() {
        let flag = Some("postgres://flag".to_owned());
        let env = Some("postgres://env".to_owned());
        assert_eq!(
            database_url(flag.clone(), env.clone()).ok(),
            Some("postgres://flag".to_owned())
        );
        assert_eq!(
            database_url(None, env).ok(),
            Some("postgres://env".to_owned())
        );
        for (flag, env) in [(None, None), (None, Some(String::new()))] {
            let error = database_url(flag, env).expect_err("no URL");
            assert_eq!(error.code(), exit::USAGE);
            assert_eq!(
                error.to_string(),
                "no database: pass --database-url postgres://... or set DATABASE_URL"
            );
        }
    }

    #[test]
    fn errors_are_text_on_stderr_or_one_json_document_on_stdout() {
        let error = CliError::NotFound {
            tenant: "acme".to_owned(),
            key: "order-9".to_owned(),
        };
        assert_eq!(
            error.output(Format::Human),
            Output {
                code: 1,
                stdout: String::new(),
                stderr: "error: no key \"order-9\" for tenant \"acme\"\n".to_owned(),
            }
        );
        assert_eq!(
            error.output(Format::Json),
            Output {
                code: 1,
                stdout: "{\n  \"error\": {\n    \"kind\": \"not_found\",\n    \"message\": \
                         \"no key \\\"order-9\\\" for tenant \\\"acme\\\"\"\n  }\n}\n"
                    .to_owned(),
                stderr: String::new(),
            }
        );
    }
}

idemflow_core::with_setters! {
    InspectOptions {
        with_show_request => show_request: bool,
        with_show_response => show_response: bool,
        with_retention => retention: Option<Duration>,
    }
}
