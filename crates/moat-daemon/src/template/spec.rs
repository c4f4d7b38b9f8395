//! Template specs (`moat.toml`) on the daemon's side: parsing, the build cache's keys, the commands
//! each step runs, the registries a step may reach, and the build context (the tar the CLI uploads
//! with the files `copy` steps take). The orchestration is `sandboxes/builds.rs`.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use anyhow::{bail, Context, Result};
use moat_api::{BuildStep, TemplateSpec};
use sha2::{Digest, Sha256};

use crate::error::Error;

/// Parses and checks a spec given as TOML; errors are 400s naming the field.
pub fn parse_toml(text: &str) -> Result<TemplateSpec, Error> {
    let spec: TemplateSpec = toml::from_str(text).map_err(|e| {
        let msg = e.message().to_string();
        let at = e
            .span()
            .map(|s| {
                let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                format!(" (line {line})")
            })
            .unwrap_or_default();
        Error::invalid("spec", format!("{}{at}: {msg}", moat_api::SPEC_FILE))
    })?;
    check(&spec)?;
    Ok(spec)
}

/// [`TemplateSpec::validate`] as an API error.
pub fn check(spec: &TemplateSpec) -> Result<(), Error> {
    spec.validate()
        .map_err(|(field, msg)| Error::invalid(&format!("spec.{field}"), msg))
}

/// Daemon-wide settings of build steps: the package registries they install from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Registries {
    /// apt source lines used instead of the image's own (`--build-apt-source`).
    pub apt_sources: Vec<String>,
    /// `--build-pip-index`
    pub pip_index: Option<String>,
    /// `--build-npm-registry`
    pub npm_registry: Option<String>,
}

impl Registries {
    /// The registries of `--build-apt-source` (lines), `--build-pip-index` and
    /// `--build-npm-registry`, checked (an error names the flag).
    pub fn new(
        apt_sources: &[String],
        pip_index: Option<String>,
        npm_registry: Option<String>,
    ) -> Result<Registries> {
        let r = Registries {
            apt_sources: apt_sources
                .iter()
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect(),
            pip_index,
            npm_registry,
        };
        for line in &r.apt_sources {
            if apt_source_hosts(line).is_empty() {
                bail!("--build-apt-source {line:?}: not an apt source line (deb [options] URI suite [components])");
            }
        }
        for (flag, url) in [
            ("--build-pip-index", &r.pip_index),
            ("--build-npm-registry", &r.npm_registry),
        ] {
            if let Some(u) = url {
                url_host(u).with_context(|| format!("{flag} {u}"))?;
            }
        }
        Ok(r)
    }

    /// What of these settings a step's result depends on (part of its cache key).
    fn for_step(&self, step: &BuildStep) -> String {
        match step {
            BuildStep::Apt(_) => self.apt_sources.join("\n"),
            BuildStep::Pip(_) => self.pip_index.clone().unwrap_or_default(),
            BuildStep::Npm(_) => self.npm_registry.clone().unwrap_or_default(),
            _ => String::new(),
        }
    }
}

fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())
}

/// Version of the key scheme: bump it when what a step does for the same inputs changes.
const KEY_VERSION: &[u8] = b"moat-build-1";

/// Cache key of a base: what it is and the identity of what it resolved to.
pub fn base_key(identity: &str) -> String {
    sha256_hex(&[KEY_VERSION, b"from", identity.as_bytes()])
}

/// Cache key of a step: the key before it, the step itself, what it depends on besides (the copied
/// files' digest, the registry settings).
pub fn step_key(parent: &str, step: &BuildStep, extra: &str, registries: &Registries) -> String {
    let json = serde_json::to_string(step).unwrap_or_default();
    sha256_hex(&[
        KEY_VERSION,
        parent.as_bytes(),
        json.as_bytes(),
        extra.as_bytes(),
        registries.for_step(step).as_bytes(),
    ])
}

/// Single-quotes `s` for /bin/sh.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Where an `apt` step puts the apt sources the daemon gives it (removed before the layer is taken).
const APT_LIST: &str = "/tmp/.moat-build-sources.list";

