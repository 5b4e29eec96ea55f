//! The benchmark's workflows: the reference checkout (create_order → charge → mark_paid, whose
//! foreign phase is an in-process no-op) and the one-phase order, over a small `orders` table.
//! Their phases are written once, for every engine, in `idemflow_testrig::checkout`; this module
//! holds the request the workloads send and the crash hooks whose cost they measure.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use idemflow::{CrashHook, CrashPoint, Fingerprint, Key, PgStore, Request, TenantId, Workflow};
use idemflow_testrig::checkout as reference;

use crate::Error;

pub use idemflow_testrig::checkout::pg::{INSERT_ORDER, MARK_PAID, ORDERS_TABLE};
pub use idemflow_testrig::checkout::{
    CHECKOUT, CLAIMED_AT, Charged, CheckoutRequest, CreateOrder, Ledger, MarkPaid, OrderCreated,
    PLACE,
};

pub const TENANT: &str = "bench";
pub const METHOD: &str = "POST";
pub const PATH: &str = "/v1/checkouts";
pub const BODY: &[u8] = br#"{"amount": 100, "source": "tok_visa"}"#;
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

/// create_order (local) → charge (foreign, a no-op) → mark_paid (local), on PostgreSQL.
pub fn checkout(ledger: Option<Ledger>) -> Result<Workflow<PgStore>, Error> {
    Ok(reference::checkout::<PgStore>(ledger)?)
}

/// place_order (local) only, on PostgreSQL: the one-commit path.
pub fn place() -> Result<Workflow<PgStore>, Error> {
    Ok(reference::place::<PgStore>()?)
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
