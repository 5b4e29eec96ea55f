//! [`StoreError`], the one error type of every store call: callers tell a lost fence (stop work
//! on the key) from a database failure (the transaction is lost) and from a row that breaks the
//! schema's promises, whichever statement reported it.

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A fenced write updated no row: another owner took the key over (or it was finished or
    /// deleted). The caller must roll back its transaction and stop working on the key.
    #[error("fenced: the lease on this key was lost to another owner")]
    Fenced,
    /// A statement failed or the connection broke: sqlx's error, as it came. A transaction it
    /// happened in is lost.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// A stored row breaks the schema's promises (for instance a fingerprint that is not 32
    /// bytes). Never expected; reported rather than guessed around.
    #[error("corrupt key row: {0}")]
    Corrupt(String),
    /// The table's layout does not allow what was asked (adopting the partitioned layout twice,
    /// a partition plan that cannot work).
    #[error("layout: {0}")]
    Layout(String),
}
