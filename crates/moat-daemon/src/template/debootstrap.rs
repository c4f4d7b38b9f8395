//! Builds a Debian root filesystem with `debootstrap`, then turns it into what an agent expects to
//! find: a `user` account with passwordless sudo, a hostname, an empty resolver configuration and no
//! package lists (they are stale the moment the template is built, and large).
//!
//! The mirror and suite come from the host's own apt configuration, so moat never names a host itself.

use std::collections::VecDeque;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{anyhow, bail, Context};
use moat_api::BuildEvent;
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;

/// Packages an agent expects on top of debootstrap's `minbase` variant.
pub const DEFAULT_PACKAGES: &[&str] = &[
    "bash",
    "coreutils",
    "python3",
    "python3-pip",
    "python3-venv",
    "git",
    "curl",
    "wget",
    "ca-certificates",
    "procps",
    "iproute2",
    "iputils-ping",
    "less",
    "nano",
    "vim-tiny",
    "sudo",
    "unzip",
    "zip",
    "xz-utils",
    "jq",
    "file",
    "tree",
    "openssh-client",
];

/// Packages some named templates get on top of [`DEFAULT_PACKAGES`]; other names get none.
pub fn template_packages(name: &str) -> &'static [&'static str] {
    match name {
        // The code interpreter: DataFrames and charts for Python, node for JavaScript contexts.
        "code-interpreter" => &[
            "python3-numpy",
            "python3-pandas",
            "python3-matplotlib",
            // What agents size thread pools and caches with (honest inside: docs/resources.md).
            "python3-psutil",
            "nodejs",
        ],
        _ => &[],
    }
}

const FALLBACK_SUITE: &str = "bookworm";
/// How many lines of output a failure message carries.
const TAIL_LINES: usize = 20;
/// Commands run in the chroot find their tools here, whatever the daemon's own PATH is.
const CHROOT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DebootstrapOptions {
    pub suite: String,
    pub mirror: String,
    pub packages: Vec<String>,
    /// Downloaded `.deb` files are kept here between builds.
    pub cache_dir: PathBuf,
}

impl DebootstrapOptions {
    /// Suite from /etc/os-release `VERSION_CODENAME` (fallback "bookworm"), mirror from the host's apt
    /// sources, and [`DEFAULT_PACKAGES`].
    pub fn from_host(cache_dir: PathBuf) -> anyhow::Result<Self> {
        let suite = std::fs::read_to_string("/etc/os-release")
            .ok()
            .and_then(|text| os_release_codename(&text))
            .unwrap_or_else(|| FALLBACK_SUITE.to_string());
        let mirror = host_mirror(Path::new("/etc/apt"), &suite)?;
        Ok(Self {
            suite,
            mirror,
            packages: DEFAULT_PACKAGES.iter().map(|p| p.to_string()).collect(),
            cache_dir,
        })
    }
}

/// `VERSION_CODENAME` from the text of /etc/os-release.
fn os_release_codename(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let value = line.trim().strip_prefix("VERSION_CODENAME=")?;
        let value = value.trim().trim_matches(|c| c == '"' || c == '\'');
        (!value.is_empty()).then(|| value.to_string())
    })
}

/// The main archive's URI for `suite` in the apt configuration under `apt_dir` (normally /etc/apt):
/// deb822 `sources.list.d/*.sources` first, then the one-line `sources.list` and `sources.list.d/*.list`.
fn host_mirror(apt_dir: &Path, suite: &str) -> anyhow::Result<String> {
    let list_d = apt_dir.join("sources.list.d");
    let mut deb822 = Vec::new();
    let mut one_line = vec![apt_dir.join("sources.list")];
    if let Ok(entries) = std::fs::read_dir(&list_d) {
        for entry in entries.flatten() {
            let path = entry.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("sources") => deb822.push(path),
                Some("list") => one_line.push(path),
                _ => {}
            }
        }
    }
    deb822.sort();
    one_line[1..].sort();
    for path in &deb822 {
        if let Some(uri) = std::fs::read_to_string(path)
            .ok()
            .and_then(|text| mirror_from_deb822(&text, suite))
        {
            return Ok(uri);
        }
    }
    for path in &one_line {
        if let Some(uri) = std::fs::read_to_string(path)
            .ok()
            .and_then(|text| mirror_from_one_line(&text, suite))
        {
            return Ok(uri);
        }
    }
    bail!(
        "no Debian mirror for suite {suite:?} with component main in {}/sources.list.d/*.sources or {}/sources.list",
        apt_dir.display(),
        apt_dir.display()
    )
}

