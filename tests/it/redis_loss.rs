//! What the Redis lever costs, shown: Redis loses its data (here: every key under the test's
//! prefix deleted at once, the fence's counter with them, as a restart without persistence or a
//! failover to a replica that missed the last writes would) while requests run, and every client
//! retries. The figures are printed (`--nocapture`), and what must hold is asserted: a lost key
//! runs again, its call goes out again under the same derived key, and the provider's idempotency
//! keeps the charge single; an owner from before the loss writes nothing after it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idemflow_core::{Key, StoredResponse};
use idemflow_redis::RedisPool;
use idemflow_redis::RedisStore as Store;
use idemflow_runner::{Outcome, Request, RunError, Runner, RunnerConfig, Workflow};
use idemflow_store::{Claim, Claimed, Engine as _, EngineError, Limits, LookUp};
use idemflow_testkit::provider::{Fault, MockProvider};
use serde_json::json;

use crate::foreign_only::{BODY, Pay, Payment, pay_key, tenant};
use crate::support::redis::{fresh, lose_everything};

fn request() -> Request<'static> {
    crate::foreign_only::request(BODY)
}

/// A key claimed before the loss is claimed again after it: the new owner's token is above the
/// old one, so the old owner (still at work, say in a long call) is fenced out of every write.
/// Counting again from 1 after the loss would hand the new owner the old owner's token.
#[tokio::test]
async fn after_redis_loses_its_data_no_token_repeats_and_an_old_owner_writes_nothing() {
    let pool = fresh("loss-tokens").await;
    let key = Key::parse("pay-lost").unwrap();
    let (tenant, fingerprint) = (
        tenant(),
        idemflow_core::Fingerprint::from_slice(&[7; 32]).unwrap(),
    );
    let request = json!({"amount": 1200});
    let claim = Claim {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: "payment.v1",
        request: &request,
        lease: Duration::from_secs(30),
    };
    let LookUp::Absent(()) = Store::look_up(&mut pool.clone(), &tenant, &key)
        .await
        .unwrap()
    else {
        panic!("new");
    };
    let (mut old_transaction, old) = claimed(&pool, claim).await;

    lose_everything(&pool).await;
    let (_transaction, new) = claimed(&pool, claim).await;
    assert!(
        new.lock_version() > old.lock_version(),
        "the token after the loss ({}) is not above the one before ({})",
        new.lock_version(),
        old.lock_version()
    );
    let advanced = Store::advance(
        &mut old_transaction,
        &old,
        "pay",
        &json!({"charge": "ch_old"}),
        Duration::from_secs(30),
    )
    .await;
    assert!(
        matches!(&advanced, Err(EngineError::Fenced)),
        "the owner from before the loss wrote over the new owner's key: {advanced:?}"
    );
    let finished = Store::finish(
        &mut old_transaction,
        &old,
        "pay",
        &StoredResponse::new(201, "old"),
        usize::MAX,
    )
    .await;
    assert!(
        matches!(&finished, Err(EngineError::Fenced)),
        "{finished:?}"
    );
}

/// Claims a key the caller found absent: its transaction and owner.
async fn claimed(
    pool: &RedisPool,
    claim: Claim<'_>,
) -> (idemflow_redis::Transaction, idemflow_redis::Owner) {
    let connection = Box::new(pool.clone());
    match Store::begin_claim(connection, claim, (), &Limits::default()).await {
        Ok(Claimed::Owned(transaction, owner)) => (transaction, owner),
        other => panic!("not claimed: {other:?}"),
    }
}

/// What a client saw, by kind.
fn kind(outcome: &Result<Outcome, RunError>) -> &'static str {
    match outcome {
        Ok(Outcome::Executed(_)) => "executed",
        Ok(Outcome::Replayed(_)) => "replayed",
        Ok(Outcome::InProgress { .. }) => "in progress (409)",
        Ok(Outcome::Interrupted { .. }) => "interrupted",
        Ok(_) => "other answer",
        Err(RunError::Fenced) => "fenced (409)",
        Err(_) => "error",
    }
}

