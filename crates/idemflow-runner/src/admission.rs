//! What a request must pass before it may touch a key: its body canonicalized and fingerprinted
//! (one parse), a value jsonb can store, and, only for a key about to be claimed, the workflow's
//! typed decode and its `validate`. A request refused here stores nothing.

use idemflow_core::{Fingerprint, Key, canonicalize_request};
use serde_json::Value;

use crate::engine::Engine;
use crate::erased::Carry;
use crate::outcome::Rejection;
use crate::runner::Request;
use crate::storable::holds_nul;
use crate::workflow::Workflow;

/// A request that passed every check before execution.
pub(crate) struct Accepted {
    pub(crate) key: Key,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) request: Value,
}

/// Canonicalizes a JSON body and fingerprints it.
pub(crate) fn canonical_request(request: Request<'_>) -> Result<(Fingerprint, Value), Rejection> {
    // Parsed once: the value is the canonical form read back, so `1e2` is the integer 100 the
    // fingerprint says it is.
    let canonical = canonicalize_request(request.body)?;
    let fingerprint =
        Fingerprint::of_canonical_json(request.method, request.path, &canonical.bytes);
    Ok((fingerprint, canonical.value))
}

pub(crate) fn accept(
    key: &Key,
    (fingerprint, value): (Fingerprint, Value),
) -> Result<Accepted, Rejection> {
    let key = key.clone();
    if holds_nul(&value) {
        // PostgreSQL's jsonb cannot store U+0000: refuse it here, before anything is stored,
        // rather than fail the claim with a database error.
        return Err(Rejection::InvalidInput(
            "strings may not contain U+0000".to_owned(),
        ));
    }
    Ok(Accepted {
        key,
        fingerprint,
        request: value,
    })
}

/// Decodes the request into the workflow's type and runs its check: only for a key about to be
/// claimed. A retry of a finished key is answered from the look-up without it: the same
/// fingerprint passed this check when the key was claimed.
pub(crate) fn decode_and_validate<E: Engine>(
    workflow: &Workflow<E>,
    request: &Value,
) -> Result<Carry, Rejection> {
    let input = workflow
        .decode_request(request)
        .map_err(|error| Rejection::InvalidInput(error.to_string()))?;
    workflow.validate(&input).map_err(Rejection::InvalidInput)?;
    Ok(input)
}
