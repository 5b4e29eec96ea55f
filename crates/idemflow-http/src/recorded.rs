//! What of a plain handler's request is stored with its key: enough for `idemflow inspect` to
//! say what the request was, nothing that would let a reader act as its sender. The handler
//! never runs from it: every attempt hands the handler its live request.

use axum::http::request::Parts;
use serde::{Deserialize, Serialize};

use crate::config::{HOP_BY_HOP, Redaction};

/// A request as stored with its key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordedRequest {
    method: String,
    /// The request target as the client sent it (before any router stripped a prefix), with
    /// the values of secret-looking query parameters replaced.
    uri: String,
    /// Headers but hop-by-hop and secret-looking ones; values that are not visible ASCII are
    /// left out.
    headers: Vec<(String, String)>,
    body: RecordedBody,
}

/// Text when the body is UTF-8 that jsonb can hold (no U+0000), else base64 bytes: a body is
/// stored at most 4/3 of its size, never refused for what it contains.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum RecordedBody {
    Text(String),
    Bytes(#[serde(with = "idemflow_core::bytes")] Vec<u8>),
}

/// The layer's workflow request as the runner reads it back: nothing. The handler runs from the
/// live request; the recorded one is stored for inspection only, so it is not decoded again
/// (a megabyte body would be copied for nothing).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unread;

impl Serialize for Unread {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_unit()
    }
}

impl<'de> Deserialize<'de> for Unread {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_ignored_any(serde::de::IgnoredAny)
            .map(|_| Unread)
    }
}

/// What query parameter values are replaced by.
pub(crate) const REDACTED: &str = "REDACTED";

impl RecordedRequest {
    pub(crate) fn new(parts: &Parts, target: &str, body: &[u8], redaction: &Redaction) -> Self {
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| {
                !HOP_BY_HOP.contains(&name.as_str()) && !redaction.is_secret(name.as_str())
            })
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect();
        let body = match std::str::from_utf8(body) {
            Ok(text) if !text.contains('\0') => RecordedBody::Text(text.to_owned()),
            _ => RecordedBody::Bytes(body.to_vec()),
        };
        Self {
            method: parts.method.to_string(),
            uri: redact_query(target, redaction),
            headers,
            body,
        }
    }
}

/// The target with the value of every query parameter whose name looks secret replaced.
fn redact_query(target: &str, redaction: &Redaction) -> String {
    let Some((path, query)) = target.split_once('?') else {
        return target.to_owned();
    };
    let pairs: Vec<String> = query
        .split('&')
        .map(|pair| {
            let name = pair.split_once('=').map_or(pair, |(name, _)| name);
            if redaction.is_secret(&percent_decoded(name)) {
                format!("{name}={REDACTED}")
            } else {
                pair.to_owned()
            }
        })
        .collect();
    format!("{path}?{}", pairs.join("&"))
}

/// A parameter name as a server would read it (`api%5Fkey` is `api_key`), for matching only.
fn percent_decoded(name: &str) -> String {
    let bytes = name.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        let hex = |at: usize| {
            bytes
                .get(at)
                .and_then(|digit| (*digit as char).to_digit(16))
        };
        match (byte, hex(index + 1), hex(index + 2)) {
            (b'%', Some(high), Some(low)) => {
                decoded.push((high * 16 + low) as u8);
                index += 3;
            }
            (b'+', _, _) => {
                decoded.push(b' ');
                index += 1;
            }
            _ => {
                decoded.push(byte);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_query_values_are_replaced_and_the_rest_kept() {
        let redaction = Redaction::default();
        assert_eq!(
            redact_query("/v1/x?a=1&api_key=sk_live&API%5FKEY=z&flag", &redaction),
            "/v1/x?a=1&api_key=REDACTED&API%5FKEY=REDACTED&flag"
        );
        assert_eq!(
            redact_query("/v1/x?access_token=t&page=2", &redaction),
            "/v1/x?access_token=REDACTED&page=2"
        );
        assert_eq!(redact_query("/v1/x", &redaction), "/v1/x");
    }
}
