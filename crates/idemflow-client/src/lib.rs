//! A client for APIs that take an `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header),
//! such as idemflow's own HTTP layer.
//!
//! The caller names an **intent**: a stable string for the one thing it wants done
//! (`"checkout:cart-7781"`, or an id it already persists). The client makes a UUIDv7 key for the
//! intent and stores it in a [`KeyJournal`] *before* the first attempt, so every retry, and a
//! caller restarted after a crash, sends the same key and gets the first answer instead of doing
//! the thing twice. Once the answer is acted upon, [`IdempotentClient::finish`] forgets the key.
//!
//! Connection failures, timeouts, 409, 429 and 5xx (but 501 and 505) are retried with exponential
//! backoff and jitter, or after the response's `Retry-After` (within the policy's bounds), until
//! the [`ClientRetryPolicy`]'s deadline. A response marked `Idempotent-Replayed` is the server's stored
//! answer and is never retried. A redirect is an error ([`ClientError::Redirected`]), never
//! followed: build the `reqwest::Client` with [`http_builder`]. Every other response is an answer
//! and is returned at once. See docs/client.md.
//!
//! ```no_run
//! use idemflow_client::{ClientError, FileJournal, IdempotentClient};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let journal = FileJournal::open("/var/lib/shop/idempotency-keys")?;
//! // No redirects followed: a redirected POST must not look like an answer.
//! let http = idemflow_client::http_builder().build()?;
//! let client = IdempotentClient::new(http, journal);
//!
//! let intent = "checkout:cart-7781";
//! let body = serde_json::json!({ "cart": "cart-7781", "amount_minor": 4200 });
//! match client.post_json(intent, "http://127.0.0.1:8080/v1/checkouts", &body).await {
//!     Ok(reply) if reply.is_success() => {
//!         println!("order placed (replayed: {}, attempts: {})", reply.replayed, reply.attempts);
//!         // ... record the order, then:
//!         client.finish(intent).await?;
//!     }
//!     Ok(reply) => println!("refused with {}: fix the request, or finish the intent", reply.status),
//!     // The key stays in the journal: calling again later, even after a restart, retries it.
//!     Err(ClientError::DeadlineExceeded { attempts, last }) => {
//!         println!("no answer after {attempts} attempts ({last}); will retry later")
//!     }
//!     // Older than the server keeps keys: find out whether it was done, then finish the intent.
//!     Err(ClientError::KeyExpired { age, .. }) => println!("key {age:?} old; check by hand"),
//!     Err(error) => return Err(error.into()),
//! }
//! # Ok(())
//! # }
//! ```

#![deny(missing_docs)]

mod client;
mod header;
mod journal;
mod policy;

pub use client::{
    ClientError, DEFAULT_KEY_MAX_AGE, DEFAULT_MAX_RESPONSE_BYTES, IdempotentClient, LastAttempt,
    Reply, http_builder,
};
pub use header::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, KeyForm};
pub use journal::{FileJournal, JournalError, JournalResult, KeyJournal, MemoryJournal};
pub use policy::ClientRetryPolicy;
