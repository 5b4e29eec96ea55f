//! What is stored: a workflow's redaction keeps a card number out of every column of the keys
//! table, whatever crashes, and a keyring seals what is stored so a dump of the table shows no
//! request, output or response, opens a value only where it was sealed, and rotates.

use idemflow::PgStore;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use idemflow::{
    CrashHook, CrashPoint, DerivedKey, ForeignPhase, Key, Keyring, LocalPhase, Outcome,
    PhaseContext, PhaseError, Registry, Resumer, RetryPolicy, RunError, Runner, RunnerConfig,
    SealError, StoredResponse, Workflow,
};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};

use crate::support::{expire_all_leases, patient, request, tenant};

/// The marker: a test card number, searched for in every column.
const CARD: &str = "4242424242424242";
const MASKED: &str = "************4242";
const OTHER_CARD: &str = "5555555555554444";

#[derive(Debug, Serialize, Deserialize)]
struct Payment {
    amount: i64,
    card: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Vaulted {
    token: String,
    amount: i64,
}

#[derive(Debug, Serialize, Deserialize)]
struct Charged {
    charge_id: String,
    token: String,
    amount: i64,
}

/// What the test's phases saw and did.
#[derive(Debug, Default)]
struct Shop {
    /// The card each run of the vault phase was given.
    cards_seen: Mutex<Vec<String>>,
    /// Fails the vault's next run (retryable).
    fail_vault: AtomicBool,
    /// Calls of the charge phase.
    charges: AtomicUsize,
}

/// Keeps the card in the application's vault and passes a token on: the card is needed until
/// this phase completes, and never after.
struct VaultCard(Arc<Shop>);

#[async_trait::async_trait]
impl LocalPhase<PgStore> for VaultCard {
    const NAME: &'static str = "vault";
    type Input = Payment;
    type Output = Vaulted;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        payment: Payment,
        context: &PhaseContext,
    ) -> Result<Vaulted, PhaseError> {
        self.0.cards_seen.lock().unwrap().push(payment.card.clone());
        if self.0.fail_vault.swap(false, Ordering::SeqCst) {
            return Err(PhaseError::retryable("the vault is down"));
        }
        if payment.card.contains('*') {
            // Run again from the stored (redacted) request: the card is gone, as documented.
            return Err(PhaseError::terminal_with(
                StoredResponse::problem(
                    422,
                    &serde_json::json!({
                        "status": 422,
                        "code": "card_details_not_kept",
                        "detail": "send the payment again, with the card, under a new key",
                    }),
                ),
                "the card was redacted before the vault kept it",
            ));
        }
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO vault (tenant, key, card) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(context.tenant.as_str())
        .bind(context.key.as_str())
        .bind(&payment.card)
        .fetch_one(&mut *connection)
        .await?;
        Ok(Vaulted {
            token: format!("tok_{id}"),
            amount: payment.amount,
        })
    }
}

struct ChargeToken(Arc<Shop>);

#[async_trait::async_trait]
impl ForeignPhase for ChargeToken {
    const NAME: &'static str = "charge";
    type Input = Vaulted;
    type Output = Charged;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        vaulted: Vaulted,
        _: &PhaseContext,
    ) -> Result<Charged, PhaseError> {
        self.0.charges.fetch_add(1, Ordering::SeqCst);
        Ok(Charged {
            charge_id: format!("ch_{key}"),
            token: vaulted.token,
            amount: vaulted.amount,
        })
    }
}

/// Answers with the card read back from the vault, in the body and in a header: what the
/// response redaction masks.
struct Receipt;

#[async_trait::async_trait]
impl LocalPhase<PgStore> for Receipt {
    const NAME: &'static str = "receipt";
    type Input = Charged;
    type Output = StoredResponse;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        charged: Charged,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        let id: i64 = charged.token.trim_start_matches("tok_").parse()?;
        let (card,): (String,) = sqlx::query_as("SELECT card FROM vault WHERE id = $1")
            .bind(id)
            .fetch_one(&mut *connection)
            .await?;
        let body = serde_json::json!({
            "charge_id": charged.charge_id, "amount": charged.amount, "card": card,
        });
        Ok(StoredResponse::json(201, &body).with_header("x-card-number", card))
    }
}

