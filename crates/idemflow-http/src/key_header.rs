//! Parsing the `Idempotency-Key` header.
//!
//! The IETF draft (draft-ietf-httpapi-idempotency-key-header) makes the field an RFC 8941
//! structured-field string: `Idempotency-Key: "8e03978e-40d5-43e8-bc93-6894a57f9324"`. Many
//! clients (Stripe's among them) send the bare value without quotes, so both are accepted: a
//! value that starts with `"` must be a valid sf-string; any other value is taken as it is. Either
//! way the key must then be 1 to 255 bytes of printable ASCII.

use idemflow_core::Key;

/// Why the header is not a usable key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyHeaderError {
    /// The request has no `Idempotency-Key` header.
    Missing,
    /// Sent more than once: which one would be the key?
    Repeated,
    /// Not a valid sf-string, or not a valid key.
    Malformed(String),
}

impl std::fmt::Display for KeyHeaderError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Missing => {
                formatter.write_str("the Idempotency-Key header is required for this request")
            }
            Self::Repeated => formatter.write_str("the Idempotency-Key header must be sent once"),
            Self::Malformed(why) => {
                write!(formatter, "the Idempotency-Key header is malformed: {why}")
            }
        }
    }
}

impl std::error::Error for KeyHeaderError {}

/// Reads the key from a request's headers.
pub fn idempotency_key(headers: &axum::http::HeaderMap) -> Result<Key, KeyHeaderError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let value = values.next().ok_or(KeyHeaderError::Missing)?;
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    let text = value
        .to_str()
        .map_err(|_| KeyHeaderError::Malformed("it holds bytes outside visible ASCII".into()))?
        .trim_matches(|character| character == ' ' || character == '\t');
    let key = if text.starts_with('"') {
        parse_sf_string(text)?
    } else if text.contains(',') {
        // Two header lines merged by a proxy ("a, b"): which one is the key?
        return Err(KeyHeaderError::Repeated);
    } else if text.contains(';') {
        // A structured-field item with parameters whose key is not a string: not a key.
        return Err(KeyHeaderError::Malformed(
            "a bare key may not hold ';' (send the key as a quoted string)".into(),
        ));
    } else {
        text.to_owned()
    };
    Key::parse(&key).map_err(|error| KeyHeaderError::Malformed(error.to_string()))
}

/// An RFC 8941 sf-string: `"`, then printable ASCII with `\"` and `\\` as the only escapes,
/// then `"` and nothing after.
fn parse_sf_string(text: &str) -> Result<String, KeyHeaderError> {
    let malformed = |why: &str| KeyHeaderError::Malformed(why.to_owned());
    let mut characters = text.chars();
    characters.next(); // the opening quote
    let mut key = String::new();
    loop {
        match characters.next() {
            None => return Err(malformed("the string has no closing quote")),
            Some('"') => break,
            Some('\\') => match characters.next() {
                Some(escaped @ ('"' | '\\')) => key.push(escaped),
                _ => return Err(malformed("only \\\" and \\\\ may be escaped")),
            },
            Some(character @ ' '..='~') => key.push(character),
            Some(_) => {
                return Err(malformed(
                    "the string holds a character outside printable ASCII",
                ));
            }
        }
    }
    if characters.next().is_some() {
        return Err(malformed("something follows the closing quote"));
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, HeaderValue};

    use super::*;

    fn parse(values: &[&str]) -> Result<String, KeyHeaderError> {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(
                "idempotency-key",
                HeaderValue::from_str(value).expect("header value"),
            );
        }
        idempotency_key(&headers).map(|key| key.as_str().to_owned())
    }

    #[test]
    fn accepts_sf_strings_and_bare_values() {
        assert_eq!(parse(&[r#""8e03978e-40d5""#]), Ok("8e03978e-40d5".into()));
        assert_eq!(
            parse(&[r#""a \"quoted\" \\ key""#]),
            Ok(r#"a "quoted" \ key"#.into())
        );
        assert_eq!(parse(&["order-42"]), Ok("order-42".into()));
        assert_eq!(parse(&[" order-42 "]), Ok("order-42".into()));
    }

    #[test]
    fn rejects_missing_repeated_and_malformed_keys() {
        assert_eq!(parse(&[]), Err(KeyHeaderError::Missing));
        assert_eq!(parse(&["a", "b"]), Err(KeyHeaderError::Repeated));
        assert_eq!(parse(&["a, b"]), Err(KeyHeaderError::Repeated));
        assert_eq!(
            parse(&[r#""a", "b""#]),
            Err(KeyHeaderError::Malformed(
                "something follows the closing quote".into()
            ))
        );
        assert!(matches!(
            parse(&["k;a=1"]),
            Err(KeyHeaderError::Malformed(_))
        ));
        for bad in [
            r#""unterminated"#,
            r#""a"b"#,
            r#""bad \n escape""#,
            r#""""#,
            "",
        ] {
            assert!(
                matches!(parse(&[bad]), Err(KeyHeaderError::Malformed(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            parse(&[&"k".repeat(256)]),
            Err(KeyHeaderError::Malformed(_))
        ));
        // Spaces alone, quoted: a key every unset client would share.
        for blank in [r#"" ""#, r#""   ""#] {
            assert!(
                matches!(parse(&[blank]), Err(KeyHeaderError::Malformed(_))),
                "{blank:?}"
            );
        }
    }
}
