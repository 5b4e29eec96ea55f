//! The benchmark's workflows: a checkout (create_order → charge → mark_paid) whose foreign phase
//! is an in-process no-op, and a one-phase order, over a small `orders` table.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemflow::{
    CrashHook, CrashPoint, DerivedKey, Fingerprint, ForeignPhase, Key, LocalPhase, PhaseContext,
    PhaseError, Request, StoredResponse, TenantId, Workflow,
};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;

use crate::Error;

pub const TENANT: &str = "bench";
pub const METHOD: &str = "POST";
pub const PATH: &str = "/v1/checkouts";
pub const BODY: &[u8] = br#"{"amount": 100, "source": "tok_visa"}"#;
pub const CHECKOUT: &str = "checkout.v1";
pub const PLACE: &str = "place.v1";

pub const ORDERS_TABLE: &str = "CREATE TABLE orders (\
    id bigserial PRIMARY KEY, tenant text NOT NULL, key text NOT NULL, amount bigint NOT NULL, \
    status text NOT NULL DEFAULT 'created', paid_by text)";

pub fn tenant() -> TenantId {
    TenantId::new(TENANT).unwrap_or_else(|_| unreachable!("a valid tenant literal"))
}

pub fn request() -> Request<'static> {
    Request {
        method: METHOD,
        path: PATH,
        body: BODY,
    }
}

/// The fingerprint the engine stores for [`BODY`], and the canonical request it stores with it:
/// what seeded rows must hold for the engine to treat them as this request.
pub fn fingerprint_and_request() -> Result<(Fingerprint, serde_json::Value), Error> {
    let canonical = idemflow::core::canonicalize(BODY)?;
    let fingerprint = Fingerprint::of_canonical_json(METHOD, PATH, &canonical);
    Ok((fingerprint, serde_json::from_slice(&canonical)?))
}

tokio::task_local! {
    /// When the first local phase of the current request began: the claim (BEGIN, claim) is
    /// done by then. Read by the workloads that report claim latency.
    pub static CLAIMED_AT: Cell<Option<Instant>>;
}

fn mark_claimed() {
    let _ = CLAIMED_AT.try_with(|cell| {
        if cell.get().is_none() {
            cell.set(Some(Instant::now()));
        }
    });
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckoutRequest {
    pub amount: i64,
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderCreated {
    pub order_id: i64,
    pub amount: i64,
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charged {
    pub order_id: i64,
    pub charge_id: String,
}

pub const INSERT_ORDER: &str =
    "INSERT INTO orders (tenant, key, amount) VALUES ($1, $2, $3) RETURNING id";
pub const MARK_PAID: &str = "UPDATE orders SET status = $2, paid_by = $3 WHERE id = $1";

pub(crate) struct CreateOrder;

#[async_trait::async_trait]
impl LocalPhase for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = CheckoutRequest;
    type Output = OrderCreated;

    async fn run(
        &self,
        connection: &mut PgConnection,
        input: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<OrderCreated, PhaseError> {
        mark_claimed();
        let (order_id,): (i64,) = sqlx::query_as(INSERT_ORDER)
            .bind(context.tenant.as_str())
            .bind(context.key.as_str())
            .bind(input.amount)
            .fetch_one(connection)
            .await?;
        Ok(OrderCreated {
            order_id,
            amount: input.amount,
            source: input.source,
        })
    }
}

/// Foreign calls made, by derived key; kept only where a workload checks them (the storm).
pub type Ledger = Arc<Mutex<HashMap<String, u32>>>;

/// The foreign phase: an in-process no-op, so the database is what is measured.
pub(crate) struct Charge(pub(crate) Option<Ledger>);

#[async_trait::async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = "charge";
    type Input = OrderCreated;
    type Output = Charged;

    fn timeout(&self) -> Duration {
        Duration::from_secs(10)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        input: OrderCreated,
        _: &PhaseContext,
    ) -> Result<Charged, PhaseError> {
        if let Some(ledger) = &self.0 {
            let mut calls = ledger
                .lock()
                .map_err(|_| PhaseError::terminal("ledger poisoned"))?;
            *calls.entry(key.to_string()).or_default() += 1;
        }
        Ok(Charged {
            order_id: input.order_id,
            charge_id: format!("ch_{}", input.order_id),
        })
    }
}

pub(crate) struct MarkPaid;

#[async_trait::async_trait]
impl LocalPhase for MarkPaid {
    const NAME: &'static str = "mark_paid";
    type Input = Charged;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut PgConnection,
        charged: Charged,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        sqlx::query(MARK_PAID)
            .bind(charged.order_id)
            .bind("paid")
            .bind(format!("attempt-{}", context.attempt))
            .execute(connection)
            .await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"order_id": charged.order_id, "charge_id": charged.charge_id, "status": "paid"}),
        ))
    }
}

struct PlaceOrder;

#[async_trait::async_trait]
impl LocalPhase for PlaceOrder {
    const NAME: &'static str = "place_order";
    type Input = CheckoutRequest;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut PgConnection,
        input: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        mark_claimed();
        let (order_id,): (i64,) = sqlx::query_as(INSERT_ORDER)
            .bind(context.tenant.as_str())
            .bind(context.key.as_str())
            .bind(input.amount)
            .fetch_one(connection)
            .await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"order_id": order_id, "status": "created"}),
        ))
    }
}

/// create_order (local) → charge (foreign, a no-op) → mark_paid (local).
pub fn checkout(ledger: Option<Ledger>) -> Result<Workflow, Error> {
    Ok(Workflow::builder::<CheckoutRequest>(CHECKOUT)
        .local(CreateOrder)
        .foreign(Charge(ledger))
        .local(MarkPaid)
        .build()?)
}

/// place_order (local) only: the one-commit path.
pub fn place() -> Result<Workflow, Error> {
    Ok(Workflow::builder::<CheckoutRequest>(PLACE)
        .local(PlaceOrder)
        .build()?)
}

/// A crash hook that never fires: what installing one costs.
#[derive(Debug, Default)]
pub struct NeverCrash;

#[async_trait::async_trait]
impl CrashHook for NeverCrash {
    async fn crash_at(&self, _: &CrashPoint, _: &TenantId, _: &Key) -> bool {
        false
    }
}

/// A crash hook that never fires and counts how often it is consulted.
#[derive(Debug, Default)]
pub struct CountingHook(pub AtomicU64);

#[async_trait::async_trait]
impl CrashHook for CountingHook {
    async fn crash_at(&self, _: &CrashPoint, _: &TenantId, _: &Key) -> bool {
        self.0.fetch_add(1, Ordering::Relaxed);
        false
    }
}

/// What consulting a never-firing hook costs, in nanoseconds per crash point: the engine builds
/// the point and awaits one dynamic (boxed) call (measured over ten million calls, in process).
pub async fn hook_nanos_per_call() -> f64 {
    let hook: Arc<dyn CrashHook> = Arc::new(NeverCrash);
    let (Ok(tenant), Ok(key)) = (TenantId::new("bench"), Key::parse("bench-key")) else {
        return f64::NAN;
    };
    let calls = 10_000_000_u32;
    let started = Instant::now();
    let mut fired = 0_u32;
    for call in 0..calls {
        let point = if call % 2 == 0 {
            CrashPoint::BeforeFinish
        } else {
            CrashPoint::BeforeCommit {
                phase: "create_order",
            }
        };
        if std::hint::black_box(&hook)
            .crash_at(std::hint::black_box(&point), &tenant, &key)
            .await
        {
            fired += 1;
        }
    }
    std::hint::black_box(fired);
    started.elapsed().as_nanos() as f64 / f64::from(calls)
}
