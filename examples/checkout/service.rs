//! The checkout HTTP service: `POST /v1/checkouts` runs the workflow under the request's
//! `Idempotency-Key`, `GET /v1/checkouts/{order_id}` reads an order back. With
//! `--allow-crash-header`, `X-Crash-At: <crash point>` makes a request's run stop at that point as
//! if the process had died there, to watch a crashed request being finished.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idemflow::{CrashHook, CrashPoint, Key, Runner, Workflow};
use idemflow_http::{BearerTenant, Problem, TenantResolver, WorkflowService};
use sqlx::PgPool;

/// The header that asks for a crash (only honoured with `--allow-crash-header`).
pub const CRASH_HEADER: &str = "x-crash-at";

/// The service's routes. `crashes`: `Some` when `X-Crash-At` is honoured; the same hook must be
/// installed on `runner` (see [`HeaderCrashes::runner`]).
pub fn router(
    pool: PgPool,
    runner: Runner,
    checkout: Workflow,
    crashes: Option<Arc<HeaderCrashes>>,
) -> Router {
    let mut checkouts = Router::new().route_service(
        "/v1/checkouts",
        WorkflowService::new(runner, checkout, BearerTenant),
    );
    if let Some(crashes) = crashes {
        checkouts = checkouts.layer(middleware::from_fn_with_state(crashes, crash_header));
    }
    checkouts.merge(
        Router::new()
            .route("/v1/checkouts/{order_id}", get(order))
            .with_state(pool),
    )
}

/// `GET /v1/checkouts/{order_id}`: the order as the example's table holds it, for its tenant only.
async fn order(State(pool): State<PgPool>, Path(order_id): Path<String>, parts: Parts) -> Response {
    let tenant = match BearerTenant.resolve(&parts) {
        Ok(tenant) => tenant,
        Err(problem) => return problem.into_response(),
    };
    let not_found = || {
        Problem::new(
            StatusCode::NOT_FOUND,
            "not_found",
            format!("no order {order_id} for this tenant"),
        )
        .into_response()
    };
    let Ok(id) = order_id.parse::<i64>() else {
        return not_found();
    };
    let row = sqlx::query_as::<_, OrderRow>(
        "SELECT id AS order_id, amount, currency, status, charge_id FROM checkout_orders
         WHERE id = $1 AND tenant = $2",
    )
    .bind(id)
    .bind(tenant.as_str())
    .fetch_optional(&pool)
    .await;
    match row {
        Ok(Some(order)) => axum::Json(order).into_response(),
        Ok(None) => not_found(),
        Err(error) => {
            tracing::error!(%error, "reading an order failed");
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "unavailable",
                "the service could not read the order",
            )
            .into_response()
        }
    }
}

/// An order as `GET /v1/checkouts/{order_id}` shows it.
#[derive(Debug, sqlx::FromRow, serde::Serialize)]
struct OrderRow {
    order_id: i64,
    amount: i64,
    currency: String,
    status: String,
    charge_id: Option<String>,
}

/// A crash hook armed per idempotency key by the `X-Crash-At` header. Each key crashes at most
/// once: a retry that carries the header again runs normally, so a crashed request can be finished
/// by repeating it as it was.
#[derive(Debug)]
pub struct HeaderCrashes {
    /// The crash points the workflow passes (`after_call:charge`, ...), for checking the header.
    points: Vec<String>,
    state: Mutex<Armed>,
}

#[derive(Debug, Default)]
struct Armed {
    /// Key → the crash point its current request stops at.
    armed: HashMap<String, String>,
    /// Keys that crashed already.
    crashed: HashSet<String>,
}

impl HeaderCrashes {
    pub fn new(workflow: &Workflow) -> Arc<Self> {
        Arc::new(Self {
            points: CrashPoint::all(workflow)
                .iter()
                .map(ToString::to_string)
                .collect(),
            state: Mutex::default(),
        })
    }

    /// `runner` with this hook installed.
    pub fn runner(self: &Arc<Self>, runner: Runner) -> Runner {
        runner.with_crash_hook(self.clone())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Armed> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl CrashHook for HeaderCrashes {
    async fn crash_at(&self, point: &CrashPoint, key: &Key) -> bool {
        let mut state = self.state();
        let wanted = state
            .armed
            .get(key.as_str())
            .is_some_and(|wanted| *wanted == point.to_string());
        if wanted {
            state.armed.remove(key.as_str());
            state.crashed.insert(key.as_str().to_owned());
        }
        wanted
    }
}

/// Reads `X-Crash-At` and the key, arms the hook for this request's run, disarms it after.
async fn crash_header(
    State(crashes): State<Arc<HeaderCrashes>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(value) = request.headers().get(CRASH_HEADER) else {
        return next.run(request).await;
    };
    let point = match value.to_str() {
        Ok(point) if crashes.points.iter().any(|known| known == point.trim()) => {
            point.trim().to_owned()
        }
        _ => {
            return Problem::new(
                StatusCode::BAD_REQUEST,
                "crash_point_invalid",
                format!(
                    "X-Crash-At must name one of this workflow's crash points: {}",
                    crashes.points.join(", ")
                ),
            )
            .into_response();
        }
    };
    // A missing or malformed key is the workflow route's to refuse.
    let Ok(key) = idemflow_http::idempotency_key(request.headers()) else {
        return next.run(request).await;
    };
    let key = key.as_str().to_owned();
    {
        let mut state = crashes.state();
        if state.crashed.contains(&key) {
            tracing::info!(key, "X-Crash-At ignored: this key crashed once already");
        } else {
            tracing::info!(key, point, "X-Crash-At: this request's run will stop there");
            state.armed.insert(key.clone(), point);
        }
    }
    let response = next.run(request).await;
    crashes.state().armed.remove(&key);
    response
}

/// The environment variable naming a crash point at which the whole process stops, for tests that
/// kill it there for real (SIGKILL) and let a separate worker finish the request.
pub const CRASH_ENV: &str = "IDEMFLOW_CRASH_AT";

/// Stops the process at one crash point: prints `crash point reached: <point>` and then makes no
/// further progress on that run, as a hung or dying process would, until it is killed.
#[derive(Debug)]
pub struct ProcessCrash {
    point: String,
}

impl ProcessCrash {
    /// The hook `IDEMFLOW_CRASH_AT` asks for, if it is set.
    pub fn from_env() -> Option<Arc<Self>> {
        let point = std::env::var(CRASH_ENV).ok()?;
        Some(Arc::new(Self { point }))
    }
}

#[async_trait::async_trait]
impl CrashHook for ProcessCrash {
    async fn crash_at(&self, point: &CrashPoint, _: &Key) -> bool {
        if point.to_string() != self.point {
            return false;
        }
        {
            use std::io::Write;
            let mut stdout = std::io::stdout().lock();
            let _ = writeln!(stdout, "crash point reached: {point}");
            let _ = stdout.flush();
        }
        // Never returns: this run is frozen where it stands, its transaction open or its call
        // made, until the process is killed.
        loop {
            std::thread::park();
        }
    }
}
