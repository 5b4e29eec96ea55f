//! A stand-in payment provider, in process: it honours idempotency keys like a real one (the
//! same key returns the first result), so a repeated call never charges twice.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChargeResult {
    Succeeded { charge_id: String },
    Declined { reason: String },
}

#[derive(Debug, Clone, Default)]
pub struct PaymentProvider {
    charges: Arc<Mutex<HashMap<String, ChargeResult>>>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
    unavailable_once: Arc<AtomicBool>,
}

impl PaymentProvider {
    pub async fn charge(
        &self,
        idempotency_key: &str,
        amount: i64,
        currency: &str,
        source: &str,
    ) -> Result<ChargeResult, String> {
        let mut calls = self
            .calls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *calls.entry(idempotency_key.to_owned()).or_default() += 1;
        drop(calls);
        if self.unavailable_once.swap(false, Ordering::SeqCst) {
            return Err("payment provider unavailable (503)".to_owned());
        }
        let mut charges = self
            .charges
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let next = charges.len() + 1;
        let result = charges
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| match source {
                "tok_chargeDeclined" => ChargeResult::Declined {
                    reason: "card declined".to_owned(),
                },
                _ => ChargeResult::Succeeded {
                    charge_id: format!("ch_{next:06}_{amount}{currency}"),
                },
            })
            .clone();
        Ok(result)
    }

    /// Makes the next call fail as if the provider were down.
    pub fn fail_next_call(&self) {
        self.unavailable_once.store(true, Ordering::SeqCst);
    }

    /// How many calls carried this idempotency key.
    pub fn calls_with(&self, idempotency_key: &str) -> u32 {
        self.calls
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(idempotency_key)
            .copied()
            .unwrap_or(0)
    }

    /// How many distinct charges were made.
    pub fn charges_made(&self) -> usize {
        self.charges
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len()
    }
}
