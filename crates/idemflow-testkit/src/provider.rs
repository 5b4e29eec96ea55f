//! A mock payment provider over real HTTP on 127.0.0.1, with Stripe's idempotency rules (simplified)
//! and faults a test scripts call by call.
//!
//! `POST /v1/charges`, with an `Idempotency-Key` header and a JSON body
//! `{"amount": 1000, "currency": "usd", "source": "tok_visa"}`, and any other operation a test
//! names, `POST /v1/<operation>` (refunds, payouts, transfers: [`operations`]) with any JSON
//! object, under the same idempotency rules and the same faults:
//!
//! - the first request with a key executes: the source `tok_chargeDeclined` (or `tok_declined`) gives
//!   402 `card_error`/`card_declined`, any other source a 200 charge `{"id": "ch_…", …}`;
//! - the response of an executed request (a decline included) is stored with the key; the same key
//!   with the same parameters gets the stored status and body back, byte for byte, plus
//!   `Idempotent-Replayed: true`;
//! - the same key with other parameters gets 400 `idempotency_error`;
//! - a key whose first request is still executing gets 409 `idempotency_error`/`request_in_progress`;
//! - a request rejected before execution (no key, a bad body) stores nothing;
//! - a stored key is forgotten once the key time-to-live has passed on the provider's clock, which
//!   only [`MockProvider::advance_clock`] moves.
//!
//! Faults ([`Fault`]) are queued with [`MockProvider::push_fault`] or
//! [`MockProvider::push_fault_for`] and consumed by upcoming calls in queue order. The ledger
//! ([`MockProvider::charges`], [`MockProvider::operations`], [`MockProvider::calls`],
//! [`MockProvider::calls_for`]) says what
//! really happened, whatever the client saw. See `docs/mock-provider.md` for what a caller sees for
//! each fault.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::connect_info::Connected;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::{IncomingStream, Listener};
use serde::Deserialize;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::provider_client::ProviderClient;

pub mod operations;

pub use operations::Operation;
use operations::OperationParams;

/// How long a stored key is remembered unless [`MockProviderBuilder::key_ttl`] says otherwise.
pub const DEFAULT_KEY_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// The request header carrying the idempotency key.
pub const IDEMPOTENCY_KEY_HEADER: &str = "Idempotency-Key";

/// The response header (value `true`) marking a replayed response.
pub const REPLAYED_HEADER: &str = "Idempotent-Replayed";

/// Card tokens that are declined (402 `card_declined`); every other source succeeds.
pub const DECLINED_SOURCES: &[&str] = &["tok_chargeDeclined", "tok_declined"];

/// The longest idempotency key accepted, in bytes (Stripe's limit).
pub const MAX_KEY_LEN: usize = 255;

/// How long [`MockProvider::shutdown`] waits for open connections before it stops waiting.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A fault applied to one upcoming call instead of (or on top of) its normal handling.
///
/// What the caller sees for each is described in `docs/mock-provider.md`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Answer this status (500–599) with an `api_error` body before anything else: the key is not
    /// looked at, nothing is executed or stored, and a retry executes normally.
    ServerError(u16),
    /// Answer 429 `rate_limit_error` with `Retry-After` (whole seconds, rounded up) before anything
    /// else: nothing is executed or stored.
    TooManyRequests {
        /// The wait announced in `Retry-After`.
        retry_after: Duration,
    },
    /// Handle the call normally but sleep this long before answering. A call that executes holds
    /// its key in flight during the sleep, so a concurrent call with that key gets 409. The charge
    /// is executed after the sleep even if the caller has given up by then.
    Delay(Duration),
    /// Never answer: hold the call until the caller gives up (or the provider shuts down). Nothing
    /// is executed or stored.
    Timeout,
    /// Reset the connection (TCP RST) without sending a byte of the response. Nothing is executed
    /// or stored.
    ConnectionReset,
    /// Handle the call normally (the charge is executed and its response stored with the key),
    /// then reset the connection instead of sending the response.
    ExecuteThenDrop,
}

/// What became of a charge in the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeOutcome {
    /// The charge succeeded (200).
    Succeeded,
    /// The card was declined (402) with this code (`card_declined`).
    Declined {
        /// The error code sent to the caller.
        code: String,
    },
}

