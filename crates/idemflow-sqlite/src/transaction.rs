//! [`Transaction`]: the engine's write transaction on SQLite, `BEGIN IMMEDIATE`.
//!
//! A deferred `BEGIN` takes the write lock at its first write; if another connection wrote in
//! between, the upgrade fails with `SQLITE_BUSY` at once (the busy handler cannot help: waiting
//! would not make this transaction's snapshot current), half-way through a claim or a phase.
//! `BEGIN IMMEDIATE` takes the write lock first, waiting up to the busy timeout, so a transaction
//! that began never fails on a lock afterwards.
//!
//! Dropped unfinished (a timeout, a cancelled request), the connection is closed rather than
//! handed back to the pool inside the transaction: the next user would otherwise run inside it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use idemflow_store::Standing;
use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteTransactionManager;
use sqlx::{AssertSqlSafe, SqlSafeStr, Sqlite, SqliteConnection};
use sqlx_core::transaction::TransactionManager;

use crate::error::StoreError;

/// A write transaction holding SQLite's write lock from its first statement.
#[derive(Debug)]
pub struct Transaction {
    connection: Option<PoolConnection<Sqlite>>,
    ends: Arc<Ends>,
}

/// What ended transactions on the connection since this one began, as SQLite's commit and
/// rollback hooks saw it. SQLite rolls a whole transaction back by itself when a write in it is
/// interrupted (the engine's statement timeout), or meets a full disk or an I/O error; a phase
/// may `COMMIT` or `ROLLBACK` it too. The hooks tell a rollback with nothing committed since (the
/// attempt's writes are all undone) from anything that may have committed.
#[derive(Debug, Default)]
struct Ends {
    committed: AtomicBool,
    rolled_back: AtomicBool,
}

impl Transaction {
    /// `BEGIN IMMEDIATE` on `connection`: waits for the write lock up to the busy timeout, then
    /// answers [`StoreError::Busy`] with nothing begun.
    pub async fn begin(connection: PoolConnection<Sqlite>) -> Result<Self, StoreError> {
        // The guard exists before BEGIN is sent: dropped while BEGIN is in flight, it closes the
        // connection too.
        let mut transaction = Self {
            connection: Some(connection),
            ends: Arc::default(),
        };
        // Through sqlx's transaction manager, so it counts the transaction: a phase's own
        // `begin()` inside it becomes a savepoint, as on PostgreSQL.
        let statement = AssertSqlSafe("BEGIN IMMEDIATE").into_sql_str();
        SqliteTransactionManager::begin(transaction.connection(), Some(statement)).await?;
        transaction.watch_ends().await?;
        Ok(transaction)
    }

    /// Installs the hooks that fill [`Ends`] for this transaction (replacing an earlier
    /// transaction's on the same connection: one hook of each kind per connection).
    async fn watch_ends(&mut self) -> Result<(), StoreError> {
        let committed = Arc::clone(&self.ends);
        let rolled_back = Arc::clone(&self.ends);
        let mut handle = self.connection().lock_handle().await?;
        handle.set_commit_hook(move || {
            committed.committed.store(true, Ordering::Relaxed);
            true
        });
        handle.set_rollback_hook(move || rolled_back.rolled_back.store(true, Ordering::Relaxed));
        Ok(())
    }

    /// Whether this is still the transaction the engine began (`idemflow_store::Standing`): no
    /// commit and no rollback on its connection since it began. Read in the process, no statement.
    pub fn standing(&self) -> Standing {
        if self.ends.committed.load(Ordering::Relaxed) {
            Standing::Ended
        } else if self.ends.rolled_back.load(Ordering::Relaxed) {
            Standing::RolledBack
        } else {
            Standing::Open
        }
    }

    /// The connection, inside the transaction (a local phase's writes go here).
    pub fn connection(&mut self) -> &mut SqliteConnection {
        self.connection
            .as_deref_mut()
            .unwrap_or_else(|| unreachable!("a transaction holds its connection until it ends"))
    }

    /// Commits, and hands the connection back.
    pub async fn commit(mut self) -> Result<PoolConnection<Sqlite>, StoreError> {
        SqliteTransactionManager::commit(self.connection()).await?;
        Ok(self.release())
    }

    /// Rolls back, and hands the connection back.
    pub async fn rollback(mut self) -> Result<PoolConnection<Sqlite>, StoreError> {
        SqliteTransactionManager::rollback(self.connection()).await?;
        Ok(self.release())
    }

    /// Gives the connection up rather than back: it closes instead of returning to the pool, and
    /// SQLite rolls back as it closes. For a transaction abandoned while a statement may still be
    /// running on it (a phase past its time limit).
    pub fn abandon(self) {
        // Dropping unfinished closes the connection.
        drop(self);
    }

    /// Rolls back to the savepoint a claim ends with ([`crate::statements::CLAIMED_SAVEPOINT`]):
    /// every effect since the claim is undone and the claim is kept, still uncommitted, so a
    /// failed first attempt is recorded under it.
    pub async fn back_to_claim(&mut self) -> Result<(), StoreError> {
        sqlx::query(crate::statements::BACK_TO_CLAIM)
            .execute(self.connection())
            .await?;
        Ok(())
    }

    fn release(&mut self) -> PoolConnection<Sqlite> {
        self.connection
            .take()
            .unwrap_or_else(|| unreachable!("a transaction ends once"))
    }
}

impl Drop for Transaction {
    fn drop(&mut self) {
        // Unfinished (or its COMMIT failed): the connection closes instead of going back to the
        // pool, and SQLite rolls the transaction back as it closes.
        if let Some(mut connection) = self.connection.take() {
            connection.close_on_drop();
        }
    }
}
