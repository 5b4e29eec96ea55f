//! Test tools for idemflow users.
//!
//! [`provider`] is a mock payment provider over real HTTP on `127.0.0.1`, with Stripe's
//! idempotency rules (simplified), faults a test scripts call by call, a clock the test moves and
//! a ledger of what really happened; [`provider_client`] is a typed client for it. Together they
//! prove a workflow crash-safe: break the call the way networks break, retry with the same key,
//! and check the ledger holds one charge. The same provider runs standalone as the
//! `idemflow-mock-psp` binary.
//!
//! A charge whose response is lost, then retried with the same key, is charged once:
//!
//! ```
//! use idemflow_testkit::provider::{Fault, MockProvider};
//! use idemflow_testkit::provider_client::ChargeResult;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let provider = MockProvider::start().await;
//! let client = provider.client();
//!
//! provider.push_fault(Fault::ExecuteThenDrop); // the charge happens, its response is lost
//! let lost = client.charge("order-42", 1000, "usd", "tok_visa").await.unwrap_err();
//! assert!(lost.is_retryable());
//!
//! let retry = client.charge("order-42", 1000, "usd", "tok_visa").await.unwrap();
//! let charges = provider.charges();
//! assert_eq!(charges.len(), 1);
//! assert_eq!(retry, ChargeResult::Succeeded { charge_id: charges[0].id.clone() });
//! assert_eq!(provider.calls_for("order-42"), 2);
//! # }
//! ```
//!
//! The faults, and what a caller sees for each, are described in `docs/mock-provider.md`.
//!
//! [`explorer`] proves a workflow crash-safe: it crashes it at every step boundary, breaks its
//! provider calls the ways networks break, recovers each case by a resumer and by a client retry,
//! and checks that nothing was done twice (docs/testing-your-workflows.md). [`crash`] stops a
//! whole process at a crash point, for tests that kill a real process there. Both come with the
//! `crash` feature (on by default), which turns on the runner's `crash-hooks`: keep the testkit
//! in dev-dependencies, or take it with `default-features = false` for the provider alone.

#![deny(missing_docs)]

#[cfg(feature = "crash")]
pub mod crash;
#[cfg(feature = "crash")]
pub mod explorer;
pub mod provider;
pub mod provider_client;
