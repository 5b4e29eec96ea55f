use std::fmt;

use sha2::{Digest, Sha256};

use crate::{Key, PhaseName, TenantId};

/// The idempotency key sent to another system for one foreign phase of one request.
///
/// It is `<tenant>:<key>:<phase>`: a pure function of what is stored on the key row, so it is the
/// same on every attempt, every takeover and every process. The tenant is part of it because two
/// tenants may send the same client key and must never share a charge at the provider. Neither a
/// tenant id nor a phase name may contain `:`, so the three parts can always be told apart.
///
/// Many providers cap their keys at 255 bytes; when the plain form would exceed that, the derived
/// key is `idf1-` and the hex SHA-256 of the three parts instead (69 bytes). The plain form always
/// holds two `:` and the hashed form none, so the two forms never collide.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct DerivedKey(String);

impl DerivedKey {
    /// The longest derived key, in bytes.
    pub const MAX_BYTES: usize = 255;

    /// The derived key of `phase` for the request keyed `key` of `tenant`: the plain form when
    /// it fits [`DerivedKey::MAX_BYTES`], the hashed form otherwise.
    pub fn new(tenant: &TenantId, key: &Key, phase: PhaseName) -> Self {
        Self::of_recorded(tenant, key, phase.as_str())
    }

    /// The derived key of a phase known by the name a key's row recorded (its recovery point),
    /// for tools that read rows rather than run workflows (the console).
    pub fn of_recorded(tenant: &TenantId, key: &Key, phase: &str) -> Self {
        let plain_length = tenant.as_str().len() + key.as_str().len() + phase.len() + 2;
        if plain_length <= Self::MAX_BYTES {
            return Self(format!("{tenant}:{key}:{phase}"));
        }
        let mut hasher = Sha256::new();
        for part in [tenant.as_str(), key.as_str(), phase] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        let mut text = String::with_capacity(69);
        text.push_str("idf1-");
        crate::hex::encode_into(&mut text, &digest);
        Self(text)
    }

    /// The key as sent to the other system.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for DerivedKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "DerivedKey({:?})", self.0)
    }
}

impl fmt::Display for DerivedKey {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(tenant: &str, key: &str, phase: &'static str) -> DerivedKey {
        DerivedKey::new(
            &TenantId::new(tenant).expect("tenant"),
            &Key::parse(key).expect("key"),
            PhaseName::new(phase).expect("phase"),
        )
    }

    #[test]
    fn plain_form_names_tenant_key_and_phase() {
        assert_eq!(
            parts("7", "order-42", "charge").as_str(),
            "7:order-42:charge"
        );
    }

    #[test]
    fn is_stable_and_unique_across_tenants_and_phases() {
        assert_eq!(parts("7", "k", "charge"), parts("7", "k", "charge"));
        assert_ne!(parts("7", "k", "charge"), parts("8", "k", "charge"));
        assert_ne!(parts("7", "k", "charge"), parts("7", "k", "refund"));
        // A key holding ':' cannot impersonate another tenant's key or phase.
        assert_ne!(parts("7", "a:b", "c"), parts("7", "a", "b"));
    }

    #[test]
    fn long_parts_are_hashed_to_a_bounded_key() {
        let long = parts(&"t".repeat(128), &"k".repeat(255), "charge");
        assert!(long.as_str().starts_with("idf1-"));
        assert_eq!(long.as_str().len(), 69);
        assert_ne!(long, parts(&"t".repeat(128), &"k".repeat(254), "charge"));
        assert_eq!(long, parts(&"t".repeat(128), &"k".repeat(255), "charge"));
        assert!(parts("7", &"k".repeat(246), "charge").as_str().len() <= DerivedKey::MAX_BYTES);
    }
}
