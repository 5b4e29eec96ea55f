//! Internal: the engine's own test rig. Not published, and no part of idemflow's API: it changes
//! with the engine. For testing your workflows, use `idemflow-testkit` (the mock payment provider
//! and the crash explorer).
//!
//! - [`simulation`]: the schedule explorer, which generates interleavings of clients, resumers,
//!   crashes, lapsed leases and faults against a real database and checks the engine's
//!   invariants after each (docs/simulation.md; the `idemflow-simulate` binary);
//! - [`faults`]: a loopback TCP proxy in front of PostgreSQL that breaks connections on command;
//! - [`wire`]: a loopback TCP proxy that counts round trips and commits on the wire;
//! - [`server_log`]: PostgreSQL's own log read through SQL, and the lost claims it shows;
//! - [`browser`]: a headless Chromium driven over WebDriver, for the console's tests;
//! - [`checkout`]: the reference checkout, its phases written once for every SQL engine, which
//!   the benchmark measures and the round-trip tests count.

#![deny(missing_docs)]

pub mod browser;
pub mod checkout;
pub mod faults;
pub mod server_log;
pub mod simulation;
pub mod wire;
