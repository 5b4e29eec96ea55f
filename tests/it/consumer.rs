//! The idempotent consumer (crates/idemflow-consumer, docs/consumer.md): a message is applied at
//! most once per subscriber, however often it is delivered.
//!
//! In-process, on a real PostgreSQL: duplicates, a reused id with another payload, subscribers
//! applying one message each, two deliveries of one message in flight at once, failures and
//! crashes before the commit, retention.
//!
//! On a real RabbitMQ (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`): the example
//! consumer (`examples/consumer`) as a process, SIGKILLed at a crash point between its commit and
//! its ack, or between its effects and its commit, while a few thousand messages (with duplicates
//! the publisher injected) flow; the broker redelivers, and every message is applied once. Each
//! test has a queue of its own, deleted at the end. Without a broker these tests fail, saying so:
//! they are never skipped.

use idemflow::PgStore;
use idemflow::consumer::ConsumerStore;
use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idemflow::consumer::{
    Consumer, ConsumerCrashHook, ConsumerCrashPoint, ConsumerError, Handler, HandlerError, Message,
    MessageRetention, Processed, Subscriber, expire_processed,
};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use tokio::sync::Notify;

use crate::support::example::database_url;

// ------------------------------------------------------------------------------ in process ---

const EFFECTS_TABLE: &str = "CREATE TABLE effects (subscriber text NOT NULL, \
    message_id text NOT NULL, payload bytea NOT NULL)";

/// Records each run as a row of `effects`, which has no unique constraint: a message applied
/// twice shows as two rows. Optionally waits at a gate first, or fails.
#[derive(Default)]
struct Effects {
    /// Told when a run has written its effect (its transaction still open).
    entered: Notify,
    /// When set, a run waits for `release` after writing its effect.
    gate: Option<Notify>,
    /// When set, a run fails after writing its effect.
    fail: std::sync::atomic::AtomicBool,
}

#[idemflow::async_trait]
impl Handler<PgStore> for Effects {
    async fn handle(
        &self,
        connection: &mut PgConnection,
        message: &Message,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (subscriber, message_id, payload) VALUES ('', $1, $2)")
            .bind(message.id())
            .bind(message.payload())
            .execute(&mut *connection)
            .await?;
        self.entered.notify_one();
        if let Some(gate) = &self.gate {
            gate.notified().await;
        }
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the handler failed after its effect".into());
        }
        Ok(())
    }
}

