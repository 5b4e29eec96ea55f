//! An owner's last write of a transaction and the `COMMIT` after it, in one message:
//! [`advance_and_commit`] (before a foreign call) and [`finish_and_commit`] (the response). A
//! round trip less per commit than the write and the `COMMIT` sent one by one.
//!
//! Safety. A fenced write that matched no row must not be followed by a `COMMIT` of the phase's
//! effects, and in one message the `COMMIT` is already on its way. So the write counts the rows it
//! changed and casts the count to the domain `idemflow_fence_held` (`CHECK (VALUE = 1)`): a lost
//! fence raises `23514` on that constraint, the server skips the rest of the message, and the
//! transaction is aborted with everything in it, which is what a lost fence must do. Any other
//! failure of the write does the same. A failure of the `COMMIT` itself (a deferred constraint)
//! rolls back as a `COMMIT` always does. Either way the caller gets the transaction back, as the
//! server left it ([`Transaction::commit_after`]).
//!
//! The statements are the engine's own ([`statements::ADVANCE`], [`statements::FINISH`]) with
//! their values written in as literals (the simple query protocol takes no parameters): hex for
//! every text, JSON and byte value, integers formatted here.

use std::time::Duration;

use idemflow_core::StoredResponse;
use serde_json::Value;

use crate::error::StoreError;
use crate::literal::{bytes_expression, text_expression};
use crate::millis::millis;
use crate::owner::Owner;
use crate::statements;
use crate::transaction::Transaction;

/// The constraint a lost fence violates in a combined message.
pub(crate) const FENCE_HELD: &str = "idemflow_fence_held";

/// Why a combined write and commit failed, and the transaction as the server left it.
#[derive(Debug)]
pub struct NotCommitted {
    /// [`StoreError::Fenced`] for a lost fence; otherwise the database's error (the write failed,
    /// or the `COMMIT` was refused, or the connection broke).
    pub error: StoreError,
    /// The transaction: aborted (the write failed: a rollback to the claim's savepoint still
    /// works), or ended (the `COMMIT` was refused), or on a broken connection.
    pub transaction: Transaction,
}

/// Records a completed phase, as [`crate::advance`], and commits, in one message. Fenced.
pub async fn advance_and_commit(
    transaction: Transaction,
    owner: &Owner,
    recovery_point: &str,
    phase_output: &Value,
    lease: Duration,
) -> Result<(), NotCommitted> {
    let output = serde_json::to_string(phase_output).unwrap_or_else(|_| "null".to_owned());
    let values = [
        text_expression(owner.tenant().as_str()),
        text_expression(owner.key().as_str()),
        owner.lock_version().to_string(),
        text_expression(recovery_point),
        format!("{}::jsonb", text_expression(&output)),
        millis(lease).to_string(),
    ];
    commit_after(transaction, statements::ADVANCE, &values).await
}

/// Finishes a key with its response in the row, as [`crate::finish`], and commits, in one
/// message. Fenced. (A body stored apart goes by [`crate::finish`] and its own commit: its bytes
/// would double as hex in the message.)
pub async fn finish_and_commit(
    transaction: Transaction,
    owner: &Owner,
    recovery_point: &str,
    response: &StoredResponse,
) -> Result<(), NotCommitted> {
    let headers = serde_json::to_string(&response.headers).unwrap_or_else(|_| "[]".to_owned());
    let values = [
        text_expression(owner.tenant().as_str()),
        text_expression(owner.key().as_str()),
        owner.lock_version().to_string(),
        text_expression(recovery_point),
        i16::try_from(response.status)
            .unwrap_or(i16::MAX)
            .to_string(),
        format!("{}::jsonb", text_expression(&headers)),
        bytes_expression(&response.body),
    ];
    commit_after(transaction, statements::FINISH, &values).await
}

async fn commit_after(
    transaction: Transaction,
    write: &str,
    values: &[String],
) -> Result<(), NotCommitted> {
    let values: Vec<&str> = values.iter().map(String::as_str).collect();
    let statement = statements::fence_held(&statements::with_values(write, &values));
    transaction
        .commit_after(&statement)
        .await
        .map_err(|(error, transaction)| NotCommitted {
            error: if lost_fence(&error) {
                StoreError::Fenced
            } else {
                StoreError::Database(error)
            },
            transaction,
        })
}

fn lost_fence(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(error)
        if error.code().as_deref() == Some("23514") && error.constraint() == Some(FENCE_HELD))
}

#[cfg(test)]
mod tests {
    use idemflow_core::{Fingerprint, Key, TenantId};
    use serde_json::json;
    use sqlx::PgPool;

