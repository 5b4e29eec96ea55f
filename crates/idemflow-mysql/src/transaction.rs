//! [`Transaction`]: the engine's write transaction on InnoDB, at READ COMMITTED (set on every
//! connection when it opens, [`crate::open`]), or at the stronger level its local phases declare
//! ([`Transaction::begin_at`]).
//!
//! Dropped unfinished (a timeout, a cancelled request), the connection is closed rather than
//! handed back to the pool inside the transaction: the next user would otherwise run inside it,
//! holding its row locks. The server rolls the transaction back when the connection closes.

use sqlx::mysql::MySqlTransactionManager;
use sqlx::pool::PoolConnection;
use sqlx::{MySql, MySqlConnection};
use sqlx_core::transaction::TransactionManager;

use idemflow_store::{Isolation, Standing};
use sqlx::Row;
use sqlx::SqlSafeStr;

use crate::error::{DEADLOCK, StoreError};

/// A write transaction on one pooled connection.
#[derive(Debug)]
pub struct Transaction {
    connection: Option<PoolConnection<MySql>>,
}

impl Transaction {
    /// `BEGIN` on `connection`.
    pub async fn begin(connection: PoolConnection<MySql>) -> Result<Self, StoreError> {
        // The guard exists before BEGIN is sent: dropped while BEGIN is in flight, it closes the
        // connection too.
        let mut transaction = Self {
            connection: Some(connection),
        };
        // Through sqlx's transaction manager, so it counts the transaction: a phase's own
        // `begin()` inside it becomes a savepoint, as on PostgreSQL.
        MySqlTransactionManager::begin(transaction.connection(), None).await?;
        Ok(transaction)
    }

    /// `BEGIN` at `isolation`: Read Committed is the session's own level; a stronger one is set
    /// for this transaction alone (`SET TRANSACTION`, which lasts until the next transaction
    /// begins) in the message that begins it, so it costs no round trip of its own and leaves
    /// the session at Read Committed for whatever runs on the connection next.
    pub async fn begin_at(
        connection: PoolConnection<MySql>,
        isolation: Isolation,
    ) -> Result<Self, StoreError> {
        if isolation == Isolation::ReadCommitted {
            return Self::begin(connection).await;
        }
        let mut transaction = Self {
            connection: Some(connection),
        };
        let statement = format!("SET TRANSACTION ISOLATION LEVEL {}; BEGIN", isolation.sql());
        MySqlTransactionManager::begin(
            transaction.connection(),
            Some(sqlx::AssertSqlSafe(statement).into_sql_str()),
        )
        .await?;
        Ok(transaction)
    }

    /// The connection, inside the transaction (a local phase's writes go here).
    pub fn connection(&mut self) -> &mut MySqlConnection {
        self.connection
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("a transaction holds its connection until it ends"))
    }

    /// Commits, and hands the connection back.
    pub async fn commit(mut self) -> Result<PoolConnection<MySql>, StoreError> {
        MySqlTransactionManager::commit(self.connection()).await?;
        Ok(self.release())
    }

    /// Rolls back, and hands the connection back.
    pub async fn rollback(mut self) -> Result<PoolConnection<MySql>, StoreError> {
        MySqlTransactionManager::rollback(self.connection()).await?;
        Ok(self.release())
    }

    /// Gives the connection up rather than back: it closes instead of returning to the pool, and
    /// the server rolls back as it closes. For a transaction abandoned while a statement may
    /// still be running on it (a phase past its time limit: the server's statement timeout ends
    /// that statement, [`crate::OpenOptions::statement_timeout`]).
    pub fn abandon(self) {
        drop(self);
    }

    /// Rolls back to the savepoint a claim ends with ([`crate::statements::CLAIMED_SAVEPOINT`]):
    /// every effect since the claim is undone and the claim is kept, still uncommitted, so a
    /// failed first attempt is recorded under it.
    ///
    /// Called after a phase gave a statement up mid-flight, the connection still owes that
    /// statement's answer: sqlx reads it before sending the next statement and reports its
    /// error (the server's statement timeout, 1969, most often) as that statement's, which was
    /// never sent. So a server error here is met once more: the second try is the rollback's own.
    pub async fn back_to_claim(&mut self) -> Result<(), StoreError> {
        let first = sqlx::query(crate::statements::BACK_TO_CLAIM)
            .execute(self.connection())
            .await;
        match first {
            Ok(_) => return Ok(()),
            Err(sqlx::Error::Database(_)) => {}
            Err(error) => return Err(error.into()),
        }
        sqlx::query(crate::statements::BACK_TO_CLAIM)
            .execute(self.connection())
            .await?;
        Ok(())
    }

    /// Whether this is still the transaction the engine began (`idemflow_store::Standing`). In
    /// a transaction: open. Out of one, it was rolled back whole, with nothing since, when the
    /// phase's last statement was a deadlock's victim (1213). Otherwise a `COMMIT`, a statement
    /// committed around, or a write after a rollback may have committed. A lock wait (1205) is
    /// not a rollback: by default InnoDB undoes the waiting statement alone, so out of a
    /// transaction after one, the transaction ended before it (and where
    /// `innodb_rollback_on_timeout` is on, the key ends with a 500 rather than risk running its
    /// phases twice). A phase that commits and then fails as a deadlock's victim reads as a
    /// rollback here (MariaDB names no transaction); where the transaction held an uncommitted
    /// claim or takeover, the runner then asks the key's row, by the owner's token and holder.
    ///
    /// A phase that ends the transaction and begins one of its own (`BEGIN` commits the open one
    /// implicitly) leaves the connection in a transaction: MariaDB names no transaction, so that
    /// one is taken for the engine's (docs/runner.md: what a phase must not do).
    pub async fn standing(&mut self) -> Result<Standing, StoreError> {
        let rows = sqlx::raw_sql(crate::statements::STANDING)
            .fetch_all(self.connection())
            .await?;
        let Some(row) = rows.last() else {
            return Err(StoreError::Corrupt(
                "no answer to the standing check".to_owned(),
            ));
        };
        let in_transaction: i64 = row.try_get(0)?;
        let last_error: i64 = row.try_get(1)?;
        Ok(match (in_transaction, u16::try_from(last_error)) {
            (1, _) => Standing::Open,
            (_, Ok(DEADLOCK)) => Standing::RolledBack,
            _ => Standing::Ended,
        })
    }

    fn release(&mut self) -> PoolConnection<MySql> {
        self.connection
            .take()
            .unwrap_or_else(|| unreachable!("a transaction ends once"))
    }
}

impl Drop for Transaction {
    fn drop(&mut self) {
        if let Some(mut connection) = self.connection.take() {
            connection.close_on_drop();
        }
    }
}
