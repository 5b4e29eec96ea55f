use std::fmt;

use sha2::{Digest, Sha256};

use crate::canonical::{CanonicalError, canonicalize_exact};

/// SHA-256 over a request's method, path and canonical body: what makes two attempts "the same
/// request". A retry with the same key and the same fingerprint gets the first result; the same key
/// with another fingerprint is refused (422).
///
/// Each part is length-prefixed and the input is tagged with its kind (canonical JSON or raw bytes
/// with a content type), so no two different requests share the bytes that are hashed.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

const DOMAIN: &[u8] = b"idemflow.fingerprint.v1";

impl Fingerprint {
    /// Canonicalizes a JSON body (RFC 8785) and fingerprints it with the method and path.
    ///
    /// Fails, without side effects, on a body that is not valid I-JSON (invalid UTF-8, a syntax
    /// error, a duplicate object key, a number beyond the range of a double) or that holds a
    /// number a double cannot hold as written ([`CanonicalError::NumberNotExact`]): two requests
    /// that differ only in such a number must not share a fingerprint.
    pub fn of_json(method: &str, path: &str, body: &[u8]) -> Result<Self, CanonicalError> {
        let canonical = canonicalize_exact(body)?;
        Ok(Self::of_canonical_json(method, path, &canonical))
    }

    /// Fingerprints a body already in canonical form (the output of
    /// [`canonicalize_exact`](crate::canonicalize_exact)).
    pub fn of_canonical_json(method: &str, path: &str, canonical: &[u8]) -> Self {
        Self::hash(b'J', &[method.as_bytes(), path.as_bytes(), canonical])
    }

    /// Fingerprints a canonical JSON body sent as a JSON media type other than
    /// `application/json` (`application/merge-patch+json`, say): the type is part of what the
    /// request means, so the same document under two types is two requests.
    /// `application/json` itself fingerprints as [`Fingerprint::of_canonical_json`].
    pub fn of_typed_json(method: &str, path: &str, media_type: &str, canonical: &[u8]) -> Self {
        if media_type.eq_ignore_ascii_case("application/json") {
            return Self::of_canonical_json(method, path, canonical);
        }
        let media_type = media_type.to_ascii_lowercase();
        Self::hash(
            b'T',
            &[
                method.as_bytes(),
                path.as_bytes(),
                media_type.as_bytes(),
                canonical,
            ],
        )
    }