/// Schemes debootstrap can fetch from (apt's `mirror+`, `cdrom:` and the like it cannot).
fn usable_uri(uri: &str) -> bool {
    ["http://", "https://", "ftp://", "file:/"]
        .iter()
        .any(|scheme| uri.starts_with(scheme))
}

/// The first URI of a deb822 stanza (`Types: deb`, not disabled) that serves exactly `suite` (so not
/// `suite-security` or `suite-updates`) with component `main`.
fn mirror_from_deb822(text: &str, suite: &str) -> Option<String> {
    // Each stanza as (field name lowercased, value) pairs; continuation lines extend the last value.
    let mut stanzas: Vec<Vec<(String, String)>> = vec![Vec::new()];
    for line in text.lines() {
        if line.trim_start().starts_with('#') {
            continue;
        }
        if line.trim().is_empty() {
            if stanzas.last().is_some_and(|s| !s.is_empty()) {
                stanzas.push(Vec::new());
            }
            continue;
        }
        let stanza = stanzas.last_mut()?;
        if line.starts_with([' ', '\t']) {
            if let Some((_, value)) = stanza.last_mut() {
                value.push(' ');
                value.push_str(line.trim());
            }
        } else if let Some((key, value)) = line.split_once(':') {
            stanza.push((key.trim().to_ascii_lowercase(), value.trim().to_string()));
        }
    }
    stanzas.iter().find_map(|stanza| {
        let field = |name: &str| {
            stanza
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
                .unwrap_or("")
        };
        let has = |name: &str, word: &str| field(name).split_whitespace().any(|w| w == word);
        let enabled = !field("enabled").eq_ignore_ascii_case("no");
        (enabled && has("types", "deb") && has("suites", suite) && has("components", "main"))
            .then(|| {
                field("uris")
                    .split_whitespace()
                    .find(|u| usable_uri(u))
                    .map(str::to_string)
            })
            .flatten()
    })
}

/// The URI of the first `deb [options] URI SUITE COMPONENTS...` line for exactly `suite` with `main`.
fn mirror_from_one_line(text: &str, suite: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or("").trim();
        let rest = line.strip_prefix("deb")?;
        if !rest.starts_with([' ', '\t']) {
            return None; // deb-src
        }
        let mut rest = rest.trim_start();
        if let Some(options) = rest.strip_prefix('[') {
            rest = options.split_once(']')?.1.trim_start();
        }
        let mut words = rest.split_whitespace();
        let uri = words.next()?;
        let line_suite = words.next()?;
        let mut components = words;
        (line_suite == suite && usable_uri(uri) && components.any(|c| c == "main"))
            .then(|| uri.to_string())
    })
}

/// A per-package step of debootstrap's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    Download,
    Extract,
    Unpack,
    Configure,
}

impl Step {
    fn phase(self) -> &'static str {
        match self {
            Step::Download => "download",
            Step::Extract => "extract",
            Step::Unpack => "unpack",
            Step::Configure => "configure",
        }
    }
}

/// What one line of debootstrap's output says about progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LineKind {
    /// One package went through a step (`I: Retrieving curl 7.88.1`, `I: Unpacking curl...`).
    Package(Step),
    /// Fetching the release and package indices, resolving dependencies.
    Resolve,
    /// `I: Base system installed successfully.`
    Installed,
    Other,
}

fn classify_line(line: &str) -> LineKind {
    let Some(info) = line.strip_prefix("I: ") else {
        return LineKind::Other;
    };
    if info.starts_with("Base system installed successfully") {
        return LineKind::Installed;
    }
    if info.starts_with("Resolving dependencies") || info.starts_with("Checking Release") {
        return LineKind::Resolve;
    }
    let Some((verb, rest)) = info.split_once(' ') else {
        return LineKind::Other;
    };
    let rest = rest.trim();
    match verb {
        // `Retrieving <package> <version>`; the indices are `Retrieving InRelease` and `Retrieving Packages`.
        "Retrieving" => match rest.split_whitespace().count() {
            2 => LineKind::Package(Step::Download),
            _ => LineKind::Resolve,
        },
        // `Extracting <package>...`; headers such as `Unpacking the base system...` have spaces.
        "Extracting" | "Unpacking" | "Configuring" => {
            let name = rest.strip_suffix("...").unwrap_or(rest);
            if name.is_empty() || name.contains(' ') {
                return LineKind::Other;
            }
            LineKind::Package(match verb {
                "Extracting" => Step::Extract,
                "Unpacking" => Step::Unpack,
                _ => Step::Configure,
            })
        }
        _ => LineKind::Other,
    }
}

