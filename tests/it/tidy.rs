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

/// The engines' stores: the crates whose SQL is the engine's.
const STORES: [&str; 3] = ["idemflow-pg", "idemflow-sqlite", "idemflow-mysql"];

/// Library and binary source of every crate but the stores: what ships.
fn shipped_sources(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let crate_dir = entry.unwrap().path();
        if STORES.iter().any(|store| crate_dir.ends_with(store)) {
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
        "crates/idemflow-bench/src/sqlite_runner.rs",
        "the raw baseline on SQLite: the stored response by primary key, as a hand-written service reads it",
    ),
    (
        "crates/idemflow-bench/src/mariadb.rs",
        "the raw baseline on MariaDB: the stored response by primary key, as a hand-written service reads it",
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
        "crates/idemflow-bench/src/mass_crash.rs",
        "checks what a crash left (counts, stuck keys) and ends the killed services' leases, as a test would",
    ),
    (
        "crates/idemflow-bench/src/fleet.rs",
        "checks what a run left (keys done, orders per key), as a test would",
    ),
    (
        "crates/idemflow-bench/src/large_responses.rs",
        "the raw baseline (the body by primary key) and retention's rewind, as a test would",
    ),
    (
        "crates/idemflow-bench/src/partitioned.rs",
        "seeds finished keys in bulk and reads the keys table's statistics and sizes, as a test would",
    ),
    (
        "crates/idemflow-bench/src/provider_storm.rs",
        "counts finished keys to check the storm, as a test would",
    ),
    (
        "crates/idemflow-testkit/src/explorer.rs",
        "a test harness: reads rows and rewinds leases, as tests do",
    ),
    (
        "crates/idemflow-testrig/src/simulation/",
        "a test harness: reads rows and rewinds leases, as tests do",
    ),
    (
        "crates/idemflow-testrig/src/server_log.rs",
        "no SQL: it finds the keys table's constraint name in the server's log lines",
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

/// README.md and every `docs/*.md`, relative to the root.
fn documents(root: &Path) -> Vec<String> {
    let mut documents = vec!["README.md".to_owned()];
    for entry in std::fs::read_dir(root.join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|extension| extension == "md") {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            documents.push(format!("docs/{name}"));
        }
    }
    documents.sort();
    documents
}

/// A fenced code block of a document.
struct Block {
    /// The line of its opening fence (1-based).
    line: usize,
    /// The info string after the opening fence: the language, then rustdoc's attributes.
    info: String,
    text: String,
}

impl Block {
    /// The language: the info string's first word (rustdoc's attributes follow it after commas).
    fn language(&self) -> &str {
        self.info.split([',', ' ', '\t']).next().unwrap_or_default()
    }

    fn attributes(&self) -> impl Iterator<Item = &str> {
        self.info
            .split([',', ' ', '\t'])
            .skip(1)
            .filter(|attribute| !attribute.is_empty())
    }
}

/// The fenced blocks (``` or ~~~, at any indentation) of a Markdown text.
fn fenced_blocks(markdown: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, Block)> = None;
    for (number, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                for marker in ['`', '~'] {
                    let fence_length = trimmed.chars().take_while(|&c| c == marker).count();
                    if fence_length >= 3 {
                        let block = Block {
                            line: number + 1,
                            info: trimmed[fence_length..].trim().to_owned(),
                            text: String::new(),
                        };
                        open = Some((trimmed[..fence_length].to_owned(), block));
                        break;
                    }
                }
            }
            Some((fence, block)) => {
                let closing = trimmed.trim_end();
                if closing.starts_with(fence.as_str())
                    && closing.chars().all(|c| fence.starts_with(c))
                {
                    blocks.push(open.take().unwrap().1);
                } else {
                    block.text.push_str(line);
                    block.text.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "a code fence is never closed");
    blocks
}

/// The languages a document's code block may be tagged with. Rust blocks are doctests; every
/// other language is one rustdoc leaves alone. An untagged block would be compiled as Rust.
const LANGUAGES: &[&str] = &["rust", "sh", "text", "sql", "json", "toml", "http"];

/// What a Rust block may add to `rust`: each still compiles. (No `ignore`: a block that does not
/// compile is a block that drifts.)
const RUST_ATTRIBUTES: &[&str] = &["no_run", "test_harness", "should_panic", "compile_fail"];

#[test]
fn every_code_block_in_the_documents_is_tagged_and_rust_ones_are_doctests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let doctests = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let mut offences = Vec::new();
    for document in documents(root) {
        let markdown = std::fs::read_to_string(root.join(&document)).unwrap();
        let blocks = fenced_blocks(&markdown);
        for block in &blocks {
            let language = block.language();
            if !LANGUAGES.contains(&language) {
                offences.push(format!(
                    "{document}:{}: a code block tagged {:?}: tag it with one of {LANGUAGES:?}",
                    block.line, block.info
                ));
            } else if language == "rust" {
                for attribute in block.attributes() {
                    if !RUST_ATTRIBUTES.contains(&attribute) && !attribute.starts_with("edition") {
                        offences.push(format!(
                            "{document}:{}: a Rust block marked {attribute:?}: it must compile (allowed: {RUST_ATTRIBUTES:?})",
                            block.line
                        ));
                    }
                }
            }
        }
        let included = format!("#[doc = include_str!(\"../{document}\")]");
        if blocks.iter().any(|block| block.language() == "rust") && !doctests.contains(&included) {
            offences.push(format!(
                "{document} has Rust blocks but is not a doctest: add `{included}` to src/lib.rs's `documents`"
            ));
        }
    }
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}

