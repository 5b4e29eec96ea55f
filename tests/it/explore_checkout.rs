//! The explorer on the checkout example: every crash point and every provider fault, recovered by
//! a resumer and by a client retry, must leave one order, one charge and a replayable response.
//! And the explorer must catch workflows that are broken on purpose.

#[path = "../../examples/checkout/workflow.rs"]
#[allow(dead_code)]
mod workflow;

#[path = "../../examples/checkout/orders.rs"]
#[allow(dead_code, clippy::duplicate_mod)]
mod orders;

use idemflow::PgStore;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idemflow::{
    DerivedKey, ForeignPhase, LocalPhase, PhaseContext, PhaseError, TenantId, Workflow,
};
use idemflow_testkit::explorer::{Case, CheckFuture, Explorer, Report};
use idemflow_testkit::provider::MockProvider;
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};
use sqlx::{PgConnection, PgPool};
use workflow::{ChargeOutcome, CheckoutRequest, Finish, OrderCreated};

const BODY: &[u8] = br#"{"amount": 2500, "currency": "usd", "source": "tok_visa"}"#;

fn client(provider: &MockProvider) -> ProviderClient {
    // Short, so the timeout fault costs little; the lease stays longer than it.
    ProviderClient::builder(provider.url())
        .timeout(Duration::from_millis(400))
        .build()
}

/// Local effects exactly once: one order per request, in a final state.
fn one_final_order<'a>(pool: &'a PgPool, case: &'a Case) -> CheckFuture<'a> {
    Box::pin(async move {
        let statuses: Vec<String> = sqlx::query_scalar(
            "SELECT status FROM checkout_orders WHERE tenant = $1 AND request_key = $2",
        )
        .bind(case.tenant.as_str())
        .bind(&case.key)
        .fetch_all(pool)
        .await
        .map_err(|error| error.to_string())?;
        match statuses.as_slice() {
            [status] if status == "paid" || status == "declined" => Ok(()),
            [status] => Err(format!("the order is left {status}")),
            orders => Err(format!("{} orders for one request", orders.len())),
        }
    })
}

