//! idemflow's HTTP face: the `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header)
//! for axum and tower, with problem+json errors.
//!
//! Two ways in:
//! - [`WorkflowService`]: a route that runs a multi-phase workflow; its JSON body is the
//!   workflow's request.
//! - [`IdempotencyLayer`]: wraps any handler; the handler's response is stored and replayed.
//!
//! Both answer: missing or malformed key → 400 (the layer can instead let a request without a
//! key through, unprotected, while clients learn to send one: [`KeyMode`]); another request
//! under the same key → 422; in progress → 409 with `Retry-After`, or, for a client that sent
//! `Prefer: wait=N`, the first attempt's answer once it is stored, if that is within N seconds;
//! finished → the stored status, headers and body with `Idempotent-Replayed: true`; body too
//! large → 413; a JSON route given another content type → 415. Nothing is stored for a request
//! refused before execution. See docs/http.md.
//!
//! [`serve`] serves a router with limits on slow and oversized clients (header and body read
//! timeouts, header size and count), on the connections held and on the covered requests
//! processed at once, which `axum::serve` does not set.

#![deny(missing_docs)]

mod body;
mod config;
mod extract;
mod handler;
mod key_header;
mod layer;
mod metrics;
mod multipart;
#[cfg(feature = "openapi")]
pub mod openapi;
mod prefer;
mod prepare;
mod problem;
mod problem_types;
mod recorded;
mod request_fingerprint;
mod route;
mod serve;
mod tenant;
mod wait;

pub use config::{HttpConfig, KeyMode, Redaction, StatusRules};
pub use extract::IdempotencyKey;
pub use key_header::{KeyHeaderError, idempotency_key};
pub use layer::{IdempotencyLayer, IdempotencyLayerBuilder, IdempotencyService, LayerError};
pub use metrics::{CATALOGUE, describe_metrics};
pub use problem::{Problem, REPLAYED_HEADER, RunResponse, respond, stored_response};
pub use problem_types::ProblemType;
pub use recorded::RecordedRequest;
pub use route::WorkflowService;
pub use serve::{Serve, ServeLimits, serve};
pub use tenant::{BearerTenant, TenantResolver};
