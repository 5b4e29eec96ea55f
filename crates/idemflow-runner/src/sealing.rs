//! Sealing what the runner stores (opt-in): a [`Keyring`] of AES-256-GCM keys by id, one of them
//! current (it seals), every one of them able to open what it sealed.
//!
//! Sealed are the values that hold a request's data: the stored request, each phase output (its
//! recovery point's value) and the response (headers and body, in one ciphertext). The rest of
//! the row stays readable, because the protocol and operators read it: tenant, key, fingerprint,
//! workflow, state, recovery point, lease, token, attempts, last error, response status, times.
//!
//! Each sealed value names its key id, so keys rotate value by value: a row's request may be
//! sealed under the key of the day it was claimed and its response under the next one. A value
//! is `format (1 byte) ‖ nonce (12 random bytes) ‖ ciphertext ‖ tag (16)`, with associated data
//! binding it to its key id, tenant, key and slot (`request`, `phase_output:<recovery point>`,
//! `response`): moved to another row, column or recovery point, it does not open, and that is a
//! [`SealError::NotAuthentic`], never another row's data. A response (format 2) is bound to its
//! life and status too: to the fencing token of the owner that stored it (the row keeps it once
//! done, and a token never repeats for a key) and to the status the row shows beside it, so a
//! body of another life of the key, or under another status, does not open either. Responses
//! sealed in format 1, before that, open as they were sealed. Where it goes:
//!
//! - `request`, `phase_output` (jsonb): `{"idemflow:sealed": "<key id>", "data": "<base64>"}`;
//! - the response: `response_headers` is `[["idemflow:sealed", "<key id>"]]` (no HTTP header
//!   has a `:` in its name) and `response_body` the sealed bytes of the headers (as JSON, length
//!   first) and the body. The status stays readable.
//!
//! The store sees none of this: it is handed values and responses as it always was, so the
//! statements, and the round trips of a request, do not change.

use std::borrow::Cow;
use std::sync::Arc;

use aes_gcm::Aes256Gcm;
use aes_gcm::aead::{Aead, Generate, KeyInit, Payload};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use idemflow_core::{Key, StoredResponse, TenantId};
use serde_json::Value;

/// The member (in a JSON value) and the header name (in a response) that mark a sealed value;
/// its value is the key id.
pub(crate) const MARKER: &str = "idemflow:sealed";
/// The member holding a sealed JSON value's bytes, in base64.
const DATA: &str = "data";
/// The format of a sealed value's bytes, its first byte: 1 binds a value to its key id, tenant,
/// key and slot; 2 (responses) also to the storing owner's token and the status.
const FORMAT_PLACE: u8 = 1;
const FORMAT_LIFE: u8 = 2;
const NONCE_BYTES: usize = 12;
const TAG_BYTES: usize = 16;
/// Associated data begins with this (by format), so nothing else sealed under the same key opens
/// as ours.
const CONTEXT_PLACE: &[u8] = b"idemflow:sealed:v1";
const CONTEXT_LIFE: &[u8] = b"idemflow:sealed:v2";

/// AES-256-GCM keys by id: the current one seals, every one opens what was sealed under its id.
///
/// Rotation: make the new key current and keep the old one with [`Keyring::with_old_key`] until
/// no row holds a value sealed under it (docs/operations.md, "What is stored"). A runner that
/// reads a value sealed under an id it does not hold fails with [`SealError::UnknownKeyId`].
/// Across many processes, every one must hold a key before any seals with it: deploy it first
/// as an old key (or, turning sealing on, in a [`Keyring::read_only`] keyring).
///
/// ```
/// use idemflow_runner::{Keyring, RunnerConfig};
/// # let (key_2, key_1) = ([2u8; 32], [1u8; 32]); // 32 bytes each, from your secret store
/// let keyring = Keyring::new("2026-12", key_2)?.with_old_key("2026-11", key_1)?;
/// assert_eq!(keyring.current_key_id(), Some("2026-12"));
/// let config = RunnerConfig::default().with_keyring(Some(keyring));
/// # Ok::<(), idemflow_runner::KeyringError>(())
/// ```
///
/// Its `Debug` shows the key ids, never a key.
#[derive(Clone)]
pub struct Keyring {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    /// Whether the first key seals ([`Keyring::read_only`] says no).
    sealing: bool,
    /// The current key first.
    keys: Vec<(String, Aes256Gcm)>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Keyring")
            .field("current", &self.current_key_id())
            .field("key_ids", &self.key_ids())
            .finish()
    }
}