/// Turns debootstrap's output into progress events. Each step counts the packages seen so far; totals
/// are learned once debootstrap has written its package lists (after the download).
#[derive(Debug, Default)]
struct ProgressTracker {
    phase: String,
    download: u64,
    extract: u64,
    unpack: u64,
    configure: u64,
    /// Packages of debootstrap's `required` set (those it extracts first).
    required: u64,
    /// All packages (`required` + `base`).
    all: u64,
}

impl ProgressTracker {
    fn set_totals(&mut self, required: u64, all: u64) {
        self.required = required;
        self.all = all;
    }

    fn totals_known(&self) -> bool {
        self.all > 0
    }

    fn observe(&mut self, line: &str) -> Option<BuildEvent> {
        match classify_line(line) {
            LineKind::Package(step) => {
                let (counter, total) = match step {
                    // The download ends before debootstrap writes its lists: the total is unknown.
                    Step::Download => (&mut self.download, 0),
                    Step::Extract => (&mut self.extract, self.required),
                    Step::Unpack => (&mut self.unpack, self.all),
                    Step::Configure => (&mut self.configure, self.all),
                };
                *counter += 1;
                let done = if total > 0 {
                    (*counter).min(total)
                } else {
                    *counter
                };
                self.phase = step.phase().to_string();
                Some(progress(step.phase(), done, total))
            }
            LineKind::Resolve if self.phase != "resolve" => {
                self.phase = "resolve".to_string();
                Some(progress("resolve", 0, 0))
            }
            LineKind::Installed => {
                self.phase = "configure".to_string();
                Some(progress("configure", self.all, self.all))
            }
            _ => None,
        }
    }
}

fn progress(phase: &str, done: u64, total: u64) -> BuildEvent {
    BuildEvent::Progress {
        phase: phase.to_string(),
        done,
        total,
    }
}

/// Sends an event; a receiver that went away does not stop the build.
async fn emit(events: &mpsc::Sender<BuildEvent>, event: BuildEvent) {
    let _ = events.send(event).await;
}

/// Builds a Debian root filesystem into `target` (which must not exist yet), streaming progress and
/// debootstrap's output to `events`. On failure the partial output is removed.
pub async fn build(
    opts: &DebootstrapOptions,
    target: &Path,
    events: &mpsc::Sender<BuildEvent>,
) -> anyhow::Result<()> {
    if tokio::fs::symlink_metadata(target).await.is_ok() {
        bail!("build target {} already exists", target.display());
    }
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    tokio::fs::create_dir_all(&opts.cache_dir)
        .await
        .with_context(|| format!("creating cache directory {}", opts.cache_dir.display()))?;

    let result = async {
        run_debootstrap(opts, target, events).await?;
        emit(events, progress("finalize", 0, 0)).await;
        finalize(target)
            .await
            .context("debootstrap finished, but preparing the root filesystem failed")?;
        emit(events, progress("finalize", 1, 1)).await;
        anyhow::Ok(())
    }
    .await;
    if let Err(err) = result {
        if let Err(cleanup) = remove_partial(target).await {
            tracing::warn!(target = %target.display(), error = %cleanup, "removing a failed template build");
        }
        return Err(err);
    }
    Ok(())
}

