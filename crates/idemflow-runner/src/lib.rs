//! Typed phases, workflows, and the runner that executes them under idempotency keys.

mod outcome;
mod phase;
mod runner;
mod transaction;
mod workflow;

pub use outcome::{Outcome, Rejection};
pub use phase::{ForeignPhase, LocalPhase, PhaseContext, PhaseError, PhaseErrorKind, PhaseValue};
pub use runner::{Request, RunError, Runner, RunnerConfig, TerminalPolicy};
pub use workflow::{BuildError, Workflow, WorkflowBuilder};
