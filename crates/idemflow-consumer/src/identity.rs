//! What identifies a message: the subscriber applying it and the message's own id, with a
//! fingerprint of its payload.

use std::fmt;

use sha2::{Digest, Sha256};

/// A name or id that cannot identify a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidIdentity {
    /// A subscriber name must be 1-128 bytes of printable ASCII, without spaces.
    #[error("a subscriber name must be 1-128 bytes of printable ASCII without spaces: {0:?}")]
    Subscriber(String),
    /// A message id must be 1-255 bytes, not only spaces, without control characters.
    #[error("a message id must be 1-255 bytes, not only spaces, without control characters: {0:?}")]
    MessageId(String),
}

/// Who applies a message: one projection, read model or downstream effect. Part of the message's
/// identity, so two subscribers of one message each apply it once.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subscriber(String);

impl Subscriber {
    /// 1-128 bytes of printable ASCII without spaces (`billing-projection`, `search.v2`).
    pub fn new(name: impl Into<String>) -> Result<Self, InvalidIdentity> {
        let name = name.into();
        let valid = (1..=128).contains(&name.len()) && name.bytes().all(|b| b.is_ascii_graphic());
        if valid {
            Ok(Self(name))
        } else {
            Err(InvalidIdentity::Subscriber(name))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Subscriber {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

/// A delivered message: the id its publisher gave it, and its payload, fingerprinted once here.
///
/// The id is the publisher's: a publisher that sends one intent twice must send it under one id
/// (that is what makes its duplicates recognisable), and never two intents under one id (the
/// second would be refused, or lost if its payload were equal).
#[derive(Clone, PartialEq, Eq)]
pub struct Message {
    id: String,
    payload: Vec<u8>,
    fingerprint: [u8; 32],
}

impl Message {
    /// The id must be 1-255 bytes (AMQP's `message-id` limit), not only spaces (an unset id
    /// variable would make every message one), and hold no control characters (no NUL, which
    /// PostgreSQL's text cannot store).
    pub fn new(
        id: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Result<Self, InvalidIdentity> {
        let id = id.into();
        let valid = (1..=255).contains(&id.len())
            && !id.chars().all(|c| c == ' ')
            && !id.chars().any(char::is_control);
        if !valid {
            return Err(InvalidIdentity::MessageId(id));
        }
        let payload = payload.into();
        let fingerprint = Sha256::digest(&payload).into();
        Ok(Self {
            id,
            payload,
            fingerprint,
        })
    }

    /// The message id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The payload, as delivered.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// SHA-256 of the payload: what a redelivery must match.
    pub fn fingerprint(&self) -> &[u8; 32] {
        &self.fingerprint
    }
}

// The payload may be large or sensitive: logs get its size and fingerprint, not its bytes.
impl fmt::Debug for Message {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Message")
            .field("id", &self.id)
            .field("payload_bytes", &self.payload.len())
            .field("fingerprint", &hex(&self.fingerprint))
            .finish()
    }
}

/// Lowercase hex, for fingerprints in errors and logs.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subscribers_are_printable_ascii_without_spaces() {
        assert!(Subscriber::new("billing-projection").is_ok());
        assert!(Subscriber::new("").is_err());
        assert!(Subscriber::new("two words").is_err());
        assert!(Subscriber::new("é").is_err());
        assert!(Subscriber::new("x".repeat(128)).is_ok());
        assert!(Subscriber::new("x".repeat(129)).is_err());
    }

    #[test]
    fn message_ids_are_bounded_and_never_blank() {
        assert!(Message::new("0190a3c4-7e1f", b"{}".to_vec()).is_ok());
        assert!(Message::new("", b"{}".to_vec()).is_err());
        assert!(Message::new("   ", b"{}".to_vec()).is_err());
        assert!(Message::new("a\0b", b"{}".to_vec()).is_err());
        assert!(Message::new("x".repeat(255), b"{}".to_vec()).is_ok());
        assert!(Message::new("x".repeat(256), b"{}".to_vec()).is_err());
    }

    #[test]
    fn the_fingerprint_is_the_payload_s_sha256() {
        let message = Message::new("m", b"abc".to_vec()).expect("a valid id");
        assert_eq!(
            hex(message.fingerprint()),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(!format!("{message:?}").contains("abc"));
    }
}
