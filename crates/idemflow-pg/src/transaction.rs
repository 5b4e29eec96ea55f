//! A transaction that owns its pooled connection, whatever happens while it begins.
//!
//! Why not sqlx's `Transaction`: it takes the connection by value before `BEGIN` runs, so when
//! the begin statement fails (or its future is dropped half-way) the connection goes back to the
//! pool in whatever state the server left it, possibly inside an open or aborted transaction
//! (sqlx issue 4393). The claim's begin statement is *meant* to fail on a conflict (see
//! [`crate::begin_claim`]), so this type keeps the connection in hand and cleans it up:
//!
//! - while beginning, a dropped future closes the connection (the server then rolls back
//!   whatever began), and a failed begin statement is rolled back explicitly;
//! - once open, it behaves as sqlx's transaction does: `commit`/`rollback`, and on drop a
//!   `ROLLBACK` is queued and sent when the connection returns to the pool. sqlx counts the
//!   transaction, so a phase that calls `begin()` on the connection gets a savepoint.

use std::fmt::Write;
use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::postgres::PgTransactionManager;
use sqlx::{AssertSqlSafe, PgConnection, PgPool, Postgres, SqlSafeStr, SqlStr};
use sqlx_core::transaction::TransactionManager;

pub use idemflow_store::Limits;

/// How every transaction of the engine begins unless a local phase in it declares a stronger
/// level: at Read Committed, stated, whatever the database's or the role's
/// `default_transaction_isolation`. The protocol's arguments are made at Read Committed
/// (docs/protocol.md): the partitioned layout's uniqueness check needs a snapshot taken after the
/// claim lock, which only Read Committed gives a statement (its trigger refuses any other level).
/// A transaction whose phases declare Repeatable Read or Serializable states that level in the
/// same place ([`crate::statements::begin_message`]), and docs/protocol.md argues the claim and
/// the fence there. Part of the `BEGIN`'s own message: no round trip of its own.
pub const BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

/// The mark every transaction of the engine carries for its life: a setting of its own, made
/// `LOCAL` by its `BEGIN`'s message, so it is gone the moment the transaction ends, whoever ends
/// it. The owner's writes run only where it is set ([`STILL_OPEN`]): a phase that committed or
/// rolled back the engine's transaction (and perhaps began one of its own) cannot have a
/// recovery point written apart from its effects (`idemflow_store::Standing`).
pub(crate) const MARK: &str = "SET LOCAL idemflow.transaction = 'open'";

/// True only inside a transaction the engine began ([`MARK`]); part of every owner's write that
/// records a phase's work (the statements spell it out; their tests hold them to this).
#[cfg(test)]
pub(crate) const STILL_OPEN: &str = "current_setting('idemflow.transaction', true) = 'open'";

/// Whether [`STILL_OPEN`] holds on a connection.
const STANDING: &str =
    "SELECT coalesce(current_setting('idemflow.transaction', true) = 'open', false)";

use crate::statements::BEGUN_SAVEPOINT;

/// Back to [`BEGUN_SAVEPOINT`].
const BACK_TO_BEGIN: &str = "ROLLBACK TO SAVEPOINT idemflow_begun";

/// [`BEGIN`] (or its stronger level, `limits.isolation`), the engine's [`MARK`], then a
/// `SET LOCAL` per limit (`statement_timeout`, `idle_in_transaction_session_timeout`,
/// `lock_timeout`): in the message that begins the transaction, so no round trip of its own, and
/// gone when it ends, so pooled connections keep their own settings. Integers and the level's
/// fixed words formatted here, nothing else.
pub(crate) fn begin_statement(limits: &Limits) -> String {
    let mut sql = match limits.isolation {
        idemflow_store::Isolation::ReadCommitted => format!("{BEGIN}; {MARK}"),
        level => format!("BEGIN ISOLATION LEVEL {}; {MARK}", level.sql()),
    };
    for (setting, limit) in [
        ("statement_timeout", limits.statement_timeout),
        ("idle_in_transaction_session_timeout", limits.idle_timeout),
        ("lock_timeout", limits.lock_timeout),
    ] {
        if let Some(limit) = limit {
            // 0 would mean "no limit": the shortest limit is a millisecond.
            let millis = crate::millis::millis(limit).clamp(1, i64::from(i32::MAX));
            let _ = write!(sql, "; SET LOCAL {setting} = {millis}");
        }
    }
    sql
}

