//! Typed phases, workflows, and the runner that executes them under idempotency keys.

#![deny(missing_docs)]

mod admission;
mod claim_cycle;
mod claim_level;
mod config;
mod crash;
mod deadline;
mod drive;
mod engine;
pub use engine::{
    Claimed, ConnectionOf, ConnectionPool, DatabaseError, DatabaseErrorKind, Engine, EngineError,
    EnginePool, Isolation, KeyOwner, Limits, PoolOf, PooledOf, SqlEngine, Standing, Taken,
};
mod erased;
mod error;
mod heartbeat;
mod live_connection;
mod metrics;
pub use metrics::{CATALOGUE, describe_metrics};
mod outcome;
mod panic;
mod phase;
mod registry;
mod resumer;
mod retention;
mod retry;
mod runner;
mod sealing;
mod storable;
mod warm;
mod workflow;

pub use config::{RunnerConfig, TerminalPolicy};
#[cfg(feature = "crash-hooks")]
pub use crash::{CrashHook, CrashPoint};
pub use error::RunError;
pub use outcome::{Outcome, Rejection};
pub use phase::{
    Failure, FailurePhase, ForeignPhase, LocalPhase, PhaseContext, PhaseError, PhaseErrorKind,
    PhaseResultExt, PhaseValue,
};
pub use registry::{RegisterError, Registry};
pub use resumer::{DrainReport, Resumer, ResumerConfig, shutdown_signal};
pub use retention::{Retention, expire, expire_paced};
pub use retry::RetryPolicy;
pub use runner::{Request, Runner};
pub use sealing::{Keyring, KeyringError, SealError};
pub use workflow::{BuildError, Workflow, WorkflowBuilder};
