//! The demo: drives a running checkout service over HTTP the ways a client would, one intent per
//! step through `idemflow_client`, and prints each step and what came back. It checks every answer
//! and reports the steps that did not behave as they should.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow::client::{ClientRetryPolicy, IdempotentClient, MemoryJournal, Reply};
use idemflow::core::PhaseName;
use idemflow::{DerivedKey, Key, TenantId};
use idemflow_testkit::provider::{Fault, MockProvider};
use reqwest::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue, RETRY_AFTER};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::Failure;
use crate::service::{CRASH_HEADER, Crashes};

/// What the demo runs against.
pub struct Target<'a> {
    /// The service, e.g. `http://127.0.0.1:8080` (no trailing slash).
    pub url: String,
    pub tenant: String,
    /// The service's payment provider, when it runs in this process: the demo can then slow a
    /// charge down (for the concurrent duplicate) and read the provider's ledger.
    pub provider: Option<&'a MockProvider>,
    /// How long the in-process provider holds the concurrent step's charge; shorter than the
    /// provider call's timeout.
    pub delay: Duration,
    /// The service's crash hook, when it runs in this process: the crash step arms it directly.
    /// Otherwise the step asks with `X-Crash-At` (a service started with `--allow-crash-header`).
    pub crashes: Option<Arc<Crashes>>,
}

/// Runs every step; `Ok(true)` when each behaved as expected.
pub async fn run(target: Target<'_>) -> Result<bool, Failure> {
    let url = target.url.trim_end_matches('/').to_owned();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()?;
    let mut demo = Demo {
        client: IdempotentClient::new(http.clone(), MemoryJournal::new())
            .with_policy(ClientRetryPolicy::default().with_deadline(Duration::from_secs(120))),
        http,
        checkouts: format!("{url}/v1/checkouts"),
        auth: HeaderValue::from_str(&format!("Bearer {}", target.tenant))?,
        tenant: TenantId::new(target.tenant.clone())?,
        provider: target.provider,
        delay: target.delay,
        crashes: target.crashes,
        unexpected: Vec::new(),
    };
    println!(
        "== demo: the checkout service at {url}, as tenant {} ==",
        target.tenant
    );
    println!("   (each step is one intent of the client; the client makes its key and keeps it)\n");
    demo.first_request_and_retry().await?;
    demo.concurrent_duplicate().await?;
    demo.reused_key().await?;
    demo.declined_card().await?;
    demo.crash_and_recovery().await?;
    for intent in ["first", "concurrent", "declined", "crash"] {
        demo.client.finish(intent).await?;
    }

    if demo.unexpected.is_empty() {
        println!("== demo passed: every step behaved as expected ==");
        Ok(true)
    } else {
        println!(
            "== demo FAILED: {} step(s) did not behave as expected ==",
            demo.unexpected.len()
        );
        for what in &demo.unexpected {
            println!("   - {what}");
        }
        Ok(false)
    }
}

struct Demo<'a> {
    client: IdempotentClient<MemoryJournal>,
    /// For the raw requests the client would retry on its own (a 409, a 503).
    http: reqwest::Client,
    checkouts: String,
    auth: HeaderValue,
    tenant: TenantId,
    provider: Option<&'a MockProvider>,
    delay: Duration,
    crashes: Option<Arc<Crashes>>,
    unexpected: Vec<String>,
}

/// A response read whole.
struct Raw {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

fn order(amount: u64, source: &str) -> Value {
    json!({"amount": amount, "currency": "usd", "source": source})
}

fn text(body: &[u8]) -> String {
    String::from_utf8_lossy(body).into_owned()
}

fn replayed_mark(replayed: bool) -> &'static str {
    if replayed {
        " [Idempotent-Replayed: true]"
    } else {
        ""
    }
}

fn show_reply(reply: &Reply) {
    let retries = match reply.attempts {
        1 => String::new(),
        attempts => format!(" (after {attempts} attempts)"),
    };
    println!(
        "   -> {}{}{retries} {}",
        reply.status,
        replayed_mark(reply.replayed),
        text(&reply.body)
    );
}

