use std::time::Duration;

use crate::Fingerprint;

/// The state of an existing key row, as far as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    /// Execution started and has not finished. `lease_left` is measured by the database clock:
    /// zero means the lease expired and the key may be taken over.
    Started {
        /// How long the owner's lease still runs; zero once it expired.
        lease_left: Duration,
    },
    /// Finished; its response is stored.
    Done,
}

/// What a failed claim found under the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredKey<'a> {
    /// The fingerprint of the request that claimed the key.
    pub fingerprint: &'a Fingerprint,
    /// The workflow (name and version) that claimed the key.
    pub workflow: &'a str,
    /// Whether the key is still running or finished.
    pub state: KeyState,
}

/// What to do with a request whose key already exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The key finished: answer with its stored response.
    Replay,
    /// Another owner holds a live lease: answer 409 and let the client retry after this long.
    InProgress {
        /// What is left of the owner's lease: the `Retry-After` to send.
        retry_after: Duration,
    },
    /// The key was used for a different request: answer 422.
    Mismatch,
    /// The owner's lease expired: take the key over (compare-and-set on lock_version) and resume.
    TakeOver,
}

/// Decides what a request does when its claim found an existing key.
///
/// A key is bound to the request that claimed it: the same fingerprint *and* the same workflow.
/// A mismatch is reported before anything else, so a different request never learns the stored
/// response nor the key's progress. A finished key replays; a started key is either in progress
/// (its lease is live) or abandoned (its lease expired, measured by the database clock).
pub fn decide(stored: &StoredKey<'_>, fingerprint: &Fingerprint, workflow: &str) -> Decision {
    if stored.fingerprint != fingerprint || stored.workflow != workflow {
        return Decision::Mismatch;
    }
    match stored.state {
        KeyState::Done => Decision::Replay,
        KeyState::Started { lease_left } if lease_left.is_zero() => Decision::TakeOver,
        KeyState::Started { lease_left } => Decision::InProgress {
            retry_after: lease_left,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_is_decided() {
        let ours = Fingerprint::of_raw("POST", "/a", "text/plain", b"1");
        let other = Fingerprint::of_raw("POST", "/a", "text/plain", b"2");
        let live = KeyState::Started {
            lease_left: Duration::from_millis(1500),
        };
        let expired = KeyState::Started {
            lease_left: Duration::ZERO,
        };
        let in_progress = Decision::InProgress {
            retry_after: Duration::from_millis(1500),
        };

        // (stored fingerprint, stored workflow, state) -> decision for (ours, "checkout.v1").
        let table = [
            (&ours, "checkout.v1", KeyState::Done, Decision::Replay),
            (&ours, "checkout.v1", live, in_progress),
            (&ours, "checkout.v1", expired, Decision::TakeOver),
            (&other, "checkout.v1", KeyState::Done, Decision::Mismatch),
            (&other, "checkout.v1", live, Decision::Mismatch),
            (&other, "checkout.v1", expired, Decision::Mismatch),
            (&ours, "refund.v1", KeyState::Done, Decision::Mismatch),
            (&ours, "refund.v1", live, Decision::Mismatch),
            (&ours, "refund.v1", expired, Decision::Mismatch),
            (&other, "refund.v1", KeyState::Done, Decision::Mismatch),
            (&other, "refund.v1", live, Decision::Mismatch),
            (&other, "refund.v1", expired, Decision::Mismatch),
        ];
        for (fingerprint, workflow, state, expected) in table {
            let stored = StoredKey {
                fingerprint,
                workflow,
                state,
            };
            assert_eq!(
                decide(&stored, &ours, "checkout.v1"),
                expected,
                "{stored:?}"
            );
        }
    }
}