async fn run_debootstrap(
    opts: &DebootstrapOptions,
    target: &Path,
    events: &mpsc::Sender<BuildEvent>,
) -> anyhow::Result<()> {
    let mut cmd = Command::new("debootstrap");
    cmd.arg("--variant=minbase");
    if !opts.packages.is_empty() {
        cmd.arg(format!("--include={}", opts.packages.join(",")));
    }
    // debootstrap insists on an absolute cache directory.
    let cache_dir = std::path::absolute(&opts.cache_dir)
        .with_context(|| format!("resolving {}", opts.cache_dir.display()))?;
    cmd.arg(format!("--cache-dir={}", cache_dir.display()))
        .arg(&opts.suite)
        .arg(target)
        .arg(&opts.mirror)
        .env("PATH", CHROOT_PATH)
        .env("LC_ALL", "C")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    tracing::info!(suite = %opts.suite, mirror = %opts.mirror, target = %target.display(), "running debootstrap");
    let mut child = cmd.spawn().map_err(|err| {
        if err.kind() == std::io::ErrorKind::NotFound {
            anyhow!("debootstrap is not installed (apt-get install debootstrap, or run scripts/deps.sh)")
        } else {
            anyhow!(err).context("starting debootstrap")
        }
    })?;

    // Both streams feed one channel of lines, read in order of arrival.
    let (line_tx, mut lines) = mpsc::unbounded_channel::<String>();
    let mut readers = Vec::new();
    if let Some(stdout) = child.stdout.take() {
        readers.push(tokio::spawn(forward_lines(stdout, line_tx.clone())));
    }
    if let Some(stderr) = child.stderr.take() {
        readers.push(tokio::spawn(forward_lines(stderr, line_tx.clone())));
    }
    drop(line_tx);

    let mut tracker = ProgressTracker::default();
    let mut tail: VecDeque<String> = VecDeque::with_capacity(TAIL_LINES);
    while let Some(line) = lines.recv().await {
        if !tracker.totals_known() && classify_line(&line) == LineKind::Package(Step::Extract) {
            if let Some((required, all)) = package_totals(target).await {
                tracker.set_totals(required, all);
            }
        }
        if let Some(event) = tracker.observe(&line) {
            emit(events, event).await;
        }
        if tail.len() == TAIL_LINES {
            tail.pop_front();
        }
        tail.push_back(line.clone());
        emit(events, BuildEvent::Log { line, step: None }).await;
    }
    for reader in readers {
        let _ = reader.await;
    }
    let status = child.wait().await.context("waiting for debootstrap")?;
    if !status.success() {
        let phase = if tracker.phase.is_empty() {
            "start"
        } else {
            tracker.phase.as_str()
        };
        let tail: Vec<String> = tail.into();
        bail!(
            "debootstrap failed during {phase} ({status}); last output:\n{}",
            tail.join("\n")
        );
    }
    Ok(())
}

async fn forward_lines(stream: impl AsyncRead + Unpin, tx: mpsc::UnboundedSender<String>) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                if tx.send(line.trim_end().to_string()).is_err() {
                    break;
                }
            }
        }
    }
}

/// Package counts from the lists debootstrap writes into `TARGET/debootstrap/` after downloading.
async fn package_totals(target: &Path) -> Option<(u64, u64)> {
    let dir = target.join("debootstrap");
    let count = |text: String| text.split_whitespace().count() as u64;
    let required = count(tokio::fs::read_to_string(dir.join("required")).await.ok()?);
    let base = count(
        tokio::fs::read_to_string(dir.join("base"))
            .await
            .unwrap_or_default(),
    );
    (required > 0).then_some((required, required + base))
}

/// Runs a command inside the new root filesystem.
async fn chroot(target: &Path, args: &[&str]) -> anyhow::Result<()> {
    let output = Command::new("chroot")
        .arg(target)
        .args(args)
        .env_clear()
        .env("PATH", CHROOT_PATH)
        .env("LC_ALL", "C")
        .env("HOME", "/root")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .with_context(|| format!("running chroot {} {}", target.display(), args.join(" ")))?;
    if !output.status.success() {
        bail!(
            "`{}` in the new root filesystem failed ({}): {}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim(),
            String::from_utf8_lossy(&output.stdout).trim()
        );
    }
    Ok(())
}

async fn write_file(path: &Path, contents: &str, mode: u32) -> anyhow::Result<()> {
    // Replace rather than write through: the file may be a symlink (resolv.conf often is).
    match tokio::fs::remove_file(path).await {
        Ok(()) => {}
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(anyhow!(err).context(format!("removing {}", path.display()))),
    }
    tokio::fs::write(path, contents)
        .await
        .with_context(|| format!("writing {}", path.display()))?;
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .await
        .with_context(|| format!("setting the mode of {}", path.display()))
}

async fn ensure_dir(path: &Path, mode: u32) -> anyhow::Result<()> {
    tokio::fs::create_dir_all(path)
        .await
        .with_context(|| format!("creating {}", path.display()))?;
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .await
        .with_context(|| format!("setting the mode of {}", path.display()))
}

