//! idemflow: durable multi-phase requests made safe by idempotency keys, on PostgreSQL, SQLite or
//! MySQL/MariaDB.
//!
//! A client sends an idempotency key with a request. The first attempt runs the request as an
//! ordered chain of typed phases; every retry with the same key gets the first result back; the
//! same key with a different request is refused; a crash at any point is finished later from the
//! last recovery point, without doing any effect twice. See `docs/ARCHITECTURE.md`.
//!
//! This crate gathers the parts:
//! - [`core`]: keys, tenants, canonical JSON fingerprints and the claim decision (pure, no IO);
//! - [`store`]: PostgreSQL's operators' tools and the partitioned layout; the migrations are
//!   [`migrate`] and [`MIGRATOR`];
//! - [`sqlite`] and [`mysql`]: opening those engines' databases (PostgreSQL's pool is sqlx's own);
//! - the runner, workflows and phases, re-exported at the top level;
//! - `http` (the `http` feature, on by default): the Idempotency-Key layer for axum/tower;
//! - `client` (the `client` feature): a client that sends requests under Idempotency-Keys;
//! - `redis` (the `redis` feature): keys in Redis, for workflows whose phases are all foreign;
//! - [`consumer`]: the idempotent consumer, a message applied at most once per subscriber;
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
//! | choose an engine | [`PgPool`] with [`migrate`] (PostgreSQL), [`sqlite::open_file`], [`mysql::open`]; [`PgStore`], [`SqliteStore`], [`MySqlStore`]; [`PoolSettings`] |
//! | write a local phase's SQL | [`sqlx`], [`PgConnection`], [`SqliteConnection`], [`MySqlConnection`] |
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

/// PostgreSQL's store, for what an application does besides running workflows: the partitioned
/// layout ([`store::partitions`]), a key's report and the stuck keys (what `idemflow inspect` and
/// `list --stuck` show), ending a lease, the table's statistics and the resumer's lag, the
/// channel a resumer listens on, and the transaction a consumer's handler writes in. The
/// statements a request sends are the engine's own business and not part of this API.
pub mod store {
    pub use idemflow_pg::partitions;
    pub use idemflow_pg::{
        DUE_CHANNEL, KeyReport, StoreError, TableStats, Transaction, end_lease, key_report,
        resumer_lag, stuck_keys, table_stats,
    };
}

/// The metrics the runner, the resumer and retention record: their catalogue (name, kind, what it
/// counts) and [`metrics::describe_metrics`], which registers the descriptions with the installed
/// recorder. The HTTP layer's and the consumer's are `http::CATALOGUE` and
/// [`consumer::CATALOGUE`].
pub mod metrics {
    pub use idemflow_runner::{CATALOGUE, describe_metrics};
}

/// Opening a SQLite database for the engine: WAL, a busy timeout, the migrations run.
pub mod sqlite {
    pub use idemflow_sqlite::{MIGRATOR, OpenOptions, open, open_file};
}

/// Opening a MySQL or MariaDB database for the engine: its session settings, the migrations run.
pub mod mysql {
    pub use idemflow_mysql::{MIGRATOR, OpenOptions, open};
}

/// Keys in Redis (the `redis` feature): [`redis::RedisPool::connect`], then a runner on it runs
/// workflows whose phases are all foreign (`Workflow::<redis::RedisStore>`). A local phase does not
/// compile on it. Redis can lose acknowledged writes (a restart, a failover), and a lost key's
/// retry runs again: docs/engines.md says when that is acceptable.
#[cfg(feature = "redis")]
pub mod redis {
    pub use idemflow_redis::{DEFAULT_PREFIX, RedisPool, StoreError};
    pub use idemflow_runner::RedisStore;
}

pub use idemflow_core::{DerivedKey, Fingerprint, Key, StoredResponse, TenantId};
pub use idemflow_pg::{MIGRATOR, PoolSettings, migrate};
pub use idemflow_runner::{
    BuildError, ConnectionOf, DrainReport, Engine, EngineError, EngineOf, Failure, FailurePhase,
    ForeignPhase, Keyring, KeyringError, LocalPhase, MySqlStore, Outcome, PgStore, PhaseContext,
    PhaseError, PhaseErrorKind, PhaseResultExt, PhaseValue, PoolEngine, PoolOf, RegisterError,
    Registry, Rejection, Request, Resumer, ResumerConfig, Retention, RetryPolicy, RunError, Runner,
    RunnerConfig, SealError, SqlEngine, SqliteStore, TerminalPolicy, Workflow, WorkflowBuilder,
    expire, expire_paced, shutdown_signal,
};
/// Crash points, for tests (feature `crash-hooks`, which `idemflow-testkit` enables): a hook that
/// stops a run where a crash would, installed with `Runner::with_crash_hook`.
#[cfg(feature = "crash-hooks")]
pub use idemflow_runner::{CrashHook, CrashPoint};
/// The sqlx this engine is built with: a local phase gets its `PgConnection` (or, on SQLite, its
/// `SqliteConnection`; on MySQL/MariaDB, its `MySqlConnection`). Use this one (`idemflow::sqlx`) rather than pinning a second copy.
pub use idemflow_runner::{
    MySqlConnection, MySqlPool, PgConnection, PgPool, SqliteConnection, SqlitePool, sqlx,
};

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
