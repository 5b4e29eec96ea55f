//! The claim of a new key ([`begin_claim`]): a transaction that inserts the key's row, and stays
//! open for the leading local phases.
//!
//! The primary key is the claim's exclusion. A committed row of the key refuses the insert with
//! a duplicate-key error (1062): the claim is lost, nothing written. An uncommitted one (another
//! claim in flight) makes the insert wait for that transaction, up to the lock wait timeout:
//! committed, the insert is refused as above; rolled back, the insert goes on and the key is
//! ours; still open at the timeout, the claim answers busy. Several claims waiting on one can
//! deadlock as the first ends (each holds a shared lock on the duplicate and wants it
//! exclusively): InnoDB rolls a victim back (1213), and its claim, which had written nothing
//! else, is tried again.

use std::time::Duration;

use futures_util::StreamExt;
use sqlx::MySql;
use sqlx::pool::PoolConnection;

use crate::error::{DEADLOCK, DUPLICATE_KEY, StoreError, error_number};
use crate::statements::{self, FENCES_PER_LIFE};
use crate::transaction::Transaction;
use idemflow_store::{Isolation, Owner};

/// Everything a claim stores: the boundary's [`idemflow_store::Claim`].
pub type ClaimRequest<'a> = idemflow_store::Claim<'a>;

/// What [`begin_claim`] did.
#[derive(Debug)]
pub enum Claimed {
    /// The key is ours: the transaction holds the uncommitted claim.
    Owned(Transaction, Owner),
    /// Another claim of this key committed first. Nothing was written; look the key up again.
    Lost(PoolConnection<MySql>),
}

/// The unique index on the life, as a duplicate-key error names it (MySQL prefixes the table).
const LIFE_INDEX: &str = "idempotency_keys_life";

/// How many times a claim chosen as a deadlock's victim is tried again before it answers busy.
const DEADLOCK_RETRIES: usize = 3;

/// Begins a transaction holding the claim of a new key.
pub async fn begin_claim(
    connection: PoolConnection<MySql>,
    claim: &ClaimRequest<'_>,
) -> Result<Claimed, StoreError> {
    begin_claim_at(connection, claim, Isolation::ReadCommitted).await
}

/// [`begin_claim`], the transaction at `isolation` (the level its leading local phases declare).
/// The primary key decides at every level: InnoDB checks a duplicate against the latest
/// committed row with a locking read, whatever the transaction's snapshot.
pub async fn begin_claim_at(
    connection: PoolConnection<MySql>,
    claim: &ClaimRequest<'_>,
    isolation: Isolation,
) -> Result<Claimed, StoreError> {
    claim_in_life(connection, claim, isolation, None).await
}

/// The claim made again with the token `token` its rolled-back insert drew (its transaction
/// undone whole, the claim never committed, so nobody else saw the life): the insert stores that
/// life rather than drawing one. A token that is not a claim's (a fence in its low bits), or a
/// life the unique index finds taken (only if the counter went back below it, as a server whose
/// counter was not durable can), draws a new life as a first claim does.
pub async fn claim_again_at(
    connection: PoolConnection<MySql>,
    claim: &ClaimRequest<'_>,
    token: i64,
    isolation: Isolation,
) -> Result<Claimed, StoreError> {
    let life = (token > 0 && token % FENCES_PER_LIFE == 0).then_some(token / FENCES_PER_LIFE);
    claim_in_life(connection, claim, isolation, life).await
}

/// The claim, its life drawn by the insert or, when `life` is set, that one.
async fn claim_in_life(
    mut connection: PoolConnection<MySql>,
    claim: &ClaimRequest<'_>,
    isolation: Isolation,
    mut life: Option<i64>,
) -> Result<Claimed, StoreError> {
    let request = serde_json::to_string(claim.request)
        .map_err(|error| StoreError::Corrupt(format!("request: {error}")))?;
    let mut tries = 0;
    while tries < DEADLOCK_RETRIES {
        let mut transaction = Transaction::begin_at(connection, isolation).await?;
        let sql = statements::claim_then_savepoint_in_life(
            claim.tenant.as_str().as_bytes(),
            claim.key.as_str().as_bytes(),
            claim.fingerprint.as_bytes(),
            claim.workflow,
            &request,
            millis(claim.lease),
            life,
        );
        let (inserted, saved) = send(&mut transaction, sql).await;
        match inserted {
            Ok(done) => {
                let life = match life {
                    Some(life) => life,
                    None => i64::try_from(done.last_insert_id())
                        .map_err(|_| StoreError::Corrupt("a life past i64".to_owned()))?,
                };
                saved.unwrap_or_else(|| {
                    Err(sqlx::Error::Protocol(
                        "no result for the claim's savepoint".into(),
                    ))
                })?;
                let token = life
                    .checked_mul(FENCES_PER_LIFE)
                    .ok_or_else(|| StoreError::Corrupt(format!("life {life} past the tokens")))?;
                return Ok(Claimed::Owned(
                    transaction,
                    Owner::new(claim.tenant.clone(), claim.key.clone(), token),
                ));
            }
            // The life given is another row's: drawn again, not a lost claim (not a try).
            Err(error)
                if life.is_some()
                    && error_number(&error) == Some(DUPLICATE_KEY)
                    && error.to_string().contains(LIFE_INDEX) =>
            {
                life = None;
                connection = transaction.rollback().await?;
            }
            Err(error) if error_number(&error) == Some(DUPLICATE_KEY) => {
                return Ok(Claimed::Lost(transaction.rollback().await?));
            }
            // The victim's transaction is already rolled back; its connection serves on.
            Err(error) if error_number(&error) == Some(DEADLOCK) => {
                tries += 1;
                connection = transaction.rollback().await?;
            }
            Err(error) => return Err(error.into()),
        }
    }
    Err(StoreError::Busy)
}

/// The claim's message: one result per statement, the insert's (its id is the life), then the
/// savepoint's. An error ends the message, so the savepoint never runs without the insert. The
/// stream is read to its end: left part-read, the connection would still owe it the rest.
async fn send(
    transaction: &mut Transaction,
    sql: String,
) -> (
    Result<sqlx::mysql::MySqlQueryResult, sqlx::Error>,
    Option<Result<sqlx::mysql::MySqlQueryResult, sqlx::Error>>,
) {
    let mut results = Vec::with_capacity(2);
    let mut stream = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute_many(transaction.connection());
    while let Some(result) = stream.next().await {
        results.push(result);
    }
    drop(stream);
    let mut results = results.into_iter();
    let inserted = results
        .next()
        .unwrap_or_else(|| Err(sqlx::Error::Protocol("no result for the claim".into())));
    (inserted, results.next())
}

/// Whole milliseconds, saturating (a lease of centuries is as good as forever).
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 2)
}
