//! idemflow: durable multi-phase requests made safe by idempotency keys, on PostgreSQL, SQLite,
//! MySQL/MariaDB or Redis.
//!
//! A client sends an idempotency key with a request. The first attempt runs the request as an
//! ordered chain of typed phases; every retry with the same key gets the first result back; the
//! same key with a different request is refused; a crash at any point is finished later from the
//! last recovery point, without doing any effect twice. See `docs/ARCHITECTURE.md`.
//!
//! This crate gathers the parts, each engine by a feature, so a program compiles the database
//! drivers of the engines it names and no other:
//!
//! | feature | brings |
//! |---|---|
//! | `sqlite` (default) | `sqlite`: the embedded engine, `SqliteStore`, a database file opened with `sqlite::open_file` |
//! | `postgres` | `postgres`: `PgStore`, a `PgPool` with `postgres::PoolSettings`, `postgres::migrate`, the partitioned layout |
//! | `mysql` | `mysql`: `MySqlStore`, `mysql::open` |
//! | `redis` | `redis`: `RedisStore`, for workflows whose phases are all foreign |
//! | `http` (default) | `http`: the Idempotency-Key layer for axum/tower |
//! | `openapi` | `http::openapi`: the layer's headers and problems as OpenAPI 3.1 components (utoipa) |
//! | `client` | `client`: a client that sends requests under Idempotency-Keys |
//! | `cli` | the `idemflow` operator binary, over the engines the other features name |
//! | `crash-hooks` | crash points, for tests (dev-dependencies only) |
//!
//! SQLite is the default so a first program runs with no server; `default-features = false,
//! features = ["http", "postgres"]` builds no SQLite.
//!
//! Whatever the engine:
//! - [`core`]: keys, tenants, canonical JSON fingerprints and the claim decision (pure, no IO);
//! - the runner, workflows and phases, re-exported at the top level, generic over the engine
//!   ([`Engine`], [`SqlEngine`]: a workflow, its local phases and its runner name one);
//! - [`consumer`]: the idempotent consumer, a message applied at most once per subscriber;
//! - [`operator`]: what operators' tools read and do, on any engine, opened by URL;
//! - [`metrics`]: the runner's metric catalogue.
//!
//! At the top level, what an application uses:
//!
//! | to | use |
//! |---|---|
//! | write a workflow | [`Workflow::builder`], [`LocalPhase`], [`ForeignPhase`], [`PhaseContext`], [`PhaseError`], [`PhaseResultExt`], [`RetryPolicy`], [`TerminalPolicy`], [`StoredResponse`], [`macro@async_trait`] |
//! | run it | [`Runner`], [`RunnerConfig`], [`Request`], [`Outcome`], [`Rejection`], [`RunError`], [`TenantId`], [`Key`] |
//! | finish what a crash left | [`Resumer`], [`ResumerConfig`], [`Registry`], [`DrainReport`], [`shutdown_signal`] |
//! | expire old keys | [`Retention`], [`expire`], [`expire_paced`] |
//! | choose an engine | a feature, then its module: `sqlite::open_file`, `postgres::PoolSettings`, `mysql::open`, `redis::RedisPool::connect` |
//! | write a local phase's SQL | [`sqlx`] (with the drivers of the engines built), the engine's connection (`sqlx::SqliteConnection`, …) |
//! | seal stored bodies | [`Keyring`] |
//! | test crash points | `CrashHook`, `CrashPoint`, `Runner::with_crash_hook`: feature `crash-hooks`, for dev-dependencies (and the `idemflow-testkit` crate) |
//!
//! The statement-level store functions, the engines' internals and the engine's own test rig are
//! not part of this API: they live in `idemflow-pg`, `idemflow-store` and friends, whose
//! interfaces change with the engine.

#![deny(missing_docs)]

pub use idemflow_consumer as consumer;
pub use idemflow_core as core;

/// The Idempotency-Key layer for axum/tower: a workflow as a route ([`http::WorkflowService`]),
/// or any handler behind [`http::IdempotencyLayer`]; problem+json errors. The `http` feature (on
/// by default).
#[cfg(feature = "http")]
pub use idemflow_http as http;

