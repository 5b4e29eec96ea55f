//! Everything checked before a request reaches the runner: the key, the tenant, the body's size
//! and type. A request refused here stores nothing.

use axum::body::{Body, Bytes};
use axum::http::request::Parts;
use axum::http::{Request, StatusCode, header};
use idemflow_core::{Key, TenantId};

use crate::config::HttpConfig;
use crate::key_header::{KeyHeaderError, idempotency_key};
use crate::problem::Problem;
use crate::tenant::TenantResolver;

/// A covered request that passed the checks.
pub(crate) struct Prepared {
    pub parts: Parts,
    pub key: Key,
    pub tenant: TenantId,
    pub body: Bytes,
    pub json: bool,
}

/// What to do with a request the checks did not pass.
pub(crate) enum Refusal {
    /// Answer with this problem.
    Answer(Problem),
    /// No key, and none is required: let it through without idempotency.
    PassThrough(Request<Body>),
}

pub(crate) async fn prepare(
    request: Request<Body>,
    config: &HttpConfig,
    resolver: &dyn TenantResolver,
    json_only: bool,
) -> Result<Prepared, Refusal> {
    let key = match idempotency_key(request.headers()) {
        Ok(key) => key,
        Err(KeyHeaderError::Missing) if !config.require_key => {
            return Err(Refusal::PassThrough(request));
        }
        Err(error) => {
            let code = if error == KeyHeaderError::Missing {
                "idempotency_key_missing"
            } else {
                "idempotency_key_invalid"
            };
            return Err(Refusal::Answer(Problem::new(
                StatusCode::BAD_REQUEST,
                code,
                error.to_string(),
            )));
        }
    };
    let (parts, body) = request.into_parts();
    let tenant = resolver.resolve(&parts).map_err(Refusal::Answer)?;
    let json = is_json(&parts);
    if json_only && !json {
        return Err(Refusal::Answer(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "this endpoint takes application/json",
        )));
    }
    let too_large = || {
        Refusal::Answer(Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the body exceeds {} bytes", config.max_body_bytes),
        ))
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse::<usize>().ok());
    if declared.is_some_and(|length| length > config.max_body_bytes) {
        return Err(too_large());
    }
    let body = axum::body::to_bytes(body, config.max_body_bytes)
        .await
        .map_err(|_| too_large())?;
    Ok(Prepared {
        parts,
        key,
        tenant,
        body,
        json,
    })
}

/// `application/json` or any `+json` type.
fn is_json(parts: &Parts) -> bool {
    let Some(content_type) = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
    else {
        return false;
    };
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The request target as fingerprinted: path and query.
pub(crate) fn target(parts: &Parts) -> &str {
    parts
        .uri
        .path_and_query()
        .map_or("/", |target| target.as_str())
}
