//! The client: one key per intent, attempts until an answer or the deadline.

use std::fmt;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use reqwest::{IntoUrl, Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::header::{self, IDEMPOTENCY_KEY};
use crate::journal::{JournalError, KeyJournal};
use crate::policy::{JitterSource, RetryPolicy};

/// An answer: a response that is not worth retrying (2xx, 3xx, and every 4xx but 409 and 429).
#[derive(Debug, Clone)]
pub struct Reply {
    /// The response's status.
    pub status: StatusCode,
    /// The response's headers.
    pub headers: HeaderMap,
    /// The response's body.
    pub body: Bytes,
    /// Whether the server said this is the stored answer of an earlier attempt
    /// (`Idempotent-Replayed: true`).
    pub replayed: bool,
    /// The idempotency key the request was sent with.
    pub key: String,
    /// How many attempts the call made, this one included.
    pub attempts: u32,
}

impl Reply {
    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        self.status.is_success()
    }

    /// The body, read as JSON.
    pub fn json<T: DeserializeOwned>(&self) -> serde_json::Result<T> {
        serde_json::from_slice(&self.body)
    }
}

/// What the last attempt before the deadline got.
#[derive(Debug)]
pub enum LastAttempt {
    /// A response that asked for a retry (409, 429 or 5xx); its `key` and `attempts` are the call's.
    Response(Reply),
    /// No response: the connection failed, was cut, or timed out.
    Transport(reqwest::Error),
    /// The attempt was still running at the deadline, and was abandoned.
    Unfinished,
}

impl fmt::Display for LastAttempt {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Response(reply) => write!(formatter, "status {}", reply.status),
            Self::Transport(error) => write!(formatter, "{error}"),
            Self::Unfinished => formatter.write_str("an attempt still running at the deadline"),
        }
    }
}

