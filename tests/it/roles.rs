//! Least privilege: migrations run as an owner role; the services and workers run as a runtime
//! role holding only what `scripts/sql/grants.sql` grants (that very file, as
//! docs/operations.md tells operators to run it). Every statement the engine sends must work as
//! the runtime role, and nothing that changes the schema may.
//!
//! Roles are cluster-wide: each test creates its own, with a random suffix (and a random
//! password, so the tests also run where the server asks for one), makes its owner role the owner
//! of the test's database, and drops them at the end, whatever happened in between.

use idemflow::PgStore;
use std::future::Future;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use idemflow::{
    DerivedKey, DrainReport, ForeignPhase, Key, LocalPhase, Outcome, PhaseContext, PhaseError,
    Registry, Resumer, ResumerConfig, Retention, RetryPolicy, Runner, RunnerConfig, StoredResponse,
    TenantId, TerminalPolicy, Workflow,
};
use idemflow_pg::{self as store, ClaimRequest, Claimed, Limits, LookUp};
use idemflow_testkit::provider::{Fault, MockProvider};
use idemflow_testkit::provider_client::{ChargeResult, ProviderClient};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgConnection, PgPool};

use crate::claim::{logged_lines, lose_a_race};
use crate::support::{patient, request};
use idemflow_testrig::server_log::ServerLog;

/// The grants, as operators run them: `psql -v runtime_role=... -f scripts/sql/grants.sql`.
pub(crate) const GRANTS_FILE: &str = "scripts/sql/grants.sql";

/// What the runtime role holds once the grants file ran: (object, privilege), sorted. Everything
/// else in the database it may not touch. `database` CONNECT is every role's by PostgreSQL's
/// defaults (granted to PUBLIC), not the file's; TEMPORARY, PUBLIC's too by default, the file takes
/// away.
pub(crate) const RUNTIME_PRIVILEGES: &[(&str, &str)] = &[
    ("database", "CONNECT"),
    (
        "function idemflow_claim(bigint,text,text,bytea,text,jsonb,bigint,bigint)",
        "EXECUTE",
    ),
    ("idempotency_keys", "DELETE"),
    ("idempotency_keys", "INSERT"),
    ("idempotency_keys", "SELECT"),
    ("idempotency_keys", "UPDATE"),
    ("idempotency_keys_fence", "USAGE"),
    ("idempotency_responses", "DELETE"),
    ("idempotency_responses", "INSERT"),
    ("idempotency_responses", "SELECT"),
    ("idempotency_responses", "UPDATE"),
    ("processed_messages", "DELETE"),
    ("processed_messages", "INSERT"),
    ("processed_messages", "SELECT"),
    ("processed_messages", "UPDATE"),
    ("schema public", "USAGE"),
];

// ---------------------------------------------------------------------------------------------
// The roles and the deployment of one test

/// A role of one test: its name (random suffix) and password.
#[derive(Debug, Clone)]
pub(crate) struct Role {
    pub name: String,
    pub password: String,
}

impl Role {
    /// `connect` (the test's database, as the superuser) as this role.
    pub fn options(&self, connect: &PgConnectOptions) -> PgConnectOptions {
        connect
            .clone()
            .username(&self.name)
            .password(&self.password)
    }

    /// A pool of connections as this role.
    pub async fn pool(&self, connect: &PgConnectOptions) -> PgPool {
        PgPoolOptions::new()
            .max_connections(8)
            .test_before_acquire(false)
            .connect_with(self.options(connect))
            .await
            .unwrap()
    }

    /// A URL to the test's database as this role, for the CLI and psql; `options` is a libpq
    /// `options` value (`-c role=...`), percent-encoded here.
    pub fn url(&self, connect: &PgConnectOptions, options: Option<&str>) -> String {
        let mut url = format!(
            "postgres://{}:{}@{}:{}/{}",
            self.name,
            self.password,
            connect.get_host(),
            connect.get_port(),
            connect.get_database().unwrap()
        );
        if let Some(options) = options {
            url.push_str("?options=");
            url.push_str(
                &options
                    .replace('%', "%25")
                    .replace(' ', "%20")
                    .replace('=', "%3D"),
            );
        }
        url
    }
}

/// The roles of one test: `owner` owns the database and the schema objects (LOGIN, or NOLOGIN
/// with `deployer` a login that is a member of it), `runtime` is what services connect as.
#[derive(Debug, Clone)]
pub(crate) struct Roles {
    pub owner: Role,
    pub runtime: Role,
    pub deployer: Option<Role>,
}

/// A short random hex string, from the server (the tests have no random crate).
async fn random_hex(admin: &PgPool) -> String {
    sqlx::query_scalar("SELECT substr(md5(random()::text || clock_timestamp()::text), 1, 12)")
        .fetch_one(admin)
        .await
        .unwrap()
}

impl Roles {
    /// Creates the roles and makes the owner the owner of the test's database (so of its
    /// `public` schema too), as docs/operations.md's administrator step does.
    pub async fn create(admin: &PgPool, owner_logs_in: bool) -> Self {
        let suffix = random_hex(admin).await;
        let role = |what: &str, password: String| Role {
            name: format!("idemflow_it_{what}_{suffix}"),
            password,
        };
        let roles = Roles {
            owner: role("owner", random_hex(admin).await),
            runtime: role("runtime", random_hex(admin).await),
            deployer: if owner_logs_in {
                None
            } else {
                Some(role("deployer", random_hex(admin).await))
            },
        };
        let login = if owner_logs_in { "LOGIN" } else { "NOLOGIN" };
        let mut statements = vec![
            format!(
                "CREATE ROLE \"{}\" {login} PASSWORD '{}'",
                roles.owner.name, roles.owner.password
            ),
            format!(
                "CREATE ROLE \"{}\" LOGIN PASSWORD '{}'",
                roles.runtime.name, roles.runtime.password
            ),
        ];
        if let Some(deployer) = &roles.deployer {
            statements.push(format!(
                "CREATE ROLE \"{}\" LOGIN PASSWORD '{}'",
                deployer.name, deployer.password
            ));
            statements.push(format!(
                "GRANT \"{}\" TO \"{}\"",
                roles.owner.name, deployer.name
            ));
        }
        let database = current_database(admin).await;
        statements.push(format!(
            "ALTER DATABASE \"{database}\" OWNER TO \"{}\"",
            roles.owner.name
        ));
        for statement in statements {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(admin)
                .await
                .unwrap();
        }
        roles
    }

