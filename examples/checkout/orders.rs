//! The example's own statements, per engine (a real service would create its table in its own
//! migrations): its orders table, written by the workflow's local
//! phases in the engine's transaction and read by `GET /v1/checkouts/{order_id}`. Everything else
//! (claims, leases, recovery points, responses) is idemflow's.

use idemflow::{ConnectionOf, MySqlStore, PgStore, PoolOf, SqlEngine, SqliteStore, sqlx};

/// An order as `GET /v1/checkouts/{order_id}` shows it.
#[derive(Debug, sqlx::FromRow, serde::Serialize, utoipa::ToSchema)]
pub struct OrderRow {
    pub order_id: i64,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub charge_id: Option<String>,
}

/// The example's statements on one engine.
#[idemflow::async_trait]
pub trait Shop: SqlEngine {
    /// Creates the orders table if it is not there (every process at start-up, at once).
    async fn create_orders(pool: &PoolOf<Self>) -> Result<(), sqlx::Error>;
    /// Inserts an order; its id.
    async fn insert_order(
        connection: &mut ConnectionOf<Self>,
        tenant: &str,
        request_key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<i64, sqlx::Error>;
    /// Sets an order's status (and its charge, when paid).
    async fn set_status(
        connection: &mut ConnectionOf<Self>,
        order_id: i64,
        status: &str,
        charge_id: Option<&str>,
    ) -> Result<(), sqlx::Error>;
    /// One tenant's order.
    async fn order(
        pool: &PoolOf<Self>,
        tenant: &str,
        order_id: i64,
    ) -> Result<Option<OrderRow>, sqlx::Error>;
    /// Whether the database answers.
    async fn ping(pool: &PoolOf<Self>) -> bool;
}

/// The orders table on PostgreSQL.
pub const PG_ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS checkout_orders (
    id         bigserial PRIMARY KEY,
    tenant     text   NOT NULL,
    -- The idempotency key of the request that created it: which request an order belongs to.
    request_key text  NOT NULL,
    amount     bigint NOT NULL CHECK (amount > 0),
    currency   text   NOT NULL,
    status     text   NOT NULL DEFAULT 'created',
    charge_id  text
)";

/// The orders table on SQLite.
pub const SQLITE_ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS checkout_orders (
    id          INTEGER PRIMARY KEY,
    tenant      TEXT    NOT NULL,
    request_key TEXT    NOT NULL,
    amount      INTEGER NOT NULL CHECK (amount > 0),
    currency    TEXT    NOT NULL,
    status      TEXT    NOT NULL DEFAULT 'created',
    charge_id   TEXT
) STRICT";

/// The orders table on MySQL/MariaDB.
pub const MYSQL_ORDERS_TABLE: &str = "CREATE TABLE IF NOT EXISTS checkout_orders (
    id          BIGINT AUTO_INCREMENT PRIMARY KEY,
    tenant      VARCHAR(128) NOT NULL,
    request_key VARBINARY(255) NOT NULL,
    amount      BIGINT NOT NULL CHECK (amount > 0),
    currency    VARCHAR(3) NOT NULL,
    status      VARCHAR(16) NOT NULL DEFAULT 'created',
    charge_id   VARCHAR(128)
) ENGINE = InnoDB";

const MYSQL_SELECT_ORDER: &str = "SELECT id AS order_id, amount, currency, status, charge_id \
     FROM checkout_orders WHERE id = ? AND tenant = ?";

const SELECT_ORDER: &str = "SELECT id AS order_id, amount, currency, status, charge_id \
     FROM checkout_orders WHERE id = $1 AND tenant = $2";

const SQLITE_SELECT_ORDER: &str = "SELECT id AS order_id, amount, currency, status, charge_id \
     FROM checkout_orders WHERE id = ?1 AND tenant = ?2";

#[idemflow::async_trait]
impl Shop for PgStore {
    /// Under a lock of its own, in one transaction: `CREATE TABLE IF NOT EXISTS` checks for the
    /// table before it inserts into the catalog, so two processes creating it at once both find
    /// none and one dies on the catalog's unique index.
    async fn create_orders(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idemflow.examples.checkout.schema'))")
            .execute(&mut *tx)
            .await?;
        sqlx::query(PG_ORDERS_TABLE).execute(&mut *tx).await?;
        tx.commit().await
    }

