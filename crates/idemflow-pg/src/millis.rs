//! Durations as the whole milliseconds the SQL works in: leases, retry delays, retention windows
//! and transaction limits travel to the server as a `bigint` of milliseconds, and leases left and
//! lags come back as one. Both conversions live here, so every statement rounds, saturates and
//! clamps the same way.

use std::time::Duration;

/// `duration` in whole milliseconds, rounded down; `i64::MAX` when it does not fit.
pub(crate) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// A count of milliseconds the server computed as a duration; a negative one (a lease that ended
/// that long ago) is zero.
pub(crate) fn from_millis(millis: i64) -> Duration {
    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
}