    fn names(&self) -> Vec<String> {
        let mut names = vec![self.owner.name.clone(), self.runtime.name.clone()];
        names.extend(self.deployer.iter().map(|deployer| deployer.name.clone()));
        names
    }

    /// Ends the roles' sessions, gives the database back to the superuser, drops what the roles
    /// own in it and their privileges, then the roles.
    pub async fn drop_all(&self, admin: &PgPool) {
        let names = self.names();
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY($1)",
        )
        .bind(&names)
        .execute(admin)
        .await
        .unwrap();
        let started = Instant::now();
        while sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = ANY($1)",
        )
        .bind(&names)
        .fetch_one(admin)
        .await
        .unwrap()
            > 0
            && started.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let database = current_database(admin).await;
        let quoted: Vec<String> = names.iter().map(|name| format!("\"{name}\"")).collect();
        let quoted = quoted.join(", ");
        for statement in [
            format!("ALTER DATABASE \"{database}\" OWNER TO CURRENT_USER"),
            format!("DROP OWNED BY {quoted}"),
            format!("DROP ROLE {quoted}"),
        ] {
            sqlx::raw_sql(AssertSqlSafe(statement))
                .execute(admin)
                .await
                .unwrap();
        }
    }
}

async fn current_database(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// One test's database, deployed the least-privilege way: migrated by the owner, the grants file
/// applied, and a pool for each role.
pub(crate) struct Deployment {
    /// The superuser, for what the test itself must do (rewind a lease, read the catalogs).
    pub admin: PgPool,
    /// The owner role: migrations and the application's own DDL.
    pub owner: PgPool,
    /// The runtime role: every request, resumer and retention of the test.
    pub runtime: PgPool,
    pub roles: Roles,
}

/// The grants file with its psql variable replaced, as `psql -v runtime_role=NAME` replaces it.
pub(crate) fn grants_for(runtime_role: &str) -> String {
    let file =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(GRANTS_FILE)).unwrap();
    assert!(
        !file.lines().any(|line| line.trim_start().starts_with('\\')),
        "{GRANTS_FILE} must hold SQL only (no psql meta-commands): the tests send it as it is"
    );
    let grants = file.replace(
        ":\"runtime_role\"",
        &format!("\"{}\"", runtime_role.replace('"', "\"\"")),
    );
    assert!(
        !grants.contains(":\"") && !grants.contains(":'"),
        "{GRANTS_FILE} uses a psql variable other than :\"runtime_role\""
    );
    grants
}

/// Creates the roles, migrates as the owner, applies the grants file as the owner, then runs
/// `scenario`; the roles are dropped afterwards even when it panics (the panic goes on).
pub(crate) async fn deployed<F, Fut>(connect: PgConnectOptions, scenario: F)
where
    F: FnOnce(Deployment) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let admin = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let roles = Roles::create(&admin, true).await;
    let outcome = {
        let (admin, roles) = (admin.clone(), roles.clone());
        tokio::spawn(async move {
            let owner = roles.owner.pool(&connect).await;
            idemflow::migrate(&owner).await.unwrap();
            sqlx::raw_sql(AssertSqlSafe(grants_for(&roles.runtime.name)))
                .execute(&owner)
                .await
                .unwrap();
            let runtime = roles.runtime.pool(&connect).await;
            scenario(Deployment {
                admin,
                owner: owner.clone(),
                runtime: runtime.clone(),
                roles,
            })
            .await;
            runtime.close().await;
            owner.close().await;
        })
        .await
    };
    roles.drop_all(&admin).await;
    if let Err(error) = outcome {
        std::panic::resume_unwind(error.into_panic());
    }
}

/// Every privilege `role` holds on the database, the `public` schema and every relation and
/// function in it (directly, through PUBLIC or through a membership), as (object, privilege).
pub(crate) async fn privileges(admin: &PgPool, role: &str) -> Vec<(String, String)> {
    let mut privileges: Vec<(String, String)> = sqlx::query_as(
        "SELECT c.relname::text, p.privilege \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', \
                                 'REFERENCES', 'TRIGGER']) AS p(privilege) \
         WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p', 'v', 'm', 'f') \
           AND has_table_privilege($1, c.oid, p.privilege) \
         UNION ALL \
         SELECT c.relname::text, p.privilege \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         CROSS JOIN unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) AS p(privilege) \
         WHERE n.nspname = 'public' AND c.relkind = 'S' \
           AND has_sequence_privilege($1, c.oid, p.privilege) \
         UNION ALL \
         SELECT 'function ' || f.oid::regprocedure::text, 'EXECUTE' \
         FROM pg_proc f JOIN pg_namespace n ON n.oid = f.pronamespace \
         WHERE n.nspname = 'public' AND has_function_privilege($1, f.oid, 'EXECUTE') \
         UNION ALL \
         SELECT 'schema public', p.privilege FROM unnest(ARRAY['USAGE', 'CREATE']) AS p(privilege) \
         WHERE has_schema_privilege($1, 'public', p.privilege) \
         UNION ALL \
         SELECT 'database', p.privilege \
         FROM unnest(ARRAY['CREATE', 'CONNECT', 'TEMPORARY']) AS p(privilege) \
         WHERE has_database_privilege($1, current_database(), p.privilege)",
    )
    .bind(role)
    .fetch_all(admin)
    .await
    .unwrap();
    // Sorted here, by bytes: the server's collation may order `_` and spaces otherwise.
    privileges.sort();
    privileges
}

fn expected_runtime_privileges() -> Vec<(String, String)> {
    RUNTIME_PRIVILEGES
        .iter()
        .map(|&(object, privilege)| (object.to_owned(), privilege.to_owned()))
        .collect()
}

