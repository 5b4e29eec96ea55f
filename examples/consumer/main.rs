//! The idempotent consumer on RabbitMQ: a ledger projection that applies each message once,
//! however often the broker delivers it.
//!
//! ```text
//! consumer consume --queue Q [--subscriber ledger] [--prefetch 32] [--concurrency 8] [--idle-exit-ms N]
//! consumer publish --queue Q [--count 1000] [--duplicates 100]
//! ```
//!
//! `consume` takes deliveries with manual acknowledgement and acknowledges each only after
//! [`Consumer::process`] returned: after the commit that recorded the message with its effects
//! (or found it recorded before). A process that dies before its ack leaves the message unacked;
//! the broker requeues it when the connection closes and delivers it again (`redelivered`), and
//! the table turns that delivery into a duplicate. Each outcome is printed as a line
//! (`applied <id> redelivered=false`), which the tests read.
//!
//! `IDEMFLOW_CONSUMER_CRASH_AT=<point>:<n>` (`before_commit` or `after_commit`) freezes the n-th
//! delivery to pass that point, printing `crash point reached: <point> <id>`, until the process is
//! killed: tests/it/consumer.rs kills it there with SIGKILL.

use idemflow::PgStore;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use futures_util::StreamExt;
use idemflow::consumer::{
    Consumer, ConsumerCrashHook, ConsumerCrashPoint, ConsumerError, Handler, HandlerError, Message,
    MessageRetention, Processed, Subscriber,
};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde::{Deserialize, Serialize};
use sqlx::PgConnection;
use tokio::sync::Semaphore;

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// The variable naming the crash point (`before_commit:<n>`, `after_commit:<n>`).
const CRASH_ENV: &str = "IDEMFLOW_CONSUMER_CRASH_AT";

#[derive(Debug, Parser)]
#[command(
    name = "consumer",
    about = "The idemflow idempotent consumer on RabbitMQ: a ledger applied once per message"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the queue's messages to the ledger, acknowledging each after its commit
    Consume(ConsumeArgs),
    /// Publish ledger entries, some of them twice (as a publisher retrying after a lost confirm)
    Publish(PublishArgs),
}

#[derive(Debug, Args)]
struct Broker {
    /// The broker [default: $AMQP_URL, else amqp://guest:guest@127.0.0.1:5672/%2f]
    #[arg(long, value_name = "URL")]
    amqp_url: Option<String>,
    /// The queue (declared if absent: non-durable, deleted after 10 minutes unused).
    #[arg(long)]
    queue: String,
}

#[derive(Debug, Args)]
struct ConsumeArgs {
    #[command(flatten)]
    broker: Broker,
    /// PostgreSQL URL [default: $DATABASE_URL]
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
    /// Whose projection this is: part of each message's identity.
    #[arg(long, default_value = "ledger")]
    subscriber: String,
    /// Deliveries the broker hands over unacknowledged at once.
    #[arg(long, default_value_t = 32)]
    prefetch: u16,
    /// Deliveries processed at once (so two deliveries of one message may race).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Stop once nothing arrived for this long and nothing is in flight.
    #[arg(long)]
    idle_exit_ms: Option<u64>,
}

#[derive(Debug, Args)]
struct PublishArgs {
    #[command(flatten)]
    broker: Broker,
    /// Distinct messages.
    #[arg(long, default_value_t = 1000)]
    count: u64,
    /// Of those, how many are published a second time.
    #[arg(long, default_value_t = 100)]
    duplicates: u64,
    /// Message ids are `<prefix>-<n>`.
    #[arg(long, default_value = "entry")]
    prefix: String,
}

/// A ledger entry: what a message carries.
#[derive(Debug, Serialize, Deserialize)]
struct Entry {
    account: String,
    amount: i64,
}

/// The projection: an append-only ledger and a balance per account. The ledger has no unique
/// constraint on the message id on purpose: only `processed_messages` keeps an entry single.
struct Ledger {
    subscriber: String,
}

#[idemflow::async_trait]
impl Handler<PgStore> for Ledger {
    async fn handle(
        &self,
        connection: &mut PgConnection,
        message: &Message,
    ) -> Result<(), HandlerError> {
        let entry: Entry = serde_json::from_slice(message.payload())?;
        sqlx::query(
            "INSERT INTO consumer_ledger (subscriber, message_id, account, amount) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(&self.subscriber)
        .bind(message.id())
        .bind(&entry.account)
        .bind(entry.amount)
        .execute(&mut *connection)
        .await?;
        sqlx::query(
            "INSERT INTO consumer_balances (subscriber, account, balance) VALUES ($1, $2, $3) \
             ON CONFLICT (subscriber, account) DO UPDATE \
             SET balance = consumer_balances.balance + excluded.balance",
        )
        .bind(&self.subscriber)
        .bind(&entry.account)
        .bind(entry.amount)
        .execute(&mut *connection)
        .await?;
        Ok(())
    }
}

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS consumer_ledger (id bigserial PRIMARY KEY, \
     subscriber text NOT NULL, message_id text NOT NULL, account text NOT NULL, \
     amount bigint NOT NULL)",
    "CREATE TABLE IF NOT EXISTS consumer_balances (subscriber text NOT NULL, \
     account text NOT NULL, balance bigint NOT NULL, PRIMARY KEY (subscriber, account))",
];

