//! The mock provider over real HTTP on 127.0.0.1: idempotency rules, every fault, the clock, the
//! ledger and the standalone binary.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idemflow_testkit::provider::{ChargeOutcome, Fault, MockProvider};
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient, ProviderError};
use serde_json::Value;

/// Every test finishes well inside this, or fails.
const BOUND: Duration = Duration::from_secs(30);

async fn bounded<F: Future>(test: F) -> F::Output {
    tokio::time::timeout(BOUND, test)
        .await
        .expect("the test finished in time")
}

fn raw_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

struct Raw {
    status: u16,
    replayed: Option<String>,
    content_type: Option<String>,
    body: Vec<u8>,
}

impl Raw {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

async fn raw_post(provider: &MockProvider, key: Option<&str>, body: &str) -> Raw {
    let mut request = raw_client()
        .post(format!("{}/v1/charges", provider.url()))
        .header("content-type", "application/json")
        .body(body.to_owned());
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    let response = request.send().await.unwrap();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    Raw {
        status: response.status().as_u16(),
        replayed: header("idempotent-replayed"),
        content_type: header("content-type"),
        body: response.bytes().await.unwrap().to_vec(),
    }
}

fn succeeded(result: Result<ChargeResult, ProviderError>) -> String {
    match result {
        Ok(ChargeResult::Succeeded { charge_id }) => charge_id,
        other => panic!("expected a successful charge, got {other:?}"),
    }
}

const VISA: &str = r#"{"amount": 1000, "currency": "usd", "source": "tok_visa"}"#;

#[tokio::test]
async fn a_first_charge_executes_and_its_retry_replays_byte_for_byte() {
    bounded(async {
        let provider = MockProvider::start().await;
        let first = raw_post(&provider, Some("k1"), VISA).await;
        assert_eq!(first.status, 200);
        assert_eq!(first.replayed, None);
        assert_eq!(first.content_type.as_deref(), Some("application/json"));
        let charge = first.json();
        assert_eq!(charge["status"], "succeeded");
        assert_eq!(charge["amount"], 1000);
        assert_eq!(charge["currency"], "usd");
        assert_eq!(charge["source"], "tok_visa");
        assert!(charge["id"].as_str().unwrap().starts_with("ch_"));

        // Same parameters in another spelling: still the same request, replayed.
        let again = r#"{"source":"tok_visa","currency":"usd","amount":1000}"#;
        let replay = raw_post(&provider, Some("k1"), again).await;
        assert_eq!(replay.status, 200);
        assert_eq!(replay.replayed.as_deref(), Some("true"));
        assert_eq!(replay.body, first.body, "byte for byte");

        let by_client = provider
            .client()
            .charge("k1", 1000, "usd", "tok_visa")
            .await;
        assert_eq!(succeeded(by_client), charge["id"]);

        let charges = provider.charges();
        assert_eq!(charges.len(), 1);
        assert_eq!(charges[0].id, charge["id"]);
        assert_eq!(charges[0].idempotency_key, "k1");
        assert_eq!(charges[0].amount, 1000);
        assert_eq!(charges[0].currency, "usd");
        assert_eq!(charges[0].source, "tok_visa");
        assert_eq!(charges[0].outcome, ChargeOutcome::Succeeded);
        assert_eq!(provider.calls_for("k1"), 3);
    })
    .await;
}

#[tokio::test]
async fn the_same_key_with_other_parameters_is_an_idempotency_error() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        let id = succeeded(client.charge("k", 1000, "usd", "tok_visa").await);

        for (amount, currency, source) in [
            (2000, "usd", "tok_visa"),
            (1000, "eur", "tok_visa"),
            (1000, "usd", "tok_mastercard"),
        ] {
            let err = client
                .charge("k", amount, currency, source)
                .await
                .unwrap_err();
            assert!(
                matches!(err, ProviderError::IdempotencyMismatch { .. }),
                "{err:?}"
            );
            assert!(!err.is_retryable());
            assert_eq!(err.retry_after(), None);
        }
        let raw = raw_post(
            &provider,
            Some("k"),
            r#"{"amount": 1, "currency": "usd", "source": "tok_visa"}"#,
        )
        .await;
        assert_eq!(raw.status, 400);
        assert_eq!(raw.json()["error"]["type"], "idempotency_error");
        assert_eq!(raw.replayed, None);

