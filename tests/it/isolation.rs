//! Tenant isolation: a tenant learns nothing about another tenant's keys. The same client key
//! under another tenant is a new key (it runs: never a replay of the other's response, a 409 or a
//! 422), a claim or takeover in flight of one tenant's key is invisible to the other's look-up
//! (the claim lock is a hash of tenant and key), and the operator CLI shows or touches a key only
//! for the tenant named on its command line.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idemflow::{Fingerprint, Key, Outcome, Runner, StoredResponse, TenantId};
use idemflow_pg::{self as store, ClaimRequest, Claimed, LookUp};
use idemflow_testkit::provider::{Fault, MockProvider};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use crate::roles::{PAYMENTS_TABLE, key_state, pay, payment_body, payments, rewind_lease};
use crate::support::example::database_url;

/// The `idemflow` CLI: this crate's binary (its `cli` feature, on in its tests), built with
/// every engine.
pub(crate) fn cli_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_idemflow"))
}

/// Runs the CLI with `DATABASE_URL` set to `url`: (exit code, stdout, stderr).
pub(crate) fn idemflow(binary: &Path, args: &[&str], url: &str) -> (i32, String, String) {
    let output = Command::new(binary)
        .args(args)
        .env("DATABASE_URL", url)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

fn response(outcome: &Outcome) -> StoredResponse {
    match outcome {
        Outcome::Executed(response) if response.status == 201 => response.clone(),
        other => panic!("expected a new key's run (Executed, 201), got {other:?}"),
    }
}

/// Every column of a tenant's rows, as text: to show they did not change.
async fn rows_of(pool: &PgPool, tenant: &TenantId) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT row_to_json(keys)::text FROM idempotency_keys AS keys WHERE tenant = $1 ORDER BY key",
    )
    .bind(tenant.as_str())
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn look_up(pool: &PgPool, tenant: &TenantId, key: &str) -> LookUp {
    let mut connection = pool.acquire().await.unwrap();
    store::look_up(&mut connection, tenant, &Key::parse(key).unwrap())
        .await
        .unwrap()
}

/// Tenant A holds key "k" done (with a response) and key "live" started under a live lease.
/// Tenant B sends both keys, with A's bodies and with others: each is a brand new key that runs
/// (201), then replays B's own response; A's rows are untouched, and the provider saw B's calls
/// under B's own derived keys.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_same_key_under_another_tenant_is_a_new_key(pool: PgPool) {
    sqlx::query(PAYMENTS_TABLE).execute(&pool).await.unwrap();
    let provider = MockProvider::start().await;
    let workflow = payments(&provider);
    let runner = Runner::new(pool.clone());
    let (a, b) = (
        TenantId::new("tenant-a").unwrap(),
        TenantId::new("tenant-b").unwrap(),
    );
    let a_body = payment_body(1200, "tok_visa");
    let other_body = payment_body(7, "tok_mastercard");

    let a_done = response(&pay(&runner, &workflow, &a, "k", &a_body).await);
    provider.push_fault(Fault::ServerError(503));
    let a_live = pay(&runner, &workflow, &a, "live", &a_body).await;
    assert!(matches!(a_live, Outcome::Interrupted { .. }), "{a_live:?}");
    // A's own duplicate is in progress, and A's other body a mismatch: those answers exist.
    assert!(matches!(
        pay(&runner, &workflow, &a, "live", &a_body).await,
        Outcome::InProgress { .. }
    ));
    assert_eq!(
        pay(&runner, &workflow, &a, "k", &other_body).await,
        Outcome::Mismatch
    );
    let a_rows = rows_of(&pool, &a).await;

    // B's look-ups see nothing of A's keys.
    for key in ["k", "live"] {
        assert!(matches!(
            look_up(&pool, &b, key).await,
            LookUp::Absent { .. }
        ));
    }
    // Done under A, with A's body: B runs it (not A's replay).
    let b_done = response(&pay(&runner, &workflow, &b, "k", &a_body).await);
    assert_ne!(b_done, a_done, "B got its own response, not A's");
    assert_eq!(
        pay(&runner, &workflow, &b, "k", &a_body).await,
        Outcome::Replayed(b_done)
    );
    // Started under A with a live lease, with another body: B runs it (not 409, not 422).
    let b_live = response(&pay(&runner, &workflow, &b, "live", &other_body).await);
    assert_eq!(
        pay(&runner, &workflow, &b, "live", &other_body).await,
        Outcome::Replayed(b_live)
    );
    // And A's body under a key B never used before, while A's "k" exists: new too.
    response(&pay(&runner, &workflow, &b, "k-2", &a_body).await);

    assert_eq!(rows_of(&pool, &a).await, a_rows, "A's keys are untouched");
    assert!(matches!(
        pay(&runner, &workflow, &a, "k", &a_body).await,
        Outcome::Replayed(response) if response == a_done
    ));
    let mut charged: Vec<String> = provider
        .charges()
        .into_iter()
        .map(|charge| charge.idempotency_key)
        .collect();
    charged.sort();
    assert_eq!(
        charged,
        [
            "tenant-a:k:charge",
            "tenant-b:k-2:charge",
            "tenant-b:k:charge",
            "tenant-b:live:charge"
        ]
    );
    provider.shutdown().await;
}

