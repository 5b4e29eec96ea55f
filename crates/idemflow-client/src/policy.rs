//! When to try again: exponential backoff with jitter, bounded by a deadline.

use std::time::Duration;

use idemflow_core::backoff;

/// How a call is retried.
///
/// The wait before retry `n` (1 for the first) is `initial_backoff × multiplierⁿ⁻¹`, at most
/// `max_backoff`, then multiplied by a random factor in `[1 − jitter, 1 + jitter]`, unless the
/// answer carried a `Retry-After`, which is waited without jitter, but at least `min_retry_after`
/// and at most `max_retry_after` ([`bounded_retry_after`](Self::bounded_retry_after)). The call
/// gives up with [`ClientError::DeadlineExceeded`] when the next attempt could not start before
/// `deadline` (counted from the start of the call) or when an attempt is still running at the
/// deadline.
///
/// ```
/// use std::time::Duration;
/// use idemflow_client::ClientRetryPolicy;
///
/// let policy = ClientRetryPolicy::default().with_deadline(Duration::from_secs(5));
/// assert_eq!(policy.initial_backoff, Duration::from_millis(200));
/// assert_eq!(policy.backoff(1), Duration::from_millis(200));
/// assert_eq!(policy.backoff(3), Duration::from_millis(800));
/// assert_eq!(policy.backoff(30), Duration::from_secs(10));
/// assert_eq!(policy.bounded_retry_after(Duration::ZERO), Duration::from_millis(100));
/// assert_eq!(policy.bounded_retry_after(Duration::MAX), Duration::from_secs(60));
/// ```
///
/// [`ClientError::DeadlineExceeded`]: crate::ClientError::DeadlineExceeded
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct ClientRetryPolicy {
    /// The wait before the first retry. Default 200 ms.
    pub initial_backoff: Duration,
    /// The longest wait, before jitter. Default 10 s.
    pub max_backoff: Duration,
    /// How much each wait grows; below 1 (or not finite) counts as 1. Default 2.0.
    pub multiplier: f64,
    /// The random spread of each wait, as a fraction of it, clamped to `[0, 1]`. Default 0.2.
    pub jitter: f64,
    /// How long one call may take, all attempts and waits included. Default 60 s.
    pub deadline: Duration,
    /// The shortest wait a `Retry-After` can ask for: `Retry-After: 0`, or a date already past,
    /// would otherwise retry at once, again and again, until the deadline. Default 100 ms.
    pub min_retry_after: Duration,
    /// The longest wait a `Retry-After` can ask for: the next attempt comes after this at the
    /// latest (a huge value, with an unbounded deadline, would otherwise sleep for years). Default
    /// 60 s.
    pub max_retry_after: Duration,
}

impl Default for ClientRetryPolicy {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(10),
            multiplier: 2.0,
            jitter: 0.2,
            deadline: Duration::from_secs(60),
            min_retry_after: Duration::from_millis(100),
            max_retry_after: Duration::from_secs(60),
        }
    }
}

impl ClientRetryPolicy {
    /// The wait before retry `retry` (1 for the first), before jitter.
    pub fn backoff(&self, retry: u32) -> Duration {
        backoff::exponential(
            self.initial_backoff,
            self.max_backoff,
            self.multiplier,
            retry,
        )
    }

    /// The wait for a response's `Retry-After` of `asked`: at least `min_retry_after`, at most
    /// `max_retry_after` (which wins if the two are crossed).
    pub fn bounded_retry_after(&self, asked: Duration) -> Duration {
        asked.max(self.min_retry_after).min(self.max_retry_after)
    }

    /// `wait` spread by the jitter, either way, given `unit` uniform in `[0, 1)`.
    pub(crate) fn jittered(&self, wait: Duration, unit: f64) -> Duration {
        backoff::jittered(wait, self.jitter, unit, backoff::Spread::Around)
    }
}

pub(crate) use backoff::JitterSource;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_is_capped_and_survives_odd_settings() {
        let policy = ClientRetryPolicy::default();
        let waits: Vec<_> = (1..=8).map(|retry| policy.backoff(retry)).collect();
        let millis: Vec<_> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(millis, [200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]);
        assert_eq!(policy.backoff(u32::MAX), Duration::from_secs(10));
        assert_eq!(policy.backoff(0), Duration::from_millis(200));

        let odd = ClientRetryPolicy {
            multiplier: f64::NAN,
            max_backoff: Duration::MAX,
            ..policy
        };
        assert_eq!(odd.backoff(50), Duration::from_millis(200));
        let huge = ClientRetryPolicy {
            multiplier: 1e300,
            max_backoff: Duration::MAX,
            ..policy
        };
        assert_eq!(huge.backoff(50), Duration::MAX);
    }

    #[test]
    fn retry_after_is_floored_and_capped() {
        let policy = ClientRetryPolicy::default();
        let bounded = |seconds: f64| policy.bounded_retry_after(Duration::from_secs_f64(seconds));
        assert_eq!(bounded(0.0), Duration::from_millis(100));
        assert_eq!(bounded(0.05), Duration::from_millis(100));
        assert_eq!(bounded(2.5), Duration::from_millis(2500));
        assert_eq!(bounded(1e9), Duration::from_secs(60));
        assert_eq!(
            policy.bounded_retry_after(Duration::MAX),
            Duration::from_secs(60)
        );
        let crossed = ClientRetryPolicy {
            min_retry_after: Duration::from_secs(5),
            max_retry_after: Duration::from_secs(1),
            ..policy
        };
        assert_eq!(
            crossed.bounded_retry_after(Duration::ZERO),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn jitter_stays_within_its_spread() {
        let policy = ClientRetryPolicy::default();
        let source = JitterSource::new();
        let wait = Duration::from_secs(1);
        let mut seen_low = false;
        let mut seen_high = false;
        for _ in 0..1000 {
            let unit = source.next_unit();
            assert!((0.0..1.0).contains(&unit));
            let jittered = policy.jittered(wait, unit);
            assert!(
                jittered >= Duration::from_millis(800) && jittered <= Duration::from_millis(1200)
            );
            seen_low |= jittered < Duration::from_millis(900);
            seen_high |= jittered > Duration::from_millis(1100);
        }
        assert!(seen_low && seen_high, "the jitter spreads both ways");
        let none = ClientRetryPolicy {
            jitter: f64::NAN,
            ..policy
        };
        assert_eq!(none.jittered(wait, 0.99), wait);
        let wide = ClientRetryPolicy {
            jitter: 7.0,
            ..policy
        };
        assert_eq!(wide.jittered(wait, 0.0), Duration::ZERO);
    }
}

idemflow_core::with_setters! {
    ClientRetryPolicy {
        with_initial_backoff => initial_backoff: Duration,
        with_max_backoff => max_backoff: Duration,
        with_multiplier => multiplier: f64,
        with_jitter => jitter: f64,
        with_deadline => deadline: Duration,
        with_min_retry_after => min_retry_after: Duration,
        with_max_retry_after => max_retry_after: Duration,
    }
}
