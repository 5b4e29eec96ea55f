//! The provider-storm workload: the duplicate storm through a real payment provider. `keys`
//! keys, each sent `duplicates` times, by `clients` clients that take the sends from one queue in
//! order: the sends of one key are consecutive there, so different clients take them at nearly
//! the same moment and they run concurrently. The workflow is the checkout (create_order, local →
//! charge, foreign → mark_paid, local) whose charge calls the testkit's mock provider over HTTP on
//! 127.0.0.1 under the derived key, so what was charged is counted by the provider's own ledger.

use idemflow::PgStore;
use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
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
use crate::db::{Scratch, literal};
use crate::load::Latencies;
use crate::report::{ProviderStorm, Report, Target, triple};
use crate::workflows::{self, Charged, CheckoutRequest, CreateOrder, MarkPaid, OrderCreated};
use crate::workloads::{BoxFuture, Ctx, Runs, Workload};

pub(crate) const WORKLOAD: Workload = Workload {
    name: "provider-storm",
    number: Some(8),
    measures: "a duplicate storm through the checkout and a mock payment provider over HTTP",
    runs: Runs::Once(run),
    targets: Some(targets),
    section: Some(section),
};

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
pub fn checkout(provider: ProviderClient) -> Result<Workflow<PgStore>, Error> {
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
    runner: Runner<PgStore>,
    workflow: Workflow<PgStore>,
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

fn run<'a>(ctx: &'a Ctx<'a>, report: &'a mut Report) -> BoxFuture<'a, ()> {
    Box::pin(async move {
        let config = ctx.config;
        eprintln!(
            "  {} keys × {} sends, {} clients",
            config.provider_storm_keys,
            config.provider_storm_duplicates,
            config.provider_storm_clients
        );
        let prefix = ctx.prefix("provider-storm");
        let provider = MockProvider::builder().start().await?;
        let result = storm(config, ctx.scratch, &ctx.tenant, &prefix, &provider).await;
        provider.shutdown().await;
        report.provider_storm = Some(result?);
        Ok(())
    })
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
    let names: Arc<Vec<String>> = Arc::new((0..keys).map(|k| format!("{prefix}-{k}")).collect());
    let sent = async {
        warm_up(&engine, clients, prefix).await?;
        send(&engine, &names, duplicates, clients).await
    }
    .await;
    pool.close().await;
    let (samples, elapsed) = sent?;
    let answers = Answers::of(&samples, keys);
    let rows = Rows::count(scratch, prefix).await?;
    let ledger = Ledger::read(provider, tenant, &names)?;
    let storm = summary(clients, keys, duplicates, elapsed, &answers, &rows, &ledger)?;
    if !storm.one_execution_per_key {
        return Err(format!(
            "provider storm: not one execution per key ({keys} keys): executions per key at most \
             {}, {} orders over {} keys, {} finished, provider charges {} over {} keys, provider \
             calls {}, {} other outcomes, replays byte-equal: {}",
            storm.max_executions_per_key,
            rows.orders,
            rows.ordered_keys,
            rows.done,
            ledger.charges.values().sum::<u64>(),
            ledger.charges.len(),
            storm.provider_calls,
            storm.other,
            storm.replays_byte_equal,
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

/// One new key per client at once (connections opened, statements prepared, the provider's
/// connections too), on keys the checks do not look at.
async fn warm_up(engine: &Arc<Engine>, clients: usize, prefix: &str) -> Result<(), Error> {
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
    Ok(())
}

/// The storm: `clients` clients take the sends from one queue, each key's `duplicates` sends in
/// a row; every send's answer, and how long the storm took.
async fn send(
    engine: &Arc<Engine>,
    names: &Arc<Vec<String>>,
    duplicates: usize,
    clients: usize,
) -> Result<(Vec<Sample>, Duration), Error> {
    let total = names.len() * duplicates;
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
    match failure {
        Some(error) => Err(error),
        None => Ok((samples, started.elapsed())),
    }
}

/// What the clients were answered: executions per key, and each replay against its key's
/// first answer.
struct Answers<'a> {
    samples: &'a [Sample],
    executions: Vec<u64>,
    replays_byte_equal: bool,
}

impl<'a> Answers<'a> {
    fn of(samples: &'a [Sample], keys: usize) -> Self {
        let mut executions = vec![0_u64; keys];
        let mut first: HashMap<usize, StoredResponse> = HashMap::new();
        for sample in samples {
            if let (Kind::Executed, Some(response)) = (sample.kind, &sample.response) {
                executions[sample.key] += 1;
                first.insert(sample.key, response.clone());
            }
        }
        let replays_byte_equal = samples
            .iter()
            .filter(|sample| sample.kind == Kind::Replayed)
            .all(|sample| first.get(&sample.key) == sample.response.as_ref());
        Self {
            samples,
            executions,
            replays_byte_equal,
        }
    }

    fn count(&self, kind: Kind) -> u64 {
        self.samples
            .iter()
            .filter(|sample| sample.kind == kind)
            .count() as u64
    }

    fn latencies(&self, kind: Kind) -> crate::LatencySummary {
        Latencies::from_unsorted(
            self.samples
                .iter()
                .filter(|sample| sample.kind == kind)
                .map(|sample| sample.micros)
                .collect(),
        )
        .summary()
    }
}

/// The database after the storm: orders and finished keys of the storm's keys.
struct Rows {
    orders: u64,
    ordered_keys: u64,
    done: u64,
}

impl Rows {
    async fn count(scratch: &Scratch, prefix: &str) -> Result<Self, Error> {
        let like = literal(&format!("{prefix}-%"));
        let count = |sql: String| async move {
            Ok::<_, Error>(u64::try_from(scratch.scalar(&sql).await?)?)
        };
        Ok(Self {
            orders: count(format!("SELECT count(*) FROM orders WHERE key LIKE {like}")).await?,
            ordered_keys: count(format!(
                "SELECT count(DISTINCT key) FROM orders WHERE key LIKE {like}"
            ))
            .await?,
            done: count(format!(
                "SELECT count(*) FROM idempotency_keys WHERE key LIKE {like} AND state = 'done'"
            ))
            .await?,
        })
    }
}

/// The provider's own ledger, for the storm's derived keys only: charges and calls per key.
struct Ledger {
    charges: HashMap<String, u64>,
    calls: Vec<usize>,
}

impl Ledger {
    fn read(provider: &MockProvider, tenant: &TenantId, names: &[String]) -> Result<Self, Error> {
        let phase = PhaseName::new("charge")?;
        let mut derived = HashSet::new();
        for name in names {
            derived.insert(DerivedKey::new(tenant, &Key::parse(name)?, phase).to_string());
        }
        let mut charges: HashMap<String, u64> = HashMap::new();
        for charge in provider.charges() {
            if derived.contains(&charge.idempotency_key) {
                *charges.entry(charge.idempotency_key).or_default() += 1;
            }
        }
        let calls = derived.iter().map(|key| provider.calls_for(key)).collect();
        Ok(Self { charges, calls })
    }
}

/// The storm's figures; `one_execution_per_key` when every key executed, ordered, finished and
/// was charged and called exactly once, nothing else was answered, and every replay was
/// byte-equal to its key's first answer.
fn summary(
    clients: usize,
    keys: usize,
    duplicates: usize,
    elapsed: Duration,
    answers: &Answers<'_>,
    rows: &Rows,
    ledger: &Ledger,
) -> Result<ProviderStorm, Error> {
    let keys_u64 = keys as u64;
    let once = answers.executions.iter().all(|&count| count == 1)
        && rows.orders == keys_u64
        && rows.ordered_keys == keys_u64
        && rows.done == keys_u64
        && ledger.charges.len() == keys
        && ledger.charges.values().all(|&count| count == 1)
        && ledger.calls.iter().all(|&count| count == 1)
        && answers.count(Kind::Other) == 0
        && answers.replays_byte_equal;
    let requests = answers.samples.len();
    Ok(ProviderStorm {
        clients,
        keys,
        duplicates,
        requests: requests as u64,
        seconds: elapsed.as_secs_f64(),
        per_second: requests as f64 / elapsed.as_secs_f64().max(1e-9),
        executed: answers.count(Kind::Executed),
        replayed: answers.count(Kind::Replayed),
        in_progress: answers.count(Kind::InProgress),
        other: answers.count(Kind::Other),
        max_executions_per_key: answers.executions.iter().copied().max().unwrap_or(0),
        orders: rows.orders,
        provider_charges: ledger.charges.values().sum(),
        provider_calls: ledger.calls.iter().sum::<usize>() as u64,
        replays_byte_equal: answers.replays_byte_equal,
        one_execution_per_key: once,
        executed_latency: answers.latencies(Kind::Executed),
        replayed_latency: answers.latencies(Kind::Replayed),
        in_progress_latency: answers.latencies(Kind::InProgress),
    })
}

/// Exactly one execution per key; as many provider charges and orders as keys.
fn targets(report: &Report, targets: &mut Vec<Target>) {
    let Some(storm) = &report.provider_storm else {
        return;
    };
    targets.push(Target::exactly_once(
        "8 provider storm: executions per key".to_owned(),
        storm.one_execution_per_key,
    ));
    targets.push(Target {
        name: "8 provider storm: provider charges = orders = keys".to_owned(),
        measured: format!("{} = {}", storm.provider_charges, storm.orders),
        target: format!("{}", storm.keys),
        met: Some(storm.provider_charges == storm.keys as u64 && storm.orders == storm.keys as u64),
    });
}

fn section(report: &Report, out: &mut String) {
    let Some(storm) = &report.provider_storm else {
        return;
    };
    let _ = writeln!(
        out,
        "\nduplicate storm through the mock provider (8): {} keys × {} sends from {} clients = {} \
         requests in {:.2} s ({:.0}/s): {} executed, {} answered 409 in progress, {} replayed, {} other",
        storm.keys,
        storm.duplicates,
        storm.clients,
        storm.requests,
        storm.seconds,
        storm.per_second,
        storm.executed,
        storm.in_progress,
        storm.replayed,
        storm.other
    );
    let _ = writeln!(
        out,
        "  orders {}, provider charges {} (calls {}), executions per key at most {}, replays \
         byte-equal: {}; one execution per key: {}",
        storm.orders,
        storm.provider_charges,
        storm.provider_calls,
        storm.max_executions_per_key,
        storm.replays_byte_equal,
        storm.one_execution_per_key
    );
    let _ = writeln!(
        out,
        "  latency p50/p99/max ms: first runs {}, replays {}, 409s {}",
        triple(&storm.executed_latency),
        triple(&storm.replayed_latency),
        triple(&storm.in_progress_latency)
    );
}