async fn explore(pool: &PgPool, workflow: Workflow<PgStore>, provider: &MockProvider) -> Report {
    sqlx::query(orders::PG_ORDERS_TABLE)
        .execute(pool)
        .await
        .unwrap();
    let explorer = Explorer::new(
        pool.clone(),
        workflow,
        TenantId::new("acme").unwrap(),
        "/v1/checkouts",
        BODY,
    )
    .check("one order per request", one_final_order);
    let report = explorer.run(Some(provider)).await;
    println!("{report}");
    report
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_checkout_survives_every_crash_point_and_provider_fault(pool: PgPool) {
    let provider = MockProvider::start().await;
    let checkout = workflow::checkout(client(&provider), Duration::from_secs(5));
    let report = explore(&pool, checkout, &provider).await;
    // 6 crash points and 5 faults, each recovered two ways.
    assert_eq!(report.results.len(), 22);
    report.assert_all_passed();
}

/// The same cases on SQLite: the explorer, the workflow and the check are the same code.
#[tokio::test]
async fn on_sqlite_the_checkout_survives_every_crash_point_and_provider_fault() {
    let pool = crate::engines::sqlite("explore_checkout").await;
    sqlx::query(orders::SQLITE_ORDERS_TABLE)
        .execute(&pool)
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    let checkout =
        workflow::checkout::<idemflow::SqliteStore>(client(&provider), Duration::from_secs(5));
    let report = Explorer::new(
        pool,
        checkout,
        TenantId::new("acme").unwrap(),
        "/v1/checkouts",
        BODY,
    )
    .check("one order per request", |pool, case| {
        Box::pin(async move {
            let statuses: Vec<String> = sqlx::query_scalar(
                "SELECT status FROM checkout_orders WHERE tenant = ?1 AND request_key = ?2",
            )
            .bind(case.tenant.as_str())
            .bind(&case.key)
            .fetch_all(pool)
            .await
            .map_err(|error| error.to_string())?;
            match statuses.as_slice() {
                [status] if status == "paid" || status == "declined" => Ok(()),
                [status] => Err(format!("the order is left {status}")),
                orders => Err(format!("{} orders for one request", orders.len())),
            }
        })
    })
    .run(Some(&provider))
    .await;
    println!("{report}");
    assert_eq!(report.results.len(), 22);
    report.assert_all_passed();
}

/// Broken on purpose: a new provider key on every attempt, so a repeated call charges again.
struct FreshKeyCharge(ProviderClient);

#[idemflow::async_trait]
impl ForeignPhase for FreshKeyCharge {
    const NAME: &'static str = "charge";
    type Input = OrderCreated;
    type Output = ChargeOutcome;

    fn timeout(&self) -> Duration {
        Duration::from_secs(1)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        order: OrderCreated,
        _: &PhaseContext,
    ) -> Result<ChargeOutcome, PhaseError> {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let fresh = format!("{key}-{nanos}");
        match self
            .0
            .charge(
                &fresh,
                order.amount.unsigned_abs(),
                &order.currency,
                &order.source,
            )
            .await
        {
            Ok(ChargeResult::Succeeded { charge_id }) => Ok(ChargeOutcome::Paid {
                order_id: order.order_id,
                amount: order.amount,
                currency: order.currency,
                charge_id,
            }),
            Ok(ChargeResult::Declined { message, .. }) => Ok(ChargeOutcome::Declined {
                order_id: order.order_id,
                reason: message,
            }),
            Err(error) => Err(PhaseError::retryable(error.to_string())),
        }
    }
}

/// Broken on purpose: the order is inserted on a connection of its own, committed outside the
/// phase's transaction, so a crash before that transaction commits leaves an orphan order.
struct CreateOrderOutside(PgPool);

#[idemflow::async_trait]
impl LocalPhase<PgStore> for CreateOrderOutside {
    const NAME: &'static str = "create_order";
    type Input = CheckoutRequest;
    type Output = OrderCreated;

    async fn run(
        &self,
        _: &mut PgConnection,
        request: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<OrderCreated, PhaseError> {
        let (order_id,): (i64,) = sqlx::query_as(
            "INSERT INTO checkout_orders (tenant, request_key, amount, currency) VALUES ($1, $2, $3, $4) RETURNING id",
        )
        .bind(context.tenant.as_str())
        .bind(context.key.as_str())
        .bind(request.amount)
        .bind(&request.currency)
        .fetch_one(&self.0)
        .await?;
        Ok(OrderCreated {
            order_id,
            amount: request.amount,
            currency: request.currency,
            source: request.source,
        })
    }
}

/// Creates the order on the phase's connection, then commits the runner's transaction itself.
struct CreateOrderAndCommit;

#[idemflow::async_trait]
impl LocalPhase<PgStore> for CreateOrderAndCommit {
    const NAME: &'static str = "create_order";
    type Input = CheckoutRequest;
    type Output = OrderCreated;

    async fn run(
        &self,
        connection: &mut PgConnection,
        request: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<OrderCreated, PhaseError> {
        let created =
            LocalPhase::<PgStore>::run(&workflow::CreateOrder, connection, request, context)
                .await?;
        sqlx::raw_sql("COMMIT").execute(&mut *connection).await?;
        Ok(created)
    }
}

/// A phase that commits the transaction it shares with the runner: the runner ends its key with
/// a 500 rather than run it again, and the explorer says why, in every case.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_explorer_catches_a_phase_that_commits_the_runners_transaction(pool: PgPool) {
    let provider = MockProvider::start().await;
    let broken = Workflow::builder::<CheckoutRequest>("checkout-commits.v1")
        .local(CreateOrderAndCommit)
        .foreign(workflow::Charge {
            provider: client(&provider),
        })
        .local(Finish)
        .lease(Duration::from_secs(5))
        .build()
        .unwrap();
    let report = explore(&pool, broken, &provider).await;
    let caught = report
        .failed()
        .iter()
        .filter(|result| {
            result
                .failures
                .iter()
                .any(|why| why.contains("ended the runner's transaction"))
        })
        .count();
    assert!(caught >= report.results.len() / 2, "{report}");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_explorer_catches_a_fresh_provider_key_per_attempt(pool: PgPool) {
    let provider = MockProvider::start().await;
    let broken = Workflow::builder::<CheckoutRequest>("checkout-fresh-keys.v1")
        .local(workflow::CreateOrder)
        .foreign(FreshKeyCharge(client(&provider)))
        .local(Finish)
        .lease(Duration::from_secs(5))
        .build()
        .unwrap();
    let report = explore(&pool, broken, &provider).await;
    let failed = report.failed();
    assert!(
        !failed.is_empty(),
        "the explorer must report the broken workflow"
    );
    assert!(
        failed.iter().any(|result| result
            .failures
            .iter()
            .any(|why| why.contains("not a derived key"))),
        "{report}"
    );
    // A crash after the call returned repeats the call, under a new key: a second charge.
    assert!(
        failed
            .iter()
            .any(|result| result.case.scenario.to_string() == "crash after_call:charge"),
        "{report}"
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_explorer_catches_a_local_effect_outside_the_phase_transaction(pool: PgPool) {
    let provider = MockProvider::start().await;
    let broken = Workflow::builder::<CheckoutRequest>("checkout-outside.v1")
        .local(CreateOrderOutside(pool.clone()))
        .foreign(workflow::Charge {
            provider: client(&provider),
        })
        .local(Finish)
        .lease(Duration::from_secs(5))
        .build()
        .unwrap();
    let report = explore(&pool, broken, &provider).await;
    let failed = report.failed();
    // Crashing before the first commit leaves the orphan order; recovery creates a second one.
    let before_commit = failed
        .iter()
        .find(|result| result.case.scenario.to_string() == "crash before_commit:create_order")
        .unwrap_or_else(|| panic!("not caught:\n{report}"));
    assert!(
        before_commit
            .failures
            .iter()
            .any(|why| why.contains("2 orders for one request")),
        "{report}"
    );
}

/// The same cases on MariaDB: the explorer, the workflow and the check are the same code.
#[tokio::test]
async fn on_mariadb_the_checkout_survives_every_crash_point_and_provider_fault() {
    let pool = crate::support::mariadb::fresh("explore_checkout").await;
    sqlx::query(orders::MYSQL_ORDERS_TABLE)
        .execute(&pool)
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    let checkout =
        workflow::checkout::<idemflow::MySqlStore>(client(&provider), Duration::from_secs(5));
    let report = Explorer::new(
        pool,
        checkout,
        TenantId::new("acme").unwrap(),
        "/v1/checkouts",
        BODY,
    )
    .check("one order per request", |pool, case| {
        Box::pin(async move {
            let statuses: Vec<String> = sqlx::query_scalar(
                "SELECT status FROM checkout_orders WHERE tenant = ? AND request_key = ?",
            )
            .bind(case.tenant.as_str())
            .bind(&case.key)
            .fetch_all(pool)
            .await
            .map_err(|error| error.to_string())?;
            match statuses.as_slice() {
                [status] if status == "paid" || status == "declined" => Ok(()),
                [status] => Err(format!("the order is left {status}")),
                orders => Err(format!("{} orders for one request", orders.len())),
            }
        })
    })
    .run(Some(&provider))
    .await;
    println!("{report}");
    assert_eq!(report.results.len(), 22);
    report.assert_all_passed();
}