const HOSTS: &str = "127.0.0.1\tlocalhost\n\
127.0.1.1\tmoat\n\
::1\tlocalhost ip6-localhost ip6-loopback\n\
ff02::1\tip6-allnodes\n\
ff02::2\tip6-allrouters\n";

/// Turns debootstrap's output into a template: the `user` account, host identity files, and no caches.
async fn finalize(target: &Path) -> anyhow::Result<()> {
    chroot(target, &["groupadd", "--gid", "1000", "user"]).await?;
    chroot(
        target,
        &[
            "useradd",
            "--uid",
            "1000",
            "--gid",
            "1000",
            "--groups",
            "sudo",
            "--create-home",
            "--home-dir",
            "/home/user",
            "--shell",
            "/bin/bash",
            "user",
        ],
    )
    .await?;
    let etc = target.join("etc");
    // Passwordless sudo for `user` where sudo is installed (a bare release from a spec may not have it).
    if tokio::fs::symlink_metadata(target.join("usr/sbin/visudo"))
        .await
        .is_ok()
    {
        ensure_dir(&etc.join("sudoers.d"), 0o755).await?;
        write_file(
            &etc.join("sudoers.d/user"),
            "user ALL=(ALL:ALL) NOPASSWD: ALL\n",
            0o440,
        )
        .await?;
        chroot(
            target,
            &[
                "visudo",
                "--check",
                "--quiet",
                "--file",
                "/etc/sudoers.d/user",
            ],
        )
        .await?;
    }
    write_file(&etc.join("hostname"), "moat\n", 0o644).await?;
    write_file(&etc.join("hosts"), HOSTS, 0o644).await?;
    // debootstrap copies the host's resolver configuration; a sandbox's DNS is set up by moat.
    write_file(&etc.join("resolv.conf"), "", 0o644).await?;

    chroot(target, &["apt-get", "clean"]).await?;
    let lists = target.join("var/lib/apt/lists");
    if let Ok(mut entries) = tokio::fs::read_dir(&lists).await {
        while let Some(entry) = entries.next_entry().await? {
            let path = entry.path();
            if entry.file_type().await?.is_dir() {
                tokio::fs::remove_dir_all(&path).await
            } else {
                tokio::fs::remove_file(&path).await
            }
            .with_context(|| format!("removing {}", path.display()))?;
        }
    }
    ensure_dir(&lists.join("partial"), 0o700).await?;
    ensure_dir(&target.join("root"), 0o700).await?;
    ensure_dir(&target.join("tmp"), 0o1777).await?;
    Ok(())
}

/// Removes a partial build. debootstrap mounts /proc and /sys inside the target while it configures
/// packages; if it died before unmounting them, unmount first so the removal stays inside the target.
async fn remove_partial(target: &Path) -> anyhow::Result<()> {
    let target = target.to_path_buf();
    tokio::task::spawn_blocking(move || {
        unmount_below(&target)?;
        match std::fs::remove_dir_all(&target) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(err) => Err(anyhow!(err).context(format!("removing {}", target.display()))),
        }
    })
    .await
    .context("removing a partial build")?
}

