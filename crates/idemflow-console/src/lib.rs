//! The operator console: an axum [`Router`] over one engine's keys (any engine's [`Operator`]), for an application to mount
//! under a prefix of its choice (behind its own authentication layers), or to run alone with
//! `idemflow console`.
//!
//! ```no_run
//! # async fn mount(pool: sqlx::SqlitePool, app: axum::Router) {
//! let operator = idemflow_sqlite::SqliteOperator::new(pool);
//! // Read-only until `.allow_actions()`; every tenant's keys until `.tenants(…)` says otherwise.
//! let console = idemflow_console::Console::new(operator);
//! let app = app.nest("/ops/idemflow", console.router());
//! # }
//! ```
//!
//! Views: an overview of the table from its indexes, a search paged over the primary key, a key's
//! page (its timeline from the key's journal, fencing token and lease, derived keys, stored
//! request and response), the stuck list. Actions: end a lease and expire a key, each confirmed,
//! refused for a live owner unless forced, fenced by the token the operator was shown, and
//! recorded (a tracing event and the `idemflow_console_actions_total` counter, naming the
//! [`Principal`] when the application's layers set one). A console starts read-only, enforced by
//! the server (the actions' routes answer 403 whatever the page shows): an application opts in
//! to the actions with [`Console::allow_actions`]. [`Console::tenants`] limits each operator to
//! some tenants' keys. Its assets are compiled in; pages work
//! without JavaScript (which only adds the confirmation dialog). docs/console.md has the rest.

#![deny(missing_docs)]

mod actions;
mod html;
mod pages;
mod search;
mod serve;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use axum::Router;
use axum::extract::{OriginalUri, Query, State};
use axum::http::{HeaderValue, Request, StatusCode, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use idemflow_store::Operator;

pub use search::{PAGE, SCAN, SearchForm};
pub use serve::{PASSWORD_ENV, ServeError, ServeOptions, serve};

use html::Frame;

/// The metrics the console exports: (name, type, help).
pub const CATALOGUE: &[(&str, &str, &str)] = &[(
    "idemflow_console_actions_total",
    "counter",
    "Actions asked of the console, by action (end_lease, expire), outcome and principal",
)];

/// Who is signed in, as the application's authentication layer says: insert it as a request
/// extension and the console names it in every action it records and in its header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal(pub String);

/// Which tenants' keys an operator may see and act on: what [`Console::tenants`]' hook answers
/// for each request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenants {
    /// Every tenant's.
    All,
    /// These tenants' only (none: no key at all).
    Only(BTreeSet<String>),
}

impl Tenants {
    /// These tenants' keys only.
    pub fn only<T: Into<String>>(tenants: impl IntoIterator<Item = T>) -> Self {
        Self::Only(tenants.into_iter().map(Into::into).collect())
    }

    /// No tenant's keys: what to answer for a request the hook cannot place.
    pub fn none() -> Self {
        Self::Only(BTreeSet::new())
    }

    /// Whether `tenant`'s keys are among these.
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            Self::All => true,
            Self::Only(tenants) => tenants.contains(tenant),
        }
    }
}

type TenantHook = Arc<dyn Fn(Option<&Principal>) -> Tenants + Send + Sync>;

/// The console over one engine's database.
#[derive(Clone)]
pub struct Console {
    operator: Arc<dyn Operator>,
    read_only: bool,
    workflows: Arc<HashMap<String, Vec<(String, bool)>>>,
    tenants: Option<TenantHook>,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Console")
            .field("engine", &self.operator.engine())
            .field("read_only", &self.read_only)
            .field("tenants_limited", &self.tenants.is_some())
            .finish()
    }
}

impl Console {
    /// A console over any engine's [`Operator`] (`PgOperator`, `SqliteOperator`,
    /// `MySqlOperator`, `RedisOperator`, or one opened by URL). It starts read-only
    /// ([`Console::allow_actions`] opts in to the actions) and shows every tenant's keys
    /// ([`Console::tenants`] limits them).
    pub fn new(operator: impl Operator + 'static) -> Self {
        Self::shared(Arc::new(operator))
    }

    /// A console over an operator already shared (one opened by URL, boxed); read-only, as
    /// [`Console::new`].
    pub fn shared(operator: Arc<dyn Operator>) -> Self {
        Self {
            operator,
            // Mounted in an application, the console answers whoever the application lets
            // through: what can delete a key's stored response is opted in to, never inherited.
            read_only: true,
            workflows: Arc::default(),
            tenants: None,
        }
    }

    /// Offers and performs the actions (end a lease, expire a key): without it, the console is
    /// read-only.
    #[must_use]
    pub fn allow_actions(self) -> Self {
        self.read_only(false)
    }

    /// Read-only (`true`, the default): every action is refused by the server (403), and no
    /// action is offered. `false` is [`Console::allow_actions`].
    #[must_use]
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Limits each operator to some tenants' keys: `hook` is asked, for every request, which
    /// tenants the signed-in [`Principal`] (`None` when the application's layers set none) may
    /// see and act on. Another tenant's key is not found on its page, is left out of the search
    /// and the stuck list, and an action on it is refused (`refused_tenant`, 403) before the
    /// database is read. The overview's figures stay the store's, every tenant's: they name no
    /// tenant and no key.
    #[must_use]
    pub fn tenants(
        mut self,
        hook: impl Fn(Option<&Principal>) -> Tenants + Send + Sync + 'static,
    ) -> Self {
        self.tenants = Some(Arc::new(hook));
        self
    }

    /// The tenants `principal` may see.
    fn tenants_of(&self, principal: Option<&Principal>) -> Tenants {
        self.tenants
            .as_ref()
            .map_or(Tenants::All, |hook| hook(principal))
    }