    async fn insert_order(
        connection: &mut sqlx::PgConnection,
        tenant: &str,
        request_key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO checkout_orders (tenant, request_key, amount, currency) \
             VALUES ($1, $2, $3, $4) RETURNING id",
        )
        .bind(tenant)
        .bind(request_key)
        .bind(amount)
        .bind(currency)
        .fetch_one(connection)
        .await
    }

    async fn set_status(
        connection: &mut sqlx::PgConnection,
        order_id: i64,
        status: &str,
        charge_id: Option<&str>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE checkout_orders SET status = $2, charge_id = coalesce($3, charge_id) \
             WHERE id = $1",
        )
        .bind(order_id)
        .bind(status)
        .bind(charge_id)
        .execute(connection)
        .await
        .map(drop)
    }

    async fn order(
        pool: &sqlx::PgPool,
        tenant: &str,
        order_id: i64,
    ) -> Result<Option<OrderRow>, sqlx::Error> {
        sqlx::query_as(SELECT_ORDER)
            .bind(order_id)
            .bind(tenant)
            .fetch_optional(pool)
            .await
    }

    async fn ping(pool: &sqlx::PgPool) -> bool {
        sqlx::query("SELECT 1").execute(pool).await.is_ok()
    }
}

#[idemflow::async_trait]
impl Shop for SqliteStore {
    /// SQLite creates the table under its write lock: two processes at once are serialized.
    async fn create_orders(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
        sqlx::query(SQLITE_ORDERS_TABLE)
            .execute(pool)
            .await
            .map(drop)
    }

    async fn insert_order(
        connection: &mut sqlx::SqliteConnection,
        tenant: &str,
        request_key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(
            "INSERT INTO checkout_orders (tenant, request_key, amount, currency) \
             VALUES (?1, ?2, ?3, ?4) RETURNING id",
        )
        .bind(tenant)
        .bind(request_key)
        .bind(amount)
        .bind(currency)
        .fetch_one(connection)
        .await
    }

    async fn set_status(
        connection: &mut sqlx::SqliteConnection,
        order_id: i64,
        status: &str,
        charge_id: Option<&str>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE checkout_orders SET status = ?2, charge_id = coalesce(?3, charge_id) \
             WHERE id = ?1",
        )
        .bind(order_id)
        .bind(status)
        .bind(charge_id)
        .execute(connection)
        .await
        .map(drop)
    }

    async fn order(
        pool: &sqlx::SqlitePool,
        tenant: &str,
        order_id: i64,
    ) -> Result<Option<OrderRow>, sqlx::Error> {
        sqlx::query_as(SQLITE_SELECT_ORDER)
            .bind(order_id)
            .bind(tenant)
            .fetch_optional(pool)
            .await
    }

    async fn ping(pool: &sqlx::SqlitePool) -> bool {
        sqlx::query("SELECT 1").execute(pool).await.is_ok()
    }
}

#[idemflow::async_trait]
impl Shop for MySqlStore {
    /// `CREATE TABLE IF NOT EXISTS` is atomic on MySQL/MariaDB (the data dictionary's lock): two
    /// processes at once both succeed.
    async fn create_orders(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
        sqlx::query(MYSQL_ORDERS_TABLE)
            .execute(pool)
            .await
            .map(drop)
    }

    async fn insert_order(
        connection: &mut sqlx::MySqlConnection,
        tenant: &str,
        request_key: &str,
        amount: i64,
        currency: &str,
    ) -> Result<i64, sqlx::Error> {
        let inserted = sqlx::query(
            "INSERT INTO checkout_orders (tenant, request_key, amount, currency) \
             VALUES (?, ?, ?, ?)",
        )
        .bind(tenant)
        .bind(request_key)
        .bind(amount)
        .bind(currency)
        .execute(connection)
        .await?;
        i64::try_from(inserted.last_insert_id())
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))
    }

    async fn set_status(
        connection: &mut sqlx::MySqlConnection,
        order_id: i64,
        status: &str,
        charge_id: Option<&str>,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE checkout_orders SET status = ?, charge_id = COALESCE(?, charge_id) \
             WHERE id = ?",
        )
        .bind(status)
        .bind(charge_id)
        .bind(order_id)
        .execute(connection)
        .await
        .map(drop)
    }

    async fn order(
        pool: &sqlx::MySqlPool,
        tenant: &str,
        order_id: i64,
    ) -> Result<Option<OrderRow>, sqlx::Error> {
        sqlx::query_as(MYSQL_SELECT_ORDER)
            .bind(order_id)
            .bind(tenant)
            .fetch_optional(pool)
            .await
    }

    async fn ping(pool: &sqlx::MySqlPool) -> bool {
        sqlx::query("SELECT 1").execute(pool).await.is_ok()
    }
}
