//! What the scripted workflow and the consumer's handler do inside the engine's own transactions,
//! per engine: the effects they commit, and the acts that misbehave there (a statement or a write
//! that never ends, a commit a deferred constraint refuses, a statement that commits the
//! transaction around itself).

use async_trait::async_trait;
use idemflow_consumer::ConsumerStore;
use idemflow_mysql::MySqlStore;
use idemflow_pg::PgStore;
use idemflow_runner::ConnectionOf;
use idemflow_sqlite::SqliteStore;

/// An engine the schedule explorer runs on.
#[async_trait]
pub trait SimEngine: ConsumerStore + idemflow_store::Tamper {
    /// One write transaction at a time on the whole database (SQLite): a run held inside one
    /// holds every other writer, the operator's too, until it moves on.
    const ONE_WRITER: bool;

    /// Now by the database's clock, in seconds since the Unix epoch (the clock its leases use).
    async fn clock(connection: &mut ConnectionOf<Self>) -> Result<f64, sqlx::Error>;

    /// Records a local phase's effect: one row naming the key, its life, the phase, the token,
    /// and the claim (the key's creation time as text) it ran under.
    async fn effect(
        connection: &mut ConnectionOf<Self>,
        tenant: &str,
        key: &str,
        life: i64,
        phase: &str,
        lock_version: i64,
    ) -> Result<(), sqlx::Error>;

    /// A statement that runs until something stops it.
    async fn hang(connection: &mut ConnectionOf<Self>) -> Result<(), sqlx::Error>;

    /// A write that runs until something stops it (into `sim_scratch`). Interrupted, SQLite
    /// rolls its whole transaction back; PostgreSQL and MariaDB roll back the statement.
    async fn hang_writing(connection: &mut ConnectionOf<Self>) -> Result<(), sqlx::Error>;

    /// Sends `sql` as it is (the simple query protocol), as a phase's own statement would be.
    async fn execute(
        connection: &mut ConnectionOf<Self>,
        sql: &'static str,
    ) -> Result<(), sqlx::Error>;

    /// A statement the database commits around (MariaDB's DDL), where it has one.
    const IMPLICIT_COMMIT: Option<&'static str>;

    /// A write its transaction's commit refuses (a deferred foreign key left dangling).
    async fn break_commit(connection: &mut ConnectionOf<Self>) -> Result<(), sqlx::Error>;

    /// The consumer's effect: one ledger row for the message.
    async fn apply(
        connection: &mut ConnectionOf<Self>,
        message_id: &str,
    ) -> Result<(), sqlx::Error>;
}

#[async_trait]
impl SimEngine for PgStore {
    const ONE_WRITER: bool = false;

    async fn clock(connection: &mut sqlx::PgConnection) -> Result<f64, sqlx::Error> {
        sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
            .fetch_one(connection)
            .await
    }