/// A handler that records which subscriber ran it, through its own name.
struct Named(&'static str);

#[idemflow::async_trait]
impl Handler<PgStore> for Named {
    async fn handle(
        &self,
        connection: &mut PgConnection,
        message: &Message,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (subscriber, message_id, payload) VALUES ($1, $2, $3)")
            .bind(self.0)
            .bind(message.id())
            .bind(message.payload())
            .execute(connection)
            .await?;
        Ok(())
    }
}

async fn effects(pool: &PgPool, message_id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE message_id = $1")
        .bind(message_id)
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn recorded(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM processed_messages")
        .fetch_one(pool)
        .await
        .unwrap()
}

fn consumer(pool: &PgPool, subscriber: &str) -> Consumer<PgStore> {
    Consumer::new(pool.clone(), Subscriber::new(subscriber).unwrap())
}

fn message(id: &str, payload: &str) -> Message {
    Message::new(id, payload.as_bytes().to_vec()).unwrap()
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_duplicate_is_recognised_and_a_reused_id_with_another_payload_is_refused(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let first = message("m-1", r#"{"amount": 10}"#);
    let handler = Effects::default();

    assert_eq!(
        consumer.process(&handler, &first).await.unwrap(),
        Processed::Applied
    );
    assert_eq!(
        consumer.process(&handler, &first).await.unwrap(),
        Processed::Duplicate
    );
    let reused = message("m-1", r#"{"amount": 99}"#);
    let refused = consumer.process(&handler, &reused).await.unwrap_err();
    let ConsumerError::PayloadMismatch {
        subscriber,
        message_id,
        stored,
        received,
    } = &refused
    else {
        panic!("expected a payload mismatch, got {refused:?}");
    };
    assert_eq!(
        (subscriber.as_str(), message_id.as_str()),
        ("ledger", "m-1")
    );
    assert_ne!(stored, received);
    assert!(refused.to_string().contains("another payload"), "{refused}");
    // The refusal ran nothing and changed nothing: the first payload's effect, once.
    assert_eq!(effects(&pool, "m-1").await, 1);
    let payload: Vec<u8> = sqlx::query_scalar("SELECT payload FROM effects")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(payload, br#"{"amount": 10}"#);
    // And it stays refused: the first payload is still the one recognised.
    assert_eq!(
        consumer.process(&handler, &first).await.unwrap(),
        Processed::Duplicate
    );
    assert!(matches!(
        consumer.process(&handler, &reused).await,
        Err(ConsumerError::PayloadMismatch { .. })
    ));
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn each_subscriber_applies_a_message_once(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let ledger = consumer(&pool, "ledger");
    let search = consumer(&pool, "search-index");
    let message = message("m-7", "{}");
    for _ in 0..3 {
        let applied = ledger.process(&Named("ledger"), &message).await.unwrap();
        let indexed = search
            .process(&Named("search-index"), &message)
            .await
            .unwrap();
        assert!(matches!(
            (applied, indexed),
            (Processed::Applied, Processed::Applied) | (Processed::Duplicate, Processed::Duplicate)
        ));
    }
    let by_subscriber: Vec<(String, i64)> = sqlx::query_as(
        "SELECT subscriber, count(*) FROM effects GROUP BY subscriber ORDER BY subscriber",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        by_subscriber,
        [("ledger".to_owned(), 1), ("search-index".to_owned(), 1)]
    );
    assert_eq!(recorded(&pool).await, 2);
    // One subscriber's record says nothing about another's payload: a projection that has not
    // seen the message yet applies it whatever the others stored.
    let other = consumer(&pool, "audit");
    assert_eq!(
        other
            .process(&Named("audit"), &self::message("m-7", "{}"))
            .await
            .unwrap(),
        Processed::Applied
    );
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_second_delivery_in_flight_waits_for_the_first_and_is_a_duplicate(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let held = Arc::new(Effects {
        gate: Some(Notify::new()),
        ..Effects::default()
    });
    let message = message("m-race", "{}");

    let first = tokio::spawn({
        let (consumer, held, message) = (consumer.clone(), Arc::clone(&held), message.clone());
        async move { consumer.process(&*held, &message).await }
    });
    // The first delivery wrote its effect; its transaction (with the identity) is open.
    held.entered.notified().await;
    let second = tokio::spawn({
        let (consumer, message) = (consumer.clone(), message.clone());
        async move { consumer.process(&Effects::default(), &message).await }
    });
    // The second is blocked on the first's uncommitted identity: it neither runs nor answers.
    wait_for_a_lock_wait(&pool).await;
    assert!(!second.is_finished());
    assert_eq!(effects(&pool, "m-race").await, 0, "nothing committed yet");

    held.gate.as_ref().unwrap().notify_one();
    assert_eq!(first.await.unwrap().unwrap(), Processed::Applied);
    assert_eq!(second.await.unwrap().unwrap(), Processed::Duplicate);
    assert_eq!(effects(&pool, "m-race").await, 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_delivery_waiting_on_one_that_rolls_back_applies_the_message_itself(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let failing = Arc::new(Effects {
        gate: Some(Notify::new()),
        ..Effects::default()
    });
    failing
        .fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let message = message("m-rolled-back", "{}");

    let first = tokio::spawn({
        let (consumer, failing, message) =
            (consumer.clone(), Arc::clone(&failing), message.clone());
        async move { consumer.process(&*failing, &message).await }
    });
    failing.entered.notified().await;
    let second = tokio::spawn({
        let (consumer, message) = (consumer.clone(), message.clone());
        async move { consumer.process(&Effects::default(), &message).await }
    });
    wait_for_a_lock_wait(&pool).await;
    failing.gate.as_ref().unwrap().notify_one();

    assert!(matches!(
        first.await.unwrap(),
        Err(ConsumerError::Handler(_))
    ));
    assert_eq!(second.await.unwrap().unwrap(), Processed::Applied);
    assert_eq!(effects(&pool, "m-rolled-back").await, 1);
    assert_eq!(recorded(&pool).await, 1);
}

/// Waits until some session of the test's database waits on a lock (the second delivery's insert
/// behind the first's uncommitted identity).
async fn wait_for_a_lock_wait(pool: &PgPool) {
    for _ in 0..200 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no delivery ever waited on the first one's identity");
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_delivery_held_past_the_wait_limit_is_told_so_and_runs_nothing(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let held = Arc::new(Effects {
        gate: Some(Notify::new()),
        ..Effects::default()
    });
    let message = message("m-held", "{}");
    let first = tokio::spawn({
        let (consumer, held, message) = (consumer.clone(), Arc::clone(&held), message.clone());
        async move { consumer.process(&*held, &message).await }
    });
    held.entered.notified().await;

    // Behind the first delivery's open transaction, a limited one gives up in about its limit.
    let limited = consumer.clone().with_wait_limit(Duration::from_millis(200));
    let began = std::time::Instant::now();
    let second = limited.process(&Effects::default(), &message).await;
    let waited = began.elapsed();
    assert!(
        matches!(&second, Err(ConsumerError::HeldElsewhere(id)) if id == "m-held"),
        "{second:?}"
    );
    assert!(
        waited >= Duration::from_millis(150) && waited < Duration::from_secs(5),
        "{waited:?}"
    );

    held.gate.as_ref().unwrap().notify_one();
    assert_eq!(first.await.unwrap().unwrap(), Processed::Applied);
    // Redelivered later, it is a duplicate; the limit costs an uncontended delivery nothing.
    assert_eq!(
        limited
            .process(&Effects::default(), &message)
            .await
            .unwrap(),
        Processed::Duplicate
    );
    assert_eq!(
        limited
            .process(&Effects::default(), &self::message("m-free", "{}"))
            .await
            .unwrap(),
        Processed::Applied
    );
    assert_eq!(effects(&pool, "m-held").await, 1);
}

/// Writes its effect, then panics.
struct Panics;

#[idemflow::async_trait]
impl Handler<PgStore> for Panics {
    async fn handle(
        &self,
        connection: &mut PgConnection,
        message: &Message,
    ) -> Result<(), HandlerError> {
        sqlx::query("INSERT INTO effects (subscriber, message_id, payload) VALUES ('', $1, $2)")
            .bind(message.id())
            .bind(message.payload())
            .execute(&mut *connection)
            .await?;
        panic!("the handler's bug");
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_panicking_handler_is_an_error_that_rolls_back_and_records_nothing(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let message = message("m-panics", "{}");
    let panicked = consumer.process(&Panics, &message).await;
    assert!(
        matches!(&panicked, Err(ConsumerError::Panicked(why)) if why == "the handler's bug"),
        "{panicked:?}"
    );
    assert_eq!(effects(&pool, "m-panics").await, 0);
    assert_eq!(recorded(&pool).await, 0);
    // The redelivery, once the handler is fixed, applies it once.
    assert_eq!(
        consumer
            .process(&Effects::default(), &message)
            .await
            .unwrap(),
        Processed::Applied
    );
    assert_eq!(effects(&pool, "m-panics").await, 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn many_deliveries_of_each_message_at_once_apply_each_once(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let handler = Arc::new(Effects::default());
    let mut tasks = Vec::new();
    for n in 0..150 {
        for _ in 0..4 {
            let (consumer, handler) = (consumer.clone(), Arc::clone(&handler));
            let message = message(&format!("m-{n}"), &format!("{{\"n\": {n}}}"));
            tasks.push(tokio::spawn(async move {
                consumer.process(&*handler, &message).await
            }));
        }
    }
    let mut applied = 0;
    for task in tasks {
        match task.await.unwrap().unwrap() {
            Processed::Applied => applied += 1,
            Processed::Duplicate => {}
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(applied, 150);
    let doubled: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT message_id FROM effects GROUP BY message_id \
         HAVING count(*) <> 1) AS doubled",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(doubled, 0);
    assert_eq!(recorded(&pool).await, 150);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_failed_handler_records_nothing_and_the_redelivery_applies(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "ledger");
    let handler = Effects::default();
    handler
        .fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let message = message("m-fails-once", "{}");
    let failed = consumer.process(&handler, &message).await.unwrap_err();
    assert!(matches!(failed, ConsumerError::Handler(_)), "{failed:?}");
    assert_eq!(
        (effects(&pool, "m-fails-once").await, recorded(&pool).await),
        (0, 0)
    );

    handler
        .fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        consumer.process(&handler, &message).await.unwrap(),
        Processed::Applied
    );
    assert_eq!(effects(&pool, "m-fails-once").await, 1);
}

/// Stops every delivery at one point, in process.
#[derive(Debug)]
struct StopAt(ConsumerCrashPoint);

#[idemflow::async_trait]
impl ConsumerCrashHook for StopAt {
    async fn crash_at(&self, point: ConsumerCrashPoint, _: &Message) -> bool {
        point == self.0
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn stopped_before_its_commit_a_delivery_leaves_nothing_and_after_it_a_duplicate(
    pool: PgPool,
) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let message = message("m-stopped", "{}");
    let before = consumer(&pool, "ledger")
        .with_crash_hook(Arc::new(StopAt(ConsumerCrashPoint::BeforeCommit)));
    assert!(matches!(
        before.process(&Effects::default(), &message).await,
        Err(ConsumerError::Crashed(ConsumerCrashPoint::BeforeCommit))
    ));
    assert_eq!(
        (effects(&pool, "m-stopped").await, recorded(&pool).await),
        (0, 0)
    );

    let after = consumer(&pool, "ledger")
        .with_crash_hook(Arc::new(StopAt(ConsumerCrashPoint::AfterCommit)));
    assert!(matches!(
        after.process(&Effects::default(), &message).await,
        Err(ConsumerError::Crashed(ConsumerCrashPoint::AfterCommit))
    ));
    // Committed though never acknowledged: the redelivery is a duplicate.
    assert_eq!(
        consumer(&pool, "ledger")
            .process(&Effects::default(), &message)
            .await
            .unwrap(),
        Processed::Duplicate
    );
    assert_eq!(effects(&pool, "m-stopped").await, 1);
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn retention_deletes_old_records_in_batches_and_keeps_the_window(pool: PgPool) {
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let ledger = consumer(&pool, "ledger");
    for n in 0..7 {
        ledger
            .process(&Effects::default(), &message(&format!("m-{n}"), "{}"))
            .await
            .unwrap();
    }
    // Five of them processed eight days ago, two just now.
    sqlx::query(
        "UPDATE processed_messages SET processed_at = now() - interval '8 days' \
         WHERE message_id IN ('m-0', 'm-1', 'm-2', 'm-3', 'm-4')",
    )
    .execute(&pool)
    .await
    .unwrap();

    // A batch at a time: batches of two delete 2, 2, 1.
    let week = Duration::from_secs(7 * 24 * 60 * 60);
    let batch = <PgStore as ConsumerStore>::expire_identities(&pool, week, 2)
        .await
        .unwrap();
    assert_eq!(batch, 2);
    assert_eq!(expire_processed(&pool, week, 2, None).await.unwrap(), 3);
    assert_eq!(MessageRetention::default().expire(&pool).await.unwrap(), 0);
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT message_id FROM processed_messages ORDER BY message_id")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(kept, ["m-5", "m-6"]);
    // Within the window a redelivery is still a duplicate.
    assert_eq!(
        ledger
            .process(&Effects::default(), &message("m-6", "{}"))
            .await
            .unwrap(),
        Processed::Duplicate
    );
}

/// The value of one series in a Prometheus rendering.
fn series(rendered: &str, name: &str) -> Option<f64> {
    rendered
        .lines()
        .find(|line| line.starts_with(name) && line[name.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|number| number.parse().ok())
}

/// Nextest runs each test in its own process: the global recorder is this test's alone.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn applied_duplicate_refused_and_failed_deliveries_are_counted_by_subscriber(pool: PgPool) {
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let ledger = consumer(&pool, "ledger");
    let handler = Effects::default();
    ledger
        .process(&handler, &message("m-1", "a"))
        .await
        .unwrap();
    ledger
        .process(&handler, &message("m-1", "a"))
        .await
        .unwrap();
    ledger
        .process(&handler, &message("m-1", "b"))
        .await
        .unwrap_err();
    handler
        .fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    ledger
        .process(&handler, &message("m-2", "a"))
        .await
        .unwrap_err();
    sqlx::query("UPDATE processed_messages SET processed_at = now() - interval '8 days'")
        .execute(&pool)
        .await
        .unwrap();
    MessageRetention::default().expire(&pool).await.unwrap();

    let rendered = metrics.render();
    for (name, expected) in [
        ("processed", 1.0),
        ("duplicates", 1.0),
        ("refused", 1.0),
        ("failed", 1.0),
    ] {
        let name = format!(r#"idemflow_consumer_{name}_total{{subscriber="ledger"}}"#);
        assert_eq!(
            series(&rendered, &name),
            Some(expected),
            "{name}\n{rendered}"
        );
    }
    assert_eq!(
        series(&rendered, "idemflow_consumer_expired_total"),
        Some(1.0)
    );
    for (name, _, help) in idemflow::consumer::CATALOGUE {
        assert!(
            rendered.contains(&format!("# HELP {name} {help}")),
            "{name} is not described\n{rendered}"
        );
    }
}

/// Deployed with least privilege (scripts/sql/grants.sql, as tests/it/roles.rs does it), the
/// runtime role applies, recognises, refuses and expires messages: the file grants what the
/// consumer needs.
#[sqlx::test(migrations = false)]
async fn the_consumer_runs_as_the_runtime_role(_: PgPoolOptions, connect: PgConnectOptions) {
    crate::roles::deployed(connect, |deployment| async move {
        sqlx::query(EFFECTS_TABLE)
            .execute(&deployment.owner)
            .await
            .unwrap();
        let grant = format!(
            "GRANT INSERT ON effects TO \"{}\"",
            deployment.roles.runtime.name
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(grant))
            .execute(&deployment.owner)
            .await
            .unwrap();
        let ledger = consumer(&deployment.runtime, "ledger");
        let handler = Effects::default();
        let first = message("m-1", "a");
        assert_eq!(
            ledger.process(&handler, &first).await.unwrap(),
            Processed::Applied
        );
        assert_eq!(
            ledger.process(&handler, &first).await.unwrap(),
            Processed::Duplicate
        );
        assert!(matches!(
            ledger.process(&handler, &message("m-1", "b")).await,
            Err(ConsumerError::PayloadMismatch { .. })
        ));
        sqlx::query("UPDATE processed_messages SET processed_at = now() - interval '8 days'")
            .execute(&deployment.owner)
            .await
            .unwrap();
        assert_eq!(
            MessageRetention::default()
                .expire(&deployment.runtime)
                .await
                .unwrap(),
            1
        );
    })
    .await;
}

// ------------------------------------------------------------------------- on RabbitMQ ---

/// The broker the tests use.
fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// A connection to the broker, or a failure that says what is missing: never a skip.
async fn broker() -> Connection {
    let url = amqp_url();
    match Connection::connect(&url, ConnectionProperties::default()).await {
        Ok(connection) => connection,
        Err(error) => panic!(
            "RabbitMQ does not answer at {url} ({error}). The consumer tests need a real broker \
             and are never skipped: start one (Debian/Ubuntu: apt-get install rabbitmq-server, \
             then service rabbitmq-server start), or point AMQP_URL at one (guest/guest)."
        ),
    }
}

/// A queue of this test's own (its name unique on the broker), deleted by [`TestQueue::delete`]
/// at the end; a test that fails first leaves it to the broker's `x-expires` (10 minutes unused).
struct TestQueue {
    name: String,
    connection: Connection,
    channel: Channel,
}

impl TestQueue {
    async fn new(test: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let name = format!("idemflow-test-{test}-{}-{nanos}", std::process::id());
        let connection = broker().await;
        let channel = connection.create_channel().await.unwrap();
        let mut arguments = FieldTable::default();
        arguments.insert("x-expires".into(), AMQPValue::LongInt(600_000));
        channel
            .queue_declare(
                name.as_str().into(),
                QueueDeclareOptions::default(),
                arguments,
            )
            .await
            .unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        Self {
            name,
            connection,
            channel,
        }
    }

    /// Publishes every message (id, payload), persistent, and waits for the broker's confirms.
    async fn publish(&self, messages: &[(String, Vec<u8>)]) {
        let mut confirms = Vec::new();
        for (id, payload) in messages {
            let properties = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2);
            confirms.push(
                self.channel
                    .basic_publish(
                        "".into(),
                        self.name.as_str().into(),
                        BasicPublishOptions::default(),
                        payload,
                        properties,
                    )
                    .await
                    .unwrap(),
            );
        }
        for confirm in confirms {
            confirm.await.unwrap();
        }
    }

    /// Messages ready in the queue (not delivered, or delivered and not acknowledged by a
    /// consumer that is gone).
    async fn ready(&self) -> u32 {
        self.channel
            .queue_declare(
                self.name.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    async fn delete(self) {
        self.channel
            .queue_delete(self.name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
        let _ = self.connection.close(200, "done".into()).await;
    }
}

/// The consumer example, built into this test binary's target directory and profile.
fn consumer_binary() -> PathBuf {
    crate::support::example::built_example("consumer")
}

/// A running `consumer consume`: its stdout lines as they come, SIGKILLed when dropped.
struct Running {
    child: Child,
    lines: tokio::sync::mpsc::UnboundedReceiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn start(binary: &std::path::Path, url: &str, queue: &str, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(binary);
        command
            .args(["consume", "--queue", queue, "--database-url", url])
            .args([
                "--prefetch",
                "32",
                "--concurrency",
                "8",
                "--idle-exit-ms",
                "3000",
            ])
            .arg("--amqp-url")
            .arg(amqp_url())
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Reads lines until one starts with `prefix`, which it returns; panics after `patience`
    /// or when the process ends first.
    async fn wait_for(&mut self, prefix: &str, patience: Duration) -> String {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    self.seen.push(line.clone());
                    if line.starts_with(prefix) {
                        return line;
                    }
                }
                Ok(None) => panic!(
                    "the consumer ended before printing {prefix:?} ({:?}); last lines: {:?}",
                    self.child.try_wait(),
                    self.seen.iter().rev().take(5).collect::<Vec<_>>()
                ),
                Err(_) => panic!("the consumer did not print {prefix:?} within {patience:?}"),
            }
        }
    }

    /// SIGKILL, reap, and every line it printed.
    fn kill(mut self) -> Vec<String> {
        let _ = self.child.kill();
        let _ = self.child.wait();
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        std::mem::take(&mut self.seen)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const MESSAGES: usize = 3000;

/// Messages to publish, in order: (message id, payload).
type Published = Vec<(String, Vec<u8>)>;

/// The ledger entries a test publishes: `MESSAGES` distinct ones, and, after every tenth, one of
/// them again (the duplicates a publisher retrying after a lost confirm sends): half of them at
/// once (so two copies are in flight together), half of an earlier one. Returns what to
/// publish, and each account's expected balance.
fn ledger_messages() -> (Published, BTreeMap<String, i64>) {
    let entry = |n: usize| {
        let payload = format!(
            r#"{{"account": "account-{}", "amount": {}}}"#,
            n % 7,
            n % 50 + 1
        );
        (format!("m-{n}"), payload.into_bytes())
    };
    let mut messages = Vec::new();
    let mut balances = BTreeMap::new();
    for n in 0..MESSAGES {
        messages.push(entry(n));
        *balances.entry(format!("account-{}", n % 7)).or_insert(0) += (n % 50 + 1) as i64;
        if n % 10 == 9 {
            let again = if n % 20 == 9 { n } else { n * 7 % (n + 1) };
            messages.push(entry(again));
        }
    }
    (messages, balances)
}

/// Publishes the ledger messages, kills the example consumer twice at `point` (once early, once
/// later) while they flow, then lets a third process finish; checks that every message was
/// applied exactly once and every delivery acknowledged. Returns every line the three printed,
/// and the ids each kill froze.
async fn kill_at_and_recover(
    test: &str,
    pool: &PgPool,
    url: &str,
    point: &str,
) -> (Vec<String>, Vec<String>) {
    let binary = tokio::task::spawn_blocking(consumer_binary).await.unwrap();
    let queue = TestQueue::new(test).await;
    let (messages, balances) = ledger_messages();
    queue.publish(&messages).await;

    let mut lines = Vec::new();
    let mut frozen = Vec::new();
    for nth in ["700", "400"] {
        let crash_at = format!("{point}:{nth}");
        let mut running = Running::start(
            &binary,
            url,
            &queue.name,
            &[("IDEMFLOW_CONSUMER_CRASH_AT", crash_at.as_str())],
        );
        let reached = running
            .wait_for("crash point reached:", Duration::from_secs(180))
            .await;
        // SIGKILL at once, the other deliveries still running: whatever was committed and not
        // yet acknowledged, or done and not yet committed, is left to the broker and the table.
        let printed = running.kill();
        let id = reached.rsplit(' ').next().unwrap().to_owned();
        assert!(reached.contains(point), "{reached}");
        frozen.push(id);
        lines.extend(printed);
    }
    let mut last = Running::start(&binary, url, &queue.name, &[]);
    last.wait_for("consumer: stopped", Duration::from_secs(300))
        .await;
    let status = last.child.wait().unwrap();
    assert!(status.success(), "the last consumer failed: {status}");
    lines.extend(last.kill());

    // Every message applied exactly once: one ledger row each (the ledger has no unique
    // constraint: only the processed-message table keeps it single), each recorded once.
    let doubled: Vec<(String, i64)> = sqlx::query_as(
        "SELECT message_id, count(*) FROM consumer_ledger GROUP BY message_id \
         HAVING count(*) <> 1 ORDER BY message_id LIMIT 10",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert!(doubled.is_empty(), "applied more than once: {doubled:?}");
    let distinct: HashSet<&str> = messages.iter().map(|(id, _)| id.as_str()).collect();
    let applied: Vec<String> = sqlx::query_scalar("SELECT message_id FROM consumer_ledger")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(applied.len(), distinct.len());
    assert!(applied.iter().all(|id| distinct.contains(id.as_str())));
    let records: i64 =
        sqlx::query_scalar("SELECT count(*) FROM processed_messages WHERE subscriber = 'ledger'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(records, distinct.len() as i64);
    let stored: BTreeMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>("SELECT account, balance FROM consumer_balances")
            .fetch_all(pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(stored, balances);
    // Every delivery was answered: nothing left in the queue.
    assert_eq!(queue.ready().await, 0, "deliveries left unacknowledged");

    // The outcome lines: at most one `applied` per message (a kill between a commit and its
    // line prints none), and every delivery but the killed ones answered one way or the other.
    let count = |word: &str| lines.iter().filter(|line| line.starts_with(word)).count();
    let duplicates = messages.len() - distinct.len();
    assert!(count("applied ") <= distinct.len(), "{}", count("applied "));
    assert!(
        count("applied ") + count("duplicate ") >= messages.len(),
        "applied {} + duplicate {} < {} deliveries",
        count("applied "),
        count("duplicate "),
        messages.len()
    );
    assert!(count("duplicate ") >= duplicates);
    assert_eq!(count("refused ") + count("failed ") + count("rejected "), 0);
    queue.delete().await;
    (lines, frozen)
}

async fn test_pool(options: PgPoolOptions, connect: PgConnectOptions) -> (PgPool, String) {
    let url = database_url(&connect);
    let pool = options
        .max_connections(2)
        .connect_with(connect)
        .await
        .unwrap();
    (pool, url)
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_consumer_killed_between_commit_and_ack_applies_each_message_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, url) = test_pool(options, connect).await;
    let (lines, frozen) = kill_at_and_recover("after-commit", &pool, &url, "after_commit").await;
    // Each frozen delivery had committed; the broker delivered it again after the kill
    // (redelivered), and the table made that delivery a duplicate: applied once.
    for id in frozen {
        let again = format!("duplicate {id} redelivered=true");
        assert!(
            lines.contains(&again),
            "{id} was not recognised as a redelivered duplicate"
        );
        // Its one application was the frozen delivery's, which printed nothing.
        let applied = format!("applied {id} ");
        assert!(!lines.iter().any(|line| line.starts_with(&applied)), "{id}");
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_consumer_killed_between_its_effects_and_its_commit_applies_each_message_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, url) = test_pool(options, connect).await;
    let (lines, frozen) = kill_at_and_recover("before-commit", &pool, &url, "before_commit").await;
    // Each frozen delivery's effects rolled back with the process (the frozen delivery printed
    // nothing); a later process applied the message, once: usually the frozen delivery itself,
    // back `redelivered`, possibly a publisher's copy of it that reached a consumer first.
    for id in frozen {
        let applied = format!("applied {id} ");
        let applications: Vec<&String> = lines
            .iter()
            .filter(|line| line.starts_with(&applied))
            .collect();
        assert_eq!(applications.len(), 1, "{id}: {applications:?}");
    }
}

#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_reused_message_id_from_the_broker_is_refused_and_not_requeued(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, url) = test_pool(options, connect).await;
    let binary = tokio::task::spawn_blocking(consumer_binary).await.unwrap();
    let queue = TestQueue::new("reused-id").await;
    let entry =
        |amount: i64| format!(r#"{{"account": "account-1", "amount": {amount}}}"#).into_bytes();
    queue
        .publish(&[("m-1".to_owned(), entry(5)), ("m-2".to_owned(), entry(7))])
        .await;
    let mut first = Running::start(&binary, &url, &queue.name, &[]);
    first
        .wait_for("consumer: stopped", Duration::from_secs(120))
        .await;
    drop(first);
    // The same id again with another amount: a publisher bug, refused loudly and dropped (to a
    // dead-letter exchange where the queue has one), not requeued for ever.
    queue
        .publish(&[("m-1".to_owned(), entry(500)), ("m-2".to_owned(), entry(7))])
        .await;
    let mut second = Running::start(&binary, &url, &queue.name, &[]);
    let stopped = second
        .wait_for("consumer: stopped", Duration::from_secs(120))
        .await;
    let lines = second.kill();
    assert!(
        lines.contains(&"refused m-1 redelivered=false".to_owned()),
        "{lines:?}"
    );
    assert!(
        lines.contains(&"duplicate m-2 redelivered=false".to_owned()),
        "{lines:?}"
    );
    assert!(
        stopped.ends_with("applied=0 duplicates=1 refused=1 failed=0"),
        "{stopped}"
    );
    let balance: i64 = sqlx::query_scalar("SELECT balance FROM consumer_balances")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(balance, 12);
    assert_eq!(queue.ready().await, 0);
    queue.delete().await;
}

/// A delivery dropped while its transaction's `BEGIN` is in flight (a timeout around `process`, a
/// shutdown's `select!`) must not hand its connection back to a shared pool inside that
/// transaction: the next user of the pool (a runner's look-up, another delivery) would run in it,
/// keeping whatever it locked until someone commits. Here the BEGIN is slowed by the fault proxy,
/// the delivery dropped while it travels, and the pool's next statements checked for transactions
/// of their own.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_delivery_dropped_while_it_begins_leaves_no_transaction_in_the_pool(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let (pool, proxy) = crate::faults::pool_through(options, connect, 1).await;
    sqlx::query(EFFECTS_TABLE).execute(&pool).await.unwrap();
    let consumer = consumer(&pool, "projection").with_wait_limit(Duration::from_secs(1));
    // The connection back in the pool, its release ping answered, before anything is slowed.
    while pool.num_idle() < 1 {
        tokio::task::yield_now().await;
    }
    proxy.delay(Duration::from_millis(300));
    let dropped = tokio::time::timeout(
        Duration::from_millis(100),
        consumer.process(&Effects::default(), &message("m-1", "payload")),
    )
    .await;
    assert!(dropped.is_err(), "the delivery was not dropped mid-BEGIN");
    proxy.delay(Duration::ZERO);
    // On the same connection (if it came back to the pool: the pool holds one), these go out
    // after the BEGIN. Each statement on its own is a transaction of its own, with an id of its
    // own; inside the dropped delivery's transaction they would share one.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let id: i64 = sqlx::query_scalar("SELECT txid_current()")
            .fetch_one(&pool)
            .await
            .unwrap();
        ids.push(id);
    }
    let lock_timeout: String = sqlx::query_scalar("SELECT current_setting('lock_timeout')")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_ne!(
        ids[0], ids[1],
        "the pool's next statements ran inside the dropped delivery's transaction"
    );
    assert_eq!(
        lock_timeout, "0",
        "the dropped delivery's lock_timeout leaked"
    );
    assert_eq!(effects(&pool, "m-1").await, 0);
    assert_eq!(recorded(&pool).await, 0);
}