/// The shell script of an `apt`, `pip`, `npm` or `workdir` step (run as root).
pub fn root_script(step: &BuildStep, registries: &Registries) -> Option<String> {
    let quoted = |pkgs: &[String]| {
        pkgs.iter()
            .map(|p| sh_quote(p))
            .collect::<Vec<_>>()
            .join(" ")
    };
    Some(match step {
        BuildStep::Apt(pkgs) => {
            let (setup, opts, cleanup) = if registries.apt_sources.is_empty() {
                (String::new(), String::new(), String::new())
            } else {
                (
                    format!(
                        "printf '%s\\n' {} > {APT_LIST}\n",
                        registries
                            .apt_sources
                            .iter()
                            .map(|l| sh_quote(l))
                            .collect::<Vec<_>>()
                            .join(" ")
                    ),
                    format!(" -o Dir::Etc::SourceList={APT_LIST} -o Dir::Etc::SourceParts=-"),
                    format!("rm -f {APT_LIST}\n"),
                )
            };
            format!(
                "set -e\n{setup}export DEBIAN_FRONTEND=noninteractive\n\
                 apt-get{opts} update\n\
                 apt-get{opts} install -y --no-install-recommends {}\n\
                 {cleanup}apt-get clean\nrm -rf /var/lib/apt/lists/*\n",
                quoted(pkgs)
            )
        }
        BuildStep::Pip(pkgs) => format!(
            "set -e\nif command -v python3 >/dev/null 2>&1; then pip='python3 -m pip'; else pip=pip; fi\n\
             $pip install --no-cache-dir {}\n",
            quoted(pkgs)
        ),
        BuildStep::Npm(pkgs) => format!(
            "set -e\ncommand -v npm >/dev/null 2>&1 || {{ echo 'npm is not installed in this image (add an apt step with npm first)' >&2; exit 127; }}\n\
             npm install -g --no-fund --no-audit --no-update-notifier {}\nrm -rf /root/.npm\n",
            quoted(pkgs)
        ),
        BuildStep::Workdir(dir) => format!("mkdir -p {}\n", sh_quote(dir)),
        _ => return None,
    })
}

/// Environment of a `pip` or `npm` step's process (the registry settings and quiet defaults).
pub fn step_env(step: &BuildStep, registries: &Registries) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    match step {
        BuildStep::Pip(_) => {
            env.insert("PIP_DISABLE_PIP_VERSION_CHECK".into(), "1".into());
            env.insert("PIP_ROOT_USER_ACTION".into(), "ignore".into());
            // Debian's Python refuses system-wide installs without it (PEP 668); a template is the
            // place where they are wanted.
            env.insert("PIP_BREAK_SYSTEM_PACKAGES".into(), "1".into());
            if let Some(index) = &registries.pip_index {
                env.insert("PIP_INDEX_URL".into(), index.clone());
                if index.starts_with("http://") {
                    if let Ok(h) = url_host(index) {
                        env.insert("PIP_TRUSTED_HOST".into(), h);
                    }
                }
            }
        }
        BuildStep::Npm(_) => {
            if let Some(r) = &registries.npm_registry {
                env.insert("npm_config_registry".into(), r.clone());
            }
        }
        _ => {}
    }
    env
}

/// The destinations a step may reach: its package registry for `apt` / `pip` / `npm` (`apt_hosts`:
/// the hosts of the sources apt uses), the spec's `build.allow_out` otherwise.
pub fn step_allow_out(
    step: &BuildStep,
    spec: &TemplateSpec,
    registries: &Registries,
    apt_hosts: &[String],
) -> Vec<String> {
    let mut out: Vec<String> = match step {
        BuildStep::Apt(_) => {
            let mut v: Vec<String> = apt_hosts.to_vec();
            if registries.apt_sources.is_empty() {
                v.push("@debian".into());
            }
            v
        }
        BuildStep::Pip(_) => match &registries.pip_index {
            Some(u) => url_host(u).into_iter().collect(),
            None => vec!["@pypi".into()],
        },
        BuildStep::Npm(_) => match &registries.npm_registry {
            Some(u) => url_host(u).into_iter().collect(),
            None => vec!["@npm".into()],
        },
        _ => spec.build.allow_out.clone(),
    };
    out.sort();
    out.dedup();
    out.retain(|e| moat_api::parse_destination(e).is_ok());
    out
}

