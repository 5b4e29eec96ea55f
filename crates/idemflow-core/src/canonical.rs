//! Canonical JSON per RFC 8785, the JSON Canonicalization Scheme (JCS).
//!
//! [`canonicalize`] turns a JSON text into one exact byte sequence, so that two bodies that mean the
//! same thing (key order, whitespace, `1e2` vs `100`, `"\u00e9"` vs `"é"`) fingerprint the same.
//!
//! # How it works
//!
//! A small recursive-descent parser of our own reads the text and writes its canonical form as it
//! goes, without building a tree of values (a tree costs tens of bytes a value however short the
//! value is in the text, so a 1 MiB body of small values once cost 24 MiB): an object's members
//! are written as they come, 12 bytes recorded for each, and put in canonical order when the
//! object closes. Canonicalizing holds the output, one object's worth of scratch and the records
//! of the objects still open: a few times the body's size at most
//! (`tests/canonical_memory.rs`). Owning the parser gives full control over what is accepted:
//!
//! - **Input must be I-JSON** (RFC 7493): valid UTF-8 ([`CanonicalError::InvalidUtf8`]), strict
//!   RFC 8259 grammar ([`CanonicalError::Syntax`]), no duplicate object keys at any depth
//!   ([`CanonicalError::DuplicateKey`]; keys are compared after unescaping, so `"a"` and `"\u0061"`
//!   are the same key), no lone surrogate escapes such as `"\ud800"` (`Syntax`), and no number
//!   beyond the range of a double such as `1e400` ([`CanonicalError::NumberOutOfRange`]). Anything
//!   but JSON whitespace (space, tab, line feed, carriage return) after the value is `Syntax`; a
//!   byte order mark is not whitespace and is refused too.
//! - **Nesting is bounded** by [`MAX_DEPTH`] (128 arrays/objects deep): deeper input is `Syntax`,
//!   so a hostile body cannot overflow the stack of the parser or of the value's drop glue. An
//!   object longer than 4 GiB in canonical form is `Syntax` too.
//! - **Numbers are doubles.** Every number is parsed with Rust's correctly rounded
//!   `str::parse::<f64>()` and written back like ECMAScript's `Number.prototype.toString`: the
//!   shortest digits that round-trip, plain notation for magnitudes in `[1e-6, 1e21)`, exponent
//!   notation (`1e+21`, `1e-7`) outside it, and `-0` written as `0`. As RFC 8785 specifies, integers
//!   beyond 2^53 therefore lose precision: `9007199254740993` canonicalizes to `9007199254740992`,
//!   the same as its neighbour. Clients should send large identifiers (and exact decimal amounts)
//!   as strings. A number so small that it rounds to zero (`1e-400`) is accepted and becomes `0`.
//! - **A request's numbers are kept as written, or refused.** That rounding is right for a
//!   fingerprint but wrong for what runs: an amount of `9007199254740993` would be charged as
//!   `9007199254740992`. [`canonicalize_request`] and [`canonicalize_exact`], what the engine
//!   applies to request bodies, refuse a number whose canonical spelling has another decimal value
//!   than the one written ([`CanonicalError::NumberNotExact`]): an integer beyond 2⁵³ that is not
//!   a double, a fraction with more digits than a double holds (`2500.00000000000001`), a
//!   non-zero number that rounds to zero. Every number a double holds as written is kept
//!   (`9007199254740992`, `1e2`, `0.1`, `2500.0`), and [`canonicalize`] itself stays RFC 8785.
//! - **Strings** are written with only the escapes JCS mandates (`\"`, `\\`, `\b`, `\f`, `\n`, `\r`,
//!   `\t`, and `\u00xx` in lowercase hex for the other control characters below U+0020); everything
//!   else, including `/`, U+007F and all non-ASCII text, is written literally as UTF-8. No Unicode
//!   normalization is applied.
//! - **Object members are sorted** by their keys compared as sequences of UTF-16 code units (not
//!   bytes, not code points: a key starting with an emoji sorts before one starting with U+E000).
//! - **No whitespace** is emitted; `true`, `false` and `null` are written as such.

use std::cmp::Ordering;
use std::fmt::Write as _;

/// The deepest nesting of arrays and objects [`canonicalize`] accepts: a top-level `[]` is depth 1.
pub const MAX_DEPTH: usize = 128;

/// Why a body cannot be canonicalized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonicalError {
    /// The input is not valid UTF-8.
    #[error("the body is not valid UTF-8")]
    InvalidUtf8,
    /// The input breaks the JSON grammar, nests deeper than [`MAX_DEPTH`], holds a lone
    /// surrogate escape or has trailing content; the text says where and what.
    #[error("the body is not valid JSON: {0}")]
    Syntax(String),
    /// An object holds this key twice (compared after unescaping).
    #[error("the object key {0:?} appears twice")]
    DuplicateKey(String),
    /// This number, as written, is beyond the range of a double (`1e400`).
    #[error("the number {0} is beyond the range of a double")]
    NumberOutOfRange(String),
    /// This number of a request cannot be held by a double as written: it would become another
    /// number (`9007199254740993` would become `9007199254740992`). Send it as a string.
    #[error(
        "the number {written} cannot be held exactly (it would become {becomes}): \
         send numbers beyond 2^53, or with more than 15 significant digits, as strings"
    )]
    NumberNotExact {
        /// The number as the request wrote it (abbreviated when long).
        written: String,
        /// The number it would have become.
        becomes: String,
    },
}

/// Returns the RFC 8785 canonical form of a JSON text.
///
/// The input may have whitespace around the value; the output has none. See the
/// [module documentation](self) for what is rejected and how numbers and strings are written.
pub fn canonicalize(json: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    write_canonical(json, Numbers::Rounded)
}