/// Why a key cannot join a [`Keyring`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyringError {
    /// A key id must be 1 to 64 bytes of `[A-Za-z0-9._-]`: it is stored with every value.
    #[error("key id {0:?} must be 1 to 64 bytes of [A-Za-z0-9._-]")]
    InvalidKeyId(String),
    /// Two keys under one id: a value sealed under it could open under either, or neither.
    #[error("key id {0:?} is in the keyring twice")]
    DuplicateKeyId(String),
}

impl Keyring {
    /// A keyring whose current key (the one that seals) is `key`, under `id`.
    pub fn new(id: &str, key: [u8; 32]) -> Result<Self, KeyringError> {
        check_key_id(id)?;
        Ok(Self {
            inner: Arc::new(Inner {
                sealing: true,
                keys: vec![(id.to_owned(), cipher(key))],
            }),
        })
    }

    /// Adds a key that opens what was sealed under `id` and seals nothing: a key rotated out,
    /// kept while rows sealed under it remain.
    pub fn with_old_key(mut self, id: &str, key: [u8; 32]) -> Result<Self, KeyringError> {
        check_key_id(id)?;
        if self.inner.keys.iter().any(|(known, _)| known == id) {
            return Err(KeyringError::DuplicateKeyId(id.to_owned()));
        }
        Arc::make_mut(&mut self.inner)
            .keys
            .push((id.to_owned(), cipher(key)));
        Ok(self)
    }

    /// The same keys, sealing nothing: values are stored as they are, and values sealed under
    /// any of its keys are read. The first step of turning sealing on across many processes
    /// (all must open before any seals), and the way to turn it off while sealed rows remain.
    pub fn read_only(mut self) -> Self {
        Arc::make_mut(&mut self.inner).sealing = false;
        self
    }

    /// The id of the key that seals; `None` for a [`Keyring::read_only`] keyring.
    pub fn current_key_id(&self) -> Option<&str> {
        let (id, _) = self.inner.keys.first().filter(|_| self.inner.sealing)?;
        Some(id)
    }

    /// Every key id the keyring opens, the current one first.
    pub fn key_ids(&self) -> Vec<&str> {
        self.inner.keys.iter().map(|(id, _)| id.as_str()).collect()
    }

    /// The key id and `version ‖ nonce ‖ ciphertext ‖ tag` of `plaintext` under the current
    /// key; `None` when the keyring seals nothing.
    fn seal(
        &self,
        context: &Context<'_>,
        plaintext: &[u8],
    ) -> Result<Option<(&str, Vec<u8>)>, SealError> {
        let Some((id, cipher)) = self.inner.keys.first().filter(|_| self.inner.sealing) else {
            return Ok(None);
        };
        // A random 96-bit nonce per value: see docs/operations.md for the bound on how many
        // values one key may seal.
        let nonce = <[u8; NONCE_BYTES]>::try_generate()
            .map_err(|error| SealError::Sealing(format!("no random nonce: {error}")))?;
        let format = context.format();
        let aad = context.associated_data(id, format);
        let sealed = cipher
            .encrypt(
                &nonce.into(),
                Payload {
                    msg: plaintext,
                    aad: &aad,
                },
            )
            // Only a plaintext over 64 GiB fails; the database holds 1 GB a value.
            .map_err(|_| SealError::Sealing("the value is too long to seal".to_owned()))?;
        let mut out = Vec::with_capacity(1 + NONCE_BYTES + sealed.len());
        out.push(format);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        Ok(Some((id, out)))
    }

