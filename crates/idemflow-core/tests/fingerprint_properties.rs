//! Properties of JSON fingerprints: what must not change them (key order, whitespace, escapes,
//! number spelling) and what must (any single leaf value or key).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use idemflow_core::{CanonicalError, Fingerprint, canonicalize};
use proptest::prelude::*;

/// A JSON value as generated: object keys are unique, numbers are finite.
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// The double this number means, if it is one.
    fn as_f64(&self) -> Option<f64> {
        match self {
            Self::Int(int) => Some(*int as f64),
            Self::Float(float) => Some(*float),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Generation

fn arb_char() -> impl Strategy<Value = char> {
    prop_oneof![
        4 => proptest::char::range('a', 'z'),
        2 => any::<char>(),
        2 => prop::sample::select(vec![
            '"', '\\', '/', '\u{0}', '\u{8}', '\u{9}', '\u{a}', '\u{c}', '\u{d}', '\u{1f}', '\u{7f}',
            'A', 'é', '€', '\u{301}', '\u{e000}', '\u{fb33}', '\u{feff}', '\u{ffff}', '😀', '\u{10ffff}',
        ]),
    ]
}

fn arb_string() -> impl Strategy<Value = String> {
    prop::collection::vec(arb_char(), 0..6).prop_map(|chars| chars.into_iter().collect())
}

fn arb_finite_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        any::<u64>()
            .prop_map(f64::from_bits)
            .prop_filter("finite", |float| float.is_finite()),
        (-4000_i32..4000).prop_map(|eighths| f64::from(eighths) / 8.0),
        (-40_i32..40).prop_map(|power| 10_f64.powi(power)),
    ]
}

fn arb_json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i64>().prop_map(Json::Int),
        (-1000_i64..1000).prop_map(Json::Int),
        arb_finite_f64().prop_map(Json::Float),
        arb_string().prop_map(Json::Str),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(arb_string(), inner, 0..6).prop_map(
                |members: BTreeMap<String, Json>| Json::Object(members.into_iter().collect())
            ),
        ]
    })
}

// ---------------------------------------------------------------------------------------------
// A serializer that writes the same value in many spellings

/// SplitMix64: a tiny deterministic generator, so each proptest seed is one spelling.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound as u64) as usize
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }
}

/// Writes `value` as JSON with shuffled object members, random whitespace, random escapes and
/// random (but equal-valued) number spellings.
fn spell(value: &Json, rng: &mut Rng) -> String {
    let mut out = String::new();
    whitespace(&mut out, rng);
    spell_value(value, rng, &mut out);
    whitespace(&mut out, rng);
    out
}

fn whitespace(out: &mut String, rng: &mut Rng) {
    if rng.chance(2) {
        return;
    }
    for _ in 0..=rng.below(3) {
        out.push([' ', '\t', '\n', '\r'][rng.below(4)]);
    }
}

fn spell_value(value: &Json, rng: &mut Rng, out: &mut String) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(boolean) => out.push_str(if *boolean { "true" } else { "false" }),
        Json::Int(int) => match rng.below(5) {
            0 => write!(out, "{int}.0"),
            1 => write!(out, "{int}e0"),
            // Not for zero: "000E-2" has leading zeros, which JSON forbids.
            2 if *int != 0 => write!(out, "{int}00E-2"),
            3 => write!(out, "{int}.000e+0"),
            _ => write!(out, "{int}"),
        }
        .expect("writing to a String cannot fail"),
        Json::Float(float) => spell_float(*float, rng, out),
        Json::Str(string) => spell_string(string, rng, out),
        Json::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                whitespace(out, rng);
                spell_value(item, rng, out);
                whitespace(out, rng);
            }
            if items.is_empty() {
                whitespace(out, rng);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut order: Vec<&(String, Json)> = members.iter().collect();
            for index in (1..order.len()).rev() {
                order.swap(index, rng.below(index + 1));
            }
            out.push('{');
            for (index, (key, item)) in order.into_iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                whitespace(out, rng);
                spell_string(key, rng, out);
                whitespace(out, rng);
                out.push(':');
                whitespace(out, rng);
                spell_value(item, rng, out);
                whitespace(out, rng);
            }
            if members.is_empty() {
                whitespace(out, rng);
            }
            out.push('}');
        }
    }
}