    /// Fingerprints a multipart request by every byte of its content type and body but its
    /// boundary, which a client draws anew for every send: `content_type` with the boundary
    /// parameter's value left out, and `pieces`, the body split at each place the boundary is
    /// written (as the caller found them, in order). A retry of the same form under a new
    /// boundary is the same request; any other change to the bytes makes another one.
    ///
    /// The caller must split only where the boundary opens a delimiter line, and nowhere else
    /// in the body may the boundary be written (else a parser could read another form from
    /// the same pieces): then two requests with one fingerprint are one form to any parser.
    pub fn of_multipart<'a>(
        method: &str,
        path: &str,
        content_type: &[u8],
        pieces: impl IntoIterator<Item = &'a [u8]>,
    ) -> Self {
        let mut hasher = Self::start(b'F', &[method.as_bytes(), path.as_bytes(), content_type]);
        for piece in pieces {
            hasher.update((piece.len() as u64).to_be_bytes());
            hasher.update(piece);
        }
        Self(hasher.finalize().into())
    }

    /// Fingerprints a body that is not JSON by its exact bytes and its content type (as its
    /// bytes: a header value need not be UTF-8).
    pub fn of_raw(method: &str, path: &str, content_type: impl AsRef<[u8]>, body: &[u8]) -> Self {
        Self::hash(
            b'R',
            &[
                method.as_bytes(),
                path.as_bytes(),
                content_type.as_ref(),
                body,
            ],
        )
    }

    fn hash(kind: u8, parts: &[&[u8]]) -> Self {
        Self(Self::start(kind, parts).finalize().into())
    }

    fn start(kind: u8, parts: &[&[u8]]) -> Sha256 {
        let mut hasher = Sha256::new();
        hasher.update(DOMAIN);
        hasher.update([kind]);
        for part in parts {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        hasher
    }

    /// Rebuilds a fingerprint from its 32 digest bytes (as stored).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// Reads a stored fingerprint; `None` unless exactly 32 bytes.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Self)
    }

    /// The 32 digest bytes, as stored.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as 64 lowercase hex digits; also what `Display` writes.
    pub fn to_hex(&self) -> String {
        crate::hex::encode(&self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.to_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let first = Fingerprint::of_json(
            "POST",
            "/v1/checkouts",
            br#"{"amount": 100, "currency":"usd"}"#,
        );
        let second = Fingerprint::of_json(
            "POST",
            "/v1/checkouts",
            br#"{"currency":"usd","amount":1e2}"#,
        );
        assert_eq!(first.expect("valid"), second.expect("valid"));
    }

    #[test]
    fn a_json_media_type_other_than_application_json_counts() {
        let plain = Fingerprint::of_canonical_json("PATCH", "/a", b"{}");
        assert_eq!(
            plain,
            Fingerprint::of_typed_json("PATCH", "/a", "Application/JSON", b"{}")
        );
        let merge =
            Fingerprint::of_typed_json("PATCH", "/a", "application/merge-patch+json", b"{}");
        assert_ne!(plain, merge);
        assert_eq!(
            merge,
            Fingerprint::of_typed_json("PATCH", "/a", "application/MERGE-PATCH+json", b"{}")
        );
    }

    #[test]
    fn multipart_counts_every_piece_in_order_and_the_content_type() {
        let form = |content_type: &[u8], pieces: &[&'static [u8]]| {
            Fingerprint::of_multipart("POST", "/u", content_type, pieces.iter().copied())
        };
        let typed = b"multipart/form-data; boundary=";
        let one = form(typed, &[b"--", b"\r\na\r\n\r\n1\r\n--", b"--"]);
        assert_eq!(one, form(typed, &[b"--", b"\r\na\r\n\r\n1\r\n--", b"--"]));
        assert_ne!(one, form(typed, &[b"--", b"--", b"\r\na\r\n\r\n1\r\n--"]));
        assert_ne!(one, form(typed, &[b"--\r\na\r\n\r\n1\r\n--", b"--"]));
        assert_ne!(one, form(typed, &[b"--", b"\r\na\r\n\r\n2\r\n--", b"--"]));
        assert_ne!(
            one,
            form(
                b"multipart/mixed; boundary=",
                &[b"--", b"\r\na\r\n\r\n1\r\n--", b"--"]
            )
        );
        assert_ne!(
            one,
            Fingerprint::of_raw("POST", "/u", typed, b"--\r\na\r\n\r\n1\r\n----")
        );
    }

    #[test]
    fn method_path_and_body_all_count() {
        let base = Fingerprint::of_json("POST", "/a", b"{}").expect("valid");
        assert_ne!(
            base,
            Fingerprint::of_json("PUT", "/a", b"{}").expect("valid")
        );
        assert_ne!(
            base,
            Fingerprint::of_json("POST", "/b", b"{}").expect("valid")
        );
        assert_ne!(
            base,
            Fingerprint::of_json("POST", "/a", b"[]").expect("valid")
        );
        // Length prefixes keep the parts apart: moving a byte from path to method changes it.
        assert_ne!(
            Fingerprint::of_json("POST/", "a", b"{}").expect("valid"),
            Fingerprint::of_json("POST", "/a", b"{}").expect("valid")
        );
    }

    #[test]
    fn raw_bodies_count_their_content_type() {
        let text = Fingerprint::of_raw("POST", "/a", "text/plain", b"{}");
        assert_ne!(text, Fingerprint::of_raw("POST", "/a", "text/csv", b"{}"));
        // As bytes: the same as its text when it is text, and any bytes count.
        assert_eq!(
            text,
            Fingerprint::of_raw("POST", "/a", b"text/plain", b"{}")
        );
        assert_ne!(
            Fingerprint::of_raw("POST", "/a", b"text/plain; x=\xe9", b"{}"),
            Fingerprint::of_raw("POST", "/a", b"text/plain; x=\xe8", b"{}")
        );
        assert_ne!(
            text,
            Fingerprint::of_json("POST", "/a", b"{}").expect("valid")
        );
    }

    #[test]
    fn round_trips_through_stored_bytes() {
        let fingerprint = Fingerprint::of_raw("POST", "/a", "text/plain", b"x");
        assert_eq!(
            Fingerprint::from_slice(fingerprint.as_bytes()),
            Some(fingerprint)
        );
        assert_eq!(Fingerprint::from_slice(&[0; 31]), None);
        assert_eq!(fingerprint.to_hex().len(), 64);
    }
}
