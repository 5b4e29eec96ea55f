//! What an operator reads in the logs without polling anything: a resumer's takeover at INFO and
//! a give-up, each with the tenant and key of its request as fields, under the one-line subscriber
//! the README's program installs (`tracing_subscriber::fmt`, INFO and up).

use std::sync::{Arc, Mutex, PoisonError};

use async_trait::async_trait;
use idemflow_core::{Key, StoredResponse};
use idemflow_runner::{
    ConnectionOf, LocalPhase, Outcome, PhaseContext, PhaseError, Registry, Resumer, RetryPolicy,
    Runner, RunnerConfig, Workflow,
};
use idemflow_sqlite::SqliteStore;
use idemflow_store::Tamper as _;

use crate::engines::{BODY, Checkout, Lab, request, sqlite, tenant};

/// Everything the subscriber wrote, shared with the test.
#[derive(Clone, Default)]
struct Written(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Written {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Written {
    fn lines_with(&self, text: &str) -> Vec<String> {
        let bytes = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|line| line.contains(text))
            .map(str::to_owned)
            .collect()
    }
}

/// Fails its first run (the key is postponed, for a resumer to take over), succeeds after.
struct FailsOnce(std::sync::atomic::AtomicBool);

#[async_trait]
impl LocalPhase<SqliteStore> for FailsOnce {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = StoredResponse;

    async fn run(
        &self,
        connection: &mut ConnectionOf<SqliteStore>,
        checkout: Checkout,
        context: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        if self.0.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Err(PhaseError::retryable(
                "the provider's database is restarting",
            ));
        }
        SqliteStore::insert_order(connection, context.key.as_str(), checkout.amount).await?;
        Ok(StoredResponse::new(201, "ordered"))
    }
}

/// Never succeeds, and has one attempt: its first failure is the give-up.
struct AlwaysFails;

#[async_trait]
impl LocalPhase<SqliteStore> for AlwaysFails {
    const NAME: &'static str = "create_order";
    type Input = Checkout;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::default().with_max_attempts(1)
    }

    async fn run(
        &self,
        _: &mut ConnectionOf<SqliteStore>,
        _: Checkout,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        Err(PhaseError::retryable("the card network is down"))
    }
}

#[tokio::test]
async fn a_resumers_takeover_and_a_give_up_are_logged_with_their_tenant_and_key() {
    let written = Written::default();
    let writer = written.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // This test's thread only: the runtime is the test's one thread.
    let _logging = tracing::subscriber::set_default(subscriber);

    let pool = sqlite("logs_takeover_and_give_up").await;
    SqliteStore::create_orders(&pool).await;
    let resumed = std::sync::Arc::new(
        Workflow::<SqliteStore>::builder_on::<Checkout>("logged.v1")
            .local(FailsOnce(std::sync::atomic::AtomicBool::new(true)))
            .build()
            .unwrap(),
    );
    let runner = Runner::<SqliteStore>::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("resumed-key").unwrap();
    let first = runner.run(&resumed, &tenant(), &key, request(BODY)).await;
    assert!(
        matches!(first, Ok(Outcome::Interrupted { .. })),
        "{first:?}"
    );
    SqliteStore::lapse_leases(&pool, None).await.unwrap();
    let mut registry = Registry::<SqliteStore>::new();
    registry.register(resumed).unwrap();
    Resumer::new(runner.clone(), registry)
        .drain()
        .await
        .unwrap();
    let taken = written.lines_with("a resumer took over the key");
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert!(taken[0].contains(" INFO "), "{taken:?}");
    assert!(taken[0].contains("tenant=t-engines"), "{taken:?}");
    assert!(taken[0].contains("key=resumed-key"), "{taken:?}");

    let given_up = Workflow::<SqliteStore>::builder_on::<Checkout>("given-up.v1")
        .local(AlwaysFails)
        .build()
        .unwrap();
    let key = Key::parse("given-up-key").unwrap();
    let answered = runner.run(&given_up, &tenant(), &key, request(BODY)).await;
    assert!(
        matches!(&answered, Ok(Outcome::Executed(response)) if response.status == 500),
        "{answered:?}"
    );
    let gave_up = written.lines_with("giving up");
    assert_eq!(gave_up.len(), 1, "{gave_up:?}");
    assert!(gave_up[0].contains("tenant=t-engines"), "{gave_up:?}");
    assert!(gave_up[0].contains("key=given-up-key"), "{gave_up:?}");
}
