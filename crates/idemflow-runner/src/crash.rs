//! Crash points: named places at every step boundary where a test can make a run stop as a crash
//! would. The hook that decides ([`CrashHook`]) exists only with the `crash-hooks` feature, which
//! the testkit enables for test builds: without it a point costs nothing (the check is empty), and
//! a production build has no way to install one.

use std::fmt;
#[cfg(feature = "crash-hooks")]
use std::sync::Arc;

#[cfg(feature = "crash-hooks")]
use async_trait::async_trait;
use idemflow_core::{Key, TenantId};

#[cfg(feature = "crash-hooks")]
use crate::{engine::Engine, erased::Step, workflow::Workflow};

/// A step boundary of a run.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CrashPoint {
    /// A transaction is about to commit; `phase` is the last phase it records (`claim` when it
    /// records only the claim or a takeover).
    BeforeCommit {
        /// The last phase the transaction records, or `claim`.
        phase: &'static str,
    },
    /// That transaction committed (after the first one: the claim is durable).
    AfterCommit {
        /// The last phase the transaction recorded, or `claim`.
        phase: &'static str,
    },
    /// A foreign phase is about to be called (its input committed).
    BeforeCall {
        /// The foreign phase about to be called.
        phase: &'static str,
    },
    /// The foreign call returned; its result is not recorded yet.
    AfterCall {
        /// The foreign phase that was called.
        phase: &'static str,
    },
    /// The transaction holding the last local effects and the response is about to commit.
    BeforeFinish,
    /// The response is stored.
    AfterFinish,
    /// A replay of a key whose response body is stored apart: its row was read, its body is
    /// about to be (the second statement). Not a step of an execution, so not in
    /// [`CrashPoint::all`]; a schedule explorer holds replays here while others act (retention,
    /// a new life of the key).
    BeforeReplayBody,
}

#[cfg(feature = "crash-hooks")]
impl CrashPoint {
    /// Every crash point a fresh run of `workflow` passes, in order.
    pub fn all<E: Engine>(workflow: &Workflow<E>) -> Vec<CrashPoint> {
        let mut points = Vec::new();
        let mut last_recorded: &'static str = "claim";
        for step in &workflow.steps {
            match step {
                Step::Local(local) => last_recorded = local.name(),
                Step::Foreign(foreign) => {
                    points.push(Self::BeforeCommit {
                        phase: last_recorded,
                    });
                    points.push(Self::AfterCommit {
                        phase: last_recorded,
                    });
                    points.push(Self::BeforeCall {
                        phase: foreign.name(),
                    });
                    points.push(Self::AfterCall {
                        phase: foreign.name(),
                    });
                    last_recorded = foreign.name();
                }
            }
        }
        points.push(Self::BeforeFinish);
        points.push(Self::AfterFinish);
        points
    }
}

impl fmt::Display for CrashPoint {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BeforeCommit { phase } => write!(formatter, "before_commit:{phase}"),
            Self::AfterCommit { phase } => write!(formatter, "after_commit:{phase}"),
            Self::BeforeCall { phase } => write!(formatter, "before_call:{phase}"),
            Self::AfterCall { phase } => write!(formatter, "after_call:{phase}"),
            Self::BeforeFinish => formatter.write_str("before_finish"),
            Self::AfterFinish => formatter.write_str("after_finish"),
            Self::BeforeReplayBody => formatter.write_str("before_replay_body"),
        }
    }
}

/// Decides, at each crash point, whether the run stops there. It may also take its time: a
/// schedule explorer holds a run at a point while others act. (Feature `crash-hooks`.)
#[cfg(feature = "crash-hooks")]
#[async_trait]
pub trait CrashHook: Send + Sync + fmt::Debug {
    /// `true`: the run stops at once as if its process died: it writes nothing more, its open
    /// transaction rolls back, its lease is left as it was, and `run` returns
    /// [`crate::RunError::Crashed`]. `tenant` and `key` name the request's key: keys are scoped
    /// by tenant, so a hook armed for one must never stop another tenant's request.
    async fn crash_at(&self, point: &CrashPoint, tenant: &TenantId, key: &Key) -> bool;
}

/// The hook a runner holds: none in production.
#[derive(Debug, Clone, Default)]
pub(crate) struct CrashPoints(#[cfg(feature = "crash-hooks")] Option<Arc<dyn CrashHook>>);

impl CrashPoints {
    #[cfg(feature = "crash-hooks")]
    pub(crate) fn new(hook: Arc<dyn CrashHook>) -> Self {
        Self(Some(hook))
    }

    /// Whether the run stops at `point` (built only when a hook is installed to ask).
    #[cfg(feature = "crash-hooks")]
    #[inline]
    pub(crate) async fn check(
        &self,
        point: impl FnOnce() -> CrashPoint,
        tenant: &TenantId,
        key: &Key,
    ) -> Result<(), crate::RunError> {
        match &self.0 {
            None => Ok(()),
            Some(hook) => {
                let point = point();
                if hook.crash_at(&point, tenant, key).await {
                    tracing::warn!(%point, "crash point: stopping as a crash would");
                    Err(crate::RunError::Crashed(point.to_string()))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Without the `crash-hooks` feature no hook can be installed: the run never stops here.
    #[cfg(not(feature = "crash-hooks"))]
    #[inline(always)]
    pub(crate) async fn check(
        &self,
        _point: impl FnOnce() -> CrashPoint,
        _tenant: &TenantId,
        _key: &Key,
    ) -> Result<(), crate::RunError> {
        Ok(())
    }
}
