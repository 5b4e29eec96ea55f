//! The CLI on every engine, from one source: each case is written once, generic over the engine,
//! and runs on PostgreSQL, SQLite, MariaDB and Redis (`engines!` below makes one test per case
//! and engine). The commands run in-process, as the binary runs them ([`idemflow_cli::run_with`],
//! the URL's scheme choosing the engine); the keys are written through the engine itself and its
//! test-only [`Tamper`] moves time (never a sleep). No server is a failure, never a skip.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use async_trait::async_trait;
use idemflow_core::{Fingerprint, Key, StoredResponse, TenantId};
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_redis::{RedisPool, RedisStore};
use idemflow_sqlite::SqliteStore;
use idemflow_store::{
    Claim, Claimed, ConnectionPool, Engine, Limits, LookUp, OperatorEngine, OperatorOptions, Tamper,
};
use serde_json::{Value, json};
use sqlx::{Connection, Executor};

/// Every engine this suite runs on, as the binary is built with them.
const ENGINES: &[&dyn OperatorEngine] = &[&PgStore, &SqliteStore, &MySqlStore, &RedisStore];

/// An engine's fresh database for one case.
#[async_trait]
trait Bench: Tamper {
    /// A fresh, migrated database for `case`: its pool, its URL, and the options the CLI opens
    /// it with.
    async fn fresh(case: &str) -> (Self::Pool, String, OperatorOptions);
}

/// A database name for `case` that fits the servers' limits (63 and 64 characters).
fn database_name(case: &str) -> String {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    case.hash(&mut hasher);
    let readable: String = case.chars().take(36).collect();
    format!("if_cli_{readable}_{:08x}", hasher.finish() as u32)
}

/// The server at `DATABASE_URL` with `database` in place of its own.
fn postgres_url(database: &str) -> String {
    let base = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let (base, query) = match base.split_once('?') {
        Some((base, query)) => (base.to_owned(), format!("?{query}")),
        None => (base, String::new()),
    };
    let authority = base.find("://").map_or(0, |at| at + 3);
    let server = match base[authority..].find('/') {
        Some(slash) => &base[..authority + slash],
        None => &base,
    };
    format!("{server}/{database}{query}")
}

#[async_trait]
impl Bench for PgStore {
    async fn fresh(case: &str) -> (sqlx::PgPool, String, OperatorOptions) {
        let database = database_name(case);
        let mut server = sqlx::PgConnection::connect(&postgres_url("postgres"))
            .await
            .unwrap();
        server
            .execute(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
            )))
            .await
            .unwrap();
        server
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .await
            .unwrap();
        let url = postgres_url(&database);
        let pool = sqlx::PgPool::connect(&url).await.unwrap();
        idemflow_pg::migrate(&pool).await.unwrap();
        (pool, url, OperatorOptions::default())
    }
}

#[async_trait]
impl Bench for SqliteStore {
    async fn fresh(case: &str) -> (sqlx::SqlitePool, String, OperatorOptions) {
        let directory = std::env::temp_dir().join(format!("idemflow-cli-{case}"));
        let _ = std::fs::remove_dir_all(&directory);
        std::fs::create_dir_all(&directory).unwrap();
        let path = directory.join("idemflow.db");
        let options = idemflow_sqlite::OpenOptions::default();
        let pool = idemflow_sqlite::open_file(&path, &options).await.unwrap();
        (
            pool,
            format!("sqlite://{}", path.display()),
            OperatorOptions::default(),
        )
    }
}

