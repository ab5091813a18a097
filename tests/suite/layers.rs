//! The crate's arrows run one way: http → wallet → (lease, ledger), with the shared vocabulary
//! (`domain`) at the bottom. Read from the source itself, so an import that runs back up a layer,
//! or a pool or SQL in the HTTP layer, fails here rather than in a reviewer's head.

use std::collections::BTreeSet;
use std::path::Path;

/// Each module of the crate, and the modules of the crate its code may name.
const LAYERS: &[(&str, &[&str])] = &[
    ("domain", &[]),
    ("failpoint", &[]),
    ("telemetry", &[]),
    ("lease", &["telemetry", "failpoint"]),
    ("ledger", &["domain", "telemetry", "failpoint"]),
    ("idempotency", &["domain", "ledger", "telemetry"]),
    ("wallet", &["domain", "failpoint", "idempotency", "lease", "ledger", "telemetry"]),
    ("http", &["domain", "idempotency", "telemetry", "wallet"]),
    ("tutorial", &["domain", "lease", "ledger", "wallet"]),
];

/// The source files of module `name`: `src/<name>.rs` and everything under `src/<name>/`.
fn sources(name: &str) -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let file = src.join(format!("{name}.rs"));
    if file.exists() {
        files.push(file);
    }
    let mut dirs = vec![src.join(name)];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.map(|e| e.unwrap().path()) {
            if entry.is_dir() {
                dirs.push(entry);
            } else if entry.extension().is_some_and(|ext| ext == "rs") {
                files.push(entry);
            }
        }
    }
    assert!(!files.is_empty(), "no source for module {name}");
    files
        .into_iter()
        .map(|path| (path.display().to_string(), std::fs::read_to_string(&path).unwrap()))
        .collect()
}

/// The code of a file, without its comments (which may name any module).
fn code(text: &str) -> impl Iterator<Item = &str> {
    text.lines().map(|line| line.split("//").next().unwrap_or("")).filter(|line| !line.trim().is_empty())
}

/// The crate modules a line of code names: `crate::<module>`, or each of `crate::{a, b::c}`.
fn named(line: &str) -> Vec<&str> {
    fn word(text: &str) -> &str {
        let text = text.trim_start();
        let end = text.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(text.len());
        &text[..end]
    }
    let mut modules = Vec::new();
    for (at, _) in line.match_indices("crate::") {
        let rest = &line[at + "crate::".len()..];
        match rest.strip_prefix('{') {
            Some(group) => {
                let group = group.split('}').next().unwrap_or("");
                modules.extend(group.split(',').map(word));
            }
            None => modules.push(word(rest)),
        }
    }
    modules
}

#[test]
fn every_module_names_only_the_layers_below_it() {
    let mut wrong = BTreeSet::new();
    for (module, allowed) in LAYERS {
        for (path, text) in sources(module) {
            for line in code(&text) {
                for target in named(line).into_iter().filter(|target| target != module && !target.is_empty())
                {
                    if !allowed.contains(&target) {
                        wrong.insert(format!("{path}: {module} names crate::{target}: {}", line.trim()));
                    }
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the arrows:\n{}",
        wrong.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn the_http_layer_touches_neither_sql_nor_pools() {
    let mut wrong = Vec::new();
    for (path, text) in sources("http") {
        for line in code(&text) {
            for word in ["sqlx", "deadpool", "redis::", "PgPool", "query(", "query_as("] {
                if line.contains(word) {
                    wrong.push(format!("{path}: {}", line.trim()));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "SQL or a pool in src/http:\n{}", wrong.join("\n"));
}

#[test]
fn the_product_does_not_import_the_tutorial() {
    for (module, _) in LAYERS.iter().filter(|(module, _)| *module != "tutorial") {
        for (path, text) in sources(module) {
            assert!(code(&text).all(|line| !line.contains("crate::tutorial")), "{path} imports the tutorial");
        }
    }
}
