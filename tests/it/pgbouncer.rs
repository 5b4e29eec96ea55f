//! The engine behind PgBouncer in transaction pooling mode: each test starts a pgbouncer of its
//! own on a free loopback port (`pool_mode = transaction`, `default_pool_size = 2`), in front of
//! the test's own database, and gives the engine more client connections than pgbouncer has
//! server connections, so every transaction may land on another server connection.
//!
//! What changes there (docs/operations.md, "Connections and poolers"):
//! - sqlx prepares every statement with bind parameters as a named, protocol-level prepared
//!   statement of the connection: behind a transaction pooler that is only correct with
//!   PgBouncer's own prepared statement support (1.21+, `max_prepared_statements`). Without it a
//!   client can run *another client's* statement of the same name.
//! - the claim's SQL-level `PREPARE` (`idemflow_claim_v4`) is not tracked by PgBouncer: the claim
//!   prepares it again where it lands, or sends the insert in full.
//! - startup `options` (`PoolSettings`' session limits) are refused unless PgBouncer ignores them,
//!   and then they are lost: set them on the role or database instead.
//! - `LISTEN` hears nothing, and leaves a shared server connection subscribed, so that a
//!   notification fails another client's statement: resumers must not listen through it. The
//!   resumer finishes due keys by polling all the same.
//! - transaction-scoped advisory locks are unaffected; fencing tokens are unique, not ordered.
//!
//! The tests need PgBouncer 1.21+: the engine cannot run behind an older one in transaction mode
//! at all, which `without_pooler_prepared_statements_a_client_runs_another_clients_statement`
//! shows. `scripts/test` finds one: the system's (Debian: `pgbouncer`) when it is recent enough,
//! else it builds the release Debian 13 packages, once, into a cache, and names it in
//! `IDEMFLOW_PGBOUNCER` (which may also name any other binary). With none, or an older one, the
//! tests fail, saying so. Running as root, pgbouncer (which refuses root) runs as the user
//! scripts/lib/postgres.sh runs its throwaway cluster as (`IDEMFLOW_POSTGRES_OS_USER`, default
//! `idemflow-pg`), else `postgres`, else `nobody`, from a directory under /tmp it owns.

use idemflow::PgStore;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use idemflow::{
    DrainReport, Fingerprint, Key, Outcome, PoolSettings, Registry, Resumer, ResumerConfig, Runner,
};
use idemflow_pg::{self as store, ClaimRequest, Claimed, Limits, statements};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool, Row};

use crate::support::*;

/// PgBouncer's version, from `pgbouncer --version` ("PgBouncer 1.18.0").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Version(u32, u32, u32);

impl Version {
    /// The first with protocol-level prepared statements in transaction mode
    /// (`max_prepared_statements`); older ones refuse to start with the setting.
    const PREPARED_STATEMENTS: Self = Self(1, 21, 0);
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// `IDEMFLOW_PGBOUNCER`, else `pgbouncer` on PATH or in /usr/sbin (Debian's place, not on a
/// normal user's PATH). Panics with the install hint when there is none.
fn pgbouncer_binary() -> PathBuf {
    if let Ok(path) = std::env::var("IDEMFLOW_PGBOUNCER") {
        let path = PathBuf::from(path);
        assert!(
            path.is_file(),
            "IDEMFLOW_PGBOUNCER={} is not a file",
            path.display()
        );
        return path;
    }
    let on_path = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|dir| dir.join("pgbouncer"))
        .find(|path| path.is_file())
        .unwrap_or_else(|| {
            panic!(
                "pgbouncer is not installed (Debian/Ubuntu: apt-get install pgbouncer; \
                 scripts/test installs it), or set IDEMFLOW_PGBOUNCER to its binary"
            )
        })
}

fn version_of(binary: &Path) -> Version {
    let output = Command::new(binary).arg("--version").output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    let parse = || -> Option<Version> {
        let number = text.lines().next()?.strip_prefix("PgBouncer ")?;
        let mut parts = number.trim().split('.').map(|part| part.parse().ok());
        Some(Version(parts.next()??, parts.next()??, parts.next()??))
    };
    parse().unwrap_or_else(|| panic!("unexpected `pgbouncer --version`: {text:?}"))
}

/// The installed pgbouncer and its version.
fn pgbouncer() -> (PathBuf, Version) {
    let binary = pgbouncer_binary();
    let version = version_of(&binary);
    (binary, version)
}

/// Whether this pgbouncer can carry the engine's own (sqlx's) statements in transaction mode
/// (1.21+). An older one fails the test that needs it, loudly: scripts/test builds one.
fn runs_the_engine(test: &str) -> bool {
    let (_, version) = pgbouncer();
    assert!(
        version >= Version::PREPARED_STATEMENTS,
        "{test}: pgbouncer {version} has no prepared statement support (max_prepared_statements, \
         1.21+), without which the engine cannot run behind it in transaction mode (see \
         without_pooler_prepared_statements_a_client_runs_another_clients_statement): run \
         scripts/test, which builds pgbouncer 1.21+ where the system's is older, or set \
         IDEMFLOW_PGBOUNCER to one"
    );
    true
}

