//! Where a drive begins: the first phase to run and its input, and whether the attempt is
//! within the budget of that phase's retry policy.

use serde_json::Value;

use super::{Drive, Entry, FailedAttempt, Stop};
use crate::engine::{Engine, KeyOwner};
use crate::erased::Carry;
use crate::panic::catch_panic_now;
use crate::phase::PhaseError;
use crate::retry::RetryPolicy;
use crate::sealing::{SealError, Slot};

impl<E: Engine> Drive<'_, E> {
    /// The first phase to run and its input. A takeover past its attempt budget runs nothing:
    /// the attempts before it ended without recording an outcome (crashes, kills), and one more
    /// would only repeat that.
    pub(super) fn enter(
        &mut self,
        entry: Entry,
        last_error: Option<String>,
    ) -> Result<(usize, Carry), Stop> {
        let workflow = self.workflow;
        let (position, carry) = match entry {
            Entry::Decoded { position, input } => (position, input),
            Entry::Stored {
                recovery_point,
                output,
            } => {
                let Some(position) = workflow.position_after(&recovery_point) else {
                    return Err(Stop::failed(FailedAttempt::of(
                        "resume",
                        RetryPolicy::default(),
                        PhaseError::retryable(format!(
                            "the key is left at recovery point {recovery_point:?}, which \
                             workflow {:?} does not have",
                            workflow.name()
                        )),
                    )));
                };
                // Sealed values open first; one that does not (an unknown key id, a value moved
                // from another row) fails the attempt as a value that does not decode does.
                let output = self.open_stored(&recovery_point, output).map_err(|error| {
                    Stop::failed(FailedAttempt::of(
                        workflow.step_name(position),
                        workflow.retry_policy_at(position),
                        PhaseError::retryable(error.to_string()),
                    ))
                })?;
                // Kept (not copied) for a failure path: what it may have to undo.
                self.recorded_output = output;
                let (request, output) = (&self.request, &self.recorded_output);
                let decoded = catch_panic_now(|| {
                    if position == 0 {
                        workflow.decode_request(request)
                    } else {
                        workflow.steps[position - 1]
                            .decode_output(output.as_ref().unwrap_or(&Value::Null))
                    }
                });
                let why = match decoded {
                    Ok(Ok(carry)) => return self.within_budget(position, carry, last_error),
                    Ok(Err(error)) => error.to_string(),
                    Err(panic) => format!("decoding it panicked: {panic}"),
                };
                return Err(Stop::failed(FailedAttempt::of(
                    workflow.step_name(position),
                    workflow.retry_policy_at(position),
                    PhaseError::retryable(format!(
                        "the stored input of this phase does not decode: {why}"
                    )),
                )));
            }
        };
        self.within_budget(position, carry, last_error)
    }

    /// Opens the stored request (in place: the failure path reads it too) and the output stored
    /// with `recovery_point`.
    fn open_stored(
        &mut self,
        recovery_point: &str,
        output: Option<Value>,
    ) -> Result<Option<Value>, SealError> {
        let sealer = self.runner.sealer(self.owner.tenant(), self.owner.key());
        self.request = sealer.open_value(Slot::Request, std::mem::take(&mut self.request))?;
        output
            .map(|output| sealer.open_value(Slot::Output(recovery_point), output))
            .transpose()
    }

    /// `Ok` unless this attempt is past the attempt budget of the phase it would run first.
    fn within_budget(
        &self,
        position: usize,
        carry: Carry,
        last_error: Option<String>,
    ) -> Result<(usize, Carry), Stop> {
        let workflow = self.workflow;
        let policy = workflow.retry_policy_at(position);
        if self.context.attempt > policy.max_attempts.max(1) {
            let earlier = last_error.unwrap_or_else(|| {
                "the earlier attempts recorded no outcome (crashed, killed or stopped)".to_owned()
            });
            return Err(Stop::failed(FailedAttempt {
                spent: true,
                ..FailedAttempt::of(
                    workflow.step_name(position),
                    policy,
                    PhaseError::retryable(earlier),
                )
            }));
        }
        Ok((position, carry))
    }
}