/// The binaries of the workspace's crates, by the name `cargo run --bin` takes.
fn binaries(root: &Path) -> Vec<String> {
    let mut binaries = Vec::new();
    let crates = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|entry| entry.unwrap().path());
    // The facade's own binaries (src/bin/) too.
    for crate_dir in crates.chain([root.to_path_buf()]) {
        if let Ok(bins) = std::fs::read_dir(crate_dir.join("src/bin")) {
            for bin in bins {
                let path = bin.unwrap().path();
                if path.extension().is_some_and(|extension| extension == "rs") {
                    binaries.push(path.file_stem().unwrap().to_string_lossy().into_owned());
                }
            }
        }
        let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
        let mut section = "";
        for line in manifest.lines().map(str::trim) {
            if line.starts_with('[') {
                section = line;
            } else if let Some(name) = line
                .strip_prefix("name = \"")
                .and_then(|rest| rest.strip_suffix('"'))
            {
                // A package's src/main.rs is a binary of the package's name unless a `[[bin]]`
                // names it otherwise.
                let package_main = section == "[package]"
                    && crate_dir.join("src/main.rs").is_file()
                    && !manifest.contains("[[bin]]");
                if section == "[[bin]]" || package_main {
                    binaries.push(name.to_owned());
                }
            }
        }
    }
    binaries
}

/// Whether `path` (relative to the root, perhaps with `*` in its last component) names a file.
fn exists(root: &Path, path: &str) -> bool {
    let Some((directory, pattern)) = path.rsplit_once('/').filter(|_| path.contains('*')) else {
        return root.join(path).exists();
    };
    let (prefix, suffix) = pattern.split_once('*').unwrap();
    std::fs::read_dir(root.join(directory)).is_ok_and(|entries| {
        entries.map(|entry| entry.unwrap().file_name()).any(|name| {
            let name = name.to_string_lossy();
            name.len() >= prefix.len() + suffix.len()
                && name.starts_with(prefix)
                && name.ends_with(suffix)
        })
    })
}

/// Shell blocks cannot compile; what they name must at least exist: every `scripts/…` path, and
/// every example, binary, package and test target a `cargo` line runs.
#[test]
fn what_the_documents_shell_blocks_run_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let binaries = binaries(root);
    let mut offences = Vec::new();
    for document in documents(root) {
        let markdown = std::fs::read_to_string(root.join(&document)).unwrap();
        for block in fenced_blocks(&markdown) {
            if block.language() != "sh" {
                continue;
            }
            for (offset, line) in block.text.lines().enumerate() {
                let at = format!("{document}:{}", block.line + 1 + offset);
                let words: Vec<&str> = line.split_whitespace().collect();
                for (index, word) in words.iter().enumerate() {
                    if let Some(start) = word.find("scripts/") {
                        let path = word[start..].trim_end_matches(|c: char| ",.:;)'\"".contains(c));
                        if !exists(root, path) {
                            offences.push(format!("{at}: {path} does not exist"));
                        }
                    }
                    let Some(name) = words.get(index + 1) else {
                        continue;
                    };
                    let found = match *word {
                        // Every example is a package of its own (`-p example-<name>`), so that
                        // it builds only what it uses: the root package has no examples.
                        "--example" => false,
                        "--bin" => binaries.iter().any(|binary| binary == name),
                        "--test" => {
                            root.join(format!("tests/{name}.rs")).is_file()
                                || root.join(format!("tests/{name}/main.rs")).is_file()
                        }
                        "-p" | "--package" => {
                            *name == "idemflow"
                                || root.join("crates").join(name).is_dir()
                                || name.strip_prefix("example-").is_some_and(|example| {
                                    root.join("examples")
                                        .join(example)
                                        .join("Cargo.toml")
                                        .is_file()
                                })
                        }
                        _ => continue,
                    };
                    if !found {
                        offences.push(format!("{at}: {word} {name}: no such target"));
                    }
                }
            }
        }
    }
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}