/// While A's claim of "k" is in flight (its transaction open, holding the claim lock), A's own
/// look-up of "k" says "being claimed" (409), and B's says absent: B's request runs at once. The
/// same for a takeover in flight: A's duplicate is in progress, B's key of the same name is taken
/// over and finished.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_or_takeover_in_flight_is_invisible_to_another_tenant(pool: PgPool) {
    sqlx::query(PAYMENTS_TABLE).execute(&pool).await.unwrap();
    let provider = MockProvider::start().await;
    let workflow = payments(&provider);
    let runner = Runner::new(pool.clone());
    let (a, b) = (
        TenantId::new("tenant-a").unwrap(),
        TenantId::new("tenant-b").unwrap(),
    );
    let body = payment_body(1200, "tok_visa");

    // A's claim of "k", held open.
    let key = Key::parse("k").unwrap();
    let fingerprint = Fingerprint::from_slice(&[1; 32]).unwrap();
    let input = json!({"amount": 1200, "source": "tok_visa"});
    let claim = ClaimRequest {
        tenant: &a,
        key: &key,
        lock_version: 1 << 40,
        fingerprint: &fingerprint,
        workflow: "payments.v1",
        request: &input,
        lease: Duration::from_secs(30),
    };
    let Claimed::Owned(held, _) =
        store::begin_claim(pool.acquire().await.unwrap(), &claim, &Default::default())
            .await
            .unwrap()
    else {
        panic!("A's key is new");
    };
    assert!(matches!(look_up(&pool, &a, "k").await, LookUp::Claiming));
    assert!(matches!(
        look_up(&pool, &b, "k").await,
        LookUp::Absent { .. }
    ));
    let b_run = tokio::time::timeout(
        Duration::from_secs(20),
        pay(&runner, &workflow, &b, "k", &body),
    )
    .await
    .expect("B's request waited on A's claim");
    response(&b_run);
    held.rollback().await.unwrap();
    assert!(matches!(
        look_up(&pool, &a, "k").await,
        LookUp::Absent { .. }
    ));

    // Both tenants' "t" left started with an expired lease.
    for tenant in [&a, &b] {
        provider.push_fault(Fault::ServerError(503));
        let left = pay(&runner, &workflow, tenant, "t", &body).await;
        assert!(matches!(left, Outcome::Interrupted { .. }), "{left:?}");
        rewind_lease(&pool, tenant, "t").await;
    }
    // A's takeover of "t", held open (its claim lock and row lock with it).
    let seen = key_state(&pool, &a, "t").await.unwrap().1;
    let mut taking = store::Transaction::begin(&pool).await.unwrap();
    store::take_over(
        &mut taking,
        &a,
        &Key::parse("t").unwrap(),
        seen,
        Duration::from_secs(30),
    )
    .await
    .unwrap()
    .expect("A's expired lease is taken over");
    let a_duplicate = tokio::time::timeout(
        Duration::from_secs(20),
        pay(&runner, &workflow, &a, "t", &body),
    )
    .await
    .expect("A's duplicate waited on A's takeover");
    assert!(
        matches!(a_duplicate, Outcome::InProgress { .. }),
        "{a_duplicate:?}"
    );
    let b_run = tokio::time::timeout(
        Duration::from_secs(20),
        pay(&runner, &workflow, &b, "t", &body),
    )
    .await
    .expect("B's request waited on A's takeover");
    response(&b_run);
    taking.rollback().await.unwrap();
    provider.shutdown().await;
}