/// A JSON text in canonical form, and its value: what reading the canonical bytes back with
/// `serde_json` gives.
#[derive(Debug, Clone, PartialEq)]
pub struct Canonical {
    /// The canonical text: what [`canonicalize`] returns, and what a fingerprint hashes.
    pub bytes: Vec<u8>,
    /// The same document as a `serde_json` value, equal to reading `bytes` back.
    pub value: serde_json::Value,
}

/// [`canonicalize`], also handing over the value: `serde_json::from_slice(&canonical.bytes)`
/// (numbers as `serde_json` reads their canonical spelling: an integral number that fits `u64`
/// or `i64` is an integer, any other a double), so `1e2` decodes as the integer 100 the
/// fingerprint says it is. A number the canonical form would change is refused
/// ([`CanonicalError::NumberNotExact`]): what the fingerprint covers and what the workflow
/// decodes is the number the client wrote.
pub fn canonicalize_request(json: &[u8]) -> Result<Canonical, CanonicalError> {
    let bytes = write_canonical(json, Numbers::AsWritten)?;
    let value = read_back(&bytes)?;
    Ok(Canonical { bytes, value })
}

/// [`canonicalize`] for a request body whose value is read elsewhere (a handler behind the HTTP
/// layer reads the bytes itself): a number the canonical form would change is refused
/// ([`CanonicalError::NumberNotExact`]), so two requests that differ in such a number never
/// share a fingerprint.
pub fn canonicalize_exact(json: &[u8]) -> Result<Vec<u8>, CanonicalError> {
    write_canonical(json, Numbers::AsWritten)
}

/// What the parser does with a number a double cannot hold as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Numbers {
    /// Rounds it to the nearest double, as RFC 8785 specifies.
    Rounded,
    /// Refuses it: a request's numbers are executed as written or not at all.
    AsWritten,
}

/// Canonical bytes read back as a `serde_json` value. The nesting was bounded by [`MAX_DEPTH`]
/// when the text was read; `serde_json`'s own bound is one level less, so it is lifted here.
fn read_back(canonical: &[u8]) -> Result<serde_json::Value, CanonicalError> {
    use serde::Deserialize as _;
    let mut deserializer = serde_json::Deserializer::from_slice(canonical);
    deserializer.disable_recursion_limit();
    serde_json::Value::deserialize(&mut deserializer).map_err(|error| {
        CanonicalError::Syntax(format!("the canonical form does not read back: {error}"))
    })
}

fn write_canonical(json: &[u8], numbers: Numbers) -> Result<Vec<u8>, CanonicalError> {
    let text = std::str::from_utf8(json).map_err(|_| CanonicalError::InvalidUtf8)?;
    let mut writer = Writer {
        text,
        bytes: json,
        pos: 0,
        numbers,
        // The canonical form is no longer than the text, but for numbers written out longer
        // (`1e20` is `100000000000000000000`).
        out: Vec::with_capacity(json.len()),
        members: Vec::new(),
        scratch: Vec::new(),
    };
    writer.skip_whitespace();
    writer.write_value(0)?;
    writer.skip_whitespace();
    if writer.pos != json.len() {
        return Err(writer.syntax("unexpected data after the JSON value"));
    }
    Ok(writer.out)
}

/// Reads a JSON text and writes its canonical form as it goes: no tree of values is built (a
/// tree costs tens of bytes a value, however short the value is in the text). An object's
/// members are written as they come, each recorded, and put in canonical order when the
/// object closes.
struct Writer<'a> {
    /// The whole input, known to be valid UTF-8.
    text: &'a str,
    /// The same input as bytes.
    bytes: &'a [u8],
    /// Byte offset of the next unread byte. Only ever advanced past ASCII bytes or whole
    /// characters, so it always sits on a character boundary.
    pos: usize,
    numbers: Numbers,
    /// The canonical form so far.
    out: Vec<u8>,
    /// The members written so far of every object still open, innermost last.
    members: Vec<Member>,
    /// Where an object's members are put in order, kept for the next object.
    scratch: Vec<u8>,
}

/// One member of an open object, as written in `out`: offsets from the object's `{`, 12 bytes a
/// member, so that an object of many short members (`"a1":0,` is 7 bytes) costs little more.
#[derive(Debug, Clone, Copy)]
struct Member {
    /// The key's opening quote.
    start: u32,
    /// Just after the key's closing quote.
    key_end: u32,
    /// Just after the value.
    end: u32,
}

