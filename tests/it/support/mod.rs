//! Shared pieces of the integration tests: a small checkout workflow over a `orders` table, an
//! in-memory stand-in for a payment provider, and helpers to look at the key table.
#![allow(dead_code, clippy::unwrap_used)]

pub mod example;
pub mod mariadb;
pub mod redis;
pub mod report;

// The wire-counting proxy lives in the testkit (the benchmark uses it too); only some tests count.
#[allow(unused_imports)]
pub use idemflow_testrig::wire;

use idemflow::PgStore;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemflow::{
    DerivedKey, Failure, FailurePhase, ForeignPhase, LocalPhase, Outcome, PhaseContext, PhaseError,
    Request, RetryPolicy, Runner, StoredResponse, TenantId, Workflow,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;

pub const ORDERS_TABLE: &str = "CREATE TABLE orders (\
    id bigserial PRIMARY KEY, tenant text NOT NULL, key text NOT NULL, amount bigint NOT NULL, \
    status text NOT NULL DEFAULT 'created', paid_by text)";

pub async fn create_orders(pool: &PgPool) {
    sqlx::query(ORDERS_TABLE).execute(pool).await.unwrap();
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckoutRequest {
    pub amount: i64,
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OrderCreated {
    pub order_id: i64,
    pub amount: i64,
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Charged {
    pub order_id: i64,
    pub charge_id: String,
    pub declined: bool,
}

/// What a test can make a phase do on its next runs.
#[derive(Debug, Default)]
pub struct Script {
    /// Fail this many of the next runs with a retryable error.
    pub fail_next: AtomicU32,
    /// Fail the next run with a terminal error.
    pub fail_terminally: std::sync::atomic::AtomicBool,
    /// When set, the next run waits for `resume` (or forever) before doing anything.
    pub hang_next: std::sync::atomic::AtomicBool,
    /// When set, the next run panics.
    pub panic_next: std::sync::atomic::AtomicBool,
    pub entered: Notify,
    pub resume: Notify,
    /// Runs begun.
    pub runs: AtomicUsize,
}

impl Script {
    async fn enter(&self) -> Result<(), PhaseError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        if self.hang_next.swap(false, Ordering::SeqCst) {
            self.entered.notify_one();
            self.resume.notified().await;
        }
        if self.panic_next.swap(false, Ordering::SeqCst) {
            panic!("scripted panic");
        }
        if self.fail_terminally.swap(false, Ordering::SeqCst) {
            return Err(PhaseError::terminal_with(
                StoredResponse::new(409, "order rejected"),
                "scripted terminal failure",
            ));
        }
        let failing = self.fail_next.load(Ordering::SeqCst);
        if failing > 0 {
            self.fail_next.store(failing - 1, Ordering::SeqCst);
            return Err(PhaseError::retryable("scripted failure"));
        }
        Ok(())
    }
}

pub struct CreateOrder(pub Arc<Script>);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = CheckoutRequest;
    type Output = OrderCreated;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        input: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<OrderCreated, PhaseError> {
        let (order_id,): (i64,) = sqlx::query_as(
            "INSERT INTO orders (tenant, key, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(context.tenant.as_str())
        .bind(context.key.as_str())
        .bind(input.amount)
        .fetch_one(&mut *connection)
        .await?;
        // The script runs after the insert so a failure here proves the insert rolls back.
        self.0.enter().await?;
        Ok(OrderCreated {
            order_id,
            amount: input.amount,
            source: input.source,
        })
    }
}

/// An in-memory payment provider honouring idempotency keys: the same key returns the first
/// charge. It counts calls per key and charges made.
#[derive(Debug, Default)]
pub struct Provider {
    pub charges: Mutex<HashMap<String, Charged>>,
    pub calls: Mutex<HashMap<String, u32>>,
    pub script: Script,
    pub delay: Mutex<Option<Duration>>,
    /// The charge phase's retry policy (the default unless a test sets one).
    pub retry: Mutex<Option<RetryPolicy>>,
    /// The charge phase's timeout (10 s unless a test sets one).
    pub timeout: Mutex<Option<Duration>>,
}

impl Provider {
    pub fn charge_count(&self) -> usize {
        self.charges.lock().unwrap().len()
    }
    pub fn call_count(&self) -> u32 {
        self.calls.lock().unwrap().values().sum()
    }
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.calls.lock().unwrap().keys().cloned().collect();
        keys.sort();
        keys
    }
}

pub struct Charge(pub Arc<Provider>);

#[async_trait::async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = "charge";
    type Input = OrderCreated;
    type Output = Charged;

    fn timeout(&self) -> Duration {
        self.0
            .timeout
            .lock()
            .unwrap()
            .unwrap_or(Duration::from_secs(10))
    }

    fn retry_policy(&self) -> RetryPolicy {
        self.0.retry.lock().unwrap().unwrap_or_else(patient)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        input: OrderCreated,
        _: &PhaseContext,
    ) -> Result<Charged, PhaseError> {
        *self
            .0
            .calls
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default() += 1;
        let delay = *self.0.delay.lock().unwrap();
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        self.0.script.enter().await?;
        let mut charges = self.0.charges.lock().unwrap();
        let next_id = charges.len() + 1;
        let charge = charges.entry(key.to_string()).or_insert_with(|| Charged {
            order_id: input.order_id,
            charge_id: format!("ch_{next_id}"),
            declined: input.source == "tok_declined",
        });
        Ok(charge.clone())
    }
}

/// A second foreign call, for two-foreign workflows: sends a receipt.
pub struct SendReceipt(pub Arc<Provider>);

#[async_trait::async_trait]
impl ForeignPhase for SendReceipt {
    const NAME: &'static str = "send_receipt";
    type Input = Charged;
    type Output = Charged;

    fn timeout(&self) -> Duration {
        Duration::from_secs(10)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        input: Charged,
        _: &PhaseContext,
    ) -> Result<Charged, PhaseError> {
        *self
            .0
            .calls
            .lock()
            .unwrap()
            .entry(key.to_string())
            .or_default() += 1;
        Ok(input)
    }
}

pub struct MarkPaid(pub Arc<Script>);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for MarkPaid {
    const NAME: &'static str = "mark_paid";
    type Input = Charged;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        charged: Charged,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let status = if charged.declined { "declined" } else { "paid" };
        sqlx::query("UPDATE orders SET status = $2, paid_by = $3 WHERE id = $1")
            .bind(charged.order_id)
            .bind(status)
            .bind(format!("attempt-{}", context.attempt))
            .execute(&mut *connection)
            .await?;
        self.0.enter().await?;
        let code = if charged.declined { 402 } else { 201 };
        Ok(StoredResponse::json(
            code,
            &serde_json::json!({"order_id": charged.order_id, "charge_id": charged.charge_id, "status": status}),
        ))
    }
}

