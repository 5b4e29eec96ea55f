//! Durations as the whole milliseconds the SQL works in: leases, retry delays, retention windows
//! and transaction limits travel to the server as a `bigint` of milliseconds, and leases left and
//! lags come back as one. Both conversions live here, so every statement rounds, saturates and
//! clamps the same way.

use std::time::Duration;

/// The longest duration sent to the server: 100 years. Past it a lease or a wait is forever in
/// practice, and `clock_timestamp() + <ms> * interval '1 millisecond'` would fail with "interval"
/// or "timestamp out of range" (after the work it was to record had run).
pub(crate) const LONGEST: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `duration` in whole milliseconds, rounded down, saturated at [`LONGEST`].
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.min(LONGEST).as_millis()).unwrap_or(i64::MAX)
}

/// A count of milliseconds the server computed as a duration; a negative one (a lease that ended
/// that long ago) is zero.
pub(crate) fn from_millis(millis: i64) -> Duration {
    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any duration becomes milliseconds the server can add to a timestamp.
    #[test]
    fn durations_saturate_at_the_longest() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert_eq!(millis(Duration::MAX), millis(LONGEST));
        assert_eq!(
            millis(Duration::from_secs(10_000_000_000_000)),
            millis(LONGEST)
        );
        assert_eq!(millis(LONGEST), 3_153_600_000_000);
    }
}