/// Why a call has no answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The body could not be written as JSON; nothing was sent, no key was made.
    #[error("the request body cannot be written as JSON")]
    Body(#[source] serde_json::Error),
    /// The request could not be built (a bad URL, a redirect loop); not retried.
    #[error("the request cannot be built or followed")]
    Request(#[source] reqwest::Error),
    /// The journal failed to load, store or forget a key.
    #[error("the key journal failed")]
    Journal(#[from] JournalError),
    /// The journal holds, for this intent, something that cannot be sent as a key.
    #[error("the journal's key for intent {intent:?} is not a valid idempotency key: {key:?}")]
    InvalidKey {
        /// The intent.
        intent: String,
        /// What the journal held.
        key: String,
    },
    /// No answer before the deadline. The key stays in the journal: calling again for the same
    /// intent retries with it.
    #[error("no answer before the deadline, after {attempts} attempts; the last: {last}")]
    DeadlineExceeded {
        /// How many attempts were made.
        attempts: u32,
        /// What the last one got.
        last: Box<LastAttempt>,
    },
}

/// Sends requests under an `Idempotency-Key`, one key per intent, retrying what is safe to retry.
///
/// See the crate documentation for an example.
#[derive(Debug)]
pub struct IdempotentClient<J> {
    http: reqwest::Client,
    journal: J,
    policy: RetryPolicy,
    jitter: JitterSource,
    /// Serialises load-or-create, so two calls for one new intent get one key.
    keys: tokio::sync::Mutex<()>,
}

impl<J: KeyJournal> IdempotentClient<J> {
    /// A client sending with `http`, keeping keys in `journal`, with the default [`RetryPolicy`].
    ///
    /// A timeout set on `http` bounds each attempt (a timed-out attempt is retried); the policy's
    /// deadline bounds the whole call.
    pub fn new(http: reqwest::Client, journal: J) -> Self {
        Self {
            http,
            journal,
            policy: RetryPolicy::default(),
            jitter: JitterSource::new(),
            keys: tokio::sync::Mutex::new(()),
        }
    }

    /// The same client with another retry policy.
    #[must_use]
    pub fn with_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The retry policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The journal.
    pub fn journal(&self) -> &J {
        &self.journal
    }

    /// The key for `intent`: the one in the journal, or a new UUIDv7, stored before it is returned.
    pub async fn key_for(&self, intent: &str) -> Result<String, ClientError> {
        let _serialised = self.keys.lock().await;
        if let Some(key) = self.journal.load(intent).await? {
            if !header::is_valid_key(&key) {
                return Err(ClientError::InvalidKey {
                    intent: intent.to_owned(),
                    key,
                });
            }
            return Ok(key);
        }
        let key = uuid::Uuid::now_v7().to_string();
        self.journal.store(intent, &key).await?;
        debug!(intent, key, "new idempotency key");
        Ok(key)
    }

    /// Forgets `intent`'s key: the next call for an intent of that name is a new request, with a
    /// new key.
    ///
    /// Call it once the intent has its final answer and the caller no longer needs to retry it (the
    /// answer is acted upon and recorded). Never called by the client itself: an answer read but
    /// not yet acted upon may still need the same key after a crash.
    pub async fn finish(&self, intent: &str) -> Result<(), ClientError> {
        let _serialised = self.keys.lock().await;
        self.journal.forget(intent).await?;
        debug!(intent, "intent finished, key forgotten");
        Ok(())
    }

    /// `POST` of `body` as JSON to `url` under `intent`'s key; see [`send_json`](Self::send_json).
    pub async fn post_json<B: Serialize + ?Sized>(
        &self,
        intent: &str,
        url: impl IntoUrl,
        body: &B,
    ) -> Result<Reply, ClientError> {
        self.send_json(intent, Method::POST, url, HeaderMap::new(), body)
            .await
    }

    /// Sends `body` as JSON under `intent`'s key until an answer comes or the deadline passes.
    ///
    /// The key is taken from the journal, or made and stored there before the first attempt, and
    /// sent as `Idempotency-Key: "<key>"` (an RFC 8941 sf-string), replacing any such header in
    /// `headers`. `Content-Type: application/json` is added unless `headers` has a content type.
    ///
    /// Retried, with the same key: connection failures and timeouts, 409, 429 and 5xx, after the
    /// `Retry-After` of the response if it has one (`0` means at once), else after the policy's
    /// backoff. Every other response is the answer, returned as `Ok` whatever its status.
    pub async fn send_json<B: Serialize + ?Sized>(
        &self,
        intent: &str,
        method: Method,
        url: impl IntoUrl,
        mut headers: HeaderMap,
        body: &B,
    ) -> Result<Reply, ClientError> {
        let body = Bytes::from(serde_json::to_vec(body).map_err(ClientError::Body)?);
        let url = self
            .http
            .request(method.clone(), url)
            .build()
            .map_err(ClientError::Request)?
            .url()
            .clone();
        let key = self.key_for(intent).await?;
        let Ok(key_header) = HeaderValue::from_str(&header::sf_string(&key)) else {
            return Err(ClientError::InvalidKey {
                intent: intent.to_owned(),
                key,
            });
        };
        headers.insert(IDEMPOTENCY_KEY, key_header);
        if !headers.contains_key(CONTENT_TYPE) {
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        let call = Call {
            intent,
            key,
            method,
            url,
            headers,
            body,
        };
        self.attempt_until_answer(call).await
    }

    async fn attempt_until_answer(&self, call: Call<'_>) -> Result<Reply, ClientError> {
        let Call {
            intent,
            key,
            method,
            url,
            headers,
            body,
        } = call;
        let started = Instant::now();
        let deadline = started.checked_add(self.policy.deadline);
        let remaining =
            || deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
        let mut attempts: u32 = 0;
        loop {
            attempts = attempts.saturating_add(1);
            debug!(intent, key, attempt = attempts, %method, %url, "sending");
            let request = self
                .http
                .request(method.clone(), url.clone())
                .headers(headers.clone())
                .body(body.clone());
            let exchange = async {
                let response = request.send().await?;
                let status = response.status();
                let headers = response.headers().clone();
                Ok::<_, reqwest::Error>((status, headers, response.bytes().await?))
            };
            let outcome = match remaining() {
                Some(left) => match tokio::time::timeout(left, exchange).await {
                    Ok(outcome) => outcome,
                    Err(_elapsed) => {
                        warn!(
                            intent,
                            key, attempts, "deadline reached during an attempt; giving up"
                        );
                        return Err(ClientError::DeadlineExceeded {
                            attempts,
                            last: Box::new(LastAttempt::Unfinished),
                        });
                    }
                },
                None => exchange.await,
            };
            let (last, asked) = match outcome {
                Ok((status, response_headers, response_body)) => {
                    let reply = Reply {
                        replayed: header::is_replayed(&response_headers),
                        status,
                        headers: response_headers,
                        body: response_body,
                        key: key.clone(),
                        attempts,
                    };
                    if !is_retryable(status) {
                        debug!(
                            intent,
                            key,
                            attempts,
                            status = status.as_u16(),
                            replayed = reply.replayed,
                            "answer"
                        );
                        return Ok(reply);
                    }
                    let asked = header::retry_after(&reply.headers, SystemTime::now());
                    (LastAttempt::Response(reply), asked)
                }
                Err(error) if error.is_builder() || error.is_redirect() => {
                    return Err(ClientError::Request(error));
                }
                Err(error) => (LastAttempt::Transport(error), None),
            };
            let wait = asked.unwrap_or_else(|| {
                self.policy
                    .jittered(self.policy.backoff(attempts), self.jitter.next_unit())
            });
            if remaining().is_some_and(|left| wait >= left) {
                warn!(
                    intent,
                    key,
                    attempts,
                    %last,
                    wait_ms = wait.as_millis(),
                    "the next attempt would start after the deadline; giving up"
                );
                return Err(ClientError::DeadlineExceeded {
                    attempts,
                    last: Box::new(last),
                });
            }
            warn!(
                intent,
                key,
                attempts,
                %last,
                wait_ms = wait.as_millis(),
                retry_after = asked.is_some(),
                "retrying"
            );
            tokio::time::sleep(wait).await;
        }
    }
}

/// One call's fixed parts.
struct Call<'a> {
    intent: &'a str,
    key: String,
    method: Method,
    url: Url,
    headers: HeaderMap,
    body: Bytes,
}

/// 409 (another attempt in progress), 429 and 5xx: come back later. Every other status is an
/// answer.
fn is_retryable(status: StatusCode) -> bool {
    status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_conflicts_throttling_and_server_errors_are_retried() {
        for code in [409, 429, 500, 502, 503, 504, 599] {
            assert!(
                is_retryable(StatusCode::from_u16(code).unwrap_or_default()),
                "{code}"
            );
        }
        for code in [
            200, 201, 204, 301, 304, 400, 401, 402, 403, 404, 408, 413, 415, 422, 451,
        ] {
            assert!(
                !is_retryable(StatusCode::from_u16(code).unwrap_or_default()),
                "{code}"
            );
        }
    }
}