    /// Names a workflow's phases, local and foreign, so a key's page lists them with where the
    /// key stands and the derived key each foreign phase sends. Without it (the standalone
    /// console) a page shows what the key's row and journal hold only.
    #[must_use]
    pub fn workflow<E: idemflow_runner::Engine>(
        mut self,
        workflow: &idemflow_runner::Workflow<E>,
    ) -> Self {
        let phases = workflow
            .phase_kinds()
            .into_iter()
            .map(|(name, foreign)| (name.to_owned(), foreign))
            .collect();
        Arc::make_mut(&mut self.workflows).insert(workflow.name().to_owned(), phases);
        self
    }

    /// The console's routes, to serve alone or to `nest` under a prefix.
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(overview))
            .route("/keys", get(search_page))
            .route("/key", get(actions::key_page))
            .route("/stuck", get(stuck))
            .route("/key/end-lease", post(actions::end_lease))
            .route("/key/expire", post(actions::expire))
            .route("/assets/console.css", get(css))
            .route("/assets/console.js", get(js))
            .layer(middleware::from_fn(secure_headers))
            .with_state(self)
    }

    fn frame<'a>(&'a self, base: &'a str, principal: Option<&'a Principal>) -> Frame<'a> {
        Frame {
            base,
            engine: self.operator.engine(),
            read_only: self.read_only,
            principal: principal.map(|p| p.0.as_str()),
        }
    }
}

/// The path the console is mounted under: what a nested router stripped from the request's path
/// (`""` when it serves at the root). Links are written from it, so the console works under any
/// prefix.
fn base(original: &OriginalUri, uri: &Uri) -> String {
    let original = original.path();
    match original.strip_suffix(uri.path()) {
        Some(base) => base.to_owned(),
        // `/ops` nested: the inner path is `/`, which `/ops` does not end with.
        None if uri.path() == "/" => original.trim_end_matches('/').to_owned(),
        None => String::new(),
    }
}

/// What a page can say went wrong: a page with its status.
fn failure(
    console: &Console,
    base: &str,
    principal: Option<&Principal>,
    status: StatusCode,
    text: &str,
) -> Response {
    let title = if status.is_server_error() {
        "The database failed"
    } else {
        "Not possible"
    };
    (
        status,
        Html(pages::message(
            &console.frame(base, principal),
            title,
            "error",
            text,
            None,
        )),
    )
        .into_response()
}

async fn overview(
    State(console): State<Console>,
    original: OriginalUri,
    uri: Uri,
    principal: Option<axum::Extension<Principal>>,
) -> Response {
    let base = base(&original, &uri);
    let principal = principal.map(|axum::Extension(p)| p);
    match console.operator.overview().await {
        Ok(overview) => Html(pages::overview(
            &console.frame(&base, principal.as_ref()),
            &overview,
        ))
        .into_response(),
        Err(error) => failure(
            &console,
            &base,
            principal.as_ref(),
            StatusCode::SERVICE_UNAVAILABLE,
            &error.to_string(),
        ),
    }
}

async fn search_page(
    State(console): State<Console>,
    original: OriginalUri,
    uri: Uri,
    principal: Option<axum::Extension<Principal>>,
    Query(form): Query<SearchForm>,
) -> Response {
    let base = base(&original, &uri);
    let principal = principal.map(|axum::Extension(p)| p);
    let frame = console.frame(&base, principal.as_ref());
    // A bare visit shows the form; any field runs the search.
    let asked = uri.query().is_some_and(|query| !query.is_empty());
    if !asked {
        return Html(pages::search(&frame, &form, None)).into_response();
    }
    let parsed = match search::Search::parse(&form) {
        Ok(parsed) => parsed,
        Err(error) => {
            return (
                StatusCode::BAD_REQUEST,
                Html(pages::message(
                    &frame,
                    "Search",
                    "error",
                    &error.to_string(),
                    None,
                )),
            )
                .into_response();
        }
    };
    let tenants = console.tenants_of(principal.as_ref());
    match search::run(console.operator.as_ref(), &parsed, &tenants).await {
        Ok(found) => Html(pages::search(&frame, &form, Some(&found))).into_response(),
        Err(error) => failure(
            &console,
            &base,
            principal.as_ref(),
            StatusCode::SERVICE_UNAVAILABLE,
            &error.to_string(),
        ),
    }
}

/// How many attempts at one recovery point make a key stuck, as `idemflow list --stuck` counts.
const STUCK_ATTEMPTS: i32 = 5;

async fn stuck(
    State(console): State<Console>,
    original: OriginalUri,
    uri: Uri,
    principal: Option<axum::Extension<Principal>>,
) -> Response {
    let base = base(&original, &uri);
    let principal = principal.map(|axum::Extension(p)| p);
    let tenants = console.tenants_of(principal.as_ref());
    match console.operator.stuck_keys(STUCK_ATTEMPTS, 100).await {
        Ok(mut keys) => {
            keys.retain(|key| tenants.allows(&key.tenant));
            Html(pages::stuck(
                &console.frame(&base, principal.as_ref()),
                &keys,
                STUCK_ATTEMPTS,
            ))
            .into_response()
        }
        Err(error) => failure(
            &console,
            &base,
            principal.as_ref(),
            StatusCode::SERVICE_UNAVAILABLE,
            &error.to_string(),
        ),
    }
}

async fn css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../assets/console.css"),
    )
}

async fn js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../assets/console.js"),
    )
}

/// The pages show what the database holds (error texts, stored requests), so a browser is told to
/// run no script and load nothing but the console's own assets, and to frame it nowhere.
async fn secure_headers(request: Request<axum::body::Body>, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}
