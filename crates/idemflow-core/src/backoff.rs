//! How long to wait before trying again: one exponential backoff and one jitter source, shared by
//! the runner (the wait before a key's next attempt) and the client (the wait before a retry).
//! Nothing here panics, whatever the settings: a wait too long to represent is the cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The wait before try `n` (1 for the first retry): `initial × multiplierⁿ⁻¹`, at most `max`. A
/// multiplier below 1, or not a number, counts as 1.
pub fn exponential(initial: Duration, max: Duration, multiplier: f64, n: u32) -> Duration {
    let multiplier = if multiplier.is_finite() && multiplier >= 1.0 {
        multiplier
    } else {
        1.0
    };
    let exponent = i32::try_from(n.saturating_sub(1)).unwrap_or(i32::MAX);
    let seconds = initial.as_secs_f64() * multiplier.powi(exponent);
    Duration::try_from_secs_f64(seconds).map_or(max, |wait| wait.min(max))
}

/// How jitter moves a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spread {
    /// Only shorter, by up to the fraction: a key is never due later than its policy says.
    Shorter,
    /// Shorter or longer, by up to the fraction each way: callers retrying together drift apart.
    Around,
}

/// `wait` moved by up to `fraction` of itself (clamped to `[0, 1]`; not a number counts as 0),
/// given `unit` uniform in `[0, 1)`.
pub fn jittered(wait: Duration, fraction: f64, unit: f64, spread: Spread) -> Duration {
    let fraction = if fraction.is_nan() {
        0.0
    } else {
        fraction.clamp(0.0, 1.0)
    };
    let factor = match spread {
        Spread::Shorter => 1.0 - fraction * unit,
        Spread::Around => 1.0 + fraction * (2.0 * unit - 1.0),
    };
    Duration::try_from_secs_f64(wait.as_secs_f64() * factor).unwrap_or(wait)
}

/// Uniform numbers in `[0, 1)` for jitter: SplitMix64 seeded from the standard library's random
/// hasher keys. Enough to spread retries; not for anything that must be unpredictable.
#[derive(Debug)]
pub struct JitterSource {
    state: AtomicU64,
}

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl Default for JitterSource {
    fn default() -> Self {
        Self::new()
    }
}

impl JitterSource {
    /// A source seeded anew (from the process's random hasher keys).
    pub fn new() -> Self {
        use std::hash::BuildHasher;
        let seed = std::collections::hash_map::RandomState::new().hash_one(std::process::id());
        Self {
            state: AtomicU64::new(seed),
        }
    }

    /// The next number, uniform in `[0, 1)`.
    pub fn next_unit(&self) -> f64 {
        let mut z = self
            .state
            .fetch_add(GOLDEN_GAMMA, Ordering::Relaxed)
            .wrapping_add(GOLDEN_GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        // The top 53 bits, as a fraction of 2^53: exactly representable, below 1.
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One source for the process.
pub fn unit() -> f64 {
    static SOURCE: std::sync::OnceLock<JitterSource> = std::sync::OnceLock::new();
    SOURCE.get_or_init(JitterSource::new).next_unit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_is_capped_and_never_panics() {
        let wait = |n| exponential(Duration::from_secs(1), Duration::from_secs(300), 2.0, n);
        assert_eq!(wait(1), Duration::from_secs(1));
        assert_eq!(wait(4), Duration::from_secs(8));
        assert_eq!(wait(30), Duration::from_secs(300));
        assert_eq!(wait(0), Duration::from_secs(1));
        assert_eq!(
            exponential(Duration::from_secs(1), Duration::MAX, 1e300, 50),
            Duration::MAX
        );
        assert_eq!(
            exponential(Duration::from_secs(1), Duration::MAX, f64::NAN, 50),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn jitter_moves_a_wait_within_its_fraction() {
        let wait = Duration::from_secs(4);
        for unit in [0.0, 0.25, 0.5, 0.999] {
            let shorter = jittered(wait, 0.5, unit, Spread::Shorter);
            assert!(
                shorter <= wait && shorter >= Duration::from_secs(2),
                "{shorter:?}"
            );
            let around = jittered(wait, 0.5, unit, Spread::Around);
            assert!(
                around >= Duration::from_secs(2) && around <= Duration::from_secs(6),
                "{around:?}"
            );
        }
        assert_eq!(jittered(wait, f64::NAN, 0.7, Spread::Around), wait);
        assert_eq!(
            jittered(Duration::MAX, 1.0, 0.999, Spread::Around),
            Duration::MAX
        );
        let source = JitterSource::new();
        assert!(
            (0..1000)
                .map(|_| source.next_unit())
                .all(|unit| (0.0..1.0).contains(&unit))
        );
    }
}