/// The store's modules on the request path: every statement a request sends. (The resumer's scan,
/// retention and operators' reports in maintenance.rs span tenants by design.)
const REQUEST_PATH: &[&str] = &[
    "statements.rs",
    "look_up.rs",
    "claim.rs",
    "take_over.rs",
    "fenced_writes.rs",
];

/// The string literals of a Rust source (up to its tests), with `\`-newline continuations joined.
fn string_literals(source: &str) -> Vec<String> {
    let source = source.split("#[cfg(test)]").next().unwrap_or(source);
    let mut literals = Vec::new();
    let mut chars = source.chars().peekable();
    let mut in_comment = false;
    let mut previous = ' ';
    while let Some(ch) = chars.next() {
        if in_comment {
            in_comment = ch != '\n';
            continue;
        }
        if ch == '/' && previous == '/' {
            in_comment = true;
            continue;
        }
        previous = ch;
        if ch != '"' {
            continue;
        }
        let mut literal = String::new();
        while let Some(ch) = chars.next() {
            match ch {
                '"' => break,
                '\\' => match chars.next() {
                    Some('\n') => {
                        while chars.peek().is_some_and(|next| next.is_whitespace()) {
                            chars.next();
                        }
                    }
                    Some(escaped) => literal.push(escaped),
                    None => {}
                },
                _ => literal.push(ch),
            }
        }
        literals.push(literal);
        previous = ' ';
    }
    literals
}

/// The statements of `source` that read or write `idempotency_keys` (or the response bodies
/// stored apart, `idempotency_responses`) without naming a tenant, and how many statements on
/// those tables it holds.
fn statements_without_tenant(source: &str) -> (Vec<String>, usize) {
    let (mut missing, mut checked) = (Vec::new(), 0);
    for literal in string_literals(source) {
        for statement in literal.split(';') {
            let sql = statement.split_whitespace().collect::<Vec<_>>().join(" ");
            let upper = format!("{} ", sql.to_ascii_uppercase());
            let insert = upper.contains("INTO IDEMPOTENCY_KEYS ")
                || upper.contains("INTO IDEMPOTENCY_RESPONSES ");
            let names_table = insert
                || upper.contains("FROM IDEMPOTENCY_KEYS ")
                || upper.contains("UPDATE IDEMPOTENCY_KEYS ")
                || upper.contains("FROM IDEMPOTENCY_RESPONSES ");
            if !names_table {
                continue;
            }
            checked += 1;
            let names_tenant = if insert {
                upper.contains("(TENANT,")
            } else {
                upper.contains("WHERE TENANT = $")
            };
            if !names_tenant {
                missing.push(sql);
            }
        }
    }
    (missing, checked)
}

/// Every statement on the request path names its tenant, so each can be routed to the one node
/// holding that tenant's keys when the table is distributed by tenant (Citus, say): a read,
/// update or delete of `idempotency_keys` filters on `tenant = $n`, an insert writes the tenant.
#[test]
fn every_request_path_statement_filters_by_tenant() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for file in REQUEST_PATH {
        let source =
            std::fs::read_to_string(root.join("crates/idemflow-pg/src").join(file)).unwrap();
        let (missing, found) = statements_without_tenant(&source);
        assert!(
            missing.is_empty(),
            "{file}: request-path statements that do not name their tenant: {missing:#?}"
        );
        checked += found;
    }
    assert!(
        checked >= 8,
        "only {checked} statements found: the scan is broken"
    );
    // The check itself catches a statement by key alone.
    let (missing, _) = statements_without_tenant(
        "const S: &str = \"UPDATE idempotency_keys \\\n SET x = 1 WHERE key = $1\";",
    );
    assert_eq!(missing.len(), 1, "{missing:?}");
}