fn id_of(flag: &str, user: &str) -> Option<u32> {
    let output = Command::new("id").args([flag, user]).output().ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

/// When running as root: the (uid, gid) pgbouncer runs as, since it refuses root.
fn run_as() -> Option<(u32, u32)> {
    let me = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&me.stdout).trim() != "0" {
        return None;
    }
    let preferred =
        std::env::var("IDEMFLOW_POSTGRES_OS_USER").unwrap_or_else(|_| "idemflow-pg".to_owned());
    let user = [preferred.as_str(), "postgres", "nobody"]
        .into_iter()
        .find_map(|user| Some((id_of("-u", user)?, id_of("-g", user)?)));
    Some(user.unwrap_or_else(|| {
        panic!("running as root, and no user ({preferred}, postgres, nobody) to run pgbouncer as")
    }))
}

/// The password of `DATABASE_URL`, if it has one (the connect options do not give it back).
fn password() -> Option<String> {
    let url = std::env::var("DATABASE_URL").ok()?;
    let (_, rest) = url.split_once("://")?;
    let authority = &rest[..rest.find('/').unwrap_or(rest.len())];
    let (user_info, _) = authority.rsplit_once('@')?;
    let (_, password) = user_info.split_once(':')?;
    Some(password.to_owned())
}

/// How a test's pgbouncer is configured beyond the fixed settings.
#[derive(Debug, Clone)]
struct Settings {
    /// `default_pool_size`: server connections per database and user.
    pool_size: u32,
    /// `max_prepared_statements`, written only where the version knows it (1.21+).
    max_prepared_statements: u32,
    /// `ignore_startup_parameters`: sqlx sends `extra_float_digits` on every connection, and
    /// `PoolSettings` sends its session limits as `options`.
    ignore_startup_parameters: &'static str,
    /// `server_round_robin`: 0 hands out the server connection released last (LIFO), 1 the one
    /// idle longest.
    round_robin: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            pool_size: 2,
            max_prepared_statements: 200,
            ignore_startup_parameters: "extra_float_digits, options",
            round_robin: false,
        }
    }
}

/// A pgbouncer of this test's own, in transaction mode, in front of the test's database. Dropped,
/// it is killed (it is this process's child) and its directory removed.
struct Bouncer {
    child: Child,
    dir: PathBuf,
    version: Version,
    /// The options the test connected with, pointed at this pgbouncer.
    connect: PgConnectOptions,
}

impl Bouncer {
    async fn start(connect: &PgConnectOptions, settings: Settings) -> Self {
        // A free port can be taken by someone else before pgbouncer binds it: try again.
        let mut attempt = 0;
        loop {
            attempt += 1;
            match Self::try_start(connect, &settings).await {
                Ok(bouncer) => return bouncer,
                Err(log) if attempt < 5 && log.contains("in use") => continue,
                Err(log) => panic!("pgbouncer did not start; its log:\n{log}"),
            }
        }
    }