        // The stored response is untouched.
        assert_eq!(
            succeeded(client.charge("k", 1000, "usd", "tok_visa").await),
            id
        );
        assert_eq!(provider.charges().len(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_concurrent_call_with_a_key_in_flight_gets_409() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        provider.push_fault(Fault::Delay(Duration::from_millis(1500)));

        let slow = {
            let client = client.clone();
            tokio::spawn(async move { client.charge("k", 1000, "usd", "tok_visa").await })
        };
        while !provider.is_in_flight("k") {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }

        let err = client
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::InProgress { .. }), "{err:?}");
        assert!(err.is_retryable());
        let raw = raw_post(&provider, Some("k"), VISA).await;
        assert_eq!(raw.status, 409);
        assert_eq!(raw.json()["error"]["type"], "idempotency_error");
        assert_eq!(raw.json()["error"]["code"], "request_in_progress");
        assert!(provider.charges().is_empty(), "still sleeping");

        // Another key is not held up.
        succeeded(client.charge("other", 1000, "usd", "tok_visa").await);

        let id = succeeded(slow.await.unwrap());
        assert!(!provider.is_in_flight("k"));
        assert_eq!(
            succeeded(client.charge("k", 1000, "usd", "tok_visa").await),
            id
        );
        assert_eq!(
            provider
                .charges()
                .iter()
                .filter(|c| c.idempotency_key == "k")
                .count(),
            1
        );
        assert_eq!(provider.calls_for("k"), 4);
    })
    .await;
}

#[tokio::test]
async fn a_delayed_charge_executes_even_when_the_caller_gave_up() {
    bounded(async {
        let provider = MockProvider::start().await;
        let impatient = ProviderClient::builder(provider.url())
            .timeout(Duration::from_millis(200))
            .build();
        provider.push_fault(Fault::Delay(Duration::from_millis(600)));

        let err = impatient
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Timeout(_)), "{err:?}");
        assert!(err.is_retryable());
        // Retrying too early finds the key in flight.
        let err = impatient
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::InProgress { .. }), "{err:?}");

        while provider.is_in_flight("k") {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let charges = provider.charges();
        assert_eq!(charges.len(), 1, "executed after the sleep, caller or not");
        let id = succeeded(impatient.charge("k", 1000, "usd", "tok_visa").await);
        assert_eq!(id, charges[0].id);
        assert_eq!(provider.charges().len(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_decline_is_stored_and_replayed() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        for (key, source) in [("d1", "tok_chargeDeclined"), ("d2", "tok_declined")] {
            let first = client.charge(key, 500, "usd", source).await.unwrap();
            let ChargeResult::Declined { code, message } = &first else {
                panic!("expected a decline, got {first:?}");
            };
            assert_eq!(code, "card_declined");
            assert!(!message.is_empty());
            assert_eq!(client.charge(key, 500, "usd", source).await.unwrap(), first);
        }

        let body = r#"{"amount": 500, "currency": "usd", "source": "tok_chargeDeclined"}"#;
        let first = raw_post(&provider, Some("d3"), body).await;
        let replay = raw_post(&provider, Some("d3"), body).await;
        assert_eq!(first.status, 402);
        assert_eq!(first.json()["error"]["type"], "card_error");
        assert_eq!(first.json()["error"]["code"], "card_declined");
        assert_eq!(first.replayed, None);
        assert_eq!(replay.status, 402);
        assert_eq!(replay.replayed.as_deref(), Some("true"));
        assert_eq!(replay.body, first.body);

        let charges = provider.charges();
        assert_eq!(charges.len(), 3, "one charge per key, declined included");
        for charge in &charges {
            assert_eq!(
                charge.outcome,
                ChargeOutcome::Declined {
                    code: "card_declined".into()
                }
            );
        }
        assert_eq!(first.json()["error"]["charge"], charges[2].id);
    })
    .await;
}

#[tokio::test]
async fn a_server_error_stores_nothing_and_the_retry_executes_once() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        provider.push_fault(Fault::ServerError(503));

        let err = client
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProviderError::Server { status: 503, .. }),
            "{err:?}"
        );
        assert!(err.is_retryable());
        assert!(provider.charges().is_empty());
        assert_eq!(provider.pending_faults(), 0);

        let id = succeeded(client.charge("k", 1000, "usd", "tok_visa").await);
        assert_eq!(
            succeeded(client.charge("k", 1000, "usd", "tok_visa").await),
            id
        );
        assert_eq!(provider.charges().len(), 1);
        assert_eq!(provider.calls_for("k"), 3);

        // A 5xx is not stored even for another body: the key was never claimed.
        provider.push_fault(Fault::ServerError(500));
        assert!(client.charge("k2", 1, "usd", "tok_visa").await.is_err());
        succeeded(client.charge("k2", 2, "usd", "tok_visa").await);
    })
    .await;
}

