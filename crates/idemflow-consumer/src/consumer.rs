//! [`Consumer::process`]: the identity first, then the effects, one commit.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use idemflow_store::{
    ConnectionOf, ConsumerStore, DatabaseError, EngineError, EnginePool, PoolOf, Standing,
};
use tracing::Instrument;

use crate::identity::{Message, Subscriber, hex};
use crate::metrics::{self, DUPLICATES, FAILED, PROCESSED, REFUSED, count};

/// What a handler's error becomes: any error converts (`?` on sqlx's, serde's, yours).
pub type HandlerError = Box<dyn std::error::Error + Send + Sync>;

/// Applies a message: its effects go through `connection`, the open transaction that also records
/// the message's identity, so they commit together or not at all.
///
/// A handler must do nothing outside that transaction that it cannot do twice: a message whose
/// commit failed, or whose process died before it, is delivered again and the handler runs again.
///
/// A handler names the engine it writes through (`E`): on SQLite, `impl Handler<SqliteStore> for
/// …` receives a `SqliteConnection`; on PostgreSQL, `impl Handler<PgStore> for …` a
/// `PgConnection`.
#[async_trait]
pub trait Handler<E: ConsumerStore>: Send + Sync {
    /// The message's effects. An error rolls them back with the identity: the delivery is to be
    /// redelivered (negatively acknowledged, or left to the broker).
    async fn handle(
        &self,
        connection: &mut ConnectionOf<E>,
        message: &Message,
    ) -> Result<(), HandlerError>;
}

/// What a delivery became. Both are to be acknowledged to the broker: the message is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Processed {
    /// This delivery ran the handler; its effects and the identity committed.
    Applied,
    /// The subscriber had applied this message before (same id, same payload): nothing ran.
    Duplicate,
}

/// Why a delivery was not applied.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The subscriber applied a message with this id and another payload. Nothing ran. Not a
    /// retryable failure: redelivering it can only be refused again. Reject it (to a dead-letter
    /// queue) and look at the publisher, which reused an id for another message.
    #[error(
        "message {message_id:?} was applied by {subscriber:?} with another payload \
         (stored fingerprint {stored}, this delivery's {received}): refused"
    )]
    PayloadMismatch {
        /// The subscriber that applied the first payload.
        subscriber: String,
        /// The reused message id.
        message_id: String,
        /// The fingerprint (hex SHA-256) of the payload applied.
        stored: String,
        /// The fingerprint (hex SHA-256) of this delivery's payload.
        received: String,
    },
    /// The handler failed; its effects rolled back and nothing was recorded.
    #[error("the handler failed (rolled back): {0}")]
    Handler(#[source] HandlerError),
    /// The database failed; nothing was recorded unless the failure was the commit's answer
    /// lost, in which case a redelivery is recognised as a duplicate.
    #[error("database error: {0}")]
    Database(#[from] DatabaseError),
    /// The message's identity was inserted and deleted again (retention) between two statements
    /// three times over: try the delivery again.
    #[error("message {0:?} kept changing under retention; try again")]
    Contended(String),
    /// Another delivery of this message held it (its transaction open) for longer than the
    /// consumer's wait limit ([`Consumer::with_wait_limit`]): it is being applied elsewhere right
    /// now. Nothing ran here; redeliver it later, when it will be a duplicate (or applied, if the
    /// other delivery rolled back).
    #[error("another delivery of message {0:?} held it past the wait limit; redeliver later")]
    HeldElsewhere(String),
    /// The handler panicked; its effects rolled back and nothing was recorded. A bug in the
    /// handler: redelivering runs it again.
    #[error("the handler panicked (rolled back): {0}")]
    Panicked(String),
    /// The handler ended the delivery's transaction (a `COMMIT` or `ROLLBACK` of its own, an
    /// implicit commit, a statement tried again after a deadlock's rollback): its effects may
    /// have committed apart from the message's identity. The identity is now recorded, so a
    /// redelivery is a duplicate and the handler never runs on this message again. Acknowledge
    /// it (or let the redelivery be acknowledged as a duplicate), look at what was applied, and
    /// fix the handler: it must leave the transaction it is handed open.
    #[error(
        "the handler ended the delivery's transaction for message {0:?}: its effects may have \
         committed without the message's identity, which is now recorded (the message is not \
         applied again)"
    )]
    TransactionEnded(String),
    /// A [`ConsumerCrashHook`] stopped the delivery at a crash point, as a crash would have.
    #[error("stopped at crash point {0}")]
    Crashed(ConsumerCrashPoint),
}