fn show_raw(raw: &Raw) {
    let retry_after = raw
        .headers
        .get(RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .map(|seconds| format!(" [Retry-After: {seconds}]"))
        .unwrap_or_default();
    let replayed = raw
        .headers
        .get(idemflow::client::IDEMPOTENT_REPLAYED)
        .is_some_and(|value| value == "true");
    println!(
        "   -> {}{}{retry_after} {}",
        raw.status,
        replayed_mark(replayed),
        text(&raw.body)
    );
}

impl Demo<'_> {
    fn check(&mut self, step: &str, ok: bool, good: &str, bad: String) {
        if ok {
            println!("   ok: {good}\n");
        } else {
            println!("   UNEXPECTED: {bad}\n");
            self.unexpected.push(format!("{step}: {bad}"));
        }
    }

    fn headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(AUTHORIZATION, self.auth.clone());
        headers
    }

    /// `POST /v1/checkouts` of `body` under `intent`'s key, retried by the client until an answer.
    async fn post(&self, intent: &str, body: &Value) -> Result<Reply, Failure> {
        Ok(self
            .client
            .send_json(
                intent,
                Method::POST,
                self.checkouts.as_str(),
                self.headers(),
                body,
            )
            .await?)
    }

    fn raw(&self, key: &str, body: &Value, extra: Option<(&'static str, &str)>) -> RawCall {
        let mut headers = self.headers();
        if let Some((name, value)) = extra
            && let Ok(value) = HeaderValue::from_str(value)
        {
            headers.insert(name, value);
        }
        Box::pin(post_once(
            self.http.clone(),
            self.checkouts.clone(),
            headers,
            key.to_owned(),
            body.clone(),
        ))
    }

    /// The key the provider sees for this request's charge: `<tenant>:<key>:charge`.
    fn derived_key(&self, key: &str) -> Result<String, Failure> {
        let charge = PhaseName::new("charge")?;
        Ok(DerivedKey::new(&self.tenant, &Key::parse(key)?, charge)
            .as_str()
            .to_owned())
    }

    async fn first_request_and_retry(&mut self) -> Result<(), Failure> {
        let body = order(2500, "tok_visa");
        let key = self.client.key_for("first").await?;
        println!("1. A first request: POST /v1/checkouts {body}");
        println!("   Idempotency-Key: \"{key}\" (made by the client for intent \"first\")");
        let first = self.post("first", &body).await?;
        show_reply(&first);
        let paid = first
            .json::<Value>()
            .is_ok_and(|value| value["status"] == "paid");
        self.check(
            "1. first request",
            first.status == StatusCode::CREATED && !first.replayed && paid,
            "executed: order created, card charged, response stored",
            format!(
                "expected a fresh 201 with status paid, got {}",
                first.status
            ),
        );

        println!("2. The same intent again, as after a lost answer: the same key, the same body");
        let retry = self.post("first", &body).await?;
        show_reply(&retry);
        self.check(
            "2. retry",
            retry.status == first.status && retry.replayed && retry.body == first.body,
            "replayed: the stored response, byte for byte; nothing ran again",
            format!(
                "expected the first response replayed (Idempotent-Replayed: true, same bytes), got {}{}",
                retry.status,
                replayed_mark(retry.replayed)
            ),
        );
        Ok(())
    }

    async fn concurrent_duplicate(&mut self) -> Result<(), Failure> {
        let body = order(4200, "tok_visa");
        let key = self.client.key_for("concurrent").await?;
        println!(
            "3. A concurrent duplicate: two requests with one key (intent \"concurrent\") at once"
        );
        let (first, second) = match self.provider {
            Some(provider) => {
                // Hold this key's charge at the provider, and send the duplicate meanwhile.
                let derived = self.derived_key(&key)?;
                provider.push_fault_for(derived.clone(), Fault::Delay(self.delay));
                println!(
                    "   (the in-process provider holds this charge for {:?}; the second request is sent while it waits)",
                    self.delay
                );
                let first = tokio::spawn(self.raw(&key, &body, None));
                let waiting = Instant::now();
                while !provider.is_in_flight(&derived)
                    && waiting.elapsed() < Duration::from_secs(10)
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let second = self.raw(&key, &body, None).await?;
                (first.await??, second)
            }
            None => {
                println!(
                    "   (best effort: the service's provider is not in this process, so the demo cannot slow the charge;"
                );
                println!(
                    "    the two race: the second gets 409 while the first runs, or the first's replay if it already finished)"
                );
                let (first, second) =
                    tokio::join!(self.raw(&key, &body, None), self.raw(&key, &body, None));
                (first?, second?)
            }
        };
        print!("   first: ");
        show_raw(&first);
        print!("   second:");
        show_raw(&second);
        let statuses = [first.status, second.status];
        let executed = statuses
            .iter()
            .filter(|status| **status == StatusCode::CREATED)
            .count();
        let conflict = statuses.contains(&StatusCode::CONFLICT);
        let ok = match self.provider {
            Some(_) => first.status == StatusCode::CREATED && second.status == StatusCode::CONFLICT,
            None => (executed == 1 && conflict) || executed == 2,
        };
        self.check(
            "3. concurrent duplicate",
            ok,
            if conflict {
                "one ran; the duplicate was told 409 request_in_progress with Retry-After, and ran nothing"
            } else {
                "one ran; the other arrived after it had finished and got its replay (the race went that way)"
            },
            format!(
                "expected one 201 and one 409, got {} and {}",
                first.status, second.status
            ),
        );
        let settled = self.post("concurrent", &body).await?;
        println!("   the client's own retry of the intent:");
        show_reply(&settled);
        let original = if first.status == StatusCode::CREATED {
            &first.body
        } else {
            &second.body
        };
        self.check(
            "3. concurrent duplicate, settled",
            settled.status == StatusCode::CREATED && settled.replayed && settled.body == *original,
            "replayed: the one stored response",
            format!(
                "expected the stored 201 replayed, got {}{}",
                settled.status,
                replayed_mark(settled.replayed)
            ),
        );
        Ok(())
    }

    async fn reused_key(&mut self) -> Result<(), Failure> {
        let body = order(9900, "tok_visa");
        println!("4. The key of step 1 reused for another request: {body}");
        let reply = self.post("first", &body).await?;
        show_reply(&reply);
        let code = reply
            .json::<Value>()
            .ok()
            .and_then(|value| value["code"].as_str().map(str::to_owned));
        self.check(
            "4. reused key",
            reply.status == StatusCode::UNPROCESSABLE_ENTITY
                && code.as_deref() == Some("idempotency_key_reused"),
            "refused with 422 idempotency_key_reused; nothing ran, nothing changed",
            format!(
                "expected 422 idempotency_key_reused, got {} {code:?}",
                reply.status
            ),
        );
        Ok(())
    }

    async fn declined_card(&mut self) -> Result<(), Failure> {
        let body = order(1200, "tok_chargeDeclined");
        println!("5. A declined card (intent \"declined\"): {body}");
        let declined = self.post("declined", &body).await?;
        show_reply(&declined);
        let problem = declined
            .headers
            .get(CONTENT_TYPE)
            .is_some_and(|value| value == "application/problem+json");
        self.check(
            "5. declined card",
            declined.status == StatusCode::PAYMENT_REQUIRED && !declined.replayed && problem,
            "402 problem+json, stored like any answer",
            format!("expected a fresh 402 problem, got {}", declined.status),
        );
        println!("   and again, with the same key:");
        let again = self.post("declined", &body).await?;
        show_reply(&again);
        self.check(
            "5. declined card, retried",
            again.status == StatusCode::PAYMENT_REQUIRED
                && again.replayed
                && again.body == declined.body,
            "replayed: the stored 402; the card was not tried again",
            format!(
                "expected the 402 replayed, got {}{}",
                again.status,
                replayed_mark(again.replayed)
            ),
        );
        Ok(())
    }

    async fn crash_and_recovery(&mut self) -> Result<(), Failure> {
        let body = order(7700, "tok_visa");
        let key = self.client.key_for("crash").await?;
        let derived = self.derived_key(&key)?;
        println!(
            "6. A crash (intent \"crash\"): X-Crash-At: after_call:charge stops the run right after the provider"
        );
        println!(
            "   charged the card, before the result is recorded, as if the process died there"
        );
        let crashed = match &self.crashes {
            Some(crashes) => {
                let armed = crashes.arm(&self.tenant, &Key::parse(&key)?, "after_call:charge");
                if let Err(why) = armed {
                    return Err(format!("the crash could not be armed: {why:?}").into());
                }
                self.raw(&key, &body, None).await?
            }
            None => {
                self.raw(&key, &body, Some((CRASH_HEADER, "after_call:charge")))
                    .await?
            }
        };
        show_raw(&crashed);
        let ok = crashed.status == StatusCode::SERVICE_UNAVAILABLE;
        let bad = if crashed.status.is_success() {
            "the service ignored X-Crash-At (start it with --allow-crash-header)".to_owned()
        } else {
            format!("expected 503, got {}", crashed.status)
        };
        self.check(
            "6. crash",
            ok,
            "503: the order exists, the card is charged, the key is left at its recovery point with its lease",
            bad,
        );
        if !ok {
            return Ok(());
        }

        let probe = self.raw(&key, &body, None).await?;
        println!("   an immediate retry:");
        show_raw(&probe);
        if probe.status == StatusCode::CONFLICT {
            let seconds = probe
                .headers
                .get(RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .unwrap_or("?");
            println!(
                "   the crashed run still holds the lease: nothing can take the key for {seconds} s more."
            );
        }
        println!(
            "   waiting for the lease to end: the client retries after Retry-After; the service's resumer may finish it first ..."
        );
        let waited = Instant::now();
        let recovered = self.post("crash", &body).await?;
        show_reply(&recovered);
        println!(
            "   after {:.1} s: {}",
            waited.elapsed().as_secs_f64(),
            if recovered.replayed {
                "finished by the resumer; the retry got the stored response"
            } else {
                "this retry took the key over and finished it from its recovery point"
            }
        );
        let answer = recovered.json::<Value>().unwrap_or_default();
        self.check(
            "6. recovery",
            recovered.status == StatusCode::CREATED && answer["status"] == "paid",
            "201: finished from the recovery point with the same derived key, no second order",
            format!("expected 201 paid, got {}", recovered.status),
        );
        if recovered.status != StatusCode::CREATED {
            return Ok(());
        }

        let again = self.post("crash", &body).await?;
        println!("   the same intent once more:");
        show_reply(&again);
        self.check(
            "6. recovery, replayed",
            again.replayed && again.body == recovered.body,
            "replayed: the stored response",
            format!(
                "expected the stored response replayed, got {}{}",
                again.status,
                replayed_mark(again.replayed)
            ),
        );

        let order_id = answer["order_id"].as_i64().unwrap_or_default();
        let charge_id = answer["charge_id"].as_str().unwrap_or_default().to_owned();
        println!("   GET /v1/checkouts/{order_id}:");
        let read = self
            .http
            .get(format!("{}/{order_id}", self.checkouts))
            .headers(self.headers())
            .send()
            .await?;
        let status = read.status();
        let stored: Value = read.json().await.unwrap_or_default();
        println!("   -> {status} {stored}");
        self.check(
            "6. the order",
            status == StatusCode::OK
                && stored["status"] == "paid"
                && stored["charge_id"] == charge_id,
            "the order is paid, with the one charge",
            format!("expected 200 with status paid and charge {charge_id}, got {status} {stored}"),
        );

        match self.provider {
            Some(provider) => {
                let charges: Vec<_> = provider
                    .charges()
                    .into_iter()
                    .filter(|charge| charge.idempotency_key == derived)
                    .collect();
                let calls = provider.calls_for(&derived);
                println!(
                    "   the provider's ledger for derived key {derived}: {} charge(s) {:?}, {calls} call(s)",
                    charges.len(),
                    charges
                        .iter()
                        .map(|charge| charge.id.as_str())
                        .collect::<Vec<_>>()
                );
                self.check(
                    "6. the provider's ledger",
                    charges.len() == 1 && charges[0].id == charge_id && calls >= 2,
                    "charged exactly once: the call after the crash reused the derived key and got the first charge back",
                    format!(
                        "expected one charge ({charge_id}) and at least two calls, got {} charge(s) and {calls} call(s)",
                        charges.len()
                    ),
                );
            }
            None => println!(
                "   (the provider is not in this process: its ledger is not shown; derived key {derived})\n"
            ),
        }
        Ok(())
    }
}

/// One `POST /v1/checkouts` with `key`, not retried: the demo wants to see a 409 or a 503.
async fn post_once(
    http: reqwest::Client,
    url: String,
    mut headers: HeaderMap,
    key: String,
    body: Value,
) -> Result<Raw, Failure> {
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(
        idemflow::client::IDEMPOTENCY_KEY,
        HeaderValue::from_str(&format!("\"{key}\""))?,
    );
    let response = http
        .post(url)
        .headers(headers)
        .body(body.to_string())
        .send()
        .await?;
    Ok(Raw {
        status: response.status(),
        headers: response.headers().clone(),
        body: response.bytes().await?.to_vec(),
    })
}

type RawCall =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Raw, Failure>> + Send + 'static>>;
