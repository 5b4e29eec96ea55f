use std::time::Duration;

use idemflow_core::backoff;

/// How a phase is retried after retryable errors: how many executions at one recovery point
/// before giving up, and how long to wait between them (exponential backoff with jitter). The
/// wait is stored as the key's lease, so it holds across processes: neither a client retry nor a
/// resumer takes the key over before it ends.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// Executions at one recovery point (the first included) before the workflow gives up and
    /// its failure path runs. At least 1.
    pub max_attempts: u32,
    /// The wait after the first failure.
    pub initial_backoff: Duration,
    /// The longest wait.
    pub max_backoff: Duration,
    /// Each wait is this many times the previous one.
    pub multiplier: f64,
    /// Up to this fraction of each wait is taken off at random (0.0 to 1.0), so keys that failed
    /// together do not come back together.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// 8 attempts, waiting 1 s, 2 s, 4 s ... up to 5 minutes, with 20% jitter: about ten minutes
    /// from the first failure to giving up.
    fn default() -> Self {
        Self {
            max_attempts: 8,
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            multiplier: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetryPolicy {
    /// Never retry: the first retryable error gives up.
    pub fn no_retries() -> Self {
        Self {
            max_attempts: 1,
            ..Self::default()
        }
    }

    /// Whether the execution numbered `attempt` (1-based) was the last one allowed.
    pub fn exhausted(&self, attempt: u32) -> bool {
        attempt >= self.max_attempts.max(1)
    }

    /// The wait after the execution numbered `attempt` failed: what the phase asked for (a
    /// provider's `Retry-After`), at most [`RetryPolicy::max_backoff`], or else
    /// [`RetryPolicy::backoff`]. Bounded, because the wait is the key's lease: a provider asking
    /// for a billion seconds would otherwise leave the key started for decades, every retry told
    /// 409 and no resumer taking it.
    pub fn wait(&self, asked: Option<Duration>, attempt: u32) -> Duration {
        match asked {
            Some(asked) => asked.min(self.max_backoff),
            None => self.backoff(attempt),
        }
    }

    /// The wait after the execution numbered `attempt` failed, jitter included (only ever
    /// shorter than the exponential wait: a key is never due later than its policy says).
    pub fn backoff(&self, attempt: u32) -> Duration {
        let wait = backoff::exponential(
            self.initial_backoff,
            self.max_backoff,
            self.multiplier,
            attempt,
        );
        backoff::jittered(wait, self.jitter, backoff::unit(), backoff::Spread::Shorter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_exponentially_up_to_the_cap() {
        let policy = RetryPolicy {
            jitter: 0.0,
            ..RetryPolicy::default()
        };
        assert_eq!(policy.backoff(1), Duration::from_secs(1));
        assert_eq!(policy.backoff(2), Duration::from_secs(2));
        assert_eq!(policy.backoff(4), Duration::from_secs(8));
        assert_eq!(policy.backoff(30), Duration::from_secs(300));
    }

    #[test]
    fn jitter_only_shortens_the_wait_by_at_most_its_fraction() {
        let policy = RetryPolicy {
            jitter: 0.5,
            ..RetryPolicy::default()
        };
        for _ in 0..100 {
            let wait = policy.backoff(3);
            assert!(
                wait <= Duration::from_secs(4) && wait >= Duration::from_secs(2),
                "{wait:?}"
            );
        }
    }

    #[test]
    fn exhaustion_counts_executions() {
        let policy = RetryPolicy {
            max_attempts: 3,
            ..RetryPolicy::default()
        };
        assert!(!policy.exhausted(2));
        assert!(policy.exhausted(3));
        assert!(RetryPolicy::no_retries().exhausted(1));
    }
}

idemflow_core::with_setters! {
    RetryPolicy {
        with_max_attempts => max_attempts: u32,
        with_initial_backoff => initial_backoff: Duration,
        with_max_backoff => max_backoff: Duration,
        with_multiplier => multiplier: f64,
        with_jitter => jitter: f64,
    }
}