    use super::*;
    use crate::{ClaimRequest, Claimed, Limits, begin_claim, next_lock_version, take_over};

    /// A committed claim of key `k` (lease already over), its owner, and a table for effects
    /// whose inserts are checked only at COMMIT (a deferred foreign key).
    async fn claimed(pool: &PgPool) -> Owner {
        sqlx::raw_sql(
            "CREATE TABLE parents (id int PRIMARY KEY); \
             CREATE TABLE effects (n int NOT NULL, \
                 parent int REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
        )
        .execute(pool)
        .await
        .expect("tables");
        let (tenant, key) = (
            TenantId::new("t").expect("tenant"),
            Key::parse("k").expect("key"),
        );
        let fingerprint = Fingerprint::from_slice(&[1; 32]).expect("fingerprint");
        let request = json!({});
        let mut connection = pool.acquire().await.expect("connection");
        let lock_version = next_lock_version(&mut connection).await.expect("token");
        drop(connection);
        let claim = ClaimRequest {
            tenant: &tenant,
            key: &key,
            lock_version,
            fingerprint: &fingerprint,
            workflow: "w.v1",
            request: &request,
            lease: Duration::ZERO,
        };
        let connection = pool.acquire().await.expect("connection");
        let Ok(Claimed::Owned(transaction, owner)) =
            begin_claim(connection, &claim, &Limits::default()).await
        else {
            panic!("a new key is ours");
        };
        transaction.commit().await.expect("commit");
        owner
    }

    async fn key_state(pool: &PgPool) -> (String, String, Option<i16>) {
        sqlx::query_as("SELECT state, recovery_point, response_status FROM idempotency_keys")
            .fetch_one(pool)
            .await
            .expect("key")
    }