#[tokio::test]
async fn too_many_requests_carries_retry_after_and_stores_nothing() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        provider.push_fault(Fault::TooManyRequests {
            retry_after: Duration::from_secs(2),
        });
        provider.push_fault(Fault::TooManyRequests {
            retry_after: Duration::from_millis(1500),
        });

        let err = client
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::RateLimited { .. }), "{err:?}");
        assert!(err.is_retryable());
        assert_eq!(err.retry_after(), Some(Duration::from_secs(2)));

        let err = client
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert_eq!(
            err.retry_after(),
            Some(Duration::from_secs(2)),
            "rounded up to whole seconds"
        );
        assert!(provider.charges().is_empty());

        succeeded(client.charge("k", 1000, "usd", "tok_visa").await);
        assert_eq!(provider.charges().len(), 1);
        assert_eq!(provider.calls_for("k"), 3);
    })
    .await;
}

#[tokio::test]
async fn a_timeout_is_retryable_and_charges_nothing() {
    bounded(async {
        let provider = MockProvider::start().await;
        let impatient = ProviderClient::builder(provider.url())
            .timeout(Duration::from_millis(300))
            .build();
        provider.push_fault(Fault::Timeout);

        let started = Instant::now();
        let err = impatient
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Timeout(_)), "{err:?}");
        assert!(err.is_retryable());
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(provider.charges().is_empty());
        assert!(!provider.is_in_flight("k"), "a held call claims nothing");

        // The retry executes (the key was never claimed), once.
        let id = succeeded(impatient.charge("k", 1000, "usd", "tok_visa").await);
        assert_eq!(
            succeeded(provider.client().charge("k", 1000, "usd", "tok_visa").await),
            id
        );
        assert_eq!(provider.charges().len(), 1);
        assert_eq!(provider.calls_for("k"), 3);
    })
    .await;
}

#[tokio::test]
async fn a_connection_reset_is_retryable_and_charges_nothing() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        // A pooled connection from an earlier call is the one reset.
        succeeded(client.charge("warm", 1, "usd", "tok_visa").await);
        provider.push_fault(Fault::ConnectionReset);

        let err = client
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Network(_)), "{err:?}");
        assert!(err.is_retryable());
        assert_eq!(
            provider.calls_for("k"),
            1,
            "the client did not resend on its own"
        );
        assert_eq!(provider.charges().len(), 1, "only the warm-up charge");

        let id = succeeded(client.charge("k", 1000, "usd", "tok_visa").await);
        let charges = provider.charges();
        assert_eq!(charges.len(), 2);
        assert_eq!(charges[1].id, id);

        // On a fresh connection too.
        provider.push_fault(Fault::ConnectionReset);
        let err = provider
            .client()
            .charge("k3", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Network(_)), "{err:?}");
        assert_eq!(provider.charges().len(), 2);
    })
    .await;
}

#[tokio::test]
async fn execute_then_drop_charges_once_and_the_retry_gets_that_charge() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        provider.push_fault(Fault::ExecuteThenDrop);

        let err = client
            .charge("k", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::Network(_)), "{err:?}");
        assert!(err.is_retryable());
        let charges = provider.charges();
        assert_eq!(charges.len(), 1, "the charge happened");

        let id = succeeded(client.charge("k", 1000, "usd", "tok_visa").await);
        assert_eq!(id, charges[0].id);
        let raw = raw_post(&provider, Some("k"), VISA).await;
        assert_eq!(raw.replayed.as_deref(), Some("true"));
        assert_eq!(raw.json()["id"], id);
        assert_eq!(provider.charges().len(), 1);
        assert_eq!(provider.calls_for("k"), 3);
    })
    .await;
}