impl Writer<'_> {
    fn syntax(&self, what: &str) -> CanonicalError {
        CanonicalError::Syntax(format!("{what} at byte {}", self.pos))
    }

    fn peek(&self) -> Option<u8> {
        self.bytes.get(self.pos).copied()
    }

    fn skip_whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn write_literal(&mut self, literal: &str) -> Result<(), CanonicalError> {
        if self.bytes[self.pos..].starts_with(literal.as_bytes()) {
            self.pos += literal.len();
            self.out.extend_from_slice(literal.as_bytes());
            Ok(())
        } else {
            Err(self.syntax("invalid literal"))
        }
    }

    /// Reads one value starting at `pos` (whitespace already skipped) and writes its canonical
    /// form. `depth` is the number of arrays and objects that enclose it.
    fn write_value(&mut self, depth: usize) -> Result<(), CanonicalError> {
        match self.peek() {
            None => Err(self.syntax("unexpected end of input")),
            Some(b'{') => self.write_object(depth + 1),
            Some(b'[') => self.write_array(depth + 1),
            Some(b'"') => self.write_string(),
            Some(b't') => self.write_literal("true"),
            Some(b'f') => self.write_literal("false"),
            Some(b'n') => self.write_literal("null"),
            Some(b'-' | b'0'..=b'9') => {
                let number = format_number(self.parse_number()?);
                self.reserve(number.len());
                self.out.extend_from_slice(number.as_bytes());
                Ok(())
            }
            Some(_) => Err(self.syntax("expected a JSON value")),
        }
    }

    /// Room in `out` for `more` bytes. Only a number's canonical form can be longer than its
    /// text (`1e20`, 4 bytes, is 21 digits), so only numbers can outgrow the text's length: the
    /// output is then grown to the length it is heading for (its length so far, scaled by the
    /// share of the text read) and an eighth more, not doubled, so that a body of such numbers
    /// holds about its canonical form, not twice it.
    fn reserve(&mut self, more: usize) {
        let length = self.out.len();
        if self.out.capacity() - length >= more {
            return;
        }
        let heading = (length as u128 * self.bytes.len() as u128 / self.pos.max(1) as u128)
            .try_into()
            .unwrap_or(usize::MAX);
        let wanted = heading.saturating_add(heading / 8).max(length + more);
        self.out.reserve_exact(wanted - length);
    }

    fn check_depth(&self, depth: usize) -> Result<(), CanonicalError> {
        if depth > MAX_DEPTH {
            Err(CanonicalError::Syntax(format!(
                "nesting deeper than {MAX_DEPTH} levels at byte {}",
                self.pos
            )))
        } else {
            Ok(())
        }
    }

    fn write_array(&mut self, depth: usize) -> Result<(), CanonicalError> {
        self.check_depth(depth)?;
        self.pos += 1; // '['
        self.out.push(b'[');
        self.skip_whitespace();
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.out.push(b']');
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            self.write_value(depth)?;
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                Some(b']') => {
                    self.pos += 1;
                    self.out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.syntax("expected ',' or ']' in an array")),
            }
        }
    }

    fn write_object(&mut self, depth: usize) -> Result<(), CanonicalError> {
        self.check_depth(depth)?;
        self.pos += 1; // '{'
        let open = self.out.len();
        self.out.push(b'{');
        let first = self.members.len();
        self.skip_whitespace();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.out.push(b'}');
            return Ok(());
        }
        loop {
            self.skip_whitespace();
            if self.peek() != Some(b'"') {
                return Err(self.syntax("expected a string key in an object"));
            }
            let start = self.out.len();
            self.write_string()?;
            let key_end = self.out.len();
            self.skip_whitespace();
            if self.peek() != Some(b':') {
                return Err(self.syntax("expected ':' after an object key"));
            }
            self.pos += 1;
            self.out.push(b':');
            self.skip_whitespace();
            self.write_value(depth)?;
            let member = self.member(open, start, key_end)?;
            self.members.push(member);
            self.skip_whitespace();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                Some(b'}') => {
                    self.pos += 1;
                    break;
                }
                _ => return Err(self.syntax("expected ',' or '}' in an object")),
            }
        }
        self.put_in_order(open, first)?;
        self.members.truncate(first);
        self.out.push(b'}');
        Ok(())
    }

    /// The member just written, from `start`, its key ending at `key_end`, its value at the
    /// end of `out`; offsets from the object's `{` at `open`.
    fn member(&self, open: usize, start: usize, key_end: usize) -> Result<Member, CanonicalError> {
        let offset = |at: usize| {
            u32::try_from(at - open).map_err(|_| {
                CanonicalError::Syntax(format!(
                    "an object longer than 4 GiB in canonical form at byte {}",
                    self.pos
                ))
            })
        };
        Ok(Member {
            start: offset(start)?,
            key_end: offset(key_end)?,
            end: offset(self.out.len())?,
        })
    }

    /// Puts the members of the object opened at `open` (`members[first..]`, as written,
    /// separated by commas) in canonical order, refusing a key written twice.
    fn put_in_order(&mut self, open: usize, first: usize) -> Result<(), CanonicalError> {
        let Self {
            out,
            members,
            scratch,
            ..
        } = self;
        let members = &mut members[first..];
        let span = |at: u32, to: u32| open + at as usize..open + to as usize;
        // The key's text between its quotes, as written (with the canonical escapes).
        let key = |member: &Member| {
            let literal = &out[span(member.start + 1, member.key_end - 1)];
            std::str::from_utf8(literal).unwrap_or_default()
        };
        if members
            .windows(2)
            .all(|pair| compare_keys(key(&pair[0]), key(&pair[1])) == Ordering::Less)
        {
            return Ok(()); // in order already, so no key twice either
        }
        members.sort_unstable_by(|a, b| compare_keys(key(a), key(b)));
        // Two keys are the same exactly when their canonical spellings are.
        if let Some(pair) = members
            .windows(2)
            .find(|pair| key(&pair[0]) == key(&pair[1]))
        {
            return Err(CanonicalError::DuplicateKey(
                unescaped(key(&pair[0])).collect(),
            ));
        }
        let content = open + 1..out.len();
        if scratch.capacity() < content.len() {
            // Not grown in place: the old buffer would be copied for nothing.
            *scratch = Vec::new();
            scratch.reserve_exact(content.len());
        }
        scratch.clear();
        for (index, member) in members.iter().enumerate() {
            if index > 0 {
                scratch.push(b',');
            }
            scratch.extend_from_slice(&out[span(member.start, member.end)]);
        }
        out[content].copy_from_slice(scratch);
        scratch.clear();
        Ok(())
    }

    /// Reads a string starting at its opening quote, resolving escapes, and writes it with the
    /// canonical ones.
    fn write_string(&mut self) -> Result<(), CanonicalError> {
        self.pos += 1; // '"'
        self.out.push(b'"');
        let mut run_start = self.pos;
        loop {
            match self.peek() {
                None => return Err(self.syntax("unterminated string")),
                Some(b'"') => {
                    self.out.extend_from_slice(&self.bytes[run_start..self.pos]);
                    self.pos += 1;
                    self.out.push(b'"');
                    return Ok(());
                }
                Some(b'\\') => {
                    self.out.extend_from_slice(&self.bytes[run_start..self.pos]);
                    self.pos += 1;
                    let character = self.parse_escape()?;
                    write_char(character, &mut self.out);
                    run_start = self.pos;
                }
                Some(0x00..=0x1f) => {
                    return Err(self.syntax("unescaped control character in a string"));
                }
                // Any other byte, including the bytes of multi-byte UTF-8 characters, is copied
                // with its run (canonical JSON writes them as they are); runs are cut only at
                // ASCII bytes, so they are whole characters.
                Some(_) => self.pos += 1,
            }
        }
    }

    /// Parses the escape after a backslash (already consumed): the character it stands for.
    fn parse_escape(&mut self) -> Result<char, CanonicalError> {
        let Some(byte) = self.peek() else {
            return Err(self.syntax("unterminated escape"));
        };
        self.pos += 1;
        Ok(match byte {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => self.parse_unicode_escape()?,
            _ => {
                self.pos -= 1;
                return Err(self.syntax("invalid escape"));
            }
        })
    }

    /// Parses the `XXXX` of a `\uXXXX` escape, and its low surrogate partner if it is a high one.
    fn parse_unicode_escape(&mut self) -> Result<char, CanonicalError> {
        let first = self.parse_hex4()?;
        match first {
            0xD800..=0xDBFF => {
                if !self.bytes[self.pos..].starts_with(b"\\u") {
                    return Err(self.syntax("high surrogate escape without a low surrogate"));
                }
                self.pos += 2;
                let second = self.parse_hex4()?;
                if !(0xDC00..=0xDFFF).contains(&second) {
                    return Err(self.syntax("high surrogate escape without a low surrogate"));
                }
                let code =
                    0x10000 + ((u32::from(first) - 0xD800) << 10) + (u32::from(second) - 0xDC00);
                char::from_u32(code).ok_or_else(|| self.syntax("invalid surrogate pair"))
            }
            0xDC00..=0xDFFF => Err(self.syntax("low surrogate escape without a high surrogate")),
            _ => char::from_u32(u32::from(first)).ok_or_else(|| self.syntax("invalid escape")),
        }
    }

    fn parse_hex4(&mut self) -> Result<u16, CanonicalError> {
        let mut value: u16 = 0;
        for _ in 0..4 {
            let digit = match self.peek() {
                Some(byte @ b'0'..=b'9') => byte - b'0',
                Some(byte @ b'a'..=b'f') => byte - b'a' + 10,
                Some(byte @ b'A'..=b'F') => byte - b'A' + 10,
                _ => return Err(self.syntax("expected four hex digits in a \\u escape")),
            };
            value = (value << 4) | u16::from(digit);
            self.pos += 1;
        }
        Ok(value)
    }

    /// Parses a number per the RFC 8259 grammar, then converts it to the nearest double.
    fn parse_number(&mut self) -> Result<f64, CanonicalError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek() {
            Some(b'0') => {
                self.pos += 1;
                if let Some(b'0'..=b'9') = self.peek() {
                    return Err(self.syntax("leading zero in a number"));
                }
            }
            Some(b'1'..=b'9') => self.skip_digits(),
            _ => return Err(self.syntax("expected a digit in a number")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            self.require_digits("expected a digit after the decimal point")?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.require_digits("expected a digit in the exponent")?;
        }
        let literal = &self.text[start..self.pos];
        let value: f64 = literal
            .parse()
            .map_err(|_| CanonicalError::Syntax(format!("invalid number at byte {start}")))?;
        if !value.is_finite() {
            return Err(CanonicalError::NumberOutOfRange(abbreviate(literal)));
        }
        if self.numbers == Numbers::AsWritten && !held_as_written(literal, value) {
            return Err(CanonicalError::NumberNotExact {
                written: abbreviate(literal),
                becomes: format_number(value),
            });
        }
        Ok(value)
    }

    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn require_digits(&mut self, what: &str) -> Result<(), CanonicalError> {
        if let Some(b'0'..=b'9') = self.peek() {
            self.skip_digits();
            Ok(())
        } else {
            Err(self.syntax(what))
        }
    }
}