/// A local-only workflow's single phase: inserts the order and answers at once.
pub struct PlaceOrder(pub Arc<Script>);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for PlaceOrder {
    const NAME: &'static str = "place_order";
    type Input = CheckoutRequest;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        input: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let (order_id,): (i64,) = sqlx::query_as(
            "INSERT INTO orders (tenant, key, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(context.tenant.as_str())
        .bind(context.key.as_str())
        .bind(input.amount)
        .fetch_one(&mut *connection)
        .await?;
        self.0.enter().await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"order_id": order_id}),
        ))
    }
}

/// The failure path: marks the order failed and answers 502.
pub struct MarkFailed;

#[async_trait::async_trait]
impl FailurePhase<PgStore> for MarkFailed {
    type Request = CheckoutRequest;

    async fn run(
        &self,
        connection: &mut PgConnection,
        failure: Failure<CheckoutRequest>,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query("UPDATE orders SET status = 'failed' WHERE tenant = $1 AND key = $2")
            .bind(context.tenant.as_str())
            .bind(context.key.as_str())
            .execute(&mut *connection)
            .await?;
        let body = serde_json::json!({
            "status": 502, "failed_phase": failure.phase, "attempts": failure.attempts,
            "recovery_point": failure.recovery_point, "amount": failure.request.amount,
            "recovery_output": failure.recovery_output,
        });
        Ok(StoredResponse::problem(502, &body))
    }
}

/// The scripts and provider behind one test's workflows.
#[derive(Clone, Default)]
pub struct Harness {
    pub create: Arc<Script>,
    pub finish: Arc<Script>,
    pub provider: Arc<Provider>,
}

impl Harness {
    /// create_order (local) → charge (foreign) → mark_paid (local).
    pub fn checkout(&self) -> Workflow<PgStore> {
        Workflow::builder::<CheckoutRequest>("checkout.v1")
            .local(CreateOrder(self.create.clone()))
            .foreign(Charge(self.provider.clone()))
            .local(MarkPaid(self.finish.clone()))
            .build()
            .unwrap()
    }

    /// The checkout with another lease (set the charge's timeout below it first).
    pub fn checkout_leased(&self, lease: Duration) -> Workflow<PgStore> {
        Workflow::builder::<CheckoutRequest>("checkout.v1")
            .local(CreateOrder(self.create.clone()))
            .foreign(Charge(self.provider.clone()))
            .local(MarkPaid(self.finish.clone()))
            .lease(lease)
            .build()
            .unwrap()
    }

