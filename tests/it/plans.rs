//! The plans PostgreSQL keeps for the engine's statements. A prepared statement runs on a generic
//! plan after its fifth execution (`plan_cache_mode = auto`), and that plan never learns the
//! key. The partial index of started keys (`idempotency_keys_started_lease`, `WHERE state =
//! 'started'`) then looked cheaper than the primary key to every write that named a key *and*
//! `state = 'started'`: few keys are started at once. But every key that finished leaves its
//! entry in that index until a vacuum, so such a write scanned every key finished since the last
//! one. Under load the advance, the finish and the takeover took hundreds of milliseconds each,
//! and new keys ran at a few percent of the raw rate (`scripts/bench`).
//!
//! So the writes of one key say `state <> 'done'` (the same rows: a key is `started` or `done`),
//! which no partial index's predicate follows from, and this test holds every statement the
//! runner, the resumer and the operator prepare to the primary key, on generic plans.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse};
use idemflow_pg::PgStore;
use idemflow_runner::{
    ConnectionOf, CrashPoint, Engine, LocalPhase, Outcome, PhaseContext, PhaseError, Registry,
    Resumer, Runner, RunnerConfig, TerminalPolicy, Workflow,
};
use idemflow_store::Tamper as _;
use idemflow_testkit::provider::MockProvider;
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::engines::{
    BODY, Charge, Checkout, CrashOnce, CreateOrder, Lab, checkout, request, tenant,
};

/// Fails terminally after the charge: under the forget policy, its owner deletes the key.
struct FailsTerminally;

#[async_trait]
impl LocalPhase<PgStore> for FailsTerminally {
    const NAME: &'static str = "answer";
    type Input = String;
    type Output = StoredResponse;

    async fn run(
        &self,
        _: &mut ConnectionOf<PgStore>,
        _: String,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        Err(PhaseError::terminal("the card was reported stolen"))
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn every_statement_on_one_key_finds_it_by_its_primary_key_on_a_generic_plan(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    every_statement_on_one_key_uses_the_primary_key(connect, false).await;
}

/// The same on the partitioned layout, whose partitions carry the same partial indexes.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn on_the_partitioned_layout_every_statement_on_one_key_uses_the_primary_key(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    every_statement_on_one_key_uses_the_primary_key(connect, true).await;
}

async fn every_statement_on_one_key_uses_the_primary_key(
    connect: PgConnectOptions,
    partitioned: bool,
) {
    // One connection, every plan generic from the first execution: what a pooled connection
    // keeps after five.
    let options = connect.options([("plan_cache_mode", "force_generic_plan")]);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .unwrap();
    if partitioned {
        idemflow_pg::partitions::adopt(&pool, &idemflow_pg::partitions::PartitionPlan::default())
            .await
            .unwrap();
    }
    PgStore::create_orders(&pool).await;
    let provider = MockProvider::start().await;
    let config = RunnerConfig::default().with_warm_connections(false);
    let runner = Runner::<PgStore>::on(pool.clone(), config.clone());

    // A checkout: the look-up, the claim, an advance, the finish; then its replay.
    let workflow = checkout::<PgStore>(&provider);
    let key = Key::parse("plans-1").unwrap();
    let first = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(matches!(first, Ok(Outcome::Executed(_))), "{first:?}");
    // A key stopped before its call (a run that crashes there, as a process would).
    let stop_before_call = |key: &'static str| {
        let crashing = Runner::<PgStore>::on(pool.clone(), config.clone()).with_crash_hook(
            Arc::new(CrashOnce {
                point: CrashPoint::BeforeCall { phase: "charge" },
                armed: AtomicBool::new(true),
            }),
        );
        let workflow = &workflow;
        async move {
            let key = Key::parse(key).unwrap();
            let _ = crashing.run(workflow, &tenant(), &key, request(BODY)).await;
            key
        }
    };
    // Taken over by a resumer (the scan, the fence confirmed, the call, the finish).
    stop_before_call("plans-2").await;
    PgStore::lapse_leases(&pool, None).await.unwrap();
    let mut registry = Registry::<PgStore>::new();
    registry.register(checkout::<PgStore>(&provider)).unwrap();
    Resumer::new(runner.clone(), registry)
        .drain()
        .await
        .unwrap();
    // The same, taken over by the client's retry instead.
    let key = stop_before_call("plans-3").await;
    PgStore::lapse_leases(&pool, None).await.unwrap();
    let retried = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(matches!(retried, Ok(Outcome::Executed(_))), "{retried:?}");
    // A terminal failure under the forget policy: the owner deletes its key.
    let forgetting = Runner::<PgStore>::on(
        pool.clone(),
        config.clone().with_terminal_errors(TerminalPolicy::Forget),
    );
    let failing = Workflow::<PgStore>::builder_on::<Checkout>("plans-failing.v1")
        .local(CreateOrder)
        .foreign(Charge {
            provider: provider.client(),
        })
        .local(FailsTerminally)
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let key = Key::parse("plans-4").unwrap();
    let _ = forgetting
        .run(&failing, &tenant(), &key, request(BODY))
        .await;
    // A provider's 503: the attempt is postponed.
    provider.push_fault(idemflow_testkit::provider::Fault::ServerError(503));
    let key = Key::parse("plans-6").unwrap();
    let postponed = runner.run(&workflow, &tenant(), &key, request(BODY)).await;
    assert!(
        matches!(postponed, Ok(Outcome::Interrupted { .. })),
        "{postponed:?}"
    );
    // An operator ends a live lease (forced).
    let key = stop_before_call("plans-5").await;
    let report = PgStore::operator(&pool)
        .key_report(tenant().as_str(), key.as_str())
        .await
        .unwrap()
        .expect("the stopped key is there");
    PgStore::operator(&pool)
        .end_lease(tenant().as_str(), key.as_str(), report.lock_version)
        .await
        .unwrap();