fn spell_float(float: f64, rng: &mut Rng, out: &mut String) {
    let text = match rng.below(5) {
        0 => format!("{float:e}"),
        1 => format!("{float:E}"),
        2 => format!("{float:?}"),
        3 => format!("{float}"),
        // A mantissa with a trailing zero: 1.5e3 becomes 1.50e3, 1e3 becomes 1.0e3.
        _ => {
            let scientific = format!("{float:e}");
            let (mantissa, exponent) = scientific.split_once('e').expect("{:e} has an exponent");
            let dot = if mantissa.contains('.') { "" } else { "." };
            format!("{mantissa}{dot}0e{exponent}")
        }
    };
    out.push_str(&text);
}

fn spell_string(string: &str, rng: &mut Rng, out: &mut String) {
    out.push('"');
    for ch in string.chars() {
        let short = match ch {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' if rng.chance(2) => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must_escape = short.is_some() || u32::from(ch) < 0x20;
        if let Some(escape) = short.filter(|_| !rng.chance(3)) {
            out.push_str(escape);
        } else if must_escape || rng.chance(4) {
            let upper = rng.chance(2);
            let mut units = [0_u16; 2];
            for unit in ch.encode_utf16(&mut units) {
                if upper {
                    write!(out, "\\u{unit:04X}")
                } else {
                    write!(out, "\\u{unit:04x}")
                }
                .expect("writing to a String cannot fail");
            }
        } else {
            out.push(ch);
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------------
// Mutation

/// The number of places [`mutate`] can change: scalars, empty containers and object keys.
fn mutation_points(value: &Json) -> usize {
    match value {
        Json::Array(items) if !items.is_empty() => items.iter().map(mutation_points).sum(),
        Json::Object(members) if !members.is_empty() => members
            .iter()
            .map(|(_, item)| 1 + mutation_points(item))
            .sum(),
        _ => 1,
    }
}

/// Changes the `target`-th mutation point (in [`mutation_points`] order) so that the value means
/// something else. Returns how many points were passed over, to find the target.
fn mutate(value: &mut Json, target: usize) -> usize {
    match value {
        Json::Array(items) if !items.is_empty() => {
            let mut seen = 0;
            for item in items {
                seen += mutate_within(item, target, seen);
            }
            seen
        }
        Json::Object(members) if !members.is_empty() => {
            let keys: Vec<String> = members.iter().map(|(key, _)| key.clone()).collect();
            let mut seen = 0;
            for (key, item) in members.iter_mut() {
                if target == seen {
                    let mut renamed = format!("{key}~");
                    while keys.contains(&renamed) {
                        renamed.push('~');
                    }
                    *key = renamed;
                }
                seen += 1;
                seen += mutate_within(item, target, seen);
            }
            seen
        }
        _ => {
            if target == 0 {
                *value = changed_leaf(value);
            }
            1
        }
    }
}

/// Mutates inside `item` if `target` falls in it; returns its number of points.
fn mutate_within(item: &mut Json, target: usize, seen: usize) -> usize {
    let points = mutation_points(item);
    if (seen..seen + points).contains(&target) {
        mutate(item, target - seen);
    }
    points
}

fn changed_leaf(leaf: &Json) -> Json {
    match leaf {
        Json::Null => Json::Bool(false),
        Json::Bool(boolean) => Json::Bool(!boolean),
        Json::Int(_) | Json::Float(_) => {
            let number = leaf.as_f64().expect("a number");
            // As doubles, -x differs from x unless x is zero (and -0 is 0).
            Json::Float(if number == 0.0 { 1.0 } else { -number })
        }
        Json::Str(string) => Json::Str(format!("{string}x")),
        Json::Array(_) => Json::Array(vec![Json::Null]),
        Json::Object(_) => Json::Object(vec![(String::new(), Json::Null)]),
    }
}

// ---------------------------------------------------------------------------------------------
// An independent reading of the canonical output

/// Whether serde_json's reading of the canonical output is the generated value (numbers compared
/// as doubles, -0 as 0).
fn same_as_model(model: &Json, parsed: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (model, parsed) {
        (Json::Null, Value::Null) => true,
        (Json::Bool(expected), Value::Bool(actual)) => expected == actual,
        (Json::Int(_) | Json::Float(_), Value::Number(actual)) => {
            let expected = model.as_f64().expect("a number");
            actual.as_f64() == Some(expected) || (expected == 0.0 && actual.as_f64() == Some(0.0))
        }
        (Json::Str(expected), Value::String(actual)) => expected == actual,
        (Json::Array(expected), Value::Array(actual)) => {
            expected.len() == actual.len()
                && expected
                    .iter()
                    .zip(actual)
                    .all(|(model, parsed)| same_as_model(model, parsed))
        }
        (Json::Object(expected), Value::Object(actual)) => {
            expected.len() == actual.len()
                && expected.iter().all(|(key, model)| {
                    actual
                        .get(key)
                        .is_some_and(|parsed| same_as_model(model, parsed))
                })
        }
        _ => false,
    }
}

/// Whether JSON text has whitespace (or any control character) outside its string literals.
fn whitespace_outside_strings(text: &str) -> bool {
    let mut in_string = false;
    let mut escaped = false;
    for ch in text.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if ch == '\\' {
                escaped = true;
            } else if ch == '"' {
                in_string = false;
            }
        } else if ch == '"' {
            in_string = true;
        } else if ch.is_whitespace() || ch.is_control() {
            return true;
        }
    }
    false
}

/// The fingerprint of a body's RFC 8785 form. (A request's fingerprint, `Fingerprint::of_json`,
/// also refuses numbers a double cannot hold as written; the generated numbers here include
/// such, and what these properties test is the canonical form.)
fn fingerprint(body: &str) -> Fingerprint {
    let canonical = canonicalize(body.as_bytes())
        .unwrap_or_else(|error| panic!("{body:?} should canonicalize: {error}"));
    Fingerprint::of_canonical_json("POST", "/p", &canonical)
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::with_cases(256) })]

    /// Key order, whitespace, escapes and number spelling do not change the fingerprint.
    #[test]
    fn spelling_does_not_change_the_fingerprint(value in arb_json(), first in any::<u64>(), second in any::<u64>()) {
        let first_spelling = spell(&value, &mut Rng(first));
        let second_spelling = spell(&value, &mut Rng(second));
        prop_assert_eq!(
            fingerprint(&first_spelling),
            fingerprint(&second_spelling),
            "{:?} vs {:?}",
            first_spelling,
            second_spelling
        );
        prop_assert_eq!(
            canonicalize(first_spelling.as_bytes()),
            canonicalize(second_spelling.as_bytes())
        );
    }

    /// Changing any one scalar, empty container or key changes the fingerprint.
    #[test]
    fn any_change_changes_the_fingerprint(
        value in arb_json(),
        which in any::<usize>(),
        first in any::<u64>(),
        second in any::<u64>(),
    ) {
        let mut changed = value.clone();
        let target = which % mutation_points(&value);
        mutate(&mut changed, target);
        let original_spelling = spell(&value, &mut Rng(first));
        let changed_spelling = spell(&changed, &mut Rng(second));
        prop_assert_ne!(
            fingerprint(&original_spelling),
            fingerprint(&changed_spelling),
            "changing point {} of {:?} gave {:?}",
            target,
            value,
            changed
        );
    }

    /// The canonical form is its own canonical form, and says what the input said.
    #[test]
    fn canonical_form_is_idempotent_and_faithful(value in arb_json(), seed in any::<u64>()) {
        let spelling = spell(&value, &mut Rng(seed));
        let canonical = canonicalize(spelling.as_bytes())
            .unwrap_or_else(|error| panic!("{spelling:?} should canonicalize: {error}"));
        prop_assert_eq!(canonicalize(&canonical), Ok(canonical.clone()));
        prop_assert_eq!(
            Fingerprint::of_canonical_json("POST", "/p", &canonical),
            fingerprint(&spelling)
        );
        let text = std::str::from_utf8(&canonical).expect("canonical output is UTF-8");
        prop_assert!(!whitespace_outside_strings(text), "whitespace in {}", text);
        let parsed: serde_json::Value = serde_json::from_slice(&canonical).expect("canonical output is JSON");
        prop_assert!(same_as_model(&value, &parsed), "{:?} read back as {:?}", value, parsed);
        // Parsed once: the value handed over is the canonical bytes read back, unless a number
        // would change (then the request is refused).
        match idemflow_core::canonicalize_request(spelling.as_bytes()) {
            Ok(once) => {
                prop_assert_eq!(&once.bytes, &canonical);
                prop_assert_eq!(once.value, parsed);
            }
            Err(CanonicalError::NumberNotExact { .. }) => {}
            Err(other) => prop_assert!(false, "{:?}: {}", spelling, other),
        }
    }

    /// A request is executed with the numbers it was sent with, or refused: the canonical
    /// spelling of every accepted number has the decimal value of the literal (by decimal
    /// arithmetic here, not through a double), and a refused one would have changed.
    #[test]
    fn a_request_s_numbers_are_kept_as_written_or_refused(literal in arb_number_literal()) {
        let body = format!("{{\"amount\":{literal}}}");
        let rounded = canonicalize(body.as_bytes()).expect("valid JSON");
        let rounded = std::str::from_utf8(&rounded).expect("canonical output is UTF-8")
            .trim_start_matches("{\"amount\":").trim_end_matches('}').to_owned();
        let same = decimal(&literal) == decimal(&rounded);
        match idemflow_core::canonicalize_request(body.as_bytes()) {
            Ok(request) => {
                prop_assert!(same, "{} was accepted as {}", literal, rounded);
                let fingerprint = Fingerprint::of_json("POST", "/p", body.as_bytes());
                prop_assert_eq!(
                    fingerprint,
                    Ok(Fingerprint::of_canonical_json("POST", "/p", &request.bytes))
                );
            }
            Err(CanonicalError::NumberNotExact { written, becomes }) => {
                prop_assert!(!same, "{} was refused, though it is {}", literal, rounded);
                prop_assert_eq!(becomes, rounded);
                prop_assert_eq!(written, literal);
            }
            Err(other) => prop_assert!(false, "{}: {}", literal, other),
        }
    }
}