/// Whether `value`, the double nearest to `literal` (a number in the JSON grammar), has the
/// decimal value `literal` has, as its canonical spelling writes it: the same significant digits
/// at the same power of ten. Then decoding the canonical form gives the number the client wrote.
fn held_as_written(literal: &str, value: f64) -> bool {
    // Any decimal of at most 15 significant digits in the normal range comes back from its
    // nearest double unchanged (DBL_DIG): the common case (an amount, a quantity), decided by
    // counting the mantissa's digits, without allocating or formatting.
    let mantissa = literal.split(['e', 'E']).next().unwrap_or(literal);
    if value.abs() >= f64::MIN_POSITIVE && mantissa.bytes().filter(u8::is_ascii_digit).count() <= 15
    {
        return true;
    }
    let written = significant(literal);
    if value == 0.0 {
        // -0 and 0e7 are zero as written; 1e-400 is not.
        return written.is_none();
    }
    let Some((digits, exponent)) = written else {
        return false;
    };
    if digits.len() <= 15 && value.abs() >= f64::MIN_POSITIVE {
        return true;
    }
    let (held_digits, held_exponent) = shortest_digits(value.abs());
    digits == held_digits && exponent == i64::from(held_exponent)
}

/// A number literal's significant digits (no leading or trailing zeros) and the power of ten of
/// the first (scientific notation: `d.ddd × 10^exponent`); `None` for zero.
fn significant(literal: &str) -> Option<(String, i64)> {
    let unsigned = literal.strip_prefix('-').unwrap_or(literal);
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        // An exponent too long for an i64 makes the number 0 or infinite, both refused before
        // or decided by `value == 0.0`; saturating keeps it far out of any double's range.
        Some((mantissa, exponent)) => (
            mantissa,
            exponent
                .parse::<i64>()
                .unwrap_or(if exponent.starts_with('-') {
                    i64::MIN / 2
                } else {
                    i64::MAX / 2
                }),
        ),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all: String = whole.chars().chain(fraction.chars()).collect();
    let leading = all.len() - all.trim_start_matches('0').len();
    let digits = all.trim_matches('0');
    if digits.is_empty() {
        return None;
    }
    let whole_len = i64::try_from(whole.len()).unwrap_or(i64::MAX);
    let leading = i64::try_from(leading).unwrap_or(i64::MAX);
    Some((
        digits.to_owned(),
        exponent.saturating_add(whole_len - 1 - leading),
    ))
}

