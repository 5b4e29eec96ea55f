/// A finished request's answer, stored with the key in the same transaction as the last local
/// effect, and returned byte for byte on every replay.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StoredResponse {
    /// The HTTP status code (or the status of whatever protocol carries the request).
    pub status: u16,
    /// Response headers in order; names as given, values as their exact bytes. Replays return
    /// exactly these.
    pub headers: Vec<(String, FieldValue)>,
    /// The exact body bytes. Written as a base64 string wherever the response is encoded as JSON
    /// (a foreign phase's recorded output): a JSON array of numbers would take ten times the
    /// bytes in memory and in the row. An array is still read, as earlier versions wrote it.
    #[serde(with = "crate::bytes")]
    pub body: Vec<u8>,
}

impl StoredResponse {
    /// A response with this status and body, and no headers.
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// A JSON response with a `content-type: application/json` header.
    pub fn json(status: u16, value: &serde_json::Value) -> Self {
        Self {
            status,
            headers: vec![("content-type".to_owned(), "application/json".into())],
            body: value.to_string().into_bytes(),
        }
    }

    /// An RFC 9457 problem response (`content-type: application/problem+json`).
    pub fn problem(status: u16, value: &serde_json::Value) -> Self {
        Self {
            status,
            headers: vec![("content-type".to_owned(), "application/problem+json".into())],
            body: value.to_string().into_bytes(),
        }
    }

    /// An RFC 9457 problem in the one shape every problem of the engine and its HTTP layer
    /// has: `type` `about:blank`, `title`, `status`, `detail`, and `code`, a word a client can
    /// branch on.
    pub fn problem_of(status: u16, title: &str, code: &str, detail: &str) -> Self {
        Self::problem(status, &problem_document(status, title, code, detail))
    }

    /// Appends a header, after those already there.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<FieldValue>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }
}

/// The document of [`StoredResponse::problem_of`], for a layer that answers it without storing.
pub fn problem_document(status: u16, title: &str, code: &str, detail: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
    })
}

/// A header's value as stored: its exact bytes. HTTP allows bytes 0x80-0xFF (obs-text) in a
/// field value, so a value need not be UTF-8, and a replay must return it as it was.
///
/// Written as a JSON string when the value is UTF-8 without U+0000 (what every earlier version
/// wrote, and still reads), else as `{"bytes": "<base64>"}`: one form for each value, both read.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct FieldValue(Vec<u8>);

impl FieldValue {
    /// A value of these exact bytes.
    pub fn from_bytes(bytes: impl Into<Vec<u8>>) -> Self {
        Self(bytes.into())
    }

    /// The exact bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The value as text, if it is UTF-8.
    pub fn to_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// The exact bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

impl From<String> for FieldValue {
    fn from(text: String) -> Self {
        Self(text.into_bytes())
    }
}

impl From<&str> for FieldValue {
    fn from(text: &str) -> Self {
        Self(text.as_bytes().to_vec())
    }
}

impl From<Vec<u8>> for FieldValue {
    fn from(bytes: Vec<u8>) -> Self {
        Self(bytes)
    }
}

impl From<&[u8]> for FieldValue {
    fn from(bytes: &[u8]) -> Self {
        Self(bytes.to_vec())
    }
}

impl PartialEq<str> for FieldValue {
    fn eq(&self, other: &str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl PartialEq<&str> for FieldValue {
    fn eq(&self, other: &&str) -> bool {
        self.0 == other.as_bytes()
    }
}

impl PartialEq<String> for FieldValue {
    fn eq(&self, other: &String) -> bool {
        self.0 == other.as_bytes()
    }
}

impl std::fmt::Debug for FieldValue {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.to_str() {
            Some(text) => std::fmt::Debug::fmt(text, formatter),
            None => write!(formatter, "b\"{}\"", self.0.escape_ascii()),
        }
    }
}

/// The form of a value that is not text jsonb can hold.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Encoded {
    #[serde(with = "crate::bytes")]
    bytes: Vec<u8>,
}

impl serde::Serialize for FieldValue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct as _;
        match self.to_str() {
            Some(text) if !text.contains('\0') => serializer.serialize_str(text),
            _ => {
                let mut encoded = serializer.serialize_struct("Encoded", 1)?;
                encoded.serialize_field("bytes", &Base64(&self.0))?;
                encoded.end()
            }
        }
    }
}

/// Bytes written as base64, for [`FieldValue`]'s second form.
struct Base64<'a>(&'a [u8]);

impl serde::Serialize for Base64<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        crate::bytes::serialize(self.0, serializer)
    }
}

impl<'de> serde::Deserialize<'de> for FieldValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(FieldValueVisitor)
    }
}

struct FieldValueVisitor;

impl<'de> serde::de::Visitor<'de> for FieldValueVisitor {
    type Value = FieldValue;

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(r#"a header value: a string, or {"bytes": "<base64>"}"#)
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<FieldValue, E> {
        Ok(FieldValue::from(text))
    }

    fn visit_string<E: serde::de::Error>(self, text: String) -> Result<FieldValue, E> {
        Ok(FieldValue::from(text))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<FieldValue, A::Error> {
        let encoded: Encoded =
            serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
        Ok(FieldValue(encoded.bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_values_are_text_when_they_can_be_and_bytes_otherwise() {
        let response = StoredResponse::new(200, Vec::new())
            .with_header("content-type", "text/plain")
            .with_header("x-name", "café")
            .with_header("x-latin-1", FieldValue::from_bytes(*b"caf\xe9 \xff"))
            .with_header("x-nul", FieldValue::from_bytes(*b"a\0b"));
        let json = serde_json::to_value(&response.headers).expect("encodes");
        assert_eq!(
            json,
            serde_json::json!([
                ["content-type", "text/plain"],
                ["x-name", "café"],
                ["x-latin-1", {"bytes": "Y2Fm6SD/"}],
                ["x-nul", {"bytes": "YQBi"}],
            ])
        );
        let read: Vec<(String, FieldValue)> = serde_json::from_value(json).expect("decodes");
        assert_eq!(read, response.headers);
        assert_eq!(read[2].1.as_bytes(), b"caf\xe9 \xff");
    }

    #[test]
    fn headers_stored_by_earlier_versions_are_read() {
        let read: Vec<(String, FieldValue)> =
            serde_json::from_str(r#"[["content-type","application/json"],["x-a","b"]]"#)
                .expect("decodes");
        assert_eq!(read[0].1, "application/json");
        assert_eq!(read[1], ("x-a".to_owned(), FieldValue::from("b")));
        assert!(serde_json::from_str::<FieldValue>(r#"{"bytes":"not base64!"}"#).is_err());
        assert!(serde_json::from_str::<FieldValue>(r#"{"text":"a"}"#).is_err());
        assert!(serde_json::from_str::<FieldValue>("7").is_err());
    }
}