/// 120 payments, 16 at a time. The first 8 calls take 2 s at the provider, the others 10 ms: once
/// 40 payments are answered (the 8 slow ones still in their call), Redis loses everything. Then
/// every client sends its request once more.
#[tokio::test]
async fn redis_losing_its_data_mid_run_reruns_the_lost_keys_and_the_provider_charges_each_once() {
    const KEYS: usize = 120;
    const AT_ONCE: usize = 16;
    const SLOW: usize = 8;
    const BEFORE_LOSS: usize = 40;
    let pool = fresh("loss-mid-run").await;
    let provider = MockProvider::start().await;
    let keys: Vec<Key> = (0..KEYS)
        .map(|index| Key::parse(&format!("pay-{index}")).unwrap())
        .collect();
    for (index, key) in keys.iter().enumerate() {
        let delay = if index < SLOW { 2000 } else { 10 };
        provider.push_fault_for(pay_key(key), Fault::Delay(Duration::from_millis(delay)));
    }
    let workflow = Arc::new(
        Workflow::<idemflow_redis::RedisStore>::builder_on::<Payment>("payment.v1")
            .foreign(Pay {
                provider: provider.client(),
            })
            .lease(Duration::from_secs(30))
            .build()
            .unwrap(),
    );
    let runner = Runner::on(pool.clone(), RunnerConfig::default());

    let answered = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let mut first = tokio::task::JoinSet::new();
    for key in keys.clone() {
        let (runner, workflow, gate, answered) = (
            runner.clone(),
            Arc::clone(&workflow),
            Arc::clone(&gate),
            Arc::clone(&answered),
        );
        // Spawned in order, so the slow keys take the first slots.
        let slot = gate.acquire_owned().await.unwrap();
        first.spawn(async move {
            let outcome = runner.run(&workflow, &tenant(), &key, request()).await;
            drop(slot);
            answered.add_permits(1);
            (key, outcome)
        });
        if first.len() == AT_ONCE {
            break;
        }
    }
    for key in keys.iter().skip(AT_ONCE).cloned() {
        let (runner, workflow, gate, answered) = (
            runner.clone(),
            Arc::clone(&workflow),
            Arc::clone(&gate),
            Arc::clone(&answered),
        );
        first.spawn(async move {
            let _slot = gate.acquire_owned().await.unwrap();
            let outcome = runner.run(&workflow, &tenant(), &key, request()).await;
            answered.add_permits(1);
            (key, outcome)
        });
    }
    answered
        .acquire_many(BEFORE_LOSS as u32)
        .await
        .unwrap()
        .forget();
    for key in &keys[..SLOW] {
        assert!(
            provider.is_in_flight(&pay_key(key)),
            "the slow calls outlast the first {BEFORE_LOSS} answers"
        );
    }
    lose_everything(&pool).await;

    let mut before: HashMap<&'static str, usize> = HashMap::new();
    let mut slow_answers = Vec::new();
    while let Some(joined) = first.join_next().await {
        let (key, outcome) = joined.unwrap();
        if keys[..SLOW].contains(&key) {
            slow_answers.push(kind(&outcome));
        }
        *before.entry(kind(&outcome)).or_default() += 1;
    }
    // Every client sends its request once more (a retry after a lost response, or a check).
    let mut again: HashMap<&'static str, usize> = HashMap::new();
    for key in &keys {
        let outcome = runner.run(&workflow, &tenant(), key, request()).await;
        *again.entry(kind(&outcome)).or_default() += 1;
    }
    let called_twice = keys
        .iter()
        .filter(|key| provider.calls_for(&pay_key(key)) >= 2)
        .count();
    let charges = provider.charges().len();
    eprintln!(
        "redis loss: {KEYS} keys, {AT_ONCE} at once; loss after {BEFORE_LOSS} answers with \
         {SLOW} calls in flight; first answers {before:?}; answers to the retry {again:?}; keys \
         whose call went out twice {called_twice}; charges executed {charges}"
    );

    // A key whose finish came after the loss found no key to finish: its client was told 409
    // (the request is not answered from a store that no longer holds it), never a payment.
    assert_eq!(slow_answers, ["fenced (409)"; SLOW], "{before:?}");
    // Each key was charged once: the second call carried the same derived key.
    assert_eq!(charges, KEYS);
    // Every retry got the payment, replayed or run again: no key was left stuck by the loss.
    assert_eq!(
        again.get("executed").copied().unwrap_or(0) + again.get("replayed").copied().unwrap_or(0),
        KEYS,
        "{again:?}"
    );
    // What ran again is what the loss took: the keys answered before it and those in flight when
    // it came (at most AT_ONCE), none claimed after it.
    let ran_again = again.get("executed").copied().unwrap_or(0);
    assert_eq!(called_twice, ran_again, "{again:?}");
    assert!(
        (BEFORE_LOSS + SLOW..=BEFORE_LOSS + AT_ONCE).contains(&ran_again),
        "{ran_again} keys ran again"
    );
}

