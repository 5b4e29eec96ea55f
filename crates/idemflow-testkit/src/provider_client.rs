//! A typed client for the mock provider's `POST /v1/charges` (or anything that speaks it), over
//! plain HTTP with reqwest.
//!
//! A call returns what the charge became ([`ChargeResult`]: succeeded or declined, both final) or a
//! [`ProviderError`] that says whether repeating the call with the same idempotency key is the
//! right thing to do ([`ProviderError::is_retryable`]) and how long the provider asked to wait
//! ([`ProviderError::retry_after`]). The client itself never retries.

use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, RETRY_AFTER};
use serde::Deserialize;
use serde_json::json;

/// The request timeout unless [`ProviderClientBuilder::timeout`] says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a charge became. Both are final answers: a decline is not an error to retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeResult {
    /// 200: the card was charged.
    Succeeded {
        /// The provider's charge id (`ch_…`).
        charge_id: String,
    },
    /// 402 `card_error`: the card was declined.
    Declined {
        /// The error code, e.g. `card_declined`.
        code: String,
        /// The provider's message.
        message: String,
    },
}

/// Why a charge call gave no [`ChargeResult`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProviderError {
    /// No complete answer within the client's timeout. Retryable: the charge may or may not have
    /// happened, and the same key finds out.
    #[error("the provider did not answer in time: {0}")]
    Timeout(#[source] reqwest::Error),
    /// The connection failed (refused, reset, closed before or during the response). Retryable,
    /// for the same reason as a timeout.
    #[error("network error talking to the provider: {0}")]
    Network(#[source] reqwest::Error),
    /// 409: a request with this key is still executing. Retryable, later.
    #[error("a request with this idempotency key is in progress (409): {message}")]
    InProgress {
        /// The provider's message.
        message: String,
        /// `Retry-After`, if the provider sent one.
        retry_after: Option<Duration>,
    },
    /// 429: rate limited, nothing executed. Retryable after `retry_after`.
    #[error("rate limited by the provider (429), retry after {retry_after:?}")]
    RateLimited {
        /// `Retry-After` (whole seconds), if the provider sent one.
        retry_after: Option<Duration>,
    },
    /// 5xx: the provider failed. Retryable.
    #[error("provider error ({status}): {message}")]
    Server {
        /// The HTTP status.
        status: u16,
        /// The provider's message, or the raw body.
        message: String,
        /// `Retry-After`, if the provider sent one.
        retry_after: Option<Duration>,
    },
    /// 400 `idempotency_error`: the key was first used with other parameters. Not retryable: the
    /// same request will always be refused; use a new key for a new charge.
    #[error("idempotency key reused with other parameters (400): {message}")]
    IdempotencyMismatch {
        /// The provider's message.
        message: String,
    },
    /// Any other 4xx (a bad request, a missing key). Not retryable.
    #[error("request rejected by the provider ({status} {kind}): {message}")]
    Rejected {
        /// The HTTP status.
        status: u16,
        /// The error's `type`, e.g. `invalid_request_error`.
        kind: String,
        /// The error's `code`, if any.
        code: Option<String>,
        /// The provider's message.
        message: String,
    },
    /// The request could not be built (an invalid URL, a key that is not a valid header value).
    /// Not retryable.
    #[error("the request could not be built: {0}")]
    InvalidRequest(#[source] reqwest::Error),
    /// A response this client does not understand. Not retryable.
    #[error("unexpected response from the provider ({status}): {body}")]
    UnexpectedResponse {
        /// The HTTP status.
        status: u16,
        /// The body, as (lossy) text.
        body: String,
    },
}

impl ProviderError {
    /// Whether repeating the call with the same idempotency key is the right next step: network
    /// errors, timeouts, 409, 429 and 5xx are; a key reused with other parameters and other 4xx
    /// are not.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Timeout(_)
            | Self::Network(_)
            | Self::InProgress { .. }
            | Self::RateLimited { .. }
            | Self::Server { .. } => true,
            Self::IdempotencyMismatch { .. }
            | Self::Rejected { .. }
            | Self::InvalidRequest(_)
            | Self::UnexpectedResponse { .. } => false,
        }
    }

    /// How long the provider asked to wait before a retry (`Retry-After` in seconds), if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::InProgress { retry_after, .. }
            | Self::RateLimited { retry_after }
            | Self::Server { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// Configures a [`ProviderClient`].
#[derive(Debug, Clone)]
pub struct ProviderClientBuilder {
    base_url: String,
    timeout: Duration,
}

impl ProviderClientBuilder {
    /// The whole-request timeout, connecting and reading the body included (default 10 s).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Builds the client.
    pub fn build(self) -> ProviderClient {
        let http = reqwest::Client::builder()
            .timeout(self.timeout)
            // The provider is on this machine; never route it through an environment proxy.
            .no_proxy()
            // Retrying is the caller's decision, made with the idempotency key.
            .retry(reqwest::retry::never())
            .build()
            .expect("a plain-HTTP reqwest client without a proxy builds");
        let base_url = self.base_url.trim_end_matches('/').to_owned();
        ProviderClient {
            http,
            charges_url: format!("{base_url}/v1/charges"),
            base_url,
            timeout: self.timeout,
        }
    }
}

/// A client for `POST /v1/charges`. Cheap to clone (connections are pooled and shared).
#[derive(Debug, Clone)]
pub struct ProviderClient {
    http: reqwest::Client,
    base_url: String,
    charges_url: String,
    timeout: Duration,
}

impl ProviderClient {
    /// A client for the provider at `base_url` (e.g. `http://127.0.0.1:4242`), timeout 10 s.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self::builder(base_url).build()
    }

    /// A builder, to set the timeout.
    pub fn builder(base_url: impl Into<String>) -> ProviderClientBuilder {
        ProviderClientBuilder {
            base_url: base_url.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The request timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Charges `amount` (integer minor units) of `currency` to the card token `source`, under
    /// `idempotency_key`.
    ///
    /// # Errors
    ///
    /// Every way the call can fail to give a final answer; see [`ProviderError::is_retryable`].
    pub async fn charge(
        &self,
        idempotency_key: &str,
        amount: u64,
        currency: &str,
        source: &str,
    ) -> Result<ChargeResult, ProviderError> {
        let body = json!({"amount": amount, "currency": currency, "source": source});
        let (status, retry_after, body) =
            self.post(&self.charges_url, idempotency_key, &body).await?;
        classify(status, retry_after, &body)
    }
}

impl ProviderClient {
    /// Calls `operation` (`"refunds"`, `"payouts"`: the mock provider's `POST /v1/<operation>`)
    /// with `params` (a JSON object) under `idempotency_key`, and returns the provider's answer:
    /// the operation as executed (`id`, `object`, `status`, the parameters), the first time and on
    /// every replay.
    ///
    /// # Errors
    ///
    /// As [`ProviderClient::charge`]: every way the call can fail to give a final answer.
    pub async fn operate(
        &self,
        operation: &str,
        idempotency_key: &str,
        params: &serde_json::Value,
    ) -> Result<serde_json::Value, ProviderError> {
        let url = format!("{}/v1/{operation}", self.base_url);
        let (status, retry_after, body) = self.post(&url, idempotency_key, params).await?;
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|_| ProviderError::UnexpectedResponse {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body).into_owned(),
            });
        }
        match classify(status, retry_after, &body) {
            Err(error) => Err(error),
            Ok(_) => Err(ProviderError::UnexpectedResponse {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body).into_owned(),
            }),
        }
    }
}

