//! [`LastError`]: the error a failed attempt leaves on its key, as every engine can store it.

use std::fmt;

/// The error a failed attempt records on its key (`last_error`): what a phase's code made of a
/// failure, which may be anything (a provider's whole HTML error page, a driver's message quoting
/// binary data), made storable on every engine. At most [`LastError::LIMIT`] bytes: a longer one
/// keeps its beginning, cut at a character boundary, and says how much was cut. U+0000, which
/// PostgreSQL's text refuses, becomes U+FFFD. (MariaDB's strict mode refuses a `TEXT` past
/// 64 KiB; a refused record rolled the attempt back unrecorded, and the key repeated it for ever.)
///
/// The only way to an engine's `postpone`: an engine is never handed an error it cannot store.
#[derive(Clone, PartialEq, Eq)]
pub struct LastError(String);

impl LastError {
    /// The most bytes a recorded error holds, the note of what was cut included: enough for any
    /// message meant for a person, far below what every engine's column holds.
    pub const LIMIT: usize = 8 * 1024;

    /// `message`, made storable.
    pub fn new(message: &str) -> Self {
        let clean = message.replace('\u{0}', "\u{fffd}");
        if clean.len() <= Self::LIMIT {
            return Self(clean);
        }
        // The note's length is bounded: its number has at most 20 digits.
        let room = Self::LIMIT - " … [99999999999999999999 bytes cut]".len();
        let mut end = room;
        while !clean.is_char_boundary(end) {
            end -= 1;
        }
        let cut = clean.len() - end;
        Self(format!("{} … [{cut} bytes cut]", &clean[..end]))
    }

    /// The error as it is stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for LastError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, formatter)
    }
}

impl fmt::Display for LastError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl From<&str> for LastError {
    fn from(message: &str) -> Self {
        Self::new(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_error_is_kept_as_it_is() {
        assert_eq!(LastError::new("provider: 503").as_str(), "provider: 503");
    }

    #[test]
    fn nul_becomes_the_replacement_character() {
        assert_eq!(LastError::new("a\u{0}b").as_str(), "a\u{fffd}b");
    }

    #[test]
    fn a_long_error_keeps_its_beginning_within_the_limit_at_a_character_boundary() {
        for filler in ["x", "é", "😀"] {
            let message = filler.repeat(LastError::LIMIT + 1);
            let recorded = LastError::new(&message);
            assert!(recorded.as_str().len() <= LastError::LIMIT, "{filler}");
            assert!(recorded.as_str().starts_with(&filler.repeat(100)));
            let (kept, note) = recorded
                .as_str()
                .rsplit_once(" … [")
                .expect("the note says how much was cut");
            let cut: usize = note
                .strip_suffix(" bytes cut]")
                .and_then(|number| number.parse().ok())
                .expect("the note names a number of bytes");
            let kept = kept.len();
            assert_eq!(kept + cut, message.len(), "{filler}");
        }
    }
}