/// The host of an `http(s)://` URL (without port or credentials).
pub fn url_host(url: &str) -> Result<String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .with_context(|| "not an http:// or https:// URL")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let hostport = authority.rsplit('@').next().unwrap_or("");
    let host = if let Some(v6) = hostport.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        hostport.split(':').next().unwrap_or("")
    };
    if host.is_empty() {
        bail!("the URL names no host");
    }
    Ok(host.to_ascii_lowercase())
}

/// Hosts an apt source line or deb822 stanza names (`deb [opts] http://host/path suite ...`, or
/// `URIs: http://host/path ...`).
pub fn apt_source_hosts(text: &str) -> Vec<String> {
    let mut hosts = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') {
            continue;
        }
        let words: Vec<&str> = if let Some(rest) = line.strip_prefix("URIs:") {
            rest.split_whitespace().collect()
        } else if line.starts_with("deb ") || line.starts_with("deb-src ") {
            let mut w: Vec<&str> = line.split_whitespace().skip(1).collect();
            // Options in brackets may hold spaces: drop everything up to the closing bracket.
            if w.first().is_some_and(|x| x.starts_with('[')) {
                let end = w.iter().position(|x| x.ends_with(']')).unwrap_or(0);
                w.drain(..=end);
            }
            w.into_iter().take(1).collect()
        } else {
            continue;
        };
        for uri in words {
            if let Ok(h) = url_host(uri) {
                if !hosts.contains(&h) {
                    hosts.push(h);
                }
            }
        }
    }
    hosts
}

/// What a `copy` step takes from the build context: a tar ready to unpack at `dir` in the sandbox,
/// and the digest of the files (path, type, mode, size, link target, content; not times or owners),
/// which is the step's cache input.
pub struct CopySource {
    pub tar: std::path::PathBuf,
    pub dir: String,
    pub digest: String,
}

/// Cuts the files of `src` out of the build context `context` into `out` (a tar whose entries are
/// relative to the directory it unpacks into, owned by root), for a copy to `dest`.
pub fn copy_source(context: &Path, src: &str, dest: &str, out: &Path) -> Result<CopySource> {
    let src = src.trim_end_matches('/');
    let src = src.strip_prefix("./").unwrap_or(src);
    let prefix = format!("{src}/");
    let mut ar = tar::Archive::new(
        std::fs::File::open(context).with_context(|| format!("open {}", context.display()))?,
    );
    let file = std::fs::File::create(out).with_context(|| format!("create {}", out.display()))?;
    let mut builder = tar::Builder::new(std::io::BufWriter::new(file));
    let mut h = Sha256::new();
    let mut found_file = false;
    let mut found_dir = false;
    // A single file named exactly `src` lands at `dest` (or in it, for a `dest` ending in `/`).
    let (dir, file_name) = if dest.ends_with('/') {
        (
            dest.trim_end_matches('/').to_string(),
            src.rsplit('/').next().unwrap_or(src).to_string(),
        )
    } else {
        let (parent, name) = dest.rsplit_once('/').unwrap_or(("", dest));
        (parent.to_string(), name.to_string())
    };
    for entry in ar.entries().context("read the build context")? {
        let mut entry = entry.context("read the build context")?;
        let path = entry.path()?.to_string_lossy().into_owned();
        let path = path
            .strip_prefix("./")
            .unwrap_or(&path)
            .trim_end_matches('/');
        let rel = if path == src {
            None
        } else if let Some(r) = path.strip_prefix(&prefix) {
            Some(r.to_string())
        } else {
            continue;
        };
        if path.split('/').any(|c| c == "..") {
            bail!("the build context holds a path with ..: {path}");
        }
        let kind = entry.header().entry_type();
        let name = match (&rel, kind) {
            (None, tar::EntryType::Directory) => {
                found_dir = true;
                continue;
            }
            (None, _) => {
                found_file = true;
                file_name.clone()
            }
            (Some(r), _) => {
                found_dir = true;
                r.clone()
            }
        };
        if !matches!(
            kind,
            tar::EntryType::Regular | tar::EntryType::Directory | tar::EntryType::Symlink
        ) {
            bail!("{path} in the build context is neither a file, a directory nor a symlink");
        }
        let mode = entry.header().mode()? & 0o7777;
        let size = entry.header().size()?;
        let link = entry
            .link_name()?
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default();
        h.update(name.as_bytes());
        h.update([0]);
        h.update(format!("{:?} {mode:o} {size} {link}\n", kind).as_bytes());
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_mode(mode);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(entry.header().mtime().unwrap_or(0));
        match kind {
            tar::EntryType::Regular => {
                let mut data = Vec::with_capacity(size.min(1 << 20) as usize);
                entry.read_to_end(&mut data)?;
                h.update(&data);
                header.set_size(data.len() as u64);
                builder.append_data(&mut header, &name, data.as_slice())?;
            }
            tar::EntryType::Symlink => {
                header.set_size(0);
                builder.append_link(&mut header, &name, &link)?;
            }
            _ => {
                header.set_size(0);
                builder.append_data(&mut header, &name, std::io::empty())?;
            }
        }
    }
    builder
        .into_inner()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    if !found_file && !found_dir {
        bail!("{src} is not in the build context");
    }
    Ok(CopySource {
        tar: out.to_path_buf(),
        dir: if found_file && !found_dir {
            if dir.is_empty() {
                "/".into()
            } else {
                dir
            }
        } else {
            dest.trim_end_matches('/').to_string()
        },
        digest: hex::encode(h.finalize()),
    })
}

