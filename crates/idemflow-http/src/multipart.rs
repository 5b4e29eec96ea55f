//! The parts of a `multipart/*` body (RFC 2046 §5.1), for fingerprinting: a client draws a new
//! boundary for every send, so the same form sent twice is two different byte strings.

/// One part: its header block (exactly as sent) and its content.
pub(crate) type Part<'a> = (&'a [u8], &'a [u8]);

/// The boundary parameter of a `multipart/*` content type, unquoted.
pub(crate) fn boundary(content_type: &str) -> Option<&str> {
    let mut pieces = content_type.split(';');
    let essence = pieces.next()?.trim();
    if !essence.to_ascii_lowercase().starts_with("multipart/") {
        return None;
    }
    pieces.find_map(|parameter| {
        let (name, value) = parameter.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("boundary") {
            return None;
        }
        let value = value.trim();
        let value = value
            .strip_prefix('"')
            .and_then(|inner| inner.strip_suffix('"'))
            .unwrap_or(value);
        (!value.is_empty() && value.len() <= 70).then_some(value)
    })
}

/// Splits `body` into its parts. `None` unless the body is well formed: a delimiter line
/// opens the first part, every part has a header block ended by an empty line, and the close
/// delimiter ends the last. The preamble and epilogue are not part of the request's meaning.
pub(crate) fn parts<'a>(body: &'a [u8], boundary: &str) -> Option<Vec<Part<'a>>> {
    let delimiter = [b"--", boundary.as_bytes()].concat();
    let separator = [b"\r\n--", boundary.as_bytes()].concat();
    // The first delimiter may open the body, or follow a preamble and a line break.
    let mut rest = if body.starts_with(&delimiter) {
        &body[delimiter.len()..]
    } else {
        let at = find(body, &separator)?;
        &body[at + separator.len()..]
    };
    let mut parts = Vec::new();
    loop {
        if rest.starts_with(b"--") {
            return (!parts.is_empty()).then_some(parts);
        }
        rest = skip_line_end(rest)?;
        let end = find(rest, &separator)?;
        let part = &rest[..end];
        rest = &rest[end + separator.len()..];
        parts.push(split_part(part)?);
    }
}

/// A delimiter line may carry trailing spaces before its line break.
fn skip_line_end(text: &[u8]) -> Option<&[u8]> {
    let spaces = text
        .iter()
        .take_while(|byte| matches!(byte, b' ' | b'\t'))
        .count();
    text[spaces..].strip_prefix(b"\r\n")
}

fn split_part(part: &[u8]) -> Option<Part<'_>> {
    if let Some(content) = part.strip_prefix(b"\r\n") {
        return Some((&[], content)); // no headers
    }
    let end = find(part, b"\r\n\r\n")?;
    Some((&part[..end], &part[end + 4..]))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(boundary: &str) -> Vec<u8> {
        format!(
            "preamble\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\none\r\n\
             --{boundary}  \r\nContent-Disposition: form-data; name=\"f\"; filename=\"x.bin\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n\0\x01two\r\n\r\n--{boundary}--\r\nepilogue"
        )
        .into_bytes()
    }

    #[test]
    fn the_same_form_under_two_boundaries_has_the_same_parts() {
        let first = form("XyZ123");
        let second = form("----abc");
        let one = parts(&first, "XyZ123").expect("well formed");
        let two = parts(&second, "----abc").expect("well formed");
        assert_eq!(one, two);
        assert_eq!(one.len(), 2);
        assert_eq!(one[0].1, b"one");
        assert_eq!(one[1].1, b"\0\x01two\r\n");
    }

    #[test]
    fn reads_the_boundary_parameter() {
        assert_eq!(boundary("multipart/form-data; boundary=abc"), Some("abc"));
        assert_eq!(
            boundary("Multipart/Mixed; charset=x; Boundary=\"a b\""),
            Some("a b")
        );
        assert_eq!(boundary("application/json; boundary=abc"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }

    #[test]
    fn a_malformed_body_has_no_parts() {
        assert!(parts(b"no delimiter at all", "abc").is_none());
        assert!(parts(b"--abc\r\nContent-Type: x\r\n\r\nunterminated", "abc").is_none());
        assert!(parts(b"--abc--", "abc").is_none());
        assert!(parts(b"--abc\r\nno blank line\r\n--abc--", "abc").is_none());
    }
}
