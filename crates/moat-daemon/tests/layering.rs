//! The daemon's layering as a test: each top-level module may use only modules of lower layers
//! (so there is no import cycle), a tier's module is used only by the tier layer itself and by
//! the top (`lib`, `config`), and no agent path is written outside the daemon's `agent` module
//! (the routes are `moat_api::protocol`'s). It reads the sources, so it fails the moment someone
//! adds an import that breaks the layering, with the file and the import.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom to top. A module may use modules of lower layers only; `lib` (the crate root) may use
/// all. Keep docs/architecture.md in step.
const LAYERS: &[&[&str]] = &[
    &["clock", "ids"],
    &["host"],
    &["agent"],
    &["db", "layers"],
    &["tier"],
    &["error"],
    &["secrets"],
    &["template"],
    &["sandboxes", "code"],
    &["audit"],
    &["netlog"],
    &["api"],
    &["e2b"],
    &["config"],
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file (`sandboxes/builds/step.rs` → [sandboxes, builds, step]).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// The source without comments, string literals (kept as empty `""`) and char literals.
fn code_only(s: &str) -> (String, Vec<String>) {
    let b = s.as_bytes();
    let (mut out, mut strings) = (String::with_capacity(s.len()), Vec::new());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'r' if b.get(i + 1) == Some(&b'#') || (b.get(i + 1) == Some(&b'"')) => {
                // A raw string r"..." or r#"..."#.
                let mut j = i + 1;
                let mut hashes = 0;
                while b.get(j) == Some(&b'#') {
                    hashes += 1;
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let end: String = std::iter::once('"')
                    .chain(std::iter::repeat_n('#', hashes))
                    .collect();
                let body_start = j + 1;
                let close = s[body_start..]
                    .find(&end)
                    .map_or(b.len(), |k| body_start + k);
                strings.push(s[body_start..close].to_string());
                out.push_str("\"\"");
                i = close + end.len();
            }
            b'"' => {
                let mut j = i + 1;
                let mut lit = Vec::new();
                while j < b.len() && b[j] != b'"' {
                    if b[j] == b'\\' {
                        j += 1;
                    }
                    if j < b.len() {
                        lit.push(b[j]);
                    }
                    j += 1;
                }
                strings.push(String::from_utf8_lossy(&lit).into_owned());
                out.push_str("\"\"");
                i = j + 1;
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\') => {
                // A char literal ('x', '\n', '\''); lifetimes ('a) are left alone.
                let mut j = i + 1;
                if b[j] == b'\\' {
                    j += 1;
                }
                j += 1;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                out.push_str("' '");
                i = j + 1;
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    (out, strings)
}

/// The top-level modules `code` (in the module at `here`) names through `crate::` and `super::`
/// paths, with the text of each path.
fn uses(code: &str, here: &[String]) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let words: Vec<(usize, &str)> = {
        let mut v = Vec::new();
        let mut start = None;
        for (i, c) in code.char_indices() {
            let part = c.is_alphanumeric() || c == '_' || c == ':';
            match (part, start) {
                (true, None) => start = Some(i),
                (false, Some(s)) => {
                    v.push((s, &code[s..i]));
                    start = None;
                }
                _ => {}
            }
        }
        v
    };
    for (i, w) in &words {
        let path: Vec<&str> = w.split("::").collect();
        let target: Option<Vec<String>> = match path.first() {
            Some(&"crate") => Some(path[1..].iter().map(|s| s.to_string()).collect()),
            Some(&"super") => {
                let mut base: Vec<String> = here.to_vec();
                let mut rest = &path[..];
                while rest.first() == Some(&"super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base.extend(rest.iter().map(|s| s.to_string()));
                Some(base)
            }
            _ => None,
        };
        let Some(target) = target else { continue };
        let mut top: Vec<String> = target
            .first()
            .filter(|s| !s.is_empty())
            .into_iter()
            .cloned()
            .collect();
        // `crate::{a, b::c}`: every name in the group.
        if target.len() == 1 && target[0].is_empty() || w.ends_with("::") {
            if let Some(rest) = code[i + w.len()..].strip_prefix('{') {
                let group = &rest[..rest.find('}').unwrap_or(0)];
                let base: Vec<String> = target.iter().filter(|s| !s.is_empty()).cloned().collect();
                for item in group.split(',') {
                    let name = item.trim().split("::").next().unwrap_or("").trim();
                    if name.is_empty() || name == "self" {
                        continue;
                    }
                    let full = if base.is_empty() {
                        name.to_string()
                    } else {
                        base[0].clone()
                    };
                    top.push(full);
                }
            }
        }
        for t in top {
            if t.chars().next().is_some_and(|c| c.is_lowercase()) {
                found.push((t, w.to_string()));
            }
        }
    }
    found
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

struct Source {
    rel: PathBuf,
    module: Vec<String>,
    code: String,
    strings: Vec<String>,
}

fn sources() -> Vec<Source> {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(&root).unwrap().to_path_buf();
            let text = std::fs::read_to_string(&f).unwrap();
            let (code, strings) = code_only(&text);
            Source {
                module: module_path(&rel),
                rel,
                code,
                strings,
            }
        })
        .collect()
}

#[test]
fn every_module_uses_only_lower_layers() {
    let mut bad = Vec::new();
    let mut graph: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    for s in sources() {
        let Some(top) = s.module.first().cloned() else {
            continue; // lib.rs: the top, it may use everything
        };
        let Some(mine) = layer_of(&top) else {
            bad.push(format!(
                "{}: module {top} is in no layer (add it to LAYERS and docs/architecture.md)",
                s.rel.display()
            ));
            continue;
        };
        for (used, path) in uses(&s.code, &s.module) {
            if used == top || !LAYERS.iter().any(|l| l.contains(&used.as_str())) {
                continue; // its own submodules, or an item of the crate root
            }
            graph.entry(top.clone()).or_default().insert(used.clone());
            let theirs = layer_of(&used).unwrap_or(usize::MAX);
            if theirs >= mine {
                bad.push(format!(
                    "{}: `{path}` — {top} (layer {mine}) may not use {used} (layer {theirs})",
                    s.rel.display()
                ));
            }
        }
    }
    assert!(bad.is_empty(), "layering broken:\n{}", bad.join("\n"));
    // The check reads something: the graph it found has the edges everyone knows are there.
    let uses = |a: &str, b: &str| graph.get(a).is_some_and(|s| s.contains(b));
    assert!(uses("sandboxes", "tier") && uses("api", "sandboxes") && uses("tier", "agent"));
    assert!(!uses("agent", "tier") && !uses("db", "sandboxes"));
}

#[test]
fn a_tier_module_is_used_only_by_its_layer_and_the_top() {
    // (The fake tier is compiled for tests only, which is what may use it.)
    let tiers = ["container", "gvisor", "microvm"];
    let mut bad = Vec::new();
    for s in sources() {
        let top = s.module.first().map(String::as_str).unwrap_or("lib");
        if matches!(top, "tier" | "lib" | "config") {
            continue;
        }
        for t in tiers {
            let needle = format!("tier::{t}");
            if s.code.contains(&needle) {
                bad.push(format!("{}: uses {needle}", s.rel.display()));
            }
        }
    }
    // Inside the tier layer, one tier does not reach into another.
    for s in sources() {
        if s.module.first().map(String::as_str) != Some("tier") || s.module.len() < 2 {
            continue;
        }
        let own = &s.module[1];
        for t in tiers.iter().filter(|t| *t != own) {
            if s.code.contains(&format!("super::{t}::")) || s.code.contains(&format!("tier::{t}::"))
            {
                bad.push(format!("{}: tier {own} uses tier {t}", s.rel.display()));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn no_agent_path_is_written_outside_the_agent_module() {
    use moat_api::protocol::Route;
    // The first segment of every route: `/processes`, `/fs`, `/vm`, ...
    let mut roots: Vec<String> = Route::ALL
        .iter()
        .map(|r| {
            let p = r.spec().path;
            let end = p[1..].find('/').map_or(p.len(), |i| i + 1);
            p[..end].to_string()
        })
        .collect();
    roots.sort();
    roots.dedup();
    assert!(
        roots.contains(&"/processes".to_string()) && roots.len() >= 8,
        "{roots:?}"
    );
    let mut bad = Vec::new();
    let mut seen_in_agent = 0;
    for s in sources() {
        let top = s.module.first().map(String::as_str).unwrap_or("lib");
        for lit in &s.strings {
            let hit = roots.iter().any(|r| {
                lit == r || lit.starts_with(&format!("{r}/")) || lit.starts_with(&format!("{r}?"))
            });
            if !hit {
                continue;
            }
            if top == "agent" {
                seen_in_agent += 1;
                continue;
            }
            // E2B's own envd serves `/files` and `/health`: those are its paths, not the agent's.
            if top == "e2b" && (lit == "/files" || lit == "/health") {
                continue;
            }
            bad.push(format!("{}: {lit:?}", s.rel.display()));
        }
    }
    assert!(
        bad.is_empty(),
        "agent paths outside the agent module:\n{}",
        bad.join("\n")
    );
    let _ = seen_in_agent;
}

#[test]
fn the_reader_understands_the_forms_it_checks() {
    let (code, strings) = code_only(
        "use crate::{db::Db, tier}; // crate::api\nlet s = \"/processes/x\"; let c = '\"';\n/* crate::e2b */ super::super::host::x();",
    );
    assert_eq!(strings, ["/processes/x"]);
    let here = vec![
        "sandboxes".to_string(),
        "builds".to_string(),
        "step".to_string(),
    ];
    let mut used: Vec<String> = uses(&code, &here).into_iter().map(|(m, _)| m).collect();
    used.sort();
    assert_eq!(used, ["db", "sandboxes", "tier"]);
}
