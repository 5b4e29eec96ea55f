/// What a terminal phase error does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TerminalPolicy {
    /// Store the error response and replay it to every retry (Stripe's v1 rule: once execution
    /// started, the outcome is the outcome, errors included). The default.
    #[default]
    Store,
    /// Delete the key and answer the error without storing it, so the client may retry the same
    /// key as a new request. Only for workflows whose phases are safe to run again from the
    /// start; foreign phases are called again with the same derived keys.
    Forget,
}

/// How a [`crate::Runner`] claims keys and treats failures. Retries are per phase
/// ([`crate::RetryPolicy`]).
#[derive(Debug, Clone, Default)]
pub struct RunnerConfig {
    /// What a terminal phase error does to its key. Default [`TerminalPolicy::Store`].
    pub terminal_errors: TerminalPolicy,
}
