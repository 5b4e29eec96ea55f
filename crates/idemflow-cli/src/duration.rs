//! Durations on the command line (`90s`, `30m`, `24h`, `7d`) and on the screen (`59s`, `12m 5s`,
//! `2d 3h`).

use std::fmt;
use std::time::Duration;

/// Why a command-line duration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DurationError {
    input: String,
    reason: &'static str,
}

impl fmt::Display for DurationError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "invalid duration {:?}: {} (write a whole number and a unit: 90s, 30m, 24h, 7d)",
            self.input, self.reason
        )
    }
}

impl std::error::Error for DurationError {}

/// Parses a whole number followed by one unit: `s` (seconds), `m` (minutes), `h` (hours) or `d`
/// (days). Zero, signs, fractions, spaces, compound forms (`1h30m`) and missing units are refused:
/// a duration given to a command that deletes rows should mean exactly one thing.
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let error = |reason| DurationError {
        input: input.to_owned(),
        reason,
    };
    let digits = input.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = input.split_at(digits);
    if number.is_empty() {
        return Err(error("it must start with a whole number"));
    }
    let seconds_per_unit = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 60 * 60,
        "d" => 24 * 60 * 60,
        "" => return Err(error("the unit is missing")),
        _ => return Err(error("the unit must be one of s, m, h, d")),
    };
    let number: u64 = number
        .parse()
        .map_err(|_| error("the number is too large"))?;
    if number == 0 {
        return Err(error("it must be greater than zero"));
    }
    number
        .checked_mul(seconds_per_unit)
        .map(Duration::from_secs)
        .ok_or_else(|| error("the number is too large"))
}

/// Renders whole seconds with the two largest units that matter: `59s`, `12m 5s`, `1h 0m`, `2d 3h`.
pub fn human(seconds: u64) -> String {
    const MINUTE: u64 = 60;
    const HOUR: u64 = 60 * MINUTE;
    const DAY: u64 = 24 * HOUR;
    if seconds < MINUTE {
        format!("{seconds}s")
    } else if seconds < HOUR {
        format!("{}m {}s", seconds / MINUTE, seconds % MINUTE)
    } else if seconds < DAY {
        format!("{}h {}m", seconds / HOUR, seconds % HOUR / MINUTE)
    } else {
        format!("{}d {}h", seconds / DAY, seconds % DAY / HOUR)
    }
}

/// Renders time elapsed, given in milliseconds, in whole seconds rounded down.
pub fn human_elapsed_ms(ms: i64) -> String {
    human(u64::try_from(ms.max(0) / 1000).unwrap_or(0))
}

/// Renders a lease from the milliseconds left on it (negative: expired that long ago): time left
/// is rounded up to whole seconds (a lease of 3 599 001 ms still shows `1h 0m left`), time since
/// expiry rounded down, so a lease read a few milliseconds after it was set renders the same.
pub fn lease(ms_left: i64) -> String {
    if ms_left > 0 {
        // ceil(ms / 1000) for a positive ms, without overflow.
        let seconds = ms_left / 1000 + i64::from(ms_left % 1000 != 0);
        format!("{} left", human(u64::try_from(seconds).unwrap_or(0)))
    } else {
        let seconds = ms_left.unsigned_abs() / 1000;
        format!("expired {} ago", human(seconds))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_each_unit() {
        assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("30m"), Ok(Duration::from_secs(30 * 60)));
        assert_eq!(parse_duration("24h"), Ok(Duration::from_secs(24 * 3600)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86400)));
        assert_eq!(parse_duration("1s"), Ok(Duration::from_secs(1)));
        assert_eq!(parse_duration("007h"), Ok(Duration::from_secs(7 * 3600)));
    }

    #[test]
    fn rejects_garbage_with_a_reason() {
        for (input, reason) in [
            ("", "it must start with a whole number"),
            ("h", "it must start with a whole number"),
            ("-5m", "it must start with a whole number"),
            (" 5m", "it must start with a whole number"),
            ("1.5h", "the unit must be one of s, m, h, d"),
            ("24", "the unit is missing"),
            ("24 h", "the unit must be one of s, m, h, d"),
            ("24H", "the unit must be one of s, m, h, d"),
            ("5ms", "the unit must be one of s, m, h, d"),
            ("1w", "the unit must be one of s, m, h, d"),
            ("1h30m", "the unit must be one of s, m, h, d"),
            ("24h ", "the unit must be one of s, m, h, d"),
            ("0s", "it must be greater than zero"),
            ("0d", "it must be greater than zero"),
            ("99999999999999999999s", "the number is too large"),
            ("999999999999999999d", "the number is too large"),
        ] {
            let error = parse_duration(input).expect_err(input);
            assert_eq!(error.reason, reason, "{input:?}");
        }
        assert_eq!(
            parse_duration("2x").expect_err("2x").to_string(),
            "invalid duration \"2x\": the unit must be one of s, m, h, d \
             (write a whole number and a unit: 90s, 30m, 24h, 7d)"
        );
    }

    #[test]
    fn renders_the_two_largest_units() {
        assert_eq!(human(0), "0s");
        assert_eq!(human(59), "59s");
        assert_eq!(human(60), "1m 0s");
        assert_eq!(human(12 * 60 + 5), "12m 5s");
        assert_eq!(human(3599), "59m 59s");
        assert_eq!(human(3600), "1h 0m");
        assert_eq!(human(23 * 3600 + 59 * 60 + 59), "23h 59m");
        assert_eq!(human(86400), "1d 0h");
        assert_eq!(human(2 * 86400 + 3 * 3600 + 59), "2d 3h");
        assert_eq!(human(400 * 86400), "400d 0h");
    }

    #[test]
    fn leases_round_so_that_they_do_not_flicker() {
        assert_eq!(lease(3_600_000), "1h 0m left");
        assert_eq!(lease(3_599_001), "1h 0m left");
        assert_eq!(lease(3_599_000), "59m 59s left");
        assert_eq!(lease(1), "1s left");
        assert_eq!(lease(0), "expired 0s ago");
        assert_eq!(lease(-999), "expired 0s ago");
        assert_eq!(lease(-3_600_000), "expired 1h 0m ago");
        assert_eq!(lease(-3_600_999), "expired 1h 0m ago");
        assert_eq!(lease(i64::MIN), "expired 106751991167d 7h ago");
        assert_eq!(lease(i64::MAX), "106751991167d 7h left");
    }

    #[test]
    fn elapsed_time_rounds_down_and_never_goes_negative() {
        assert_eq!(human_elapsed_ms(3_600_999), "1h 0m");
        assert_eq!(human_elapsed_ms(999), "0s");
        assert_eq!(human_elapsed_ms(-5), "0s");
    }
}