/// A response stored apart is deleted by the statement that deletes its key, so no body outlives
/// its key (there is no foreign key to cascade: see migrations/postgres/20261201000200_responses_apart.sql).
/// Every statement of the store that deletes keys either deletes only started keys (which have no
/// response) or deletes their bodies apart in the same statement.
#[test]
fn every_delete_of_a_finished_key_deletes_its_body_apart() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("crates/idemflow-pg/src"), &mut files);
    let mut deletes = 0;
    for file in files {
        let source = std::fs::read_to_string(&file).unwrap();
        for literal in string_literals(&source) {
            let upper = literal.split_whitespace().collect::<Vec<_>>().join(" ");
            let upper = upper.to_ascii_uppercase();
            if !upper.contains("DELETE FROM IDEMPOTENCY_KEYS") {
                continue;
            }
            deletes += 1;
            // Started keys only: `state <> 'done'` (as the writes of one key say it, so that
            // they use the primary key: tests/it/plans.rs) or `state = 'started'`.
            assert!(
                upper.contains("STATE = 'STARTED'")
                    || upper.contains("STATE <> 'DONE'")
                    || upper.contains("DELETE FROM IDEMPOTENCY_RESPONSES"),
                "{}: a delete of finished keys that leaves their bodies apart behind: {literal}",
                file.display()
            );
        }
    }
    assert!(
        deletes >= 2,
        "only {deletes} deletes found: the scan is broken"
    );
}

/// A `major.minor[.patch]` version as numbers, for comparing rust-versions.
fn version_numbers(version: &str) -> Vec<u64> {
    let mut numbers: Vec<u64> = version
        .split('.')
        .map(|part| part.parse().expect("a numeric rust-version"))
        .collect();
    // 1.94 is 1.94.0.
    numbers.resize(3, 0);
    numbers
}

/// The stated MSRV (the workspace's `rust-version`) holds only if no dependency needs a newer
/// compiler: every package in the resolved graph that states its own `rust-version` states one
/// no newer than ours. (The std APIs our own code calls are held to it by clippy's
/// `incompatible_msrv`, which reads the same field, with warnings denied.)
#[test]
fn no_dependency_needs_a_newer_compiler_than_the_stated_msrv() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
            "--offline",
            "--filter-platform",
            "x86_64-unknown-linux-gnu",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).expect("metadata");
    let packages = metadata["packages"].as_array().expect("packages");
    let ours = packages
        .iter()
        .find(|package| package["name"] == "idemflow")
        .and_then(|package| package["rust_version"].as_str())
        .expect("the facade states a rust-version");
    let msrv = version_numbers(ours);
    let newer: Vec<String> = packages
        .iter()
        .filter_map(|package| {
            let needs = package["rust_version"].as_str()?;
            (version_numbers(needs) > msrv)
                .then(|| format!("{} {} needs {needs}", package["name"], package["version"]))
        })
        .collect();
    assert!(
        newer.is_empty(),
        "the stated MSRV {ours} is too old for: {newer:#?} (raise rust-version, or pin older)"
    );
}

/// The string literal right after `marker` in `source`, each time it appears.
fn literals_after<'a>(source: &'a str, marker: &str) -> Vec<&'a str> {
    source
        .match_indices(marker)
        .filter_map(|(at, _)| {
            let rest = &source[at + marker.len()..];
            let start = rest.find('"')?;
            // Only a literal that opens the call (whitespace before it), not a later argument.
            if !rest[..start].trim().is_empty() {
                return None;
            }
            let end = rest[start + 1..].find('"')?;
            Some(&rest[start + 1..start + 1 + end])
        })
        .collect()
}

