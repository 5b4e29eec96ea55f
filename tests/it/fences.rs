//! Fencing tokens and leases at the store's level: a token never repeats for a key, a lease is
//! measured from the statement that writes it, and an owner never shortens its own lease.

use idemflow::PgStore;
use std::time::Duration;

use crate::support::*;
use idemflow::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_pg::{self as store, ClaimRequest, Claimed, Owner, StoreError};
use serde_json::json;
use sqlx::PgPool;

/// Claims a new key and commits the claim; its owner.
async fn claim_committed(pool: &PgPool, tenant: &TenantId, key: &Key, amount: i64) -> Owner {
    let fingerprint = Fingerprint::of_json("POST", "/x", amount.to_string().as_bytes()).unwrap();
    let request = json!({ "amount": amount });
    let lock_version = store::next_lock_version(&mut pool.acquire().await.unwrap())
        .await
        .unwrap();
    let claim = ClaimRequest {
        tenant,
        key,
        lock_version,
        fingerprint: &fingerprint,
        workflow: "w.v1",
        request: &request,
        lease: Duration::from_secs(60),
    };
    let Claimed::Owned(tx, owner) =
        store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
            .await
            .unwrap()
    else {
        panic!("the key is new");
    };
    tx.commit().await.unwrap();
    owner
}

/// Seconds left on a key's lease, by the database's clock at this statement.
async fn lease_left(pool: &PgPool, key: &str) -> f64 {
    sqlx::query_scalar(
        "SELECT extract(epoch FROM locked_until - clock_timestamp())::float8 \
         FROM idempotency_keys WHERE key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A key deleted by its owner (the release policy) and claimed again is a new life: no owner of
/// the old life, however long it slept, can write to the new one.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_fencing_token_never_repeats_for_a_key(pool: PgPool) {
    let tenant = TenantId::new("t").unwrap();
    let key = Key::parse("reused").unwrap();
    let long = Duration::from_secs(60);
    let mut connection = pool.acquire().await.unwrap();

    // Life 1: claimed, its owner stalls, the lease expires, a takeover deletes the key.
    let claimer = claim_committed(&pool, &tenant, &key, 1).await;
    expire_lease(&pool, "reused").await;
    let taker = store::take_over(&mut connection, &tenant, &key, claimer.lock_version(), long)
        .await
        .unwrap()
        .expect("the expired lease is taken over");
    store::delete_owned(&mut connection, &taker.owner)
        .await
        .unwrap();

    // Life 2: the same key, another request.
    let new_owner = claim_committed(&pool, &tenant, &key, 2).await;
    assert_ne!(new_owner.lock_version(), claimer.lock_version());
    assert_ne!(new_owner.lock_version(), taker.owner.lock_version());

    // Both owners of life 1 wake up: every write they try is fenced, the row unchanged.
    let response = StoredResponse::new(200, "from an earlier life");
    for stale in [&claimer, &taker.owner] {
        // The phase's writes as the engine makes them: in its transaction (rolled back, dropped).
        let mut tx = store::Transaction::begin(&pool).await.unwrap();
        let results = [
            store::finish(&mut tx, stale, "phase", &response, usize::MAX).await,
            store::advance(&mut tx, stale, "phase", &json!({}), long).await,
            store::renew_lease(&mut connection, stale, long).await,
            store::postpone(&mut connection, stale, Duration::ZERO, "stale").await,
        ];
        for result in results {
            assert!(matches!(result, Err(StoreError::Fenced)), "{result:?}");
        }
    }
    let (state, request): (String, serde_json::Value) =
        sqlx::query_as("SELECT state, request FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), request), ("started", json!({"amount": 2})));
    // The new owner's writes still land.
    let mut tx = store::Transaction::begin(&pool).await.unwrap();
    store::finish(&mut tx, &new_owner, "phase", &response, usize::MAX)
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

/// A lease is measured from the statement that writes it, not from the start of its
/// transaction: a transaction that ran for a while still commits a whole lease.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_lease_written_late_in_a_transaction_is_a_whole_lease(pool: PgPool) {
    let tenant = TenantId::new("t").unwrap();
    let key = Key::parse("slow").unwrap();
    let owner = claim_committed(&pool, &tenant, &key, 1).await;
    let lease = Duration::from_secs(3);

    let mut tx = store::Transaction::begin(&pool).await.unwrap();
    sqlx::query("SELECT pg_sleep(1.2)")
        .execute(&mut *tx)
        .await
        .unwrap();
    store::advance(&mut tx, &owner, "phase", &json!({}), lease)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let left = lease_left(&pool, "slow").await;
    assert!(
        left > 2.7,
        "the lease left right after commit is {left:.2} s of 3 s"
    );
}

/// An owner's own writes never shorten the lease it holds (a heartbeat's renewal is not undone
/// by an advance that asks for less).
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_owner_never_shortens_its_own_lease(pool: PgPool) {
    let tenant = TenantId::new("t").unwrap();
    let key = Key::parse("long").unwrap();
    let owner = claim_committed(&pool, &tenant, &key, 1).await;
    let mut connection = pool.acquire().await.unwrap();
    store::renew_lease(&mut connection, &owner, Duration::from_secs(60))
        .await
        .unwrap();
    let mut tx = store::Transaction::begin(&pool).await.unwrap();
    store::advance(&mut tx, &owner, "phase", &json!({}), Duration::from_secs(1))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    store::renew_lease(&mut connection, &owner, Duration::from_secs(1))
        .await
        .unwrap();
    let left = lease_left(&pool, "long").await;
    assert!(left > 58.0, "the lease was shortened to {left:.2} s");
}

/// A heartbeat's renewal in flight when its owner postpones the key (the attempt failed) waits
/// for the postpone's row lock, and must then change nothing: the postpone advanced the fence. It
/// used to match the unchanged token and stretch the backoff back to a whole lease.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_renewal_landing_after_its_owner_postponed_the_key_changes_nothing(pool: PgPool) {
    let tenant = TenantId::new("t").unwrap();
    let key = Key::parse("postponed").unwrap();
    let owner = claim_committed(&pool, &tenant, &key, 1).await;
    let mut record = pool.begin().await.unwrap();
    store::postpone(&mut record, &owner, Duration::from_secs(2), "scripted")
        .await
        .unwrap();
    let renewal = {
        let (pool, owner) = (pool.clone(), owner.clone());
        tokio::spawn(async move {
            let mut connection = pool.acquire().await.unwrap();
            store::renew_lease(&mut connection, &owner, Duration::from_secs(60)).await
        })
    };
    wait_for_a_lock_wait(&pool).await;
    record.commit().await.unwrap();
    assert!(matches!(renewal.await.unwrap(), Err(StoreError::Fenced)));
    let left = lease_left(&pool, "postponed").await;
    assert!(left <= 2.0, "the backoff was stretched to {left:.2} s");
}

/// Waits until a statement of this database waits for a lock.
async fn wait_for_a_lock_wait(pool: &PgPool) {
    for _ in 0..1000 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("nothing waited for a lock");
}

/// A resumer's batch takeover writes each key its own workflow's lease, not the longest of the
/// workflows it runs: a key of a 5-second workflow taken over beside a 10-minute one is due again
/// 5 seconds after, if its new owner dies.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_batch_takeover_writes_each_key_its_own_workflows_lease(pool: PgPool) {
    let tenant = TenantId::new("t").unwrap();
    for (key, workflow) in [("short", "short.v1"), ("long", "long.v1")] {
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, \
                 locked_until) \
             VALUES ($1, $2, sha256('x'), $3, '{}', now() - interval '1 second')",
        )
        .bind(tenant.as_str())
        .bind(key)
        .bind(workflow)
        .execute(&pool)
        .await
        .unwrap();
    }
    let workflows = [
        ("short.v1".to_owned(), Duration::from_secs(5)),
        ("long.v1".to_owned(), Duration::from_secs(600)),
    ];
    let mut connection = pool.acquire().await.unwrap();
    let due = store::take_over_due(&mut connection, &workflows, 10)
        .await
        .unwrap();
    assert_eq!(due.len(), 2);
    let short = lease_left(&pool, "short").await;
    let long = lease_left(&pool, "long").await;
    assert!(short <= 5.0 && short > 3.0, "short: {short:.2} s");
    assert!(long > 598.0, "long: {long:.2} s");
}

