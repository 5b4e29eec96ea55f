use std::fmt;

/// Who a key belongs to. Keys are scoped by tenant: two tenants may use the same client key and
/// never see each other's responses.
///
/// A tenant id is text so integers, UUIDs and slugs all fit: 1 to 128 bytes of ASCII letters,
/// digits, `-`, `_` and `.`. The restricted alphabet keeps [`crate::DerivedKey`] unambiguous (a
/// tenant id never contains the `:` that separates its parts). It should come from authentication,
/// never from the request body.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TenantId(String);

/// Why a string is not a valid [`TenantId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// The tenant id is the empty string.
    #[error("the tenant id is empty")]
    Empty,
    /// The tenant id is longer than [`TenantId::MAX_BYTES`].
    #[error("the tenant id is {length} bytes long; at most {max} are allowed", max = TenantId::MAX_BYTES)]
    TooLong {
        /// The tenant id's length, in bytes.
        length: usize,
    },
    /// The tenant id holds a character other than ASCII letters, digits, `-`, `_` or `.`.
    #[error(
        "the tenant id holds a character other than ASCII letters, digits, '-', '_' or '.' at byte {position}"
    )]
    InvalidCharacter {
        /// The offset of the first such byte.
        position: usize,
    },
}

impl TenantId {
    /// The longest tenant id accepted, in bytes.
    pub const MAX_BYTES: usize = 128;

    /// Validates a tenant id; the text is kept as is.
    pub fn new(text: impl Into<String>) -> Result<Self, TenantError> {
        let text = text.into();
        if text.is_empty() {
            return Err(TenantError::Empty);
        }
        if text.len() > Self::MAX_BYTES {
            return Err(TenantError::TooLong { length: text.len() });
        }
        let allowed = |byte: u8| byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.');
        if let Some(position) = text.bytes().position(|byte| !allowed(byte)) {
            return Err(TenantError::InvalidCharacter { position });
        }
        Ok(Self(text))
    }

    /// The tenant id's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<u64> for TenantId {
    fn from(number: u64) -> Self {
        Self(number.to_string())
    }
}

impl From<i64> for TenantId {
    fn from(number: i64) -> Self {
        Self(number.to_string())
    }
}

impl std::str::FromStr for TenantId {
    type Err = TenantError;
    fn from_str(text: &str) -> Result<Self, TenantError> {
        Self::new(text)
    }
}

impl fmt::Debug for TenantId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "TenantId({:?})", self.0)
    }
}

impl fmt::Display for TenantId {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_uuids_and_slugs_fit() {
        assert_eq!(TenantId::from(42_u64).as_str(), "42");
        assert_eq!(TenantId::from(-7_i64).as_str(), "-7");
        assert!(TenantId::new("0190a5c4-6f1e-7b7a-9a51-3f0f5d1c2b3a").is_ok());
        assert!(TenantId::new("acme_corp.eu").is_ok());
    }

    #[test]
    fn rejects_empty_long_and_separator_characters() {
        assert_eq!(TenantId::new(""), Err(TenantError::Empty));
        assert_eq!(
            TenantId::new("t".repeat(129)),
            Err(TenantError::TooLong { length: 129 })
        );
        assert_eq!(
            TenantId::new("a:b"),
            Err(TenantError::InvalidCharacter { position: 1 })
        );
        assert_eq!(
            TenantId::new("a b"),
            Err(TenantError::InvalidCharacter { position: 1 })
        );
    }
}