/// A published crate is built from its package alone: every file its code reads at compile time
/// (`include_str!`, `include_bytes!`, `sqlx::migrate!`, a build script's `rerun-if-changed`)
/// must lie inside the crate's own directory. (`cargo package` without its verification build,
/// which the test command runs, would not notice one outside: the package would not compile.)
#[test]
fn published_crates_reach_no_file_outside_themselves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .canonicalize()
        .unwrap();
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| !path.ends_with("idemflow-bench"))
        .collect();
    crates.push(root.clone());
    let mut outside = Vec::new();
    let mut seen = 0;
    for krate in &crates {
        let krate = krate.canonicalize().unwrap();
        let mut files = Vec::new();
        let source = krate.join("src");
        if source.is_dir() {
            rust_files(&source, &mut files);
        }
        if krate.join("build.rs").is_file() {
            files.push(krate.join("build.rs"));
        }
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            let relative_to_file = ["include_str!(", "include_bytes!("]
                .iter()
                .flat_map(|marker| literals_after(&text, marker))
                .map(|path| file.parent().unwrap().join(path));
            let relative_to_crate = ["migrate!(", "rerun-if-changed="]
                .iter()
                .flat_map(|marker| literals_after(&text, marker))
                .chain(
                    text.match_indices("rerun-if-changed=")
                        .filter_map(|(at, _)| {
                            let rest = &text[at + "rerun-if-changed=".len()..];
                            rest.split(['"', '\n']).next()
                        })
                        .filter(|path| !path.is_empty()),
                )
                .map(|path| krate.join(path));
            for path in relative_to_file.chain(relative_to_crate) {
                seen += 1;
                match path.canonicalize() {
                    Ok(real) if real.starts_with(&krate) => {}
                    Ok(real) => outside.push(format!("{}: {}", file.display(), real.display())),
                    Err(error) => {
                        outside.push(format!("{}: {} ({error})", file.display(), path.display()))
                    }
                }
            }
        }
    }
    assert!(
        seen > 5,
        "the check found only {seen} paths: is it still reading the sources?"
    );
    assert!(
        outside.is_empty(),
        "files a published crate reads at compile time, outside it: {outside:#?}"
    );
}

/// The packages a package's build compiles (normal and build dependencies, for this platform),
/// by name, from `cargo tree`: it resolves, it compiles nothing.
fn built_packages(package: &str) -> Vec<String> {
    let mut names: Vec<String> = cargo_tree(package, "{p}")
        .lines()
        .filter_map(|line| line.split_whitespace().next().map(str::to_owned))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// `cargo tree` of what building `package` alone builds (no dev-dependencies), a line per
/// package as `format` says.
fn cargo_tree(package: &str, format: &str) -> String {
    let output = std::process::Command::new(env!("CARGO"))
        .args(["tree", "--quiet", "-p", package, "-e", "normal,build"])
        .args(["--prefix", "none", "--format", format])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    assert!(
        output.status.success(),
        "cargo tree -p {package}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Each example is a package of its own, so building one compiles only what it uses: the
/// checkout service (the main job) compiles no message broker client, and only the consumer
/// example, which speaks AMQP, compiles one.
#[test]
fn the_checkout_example_compiles_no_message_broker_client() {
    let checkout = built_packages("example-checkout");
    assert!(
        checkout.iter().any(|name| name == "idemflow"),
        "{checkout:?}"
    );
    assert!(!checkout.iter().any(|name| name == "lapin"), "{checkout:?}");
    let hello = built_packages("example-hello");
    assert!(!hello.iter().any(|name| name == "lapin"), "{hello:?}");
    let consumer = built_packages("example-consumer");
    assert!(consumer.iter().any(|name| name == "lapin"), "{consumer:?}");
}

/// The features `cargo tree` resolves for `dependency` when `package` alone is built (no
/// dev-dependencies): each line's bracketed list.
fn features_of(package: &str, dependency: &str) -> Vec<String> {
    let lines: Vec<String> = cargo_tree(package, "{p} [{f}]")
        .lines()
        .filter(|line| line.starts_with(&format!("{dependency} v")))
        .map(str::to_owned)
        .collect();
    assert!(!lines.is_empty(), "{package} does not build {dependency}");
    lines
}

/// Crash hooks are for tests: a service built on the facade's default features (and a demo that
/// runs the testkit's mock provider in its own process) has none, so no production build can
/// install one and its crash points cost nothing. The crash tools turn them on for test builds.
#[test]
fn a_production_build_has_no_crash_hooks() {
    for package in ["idemflow", "example-hello"] {
        for line in features_of(package, "idemflow-runner") {
            assert!(!line.contains("crash-hooks"), "{package}: {line}");
        }
    }
    for line in features_of("idemflow-testkit", "idemflow-runner") {
        assert!(line.contains("crash-hooks"), "{line}");
    }
}

/// The names a configuration struct goes by: such a struct grows a setting now and then.
const CONFIGURATION: &[&str] = &[
    "Config",
    "Options",
    "Settings",
    "Policy",
    "Limits",
    "Retention",
];

/// A configuration struct a user builds is `#[non_exhaustive]` (built from `default()` and
/// `with_<field>` setters, or by assigning fields), so that adding a setting breaks no caller.
/// Checked over the published crates' sources: every `pub struct` whose name ends as a
/// configuration's does and has public fields.
#[test]
fn configuration_structs_are_non_exhaustive() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        let crate_dir = entry.unwrap().path();
        let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
        if !manifest.contains("publish = false") {
            rust_files(&crate_dir.join("src"), &mut files);
        }
    }
    let mut offences = Vec::new();
    let mut checked = 0;
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (index, line) in lines.iter().enumerate() {
            let Some(name) = line
                .strip_prefix("pub struct ")
                .and_then(|rest| rest.strip_suffix(" {"))
            else {
                continue;
            };
            let public_fields = lines[index + 1..]
                .iter()
                .take_while(|line| **line != "}")
                .any(|line| line.starts_with("    pub "));
            if !public_fields || !CONFIGURATION.iter().any(|end| name.ends_with(end)) {
                continue;
            }
            checked += 1;
            let attributes = lines[..index]
                .iter()
                .rev()
                .take_while(|line| line.starts_with("#[") || line.starts_with("///"));
            if !attributes
                .into_iter()
                .any(|line| *line == "#[non_exhaustive]")
            {
                offences.push(format!(
                    "{}:{}: {name} is not #[non_exhaustive]",
                    file.strip_prefix(root).unwrap().display(),
                    index + 1
                ));
            }
        }
    }
    assert!(checked >= 10, "only {checked} configuration structs found");
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}