    async fn try_start(connect: &PgConnectOptions, settings: &Settings) -> Result<Self, String> {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;

        let (binary, version) = pgbouncer();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Under /tmp, not $TMPDIR: the user pgbouncer runs as must reach it.
        let dir = PathBuf::from(format!(
            "/tmp/idemflow-pgbouncer.{}.{port}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();

        let user = connect.get_username();
        let database = connect.get_database().unwrap();
        let server_password = password()
            .map(|password| format!(" password={password}"))
            .unwrap_or_default();
        let mut ini = format!(
            "[databases]\n\
             {database} = host={host} port={server_port} dbname={database} user={user}{server_password}\n\
             \n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/userlist.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {pool_size}\n\
             min_pool_size = 0\n\
             reserve_pool_size = 0\n\
             max_client_conn = 100\n\
             server_round_robin = {round_robin}\n\
             ignore_startup_parameters = {ignore}\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            host = connect.get_host(),
            server_port = connect.get_port(),
            dir = dir.display(),
            pool_size = settings.pool_size,
            round_robin = u8::from(settings.round_robin),
            ignore = settings.ignore_startup_parameters,
        );
        if version >= Version::PREPARED_STATEMENTS {
            ini.push_str(&format!(
                "max_prepared_statements = {}\n",
                settings.max_prepared_statements
            ));
        }
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        // auth_type = trust still wants the user listed.
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n")).unwrap();

        let mut command = Command::new(&binary);
        command
            .arg(dir.join("pgbouncer.ini"))
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = run_as() {
            for path in [
                dir.clone(),
                dir.join("pgbouncer.ini"),
                dir.join("userlist.txt"),
            ] {
                std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
            }
            // std drops root's supplementary groups before setuid.
            command.uid(uid).gid(gid);
        }
        let child = command.spawn().unwrap();
        let mut bouncer = Self {
            child,
            dir,
            version,
            connect: connect.clone().host("127.0.0.1").port(port),
        };
        let started = Instant::now();
        loop {
            if bouncer.child.try_wait().unwrap().is_some() {
                return Err(bouncer.log());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(bouncer);
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err(format!("not listening after 10 s\n{}", bouncer.log()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }

    /// A pool of `clients` connections through this pgbouncer, built as the engine recommends
    /// (`PoolSettings`, whose session limits pgbouncer ignores here: see
    /// `session_limits_given_at_startup_are_refused_or_lost`).
    async fn engine_pool(&self, clients: u32) -> PgPool {
        let settings = PoolSettings::default().with_max_connections(clients);
        settings
            .pool_options()
            .connect_with(settings.connect_options(self.connect.clone()))
            .await
            .unwrap()
    }

    /// One client connection of its own.
    async fn client(&self) -> PgConnection {
        PgConnection::connect_with(&self.connect).await.unwrap()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A direct pool to the test's database, for setting up and looking (never through pgbouncer).
async fn direct(options: PgPoolOptions, connect: &PgConnectOptions) -> PgPool {
    options.connect_with(connect.clone()).await.unwrap()
}

/// Runs `sql` in the simple query protocol (no prepared statement of sqlx's: safe through any
/// pgbouncer) and returns the first column of its last row.
async fn simple(connection: &mut PgConnection, sql: &str) -> String {
    let rows = sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_all(&mut *connection)
        .await
        .unwrap_or_else(|error| panic!("{sql}: {error}"));
    rows.last()
        .map(|row| row.get::<String, _>(0))
        .unwrap_or_default()
}

/// The server process behind `connection`'s current transaction.
async fn backend(connection: &mut PgConnection) -> String {
    simple(connection, "SELECT pg_backend_pid()::text").await
}

/// Whether the server connection behind `connection`'s current transaction has the claim's
/// prepared statement.
async fn has_the_claim_prepared(connection: &mut PgConnection) -> bool {
    let sql = format!(
        "SELECT count(*)::text FROM pg_prepared_statements WHERE name = '{}'",
        statements::CLAIM_NAME
    );
    simple(connection, &sql).await == "1"
}

/// What the first test pins down: sqlx's statement cache, client by client, against a pooler that
/// mixes server connections. Returns what client A's `$1 + 1` answered for 1 (2 is right).
async fn a_cached_statement_after_another_client_prepared_on_the_other_server(
    bouncer: &Bouncer,
) -> Result<i64, sqlx::Error> {
    let (mut a, mut b, mut holder) = (
        bouncer.client().await,
        bouncer.client().await,
        bouncer.client().await,
    );
    // A prepares its first statement (sqlx names it sqlx_s_1) on the server connection S1.
    let sum: i64 = sqlx::query_scalar("SELECT $1::bigint + 1")
        .bind(1_i64)
        .fetch_one(&mut a)
        .await?;
    assert_eq!(sum, 2);
    // While S1 is held, B's first statement (its own sqlx_s_1) is prepared on S2.
    simple(&mut holder, "BEGIN").await;
    let on_s1 = backend(&mut holder).await;
    let product: i64 = sqlx::query_scalar("SELECT $1::bigint * 100")
        .bind(1_i64)
        .fetch_one(&mut b)
        .await?;
    assert_eq!(product, 100);
    // A runs its statement again: sqlx binds its cached sqlx_s_1, and the pooler hands it S2.
    let again = sqlx::query_scalar("SELECT $1::bigint + 1")
        .bind(1_i64)
        .fetch_one(&mut a)
        .await;
    assert_eq!(backend(&mut holder).await, on_s1, "S1 stayed held");
    simple(&mut holder, "COMMIT").await;
    again
}

/// Without PgBouncer's own prepared statement support (before 1.21, or
/// `max_prepared_statements = 0`), sqlx's statements are wrong behind a transaction pooler, not
/// merely slow: a client's cached statement name is bound on whichever server connection it gets,
/// where another client may have prepared another statement under the same name. Here client A
/// asks `1 + 1` and gets B's `1 * 100`. With `max_prepared_statements` (1.21+) pgbouncer renames
/// and prepares statements per server connection itself, and A gets 2.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn without_pooler_prepared_statements_a_client_runs_another_clients_statement(
    _: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let without = Bouncer::start(
        &connect,
        Settings {
            max_prepared_statements: 0,
            ..Settings::default()
        },
    )
    .await;
    let answered = a_cached_statement_after_another_client_prepared_on_the_other_server(&without)
        .await
        .unwrap();
    assert_eq!(
        answered, 100,
        "pgbouncer {} without max_prepared_statements: A ran B's statement",
        without.version
    );
    drop(without);

    let (_, version) = pgbouncer();
    if version >= Version::PREPARED_STATEMENTS {
        let with = Bouncer::start(&connect, Settings::default()).await;
        let answered = a_cached_statement_after_another_client_prepared_on_the_other_server(&with)
            .await
            .unwrap();
        assert_eq!(answered, 2, "max_prepared_statements = 200: A ran its own");
    } else {
        eprintln!(
            "pgbouncer {version}: no max_prepared_statements (1.21+), so only the failure is shown"
        );
    }
}

fn claim_of<'a>(
    tenant: &'a idemflow::TenantId,
    key: &'a Key,
    fingerprint: &'a Fingerprint,
    request: &'a serde_json::Value,
) -> ClaimRequest<'a> {
    ClaimRequest {
        tenant,
        key,
        lock_version: 1 << 40,
        fingerprint,
        workflow: "w.v1",
        request,
        lease: Duration::from_secs(60),
    }
}

/// Two clients holding a transaction each, and so both server connections.
struct Holders(PgConnection, PgConnection);

impl Holders {
    async fn new(bouncer: &Bouncer) -> Self {
        Self(bouncer.client().await, bouncer.client().await)
    }

    /// Takes both server connections, leaves the claim's statement prepared on one of them only
    /// (`PREPARE`d by hand, as a claim there would have), and releases them, the prepared one
    /// first or last. Returns the server processes (unprepared, prepared).
    async fn arrange(&mut self, release_prepared_first: bool) -> (String, String) {
        let Self(unprepared, prepared) = self;
        simple(unprepared, "BEGIN").await;
        simple(prepared, "BEGIN").await;
        let (unprepared_pid, prepared_pid) = (backend(unprepared).await, backend(prepared).await);
        assert_ne!(unprepared_pid, prepared_pid, "two server connections");
        if has_the_claim_prepared(unprepared).await {
            simple(
                unprepared,
                &format!("DEALLOCATE {}", statements::CLAIM_NAME),
            )
            .await;
        }
        if !has_the_claim_prepared(prepared).await {
            simple(prepared, statements::PREPARE_CLAIM).await;
        }
        let order = if release_prepared_first {
            [prepared, unprepared]
        } else {
            [unprepared, prepared]
        };
        for holder in order {
            simple(holder, "COMMIT").await;
        }
        (unprepared_pid, prepared_pid)
    }
}

/// Claims `key` through `pool` with the engine's claim; panics unless the key is ours.
async fn claim_key(pool: &PgPool, key: &str) -> (store::Transaction, store::Owner) {
    let (tenant, key) = (tenant(1), Key::parse(key).unwrap());
    let (fingerprint, request) = (
        Fingerprint::from_slice(&[7; 32]).unwrap(),
        serde_json::json!({"amount": 1}),
    );
    let claim = claim_of(&tenant, &key, &fingerprint, &request);
    let connection = pool.acquire().await.unwrap();
    match store::begin_claim(connection, &claim, &Limits::default()).await {
        Ok(Claimed::Owned(transaction, owner)) => (transaction, owner),
        Ok(Claimed::Lost(_)) => panic!("{key}: a new key is ours, not lost"),
        Err(error) => panic!("{key}: {error}"),
    }
}

/// The claim's `PREPARE` done on one server connection, the claim sent on another (pgbouncer hands
/// out the connection released last, here the unprepared one): "prepared statement does not
/// exist", rolled back, prepared again where the claim runs, and the claim succeeds there.
/// Plain SQL through the simple query protocol: runs on any pgbouncer.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_landing_where_its_statement_was_never_prepared_prepares_it_there(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let direct = direct(options, &connect).await;
    let bouncer = Bouncer::start(&connect, Settings::default()).await;
    let pool = bouncer.engine_pool(4).await;
    let (unprepared, _) = Holders::new(&bouncer).await.arrange(true).await;

    let (mut transaction, owner) = claim_key(&pool, "k").await;
    assert_eq!(
        backend(&mut transaction).await,
        unprepared,
        "the claim ran on the connection that had no prepared claim"
    );
    assert!(
        has_the_claim_prepared(&mut transaction).await,
        "and prepared it there"
    );
    transaction.commit().await.unwrap();
    assert_eq!(owner.lock_version(), 1 << 40);
    assert_eq!(key_row(&direct, "k").await.unwrap().0, "started");
}

/// The claim's statement missing twice: with `server_round_robin = 1` pgbouncer hands out the
/// server connection idle longest, so the claim's `EXECUTE` lands on the one without the statement
/// and its `PREPARE` on the one that has it ("already exists", ignored), twice; the third form,
/// the insert written out in full, claims the key where the statement is still not prepared.
///
/// Not every time: when sqlx sends its next message before pgbouncer has read the server's
/// ReadyForQuery for the last one, pgbouncer keeps the client on that server connection, so the
/// second `EXECUTE` may follow the `PREPARE` onto the prepared connection and succeed there. Each
/// try claims a new key; the full statement must be seen within 50 tries (most tries see it), and
/// every claim, whichever form won, must hold.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn a_claim_missing_its_statement_twice_claims_with_the_full_statement(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let direct = direct(options, &connect).await;
    let bouncer = Bouncer::start(
        &connect,
        Settings {
            round_robin: true,
            ..Settings::default()
        },
    )
    .await;
    let pool = bouncer.engine_pool(4).await;
    let mut holders = Holders::new(&bouncer).await;
    let mut prepared_form = 0;
    let full_form = loop {
        assert!(
            prepared_form < 50,
            "the full statement never claimed in {prepared_form} tries"
        );
        // Round robin hands out the connection idle longest: the unprepared one, released first.
        let (unprepared, prepared) = holders.arrange(false).await;
        let key = format!("k{prepared_form}");
        let (mut transaction, owner) = claim_key(&pool, &key).await;
        let (on, has) = (
            backend(&mut transaction).await,
            has_the_claim_prepared(&mut transaction).await,
        );
        transaction.commit().await.unwrap();
        assert_eq!(owner.lock_version(), 1 << 40);
        assert_eq!(key_row(&direct, &key).await.unwrap().0, "started");
        if on == unprepared && !has {
            break key;
        }
        // Otherwise the prepared form won, on a connection that has the statement.
        assert!(
            has,
            "claimed on {on} (unprepared {unprepared}, prepared {prepared}) without the statement"
        );
        prepared_form += 1;
    };
    eprintln!("the full statement claimed after {prepared_form} claims by the prepared one");

    // A key claimed already, through the fallback too: lost to the committed claim, not an error.
    holders.arrange(false).await;
    let (tenant, key) = (tenant(1), Key::parse(&full_form).unwrap());
    let (fingerprint, request) = (
        Fingerprint::from_slice(&[7; 32]).unwrap(),
        serde_json::json!({"amount": 1}),
    );
    let connection = pool.acquire().await.unwrap();
    assert!(matches!(
        store::begin_claim(
            connection,
            &claim_of(&tenant, &key, &fingerprint, &request),
            &Limits::default()
        )
        .await,
        Ok(Claimed::Lost(_))
    ));
}

/// `PoolSettings` sends its session limits as the startup parameter `options`: PgBouncer refuses
/// the connection unless `ignore_startup_parameters` lists `options` (as it must list
/// `extra_float_digits`, which sqlx sends on every connection), and then the limits are silently
/// lost. Set on the role (or database) on the server, they hold on every server connection.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn session_limits_given_at_startup_are_refused_or_lost(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let direct = direct(options, &connect).await;
    let settings = PoolSettings::default();

    let strict = Bouncer::start(
        &connect,
        Settings {
            ignore_startup_parameters: "",
            ..Settings::default()
        },
    )
    .await;
    let refused = PgConnection::connect_with(&settings.connect_options(strict.connect.clone()))
        .await
        .expect_err("refused");
    assert!(
        refused
            .to_string()
            .contains("unsupported startup parameter"),
        "{refused}"
    );
    // sqlx's extra_float_digits alone is refused too.
    let refused = PgConnection::connect_with(&strict.connect)
        .await
        .expect_err("refused");
    assert!(
        refused.to_string().contains("extra_float_digits"),
        "{refused}"
    );
    // Without it (sqlx's `extra_float_digits(None)`) and without options, it connects.
    let mut plain = PgConnection::connect_with(&strict.connect.clone().extra_float_digits(None))
        .await
        .unwrap();
    simple(&mut plain, "SELECT 1::text").await;
    drop(strict);

    let ignoring = Bouncer::start(&connect, Settings::default()).await;
    let mut connection =
        PgConnection::connect_with(&settings.connect_options(ignoring.connect.clone()))
            .await
            .unwrap();
    assert_eq!(
        simple(&mut connection, "SHOW statement_timeout").await,
        "0",
        "the 30 s statement_timeout of PoolSettings never reached the server"
    );
    assert_eq!(
        simple(&mut connection, "SHOW idle_in_transaction_session_timeout").await,
        "0"
    );
    drop(connection);
    drop(ignoring);

    // Where they hold: on the server, for the role (or the database), read by every new server
    // connection.
    let role = connect.get_username();
    let database = connect.get_database().unwrap();
    for setting in [
        "statement_timeout = '30s'",
        "idle_in_transaction_session_timeout = '30s'",
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "ALTER ROLE \"{role}\" IN DATABASE \"{database}\" SET {setting}"
        )))
        .execute(&direct)
        .await
        .unwrap();
    }
    let on_the_role = Bouncer::start(&connect, Settings::default()).await;
    let mut connection =
        PgConnection::connect_with(&settings.connect_options(on_the_role.connect.clone()))
            .await
            .unwrap();
    assert_eq!(
        simple(&mut connection, "SHOW statement_timeout").await,
        "30s"
    );
    assert_eq!(
        simple(&mut connection, "SHOW idle_in_transaction_session_timeout").await,
        "30s"
    );
    // (The database is dropped after the test, and with it these settings.)
}

