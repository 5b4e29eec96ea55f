//! The wrapped handler as the layer's one foreign phase, and the live request it runs with.
//!
//! The runner calls the phase inside the attempt that claimed (or took over) the key; the
//! attempt's live request reaches it through a task-local, whole: headers with credentials,
//! extensions (`Path` parameters, an auth layer's `Extension<User>`, `ConnectInfo`,
//! `MatchedPath`), body. The phase's output is the response as stored; the response as the
//! handler made it goes back to the live client through the same task-local.

use std::convert::Infallible;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::request::Parts;
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::Response;
use idemflow_core::{DerivedKey, FieldValue, StoredResponse};
use idemflow_runner::{ForeignPhase, PhaseContext, PhaseError, RetryPolicy};
use tower::{Service, ServiceExt};

use crate::body::{BodyError, read_limited};
use crate::config::{HOP_BY_HOP, Redaction, StatusClass, StatusRules, TRANSFER};
use crate::recorded::Unread;

tokio::task_local! {
    /// The attempt's live request, for the handler phase of this very attempt.
    pub(crate) static LIVE: Arc<Live>;
}

/// One attempt's live request, and the handler's answer to it.
#[derive(Debug)]
pub(crate) struct Live {
    /// Taken by the handler phase: one attempt calls its handler once.
    request: Mutex<Option<(Parts, Bytes)>>,
    answer: Mutex<Option<Answer>>,
}

/// The handler's response as it made it.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: AnswerBody,
}

/// A stored answer's body is the stored response's, not a second copy of it (a response may be
/// megabytes): what was stored is recognised by its status and size, and its bytes taken from
/// the outcome.
#[derive(Debug)]
pub(crate) enum AnswerBody {
    Stored { length: usize },
    Unstored(Bytes),
}

impl Live {
    pub(crate) fn new(parts: Parts, body: Bytes) -> Arc<Self> {
        Arc::new(Self {
            request: Mutex::new(Some((parts, body))),
            answer: Mutex::new(None),
        })
    }

