//! Every answer the layer makes itself: RFC 9457 problem documents, and the one function that
//! maps an outcome or an error to a response. Database text never reaches a client.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idemflow_core::StoredResponse;
use idemflow_runner::{Outcome, Rejection, RunError};

use crate::ProblemType;

/// The header a replayed response carries.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// An RFC 9457 problem: `type` is `about:blank`, `code` says which one in a word.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The response status, also the document's `status`.
    pub status: StatusCode,
    /// A stable snake_case word for the problem (`idempotency_key_reused`), for clients to match
    /// on; the document's `code`.
    pub code: &'static str,
    /// What went wrong, for a human; the document's `detail`.
    pub detail: String,
    /// Seconds, for `Retry-After`.
    pub retry_after: Option<u64>,
}

impl Problem {
    /// A problem without `Retry-After`.
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            code,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds `Retry-After`: `wait` in whole seconds, rounded up, at least 1.
    pub fn retry_after(mut self, wait: Duration) -> Self {
        self.retry_after = Some(seconds(wait));
        self
    }
}

impl Problem {
    fn document(&self) -> serde_json::Value {
        idemflow_core::problem_document(
            self.status.as_u16(),
            self.status.canonical_reason().unwrap_or("Error"),
            self.code,
            &self.detail,
        )
    }
}

/// The 408 for a request body that did not arrive within `timeout` (see [`crate::ServeLimits`]).
pub(crate) fn body_timeout(timeout: Duration) -> Problem {
    ProblemType::BODY_TIMEOUT.problem(format!(
        "the request body did not arrive within {} ms; send the request again",
        timeout.as_millis()
    ))
}

/// The 503 for a covered request that found no place within its wait (see
/// [`crate::ServeLimits::max_covered_requests`]).
pub(crate) fn overloaded() -> Problem {
    ProblemType::OVERLOADED
        .problem(
            "the server is processing as many requests as it takes at once; \
         send the request again with the same idempotency key",
        )
        .retry_after(Duration::from_secs(1))
}

/// A problem as the layer stores it (a handler whose response cannot be stored, say): the same
/// document it answers, `code` included.
pub(crate) fn stored_problem(kind: ProblemType, detail: impl Into<String>) -> StoredResponse {
    StoredResponse::problem(kind.status, &kind.problem(detail).document())
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = self.document();
        let mut response = (self.status, body.to_string()).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(retry_after) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after));
        }
        response
    }
}

/// Whole seconds for `Retry-After`, rounded up and at least 1: a client told 0 would retry at
/// once and be told the same.
pub(crate) fn seconds(wait: Duration) -> u64 {
    let whole = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    whole.max(1)
}

/// What [`Runner::run`](idemflow_runner::Runner::run) returned, as an axum response: a handler
/// that runs a workflow itself returns `RunResponse(runner.run(…).await)`.
#[derive(Debug)]
pub struct RunResponse(pub Result<Outcome, RunError>);

impl IntoResponse for RunResponse {
    fn into_response(self) -> Response {
        respond(self.0)
    }
}

/// The response for what the runner made of a request.
pub fn respond(result: Result<Outcome, RunError>) -> Response {
    match result {
        Ok(Outcome::Executed(stored) | Outcome::Forgotten(stored)) => {
            stored_response(&stored, false)
        }
        Ok(Outcome::Replayed(stored)) => stored_response(&stored, true),
        Ok(Outcome::InProgress { retry_after }) => ProblemType::REQUEST_IN_PROGRESS
            .problem("a request with this idempotency key is in progress; retry later")
            .retry_after(retry_after)
            .into_response(),
        Ok(Outcome::Mismatch) => ProblemType::IDEMPOTENCY_KEY_REUSED
            .problem("this idempotency key was used for a different request")
            .into_response(),
        Ok(Outcome::Rejected(rejection)) => rejected(&rejection).into_response(),
        Ok(Outcome::Interrupted { retry_after, .. }) => ProblemType::INTERRUPTED
            .problem(
                "the request started and will be finished; retry with the same idempotency key",
            )
            .retry_after(retry_after)
            .into_response(),
        Ok(other) => {
            // An outcome this layer was not built to know of: a bug to fix, answered in general.
            tracing::error!(?other, "an outcome the HTTP layer does not know");
            internal_error().into_response()
        }
        Err(RunError::Fenced) => ProblemType::REQUEST_IN_PROGRESS
            .problem("another attempt took this request over; retry later")
            .retry_after(Duration::from_secs(1))
            .into_response(),
        Err(RunError::Panicked { phase, message }) => {
            // A bug: recorded as a failed attempt (the key resumes by its retry policy), and
            // answered in general terms.
            tracing::error!(phase, message, "a phase panicked");
            internal_error().into_response()
        }
        Err(RunError::Busy) => {
            // SQLite's one writer was held past the busy timeout: nothing of this request was
            // written, so the same key may come again at once. Not an error of the service.
            tracing::warn!("the database was busy; answered 503");
            ProblemType::DATABASE_BUSY
                .problem("the database is busy; retry with the same idempotency key shortly")
                .retry_after(BUSY_RETRY_AFTER)
                .into_response()
        }
        Err(RunError::Sealing(error)) => {
            // A stored value did not open (a key id removed from the keyring, a ciphertext moved
            // between rows): a retry cannot help until an operator does.
            tracing::error!(%error, "a stored value did not open");
            ProblemType::INTERNAL_ERROR
                .problem("the request failed on an internal error")
                .into_response()
        }
        Err(error) => {
            // Logged in full here, answered in general terms: no database text leaves.
            tracing::error!(%error, "request failed");
            ProblemType::UNAVAILABLE
                .problem("the service could not process the request")
                .retry_after(Duration::from_secs(1))
                .into_response()
        }
    }
}

/// The 500 for a bug, in general terms: the attempt counts and the key resumes.
pub(crate) fn internal_error() -> Problem {
    ProblemType::INTERNAL_ERROR
        .problem("the request failed on an internal error; retry with the same idempotency key")
}

/// Retry-After for a busy database: its writer's transactions last milliseconds.
const BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

fn rejected(rejection: &Rejection) -> Problem {
    match rejection {
        Rejection::InvalidKey(error) => {
            ProblemType::IDEMPOTENCY_KEY_INVALID.problem(error.to_string())
        }
        Rejection::InvalidBody(error) => ProblemType::BODY_INVALID.problem(error.to_string()),
        Rejection::InvalidInput(why) => ProblemType::REQUEST_INVALID.problem(why.clone()),
        // A refusal added to the runner later: the request was not the route's to run.
        other => ProblemType::REQUEST_INVALID.problem(other.to_string()),
    }
}

/// A stored response, as it was stored, plus the replay marker on replays.
pub fn stored_response(stored: &StoredResponse, replayed: bool) -> Response {
    let mut response = Response::new(Body::from(stored.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            header::HeaderName::try_from(name.as_str()),
            HeaderValue::from_bytes(value.as_bytes()),
        ) {
            headers.append(name, value);
        }
    }
    if replayed {
        headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::ZERO), 1);
        assert_eq!(seconds(Duration::from_millis(2001)), 3);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
    }

    /// A busy database (SQLite's writer held past the busy timeout) wrote nothing: the client is
    /// told to come back with the same key, never a 500.
    #[tokio::test]
    async fn a_busy_database_is_answered_503_with_retry_after() {
        let response = respond(Err(RunError::Busy));
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "1");
        let body = axum::body::to_bytes(response.into_body(), 4096)
            .await
            .expect("a problem body");
        let problem: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(problem["code"], "database_busy", "{problem}");
    }
}