/// Every run of 13 to 19 digits but its last four replaced by `*`.
fn mask_pans(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if (13..=19).contains(&digits.len()) {
            out.push_str(&"*".repeat(digits.len() - 4));
            out.push_str(&digits[digits.len() - 4..]);
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for character in text.chars() {
        if character.is_ascii_digit() {
            digits.push(character);
        } else {
            flush(&mut digits, &mut out);
            out.push(character);
        }
    }
    flush(&mut digits, &mut out);
    out
}

fn mask_response(response: &mut StoredResponse) {
    if let Ok(text) = std::str::from_utf8(&response.body) {
        response.body = mask_pans(text).into_bytes();
    }
    for (_, value) in &mut response.headers {
        if let Some(text) = value.to_str() {
            *value = mask_pans(text).into();
        }
    }
}

/// vault (local) → charge (foreign) → receipt (local); with the redactions or without.
fn payments(shop: &Arc<Shop>, redacting: bool) -> Workflow<PgStore> {
    let builder = Workflow::builder::<Payment>("payments.v1");
    let builder = if redacting {
        builder.redact_request(|payment| payment.card = mask_pans(&payment.card))
    } else {
        builder
    };
    let builder = builder
        .local(VaultCard(shop.clone()))
        .foreign(ChargeToken(shop.clone()))
        .local(Receipt);
    let builder = if redacting {
        builder.redact_response(mask_response)
    } else {
        builder
    };
    builder.build().unwrap()
}

async fn create_vault(pool: &PgPool) {
    sqlx::query(
        "CREATE TABLE vault (id bigserial PRIMARY KEY, tenant text NOT NULL, key text NOT NULL, \
         card text NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

fn payment(amount: i64, card: &str) -> Vec<u8> {
    format!(r#"{{"amount": {amount}, "card": "{card}"}}"#).into_bytes()
}

async fn pay(
    runner: &Runner<PgStore>,
    workflow: &Workflow<PgStore>,
    key: &str,
    body: &[u8],
) -> Result<Outcome, RunError> {
    let key = Key::parse(key).unwrap();
    runner.run(workflow, &tenant(1), &key, request(body)).await
}

/// Stops every run at one crash point, as a crash would.
#[derive(Debug)]
struct CrashAt(&'static str);

#[async_trait::async_trait]
impl CrashHook for CrashAt {
    async fn crash_at(&self, point: &CrashPoint, _: &idemflow::TenantId, _: &Key) -> bool {
        point.to_string() == self.0
    }
}

fn sealing(pool: &PgPool, keyring: Option<Keyring>) -> Runner<PgStore> {
    Runner::with_config(pool.clone(), RunnerConfig::default().with_keyring(keyring))
}

fn keyring(id: &str, byte: u8) -> Keyring {
    Keyring::new(id, [byte; 32]).unwrap()
}

async fn drain(runner: Runner<PgStore>, workflow: Workflow<PgStore>) -> idemflow::DrainReport {
    let mut registry = Registry::new();
    registry.register(workflow).unwrap();
    Resumer::new(runner, registry).drain().await.unwrap()
}

/// Asserts that no column of any row of the keys table holds `marker`: as text (the `LIKE` over
/// each row as text, and its jsonb), as bytes (bytea columns show as hex) or in base64 (bytes
/// inside JSON), at any alignment.
async fn assert_nowhere(pool: &PgPool, marker: &str) {
    let like: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys k WHERE k::text LIKE '%' || $1 || '%'",
    )
    .bind(marker)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(like, 0, "a row holds {marker} as text");
    let hex: String = marker.bytes().map(|byte| format!("{byte:02x}")).collect();
    let mut forms = vec![marker.to_owned(), hex];
    for skip in 0..3 {
        let rest = &marker.as_bytes()[skip..];
        forms.push(STANDARD.encode(&rest[..rest.len() / 3 * 3]));
    }
    let rows: Vec<String> = sqlx::query_scalar("SELECT k::text FROM idempotency_keys k")
        .fetch_all(pool)
        .await
        .unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        for form in &forms {
            assert!(
                !row.contains(form.as_str()),
                "{form} (for {marker}) in {row}"
            );
        }
    }
}

fn replayed(outcome: Result<Outcome, RunError>) -> StoredResponse {
    match outcome {
        Ok(Outcome::Replayed(response)) => response,
        other => panic!("expected a replay, got {other:?}"),
    }
}

fn header<'r>(response: &'r StoredResponse, name: &str) -> Option<&'r str> {
    response
        .headers
        .iter()
        .find(|(header, _)| header == name)
        .and_then(|(_, value)| value.to_str())
}

fn assert_masked(response: &StoredResponse) {
    let body = String::from_utf8(response.body.clone()).unwrap();
    assert!(!body.contains(CARD) && body.contains(MASKED), "{body}");
    assert_eq!(header(response, "x-card-number"), Some(MASKED));
}

/// The issue's test: a card number in a request, redacted by the workflow, reaches no column,
/// on the first answer, after a crash mid-way finished by a resumer, and on every replay; the
/// replay is the first answer, masked; the fingerprint still tells another card apart.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_redacted_card_reaches_no_column_whatever_crashes(pool: PgPool) {
    create_vault(&pool).await;
    let shop = Arc::new(Shop::default());
    let workflow = payments(&shop, true);
    let runner = Runner::new(pool.clone());
    let body = payment(2500, CARD);

    // Answered live: the answer is the stored response, masked, and a retry gets the same bytes.
    let executed = match pay(&runner, &workflow, "live", &body).await {
        Ok(Outcome::Executed(response)) => response,
        other => panic!("expected Executed, got {other:?}"),
    };
    assert_masked(&executed);
    assert_eq!(
        replayed(pay(&runner, &workflow, "live", &body).await),
        executed
    );

    // Crashed after the charge, before its result was recorded: the row holds the request and
    // the vault's token (the recovery point), neither of them the card.
    let crashing =
        Runner::new(pool.clone()).with_crash_hook(Arc::new(CrashAt("after_call:charge")));
    let crashed = pay(&crashing, &workflow, "crashed", &body).await;
    assert!(matches!(crashed, Err(RunError::Crashed(_))), "{crashed:?}");
    let stored: (String, String, String) = sqlx::query_as(
        "SELECT state, recovery_point, request->>'card' FROM idempotency_keys WHERE key = 'crashed'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(stored, ("started".into(), "vault".into(), MASKED.into()));
    assert_nowhere(&pool, CARD).await;

    expire_all_leases(&pool).await;
    let report = drain(Runner::new(pool.clone()), workflow).await;
    assert_eq!((report.taken, report.finished), (1, 1), "{report:?}");
    let workflow = payments(&shop, true);
    let response = replayed(pay(&runner, &workflow, "crashed", &body).await);
    assert_eq!(response.status, 201);
    assert_masked(&response);
    // The fingerprint is over the request as sent: another card under the key is a mismatch.
    assert!(matches!(
        pay(&runner, &workflow, "crashed", &payment(2500, OTHER_CARD)).await,
        Ok(Outcome::Mismatch)
    ));
    assert_nowhere(&pool, CARD).await;

    // The phases of the first attempts had the card (the vault, the application's own table,
    // keeps it); the resumer went on from the token and never needed it.
    assert_eq!(*shop.cards_seen.lock().unwrap(), [CARD, CARD]);
    let vaulted: i64 = sqlx::query_scalar("SELECT count(*) FROM vault WHERE card = $1")
        .bind(CARD)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(vaulted, 2);
}

/// A phase run again from the start (its first attempt failed before it completed) gets the
/// stored request, redacted: the documented price of redaction, and what the phase answers.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_phase_run_again_from_the_start_gets_the_redacted_request(pool: PgPool) {
    create_vault(&pool).await;
    let shop = Arc::new(Shop::default());
    let workflow = payments(&shop, true);
    let runner = Runner::new(pool.clone());
    let body = payment(900, CARD);
    shop.fail_vault.store(true, Ordering::SeqCst);

    let interrupted = pay(&runner, &workflow, "k", &body).await;
    assert!(
        matches!(interrupted, Ok(Outcome::Interrupted { .. })),
        "{interrupted:?}"
    );
    assert_nowhere(&pool, CARD).await;

    expire_all_leases(&pool).await;
    let report = drain(Runner::new(pool.clone()), payments(&shop, true)).await;
    assert_eq!(report.finished, 1, "{report:?}");
    assert_eq!(*shop.cards_seen.lock().unwrap(), [CARD, MASKED]);
    let response = replayed(pay(&runner, &workflow, "k", &body).await);
    assert_eq!(response.status, 422);
    assert_eq!(shop.charges.load(Ordering::SeqCst), 0);
    assert_nowhere(&pool, CARD).await;
}

