//! Any operation a test names, beside charges: `POST /v1/<operation>` (`refunds`, `payouts`,
//! `transfers`, …) with an `Idempotency-Key` and any JSON object as its parameters.
//!
//! The provider's rules are the charges' rules: the first call with a key executes and its answer
//! is stored with the key; the same key with the same parameters (and the same operation) gets it
//! back, byte for byte, with `Idempotent-Replayed: true`; the same key with other parameters, or
//! for another operation, gets 400 `idempotency_error`; a key still executing gets 409; a call
//! refused before execution stores nothing. Every [`super::Fault`] applies to these calls as it
//! does to charges, and every call counts in [`super::MockProvider::calls_for`].
//!
//! An executed operation answers 200 with its parameters, an id (`<two letters>_mock<n>`: `re_`
//! for refunds), its `object` (the operation's name without its final `s`) and `"status":
//! "succeeded"`, and is recorded in the ledger ([`super::MockProvider::operations`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Map, Value};

use super::{ConnectionHandle, Invalid, Params, Shared, Stored, json_bytes, serve_call};

/// The longest operation name accepted, in bytes.
const MAX_OPERATION_LEN: usize = 40;

/// One executed operation, as recorded in the provider's ledger.
#[derive(Debug, Clone, PartialEq)]
pub struct Operation {
    /// The operation, as its path named it (`refunds`).
    pub operation: String,
    /// Its id (`re_mock000001`).
    pub id: String,
    /// The idempotency key it was executed under.
    pub idempotency_key: String,
    /// The parameters, as sent.
    pub params: Value,
}

/// What a key was first used with for an operation: the operation and its parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct OperationParams {
    operation: String,
    params: Map<String, Value>,
}

/// `POST /v1/{operation}`.
pub(super) async fn create(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(connection): ConnectInfo<ConnectionHandle>,
    Path(operation): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve_call(shared, connection, &headers, |key| {
        validate(&operation, key, &body).map(|(key, params)| (key, Params::Operation(params)))
    })
    .await
}

fn validate(
    operation: &str,
    key: Option<String>,
    body: &[u8],
) -> Result<(String, OperationParams), Invalid> {
    if operation.is_empty()
        || operation.len() > MAX_OPERATION_LEN
        || !operation
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b == b'_')
    {
        return Err(Invalid(
            "resource_missing",
            format!("An operation is 1 to {MAX_OPERATION_LEN} lowercase letters or underscores."),
        ));
    }
    let key = super::validate_key(key)?;
    let params: Map<String, Value> = serde_json::from_slice(body).map_err(|error| {
        Invalid(
            "parameter_invalid",
            format!("Expected a JSON object of the {operation}'s parameters: {error}"),
        )
    })?;
    Ok((
        key,
        OperationParams {
            operation: operation.to_owned(),
            params,
        },
    ))
}

impl Shared {
    /// Executes an operation: its id drawn, its answer stored with the key, the ledger told.
    pub(super) fn operate(&self, key: &str, claim: u64, params: OperationParams) -> Stored {
        let mut ledger = self.lock();
        ledger.next_operation += 1;
        let prefix: String = params.operation.chars().take(2).collect();
        let id = format!("{prefix}_mock{:06}", ledger.next_operation);
        let object = params
            .operation
            .strip_suffix('s')
            .unwrap_or(&params.operation)
            .to_owned();
        let mut body = params.params.clone();
        body.insert("id".to_owned(), Value::from(id.clone()));
        body.insert("object".to_owned(), Value::from(object));
        body.insert("status".to_owned(), Value::from("succeeded"));
        let stored = Stored {
            status: StatusCode::OK,
            body: json_bytes(&Value::Object(body)),
        };
        ledger.operations.push(Operation {
            operation: params.operation,
            id,
            idempotency_key: key.to_owned(),
            params: Value::Object(params.params),
        });
        ledger.executed.push(key.to_owned());
        Shared::store(&mut ledger, key, claim, &stored);
        stored
    }
}