    // Every statement this connection prepared that names one key: its generic plan. (Not the
    // test's own lease rewind, which names every started key or one, `$1 IS NULL OR …`.)
    let mut connection = pool.acquire().await.unwrap();
    let prepared: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT name, statement, coalesce(cardinality(parameter_types), 0)::bigint \
         FROM pg_prepared_statements \
         WHERE statement LIKE '%idempotency_keys%' AND statement ~ 'key = \\$[0-9]' \
           AND statement NOT LIKE '%IS NULL OR%'",
    )
    .fetch_all(&mut *connection)
    .await
    .unwrap();
    let mut checked = 0;
    for (name, statement, parameters) in &prepared {
        let nulls = vec!["NULL"; usize::try_from(*parameters).unwrap()].join(", ");
        let execute = if nulls.is_empty() {
            format!("EXECUTE {name}")
        } else {
            format!("EXECUTE {name}({nulls})")
        };
        let plan: Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN (FORMAT JSON) {execute}"
        )))
        .fetch_one(&mut *connection)
        .await
        .unwrap();
        let indexes = index_names(&plan);
        assert!(
            !indexes.is_empty() && indexes.iter().all(|index| index.ends_with("pkey")),
            "a statement on one key scans {indexes:?} on its generic plan:\n{statement}\n{plan}"
        );
        checked += 1;
    }
    // The look-up, the key's report, the advance, the finish, the takeover, the postpone, the
    // delete and the end of a lease, at least.
    assert!(checked >= 8, "{prepared:#?}");
}

/// Every index a plan scans, by name.
fn index_names(plan: &Value) -> Vec<String> {
    let mut names = Vec::new();
    let mut stack = vec![plan];
    while let Some(node) = stack.pop() {
        match node {
            Value::Object(fields) => {
                if let Some(Value::String(name)) = fields.get("Index Name") {
                    names.push(name.clone());
                }
                stack.extend(fields.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    names
}