/// `LISTEN` through a transaction pooler is accepted, and then nothing is heard: the `LISTEN`
/// ran on a server connection that went back to the pool at once, and the listening client has
/// no server connection while it waits. No error tells the listener so.
///
/// Worse, that server connection stays subscribed while pgbouncer hands it to other clients: a
/// notification reaches whichever client's transaction ends on it (the server sends it before
/// the ReadyForQuery), and sqlx, which expects none on a connection that never listened, fails
/// that client's statement ("unexpected message: NotificationResponse"), here a COMMIT that
/// committed. With one server connection, deterministically.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn listen_through_a_transaction_pooler_hears_nothing_and_fails_other_clients(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    let direct = direct(options, &connect).await;
    let bouncer = Bouncer::start(
        &connect,
        Settings {
            pool_size: 1,
            ..Settings::default()
        },
    )
    .await;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(bouncer.connect.clone())
        .await
        .unwrap();
    // As the resumer listens: PgListener on the engine's pool's connect options.
    let mut listener = PgListener::connect_with(&pool).await.unwrap();
    listener.listen(store::DUE_CHANNEL).await.unwrap();
    let mut direct_listener = PgListener::connect_with(&direct).await.unwrap();
    direct_listener.listen(store::DUE_CHANNEL).await.unwrap();
    let notify = format!("NOTIFY {}", store::DUE_CHANNEL);

    // Announced while no client uses the subscribed server connection: lost.
    sqlx::raw_sql(sqlx::AssertSqlSafe(notify.clone()))
        .execute(&direct)
        .await
        .unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(5), direct_listener.recv())
        .await
        .expect("a direct listener hears the notification")
        .unwrap();
    assert_eq!(heard.channel(), store::DUE_CHANNEL);
    let through = tokio::time::timeout(Duration::from_secs(2), listener.recv()).await;
    assert!(
        through.is_err(),
        "the listener through pgbouncer heard {through:?}"
    );

    // Announced while another client's transaction holds that server connection: the server
    // delivers it when the transaction ends, before its ReadyForQuery, so the client's COMMIT
    // fails, though it committed.
    let mut client = bouncer.client().await;
    simple(&mut client, "BEGIN").await;
    simple(&mut client, "CREATE TABLE committed (id int)").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(notify))
        .execute(&direct)
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), direct_listener.recv())
        .await
        .expect("a direct listener hears the notification")
        .unwrap();
    let failed = sqlx::raw_sql("COMMIT")
        .execute(&mut client)
        .await
        .expect_err("a notification for the listener, at the end of another client's transaction");
    assert!(
        failed.to_string().contains("NotificationResponse"),
        "{failed}"
    );
    assert_eq!(
        count(
            &direct,
            "SELECT count(*) FROM pg_tables WHERE tablename = 'committed'"
        )
        .await,
        1,
        "the failed COMMIT committed"
    );
    let through = tokio::time::timeout(Duration::from_millis(200), listener.recv()).await;
    assert!(through.is_err(), "and the listener still heard nothing");
}

