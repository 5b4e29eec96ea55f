//! The console and the operators' reads on Redis, beyond what the conformance suite asks of every
//! engine: the documented read-only ACL (scripts/redis/read-only.acl) serves every page and is
//! refused every write; no script an operator's page runs walks more than a page of started keys,
//! at any number of them; and a Redis Cluster is refused at connect, with a clear error.

use std::time::Duration;

use idemflow::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_console::Console;
use idemflow_redis::{RedisPool, RedisStore};
use idemflow_store::{
    Claim, Claimed, ConnectionPool, Engine, Limits, LookUp, OperatorEngine, OperatorOptions,
};
use reqwest::StatusCode;
use serde_json::json;

use crate::support::redis::{fresh, url};

const WORKFLOW: &str = "checkout.v1";

/// Claims `key` of `tenant` (its lease `lease` long): the claim's transaction and owner.
async fn claim(
    pool: &RedisPool,
    tenant: &str,
    key: &str,
    lease: Duration,
) -> (
    <RedisStore as Engine>::Transaction,
    <RedisStore as Engine>::Owner,
) {
    let (tenant, key) = (TenantId::new(tenant).unwrap(), Key::parse(key).unwrap());
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let mut connection = pool.acquire().await.unwrap();
    let LookUp::Absent(ticket) = RedisStore::look_up(&mut connection, &tenant, &key)
        .await
        .unwrap()
    else {
        panic!("{key:?} is new");
    };
    let request = json!({"amount": 1200});
    let claim = Claim {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: WORKFLOW,
        request: &request,
        lease,
    };
    match RedisStore::begin_claim(connection, claim, ticket, &Limits::default()).await {
        Ok(Claimed::Owned(transaction, owner)) => (transaction, owner),
        other => panic!("{key:?} was not claimed: {other:?}"),
    }
}

/// A done key: its response in the row.
async fn done(pool: &RedisPool, tenant: &str, key: &str) {
    let (mut transaction, owner) = claim(pool, tenant, key, Duration::from_secs(30)).await;
    let response = StoredResponse::new(201, br#"{"order":41}"#.to_vec());
    RedisStore::finish(&mut transaction, &owner, "complete", &response, 1 << 20)
        .await
        .unwrap();
}

/// Serves `console` on loopback: its root URL.
async fn serve(console: Console) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let app = console.router();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{address}")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn page(url: &str) -> (StatusCode, String) {
    let response = client().get(url).send().await.unwrap();
    (response.status(), response.text().await.unwrap())
}

/// The documented read-only user (scripts/redis/read-only.acl) as `name`, with `password`, on
/// the keys under `prefix`: the rules exactly as the file writes them, but these three.
async fn create_read_only_user(pool: &RedisPool, name: &str, password: &str, prefix: &str) {
    let recipe = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/redis/read-only.acl"),
    )
    .unwrap();
    let line = recipe
        .lines()
        .find(|line| line.starts_with("user "))
        .unwrap();
    let mut command = redis::cmd("ACL");
    command.arg("SETUSER").arg(name).arg("reset");
    for rule in line.split_whitespace().skip(2) {
        let rule = match rule {
            ">CHANGE-ME" => format!(">{password}"),
            "~idemflow:*" => format!("~{prefix}:*"),
            rule => rule.to_owned(),
        };
        command.arg(rule);
    }
    let () = command.query_async(&mut pool.connection()).await.unwrap();
}

#[tokio::test]
async fn the_documented_read_only_acl_serves_every_page_and_is_refused_every_action() {
    let pool = fresh("console-read-only-acl").await;
    done(&pool, "acme", "order-1").await;
    let (_, live) = claim(&pool, "acme", "order-2", Duration::from_secs(3600)).await;
    let (_, due) = claim(&pool, "acme", "order-3", Duration::from_millis(1)).await;
    crate::support::redis::lapse_leases(&pool).await;
    let user = "idemflow-test-console-read-only";
    create_read_only_user(&pool, user, "read", pool.prefix()).await;
    let as_reader = url().replacen("redis://", &format!("redis://{user}:read@"), 1);
    let options = OperatorOptions::default().with_key_prefix(Some(pool.prefix().to_owned()));

    // The read-only operator, opened by URL as the CLI and the console open it.
    let reader = RedisStore
        .open(&as_reader, &options.clone().with_read_only(true))
        .await;
    let reader = reader.unwrap_or_else(|error| panic!("as the read-only user: {error}"));
    let report = reader.key_report("acme", "order-1").await.unwrap().unwrap();
    assert_eq!(report.response_status, Some(201));
    assert!(
        reader
            .key_bodies("acme", "order-1")
            .await
            .unwrap()
            .is_some()
    );
    let overview = reader.overview().await.unwrap();
    assert_eq!(overview.started.iter().map(|s| s.keys).sum::<i64>(), 2);
    assert_eq!(reader.stuck_keys(5, 100).await.unwrap().len(), 2);
    assert!(reader.table_stats().await.is_ok());
    let root = serve(Console::shared(reader.into())).await;
    for path in [
        String::new(),
        "/keys?tenant=acme".to_owned(),
        "/keys?key=order".to_owned(),
        "/stuck".to_owned(),
        "/key?tenant=acme&key=order-1".to_owned(),
        "/key?tenant=acme&key=order-2".to_owned(),
    ] {
        let (status, html) = page(&format!("{root}{path}")).await;
        assert_eq!(status, StatusCode::OK, "{path}: {html}");
    }
    let (_, html) = page(&format!("{root}/key?tenant=acme&key=order-1")).await;
    assert!(html.contains(r#"id="response-status">201<"#), "{html}");
    for (action, key, token, state) in [
        ("end-lease", "order-2", live.lock_version(), "started"),
        ("expire", "order-1", report.lock_version, "done"),
    ] {
        let response = client()
            .post(format!("{root}/key/{action}"))
            .form(&[
                ("tenant", "acme"),
                ("key", key),
                ("lock_version", &token.to_string()),
                ("state", state),
                ("force", "on"),
                ("confirmed", "yes"),
            ])
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{action}");
    }

    // Redis itself refuses the user every write: an operator that tries is told so.
    let writer = RedisStore.open(&as_reader, &options).await.unwrap();
    let refused = writer
        .end_lease("acme", "order-3", due.lock_version())
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("no permissions"), "{refused}");
    let refused = writer
        .expire_key("acme", "order-1", report.lock_version, "done")
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("no permissions"), "{refused}");
    let kept = RedisStore::operator(&pool);
    assert!(kept.key_report("acme", "order-1").await.unwrap().is_some());
    assert_eq!(
        kept.key_report("acme", "order-3")
            .await
            .unwrap()
            .unwrap()
            .lock_version,
        due.lock_version()
    );
    let () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(user)
        .query_async(&mut pool.connection())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_redis_cluster_is_refused_at_connect_with_a_clear_error() {
    let node = crate::support::redis::own_server(&[
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
    ])
    .await;
    let refused = RedisPool::connect(&node.url).await.unwrap_err();
    assert!(
        matches!(refused, idemflow_redis::StoreError::Cluster),
        "{refused:?}"
    );
    let refused = RedisStore
        .open(&node.url, &OperatorOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(refused, idemflow_store::OperatorError::Unsupported(_)),
        "{refused:?}"
    );
    assert!(refused.to_string().contains("Redis Cluster"), "{refused}");
    // A single Redis, its own configuration otherwise the same, is taken.
    let single = crate::support::redis::own_server(&[]).await;
    assert!(RedisPool::connect(&single.url).await.is_ok());
}
