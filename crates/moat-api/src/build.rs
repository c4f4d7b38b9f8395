//! Template builds from a spec (`moat.toml`): a base, steps that each become a cached layer, and how
//! the template's sandboxes start. See docs/templates.md.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Isolation;

/// A template spec: what the template starts from, the steps that make it and how its sandboxes start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TemplateSpec {
    /// What the template starts from: a template name (`from = "base"`), or a table with one of
    /// `template`, `image` (an OCI registry reference) or `debian` (a release, by debootstrap).
    pub from: BaseSpec,
    /// The steps, in order. Each step that changes files becomes a layer, cached by its inputs and
    /// everything before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steps: Vec<BuildStep>,
    /// A process every sandbox of the template starts with, and when the sandbox counts as ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
    /// How the build's own sandboxes run.
    #[serde(default, skip_serializing_if = "BuildSettings::is_default")]
    pub build: BuildSettings,
}

/// The base of a template spec: exactly one of `template`, `image`, `debian`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BaseSpec {
    /// An existing template (its layers, environment, user, working directory and start command
    /// are inherited; another spec template works too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// An image in an OCI registry: `[registry/]repository[:tag|@sha256:digest]` (Docker Hub when no
    /// registry is named). Pulled once; `--no-cache` pulls it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Registry credentials for `image`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Plain HTTP to the registry of `image`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
    /// A Debian release (`bookworm`), made with debootstrap (`--variant=minbase`) from the host's
    /// Debian mirror.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debian: Option<String>,
    /// Extra packages debootstrap installs with `debian`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub packages: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BaseTable {
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    insecure: bool,
    #[serde(default)]
    debian: Option<String>,
    #[serde(default)]
    packages: Vec<String>,
}

impl<'de> Deserialize<'de> for BaseSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = BaseSpec;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a template name or a table with template, image or debian")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<BaseSpec, E> {
                Ok(BaseSpec {
                    template: Some(s.to_string()),
                    ..Default::default()
                })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, m: A) -> Result<BaseSpec, A::Error> {
                let t = BaseTable::deserialize(serde::de::value::MapAccessDeserializer::new(m))?;
                Ok(BaseSpec {
                    template: t.template,
                    image: t.image,
                    username: t.username,
                    password: t.password,
                    insecure: t.insecure,
                    debian: t.debian,
                    packages: t.packages,
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl BaseSpec {
    /// How the base reads in logs and the API: `template base`, `image python:3.12`, `debian bookworm`.
    pub fn describe(&self) -> String {
        match (&self.template, &self.image, &self.debian) {
            (Some(t), _, _) => format!("template {t}"),
            (_, Some(i), _) => format!("image {i}"),
            (_, _, Some(r)) if self.packages.is_empty() => format!("debian {r}"),
            (_, _, Some(r)) => format!("debian {r} + {}", self.packages.join(" ")),
            _ => "nothing".into(),
        }
    }
}

/// One step of a template spec (a table with exactly one of these keys).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum BuildStep {
    /// Debian packages: `apt-get update` and `apt-get install -y --no-install-recommends`, as root,
    /// with the package lists and caches removed afterwards.
    Apt(Vec<String>),
    /// Python packages (pip requirement specifiers): `pip install --no-cache-dir`, as root, into the
    /// system Python.
    Pip(Vec<String>),
    /// npm packages: `npm install -g`, as root.
    Npm(Vec<String>),
    /// A shell command (`/bin/sh -c`), as the current user in the current working directory.
    Run(String),
    /// Files from the build context (the directory the spec is in, uploaded by the CLI).
    Copy(CopyStep),
    /// Environment variables for the steps after this one and for the template's sandboxes.
    Env(BTreeMap<String, String>),
    /// Working directory of the steps after this one and of commands in the template's sandboxes
    /// (made when missing).
    Workdir(String),
    /// User of the `run` steps after this one and of commands in the template's sandboxes.
    User(String),
}

impl BuildStep {
    /// The step as one line for logs and the API (`apt curl jq`).
    pub fn describe(&self) -> String {
        let mut s = match self {
            BuildStep::Apt(p) => format!("apt {}", p.join(" ")),
            BuildStep::Pip(p) => format!("pip {}", p.join(" ")),
            BuildStep::Npm(p) => format!("npm {}", p.join(" ")),
            BuildStep::Run(c) => format!("run {}", c.replace('\n', " ")),
            BuildStep::Copy(c) => format!("copy {} {}", c.src, c.dest),
            BuildStep::Env(e) => format!(
                "env {}",
                e.keys().map(String::as_str).collect::<Vec<_>>().join(" ")
            ),
            BuildStep::Workdir(w) => format!("workdir {w}"),
            BuildStep::User(u) => format!("user {u}"),
        };
        if s.len() > 120 {
            let mut cut = 117;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
            s.push_str("...");
        }
        s
    }

    /// Whether the step runs in a sandbox and may make a layer (`env` and `user` only change what
    /// later steps and the template's sandboxes see; `workdir` also makes its directory).
    pub fn makes_layer(&self) -> bool {
        !matches!(self, BuildStep::Env(_) | BuildStep::User(_))
    }
}

/// `copy = { src = "app", dest = "/opt/app" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CopyStep {
    /// A file or directory of the build context, relative to it (no `..`). A directory's contents are
    /// copied into `dest`.
    pub src: String,
    /// Absolute path in the template. A file `src` goes to `dest`, or into it when `dest` ends with `/`.
    pub dest: String,
    /// `user[:group]` that owns the copied files (root when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// `[start]`: a process every sandbox of the template starts with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StartSpec {
    /// Shell command (`/bin/sh -c`), run in the background with tag `start` as the template's user in
    /// its working directory.
    pub cmd: String,
    /// When the sandbox counts as ready; without one it is ready once the command has started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<ReadyCheck>,
    /// Seconds the ready check may take (default 60); past them the create fails with the command's
    /// output.
    #[serde(default = "default_ready_timeout")]
    pub timeout: u64,
}

fn default_ready_timeout() -> u64 {
    60
}

/// How a started sandbox shows it is ready (a table with one key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum ReadyCheck {
    /// A TCP port inside the sandbox accepts connections.
    Port(u16),
    /// A file exists.
    File(String),
    /// A shell command exits 0 (tried every 200 ms).
    Command(String),
}

