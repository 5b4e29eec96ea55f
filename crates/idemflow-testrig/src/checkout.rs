//! The engine's own reference checkout, written once for every SQL engine: the workflow the
//! benchmark measures and the round-trip tests count. `create_order` (local: an insert) →
//! `charge` (foreign: an in-process no-op, so the database is what is measured) → `mark_paid`
//! (local: an update); and `place_order`, one local phase, the one-commit path.
//!
//! The phases are generic over [`Orders`], the two statements they send in each engine's SQL;
//! what differs between engines is only that. (The checkout example writes its own phases: it
//! is what a user reads to learn how.)

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemflow_core::{DerivedKey, StoredResponse};
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_runner::{
    BuildError, ConnectionOf, ForeignPhase, LocalPhase, PhaseContext, PhaseError, SqlEngine,
    Workflow,
};
use idemflow_sqlite::SqliteStore;
use serde::{Deserialize, Serialize};

/// The checkout's workflow name.
pub const CHECKOUT: &str = "checkout.v1";
/// The one-phase order's workflow name.
pub const PLACE: &str = "place.v1";

/// The request both workflows take.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckoutRequest {
    /// In the currency's smallest unit.
    pub amount: i64,
    /// A card token.
    pub source: String,
}

/// What `create_order` hands to `charge`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderCreated {
    /// The order's id in the orders table.
    pub order_id: i64,
    /// The amount to charge.
    pub amount: i64,
    /// The card token.
    pub source: String,
}

/// What `charge` hands to `mark_paid`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Charged {
    /// The order's id.
    pub order_id: i64,
    /// The (made-up) charge's id.
    pub charge_id: String,
}

tokio::task_local! {
    /// When the first local phase of the current request began: the claim (`BEGIN`, claim) is
    /// done by then. Set only inside a scope of it; read by the benchmark's claim latency.
    pub static CLAIMED_AT: Cell<Option<Instant>>;
}

/// The first local phase's statement: notes when it began ([`CLAIMED_AT`]), inserts the order.
async fn insert_order<E: Orders>(
    connection: &mut ConnectionOf<E>,
    context: &PhaseContext,
    amount: i64,
) -> Result<i64, sqlx::Error> {
    let _ = CLAIMED_AT.try_with(|cell| {
        if cell.get().is_none() {
            cell.set(Some(Instant::now()));
        }
    });
    E::insert_order(
        connection,
        context.tenant.as_str(),
        context.key.as_str(),
        amount,
    )
    .await
}

/// The orders table and the phases' two statements, in one engine's SQL.
#[async_trait::async_trait]
pub trait Orders: SqlEngine {
    /// Creates the orders table: id, tenant, key, amount, status (`created`), paid_by.
    const ORDERS_TABLE: &'static str;
    /// Inserts an order; its id.
    async fn insert_order(
        connection: &mut ConnectionOf<Self>,
        tenant: &str,
        key: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error>;
    /// Marks an order paid, by whom (the attempt that did).
    async fn mark_paid(
        connection: &mut ConnectionOf<Self>,
        order_id: i64,
        paid_by: &str,
    ) -> Result<(), sqlx::Error>;
}

/// PostgreSQL's statements (the raw baseline's and pgbench's too).
pub mod pg {
    /// The orders table.
    pub const ORDERS_TABLE: &str = "CREATE TABLE orders (\
        id bigserial PRIMARY KEY, tenant text NOT NULL, key text NOT NULL, amount bigint NOT NULL, \
        status text NOT NULL DEFAULT 'created', paid_by text)";
    /// `$1` tenant, `$2` key, `$3` amount; returns the id.
    pub const INSERT_ORDER: &str =
        "INSERT INTO orders (tenant, key, amount) VALUES ($1, $2, $3) RETURNING id";
    /// `$1` id, `$2` status, `$3` paid by.
    pub const MARK_PAID: &str = "UPDATE orders SET status = $2, paid_by = $3 WHERE id = $1";
}

/// SQLite's statements.
pub mod sqlite {
    /// The orders table.
    pub const ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, \
        tenant TEXT NOT NULL, key TEXT NOT NULL, amount INTEGER NOT NULL, \
        status TEXT NOT NULL DEFAULT 'created', paid_by TEXT) STRICT";
    /// `?1` tenant, `?2` key, `?3` amount; returns the id.
    pub const INSERT_ORDER: &str =
        "INSERT INTO orders (tenant, key, amount) VALUES (?1, ?2, ?3) RETURNING id";
    /// `?1` id, `?2` status, `?3` paid by.
    pub const MARK_PAID: &str = "UPDATE orders SET status = ?2, paid_by = ?3 WHERE id = ?1";
}