/// A client for APIs that take an Idempotency-Key: one key per intent, kept in a journal, sent
/// again on retryable answers ([`client::IdempotentClient`]). The `client` feature.
#[cfg(feature = "client")]
pub use idemflow_client as client;

/// PostgreSQL (the `postgres` feature): its engine ([`postgres::PgStore`]), the pool it runs best
/// on ([`postgres::PoolSettings`]), its migrations, the partitioned layout
/// ([`postgres::partitions`]), and what an application does besides running workflows: a key's
/// report and the stuck keys, ending a lease, the table's statistics and the resumer's lag, the
/// channel a resumer listens on. The statements a request sends are the engine's own business
/// and not part of this API.
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use idemflow_pg::partitions;
    pub use idemflow_pg::{
        DUE_CHANNEL, KeyReport, MIGRATOR, PgOperator, PgStore, PoolSettings, StoreError,
        TableStats, Transaction, end_lease, key_report, migrate, open, resumer_lag, stuck_keys,
        table_stats,
    };
    pub use idemflow_store::sqlx::{PgConnection, PgPool};
}

/// SQLite (the `sqlite` feature, on by default): its engine ([`sqlite::SqliteStore`]), and
/// opening a database file for it: WAL, a busy timeout, the migrations run.
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use idemflow_sqlite::{
        MIGRATOR, OpenOptions, SqliteOperator, SqliteStore, open, open_file,
    };
    pub use idemflow_store::sqlx::{SqliteConnection, SqlitePool};
}

/// MySQL or MariaDB (the `mysql` feature): its engine ([`mysql::MySqlStore`]), and opening a
/// database for it: its session settings, the migrations run.
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use idemflow_mysql::{MIGRATOR, MySqlOperator, MySqlStore, OpenOptions, open};
    pub use idemflow_store::sqlx::{MySqlConnection, MySqlPool};
}

/// Keys in Redis (the `redis` feature): [`redis::open`] (or [`redis::RedisPool::connect`]), then a runner on it runs
/// workflows whose phases are all foreign (`Workflow::<redis::RedisStore>`). A local phase does not
/// compile on it. Redis can lose acknowledged writes (a restart, a failover), and a lost key's
/// retry runs again: docs/engines.md says when that is acceptable.
#[cfg(feature = "redis")]
pub mod redis {
    pub use idemflow_redis::{DEFAULT_PREFIX, RedisOperator, RedisPool, RedisStore, StoreError};

    /// Connects to the Redis at `url`: the same call as the SQL engines' `open`, with nothing to
    /// migrate (the engine's scripts are loaded on first use) and no settings but the URL's.
    pub async fn open(url: &str) -> Result<RedisPool, StoreError> {
        RedisPool::connect(url).await
    }
}

/// What operators' tools read and do, on any engine ([`operator::Operator`]), and the engines
/// this build has, as tools open them by URL ([`operator::engines`]).
pub mod operator {
    pub use idemflow_store::layout;
    pub use idemflow_store::{
        KeyBodies, KeyReport, KeyResponse, Migration, Operator, OperatorEngine, OperatorError,
        OperatorOptions, Overview, Partitions, ScanFrom, TableStats, engine_for,
    };

    /// The engines this build has (its engine features), as tools open them by URL: the CLI and
    /// a standalone console pick the one whose scheme the URL has.
    pub fn engines() -> Vec<&'static dyn OperatorEngine> {
        vec![
            #[cfg(feature = "postgres")]
            &idemflow_pg::PgStore,
            #[cfg(feature = "sqlite")]
            &idemflow_sqlite::SqliteStore,
            #[cfg(feature = "mysql")]
            &idemflow_mysql::MySqlStore,
            #[cfg(feature = "redis")]
            &idemflow_redis::RedisStore,
        ]
    }
}

/// The metrics the runner, the resumer and retention record: their catalogue (name, kind, what it
/// counts) and [`metrics::describe_metrics`], which registers the descriptions with the installed
/// recorder. The HTTP layer's and the consumer's are `http::CATALOGUE` and
/// [`consumer::CATALOGUE`].
pub mod metrics {
    pub use idemflow_runner::{CATALOGUE, describe_metrics};
}

