//! The headers the client writes and reads.

use std::time::{Duration, SystemTime};

use reqwest::header::{HeaderMap, HeaderValue, RETRY_AFTER};

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header that marks a replayed answer.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// How the key is written in the `Idempotency-Key` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyForm {
    /// As an RFC 8941 sf-string, `Idempotency-Key: "0190b6c2-…"`, with `"` and `\` escaped: what
    /// draft-ietf-httpapi-idempotency-key-header asks for, and what idemflow's server reads (it
    /// also accepts bare keys).
    #[default]
    Quoted,
    /// The key as it is, `Idempotency-Key: 0190b6c2-…`: for servers that take the header's value
    /// verbatim (and would keep the quotes as part of the key). A key with leading or trailing
    /// spaces cannot be sent this way (HTTP strips them). The client's own keys (UUIDs) read the
    /// same either way to idemflow's server; a key of a journal of the caller's own holding `"`,
    /// `,` or `;` is better sent quoted to it.
    Bare,
}

/// The header value for a valid `key` in `form`, if it can be written so.
pub(crate) fn key_value(key: &str, form: KeyForm) -> Option<HeaderValue> {
    match form {
        KeyForm::Quoted => HeaderValue::from_str(&sf_string(key)).ok(),
        KeyForm::Bare if key.trim() == key => HeaderValue::from_str(key).ok(),
        KeyForm::Bare => None,
    }
}

/// Whether `key` can be sent: 1 to 255 printable ASCII characters (what idemflow's server
/// accepts).
pub(crate) fn is_valid_key(key: &str) -> bool {
    (1..=255).contains(&key.len()) && key.bytes().all(|byte| (b' '..=b'~').contains(&byte))
}

/// `key` as an RFC 8941 sf-string: quoted, with `"` and `\` escaped. `key` must be valid.
pub(crate) fn sf_string(key: &str) -> String {
    let mut quoted = String::with_capacity(key.len() + 2);
    quoted.push('"');
    for character in key.chars() {
        if matches!(character, '"' | '\\') {
            quoted.push('\\');
        }
        quoted.push(character);
    }
    quoted.push('"');
    quoted
}

/// Whether the answer says it is a replay (`true`, or the sf-boolean `?1`).
pub(crate) fn is_replayed(headers: &HeaderMap) -> bool {
    headers
        .get(IDEMPOTENT_REPLAYED)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            let value = value.trim();
            value.eq_ignore_ascii_case("true") || value == "?1"
        })
}

/// The wait a `Retry-After` asks for, if it is present and readable: delay-seconds (`0` means
/// now; a decimal such as `0.5` is accepted too) or an HTTP-date (a date past means now).
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(RETRY_AFTER)?.to_str().ok()?.trim();
    let digits = |text: &str| !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit());
    if digits(value) {
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    if let Some((whole, fraction)) = value.split_once('.')
        && digits(whole)
        && digits(fraction)
    {
        return Some(
            value
                .parse()
                .ok()
                .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok())
                .unwrap_or(Duration::MAX),
        );
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(name: &'static str, value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, HeaderValue::from_static(value));
        headers
    }

    #[test]
    fn keys_are_quoted_and_escaped() {
        assert_eq!(sf_string("abc-1"), r#""abc-1""#);
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert!(is_valid_key("0190b6c2-8f4e-7c3a-9d2b-5e6f7a8b9c0d"));
        assert!(is_valid_key(" ~"));
        assert!(!is_valid_key(""));
        assert!(!is_valid_key("tab\there"));
        assert!(!is_valid_key("é"));
        assert!(!is_valid_key(&"k".repeat(256)));
        assert!(is_valid_key(&"k".repeat(255)));
    }

    #[test]
    fn keys_are_written_in_the_form_asked_for() {
        let value = |key, form| key_value(key, form).map(|value| value.as_bytes().to_vec());
        assert_eq!(
            value("abc-1", KeyForm::Quoted),
            Some(br#""abc-1""#.to_vec())
        );
        assert_eq!(value("abc-1", KeyForm::Bare), Some(b"abc-1".to_vec()));
        assert_eq!(
            value(r#"a"b"#, KeyForm::Quoted),
            Some(br#""a\"b""#.to_vec())
        );
        assert_eq!(value(r#"a"b"#, KeyForm::Bare), Some(br#"a"b"#.to_vec()));
        assert_eq!(
            value(" padded ", KeyForm::Quoted),
            Some(br#"" padded ""#.to_vec())
        );
        assert_eq!(value(" padded", KeyForm::Bare), None);
        assert_eq!(value("padded ", KeyForm::Bare), None);
    }

    #[test]
    fn retry_after_reads_seconds_decimals_and_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap_or(now());
        let read = |value| retry_after(&with("retry-after", value), now);
        assert_eq!(read("0"), Some(Duration::ZERO));
        assert_eq!(read(" 3 "), Some(Duration::from_secs(3)));
        assert_eq!(read("0.25"), Some(Duration::from_millis(250)));
        assert_eq!(
            read("99999999999999999999999"),
            Some(Duration::from_secs(u64::MAX))
        );
        assert_eq!(
            read("Sun, 06 Nov 1994 08:50:07 GMT"),
            Some(Duration::from_secs(30))
        );
        assert_eq!(read("Sun, 06 Nov 1994 08:00:00 GMT"), Some(Duration::ZERO));
        assert_eq!(read("-1"), None);
        assert_eq!(read(".5"), None);
        assert_eq!(read("soon"), None);
        assert_eq!(retry_after(&HeaderMap::new(), now), None);
    }

    fn now() -> SystemTime {
        SystemTime::now()
    }

    #[test]
    fn replayed_is_read_from_its_header() {
        assert!(is_replayed(&with(IDEMPOTENT_REPLAYED, "true")));
        assert!(is_replayed(&with(IDEMPOTENT_REPLAYED, "?1")));
        assert!(!is_replayed(&with(IDEMPOTENT_REPLAYED, "false")));
        assert!(!is_replayed(&HeaderMap::new()));
    }
}