    /// The plaintext of a value sealed under `id`.
    fn open(&self, context: &Context<'_>, id: &str, sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        let Some((_, cipher)) = self.inner.keys.iter().find(|(known, _)| known == id) else {
            return Err(context.unknown(id));
        };
        let (&format, rest) = sealed
            .split_first()
            .ok_or_else(|| context.malformed("it is empty"))?;
        // A response in format 1 was sealed before responses were bound to their life; every
        // other value, and every response sealed since, must be in the context's own format.
        let legacy_response = format == FORMAT_PLACE && context.life.is_some();
        if format != context.format() && !legacy_response {
            return Err(context.malformed(&format!("unknown format {format}")));
        }
        if rest.len() < NONCE_BYTES + TAG_BYTES {
            return Err(context.malformed("it is too short"));
        }
        let (nonce, ciphertext) = rest.split_at(NONCE_BYTES);
        let nonce: [u8; NONCE_BYTES] = nonce
            .try_into()
            .map_err(|_| context.malformed("no nonce"))?;
        let aad = context.associated_data(id, format);
        cipher
            .decrypt(
                &nonce.into(),
                Payload {
                    msg: ciphertext,
                    aad: &aad,
                },
            )
            .map_err(|_| SealError::NotAuthentic {
                what: context.slot.to_string(),
            })
    }
}

/// Opening stored values outside the runner: for tools that read the table (an operator's
/// console given the keyring, a test's checks). Values stored unsealed come back as they are.
impl Keyring {
    /// The stored request of `tenant`'s `key` (the `request` column), opened.
    pub fn open_request(
        &self,
        tenant: &TenantId,
        key: &Key,
        request: Value,
    ) -> Result<Value, SealError> {
        self.sealer(tenant, key).open_value(Slot::Request, request)
    }

    /// A phase output stored at `recovery_point` (the `phase_output` column), opened.
    pub fn open_output(
        &self,
        tenant: &TenantId,
        key: &Key,
        recovery_point: &str,
        output: Value,
    ) -> Result<Value, SealError> {
        self.sealer(tenant, key)
            .open_value(Slot::Output(recovery_point), output)
    }

    /// The stored response of a done key whose `lock_version` is `lock_version`, opened.
    pub fn open_response(
        &self,
        tenant: &TenantId,
        key: &Key,
        lock_version: i64,
        response: StoredResponse,
    ) -> Result<StoredResponse, SealError> {
        self.sealer(tenant, key)
            .open_response(response, lock_version)
    }

    fn sealer<'a>(&'a self, tenant: &'a TenantId, key: &'a Key) -> Sealer<'a> {
        Sealer {
            keyring: Some(self),
            tenant,
            key,
        }
    }
}

fn cipher(key: [u8; 32]) -> Aes256Gcm {
    Aes256Gcm::new(&key.into())
}

fn check_key_id(id: &str) -> Result<(), KeyringError> {
    let valid = (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || b"._-".contains(&byte));
    if valid {
        Ok(())
    } else {
        Err(KeyringError::InvalidKeyId(id.to_owned()))
    }
}

/// Why a stored value could not be sealed or opened. Nothing is ever answered from a value that
/// did not open.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The value is sealed under a key id the runner's keyring does not hold: a key removed
    /// while rows still needed it, or a runner without a keyring reading a sealed row.
    #[error(
        "the stored {what} is sealed under key id {key_id:?}, which the runner's keyring does not hold"
    )]
    UnknownKeyId {
        /// What was read: `request`, `phase_output:<recovery point>` or `response`.
        what: String,
        /// The key id the value names.
        key_id: String,
    },
    /// The value does not open under the key it names: it was altered, or moved from another
    /// row, column or recovery point, or sealed by another key under the same id.
    #[error(
        "the stored {what} does not open: altered, moved from another row or column, or sealed by another key"
    )]
    NotAuthentic {
        /// What was read.
        what: String,
    },
    /// The value is marked sealed but is not in the sealed format.
    #[error("the stored {what} is not a well-formed sealed value: {why}")]
    Malformed {
        /// What was read.
        what: String,
        /// What is wrong with it.
        why: String,
    },
    /// Sealing failed (the system's random number generator, say): nothing was stored.
    #[error("sealing failed: {0}")]
    Sealing(String),
}

/// Where a sealed value lives: part of its associated data.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Slot<'a> {
    Request,
    /// A phase output, at the recovery point it is stored with.
    Output(&'a str),
    Response,
}

impl std::fmt::Display for Slot<'_> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Request => formatter.write_str("request"),
            Self::Output(point) => write!(formatter, "phase_output:{point}"),
            Self::Response => formatter.write_str("response"),
        }
    }
}

/// A value's place: whose key, which slot; for a response, which life and status.
struct Context<'a> {
    tenant: &'a TenantId,
    key: &'a Key,
    slot: Slot<'a>,
    life: Option<Life>,
}