/// Freezes the n-th delivery to reach one crash point, for a test to kill the process there.
#[derive(Debug)]
struct FreezeAt {
    point: ConsumerCrashPoint,
    nth: u64,
    passed: AtomicU64,
}

impl FreezeAt {
    fn from_env() -> Result<Option<Arc<Self>>, Failure> {
        let Ok(value) = std::env::var(CRASH_ENV) else {
            return Ok(None);
        };
        let (point, nth) = value
            .split_once(':')
            .ok_or_else(|| format!("{CRASH_ENV}={value}: expected <point>:<n>"))?;
        let point = match point {
            "before_commit" => ConsumerCrashPoint::BeforeCommit,
            "after_commit" => ConsumerCrashPoint::AfterCommit,
            other => return Err(format!("{CRASH_ENV}: unknown crash point {other}").into()),
        };
        Ok(Some(Arc::new(Self {
            point,
            nth: nth.parse()?,
            passed: AtomicU64::new(0),
        })))
    }
}

#[idemflow::async_trait]
impl ConsumerCrashHook for FreezeAt {
    async fn crash_at(&self, point: ConsumerCrashPoint, message: &Message) -> bool {
        if point != self.point || self.passed.fetch_add(1, Ordering::SeqCst) + 1 != self.nth {
            return false;
        }
        println!("crash point reached: {point} {}", message.id());
        // Never returns: this delivery stays where it is (its transaction open, or committed
        // and unacknowledged) until the process is killed. Other deliveries go on meanwhile.
        std::future::pending().await
    }
}

#[derive(Debug, Default)]
struct Tallies {
    applied: AtomicU64,
    duplicates: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
}

impl Broker {
    fn url(&self) -> String {
        self.amqp_url
            .clone()
            .or_else(|| std::env::var("AMQP_URL").ok())
            .unwrap_or_else(|| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
    }
}

async fn connect(broker: &Broker) -> Result<Connection, Failure> {
    let url = broker.url();
    Connection::connect(&url, ConnectionProperties::default())
        .await
        .map_err(|error| format!("RabbitMQ at {url}: {error}").into())
}

fn queue_arguments() -> FieldTable {
    // Deleted by the broker once unused for 10 minutes: a test that fails leaves nothing for long.
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-expires".into(),
        lapin::types::AMQPValue::LongInt(600_000),
    );
    arguments
}

async fn consume(args: ConsumeArgs) -> Result<(), Failure> {
    let subscriber = Subscriber::new(args.subscriber.clone())?;
    let ledger = Arc::new(Ledger {
        subscriber: args.subscriber.clone(),
    });
    let database_url = match &args.database_url {
        Some(url) => url.clone(),
        None => std::env::var("DATABASE_URL").map_err(|_| "--database-url or DATABASE_URL")?,
    };
    // A connection per delivery in flight, and one for retention; no ping before each
    // transaction (README, "Pools").
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(u32::try_from(args.concurrency.max(1))? + 1)
        .test_before_acquire(false)
        .connect(&database_url)
        .await?;
    idemflow::migrate(&pool).await?;
    for statement in SCHEMA {
        sqlx::query(*statement).execute(&pool).await?;
    }
    let mut consumer = Consumer::new(pool.clone(), subscriber);
    if let Some(hook) = FreezeAt::from_env()? {
        consumer = consumer.with_crash_hook(hook);
    }
    let consumer = Arc::new(consumer);

    let connection = connect(&args.broker).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            args.broker.queue.as_str().into(),
            QueueDeclareOptions::default(),
            queue_arguments(),
        )
        .await?;
    channel
        .basic_qos(args.prefetch, BasicQosOptions::default())
        .await?;
    let mut deliveries = channel
        .basic_consume(
            args.broker.queue.as_str().into(),
            "".into(),
            // Manual acknowledgement: `no_ack` stays false.
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    println!("consuming {} as {}", args.broker.queue, args.subscriber);

    let retention = tokio::spawn({
        let pool = pool.clone();
        async move {
            MessageRetention::default()
                .run(&pool, idemflow::shutdown_signal())
                .await;
        }
    });
    let tallies = Arc::new(Tallies::default());
    let concurrency = args.concurrency.max(1);
    let slots = Arc::new(Semaphore::new(concurrency));
    let idle = args.idle_exit_ms.map(Duration::from_millis);
    let mut shutdown = std::pin::pin!(idemflow::shutdown_signal());
    loop {
        let next = tokio::select! {
            () = &mut shutdown => break,
            next = async {
                match idle {
                    Some(idle) => tokio::time::timeout(idle, deliveries.next()).await.ok(),
                    None => Some(deliveries.next().await),
                }
            } => next,
        };
        let delivery = match next {
            // Idle: stop if nothing is in flight either (a frozen delivery keeps it going).
            None if slots.available_permits() == concurrency => break,
            None => continue,
            Some(None) => break,
            Some(Some(delivery)) => delivery?,
        };
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let consumer = Arc::clone(&consumer);
        let ledger = Arc::clone(&ledger);
        let tallies = Arc::clone(&tallies);
        tokio::spawn(async move {
            deliver(&consumer, &ledger, delivery, &tallies).await;
            drop(slot);
        });
    }
    // What is in flight finishes and is acknowledged; the rest stays with the broker.
    let _ = slots.acquire_many(u32::try_from(concurrency)?).await?;
    retention.abort();
    let _ = channel.close(200, "bye".into()).await;
    let _ = connection.close(200, "bye".into()).await;
    println!(
        "consumer: stopped applied={} duplicates={} refused={} failed={}",
        tallies.applied.load(Ordering::SeqCst),
        tallies.duplicates.load(Ordering::SeqCst),
        tallies.refused.load(Ordering::SeqCst),
        tallies.failed.load(Ordering::SeqCst),
    );
    Ok(())
}