/// Number literals in the JSON grammar, biased to where doubles run out of digits: integers
/// around 2^53 and 2^63, long fractions, exponents, zeros.
fn arb_number_literal() -> impl Strategy<Value = String> {
    let digits = |range: std::ops::RangeInclusive<usize>| {
        proptest::collection::vec(0u8..10, range).prop_map(|digits| {
            digits
                .into_iter()
                .map(|d| char::from(b'0' + d))
                .collect::<String>()
        })
    };
    (
        any::<bool>(),
        prop_oneof![
            Just("9007199254740992".to_owned()),
            Just("9007199254740993".to_owned()),
            Just("0".to_owned()),
            (1u8..10, digits(0..=25)).prop_map(|(first, rest)| format!("{first}{rest}")),
            (9007199254740000u64..9007199254742000).prop_map(|n| n.to_string()),
        ],
        proptest::option::of(digits(1..=22)),
        proptest::option::of(-30i32..30),
    )
        .prop_map(|(negative, whole, fraction, exponent)| {
            let mut literal = String::new();
            if negative {
                literal.push('-');
            }
            literal.push_str(&whole);
            if let Some(fraction) = fraction {
                literal.push('.');
                literal.push_str(&fraction);
            }
            if let Some(exponent) = exponent {
                literal.push_str(&format!("e{exponent}"));
            }
            literal
        })
}

