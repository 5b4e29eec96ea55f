//! What makes two requests under one key "the same request", by their content type.

use axum::http::request::Parts;
use axum::http::{HeaderValue, header};
use idemflow_core::{CanonicalError, Fingerprint, canonicalize_exact};

use crate::multipart::{self, ContentType};

/// Why a request could not be fingerprinted: it is refused (400), nothing stored.
#[derive(Debug)]
pub(crate) enum FingerprintError {
    /// A JSON body that does not canonicalize.
    Body(CanonicalError),
    /// A content type that does not say one thing: sent twice, or a multipart one whose
    /// boundary cannot be told for sure. A handler's parser and the fingerprint could read two
    /// different requests from it.
    ContentType(String),
}

/// A JSON body (`application/json` or any `+json` type) by its RFC 8785 canonical form and its
/// media type; a multipart body by every byte of it and of its content type but its boundary
/// (drawn anew for every send), when the boundary is written only where it opens delimiter
/// lines; any other body by its exact bytes and its content type.
pub(crate) fn fingerprint(
    method: &str,
    target: &str,
    parts: &Parts,
    body: &[u8],
) -> Result<Fingerprint, FingerprintError> {
    let mut content_types = parts.headers.get_all(header::CONTENT_TYPE).iter();
    let content_type = content_types.next().map_or(&[][..], HeaderValue::as_bytes);
    if content_types.next().is_some() {
        return Err(FingerprintError::ContentType(
            "the Content-Type header is sent more than once".to_owned(),
        ));
    }
    let essence = media_type(&String::from_utf8_lossy(content_type));
    if is_json(&essence) {
        // Exact: the handler reads the bytes itself, so numbers must mean what they say.
        let canonical = canonicalize_exact(body).map_err(FingerprintError::Body)?;
        return Ok(Fingerprint::of_typed_json(
            method, target, &essence, &canonical,
        ));
    }
    if essence.starts_with("multipart/") {
        let parsed = ContentType::parse(content_type).map_err(FingerprintError::ContentType)?;
        if let Some(boundary) = parsed.boundary().map_err(FingerprintError::ContentType)?
            && let Some(pieces) = multipart::between_delimiters(body, boundary.value)
        {
            let unbounded = [
                &content_type[..boundary.written_at.start],
                &content_type[boundary.written_at.end..],
            ]
            .concat();
            return Ok(Fingerprint::of_multipart(
                method, target, &unbounded, pieces,
            ));
        }
        // No boundary, or one written elsewhere than its delimiters: by the exact bytes.
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

#[cfg(test)]
mod tests {
    use axum::http::Request;

    use super::*;

    /// A small xorshift generator: the same cases on every run.
    struct Generator(u64);

    impl Generator {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, bound: usize) -> usize {
            (self.next() % bound as u64) as usize
        }
    }

    /// What `fingerprint` makes of a request with these content types and body; `None` when
    /// it is refused.
    fn print(content_types: &[&[u8]], body: &[u8]) -> Option<Fingerprint> {
        let mut request = Request::builder().method("POST").uri("/v1/forms");
        for content_type in content_types {
            request = request.header(
                header::CONTENT_TYPE,
                axum::http::HeaderValue::from_bytes(content_type).ok()?,
            );
        }
        let (parts, ()) = request.body(()).expect("a request").into_parts();
        fingerprint("POST", "/v1/forms", &parts, body).ok()
    }

    /// A form with a preamble, two parts (one binary) and an epilogue.
    fn form(boundary: &str) -> Vec<u8> {
        let mut form = format!(
            "preamble\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"amount\"\r\n\r\n\
             100\r\n--{boundary}  \r\nContent-Disposition: form-data; name=\"f\"; \
             filename=\"x.bin\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        )
        .into_bytes();
        form.extend_from_slice(b"\0\x01\xfftwo\r\n");
        form.extend_from_slice(format!("\r\n--{boundary}--\r\nepilogue").as_bytes());
        form
    }

    const BCHARS: &[u8] =
        b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'()+_,-./:=? ";

    /// A boundary of 1 to 70 characters of RFC 2046's, not ending in a space, not found in the
    /// form's other text.
    fn boundary(generator: &mut Generator) -> String {
        loop {
            let length = 1 + generator.below(70);
            let mut boundary: Vec<u8> = (0..length)
                .map(|_| BCHARS[generator.below(BCHARS.len())])
                .collect();
            while boundary.last() == Some(&b' ') {
                boundary.pop();
            }
            let boundary = String::from_utf8(boundary).expect("ASCII");
            let text = String::from_utf8_lossy(&form("")).into_owned();
            if boundary.len() >= 4 && !text.contains(&boundary) {
                return boundary;
            }
        }
    }

    /// The content type for `boundary`: a token as it is, else quoted.
    fn content_type(boundary: &str) -> String {
        let token = boundary
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || b"'+_-.".contains(&byte));
        if token {
            format!("multipart/form-data; charset=utf-8; boundary={boundary}")
        } else {
            format!("multipart/form-data; charset=utf-8; boundary=\"{boundary}\"")
        }
    }

    #[test]
    fn the_same_form_under_any_boundary_is_one_request() {
        let base = print(
            &[b"multipart/form-data; charset=utf-8; boundary=base"],
            &form("base"),
        )
        .expect("fingerprinted");
        let mut generator = Generator(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let boundary = boundary(&mut generator);
            let content_type = content_type(&boundary);
            assert_eq!(
                print(&[content_type.as_bytes()], &form(&boundary)),
                Some(base),
                "{content_type}"
            );
        }
        // A token boundary may be quoted or not.
        assert_eq!(
            print(
                &[b"multipart/form-data; charset=utf-8; boundary=\"base\""],
                &form("base")
            ),
            Some(base)
        );
    }

    /// Every byte of the body, and of the content type, counts: changed, the request is another
    /// one (or refused), wherever the byte is (preamble, delimiter line, part headers, content,
    /// epilogue). Generated over every position, for several boundaries.
    #[test]
    fn every_byte_of_a_form_but_its_boundary_is_fingerprinted() {
        let mut generator = Generator(0x2545_f491_4f6c_dd1d);
        for _ in 0..8 {
            let boundary = boundary(&mut generator);
            let content_type = content_type(&boundary);
            let body = form(&boundary);
            let base = print(&[content_type.as_bytes()], &body).expect("fingerprinted");
            for at in 0..body.len() {
                let mut changed = body.clone();
                changed[at] ^= 1 + generator.below(255) as u8;
                assert_ne!(
                    print(&[content_type.as_bytes()], &changed),
                    Some(base),
                    "{content_type}: byte {at} of the body"
                );
            }
            for at in 0..content_type.len() {
                let mut changed = content_type.clone().into_bytes();
                changed[at] ^= 1 + generator.below(127) as u8;
                assert_ne!(
                    print(&[changed.as_slice()], &body),
                    Some(base),
                    "{content_type}: byte {at} of the content type, {:?}",
                    String::from_utf8_lossy(&changed)
                );
            }
        }
    }
}
