//! The checkout HTTP service: `POST /v1/checkouts` runs the workflow under the request's
//! `Idempotency-Key`, `GET /v1/checkouts/{order_id}` reads an order back. With
//! `--allow-crash-header`, `X-Crash-At: <crash point>` makes a request's run stop at that point as
//! if the process had died there, to watch a crashed request being finished.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use idemflow::http::{BearerTenant, Problem, TenantResolver, WorkflowService};
use idemflow::{CrashHook, CrashPoint, Engine, Key, PoolOf, Runner, TenantId, Workflow};

use crate::orders::Shop;

/// The header that asks for a crash (only honoured with `--allow-crash-header`).
pub const CRASH_HEADER: &str = "x-crash-at";

/// The service's routes. `crashes`: `Some` when `X-Crash-At` is honoured; the same hook must be
/// installed on `runner` (see [`Crashes::runner`]).
pub fn router<E: Shop>(
    pool: PoolOf<E>,
    runner: Runner<E>,
    checkout: Workflow<E>,
    crashes: Option<Arc<Crashes>>,
) -> Router {
    let mut checkouts = Router::new().route_service(
        "/v1/checkouts",
        WorkflowService::new(runner, checkout, BearerTenant),
    );
    if let Some(crashes) = crashes {
        checkouts = checkouts.layer(middleware::from_fn_with_state(crashes, crash_header));
    }
    checkouts
        .merge(
            Router::new()
                .route("/v1/checkouts/{order_id}", get(order::<E>))
                .with_state(pool),
        )
        .route(crate::openapi::PATH, get(openapi))
}

/// `GET /openapi.json`: the document, made once from the code.
async fn openapi() -> Response {
    static DOCUMENT: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(crate::openapi::json_text);
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}

/// `GET /v1/checkouts/{order_id}`: the order as the example's table holds it, for its tenant only.
async fn order<E: Shop>(
    State(pool): State<PoolOf<E>>,
    Path(order_id): Path<String>,
    parts: Parts,
) -> Response {
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
    let row = E::order(&pool, tenant.as_str(), id).await;
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

/// A crash hook armed per request, by tenant and idempotency key: by the `X-Crash-At` header (when
/// the service honours it) or by the in-process demo. Each key crashes at most once: a retry that
/// carries the header again runs normally, so a crashed request can be finished by repeating it as
/// it was.
///
/// Keys are scoped by tenant, so the hook is too: tenant A asking for a crash under key `k` never
/// stops tenant B's request under `k` (B's card may just have been charged). And it is bounded: at
/// most [`Crashes::MOST_ARMED`] requests armed at once (more are refused), and the keys that
/// crashed are remembered only up to [`Crashes::REMEMBERED`], the oldest forgotten first.
#[derive(Debug)]
pub struct Crashes {
    /// The crash points the workflow passes (`after_call:charge`, ...), for checking the header.
    points: Vec<String>,
    state: Mutex<Armed>,
}

/// A request's key, with its tenant.
type TenantKey = (String, String);

#[derive(Debug, Default)]
struct Armed {
    /// (tenant, key) → the crash point its current request stops at.
    armed: HashMap<TenantKey, String>,
    /// (tenant, key) that crashed already, oldest first.
    crashed: VecDeque<TenantKey>,
}

/// Why a crash could not be armed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotArmed {
    /// The point is not one this workflow passes.
    UnknownPoint,
    /// This tenant's key crashed once already: its retry runs normally.
    CrashedBefore,
    /// [`Crashes::MOST_ARMED`] requests are armed already.
    Full,
}

impl Crashes {
    /// The most requests armed at once.
    pub const MOST_ARMED: usize = 64;
    /// The most crashed keys remembered.
    pub const REMEMBERED: usize = 1024;

    pub fn new<E: Engine>(workflow: &Workflow<E>) -> Arc<Self> {
        Arc::new(Self {
            points: CrashPoint::all(workflow)
                .iter()
                .map(ToString::to_string)
                .collect(),
            state: Mutex::default(),
        })
    }

    /// `runner` with this hook installed.
    pub fn runner<E: Engine>(self: &Arc<Self>, runner: Runner<E>) -> Runner<E> {
        runner.with_crash_hook(self.clone())
    }

    /// Arms the next run of `tenant`'s `key` to stop at `point`.
    pub fn arm(&self, tenant: &TenantId, key: &Key, point: &str) -> Result<(), NotArmed> {
        if !self.points.iter().any(|known| known == point) {
            return Err(NotArmed::UnknownPoint);
        }
        let which = (tenant.as_str().to_owned(), key.as_str().to_owned());
        let mut state = self.state();
        if state.crashed.contains(&which) {
            return Err(NotArmed::CrashedBefore);
        }
        if state.armed.len() >= Self::MOST_ARMED && !state.armed.contains_key(&which) {
            return Err(NotArmed::Full);
        }
        state.armed.insert(which, point.to_owned());
        Ok(())
    }

    /// Disarms `tenant`'s `key` (its request ended without reaching the point).
    pub fn disarm(&self, tenant: &TenantId, key: &Key) {
        self.state()
            .armed
            .remove(&(tenant.as_str().to_owned(), key.as_str().to_owned()));
    }

