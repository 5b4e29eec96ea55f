//! Everything checked before a request reaches the runner: the key, the tenant, the body's size
//! and type. A request refused here stores nothing.

use axum::body::{Body, Bytes};
use axum::extract::OriginalUri;
use axum::http::request::Parts;
use axum::http::{Request, header};
use idemflow_core::{Key, TenantId};
use tokio::sync::OwnedSemaphorePermit;

use crate::ProblemType;
use crate::body::{BodyError, read_limited};
use crate::config::HttpConfig;
use crate::extract::key_problem;
use crate::key_header::{KeyHeaderError, idempotency_key};
use crate::problem::{Problem, body_timeout};
use crate::request_fingerprint;
use crate::serve::CoveredLimit;
use crate::tenant::TenantResolver;

/// A covered request that passed the checks.
pub(crate) struct Prepared {
    pub parts: Parts,
    pub key: Key,
    pub tenant: TenantId,
    pub body: Bytes,
    /// Its place among the covered requests being processed (served by [`crate::serve`]):
    /// held until the request's run has ended, whatever becomes of its client.
    pub place: Option<OwnedSemaphorePermit>,
}

/// What to do with a request the checks did not pass.
pub(crate) enum Refusal {
    /// Answer with this problem.
    Answer(Problem),
    /// No key: the route's key mode says what becomes of it.
    NoKey(Request<Body>),
}

pub(crate) async fn prepare(
    request: Request<Body>,
    config: &HttpConfig,
    resolver: &dyn TenantResolver,
    json_only: bool,
) -> Result<Prepared, Refusal> {
    let key = match idempotency_key(request.headers()) {
        Ok(key) => key,
        Err(KeyHeaderError::Missing) => return Err(Refusal::NoKey(request)),
        Err(error) => return Err(Refusal::Answer(key_problem(&error))),
    };
    let (mut parts, body) = request.into_parts();
    let tenant = resolver.resolve(&parts).map_err(Refusal::Answer)?;
    if json_only && !is_json(&parts) {
        return Err(Refusal::Answer(
            ProblemType::UNSUPPORTED_MEDIA_TYPE.problem("this endpoint takes application/json"),
        ));
    }
    let too_large = || {
        Refusal::Answer(
            ProblemType::BODY_TOO_LARGE
                .problem(format!("the body exceeds {} bytes", config.max_body_bytes)),
        )
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse::<usize>().ok());
    if declared.is_some_and(|length| length > config.max_body_bytes) {
        return Err(too_large());
    }
    // A place before the body is read: the body and all that is made of it are what the limit
    // bounds. Taken out of the extensions, so a second covered layer does not wait for another.
    let place = match parts.extensions.remove::<CoveredLimit>() {
        Some(limit) => Some(limit.enter().await.map_err(Refusal::Answer)?),
        None => None,
    };
    let body = match read_limited(body, config.max_body_bytes).await {
        Ok(body) => body,
        Err(BodyError::TooLarge) => return Err(too_large()),
        // Before the claim: a client that stalls holds no key, and may send it all again.
        Err(BodyError::TimedOut(timeout)) => return Err(Refusal::Answer(body_timeout(timeout))),
        Err(BodyError::Unreadable(error)) => {
            return Err(Refusal::Answer(
                ProblemType::BODY_UNREADABLE
                    .problem(format!("the body could not be read: {error}")),
            ));
        }
    };
    Ok(Prepared {
        parts,
        key,
        tenant,
        body,
        place,
    })
}

fn is_json(parts: &Parts) -> bool {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    request_fingerprint::is_json(&request_fingerprint::media_type(content_type))
}

/// The request target as fingerprinted: path and query as the client sent them. A router
/// nested under `/accounts/{acct}` strips the prefix from the URI its routes see (axum keeps
/// the original in `OriginalUri`), and two accounts' requests must not fingerprint alike.
pub(crate) fn target(parts: &Parts) -> String {
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    uri.path_and_query()
        .map_or_else(|| "/".to_owned(), |target| target.as_str().to_owned())
}