impl ProviderClient {
    /// Posts `body` as JSON to `url` under `idempotency_key`: the answer's status, its
    /// `Retry-After` and its body, read whole.
    async fn post(
        &self,
        url: &str,
        idempotency_key: &str,
        body: &serde_json::Value,
    ) -> Result<(StatusCode, Option<Duration>, axum::body::Bytes), ProviderError> {
        let response = self
            .http
            .post(url)
            .header("Idempotency-Key", idempotency_key)
            .json(body)
            .send()
            .await
            .map_err(transport)?;
        let status = response.status();
        let retry_after = parse_retry_after(response.headers());
        // A connection that dies after the headers fails here, and is a network error too.
        let body = response.bytes().await.map_err(transport)?;
        Ok((status, retry_after, body))
    }
}

fn transport(error: reqwest::Error) -> ProviderError {
    if error.is_builder() {
        ProviderError::InvalidRequest(error)
    } else if error.is_timeout() {
        ProviderError::Timeout(error)
    } else {
        ProviderError::Network(error)
    }
}

fn parse_retry_after(headers: &HeaderMap) -> Option<Duration> {
    // Only delay-seconds; an HTTP-date is not something this provider sends.
    let seconds = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds))
}

#[derive(Deserialize)]
struct ChargeBody {
    id: String,
    status: String,
}

