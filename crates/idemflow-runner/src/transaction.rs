use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres, Transaction};

type Tx = Transaction<'static, Postgres>;

/// Begins a transaction on a pooled connection, safely under cancellation.
///
/// Why not `pool.begin()`: sqlx 0.9 leaves a connection inside an open transaction, and returns
/// it to the pool, when the future is dropped during `BEGIN`'s round trip (sqlx issue 4393). Here
/// `BEGIN` runs in its own task: if the caller goes away, the task still completes it, and the
/// unclaimed transaction is then dropped inside the task, which rolls it back. Once a
/// `Transaction` exists, sqlx rolls it back on drop by itself.
pub(crate) async fn begin(pool: &PgPool) -> Result<Tx, sqlx::Error> {
    let pool = pool.clone();
    joined(tokio::spawn(async move { pool.begin().await })).await
}

/// As [`begin`], on a connection the caller already holds.
pub(crate) async fn begin_on(connection: PoolConnection<Postgres>) -> Result<Tx, sqlx::Error> {
    joined(tokio::spawn(async move {
        Transaction::begin(connection, None).await
    }))
    .await
}

async fn joined(task: tokio::task::JoinHandle<Result<Tx, sqlx::Error>>) -> Result<Tx, sqlx::Error> {
    match task.await {
        Ok(result) => result,
        Err(join_error) if join_error.is_panic() => {
            std::panic::resume_unwind(join_error.into_panic())
        }
        Err(_) => Err(sqlx::Error::PoolClosed),
    }
}
