use std::fmt;

/// A client's idempotency key, validated: 1 to 255 bytes of printable ASCII (space through `~`),
/// not spaces alone.
///
/// Printable ASCII is what an RFC 8941 sf-string can carry, so every key an HTTP client can send
/// fits, and no key can smuggle control characters into logs or the derived keys sent downstream.
/// Keys compare bytewise (the column uses the `C` collation): `abc` and `ABC` are two keys.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(String);

/// Why a string is not a valid [`Key`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key is the empty string.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is spaces alone: empty once trimmed, the mark of a client whose key was never
    /// set, which would share it with every other such client.
    #[error("the idempotency key is only spaces")]
    Blank,
    /// The key is longer than [`Key::MAX_BYTES`].
    #[error("the idempotency key is {length} bytes long; at most {max} are allowed", max = Key::MAX_BYTES)]
    TooLong {
        /// The key's length, in bytes.
        length: usize,
    },
    /// The key holds a byte outside printable ASCII (space through `~`).
    #[error("the idempotency key holds a character outside printable ASCII at byte {position}")]
    NotPrintable {
        /// The offset of the first such byte.
        position: usize,
    },
}

impl Key {
    /// The longest key accepted, in bytes.
    pub const MAX_BYTES: usize = 255;

    /// Validates a key as received; the text is kept as is, never trimmed or case-folded.
    pub fn parse(text: &str) -> Result<Self, KeyError> {
        if text.is_empty() {
            return Err(KeyError::Empty);
        }
        if text.len() > Self::MAX_BYTES {
            return Err(KeyError::TooLong { length: text.len() });
        }
        if let Some(position) = text.bytes().position(|byte| !(0x20..=0x7e).contains(&byte)) {
            return Err(KeyError::NotPrintable { position });
        }
        if text.bytes().all(|byte| byte == b' ') {
            return Err(KeyError::Blank);
        }
        Ok(Self(text.to_owned()))
    }

    /// The key as received.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "Key({:?})", self.0)
    }
}

impl fmt::Display for Key {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl std::str::FromStr for Key {
    type Err = KeyError;
    fn from_str(text: &str) -> Result<Self, KeyError> {
        Self::parse(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_printable_ascii_up_to_255_bytes() {
        assert!(Key::parse("a").is_ok());
        assert!(Key::parse(" ~!\"#").is_ok());
        assert!(Key::parse(&"k".repeat(255)).is_ok());
        assert_eq!(
            Key::parse("order-42").map(|key| key.to_string()),
            Ok("order-42".to_owned())
        );
    }

    #[test]
    fn rejects_empty_long_and_unprintable_keys() {
        assert_eq!(Key::parse(""), Err(KeyError::Empty));
        assert_eq!(
            Key::parse(&"k".repeat(256)),
            Err(KeyError::TooLong { length: 256 })
        );
        assert_eq!(
            Key::parse("a\nb"),
            Err(KeyError::NotPrintable { position: 1 })
        );
        assert_eq!(Key::parse("é"), Err(KeyError::NotPrintable { position: 0 }));
        assert_eq!(
            Key::parse("a\u{7f}"),
            Err(KeyError::NotPrintable { position: 1 })
        );
    }

    /// A key of spaces alone is almost always a client's bug (an unset variable padded, a
    /// template left empty): every such client would share one key.
    #[test]
    fn rejects_keys_of_spaces_alone() {
        assert_eq!(Key::parse(" "), Err(KeyError::Blank));
        assert_eq!(Key::parse("   "), Err(KeyError::Blank));
        // Spaces inside or around a key are kept as sent: " a " and "a" are two keys.
        assert_eq!(
            Key::parse(" a ").map(|key| key.to_string()),
            Ok(" a ".to_owned())
        );
    }

    #[test]
    fn keys_are_case_sensitive() {
        assert_ne!(Key::parse("abc"), Key::parse("ABC"));
    }
}