#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorBody,
}

#[derive(Deserialize)]
struct ErrorBody {
    #[serde(rename = "type")]
    kind: String,
    code: Option<String>,
    message: Option<String>,
}

fn classify(
    status: StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
) -> Result<ChargeResult, ProviderError> {
    let unexpected = || ProviderError::UnexpectedResponse {
        status: status.as_u16(),
        body: String::from_utf8_lossy(body).into_owned(),
    };
    if status.is_success() {
        return match serde_json::from_slice::<ChargeBody>(body) {
            Ok(charge) if charge.status == "succeeded" => Ok(ChargeResult::Succeeded {
                charge_id: charge.id,
            }),
            _ => Err(unexpected()),
        };
    }
    let error = serde_json::from_slice::<ErrorEnvelope>(body)
        .ok()
        .map(|e| e.error);
    let message = error
        .as_ref()
        .and_then(|e| e.message.clone())
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    match status.as_u16() {
        402 => match error {
            Some(ErrorBody {
                kind,
                code: Some(code),
                ..
            }) if kind == "card_error" => Ok(ChargeResult::Declined { code, message }),
            _ => Err(unexpected()),
        },
        409 => Err(ProviderError::InProgress {
            message,
            retry_after,
        }),
        429 => Err(ProviderError::RateLimited { retry_after }),
        500..=599 => Err(ProviderError::Server {
            status: status.as_u16(),
            message,
            retry_after,
        }),
        400..=499 => match error {
            Some(e) if status == StatusCode::BAD_REQUEST && e.kind == "idempotency_error" => {
                Err(ProviderError::IdempotencyMismatch { message })
            }
            Some(e) => Err(ProviderError::Rejected {
                status: status.as_u16(),
                kind: e.kind,
                code: e.code,
                message,
            }),
            None => Err(ProviderError::Rejected {
                status: status.as_u16(),
                kind: String::new(),
                code: None,
                message,
            }),
        },
        _ => Err(unexpected()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_what_a_caller_should_retry() {
        let err = |status: u16, body: &str| {
            classify(
                StatusCode::from_u16(status).expect("status"),
                None,
                body.as_bytes(),
            )
            .expect_err("an error")
        };
        let idem = r#"{"error":{"type":"idempotency_error","message":"m"}}"#;
        let busy = r#"{"error":{"type":"idempotency_error","code":"request_in_progress"}}"#;
        let bad = r#"{"error":{"type":"invalid_request_error","code":"parameter_invalid"}}"#;
        assert!(!err(400, idem).is_retryable());
        assert!(matches!(
            err(400, idem),
            ProviderError::IdempotencyMismatch { .. }
        ));
        assert!(err(409, busy).is_retryable());
        assert!(!err(400, bad).is_retryable());
        assert!(!err(404, "not json").is_retryable());
        assert!(err(503, "not json").is_retryable());
        assert!(err(429, "").is_retryable());
        assert!(!err(200, "{}").is_retryable());
    }

    #[test]
    fn reads_retry_after_in_seconds() {
        let mut headers = HeaderMap::new();
        assert_eq!(parse_retry_after(&headers), None);
        headers.insert(RETRY_AFTER, "7".parse().expect("header"));
        assert_eq!(parse_retry_after(&headers), Some(Duration::from_secs(7)));
        headers.insert(
            RETRY_AFTER,
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().expect("header"),
        );
        assert_eq!(parse_retry_after(&headers), None);
    }
}
