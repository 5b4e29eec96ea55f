use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::workflow::Workflow;

/// The workflows a resumer can finish, by name (with version). Keep every version registered
/// while keys claimed by it may still be resumed.
#[derive(Debug, Default, Clone)]
pub struct Registry {
    workflows: BTreeMap<String, Arc<Workflow>>,
}

/// A second workflow under a name already registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("workflow {0:?} is already registered")]
pub struct DuplicateWorkflow(pub String);

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn register(
        &mut self,
        workflow: impl Into<Arc<Workflow>>,
    ) -> Result<&mut Self, DuplicateWorkflow> {
        let workflow = workflow.into();
        let name = workflow.name().to_owned();
        if self.workflows.contains_key(&name) {
            return Err(DuplicateWorkflow(name));
        }
        self.workflows.insert(name, workflow);
        Ok(self)
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Workflow>> {
        self.workflows.get(name)
    }

    pub fn names(&self) -> Vec<String> {
        self.workflows.keys().cloned().collect()
    }

    pub fn is_empty(&self) -> bool {
        self.workflows.is_empty()
    }

    /// The longest lease of any registered workflow: what a resumer's batch takeover grants.
    pub fn longest_lease(&self) -> Duration {
        self.workflows
            .values()
            .map(|workflow| workflow.lease())
            .max()
            .unwrap_or(Workflow::DEFAULT_LEASE)
    }
}