/// A Redis restart closes every client connection (here: the server kills the store's one
/// connection, as `CLIENT KILL` does and as a restart or a failover's switch does). The request that
/// meets the closed connection fails as the database being unavailable; the requests after it must
/// reach Redis again on a new connection, not fail for ever on the dead one.
#[tokio::test]
async fn after_redis_closes_the_connection_the_store_reconnects_and_requests_succeed_again() {
    let pool = fresh("loss-connection").await;
    let provider = MockProvider::start().await;
    let workflow = Workflow::<idemflow_redis::RedisStore>::builder_on::<Payment>("payment.v1")
        .foreign(Pay {
            provider: provider.client(),
        })
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let runner = Runner::on(pool.clone(), RunnerConfig::default());
    let key = Key::parse("pay-before-kill").unwrap();
    let first = runner.run(&workflow, &tenant(), &key, request()).await;
    assert_eq!(kind(&first), "executed");

    // Kill every connection of this test's client name from a connection of its own.
    let client = redis::Client::open(crate::support::redis::url()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(killed, 1, "the store's connection was killed");

    let mut answers = Vec::new();
    for attempt in 0..5 {
        let key = Key::parse(&format!("pay-after-kill-{attempt}")).unwrap();
        let outcome = runner.run(&workflow, &tenant(), &key, request()).await;
        answers.push(kind(&outcome));
        if kind(&outcome) == "executed" {
            break;
        }
        // The store reconnects in the background; a client's retry comes later too.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        answers.last(),
        Some(&"executed"),
        "after its connection was closed the store never reached Redis again: {answers:?}"
    );
    let replay = runner.run(&workflow, &tenant(), &key, request()).await;
    assert_eq!(kind(&replay), "replayed");
}

/// A finished key's row lost alone (an eviction under a `maxmemory` policy that evicts keys, or a
/// stray `DEL`) leaves its entry in the set of finishes. When the key is claimed again and runs,
/// retention must not take that stale entry for the new claim: deleting a running key's row fences
/// its owner out and lets the next retry run the request a second time.
#[tokio::test]
async fn retention_never_deletes_a_key_claimed_again_after_its_finished_row_was_lost() {
    let pool = fresh("loss-stale-finish").await;
    let key = Key::parse("pay-evicted").unwrap();
    let (tenant, fingerprint) = (
        tenant(),
        idemflow_core::Fingerprint::from_slice(&[9; 32]).unwrap(),
    );
    let request = json!({"amount": 1200});
    let claim = Claim {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: "payment.v1",
        request: &request,
        lease: Duration::from_secs(30),
    };
    let (mut transaction, owner) = claimed(&pool, claim).await;
    Store::finish(
        &mut transaction,
        &owner,
        "pay",
        &StoredResponse::new(201, "first"),
        usize::MAX,
    )
    .await
    .unwrap();
    crate::support::redis::age_finished(&pool).await;
    // The row alone goes, as an eviction takes it.
    let _: () = redis::cmd("DEL")
        .arg(pool.row(tenant.as_str(), key.as_str()))
        .query_async(&mut pool.connection())
        .await
        .unwrap();

    let (_running, again) = claimed(&pool, claim).await;
    let expired = idemflow_runner::expire(&pool, Duration::from_secs(24 * 60 * 60), 100)
        .await
        .unwrap();
    assert_eq!(expired, 0, "retention deleted a key that runs");
    let LookUp::Found(found) = Store::look_up(&mut pool.clone(), &tenant, &key)
        .await
        .unwrap()
    else {
        panic!("the running key's row is gone");
    };
    assert_eq!(found.lock_version, again.lock_version());
}

/// A server whose `maxmemory-policy` may evict any key may evict the store's rows (each eviction a
/// key lost); the store says so, and names the policy. `volatile-*` policies take only keys with
/// an expiry, which the store's rows never have. (The policy is the server's, shared by every
/// test; with no `maxmemory` set, as here, nothing is evicted while it is changed.)
#[tokio::test]
async fn the_store_names_a_server_policy_that_may_evict_its_keys() {
    let pool = fresh("loss-eviction-policy").await;
    let set = |policy: &'static str| {
        let pool = pool.clone();
        async move {
            let _: () = redis::cmd("CONFIG")
                .arg("SET")
                .arg("maxmemory-policy")
                .arg(policy)
                .query_async(&mut pool.connection())
                .await
                .unwrap();
        }
    };
    let before: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    set("allkeys-lru").await;
    let evicting = pool.evicting_policy().await.unwrap();
    set("volatile-lru").await;
    let volatile = pool.evicting_policy().await.unwrap();
    set("noeviction").await;
    let none = pool.evicting_policy().await.unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg(&before[1])
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    assert_eq!(evicting.as_deref(), Some("allkeys-lru"));
    assert_eq!(volatile, None);
    assert_eq!(none, None);
}

