//! Tidy checks over the source tree, in the manner of rust-analyzer's `tidy.rs`: rules a reviewer
//! would otherwise have to remember.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            out.push(path);
        }
    }
}

/// Library and binary source of every crate but the store: what ships.
fn shipped_sources(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let crate_dir = entry.unwrap().path();
        if crate_dir.ends_with("idemflow-pg") {
            continue;
        }
        let src = crate_dir.join("src");
        if src.is_dir() {
            rust_files(&src, &mut files);
        }
    }
    files.sort();
    files
}

/// Files outside `idemflow-pg` that may name `idempotency_keys` in SQL, and why.
const ALLOWED: &[(&str, &str)] = &[
    (
        "crates/idemflow-bench/src/raw.rs",
        "the raw baseline: hand-written statements by definition",
    ),
    (
        "crates/idemflow-bench/src/pgbench.rs",
        "pgbench's reference shape and raw select (baselines); the engine's statements come from idemflow_pg::statements",
    ),
    (
        "crates/idemflow-bench/src/workloads.rs",
        "seeds finished keys in bulk and counts rows, as a test would",
    ),
    (
        "crates/idemflow-testkit/src/explorer.rs",
        "a test harness: reads rows and rewinds leases, as tests do",
    ),
    (
        "crates/idemflow-testkit/src/simulation/",
        "a test harness: reads rows and rewinds leases, as tests do",
    ),
];

/// Texts only the engine's own statements hold: a copy of one outside the store is a copy of
/// the protocol that will drift.
const ENGINE_ONLY: &[&str] = &[
    "pg_try_advisory_xact_lock_shared",
    "PREPARE idemflow_claim",
    "SET state = 'done'",
    "greatest(locked_until",
];

#[test]
fn sql_on_the_keys_table_lives_in_the_store() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut offences = Vec::new();
    for file in shipped_sources(root) {
        let relative = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let text = std::fs::read_to_string(&file).unwrap();
        let allowed = ALLOWED
            .iter()
            .any(|(prefix, _)| relative.starts_with(prefix));
        for (number, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("//") {
                continue;
            }
            if !allowed && line.contains("idempotency_keys") {
                offences.push(format!(
                    "{relative}:{}: SQL on idempotency_keys outside idemflow-pg: {}",
                    number + 1,
                    code
                ));
            }
            for engine in ENGINE_ONLY {
                if line.contains(engine) {
                    offences.push(format!(
                        "{relative}:{}: a copy of the engine's statement ({engine}); use idemflow_pg::statements",
                        number + 1
                    ));
                }
            }
        }
    }
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}

/// The defects the schedule explorer is shown to catch (scripts/mutants/) must still apply to
/// the engine as it is: a patch that no longer applies shows nothing.
#[test]
fn every_mutant_patch_still_applies() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut patches: Vec<PathBuf> = std::fs::read_dir(root.join("scripts/mutants"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "patch")
        })
        .collect();
    patches.sort();
    assert!(patches.len() >= 6, "{patches:?}");
    for patch in patches {
        let checked = std::process::Command::new("git")
            .arg("apply")
            .arg("--check")
            .arg(&patch)
            .current_dir(root)
            .output()
            .expect("git runs");
        assert!(
            checked.status.success(),
            "{} no longer applies (make it again against the current engine):\n{}",
            patch.display(),
            String::from_utf8_lossy(&checked.stderr)
        );
    }
}