/// `[build]`: how the build's own sandboxes run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BuildSettings {
    /// Destinations `run` and `copy` steps may reach (the same entries as a sandbox's `allow_out`).
    /// `apt`, `pip` and `npm` steps reach their package registry and nothing else; `run` steps reach
    /// nothing unless listed here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    /// Isolation tier the steps run on (the daemon's default when absent). The layers serve every tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
    /// CPU cores of a step's sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Memory of a step's sandbox, MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Seconds one step may run (default 1800).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_timeout: Option<u64>,
}

impl BuildSettings {
    pub fn is_default(&self) -> bool {
        *self == BuildSettings::default()
    }
}

/// Most steps a spec may have.
pub const MAX_BUILD_STEPS: usize = 40;

/// Name of the spec file in a build context.
pub const SPEC_FILE: &str = "moat.toml";

impl TemplateSpec {
    /// Checks what serde cannot: one base, non-empty steps, paths and names. The error names the field
    /// (`steps[2].copy.dest`) and says what is wrong.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let f = |field: &str, msg: String| Err((field.to_string(), msg));
        let b = &self.from;
        let bases = b.template.is_some() as u8 + b.image.is_some() as u8 + b.debian.is_some() as u8;
        if bases != 1 {
            return f(
                "from",
                "from needs exactly one of template, image or debian".into(),
            );
        }
        if let Some(t) = &b.template {
            crate::validate_template_name(t).or_else(|m| f("from.template", m))?;
        }
        if let Some(i) = &b.image {
            if i.trim().is_empty() || i.chars().any(char::is_whitespace) {
                return f("from.image", format!("{i:?} is not an image reference"));
            }
        }
        if b.image.is_none() && (b.username.is_some() || b.password.is_some() || b.insecure) {
            return f(
                "from.username",
                "username, password and insecure go with image".into(),
            );
        }
        if b.username.is_some() != b.password.is_some() {
            return f("from.password", "username and password go together".into());
        }
        if let Some(r) = &b.debian {
            if r.is_empty() || !r.bytes().all(|c| c.is_ascii_lowercase() || c == b'-') {
                return f(
                    "from.debian",
                    format!("{r:?} is not a Debian release name (like bookworm)"),
                );
            }
        } else if !b.packages.is_empty() {
            return f("from.packages", "packages go with debian".into());
        }
        for (i, p) in b.packages.iter().enumerate() {
            check_package_name(p).or_else(|m| f(&format!("from.packages[{i}]"), m))?;
        }
        if self.steps.len() > MAX_BUILD_STEPS {
            return f(
                "steps",
                format!("at most {MAX_BUILD_STEPS} steps, got {}", self.steps.len()),
            );
        }
        for (i, s) in self.steps.iter().enumerate() {
            let at = |k: &str| format!("steps[{i}].{k}");
            match s {
                BuildStep::Apt(p) | BuildStep::Pip(p) | BuildStep::Npm(p) => {
                    let kind = match s {
                        BuildStep::Apt(_) => "apt",
                        BuildStep::Pip(_) => "pip",
                        _ => "npm",
                    };
                    if p.is_empty() {
                        return f(&at(kind), format!("{kind} needs at least one package"));
                    }
                    for (j, name) in p.iter().enumerate() {
                        let field = format!("steps[{i}].{kind}[{j}]");
                        if name.trim().is_empty() || name.starts_with('-') || name.contains('\0') {
                            return f(
                                &field,
                                format!("{name:?} is not a package (options are not allowed)"),
                            );
                        }
                        if kind == "apt" {
                            check_package_name(name).or_else(|m| f(&field, m))?;
                        }
                    }
                }
                BuildStep::Run(c) => {
                    if c.trim().is_empty() || c.contains('\0') {
                        return f(&at("run"), "run needs a command without NUL bytes".into());
                    }
                }
                BuildStep::Copy(c) => {
                    check_context_path(&c.src).or_else(|m| f(&at("copy.src"), m))?;
                    check_abs_path(&c.dest).or_else(|m| f(&at("copy.dest"), m))?;
                    if let Some(o) = &c.owner {
                        check_user(o).or_else(|m| f(&at("copy.owner"), m))?;
                    }
                }
                BuildStep::Env(e) => {
                    if e.is_empty() {
                        return f(&at("env"), "env needs at least one variable".into());
                    }
                    for (k, v) in e {
                        let bad_name = k.is_empty()
                            || k.contains('=')
                            || k.contains('\0')
                            || k.bytes().any(|b| b.is_ascii_whitespace());
                        if bad_name || v.contains('\0') {
                            return f(
                                &format!("steps[{i}].env.{k}"),
                                "names must be non-empty without '=', blanks or NUL; values without NUL".into(),
                            );
                        }
                    }
                }
                BuildStep::Workdir(w) => check_abs_path(w).or_else(|m| f(&at("workdir"), m))?,
                BuildStep::User(u) => check_user(u).or_else(|m| f(&at("user"), m))?,
            }
        }
        if let Some(st) = &self.start {
            if st.cmd.trim().is_empty() || st.cmd.contains('\0') {
                return f("start.cmd", "start.cmd needs a command".into());
            }
            if !(1..=3600).contains(&st.timeout) {
                return f(
                    "start.timeout",
                    format!("start.timeout must be 1..=3600 seconds, got {}", st.timeout),
                );
            }
            match &st.ready {
                Some(ReadyCheck::Port(0)) => {
                    return f("start.ready.port", "port must be 1..=65535".into())
                }
                Some(ReadyCheck::File(p)) => {
                    check_abs_path(p).or_else(|m| f("start.ready.file", m))?
                }
                Some(ReadyCheck::Command(c)) if c.trim().is_empty() || c.contains('\0') => {
                    return f("start.ready.command", "the command is empty".into())
                }
                _ => {}
            }
        }
        let bs = &self.build;
        if bs.cpu.is_some_and(|c| !c.is_finite() || c < 0.01) {
            return f("build.cpu", "cpu must be at least 0.01 cores".into());
        }
        if bs.memory_mb.is_some_and(|m| m < 64) {
            return f("build.memory_mb", "memory_mb must be at least 64".into());
        }
        if bs.step_timeout.is_some_and(|t| !(1..=86_400).contains(&t)) {
            return f(
                "build.step_timeout",
                "step_timeout must be 1..=86400 seconds".into(),
            );
        }
        for (i, e) in bs.allow_out.iter().enumerate() {
            if let Err(m) = crate::parse_destination(e) {
                return f(&format!("build.allow_out[{i}]"), m);
            }
        }
        Ok(())
    }

    /// The build-context paths the spec's `copy` steps read.
    pub fn context_paths(&self) -> Vec<&str> {
        self.steps
            .iter()
            .filter_map(|s| match s {
                BuildStep::Copy(c) => Some(c.src.as_str()),
                _ => None,
            })
            .collect()
    }
}