/// The workspace's packages by layer: the layers point one way, and [`the_layers_point_one_way`]
/// holds the build to it.
const CORE: &[&str] = &["idemflow-core"];
/// The engine boundary: the one crate every engine implements and everything above speaks.
const BOUNDARY: &[&str] = &["idemflow-store"];
/// One crate per engine, each behind the boundary.
const ENGINES: &[&str] = &[
    "idemflow-pg",
    "idemflow-sqlite",
    "idemflow-mysql",
    "idemflow-redis",
];
/// What runs on any engine: it names none.
const ENGINE_BLIND: &[&str] = &[
    "idemflow-runner",
    "idemflow-http",
    "idemflow-consumer",
    "idemflow-client",
    "idemflow-console",
    "idemflow-cli",
    "idemflow-testkit",
];

/// Every package each workspace package builds on (normal and build dependencies, not
/// dev-dependencies, transitively), from `cargo metadata`'s resolved graph.
fn reaches() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let output = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked", "--offline"])
        .args(["--filter-platform", "x86_64-unknown-linux-gnu"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let name_of: BTreeMap<&str, &str> = metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| {
            (
                package["id"].as_str().unwrap(),
                package["name"].as_str().unwrap(),
            )
        })
        .collect();
    let mut direct: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for node in metadata["resolve"]["nodes"].as_array().unwrap() {
        let id = node["id"].as_str().unwrap();
        let built_on = node["deps"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|dependency| {
                dependency["dep_kinds"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|kind| kind["kind"].is_null() || kind["kind"] == "build")
            })
            .map(|dependency| dependency["pkg"].as_str().unwrap())
            .collect();
        direct.insert(id, built_on);
    }
    let members: Vec<&str> = metadata["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.as_str().unwrap())
        .collect();
    let mut reaches = BTreeMap::new();
    for member in members {
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        let mut todo = direct.get(member).cloned().unwrap_or_default();
        while let Some(id) = todo.pop() {
            if seen.insert(id) {
                todo.extend(direct.get(id).into_iter().flatten().copied());
            }
        }
        reaches.insert(
            name_of[member].to_owned(),
            seen.iter().map(|id| name_of[id].to_owned()).collect(),
        );
    }
    reaches
}

/// The layers point one way: the core (no IO: no sqlx, no tokio) <- the engine boundary <- each
/// engine's crate; the runner, the HTTP layer, the consumer, the client, the console, the CLI and
/// the testkit speak only the boundary and reach no engine crate, by any path; no engine reaches
/// another, nor anything above the boundary. Only the composition roots (the facade, which brings
/// each engine by a feature, the examples, the bench and the test rig) name engines.
#[test]
fn the_layers_point_one_way() {
    let reaches = reaches();
    let offences = std::cell::RefCell::new(Vec::new());
    let forbid = |package: &str, forbidden: &[&str], why: &str| {
        let reached = reaches
            .get(package)
            .unwrap_or_else(|| panic!("{package} is not a workspace member"));
        for name in forbidden {
            if reached.contains(*name) {
                offences
                    .borrow_mut()
                    .push(format!("{package} reaches {name}: {why}"));
            }
        }
    };
    let above: Vec<&str> = ENGINES.iter().chain(ENGINE_BLIND).copied().collect();
    for core in CORE {
        let io = ["sqlx", "sqlx-core", "tokio", "idemflow-store"];
        forbid(core, &io, "the core does no IO");
        forbid(core, &above, "the core is the bottom layer");
    }
    for boundary in BOUNDARY {
        forbid(
            boundary,
            &above,
            "the boundary sits below the engines and what uses them",
        );
    }
    for engine in ENGINES {
        let others: Vec<&str> = ENGINES
            .iter()
            .filter(|other| *other != engine)
            .copied()
            .collect();
        forbid(
            engine,
            &others,
            "an engine stands alone behind the boundary",
        );
        forbid(engine, ENGINE_BLIND, "an engine sits below what uses it");
    }
    for blind in ENGINE_BLIND {
        forbid(blind, ENGINES, "it speaks only the boundary");
        // Built alone (cargo tree resolves its features, not the workspace's union).
        let built = built_packages(blind);
        for driver in ["sqlx-postgres", "sqlx-mysql", "sqlx-sqlite", "redis"] {
            if built.iter().any(|name| name == driver) {
                offences.borrow_mut().push(format!(
                    "{blind} builds {driver}: it compiles no database driver"
                ));
            }
        }
    }
    let offences = offences.into_inner();
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}

/// A program built with one engine compiles one sqlx driver: the SQLite-only hello example
/// builds neither PostgreSQL's nor MySQL's, the PostgreSQL-only consumer example neither SQLite's
/// nor MySQL's (nor a Redis client).
#[test]
fn a_program_built_with_one_engine_compiles_its_driver_only() {
    let hello = built_packages("example-hello");
    assert!(hello.iter().any(|name| name == "sqlx-sqlite"), "{hello:?}");
    for other in [
        "sqlx-postgres",
        "sqlx-mysql",
        "idemflow-pg",
        "idemflow-mysql",
        "redis",
    ] {
        assert!(
            !hello.iter().any(|name| name == other),
            "hello builds {other}"
        );
    }
    let consumer = built_packages("example-consumer");
    assert!(
        consumer.iter().any(|name| name == "sqlx-postgres"),
        "{consumer:?}"
    );
    for other in [
        "sqlx-sqlite",
        "sqlx-mysql",
        "idemflow-sqlite",
        "idemflow-mysql",
        "redis",
    ] {
        assert!(
            !consumer.iter().any(|name| name == other),
            "the consumer example builds {other}"
        );
    }
}

/// The longest a library function may be: past it, a function does several things and reads as
/// several. (Tests are not held to it.)
const FUNCTION_LINES: usize = 70;

/// The library functions longer than [`FUNCTION_LINES`], each at its length: the list only
/// shrinks. A function split below the limit leaves it; one that shrinks lowers its line; a new
/// long function, or a listed one that grows, fails the test.
const LONG_FUNCTIONS: &[(&str, &str, usize)] = &[
    (
        "crates/idemflow-testrig/src/simulation/check.rs",
        "replays_and_ends",
        220,
    ),
    (
        "crates/idemflow-testrig/src/simulation/world.rs",
        "run",
        130,
    ),
    (
        "crates/idemflow-testrig/src/simulation/foreign/mod.rs",
        "run",
        80,
    ),
    ("crates/idemflow-http/src/layer.rs", "handle", 89),
    ("crates/idemflow-cli/src/lib.rs", "end_lease_answer", 92),
    ("crates/idemflow-http/src/route.rs", "handle", 82),
    ("crates/idemflow-console/src/pages.rs", "bodies", 88),
    (
        "crates/idemflow-testrig/src/simulation/world.rs",
        "wind_down",
        87,
    ),
    (
        "crates/idemflow-testrig/src/simulation/world.rs",
        "sample",
        83,
    ),
    ("crates/idemflow-testkit/src/explorer.rs", "run_case", 82),
    ("crates/idemflow-runner/src/drive/steps.rs", "call", 79),
    ("crates/idemflow-console/src/pages.rs", "overview", 76),
    ("crates/idemflow-http/src/handler.rs", "settle", 74),
    (
        "crates/idemflow-runner/src/drive/steps.rs",
        "record_before_call",
        74,
    ),
    (
        "crates/idemflow-testrig/src/simulation/foreign/mod.rs",
        "step",
        72,
    ),
    (
        "crates/idemflow-pg/src/partitions.rs",
        "maintain_locked",
        72,
    ),
];

/// Every library function in `source` (up to its tests), as (name, lines from its signature to
/// its closing brace). Braces in comments and string literals are passed over.
fn functions(source: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = source
        .lines()
        .take_while(|line| line.trim() != "#[cfg(test)]")
        .collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(at) = words.iter().position(|word| *word == "fn") else {
            continue;
        };
        let qualifiers = [
            "pub",
            "pub(crate)",
            "pub(super)",
            "const",
            "async",
            "unsafe",
        ];
        if !words[..at].iter().all(|word| qualifiers.contains(word)) {
            continue;
        }
        let Some(name) = words.get(at + 1).map(|word| {
            word.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or_default()
                .to_owned()
        }) else {
            continue;
        };
        let mut depth = 0i32;
        let mut opened = false;
        for (offset, line) in lines[start..].iter().enumerate() {
            let code: Vec<char> = line
                .split("//")
                .next()
                .unwrap_or_default()
                .chars()
                .collect();
            let (mut in_string, mut escaped, mut at) = (false, false, 0);
            while at < code.len() {
                let c = code[at];
                at += 1;
                match (in_string, escaped, c) {
                    (true, true, _) => escaped = false,
                    (true, false, '\\') => escaped = true,
                    (_, false, '"') => in_string = !in_string,
                    // A char literal ('{', '"', '\'') is passed over; a lifetime is not one.
                    (false, _, '\'') if code.get(at) == Some(&'\\') => {
                        at += code[at + 1..]
                            .iter()
                            .position(|&c| c == '\'')
                            .map_or(0, |end| end + 2);
                    }
                    (false, _, '\'') if code.get(at + 1) == Some(&'\'') => at += 2,
                    (false, _, '{') => {
                        depth += 1;
                        opened = true;
                    }
                    (false, _, '}') => depth -= 1,
                    _ => {}
                }
            }
            if !opened && code.iter().rev().find(|c| !c.is_whitespace()) == Some(&';') {
                break; // a declaration without a body
            }
            if opened && depth == 0 {
                found.push((name.clone(), offset + 1));
                break;
            }
        }
    }
    found
}

