//! The `wait` preference of RFC 7240's `Prefer` header: how long a client would rather wait for
//! an answer than be told to come back.
//!
//! ```text
//! Prefer     = 1#preference
//! preference = token [ BWS "=" BWS word ] *( OWS ";" [ OWS parameter ] )
//! parameter  = token [ BWS "=" BWS word ]
//! word       = token / quoted-string
//! ```
//!
//! Preferences are read across every `Prefer` field in order (a proxy may merge them into one
//! line, or not); names are case-insensitive. A field value that does not parse is ignored as a
//! whole: which of its preferences were meant cannot be known. RFC 7240 §2: only the first `wait`
//! counts, so a first one that is not delta-seconds (`wait=soon`, `wait=-1`, `wait`) means no
//! wait, whatever follows.

use axum::http::HeaderMap;
use axum::http::header::HeaderName;

/// The `Prefer` request header (RFC 7240).
pub(crate) const PREFER: HeaderName = HeaderName::from_static("prefer");
/// The `Preference-Applied` response header (RFC 7240 §3).
pub(crate) const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");

/// The seconds of the request's first `wait` preference, if it has a valid one. Too many digits
/// for a `u64` read as `u64::MAX` (RFC 9111 §1.2.2's rule for delta-seconds): longer than any
/// server allows anyway.
pub(crate) fn wait(headers: &HeaderMap) -> Option<u64> {
    let value = headers
        .get_all(PREFER)
        .iter()
        .filter_map(|field| field.to_str().ok())
        .filter_map(preferences)
        .flatten()
        .find(|(name, _)| name.eq_ignore_ascii_case("wait"))?
        .1?;
    if value.is_empty() || !value.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    Some(value.parse().unwrap_or(u64::MAX))
}

/// Each preference of one field value, its name and its value (a quoted string unquoted), its
/// parameters left out; `None` if the value does not parse.
fn preferences(field: &str) -> Option<Vec<(String, Option<String>)>> {
    let mut reader = Reader {
        rest: field.as_bytes(),
    };
    let mut found = Vec::new();
    loop {
        reader.skip_whitespace();
        // RFC 9110 §5.6.1: a recipient accepts empty list elements (`a, , b`).
        if reader.eat(b',') {
            continue;
        }
        if reader.rest.is_empty() {
            return Some(found);
        }
        let (name, value) = reader.pair()?;
        // Parameters belong to the preference: read to stay in step, then dropped.
        loop {
            reader.skip_whitespace();
            if !reader.eat(b';') {
                break;
            }
            reader.skip_whitespace();
            if reader.rest.first().is_some_and(|&byte| is_tchar(byte)) {
                reader.pair()?;
            }
        }
        found.push((name, value));
        reader.skip_whitespace();
        if !reader.eat(b',') && !reader.rest.is_empty() {
            return None;
        }
    }
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl Reader<'_> {
    fn skip_whitespace(&mut self) {
        while let [b' ' | b'\t', rest @ ..] = self.rest {
            self.rest = rest;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        match self.rest.split_first() {
            Some((&first, rest)) if first == byte => {
                self.rest = rest;
                true
            }
            _ => false,
        }
    }

    fn token(&mut self) -> Option<String> {
        let length = self
            .rest
            .iter()
            .position(|&byte| !is_tchar(byte))
            .unwrap_or(self.rest.len());
        if length == 0 {
            return None;
        }
        let (token, rest) = self.rest.split_at(length);
        self.rest = rest;
        Some(String::from_utf8_lossy(token).into_owned())
    }

    /// `token [ BWS "=" BWS word ]`.
    fn pair(&mut self) -> Option<(String, Option<String>)> {
        let name = self.token()?;
        let before = self.rest;
        self.skip_whitespace();
        if !self.eat(b'=') {
            self.rest = before;
            return Some((name, None));
        }
        self.skip_whitespace();
        let value = if self.rest.first() == Some(&b'"') {
            self.quoted()?
        } else {
            self.token()?
        };
        Some((name, Some(value)))
    }

    /// A quoted-string (RFC 9110 §5.6.4), unquoted: `\` escapes the next character.
    fn quoted(&mut self) -> Option<String> {
        let mut value = Vec::new();
        let mut bytes = self.rest.iter().enumerate().skip(1);
        while let Some((at, &byte)) = bytes.next() {
            match byte {
                b'"' => {
                    self.rest = &self.rest[at + 1..];
                    return Some(String::from_utf8_lossy(&value).into_owned());
                }
                b'\\' => value.push(*bytes.next()?.1),
                _ => value.push(byte),
            }
        }
        None // never closed
    }
}

/// RFC 9110 §5.6.2's tchar.
fn is_tchar(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn wait_of(fields: &[&str]) -> Option<u64> {
        let mut headers = HeaderMap::new();
        for field in fields {
            headers.append(PREFER, HeaderValue::from_str(field).expect("a field value"));
        }
        wait(&headers)
    }

    #[test]
    fn the_wait_preference_is_read_among_others() {
        assert_eq!(wait_of(&["wait=5"]), Some(5));
        assert_eq!(wait_of(&["WAIT=5"]), Some(5));
        assert_eq!(wait_of(&["respond-async, wait=7"]), Some(7));
        assert_eq!(wait_of(&["respond-async,wait=7,handling=lenient"]), Some(7));
        assert_eq!(wait_of(&["  wait = 3 "]), Some(3), "BWS around =");
        assert_eq!(wait_of(&["wait=\"4\""]), Some(4), "a quoted value");
        assert_eq!(wait_of(&["wait=4; foo=bar; baz"]), Some(4), "parameters");
        assert_eq!(
            wait_of(&["return=minimal; x=\"a, wait=9\", wait=2"]),
            Some(2)
        );
        assert_eq!(wait_of(&[", ,wait=6,"]), Some(6), "empty elements");
        assert_eq!(wait_of(&["respond-async", "wait=8"]), Some(8), "two fields");
        assert_eq!(wait_of(&["wait=0"]), Some(0));
        assert_eq!(wait_of(&["wait=99999999999999999999999"]), Some(u64::MAX));
        assert_eq!(wait_of(&[]), None);
        assert_eq!(wait_of(&["respond-async"]), None);
    }

    #[test]
    fn only_the_first_wait_counts_and_an_invalid_one_means_none() {
        assert_eq!(wait_of(&["wait=3, wait=9"]), Some(3));
        assert_eq!(wait_of(&["wait=3", "wait=9"]), Some(3));
        for invalid in [
            "wait=soon",
            "wait=-1",
            "wait=1.5",
            "wait",
            "wait=\"\"",
            "wait=+2",
        ] {
            assert_eq!(wait_of(&[invalid, "wait=9"]), None, "{invalid}");
        }
    }

    #[test]
    fn a_field_that_does_not_parse_is_ignored_whole() {
        for malformed in [
            "wait=5 x",
            "wait=\"5",
            "wait=5; =x",
            "wait==5",
            "wait=5 ,; x",
            "=5",
            "wait=(5)",
        ] {
            assert_eq!(wait_of(&[malformed]), None, "{malformed}");
        }
        // Another field still counts.
        assert_eq!(wait_of(&["wait=\"5", "wait=2"]), Some(2));
    }
}
