//! The conformance suite of the engine boundary: every case is written once, generic over
//! [`Engine`], and runs against each engine (`conformance!` below makes one test per case and
//! engine). A new engine is proven by adding its line here, not by tests of its own.
//!
//! A case speaks only the boundary: the protocol's steps ([`Engine`], each on a connection of its
//! own, as a runner takes them: [`steps`]), what a test does behind the engine's back in the
//! engine's own statements ([`Tamper`]: leases ended and keys aged by rewinding them, never by
//! sleeping; journals damaged), and what operators read and do ([`Engine::operator`]: reports,
//! the console's scan, overview and expiry).

use std::time::Duration;

use idemflow_core::{FieldValue, Fingerprint, Key, StoredResponse, TenantId};
use idemflow_store::{
    Claim, Claimed, Engine, EngineError, FoundKey, Isolation, JournalEntry, KeyOwner, KeyReport,
    Limits, LookUp, Operator, Tamper,
};
use serde_json::{Value, json};

/// What a failed step means to the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// A fenced write changed nothing: another owner holds the key.
    Fenced,
    /// The database was busy past its limit.
    Busy,
    /// Anything else.
    Other,
}

/// The protocol's steps on a pool, each on a connection (or in a transaction) of its own, as a
/// runner takes them.
mod steps {
    use super::*;
    use idemflow_store::ConnectionPool;

    pub async fn look_up<S: Engine>(
        pool: &S::Pool,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<LookUp<S::Ticket>, EngineError> {
        let mut connection = pool.acquire().await?;
        S::look_up(&mut connection, tenant, key).await
    }

    /// Begins the claim of a key a look-up found absent; `None` when another claim of it
    /// committed first.
    pub async fn begin_claim<S: Engine>(
        pool: &S::Pool,
        claim: Claim<'_>,
        ticket: S::Ticket,
    ) -> Result<Option<(S::Transaction, S::Owner)>, EngineError> {
        begin_claim_at::<S>(pool, claim, ticket, Isolation::ReadCommitted).await
    }

    /// [`begin_claim`], its transaction at `isolation` (as leading local phases declare it).
    pub async fn begin_claim_at<S: Engine>(
        pool: &S::Pool,
        claim: Claim<'_>,
        ticket: S::Ticket,
        isolation: Isolation,
    ) -> Result<Option<(S::Transaction, S::Owner)>, EngineError> {
        let connection = pool.acquire().await?;
        let limits = Limits::default().with_isolation(isolation);
        Ok(
            match S::begin_claim(connection, claim, ticket, &limits).await? {
                Claimed::Owned(transaction, owner) => Some((transaction, owner)),
                Claimed::Lost(_) => None,
            },
        )
    }

    pub async fn begin<S: Engine>(pool: &S::Pool) -> Result<S::Transaction, EngineError> {
        begin_at::<S>(pool, Isolation::ReadCommitted).await
    }

    pub async fn begin_at<S: Engine>(
        pool: &S::Pool,
        isolation: Isolation,
    ) -> Result<S::Transaction, EngineError> {
        let limits = Limits::default().with_isolation(isolation);
        S::begin(pool.acquire().await?, &limits).await
    }

    pub async fn commit<S: Engine>(transaction: S::Transaction) -> Result<(), EngineError> {
        S::commit_keeping(transaction).await.map(drop)
    }

    pub async fn rollback<S: Engine>(transaction: S::Transaction) -> Result<(), EngineError> {
        S::rollback(transaction).await
    }

    pub async fn renew_lease<S: Engine>(
        pool: &S::Pool,
        owner: &S::Owner,
        lease: Duration,
    ) -> Result<(), EngineError> {
        let mut connection = pool.acquire().await?;
        S::renew_lease(&mut connection, owner, lease).await
    }

    pub async fn postpone<S: Engine>(
        pool: &S::Pool,
        owner: &S::Owner,
        retry_after: Duration,
        last_error: &str,
    ) -> Result<(), EngineError> {
        S::postpone_alone(pool, owner, retry_after, &last_error.into()).await
    }

    /// Takes `key` over from the owner holding `seen`, in a transaction of its own.
    pub async fn take_over<S: Engine>(
        pool: &S::Pool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
        lease: Duration,
    ) -> Result<Option<idemflow_store::Taken<S::Owner>>, EngineError> {
        let mut transaction = begin::<S>(pool).await?;
        let taken = S::take_over(&mut transaction, tenant, key, seen, lease).await?;
        commit::<S>(transaction).await?;
        Ok(taken)
    }

    pub async fn take_over_due<S: Engine>(
        pool: &S::Pool,
        workflows: &[(String, Duration)],
        batch: i64,
    ) -> Result<Vec<(String, idemflow_store::Taken<S::Owner>)>, EngineError> {
        S::take_over_due(pool, workflows, batch).await
    }

    pub async fn response_apart<S: Engine>(
        pool: &S::Pool,
        tenant: &TenantId,
        key: &Key,
        life: i64,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        let mut connection = pool.acquire().await?;
        S::response_apart(&mut connection, tenant, key, life).await
    }

    pub async fn expire_batch<S: Engine>(
        pool: &S::Pool,
        keep_for: Duration,
        batch: i64,
    ) -> Result<u64, EngineError> {
        S::expire_batch(pool, keep_for, batch).await
    }

    /// An operator ends a lease (fenced by the token it saw).
    pub async fn end_lease<S: Engine>(
        pool: &S::Pool,
        tenant: &TenantId,
        key: &Key,
        seen: i64,
    ) -> Result<Option<i64>, EngineError> {
        S::operator(pool)
            .end_lease(tenant.as_str(), key.as_str(), seen)
            .await
            .map_err(|error| match error {
                idemflow_store::OperatorError::Engine(error) => error,
                other => EngineError::Corrupt(other.to_string()),
            })
    }
}

/// Ends every started key's lease.
async fn lapse_leases<S: Tamper>(pool: &S::Pool) {
    S::lapse_leases(pool, None).await.unwrap();
}

/// Moves every finished key's finish two days back.
async fn age_finished<S: Tamper>(pool: &S::Pool) {
    S::age_finished(pool, Duration::from_secs(2 * 86_400))
        .await
        .unwrap();
}

/// The operators' report of the conformance tenant's `key` (`idemflow inspect`).
async fn report_of<S: Engine>(pool: &S::Pool, key: &Key) -> KeyReport {
    S::operator(pool)
        .key_report(tenant().as_str(), key.as_str())
        .await
        .unwrap()
        .expect("the key is there")
}

/// The console's door to the same database (its scan, overview and expiry of one key).
fn console<S: Engine>(pool: &S::Pool) -> Box<dyn Operator> {
    S::operator(pool)
}

/// A fresh SQLite database file for `case`, removed at the next run of the same case.
async fn sqlite(case: &str) -> sqlx::SqlitePool {
    let directory = std::env::temp_dir().join(format!("idemflow-conformance-{case}"));
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    idemflow_sqlite::open_file(
        &directory.join("idemflow.db"),
        &idemflow_sqlite::OpenOptions::default(),
    )
    .await
    .unwrap()
}

/// One test per case and engine: PostgreSQL on a fresh database of its own (`#[sqlx::test]`),
/// SQLite on a fresh file, MariaDB on a fresh database of its own, Redis under a prefix of its
/// own, emptied first, on one Redis and on a Redis Cluster of three primaries.
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod postgres {
            $(
                #[sqlx::test(migrator = "idemflow::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    super::$case::<idemflow_pg::PgStore>(pool).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = super::sqlite(stringify!($case)).await;
                    super::$case::<idemflow_sqlite::SqliteStore>(pool).await;
                }
            )*
        }
        mod mariadb {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::mariadb::fresh(
                        concat!("conformance_", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_mysql::MySqlStore>(pool).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::redis::fresh(
                        concat!("conformance-", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_redis::RedisStore>(pool).await;
                }
            )*
        }
        mod redis_cluster {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::redis::fresh_on(
                        concat!("conformance-", stringify!($case)),
                        true,
                    )
                    .await;
                    super::$case::<idemflow_redis::RedisStore>(pool).await;
                }
            )*
        }
    };
}

