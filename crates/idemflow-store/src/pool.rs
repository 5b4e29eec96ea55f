//! The connections an engine's requests run on: what the runner asks of a pool, whatever the
//! engine ([`ConnectionPool`]). sqlx's pools are one kind ([`sqlx::Pool`], every SQL engine's,
//! whatever its driver); an engine with no sqlx driver brings its own.

use std::fmt::Debug;
use std::ops::DerefMut;

use async_trait::async_trait;
use sqlx::pool::PoolConnection;

use crate::error::{DatabaseError, DatabaseErrorKind, EngineError};

/// A pool of connections, as the runner uses it: to take one (waiting, or only if one is free
/// now), to size its own keeping of connections by the pool's, and to let them go when the pool
/// closes.
#[async_trait]
pub trait ConnectionPool: Clone + Debug + Send + Sync + 'static {
    /// The connection a statement (and a local phase) runs on.
    type Connection: Send + 'static;
    /// A connection taken from the pool: back to it when dropped.
    type Pooled: DerefMut<Target = Self::Connection> + Debug + Send + 'static;

    /// Takes a connection, waiting for one (up to the pool's own limit).
    async fn acquire(&self) -> Result<Self::Pooled, EngineError>;
    /// A connection idle in the pool right now, or `None`.
    fn try_acquire(&self) -> Option<Self::Pooled>;
    /// Connections open now, in use or idle.
    fn size(&self) -> u32;
    /// The most connections the pool opens.
    fn max_size(&self) -> u32;
    /// Whether the pool was closed.
    fn is_closed(&self) -> bool;
    /// Returns once the pool is closed.
    async fn closed(&self);
    /// Closes the pool: its connections are closed as they come back, and no more are opened.
    async fn close(&self);
    /// Marks a taken connection to be closed when dropped rather than go back to the pool: one
    /// whose state nobody can vouch for, or that was found dead.
    fn close_on_drop(pooled: &mut Self::Pooled);
}

/// sqlx's failure to hand a connection over, as the boundary reports it: a connection that could
/// not be opened (or was found closed) is a lost one, so the caller may try another; a pool that
/// timed out or was closed is not.
fn acquire_error(error: sqlx::Error) -> EngineError {
    let kind = match error {
        sqlx::Error::Io(_) => DatabaseErrorKind::ConnectionLost,
        _ => DatabaseErrorKind::Other,
    };
    EngineError::Database(DatabaseError::new(kind, error))
}

#[async_trait]
impl<D: sqlx::Database> ConnectionPool for sqlx::Pool<D> {
    type Connection = D::Connection;
    type Pooled = PoolConnection<D>;

    async fn acquire(&self) -> Result<PoolConnection<D>, EngineError> {
        sqlx::Pool::acquire(self).await.map_err(acquire_error)
    }

    fn try_acquire(&self) -> Option<PoolConnection<D>> {
        sqlx::Pool::try_acquire(self)
    }

    fn size(&self) -> u32 {
        sqlx::Pool::size(self)
    }

    fn max_size(&self) -> u32 {
        self.options().get_max_connections()
    }

    fn is_closed(&self) -> bool {
        sqlx::Pool::is_closed(self)
    }

    async fn closed(&self) {
        self.close_event().await;
    }

    async fn close(&self) {
        sqlx::Pool::close(self).await;
    }

    fn close_on_drop(pooled: &mut PoolConnection<D>) {
        pooled.close_on_drop();
    }
}