/// An open transaction on a pooled connection. Dereferences to the connection, so store
/// functions and phases run their statements inside it.
#[derive(Debug)]
pub struct Transaction {
    /// Always `Some`, but for the moment [`Transaction::commit_keeping`] takes it out.
    connection: Option<PoolConnection<Postgres>>,
    open: bool,
}

impl Transaction {
    /// Takes a connection from the pool and begins a transaction on it.
    pub async fn begin(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Self::begin_on(pool.acquire().await?).await
    }

    /// Begins a transaction on a connection the caller already holds.
    pub async fn begin_on(connection: PoolConnection<Postgres>) -> Result<Self, sqlx::Error> {
        Self::begin_limited(connection, &Limits::default()).await
    }

    /// Begins a transaction under `limits`, on a connection the caller holds.
    pub async fn begin_limited(
        connection: PoolConnection<Postgres>,
        limits: &Limits,
    ) -> Result<Self, sqlx::Error> {
        let statement = format!("{}; {BEGUN_SAVEPOINT}", begin_statement(limits));
        let statement = AssertSqlSafe(statement).into_sql_str();
        match Self::begin_with(connection, statement).await {
            Ok(transaction) => Ok(transaction),
            Err((error, _connection)) => Err(error),
        }
    }

    /// Gives the connection up rather than back: it closes instead of returning to the pool. For
    /// a transaction abandoned while a statement may still be running on it (a phase that
    /// overran its time limit), whose state nobody can vouch for; the server rolls back.
    pub fn abandon(mut self) {
        self.held().close_on_drop();
        self.open = false;
    }

    /// Begins with `statement`: [`BEGIN`], and more statements in the same message. On failure the
    /// connection is handed back idle: the failed transaction was rolled
    /// back (or, when even that failed, the connection will close rather than return to the pool).
    pub(crate) async fn begin_with(
        connection: PoolConnection<Postgres>,
        statement: SqlStr,
    ) -> Result<Self, (sqlx::Error, PoolConnection<Postgres>)> {
        let mut beginning = Beginning(Some(connection));
        let result = PgTransactionManager::begin(beginning.connection(), Some(statement)).await;
        match result {
            Ok(()) => Ok(Self {
                connection: Some(beginning.finish()),
                open: true,
            }),
            Err(error) => {
                // sqlx counts the transaction only once its begin statement succeeded; the server
                // may still be inside it (aborted), so end it here before anyone reuses the
                // connection. ROLLBACK outside a transaction only warns.
                let rolled_back = sqlx::Executor::execute(beginning.connection(), "ROLLBACK").await;
                let mut connection = beginning.finish();
                if rolled_back.is_err() {
                    connection.close_on_drop();
                }
                Err((error, connection))
            }
        }
    }

    /// Commits. If the commit fails the transaction counts as open, and dropping it rolls back.
    pub async fn commit(self) -> Result<(), sqlx::Error> {
        self.commit_keeping().await.map(drop)
    }

    /// Commits, and hands back the connection, idle: for a caller that sends its next statement
    /// on it rather than on one from the pool. If the commit fails the transaction counts as
    /// open, and dropping it rolls back.
    pub async fn commit_keeping(mut self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        PgTransactionManager::commit(self.held()).await?;
        self.open = false;
        Ok(self
            .connection
            .take()
            .expect("a transaction holds its connection until it ends"))
    }

    fn held(&mut self) -> &mut PoolConnection<Postgres> {
        self.connection
            .as_mut()
            .expect("a transaction holds its connection until it ends")
    }

    /// Rolls back to the savepoint the claim's message ends with ([`crate::statements::CLAIMED_SAVEPOINT`]):
    /// every effect since the claim is undone and the claim is kept, still uncommitted, so a
    /// failed first attempt is recorded under it. Works in a transaction a failed statement
    /// aborted; an error means the connection (and with it the claim) is gone.
    ///
    /// A phase stopped past its time limit may have left a statement in flight: sqlx reads that
    /// statement's answer before sending the next one, and reports an error in it (the server's
    /// `statement_timeout` cancelling it, say) as the next statement's own, which then was never
    /// sent. So an error from the server is followed by one more try; only a second one, or a
    /// lost connection, means the claim is gone.
    pub async fn back_to_claim(&mut self) -> Result<(), sqlx::Error> {
        let first =
            sqlx::Executor::execute(&mut **self.held(), crate::statements::BACK_TO_CLAIM).await;
        match first {
            Ok(_) => Ok(()),
            Err(sqlx::Error::Database(_)) => {
                sqlx::Executor::execute(&mut **self.held(), crate::statements::BACK_TO_CLAIM)
                    .await?;
                Ok(())
            }
            Err(error) => Err(error),
        }
    }