/// One executed charge, as recorded in the provider's ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Charge {
    /// The charge id (`ch_…`); a declined charge has one too (the error body's `charge`).
    pub id: String,
    /// The idempotency key the charge was executed under.
    pub idempotency_key: String,
    /// The amount, in integer minor units.
    pub amount: u64,
    /// The currency, as sent.
    pub currency: String,
    /// The card token, as sent.
    pub source: String,
    /// Succeeded or declined.
    pub outcome: ChargeOutcome,
}

/// Configures a [`MockProvider`] before it starts.
#[derive(Debug, Clone)]
pub struct MockProviderBuilder {
    key_ttl: Duration,
    bind: SocketAddr,
}

impl Default for MockProviderBuilder {
    fn default() -> Self {
        Self {
            key_ttl: DEFAULT_KEY_TTL,
            bind: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
        }
    }
}

impl MockProviderBuilder {
    /// How long a stored key is remembered, on the provider's clock (default 24 h), counted from
    /// the key's first executed request.
    #[must_use]
    pub fn key_ttl(mut self, ttl: Duration) -> Self {
        self.key_ttl = ttl;
        self
    }

    /// The address to listen on (default `127.0.0.1:0`, a random free port).
    #[must_use]
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.bind = addr;
        self
    }

    /// Binds the address and serves on a new tokio task. Must be called within a tokio runtime.
    ///
    /// # Errors
    ///
    /// When the address cannot be bound.
    pub async fn start(self) -> io::Result<MockProvider> {
        let listener = TcpListener::bind(self.bind).await?;
        let addr = listener.local_addr()?;
        let (shutdown, _) = watch::channel(false);
        let shared = Arc::new(Shared {
            key_ttl: self.key_ttl,
            state: Mutex::new(Ledger::default()),
            shutdown,
        });
        let app = Router::new()
            .route("/v1/charges", post(create_charge))
            .route("/v1/{operation}", post(operations::create))
            .fallback(not_found)
            .with_state(Arc::clone(&shared));
        let signal = {
            let shared = Arc::clone(&shared);
            async move { shared.until_shutdown().await }
        };
        let server = axum::serve(
            KillableListener(listener),
            app.into_make_service_with_connect_info::<ConnectionHandle>(),
        )
        .with_graceful_shutdown(signal);
        let task = tokio::spawn(async move {
            // Accept errors are retried inside the listener; serving itself never fails.
            let _ = server.await;
        });
        Ok(MockProvider {
            url: format!("http://{addr}"),
            addr,
            shared,
            task: Some(task),
        })
    }
}

/// A running mock payment provider. Dropping it (or [`MockProvider::shutdown`]) stops it.
///
/// A fault scripted for one key, then that key forgotten once its time-to-live has passed on the
/// provider's clock:
///
/// ```
/// use std::time::Duration;
///
/// use idemflow_testkit::provider::{Fault, MockProvider};
/// use idemflow_testkit::provider_client::ProviderError;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let provider = MockProvider::builder().key_ttl(Duration::from_secs(3600)).start().await?;
/// let client = provider.client();
///
/// // The next call with this key gets a 503; calls with other keys pass the fault by.
/// provider.push_fault_for("order-7", Fault::ServerError(503));
/// let failed = client.charge("order-7", 500, "eur", "tok_visa").await.unwrap_err();
/// assert!(matches!(failed, ProviderError::Server { status: 503, .. }));
/// client.charge("order-7", 500, "eur", "tok_visa").await?; // nothing was executed: it charges
/// assert_eq!(provider.calls_for("order-7"), 2);
///
/// // An hour later on the provider's clock, the key is forgotten: the same key charges again.
/// provider.advance_clock(Duration::from_secs(3600));
/// client.charge("order-7", 500, "eur", "tok_visa").await?;
/// assert_eq!(provider.charges().len(), 2);
/// # Ok(())
/// # }
/// ```
pub struct MockProvider {
    url: String,
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<()>>,
}

impl fmt::Debug for MockProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MockProvider")
            .field("url", &self.url)
            .field("key_ttl", &self.shared.key_ttl)
            .finish_non_exhaustive()
    }
}

impl MockProvider {
    /// Starts a provider on `127.0.0.1` at a random port, with the default configuration. Must be
    /// called within a tokio runtime.
    ///
    /// # Panics
    ///
    /// When no loopback port can be bound; use [`MockProvider::builder`] to handle that error.
    pub async fn start() -> MockProvider {
        Self::builder()
            .start()
            .await
            .expect("the mock provider binds a random port on 127.0.0.1")
    }

    /// A builder, to set the key time-to-live or the address before starting.
    pub fn builder() -> MockProviderBuilder {
        MockProviderBuilder::default()
    }