#[test]
fn library_functions_stay_short_and_the_long_ones_only_shrink() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    for entry in std::fs::read_dir(root.join("crates")).unwrap() {
        rust_files(&entry.unwrap().path().join("src"), &mut files);
    }
    let mut long = Vec::new();
    for file in files {
        let relative = file
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if relative.contains("/bin/") {
            continue;
        }
        let source = std::fs::read_to_string(&file).unwrap();
        for (name, lines) in functions(&source) {
            if lines > FUNCTION_LINES {
                long.push((relative.clone(), name, lines));
            }
        }
    }
    let mut offences = Vec::new();
    for (file, name, lines) in &long {
        match LONG_FUNCTIONS
            .iter()
            .find(|(listed, listed_name, _)| listed == file && listed_name == name)
        {
            None => offences.push(format!(
                "{file}: fn {name} has {lines} lines (at most {FUNCTION_LINES}): split it"
            )),
            Some((_, _, max)) if lines > max => {
                offences.push(format!(
                    "{file}: fn {name} grew to {lines} lines (was {max})"
                ));
            }
            Some((_, _, max)) if lines < max => offences.push(format!(
                "{file}: fn {name} shrank to {lines} lines: lower its LONG_FUNCTIONS entry ({max})"
            )),
            Some(_) => {}
        }
    }
    for (file, name, max) in LONG_FUNCTIONS {
        if !long
            .iter()
            .any(|(long_file, long_name, _)| long_file == file && long_name == name)
        {
            offences.push(format!(
                "{file}: fn {name} is no longer over {FUNCTION_LINES} lines (was {max}): remove \
                 its LONG_FUNCTIONS entry"
            ));
        }
    }
    assert!(offences.is_empty(), "\n{}", offences.join("\n"));
}
