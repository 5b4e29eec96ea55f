use std::time::Duration;

use crate::sealing::Keyring;

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
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RunnerConfig {
    /// What a terminal phase error does to its key. Default [`TerminalPolicy::Store`].
    pub terminal_errors: TerminalPolicy,
    /// How long the engine waits for one of its own statements (a look-up, a claim, a record, a
    /// commit) or for a connection from the pool before it gives the database up for this
    /// request: [`crate::RunError::DatabaseTimeout`], answered 503. The claim may wait behind a
    /// concurrent claim of the same key, so it gets this plus the workflow's longest local time
    /// limit. It bounds waits on a database that does not answer at all (a network that drops
    /// packets, a failover), which the server's own timeouts cannot. Default
    /// [`RunnerConfig::DEFAULT_DATABASE_TIMEOUT`] (5 s): the engine's statements take
    /// milliseconds, and a client told 503 retries with the same key.
    pub database_timeout: Duration,
    /// Seals (AES-256-GCM) the stored request, phase outputs and responses, so a dump of the
    /// table shows none of them; every runner and resumer reading the same rows needs the key
    /// ids they were sealed under. Default `None`: values are stored as they are. See
    /// [`Keyring`] and docs/operations.md, "What is stored".
    pub keyring: Option<Keyring>,
    /// A stored response body longer than this many bytes (after sealing) is kept out of the
    /// key's row, in a table of its own, written in the same statement as the finish and read
    /// back by a replay with one more statement. Default
    /// [`RunnerConfig::DEFAULT_RESPONSE_APART_ABOVE`]; `usize::MAX` keeps every body in the row.
    /// See docs/operations.md, "Large responses".
    pub response_apart_above: usize,
    /// Whether the runner keeps the connection a request ends with for its next request (a warm
    /// connection, see docs/operations.md, "Running workers") rather than handing it back to the
    /// pool. Default `true`. A kept connection skips what the pool does on a release and on an
    /// acquire: its test, and the pool's `after_release` and `before_acquire` hooks. Turn it off
    /// for a pool whose hooks must see every connection between two requests (one that resets
    /// session state a phase may leave, such as a `SET` without `LOCAL`).
    pub warm_connections: bool,
    /// How many times one transaction is run again in place after the database rolled it back
    /// to keep transactions apart (a serialization failure, a deadlock's victim) before its
    /// failure counts as an attempt (docs/runner.md, "Choosing an isolation level"). Default
    /// [`RunnerConfig::DEFAULT_MOST_RESTARTS`]; 0 makes every such failure an ordinary failed
    /// attempt, with its retry policy's backoff.
    pub most_restarts: u32,
}

impl RunnerConfig {
    /// The default [`RunnerConfig::database_timeout`].
    pub const DEFAULT_DATABASE_TIMEOUT: Duration = Duration::from_secs(5);

    /// The default [`RunnerConfig::response_apart_above`]: 64 KiB. Below it a body costs a
    /// replay nothing extra in the row (PostgreSQL compresses and moves it out of line itself
    /// past about 2 KB); above it the second statement costs less than the body's transfer.
    pub const DEFAULT_RESPONSE_APART_ABOVE: usize = 64 * 1024;

    /// The default [`RunnerConfig::most_restarts`]: 8. Each restart waits up to 2ⁿ ms (at most
    /// 64 ms), so eight cost at most about a quarter of a second: enough for the conflicts of a
    /// few contended keys, short next to a retry's backoff of a second.
    pub const DEFAULT_MOST_RESTARTS: u32 = 8;
}

impl Default for RunnerConfig {
    fn default() -> Self {
        Self {
            terminal_errors: TerminalPolicy::default(),
            database_timeout: Self::DEFAULT_DATABASE_TIMEOUT,
            keyring: None,
            response_apart_above: Self::DEFAULT_RESPONSE_APART_ABOVE,
            warm_connections: true,
            most_restarts: Self::DEFAULT_MOST_RESTARTS,
        }
    }
}

idemflow_core::with_setters! {
    RunnerConfig {
        with_terminal_errors => terminal_errors: TerminalPolicy,
        with_database_timeout => database_timeout: Duration,
        with_keyring => keyring: Option<Keyring>,
        with_response_apart_above => response_apart_above: usize,
        with_warm_connections => warm_connections: bool,
        with_most_restarts => most_restarts: u32,
    }
}