/// Objects anywhere in the cluster that `role` owns (pg_shdepend's owner dependencies).
async fn owned_by(admin: &PgPool, role: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_shdepend WHERE deptype = 'o' AND refobjid = $1::text::regrole",
    )
    .bind(role)
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Relations of the `public` schema not owned by `role`.
async fn not_owned_by(admin: &PgPool, role: &str) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = 'public' AND c.relowner <> $1::text::regrole ORDER BY 1",
    )
    .bind(role)
    .fetch_all(admin)
    .await
    .unwrap()
}

/// The SQLSTATE of a database error.
pub(crate) fn sqlstate(error: &sqlx::Error) -> String {
    error
        .as_database_error()
        .and_then(|error| error.code())
        .map(|code| code.into_owned())
        .unwrap_or_else(|| panic!("not a database error: {error:?}"))
}

// ---------------------------------------------------------------------------------------------
// A workflow of one local and one foreign phase, against the testkit's mock provider

/// The application's own table: its DDL runs as the owner (its own migration), and the runtime
/// role needs its own grants on it (see [`grant_payments`]).
pub(crate) const PAYMENTS_TABLE: &str = "CREATE TABLE payments (\
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, tenant text NOT NULL, key text NOT NULL, \
    amount bigint NOT NULL)";

/// The application's grant on its own table, next to the engine's: local phases run as the
/// runtime role too. (An identity column needs no grant on its sequence.)
async fn grant_payments(owner: &PgPool, runtime: &str) {
    sqlx::query(PAYMENTS_TABLE).execute(owner).await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "GRANT SELECT, INSERT ON payments TO \"{runtime}\""
    )))
    .execute(owner)
    .await
    .unwrap();
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Payment {
    pub amount: u64,
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Recorded {
    pub payment_id: i64,
    pub amount: u64,
    pub source: String,
}

/// Local: records the payment in the application's table.
struct RecordPayment;

#[idemflow::async_trait]
impl LocalPhase<PgStore> for RecordPayment {
    const NAME: &'static str = "record_payment";
    type Input = Payment;
    type Output = Recorded;

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn run(
        &self,
        connection: &mut PgConnection,
        payment: Payment,
        context: &PhaseContext,
    ) -> Result<Recorded, PhaseError> {
        let payment_id: i64 = sqlx::query_scalar(
            "INSERT INTO payments (tenant, key, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(context.tenant.as_str())
        .bind(context.key.as_str())
        .bind(i64::try_from(payment.amount).unwrap())
        .fetch_one(connection)
        .await?;
        Ok(Recorded {
            payment_id,
            amount: payment.amount,
            source: payment.source,
        })
    }
}

/// Foreign: charges the card at the mock provider with the derived key, and answers 201; a
/// declined card is terminal (402), a provider failure retryable.
struct ChargeCard(ProviderClient);

#[idemflow::async_trait]
impl ForeignPhase for ChargeCard {
    const NAME: &'static str = "charge";
    type Input = Recorded;
    type Output = StoredResponse;

    fn timeout(&self) -> Duration {
        Duration::from_secs(5)
    }

    fn retry_policy(&self) -> RetryPolicy {
        patient()
    }

    async fn call(
        &self,
        key: &DerivedKey,
        recorded: Recorded,
        _: &PhaseContext,
    ) -> Result<StoredResponse, PhaseError> {
        match self
            .0
            .charge(key.as_str(), recorded.amount, "usd", &recorded.source)
            .await
        {
            Ok(ChargeResult::Succeeded { charge_id }) => Ok(StoredResponse::json(
                201,
                &json!({"payment_id": recorded.payment_id, "charge_id": charge_id}),
            )),
            Ok(ChargeResult::Declined { code, .. }) => Err(PhaseError::terminal_with(
                StoredResponse::json(402, &json!({"declined": code})),
                "card declined",
            )),
            Err(error) => Err(PhaseError::retryable(error.to_string())),
        }
    }
}

/// record_payment (local) → charge (foreign, the mock provider).
pub(crate) fn payments(provider: &MockProvider) -> Workflow<PgStore> {
    let client = ProviderClient::builder(provider.url())
        .timeout(Duration::from_secs(4))
        .build();
    Workflow::builder::<Payment>("payments.v1")
        .local(RecordPayment)
        .foreign(ChargeCard(client))
        .build()
        .unwrap()
}

pub(crate) fn payment_body(amount: u64, source: &str) -> Vec<u8> {
    format!(r#"{{"amount": {amount}, "source": "{source}"}}"#).into_bytes()
}

pub(crate) async fn pay(
    runner: &Runner<PgStore>,
    workflow: &Workflow<PgStore>,
    tenant: &TenantId,
    key: &str,
    body: &[u8],
) -> Outcome {
    runner
        .run(workflow, tenant, &Key::parse(key).unwrap(), request(body))
        .await
        .unwrap()
}

/// Rewinds a key's lease into the past, as the superuser, as if its owner had gone.
pub(crate) async fn rewind_lease(admin: &PgPool, tenant: &TenantId, key: &str) {
    let rewound = sqlx::query(
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second' \
         WHERE tenant = $1 AND key = $2 AND state = 'started'",
    )
    .bind(tenant.as_str())
    .bind(key)
    .execute(admin)
    .await
    .unwrap();
    assert_eq!(rewound.rows_affected(), 1, "no started key {key} to rewind");
}

/// (state, lock_version, attempts, locked_until in epoch ms) of a key, read as the superuser.
pub(crate) async fn key_state(
    admin: &PgPool,
    tenant: &TenantId,
    key: &str,
) -> Option<(String, i64, i32, Option<i64>)> {
    sqlx::query_as(
        "SELECT state, lock_version, attempts, \
                (extract(epoch FROM locked_until) * 1000)::bigint \
         FROM idempotency_keys WHERE tenant = $1 AND key = $2",
    )
    .bind(tenant.as_str())
    .bind(key)
    .fetch_optional(admin)
    .await
    .unwrap()
}

fn interrupted(outcome: &Outcome) {
    assert!(
        matches!(outcome, Outcome::Interrupted { .. }),
        "expected Interrupted, got {outcome:?}"
    );
}

fn executed(outcome: &Outcome, status: u16) -> StoredResponse {
    match outcome {
        Outcome::Executed(response) if response.status == status => response.clone(),
        other => panic!("expected Executed({status}), got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The tests

/// The grants file leaves the runtime role exactly [`RUNTIME_PRIVILEGES`], owner of nothing,
/// and the owner role owner of every object the migrations created; running it again changes
/// nothing, and takes back what was granted by hand since.
#[sqlx::test(migrations = false)]
async fn the_grants_file_gives_the_runtime_role_exactly_what_the_engine_needs(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment {
            admin,
            owner,
            roles,
            ..
        } = deployment;
        let runtime = roles.runtime.name.as_str();
        assert_eq!(
            privileges(&admin, runtime).await,
            expected_runtime_privileges()
        );
        assert_eq!(
            owned_by(&admin, runtime).await,
            0,
            "the runtime role owns nothing"
        );
        assert_eq!(
            not_owned_by(&admin, &roles.owner.name).await,
            Vec::<String>::new(),
            "the owner role owns every relation the migrations created"
        );
        // The functions the migrations created: the claim's, granted in the file. (A new one
        // fails here until the file grants what the runtime role needs of it, and
        // RUNTIME_PRIVILEGES lists it.)
        let functions: Vec<String> = sqlx::query_scalar(
            "SELECT f.oid::regprocedure::text FROM pg_proc f \
             JOIN pg_namespace n ON n.oid = f.pronamespace WHERE n.nspname = 'public'",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        assert_eq!(
            functions,
            ["idemflow_claim(bigint,text,text,bytea,text,jsonb,bigint,bigint)"]
        );
        // Every relation the migrations created, so a new one fails here until the file (and
        // RUNTIME_PRIVILEGES) say what the runtime role may do with it.
        let relations: Vec<String> = sqlx::query_scalar(
            "SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = 'public' ORDER BY c.relname::text COLLATE \"C\"",
        )
        .fetch_all(&admin)
        .await
        .unwrap();
        assert_eq!(
            relations,
            [
                "_sqlx_migrations",
                "_sqlx_migrations_pkey",
                "idempotency_keys",
                "idempotency_keys_fence",
                "idempotency_keys_finished_at",
                "idempotency_keys_pkey",
                "idempotency_keys_started_lease",
                "idempotency_responses",
                "idempotency_responses_pkey",
                "processed_messages",
                "processed_messages_pkey",
                "processed_messages_processed_at",
            ]
        );

        // Granted by hand since; the file, run again, takes it back and changes nothing else.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT TRUNCATE, TRIGGER ON idempotency_keys TO \"{runtime}\"; \
             GRANT SELECT ON _sqlx_migrations TO \"{runtime}\"; \
             GRANT UPDATE ON SEQUENCE idempotency_keys_fence TO \"{runtime}\""
        )))
        .execute(&owner)
        .await
        .unwrap();
        assert_ne!(
            privileges(&admin, runtime).await,
            expected_runtime_privileges()
        );
        sqlx::raw_sql(AssertSqlSafe(grants_for(runtime)))
            .execute(&owner)
            .await
            .unwrap();
        assert_eq!(
            privileges(&admin, runtime).await,
            expected_runtime_privileges()
        );

        // The schema is the owner's to create in: PUBLIC lost CREATE (a no-op on PostgreSQL 15,
        // where it never had it, and what older databases need).
        let public_can_create: bool =
            sqlx::query_scalar("SELECT has_schema_privilege('public', 'public', 'CREATE')")
                .fetch_one(&admin)
                .await
                .unwrap();
        assert!(!public_can_create);
    })
    .await;
}

/// Real requests as the runtime role: a claim, a replay, a 409, a 422, a takeover after the lease
/// was rewound, the resumer's drain, a resumer woken by NOTIFY (its LISTEN), retention, and the
/// forget policy's delete. Each behaves as it does for a superuser.
#[sqlx::test(migrations = false)]
async fn requests_resumers_and_retention_run_as_the_runtime_role(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment {
            admin,
            owner,
            runtime,
            roles,
            ..
        } = deployment;
        grant_payments(&owner, &roles.runtime.name).await;
        let provider = MockProvider::start().await;
        let workflow = payments(&provider);
        let runner = Runner::new(runtime.clone());
        let tenant = TenantId::new("acme").unwrap();
        let visa = payment_body(1200, "tok_visa");

        // A new key runs (claim, local phase, provider call, finish): 201.
        let first = executed(&pay(&runner, &workflow, &tenant, "k1", &visa).await, 201);
        // The same request again: its stored response.
        assert_eq!(
            pay(&runner, &workflow, &tenant, "k1", &visa).await,
            Outcome::Replayed(first.clone())
        );
        // The key with another body: 422.
        assert_eq!(
            pay(
                &runner,
                &workflow,
                &tenant,
                "k1",
                &payment_body(1, "tok_visa")
            )
            .await,
            Outcome::Mismatch
        );

        // The provider fails once: the key waits out its backoff in its lease, and a retry
        // meanwhile is told it is in progress (409).
        provider.push_fault(Fault::ServerError(503));
        interrupted(&pay(&runner, &workflow, &tenant, "k2", &visa).await);
        assert!(matches!(
            pay(&runner, &workflow, &tenant, "k2", &visa).await,
            Outcome::InProgress { .. }
        ));
        // Its lease rewound (as if the backoff were over): the retry takes it over and finishes.
        let before = key_state(&admin, &tenant, "k2").await.unwrap();
        rewind_lease(&admin, &tenant, "k2").await;
        executed(&pay(&runner, &workflow, &tenant, "k2", &visa).await, 201);
        let after = key_state(&admin, &tenant, "k2").await.unwrap();
        assert_eq!(after.0, "done");
        assert_ne!(after.1, before.1, "the takeover drew a new fencing token");
        assert_eq!(after.2, 2, "the claim and the takeover");

        // A key left behind is finished by a resumer's drain.
        provider.push_fault(Fault::ServerError(503));
        interrupted(&pay(&runner, &workflow, &tenant, "k3", &visa).await);
        rewind_lease(&admin, &tenant, "k3").await;
        let mut registry = Registry::new();
        registry.register(payments(&provider)).unwrap();
        let config = ResumerConfig::default().with_retention(None);
        let report = Resumer::with_config(Runner::new(runtime.clone()), registry, config)
            .drain()
            .await
            .unwrap();
        assert_eq!(
            report,
            DrainReport {
                taken: 1,
                finished: 1,
                interrupted: 0,
                failed: 0
            }
        );
        assert_eq!(key_state(&admin, &tenant, "k3").await.unwrap().0, "done");

        // A running resumer LISTENs: a key whose lease is ended and announced (what `idemflow
        // end-lease` does, as the runtime role) is finished at once, long before its next scan.
        provider.push_fault(Fault::ServerError(503));
        interrupted(&pay(&runner, &workflow, &tenant, "k4", &visa).await);
        let mut registry = Registry::new();
        registry.register(payments(&provider)).unwrap();
        let config = ResumerConfig::default()
            .with_idle_min(Duration::from_secs(60))
            .with_idle_max(Duration::from_secs(120))
            .with_report_every(Duration::from_secs(3600))
            .with_retention(None);
        let worker = Resumer::with_config(Runner::new(runtime.clone()), registry, config);
        let stop = std::sync::Arc::new(tokio::sync::Notify::new());
        let running = {
            let stop = stop.clone();
            tokio::spawn(worker.run(async move { stop.notified().await }))
        };
        // Once it listens, and its first scan (which found nothing due) is over: from then on
        // only the announcement can bring it back within the minute.
        let started = Instant::now();
        for (what, pattern) in [("listened", "LISTEN%"), ("scanned", "WITH due AS%")] {
            while sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE usename = $1 AND state = 'idle' AND query ILIKE $2",
            )
            .bind(&roles.runtime.name)
            .bind(pattern)
            .fetch_one(&admin)
            .await
            .unwrap()
                == 0
            {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "the resumer never {what} (as the runtime role)"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert_eq!(key_state(&admin, &tenant, "k4").await.unwrap().0, "started");
        let lock_version = key_state(&admin, &tenant, "k4").await.unwrap().1;
        let mut connection = runtime.acquire().await.unwrap();
        assert!(
            store::end_lease(&mut connection, "acme", "k4", lock_version)
                .await
                .unwrap()
                .is_some()
        );
        store::notify_due(&mut connection).await.unwrap();
        drop(connection);
        let woken = Instant::now();
        while key_state(&admin, &tenant, "k4").await.unwrap().0 != "done" {
            assert!(
                woken.elapsed() < Duration::from_secs(30),
                "the announced key was not resumed before the resumer's next scan"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.notify_one();
        running.await.unwrap();

        // Retention: a key finished two days ago goes; the others stay. Then its key is new.
        sqlx::query(
            "UPDATE idempotency_keys SET finished_at = now() - interval '2 days' WHERE key = 'k1'",
        )
        .execute(&admin)
        .await
        .unwrap();
        let day = Duration::from_secs(24 * 60 * 60);
        assert_eq!(idemflow::expire(&runtime, day, 100).await.unwrap(), 1);
        let retention = Retention::default().with_keep_for(day);
        assert_eq!(retention.expire(&runtime).await.unwrap(), 0);
        assert!(key_state(&admin, &tenant, "k1").await.is_none());
        executed(&pay(&runner, &workflow, &tenant, "k1", &visa).await, 201);

        // The forget policy deletes a key whose phase failed terminally.
        let forgetting = Runner::with_config(
            runtime.clone(),
            RunnerConfig::default().with_terminal_errors(TerminalPolicy::Forget),
        );
        let declined = payment_body(500, "tok_declined");
        match pay(&forgetting, &workflow, &tenant, "k5", &declined).await {
            Outcome::Forgotten(response) => assert_eq!(response.status, 402),
            other => panic!("expected Forgotten, got {other:?}"),
        }
        assert!(key_state(&admin, &tenant, "k5").await.is_none());

        // One charge per key at the provider (the declined one included): k1 run again after
        // retention sent the same derived key, and the provider answered with its first charge.
        let mut charged: Vec<String> = provider
            .charges()
            .into_iter()
            .map(|charge| charge.idempotency_key)
            .collect();
        charged.sort();
        assert_eq!(
            charged,
            [
                "acme:k1:charge",
                "acme:k2:charge",
                "acme:k3:charge",
                "acme:k4:charge",
                "acme:k5:charge"
            ]
        );
        provider.shutdown().await;
    })
    .await;
}

/// Every public statement of the store, called directly as the runtime role: the look-up, the
/// claim with its `PREPARE` and `SET LOCAL` limits, the fenced writes (a response stored out of
/// the row too), both takeovers, the reports, the announcement, end-lease, retention's batch and
/// the owner's delete.
#[sqlx::test(migrations = false)]
async fn every_statement_of_the_store_runs_as_the_runtime_role(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment { admin, runtime, .. } = deployment;
        let tenant = TenantId::new("acme").unwrap();
        let key = Key::parse("k").unwrap();
        let fingerprint = idemflow::Fingerprint::from_slice(&[7; 32]).unwrap();
        let input = json!({"amount": 1, "source": "tok_visa"});
        let lease = Duration::from_secs(30);
        let limits = Limits::default()
            .with_statement_timeout(Some(Duration::from_secs(5)))
            .with_idle_timeout(Some(Duration::from_secs(10)))
            .with_lock_timeout(None);
        let workflows = [("payments.v1".to_owned(), lease)];
        let mut connection = runtime.acquire().await.unwrap();

        let LookUp::Absent { lock_version, .. } = store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap()
        else {
            panic!("a new key is absent");
        };
        let claim = ClaimRequest {
            tenant: &tenant,
            key: &key,
            lock_version,
            fingerprint: &fingerprint,
            workflow: "payments.v1",
            request: &input,
            lease,
        };
        // A connection of its own, new: the claim prepares its statement on it first.
        let claimer = runtime.acquire().await.unwrap();
        let Claimed::Owned(mut transaction, owner) =
            store::begin_claim(claimer, &claim, &limits).await.unwrap()
        else {
            panic!("a new key is ours");
        };
        store::advance(
            &mut transaction,
            &owner,
            "record_payment",
            &json!({"id": 1}),
            lease,
        )
        .await
        .unwrap();
        transaction.commit().await.unwrap();
        assert!(matches!(
            store::look_up(&mut connection, &tenant, &key)
                .await
                .unwrap(),
            LookUp::Found(_)
        ));
        store::renew_lease(&mut connection, &owner, lease)
            .await
            .unwrap();
        store::postpone(&mut connection, &owner, Duration::ZERO, "boom")
            .await
            .unwrap();
        store::notify_due(&mut connection).await.unwrap();

        // The operators' reads.
        let report = store::key_report(&mut connection, "acme", "k")
            .await
            .unwrap()
            .unwrap();
        // The postpone advanced the fence past the owner's token.
        assert_ne!(report.lock_version, lock_version);
        let lock_version = report.lock_version;
        assert!(
            store::inspect(&mut connection, &tenant, &key)
                .await
                .unwrap()
                .is_some()
        );
        assert_eq!(
            store::stuck_keys(&mut connection, 5, 10)
                .await
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            store::table_stats(&mut connection).await.unwrap().counts,
            [("payments.v1".to_owned(), "started".to_owned(), 1)]
        );
        store::resumer_lag(&mut connection).await.unwrap();
        assert_eq!(
            store::count_due_unknown(&mut connection, &["other.v1".to_owned()])
                .await
                .unwrap(),
            [("payments.v1".to_owned(), 1)]
        );

        // A client retry's takeover, inside a transaction under limits, as the runner does it.
        let mut transaction =
            store::Transaction::begin_limited(runtime.acquire().await.unwrap(), &limits)
                .await
                .unwrap();
        let taken = store::take_over(&mut transaction, &tenant, &key, lock_version, lease)
            .await
            .unwrap()
            .expect("an expired lease is taken over");
        transaction.commit().await.unwrap();
        // An operator ends the lease; the resumer's scan takes the key over.
        assert!(
            store::end_lease(&mut connection, "acme", "k", taken.owner.lock_version())
                .await
                .unwrap()
                .is_some()
        );
        let due = store::take_over_due(&mut connection, &workflows, 10)
            .await
            .unwrap();
        let [due] = due.as_slice() else {
            panic!("one key is due: {due:?}");
        };
        let response = StoredResponse::json(201, &json!({"ok": true}));
        // Stored out of the row (any body is above a threshold of 0), and read back from there.
        let mut tx = store::Transaction::begin(&runtime).await.unwrap();
        store::finish(&mut tx, &due.1.owner, "charge", &response, 0)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let LookUp::Found(found) = store::look_up(&mut connection, &tenant, &key)
            .await
            .unwrap()
        else {
            panic!("a finished key is found");
        };
        let life = found.body_apart.expect("the body is stored apart");
        let body = store::response_apart(&mut connection, &tenant, &key, life)
            .await
            .unwrap();
        assert_eq!(body.as_deref(), Some(response.body.as_slice()));
        assert_eq!(
            found.response.map(|found| found.status),
            Some(response.status)
        );
        // Retention's batch deletes it once it is older than the window (here: any age).
        sqlx::query("UPDATE idempotency_keys SET finished_at = now() - interval '1 minute'")
            .execute(&admin)
            .await
            .unwrap();
        assert_eq!(
            store::expire_batch(&mut connection, Duration::from_secs(1), 100)
                .await
                .unwrap(),
            1
        );

        // A token drawn on its own, and the owner's delete of its started key.
        let lock_version = store::next_lock_version(&mut connection).await.unwrap();
        let claim = ClaimRequest {
            lock_version,
            ..claim
        };
        let Claimed::Owned(mut transaction, owner) =
            store::begin_claim(runtime.acquire().await.unwrap(), &claim, &Limits::default())
                .await
                .unwrap()
        else {
            panic!("the key is new again");
        };
        store::delete_owned(&mut transaction, &owner).await.unwrap();
        transaction.commit().await.unwrap();
        assert!(matches!(
            store::look_up(&mut connection, &tenant, &key)
                .await
                .unwrap(),
            LookUp::Absent { .. }
        ));
    })
    .await;
}

/// The runtime role can change neither the schema nor the fencing tokens nor the migrations'
/// history, and cannot run the migrator: each refused with insufficient_privilege (42501).
/// The partitioned layout under least privilege: the owner adopts it and maintains it; the
/// runtime role keeps exactly its privileges (the partitions and the trigger's functions need no
/// grant: rows are reached through the parent, and the trigger runs with its owner's rights), runs
/// requests on it as before, including the trigger's uniqueness check, and may not maintain it.
#[sqlx::test(migrations = false)]
async fn the_partitioned_layout_is_the_owners_to_maintain_and_the_runtime_roles_to_use(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment {
            admin,
            owner,
            runtime,
            roles,
        } = deployment;
        let plan = store::partitions::PartitionPlan {
            width: Duration::from_secs(60 * 60),
            ahead: 2,
        };
        // Only the owner converts the table.
        assert!(matches!(
            store::partitions::adopt(&runtime, &plan).await,
            Err(store::StoreError::Database(_))
        ));
        store::partitions::adopt(&owner, &plan).await.unwrap();
        assert_eq!(
            privileges(&admin, &roles.runtime.name).await,
            expected_runtime_privileges()
        );

        grant_payments(&owner, &roles.runtime.name).await;
        let provider = MockProvider::start().await;
        let workflow = payments(&provider);
        let runner = Runner::new(runtime.clone());
        let tenant = TenantId::new("acme").unwrap();
        let visa = payment_body(1200, "tok_visa");
        let first = executed(&pay(&runner, &workflow, &tenant, "k1", &visa).await, 201);
        assert_eq!(
            pay(&runner, &workflow, &tenant, "k1", &visa).await,
            Outcome::Replayed(first)
        );
        // A second row of the key in another partition is refused by the trigger, for the
        // runtime role as for anyone.
        let refused = sqlx::query(
            "INSERT INTO idempotency_keys (tenant, key, fingerprint, workflow, request, \
                 locked_until, created_at) \
             VALUES ('acme', 'k1', sha256('x'), 'w', '{}', now(), now() + interval '1 hour')",
        )
        .execute(&runtime)
        .await
        .unwrap_err();
        assert_eq!(
            refused
                .as_database_error()
                .and_then(|error| error.constraint()),
            Some("idempotency_keys_pkey")
        );

        // Maintenance changes the schema: the owner's, refused to the runtime role (42501).
        let day = Duration::from_secs(24 * 60 * 60);
        let denied = store::partitions::maintain(&runtime, day)
            .await
            .unwrap_err();
        assert!(
            matches!(&denied, store::StoreError::Database(error)
                if error.as_database_error().and_then(|e| e.code()).as_deref() == Some("42501")),
            "{denied:?}"
        );
        let maintained = store::partitions::maintain(&owner, day).await.unwrap();
        assert!(
            maintained.kept.is_empty() && !maintained.skipped,
            "{maintained:?}"
        );
        assert_eq!(maintained.ahead, 2);
    })
    .await;
}