conformance!(
    a_claimed_key_is_replayed_from_its_stored_response,
    of_two_claims_of_one_key_the_second_loses_and_writes_nothing,
    a_takeover_fences_the_old_owner_out_of_every_write,
    a_renewal_renews_only_its_own_owners_hold,
    tokens_never_repeat_for_a_key_across_deletes,
    a_body_apart_is_read_for_its_own_life_only,
    retention_deletes_finished_keys_past_their_window_in_batches_only,
    the_resumers_scan_takes_lapsed_keys_of_its_workflows_only,
    the_resumers_scan_takes_the_longest_lapsed_keys_first_across_workflows,
    a_postponed_key_waits_its_retry_after_under_a_new_token,
    a_failed_attempts_error_is_recorded_whatever_it_holds,
    a_key_deleted_by_its_owner_is_free_and_a_stale_owner_deletes_nothing,
    an_ended_lease_advances_the_fence_and_frees_the_key_at_once,
    keys_and_tenants_are_compared_byte_for_byte,
    a_keys_journal_is_its_timeline_in_order,
    a_full_journal_keeps_the_claim_first_and_the_newest_last,
    the_journal_names_who_took_a_key_over_and_who_ended_its_lease,
    a_journal_no_report_can_read_is_reported_empty,
    the_consoles_scan_walks_the_primary_key_from_a_position,
    the_consoles_overview_counts_started_due_and_lately_finished_keys,
    the_console_expires_one_key_only_under_the_token_it_was_shown,
    the_layout_the_migrations_make_claims_at_every_level,
);

/// The cases of a transaction at a stronger isolation level (a local phase's declaration), on
/// the engines that state one: PostgreSQL and MariaDB. (SQLite's transactions run one at a time
/// whatever is declared; Redis runs no local phase.)
macro_rules! conformance_at_levels {
    ($($case:ident),* $(,)?) => {
        mod postgres_levels {
            $(
                #[sqlx::test(migrator = "idemflow::MIGRATOR")]
                async fn $case(pool: sqlx::PgPool) {
                    super::$case::<idemflow_pg::PgStore>(pool).await;
                }
            )*
        }
        mod mariadb_levels {
            $(
                #[tokio::test]
                async fn $case() {
                    let pool = crate::support::mariadb::fresh(
                        concat!("conformance_", stringify!($case)),
                    )
                    .await;
                    super::$case::<idemflow_mysql::MySqlStore>(pool).await;
                }
            )*
        }
    };
}

conformance_at_levels!(
    claims_racing_at_every_level_leave_one_row_and_the_loser_writes_nothing,
    a_stale_owners_write_at_every_level_changes_nothing,
);

fn tenant() -> TenantId {
    TenantId::new("t-conformance").unwrap()
}

fn key(name: &str) -> Key {
    Key::parse(name).unwrap()
}

fn fingerprint() -> Fingerprint {
    Fingerprint::from_slice(&[9; 32]).unwrap()
}

fn response(body: &[u8]) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            "content-type".to_owned(),
            FieldValue::from("application/json"),
        )],
        body: body.to_vec(),
    }
}

const LEASE: Duration = Duration::from_secs(30);
const REQUEST: &str = r#"{"amount": 1200}"#;

/// Looks `key` up, expecting it absent, and begins its claim under `workflow`.
async fn claim<S: Tamper>(
    pool: &S::Pool,
    key: &Key,
    workflow: &str,
) -> Option<(S::Transaction, S::Owner)> {
    let LookUp::Absent(ticket) = steps::look_up::<S>(pool, &tenant(), key).await.unwrap() else {
        panic!("{key:?} is new");
    };
    claim_with::<S>(pool, key, workflow, ticket).await
}

async fn claim_with<S: Tamper>(
    pool: &S::Pool,
    key: &Key,
    workflow: &str,
    ticket: S::Ticket,
) -> Option<(S::Transaction, S::Owner)> {
    let request: Value = serde_json::from_str(REQUEST).unwrap();
    let (tenant, fingerprint) = (tenant(), fingerprint());
    steps::begin_claim::<S>(
        pool,
        Claim {
            tenant: &tenant,
            key,
            fingerprint: &fingerprint,
            workflow,
            request: &request,
            lease: LEASE,
        },
        ticket,
    )
    .await
    .unwrap()
}