/// Lazily unmounts every mount point at or below `dir`, deepest first.
fn unmount_below(dir: &Path) -> anyhow::Result<()> {
    let Ok(dir) = dir.canonicalize() else {
        return Ok(());
    };
    let mountinfo =
        std::fs::read_to_string("/proc/self/mountinfo").context("reading /proc/self/mountinfo")?;
    let mut points: Vec<PathBuf> = mount_points(&mountinfo)
        .into_iter()
        .filter(|p| p.starts_with(&dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in points {
        nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH)
            .with_context(|| format!("unmounting {}", point.display()))?;
    }
    Ok(())
}

/// Mount points (field 5) of /proc/self/mountinfo, with its octal escapes (`\040` for space) decoded.
fn mount_points(mountinfo: &str) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| {
            let bytes = field.as_bytes();
            let mut out = Vec::with_capacity(bytes.len());
            let mut i = 0;
            while i < bytes.len() {
                let octal = bytes
                    .get(i + 1..i + 4)
                    .filter(|d| bytes[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
                if let Some(digits) = octal {
                    out.push(
                        digits
                            .iter()
                            .fold(0u8, |acc, d| acc.wrapping_mul(8) + (d - b'0')),
                    );
                    i += 4;
                } else {
                    out.push(bytes[i]);
                    i += 1;
                }
            }
            PathBuf::from(std::ffi::OsString::from_vec(out))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEB822: &str = "\
Types: deb
# http://snapshot.example/archive/debian/20250520T000000Z
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
";

    #[test]
    fn deb822_main_archive() {
        assert_eq!(
            mirror_from_deb822(DEB822, "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
        // Only the security stanza serves this suite, and it is not what is asked for.
        assert_eq!(mirror_from_deb822(DEB822, "trixie"), None);
    }

    #[test]
    fn deb822_skips_security_disabled_src_and_foreign_suites() {
        let text = "\
Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
URIs: https://vendor.example/apt
Suites: nodistro
Components: main

Enabled: no
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Components: main

types: deb deb-src
uris: mirror+file:///etc/apt/mirrors.txt
  https://second.example/debian
suites: bookworm
components: contrib
  main non-free-firmware
";
        assert_eq!(
            mirror_from_deb822(text, "bookworm").as_deref(),
            Some("https://second.example/debian")
        );
    }

    #[test]
    fn one_line_sources() {
        let text = "\
# deb http://commented.example/debian bookworm main
deb-src http://src.example/debian bookworm main
deb http://security.example/debian-security bookworm-security main
deb http://mirror.example/debian bookworm-updates main
deb https://vendor.example/apt cloud-sdk-bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://mirror.example/debian bookworm main contrib # trailing
";
        assert_eq!(
            mirror_from_one_line(text, "bookworm").as_deref(),
            Some("http://mirror.example/debian")
        );
        assert_eq!(
            mirror_from_one_line("deb http://m.example/debian bookworm contrib\n", "bookworm"),
            None
        );
        assert_eq!(mirror_from_one_line("", "bookworm"), None);
    }

    #[test]
    fn host_mirror_prefers_deb822_then_one_line() {
        let dir = tempfile::tempdir().unwrap();
        let apt = dir.path();
        std::fs::create_dir(apt.join("sources.list.d")).unwrap();
        std::fs::write(
            apt.join("sources.list"),
            "deb http://oneline.example/debian bookworm main\n",
        )
        .unwrap();
        assert_eq!(
            host_mirror(apt, "bookworm").unwrap(),
            "http://oneline.example/debian"
        );
        std::fs::write(apt.join("sources.list.d/debian.sources"), DEB822).unwrap();
        // A disabled file (not *.sources / *.list) is ignored.
        std::fs::write(
            apt.join("sources.list.d/other.sources.disabled"),
            "Types: deb\nURIs: http://disabled.example/\nSuites: bookworm\nComponents: main\n",
        )
        .unwrap();
        assert_eq!(
            host_mirror(apt, "bookworm").unwrap(),
            "http://mirror.example/debian"
        );
        let err = host_mirror(apt, "sid").unwrap_err().to_string();
        assert!(err.contains("sid"), "{err}");
    }

    #[test]
    fn codename() {
        let text = "PRETTY_NAME=\"Debian GNU/Linux 12 (bookworm)\"\nVERSION_ID=\"12\"\nVERSION_CODENAME=bookworm\nID=debian\n";
        assert_eq!(os_release_codename(text).as_deref(), Some("bookworm"));
        assert_eq!(
            os_release_codename("VERSION_CODENAME=\"trixie\"\n").as_deref(),
            Some("trixie")
        );
        assert_eq!(os_release_codename("VERSION_CODENAME=\n"), None);
        assert_eq!(os_release_codename("ID=debian\n"), None);
    }

    #[test]
    fn classify_debootstrap_lines() {
        use LineKind::*;
        assert_eq!(classify_line("I: Retrieving InRelease "), Resolve);
        assert_eq!(classify_line("I: Retrieving Packages "), Resolve);
        assert_eq!(
            classify_line("I: Resolving dependencies of required packages..."),
            Resolve
        );
        assert_eq!(
            classify_line("I: Retrieving adduser 3.134"),
            Package(Step::Download)
        );
        assert_eq!(classify_line("I: Validating adduser 3.134"), Other);
        assert_eq!(
            classify_line("I: Extracting base-files..."),
            Package(Step::Extract)
        );
        assert_eq!(
            classify_line("I: Unpacking libc6:amd64..."),
            Package(Step::Unpack)
        );
        assert_eq!(classify_line("I: Unpacking the base system..."), Other);
        assert_eq!(classify_line("I: Unpacking required packages..."), Other);
        assert_eq!(
            classify_line("I: Configuring dpkg..."),
            Package(Step::Configure)
        );
        assert_eq!(classify_line("I: Configuring required packages..."), Other);
        assert_eq!(
            classify_line("I: Base system installed successfully."),
            Installed
        );
        assert_eq!(classify_line("W: Failure trying to run: chroot"), Other);
        assert_eq!(classify_line("E: Couldn't find these debs: nope"), Other);
    }

    #[test]
    fn tracker_counts_and_clamps() {
        let mut t = ProgressTracker::default();
        let p = |phase: &str, done, total| progress(phase, done, total);
        assert_eq!(
            t.observe("I: Retrieving InRelease "),
            Some(p("resolve", 0, 0))
        );
        assert_eq!(t.observe("I: Checking Release signature"), None);
        assert_eq!(t.observe("I: Retrieving a 1"), Some(p("download", 1, 0)));
        assert_eq!(t.observe("I: Validating a 1"), None);
        assert_eq!(t.observe("I: Retrieving b 1"), Some(p("download", 2, 0)));
        assert_eq!(t.observe("I: Retrieving c 1"), Some(p("download", 3, 0)));
        t.set_totals(2, 3);
        assert!(t.totals_known());
        assert_eq!(t.observe("I: Extracting a..."), Some(p("extract", 1, 2)));
        assert_eq!(t.observe("I: Extracting b..."), Some(p("extract", 2, 2)));
        assert_eq!(t.observe("I: Unpacking required packages..."), None);
        assert_eq!(t.observe("I: Unpacking a..."), Some(p("unpack", 1, 3)));
        assert_eq!(t.observe("I: Configuring a..."), Some(p("configure", 1, 3)));
        assert_eq!(t.observe("I: Unpacking b..."), Some(p("unpack", 2, 3)));
        assert_eq!(t.observe("I: Unpacking c..."), Some(p("unpack", 3, 3)));
        // Some packages are unpacked twice; done never passes total.
        assert_eq!(t.observe("I: Unpacking c..."), Some(p("unpack", 3, 3)));
        assert_eq!(t.phase, "unpack");
        assert_eq!(
            t.observe("I: Base system installed successfully."),
            Some(p("configure", 3, 3))
        );
    }

    #[test]
    fn mountinfo_points() {
        let text = "\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
88 22 0:5 / /tmp/with\\040space/proc rw - proc proc rw
";
        assert_eq!(
            mount_points(text),
            vec![PathBuf::from("/"), PathBuf::from("/tmp/with space/proc")]
        );
    }

    #[tokio::test]
    async fn failed_build_reports_phase_and_output_and_cleans_up() {
        // A mirror that does not exist fails at once, without network: the real process path.
        let dir = tempfile::tempdir().unwrap();
        let opts = DebootstrapOptions {
            suite: "bookworm".into(),
            mirror: "file:///nonexistent-moat-mirror".into(),
            packages: vec![],
            cache_dir: dir.path().join("cache"),
        };
        let target = dir.path().join("templates/base");
        let (tx, mut rx) = mpsc::channel(1024);
        let err = build(&opts, &target, &tx).await.unwrap_err().to_string();
        assert!(err.contains("debootstrap failed during resolve"), "{err}");
        assert!(err.contains("Failed getting release file"), "{err}");
        assert!(!target.exists(), "partial output removed");
        assert!(dir.path().join("cache").is_dir());
        drop(tx);
        let mut logs = Vec::new();
        while let Some(event) = rx.recv().await {
            if let BuildEvent::Log { line, .. } = event {
                logs.push(line);
            }
        }
        assert!(logs.iter().any(|l| l.starts_with("E: ")), "{logs:?}");

        // A receiver that went away does not change the outcome.
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        let err = build(&opts, &target, &tx).await.unwrap_err().to_string();
        assert!(err.contains("Failed getting release file"), "{err}");

        std::fs::create_dir_all(&target).unwrap();
        let err = build(&opts, &target, &tx).await.unwrap_err().to_string();
        assert!(err.contains("already exists"), "{err}");
    }

    #[test]
    fn options_from_this_host() {
        // Every machine moat is built on is Debian with apt sources.
        let opts = DebootstrapOptions::from_host(PathBuf::from("/nonexistent-cache")).unwrap();
        assert!(!opts.suite.is_empty());
        assert!(usable_uri(&opts.mirror), "{}", opts.mirror);
        assert!(opts.packages.iter().any(|p| p == "python3"));
    }
}