#[tokio::test]
async fn a_key_is_forgotten_after_its_time_to_live() {
    bounded(async {
        let provider = MockProvider::builder()
            .key_ttl(Duration::from_secs(3600))
            .start()
            .await
            .unwrap();
        let client = provider.client();
        let first = succeeded(client.charge("k", 1000, "usd", "tok_visa").await);

        provider.advance_clock(Duration::from_secs(3599));
        assert_eq!(
            succeeded(client.charge("k", 1000, "usd", "tok_visa").await),
            first
        );
        // Not even a mismatch is remembered once expired: other parameters execute too.
        provider.advance_clock(Duration::from_secs(1));
        let second = succeeded(client.charge("k", 2000, "usd", "tok_visa").await);
        assert_ne!(second, first);
        assert_eq!(
            succeeded(client.charge("k", 2000, "usd", "tok_visa").await),
            second
        );

        let charges = provider.charges();
        assert_eq!(charges.len(), 2);
        assert_eq!(charges[1].amount, 2000);

        // The default is 24 hours.
        let default = MockProvider::start().await;
        let client = default.client();
        let id = succeeded(client.charge("k", 1, "usd", "tok_visa").await);
        default.advance_clock(Duration::from_secs(24 * 3600 - 1));
        assert_eq!(
            succeeded(client.charge("k", 1, "usd", "tok_visa").await),
            id
        );
        default.advance_clock(Duration::from_secs(1));
        assert_ne!(
            succeeded(client.charge("k", 1, "usd", "tok_visa").await),
            id
        );
    })
    .await;
}

#[tokio::test]
async fn calls_are_counted_per_key_and_faults_can_target_a_key() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        provider.push_fault_for("b", Fault::ServerError(500));
        provider.push_fault(Fault::ServerError(502));

        // "a" passes the fault meant for "b" and takes the next one.
        let err = client.charge("a", 1, "usd", "tok_visa").await.unwrap_err();
        assert!(
            matches!(err, ProviderError::Server { status: 502, .. }),
            "{err:?}"
        );
        succeeded(client.charge("a", 1, "usd", "tok_visa").await);
        let err = client.charge("b", 1, "usd", "tok_visa").await.unwrap_err();
        assert!(
            matches!(err, ProviderError::Server { status: 500, .. }),
            "{err:?}"
        );
        assert_eq!(provider.pending_faults(), 0);
        succeeded(client.charge("b", 1, "usd", "tok_visa").await);
        succeeded(client.charge("b", 1, "usd", "tok_visa").await);
        let _ = raw_post(&provider, None, VISA).await;

        assert_eq!(provider.calls_for("a"), 2);
        assert_eq!(provider.calls_for("b"), 3);
        assert_eq!(provider.calls_for("c"), 0);
        assert_eq!(provider.calls(), 6, "the call without a key counts too");
        assert_eq!(provider.charges().len(), 2);

        provider.push_fault(Fault::Timeout);
        provider.advance_clock(Duration::from_secs(1));
        provider.reset();
        assert_eq!(provider.calls(), 0);
        assert_eq!(provider.calls_for("b"), 0);
        assert!(provider.charges().is_empty());
        assert_eq!(provider.pending_faults(), 0);
        // The key is forgotten, and charge ids are not given twice.
        let old = succeeded(client.charge("b", 1, "usd", "tok_visa").await);
        assert_eq!(provider.charges().len(), 1);
        assert_eq!(provider.charges()[0].id, old);
        assert_eq!(provider.calls(), 1);
    })
    .await;
}