    fn state(&self) -> std::sync::MutexGuard<'_, Armed> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[idemflow::async_trait]
impl CrashHook for Crashes {
    async fn crash_at(&self, point: &CrashPoint, tenant: &TenantId, key: &Key) -> bool {
        let which = (tenant.as_str().to_owned(), key.as_str().to_owned());
        let mut state = self.state();
        let wanted = state
            .armed
            .get(&which)
            .is_some_and(|wanted| *wanted == point.to_string());
        if wanted {
            state.armed.remove(&which);
            if state.crashed.len() >= Self::REMEMBERED {
                state.crashed.pop_front();
            }
            state.crashed.push_back(which);
        }
        wanted
    }
}

/// Reads `X-Crash-At`, the tenant and the key, arms the hook for this request's run, disarms it
/// after. Only mounted with `--allow-crash-header`.
async fn crash_header(
    State(crashes): State<Arc<Crashes>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(value) = request.headers().get(CRASH_HEADER) else {
        return next.run(request).await;
    };
    let point = value.to_str().unwrap_or_default().trim().to_owned();
    // A missing key or tenant is the workflow route's to refuse.
    let (parts, body) = request.into_parts();
    let (Ok(key), Ok(tenant)) = (
        idemflow::http::idempotency_key(&parts.headers),
        BearerTenant.resolve(&parts),
    ) else {
        return next.run(Request::from_parts(parts, body)).await;
    };
    let request = Request::from_parts(parts, body);
    match crashes.arm(&tenant, &key, &point) {
        Ok(()) => {
            tracing::info!(%tenant, %key, point, "X-Crash-At: this request's run will stop there");
        }
        Err(NotArmed::CrashedBefore) => {
            tracing::info!(%tenant, %key, "X-Crash-At ignored: this key crashed once already");
            return next.run(request).await;
        }
        Err(NotArmed::UnknownPoint) => {
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
        Err(NotArmed::Full) => {
            return Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "crash_requests_full",
                "too many requests asking for a crash are in flight; try again",
            )
            .into_response();
        }
    }
    let response = next.run(request).await;
    crashes.disarm(&tenant, &key);
    response
}

/// The environment variable naming a crash point at which the whole process stops, for tests that
/// kill it there for real (SIGKILL) and let a separate worker finish the request
/// (`idemflow_testkit::crash::ProcessCrash`).
pub const CRASH_ENV: &str = "IDEMFLOW_CRASH_AT";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn crashes() -> Arc<Crashes> {
        let provider = idemflow_testkit::provider_client::ProviderClient::new("http://127.0.0.1:9");
        Crashes::new(&crate::workflow::checkout::<idemflow::PgStore>(
            provider,
            std::time::Duration::from_secs(30),
        ))
    }

    fn names(tenant: &str, key: &str) -> (TenantId, Key) {
        (TenantId::new(tenant).unwrap(), Key::parse(key).unwrap())
    }

    /// Tenant A asking for a crash under key `k` never stops tenant B's request under `k`; A's
    /// own run stops once, and its retry runs normally.
    #[tokio::test]
    async fn a_crash_armed_by_one_tenant_never_stops_another_tenants_request() {
        let crashes = crashes();
        let (a, k) = names("tenant-a", "k");
        let (b, _) = names("tenant-b", "k");
        let point = CrashPoint::AfterCall { phase: "charge" };
        crashes.arm(&a, &k, "after_call:charge").unwrap();
        assert!(!crashes.crash_at(&point, &b, &k).await);
        assert!(crashes.crash_at(&point, &a, &k).await);
        assert_eq!(
            crashes.arm(&a, &k, "after_call:charge"),
            Err(NotArmed::CrashedBefore)
        );
        crashes.arm(&b, &k, "after_call:charge").unwrap();
        assert!(crashes.crash_at(&point, &b, &k).await);
        assert_eq!(crashes.arm(&a, &k, "nowhere"), Err(NotArmed::UnknownPoint));
    }

    /// What the hook holds is bounded: requests armed at once, and keys remembered as crashed.
    #[tokio::test]
    async fn what_the_hook_holds_is_bounded() {
        let crashes = crashes();
        let (tenant, _) = names("t", "k");
        for n in 0..Crashes::MOST_ARMED {
            let key = Key::parse(&format!("k{n}")).unwrap();
            crashes.arm(&tenant, &key, "after_call:charge").unwrap();
        }
        let one_more = Key::parse("one-more").unwrap();
        assert_eq!(
            crashes.arm(&tenant, &one_more, "after_call:charge"),
            Err(NotArmed::Full)
        );
        let point = CrashPoint::AfterCall { phase: "charge" };
        for n in 0..Crashes::REMEMBERED + 10 {
            let key = Key::parse(&format!("crashed-{n}")).unwrap();
            crashes.disarm(&tenant, &Key::parse(&format!("k{}", n % 64)).unwrap());
            crashes.arm(&tenant, &key, "after_call:charge").unwrap();
            assert!(crashes.crash_at(&point, &tenant, &key).await);
        }
        let state = crashes.state();
        assert_eq!(state.crashed.len(), Crashes::REMEMBERED);
        assert!(state.armed.len() <= Crashes::MOST_ARMED);
    }
}
