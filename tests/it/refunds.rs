//! The testkit beyond charges: a refunds workflow (a local phase, a refund at the mock provider
//! under its derived key, a local phase marking it done) explored at every crash point and under
//! every network fault, on every SQL engine, with the provider's own ledger of refunds counting
//! executions. No fake provider of the test's own.

use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{DerivedKey, StoredResponse, TenantId};
use idemflow_runner::{ConnectionOf, ForeignPhase, LocalPhase, PhaseContext, PhaseError, PoolOf};
use idemflow_runner::{PhaseResultExt, Workflow};
use idemflow_testkit::explorer::{Case, CheckFuture, Explorer};
use idemflow_testkit::provider::MockProvider;
use idemflow_testkit::provider_client::{ProviderClient, ProviderError};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::engines::{Lab, engines, sqlite};

engines!(a_refund_is_crash_safe_and_executed_once_per_request);

#[derive(Debug, Clone, Serialize, Deserialize)]
struct RefundRequest {
    charge: String,
    amount: i64,
}

/// Records the refund as requested (the order row of the checkout's tests, reused).
struct RecordRefund;

#[async_trait]
impl<E: Lab> LocalPhase<E> for RecordRefund {
    const NAME: &'static str = "record_refund";
    type Input = RefundRequest;
    type Output = RefundRequest;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        refund: RefundRequest,
        context: &PhaseContext,
    ) -> Result<RefundRequest, PhaseError> {
        E::insert_order(connection, context.key.as_str(), -refund.amount).await?;
        Ok(refund)
    }
}

/// The refund at the provider, under the derived key.
struct Refund {
    provider: ProviderClient,
}

#[async_trait]
impl ForeignPhase for Refund {
    const NAME: &'static str = "refund";
    type Input = RefundRequest;
    type Output = String;

    fn timeout(&self) -> Duration {
        Duration::from_secs(2)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        refund: RefundRequest,
        _: &PhaseContext,
    ) -> Result<String, PhaseError> {
        let params = json!({ "charge": refund.charge, "amount": refund.amount });
        let refunded = match self
            .provider
            .operate("refunds", key.as_str(), &params)
            .await
        {
            Ok(refunded) => refunded,
            Err(error @ ProviderError::Rejected { .. }) => return Err(error).terminal(),
            Err(error) => return Err(PhaseError::retryable(error.to_string())),
        };
        refunded["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or("the provider's refund has no id")
            .terminal()
    }
}

/// Answers with the refund.
struct Refunded;

#[async_trait]
impl<E: Lab> LocalPhase<E> for Refunded {
    const NAME: &'static str = "answer";
    type Input = String;
    type Output = StoredResponse;

    async fn run(
        &self,
        _: &mut ConnectionOf<E>,
        refund: String,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        Ok(StoredResponse::json(201, &json!({ "refund": refund })))
    }
}

const BODY: &[u8] = br#"{"charge": "ch_mock000001", "amount": 700}"#;

/// One refund row per request, whatever crashed.
fn one_refund_row<E: Lab>() -> impl for<'a> Fn(&'a PoolOf<E>, &'a Case) -> CheckFuture<'a> {
    |pool, case| {
        Box::pin(async move {
            let rows = E::orders(pool, &case.key).await;
            if rows == 1 {
                Ok(())
            } else {
                Err(format!("{rows} refund rows for one request"))
            }
        })
    }
}

async fn a_refund_is_crash_safe_and_executed_once_per_request<E: Lab>(pool: PoolOf<E>) {
    E::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let client = ProviderClient::builder(provider.url())
        .timeout(Duration::from_millis(500))
        .build();
    let workflow = Workflow::<E>::builder_on::<RefundRequest>("refund.v1")
        .local(RecordRefund)
        .foreign(Refund { provider: client })
        .local(Refunded)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let tenant = TenantId::new("t-refunds").unwrap();
    let explorer = Explorer::new(pool, workflow, tenant.clone(), "/v1/refunds", BODY)
        .check("one refund row per request", one_refund_row::<E>());
    let cases = explorer.cases().len();
    let report = explorer.run(Some(&provider)).await;
    report.assert_all_passed();
    // The provider's own ledger: one refund per request that reached it, each under the
    // request's derived key, none executed twice.
    let refunds = provider.operations_of("refunds");
    assert!(!refunds.is_empty() && refunds.len() <= cases, "{refunds:?}");
    let mut keys: Vec<&str> = refunds
        .iter()
        .map(|refund| refund.idempotency_key.as_str())
        .collect();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), refunds.len(), "{refunds:?}");
    assert!(
        refunds.iter().all(|refund| refund.id.starts_with("re_mock")
            && refund.idempotency_key.ends_with(":refund")
            && refund.params == json!({ "charge": "ch_mock000001", "amount": 700 })),
        "{refunds:?}"
    );
    assert!(provider.charges().is_empty());
}

/// The provider's rules hold for an operation as for a charge: a replay answers the first
/// execution byte for byte, other parameters (or another operation) under the key are refused,
/// and nothing refused is stored.
#[tokio::test]
async fn the_mock_provider_serves_any_operation_under_the_charges_rules() {
    let provider = MockProvider::start().await;
    let client = provider.client();
    let params = json!({ "destination": "acct_1", "amount": 300 });
    let first = client.operate("payouts", "k-1", &params).await.unwrap();
    assert_eq!(first["object"], "payout");
    assert_eq!(first["status"], "succeeded");
    assert_eq!(first["amount"], 300);
    let again = client.operate("payouts", "k-1", &params).await.unwrap();
    assert_eq!(again, first, "a replay answers the first execution");
    let other = client
        .operate(
            "payouts",
            "k-1",
            &json!({ "destination": "acct_1", "amount": 301 }),
        )
        .await;
    assert!(
        matches!(other, Err(ProviderError::IdempotencyMismatch { .. })),
        "{other:?}"
    );
    let elsewhere = client.operate("transfers", "k-1", &params).await;
    assert!(
        matches!(elsewhere, Err(ProviderError::IdempotencyMismatch { .. })),
        "{elsewhere:?}"
    );
    let not_an_object = client.operate("payouts", "k-2", &json!([1, 2])).await;
    assert!(
        matches!(
            not_an_object,
            Err(ProviderError::Rejected { status: 400, .. })
        ),
        "{not_an_object:?}"
    );
    provider.push_fault_for("k-3", idemflow_testkit::provider::Fault::ServerError(503));
    let faulted = client.operate("payouts", "k-3", &params).await;
    assert!(
        matches!(faulted, Err(ProviderError::Server { status: 503, .. })),
        "{faulted:?}"
    );
    client.operate("payouts", "k-3", &params).await.unwrap();
    assert_eq!(provider.operations_of("payouts").len(), 2);
    assert_eq!(provider.executed_keys(), ["k-1", "k-3"]);
    assert_eq!(provider.calls_for("k-1"), 4);
}