#[tokio::test]
async fn a_bad_request_is_400_json_and_stores_nothing() {
    bounded(async {
        let provider = MockProvider::start().await;
        let missing = raw_post(&provider, None, VISA).await;
        assert_eq!(missing.status, 400);
        assert_eq!(missing.json()["error"]["type"], "invalid_request_error");
        assert_eq!(missing.json()["error"]["code"], "missing_idempotency_key");

        for body in [
            "not json",
            r#"{"amount": 10.5, "currency": "usd", "source": "tok_visa"}"#,
            r#"{"amount": -1, "currency": "usd", "source": "tok_visa"}"#,
            r#"{"amount": 0, "currency": "usd", "source": "tok_visa"}"#,
            r#"{"currency": "usd", "source": "tok_visa"}"#,
            r#"{"amount": 1, "currency": "dollars", "source": "tok_visa"}"#,
            r#"{"amount": 1, "currency": "usd", "source": ""}"#,
            r#"{"amount": 1, "currency": "usd", "source": "tok_visa", "extra": true}"#,
        ] {
            let raw = raw_post(&provider, Some("k"), body).await;
            assert_eq!(raw.status, 400, "{body}");
            assert_eq!(
                raw.json()["error"]["type"],
                "invalid_request_error",
                "{body}"
            );
        }
        let long_key = "x".repeat(256);
        assert_eq!(raw_post(&provider, Some(&long_key), VISA).await.status, 400);

        let err = provider
            .client()
            .charge("", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(
            matches!(err, ProviderError::Rejected { status: 400, .. }),
            "{err:?}"
        );
        assert!(!err.is_retryable());
        let err = provider
            .client()
            .charge("k\n", 1000, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(err, ProviderError::InvalidRequest(_)), "{err:?}");
        assert!(!err.is_retryable());

        // Nothing was stored under "k": a good body executes.
        assert_eq!(raw_post(&provider, Some("k"), VISA).await.status, 200);
        assert_eq!(provider.charges().len(), 1);

        // Every operation is POST /v1/<operation>: another method there is 405, another path 404.
        let other = raw_client()
            .get(format!("{}/v1/refunds", provider.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(other.status(), 405);
        let other = raw_client()
            .post(format!("{}/v2/refunds", provider.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(other.status(), 404);
    })
    .await;
}

#[tokio::test]
async fn shutdown_ends_held_calls_and_stops_serving() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        provider.push_fault(Fault::Timeout);
        provider.push_fault(Fault::Delay(Duration::from_secs(60)));
        let held = {
            let client = client.clone();
            tokio::spawn(async move { client.charge("held", 1, "usd", "tok_visa").await })
        };
        let delayed = {
            let client = client.clone();
            tokio::spawn(async move { client.charge("delayed", 1, "usd", "tok_visa").await })
        };
        while provider.calls() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ledger = provider.charges();
        let started = Instant::now();
        provider.shutdown().await;
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "shutdown is prompt"
        );

        let held = held.await.unwrap().unwrap_err();
        assert!(held.is_retryable(), "{held:?}");
        let delayed = delayed.await.unwrap().unwrap_err();
        assert!(delayed.is_retryable(), "{delayed:?}");
        assert!(ledger.is_empty());

        let refused = client
            .charge("after", 1, "usd", "tok_visa")
            .await
            .unwrap_err();
        assert!(matches!(refused, ProviderError::Network(_)), "{refused:?}");
    })
    .await;
}

#[tokio::test]
async fn dropping_the_provider_stops_it() {
    bounded(async {
        let provider = MockProvider::start().await;
        let client = provider.client();
        succeeded(client.charge("k", 1, "usd", "tok_visa").await);
        drop(provider);
        loop {
            match client.charge("k2", 1, "usd", "tok_visa").await {
                Err(ProviderError::Network(_)) => break,
                // The listener closes on the server's task, a moment after the drop.
                _ => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    })
    .await;
}

/// Kills the child when dropped, so a failing assertion leaves no process behind.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn the_standalone_binary_prints_its_url_and_serves_charges() {
    bounded(async {
        let child = Command::new(env!("CARGO_BIN_EXE_idemflow-mock-psp"))
            .args(["--bind", "127.0.0.1:0", "--key-ttl", "60"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut child = Killed(child);
        let stdout = child.0.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let url = tokio::task::spawn_blocking(move || rx.recv_timeout(Duration::from_secs(20)))
            .await
            .unwrap()
            .expect("the binary printed its URL");
        let url = url.trim();
        assert!(url.starts_with("http://127.0.0.1:"), "{url:?}");

        let client = ProviderClient::new(url);
        let id = succeeded(client.charge("k", 1000, "usd", "tok_visa").await);
        assert_eq!(
            succeeded(client.charge("k", 1000, "usd", "tok_visa").await),
            id
        );
        let declined = client
            .charge("d", 1000, "usd", "tok_chargeDeclined")
            .await
            .unwrap();
        assert!(matches!(declined, ChargeResult::Declined { .. }));

        assert!(child.0.try_wait().unwrap().is_none(), "still serving");
    })
    .await;
}

#[test]
fn the_standalone_binary_refuses_unknown_arguments() {
    let output = Command::new(env!("CARGO_BIN_EXE_idemflow-mock-psp"))
        .arg("--port")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("usage"));

    let help = Command::new(env!("CARGO_BIN_EXE_idemflow-mock-psp"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    assert!(String::from_utf8_lossy(&help.stdout).contains("--bind"));
}