#[sqlx::test(migrations = false)]
async fn the_runtime_role_cannot_change_the_schema_or_run_migrations(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment {
            admin,
            runtime,
            roles,
            ..
        } = deployment;
        let before = privileges(&admin, &roles.runtime.name).await;
        for statement in [
            "ALTER TABLE idempotency_keys ADD COLUMN note text",
            "ALTER TABLE idempotency_keys DROP CONSTRAINT started_keys_hold_a_lease",
            "DROP TABLE idempotency_keys",
            "TRUNCATE idempotency_keys",
            "CREATE INDEX ON idempotency_keys (workflow)",
            "CREATE TABLE public.scratch (id int)",
            "CREATE TABLE scratch (id int)",
            "CREATE FUNCTION public.scratch() RETURNS int LANGUAGE sql AS 'SELECT 1'",
            "CREATE SCHEMA scratch",
            "ALTER SEQUENCE idempotency_keys_fence RESTART",
            "SELECT setval('idempotency_keys_fence', 1)",
            "DROP SEQUENCE idempotency_keys_fence",
            "SELECT * FROM _sqlx_migrations",
            "DELETE FROM _sqlx_migrations",
            "DROP TABLE _sqlx_migrations",
        ] {
            let error = sqlx::raw_sql(statement)
                .execute(&runtime)
                .await
                .expect_err(statement);
            assert_eq!(sqlstate(&error), "42501", "{statement}: {error}");
        }

        // The migrator's first statement (its history table, `CREATE TABLE IF NOT EXISTS`) needs
        // CREATE on the schema even when the table exists: migrating is the owner's job.
        let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
            .fetch_one(&admin)
            .await
            .unwrap();
        match idemflow::migrate(&runtime).await {
            Err(sqlx::migrate::MigrateError::Execute(error)) => {
                assert_eq!(sqlstate(&error), "42501", "{error}");
            }
            other => panic!("the runtime role ran the migrator: {other:?}"),
        }
        let still: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations")
            .fetch_one(&admin)
            .await
            .unwrap();
        assert_eq!(still, applied);

        // Nor can it grant itself more: without grant options, GRANT grants nothing.
        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT TRUNCATE ON idempotency_keys TO \"{}\"",
            roles.runtime.name
        )))
        .execute(&runtime)
        .await
        .ok();
        assert_eq!(privileges(&admin, &roles.runtime.name).await, before);
    })
    .await;
}

