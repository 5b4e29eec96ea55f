//! The client: one key per intent, attempts until an answer or the deadline.

use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue, LOCATION};
use reqwest::{IntoUrl, Method, StatusCode, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::header::{self, IDEMPOTENCY_KEY, KeyForm};
use crate::journal::{JournalError, KeyJournal};
use crate::policy::{ClientRetryPolicy, JitterSource};

/// The default of [`IdempotentClient::with_max_response_bytes`]: 8 MiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// The default of [`IdempotentClient::with_key_max_age`]: 24 hours, idemflow's default retention.
pub const DEFAULT_KEY_MAX_AGE: Duration = Duration::from_secs(24 * 60 * 60);

/// An answer: a response that is not worth retrying: 2xx, 304, every 4xx but 409 and 429, 501 and
/// 505, and any response the server marked as a replay.
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
    /// A response that asked for a retry (409, 429, or a 5xx but 501 and 505, not a replay); its
    /// `key` and `attempts` are the call's.
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
#[non_exhaustive]
pub enum ClientError {
    /// The body could not be written as JSON; nothing was sent, no key was made.
    #[error("the request body cannot be written as JSON")]
    Body(#[source] serde_json::Error),
    /// The request could not be built (a bad URL), or a `reqwest::Client` that follows redirects
    /// gave up on them (a loop, too many); not retried.
    #[error("the request cannot be built or followed")]
    Request(#[source] reqwest::Error),
    /// The journal failed to load, store or forget a key.
    #[error("the key journal failed")]
    Journal(#[from] JournalError),
    /// The journal holds, for this intent, something that cannot be sent as a key (in the
    /// client's [`KeyForm`]).
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
    /// The server redirected the request. A redirect is not an answer (a `POST` that a redirect
    /// turned into a `GET` may answer 200 for work that never ran), and is not retried: the caller
    /// decides whether to send the intent to the new location. The key stays in the journal.
    ///
    /// With a `reqwest::Client` built by [`http_builder`], the 3xx itself (all but 304) is
    /// reported and nothing else was sent. A client that follows redirects has already sent the
    /// request on (as a `GET` after 301, 302 and 303; the same method, body and key after 307 and
    /// 308); the client notices it from the response's URL and reports it with `followed`.
    #[error("{}", redirected_message(*.status, .location.as_deref(), *.followed))]
    Redirected {
        /// The 3xx, or, when `followed`, the status of the response at the end of the redirects.
        status: StatusCode,
        /// Where to: the `Location` header, resolved against the request's URL; when `followed`,
        /// the URL the redirects ended at.
        location: Option<String>,
        /// Whether the `reqwest::Client` followed the redirect (it was not built by
        /// [`http_builder`] or with `redirect::Policy::none()`).
        followed: bool,
        /// The idempotency key the request was sent with.
        key: String,
        /// How many attempts the call made.
        attempts: u32,
    },
    /// The response's body is longer than the limit set by
    /// [`IdempotentClient::with_max_response_bytes`]; the rest was not read. Not retried (the
    /// server would send the same answer again); the key stays in the journal.
    #[error("the response's body is longer than the limit of {limit} bytes")]
    ResponseTooLarge {
        /// The limit.
        limit: usize,
        /// The idempotency key the request was sent with.
        key: String,
        /// How many attempts the call made.
        attempts: u32,
    },
    /// The intent's key is older than the client's key max age
    /// ([`IdempotentClient::with_key_max_age`]): the server may have forgotten it, and sending it
    /// could run the request again. Nothing was sent and the key stays in the journal. Find out
    /// whether the first attempts did the work; then [`finish`](IdempotentClient::finish) the
    /// intent and, if needed, start a new one.
    #[error(
        "the key of intent {intent:?} was made {age:?} ago, longer than the server may keep it; \
         nothing was sent"
    )]
    KeyExpired {
        /// The intent.
        intent: String,
        /// Its key, as the journal holds it.
        key: String,
        /// How long ago the key was made, by the time in its UUIDv7.
        age: Duration,
    },
}

/// [`ClientError::Redirected`]'s message.
fn redirected_message(status: StatusCode, location: Option<&str>, followed: bool) -> String {
    let to = location.unwrap_or("an unnamed location");
    if followed {
        format!(
            "the request was redirected, and the reqwest::Client followed, to {to} (status \
             {status} there); a redirect is not an answer"
        )
    } else {
        format!("the server redirected the request to {to} (status {status}); not followed")
    }
}

/// A `reqwest::ClientBuilder` that does not follow redirects, as the [`IdempotentClient`] needs:
/// add timeouts and the like, then `build()`.
///
/// A client that follows redirects sends the request on before the [`IdempotentClient`] sees the
/// 3xx: after 301, 302 and 303 as a `GET`, which may answer 200 for work that never ran; after 307
/// and 308 the same request, key included, to another server.
///
/// ```
/// use std::time::Duration;
///
/// let http = idemflow_client::http_builder().timeout(Duration::from_secs(10)).build()?;
/// # Ok::<(), reqwest::Error>(())
/// ```
pub fn http_builder() -> reqwest::ClientBuilder {
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none())
}

/// Sends requests under an `Idempotency-Key`, one key per intent, retrying what is safe to retry.
///
/// See the crate documentation for an example.
#[derive(Debug)]
pub struct IdempotentClient<J> {
    http: reqwest::Client,
    journal: J,
    policy: ClientRetryPolicy,
    jitter: JitterSource,
    max_response_bytes: usize,
    key_max_age: Option<Duration>,
    key_form: KeyForm,
    /// Serialises load-or-create, so two calls for one new intent get one key even with a
    /// journal whose `store_new` is not atomic.
    keys: tokio::sync::Mutex<()>,
}

impl<J: KeyJournal> IdempotentClient<J> {
    /// A client sending with `http`, keeping keys in `journal`, with the default [`ClientRetryPolicy`],
    /// a response limit of [`DEFAULT_MAX_RESPONSE_BYTES`], a key max age of
    /// [`DEFAULT_KEY_MAX_AGE`] and keys sent as [`KeyForm::Quoted`].
    ///
    /// Build `http` with [`http_builder`] (or `redirect::Policy::none()`): a client that follows
    /// redirects sends the request on before this one can refuse to (it then reports
    /// [`ClientError::Redirected`] all the same). A timeout set on `http` bounds each attempt (a
    /// timed-out attempt is retried); the policy's deadline bounds the whole call.
    pub fn new(http: reqwest::Client, journal: J) -> Self {
        Self {
            http,
            journal,
            policy: ClientRetryPolicy::default(),
            jitter: JitterSource::new(),
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            key_max_age: Some(DEFAULT_KEY_MAX_AGE),
            key_form: KeyForm::Quoted,
            keys: tokio::sync::Mutex::new(()),
        }
    }

    /// A client with a `reqwest::Client` from [`http_builder`] (no redirects, no timeout), keeping
    /// keys in `journal`; otherwise as [`new`](Self::new).
    pub fn with_default_http(journal: J) -> Result<Self, ClientError> {
        let http = http_builder().build().map_err(ClientError::Request)?;
        Ok(Self::new(http, journal))
    }

    /// The same client with another retry policy.
    #[must_use]
    pub fn with_policy(mut self, policy: ClientRetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The same client reading at most `limit` bytes of a response's body (default
    /// [`DEFAULT_MAX_RESPONSE_BYTES`]); a longer body is [`ClientError::ResponseTooLarge`].
    ///
    /// The body is read in chunks as it comes, so a server that streams without end costs at most
    /// `limit` bytes of memory.
    #[must_use]
    pub fn with_max_response_bytes(mut self, limit: usize) -> Self {
        self.max_response_bytes = limit;
        self
    }

    /// The same client refusing to send a key made more than `age` ago (default
    /// [`DEFAULT_KEY_MAX_AGE`]), with [`ClientError::KeyExpired`]: set it to the server's
    /// retention window, past which a retry may run the request again.
    ///
    /// The age is read from the key itself, a UUIDv7 whose first 48 bits are the Unix time in
    /// milliseconds it was made at, against this machine's clock. Keys that are not UUIDv7 (from
    /// a journal of the caller's own) are never judged.
    #[must_use]
    pub fn with_key_max_age(mut self, age: Duration) -> Self {
        self.key_max_age = Some(age);
        self
    }

    /// The same client sending keys whatever their age: for servers that keep keys for ever, or
    /// callers that check the age themselves.
    #[must_use]
    pub fn without_key_max_age(mut self) -> Self {
        self.key_max_age = None;
        self
    }

    /// The same client writing the key in the `Idempotency-Key` header in `form` (default
    /// [`KeyForm::Quoted`]).
    #[must_use]
    pub fn with_key_form(mut self, form: KeyForm) -> Self {
        self.key_form = form;
        self
    }

    /// The retry policy.
    pub fn policy(&self) -> &ClientRetryPolicy {
        &self.policy
    }

    /// The longest response body read, in bytes.
    pub fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// The age past which a key is not sent, if any.
    pub fn key_max_age(&self) -> Option<Duration> {
        self.key_max_age
    }

    /// How the key is written in the header.
    pub fn key_form(&self) -> KeyForm {
        self.key_form
    }

    /// The journal.
    pub fn journal(&self) -> &J {
        &self.journal
    }

    /// The key for `intent`: the one in the journal, or a new UUIDv7, stored before it is
    /// returned.
    ///
    /// A new key is stored with [`KeyJournal::store_new`]: if another client (another process on
    /// the same journal) stored a key for the intent first, that key is returned instead, so both
    /// send the same one.
    pub async fn key_for(&self, intent: &str) -> Result<String, ClientError> {
        let _serialised = self.keys.lock().await;
        let key = match self.journal.load(intent).await? {
            Some(key) => key,
            None => self.new_key(intent).await?,
        };
        if !header::is_valid_key(&key) {
            return Err(ClientError::InvalidKey {
                intent: intent.to_owned(),
                key,
            });
        }
        Ok(key)
    }

    async fn new_key(&self, intent: &str) -> Result<String, ClientError> {
        let made = uuid::Uuid::now_v7().to_string();
        let key = self.journal.store_new(intent, &made).await?;
        if key == made {
            debug!(intent, key, "new idempotency key");
        } else {
            debug!(
                intent,
                key, "another client stored a key for this intent first"
            );
        }
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
    /// sent as `Idempotency-Key: "<key>"` (an RFC 8941 sf-string; see [`KeyForm`]), replacing any
    /// such header in `headers`. `Content-Type: application/json` is added unless `headers` has a
    /// content type. A key older than the key max age is not sent ([`ClientError::KeyExpired`]).
    ///
    /// Retried, with the same key: connection failures and timeouts, 409, 429 and 5xx but 501 and
    /// 505, after the `Retry-After` of the response if it has one (bounded by the policy's
    /// `min_retry_after` and `max_retry_after`), else after the policy's backoff; never a response
    /// marked `Idempotent-Replayed`, which is the server's stored answer. A redirect is an error
    /// ([`ClientError::Redirected`]), so is a body over the limit
    /// ([`ClientError::ResponseTooLarge`]). Every other response is the answer, returned as `Ok`
    /// whatever its status.
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
        self.check_age(intent, &key)?;
        let Some(key_header) = header::key_value(&key, self.key_form) else {
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

    /// [`ClientError::KeyExpired`] if `key` is a UUIDv7 made longer ago than the key max age.
    fn check_age(&self, intent: &str, key: &str) -> Result<(), ClientError> {
        let Some(max_age) = self.key_max_age else {
            return Ok(());
        };
        match key_age(key, SystemTime::now()) {
            Some(age) if age > max_age => {
                warn!(
                    intent,
                    key,
                    age_s = age.as_secs(),
                    "the key is too old to send"
                );
                Err(ClientError::KeyExpired {
                    intent: intent.to_owned(),
                    key: key.to_owned(),
                    age,
                })
            }
            _ => Ok(()),
        }
    }

    async fn attempt_until_answer(&self, call: Call<'_>) -> Result<Reply, ClientError> {
        let Call { intent, key, .. } = &call;
        let started = Instant::now();
        let deadline = started.checked_add(self.policy.deadline);
        let remaining =
            || deadline.map(|deadline| deadline.saturating_duration_since(Instant::now()));
        let mut attempts: u32 = 0;
        loop {
            attempts = attempts.saturating_add(1);
            let (method, url) = (&call.method, &call.url);
            debug!(intent, key, attempt = attempts, %method, %url, "sending");
            let exchange = self.exchange(&call);
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
            let (last, asked) = match self.judge(&call, attempts, outcome)? {
                Verdict::Answer(reply) => return Ok(reply),
                Verdict::Retry { last, asked } => (last, asked),
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

    /// One attempt: the request sent, the response read, unless it is a redirect or too long.
    async fn exchange(&self, call: &Call<'_>) -> Result<Exchange, reqwest::Error> {
        let mut response = self
            .http
            .request(call.method.clone(), call.url.clone())
            .headers(call.headers.clone())
            .body(call.body.clone())
            .send()
            .await?;
        let status = response.status();
        if *response.url() != call.url {
            // The reqwest::Client followed a redirect: what answered is not what was asked.
            return Ok(Exchange::Redirected {
                status,
                location: Some(response.url().to_string()),
                followed: true,
            });
        }
        if is_redirect(status) {
            return Ok(Exchange::Redirected {
                status,
                location: location(response.headers(), &call.url),
                followed: false,
            });
        }
        let headers = std::mem::take(response.headers_mut());
        let body = read_body(&mut response, self.max_response_bytes).await?;
        Ok(body.map_or(Exchange::TooLarge, |body| Exchange::Response {
            status,
            headers,
            body,
        }))
    }

    /// What an attempt's outcome means: an answer, an error, or a retry.
    fn judge(
        &self,
        call: &Call<'_>,
        attempts: u32,
        outcome: Result<Exchange, reqwest::Error>,
    ) -> Result<Verdict, ClientError> {
        let Call { intent, key, .. } = call;
        match outcome {
            Ok(Exchange::Response {
                status,
                headers,
                body,
            }) => Ok(self.judge_response(
                intent,
                Reply {
                    replayed: header::is_replayed(&headers),
                    status,
                    headers,
                    body,
                    key: key.clone(),
                    attempts,
                },
            )),
            Ok(Exchange::Redirected {
                status,
                location,
                followed,
            }) => {
                warn!(
                    intent,
                    key,
                    attempts,
                    status = status.as_u16(),
                    location,
                    followed,
                    "redirected; not an answer"
                );
                Err(ClientError::Redirected {
                    status,
                    location,
                    followed,
                    key: key.clone(),
                    attempts,
                })
            }
            Ok(Exchange::TooLarge) => {
                warn!(
                    intent,
                    key,
                    attempts,
                    limit = self.max_response_bytes,
                    "response too large"
                );
                Err(ClientError::ResponseTooLarge {
                    limit: self.max_response_bytes,
                    key: key.clone(),
                    attempts,
                })
            }
            Err(error) if error.is_builder() || error.is_redirect() => {
                Err(ClientError::Request(error))
            }
            Err(error) => Ok(Verdict::Retry {
                last: LastAttempt::Transport(error),
                asked: None,
            }),
        }
    }
}

impl<J> IdempotentClient<J> {
    /// A whole response is the answer, unless it asks to be retried and is not a replay (a replay
    /// is the server's stored final answer: asking again gets it again).
    fn judge_response(&self, intent: &str, reply: Reply) -> Verdict {
        if reply.replayed || !is_retryable(reply.status) {
            debug!(
                intent,
                key = reply.key,
                attempts = reply.attempts,
                status = reply.status.as_u16(),
                replayed = reply.replayed,
                "answer"
            );
            return Verdict::Answer(reply);
        }
        let asked = header::retry_after(&reply.headers, SystemTime::now())
            .map(|asked| self.policy.bounded_retry_after(asked));
        Verdict::Retry {
            last: LastAttempt::Response(reply),
            asked,
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

/// What one attempt got, short of a transport error.
enum Exchange {
    /// A response, its body whole and within the limit.
    Response {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
    /// A 3xx (but 304), or a response the reqwest::Client reached by following one.
    Redirected {
        status: StatusCode,
        location: Option<String>,
        followed: bool,
    },
    /// A body longer than the limit; the rest was not read.
    TooLarge,
}

/// What to do after an attempt that did not end the call.
enum Verdict {
    Answer(Reply),
    Retry {
        last: LastAttempt,
        /// The response's `Retry-After`, bounded by the policy.
        asked: Option<Duration>,
    },
}

/// 409 (another attempt in progress), 429 and 5xx: come back later; but 501 (Not Implemented)
/// and 505 (HTTP Version Not Supported), which say the same whenever asked. Every other status is
/// an answer.
fn is_retryable(status: StatusCode) -> bool {
    status == StatusCode::CONFLICT
        || status == StatusCode::TOO_MANY_REQUESTS
        || (status.is_server_error()
            && status != StatusCode::NOT_IMPLEMENTED
            && status != StatusCode::HTTP_VERSION_NOT_SUPPORTED)
}

/// Every 3xx but 304 (Not Modified, the answer to a conditional request) sends the client
/// elsewhere.
fn is_redirect(status: StatusCode) -> bool {
    status.is_redirection() && status != StatusCode::NOT_MODIFIED
}

/// The `Location` of a redirect, resolved against the request's URL (it may be relative); as sent
/// if it cannot be.
fn location(headers: &HeaderMap, base: &Url) -> Option<String> {
    let value = headers.get(LOCATION)?;
    let text = String::from_utf8_lossy(value.as_bytes());
    Some(
        base.join(&text)
            .map_or_else(|_| text.into_owned(), String::from),
    )
}

/// The body, read chunk by chunk, or `None` as soon as it is known to be longer than `limit`: the
/// rest is never read.
async fn read_body(
    response: &mut reqwest::Response,
    limit: usize,
) -> Result<Option<Bytes>, reqwest::Error> {
    let announced = response.content_length();
    if announced.is_some_and(|length| length > u64::try_from(limit).unwrap_or(u64::MAX)) {
        return Ok(None);
    }
    let mut body = BytesMut::new();
    while let Some(chunk) = response.chunk().await? {
        if chunk.len() > limit - body.len() {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body.freeze()))
}

/// How long before `now` `key` was made, if it is a UUIDv7 (its first 48 bits are the Unix time in
/// milliseconds); a key made after `now` (the clock went back) is 0 old.
fn key_age(key: &str, now: SystemTime) -> Option<Duration> {
    let uuid = uuid::Uuid::parse_str(key).ok()?;
    if uuid.get_version() != Some(uuid::Version::SortRand) {
        return None;
    }
    let (seconds, nanos) = uuid.get_timestamp()?.to_unix();
    let made = UNIX_EPOCH.checked_add(Duration::new(seconds, nanos))?;
    Some(now.duration_since(made).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_conflicts_throttling_and_transient_server_errors_are_retried() {
        for code in [409, 429, 500, 502, 503, 504, 507, 599] {
            assert!(
                is_retryable(StatusCode::from_u16(code).unwrap_or_default()),
                "{code}"
            );
        }
        for code in [
            200, 201, 204, 301, 304, 400, 401, 402, 403, 404, 408, 413, 415, 422, 451, 501, 505,
        ] {
            assert!(
                !is_retryable(StatusCode::from_u16(code).unwrap_or_default()),
                "{code}"
            );
        }
    }

    #[test]
    fn every_3xx_but_304_is_a_redirect() {
        for code in [300, 301, 302, 303, 305, 307, 308, 399] {
            assert!(
                is_redirect(StatusCode::from_u16(code).unwrap_or_default()),
                "{code}"
            );
        }
        for code in [200, 204, 304, 400, 500] {
            assert!(
                !is_redirect(StatusCode::from_u16(code).unwrap_or_default()),
                "{code}"
            );
        }
    }

    #[test]
    fn a_location_is_resolved_against_the_request() -> Result<(), Box<dyn std::error::Error>> {
        let base = Url::parse("http://api.example/v1/orders?x=1")?;
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(LOCATION, HeaderValue::from_static(value));
            location(&headers, &base)
        };
        assert_eq!(
            with("/v2/orders").as_deref(),
            Some("http://api.example/v2/orders")
        );
        assert_eq!(
            with("other").as_deref(),
            Some("http://api.example/v1/other")
        );
        assert_eq!(
            with("https://elsewhere.example/").as_deref(),
            Some("https://elsewhere.example/")
        );
        assert_eq!(with("http://[bad").as_deref(), Some("http://[bad"));
        assert_eq!(location(&HeaderMap::new(), &base), None);
        Ok(())
    }

    #[test]
    fn a_key_is_as_old_as_its_uuidv7_time() {
        let now = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let made = |seconds_ago: u64| {
            let at = Duration::from_secs(1_800_000_000 - seconds_ago);
            let timestamp =
                uuid::Timestamp::from_unix(uuid::NoContext, at.as_secs(), at.subsec_nanos());
            uuid::Uuid::new_v7(timestamp)
        };
        let key = made(90_000);
        assert_eq!(
            key_age(&key.to_string(), now),
            Some(Duration::from_secs(90_000))
        );
        assert_eq!(
            key_age(&key.simple().to_string(), now),
            Some(Duration::from_secs(90_000))
        );
        assert_eq!(key_age(&made(0).to_string(), now), Some(Duration::ZERO));
        let ahead = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(key_age(&key.to_string(), ahead), Some(Duration::ZERO));
        assert_eq!(key_age("9b2f0c4e-8a1d-4c3b-9e5f-1a2b3c4d5e6f", now), None);
        assert_eq!(key_age("order-7781", now), None);
        assert_eq!(key_age("", now), None);
    }
}
