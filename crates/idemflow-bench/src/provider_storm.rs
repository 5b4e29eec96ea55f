//! Workload 8: the duplicate storm through a real payment provider. `keys` keys, each sent
//! `duplicates` times, by `clients` clients that take the sends from one queue in order: the
//! sends of one key are consecutive there, so different clients take them at nearly the same
//! moment and they run concurrently. The workflow is the checkout (create_order, local → charge,
//! foreign → mark_paid, local) whose charge calls the testkit's mock provider over HTTP on
//! 127.0.0.1 under the derived key, so what was charged is counted by the provider's own ledger.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idemflow::core::PhaseName;
use idemflow::{
    DerivedKey, ForeignPhase, Key, Outcome, PhaseContext, PhaseError, Runner, StoredResponse,
    TenantId, Workflow,
};
use idemflow_testkit::provider::MockProvider;
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};

use crate::Error;
use crate::config::Config;
use crate::db::Scratch;
use crate::load::Latencies;
use crate::report::ProviderStorm;
use crate::workflows::{self, Charged, CheckoutRequest, CreateOrder, MarkPaid, OrderCreated};

/// The workflow's name: a checkout of its own, so the keys it claims are told apart.
pub const WORKFLOW: &str = "checkout-psp.v1";
const CURRENCY: &str = "usd";
/// The provider call's timeout (the phase's is one second longer, well inside the lease).
const PROVIDER_TIMEOUT: Duration = Duration::from_secs(10);

/// The charge at the mock provider, under the derived key.
struct ProviderCharge(ProviderClient);

#[async_trait::async_trait]
impl ForeignPhase for ProviderCharge {
    const NAME: &'static str = "charge";
    type Input = OrderCreated;
    type Output = Charged;

    fn timeout(&self) -> Duration {
        self.0.timeout() + Duration::from_secs(1)
    }

    async fn call(
        &self,
        key: &DerivedKey,
        order: OrderCreated,
        _: &PhaseContext,
    ) -> Result<Charged, PhaseError> {
        let charged = self
            .0
            .charge(
                key.as_str(),
                order.amount.unsigned_abs(),
                CURRENCY,
                &order.source,
            )
            .await;
        match charged {
            Ok(ChargeResult::Succeeded { charge_id }) => Ok(Charged {
                order_id: order.order_id,
                charge_id,
            }),
            Ok(ChargeResult::Declined { code, .. }) => {
                Err(PhaseError::terminal(format!("declined: {code}")))
            }
            Err(error) if error.is_retryable() => Err(PhaseError::retryable(error.to_string())),
            Err(error) => Err(PhaseError::terminal(error.to_string())),
        }
    }
}

/// create_order (local) → charge at the provider (foreign) → mark_paid (local).
pub fn checkout(provider: ProviderClient) -> Result<Workflow, Error> {
    Ok(Workflow::builder::<CheckoutRequest>(WORKFLOW)
        .local(CreateOrder)
        .foreign(ProviderCharge(provider))
        .local(MarkPaid)
        .build()?)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Executed,
    Replayed,
    InProgress,
    Other,
}

/// One send: its key, what came back, how long it took.
struct Sample {
    key: usize,
    kind: Kind,
    micros: u32,
    response: Option<StoredResponse>,
}

struct Engine {
    runner: Runner,
    workflow: Workflow,
    tenant: TenantId,
}

impl Engine {
    async fn send(&self, key: &str) -> Result<(Kind, Option<StoredResponse>), Error> {
        let key = Key::parse(key)?;
        let outcome = self
            .runner
            .run(&self.workflow, &self.tenant, &key, workflows::request())
            .await?;
        Ok(match outcome {
            Outcome::Executed(response) => (Kind::Executed, Some(response)),
            Outcome::Replayed(response) => (Kind::Replayed, Some(response)),
            Outcome::InProgress { .. } => (Kind::InProgress, None),
            _ => (Kind::Other, None),
        })
    }
}

fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

pub async fn run(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    prefix: &str,
) -> Result<ProviderStorm, Error> {
    let provider = MockProvider::builder().start().await?;
    let result = storm(config, scratch, tenant, prefix, &provider).await;
    provider.shutdown().await;
    result
}