/// The production shape: the owner role cannot log in; a deployer login that is a member of it
/// runs `idemflow migrate` with `options=-c role=<owner>` in its URL, and applies the grants
/// file the same way (with psql, exactly as docs/operations.md shows, where psql is installed).
/// Everything created is the owner's, not the deployer's; the runtime role can use the CLI's
/// reading commands but not its `migrate`.
#[sqlx::test(migrations = false)]
async fn a_nologin_owner_migrates_through_a_member_login_with_the_cli(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let admin = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(connect.clone())
        .await
        .unwrap();
    let roles = Roles::create(&admin, false).await;
    let outcome = {
        let (admin, roles) = (admin.clone(), roles.clone());
        tokio::spawn(async move {
            let deployer = roles.deployer.clone().unwrap();
            let as_owner = format!("-c role={}", roles.owner.name);
            let deployer_url = deployer.url(&connect, Some(&as_owner));
            let binary = tokio::task::spawn_blocking(crate::isolation::cli_binary)
                .await
                .unwrap();
            let (code, stdout, stderr) =
                crate::isolation::idemflow(&binary, &["migrate"], &deployer_url);
            assert_eq!(code, 0, "{stdout}{stderr}");
            assert!(stdout.starts_with("schema up to date"), "{stdout}");

            let root = Path::new(env!("CARGO_MANIFEST_DIR"));
            let psql = Command::new("psql")
                .arg(&deployer_url)
                .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-v"])
                .arg(format!("runtime_role={}", roles.runtime.name))
                .arg("-f")
                .arg(root.join(GRANTS_FILE))
                .output();
            match psql {
                Ok(output) => assert!(
                    output.status.success(),
                    "psql -f {GRANTS_FILE}: {}{}",
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ),
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                    eprintln!("psql is not installed: the grants file is sent by sqlx instead");
                    let as_owner = deployer
                        .options(&connect)
                        .options([("role", roles.owner.name.as_str())]);
                    let pool = PgPoolOptions::new()
                        .max_connections(1)
                        .connect_with(as_owner)
                        .await
                        .unwrap();
                    sqlx::raw_sql(AssertSqlSafe(grants_for(&roles.runtime.name)))
                        .execute(&pool)
                        .await
                        .unwrap();
                    pool.close().await;
                }
                Err(error) => panic!("psql: {error}"),
            }

            assert_eq!(
                not_owned_by(&admin, &roles.owner.name).await,
                Vec::<String>::new()
            );
            assert_eq!(owned_by(&admin, &deployer.name).await, 0);
            assert_eq!(owned_by(&admin, &roles.runtime.name).await, 0);
            assert_eq!(
                privileges(&admin, &roles.runtime.name).await,
                expected_runtime_privileges()
            );

            let runtime_url = roles.runtime.url(&connect, None);
            let (code, stdout, stderr) =
                crate::isolation::idemflow(&binary, &["stats"], &runtime_url);
            assert_eq!(code, 0, "{stdout}{stderr}");
            assert!(stdout.starts_with("no keys\n"), "{stdout}");
            let (code, _, stderr) = crate::isolation::idemflow(&binary, &["migrate"], &runtime_url);
            assert_eq!(code, 3);
            assert!(
                stderr.contains("permission denied for schema public"),
                "{stderr}"
            );
        })
        .await
    };
    roles.drop_all(&admin).await;
    if let Err(error) = outcome {
        std::panic::resume_unwind(error.into_panic());
    }
}

