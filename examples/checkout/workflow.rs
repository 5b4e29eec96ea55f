//! The checkout workflow: create the order (local), charge the card (foreign), finish (local).

use std::time::Duration;

use idemflow::{
    ConnectionOf, DerivedKey, ForeignPhase, LocalPhase, PhaseContext, PhaseError, PhaseResultExt,
    StoredResponse, Workflow,
};
use serde::{Deserialize, Serialize};

use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};

use super::orders::Shop;

/// The request body of `POST /v1/checkouts`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckoutRequest {
    /// In the currency's smallest unit (cents).
    pub amount: i64,
    pub currency: String,
    /// A card token.
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderCreated {
    pub order_id: i64,
    pub amount: i64,
    pub currency: String,
    pub source: String,
}

/// What the charge phase learned. A declined card is an outcome, not an error.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ChargeOutcome {
    Paid {
        order_id: i64,
        amount: i64,
        currency: String,
        charge_id: String,
    },
    Declined {
        order_id: i64,
        reason: String,
    },
}

pub struct CreateOrder;

#[idemflow::async_trait]
impl<E: Shop> LocalPhase<E> for CreateOrder {
    const NAME: &'static str = "create_order";
    type Input = CheckoutRequest;
    type Output = OrderCreated;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        request: CheckoutRequest,
        context: &PhaseContext,
    ) -> Result<OrderCreated, PhaseError> {
        let order_id = E::insert_order(
            connection,
            context.tenant.as_str(),
            context.key.as_str(),
            request.amount,
            &request.currency,
        )
        .await?;
        Ok(OrderCreated {
            order_id,
            amount: request.amount,
            currency: request.currency,
            source: request.source,
        })
    }
}

/// Charges the card at the payment provider, with the derived key as its idempotency key.
pub struct Charge {
    pub provider: ProviderClient,
}

#[idemflow::async_trait]
impl ForeignPhase for Charge {
    const NAME: &'static str = "charge";
    type Input = OrderCreated;
    type Output = ChargeOutcome;

    /// Shorter than the workflow's lease (checked when it is built).
    fn timeout(&self) -> Duration {
        self.provider.timeout() + Duration::from_secs(1)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        order: OrderCreated,
        _: &PhaseContext,
    ) -> Result<ChargeOutcome, PhaseError> {
        // The derived key makes a repeated call (after a crash or a takeover) return the first
        // charge instead of charging again.
        let result = self
            .provider
            .charge(
                key.as_str(),
                // Positive: checked by `validate` before the key was claimed.
                order.amount.unsigned_abs(),
                &order.currency,
                &order.source,
            )
            .await;
        match result {
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
            // Unavailable, rate limited, timed out, connection lost: the same key finds out
            // later whether the charge happened. Retryable, at the provider's pace if it said.
            Err(error) if error.is_retryable() => match error.retry_after() {
                Some(wait) => Err(error).retry_after(wait),
                None => Err(error.into()),
            },
            // The provider refused the request itself: retrying cannot help.
            Err(error) => {
                let problem = serde_json::json!({
                    "type": "about:blank", "title": "Bad Gateway", "status": 502,
                    "detail": "the payment provider refused the charge request", "order_id": order.order_id,
                });
                Err(error).terminal_with(StoredResponse::problem(502, &problem))
            }
        }
    }
}

pub struct Finish;

#[idemflow::async_trait]
impl<E: Shop> LocalPhase<E> for Finish {
    const NAME: &'static str = "finish";
    type Input = ChargeOutcome;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut ConnectionOf<E>,
        outcome: ChargeOutcome,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        match outcome {
            ChargeOutcome::Paid {
                order_id,
                amount,
                currency,
                charge_id,
            } => {
                E::set_status(connection, order_id, "paid", Some(&charge_id)).await?;
                let body = serde_json::json!({
                    "order_id": order_id, "charge_id": charge_id, "amount": amount,
                    "currency": currency, "status": "paid",
                });
                Ok(StoredResponse::json(201, &body))
            }
            ChargeOutcome::Declined { order_id, reason } => {
                E::set_status(connection, order_id, "declined", None).await?;
                let problem = serde_json::json!({
                    "type": "about:blank", "title": "Payment Required", "status": 402,
                    "detail": reason, "order_id": order_id,
                });
                Ok(StoredResponse::problem(402, &problem))
            }
        }
    }
}

/// Checked before the key is claimed: a request that fails leaves nothing behind, and the client
/// may fix it and send it again under the same key.
fn validate(request: &CheckoutRequest) -> Result<(), String> {
    if request.amount <= 0 {
        return Err("amount must be a positive number of cents".to_owned());
    }
    if request.currency.len() != 3
        || !request
            .currency
            .bytes()
            .all(|byte| byte.is_ascii_lowercase())
    {
        return Err("currency must be a three-letter lowercase ISO 4217 code".to_owned());
    }
    if request.source.is_empty() {
        return Err("source must name a card token".to_owned());
    }
    Ok(())
}

/// The checkout workflow on engine `E`, charging through `provider`; `lease` must exceed the
/// provider's timeout.
pub fn checkout<E: Shop>(provider: ProviderClient, lease: Duration) -> Workflow<E> {
    Workflow::<E>::builder_on::<CheckoutRequest>("checkout.v1")
        .validate(validate)
        .local(CreateOrder)
        .foreign(Charge { provider })
        .local(Finish)
        .lease(lease)
        .build()
        .expect("the checkout workflow is valid")
}
