//! The integration tests, one binary (one build of `support/` and of every dependency's test
//! profile): each module was once a test binary of its own. Every test that touches storage runs
//! against a real database, a fresh one per test: PostgreSQL (`DATABASE_URL`, `#[sqlx::test]`),
//! a SQLite file, or MariaDB (`MARIADB_URL`, `support::mariadb::fresh`).
//! Run one module with `cargo nextest run --test it -E 'test(/^simulate::/)'`.
#![allow(clippy::unwrap_used)]

mod support;

mod browser;
mod checkout_example;
mod claim;
mod cli_binary;
mod clock_skew;
mod conformance;
mod console;
mod console_redis;
mod consumer;
mod crash_processes;
mod deploy;
mod ended_transactions;
mod engines;
mod explore_checkout;
mod failover;
mod failover_patroni;
mod failures;
mod faults;
mod fences;
mod foreign_only;
mod hello_example;
mod isolation;
mod large_responses;
mod load;
mod logs;
mod many_processes;
mod metrics;
mod openapi;
mod partitions;
mod pgbouncer;
mod plans;
mod precision;
mod protocol;
mod redis_cluster;
mod redis_loss;
mod refunds;
mod restarts;
mod resumer;
mod retention;
mod roles;
mod round_trips;
mod round_trips_mariadb;
mod simulate;
mod slow_clients;
mod startup;
mod stored;
mod tidy;
mod warm;