/// The CLI's commands that read or change one key need `--tenant`: without it the argument
/// parser refuses (before connecting), with an empty or wildcard-looking one the tenant id's
/// validation does, and neither prints anything of any key; naming another tenant finds nothing.
/// Only the key's own tenant sees it.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_cli_shows_or_ends_a_key_only_for_the_tenant_named(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let pool = options.connect_with(connect.clone()).await.unwrap();
    sqlx::query(PAYMENTS_TABLE).execute(&pool).await.unwrap();
    let provider = MockProvider::start().await;
    let workflow = payments(&provider);
    let runner = Runner::new(pool.clone());
    let a = TenantId::new("tenant-a").unwrap();
    let body = payment_body(1200, "tok_visa");
    response(&pay(&runner, &workflow, &a, "k", &body).await);
    provider.push_fault(Fault::ServerError(503));
    let live = pay(&runner, &workflow, &a, "live", &body).await;
    assert!(matches!(live, Outcome::Interrupted { .. }), "{live:?}");
    let live_before = key_state(&pool, &a, "live").await.unwrap();
    let fingerprint: String = sqlx::query_scalar(
        "SELECT encode(fingerprint, 'hex') FROM idempotency_keys WHERE key = 'k'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();

    let binary = tokio::task::spawn_blocking(cli_binary).await.unwrap();
    let url = database_url(&connect);
    let shows_nothing = |args: &[&str], stdout: &str, stderr: &str| {
        for secret in [fingerprint.as_str(), "tenant-a", "payments.v1"] {
            assert!(
                !stdout.contains(secret) && !stderr.contains(secret),
                "{args:?} showed {secret}: {stdout}{stderr}"
            );
        }
    };

    // No tenant: a usage error (exit 2) from the argument parser, naming the missing option.
    for args in [
        &["inspect", "--key", "k"][..],
        &["--json", "inspect", "--key", "k"],
        &["end-lease", "--key", "live"],
        &["release", "--key", "live"],
    ] {
        let (code, stdout, stderr) = idemflow(&binary, args, &url);
        assert_eq!(code, 2, "{args:?}: {stdout}{stderr}");
        assert!(stdout.is_empty(), "{args:?}: {stdout}");
        assert!(stderr.contains("--tenant"), "{args:?}: {stderr}");
        shows_nothing(args, &stdout, &stderr);
    }
    // An empty tenant, or one that looks like a pattern: refused as not a tenant id (exit 2).
    for tenant in ["", "%", "*", "tenant-%"] {
        let args = ["inspect", "--tenant", tenant, "--key", "k"];
        let (code, stdout, stderr) = idemflow(&binary, &args, &url);
        assert_eq!(code, 2, "{args:?}: {stdout}{stderr}");
        assert!(stderr.starts_with("error: the tenant id "), "{stderr}");
        shows_nothing(&args, &stdout, &stderr);
    }
    // Another tenant: no such key (exit 1), and A's lease is not ended.
    let args = ["inspect", "--tenant", "tenant-b", "--key", "k"];
    let (code, stdout, stderr) = idemflow(&binary, &args, &url);
    assert_eq!(
        (code, stdout.as_str(), stderr.as_str()),
        (1, "", "error: no key \"k\" for tenant \"tenant-b\"\n")
    );
    let args = [
        "end-lease",
        "--tenant",
        "tenant-b",
        "--key",
        "live",
        "--force",
    ];
    let (code, stdout, stderr) = idemflow(&binary, &args, &url);
    assert_eq!(
        (code, stdout.as_str()),
        (
            1,
            "lease not ended: no key \"live\" for tenant \"tenant-b\"\n"
        ),
        "{stderr}"
    );
    assert_eq!(
        key_state(&pool, &a, "live").await.unwrap(),
        live_before,
        "A's lease is untouched"
    );
    // Its own tenant sees it.
    let args = ["inspect", "--tenant", "tenant-a", "--key", "k"];
    let (code, stdout, stderr) = idemflow(&binary, &args, &url);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains(&fingerprint), "{stdout}");
    provider.shutdown().await;
}
