//! Bytes inside JSON: written as one base64 string (RFC 4648, standard alphabet, padded), read
//! from that or from an array of numbers. serde's default for `Vec<u8>` is the array, about ten
//! bytes of JSON and thirty-two of `serde_json::Value` per byte; the string is 4/3.
//!
//! Use with `#[serde(with = "idemflow_core::bytes")]` on a `Vec<u8>` field.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

/// Writes `bytes` as one padded base64 string.
pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&STANDARD.encode(bytes))
}

/// Reads bytes from a base64 string, or from an array of numbers (each 0 to 255).
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
    deserializer.deserialize_any(BytesVisitor)
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("a base64 string or an array of bytes")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<Vec<u8>, E> {
        STANDARD
            .decode(text)
            .map_err(|error| E::custom(format!("invalid base64: {error}")))
    }

    fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<Vec<u8>, E> {
        Ok(bytes.to_vec())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut sequence: A) -> Result<Vec<u8>, A::Error> {
        let mut bytes = Vec::with_capacity(sequence.size_hint().unwrap_or(0));
        while let Some(byte) = sequence.next_element::<u8>()? {
            bytes.push(byte);
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Holder {
        #[serde(with = "super")]
        body: Vec<u8>,
    }

    #[test]
    fn bytes_are_written_as_base64_and_read_back() {
        let holder = Holder {
            body: vec![0, 1, 2, 250, 255, b'a'],
        };
        let json = serde_json::to_string(&holder).expect("encodes");
        assert_eq!(json, r#"{"body":"AAEC+v9h"}"#);
        let value = serde_json::to_value(&holder).expect("encodes");
        assert_eq!(
            serde_json::from_value::<Holder>(value).expect("decodes"),
            holder
        );
    }

    #[test]
    fn the_array_form_of_earlier_versions_is_still_read() {
        let holder: Holder = serde_json::from_str(r#"{"body":[0,1,255]}"#).expect("decodes");
        assert_eq!(holder.body, vec![0, 1, 255]);
        assert!(serde_json::from_str::<Holder>(r#"{"body":"not base64!"}"#).is_err());
        assert!(serde_json::from_str::<Holder>(r#"{"body":[256]}"#).is_err());
    }
}