    async fn effect(
        connection: &mut sqlx::PgConnection,
        tenant: &str,
        key: &str,
        life: i64,
        phase: &str,
        lock_version: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO sim_effects (tenant, key, life, phase, lock_version, claimed_at) \
             SELECT $1, $2, $3, $4, $5, \
                    (SELECT created_at::text FROM idempotency_keys WHERE tenant = $1 AND key = $2)",
        )
        .bind(tenant)
        .bind(key)
        .bind(life)
        .bind(phase)
        .bind(lock_version)
        .execute(connection)
        .await
        .map(drop)
    }

    async fn hang(connection: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT pg_sleep(3600)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn hang_writing(connection: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_scratch (n) SELECT 1 FROM pg_sleep(3600)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn execute(
        connection: &mut sqlx::PgConnection,
        sql: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(connection).await.map(drop)
    }

    const IMPLICIT_COMMIT: Option<&'static str> = None;

    async fn break_commit(connection: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_orphans (parent) VALUES (1)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn apply(
        connection: &mut sqlx::PgConnection,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_ledger (message_id) VALUES ($1)")
            .bind(message_id)
            .execute(connection)
            .await
            .map(drop)
    }
}

#[async_trait]
impl SimEngine for SqliteStore {
    const ONE_WRITER: bool = true;

    async fn clock(connection: &mut sqlx::SqliteConnection) -> Result<f64, sqlx::Error> {
        sqlx::query_scalar("SELECT unixepoch('subsec')")
            .fetch_one(connection)
            .await
    }

    async fn effect(
        connection: &mut sqlx::SqliteConnection,
        tenant: &str,
        key: &str,
        life: i64,
        phase: &str,
        lock_version: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO sim_effects (tenant, key, life, phase, lock_version, claimed_at) \
             SELECT ?1, ?2, ?3, ?4, ?5, \
                    (SELECT CAST(created_at AS TEXT) FROM idempotency_keys \
                     WHERE tenant = ?1 AND key = ?2)",
        )
        .bind(tenant)
        .bind(key)
        .bind(life)
        .bind(phase)
        .bind(lock_version)
        .execute(connection)
        .await
        .map(drop)
    }

    async fn hang(connection: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        // Counts for ever: only the connection's statement timeout ends it.
        sqlx::query(
            "WITH RECURSIVE forever(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM forever) \
             SELECT count(*) FROM forever",
        )
        .execute(connection)
        .await
        .map(drop)
    }

    async fn hang_writing(connection: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        // Writes for ever: only the connection's statement timeout ends it, and SQLite rolls the
        // whole transaction back with it.
        sqlx::query(
            "INSERT INTO sim_scratch (n) \
             WITH RECURSIVE forever(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM forever) \
             SELECT n FROM forever",
        )
        .execute(connection)
        .await
        .map(drop)
    }

    async fn execute(
        connection: &mut sqlx::SqliteConnection,
        sql: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(connection).await.map(drop)
    }

    const IMPLICIT_COMMIT: Option<&'static str> = None;

    async fn break_commit(connection: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_orphans (parent) VALUES (1)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn apply(
        connection: &mut sqlx::SqliteConnection,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_ledger (message_id) VALUES (?1)")
            .bind(message_id)
            .execute(connection)
            .await
            .map(drop)
    }
}

#[async_trait]
impl SimEngine for MySqlStore {
    const ONE_WRITER: bool = false;

    async fn clock(connection: &mut sqlx::MySqlConnection) -> Result<f64, sqlx::Error> {
        sqlx::query_scalar(
            "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) / 1e6",
        )
        .fetch_one(connection)
        .await
    }

    async fn effect(
        connection: &mut sqlx::MySqlConnection,
        tenant: &str,
        key: &str,
        life: i64,
        phase: &str,
        lock_version: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "INSERT INTO sim_effects (tenant, `key`, life, phase, lock_version, claimed_at) \
             SELECT ?, ?, ?, ?, ?, \
                    (SELECT CAST(created_at AS CHAR) FROM idempotency_keys \
                     WHERE tenant = ? AND `key` = ?)",
        )
        .bind(tenant)
        .bind(key)
        .bind(life)
        .bind(phase)
        .bind(lock_version)
        .bind(tenant)
        .bind(key)
        .execute(connection)
        .await
        .map(drop)
    }

    async fn hang(connection: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        // Sleeps for an hour: only the session's statement timeout (`max_statement_time`) ends it.
        sqlx::query("SELECT SLEEP(3600)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn hang_writing(connection: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_scratch (n) SELECT SLEEP(3600)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn execute(
        connection: &mut sqlx::MySqlConnection,
        sql: &'static str,
    ) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(connection).await.map(drop)
    }

    const IMPLICIT_COMMIT: Option<&'static str> =
        Some("CREATE TABLE IF NOT EXISTS sim_ddl (x INT) ENGINE = InnoDB");

    /// InnoDB checks foreign keys at once (it has no deferred constraints): the write fails its
    /// own statement, and the phase fails with it, rather than at the commit.
    async fn break_commit(connection: &mut sqlx::MySqlConnection) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_orphans (parent) VALUES (1)")
            .execute(connection)
            .await
            .map(drop)
    }

    async fn apply(
        connection: &mut sqlx::MySqlConnection,
        message_id: &str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO sim_ledger (message_id) VALUES (?)")
            .bind(message_id)
            .execute(connection)
            .await
            .map(drop)
    }
}