/// What binds a response to one life of its key: the fencing token of the owner that stored it
/// (the row's `lock_version` once done) and the status stored beside it.
#[derive(Debug, Clone, Copy)]
struct Life {
    lock_version: i64,
    status: u16,
}

impl Context<'_> {
    fn format(&self) -> u8 {
        if self.life.is_some() {
            FORMAT_LIFE
        } else {
            FORMAT_PLACE
        }
    }

    /// The format's context, then the key id, tenant, key and slot, each preceded by its length;
    /// in format 2, the life's token and status after them.
    fn associated_data(&self, key_id: &str, format: u8) -> Vec<u8> {
        let slot = self.slot.to_string();
        let parts = [
            key_id.as_bytes(),
            self.tenant.as_str().as_bytes(),
            self.key.as_str().as_bytes(),
            slot.as_bytes(),
        ];
        let mut aad = Vec::with_capacity(
            CONTEXT_LIFE.len() + 26 + parts.iter().map(|part| part.len()).sum::<usize>(),
        );
        aad.extend_from_slice(if format == FORMAT_LIFE {
            CONTEXT_LIFE
        } else {
            CONTEXT_PLACE
        });
        for part in parts {
            // Each part is at most a few hundred bytes (a key is 255 at most).
            aad.extend_from_slice(&u32::try_from(part.len()).unwrap_or(u32::MAX).to_be_bytes());
            aad.extend_from_slice(part);
        }
        if let (FORMAT_LIFE, Some(life)) = (format, self.life) {
            aad.extend_from_slice(&life.lock_version.to_be_bytes());
            aad.extend_from_slice(&life.status.to_be_bytes());
        }
        aad
    }

    fn unknown(&self, key_id: &str) -> SealError {
        SealError::UnknownKeyId {
            what: self.slot.to_string(),
            key_id: key_id.to_owned(),
        }
    }

    fn malformed(&self, why: &str) -> SealError {
        SealError::Malformed {
            what: self.slot.to_string(),
            why: why.to_owned(),
        }
    }
}

/// The runner's keyring (if any) applied to one key's values: what the runner writes is sealed
/// here, what it reads is opened here. Without a keyring values pass through as they are, and a
/// sealed one read fails with [`SealError::UnknownKeyId`]. With one, a value stored unsealed
/// (before sealing was turned on) is read as it is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sealer<'a> {
    pub(crate) keyring: Option<&'a Keyring>,
    pub(crate) tenant: &'a TenantId,
    pub(crate) key: &'a Key,
}

