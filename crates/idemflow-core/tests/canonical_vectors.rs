//! Golden vectors for RFC 8785 canonicalization: the project's own, inline, and the public
//! conformance vectors read at test time from the shared folder next to the project.

use std::fs;
use std::path::{Path, PathBuf};

use idemflow_core::{CanonicalError, canonicalize};

/// The public RFC 8785 conformance vectors (see its README.md); not copied into the project.
const EXTERNAL_VECTORS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../../shared/conformance/jcs"
);

fn canonical(input: &str) -> String {
    let bytes = canonicalize(input.as_bytes())
        .unwrap_or_else(|error| panic!("{input:?} should canonicalize: {error}"));
    String::from_utf8(bytes).expect("canonical output is UTF-8")
}

/// Each case: several inputs that must all canonicalize to the expected output.
const GOLDEN: &[(&[&str], &str)] = &[
    // Key order does not matter, at any depth.
    (
        &[
            r#"{"amount":100,"currency":"usd","customer":"c_1"}"#,
            r#"{"amount":100,"customer":"c_1","currency":"usd"}"#,
            r#"{"currency":"usd","amount":100,"customer":"c_1"}"#,
            r#"{"currency":"usd","customer":"c_1","amount":100}"#,
            r#"{"customer":"c_1","amount":100,"currency":"usd"}"#,
            r#"{"customer":"c_1","currency":"usd","amount":100}"#,
        ],
        r#"{"amount":100,"currency":"usd","customer":"c_1"}"#,
    ),
    (
        &[
            r#"{"z":{"b":[{"y":1,"x":2}],"a":null},"a":{"d":true,"c":false}}"#,
            r#"{"a":{"c":false,"d":true},"z":{"a":null,"b":[{"x":2,"y":1}]}}"#,
            "{\n  \"a\" : { \"d\" : true , \"c\" : false } ,\n  \"z\" : { \"a\" : null , \"b\" : [ { \"y\" : 1 , \"x\" : 2 } ] }\n}\n",
        ],
        r#"{"a":{"c":false,"d":true},"z":{"a":null,"b":[{"x":2,"y":1}]}}"#,
    ),
    // Array order does matter and is kept.
    (&[r#"[3,1,2]"#, " [ 3 , 1 , 2 ] "], "[3,1,2]"),
    (
        &[r#"[[],{},[[]],[{}],{"a":[]}]"#],
        r#"[[],{},[[]],[{}],{"a":[]}]"#,
    ),
    // Unicode escapes and literal characters are the same string, in keys and in values.
    (
        &[
            r#"{"caf\u00e9":"cr\u00e8me br\u00fbl\u00e9e"}"#,
            r#"{"café":"crème brûlée"}"#,
            r#"{"caf\u00E9":"cr\u00e8me br\u00FBl\u00e9e"}"#,
        ],
        r#"{"café":"crème brûlée"}"#,
    ),
    (
        &[r#""\ud83d\ude00""#, "\"😀\"", r#""\uD83D\uDE00""#],
        "\"😀\"",
    ),
    (&[r#""\u0041\u0062\/""#, r#""Ab/""#], r#""Ab/""#),
    // No Unicode normalization: a precomposed é and e + combining acute stay different.
    (&[r#""\u00e9""#], "\"\u{e9}\""),
    (&[r#""e\u0301""#], "\"e\u{301}\""),
    // Keys sort by UTF-16 code units: the emoji (surrogates D83D DE00) sorts after U+20AC and
    // before the BMP characters at U+E000 and above, though its code point is larger.
    (
        &[
            r#"{"\uff41":5,"\ufb33":4,"\ue000":3,"\ud83d\ude00":2,"\u20ac":1}"#,
            "{\"😀\":2,\"€\":1,\"\u{ff41}\":5,\"\u{e000}\":3,\"\u{fb33}\":4}",
        ],
        "{\"€\":1,\"😀\":2,\"\u{e000}\":3,\"\u{fb33}\":4,\"\u{ff41}\":5}",
    ),
    (
        &[r#"{"b":1,"B":2,"a":3,"A":4,"_":5,"1":6,"":7}"#],
        r#"{"":7,"1":6,"A":4,"B":2,"_":5,"a":3,"b":1}"#,
    ),
    // A key that is a prefix of another sorts first.
    (&[r#"{"ab":1,"a":2,"abc":3}"#], r#"{"a":2,"ab":1,"abc":3}"#),
    // Numbers are doubles, written as ECMAScript does.
    (&["100", "1e2", "1E+2", "100.0", "10000e-2", "0.1e3"], "100"),
    (&["0", "-0", "0.0", "-0.0e10", "0e-5"], "0"),
    (&["[1.0,1.50,-2.250e0]"], "[1,1.5,-2.25]"),
    (&["1e21", "1000000000000000000000"], "1e+21"),
    (&["1e20", "100000000000000000000"], "100000000000000000000"),
    (&["0.000001", "1e-6"], "0.000001"),
    (&["0.0000001", "1e-7"], "1e-7"),
    (
        &["9007199254740993", "9007199254740992"],
        "9007199254740992",
    ),
    (&["0.30000000000000004"], "0.30000000000000004"),
    // Control characters and the JCS escapes.
    (
        &[r#""\u0000\u001F\u007F\b\f\n\r\t\"\\""#],
        "\"\\u0000\\u001f\u{7f}\\b\\f\\n\\r\\t\\\"\\\\\"",
    ),
    // Literals.
    (
        &[r#"{"t":true,"f":false,"n":null}"#],
        r#"{"f":false,"n":null,"t":true}"#,
    ),
];

#[test]
fn golden_vectors() {
    let mut checked = 0;
    for (inputs, expected) in GOLDEN {
        for input in *inputs {
            assert_eq!(canonical(input), *expected, "canonicalizing {input:?}");
            checked += 1;
        }
        // The canonical form is its own canonical form.
        assert_eq!(
            canonical(expected),
            *expected,
            "re-canonicalizing {expected:?}"
        );
    }
    assert!(checked > 50, "only {checked} golden inputs");
}

#[test]
fn golden_rejections() {
    let duplicate = |key: &str| Err(CanonicalError::DuplicateKey(key.to_owned()));
    assert_eq!(canonicalize(br#"{"id":1,"id":1}"#), duplicate("id"));
    assert_eq!(
        canonicalize(br#"{"a":[{"b":{"c":1,"c":2}}]}"#),
        duplicate("c")
    );
    assert_eq!(
        canonicalize(r#"{"caf\u00e9":1,"café":2}"#.as_bytes()),
        duplicate("café")
    );
    assert_eq!(
        canonicalize(b"\"\xc3\x28\""),
        Err(CanonicalError::InvalidUtf8)
    );
    assert!(matches!(
        canonicalize(b"1e400"),
        Err(CanonicalError::NumberOutOfRange(_))
    ));
    for input in [&br#""\ud800""#[..], br#""\udfff""#, b"{} {}", b"[1,]", b""] {
        assert!(
            matches!(canonicalize(input), Err(CanonicalError::Syntax(_))),
            "{:?} should be a syntax error",
            String::from_utf8_lossy(input)
        );
    }
}

/// Every `input/NAME.json` must canonicalize to exactly the bytes of `output/NAME.json`.
#[test]
fn external_rfc8785_vectors() {
    let root = Path::new(EXTERNAL_VECTORS);
    let input_dir = root.join("input");
    if !input_dir.is_dir() {
        eprintln!(
            "NOTE: the external RFC 8785 conformance vectors were NOT run: {} is absent",
            input_dir.display()
        );
        return;
    }
    let mut names: Vec<PathBuf> = fs::read_dir(&input_dir)
        .expect("the vectors' input folder is readable")
        .map(|entry| entry.expect("a readable folder entry").path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "json")
        })
        .collect();
    names.sort();
    assert!(
        !names.is_empty(),
        "no input/*.json vectors in {}",
        input_dir.display()
    );
    for input_path in &names {
        let file_name = input_path.file_name().expect("a vector file has a name");
        let output_path = root.join("output").join(file_name);
        let input = fs::read(input_path).expect("the input vector is readable");
        let expected = fs::read(&output_path).unwrap_or_else(|error| {
            panic!("{} has no expected output: {error}", output_path.display())
        });
        let actual = canonicalize(&input).unwrap_or_else(|error| {
            panic!("{} should canonicalize: {error}", input_path.display())
        });
        assert_eq!(
            String::from_utf8_lossy(&actual),
            String::from_utf8_lossy(&expected),
            "vector {}",
            input_path.display()
        );
        assert_eq!(
            actual,
            expected,
            "vector {} (exact bytes)",
            input_path.display()
        );
        assert_eq!(
            canonicalize(&expected).as_ref(),
            Ok(&expected),
            "{} is its own canonical form",
            output_path.display()
        );
    }
    eprintln!(
        "ran {} external RFC 8785 conformance vectors from {}",
        names.len(),
        root.display()
    );
}