async fn storm(
    config: &Config,
    scratch: &Scratch,
    tenant: &TenantId,
    prefix: &str,
    provider: &MockProvider,
) -> Result<ProviderStorm, Error> {
    let keys = config.provider_storm_keys.max(1);
    let duplicates = config.provider_storm_duplicates.max(1);
    let clients = config.provider_storm_clients.max(1);
    let client = ProviderClient::builder(provider.url())
        .timeout(PROVIDER_TIMEOUT)
        .build();
    let pool = scratch.pool(clients).await?;
    let engine = Arc::new(Engine {
        runner: Runner::new(pool.clone()),
        workflow: checkout(client)?,
        tenant: tenant.clone(),
    });

    // Warm-up: one new key per client at once (connections opened, statements prepared, the
    // provider's connections too), on keys the checks below do not look at.
    let mut warm = tokio::task::JoinSet::new();
    for client in 0..clients {
        let engine = engine.clone();
        let key = format!("{prefix}warm-{client}");
        warm.spawn(async move { engine.send(&key).await });
    }
    while let Some(joined) = warm.join_next().await {
        let (kind, _) = joined??;
        if kind != Kind::Executed {
            return Err(format!("provider storm warm-up: {kind:?} for a new key").into());
        }
    }

    let names: Arc<Vec<String>> = Arc::new((0..keys).map(|k| format!("{prefix}-{k}")).collect());
    let total = keys * duplicates;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..clients {
        let (engine, names, next) = (engine.clone(), names.clone(), next.clone());
        tasks.spawn(async move {
            let mut samples = Vec::new();
            loop {
                let send = next.fetch_add(1, Ordering::Relaxed);
                if send >= total {
                    return Ok::<_, Error>(samples);
                }
                let key = send / duplicates;
                let sent = Instant::now();
                let (kind, response) = engine.send(&names[key]).await?;
                samples.push(Sample {
                    key,
                    kind,
                    micros: u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX),
                    response,
                });
            }
        });
    }
    let mut samples = Vec::with_capacity(total);
    let mut failure = None;
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(part)) => samples.extend(part),
            Ok(Err(error)) => {
                failure.get_or_insert(error);
                tasks.abort_all();
            }
            Err(join) if join.is_cancelled() => {}
            Err(join) => {
                failure.get_or_insert_with(|| format!("a storm client failed: {join}").into());
            }
        }
    }
    let elapsed = started.elapsed();
    pool.close().await;
    if let Some(error) = failure {
        return Err(error);
    }

    // Outcomes, and each replay against its key's first answer.
    let mut executions = vec![0_u64; keys];
    let mut first: HashMap<usize, StoredResponse> = HashMap::new();
    for sample in &samples {
        if let (Kind::Executed, Some(response)) = (sample.kind, &sample.response) {
            executions[sample.key] += 1;
            first.insert(sample.key, response.clone());
        }
    }
    let replays_byte_equal = samples
        .iter()
        .filter(|sample| sample.kind == Kind::Replayed)
        .all(|sample| first.get(&sample.key) == sample.response.as_ref());
    let latencies = |kind: Kind| {
        Latencies::from_unsorted(
            samples
                .iter()
                .filter(|sample| sample.kind == kind)
                .map(|sample| sample.micros)
                .collect(),
        )
        .summary()
    };
    let count = |kind: Kind| samples.iter().filter(|sample| sample.kind == kind).count() as u64;

    // The database: one order and one finished key per key.
    let like = literal(&format!("{prefix}-%"));
    let orders = scratch
        .scalar(&format!(
            "SELECT count(*) FROM orders WHERE key LIKE {like}"
        ))
        .await?;
    let ordered_keys = scratch
        .scalar(&format!(
            "SELECT count(DISTINCT key) FROM orders WHERE key LIKE {like}"
        ))
        .await?;
    let done = scratch
        .scalar(&format!(
            "SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state = 'done'"
        ))
        .await?;

    // The provider's ledger, for the storm's derived keys only.
    let phase = PhaseName::new("charge")?;
    let mut derived = HashSet::new();
    for name in names.iter() {
        derived.insert(DerivedKey::new(tenant, &Key::parse(name)?, phase).to_string());
    }
    let mut charges: HashMap<String, u64> = HashMap::new();
    for charge in provider.charges() {
        if derived.contains(&charge.idempotency_key) {
            *charges.entry(charge.idempotency_key).or_default() += 1;
        }
    }
    let calls: Vec<usize> = derived.iter().map(|key| provider.calls_for(key)).collect();
    let provider_charges: u64 = charges.values().sum();
    let provider_calls = calls.iter().sum::<usize>() as u64;

    let keys_u64 = keys as u64;
    let once = executions.iter().all(|&count| count == 1)
        && u64::try_from(orders)? == keys_u64
        && u64::try_from(ordered_keys)? == keys_u64
        && u64::try_from(done)? == keys_u64
        && charges.len() == keys
        && charges.values().all(|&count| count == 1)
        && calls.iter().all(|&count| count == 1)
        && count(Kind::Other) == 0
        && replays_byte_equal;
    let storm = ProviderStorm {
        clients,
        keys,
        duplicates,
        requests: samples.len() as u64,
        seconds: elapsed.as_secs_f64(),
        per_second: samples.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        executed: count(Kind::Executed),
        replayed: count(Kind::Replayed),
        in_progress: count(Kind::InProgress),
        other: count(Kind::Other),
        max_executions_per_key: executions.iter().copied().max().unwrap_or(0),
        orders: u64::try_from(orders)?,
        provider_charges,
        provider_calls,
        replays_byte_equal,
        one_execution_per_key: once,
        executed_latency: latencies(Kind::Executed),
        replayed_latency: latencies(Kind::Replayed),
        in_progress_latency: latencies(Kind::InProgress),
    };
    if !once {
        return Err(format!(
            "provider storm: not one execution per key ({keys} keys): executions per key at most \
             {}, {orders} orders over {ordered_keys} keys, {done} finished, provider charges \
             {provider_charges} over {} keys, provider calls {provider_calls}, {} other outcomes, \
             replays byte-equal: {replays_byte_equal}",
            storm.max_executions_per_key,
            charges.len(),
            storm.other,
        )
        .into());
    }
    eprintln!(
        "  provider storm: {} requests in {:.2} s: {} executed, {} in progress (409), {} replayed; \
         provider charges {}",
        storm.requests,
        storm.seconds,
        storm.executed,
        storm.in_progress,
        storm.replayed,
        storm.provider_charges
    );
    Ok(storm)
}