/// A step boundary of [`Consumer::process`] at which a test can stop it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ConsumerCrashPoint {
    /// The handler ran; its effects and the identity are about to commit.
    BeforeCommit,
    /// Committed; the caller has not acknowledged the delivery yet.
    AfterCommit,
}

impl fmt::Display for ConsumerCrashPoint {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            Self::BeforeCommit => "before_commit",
            Self::AfterCommit => "after_commit",
        })
    }
}

/// Decides at each crash point whether the delivery stops there; it may also take its time (or
/// never return: a process frozen until a test kills it). In production there is none.
#[async_trait]
pub trait ConsumerCrashHook: Send + Sync + fmt::Debug {
    /// `true`: stop as a crash would: before the commit the transaction rolls back; after it the
    /// caller is told [`ConsumerError::Crashed`] and must not acknowledge.
    async fn crash_at(&self, point: ConsumerCrashPoint, message: &Message) -> bool;
}

/// Applies messages for one subscriber, each at most once, on a pool of engine `E`
/// ([`Consumer::new`] knows it from the pool).
#[derive(Debug)]
pub struct Consumer<E: ConsumerStore> {
    pool: PoolOf<E>,
    subscriber: Subscriber,
    crash_hook: Option<Arc<dyn ConsumerCrashHook>>,
    /// How long a delivery waits behind another of the same message (PostgreSQL: the
    /// transaction's `lock_timeout`, sent with its `BEGIN`).
    wait_limit: Option<Duration>,
}

impl<E: ConsumerStore> Clone for Consumer<E> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            subscriber: self.subscriber.clone(),
            crash_hook: self.crash_hook.clone(),
            wait_limit: self.wait_limit,
        }
    }
}

/// How often an identity found and gone again is tried before [`ConsumerError::Contended`].
const ROUNDS: usize = 3;

impl<E: ConsumerStore> Consumer<E> {
    /// A consumer for `subscriber` on `pool` (a `PgPool`, a `SqlitePool`, a `MySqlPool`: the
    /// engine follows from it). Describes the metrics to the installed recorder once per
    /// process. The pool's database must be migrated (each engine's `migrate`, or `open`).
    pub fn new(pool: impl EnginePool<E>, subscriber: Subscriber) -> Self {
        Self::on(pool.into_pool(), subscriber)
    }

    /// [`Consumer::new`] on engine `E`'s pool, named through the engine: what code generic over
    /// `E` calls (there the pool's type is `sqlx::Pool<E::Database>`, which the compiler does not
    /// see as `E`'s pool).
    pub fn on(pool: PoolOf<E>, subscriber: Subscriber) -> Self {
        metrics::describe_once();
        Consumer {
            pool,
            subscriber,
            crash_hook: None,
            wait_limit: None,
        }
    }

    /// The same consumer, waiting at most `limit` on another delivery of the same message that
    /// is in flight (its uncommitted identity): past it the delivery ends with
    /// [`ConsumerError::HeldElsewhere`] rather than holding its connection and its broker slot
    /// for as long as the other handler runs. Without a limit it waits as long as the server lets
    /// it. Sent with the `BEGIN`, in the same message: no round trip of its own.
    pub fn with_wait_limit(mut self, limit: Duration) -> Self {
        self.wait_limit = Some(limit);
        self
    }

    /// The same consumer, stopping where `hook` says: for crash tests.
    pub fn with_crash_hook(mut self, hook: Arc<dyn ConsumerCrashHook>) -> Self {
        self.crash_hook = Some(hook);
        self
    }

    /// Whose identity this consumer records.
    pub fn subscriber(&self) -> &Subscriber {
        &self.subscriber
    }

    /// The pool it works on.
    pub fn pool(&self) -> &PoolOf<E> {
        &self.pool
    }