    /// The base URL, `http://127.0.0.1:<port>` (no trailing slash).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The address the provider listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A [`ProviderClient`] for this provider, with the default timeout.
    pub fn client(&self) -> ProviderClient {
        ProviderClient::new(self.url.clone())
    }

    /// Queues a fault for the next call that no earlier queued fault applies to.
    ///
    /// # Panics
    ///
    /// When a [`Fault::ServerError`] status is not in 500–599.
    pub fn push_fault(&self, fault: Fault) {
        self.push(None, fault);
    }

    /// Queues a fault for the next call carrying this idempotency key; calls with other keys pass it
    /// by.
    ///
    /// # Panics
    ///
    /// When a [`Fault::ServerError`] status is not in 500–599.
    pub fn push_fault_for(&self, idempotency_key: impl Into<String>, fault: Fault) {
        self.push(Some(idempotency_key.into()), fault);
    }

    fn push(&self, key: Option<String>, fault: Fault) {
        if let Fault::ServerError(status) = fault {
            assert!(
                (500..=599).contains(&status),
                "Fault::ServerError takes a 5xx status, not {status}"
            );
        }
        self.shared.lock().faults.push_back(Scripted { key, fault });
    }

    /// How many queued faults no call has consumed yet.
    pub fn pending_faults(&self) -> usize {
        self.shared.lock().faults.len()
    }

    /// Whether a call with this key is executing right now (claimed, its response not yet stored):
    /// another call with the key would get 409.
    pub fn is_in_flight(&self, idempotency_key: &str) -> bool {
        matches!(
            self.shared.lock().keys.get(idempotency_key),
            Some(KeyEntry {
                state: KeyState::InFlight { .. },
                ..
            })
        )
    }

    /// Moves the provider's clock forward; stored keys older than the time-to-live are forgotten.
    pub fn advance_clock(&self, by: Duration) {
        let mut ledger = self.shared.lock();
        ledger.clock = ledger.clock.saturating_add(by);
    }

    /// Every charge executed, in order (replays add none; a declined card is a charge).
    pub fn charges(&self) -> Vec<Charge> {
        self.shared.lock().charges.clone()
    }

    /// The idempotency key of every call executed, charges and other operations alike, in order
    /// (replays add none): what "each derived key executed at most once" is checked against.
    pub fn executed_keys(&self) -> Vec<String> {
        self.shared.lock().executed.clone()
    }

    /// Every operation other than a charge executed, in order (replays add none).
    pub fn operations(&self) -> Vec<Operation> {
        self.shared.lock().operations.clone()
    }

    /// The executed operations named `operation` (`"refunds"`), in order.
    pub fn operations_of(&self, operation: &str) -> Vec<Operation> {
        let ledger = self.shared.lock();
        ledger
            .operations
            .iter()
            .filter(|executed| executed.operation == operation)
            .cloned()
            .collect()
    }

    /// How many calls reached the provider (any operation), faulted and rejected ones included.
    pub fn calls(&self) -> usize {
        self.shared.lock().calls
    }

    /// How many calls carried this idempotency key, faulted and rejected ones included.
    pub fn calls_for(&self, idempotency_key: &str) -> usize {
        self.shared
            .lock()
            .calls_by_key
            .get(idempotency_key)
            .copied()
            .unwrap_or(0)
    }

    /// Forgets every key, charge, call count and queued fault, and sets the clock back to zero.
    /// Charge ids keep counting, so an id is never given twice by one provider.
    pub fn reset(&self) {
        let mut ledger = self.shared.lock();
        let next_charge = ledger.next_charge;
        let next_claim = ledger.next_claim;
        let next_operation = ledger.next_operation;
        *ledger = Ledger {
            next_charge,
            next_claim,
            next_operation,
            ..Ledger::default()
        };
    }

    /// Stops accepting connections, ends held and delayed calls (their connections are reset,
    /// nothing more is executed), and waits (at most 5 s) for open connections to close.
    pub async fn shutdown(mut self) {
        self.shared.signal_shutdown();
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
        {
            task.abort();
        }
    }
}

impl Drop for MockProvider {
    fn drop(&mut self) {
        // The server task finishes by itself once signalled; no runtime is needed here.
        self.shared.signal_shutdown();
    }
}

// ---------------------------------------------------------------------------------------------
// State

struct Shared {
    key_ttl: Duration,
    state: Mutex<Ledger>,
    shutdown: watch::Sender<bool>,
}

