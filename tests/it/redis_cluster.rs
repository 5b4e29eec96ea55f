//! The Redis store on a Redis Cluster of the test's own (three primaries, three replicas) while
//! the cluster changes under load: slots moved from one primary to another key by key (the
//! store's scripts sent where their keys are, `ASK` and `TRYAGAIN` followed), and a primary
//! killed with SIGKILL (its replica promoted, acknowledged writes it had not received lost).
//! Payments call the mock provider over real HTTP, which counts each derived key's calls. The
//! conformance suite and the schedule explorer run on the suite's shared cluster
//! (`conformance::redis_cluster::…`, `simulate::redis_cluster::…`); these need one to break.
//!
//! The failover's figures are printed (`--no-capture`); docs/engines.md records them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemflow_core::Key;
use idemflow_redis::{BUCKETS, RedisPool, RedisStore};
use idemflow_runner::{Outcome, Registry, Resumer, RunError, Runner, RunnerConfig, Workflow};
use idemflow_store::{Engine as _, Tamper};
use idemflow_testkit::provider::{Fault, MockProvider};

use crate::foreign_only::{BODY, Pay, Payment, pay_key, tenant};
use crate::support::redis::{OwnCluster, own_cluster};

/// How long a client keeps sending its request before it gives up on a key.
const CLIENT_PATIENCE: Duration = Duration::from_secs(60);

/// A payment of the foreign-only suite, its call answered after `delay` by the provider.
fn payments(provider: &MockProvider) -> Arc<Workflow<RedisStore>> {
    Arc::new(
        Workflow::<RedisStore>::builder_on::<Payment>("payment.v1")
            .foreign(Pay {
                provider: provider.client(),
            })
            .lease(Duration::from_secs(30))
            .build()
            .unwrap(),
    )
}

/// What one client saw: its first answer's kind, and how many sends it took to get the payment
/// (executed or replayed), or `None` when it gave up (a 409 for a key whose owner's finish was
/// lost: its lease must lapse first).
#[derive(Debug)]
struct Client {
    first: &'static str,
    sends: Option<u32>,
}

fn kind(outcome: &Result<Outcome, RunError>) -> &'static str {
    match outcome {
        Ok(Outcome::Executed(_)) => "executed",
        Ok(Outcome::Replayed(_)) => "replayed",
        Ok(Outcome::InProgress { .. }) => "in progress (409)",
        Ok(_) => "other answer",
        Err(RunError::Fenced) => "fenced (409)",
        Err(_) => "error",
    }
}

fn paid(outcome: &Result<Outcome, RunError>) -> bool {
    matches!(outcome, Ok(Outcome::Executed(_) | Outcome::Replayed(_)))
}