mod slow {
    //! A workflow whose first local phase is slow, and whose foreign phase reads the lease its
    //! owner holds as the call starts.
    use super::*;
    use idemflow::{DerivedKey, ForeignPhase, LocalPhase, PhaseContext, PhaseError};
    use sqlx::PgConnection;

    pub struct Slow;

    #[async_trait::async_trait]
    impl LocalPhase<PgStore> for Slow {
        const NAME: &'static str = "slow";
        type Input = serde_json::Value;
        type Output = f64;

        async fn run(
            &self,
            connection: &mut PgConnection,
            _: serde_json::Value,
            _: &PhaseContext,
        ) -> Result<f64, PhaseError> {
            sqlx::query("SELECT pg_sleep(1.2)")
                .execute(connection)
                .await?;
            Ok(0.0)
        }
    }

    pub struct Probe(pub PgPool);

    #[async_trait::async_trait]
    impl ForeignPhase for Probe {
        const NAME: &'static str = "probe";
        type Input = f64;
        type Output = f64;

        fn timeout(&self) -> Duration {
            Duration::from_secs(1)
        }

        async fn call(
            &self,
            _: &DerivedKey,
            _: f64,
            ctx: &PhaseContext,
        ) -> Result<f64, PhaseError> {
            Ok(lease_left(&self.0, ctx.key.as_str()).await)
        }
    }

    pub struct Answer;

    #[async_trait::async_trait]
    impl LocalPhase<PgStore> for Answer {
        const NAME: &'static str = "answer";
        type Input = f64;
        type Output = StoredResponse;

        async fn run(
            &self,
            _: &mut PgConnection,
            left: f64,
            _: &PhaseContext,
        ) -> Result<StoredResponse, PhaseError> {
            Ok(StoredResponse::new(200, format!("{left:.3}")))
        }
    }
}

/// The defect seen from outside: a slow first transaction used to commit a lease shortened by
/// its own length, so a duplicate could take the key over while its owner was still calling the
/// provider. The lease the owner holds as its call starts is a whole one.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn an_owner_calls_out_holding_a_whole_lease_after_a_slow_transaction(pool: PgPool) {
    let workflow = idemflow::Workflow::builder::<serde_json::Value>("slow.v1")
        .local(slow::Slow)
        .foreign(slow::Probe(pool.clone()))
        .local(slow::Answer)
        .lease(Duration::from_secs(3))
        .build()
        .unwrap();
    let runner = idemflow::Runner::new(pool.clone());
    let response = executed(&run(&runner, &workflow, &tenant(1), "k", b"{}").await).clone();
    let left: f64 = String::from_utf8(response.body).unwrap().parse().unwrap();
    assert!(
        left > 2.7,
        "the owner called out with {left:.2} s of its 3 s lease left"
    );
}
