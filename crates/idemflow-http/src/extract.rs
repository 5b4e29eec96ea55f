//! For handlers that call the runner themselves: the key as an extractor.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use idemflow_core::Key;

use crate::ProblemType;
use crate::key_header::{KeyHeaderError, idempotency_key};
use crate::problem::Problem;

/// The request's `Idempotency-Key`, parsed (RFC 8941 string or bare). A request without a
/// usable key is refused with a 400 problem (`idempotency_key_missing` or
/// `idempotency_key_invalid`) before the handler runs.
///
/// ```no_run
/// use std::sync::Arc;
///
/// use axum::Router;
/// use axum::body::Bytes;
/// use axum::extract::State;
/// use axum::routing::post;
/// use idemflow_core::TenantId;
/// use idemflow_http::{IdempotencyKey, RunResponse};
/// use idemflow_pg::PgStore;
/// use idemflow_runner::{Request, Runner, Workflow};
///
/// async fn checkout(
///     State((runner, workflow)): State<(Runner<PgStore>, Arc<Workflow<PgStore>>)>,
///     IdempotencyKey(key): IdempotencyKey,
///     body: Bytes,
/// ) -> RunResponse {
///     let tenant = TenantId::from(7_u64); // from authentication in a real service
///     let request = Request { method: "POST", path: "/v1/checkouts", body: &body };
///     RunResponse(runner.run(&workflow, &tenant, &key, request).await)
/// }
///
/// # fn app(runner: Runner<PgStore>, workflow: Arc<Workflow<PgStore>>) -> Router {
/// Router::new()
///     .route("/v1/checkouts", post(checkout))
///     .with_state((runner, workflow))
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyKey(pub Key);

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyKey {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Problem> {
        idempotency_key(&parts.headers)
            .map(IdempotencyKey)
            .map_err(|error| key_problem(&error))
    }
}

/// The 400 problem for a key header that cannot be used.
pub(crate) fn key_problem(error: &KeyHeaderError) -> Problem {
    let kind = if *error == KeyHeaderError::Missing {
        ProblemType::IDEMPOTENCY_KEY_MISSING
    } else {
        ProblemType::IDEMPOTENCY_KEY_INVALID
    };
    kind.problem(error.to_string())
}