/// (the request's key id, the response's key id) of a key.
async fn sealed_with(pool: &PgPool, key: &str) -> (Option<String>, Option<String>) {
    sqlx::query_as(
        "SELECT request->>'idemflow:sealed', \
                CASE WHEN response_headers->0->>0 = 'idemflow:sealed' THEN response_headers->0->>1 END \
         FROM idempotency_keys WHERE key = $1",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// With a keyring, a dump of the table shows no request, phase output or response body (here
/// unredacted, so only the seal hides the card), while a replay returns the plaintext; a
/// runner without the key cannot read it, and says so.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn sealed_values_reveal_nothing_in_a_dump_and_replay_in_plaintext(pool: PgPool) {
    create_vault(&pool).await;
    let shop = Arc::new(Shop::default());
    let keys = keyring("k1", 1);
    let body = payment(2500, CARD);

    let crashing =
        sealing(&pool, Some(keys.clone())).with_crash_hook(Arc::new(CrashAt("after_call:charge")));
    let crashed = pay(&crashing, &payments(&shop, false), "k", &body).await;
    assert!(matches!(crashed, Err(RunError::Crashed(_))), "{crashed:?}");
    let output_key_id: Option<String> =
        sqlx::query_scalar("SELECT phase_output->>'idemflow:sealed' FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(output_key_id.as_deref(), Some("k1"));
    assert_nowhere(&pool, CARD).await;

    expire_all_leases(&pool).await;
    let report = drain(sealing(&pool, Some(keys.clone())), payments(&shop, false)).await;
    assert_eq!(report.finished, 1, "{report:?}");
    assert_eq!(
        sealed_with(&pool, "k").await,
        (Some("k1".into()), Some("k1".into()))
    );
    let (status, body_bytes): (i16, Vec<u8>) =
        sqlx::query_as("SELECT response_status, response_body FROM idempotency_keys")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(status, 201, "the status stays readable");
    assert!(
        !body_bytes
            .windows(CARD.len())
            .any(|window| window == CARD.as_bytes())
    );
    assert_nowhere(&pool, CARD).await;

    let workflow = payments(&shop, false);
    let response = replayed(pay(&sealing(&pool, Some(keys)), &workflow, "k", &body).await);
    assert_eq!(response.status, 201);
    assert!(String::from_utf8(response.body).unwrap().contains(CARD));
    assert_eq!(
        response.headers,
        [
            ("content-type".to_owned(), "application/json".into()),
            ("x-card-number".to_owned(), CARD.into())
        ]
    );
    let unkeyed = pay(&Runner::new(pool.clone()), &workflow, "k", &body).await;
    assert!(
        matches!(
            &unkeyed,
            Err(RunError::Sealing(SealError::UnknownKeyId { key_id, .. })) if key_id == "k1"
        ),
        "{unkeyed:?}"
    );
}

/// A ciphertext moved to another row does not open: the replay fails with the typed error, not
/// with the other row's response; a resumed key whose request and output were swapped with
/// another's records a failed attempt and runs nothing.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_ciphertext_moved_to_another_row_does_not_open(pool: PgPool) {
    create_vault(&pool).await;
    let shop = Arc::new(Shop::default());
    let workflow = payments(&shop, false);
    let runner = sealing(&pool, Some(keyring("k1", 1)));
    for (key, card) in [("a", CARD), ("b", OTHER_CARD)] {
        let outcome = pay(&runner, &workflow, key, &payment(100, card)).await;
        assert!(matches!(outcome, Ok(Outcome::Executed(_))), "{outcome:?}");
    }
    let swapped = sqlx::query(
        "UPDATE idempotency_keys k SET response_body = o.response_body \
         FROM idempotency_keys o WHERE k.key IN ('a', 'b') AND o.key IN ('a', 'b') AND o.key <> k.key",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(swapped.rows_affected(), 2);
    for (key, card) in [("a", CARD), ("b", OTHER_CARD)] {
        let replay = pay(&runner, &workflow, key, &payment(100, card)).await;
        assert!(
            matches!(
                &replay,
                Err(RunError::Sealing(SealError::NotAuthentic { what })) if what == "response"
            ),
            "{replay:?}"
        );
    }

    // Two keys left after their charge: their requests and recovery points swapped.
    let crashing = sealing(&pool, Some(keyring("k1", 1)))
        .with_crash_hook(Arc::new(CrashAt("after_call:charge")));
    for (key, card) in [("c", CARD), ("d", OTHER_CARD)] {
        let crashed = pay(&crashing, &workflow, key, &payment(100, card)).await;
        assert!(matches!(crashed, Err(RunError::Crashed(_))), "{crashed:?}");
    }
    let charges = shop.charges.load(Ordering::SeqCst);
    let swapped = sqlx::query(
        "UPDATE idempotency_keys k SET request = o.request, phase_output = o.phase_output \
         FROM idempotency_keys o WHERE k.key IN ('c', 'd') AND o.key IN ('c', 'd') AND o.key <> k.key",
    )
    .execute(&pool)
    .await
    .unwrap();
    assert_eq!(swapped.rows_affected(), 2);
    expire_all_leases(&pool).await;
    let report = drain(runner, payments(&shop, false)).await;
    assert_eq!((report.taken, report.interrupted), (2, 2), "{report:?}");
    assert_eq!(shop.charges.load(Ordering::SeqCst), charges, "nothing ran");
    let errors: Vec<(String, String)> = sqlx::query_as(
        "SELECT state, last_error FROM idempotency_keys WHERE key IN ('c', 'd') ORDER BY key",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    for (state, error) in errors {
        assert_eq!(state, "started");
        assert!(error.contains("request does not open"), "{error}");
    }
}

/// Rotation: rows sealed under k1 stay readable once k2 is current and k1 kept for reading; new
/// values are sealed under k2 (a key in flight across the rotation keeps its request under k1
/// and stores its response under k2); without k1, its rows fail with the typed unknown key id.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn rotation_keeps_old_rows_readable_and_seals_new_values_under_the_new_key(pool: PgPool) {
    create_vault(&pool).await;
    let shop = Arc::new(Shop::default());
    let workflow = payments(&shop, false);
    let body = payment(700, CARD);
    let before = sealing(&pool, Some(keyring("k1", 1)));
    let old = pay(&before, &workflow, "old", &body).await;
    assert!(matches!(old, Ok(Outcome::Executed(_))), "{old:?}");
    let crashing = before.with_crash_hook(Arc::new(CrashAt("after_call:charge")));
    let crashed = pay(&crashing, &workflow, "in-flight", &body).await;
    assert!(matches!(crashed, Err(RunError::Crashed(_))), "{crashed:?}");

    let rotated = Keyring::new("k2", [2; 32])
        .and_then(|keyring| keyring.with_old_key("k1", [1; 32]))
        .unwrap();
    let after = sealing(&pool, Some(rotated));
    let response = replayed(pay(&after, &workflow, "old", &body).await);
    assert!(String::from_utf8(response.body).unwrap().contains(CARD));
    expire_all_leases(&pool).await;
    let report = drain(after.clone(), payments(&shop, false)).await;
    assert_eq!(report.finished, 1, "{report:?}");
    let new = pay(&after, &workflow, "new", &body).await;
    assert!(matches!(new, Ok(Outcome::Executed(_))), "{new:?}");
    assert_eq!(
        sealed_with(&pool, "old").await,
        (Some("k1".into()), Some("k1".into()))
    );
    assert_eq!(
        sealed_with(&pool, "in-flight").await,
        (Some("k1".into()), Some("k2".into()))
    );
    assert_eq!(
        sealed_with(&pool, "new").await,
        (Some("k2".into()), Some("k2".into()))
    );

    // k1 removed: its rows fail with the typed error, the others replay.
    let only_new = sealing(&pool, Some(keyring("k2", 2)));
    let old = pay(&only_new, &workflow, "old", &body).await;
    assert!(
        matches!(
            &old,
            Err(RunError::Sealing(SealError::UnknownKeyId { key_id, what })) if key_id == "k1" && what == "response"
        ),
        "{old:?}"
    );
    for key in ["in-flight", "new"] {
        let response = replayed(pay(&only_new, &workflow, key, &body).await);
        assert_eq!(response.status, 201);
    }
    assert_nowhere(&pool, CARD).await;
}