impl Sealer<'_> {
    fn context<'s>(&'s self, slot: Slot<'s>) -> Context<'s> {
        Context {
            tenant: self.tenant,
            key: self.key,
            slot,
            life: None,
        }
    }

    fn response_context(&self, lock_version: i64, status: u16) -> Context<'_> {
        Context {
            life: Some(Life {
                lock_version,
                status,
            }),
            ..self.context(Slot::Response)
        }
    }

    /// A JSON value (the request, a phase output) as it is stored.
    pub(crate) fn seal_value<'v>(
        &self,
        slot: Slot<'_>,
        value: &'v Value,
    ) -> Result<Cow<'v, Value>, SealError> {
        let Some(keyring) = self.keyring else {
            return Ok(Cow::Borrowed(value));
        };
        let Some((key_id, sealed)) =
            keyring.seal(&self.context(slot), value.to_string().as_bytes())?
        else {
            return Ok(Cow::Borrowed(value));
        };
        let mut envelope = serde_json::Map::new();
        envelope.insert(MARKER.to_owned(), key_id.into());
        envelope.insert(DATA.to_owned(), STANDARD.encode(sealed).into());
        Ok(Cow::Owned(Value::Object(envelope)))
    }

    /// A stored JSON value, opened.
    pub(crate) fn open_value(&self, slot: Slot<'_>, value: Value) -> Result<Value, SealError> {
        let Some((key_id, data)) = sealed_value(&value) else {
            return Ok(value);
        };
        let context = self.context(slot);
        let keyring = self.keyring.ok_or_else(|| context.unknown(key_id))?;
        let sealed = STANDARD
            .decode(data)
            .map_err(|error| context.malformed(&format!("invalid base64: {error}")))?;
        let plaintext = keyring.open(&context, key_id, &sealed)?;
        serde_json::from_slice(&plaintext)
            .map_err(|error| context.malformed(&format!("not JSON once opened: {error}")))
    }

    /// A response as it is stored by the owner holding `lock_version`: status readable, headers
    /// and body sealed together, bound to that token and the status.
    pub(crate) fn seal_response<'r>(
        &self,
        response: &'r StoredResponse,
        lock_version: i64,
    ) -> Result<Cow<'r, StoredResponse>, SealError> {
        let Some(keyring) = self.keyring.filter(|keyring| keyring.inner.sealing) else {
            return Ok(Cow::Borrowed(response));
        };
        let headers = serde_json::to_vec(&response.headers)
            .map_err(|error| SealError::Sealing(format!("headers: {error}")))?;
        let length = u32::try_from(headers.len())
            .map_err(|_| SealError::Sealing("the headers are too long".to_owned()))?;
        let mut plaintext = Vec::with_capacity(4 + headers.len() + response.body.len());
        plaintext.extend_from_slice(&length.to_be_bytes());
        plaintext.extend_from_slice(&headers);
        plaintext.extend_from_slice(&response.body);
        let context = self.response_context(lock_version, response.status);
        let Some((key_id, body)) = keyring.seal(&context, &plaintext)? else {
            return Ok(Cow::Borrowed(response));
        };
        Ok(Cow::Owned(StoredResponse {
            status: response.status,
            headers: vec![(MARKER.to_owned(), key_id.into())],
            body,
        }))
    }

    /// A stored response, opened: `lock_version` is the token of the row it was read from.
    pub(crate) fn open_response(
        &self,
        response: StoredResponse,
        lock_version: i64,
    ) -> Result<StoredResponse, SealError> {
        let key_id = match response.headers.as_slice() {
            [(name, key_id)] if name == MARKER => key_id,
            _ => return Ok(response),
        };
        let context = self.response_context(lock_version, response.status);
        let key_id = key_id
            .to_str()
            .ok_or_else(|| context.malformed("the key id is not text"))?;
        let keyring = self.keyring.ok_or_else(|| context.unknown(key_id))?;
        let plaintext = keyring.open(&context, key_id, &response.body)?;
        let (length, rest) = plaintext
            .split_first_chunk::<4>()
            .ok_or_else(|| context.malformed("no header length"))?;
        let length = u32::from_be_bytes(*length) as usize;
        if rest.len() < length {
            return Err(context.malformed("the headers are cut short"));
        }
        let (headers, body) = rest.split_at(length);
        let headers = serde_json::from_slice(headers)
            .map_err(|error| context.malformed(&format!("headers: {error}")))?;
        Ok(StoredResponse {
            status: response.status,
            headers,
            body: body.to_vec(),
        })
    }
}

