//! A `multipart/*` request for fingerprinting: its content type's parameters, read as RFC 9110
//! §5.6.6 has them (a quoted string may hold `;` and `boundary=`), and its body split at its
//! boundary. A client draws a new boundary for every send, so the same form sent twice is two
//! byte strings that differ only where the boundary is written: the fingerprint covers every
//! other byte of the body and of the content type, so two requests share one only when a
//! handler's parser, whatever it makes of the form, makes the same of both.

use std::ops::Range;

/// A content type read as RFC 9110 §5.6.6 has it:
/// `type "/" subtype *( OWS ";" OWS [ name "=" ( token / quoted-string ) ] )`.
#[derive(Debug)]
pub(crate) struct ContentType {
    parameters: Vec<Parameter>,
}

/// One parameter: its name (lowercase: names are case-insensitive), its value (unquoted), and
/// where the value is written in the content type (quotes included).
#[derive(Debug)]
struct Parameter {
    name: String,
    value: Vec<u8>,
    written_at: Range<usize>,
}

/// A multipart content type's boundary: its value, and where it is written.
#[derive(Debug)]
pub(crate) struct Boundary<'a> {
    pub value: &'a [u8],
    pub written_at: Range<usize>,
}

impl ContentType {
    /// Reads `raw`, or says why it is not a content type.
    pub(crate) fn parse(raw: &[u8]) -> Result<Self, String> {
        let mut at = skip_whitespace(raw, 0);
        let type_end = token_end(raw, at);
        if type_end == at || raw.get(type_end) != Some(&b'/') {
            return Err("the media type is not type/subtype".to_owned());
        }
        let subtype_end = token_end(raw, type_end + 1);
        if subtype_end == type_end + 1 {
            return Err("the media type has no subtype".to_owned());
        }
        at = subtype_end;
        let mut parameters = Vec::new();
        loop {
            at = skip_whitespace(raw, at);
            match raw.get(at) {
                None => break,
                Some(b';') => at = skip_whitespace(raw, at + 1),
                Some(_) => return Err(format!("unexpected text at byte {at}")),
            }
            if matches!(raw.get(at), None | Some(b';')) {
                continue; // an empty parameter
            }
            let name_end = token_end(raw, at);
            if name_end == at {
                return Err(format!("a parameter without a name at byte {at}"));
            }
            let name = String::from_utf8_lossy(&raw[at..name_end]).to_ascii_lowercase();
            if raw.get(name_end) != Some(&b'=') {
                return Err(format!(
                    "the parameter {name} has no `=` right after its name"
                ));
            }
            let start = name_end + 1;
            let (value, end) = if raw.get(start) == Some(&b'"') {
                quoted_string(raw, start).map_err(|why| format!("the parameter {name}: {why}"))?
            } else {
                let end = token_end(raw, start);
                if end == start {
                    return Err(format!("the parameter {name} has no value"));
                }
                (raw[start..end].to_vec(), end)
            };
            parameters.push(Parameter {
                name,
                value,
                written_at: start..end,
            });
            at = end;
        }
        Ok(Self { parameters })
    }

    /// The boundary parameter, if there is one; refused when it is given more than once (in
    /// any case), in RFC 2231's extended notation (`boundary*`: a parser may take it instead),
    /// or is not an RFC 2046 boundary (1 to 70 of `0-9 A-Z a-z '()+_,-./:=?` and space, not
    /// ending in a space).
    pub(crate) fn boundary(&self) -> Result<Option<Boundary<'_>>, String> {
        let mut boundary = None;
        for parameter in &self.parameters {
            if parameter.name == "boundary" {
                if boundary.replace(parameter).is_some() {
                    return Err("the boundary parameter is given more than once".to_owned());
                }
            } else if parameter.name.starts_with("boundary*") {
                return Err(format!(
                    "the boundary is given as {}, which parsers read differently",
                    parameter.name
                ));
            }
        }
        let Some(parameter) = boundary else {
            return Ok(None);
        };
        let value = parameter.value.as_slice();
        let valid = (1..=70).contains(&value.len())
            && value.last() != Some(&b' ')
            && value
                .iter()
                .all(|byte| byte.is_ascii_alphanumeric() || b"'()+_,-./:=? ".contains(byte));
        if !valid {
            return Err(
                "the boundary is not 1 to 70 of 0-9, A-Z, a-z, '()+_,-./:=? and space, \
                 not ending in a space (RFC 2046)"
                    .to_owned(),
            );
        }
        Ok(Some(Boundary {
            value,
            written_at: parameter.written_at.clone(),
        }))
    }
}

fn skip_whitespace(raw: &[u8], mut at: usize) -> usize {
    while matches!(raw.get(at), Some(b' ' | b'\t')) {
        at += 1;
    }
    at
}

/// Where the token starting at `at` ends (`at` itself when there is none).
fn token_end(raw: &[u8], mut at: usize) -> usize {
    while raw
        .get(at)
        .is_some_and(|byte| byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(byte))
    {
        at += 1;
    }
    at
}