/// Keeps error messages bounded when a client sends a number thousands of digits long.
fn abbreviate(literal: &str) -> String {
    const LIMIT: usize = 64;
    if literal.len() <= LIMIT {
        literal.to_owned()
    } else {
        // Number literals are ASCII, so any byte offset is a character boundary.
        format!("{}...({} digits)", &literal[..LIMIT], literal.len())
    }
}

/// Orders two keys, each its text between the quotes as canonical JSON writes it, as
/// sequences of UTF-16 code units, as RFC 8785 section 3.2.3 requires.
fn compare_keys(a: &str, b: &str) -> Ordering {
    utf16(a).cmp(utf16(b))
}

/// The UTF-16 code units of a key written with canonical escapes.
fn utf16(escaped: &str) -> impl Iterator<Item = u16> + '_ {
    unescaped(escaped).flat_map(|character| {
        let mut units = [0u16; 2];
        let length = character.encode_utf16(&mut units).len();
        units.into_iter().take(length)
    })
}

/// The characters of a string's text written with canonical escapes (only `\"`, `\\`, `\b`,
/// `\f`, `\n`, `\r`, `\t` and `\u00xx` occur).
fn unescaped(escaped: &str) -> impl Iterator<Item = char> + '_ {
    let mut characters = escaped.chars();
    std::iter::from_fn(move || {
        let character = characters.next()?;
        if character != '\\' {
            return Some(character);
        }
        Some(match characters.next()? {
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let code = (0..4).try_fold(0u32, |code, _| {
                    Some(code * 16 + characters.next()?.to_digit(16)?)
                })?;
                char::from_u32(code)?
            }
            other => other,
        })
    })
}

/// Writes one character of a string with exactly the escapes of RFC 8785 section 3.2.2.2.
fn write_char(character: char, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let escape: &[u8] = match character {
        '"' => b"\\\"",
        '\\' => b"\\\\",
        '\u{8}' => b"\\b",
        '\u{c}' => b"\\f",
        '\n' => b"\\n",
        '\r' => b"\\r",
        '\t' => b"\\t",
        '\u{0}'..='\u{1f}' => {
            let byte = character as u8;
            out.extend_from_slice(&[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[usize::from(byte >> 4)],
                HEX[usize::from(byte & 0xf)],
            ]);
            return;
        }
        _ => {
            let mut buffer = [0u8; 4];
            out.extend_from_slice(character.encode_utf8(&mut buffer).as_bytes());
            return;
        }
    };
    out.extend_from_slice(escape);
}

/// The decimal digits (no trailing zeros) and exponent of the ECMAScript representation of a
/// positive finite double: the value is `d.ddd × 10^exponent`.
///
/// ECMA-262 asks for the fewest digits that round-trip and, among those, the ones closest to the
/// value, with ties going to the even digit. Rust's `{:e}` gives the fewest digits, but on a tie
/// it rounds up: for 700635288402475.25 (exactly representable) both `…475.2` and `…475.3`
/// round-trip and are as close, and `{:e}` gives `…475.3` where ECMAScript gives `…475.2`. So the
/// digit count is taken from `{:e}` and the digits from `{:.N$e}`, Rust's correctly rounded
/// (ties-to-even) fixed-precision format, whenever those digits round-trip too.
fn shortest_digits(value: f64) -> (String, i32) {
    let shortest = format!("{value:e}");
    let (mut digits, mut exponent) = split_scientific(&shortest);
    let nearest = format!("{value:.*e}", digits.len() - 1);
    if nearest != shortest && nearest.parse::<f64>() == Ok(value) {
        (digits, exponent) = split_scientific(&nearest);
    }
    (digits, exponent)
}

/// Splits Rust's `d[.ddd]e[-]x` float format into its significant digits (without trailing
/// zeros) and its exponent.
fn split_scientific(scientific: &str) -> (String, i32) {
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("Rust's {:e} float format always has an exponent");
    let exponent: i32 = exponent
        .parse()
        .expect("Rust's {:e} float format has an integer exponent");
    let mut digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let significant = digits.trim_end_matches('0').len().max(1);
    digits.truncate(significant);
    (digits, exponent)
}