/// The protocol as real requests through pgbouncer, 6 client connections over 2 server
/// connections: new keys claimed and finished (a local-only and a checkout workflow), replays,
/// 409 for a concurrent duplicate, 422 for another body, and a takeover after the lease ran out.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_protocol_runs_through_a_transaction_pooler(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    if !runs_the_engine("the_protocol_runs_through_a_transaction_pooler") {
        return;
    }
    logs();
    let direct = direct(options, &connect).await;
    create_orders(&direct).await;
    let bouncer = Bouncer::start(&connect, Settings::default()).await;
    let pool = bouncer.engine_pool(6).await;
    let harness = Harness::default();
    let runner = Runner::new(pool.clone());
    let (checkout, local_only) = (Arc::new(harness.checkout()), harness.local_only());
    let one = tenant(1);

    // New keys, claimed and finished; their retries replay.
    let placed = executed(&run(&runner, &local_only, &one, "local", &body(5)).await).clone();
    assert_eq!(placed.status, 201);
    let paid = executed(&run(&runner, &checkout, &one, "checkout", &body(100)).await).clone();
    assert_eq!(paid.status, 201);
    for _ in 0..3 {
        assert_eq!(
            run(&runner, &local_only, &one, "local", &body(5)).await,
            Outcome::Replayed(placed.clone())
        );
        assert_eq!(
            run(&runner, &checkout, &one, "checkout", &body(100)).await,
            Outcome::Replayed(paid.clone())
        );
    }
    // The same key with another body.
    assert_eq!(
        run(&runner, &checkout, &one, "checkout", &body(101)).await,
        Outcome::Mismatch
    );
    assert_eq!(
        run(&runner, &local_only, &one, "local", &body(6)).await,
        Outcome::Mismatch
    );

    // A concurrent duplicate while the first is inside its charge: 409.
    harness
        .provider
        .script
        .hang_next
        .store(true, Ordering::SeqCst);
    let first = {
        let (runner, checkout, one) = (runner.clone(), checkout.clone(), one.clone());
        tokio::spawn(async move { run(&runner, &checkout, &one, "busy", &body(7)).await })
    };
    harness.provider.script.entered.notified().await;
    assert!(matches!(
        run(&runner, &checkout, &one, "busy", &body(7)).await,
        Outcome::InProgress { .. }
    ));
    harness.provider.script.resume.notify_one();
    let busy = executed(&first.await.unwrap()).clone();
    assert_eq!(
        run(&runner, &checkout, &one, "busy", &body(7)).await,
        Outcome::Replayed(busy)
    );

    // An owner gone inside its charge; once its lease is rewound, a retry takes over.
    harness
        .provider
        .script
        .hang_next
        .store(true, Ordering::SeqCst);
    let gone = {
        let (runner, checkout, one) = (runner.clone(), checkout.clone(), one.clone());
        tokio::spawn(async move { run(&runner, &checkout, &one, "gone", &body(8)).await })
    };
    harness.provider.script.entered.notified().await;
    gone.abort();
    assert!(
        gone.await.unwrap_err().is_cancelled(),
        "the owner vanished mid-charge"
    );
    assert!(matches!(
        run(&runner, &checkout, &one, "gone", &body(8)).await,
        Outcome::InProgress { .. }
    ));
    let (_, _, token_before, _) = key_row(&direct, "gone").await.unwrap();
    expire_lease(&direct, "gone").await;
    let taken_over = executed(&run(&runner, &checkout, &one, "gone", &body(8)).await).clone();
    assert_eq!(taken_over.status, 201);
    let (state, _, token_after, _) = key_row(&direct, "gone").await.unwrap();
    assert_eq!(state, "done");
    // (Tokens are unique, not ordered: the sequence caches per server connection.)
    assert_ne!(token_after, token_before, "the takeover drew a new token");

    // One order per key; one charge per checkout key, the vanished one's repeated under the same
    // derived key.
    assert_eq!(count(&direct, "SELECT count(*) FROM orders").await, 4);
    assert_eq!(
        count(&direct, "SELECT count(DISTINCT key) FROM orders").await,
        4
    );
    assert_eq!(harness.provider.charge_count(), 3);
    let calls = harness.provider.calls.lock().unwrap().clone();
    assert_eq!(calls["1:checkout:charge"], 1);
    assert_eq!(calls["1:busy:charge"], 1);
    assert_eq!(calls["1:gone:charge"], 2);
    assert_eq!(
        count(
            &direct,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'done'"
        )
        .await,
        4
    );
}

