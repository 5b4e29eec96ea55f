//! The smallest complete idemflow service: a payment as two phases (a local order row, a foreign
//! charge), served over HTTP under `Idempotency-Key`, with a resumer finishing what a crash
//! left. SQLite, and the testkit's mock payment provider in the same process: nothing to install.
//! Run `cargo run -p example-hello [BIND] [DATABASE_FILE]` (default `127.0.0.1:3000`, `hello.db`),
//! then the curl line it prints, twice: the second answer is the first, replayed.
use std::sync::Arc;

use idemflow::http::{BearerTenant, WorkflowService};
use idemflow::{DerivedKey, ForeignPhase, LocalPhase, PhaseContext, PhaseError, Registry, Resumer};
use idemflow::{Runner, SqliteConnection, SqliteStore, StoredResponse, Workflow};
use idemflow_testkit::provider::MockProvider;
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Payment {
    amount: u64,
}

#[derive(Serialize, Deserialize)]
struct Order {
    id: i64,
    amount: u64,
}

/// Local: the order row, committed in one transaction with the key's recovery point.
struct CreateOrder;

#[idemflow::async_trait]
impl LocalPhase<SqliteStore> for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = Payment;
    type Output = Order;

    async fn run(
        &self,
        db: &mut SqliteConnection,
        payment: Payment,
        _: &PhaseContext,
    ) -> Result<Order, PhaseError> {
        let id =
            idemflow::sqlx::query_scalar("INSERT INTO orders (amount) VALUES (?) RETURNING id")
                .bind(i64::try_from(payment.amount)?)
                .fetch_one(db)
                .await?;
        Ok(Order {
            id,
            amount: payment.amount,
        })
    }
}

/// Foreign: the charge, sent under the derived key `<tenant>:<key>:charge` on every attempt.
struct Charge(ProviderClient);

#[idemflow::async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = "charge";
    type Input = Order;
    type Output = StoredResponse;

    async fn call(
        &self,
        key: &DerivedKey,
        order: Order,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let body = match self
            .0
            .charge(key.as_str(), order.amount, "usd", "tok_visa")
            .await?
        {
            ChargeResult::Succeeded { charge_id } => {
                serde_json::json!({"order": order.id, "charge": charge_id})
            }
            other => serde_json::json!({"order": order.id, "declined": format!("{other:?}")}),
        };
        Ok(StoredResponse::json(201, &body))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init(); // INFO and up, with the tenant and key of each request
    let provider = MockProvider::start().await; // a payment provider over real HTTP, in process
    let mut args = std::env::args().skip(1);
    let bind = args.next().unwrap_or_else(|| "127.0.0.1:3000".to_owned());
    let file = args.next().unwrap_or_else(|| "hello.db".to_owned());
    let pool = idemflow::sqlite::open_file(file.as_ref(), &Default::default()).await?; // migrated
    idemflow::sqlx::query(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, amount INTEGER)",
    )
    .execute(&pool)
    .await?;

    let payments = Arc::new(
        Workflow::<SqliteStore>::builder_on::<Payment>("payment.v1")
            .local(CreateOrder)
            .foreign(Charge(provider.client()))
            .build()?,
    );
    let runner = Runner::new(pool);
    let mut registry = Registry::new();
    registry.register(payments.clone())?;
    tokio::spawn(Resumer::new(runner.clone(), registry).run(std::future::pending()));

    // BearerTenant takes the bearer token as the tenant: for demos. A service resolves the tenant
    // from a verified credential with its own TenantResolver.
    let app = axum::Router::new().route_service(
        "/payments",
        WorkflowService::new(runner, payments, BearerTenant),
    );
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    let address = listener.local_addr()?;
    println!("hello: listening on http://{address}");
    println!(
        "curl -i {address}/payments -H 'Authorization: Bearer acme' -H 'Idempotency-Key: k1' \
         -H 'Content-Type: application/json' -d '{{\"amount\": 500}}'"
    );
    // Served with limits on slow and oversized clients (docs/operations.md).
    idemflow::http::serve(listener, app, idemflow::http::ServeLimits::default()).await?;
    Ok(())
}