/// The attack on the partitioned layout's SECURITY DEFINER trigger, as the runtime role: a
/// temporary view named `idempotency_keys` over a function of its own, then an insert into the
/// keys table. Were the trigger's function to resolve `idempotency_keys` through a path that
/// searches the session's temporary schema first (PostgreSQL does, for relations, unless the path
/// names `pg_temp`), the view's function would run as the owner: here it would create a table and
/// grant the runtime role the migrations' history. Two defences, each checked alone: the grants
/// file takes `TEMPORARY` away (the view cannot be made), and with `TEMPORARY` granted back the
/// trigger's fixed path and qualified names never reach the view.
#[sqlx::test(migrations = false)]
async fn the_runtime_role_cannot_run_sql_as_the_owner_through_the_partitioned_trigger(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment {
            admin,
            owner,
            runtime,
            roles,
        } = deployment;
        store::partitions::adopt(&owner, &store::partitions::PartitionPlan::default())
            .await
            .unwrap();
        const ATTACK: &str = "\
            CREATE FUNCTION pg_temp.escalate() RETURNS TABLE (tenant text, key text) \
                LANGUAGE plpgsql AS $f$ BEGIN \
                    EXECUTE 'CREATE TABLE public.escalated (id int)'; \
                    EXECUTE format('GRANT ALL ON public._sqlx_migrations TO %I', session_user); \
                    RETURN; \
                END $f$; \
            CREATE TEMPORARY VIEW idempotency_keys AS SELECT * FROM pg_temp.escalate(); \
            GRANT SELECT ON pg_temp.idempotency_keys TO PUBLIC;";
        const INSERT: &str = "\
            INSERT INTO public.idempotency_keys \
                (tenant, key, fingerprint, workflow, request, locked_until) \
            VALUES ('acme', 'escalate', sha256('x'), 'w', '{}', now() + interval '1 minute')";
        // As the grants file leaves it: no temporary objects at all.
        let mut session = runtime.acquire().await.unwrap();
        let refused = sqlx::raw_sql(ATTACK)
            .execute(&mut *session)
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&refused), "42501", "{refused}");
        drop(session);

        // TEMPORARY granted back (a database whose other users need it): the view is made, the
        // insert goes in, and the trigger reads the real table as the owner, never the view.
        let database = current_database(&admin).await;
        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT TEMPORARY ON DATABASE \"{database}\" TO \"{}\"",
            roles.runtime.name
        )))
        .execute(&owner)
        .await
        .unwrap();
        let granted = privileges(&admin, &roles.runtime.name).await;
        let mut session = runtime.acquire().await.unwrap();
        sqlx::raw_sql(ATTACK).execute(&mut *session).await.unwrap();
        let inserted = sqlx::raw_sql(INSERT).execute(&mut *session).await;
        session.close().await.unwrap();
        assert!(inserted.is_ok(), "{inserted:?}");
        let table: Option<String> =
            sqlx::query_scalar("SELECT to_regclass('public.escalated')::text")
                .fetch_one(&admin)
                .await
                .unwrap();
        assert_eq!(table, None, "the view's function ran as the owner");
        assert_eq!(privileges(&admin, &roles.runtime.name).await, granted);
        // And a second row of the key is still refused: the trigger read the real table.
        let mut session = runtime.acquire().await.unwrap();
        let duplicate = sqlx::raw_sql(INSERT)
            .execute(&mut *session)
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&duplicate), "23505", "{duplicate}");
        drop(session);
    })
    .await;
}

