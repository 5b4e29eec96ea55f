use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use crate::engine::Engine;
use crate::workflow::Workflow;

/// The workflows a resumer can finish, by name (with version). Keep every version registered
/// while keys claimed by it may still be resumed.
#[derive(Debug, Clone)]
pub struct Registry<E: Engine> {
    workflows: BTreeMap<String, Arc<Workflow<E>>>,
}

impl<E: Engine> Default for Registry<E> {
    fn default() -> Self {
        Self {
            workflows: BTreeMap::new(),
        }
    }
}

/// Why a workflow cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// A second workflow under a name already registered.
    #[error("workflow {0:?} is already registered")]
    Duplicate(String),
    /// The workflow runs only with the live request that claimed its key (the plain-handler
    /// layer's: its handler needs the request's extensions and credentials, which are never
    /// stored). A resumer would run it without them; its keys are finished by client retries.
    #[error(
        "workflow {0:?} runs only with its live request and cannot be resumed in the background"
    )]
    LiveOnly(String),
}

impl<E: Engine> Registry<E> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `workflow` under its name. Refuses a second workflow under the same name and a
    /// live-only one ([`RegisterError`]). Returns the registry, so registrations chain.
    pub fn register(
        &mut self,
        workflow: impl Into<Arc<Workflow<E>>>,
    ) -> Result<&mut Self, RegisterError> {
        let workflow = workflow.into();
        let name = workflow.name().to_owned();
        if workflow.live_only() {
            return Err(RegisterError::LiveOnly(name));
        }
        if self.workflows.contains_key(&name) {
            return Err(RegisterError::Duplicate(name));
        }
        self.workflows.insert(name, workflow);
        Ok(self)
    }

    /// The workflow registered under `name` (with version), if any.
    pub fn get(&self, name: &str) -> Option<&Arc<Workflow<E>>> {
        self.workflows.get(name)
    }

    /// The registered names, sorted: the workflows whose keys a resumer takes over.
    pub fn names(&self) -> Vec<String> {
        self.workflows.keys().cloned().collect()
    }

    /// Whether no workflow is registered: a resumer then takes no key over.
    pub fn is_empty(&self) -> bool {
        self.workflows.is_empty()
    }

    /// Each registered workflow's name and lease: what a resumer's batch takeover grants each
    /// key.
    pub fn leases(&self) -> Vec<(String, Duration)> {
        self.workflows
            .iter()
            .map(|(name, workflow)| (name.clone(), workflow.lease()))
            .collect()
    }
}