/// 50 concurrent requests over 10 keys (5 of each) through 6 client and 2 server connections:
/// exactly one execution per key, every other request a 409 or the replay.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn fifty_concurrent_requests_over_ten_keys_execute_each_key_once(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    if !runs_the_engine("fifty_concurrent_requests_over_ten_keys_execute_each_key_once") {
        return;
    }
    logs();
    let direct = direct(options, &connect).await;
    create_orders(&direct).await;
    let bouncer = Bouncer::start(&connect, Settings::default()).await;
    let pool = bouncer.engine_pool(6).await;
    let harness = Harness::default();
    // A slow provider keeps the leases live while the duplicates arrive.
    *harness.provider.delay.lock().unwrap() = Some(Duration::from_millis(100));
    let runner = Runner::new(pool.clone());
    let workflow = Arc::new(harness.checkout());

    let mut requests = Vec::new();
    for n in 0..50_i64 {
        let (runner, workflow) = (runner.clone(), workflow.clone());
        requests.push(tokio::spawn(async move {
            let key = format!("key-{}", n % 10);
            let outcome = run(&runner, &workflow, &tenant(1), &key, &body(n % 10)).await;
            (key, outcome)
        }));
    }
    let mut executions = std::collections::HashMap::<String, usize>::new();
    for request in requests {
        let (key, outcome) = request.await.unwrap();
        match outcome {
            Outcome::Executed(response) => {
                assert_eq!(response.status, 201);
                *executions.entry(key).or_default() += 1;
            }
            Outcome::InProgress { .. } | Outcome::Replayed(_) => {}
            other => panic!("{key}: unexpected {other:?}"),
        }
    }
    assert_eq!(executions.len(), 10, "every key executed: {executions:?}");
    assert!(
        executions.values().all(|&n| n == 1),
        "once each: {executions:?}"
    );
    assert_eq!(count(&direct, "SELECT count(*) FROM orders").await, 10);
    assert_eq!(
        count(&direct, "SELECT count(DISTINCT key) FROM orders").await,
        10
    );
    assert_eq!(harness.provider.charge_count(), 10);
    assert_eq!(harness.provider.call_count(), 10);
    assert_eq!(harness.create.runs.load(Ordering::SeqCst), 10);
    assert_eq!(
        count(
            &direct,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'done'"
        )
        .await,
        10
    );
}