#[derive(Default)]
struct Ledger {
    clock: Duration,
    keys: HashMap<String, KeyEntry>,
    faults: VecDeque<Scripted>,
    charges: Vec<Charge>,
    operations: Vec<Operation>,
    /// The idempotency key of every executed call, charges and operations, in order.
    executed: Vec<String>,
    calls: usize,
    calls_by_key: HashMap<String, usize>,
    next_charge: u64,
    next_claim: u64,
    next_operation: u64,
}

struct Scripted {
    key: Option<String>,
    fault: Fault,
}

struct KeyEntry {
    params: Params,
    created_at: Duration,
    state: KeyState,
}

enum KeyState {
    InFlight { claim: u64 },
    Done(Stored),
}

#[derive(Clone)]
struct Stored {
    status: StatusCode,
    body: Bytes,
}

/// What a key was first used with: a key used for a charge and then for a refund is a mismatch.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Params {
    Charge(ChargeParams),
    Operation(OperationParams),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct ChargeParams {
    amount: u64,
    currency: String,
    source: String,
}

enum Decision {
    Execute { claim: u64 },
    Replay(Stored),
    InProgress,
    Mismatch,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // Nothing panics while holding the lock; recover the state if something ever does.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn signal_shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    async fn until_shutdown(&self) {
        let mut rx = self.shutdown.subscribe();
        // An error means the sender is gone, which is a shutdown too.
        let _ = rx.wait_for(|stopped| *stopped).await;
    }

    /// Sleeps, unless the provider shuts down first: then returns false.
    async fn sleep(&self, delay: Option<Duration>) -> bool {
        let Some(delay) = delay else { return true };
        tokio::select! {
            () = tokio::time::sleep(delay) => true,
            () = self.until_shutdown() => false,
        }
    }

    /// Counts the call and takes the first queued fault that applies to it.
    fn begin_call(&self, key: Option<&str>) -> Option<Fault> {
        let mut ledger = self.lock();
        ledger.calls += 1;
        if let Some(key) = key {
            *ledger.calls_by_key.entry(key.to_owned()).or_default() += 1;
        }
        let index = ledger
            .faults
            .iter()
            .position(|s| s.key.is_none() || s.key.as_deref() == key)?;
        ledger.faults.remove(index).map(|s| s.fault)
    }

    fn decide(&self, key: &str, params: &Params) -> Decision {
        let mut ledger = self.lock();
        let now = ledger.clock;
        if let Some(entry) = ledger.keys.get(key) {
            match &entry.state {
                KeyState::InFlight { .. } => return Decision::InProgress,
                KeyState::Done(stored) => {
                    let expired = now.saturating_sub(entry.created_at) >= self.key_ttl;
                    if !expired {
                        return if entry.params == *params {
                            Decision::Replay(stored.clone())
                        } else {
                            Decision::Mismatch
                        };
                    }
                }
            }
        }
        ledger.next_claim += 1;
        let claim = ledger.next_claim;
        ledger.keys.insert(
            key.to_owned(),
            KeyEntry {
                params: params.clone(),
                created_at: now,
                state: KeyState::InFlight { claim },
            },
        );
        Decision::Execute { claim }
    }

    /// Forgets a claim that will not execute (the provider is shutting down).
    fn release(&self, key: &str, claim: u64) {
        let mut ledger = self.lock();
        if matches!(ledger.keys.get(key), Some(KeyEntry { state: KeyState::InFlight { claim: c }, .. }) if *c == claim)
        {
            ledger.keys.remove(key);
        }
    }

    fn execute(&self, key: &str, claim: u64, params: Params) -> Stored {
        match params {
            Params::Charge(params) => self.charge(key, claim, params),
            Params::Operation(params) => self.operate(key, claim, params),
        }
    }

    /// Stores an executed call's answer with its key, unless the claim is gone (a reset).
    fn store(ledger: &mut Ledger, key: &str, claim: u64, stored: &Stored) {
        if let Some(entry) = ledger.keys.get_mut(key)
            && matches!(entry.state, KeyState::InFlight { claim: c } if c == claim)
        {
            entry.state = KeyState::Done(stored.clone());
        }
    }

    fn charge(&self, key: &str, claim: u64, params: ChargeParams) -> Stored {
        let mut ledger = self.lock();
        ledger.next_charge += 1;
        let id = format!("ch_mock{:06}", ledger.next_charge);
        let (status, body, outcome) = if DECLINED_SOURCES.contains(&params.source.as_str()) {
            let body = json!({"error": {
                "type": "card_error",
                "code": "card_declined",
                "decline_code": "generic_decline",
                "message": "Your card was declined.",
                "charge": id,
            }});
            let outcome = ChargeOutcome::Declined {
                code: "card_declined".to_owned(),
            };
            (StatusCode::PAYMENT_REQUIRED, body, outcome)
        } else {
            let body = json!({
                "id": id,
                "object": "charge",
                "amount": params.amount,
                "currency": params.currency,
                "source": params.source,
                "status": "succeeded",
            });
            (StatusCode::OK, body, ChargeOutcome::Succeeded)
        };
        let stored = Stored {
            status,
            body: json_bytes(&body),
        };
        ledger.charges.push(Charge {
            id,
            idempotency_key: key.to_owned(),
            amount: params.amount,
            currency: params.currency,
            source: params.source,
            outcome,
        });
        ledger.executed.push(key.to_owned());
        // After a reset() the claim is gone: the charge stays in the ledger but no key remembers it.
        Self::store(&mut ledger, key, claim, &stored);
        stored
    }
}