/// Claims `key` and finishes it at once with `body`, stored apart above `apart_above` bytes.
async fn claim_and_finish<S: Tamper>(pool: &S::Pool, key: &Key, body: &[u8], apart_above: usize) {
    let (mut transaction, owner) = claim::<S>(pool, key, "checkout@1").await.unwrap();
    S::finish(
        &mut transaction,
        &owner,
        "complete",
        &response(body),
        apart_above,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
}

async fn found<S: Tamper>(pool: &S::Pool, key: &Key) -> FoundKey {
    match steps::look_up::<S>(pool, &tenant(), key).await.unwrap() {
        LookUp::Found(found) => found,
        _ => panic!("{key:?} is there"),
    }
}

fn refused<T: std::fmt::Debug>(result: Result<T, EngineError>) -> Failure {
    match result {
        Ok(value) => panic!("refused, not {value:?}"),
        Err(EngineError::Fenced) => Failure::Fenced,
        Err(EngineError::Busy) => Failure::Busy,
        Err(_) => Failure::Other,
    }
}

async fn a_claimed_key_is_replayed_from_its_stored_response<S: Tamper>(pool: S::Pool) {
    let key = key("k-replay");
    let (mut transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    S::advance(
        &mut transaction,
        &owner,
        "reserve",
        &json!({"order": 7}),
        LEASE,
    )
    .await
    .unwrap();
    // Uncommitted, the claim is not a finished key to anyone else.
    S::finish(
        &mut transaction,
        &owner,
        "complete",
        &response(b"{\"ok\":true}"),
        usize::MAX,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    let found = found::<S>(&pool, &key).await;
    assert!(found.done);
    assert_eq!(found.fingerprint, fingerprint());
    assert_eq!(found.workflow, "checkout@1");
    assert_eq!(found.lock_version, owner.lock_version());
    assert_eq!(found.body_apart, None);
    let stored = found.response.unwrap();
    assert_eq!(
        (stored.status, stored.body.as_slice()),
        (201, &b"{\"ok\":true}"[..])
    );
    assert_eq!(stored.headers, response(b"").headers);
}

async fn of_two_claims_of_one_key_the_second_loses_and_writes_nothing<S: Tamper>(pool: S::Pool) {
    let key = key("k-race");
    // Both look the key up before either claims it.
    let LookUp::Absent(first) = steps::look_up::<S>(&pool, &tenant(), &key).await.unwrap() else {
        panic!("new");
    };
    let LookUp::Absent(second) = steps::look_up::<S>(&pool, &tenant(), &key).await.unwrap() else {
        panic!("new");
    };
    let (mut transaction, owner) = claim_with::<S>(&pool, &key, "checkout@1", first)
        .await
        .unwrap();
    S::advance(&mut transaction, &owner, "reserve", &json!(1), LEASE)
        .await
        .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    assert!(
        claim_with::<S>(&pool, &key, "other@1", second)
            .await
            .is_none(),
        "the second claim loses"
    );
    let found = found::<S>(&pool, &key).await;
    assert_eq!((found.workflow.as_str(), found.done), ("checkout@1", false));
    assert_eq!(found.lock_version, owner.lock_version());
    assert!(found.lease_left > LEASE - Duration::from_secs(5));
}

async fn a_takeover_fences_the_old_owner_out_of_every_write<S: Tamper>(pool: S::Pool) {
    let key = key("k-fence");
    let (mut transaction, old) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    S::advance(
        &mut transaction,
        &old,
        "reserve",
        &json!({"order": 7}),
        LEASE,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    // A live lease is not taken over.
    assert!(
        steps::take_over::<S>(&pool, &tenant(), &key, old.lock_version(), LEASE)
            .await
            .unwrap()
            .is_none()
    );
    lapse_leases::<S>(&pool).await;
    let taken = steps::take_over::<S>(&pool, &tenant(), &key, old.lock_version(), LEASE)
        .await
        .unwrap()
        .expect("a lapsed lease is taken over");
    assert_ne!(taken.owner.lock_version(), old.lock_version());
    assert_eq!(taken.attempts, 2);
    assert_eq!(taken.recovery_point, "reserve");
    assert_eq!(taken.phase_output, Some(json!({"order": 7})));
    assert_eq!(
        taken.request,
        serde_json::from_str::<Value>(REQUEST).unwrap()
    );
    // The same takeover again names a token that moved on.
    assert!(
        steps::take_over::<S>(&pool, &tenant(), &key, old.lock_version(), LEASE)
            .await
            .unwrap()
            .is_none()
    );
    // The old owner wakes up: its renewal, its advance and its finish are refused.
    assert_eq!(
        refused(steps::renew_lease::<S>(&pool, &old, LEASE).await),
        Failure::Fenced
    );
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    assert_eq!(
        refused(S::advance(&mut transaction, &old, "charge", &json!(2), LEASE).await),
        Failure::Fenced
    );
    steps::rollback::<S>(transaction).await.unwrap();
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    assert_eq!(
        refused(
            S::finish(
                &mut transaction,
                &old,
                "complete",
                &response(b"old"),
                usize::MAX
            )
            .await
        ),
        Failure::Fenced
    );
    steps::rollback::<S>(transaction).await.unwrap();
    // The new owner's writes stand.
    steps::renew_lease::<S>(&pool, &taken.owner, LEASE)
        .await
        .unwrap();
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    S::finish(
        &mut transaction,
        &taken.owner,
        "complete",
        &response(b"new"),
        usize::MAX,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    assert_eq!(found::<S>(&pool, &key).await.response.unwrap().body, b"new");
}

/// A takeover whose transaction rolled back leaves the key to the next taker, who may draw the
/// very token it drew (MariaDB's fence, SQLite's fence row: drawn in the transaction). The
/// renewal of the first, which is also how the runner asks the row whether its hold committed
/// after all, must not renew the next taker's hold: only the owner that holds the key renews.
/// (Redis commits a takeover at once: there the first taker's hold is simply taken over.)
async fn a_renewal_renews_only_its_own_owners_hold<S: Tamper>(pool: S::Pool) {
    let key = key("k-holder");
    let (transaction, claimed) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    lapse_leases::<S>(&pool).await;
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    let first = S::take_over(
        &mut transaction,
        &tenant(),
        &key,
        claimed.lock_version(),
        LEASE,
    )
    .await
    .unwrap()
    .expect("a lapsed lease is taken over");
    steps::rollback::<S>(transaction).await.unwrap();
    lapse_leases::<S>(&pool).await;
    let seen = found::<S>(&pool, &key).await.lock_version;
    let next = steps::take_over::<S>(&pool, &tenant(), &key, seen, LEASE)
        .await
        .unwrap()
        .expect("the next taker takes the key over");
    assert_eq!(
        refused(steps::renew_lease::<S>(&pool, &first.owner, LEASE).await),
        Failure::Fenced,
        "the first taker renewed the next one's hold"
    );
    steps::renew_lease::<S>(&pool, &next.owner, LEASE)
        .await
        .expect("the holder renews");
}

async fn tokens_never_repeat_for_a_key_across_deletes<S: Tamper>(pool: S::Pool) {
    let key = key("k-lives");
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (mut transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
        seen.push(owner.lock_version());
        S::finish(
            &mut transaction,
            &owner,
            "complete",
            &response(b"{}"),
            usize::MAX,
        )
        .await
        .unwrap();
        steps::commit::<S>(transaction).await.unwrap();
        age_finished::<S>(&pool).await;
        assert_eq!(
            steps::expire_batch::<S>(&pool, Duration::from_secs(86_400), 10)
                .await
                .unwrap(),
            1
        );
    }
    // Unique, not ordered: PostgreSQL's sequence hands each session a block of its own.
    let distinct: std::collections::HashSet<i64> = seen.iter().copied().collect();
    assert_eq!(distinct.len(), seen.len(), "{seen:?}");
}

async fn a_body_apart_is_read_for_its_own_life_only<S: Tamper>(pool: S::Pool) {
    let key = key("k-apart");
    claim_and_finish::<S>(&pool, &key, b"first life", 0).await;
    let first = found::<S>(&pool, &key).await;
    let life = first.body_apart.expect("stored apart");
    assert!(first.response.unwrap().body.is_empty());
    assert_eq!(
        steps::response_apart::<S>(&pool, &tenant(), &key, life)
            .await
            .unwrap()
            .as_deref(),
        Some(&b"first life"[..])
    );
    // Between a replay's look-up and its body read: the window ends, retention deletes the key
    // (and its body), and a new life of the key finishes with a body of its own.
    age_finished::<S>(&pool).await;
    assert_eq!(
        steps::expire_batch::<S>(&pool, Duration::from_secs(86_400), 10)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        steps::response_apart::<S>(&pool, &tenant(), &key, life)
            .await
            .unwrap(),
        None
    );
    claim_and_finish::<S>(&pool, &key, b"second life", 0).await;
    assert_eq!(
        steps::response_apart::<S>(&pool, &tenant(), &key, life)
            .await
            .unwrap(),
        None,
        "the old life's read never finds the new life's body"
    );
    let second = found::<S>(&pool, &key).await.body_apart.unwrap();
    assert_ne!(second, life);
    assert_eq!(
        steps::response_apart::<S>(&pool, &tenant(), &key, second)
            .await
            .unwrap()
            .as_deref(),
        Some(&b"second life"[..])
    );
}

async fn retention_deletes_finished_keys_past_their_window_in_batches_only<S: Tamper>(
    pool: S::Pool,
) {
    for index in 0..3 {
        claim_and_finish::<S>(&pool, &key(&format!("k-old-{index}")), b"{}", 0).await;
    }
    let (transaction, _) = claim::<S>(&pool, &key("k-started"), "checkout@1")
        .await
        .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    age_finished::<S>(&pool).await;
    lapse_leases::<S>(&pool).await;
    claim_and_finish::<S>(&pool, &key("k-recent"), b"{}", usize::MAX).await;
    let keep_for = Duration::from_secs(86_400);
    let batches = (
        steps::expire_batch::<S>(&pool, keep_for, 2).await.unwrap(),
        steps::expire_batch::<S>(&pool, keep_for, 2).await.unwrap(),
        steps::expire_batch::<S>(&pool, keep_for, 2).await.unwrap(),
    );
    assert_eq!(batches, (2, 1, 0));
    for kept in ["k-started", "k-recent"] {
        found::<S>(&pool, &key(kept)).await;
    }
    for index in 0..3 {
        assert!(matches!(
            steps::look_up::<S>(&pool, &tenant(), &key(&format!("k-old-{index}")))
                .await
                .unwrap(),
            LookUp::Absent(_)
        ));
    }
}

/// The scan takes the keys whose leases lapsed longest ago first, whatever their workflow and
/// whatever order the resumer lists its workflows in: a workflow with a steady stream of due keys
/// must not starve another.
async fn the_resumers_scan_takes_the_longest_lapsed_keys_first_across_workflows<S: Tamper>(
    pool: S::Pool,
) {
    for (name, workflow) in [
        ("k-first", "checkout@1"),
        ("k-second", "checkout@1"),
        ("k-third", "refund@1"),
    ] {
        let (transaction, owner) = claim::<S>(&pool, &key(name), workflow).await.unwrap();
        steps::commit::<S>(transaction).await.unwrap();
        // Due now, in this order: lease ends apart on every engine's clock (SQLite and MariaDB
        // count milliseconds).
        steps::postpone::<S>(&pool, &owner, Duration::ZERO, "provider: 503")
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The workflow with the newest due key is listed first.
    let workflows = [
        ("refund@1".to_owned(), Duration::from_secs(30)),
        ("checkout@1".to_owned(), Duration::from_secs(30)),
    ];
    let mut order = Vec::new();
    for _ in 0..3 {
        let taken = steps::take_over_due::<S>(&pool, &workflows, 1)
            .await
            .unwrap();
        assert_eq!(taken.len(), 1, "one key a scan");
        order.push(taken[0].0.clone());
    }
    assert_eq!(order, ["checkout@1", "checkout@1", "refund@1"]);
    for name in ["k-first", "k-second", "k-third"] {
        assert!(found::<S>(&pool, &key(name)).await.lease_left > Duration::from_secs(25));
    }
}

async fn the_resumers_scan_takes_lapsed_keys_of_its_workflows_only<S: Tamper>(pool: S::Pool) {
    for (name, workflow) in [
        ("k-a", "checkout@1"),
        ("k-b", "checkout@1"),
        ("k-c", "refund@1"),
    ] {
        let (transaction, _) = claim::<S>(&pool, &key(name), workflow).await.unwrap();
        steps::commit::<S>(transaction).await.unwrap();
    }
    let workflows = [("checkout@1".to_owned(), Duration::from_secs(45))];
    // Nothing is due while the leases live.
    assert!(
        steps::take_over_due::<S>(&pool, &workflows, 10)
            .await
            .unwrap()
            .is_empty()
    );
    lapse_leases::<S>(&pool).await;
    let taken = steps::take_over_due::<S>(&pool, &workflows, 10)
        .await
        .unwrap();
    let mut names: Vec<(String, String)> = taken
        .iter()
        .map(|(workflow, one)| (workflow.clone(), format!("{:?}", one.attempts)))
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            ("checkout@1".to_owned(), "2".to_owned()),
            ("checkout@1".to_owned(), "2".to_owned())
        ]
    );
    // Taken with the workflow's own lease, so nothing is due again.
    for name in ["k-a", "k-b"] {
        let lease = found::<S>(&pool, &key(name)).await.lease_left;
        assert!(lease > Duration::from_secs(40), "{name}: {lease:?}");
    }
    assert!(
        steps::take_over_due::<S>(&pool, &workflows, 10)
            .await
            .unwrap()
            .is_empty()
    );
    // A workflow this resumer does not know is left for one that does.
    let refunds = [("refund@1".to_owned(), Duration::from_secs(30))];
    assert_eq!(
        steps::take_over_due::<S>(&pool, &refunds, 10)
            .await
            .unwrap()
            .len(),
        1
    );
}

async fn a_postponed_key_waits_its_retry_after_under_a_new_token<S: Tamper>(pool: S::Pool) {
    let key = key("k-postpone");
    let (transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    steps::postpone::<S>(&pool, &owner, Duration::from_secs(60), "provider: 503")
        .await
        .unwrap();
    let postponed = found::<S>(&pool, &key).await;
    assert!(
        postponed.lock_version != owner.lock_version(),
        "the fence advanced"
    );
    assert!(
        postponed.lease_left > Duration::from_secs(55)
            && postponed.lease_left <= Duration::from_secs(60),
        "{:?}",
        postponed.lease_left
    );
    // The owner is done with the key: its heartbeat, and a second postpone, change nothing.
    assert_eq!(
        refused(steps::renew_lease::<S>(&pool, &owner, LEASE).await),
        Failure::Fenced
    );
    assert_eq!(
        refused(steps::postpone::<S>(&pool, &owner, Duration::ZERO, "again").await),
        Failure::Fenced
    );
    // Not before its retry-after; at once with a zero one, the error recorded for the next.
    assert!(
        steps::take_over::<S>(&pool, &tenant(), &key, postponed.lock_version, LEASE)
            .await
            .unwrap()
            .is_none()
    );
    let key2 = self::key("k-postpone-now");
    let (transaction, owner) = claim::<S>(&pool, &key2, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    steps::postpone::<S>(&pool, &owner, Duration::ZERO, "provider: 503")
        .await
        .unwrap();
    let seen = found::<S>(&pool, &key2).await;
    assert_eq!(seen.lease_left, Duration::ZERO);
    let taken = steps::take_over::<S>(&pool, &tenant(), &key2, seen.lock_version, LEASE)
        .await
        .unwrap()
        .expect("a zero retry-after gives the key back at once");
    assert_eq!(taken.last_error.as_deref(), Some("provider: 503"));
    assert_eq!(taken.attempts, 2);
}

/// A phase's error is whatever its code made of a failure: a provider's whole HTML error page,
/// a driver's message quoting binary data. Every engine records it, bounded and without U+0000
/// (which PostgreSQL's text refuses, as MariaDB's strict mode refuses a `TEXT` past 64 KiB):
/// a record refused rolled the attempt back unrecorded, and the key repeated it for ever.
async fn a_failed_attempts_error_is_recorded_whatever_it_holds<S: Tamper>(pool: S::Pool) {
    let huge = format!(
        "provider: {}\u{0}after the NUL",
        "<p>error page</p>".repeat(6_000)
    );
    for (name, message) in [("k-error-huge", huge.as_str()), ("k-error-nul", "a\u{0}b")] {
        let key = key(name);
        let (transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
        steps::commit::<S>(transaction).await.unwrap();
        steps::postpone::<S>(&pool, &owner, Duration::ZERO, message)
            .await
            .unwrap_or_else(|error| panic!("{name}: the failure is recorded: {error}"));
        let seen = found::<S>(&pool, &key).await;
        let taken = steps::take_over::<S>(&pool, &tenant(), &key, seen.lock_version, LEASE)
            .await
            .unwrap()
            .expect("the key is due at once");
        let recorded = taken.last_error.expect("the error is recorded");
        assert!(!recorded.contains('\u{0}'), "{name}: {recorded:?}");
        assert!(
            recorded.len() <= idemflow_store::LastError::LIMIT,
            "{name}: {} bytes",
            recorded.len()
        );
        assert!(recorded.starts_with("provider: <p>error page</p>") || recorded == "a\u{fffd}b");
    }
}

async fn a_key_deleted_by_its_owner_is_free_and_a_stale_owner_deletes_nothing<S: Tamper>(
    pool: S::Pool,
) {
    let key = key("k-forget");
    let (transaction, old) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    lapse_leases::<S>(&pool).await;
    let taken = steps::take_over::<S>(&pool, &tenant(), &key, old.lock_version(), LEASE)
        .await
        .unwrap()
        .unwrap();
    // The replaced owner's delete is fenced out.
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    assert_eq!(
        refused(S::delete_owned(&mut transaction, &old).await),
        Failure::Fenced
    );
    steps::rollback::<S>(transaction).await.unwrap();
    found::<S>(&pool, &key).await;
    // The owner's delete frees the key for a new request.
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    S::delete_owned(&mut transaction, &taken.owner)
        .await
        .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    let (transaction, next) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    assert!(![old.lock_version(), taken.owner.lock_version()].contains(&next.lock_version()));
}

async fn an_ended_lease_advances_the_fence_and_frees_the_key_at_once<S: Tamper>(pool: S::Pool) {
    let key = key("k-end");
    let (transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    let token = steps::end_lease::<S>(&pool, &tenant(), &key, owner.lock_version())
        .await
        .unwrap()
        .expect("a started key's lease ends");
    assert_ne!(token, owner.lock_version());
    // Naming the old token again ends nothing.
    assert_eq!(
        steps::end_lease::<S>(&pool, &tenant(), &key, owner.lock_version())
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        refused(steps::renew_lease::<S>(&pool, &owner, LEASE).await),
        Failure::Fenced
    );
    let taken = steps::take_over::<S>(&pool, &tenant(), &key, token, LEASE)
        .await
        .unwrap()
        .expect("taken over at once");
    assert!(![token, owner.lock_version()].contains(&taken.owner.lock_version()));
}

/// Keys that differ only in case or in a trailing space are two keys, and so are tenants that
/// differ only in case: a key generator that treats case as significant must not have its
/// identities collapsed by a case-insensitive or padding comparison (MariaDB's text collations
/// all pad, `utf8mb4_bin` included).
async fn keys_and_tenants_are_compared_byte_for_byte<S: Tamper>(pool: S::Pool) {
    let names = ["Key-A", "key-a", "a", "a ", "a  "];
    for name in names {
        claim_and_finish::<S>(&pool, &key(name), name.as_bytes(), usize::MAX).await;
    }
    for name in names {
        let found = found::<S>(&pool, &key(name)).await;
        assert_eq!(
            found.response.map(|response| response.body),
            Some(name.as_bytes().to_vec()),
            "{name:?} was answered with another key's response"
        );
    }
    let upper = TenantId::new("T-Conformance").unwrap();
    match steps::look_up::<S>(&pool, &upper, &key("Key-A"))
        .await
        .unwrap()
    {
        LookUp::Absent(_) => {}
        LookUp::Found(_) | LookUp::Claiming => {
            panic!("tenant T-Conformance found t-conformance's key")
        }
    }
}

/// `(event, token)` of each entry, for comparing a journal at a glance.
fn events(journal: &[JournalEntry]) -> Vec<(&str, i64)> {
    journal
        .iter()
        .map(|entry| (entry.event.as_str(), entry.token))
        .collect()
}

/// A key claimed, a phase done, a failed attempt recorded, taken over by a client retry after its
/// lease is rewound, another phase done, finished: the journal lists each of these, in order,
/// each with the token the key held after it and the database's time.
async fn a_keys_journal_is_its_timeline_in_order<S: Tamper>(pool: S::Pool) {
    let key = key("k-journal");
    let (mut transaction, first) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    S::advance(
        &mut transaction,
        &first,
        "reserve",
        &json!({"order": 7}),
        LEASE,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    steps::postpone::<S>(
        &pool,
        &first,
        Duration::from_secs(60),
        "charge: provider 503",
    )
    .await
    .unwrap();
    let failed = found::<S>(&pool, &key).await.lock_version;
    lapse_leases::<S>(&pool).await;
    let taken = steps::take_over::<S>(&pool, &tenant(), &key, failed, LEASE)
        .await
        .unwrap()
        .expect("a lapsed lease is taken over");
    let second = taken.owner.lock_version();
    let mut transaction = steps::begin::<S>(&pool).await.unwrap();
    S::advance(
        &mut transaction,
        &taken.owner,
        "charge",
        &json!({"charge": "ch_1"}),
        LEASE,
    )
    .await
    .unwrap();
    S::finish(
        &mut transaction,
        &taken.owner,
        "complete",
        &response(b"{}"),
        usize::MAX,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();

    let report = report_of::<S>(&pool, &key).await;
    let token = first.lock_version();
    // Each change that moved the fence names the new token (unique, not ordered: no case
    // compares tokens by size).
    assert!(token != failed && failed != second && second != token);
    assert_eq!(
        events(&report.journal),
        [
            ("claimed", token),
            ("phase", token),
            ("failed", failed),
            ("taken_over", second),
            ("phase", second),
            ("finished", second),
        ],
        "{:#?}",
        report.journal
    );
    assert_eq!(report.lock_version, second);
    let entry = |at: usize| &report.journal[at];
    assert_eq!(entry(1).point.as_deref(), Some("reserve"));
    // A failed attempt names where it began and the error `last_error` got.
    assert_eq!(
        (entry(2).point.as_deref(), entry(2).error.as_deref()),
        (Some("reserve"), Some("charge: provider 503"))
    );
    assert_eq!(
        (entry(3).by.as_deref(), entry(3).attempt),
        (Some("retry"), Some(2))
    );
    assert_eq!(entry(4).point.as_deref(), Some("charge"));
    assert_eq!(entry(5).status, Some(201));
    // Only the fields of each event: nothing else is stored.
    for entry in &report.journal {
        let fields = [
            entry.point.is_some(),
            entry.error.is_some(),
            entry.by.is_some(),
            entry.attempt.is_some(),
            entry.status.is_some(),
        ];
        let expected = match entry.event.as_str() {
            "claimed" => [false; 5],
            "phase" => [true, false, false, false, false],
            "failed" => [true, true, false, false, false],
            "taken_over" => [false, false, true, true, false],
            "finished" => [false, false, false, false, true],
            other => panic!("no {other} event here"),
        };
        assert_eq!(fields, expected, "{entry:?}");
    }
    // Times by the database's clock, in milliseconds, in order.
    let now_ms = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    let times: Vec<i64> = report.journal.iter().map(|entry| entry.at_ms).collect();
    assert!(times.is_sorted(), "{times:?}");
    assert!(
        times
            .iter()
            .all(|at| (now_ms - 600_000..=now_ms + 600_000).contains(at)),
        "{times:?} against {now_ms}"
    );
}

/// 70 takeovers of a key that never gets anywhere: its journal keeps 64 entries, the claim first
/// and the newest takeover last, the oldest takeovers dropped.
async fn a_full_journal_keeps_the_claim_first_and_the_newest_last<S: Tamper>(pool: S::Pool) {
    let key = key("k-crash-loop");
    let (transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    let claimed = owner.lock_version();
    let mut token = claimed;
    for _ in 0..70 {
        lapse_leases::<S>(&pool).await;
        token = steps::take_over::<S>(&pool, &tenant(), &key, token, LEASE)
            .await
            .unwrap()
            .expect("a lapsed lease is taken over")
            .owner
            .lock_version();
    }
    let report = report_of::<S>(&pool, &key).await;
    assert_eq!(report.journal.len(), idemflow_store::JOURNAL_LIMIT);
    assert_eq!(events(&report.journal[..1]), [("claimed", claimed)]);
    let last = report.journal.last().unwrap();
    assert_eq!(
        (last.event.as_str(), last.token, last.attempt),
        ("taken_over", token, Some(71))
    );
    // The 63 newest takeovers, one after another: attempts 9 to 71.
    let attempts: Vec<Option<i64>> = report.journal[1..]
        .iter()
        .map(|entry| entry.attempt)
        .collect();
    assert_eq!(attempts, (9..=71).map(Some).collect::<Vec<_>>());
    assert_eq!(report.attempts, 71);
}

/// A resumer's takeover is marked `resumer`, an operator's ended lease `operator`, each with the
/// token it drew.
async fn the_journal_names_who_took_a_key_over_and_who_ended_its_lease<S: Tamper>(pool: S::Pool) {
    let (resumed, ended) = (key("k-resumed"), key("k-ended"));
    let (transaction, first) = claim::<S>(&pool, &resumed, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    let (transaction, second) = claim::<S>(&pool, &ended, "refund@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();

    let token = steps::end_lease::<S>(&pool, &tenant(), &ended, second.lock_version())
        .await
        .unwrap()
        .expect("a started key's lease ends");
    let report = report_of::<S>(&pool, &ended).await;
    assert_eq!(
        events(&report.journal),
        [("claimed", second.lock_version()), ("lease_ended", token)]
    );
    assert_eq!(
        (report.journal[1].by.as_deref(), report.journal[1].attempt),
        (Some("operator"), None)
    );

    lapse_leases::<S>(&pool).await;
    let workflows = [("checkout@1".to_owned(), LEASE)];
    let taken = steps::take_over_due::<S>(&pool, &workflows, 10)
        .await
        .unwrap();
    let [(_, taken)] = taken.as_slice() else {
        panic!("one checkout is due: {taken:?}");
    };
    let report = report_of::<S>(&pool, &resumed).await;
    assert_eq!(
        events(&report.journal),
        [
            ("claimed", first.lock_version()),
            ("taken_over", taken.owner.lock_version())
        ]
    );
    assert_eq!(
        (report.journal[1].by.as_deref(), report.journal[1].attempt),
        (Some("resumer"), Some(2))
    );
}

/// A journal damaged behind the store's back is reported empty; the rest of the report stands.
async fn a_journal_no_report_can_read_is_reported_empty<S: Tamper>(pool: S::Pool) {
    let key = key("k-damaged");
    claim_and_finish::<S>(&pool, &key, b"{}", usize::MAX).await;
    S::damage_journals(&pool).await.unwrap();
    let report = report_of::<S>(&pool, &key).await;
    assert_eq!(report.journal, []);
    assert_eq!(
        (report.state.as_str(), report.response_status),
        ("done", Some(201))
    );
}

fn keys_of(reports: &[KeyReport]) -> Vec<&str> {
    reports.iter().map(|report| report.key.as_str()).collect()
}

async fn the_consoles_scan_walks_the_primary_key_from_a_position<S: Tamper>(pool: S::Pool) {
    for name in ["b-1", "a-2", "a-1"] {
        claim_and_finish::<S>(&pool, &key(name), b"{}", usize::MAX).await;
    }
    let console = console::<S>(&pool);
    let from = |tenant: Option<&str>, after: (&str, &str), inclusive| idemflow_store::ScanFrom {
        tenant: tenant.map(str::to_owned),
        after: (after.0.to_owned(), after.1.to_owned()),
        inclusive,
    };
    let t = tenant();
    let t = t.as_str();
    // From the start of the table, in key order, bounded.
    let all = console
        .scan_keys(&from(None, ("", ""), true), 10)
        .await
        .unwrap();
    assert_eq!(keys_of(&all), ["a-1", "a-2", "b-1"]);
    assert_eq!(all[0].tenant, t);
    let first = console
        .scan_keys(&from(None, ("", ""), true), 1)
        .await
        .unwrap();
    assert_eq!(keys_of(&first), ["a-1"]);
    // The next page starts after the last key of the previous one.
    let next = console
        .scan_keys(&from(None, (t, "a-1"), false), 10)
        .await
        .unwrap();
    assert_eq!(keys_of(&next), ["a-2", "b-1"]);
    // Within a tenant, from a key prefix (inclusive) or after a key.
    let prefix = console
        .scan_keys(&from(Some(t), (t, "a-2"), true), 10)
        .await
        .unwrap();
    assert_eq!(keys_of(&prefix), ["a-2", "b-1"]);
    let after = console
        .scan_keys(&from(Some(t), (t, "a-2"), false), 10)
        .await
        .unwrap();
    assert_eq!(keys_of(&after), ["b-1"]);
    // Another tenant's range is empty.
    let other = console
        .scan_keys(&from(Some("t-other"), ("t-other", ""), true), 10)
        .await
        .unwrap();
    assert!(other.is_empty(), "{other:?}");
}

async fn the_consoles_overview_counts_started_due_and_lately_finished_keys<S: Tamper>(
    pool: S::Pool,
) {
    let console = console::<S>(&pool);
    let empty = console.overview().await.unwrap();
    assert!(empty.started.is_empty());
    assert_eq!((empty.finished_last_minute, empty.resumer_lag_ms), (0, 0));
    claim_and_finish::<S>(&pool, &key("done"), b"{}", usize::MAX).await;
    for (name, workflow) in [
        ("s-1", "checkout@1"),
        ("s-2", "checkout@1"),
        ("s-3", "refund@1"),
    ] {
        let (transaction, _owner) = claim::<S>(&pool, &key(name), workflow).await.unwrap();
        steps::commit::<S>(transaction).await.unwrap();
    }
    let live = console.overview().await.unwrap();
    let started: Vec<(&str, i64, i64)> = live
        .started
        .iter()
        .map(|w| (w.workflow.as_str(), w.keys, w.due))
        .collect();
    assert_eq!(started, [("checkout@1", 2, 0), ("refund@1", 1, 0)]);
    assert_eq!(
        (live.finished_last_minute, live.finished_last_15_minutes),
        (1, 1)
    );
    assert!(live.oldest_started_seconds.is_some());
    lapse_leases::<S>(&pool).await;
    age_finished::<S>(&pool).await;
    let due = console.overview().await.unwrap();
    let started: Vec<(&str, i64, i64)> = due
        .started
        .iter()
        .map(|w| (w.workflow.as_str(), w.keys, w.due))
        .collect();
    assert_eq!(started, [("checkout@1", 2, 2), ("refund@1", 1, 1)]);
    assert!(due.resumer_lag_ms > 0, "{due:?}");
    // Finished two days ago: no longer in the last quarter hour.
    assert_eq!(due.finished_last_15_minutes, 0);
}

async fn the_console_expires_one_key_only_under_the_token_it_was_shown<S: Tamper>(pool: S::Pool) {
    let console = console::<S>(&pool);
    let t = tenant();
    // A finished key whose body is stored apart, and a started one.
    let done = key("done-apart");
    claim_and_finish::<S>(&pool, &done, b"{\"receipt\": 1}", 0).await;
    let started = key("started");
    let (transaction, owner) = claim::<S>(&pool, &started, "checkout@1").await.unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    let shown = report_of::<S>(&pool, &done).await.lock_version;
    let expire = |key: &Key, token: i64, state: &'static str| {
        let (console, tenant, key) = (&console, t.as_str().to_owned(), key.as_str().to_owned());
        async move {
            console
                .expire_key(&tenant, &key, token, state)
                .await
                .unwrap()
        }
    };
    // A token the key no longer holds (or never held) deletes nothing; nor does the state it
    // no longer has.
    assert_eq!(expire(&done, shown + 1, "done").await, None);
    assert_eq!(expire(&done, shown, "started").await, None);
    found::<S>(&pool, &done).await;
    assert_eq!(expire(&done, shown, "done").await.as_deref(), Some("done"));
    assert!(
        console
            .key_report(t.as_str(), done.as_str())
            .await
            .unwrap()
            .is_none()
    );
    // Its body apart went with it: a new life of the key finished in its row reads its own body.
    claim_and_finish::<S>(&pool, &done, b"{\"receipt\": 2}", usize::MAX).await;
    let bodies = console
        .key_bodies(t.as_str(), done.as_str())
        .await
        .unwrap()
        .expect("the new life");
    let stored = bodies.response.expect("finished");
    assert_eq!(
        (stored.body.as_slice(), stored.apart),
        (&b"{\"receipt\": 2}"[..], false)
    );
    // A started key goes too, and its owner is fenced out of every write after.
    assert_eq!(
        expire(&started, owner.lock_version(), "started")
            .await
            .as_deref(),
        Some("started")
    );
    assert!(matches!(
        steps::look_up::<S>(&pool, &t, &started).await.unwrap(),
        LookUp::Absent(_)
    ));
    assert_eq!(
        refused(steps::renew_lease::<S>(&pool, &owner, LEASE).await),
        Failure::Fenced
    );
    // A key shown started that finished since keeps its token: named started, it is kept, and
    // with it the response a retry is owed.
    let finishing = key("finishing");
    let (mut transaction, owner) = claim::<S>(&pool, &finishing, "checkout@1").await.unwrap();
    S::finish(
        &mut transaction,
        &owner,
        "complete",
        &response(b"{}"),
        usize::MAX,
    )
    .await
    .unwrap();
    steps::commit::<S>(transaction).await.unwrap();
    assert_eq!(
        expire(&finishing, owner.lock_version(), "started").await,
        None
    );
    assert!(found::<S>(&pool, &finishing).await.done);
}

/// Claims `key` with `ticket`, the claim's transaction at `isolation`.
async fn claim_at<S: Tamper>(
    pool: &S::Pool,
    key: &Key,
    workflow: &str,
    ticket: S::Ticket,
    isolation: Isolation,
) -> Option<(S::Transaction, S::Owner)> {
    let request: Value = serde_json::from_str(REQUEST).unwrap();
    let (tenant, fingerprint) = (tenant(), fingerprint());
    let claim = Claim {
        tenant: &tenant,
        key,
        fingerprint: &fingerprint,
        workflow,
        request: &request,
        lease: LEASE,
    };
    steps::begin_claim_at::<S>(pool, claim, ticket, isolation)
        .await
        .unwrap()
}

/// The claim's guarantee at a stronger level: a claim whose transaction took its snapshot before
/// it waited on the first claim (PostgreSQL's look for the key inside the claim reads that
/// snapshot) still loses once the first commits, and writes nothing. The unique index decides,
/// whatever the snapshot: a unique violation, or at Serializable a serialization failure, both
/// a lost race.
async fn claims_racing_at_every_level_leave_one_row_and_the_loser_writes_nothing<S: Tamper>(
    pool: S::Pool,
) {
    for isolation in Isolation::ALL {
        let key = key(&format!("k-race-{}", isolation.as_str()));
        let LookUp::Absent(first) = steps::look_up::<S>(&pool, &tenant(), &key).await.unwrap()
        else {
            panic!("new");
        };
        let LookUp::Absent(second) = steps::look_up::<S>(&pool, &tenant(), &key).await.unwrap()
        else {
            panic!("new");
        };
        let (mut transaction, owner) = claim_at::<S>(&pool, &key, "checkout@1", first, isolation)
            .await
            .unwrap();
        let racing = tokio::spawn({
            let (pool, key) = (pool.clone(), key.clone());
            async move {
                claim_at::<S>(&pool, &key, "other@1", second, isolation)
                    .await
                    .map(|(transaction, owner)| {
                        drop(transaction);
                        owner.lock_version()
                    })
            }
        });
        // Not a lease's expiry: time for the second claim to begin and wait on the first.
        tokio::time::sleep(Duration::from_millis(200)).await;
        S::advance(&mut transaction, &owner, "reserve", &json!(1), LEASE)
            .await
            .unwrap();
        steps::commit::<S>(transaction).await.unwrap();
        assert_eq!(
            racing.await.unwrap(),
            None,
            "{isolation}: the second claim loses"
        );
        let found = found::<S>(&pool, &key).await;
        assert_eq!(found.workflow, "checkout@1", "{isolation}");
        assert_eq!(found.lock_version, owner.lock_version(), "{isolation}");
        assert_eq!(report_of::<S>(&pool, &key).await.recovery_point, "reserve");
    }
}

/// The fence's guarantee at a stronger level: an owner whose transaction read the key before
/// another took it over writes nothing over the new owner, whatever its snapshot says. PostgreSQL
/// refuses the write with a serialization failure (the row changed since the snapshot), which
/// the runner answers by running the transaction again, where the write then matches no row;
/// InnoDB writes on the latest row, and the fence matches none at once.
async fn a_stale_owners_write_at_every_level_changes_nothing<S: Tamper>(pool: S::Pool) {
    for isolation in Isolation::ALL {
        let key = key(&format!("k-stale-{}", isolation.as_str()));
        let (transaction, owner) = claim::<S>(&pool, &key, "checkout@1").await.unwrap();
        steps::commit::<S>(transaction).await.unwrap();
        let other = Key::parse(&format!("k-other-{}", isolation.as_str())).unwrap();
        let (transaction, _) = claim::<S>(&pool, &other, "checkout@1").await.unwrap();
        steps::commit::<S>(transaction).await.unwrap();
        let mut stale = steps::begin_at::<S>(&pool, isolation).await.unwrap();
        // The stale owner's transaction reads: its snapshot is taken, where the level keeps one.
        // (Another key's row: at Serializable InnoDB's reads lock what they read, and a read of
        // this key's row would hold the takeover off until the stale owner ends.)
        let seen = S::look_up(S::connection(&mut stale), &tenant(), &other)
            .await
            .unwrap();
        assert!(matches!(seen, LookUp::Found(_)));
        S::lapse_leases(&pool, Some((tenant().as_str(), key.as_str())))
            .await
            .unwrap();
        let taken = steps::take_over::<S>(&pool, &tenant(), &key, owner.lock_version(), LEASE)
            .await
            .unwrap()
            .expect("the lapsed key is taken over");
        let advanced = S::advance(&mut stale, &owner, "reserve", &json!(1), LEASE).await;
        assert!(
            matches!(advanced, Err(EngineError::Fenced))
                || advanced.as_ref().is_err_and(EngineError::is_restartable),
            "{isolation}: {advanced:?}"
        );
        steps::rollback::<S>(stale).await.unwrap();
        // Run again, as the runner does: the write matches no row.
        let mut again = steps::begin_at::<S>(&pool, isolation).await.unwrap();
        let advanced = S::advance(&mut again, &owner, "reserve", &json!(1), LEASE).await;
        assert!(
            matches!(advanced, Err(EngineError::Fenced)),
            "{isolation}: {advanced:?}"
        );
        steps::rollback::<S>(again).await.unwrap();
        let report = report_of::<S>(&pool, &key).await;
        assert_eq!(report.recovery_point, "start", "{isolation}");
        assert_eq!(
            found::<S>(&pool, &key).await.lock_version,
            taken.owner.lock_version()
        );
    }
}

/// The layout every engine's migrations make keeps a claim at any isolation level, so a runner
/// claims in its leading phases' transaction whatever they declare; only a layout adopted
/// afterwards (PostgreSQL's partitions, tests/it/partitions.rs) answers otherwise. Asked on a
/// connection as a runner asks it, before its first claim above Read Committed.
async fn the_layout_the_migrations_make_claims_at_every_level<S: Engine>(pool: S::Pool) {
    use idemflow_store::ConnectionPool;
    let mut connection = pool.acquire().await.unwrap();
    assert!(
        !S::claims_at_read_committed_only(&mut connection)
            .await
            .unwrap()
    );
}