fn resumer(pool: &PgPool, harness: &Harness, config: ResumerConfig) -> Resumer<PgStore> {
    let mut registry = Registry::new();
    registry
        .register(harness.checkout_with_failure_path())
        .unwrap();
    Resumer::with_config(Runner::new(pool.clone()), registry, config)
}

/// Leaves `keys` started through the pooler: each request's charge fails once (retried after a
/// minute), so each key waits at `create_order` with its order made.
async fn interrupted_keys(runner: &Runner<PgStore>, harness: &Harness, keys: &[&str]) {
    let workflow = harness.checkout_with_failure_path();
    for key in keys {
        harness.provider.script.fail_next.store(1, Ordering::SeqCst);
        let outcome = run(runner, &workflow, &tenant(1), key, &body(3)).await;
        assert!(
            matches!(outcome, Outcome::Interrupted { .. }),
            "{key}: {outcome:?}"
        );
    }
}

/// The resumer's drain through pgbouncer finishes keys whose leases were rewound, each once.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_resumer_drains_rewound_keys_through_a_transaction_pooler(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    if !runs_the_engine("the_resumer_drains_rewound_keys_through_a_transaction_pooler") {
        return;
    }
    logs();
    let direct = direct(options, &connect).await;
    create_orders(&direct).await;
    let bouncer = Bouncer::start(&connect, Settings::default()).await;
    let pool = bouncer.engine_pool(6).await;
    let harness = Harness::default();
    let keys = ["a", "b", "c", "d", "e", "f", "g", "h"];
    interrupted_keys(&Runner::new(pool.clone()), &harness, &keys).await;
    expire_all_leases(&direct).await;

    let config = ResumerConfig::default().with_retention(None);
    let report = resumer(&pool, &harness, config).drain().await.unwrap();
    assert_eq!(
        report,
        DrainReport {
            taken: 8,
            finished: 8,
            interrupted: 0,
            failed: 0
        }
    );
    assert_eq!(
        count(
            &direct,
            "SELECT count(*) FROM idempotency_keys WHERE state = 'done'"
        )
        .await,
        8
    );
    assert_eq!(
        count(&direct, "SELECT count(*) FROM orders WHERE status = 'paid'").await,
        8
    );
    assert_eq!(count(&direct, "SELECT count(*) FROM orders").await, 8);
    assert_eq!(harness.provider.charge_count(), 8);
}