/// One delivery: processed, then acknowledged (applied or duplicate), rejected for good (a
/// message that can never apply), or handed back to be delivered again (a failure).
async fn deliver(
    consumer: &Consumer<PgStore>,
    ledger: &Ledger,
    mut delivery: Delivery,
    tallies: &Tallies,
) {
    let redelivered = delivery.redelivered;
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
        .unwrap_or_default();
    let payload = std::mem::take(&mut delivery.data);
    // A message without a usable id or with a payload that is no entry can never apply: reject
    // it without requeueing (to the queue's dead-letter exchange, where one is configured).
    let message = match Message::new(id.clone(), payload) {
        Ok(message) if serde_json::from_slice::<Entry>(message.payload()).is_ok() => message,
        _ => {
            println!("rejected {id:?} redelivered={redelivered}: no message id or not an entry");
            tallies.refused.fetch_add(1, Ordering::SeqCst);
            let _ = delivery.nack(BasicNackOptions::default()).await;
            return;
        }
    };
    let outcome = consumer.process(ledger, &message).await;
    let (word, ack) = match &outcome {
        Ok(Processed::Applied) => {
            tallies.applied.fetch_add(1, Ordering::SeqCst);
            ("applied", true)
        }
        Ok(Processed::Duplicate) => {
            tallies.duplicates.fetch_add(1, Ordering::SeqCst);
            ("duplicate", true)
        }
        Ok(_) => ("processed", true),
        Err(ConsumerError::PayloadMismatch { .. }) => {
            tallies.refused.fetch_add(1, Ordering::SeqCst);
            ("refused", false)
        }
        Err(_) => {
            tallies.failed.fetch_add(1, Ordering::SeqCst);
            ("failed", false)
        }
    };
    println!("{word} {id} redelivered={redelivered}");
    let answered = if ack {
        delivery.ack(BasicAckOptions::default()).await
    } else {
        let requeue = !matches!(outcome, Err(ConsumerError::PayloadMismatch { .. }));
        if requeue {
            // A failure (the database away, a handler error): back to the queue, after a pause
            // so a persistent failure does not spin.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        delivery
            .nack(BasicNackOptions {
                requeue,
                ..BasicNackOptions::default()
            })
            .await
    };
    if let Err(error) = answered {
        // The channel is gone: the broker requeues the delivery itself, and the table makes its
        // next delivery a duplicate if this one was applied.
        tracing::warn!(%error, message_id = %id, "acknowledgement not sent");
    }
}

async fn publish(args: PublishArgs) -> Result<(), Failure> {
    let connection = connect(&args.broker).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            args.broker.queue.as_str().into(),
            QueueDeclareOptions::default(),
            queue_arguments(),
        )
        .await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    // Every n-th message is sent twice in a row, as a publisher retrying after a lost confirm
    // would: with several deliveries in flight, the two copies are processed at the same time.
    let every = args
        .count
        .checked_div(args.duplicates)
        .map_or(u64::MAX, |every| every.max(1));
    let mut confirms = Vec::new();
    let mut sent_twice = 0;
    for n in 0..args.count {
        let mut send = vec![n];
        if (n + 1) % every == 0 && sent_twice < args.duplicates {
            send.push(n);
            sent_twice += 1;
        }
        for n in send {
            let entry = Entry {
                account: format!("account-{}", n % 10),
                amount: i64::try_from(n % 100)? + 1,
            };
            let properties = BasicProperties::default()
                .with_message_id(format!("{}-{n}", args.prefix).into())
                .with_delivery_mode(2);
            confirms.push(
                channel
                    .basic_publish(
                        "".into(),
                        args.broker.queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &serde_json::to_vec(&entry)?,
                        properties,
                    )
                    .await?,
            );
        }
    }
    for confirm in confirms {
        confirm.await?;
    }
    let _ = connection.close(200, "bye".into()).await;
    println!(
        "published {} messages ({} of them twice) to {}",
        args.count, sent_twice, args.broker.queue
    );
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let result = match Cli::parse().command {
        Command::Consume(args) => consume(args).await,
        Command::Publish(args) => publish(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("consumer: {error}");
            ExitCode::FAILURE
        }
    }
}