    fn take_request(&self) -> Option<(Parts, Bytes)> {
        self.request
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    fn keep_answer(&self, answer: Answer) {
        *self.answer.lock().unwrap_or_else(PoisonError::into_inner) = Some(answer);
    }

    pub(crate) fn take_answer(&self) -> Option<Answer> {
        self.answer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl Answer {
    /// The answer, if it was not stored.
    pub(crate) fn unstored(self) -> Option<Response> {
        let Self {
            status,
            headers,
            body: AnswerBody::Unstored(body),
        } = self
        else {
            return None;
        };
        Some(response(status, headers, body.into()))
    }

    /// The answer with the stored response's body, if `stored` is what this answer stored.
    pub(crate) fn stored(self, stored: StoredResponse) -> Result<Response, StoredResponse> {
        match self.body {
            AnswerBody::Stored { length }
                if length == stored.body.len() && self.status.as_u16() == stored.status =>
            {
                Ok(response(self.status, self.headers, stored.body.into()))
            }
            _ => Err(stored),
        }
    }
}

fn response(status: StatusCode, headers: HeaderMap, body: Body) -> Response {
    let mut response = Response::new(body);
    *response.status_mut() = status;
    *response.headers_mut() = headers;
    response
}

/// How the handler phase treats the handler's response.
#[derive(Debug, Clone)]
pub(crate) struct HandlerSettings {
    pub timeout: Duration,
    pub max_response_bytes: usize,
    pub redaction: Arc<Redaction>,
    pub statuses: Arc<StatusRules>,
}

/// The wrapped handler, as a foreign phase.
pub(crate) struct Handler<S> {
    pub inner: S,
    pub settings: HandlerSettings,
}

#[async_trait::async_trait]
impl<S> ForeignPhase for Handler<S>
where
    S: Service<Request<Body>, Response = Response, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    const NAME: &'static str = "handler";
    type Input = Unread;
    type Output = StoredResponse;

    fn timeout(&self) -> Duration {
        self.settings.timeout
    }

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default()
    }

    async fn call(
        &self,
        derived_key: &DerivedKey,
        _: Unread,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        // The workflow is live-only (a resumer refuses it), so there is always a live
        // request; without one nothing can be run faithfully.
        let live = LIVE
            .try_with(Arc::clone)
            .map_err(|_| PhaseError::retryable("the handler runs only within a live request"))?;
        let (mut parts, body) = live
            .take_request()
            .ok_or_else(|| PhaseError::retryable("the live request was already handled"))?;
        // The handler may pass it on to a system it calls, to make that call idempotent too.
        parts.extensions.insert(derived_key.clone());
        let response = self
            .inner
            .clone()
            .oneshot(Request::from_parts(parts, body.into()))
            .await
            .unwrap_or_else(|never| match never {});
        self.settle(&live, response).await
    }
}

impl<S> Handler<S> {
    /// Reads the handler's response and decides, by its status, what becomes of it.
    async fn settle(&self, live: &Live, response: Response) -> Result<StoredResponse, PhaseError> {
        let (parts, body) = response.into_parts();
        let status = parts.status;
        if is_event_stream(&parts.headers) {
            // A stream that may never end cannot be stored; the handler ran, so the request
            // ends with a problem that says why.
            return Err(PhaseError::terminal_with(
                crate::problem::stored_problem(
                    crate::ProblemType::RESPONSE_NOT_STORABLE,
                    "the handler answered with an event stream, which cannot be stored and replayed",
                ),
                "the handler answered with an event stream",
            ));
        }
        let body = self.read_response(body).await?;
        let mut headers = parts.headers;
        for name in HOP_BY_HOP.iter().chain(TRANSFER.iter()) {
            headers.remove(*name);
        }
        match self.settings.statuses.class(status) {
            StatusClass::Stored => {
                let stored = StoredResponse {
                    status: status.as_u16(),
                    headers: headers
                        .iter()
                        .filter(|(name, _)| {
                            self.settings
                                .redaction
                                .stores_response_header(name.as_str())
                        })
                        // As their bytes: obs-text (0x80-0xFF) is legal in a field value.
                        .map(|(name, value)| {
                            (name.as_str().to_owned(), FieldValue::from(value.as_bytes()))
                        })
                        .collect(),
                    // Without a copy when the handler's body is one buffer it owns alone.
                    body: Vec::from(body),
                };
                live.keep_answer(Answer {
                    status,
                    headers,
                    body: AnswerBody::Stored {
                        length: stored.body.len(),
                    },
                });
                Ok(stored)
            }
            StatusClass::NotExecuted => {
                let message = format!("the handler answered {status}: not executed");
                live.keep_answer(Answer {
                    status,
                    headers,
                    body: AnswerBody::Unstored(body),
                });
                Err(PhaseError::not_executed(
                    StoredResponse::new(status.as_u16(), Vec::new()),
                    message,
                ))
            }
            StatusClass::Retried => {
                let asked = retry_after(&headers);
                let message = format!("the handler answered {status}");
                live.keep_answer(Answer {
                    status,
                    headers,
                    body: AnswerBody::Unstored(body),
                });
                Err(match asked {
                    Some(wait) => PhaseError::retry_after(message, wait),
                    None => PhaseError::retryable(message),
                })
            }
        }
    }

    /// The handler's response body, read whole within the response limit. Too large to store
    /// ends the request with a problem (the handler ran); unreadable, or a streamed request body
    /// that stalled, is a retryable failure.
    async fn read_response(&self, body: Body) -> Result<Bytes, PhaseError> {
        match read_limited(body, self.settings.max_response_bytes).await {
            Ok(body) => Ok(body),
            Err(BodyError::TooLarge) => Err(PhaseError::terminal_with(
                crate::problem::stored_problem(
                    crate::ProblemType::RESPONSE_TOO_LARGE,
                    format!(
                        "the handler's response exceeds {} bytes and cannot be stored",
                        self.settings.max_response_bytes
                    ),
                ),
                "the handler's response is too large to store",
            )),
            Err(BodyError::Unreadable(error)) => Err(PhaseError::retryable(format!(
                "reading the handler's response: {error}"
            ))),
            Err(BodyError::TimedOut(timeout)) => {
                // A response streaming a request body (served with a deadline) that stalled.
                Err(PhaseError::retryable(format!(
                    "reading the handler's response: a request body it streams did not arrive within {} ms",
                    timeout.as_millis()
                )))
            }
        }
    }
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value
                .split(';')
                .next()
                .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("text/event-stream"))
        })
}

/// A `Retry-After` in seconds from the handler: when the next attempt may run.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}