/// A number literal's exact decimal value, normalized: sign, significant digits, and the power
/// of ten of the last digit; zero is `(false, "", 0)` whatever its sign.
fn decimal(literal: &str) -> (bool, String, i64) {
    let (negative, unsigned) = match literal.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, literal),
    };
    let (mantissa, exponent) = match unsigned.split_once(['e', 'E']) {
        Some((mantissa, exponent)) => (
            mantissa,
            exponent
                .trim_start_matches('+')
                .parse::<i64>()
                .expect("a generated exponent"),
        ),
        None => (unsigned, 0),
    };
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut digits = format!("{whole}{fraction}");
    let mut last_power = exponent - fraction.len() as i64;
    while digits.ends_with('0') {
        digits.pop();
        last_power += 1;
    }
    let digits = digits.trim_start_matches('0').to_owned();
    if digits.is_empty() {
        return (false, String::new(), 0);
    }
    (negative, digits, last_power)
}

/// Numbers at the edges of `serde_json`'s integer types read back as `serde_json` reads them.
#[test]
fn parsed_once_numbers_match_serde_json_at_the_integer_edges() {
    for text in [
        "0",
        "-0",
        "1e2",
        "-1",
        "9007199254740993",
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775808",
        "-9223372036854775809",
        "1e20",
        "1e21",
        "123456789012345678901234",
        "0.5",
        "-2.5e-7",
    ] {
        // Through the rounding form: every one of these is read back as serde_json reads it.
        let rounded = idemflow_core::canonicalize(text.as_bytes()).expect("canonicalizes");
        match idemflow_core::canonicalize_request(text.as_bytes()) {
            Ok(once) => {
                assert_eq!(once.bytes, rounded, "{text}");
                let read_back: serde_json::Value =
                    serde_json::from_slice(&once.bytes).expect("JSON");
                assert_eq!(once.value, read_back, "{text}");
            }
            // Beyond a double's digits: refused, and it would indeed have changed.
            Err(CanonicalError::NumberNotExact { .. }) => {
                assert_ne!(rounded, text.as_bytes(), "{text} refused but unchanged");
            }
            Err(other) => panic!("{text}: {other}"),
        }
    }
}