    async fn effects(pool: &PgPool) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM effects")
            .fetch_one(pool)
            .await
            .expect("count")
    }

    /// The connection a failed message leaves behind is clean once the transaction is rolled
    /// back: outside any transaction, its next statement runs.
    async fn clean_after(transaction: Transaction, pool: &PgPool) {
        transaction.rollback().await.ok();
        let mut connection = pool.acquire().await.expect("connection");
        let depth = <sqlx::postgres::PgTransactionManager as sqlx_core::transaction::TransactionManager>::get_transaction_depth(&connection);
        assert_eq!(depth, 0);
        // A savepoint exists only inside a transaction block: 25P01 outside one.
        let outside = sqlx::raw_sql("SAVEPOINT probe")
            .execute(&mut *connection)
            .await
            .expect_err("the connection is outside any transaction");
        assert_eq!(
            outside
                .as_database_error()
                .and_then(|error| error.code())
                .as_deref(),
            Some("25P01")
        );
    }

    fn response() -> StoredResponse {
        StoredResponse::new(201, "done")
    }

    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn a_write_and_its_commit_in_one_message_commit_both(pool: PgPool) {
        let owner = claimed(&pool).await;
        let mut transaction = Transaction::begin(&pool).await.expect("begin");
        sqlx::query("INSERT INTO effects (n) VALUES (1)")
            .execute(&mut *transaction)
            .await
            .expect("effect");
        advance_and_commit(
            transaction,
            &owner,
            "one",
            &json!({"n": 1}),
            Duration::from_secs(60),
        )
        .await
        .expect("advanced");
        assert_eq!(
            key_state(&pool).await,
            ("started".into(), "one".into(), None)
        );
        let mut transaction = Transaction::begin(&pool).await.expect("begin");
        sqlx::query("INSERT INTO effects (n) VALUES (2)")
            .execute(&mut *transaction)
            .await
            .expect("effect");
        finish_and_commit(transaction, &owner, "two", &response())
            .await
            .expect("finished");
        assert_eq!(
            key_state(&pool).await,
            ("done".into(), "two".into(), Some(201))
        );
        assert_eq!(effects(&pool).await, 2);
        let body: Vec<u8> = sqlx::query_scalar("SELECT response_body FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .expect("body");
        assert_eq!(body, b"done");
    }

    /// A lost fence fails the write, and the COMMIT in the same message never runs: the phase's
    /// effects roll back, the key is as the new owner left it.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn a_lost_fence_commits_nothing_of_the_message(pool: PgPool) {
        let owner = claimed(&pool).await;
        let mut connection = pool.acquire().await.expect("connection");
        take_over(
            &mut connection,
            owner.tenant(),
            owner.key(),
            owner.lock_version(),
            Duration::from_secs(60),
        )
        .await
        .expect("take over")
        .expect("taken");
        drop(connection);
        for finish in [false, true] {
            let mut transaction = Transaction::begin(&pool).await.expect("begin");
            sqlx::query("INSERT INTO effects (n) VALUES (1)")
                .execute(&mut *transaction)
                .await
                .expect("effect");
            let failed = if finish {
                finish_and_commit(transaction, &owner, "two", &response()).await
            } else {
                advance_and_commit(
                    transaction,
                    &owner,
                    "one",
                    &json!(1),
                    Duration::from_secs(60),
                )
                .await
            };
            let Err(NotCommitted { error, transaction }) = failed else {
                panic!("a stale owner's message commits");
            };
            assert!(matches!(error, StoreError::Fenced), "{error:?}");
            clean_after(transaction, &pool).await;
            assert_eq!(effects(&pool).await, 0);
            assert_eq!(
                key_state(&pool).await,
                ("started".into(), "start".into(), None)
            );
        }
    }

    /// A COMMIT refused (a deferred constraint) after the write succeeded in the same message:
    /// the write and the effects roll back together; the error is the database's, the
    /// transaction comes back ended, and the key is as before.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn a_refused_commit_rolls_back_the_write_with_the_effects(pool: PgPool) {
        let owner = claimed(&pool).await;
        for finish in [false, true] {
            let mut transaction = Transaction::begin(&pool).await.expect("begin");
            sqlx::query("INSERT INTO effects (n, parent) VALUES (1, 42)")
                .execute(&mut *transaction)
                .await
                .expect("a deferred violation");
            let failed = if finish {
                finish_and_commit(transaction, &owner, "two", &response()).await
            } else {
                advance_and_commit(
                    transaction,
                    &owner,
                    "one",
                    &json!(1),
                    Duration::from_secs(60),
                )
                .await
            };
            let Err(NotCommitted {
                error,
                mut transaction,
            }) = failed
            else {
                panic!("a refused commit commits");
            };
            let StoreError::Database(sqlx::Error::Database(database)) = &error else {
                panic!("{error:?}");
            };
            assert_eq!(database.code().as_deref(), Some("23503"));
            // Ended: there is no savepoint to go back to.
            assert!(transaction.back_to_claim().await.is_err());
            clean_after(transaction, &pool).await;
            assert_eq!(effects(&pool).await, 0);
            assert_eq!(
                key_state(&pool).await,
                ("started".into(), "start".into(), None)
            );
        }
    }

    /// The write failing for another reason (here an interval out of range) leaves the
    /// transaction aborted, not ended: the claim's savepoint would still be there.
    #[sqlx::test(migrator = "crate::MIGRATOR")]
    async fn a_failed_write_aborts_the_transaction_and_skips_the_commit(pool: PgPool) {
        let owner = claimed(&pool).await;
        let mut transaction = Transaction::begin(&pool).await.expect("begin");
        sqlx::raw_sql("INSERT INTO effects (n) VALUES (1); SAVEPOINT idemflow_claimed")
            .execute(&mut *transaction)
            .await
            .expect("effect and savepoint");
        let failed = advance_and_commit(
            transaction,
            &owner,
            "one",
            &json!(1),
            Duration::from_secs(u64::MAX / 1000),
        )
        .await;
        let Err(NotCommitted {
            error,
            mut transaction,
        }) = failed
        else {
            panic!("an impossible lease commits");
        };
        assert!(matches!(error, StoreError::Database(_)), "{error:?}");
        transaction
            .back_to_claim()
            .await
            .expect("the transaction is still open, aborted");
        transaction
            .commit()
            .await
            .expect("the effect before the savepoint commits");
        assert_eq!(effects(&pool).await, 1);
        assert_eq!(
            key_state(&pool).await,
            ("started".into(), "start".into(), None)
        );
    }

    /// No value reaches the SQL text but as hex or as an integer formatted here.
    #[test]
    fn values_travel_as_hex() {
        let values = [
            text_expression("t'; DROP TABLE x; --"),
            text_expression("$$ \\ '"),
        ];
        let values: Vec<&str> = values.iter().map(String::as_str).collect();
        let sql = statements::with_values("SELECT $1, $2", &values);
        let quoted: Vec<&str> = sql.split('\'').skip(1).step_by(2).collect();
        assert!(
            quoted
                .iter()
                .all(|span| span.bytes().all(|b| b.is_ascii_hexdigit())
                    || ["hex", "UTF8"].contains(span)),
            "{sql}"
        );
    }
}