/// A Debian package name (with an optional `=version` or `/release`), as apt takes it.
fn check_package_name(p: &str) -> Result<(), String> {
    let ok = !p.is_empty()
        && p.len() <= 200
        && p.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && p.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.:=~/_".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(format!("{p:?} is not a Debian package name"))
    }
}

/// A relative path inside the build context: not empty, no `..`, not absolute.
pub fn check_context_path(p: &str) -> Result<(), String> {
    let trimmed = p.trim_end_matches('/');
    if trimmed.is_empty() || p.starts_with('/') || p.contains('\0') {
        return Err(format!(
            "{p:?} must be a path relative to the build context"
        ));
    }
    if trimmed.split('/').any(|c| c == "..") {
        return Err(format!("{p:?} may not leave the build context (..)"));
    }
    Ok(())
}

fn check_abs_path(p: &str) -> Result<(), String> {
    if !p.starts_with('/') || p.contains('\0') || p.split('/').any(|c| c == "..") {
        Err(format!("{p:?} must be an absolute path without .."))
    } else {
        Ok(())
    }
}

/// `name`, `uid`, `name:group` or `uid:gid`.
fn check_user(u: &str) -> Result<(), String> {
    let ok = |s: &str| {
        !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b))
    };
    let mut parts = u.splitn(2, ':');
    let user = parts.next().unwrap_or("");
    if ok(user) && parts.next().is_none_or(ok) {
        Ok(())
    } else {
        Err(format!("{u:?} is not a user name, uid or user:group"))
    }
}