    /// Applies `message` with `handler` unless this subscriber already did.
    ///
    /// In one transaction: insert the identity first (`ON CONFLICT DO NOTHING`); if it was new,
    /// run the handler and commit both. If it was there, compare the payload's fingerprint:
    /// equal, [`Processed::Duplicate`]; different, [`ConsumerError::PayloadMismatch`]. A
    /// concurrent delivery of the same message waits on the first one's uncommitted identity
    /// (PostgreSQL's unique index blocks the second insert) and is then a duplicate if the first
    /// committed, or applies it if the first rolled back: the handler never runs twice.
    ///
    /// Acknowledge the delivery on `Ok` only; on any error leave it to be redelivered, except
    /// [`ConsumerError::PayloadMismatch`], which will never pass.
    pub async fn process<H: Handler<E> + ?Sized>(
        &self,
        handler: &H,
        message: &Message,
    ) -> Result<Processed, ConsumerError> {
        let span = tracing::info_span!(
            "idemflow.consume",
            subscriber = %self.subscriber,
            message_id = %message.id(),
            outcome = tracing::field::Empty,
        );
        async {
            let result = self.process_in_transaction(handler, message).await;
            let (outcome, metric) = match &result {
                Ok(Processed::Applied) => ("applied", Some(PROCESSED)),
                Ok(Processed::Duplicate) => ("duplicate", Some(DUPLICATES)),
                Err(ConsumerError::PayloadMismatch { .. }) => ("refused", Some(REFUSED)),
                Err(ConsumerError::Crashed(_)) => ("crashed", None),
                Err(ConsumerError::TransactionEnded(_)) => ("transaction_ended", Some(FAILED)),
                Err(_) => ("failed", Some(FAILED)),
            };
            tracing::Span::current().record("outcome", outcome);
            if let Some(metric) = metric {
                count(metric, self.subscriber.as_str());
            }
            match &result {
                Err(error @ ConsumerError::PayloadMismatch { .. }) => {
                    tracing::error!(%error, "message id reused with another payload");
                }
                // Logged where it was found, at ERROR.
                Err(ConsumerError::Crashed(_) | ConsumerError::TransactionEnded(_)) | Ok(_) => {}
                Err(error) => tracing::warn!(%error, "delivery rolled back"),
            }
            result
        }
        .instrument(span)
        .await
    }

    async fn process_in_transaction<H: Handler<E> + ?Sized>(
        &self,
        handler: &H,
        message: &Message,
    ) -> Result<Processed, ConsumerError> {
        let failed = |error| consumer_error(error, message.id());
        let mut transaction = E::begin_delivery(&self.pool, self.wait_limit)
            .await
            .map_err(failed)?;
        let subscriber = self.subscriber.as_str();
        let mut rounds = 0;
        // The identity before the effects: a second delivery in flight waits here, behind the
        // first's uncommitted identity, rather than running the handler beside it.
        loop {
            let fingerprint = message.fingerprint().as_slice();
            if E::insert_identity(&mut transaction, subscriber, message.id(), fingerprint)
                .await
                .map_err(failed)?
            {
                break;
            }
            // A separate statement, so a fresh snapshot (Read Committed) sees the row that the
            // insert found, committed by another transaction after this one began.
            let stored = E::stored_fingerprint(&mut transaction, subscriber, message.id())
                .await
                .map_err(failed)?;
            match stored {
                Some(stored) => {
                    E::rollback(transaction).await.map_err(failed)?;
                    if stored.as_slice() == message.fingerprint().as_slice() {
                        return Ok(Processed::Duplicate);
                    }
                    return Err(ConsumerError::PayloadMismatch {
                        subscriber: self.subscriber.to_string(),
                        message_id: message.id().to_owned(),
                        stored: hex(&stored),
                        received: hex(message.fingerprint()),
                    });
                }
                // Retention deleted it between the two statements: the insert may win now.
                None if rounds + 1 < ROUNDS => rounds += 1,
                None => return Err(ConsumerError::Contended(message.id().to_owned())),
            }
        }
        self.apply(handler, message, transaction).await
    }