/// Sends `key`'s payment until it is paid (a 409 or an error sent again after 50 ms), at most
/// [`CLIENT_PATIENCE`], or until `give_up_on_409` and a 409 comes.
async fn client(
    runner: Runner<RedisStore>,
    workflow: Arc<Workflow<RedisStore>>,
    key: Key,
    give_up_on_409: bool,
) -> Client {
    let started = Instant::now();
    let mut first = None;
    let mut sends = 0;
    loop {
        sends += 1;
        let outcome = runner
            .run(
                &workflow,
                &tenant(),
                &key,
                crate::foreign_only::request(BODY),
            )
            .await;
        let seen = kind(&outcome);
        first.get_or_insert(seen);
        if paid(&outcome) {
            return Client {
                first: first.unwrap(),
                sends: Some(sends),
            };
        }
        if (give_up_on_409 && seen.contains("409")) || started.elapsed() > CLIENT_PATIENCE {
            return Client {
                first: first.unwrap(),
                sends: None,
            };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A node's connection of its own.
async fn node(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The node id and URL of the primary serving `slot`, as the first node that answers sees it.
async fn primary_of(cluster: &OwnCluster, slot: u16) -> (String, String) {
    primary_of_alive(cluster, usize::MAX, slot).await
}

/// The hash slot of bucket `bucket`'s keys.
fn slot_of(bucket: u16) -> u16 {
    idemflow_redis::bucket_slot(bucket)
}

/// `CLUSTER SLOTS` as `node` answers it: each range's first and last slot, its primary's id and
/// URL. Empty when the node does not answer.
async fn slots(url: &str) -> Vec<(u16, u16, String, String)> {
    let Ok(client) = redis::Client::open(url) else {
        return Vec::new();
    };
    let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
        return Vec::new();
    };
    let Ok(ranges) = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async::<Vec<Vec<redis::Value>>>(&mut connection)
        .await
    else {
        return Vec::new();
    };
    let text = |value: &redis::Value| match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        redis::Value::SimpleString(text) => text.clone(),
        _ => String::new(),
    };
    let number = |value: &redis::Value| match value {
        redis::Value::Int(number) => u16::try_from(*number).unwrap_or(0),
        _ => 0,
    };
    ranges
        .into_iter()
        .filter_map(|range| {
            let redis::Value::Array(primary) = range.get(2)? else {
                return None;
            };
            Some((
                number(range.first()?),
                number(range.get(1)?),
                text(primary.get(2)?),
                format!(
                    "redis://{}:{}",
                    text(primary.first()?),
                    number(primary.get(1)?)
                ),
            ))
        })
        .collect()
}

/// Moves `slot` from the primary `from` to the primary `to`, one key at a time with a pause
/// between, so requests meet the slot half moved: `CLUSTER SETSLOT … IMPORTING` and `MIGRATING`,
/// `MIGRATE` of each key `CLUSTER GETKEYSINSLOT` names, then `SETSLOT … NODE` on every primary.
async fn move_slot(
    slot: u16,
    (from_id, from_url): &(String, String),
    (to_id, to_url): &(String, String),
    primaries: &[String],
) -> usize {
    let (mut from, mut to) = (node(from_url).await, node(to_url).await);
    let to_address = to_url.trim_start_matches("redis://");
    let (host, port) = to_address.split_once(':').unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("IMPORTING")
        .arg(from_id)
        .query_async(&mut to)
        .await
        .unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("MIGRATING")
        .arg(to_id)
        .query_async(&mut from)
        .await
        .unwrap();
    let mut moved = 0;
    loop {
        let keys: Vec<String> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(1)
            .query_async(&mut from)
            .await
            .unwrap();
        let Some(name) = keys.first() else {
            break;
        };
        let answer: redis::RedisResult<String> = redis::cmd("MIGRATE")
            .arg(host)
            .arg(port)
            .arg(name)
            .arg(0)
            .arg(5000)
            .query_async(&mut from)
            .await;
        if answer.is_ok() {
            moved += 1;
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    // The importing node first, then the one that gave the slot, then the others.
    let mut order = vec![to_url.clone(), from_url.clone()];
    let others: Vec<String> = primaries
        .iter()
        .filter(|url| !order.contains(url))
        .cloned()
        .collect();
    order.extend(others);
    for url in &order {
        let () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg("NODE")
            .arg(to_id)
            .query_async(&mut node(url).await)
            .await
            .unwrap();
    }
    moved
}

/// While 400 payments run, 16 at a time (each call 20 ms at the provider), the slots of four
/// buckets move from their primary to another, key by key, from the 40th answer on. Every client gets its payment, each key's call reached the provider once
/// (no key ran twice: no claim was lost or taken twice while its keys were split between two
/// nodes), and no key is left started.
#[tokio::test]
async fn a_resharding_under_load_ends_every_key_once() {
    const KEYS: usize = 400;
    const AT_ONCE: usize = 16;
    let cluster = own_cluster().await;
    let pool = RedisPool::connect_with_prefix(&cluster.urls(), "idemflow-test:reshard")
        .await
        .unwrap();
    assert!(pool.is_cluster());
    let provider = MockProvider::start().await;
    let keys: Vec<Key> = (0..KEYS)
        .map(|index| Key::parse(&format!("reshard-{index}")).unwrap())
        .collect();
    for key in &keys {
        provider.push_fault_for(pay_key(key), Fault::Delay(Duration::from_millis(20)));
    }
    let workflow = payments(&provider);
    let runner = Runner::on(pool.clone(), RunnerConfig::default());
    let gate = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for key in keys.clone() {
        let (runner, workflow, gate, answered) = (
            runner.clone(),
            Arc::clone(&workflow),
            Arc::clone(&gate),
            Arc::clone(&answered),
        );
        clients.spawn(async move {
            let _slot = gate.acquire_owned().await.unwrap();
            let seen = client(runner, workflow, key, false).await;
            answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            seen
        });
    }
    // Buckets 0 to 3 live in the first sixteenths of the slots, on the first primary.
    let primaries: Vec<String> = {
        let mut urls = Vec::new();
        for bucket in [0, 6, 12] {
            urls.push(primary_of(&cluster, slot_of(bucket)).await.1);
        }
        urls
    };
    let target = primary_of(&cluster, slot_of(BUCKETS - 1)).await;
    let mut moved = 0;
    while answered.load(std::sync::atomic::Ordering::SeqCst) < 40 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let before = answered.load(std::sync::atomic::Ordering::SeqCst);
    for bucket in 0..4 {
        let slot = slot_of(bucket);
        let source = primary_of(&cluster, slot).await;
        assert_ne!(source.0, target.0);
        moved += move_slot(slot, &source, &target, &primaries).await;
    }
    let during = answered.load(std::sync::atomic::Ordering::SeqCst) - before;
    let mut answers: HashMap<&'static str, usize> = HashMap::new();
    let mut unpaid = 0;
    while let Some(joined) = clients.join_next().await {
        let seen = joined.unwrap();
        *answers.entry(seen.first).or_default() += 1;
        unpaid += usize::from(seen.sends.is_none());
    }
    let calls: Vec<usize> = keys
        .iter()
        .map(|key| provider.calls_for(&pay_key(key)))
        .collect();
    eprintln!(
        "redis cluster resharding: {KEYS} keys, {AT_ONCE} at once; 4 slots moved, {moved} Redis \
         keys migrated one at a time, {during} payments answered meanwhile; first answers \
         {answers:?}; unpaid {unpaid}; keys called twice {}",
        calls.iter().filter(|calls| **calls > 1).count()
    );
    assert!(moved > 0, "the moved slots held keys");
    assert!(
        during > 0 && during < KEYS - before,
        "the slots moved while payments ran"
    );
    assert_eq!(unpaid, 0, "{answers:?}");
    assert!(calls.iter().all(|calls| *calls == 1), "{calls:?}");
    for bucket in 0..4 {
        assert_eq!(primary_of(&cluster, slot_of(bucket)).await.0, target.0);
    }
    let overview = RedisStore::operator(&pool).overview().await.unwrap();
    assert!(overview.started.is_empty(), "{overview:?}");
    assert_eq!(overview.estimated_keys, Some(KEYS as i64));
}

/// While 400 payments run, 16 at a time (each call 20 ms at the provider), the primary of bucket
/// 0's slot is killed with SIGKILL once 100 are answered; the cluster promotes its replica
/// (`cluster-node-timeout` 1000 ms). Clients send again on an error or a 409, and one whose
/// key's owner lost its finish gives up on the 409 (its lease holds the key); then the leases
/// still running are rewound (the engine's `Tamper`, never a sleep), a resumer finishes what is
/// started, and every client sends once more. Asserted: every key ends paid, and the provider
/// charged each once (a key whose claim or finish the new primary never received ran its call
/// again, with the same derived key). Printed: the figures of docs/engines.md.
#[tokio::test]
async fn a_primary_killed_under_load_loses_only_unreplicated_writes_and_no_key_sticks() {
    const KEYS: usize = 400;
    const AT_ONCE: usize = 16;
    const BEFORE_KILL: usize = 100;
    let mut cluster = own_cluster().await;
    let pool = RedisPool::connect_with_prefix(&cluster.urls(), "idemflow-test:failover")
        .await
        .unwrap();
    let provider = MockProvider::start().await;
    let keys: Vec<Key> = (0..KEYS)
        .map(|index| Key::parse(&format!("failover-{index}")).unwrap())
        .collect();
    for key in &keys {
        provider.push_fault_for(pay_key(key), Fault::Delay(Duration::from_millis(20)));
    }
    let workflow = payments(&provider);
    let runner = Runner::on(pool.clone(), RunnerConfig::default());
    let answered = Arc::new(tokio::sync::Semaphore::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(AT_ONCE));
    let mut clients = tokio::task::JoinSet::new();
    for key in keys.clone() {
        let (runner, workflow, gate, answered) = (
            runner.clone(),
            Arc::clone(&workflow),
            Arc::clone(&gate),
            Arc::clone(&answered),
        );
        clients.spawn(async move {
            let _slot = gate.acquire_owned().await.unwrap();
            let seen = client(runner, workflow, key.clone(), true).await;
            answered.add_permits(1);
            (key, seen)
        });
    }
    answered
        .acquire_many(BEFORE_KILL as u32)
        .await
        .unwrap()
        .forget();
    let (_, victim_url) = primary_of(&cluster, slot_of(0)).await;
    let victim = cluster
        .nodes
        .iter()
        .position(|node| node.url == victim_url)
        .unwrap();
    let killed_at = Instant::now();
    cluster.nodes[victim].kill();
    // The promotion, as the surviving nodes see it: bucket 0's slot served by another node.
    let promoted = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let (_, serving) = primary_of_alive(&cluster, victim, slot_of(0)).await;
            if serving != victim_url {
                return killed_at.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        let mut nodes = String::new();
        for (index, survivor) in cluster.nodes.iter().enumerate() {
            if index == victim {
                continue;
            }
            for what in [&["cluster", "nodes"][..], &["info", "replication"][..]] {
                nodes += &std::process::Command::new("redis-cli")
                    .args(["-u", &survivor.url])
                    .args(what)
                    .output()
                    .map(|output| String::from_utf8_lossy(&output.stdout).into_owned())
                    .unwrap_or_default();
            }
        }
        panic!("no replica of {victim_url} was promoted within 30 s:\n{nodes}")
    });
    let mut first: HashMap<&'static str, usize> = HashMap::new();
    let mut sends_after = 0;
    let mut stuck = Vec::new();
    while let Some(joined) = clients.join_next().await {
        let (key, seen) = joined.unwrap();
        *first.entry(seen.first).or_default() += 1;
        match seen.sends {
            Some(sends) => sends_after += usize::from(sends > 1),
            None => stuck.push(key),
        }
    }
    // What the clients left started: its owner's finish was lost to the kill (an error), and the
    // key holds its lease. Rewound, never slept through; then the resumer finishes it.
    RedisStore::lapse_leases(&pool, None).await.unwrap();
    let mut registry = Registry::new();
    registry.register(Arc::clone(&workflow)).unwrap();
    let drained = Resumer::new(runner.clone(), registry)
        .drain()
        .await
        .unwrap();
    let mut again: HashMap<&'static str, usize> = HashMap::new();
    for key in &keys {
        let outcome = runner
            .run(
                &workflow,
                &tenant(),
                key,
                crate::foreign_only::request(BODY),
            )
            .await;
        *again.entry(kind(&outcome)).or_default() += 1;
    }
    let called_twice = keys
        .iter()
        .filter(|key| provider.calls_for(&pay_key(key)) >= 2)
        .count();
    let charges = provider.charges().len();
    let buckets_on_victim = {
        let mut count = 0;
        for bucket in 0..BUCKETS {
            if primary_of_alive(&cluster, victim, slot_of(bucket)).await.1 != victim_url {
                count += 1;
            }
        }
        count
    };
    eprintln!(
        "redis cluster failover: {KEYS} keys, {AT_ONCE} at once, the primary of bucket 0 killed \
         after {BEFORE_KILL} answers; replica serving after {promoted:?}; {buckets_on_victim} \
         of {BUCKETS} buckets served by the survivors; first answers {first:?}; clients that sent more than \
         once {sends_after}; keys left started by their clients {}; the resumer took {} and \
         finished {}; answers to a last send {again:?}; keys whose call went out twice \
         {called_twice}; charges {charges}",
        stuck.len(),
        drained.taken,
        drained.finished
    );
    assert_eq!(
        again.get("replayed").copied().unwrap_or(0) + again.get("executed").copied().unwrap_or(0),
        KEYS,
        "every key ends: {again:?}"
    );
    assert_eq!(charges, KEYS, "the provider charged each key once");
    assert!(
        keys.iter()
            .all(|key| provider.calls_for(&pay_key(key)) <= 2),
        "no key's call went out more than twice"
    );
}

/// [`primary_of`], asking only the nodes other than the killed one.
async fn primary_of_alive(cluster: &OwnCluster, killed: usize, slot: u16) -> (String, String) {
    for (index, own) in cluster.nodes.iter().enumerate() {
        if index == killed {
            continue;
        }
        for (from, to, id, url) in slots(&own.url).await {
            if (from..=to).contains(&slot) {
                return (id, url);
            }
        }
    }
    panic!("no node serves slot {slot}");
}