/// `POST /v1/templates/{name}/build` with a JSON body: a spec without a build context (`copy` steps
/// need one: send a tar instead, as the CLI does).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct BuildRequest {
    pub spec: TemplateSpec,
    /// Run every step again instead of taking it from the build cache.
    #[serde(default)]
    pub no_cache: bool,
}

/// Where a build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum BuildStatus {
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl BuildStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BuildStatus::Running => "running",
            BuildStatus::Succeeded => "succeeded",
            BuildStatus::Failed => "failed",
            BuildStatus::Cancelled => "cancelled",
        }
    }
}

/// Where one step of a build is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum StepStatus {
    Pending,
    Running,
    /// Taken from the build cache: not run again.
    Cached,
    Done,
    Failed,
}

/// One step of a build (index 0 is the base, the last one the start check when the spec has one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BuildStepInfo {
    pub index: u32,
    /// `from template base`, `apt curl jq`, `start python3 -m http.server`.
    pub description: String,
    pub status: StepStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// The layer the step made (none when it changed no file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<String>,
    /// Bytes of that layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
}

/// A template build from a spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Build {
    /// `bld_` followed by 26 base32 characters.
    pub id: String,
    pub template: String,
    pub status: BuildStatus,
    /// RFC 3339.
    pub started_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<String>,
    pub steps: Vec<BuildStepInfo>,
    /// Why it failed: the step and the end of its output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Index of the step that failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_step: Option<u32>,
    pub spec: TemplateSpec,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BuildList {
    pub builds: Vec<Build>,
}