    /// Runs the handler in the delivery's transaction, which holds the message's new identity,
    /// and commits both, unless the handler failed or ended that transaction itself.
    async fn apply<H: Handler<E> + ?Sized>(
        &self,
        handler: &H,
        message: &Message,
        mut transaction: E::Transaction,
    ) -> Result<Processed, ConsumerError> {
        let failed = |error| consumer_error(error, message.id());
        let handled = CatchPanic(Box::pin(
            handler.handle(E::connection(&mut transaction), message),
        ))
        .await;
        if handled.is_ok() {
            // A handler holds the connection itself: before anything commits in its name, the
            // transaction must still be the one the delivery began.
            let standing = E::standing(&mut transaction).await.map_err(failed)?;
            if standing != Standing::Open {
                E::abandon(transaction);
                return self
                    .after_transaction_ended(message, standing, handled)
                    .await;
            }
        }
        match handled {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                E::rollback(transaction).await.map_err(failed)?;
                return Err(ConsumerError::Handler(error));
            }
            Err(panic) => {
                // The transaction may be mid-statement: its connection is closed, and the
                // database rolls back.
                E::abandon(transaction);
                return Err(ConsumerError::Panicked(panic));
            }
        }
        if self
            .crashes_at(ConsumerCrashPoint::BeforeCommit, message)
            .await
        {
            // Dropping the transaction rolls it back, as the database does when a process dies.
            drop(transaction);
            return Err(ConsumerError::Crashed(ConsumerCrashPoint::BeforeCommit));
        }
        E::commit_keeping(transaction).await.map_err(failed)?;
        if self
            .crashes_at(ConsumerCrashPoint::AfterCommit, message)
            .await
        {
            return Err(ConsumerError::Crashed(ConsumerCrashPoint::AfterCommit));
        }
        Ok(Processed::Applied)
    }

    /// The handler ended the delivery's transaction. Whether the identity committed (with a
    /// `COMMIT` of the handler's) is read by inserting it again, in a transaction of its own.
    /// Rolled back whole by the database with the identity, nothing committed: the delivery
    /// failed as any other and is redelivered. Otherwise the effects may have committed: the
    /// identity is recorded (if it is not already), so the message is never applied again.
    async fn after_transaction_ended(
        &self,
        message: &Message,
        standing: Standing,
        handled: Result<Result<(), HandlerError>, String>,
    ) -> Result<Processed, ConsumerError> {
        let failed = |error| consumer_error(error, message.id());
        let mut transaction = E::begin_delivery(&self.pool, self.wait_limit)
            .await
            .map_err(failed)?;
        let fingerprint = message.fingerprint().as_slice();
        let recorded_now = E::insert_identity(
            &mut transaction,
            self.subscriber.as_str(),
            message.id(),
            fingerprint,
        )
        .await
        .map_err(failed)?;
        if recorded_now && standing == Standing::RolledBack {
            E::rollback(transaction).await.map_err(failed)?;
            return Err(match handled {
                Ok(Err(error)) => ConsumerError::Handler(error),
                _ => ConsumerError::Handler(HandlerError::from(
                    "the delivery's transaction was rolled back under the handler",
                )),
            });
        }
        E::commit_keeping(transaction).await.map_err(failed)?;
        tracing::error!(
            "the handler ended the delivery's transaction; the message is recorded applied and \
             never applied again (docs/consumer.md: what a handler must not do)"
        );
        Err(ConsumerError::TransactionEnded(message.id().to_owned()))
    }

    async fn crashes_at(&self, point: ConsumerCrashPoint, message: &Message) -> bool {
        match &self.crash_hook {
            None => false,
            Some(hook) => hook.crash_at(point, message).await,
        }
    }
}

/// An engine's error as the consumer reports it: busy is another delivery of the message holding
/// it past the wait limit; a deadlock's victim (MariaDB's waiting inserts of one identity) is
/// one too, its delivery rolled back whole.
fn consumer_error(error: EngineError, message_id: &str) -> ConsumerError {
    match error {
        EngineError::Busy => ConsumerError::HeldElsewhere(message_id.to_owned()),
        EngineError::Database(error) if error.is_restartable() => {
            ConsumerError::HeldElsewhere(message_id.to_owned())
        }
        EngineError::Database(error) => ConsumerError::Database(error),
        other => ConsumerError::Database(DatabaseError::other(other)),
    }
}

/// A handler's future with its panics caught: a panic must not unwind through the caller's
/// delivery loop (and its broker channel) with the transaction's outcome unknown.
///
/// Unwind safety: what the handler touched of this crate's state is the transaction, which is
/// dropped (rolled back) after a panic.
struct CatchPanic<'a, T>(Pin<Box<dyn Future<Output = T> + Send + 'a>>);

impl<T> Future for CatchPanic<'_, T> {
    type Output = Result<T, String>;

    fn poll(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let future = self.0.as_mut();
        match catch_unwind(AssertUnwindSafe(|| future.poll(context))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(payload) => Poll::Ready(Err(panic_message(payload.as_ref()))),
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with a payload that is not text".to_owned())
}