#[async_trait]
impl Bench for MySqlStore {
    async fn fresh(case: &str) -> (sqlx::MySqlPool, String, OperatorOptions) {
        let server = std::env::var("MARIADB_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
        let database = database_name(case);
        let mut admin = sqlx::MySqlConnection::connect(&server).await.unwrap();
        admin
            .execute(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS `{database}`"
            )))
            .await
            .unwrap();
        admin
            .execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{database}`")))
            .await
            .unwrap();
        let (host, _) = server.rsplit_once('/').unwrap();
        let url = format!("{host}/{database}");
        let options = idemflow_mysql::OpenOptions::default();
        let pool = idemflow_mysql::open(&url, &options).await.unwrap();
        (pool, url, OperatorOptions::default())
    }
}

#[async_trait]
impl Bench for RedisStore {
    /// Keys under a prefix of the case's own, emptied first.
    async fn fresh(case: &str) -> (RedisPool, String, OperatorOptions) {
        let url =
            std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned());
        let prefix = format!("idemflow-cli-test:{case}");
        let pool = RedisPool::connect_with_prefix(&url, &prefix)
            .await
            .unwrap_or_else(|error| panic!("no Redis at {url} ({error})"));
        let stale: Vec<String> = idemflow_redis::redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(&mut pool.connection())
            .await
            .unwrap();
        if !stale.is_empty() {
            let _: () = idemflow_redis::redis::cmd("DEL")
                .arg(&stale)
                .query_async(&mut pool.connection())
                .await
                .unwrap();
        }
        (
            pool,
            url,
            OperatorOptions::default().with_key_prefix(Some(prefix)),
        )
    }
}

/// One test per case and engine.
macro_rules! engines {
    ($($case:ident),* $(,)?) => {
        $(
            mod $case {
                #[tokio::test]
                async fn postgres() {
                    super::$case::<idemflow_pg::PgStore>(concat!("pg_", stringify!($case))).await;
                }

                #[tokio::test]
                async fn sqlite() {
                    super::$case::<idemflow_sqlite::SqliteStore>(stringify!($case)).await;
                }

                #[tokio::test]
                async fn mariadb() {
                    super::$case::<idemflow_mysql::MySqlStore>(stringify!($case)).await;
                }

                #[tokio::test]
                async fn redis() {
                    super::$case::<idemflow_redis::RedisStore>(stringify!($case)).await;
                }
            }
        )*
    };
}

engines!(
    migrate_then_expire_deletes_only_finished_keys_past_their_window,
    inspect_list_stats_and_end_lease_answer_alike,
    inspect_shows_the_stored_bodies_and_the_time_left_before_expiry,
    the_console_serves_read_only_and_only_on_loopback_without_a_password,
);

/// Runs `idemflow --database-url <url> <arguments>` in-process: (exit code, stdout, stderr).
async fn idemflow(
    url: &str,
    options: &OperatorOptions,
    arguments: &[&str],
) -> (u8, String, String) {
    let command_line = ["idemflow", "--database-url", url]
        .into_iter()
        .chain(arguments.iter().copied());
    let output = idemflow_cli::run_with(command_line, ENGINES, options.clone()).await;
    (output.code, output.stdout, output.stderr)
}

fn tenant() -> TenantId {
    TenantId::new("t-1").unwrap()
}

const WORKFLOW: &str = "checkout@1";

/// Claims `key` (its lease `lease` long) with `request`: the claim's open transaction and owner.
async fn claim<E: Engine>(
    pool: &E::Pool,
    key: &str,
    request: &Value,
    lease: Duration,
) -> (E::Transaction, E::Owner) {
    let (tenant, key) = (tenant(), Key::parse(key).unwrap());
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let mut connection = pool.acquire().await.unwrap();
    let LookUp::Absent(ticket) = E::look_up(&mut connection, &tenant, &key).await.unwrap() else {
        panic!("{key:?} is new");
    };
    let claim = Claim {
        tenant: &tenant,
        key: &key,
        fingerprint: &fingerprint,
        workflow: WORKFLOW,
        request,
        lease,
    };
    match E::begin_claim(connection, claim, ticket, &Limits::default()).await {
        Ok(Claimed::Owned(transaction, owner)) => (transaction, owner),
        other => panic!("{key:?} was not claimed: {other:?}"),
    }
}

/// A started key, its lease `lease` long.
async fn started<E: Engine>(pool: &E::Pool, key: &str, lease: Duration) -> E::Owner {
    let (transaction, owner) = claim::<E>(pool, key, &json!({}), lease).await;
    E::commit_keeping(transaction).await.unwrap();
    owner
}

/// A done key with `request` and `response`: its body in the row, or apart when longer than
/// `apart_above` bytes.
async fn finished<E: Engine>(
    pool: &E::Pool,
    key: &str,
    request: &Value,
    response: &StoredResponse,
    apart_above: usize,
) {
    let (mut transaction, owner) = claim::<E>(pool, key, request, Duration::from_secs(30)).await;
    E::finish(&mut transaction, &owner, "complete", response, apart_above)
        .await
        .unwrap();
    E::commit_keeping(transaction).await.unwrap();
}

/// A done key with a two-byte body stored apart.
async fn done<E: Engine>(pool: &E::Pool, key: &str) {
    let response = StoredResponse::new(200, b"{}".to_vec());
    finished::<E>(pool, key, &json!({}), &response, 0).await;
}

fn document(stdout: &str) -> Value {
    serde_json::from_str(stdout).unwrap_or_else(|error| panic!("{error}: {stdout}"))
}

/// The keys a `--json stats` counts in `state`, whatever workflow it counts them under (Redis
/// keeps no workflow for finished keys: `*`).
fn counted(stats: &Value, state: &str) -> i64 {
    stats["counts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|count| count["state"] == state)
        .map(|count| count["keys"].as_i64().unwrap())
        .sum()
}

/// `migrate` migrates (or says the engine has no schema), and `expire` deletes the keys finished
/// longer ago than its window, in batches, and nothing else: not a recent one, not a started one
/// whose lease ended long ago.
async fn migrate_then_expire_deletes_only_finished_keys_past_their_window<E: Bench>(case: &str) {
    let (pool, url, options) = E::fresh(case).await;
    let (code, stdout, stderr) = idemflow(&url, &options, &["migrate"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("create idempotency keys") || stdout.contains("nothing to migrate"),
        "{stdout}"
    );
    for key in ["old-1", "old-2", "old-3"] {
        done::<E>(&pool, key).await;
    }
    E::age_finished(&pool, 2 * DAY).await.unwrap();
    done::<E>(&pool, "recent").await;
    started::<E>(&pool, "started", Duration::ZERO).await;
    E::lapse_leases(&pool, None).await.unwrap();

    let (code, stdout, stderr) = idemflow(
        &url,
        &options,
        &[
            "--json",
            "expire",
            "--older-than",
            "1d",
            "--batch-size",
            "2",
        ],
    )
    .await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(document(&stdout)["deleted"], 3, "{stdout}");
    let operator = E::operator(&pool);
    for (key, kept) in [
        ("old-1", false),
        ("old-3", false),
        ("recent", true),
        ("started", true),
    ] {
        let report = operator.key_report("t-1", key).await.unwrap();
        assert_eq!(report.is_some(), kept, "{key}");
    }
    let (code, _, stderr) = idemflow(
        &url,
        &options,
        &["expire", "--older-than", "1d", "--batch-size", "0"],
    )
    .await;
    assert_eq!(code, 2, "{stderr}");
}

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// The operator's commands answer alike on every engine: a lapsed key is listed as stuck and
/// counted in the resumer's lag, a key is inspected with its journal, a missing one exits 1, a
/// live lease is not ended without `--force`, an ended one advances the fence and is due at
/// once, and the partitioned layout's commands answer with a usage error outside it.
async fn inspect_list_stats_and_end_lease_answer_alike<E: Bench>(case: &str) {
    let (pool, url, options) = E::fresh(case).await;
    let lapsed = started::<E>(&pool, "lapsed", Duration::ZERO).await;
    E::postpone_alone(&pool, &lapsed, Duration::ZERO, &"provider: 503".into())
        .await
        .unwrap();
    E::lapse_leases(&pool, Some(("t-1", "lapsed")))
        .await
        .unwrap();
    started::<E>(&pool, "live", Duration::from_secs(3600)).await;
    done::<E>(&pool, "done").await;

    let (code, stdout, stderr) = idemflow(&url, &options, &["--json", "list", "--stuck"]).await;
    assert_eq!(code, 0, "{stderr}");
    let listed = document(&stdout);
    let keys: Vec<&str> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|key| key["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["lapsed"], "{listed}");
    assert_eq!(listed[0]["last_error"], "provider: 503", "{listed}");

    let (code, stdout, stderr) = idemflow(&url, &options, &["--json", "stats"]).await;
    assert_eq!(code, 0, "{stderr}");
    let stats = document(&stdout);
    assert_eq!(
        (counted(&stats, "started"), counted(&stats, "done")),
        (2, 1),
        "{stats}"
    );
    let lag = stats["resumer_lag_ms"].as_i64().unwrap();
    assert!(
        (86_000_000..87_000_000).contains(&lag),
        "the lapsed key's lease ended a day ago: {lag}"
    );

    let (code, stdout, stderr) = idemflow(
        &url,
        &options,
        &["--json", "inspect", "--tenant", "t-1", "--key", "done"],
    )
    .await;
    assert_eq!(code, 0, "{stderr}");
    let report = document(&stdout);
    assert_eq!(report["state"], "done", "{report}");
    assert_eq!(report["response_status"], 200);
    assert_eq!(report["response_bytes"], 2, "the body apart is counted");
    assert_eq!(report["fingerprint_hex"], "01".repeat(32));
    let events: Vec<&str> = report["journal"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["event"].as_str().unwrap())
        .collect();
    assert_eq!(events, ["claimed", "finished"], "{report}");

    let missing = ["inspect", "--tenant", "t-1", "--key", "nope"];
    assert_eq!(idemflow(&url, &options, &missing).await.0, 1);

    let end_lease = ["--json", "end-lease", "--tenant", "t-1", "--key", "live"];
    let (code, stdout, _) = idemflow(&url, &options, &end_lease).await;
    assert_eq!(
        code, 1,
        "a live lease is not ended without --force: {stdout}"
    );
    let operator = E::operator(&pool);
    let before = operator.key_report("t-1", "live").await.unwrap().unwrap();
    let (code, stdout, stderr) =
        idemflow(&url, &options, &[&end_lease[..], &["--force"]].concat()).await;
    assert_eq!(code, 0, "{stderr}");
    let ended = document(&stdout);
    assert_eq!(ended["outcome"], "ended", "{ended}");
    let after = operator.key_report("t-1", "live").await.unwrap().unwrap();
    assert_ne!(
        after.lock_version, before.lock_version,
        "the fence advanced"
    );
    assert_eq!(ended["new_lock_version"], after.lock_version);
    assert!(after.lease_left_ms.unwrap() <= 0, "due now: {after:?}");

    let (code, _, stderr) = idemflow(&url, &options, &["partitions", "list"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("not partitioned") || stderr.contains("no "),
        "{stderr}"
    );
}

/// `inspect --show-request --show-response` shows what is stored, alike on every engine: a body
/// in the row or apart, one that is not UTF-8 as base64, sealed values by their key only (never
/// opened); and the time left before retention deletes the key. `end-lease` of a due key names
/// the request's retry and a resumer both.
async fn inspect_shows_the_stored_bodies_and_the_time_left_before_expiry<E: Bench>(case: &str) {
    let (pool, url, options) = E::fresh(case).await;
    let response = StoredResponse::new(201, br#"{"order_id":41}"#.to_vec())
        .with_header("content-type", "application/json");
    let request = json!({"amount": 1200});
    finished::<E>(&pool, "in-row", &request, &response, 1 << 20).await;
    finished::<E>(&pool, "apart", &request, &response, 0).await;
    let binary = StoredResponse::new(200, vec![0xde, 0xad, 0xbe, 0xef]);
    finished::<E>(&pool, "binary", &json!({}), &binary, 1 << 20).await;
    // As the runner stores them sealed (crates/idemflow-runner/src/sealing.rs).
    let sealed = StoredResponse {
        status: 201,
        headers: vec![("idemflow:sealed".to_owned(), "2026-11".into())],
        body: b"\x02sealed-bytes".to_vec(),
    };
    let sealed_request = json!({"idemflow:sealed": "2026-12", "data": "AQID"});
    finished::<E>(&pool, "sealed", &sealed_request, &sealed, 1 << 20).await;
    // Finished an hour and a half ago (away from a unit's boundary, so the text does not
    // flicker); a lease that ended a day ago.
    E::age_finished(&pool, Duration::from_secs(90 * 60))
        .await
        .unwrap();
    started::<E>(&pool, "lapsed", Duration::ZERO).await;
    E::lapse_leases(&pool, Some(("t-1", "lapsed")))
        .await
        .unwrap();

    let show = async |key: &str, json: bool| {
        let mut arguments = vec![
            "inspect",
            "--tenant",
            "t-1",
            "--key",
            key,
            "--show-request",
            "--show-response",
            "--retention",
            "7d",
        ];
        if json {
            arguments.insert(0, "--json");
        }
        let (code, stdout, stderr) = idemflow(&url, &options, &arguments).await;
        assert_eq!((code, stderr.as_str()), (0, ""), "{stdout}");
        stdout
    };
    let stdout = show("in-row", false).await;
    assert!(
        stdout.ends_with(
            "\nexpiry          expires in ~6d 22h (finished 1h 30m ago; retention 7d 0h)\n\
             \nrequest\n{\n  \"amount\": 1200\n}\n\
             \nresponse 201, body 15 bytes\ncontent-type: application/json\n\n{\"order_id\":41}\n"
        ),
        "{stdout}"
    );
    let stdout = show("apart", false).await;
    assert!(
        stdout.ends_with(
            "\nresponse 201, body 15 bytes, stored apart\ncontent-type: application/json\n\
             \n{\"order_id\":41}\n"
        ),
        "{stdout}"
    );
    let apart = document(&show("apart", true).await);
    assert_eq!(apart["response"]["body_apart"], true, "{apart}");
    assert_eq!(apart["response"]["body"], r#"{"order_id":41}"#);
    assert_eq!(
        apart["response"]["headers"],
        json!([["content-type", "application/json"]])
    );
    assert_eq!(
        apart["request"],
        json!({"sealed_under": null, "json": request})
    );
    let finished = apart["finished_seconds_ago"].as_i64().unwrap();
    assert!((5400..5460).contains(&finished), "{apart}");
    assert_eq!(apart["retention_seconds"], 604_800);
    assert_eq!(apart["expires_in_seconds"], 604_800 - finished);

    let stdout = show("binary", false).await;
    assert!(
        stdout.ends_with("\nresponse 200, body 4 bytes, not UTF-8: shown as base64\n\n3q2+7w==\n"),
        "{stdout}"
    );
    let stdout = show("sealed", false).await;
    assert!(
        stdout.ends_with(
            "\nrequest\nsealed under key 2026-12 (not decrypted: this tool holds no keyring)\n\
             \nresponse 201, sealed under key 2026-11: headers and body (13 bytes), not \
             decrypted: this tool holds no keyring\n"
        ),
        "{stdout}"
    );
    assert!(!show("sealed", true).await.contains("AQID"));

    let stdout = show("lapsed", false).await;
    assert!(
        stdout.contains("\nexpiry          not expired while started\n"),
        "{stdout}"
    );
    assert!(
        stdout.ends_with("\nrequest\n{}\n\nresponse\n- (started: no response is stored yet)\n"),
        "{stdout}"
    );

    let end_lease = ["end-lease", "--tenant", "t-1", "--key", "lapsed"];
    let (code, stdout, stderr) = idemflow(&url, &options, &end_lease).await;
    assert_eq!((code, stderr.as_str()), (0, ""));
    assert_eq!(
        stdout,
        "nothing to end: the lease of key \"lapsed\" of tenant \"t-1\" expired 1d 0h ago; it is \
         due now: the next retry of the request takes it over, or a resumer that runs workflow \
         \"checkout@1\" (none runs a live-only workflow, such as a plain-handler route's: its \
         keys wait for that retry)\n"
    );
}

/// One HTTP/1.1 exchange on a fresh connection: the status and the body.
async fn http(address: &str, request: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    let status = answer[9..12].parse().unwrap();
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned());
    (status, body.unwrap_or_default())
}

/// `idemflow console --read-only`: the overview and a key's page, an action refused by the
/// server (and the key still there); and no console beyond loopback without a password.
async fn the_console_serves_read_only_and_only_on_loopback_without_a_password<E: Bench>(
    case: &str,
) {
    let (pool, url, options) = E::fresh(case).await;
    done::<E>(&pool, "k-1").await;
    let report = E::operator(&pool)
        .key_report("t-1", "k-1")
        .await
        .unwrap()
        .unwrap();

    let (code, _, stderr) = idemflow(&url, &options, &["console", "--bind", "0.0.0.0:0"]).await;
    assert_ne!(code, 0);
    assert!(stderr.contains("IDEMFLOW_CONSOLE_PASSWORD"), "{stderr}");

    // A port free a moment ago: the console binds it itself.
    let address = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let console = tokio::spawn({
        let (url, options, address) = (url.clone(), options.clone(), address.clone());
        async move {
            idemflow(
                &url,
                &options,
                &["console", "--bind", &address, "--read-only"],
            )
            .await
        }
    });
    tokio::time::timeout(Duration::from_secs(30), async {
        while tokio::net::TcpStream::connect(&address).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap();
    let get =
        |path: &str| format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    let (status, overview) = http(&address, &get("/")).await;
    assert_eq!(status, 200, "{overview}");
    assert!(overview.contains("read-only"), "{overview}");
    let (status, page) = http(&address, &get("/key?tenant=t-1&key=k-1")).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(r#"id="actions-off""#) && page.contains("k-1"));
    let form = format!(
        "tenant=t-1&key=k-1&lock_version={}&state=done&confirmed=yes",
        report.lock_version
    );
    let post = format!(
        "POST /key/expire HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\
         Content-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{form}",
        form.len()
    );
    assert_eq!(http(&address, &post).await.0, 403);
    console.abort();
    let kept = E::operator(&pool).key_report("t-1", "k-1").await.unwrap();
    assert!(kept.is_some(), "the refused action deleted nothing");
}

/// A command on a SQLite path with no database creates nothing: a mistyped path is refused.
#[tokio::test]
async fn a_command_on_a_sqlite_path_with_no_database_creates_nothing() {
    let directory = std::env::temp_dir().join("idemflow-cli-typo");
    let _ = std::fs::remove_dir_all(&directory);
    std::fs::create_dir_all(&directory).unwrap();
    let path = directory.join("idemflow.db");
    let url = format!("sqlite://{}", path.display());
    let options = OperatorOptions::default();
    let (code, _, stderr) = idemflow(&url, &options, &["expire", "--older-than", "1d"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no SQLite database at"), "{stderr}");
    assert!(!path.exists());
}

/// A URL of a scheme no engine of the build has is a usage error naming those it has.
#[tokio::test]
async fn a_url_of_no_engine_is_refused_naming_the_engines_there_are() {
    let options = OperatorOptions::default();
    let (code, _, stderr) = idemflow("mongodb://localhost/keys", &options, &["stats"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("postgres://") && stderr.contains("redis://"),
        "{stderr}"
    );
}