pub use idemflow_core::{DerivedKey, Fingerprint, Key, StoredResponse, TenantId};
#[cfg(feature = "mysql")]
pub use idemflow_mysql::MySqlStore;
#[cfg(feature = "postgres")]
pub use idemflow_pg::{MIGRATOR, PgStore, PoolSettings, migrate};
#[cfg(feature = "redis")]
pub use idemflow_redis::RedisStore;
pub use idemflow_runner::{
    BuildError, ConnectionOf, DatabaseError, DatabaseErrorKind, DrainReport, Engine, EngineError,
    EnginePool, Failure, FailurePhase, ForeignPhase, Isolation, Keyring, KeyringError, LocalPhase,
    Outcome, PhaseContext, PhaseError, PhaseErrorKind, PhaseResultExt, PhaseValue, PoolOf,
    RegisterError, Registry, Rejection, Request, Resumer, ResumerConfig, Retention, RetryPolicy,
    RunError, Runner, RunnerConfig, SealError, SqlEngine, TerminalPolicy, Workflow,
    WorkflowBuilder, expire, expire_paced, shutdown_signal,
};
/// Crash points, for tests (feature `crash-hooks`, which `idemflow-testkit` enables): a hook that
/// stops a run where a crash would, installed with `Runner::with_crash_hook`.
#[cfg(feature = "crash-hooks")]
pub use idemflow_runner::{CrashHook, CrashPoint};
#[cfg(feature = "sqlite")]
pub use idemflow_sqlite::SqliteStore;
/// The sqlx this engine is built with, with the driver of each engine the build has: a local
/// phase gets its connection (`sqlx::SqliteConnection`, `sqlx::PgConnection`,
/// `sqlx::MySqlConnection`). Use this one (`idemflow::sqlx`) rather than pinning a second copy.
pub use idemflow_store::sqlx;
#[cfg(feature = "mysql")]
pub use idemflow_store::sqlx::{MySqlConnection, MySqlPool};
#[cfg(feature = "postgres")]
pub use idemflow_store::sqlx::{PgConnection, PgPool};
#[cfg(feature = "sqlite")]
pub use idemflow_store::sqlx::{SqliteConnection, SqlitePool};

/// The attribute the phase traits are implemented with (`#[idemflow::async_trait]`), re-exported
/// so an application needs no async-trait dependency of its own.
pub use async_trait::async_trait;

/// The documents' code blocks, compiled (and, unless `no_run`, run) as this crate's doctests:
/// `cargo test --doc -p idemflow`. A Rust block in a document that does not compile fails the
/// test suite, so the documents cannot drift from the code. Every document is listed here
/// (`tests/it/tidy.rs` checks that none is missing).
#[cfg(doctest)]
mod documents {
    #[doc = include_str!("../README.md")]
    mod readme {}
    #[doc = include_str!("../docs/ARCHITECTURE.md")]
    mod architecture {}
    #[doc = include_str!("../docs/benchmarks.md")]
    mod benchmarks {}
    #[doc = include_str!("../docs/cli.md")]
    mod cli {}
    #[doc = include_str!("../docs/client.md")]
    mod client {}
    #[doc = include_str!("../docs/console.md")]
    mod console {}
    #[doc = include_str!("../docs/consumer.md")]
    mod consumer {}
    #[doc = include_str!("../docs/development.md")]
    mod development {}
    #[doc = include_str!("../docs/engines.md")]
    mod engines {}
    #[doc = include_str!("../docs/http.md")]
    mod http {}
    #[doc = include_str!("../docs/mock-provider.md")]
    mod mock_provider {}
    #[doc = include_str!("../docs/operations.md")]
    mod operations {}
    #[doc = include_str!("../docs/protocol.md")]
    mod protocol {}
    #[doc = include_str!("../docs/runner.md")]
    mod runner {}
    #[doc = include_str!("../docs/simulation.md")]
    mod simulation {}
    #[doc = include_str!("../docs/testing-your-workflows.md")]
    mod testing_your_workflows {}
}
