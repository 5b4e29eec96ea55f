//! What makes two requests under one key "the same request", by their content type.

use axum::http::header;
use axum::http::request::Parts;
use idemflow_core::{CanonicalError, Fingerprint, canonicalize_exact};

use crate::multipart;

/// A JSON body (`application/json` or any `+json` type) by its RFC 8785 canonical form and its
/// media type; a multipart body by its parts (the boundary a client draws anew for every send
/// left out); any other body by its exact bytes and its content type.
pub(crate) fn fingerprint(
    method: &str,
    target: &str,
    parts: &Parts,
    body: &[u8],
) -> Result<Fingerprint, CanonicalError> {
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    let essence = media_type(content_type);
    if is_json(&essence) {
        // Exact: the handler reads the bytes itself, so numbers must mean what they say.
        let canonical = canonicalize_exact(body)?;
        return Ok(Fingerprint::of_typed_json(
            method, target, &essence, &canonical,
        ));
    }
    if let Some(boundary) = multipart::boundary(content_type)
        && let Some(parts) = multipart::parts(body, boundary)
    {
        return Ok(Fingerprint::of_multipart(method, target, &essence, parts));
    }
    Ok(Fingerprint::of_raw(method, target, content_type, body))
}

/// The media type without parameters, lowercase.
pub(crate) fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// `application/json` or any `+json` type.
pub(crate) fn is_json(essence: &str) -> bool {
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}