    /// The checkout with the MarkFailed failure path.
    pub fn checkout_with_failure_path(&self) -> Workflow<PgStore> {
        Workflow::builder::<CheckoutRequest>("checkout.v1")
            .local(CreateOrder(self.create.clone()))
            .foreign(Charge(self.provider.clone()))
            .local(MarkPaid(self.finish.clone()))
            .on_failure(MarkFailed)
            .build()
            .unwrap()
    }

    /// place_order (local) only.
    pub fn local_only(&self) -> Workflow<PgStore> {
        Workflow::builder::<CheckoutRequest>("place.v1")
            .local(PlaceOrder(self.create.clone()))
            .build()
            .unwrap()
    }

    /// create_order → charge → send_receipt → mark_paid: two foreign phases.
    pub fn two_foreign(&self) -> Workflow<PgStore> {
        Workflow::builder::<CheckoutRequest>("checkout-receipt.v1")
            .local(CreateOrder(self.create.clone()))
            .foreign(Charge(self.provider.clone()))
            .foreign(SendReceipt(self.provider.clone()))
            .local(MarkPaid(self.finish.clone()))
            .build()
            .unwrap()
    }
}

pub fn tenant(id: u64) -> TenantId {
    TenantId::from(id)
}

pub fn body(amount: i64) -> Vec<u8> {
    format!(r#"{{"amount": {amount}, "source": "tok_visa"}}"#).into_bytes()
}

pub fn request(body: &[u8]) -> Request<'_> {
    Request {
        method: "POST",
        path: "/v1/checkouts",
        body,
    }
}

pub async fn run(
    runner: &Runner<PgStore>,
    workflow: &Workflow<PgStore>,
    tenant: &TenantId,
    key: &str,
    body: &[u8],
) -> Outcome {
    // A key that does not parse never reaches the runner (its type says so): answered as an
    // HTTP layer answers it.
    let key = match idemflow::Key::parse(key) {
        Ok(key) => key,
        Err(error) => return Outcome::Rejected(idemflow::Rejection::InvalidKey(error)),
    };
    runner
        .run(workflow, tenant, &key, request(body))
        .await
        .unwrap()
}

/// Expires a key's lease by rewinding it in SQL, as if its owner had been gone for a minute.
pub async fn expire_lease(pool: &PgPool, key: &str) {
    let result = sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' WHERE key = $1",
    )
    .bind(key)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(result.rows_affected(), 1, "no key {key} to expire");
}

/// (state, recovery_point, lock_version, attempts) of a key.
pub async fn key_row(pool: &PgPool, key: &str) -> Option<(String, String, i64, i32)> {
    sqlx::query_as(
        "SELECT state, recovery_point, lock_version, attempts FROM idempotency_keys WHERE key = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

pub async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

pub fn executed(outcome: &Outcome) -> &StoredResponse {
    match outcome {
        Outcome::Executed(response) => response,
        other => panic!("expected Executed, got {other:?}"),
    }
}

/// Expires every started key's lease.
pub async fn expire_all_leases(pool: &PgPool) {
    sqlx::query("UPDATE idempotency_keys SET locked_until = now() - interval '1 minute' WHERE state = 'started'")
        .execute(pool)
        .await
        .unwrap();
}

/// A retry policy with short waits, so a test's resumer comes back quickly.
pub fn quick_retries(max_attempts: u32) -> RetryPolicy {
    RetryPolicy::default()
        .with_max_attempts(max_attempts)
        .with_initial_backoff(Duration::from_millis(20))
        .with_max_backoff(Duration::from_millis(40))
        .with_multiplier(2.0)
        .with_jitter(0.0)
}

/// Waits (bounded) until `condition` holds, polling the database.
pub async fn eventually(pool: &PgPool, sql: &'static str, expected: i64) {
    for _ in 0..200 {
        if count(pool, sql).await == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "{sql} never returned {expected}; it returns {}",
        count(pool, sql).await
    );
}

/// Prints the engine's logs when `RUST_LOG` is set (for example `RUST_LOG=idemflow=debug`).
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// The tests' default retry policy: a failed attempt waits a minute, so a test that looks at a key
/// right after a failure finds it in progress however slow the machine is, and moves on by
/// rewinding the lease in SQL, never by waiting.
pub fn patient() -> RetryPolicy {
    RetryPolicy::default()
        .with_initial_backoff(Duration::from_secs(60))
        .with_max_backoff(Duration::from_secs(60))
        .with_jitter(0.0)
}
