use axum::http::request::Parts;
use idemflow_core::TenantId;

use crate::ProblemType;
use crate::problem::Problem;

/// Finds the tenant of a request: from its authenticated principal, never from its body.
///
/// Any `Fn(&Parts) -> Result<TenantId, Problem>` is one.
pub trait TenantResolver: Send + Sync + 'static {
    /// The tenant of the request with these parts, or the problem to answer instead (401,
    /// say). Called before the body is read.
    fn resolve(&self, request: &Parts) -> Result<TenantId, Problem>;
}

impl<F> TenantResolver for F
where
    F: Fn(&Parts) -> Result<TenantId, Problem> + Send + Sync + 'static,
{
    fn resolve(&self, request: &Parts) -> Result<TenantId, Problem> {
        self(request)
    }
}

/// The tenant is the bearer token itself (`Authorization: Bearer <tenant>`): for examples and
/// tests. A real service maps a verified credential to its tenant.
#[derive(Debug, Clone, Copy, Default)]
pub struct BearerTenant;

impl TenantResolver for BearerTenant {
    fn resolve(&self, request: &Parts) -> Result<TenantId, Problem> {
        let unauthorized = |detail: &str| ProblemType::UNAUTHORIZED.problem(detail);
        let value = request
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .ok_or_else(|| unauthorized("an Authorization: Bearer <tenant> header is required"))?;
        let token = value
            .to_str()
            .ok()
            .and_then(|text| text.strip_prefix("Bearer "))
            .ok_or_else(|| unauthorized("the Authorization header must be Bearer <tenant>"))?;
        TenantId::new(token.trim()).map_err(|error| unauthorized(&error.to_string()))
    }
}