/// Formats a finite double like ECMAScript's `Number.prototype.toString` (ECMA-262,
/// Number::toString with radix 10), as RFC 8785 section 3.2.2.3 requires.
fn format_number(value: f64) -> String {
    debug_assert!(value.is_finite(), "the parser only produces finite numbers");
    if value == 0.0 {
        // Both +0 and -0.
        return "0".to_owned();
    }
    let mut out = String::new();
    if value < 0.0 {
        out.push('-');
    }
    let (digits, exponent) = shortest_digits(value.abs());
    // In ECMA-262 terms: the value is 0.digits * 10^n, with k digits.
    let k = i32::try_from(digits.len()).expect("a double has at most 17 significant digits");
    let n = exponent + 1;
    if k <= n && n <= 21 {
        // An integer: the digits then zeros, e.g. 123000.
        out.push_str(&digits);
        out.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        // A decimal point inside the digits, e.g. 12.3.
        let (whole, fraction) = digits.split_at(n as usize);
        out.push_str(whole);
        out.push('.');
        out.push_str(fraction);
    } else if -6 < n && n <= 0 {
        // A small number without exponent, e.g. 0.00123.
        out.push_str("0.");
        out.extend(std::iter::repeat_n('0', (-n) as usize));
        out.push_str(&digits);
    } else {
        // Exponent form, e.g. 1e+21, 1.5e-7.
        let (first, rest) = digits.split_at(1);
        out.push_str(first);
        if !rest.is_empty() {
            out.push('.');
            out.push_str(rest);
        }
        let sign = if n - 1 < 0 { '-' } else { '+' };
        write!(out, "e{sign}{}", (n - 1).abs()).expect("writing to a String cannot fail");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canon(json: &str) -> Result<String, CanonicalError> {
        canonicalize(json.as_bytes())
            .map(|bytes| String::from_utf8(bytes).expect("canonical output is UTF-8"))
    }

    fn ok(json: &str) -> String {
        canon(json).unwrap_or_else(|error| panic!("{json:?} should canonicalize: {error}"))
    }

    fn is_syntax(result: Result<String, CanonicalError>) -> bool {
        matches!(result, Err(CanonicalError::Syntax(_)))
    }

    #[test]
    // The literals spell exact doubles on purpose (ties, and values that round to a neighbour).
    #[allow(clippy::excessive_precision)]
    fn number_formatting() {
        let table: &[(f64, &str)] = &[
            (0.0, "0"),
            (-0.0, "0"),
            (1.0, "1"),
            (-1.0, "-1"),
            (0.1, "0.1"),
            (-0.5, "-0.5"),
            (1e21, "1e+21"),
            (1e20, "100000000000000000000"),
            (123456789012345680000.0, "123456789012345680000"),
            (1.5e21, "1.5e+21"),
            (1e30, "1e+30"),
            (1e-6, "0.000001"),
            (1.5e-6, "0.0000015"),
            (1e-7, "1e-7"),
            (1.25e-7, "1.25e-7"),
            (5e-324, "5e-324"),
            (-5e-324, "-5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (333333333.33333329, "333333333.3333333"),
            (4.50, "4.5"),
            (2e-3, "0.002"),
            (9007199254740993.0, "9007199254740992"),
            (123.0, "123"),
            (12.5, "12.5"),
            (0.000123, "0.000123"),
            (1e-27, "1e-27"),
            (f64::EPSILON, "2.220446049250313e-16"),
            // Ties between two shortest candidates go to the even digit, as in ECMAScript
            // (Rust's own `{:e}` rounds these up).
            (700635288402475.25, "700635288402475.2"),
            (203963124808269.625, "203963124808269.62"),
            (-1867730651453702.25, "-1867730651453702.2"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e23, "1e+23"),
            (9.999999999999999e22, "1e+23"),
            (9.999999999999997e22, "9.999999999999997e+22"),
        ];
        for &(value, expected) in table {
            assert_eq!(format_number(value), expected, "formatting {value:e}");
        }
    }

    #[test]
    fn numbers_through_the_parser() {
        let table = [
            ("0", "0"),
            ("-0", "0"),
            ("-0.0e-5", "0"),
            ("1E2", "100"),
            ("1e+2", "100"),
            ("100e-2", "1"),
            ("4.50", "4.5"),
            ("2e-3", "0.002"),
            ("333333333.33333329", "333333333.3333333"),
            ("1E30", "1e+30"),
            ("0.000000000000000000000000001", "1e-27"),
            ("9007199254740993", "9007199254740992"),
            ("9007199254740992", "9007199254740992"),
            ("1.7976931348623157e308", "1.7976931348623157e+308"),
            ("5e-324", "5e-324"),
            ("1e-400", "0"),
            ("123456789012345678901234567890", "1.2345678901234568e+29"),
        ];
        for (input, expected) in table {
            assert_eq!(ok(input), expected, "canonicalizing {input}");
        }
    }

    #[test]
    fn numbers_out_of_range() {
        for input in [
            "1e400",
            "-1e400",
            "1.7976931348623159e308",
            "[1e99999999999999999999]",
        ] {
            assert!(
                matches!(canon(input), Err(CanonicalError::NumberOutOfRange(_))),
                "{input} should be out of range, got {:?}",
                canon(input)
            );
        }
        assert_eq!(
            canon("1e400"),
            Err(CanonicalError::NumberOutOfRange("1e400".to_owned()))
        );
        // The largest double still parses: 1.7976931348623158e308 rounds down to it.
        assert_eq!(ok("1.7976931348623158e308"), "1.7976931348623157e+308");
        let long = format!("1{}", "0".repeat(400));
        let Err(CanonicalError::NumberOutOfRange(shown)) = canon(&long) else {
            panic!("a 401-digit integer is out of range");
        };
        assert!(
            shown.len() < 100,
            "long literals are abbreviated in errors: {shown}"
        );
    }

    #[test]
    fn a_request_s_numbers_are_kept_as_written_or_refused() {
        let request = |json: &str| canonicalize_exact(json.as_bytes()).map(String::from_utf8);
        for (written, canonical) in [
            ("9007199254740992", "9007199254740992"),
            ("-9007199254740992", "-9007199254740992"),
            ("1e2", "100"),
            ("2500.0", "2500"),
            ("0.1", "0.1"),
            ("-0", "0"),
            ("0e999999999999999999999", "0"),
            ("1.5e300", "1.5e+300"),
            ("123456789012345", "123456789012345"),
            ("5e-324", "5e-324"),
        ] {
            assert_eq!(request(written), Ok(Ok(canonical.to_owned())), "{written}");
        }
        for (written, becomes) in [
            ("9007199254740993", "9007199254740992"),
            ("-9007199254740993", "-9007199254740992"),
            ("2500.00000000000001", "2500"),
            ("12345678901234567", "12345678901234568"),
            ("1e-400", "0"),
            ("4.9e-324", "5e-324"),
        ] {
            assert_eq!(
                request(written),
                Err(CanonicalError::NumberNotExact {
                    written: written.to_owned(),
                    becomes: becomes.to_owned()
                }),
                "{written}"
            );
            // RFC 8785 itself rounds them, as it must.
            assert_eq!(canon(written), Ok(becomes.to_owned()), "{written}");
        }
    }

    #[test]
    fn number_grammar() {
        for input in [
            "01",
            "-",
            "+1",
            "1.",
            ".5",
            "1e",
            "1e+",
            "-01",
            "0x10",
            "NaN",
            "Infinity",
            "-Infinity",
            "1.e5",
            "--1",
            "1 2",
        ] {
            assert!(
                is_syntax(canon(input)),
                "{input} should be a syntax error, got {:?}",
                canon(input)
            );
        }
    }

    #[test]
    fn string_escaping() {
        let table = [
            (r#""""#, r#""""#),
            (r#""abc""#, r#""abc""#),
            (r#""\"\\""#, r#""\"\\""#),
            (r#""\/""#, r#""/""#),
            (r#""/""#, r#""/""#),
            (r#""\b\f\n\r\t""#, r#""\b\f\n\r\t""#),
            (r#""\u0008\u000C\u000a\u000D\u0009""#, r#""\b\f\n\r\t""#),
            (
                r#""\u0000\u0001\u001f\u000B""#,
                r#""\u0000\u0001\u001f\u000b""#,
            ),
            (r#""\u007f""#, "\"\u{7f}\""),
            (r#""\u00e9""#, "\"é\""),
            (r#""\u00E9""#, "\"é\""),
            ("\"é\"", "\"é\""),
            (r#""\u20ac""#, "\"€\""),
            (r#""\ud83d\ude02""#, "\"😂\""),
            (r#""\uD83D\uDE02""#, "\"😂\""),
            ("\"😂\"", "\"😂\""),
            (r#""\ufeff""#, "\"\u{feff}\""),
            (r#""A\u030a""#, "\"A\u{30a}\""),
            (r#""</script>""#, r#""</script>""#),
        ];
        for (input, expected) in table {
            assert_eq!(ok(input), expected, "canonicalizing {input}");
        }
    }

    #[test]
    fn string_errors() {
        for input in [
            r#""\ud800""#,
            r#""\ud800x""#,
            r#""\udc00""#,
            r#""\ud800\u0041""#,
            r#""\ud800\ud800""#,
            r#""\ude02\ud83d""#,
            r#""\u12""#,
            r#""\u12g4""#,
            r#""\x41""#,
            r#""\a""#,
            "\"tab\tinside\"",
            "\"line\nbreak\"",
            "\"\u{0}\"",
            r#""unterminated"#,
            r#""escape at end\"#,
            "'single'",
        ] {
            assert!(
                is_syntax(canon(input)),
                "{input:?} should be a syntax error, got {:?}",
                canon(input)
            );
        }
    }

    #[test]
    fn literals_and_structures() {
        assert_eq!(ok("true"), "true");
        assert_eq!(ok("false"), "false");
        assert_eq!(ok("null"), "null");
        assert_eq!(ok("[]"), "[]");
        assert_eq!(ok("{}"), "{}");
        assert_eq!(ok("[ 1 , [ ] , { } , null ]"), "[1,[],{},null]");
        assert_eq!(
            ok(r#"{"b":1,"a":{"d":[true,false],"c":null}}"#),
            r#"{"a":{"c":null,"d":[true,false]},"b":1}"#
        );
        for input in [
            "tru",
            "nul",
            "True",
            "[1,]",
            "[,1]",
            "{,}",
            r#"{"a":1,}"#,
            r#"{"a" 1}"#,
            "{1:2}",
            "[1 2]",
            "{\"a\"}",
            "[",
            "{",
            "]",
            "",
        ] {
            assert!(
                is_syntax(canon(input)),
                "{input:?} should be a syntax error, got {:?}",
                canon(input)
            );
        }
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+E000 is above the surrogates that encode U+1F600, so the emoji sorts first in UTF-16
        // although it is the larger code point (and sorts last by UTF-8 bytes).
        assert_eq!(
            ok("{\"\u{e000}\":1,\"\u{1f600}\":2}"),
            "{\"\u{1f600}\":2,\"\u{e000}\":1}"
        );
        assert_eq!(
            ok(r#"{"b":1,"a":2,"":3,"aa":4,"A":5}"#),
            r#"{"":3,"A":5,"a":2,"aa":4,"b":1}"#
        );
        assert_eq!(ok(r#"{"10":1,"1":2,"9":3}"#), r#"{"1":2,"10":1,"9":3}"#);
    }

    #[test]
    fn duplicate_keys() {
        assert_eq!(
            canon(r#"{"a":1,"a":2}"#),
            Err(CanonicalError::DuplicateKey("a".to_owned()))
        );
        assert_eq!(
            canon(r#"{"a":1,"b":2,"a":1}"#),
            Err(CanonicalError::DuplicateKey("a".to_owned()))
        );
        assert_eq!(
            canon(r#"{"x":[{"ok":1},{"k":{"é":1,"\u00e9":2}}]}"#),
            Err(CanonicalError::DuplicateKey("é".to_owned()))
        );
        assert_eq!(canon(r#"{"a":{"a":1}}"#).as_deref(), Ok(r#"{"a":{"a":1}}"#));
        assert_eq!(
            canon(r#"[{"a":1},{"a":1}]"#).as_deref(),
            Ok(r#"[{"a":1},{"a":1}]"#)
        );
        assert_eq!(
            canon(r#"{"\u0061":1,"a":2}"#),
            Err(CanonicalError::DuplicateKey("a".to_owned()))
        );
    }

    #[test]
    fn invalid_utf8() {
        for input in [
            &b"\"\xff\""[..],
            b"\"\xc3\"",
            b"\"\xed\xa0\x80\"", // an encoded surrogate, not valid UTF-8
            b"\xc0\xaf",
            b"{\"a\":\"\xe2\x82\"}",
        ] {
            assert_eq!(
                canonicalize(input),
                Err(CanonicalError::InvalidUtf8),
                "{input:?}"
            );
        }
    }

    #[test]
    fn nesting_depth() {
        let nested = |open: &str, close: &str, depth: usize| {
            format!("{}{}", open.repeat(depth), close.repeat(depth))
        };
        assert_eq!(
            ok(&nested("[", "]", MAX_DEPTH)),
            nested("[", "]", MAX_DEPTH)
        );
        assert!(is_syntax(canon(&nested("[", "]", MAX_DEPTH + 1))));
        let objects = |depth: usize| format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
        assert_eq!(ok(&objects(MAX_DEPTH)), objects(MAX_DEPTH));
        assert!(is_syntax(canon(&objects(MAX_DEPTH + 1))));
        let mixed = format!(
            "{}{}",
            "[{\"a\":".repeat(MAX_DEPTH / 2),
            "}]".repeat(MAX_DEPTH / 2)
        );
        assert!(
            is_syntax(canon(&mixed)),
            "the innermost object has no value"
        );
        let mixed = format!(
            "{}[]{}",
            "[{\"a\":".repeat(MAX_DEPTH / 2),
            "}]".repeat(MAX_DEPTH / 2)
        );
        assert!(is_syntax(canon(&mixed)), "one level too deep");
        let mixed = format!(
            "{}0{}",
            "[{\"a\":".repeat(MAX_DEPTH / 2),
            "}]".repeat(MAX_DEPTH / 2)
        );
        assert_eq!(ok(&mixed), mixed);
        // Far too deep, and unterminated: refused without recursing a million frames.
        assert!(is_syntax(canon(&"[".repeat(1_000_000))));
        assert!(is_syntax(canon(&"{\"a\":".repeat(1_000_000))));
    }

    #[test]
    fn whitespace_and_trailing_data() {
        assert_eq!(
            ok(" \t\r\n{ \"a\" :\n[ 1 ,\t2 ] } \r\n\t "),
            r#"{"a":[1,2]}"#
        );
        assert_eq!(ok("  7  "), "7");
        for input in [
            "{} x",
            "{}{}",
            "1 2",
            "[] ]",
            "null,",
            "\"a\" \"b\"",
            "\u{feff}{}",
            "{}\u{a0}",
            "\u{c}1",
            "{}\0",
        ] {
            assert!(
                is_syntax(canon(input)),
                "{input:?} should be a syntax error, got {:?}",
                canon(input)
            );
        }
        for input in ["", "   ", "\n"] {
            assert!(
                is_syntax(canon(input)),
                "{input:?} should be a syntax error"
            );
        }
    }

    #[test]
    fn errors_read_well() {
        assert_eq!(
            CanonicalError::DuplicateKey("a".to_owned()).to_string(),
            "the object key \"a\" appears twice"
        );
        let Err(CanonicalError::Syntax(message)) = canon("[1,]") else {
            panic!("[1,] is a syntax error");
        };
        assert!(message.contains("byte 3"), "{message}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every finite double survives the trip through text: its canonical form parses back to
        /// the same double, is valid JSON that canonicalizes to itself, and agrees with format_number.
        #[test]
        fn every_finite_double_round_trips(bits in any::<u64>()) {
            let value = f64::from_bits(bits);
            prop_assume!(value.is_finite());
            for text in [format!("{value:e}"), format!("{value:?}"), format!("{value}")] {
                let canonical = ok(&text);
                prop_assert_eq!(&canonical, &format_number(value));
                let back: f64 = canonical.parse().expect("canonical numbers parse");
                prop_assert!(back == value, "{} became {}", text, canonical);
                prop_assert_eq!(ok(&canonical), canonical.clone());
            }
        }

        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = canonicalize(&bytes);
        }

        #[test]
        fn never_panics_on_json_like_text(text in r#"[\[\]{}":,0-9eE.+\- a-z\\u]{0,40}"#) {
            if let Ok(canonical) = canonicalize(text.as_bytes()) {
                prop_assert_eq!(canonicalize(&canonical), Ok(canonical.clone()));
            }
        }
    }
}
