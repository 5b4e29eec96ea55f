//! The checkout workflow: create the order (local), charge the card (foreign), finish (local).

use std::time::Duration;

use idemflow::{
    ConnectionOf, DerivedKey, ForeignPhase, LocalPhase, PhaseContext, PhaseError, PhaseResultExt,
    StoredResponse, Workflow,
};
use serde::{Deserialize, Serialize};

use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};

use super::orders::Shop;

/// The request body of `POST /v1/checkouts`. Its schema says what `validate` checks, so the
/// OpenAPI document and the route agree on what is a checkout.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckoutRequest {
    /// In the currency's smallest unit (cents): positive, and at most 2^53 - 1, the largest
    /// integer a JSON number holds exactly (a larger one is refused 400 before it is read).
    // MAX_AMOUNT written out: the derive takes a literal (tests/it/openapi.rs checks the two).
    #[schema(minimum = 1, maximum = 9007199254740991_i64)]
    pub amount: i64,
    /// A three-letter lowercase ISO 4217 code.
    #[schema(pattern = "^[a-z]{3}$")]
    pub currency: String,
    /// A card token: `tok_chargeDeclined` is declined (402), any other is charged. No string of
    /// a request may hold U+0000 (PostgreSQL's `jsonb` cannot store it: refused 422 on every
    /// engine, so a request means the same wherever it is stored).
    #[schema(min_length = 1, pattern = r"^[^\u0000]+$")]
    pub source: String,
}

/// The largest amount a checkout takes: 2^53 - 1, the largest integer every JSON reader holds
/// exactly. Larger ones that a double happens to hold (2^53) would run; refused instead, so the
/// route takes exactly what its schema says.
pub const MAX_AMOUNT: i64 = (1 << 53) - 1;

/// The answer to a paid checkout (201). Its fields are in the order the stored bytes have them.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CheckoutPaid {
    pub amount: i64,
    /// The provider's charge.
    pub charge_id: String,
    pub currency: String,
    pub order_id: i64,
    /// Always `paid`.
    #[schema(pattern = "^paid$")]
    pub status: String,
}

/// The checkout's own problems (402 declined, 502 provider refused): an RFC 9457 document with
/// the order it concerns.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CheckoutProblem {
    pub detail: String,
    pub order_id: i64,
    pub status: u16,
    pub title: String,
    #[serde(rename = "type")]
    #[schema(rename = "type")]
    pub kind: String,
}

impl CheckoutProblem {
    fn stored(status: u16, title: &str, detail: String, order_id: i64) -> StoredResponse {
        let problem = Self {
            detail,
            order_id,
            status,
            title: title.to_owned(),
            kind: "about:blank".to_owned(),
        };
        StoredResponse::problem(status, &to_json(&problem))
    }
}

/// A value of this module's types as JSON (it always serializes).
fn to_json(value: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(value).expect("the checkout's answers serialize")
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
                let detail = "the payment provider refused the charge request".to_owned();
                let problem = CheckoutProblem::stored(502, "Bad Gateway", detail, order.order_id);
                Err(error).terminal_with(problem)
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
                let paid = CheckoutPaid {
                    amount,
                    charge_id,
                    currency,
                    order_id,
                    status: "paid".to_owned(),
                };
                Ok(StoredResponse::json(201, &to_json(&paid)))
            }
            ChargeOutcome::Declined { order_id, reason } => {
                E::set_status(connection, order_id, "declined", None).await?;
                Ok(CheckoutProblem::stored(
                    402,
                    "Payment Required",
                    reason,
                    order_id,
                ))
            }
        }
    }
}

/// Checked before the key is claimed: a request that fails leaves nothing behind, and the client
/// may fix it and send it again under the same key.
fn validate(request: &CheckoutRequest) -> Result<(), String> {
    if request.amount <= 0 || request.amount > MAX_AMOUNT {
        return Err(format!(
            "amount must be a positive number of cents, at most {MAX_AMOUNT}"
        ));
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