    /// Whether this is still the transaction the engine began (its mark). PostgreSQL never ends a
    /// transaction by itself (an error aborts it, and it stays open until rolled back), so one that
    /// ended was ended by a phase's `COMMIT` or `ROLLBACK`: which, the engine cannot tell.
    ///
    /// A transaction a failed statement aborted answers nothing but a rollback: it is rolled back
    /// to the engine's savepoint (the claim's, or the one every other transaction begins with),
    /// which undoes the failed attempt's work as the failure path would, and then read. One
    /// without either savepoint is not the engine's: a phase ended that one and began its own.
    pub async fn standing(&mut self) -> Result<idemflow_store::Standing, sqlx::Error> {
        let read = sqlx::query_scalar(STANDING)
            .fetch_one(&mut **self.held())
            .await;
        let open: bool = match read {
            Ok(open) => open,
            Err(error) if has_code(&error, IN_FAILED_TRANSACTION) => {
                if !self.back_to_a_savepoint_of_its_own().await? {
                    return Ok(idemflow_store::Standing::Ended);
                }
                sqlx::query_scalar(STANDING)
                    .fetch_one(&mut **self.held())
                    .await?
            }
            Err(error) => return Err(error),
        };
        Ok(if open {
            idemflow_store::Standing::Open
        } else {
            idemflow_store::Standing::Ended
        })
    }

    /// Rolls an aborted transaction back to the claim's savepoint or the one every other
    /// transaction of the engine begins with; false when it has neither.
    async fn back_to_a_savepoint_of_its_own(&mut self) -> Result<bool, sqlx::Error> {
        for statement in [crate::statements::BACK_TO_CLAIM, BACK_TO_BEGIN] {
            match sqlx::Executor::execute(&mut **self.held(), statement).await {
                Ok(_) => return Ok(true),
                Err(error) if has_code(&error, NO_SUCH_SAVEPOINT) => continue,
                Err(error) => return Err(error),
            }
        }
        Ok(false)
    }

    /// Rolls back and waits for the server to confirm.
    pub async fn rollback(mut self) -> Result<(), sqlx::Error> {
        PgTransactionManager::rollback(self.held()).await?;
        self.open = false;
        Ok(())
    }
}

impl Deref for Transaction {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.connection
            .as_ref()
            .expect("a transaction holds its connection until it ends")
    }
}

impl DerefMut for Transaction {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.held()
    }
}

impl Drop for Transaction {
    fn drop(&mut self) {
        if let (true, Some(connection)) = (self.open, self.connection.as_mut()) {
            // Queued, not sent: it goes out with the connection's return to the pool, so a
            // caller that drops a transaction it no longer needs does not wait for it.
            PgTransactionManager::start_rollback(connection);
        }
    }
}

/// A connection between `BEGIN` being sent and its outcome being known. Dropped there (the
/// caller's future cancelled), the connection is closed: its transaction state is unknown.
struct Beginning(Option<PoolConnection<Postgres>>);

impl Beginning {
    fn connection(&mut self) -> &mut PgConnection {
        self.0
            .as_mut()
            .expect("a beginning transaction holds its connection until finished")
    }

    fn finish(mut self) -> PoolConnection<Postgres> {
        self.0
            .take()
            .expect("a beginning transaction holds its connection until finished")
    }
}

impl Drop for Beginning {
    fn drop(&mut self) {
        if let Some(connection) = &mut self.0 {
            connection.close_on_drop();
        }
    }
}

/// `in_failed_sql_transaction`: a statement sent to a transaction a failed statement aborted.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// `invalid_savepoint_specification`: no savepoint of that name in the transaction.
const NO_SUCH_SAVEPOINT: &str = "3B001";

fn has_code(error: &sqlx::Error, code: &str) -> bool {
    matches!(error, sqlx::Error::Database(error) if error.code().as_deref() == Some(code))
}