/// MySQL's and MariaDB's statements.
pub mod mysql {
    /// The orders table.
    pub const ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS orders (\
        id BIGINT AUTO_INCREMENT PRIMARY KEY, tenant VARBINARY(255) NOT NULL, \
        `key` VARBINARY(255) NOT NULL, amount BIGINT NOT NULL, \
        status VARCHAR(16) NOT NULL DEFAULT 'created', paid_by VARCHAR(64)) ENGINE = InnoDB";
    /// Tenant, key, amount; the id is the insert's `last_insert_id`.
    pub const INSERT_ORDER: &str = "INSERT INTO orders (tenant, `key`, amount) VALUES (?, ?, ?)";
    /// Status, paid by, id.
    pub const MARK_PAID: &str = "UPDATE orders SET status = ?, paid_by = ? WHERE id = ?";
}

/// `Orders` for an engine whose insert returns the id (`RETURNING`): its statements in `$sql`.
macro_rules! orders_returning_id {
    ($engine:ty, $sql:ident) => {
        #[async_trait::async_trait]
        impl Orders for $engine {
            const ORDERS_TABLE: &'static str = $sql::ORDERS_TABLE;

            async fn insert_order(
                connection: &mut ConnectionOf<Self>,
                tenant: &str,
                key: &str,
                amount: i64,
            ) -> Result<i64, sqlx::Error> {
                sqlx::query_scalar($sql::INSERT_ORDER)
                    .bind(tenant)
                    .bind(key)
                    .bind(amount)
                    .fetch_one(connection)
                    .await
            }

            async fn mark_paid(
                connection: &mut ConnectionOf<Self>,
                order_id: i64,
                paid_by: &str,
            ) -> Result<(), sqlx::Error> {
                sqlx::query($sql::MARK_PAID)
                    .bind(order_id)
                    .bind("paid")
                    .bind(paid_by)
                    .execute(connection)
                    .await
                    .map(drop)
            }
        }
    };
}

orders_returning_id!(PgStore, pg);
orders_returning_id!(SqliteStore, sqlite);

#[async_trait::async_trait]
impl Orders for MySqlStore {
    const ORDERS_TABLE: &'static str = mysql::ORDERS_TABLE;

    async fn insert_order(
        connection: &mut ConnectionOf<Self>,
        tenant: &str,
        key: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        let done = sqlx::query(mysql::INSERT_ORDER)
            .bind(tenant)
            .bind(key)
            .bind(amount)
            .execute(connection)
            .await?;
        i64::try_from(done.last_insert_id()).map_err(|error| sqlx::Error::Decode(Box::new(error)))
    }

    async fn mark_paid(
        connection: &mut ConnectionOf<Self>,
        order_id: i64,
        paid_by: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(mysql::MARK_PAID)
            .bind("paid")
            .bind(paid_by)
            .bind(order_id)
            .execute(connection)
            .await
            .map(drop)
    }
}

/// The first local phase: inserts the order.
#[derive(Debug)]
pub struct CreateOrder;

#[async_trait::async_trait]
impl<E: Orders> LocalPhase<E> for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = CheckoutRequest;
    type Output = OrderCreated;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<OrderCreated, PhaseError> {
        let order_id = insert_order::<E>(connection, context, input.amount).await?;
        Ok(OrderCreated {
            order_id,
            amount: input.amount,
            source: input.source,
        })
    }
}

/// Foreign calls made, by derived key; kept only where a caller checks them (the storm).
pub type Ledger = Arc<Mutex<HashMap<String, u32>>>;

/// The foreign phase: an in-process no-op that counts its calls in the ledger, if given one.
#[derive(Debug)]
pub struct Charge(pub Option<Ledger>);

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

/// The last local phase: marks the order paid; the response (201).
#[derive(Debug)]
pub struct MarkPaid;

#[async_trait::async_trait]
impl<E: Orders> LocalPhase<E> for MarkPaid {
    const NAME: &'static str = "mark_paid";
    type Input = Charged;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        charged: Charged,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        E::mark_paid(
            connection,
            charged.order_id,
            &format!("attempt-{}", context.attempt),
        )
        .await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({
                "order_id": charged.order_id, "charge_id": charged.charge_id, "status": "paid",
            }),
        ))
    }
}

/// The one-phase order: inserts it; the response (201).
#[derive(Debug)]
pub struct PlaceOrder;

#[async_trait::async_trait]
impl<E: Orders> LocalPhase<E> for PlaceOrder {
    const NAME: &'static str = "place_order";
    type Input = CheckoutRequest;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        input: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let order_id = insert_order::<E>(connection, context, input.amount).await?;
        Ok(StoredResponse::json(
            201,
            &serde_json::json!({"order_id": order_id, "status": "created"}),
        ))
    }
}

/// create_order (local) → charge (foreign, a no-op) → mark_paid (local), on engine `E`.
pub fn checkout<E: Orders>(ledger: Option<Ledger>) -> Result<Workflow<E>, BuildError> {
    Workflow::<E>::builder_on::<CheckoutRequest>(CHECKOUT)
        .local(CreateOrder)
        .foreign(Charge(ledger))
        .local(MarkPaid)
        .build()
}

/// place_order (local) only, on engine `E`: the one-commit path.
pub fn place<E: Orders>() -> Result<Workflow<E>, BuildError> {
    Workflow::<E>::builder_on::<CheckoutRequest>(PLACE)
        .local(PlaceOrder)
        .build()
}