/// The resumer's `run` loop through pgbouncer: its `LISTEN` is accepted and hears nothing, so a
/// key announced due does not wake it (a resumer that would not scan again for a minute leaves
/// the key alone), and a resumer that polls (`idle_max` short) finishes due keys all the same.
///
/// The keys are left before any resumer runs and announced from outside the pooler: while a
/// resumer's `LISTEN` is subscribed through pgbouncer, an announcement can fail another client's
/// statement (`listen_through_a_transaction_pooler_hears_nothing_and_fails_other_clients`), as
/// the engine's own requests do when a failed attempt announces its key.
#[sqlx::test(migrator = "idemflow::MIGRATOR")]
async fn the_resumers_run_loop_finishes_due_keys_by_polling_without_listen(
    options: PgPoolOptions,
    connect: PgConnectOptions,
) {
    if !runs_the_engine("the_resumers_run_loop_finishes_due_keys_by_polling_without_listen") {
        return;
    }
    logs();
    let direct = direct(options, &connect).await;
    create_orders(&direct).await;
    let bouncer = Bouncer::start(&connect, Settings::default()).await;
    let pool = bouncer.engine_pool(6).await;
    let harness = Harness::default();
    // Left at create_order (the charge failed, retried in a minute), before anyone listens.
    interrupted_keys(
        &Runner::new(pool.clone()),
        &harness,
        &["announced", "polled"],
    )
    .await;
    let stop = Arc::new(tokio::sync::Notify::new());
    let start = |config: ResumerConfig| {
        let stop = stop.clone();
        tokio::spawn(resumer(&pool, &harness, config).run(async move { stop.notified().await }))
    };

    // Deaf: after its first, empty scan it would be woken only by a notification.
    let worker = start(
        ResumerConfig::default()
            .with_idle_min(Duration::from_secs(60))
            .with_idle_max(Duration::from_secs(60))
            .with_retention(None),
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The lease ended and announced, as `idemflow end-lease` does.
    expire_lease(&direct, "announced").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "NOTIFY {}",
        store::DUE_CHANNEL
    )))
    .execute(&direct)
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        key_row(&direct, "announced").await.unwrap().0,
        "started",
        "the notification never reached the resumer through pgbouncer"
    );
    stop.notify_one();
    worker.await.unwrap();

    // Polling, without LISTEN (what docs/operations.md says to set behind a transaction pooler):
    // idle waits of 10 to 50 ms.
    let subscribed = "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND query ILIKE 'LISTEN%'";
    // The deaf worker left a server connection subscribed: this pgbouncer goes, and a fresh one
    // serves the rest.
    drop(pool);
    drop(bouncer);
    let bouncer = Bouncer::start(&connect, Settings::default()).await;
    let pool = bouncer.engine_pool(6).await;
    let start = |config: ResumerConfig| {
        let stop = stop.clone();
        tokio::spawn(resumer(&pool, &harness, config).run(async move { stop.notified().await }))
    };
    let worker = start(
        ResumerConfig::default()
            .with_idle_min(Duration::from_millis(10))
            .with_idle_max(Duration::from_millis(50))
            .with_retention(None)
            .with_listen(false),
    );
    eventually(
        &direct,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        1,
    )
    .await;
    // A lease rewound while it runs, nothing announced: found by the next poll.
    assert_eq!(key_row(&direct, "polled").await.unwrap().0, "started");
    expire_lease(&direct, "polled").await;
    eventually(
        &direct,
        "SELECT count(*) FROM idempotency_keys WHERE state = 'done'",
        2,
    )
    .await;
    // No server connection is subscribed, so announcements break no one: requests through
    // the same two server connections, each followed by an announcement, all answered.
    assert_eq!(
        count(&direct, subscribed).await,
        0,
        "a LISTEN went through the pooler"
    );
    let runner = Runner::new(pool.clone());
    let workflow = harness.local_only();
    for index in 0..20 {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "NOTIFY {}",
            store::DUE_CHANNEL
        )))
        .execute(&direct)
        .await
        .unwrap();
        let key = idemflow::Key::parse(&format!("after-notify-{index}")).unwrap();
        let outcome = runner
            .run(&workflow, &tenant(1), &key, request(&body(index)))
            .await;
        assert!(matches!(outcome, Ok(Outcome::Executed(_))), "{outcome:?}");
    }
    stop.notify_one();
    worker.await.unwrap();
    assert_eq!(count(&direct, "SELECT count(*) FROM orders").await, 22);
    assert_eq!(harness.provider.charge_count(), 2);
}