/// The quoted string opening at `start`: its value (quoted pairs resolved) and where it ends.
fn quoted_string(raw: &[u8], start: usize) -> Result<(Vec<u8>, usize), &'static str> {
    let text = |byte: u8| byte == b'\t' || (0x20..=0x7e).contains(&byte) || byte >= 0x80;
    let mut value = Vec::new();
    let mut at = start + 1;
    loop {
        match raw.get(at).copied() {
            None => return Err("a quoted string is not closed"),
            Some(b'"') => return Ok((value, at + 1)),
            Some(b'\\') => match raw.get(at + 1).copied() {
                Some(byte) if text(byte) => {
                    value.push(byte);
                    at += 2;
                }
                _ => return Err("a quoted string escapes what it cannot hold"),
            },
            Some(byte) if text(byte) => {
                value.push(byte);
                at += 1;
            }
            Some(_) => return Err("a quoted string holds a control character"),
        }
    }
}

/// The body split at every place its boundary is written, if each of those opens a delimiter
/// line (`--` and the boundary, at the very start of the body or after a line break); `None`
/// when the boundary is written anywhere else, where a parser might take it for a delimiter or
/// not. The pieces are every byte of the body but the boundary's, in order.
pub(crate) fn between_delimiters<'a>(body: &'a [u8], boundary: &[u8]) -> Option<Vec<&'a [u8]>> {
    let mut pieces = Vec::new();
    let mut piece_start = 0;
    let mut search = 0;
    while let Some(found) = find(&body[search..], boundary) {
        let at = search + found;
        let before = &body[..at];
        let opens_delimiter =
            before.ends_with(b"--") && (at == 2 || before[..at - 2].ends_with(b"\r\n"));
        // A delimiter holds no line break, so two never overlap: one that does is not one.
        if !opens_delimiter || at < piece_start {
            return None;
        }
        pieces.push(&body[piece_start..at]);
        piece_start = at + boundary.len();
        search = at + 1;
    }
    pieces.push(&body[piece_start..]);
    Some(pieces)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boundary_of(content_type: &str) -> Result<Option<String>, String> {
        let parsed = ContentType::parse(content_type.as_bytes())?;
        Ok(parsed
            .boundary()?
            .map(|boundary| String::from_utf8_lossy(boundary.value).into_owned()))
    }

    #[test]
    fn parameters_are_read_with_their_quoted_strings() {
        let boundary = |content_type| boundary_of(content_type).expect("parses");
        assert_eq!(
            boundary("multipart/form-data; boundary=abc"),
            Some("abc".into())
        );
        assert_eq!(
            boundary("Multipart/Mixed; charset=x; Boundary=\"a b\""),
            Some("a b".into())
        );
        assert_eq!(
            boundary(r#"multipart/form-data; x="y;boundary=A"; boundary=B"#),
            Some("B".into())
        );
        assert_eq!(
            boundary(r#"multipart/form-data; x="a\"; boundary=A"; boundary=B"#),
            Some("B".into())
        );
        assert_eq!(
            boundary("multipart/form-data;boundary=abc;"),
            Some("abc".into())
        );
        assert_eq!(
            boundary("multipart/form-data ; ; boundary=abc"),
            Some("abc".into())
        );
        assert_eq!(boundary("multipart/form-data"), None);
        assert_eq!(boundary("multipart/form-data; boundaryx=abc"), None);
    }

    #[test]
    fn an_ambiguous_or_invalid_boundary_is_refused() {
        for content_type in [
            "multipart/form-data; boundary=a; boundary=b",
            "multipart/form-data; boundary=a; BOUNDARY=a",
            "multipart/form-data; boundary*=utf-8''a",
            "multipart/form-data; boundary=\"\"",
            "multipart/form-data; boundary=\"a \"",
            "multipart/form-data; boundary=\"a\\\"b\"",
            "multipart/form-data; boundary=\"a",
            "multipart/form-data; boundary=a{b",
            "multipart/form-data; boundary = a",
            "multipart/form-data; boundary=\"a\"b",
            "multipart/form-data; x=\"y; boundary=a",
            "multipart/form-data; =a",
            "multipart; boundary=a",
        ] {
            assert!(boundary_of(content_type).is_err(), "{content_type}");
        }
        let longest = format!("multipart/form-data; boundary={}", "b".repeat(70));
        assert!(boundary_of(&longest).is_ok());
        assert!(boundary_of(&format!("{longest}b")).is_err());
    }

    #[test]
    fn a_body_is_split_only_where_its_boundary_opens_a_delimiter_line() {
        let body = b"pre\r\n--XyZ\r\nA: 1\r\n\r\none\r\n--XyZ--\r\npost";
        assert_eq!(
            between_delimiters(body, b"XyZ"),
            Some(vec![
                &b"pre\r\n--"[..],
                b"\r\nA: 1\r\n\r\none\r\n--",
                b"--\r\npost"
            ])
        );
        assert_eq!(
            between_delimiters(b"--XyZ\r\n\r\nx\r\n--XyZ--", b"XyZ"),
            Some(vec![&b"--"[..], b"\r\n\r\nx\r\n--", b"--"])
        );
        assert_eq!(
            between_delimiters(b"no boundary here", b"XyZ"),
            Some(vec![&b"no boundary here"[..]])
        );
        // Written anywhere else, the boundary makes the body ambiguous.
        assert_eq!(
            between_delimiters(b"--XyZ\r\n\r\nXyZ\r\n--XyZ--", b"XyZ"),
            None
        );
        assert_eq!(between_delimiters(b"a--XyZ\r\n\r\n--XyZ--", b"XyZ"), None);
        assert_eq!(between_delimiters(b"--aa\r\n\r\nx\r\n--aaa", b"aa"), None);
    }
}
