//! The idempotent consumer: a message delivered at least once is applied at most once per
//! subscriber.
//!
//! A broker redelivers a message whose acknowledgement it never got: after a consumer crashed
//! between its commit and its ack, or when a publisher sent it twice. [`Consumer::process`] records
//! the message's identity `(subscriber, message_id)` in `processed_messages` in the same
//! database transaction as the [`Handler`]'s effects, so either both committed or neither did. A
//! delivery whose identity is already there is [`Processed::Duplicate`]: acknowledge it, nothing
//! ran. The same id with another payload is refused ([`ConsumerError::PayloadMismatch`]): a SHA-256
//! fingerprint of the payload is kept with the identity.
//!
//! The crate knows no broker: a [`Message`] is an id and a payload. Acknowledge a delivery once
//! `process` returned `Ok` (after the commit), never before. `examples/consumer` does it on
//! RabbitMQ; docs/consumer.md says what the broker promises and what the table adds.
//!
//! ```no_run
//! use idemflow_consumer::{Consumer, Handler, HandlerError, Message, Processed, Subscriber};
//! use idemflow_sqlite::SqliteStore;
//! use sqlx::SqliteConnection;
//!
//! struct Ledger;
//!
//! #[async_trait::async_trait]
//! impl Handler<SqliteStore> for Ledger {
//!     async fn handle(&self, connection: &mut SqliteConnection, message: &Message) -> Result<(), HandlerError> {
//!         // The effects, in the transaction that records the message.
//!         sqlx::query("INSERT INTO ledger (message_id, body) VALUES (?1, ?2)")
//!             .bind(message.id())
//!             .bind(message.payload())
//!             .execute(connection)
//!             .await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn example(pool: sqlx::SqlitePool, id: String, payload: Vec<u8>) -> Result<(), Box<dyn std::error::Error>> {
//! let consumer = Consumer::new(pool, Subscriber::new("ledger")?);
//! let message = Message::new(id, payload)?;
//! match consumer.process(&Ledger, &message).await? {
//!     Processed::Applied | Processed::Duplicate => { /* acknowledge the delivery now */ }
//!     _ => {}
//! }
//! # Ok(())
//! # }
//! ```

//! The crate names no engine: each SQL engine's crate implements [`ConsumerStore`] with its own
//! statements on `processed_messages`, and a consumer on a pool runs on that pool's engine.

#![deny(missing_docs)]

mod consumer;
mod identity;
mod metrics;
mod retention;

pub use consumer::{
    Consumer, ConsumerCrashHook, ConsumerCrashPoint, ConsumerError, Handler, HandlerError,
    Processed,
};
pub use idemflow_store::ConsumerStore;
pub use identity::{InvalidIdentity, Message, Subscriber};
pub use metrics::{CATALOGUE, describe_metrics};
pub use retention::{MessageRetention, expire_processed};