/// The build cache: one entry per step that ran, keyed by its inputs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PruneResult {
    /// Cache entries removed.
    pub entries: u64,
    /// Layers removed with them (those no template, snapshot or sandbox uses).
    pub layers: u64,
}

/// What a spec-built template's sandboxes get besides their files (`Template::config`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TemplateConfig {
    /// Environment variables (a create's `env` goes over them).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Default working directory of commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workdir: Option<String>,
    /// Default user of commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The process each sandbox starts with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartSpec>,
}

impl TemplateConfig {
    pub fn is_empty(&self) -> bool {
        *self == TemplateConfig::default()
    }
}

/// The first event of a spec build's stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BuildStarted {
    pub build: Build,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(json: serde_json::Value) -> TemplateSpec {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn from_is_a_name_or_a_table() {
        let s = spec(serde_json::json!({"from": "base"}));
        assert_eq!(s.from.template.as_deref(), Some("base"));
        let s = spec(serde_json::json!({"from": {"image": "python:3.12-slim"}}));
        assert_eq!(s.from.image.as_deref(), Some("python:3.12-slim"));
        let e = serde_json::from_value::<TemplateSpec>(serde_json::json!({"from": {"imag": "x"}}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("imag"), "{e}");
    }

    #[test]
    fn steps_are_one_key_tables() {
        let s = spec(serde_json::json!({
            "from": "base",
            "steps": [{"apt": ["curl"]}, {"run": "echo hi"}, {"copy": {"src": "app", "dest": "/app"}},
                      {"env": {"A": "1"}}, {"workdir": "/app"}, {"user": "user"}],
            "start": {"cmd": "sleep 1000", "ready": {"port": 8000}}
        }));
        assert_eq!(s.steps.len(), 6);
        assert!(s.validate().is_ok());
        assert_eq!(s.steps[0].describe(), "apt curl");
        assert!(!s.steps[3].makes_layer() && s.steps[4].makes_layer() && s.steps[1].makes_layer());
        assert_eq!(s.start.as_ref().unwrap().timeout, 60);
        assert_eq!(s.context_paths(), vec!["app"]);
        assert!(serde_json::from_value::<TemplateSpec>(
            serde_json::json!({"from": "base", "steps": [{"apt": ["a"], "pip": ["b"]}]})
        )
        .is_err());
    }

    #[test]
    fn validation_names_the_field() {
        let field = |v: serde_json::Value| spec(v).validate().unwrap_err().0;
        assert_eq!(
            field(serde_json::json!({"from": {"template": "a", "image": "b"}})),
            "from"
        );
        assert_eq!(
            field(serde_json::json!({"from": "base", "steps": [{"run": "x"}, {"apt": []}]})),
            "steps[1].apt"
        );
        assert_eq!(
            field(serde_json::json!({"from": "base", "steps": [{"apt": ["-oFoo=1"]}]})),
            "steps[0].apt[0]"
        );
        assert_eq!(
            field(
                serde_json::json!({"from": "base", "steps": [{"copy": {"src": "../x", "dest": "/a"}}]})
            ),
            "steps[0].copy.src"
        );
        assert_eq!(
            field(
                serde_json::json!({"from": "base", "steps": [{"copy": {"src": "x", "dest": "rel"}}]})
            ),
            "steps[0].copy.dest"
        );
        assert_eq!(
            field(serde_json::json!({"from": "base", "build": {"allow_out": ["no such"]}})),
            "build.allow_out[0]"
        );
        assert_eq!(
            field(serde_json::json!({"from": "base", "start": {"cmd": "x", "timeout": 0}})),
            "start.timeout"
        );
        assert_eq!(
            field(serde_json::json!({"from": {"template": "base", "packages": ["x"]}})),
            "from.packages"
        );
        assert_eq!(field(serde_json::json!({"from": "Base"})), "from.template");
    }

    #[test]
    fn long_descriptions_are_cut() {
        let d = BuildStep::Run("é".repeat(200)).describe();
        assert!(d.len() <= 120 && d.ends_with("..."), "{d}");
    }
}
