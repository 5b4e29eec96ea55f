use std::fmt;

/// The durable name of a phase. It is stored as the key's recovery point, so renaming a phase
/// breaks the resumption of keys left at it: treat names as a contract, like a column name.
///
/// 1 to 64 bytes of lowercase ASCII letters, digits, `_`, `-` and `.`; never `start`, which names
/// the recovery point before any phase. No `:` so a [`crate::DerivedKey`] stays unambiguous.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PhaseName(&'static str);

/// Why a phase name is not valid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PhaseNameError {
    /// The name is empty or longer than [`PhaseName::MAX_BYTES`].
    #[error("phase name {name:?} is empty or longer than {max} bytes", max = PhaseName::MAX_BYTES)]
    Length {
        /// The name given.
        name: String,
    },
    /// The name holds a character other than `a`-`z`, `0`-`9`, `_`, `-` or `.`.
    #[error("phase name {name:?} holds a character other than a-z, 0-9, '_', '-' or '.'")]
    InvalidCharacter {
        /// The name given.
        name: String,
    },
    /// The name is `start`, the recovery point before any phase.
    #[error("phase name {name:?} is reserved")]
    Reserved {
        /// The name given.
        name: String,
    },
}

impl PhaseName {
    /// The longest phase name accepted, in bytes.
    pub const MAX_BYTES: usize = 64;

    /// Validates a phase name. Names are `'static`: they are part of the code, not of the data.
    pub fn new(name: &'static str) -> Result<Self, PhaseNameError> {
        if name.is_empty() || name.len() > Self::MAX_BYTES {
            return Err(PhaseNameError::Length {
                name: name.to_owned(),
            });
        }
        let allowed = |byte: u8| {
            byte.is_ascii_lowercase() || byte.is_ascii_digit() || matches!(byte, b'_' | b'-' | b'.')
        };
        if !name.bytes().all(allowed) {
            return Err(PhaseNameError::InvalidCharacter {
                name: name.to_owned(),
            });
        }
        if name == RecoveryPoint::START {
            return Err(PhaseNameError::Reserved {
                name: name.to_owned(),
            });
        }
        Ok(Self(name))
    }

    /// The name, as stored in the recovery point.
    pub fn as_str(&self) -> &'static str {
        self.0
    }
}

impl fmt::Debug for PhaseName {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "PhaseName({:?})", self.0)
    }
}

impl fmt::Display for PhaseName {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.0)
    }
}

/// Where a started key stands: before any phase, or after the named phase completed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveryPoint {
    /// No phase has completed yet.
    Start,
    /// The named phase completed; the workflow resumes with the phase after it. The name is
    /// the stored text, not yet checked against the workflow's phases.
    After(String),
}

impl RecoveryPoint {
    /// The stored text of [`RecoveryPoint::Start`].
    pub const START: &'static str = "start";

    /// Reads a recovery point from its stored text: `start`, or a phase name.
    pub fn from_stored(text: &str) -> Self {
        if text == Self::START {
            Self::Start
        } else {
            Self::After(text.to_owned())
        }
    }

    /// The stored text: `start`, or the phase name.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Start => Self::START,
            Self::After(name) => name,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_phase_names() {
        assert!(PhaseName::new("create_order").is_ok());
        assert!(PhaseName::new("charge.v2").is_ok());
        assert!(matches!(
            PhaseName::new(""),
            Err(PhaseNameError::Length { .. })
        ));
        assert!(matches!(
            PhaseName::new("Charge"),
            Err(PhaseNameError::InvalidCharacter { .. })
        ));
        assert!(matches!(
            PhaseName::new("a:b"),
            Err(PhaseNameError::InvalidCharacter { .. })
        ));
        assert!(matches!(
            PhaseName::new("start"),
            Err(PhaseNameError::Reserved { .. })
        ));
    }

    #[test]
    fn recovery_point_round_trips_through_its_stored_text() {
        assert_eq!(RecoveryPoint::from_stored("start"), RecoveryPoint::Start);
        assert_eq!(RecoveryPoint::from_stored("charge").as_str(), "charge");
    }
}