// ---------------------------------------------------------------------------------------------
// HTTP

async fn create_charge(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(connection): ConnectInfo<ConnectionHandle>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve_call(shared, connection, &headers, |key| {
        validate(key, &body).map(|(key, params)| (key, Params::Charge(params)))
    })
    .await
}

/// One call of any operation: counted, its fault (if one is queued for it) applied, then
/// `validate`d and decided under the provider's idempotency rules.
async fn serve_call(
    shared: Arc<Shared>,
    connection: ConnectionHandle,
    headers: &HeaderMap,
    validate: impl FnOnce(Option<String>) -> Result<(String, Params), Invalid>,
) -> Response {
    let key = headers
        .get(IDEMPOTENCY_KEY_HEADER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let fault = shared.begin_call(key.as_deref());
    let delay = match fault {
        Some(Fault::ServerError(status)) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return error_response(
                status,
                "api_error",
                None,
                "Scripted server error; nothing was executed.",
            );
        }
        Some(Fault::TooManyRequests { retry_after }) => {
            let mut response = error_response(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("rate_limit"),
                "Too many requests; nothing was executed.",
            );
            let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
            return response;
        }
        Some(Fault::Timeout) => {
            // Until the caller gives up (hyper then drops this future) or the provider stops.
            shared.until_shutdown().await;
            connection.kill();
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        Some(Fault::ConnectionReset) => {
            connection.kill();
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        Some(Fault::Delay(delay)) => Some(delay),
        Some(Fault::ExecuteThenDrop) | None => None,
    };
    let response = handle(shared, validate(key), delay).await;
    if matches!(fault, Some(Fault::ExecuteThenDrop)) {
        connection.kill();
    }
    response
}

async fn handle(
    shared: Arc<Shared>,
    validated: Result<(String, Params), Invalid>,
    delay: Option<Duration>,
) -> Response {
    let (key, params) = match validated {
        Ok(valid) => valid,
        Err(Invalid(code, message)) => {
            shared.sleep(delay).await;
            return error_response(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some(code),
                &message,
            );
        }
    };
    match shared.decide(&key, &params) {
        Decision::Execute { claim } => {
            // Executed on its own task, so a caller that gives up during a delay does not leave
            // the key in flight forever: the charge happens anyway, as it would at a real provider.
            let task = tokio::spawn(async move {
                if !shared.sleep(delay).await {
                    shared.release(&key, claim);
                    return None;
                }
                Some(shared.execute(&key, claim, params))
            });
            match task.await {
                Ok(Some(stored)) => stored_response(stored, false),
                Ok(None) => error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "api_error",
                    None,
                    "The provider is shutting down; nothing was executed.",
                ),
                Err(_) => error_response(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "api_error",
                    None,
                    "The mock provider failed while executing.",
                ),
            }
        }
        Decision::Replay(stored) => {
            shared.sleep(delay).await;
            stored_response(stored, true)
        }
        Decision::InProgress => {
            shared.sleep(delay).await;
            error_response(
                StatusCode::CONFLICT,
                "idempotency_error",
                Some("request_in_progress"),
                "Another request with this idempotency key is in progress; retry later.",
            )
        }
        Decision::Mismatch => {
            shared.sleep(delay).await;
            error_response(
                StatusCode::BAD_REQUEST,
                "idempotency_error",
                None,
                "Keys for idempotent requests can only be used with the same parameters they were \
                 first used with.",
            )
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChargeBody {
    amount: u64,
    currency: String,
    source: String,
}

/// Why a request is refused before execution: 400 `invalid_request_error` with this code and message.
struct Invalid(&'static str, String);

fn validate(key: Option<String>, body: &[u8]) -> Result<(String, ChargeParams), Invalid> {
    let key = validate_key(key)?;
    let body: ChargeBody = serde_json::from_slice(body).map_err(|e| {
        Invalid(
            "parameter_invalid",
            format!(
                "Expected {{\"amount\": <positive integer>, \"currency\": \"usd\", \"source\": \
                 \"<token>\"}}: {e}"
            ),
        )
    })?;
    if body.amount == 0 {
        return Err(Invalid(
            "parameter_invalid",
            "amount must be a positive integer (minor units).".to_owned(),
        ));
    }
    if body.currency.len() != 3 || !body.currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(Invalid(
            "parameter_invalid",
            "currency must be a three-letter ISO code.".to_owned(),
        ));
    }
    if body.source.is_empty() {
        return Err(Invalid(
            "parameter_invalid",
            "source must not be empty.".to_owned(),
        ));
    }
    Ok((
        key,
        ChargeParams {
            amount: body.amount,
            currency: body.currency,
            source: body.source,
        },
    ))
}

/// The idempotency key every call needs: present, 1 to [`MAX_KEY_LEN`] bytes.
fn validate_key(key: Option<String>) -> Result<String, Invalid> {
    let Some(key) = key else {
        return Err(Invalid(
            "missing_idempotency_key",
            format!("The {IDEMPOTENCY_KEY_HEADER} header is required."),
        ));
    };
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(Invalid(
            "invalid_idempotency_key",
            format!("The {IDEMPOTENCY_KEY_HEADER} header must hold 1 to {MAX_KEY_LEN} bytes."),
        ));
    }
    Ok(key)
}

async fn not_found() -> Response {
    error_response(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("resource_missing"),
        "Unrecognized request URL; the mock provider serves POST /v1/charges and POST \
         /v1/<operation>.",
    )
}

fn stored_response(stored: Stored, replayed: bool) -> Response {
    let mut response = (
        stored.status,
        [(header::CONTENT_TYPE, "application/json")],
        stored.body,
    )
        .into_response();
    if replayed {
        response
            .headers_mut()
            .insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    }
    response
}

fn error_response(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let mut error = json!({"type": kind, "message": message});
    if let Some(code) = code {
        error["code"] = json!(code);
    }
    stored_response(
        Stored {
            status,
            body: json_bytes(&json!({ "error": error })),
        },
        false,
    )
}

fn json_bytes(value: &serde_json::Value) -> Bytes {
    Bytes::from(serde_json::to_vec(value).expect("a JSON value serializes"))
}

// ---------------------------------------------------------------------------------------------
// Connections that a handler can reset

/// Shared between a connection's stream and the requests served on it: once killed, the stream
/// fails every read and write and is closed with a TCP RST.
#[derive(Clone, Default)]
struct ConnectionHandle(Arc<AtomicBool>);

impl ConnectionHandle {
    fn kill(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    fn is_killed(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

impl Connected<IncomingStream<'_, KillableListener>> for ConnectionHandle {
    fn connect_info(stream: IncomingStream<'_, KillableListener>) -> Self {
        stream.io().handle.clone()
    }
}

struct KillableListener(TcpListener);

impl Listener for KillableListener {
    type Io = KillableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((stream, addr)) => {
                    let _ = stream.set_nodelay(true);
                    let stream = KillableStream {
                        inner: stream,
                        handle: ConnectionHandle::default(),
                    };
                    return (stream, addr);
                }
                // Out of file descriptors and the like: wait a little rather than spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

struct KillableStream {
    inner: TcpStream,
    handle: ConnectionHandle,
}

impl KillableStream {
    /// Fails the stream: hyper then drops it, and the zero linger turns the close into a RST.
    fn check(&self) -> io::Result<()> {
        if self.handle.is_killed() {
            let _ = self.inner.set_zero_linger();
            Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "scripted connection reset",
            ))
        } else {
            Ok(())
        }
    }
}

impl AsyncRead for KillableStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check()?;
        Pin::new(&mut this.inner).poll_shutdown(cx)
    }
}