/// Whether the claim's function runs with its owner's rights: it does only where it quiets a lost
/// race (its owner may set `log_min_messages`).
async fn claim_quiets(admin: &PgPool) -> bool {
    sqlx::query_scalar(
        "SELECT prosecdef AND prosrc LIKE '%log_min_messages%' FROM pg_proc \
         WHERE proname = 'idemflow_claim'",
    )
    .fetch_one(admin)
    .await
    .unwrap()
}

/// Migrated by a least-privilege owner, a claim that loses the race for its key still answers
/// (the runtime role's claim comes back lost) and its ERROR line is logged, as it must be where
/// the owner may not set `log_min_messages`. Once a superuser grants the owner that and the owner
/// defines the claim's function again (the migration's file, run again), the lost race is quiet;
/// the function keeps its owner and the runtime role keeps exactly its grants.
#[sqlx::test(migrations = false)]
async fn a_lost_race_is_quiet_once_the_owner_may_set_log_min_messages(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    deployed(connect, |deployment| async move {
        let Deployment {
            admin,
            owner,
            runtime,
            roles,
        } = deployment;
        assert!(!claim_quiets(&admin).await);
        let log = ServerLog::from_now(&admin).await.expect("the server's log");
        let loud = lose_a_race(&runtime, "loud", true).await;
        assert_ne!(
            logged_lines(&admin, &log, &[loud]).await,
            Vec::<String>::new()
        );

        sqlx::raw_sql(AssertSqlSafe(format!(
            "GRANT SET ON PARAMETER log_min_messages TO \"{}\"",
            roles.owner.name
        )))
        .execute(&admin)
        .await
        .unwrap();
        sqlx::raw_sql(store::statements::DEFINE_CLAIM)
            .execute(&owner)
            .await
            .unwrap();
        assert!(claim_quiets(&admin).await);
        let log = ServerLog::from_now(&admin).await.expect("the server's log");
        let quiet = lose_a_race(&runtime, "quiet", true).await;
        assert_eq!(
            logged_lines(&admin, &log, &[quiet]).await,
            Vec::<String>::new()
        );
        assert_eq!(owned_by(&admin, &roles.runtime.name).await, 0);
        assert_eq!(
            privileges(&admin, &roles.runtime.name).await,
            expected_runtime_privileges()
        );
    })
    .await;
}
