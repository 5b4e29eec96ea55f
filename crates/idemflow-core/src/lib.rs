//! idemflow's pure core: the correctness argument, with no IO.
//!
//! Everything here is testable without a database: who a request belongs to ([`TenantId`], [`Key`]),
//! what it is ([`Fingerprint`] over [`canonical`] JSON), what to do when a key already exists
//! ([`decide`]), and the durable names a workflow is made of ([`PhaseName`], [`DerivedKey`]).

#![deny(missing_docs)]

pub mod backoff;
pub mod bytes;
pub mod canonical;
mod decide;
mod derived_key;
mod fingerprint;
pub mod hex;
mod key;
mod phase_name;
mod response;
mod setters;
mod tenant;

pub use canonical::{
    Canonical, CanonicalError, canonicalize, canonicalize_exact, canonicalize_request,
};
pub use decide::{Decision, KeyState, StoredKey, decide};
pub use derived_key::DerivedKey;
pub use fingerprint::Fingerprint;
pub use key::{Key, KeyError};
pub use phase_name::{PhaseName, PhaseNameError, RecoveryPoint};
pub use response::{FieldValue, StoredResponse, problem_document};
pub use tenant::{TenantError, TenantId};