/// A Redis user with fewer rights (no `@admin` or `@dangerous` commands, so no `CONFIG GET`, as
/// managed services give): the store connects, says nothing about eviction it cannot read, and
/// runs requests.
#[tokio::test]
async fn a_redis_user_without_admin_commands_runs_the_store() {
    let admin = fresh("loss-limited-user").await;
    let user = "idemflow-test-limited";
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg("reset")
        .arg("on")
        .arg(">limited-secret")
        .arg("~*")
        .arg("+@all")
        .arg("-@admin")
        .arg("-@dangerous")
        .query_async(&mut admin.connection())
        .await
        .unwrap();
    let url = crate::support::redis::url().replacen(
        "redis://",
        &format!("redis://{user}:limited-secret@"),
        1,
    );
    let pool = idemflow_redis::RedisPool::connect_with_prefix(&url, admin.prefix())
        .await
        .expect("a user without admin commands connects");
    assert!(
        pool.evicting_policy().await.is_err(),
        "CONFIG GET is refused to this user"
    );
    let provider = MockProvider::start().await;
    let workflow = Workflow::<idemflow_redis::RedisStore>::builder_on::<Payment>("payment.v1")
        .foreign(Pay {
            provider: provider.client(),
        })
        .lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let runner = Runner::on(pool, RunnerConfig::default());
    let key = Key::parse("pay-limited").unwrap();
    let first = runner.run(&workflow, &tenant(), &key, request()).await;
    let again = runner.run(&workflow, &tenant(), &key, request()).await;
    let _: () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(user)
        .query_async(&mut admin.connection())
        .await
        .unwrap();
    assert_eq!((kind(&first), kind(&again)), ("executed", "replayed"));
}

/// A row lost alone (an eviction, a stray `DEL`) and claimed again under another workflow is still
/// named in the first workflow's set of lease ends. A resumer of the first workflow must never
/// take it: it would run its own phases on the other's request, calling out with its own derived
/// keys (a second charge). The stale entry goes instead, so the first workflow's due count (and
/// the resumer's lag, the overview, `stuck`) are right again.
#[tokio::test]
async fn a_row_claimed_again_under_another_workflow_is_never_taken_by_the_first_ones_resumer() {
    let pool = fresh("loss-other-workflow").await;
    let key = Key::parse("pay-moved").unwrap();
    let (tenant, fingerprint) = (
        tenant(),
        idemflow_core::Fingerprint::from_slice(&[5; 32]).unwrap(),
    );
    let request = json!({"amount": 1200});
    let mut claim = Claim {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: "payment.v1",
        request: &request,
        lease: Duration::ZERO,
    };
    let _first = claimed(&pool, claim).await;
    let _: () = redis::cmd("DEL")
        .arg(pool.row(tenant.as_str(), key.as_str()))
        .query_async(&mut pool.connection())
        .await
        .unwrap();
    claim.workflow = "refund.v1";
    let (_transaction, again) = claimed(&pool, claim).await;

    let lease = Duration::from_secs(30);
    let taken = Store::take_over_due(&pool, &[("payment.v1".to_owned(), lease)], 10)
        .await
        .unwrap();
    assert!(
        taken.is_empty(),
        "payment.v1's resumer took refund.v1's key: {taken:?}"
    );
    let unknown = Store::count_due_unknown(&pool, &["refund.v1".to_owned()])
        .await
        .unwrap();
    assert!(
        unknown.is_empty(),
        "the stale entry stays in payment.v1's set: {unknown:?}"
    );
    let taken = Store::take_over_due(&pool, &[("refund.v1".to_owned(), lease)], 10)
        .await
        .unwrap();
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_eq!(taken[0].0, "refund.v1");
    assert!(taken[0].1.owner.lock_version() > again.lock_version());
}