/// Reads the spec file out of a build context tar.
pub fn spec_from_context(context: &Path, name: &str) -> Result<String, Error> {
    let f = std::fs::File::open(context)
        .map_err(|e| Error::internal(format!("open the build context: {e}")))?;
    let mut ar = tar::Archive::new(f);
    let entries = ar
        .entries()
        .map_err(|e| Error::invalid("body", format!("the build context is not a tar: {e}")))?;
    for entry in entries {
        let mut entry = entry
            .map_err(|e| Error::invalid("body", format!("the build context is not a tar: {e}")))?;
        let path = entry
            .path()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        if path.strip_prefix("./").unwrap_or(&path) == name {
            let mut text = String::new();
            entry
                .by_ref()
                .take(1 << 20)
                .read_to_string(&mut text)
                .map_err(|e| Error::invalid("spec", format!("{name} is not UTF-8 text: {e}")))?;
            return Ok(text);
        }
    }
    Err(Error::invalid(
        "spec",
        format!("the build context has no {name}"),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn toml_specs_parse_and_errors_say_where() {
        let spec = parse_toml(
            r#"
from = "base"
[[steps]]
apt = ["curl"]
[[steps]]
run = "echo hi"
[start]
cmd = "python3 -m http.server 8000"
ready = { port = 8000 }
"#,
        )
        .unwrap();
        assert_eq!(spec.steps.len(), 2);
        let e = parse_toml("from = \"base\"\n[[steps]]\nap = [\"x\"]\n").unwrap_err();
        assert_eq!(e.field(), Some("spec"));
        assert!(e.to_string().contains("line 3"), "{}", e);
        let e = parse_toml("from = { image = \"a\", template = \"b\" }\n").unwrap_err();
        assert_eq!(e.field(), Some("spec.from"));
    }

    #[test]
    fn keys_chain_and_change_with_inputs() {
        let r = Registries::default();
        let base = base_key("template:base");
        let apt = BuildStep::Apt(vec!["curl".into()]);
        let k1 = step_key(&base, &apt, "", &r);
        assert_eq!(k1, step_key(&base, &apt, "", &r));
        assert_ne!(k1, step_key(&base_key("template:other"), &apt, "", &r));
        assert_ne!(
            k1,
            step_key(&base, &BuildStep::Apt(vec!["jq".into()]), "", &r)
        );
        let mirrored = Registries {
            apt_sources: vec!["deb http://m/debian bookworm main".into()],
            ..Default::default()
        };
        assert_ne!(k1, step_key(&base, &apt, "", &mirrored));
        // A pip mirror does not change an apt step.
        let pip_mirror = Registries {
            pip_index: Some("http://m/simple".into()),
            ..Default::default()
        };
        assert_eq!(k1, step_key(&base, &apt, "", &pip_mirror));
        let run = BuildStep::Run("make".into());
        assert_ne!(step_key(&k1, &run, "a", &r), step_key(&k1, &run, "b", &r));
    }

    #[test]
    fn hosts_of_sources_and_urls() {
        assert_eq!(
            apt_source_hosts(
                "deb [trusted=yes arch=amd64] http://198.51.100.1:8080/apt ./\n# deb http://x/\n\
                 Types: deb\nURIs: http://deb.debian.org/debian https://security.debian.org/x\n"
            ),
            vec!["198.51.100.1", "deb.debian.org", "security.debian.org"]
        );
        assert_eq!(
            url_host("https://user:pw@Mirror.example:8443/simple").unwrap(),
            "mirror.example"
        );
        assert!(url_host("ftp://x").is_err());
        let spec = parse_toml(
            "from = \"base\"\n[[steps]]\nrun = \"x\"\n[build]\nallow_out = [\"10.0.0.1\"]\n",
        )
        .unwrap();
        let r = Registries {
            pip_index: Some("http://198.51.100.1:8080/simple".into()),
            ..Default::default()
        };
        assert_eq!(
            step_allow_out(&BuildStep::Pip(vec!["x".into()]), &spec, &r, &[]),
            vec!["198.51.100.1"]
        );
        assert_eq!(
            step_allow_out(&BuildStep::Apt(vec!["x".into()]), &spec, &r, &[]),
            vec!["@debian"]
        );
        assert_eq!(
            step_allow_out(&spec.steps[0], &spec, &r, &[]),
            vec!["10.0.0.1"]
        );
        assert_eq!(
            step_env(&BuildStep::Pip(vec![]), &r)["PIP_TRUSTED_HOST"],
            "198.51.100.1"
        );
    }

    #[test]
    fn scripts_quote_their_arguments() {
        let s = root_script(
            &BuildStep::Apt(vec!["a'b".into()]),
            &Registries {
                apt_sources: vec!["deb [trusted=yes] http://h/ ./".into()],
                ..Default::default()
            },
        )
        .unwrap();
        assert!(s.contains(r"'a'\''b'"), "{s}");
        assert!(s.contains("Dir::Etc::SourceParts=-"), "{s}");
        assert!(root_script(&BuildStep::Run("x".into()), &Registries::default()).is_none());
    }

    fn context(dir: &Path) -> std::path::PathBuf {
        let p = dir.join("ctx.tar");
        let mut b = tar::Builder::new(std::fs::File::create(&p).unwrap());
        let mut add = |name: &str, data: &[u8], mode: u32| {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(mode);
            h.set_uid(1234);
            b.append_data(&mut h, name, data).unwrap();
        };
        add("moat.toml", b"from = \"base\"\n", 0o644);
        add("app/main.py", b"print(1)\n", 0o644);
        add("app/bin/run", b"#!/bin/sh\n", 0o755);
        add("notes.txt", b"hello", 0o600);
        b.finish().unwrap();
        p
    }

    fn names(tar_path: &Path) -> Vec<(String, u64)> {
        let mut ar = tar::Archive::new(std::fs::File::open(tar_path).unwrap());
        ar.entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                assert_eq!(e.header().uid().unwrap(), 0);
                (
                    e.path().unwrap().display().to_string(),
                    e.header().size().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn copy_sources_come_out_of_the_context() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = context(dir.path());
        assert_eq!(
            spec_from_context(&ctx, "moat.toml").unwrap(),
            "from = \"base\"\n"
        );
        let d = copy_source(&ctx, "app/", "/opt/app", &dir.path().join("a.tar")).unwrap();
        assert_eq!(d.dir, "/opt/app");
        assert_eq!(
            names(&d.tar),
            vec![("main.py".to_string(), 9), ("bin/run".to_string(), 10)]
        );
        let f = copy_source(&ctx, "notes.txt", "/etc/motd", &dir.path().join("b.tar")).unwrap();
        assert_eq!(f.dir, "/etc");
        assert_eq!(names(&f.tar), vec![("motd".to_string(), 5)]);
        let g = copy_source(&ctx, "notes.txt", "/srv/", &dir.path().join("c.tar")).unwrap();
        assert_eq!(
            (g.dir.as_str(), names(&g.tar)[0].0.as_str()),
            ("/srv", "notes.txt")
        );
        assert_ne!(d.digest, f.digest);
        // The same files again give the same digest.
        let again = copy_source(&ctx, "app", "/opt/app", &dir.path().join("e.tar")).unwrap();
        assert_eq!(again.digest, d.digest);
        assert!(copy_source(&ctx, "missing", "/x", &dir.path().join("d.tar")).is_err());
    }
}