/// The key id and data of a sealed JSON value: an object of exactly the marker and the data.
fn sealed_value(value: &Value) -> Option<(&str, &str)> {
    let Value::Object(members) = value else {
        return None;
    };
    if members.len() != 2 {
        return None;
    }
    match (members.get(MARKER), members.get(DATA)) {
        (Some(Value::String(key_id)), Some(Value::String(data))) => Some((key_id, data)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn names() -> (TenantId, Key, Key) {
        (
            TenantId::new("acme").expect("tenant"),
            Key::parse("order-1").expect("key"),
            Key::parse("order-2").expect("key"),
        )
    }

    fn sealer<'a>(keyring: Option<&'a Keyring>, tenant: &'a TenantId, key: &'a Key) -> Sealer<'a> {
        Sealer {
            keyring,
            tenant,
            key,
        }
    }

    #[test]
    fn a_value_opens_where_it_was_sealed_and_nowhere_else() {
        let (tenant, one, two) = names();
        let keyring = Keyring::new("k1", [7; 32]).expect("keyring");
        let value = json!({"card": "4242424242424242", "amount": 100});
        let sealer_one = sealer(Some(&keyring), &tenant, &one);
        let sealed = sealer_one
            .seal_value(Slot::Request, &value)
            .expect("sealed")
            .into_owned();
        assert!(!sealed.to_string().contains("4242"), "{sealed}");
        assert_eq!(sealed[MARKER], "k1");
        assert_eq!(
            sealer_one.open_value(Slot::Request, sealed.clone()),
            Ok(value.clone())
        );
        // Another key of the same tenant, another column, another recovery point: none opens.
        let other_key = sealer(Some(&keyring), &tenant, &two);
        assert!(matches!(
            other_key.open_value(Slot::Request, sealed.clone()),
            Err(SealError::NotAuthentic { .. })
        ));
        assert!(matches!(
            sealer_one.open_value(Slot::Output("charge"), sealed.clone()),
            Err(SealError::NotAuthentic { .. })
        ));
        let output = sealer_one
            .seal_value(Slot::Output("charge"), &value)
            .expect("sealed")
            .into_owned();
        assert!(matches!(
            sealer_one.open_value(Slot::Output("finish"), output.clone()),
            Err(SealError::NotAuthentic { .. })
        ));
        assert_eq!(
            sealer_one.open_value(Slot::Output("charge"), output),
            Ok(value)
        );
    }

    #[test]
    fn each_seal_draws_a_new_nonce() {
        let (tenant, one, _) = names();
        let keyring = Keyring::new("k1", [7; 32]).expect("keyring");
        let sealer = sealer(Some(&keyring), &tenant, &one);
        let value = json!("same");
        let first = sealer.seal_value(Slot::Request, &value).expect("sealed");
        let second = sealer.seal_value(Slot::Request, &value).expect("sealed");
        assert_ne!(first, second);
    }

    #[test]
    fn a_response_is_sealed_but_its_status_and_opens_whole() {
        let (tenant, one, two) = names();
        let keyring = Keyring::new("k1", [9; 32]).expect("keyring");
        let response = StoredResponse::json(201, &json!({"card": "4242424242424242"}))
            .with_header("location", "/v1/cards/4242424242424242");
        let sealer_one = sealer(Some(&keyring), &tenant, &one);
        let sealed = sealer_one
            .seal_response(&response, 7)
            .expect("sealed")
            .into_owned();
        assert_eq!(sealed.status, 201);
        assert_eq!(sealed.headers, vec![(MARKER.to_owned(), "k1".into())]);
        assert!(!sealed.body.windows(4).any(|window| window == b"4242"));
        assert_eq!(sealer_one.open_response(sealed.clone(), 7), Ok(response));
        assert!(matches!(
            sealer(Some(&keyring), &tenant, &two).open_response(sealed.clone(), 7),
            Err(SealError::NotAuthentic { .. })
        ));
        let mut altered = sealed;
        let last = altered.body.len() - 1;
        altered.body[last] ^= 1;
        assert!(matches!(
            sealer_one.open_response(altered, 7),
            Err(SealError::NotAuthentic { .. })
        ));
    }

    /// A sealed response opens only for the life of its key it was stored in (the storing
    /// owner's token, which the done row keeps) and under the status stored beside it: another
    /// life's body, or the body shown under another status, is not authentic.
    #[test]
    fn a_sealed_response_opens_only_in_its_life_and_under_its_status() {
        let (tenant, one, _) = names();
        let keyring = Keyring::new("k1", [9; 32]).expect("keyring");
        let sealer = sealer(Some(&keyring), &tenant, &one);
        let response = StoredResponse::new(201, "created");
        let sealed = sealer
            .seal_response(&response, 41)
            .expect("sealed")
            .into_owned();
        assert_eq!(sealed.body[0], FORMAT_LIFE);
        assert_eq!(sealer.open_response(sealed.clone(), 41), Ok(response));
        assert!(matches!(
            sealer.open_response(sealed.clone(), 42),
            Err(SealError::NotAuthentic { .. })
        ));
        let under_another_status = StoredResponse {
            status: 200,
            ..sealed
        };
        assert!(matches!(
            sealer.open_response(under_another_status, 41),
            Err(SealError::NotAuthentic { .. })
        ));
    }

    /// A response sealed before responses were bound to their life (format 1) still opens.
    #[test]
    fn a_response_sealed_in_the_first_format_still_opens() {
        let (tenant, one, _) = names();
        let keyring = Keyring::new("k1", [9; 32]).expect("keyring");
        let sealer = sealer(Some(&keyring), &tenant, &one);
        let headers = serde_json::to_vec(&Vec::<(String, String)>::new()).expect("headers");
        let mut plaintext = u32::try_from(headers.len())
            .expect("length")
            .to_be_bytes()
            .to_vec();
        plaintext.extend_from_slice(&headers);
        plaintext.extend_from_slice(b"then");
        let (_, body) = keyring
            .seal(&sealer.context(Slot::Response), &plaintext)
            .expect("sealed")
            .expect("a sealing keyring");
        assert_eq!(body[0], FORMAT_PLACE);
        let stored = StoredResponse {
            status: 200,
            headers: vec![(MARKER.to_owned(), "k1".into())],
            body,
        };
        assert_eq!(
            sealer.open_response(stored, 99),
            Ok(StoredResponse::new(200, "then"))
        );
    }

    #[test]
    fn rotation_opens_old_values_and_seals_under_the_new_key() {
        let (tenant, one, _) = names();
        let old = Keyring::new("k1", [1; 32]).expect("keyring");
        let value = json!({"n": 1});
        let sealed = sealer(Some(&old), &tenant, &one)
            .seal_value(Slot::Request, &value)
            .expect("sealed")
            .into_owned();
        let rotated = Keyring::new("k2", [2; 32])
            .and_then(|keyring| keyring.with_old_key("k1", [1; 32]))
            .expect("keyring");
        let sealer_rotated = sealer(Some(&rotated), &tenant, &one);
        assert_eq!(
            sealer_rotated.open_value(Slot::Request, sealed.clone()),
            Ok(value.clone())
        );
        let resealed = sealer_rotated
            .seal_value(Slot::Request, &value)
            .expect("sealed");
        assert_eq!(resealed[MARKER], "k2");
        let without_old = Keyring::new("k2", [2; 32]).expect("keyring");
        assert_eq!(
            sealer(Some(&without_old), &tenant, &one).open_value(Slot::Request, sealed.clone()),
            Err(SealError::UnknownKeyId {
                what: "request".to_owned(),
                key_id: "k1".to_owned()
            })
        );
        // A runner without a keyring cannot read it either, and says why.
        assert!(matches!(
            sealer(None, &tenant, &one).open_value(Slot::Request, sealed.clone()),
            Err(SealError::UnknownKeyId { .. })
        ));
        // Read-only: stores as it is, still opens.
        let reading = rotated.clone().read_only();
        assert_eq!(reading.current_key_id(), None);
        let sealer_reading = sealer(Some(&reading), &tenant, &one);
        assert_eq!(
            sealer_reading.seal_value(Slot::Request, &value),
            Ok(Cow::Borrowed(&value))
        );
        let response = StoredResponse::new(200, "ok");
        assert_eq!(
            sealer_reading.seal_response(&response, 1),
            Ok(Cow::Borrowed(&response))
        );
        assert_eq!(
            sealer_reading.open_value(Slot::Request, sealed.clone()),
            Ok(value.clone())
        );
        // Another key under the same id: not authentic, rather than garbage.
        let impostor = Keyring::new("k2", [3; 32]).expect("keyring");
        let under_k2 = resealed.into_owned();
        assert!(matches!(
            sealer(Some(&impostor), &tenant, &one).open_value(Slot::Request, under_k2),
            Err(SealError::NotAuthentic { .. })
        ));
    }

    #[test]
    fn unsealed_values_pass_through_and_key_ids_are_checked() {
        let (tenant, one, _) = names();
        let keyring = Keyring::new("k1", [1; 32]).expect("keyring");
        let sealer = sealer(Some(&keyring), &tenant, &one);
        let plain = json!({"idemflow:sealed": "k1"});
        assert_eq!(sealer.open_value(Slot::Request, plain.clone()), Ok(plain));
        let response = StoredResponse::new(200, "ok").with_header("content-type", "text/plain");
        assert_eq!(sealer.open_response(response.clone(), 1), Ok(response));
        assert_eq!(
            Keyring::new("", [0; 32]).map(|_| ()),
            Err(KeyringError::InvalidKeyId(String::new()))
        );
        assert!(Keyring::new("a b", [0; 32]).is_err());
        assert_eq!(
            keyring.clone().with_old_key("k1", [2; 32]).map(|_| ()),
            Err(KeyringError::DuplicateKeyId("k1".to_owned()))
        );
        let debug = format!("{keyring:?}");
        assert!(debug.contains("k1") && !debug.contains("[1,"), "{debug}");
    }
}
