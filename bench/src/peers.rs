//! The tools moat is compared with, run as plain commands, and what `/proc` says about a process's
//! isolation.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// `Some(path)` of `prog` when it is on `PATH`.
pub fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(prog))
        .find(|p| p.is_file())
}

/// Runs `argv` to completion, stdout discarded; its wall time, or an error holding its stderr.
pub fn time_cmd(argv: &[OsString]) -> Result<Duration> {
    tokio::task::block_in_place(|| time_cmd_sync(argv))
}

/// [`time_cmd`] for threads of the bench's own (concurrent bursts).
pub fn time_cmd_sync(argv: &[OsString]) -> Result<Duration> {
    let (prog, args) = argv.split_first().context("empty command")?;
    let started = Instant::now();
    let out = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("run {}", prog.to_string_lossy()))?;
    let elapsed = started.elapsed();
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            prog.to_string_lossy(),
            out.status,
            last_line(&String::from_utf8_lossy(&out.stderr))
        );
    }
    Ok(elapsed)
}

/// Runs `argv` once (setup and teardown steps), failing with its stderr.
pub fn run_quiet(argv: &[OsString]) -> Result<()> {
    time_cmd(argv).map(drop)
}

/// Runs `argv`, which leaves a process behind (`runsc run --detach`), with its output going to `log`
/// rather than a pipe: a pipe inherited by what stays behind would never reach end-of-file.
pub fn run_detached(argv: &[OsString], log: &Path) -> Result<()> {
    let (prog, args) = argv.split_first().context("empty command")?;
    let file = std::fs::File::create(log).with_context(|| format!("create {}", log.display()))?;
    let status = tokio::task::block_in_place(|| {
        Command::new(prog)
            .args(args)
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .status()
    })
    .with_context(|| format!("run {}", prog.to_string_lossy()))?;
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        bail!(
            "{} failed ({status}): {}",
            prog.to_string_lossy(),
            last_line(&text)
        );
    }
    Ok(())
}

/// The last non-empty line of a tool's stderr, shortened for a table cell.
pub fn last_line(text: &str) -> String {
    let line = text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .trim();
    let mut short: String = line.chars().take(160).collect();
    if short.len() < line.len() {
        short.push('…');
    }
    short.replace('|', "/")
}

/// First line of `prog --version` (or `prog version_arg`).
pub fn version(prog: &str, version_arg: &str) -> String {
    match Command::new(prog).arg(version_arg).output() {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            text.lines().next().unwrap_or("").trim().to_string()
        }
        Err(_) => "not installed".into(),
    }
}

/// `OsString`s from string slices and paths.
pub fn argv<I, S>(parts: I) -> Vec<OsString>
where
    I: IntoIterator<Item = S>,
    S: Into<OsString>,
{
    parts.into_iter().map(Into::into).collect()
}

/// `bwrap --unshare-all` over a read-only bind of `rootfs`, running `cmd`.
pub fn bwrap_argv(rootfs: &Path, cmd: &[&str]) -> Vec<OsString> {
    let mut v = argv(["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind"]);
    v.push(rootfs.into());
    v.extend(argv(["/", "--proc", "/proc", "--dev", "/dev"]));
    v.extend(argv(cmd.iter().copied()));
    v
}

/// Plain namespaces with `unshare(1)` and a `chroot` into `rootfs`: the floor of what a container costs.
pub fn unshare_argv(rootfs: &Path) -> Vec<OsString> {
    let mut v = argv([
        "unshare",
        "--user",
        "--map-root-user",
        "--pid",
        "--mount",
        "--uts",
        "--ipc",
        "--net",
        "--cgroup",
        "--fork",
        "chroot",
    ]);
    v.push(rootfs.into());
    v.push("/bin/true".into());
    v
}

/// `runsc` with its state under `state` and no network (never the host's network).
pub fn runsc_base(state: &Path) -> Vec<OsString> {
    let mut v = argv(["runsc", "--root"]);
    v.push(state.into());
    v.push("--network=none".into());
    v
}

/// `runsc do` of `/bin/true` with `rootfs` as the root (runsc puts a tmpfs overlay over it).
pub fn runsc_do_argv(state: &Path, rootfs: &Path) -> Vec<OsString> {
    let mut v = runsc_base(state);
    v.extend(argv(["do", "-root"]));
    v.push(rootfs.into());
    v.extend(argv(["-cwd", "/", "/bin/true"]));
    v
}

/// `runc` with its state under `root`.
pub fn runc_base(root: &Path) -> Vec<OsString> {
    let mut v = argv(["runc", "--root"]);
    v.push(root.into());
    v
}

/// `<base> run --bundle B ID` (runsc or runc): create, start, wait and delete one container.
pub fn oci_run_argv(base: &[OsString], bundle: &Path, id: &str) -> Vec<OsString> {
    let mut v = base.to_vec();
    v.extend(argv(["run", "--bundle"]));
    v.push(bundle.into());
    v.push(id.into());
    v
}

/// The `podman` binary with the bench's global flags: its own storage under `dir` (never the
/// system's), runc (crun refuses cgroup v1 hybrid hosts), cgroupfs, events to a file.
pub fn podman_base(dir: &Path) -> Vec<OsString> {
    let mut v = argv(["podman", "--root"]);
    v.push(dir.join("root").into());
    v.push("--runroot".into());
    v.push(dir.join("runroot").into());
    v.push("--tmpdir".into());
    v.push(dir.join("tmp").into());
    v.extend(argv([
        "--runtime",
        PODMAN_RUNTIME,
        "--cgroup-manager",
        "cgroupfs",
        "--events-backend",
        "file",
    ]));
    v
}

/// The OCI runtime podman is told to use.
pub const PODMAN_RUNTIME: &str = "/usr/sbin/runc";

/// `podman run` with no network, explicit rlimits (the host's hard nofile limit is 20000 and nothing
/// may raise it) and `rootfs` as the root through an overlay (`:O`: writes are discarded, the
/// directory is never changed); `extra` go before the root (`--rm`, `-d`, `--name N`).
pub fn podman_run_argv(
    base: &[OsString],
    rootfs: &Path,
    extra: &[&str],
    cmd: &[&str],
) -> Vec<OsString> {
    let mut v = base.to_vec();
    v.push("run".into());
    v.extend(argv(extra.iter().copied()));
    v.extend(argv([
        "--network",
        "none",
        "--ulimit",
        "nofile=20000:20000",
        "--ulimit",
        "nproc=4096:4096",
        "--rootfs",
    ]));
    let mut root = OsString::from(rootfs);
    root.push(":O");
    v.push(root);
    v.extend(argv(cmd.iter().copied()));
    v
}

/// `base` followed by `rest`.
pub fn with(base: &[OsString], rest: &[&str]) -> Vec<OsString> {
    let mut v = base.to_vec();
    v.extend(argv(rest.iter().copied()));
    v
}

/// Runs `argv` to completion and returns its stdout; fails with its stderr.
pub fn output_of(argv: &[OsString]) -> Result<String> {
    let (prog, args) = argv.split_first().context("empty command")?;
    let out =
        tokio::task::block_in_place(|| Command::new(prog).args(args).stdin(Stdio::null()).output())
            .with_context(|| format!("run {}", prog.to_string_lossy()))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            prog.to_string_lossy(),
            out.status,
            last_line(&String::from_utf8_lossy(&out.stderr))
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The host pid of container `id`'s init, from `<base> state ID` (runc, runsc).
pub fn oci_pid(base: &[OsString], id: &str) -> Result<u32> {
    let text = output_of(&with(base, &["state", id]))?;
    let v: serde_json::Value = serde_json::from_str(&text).context("parse the state")?;
    v["pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .filter(|p| *p > 0)
        .with_context(|| format!("no pid in the state of {id}"))
}

/// The host pid of podman container `name`'s init.
pub fn podman_pid(base: &[OsString], name: &str) -> Result<u32> {
    let text = output_of(&with(
        base,
        &["inspect", "--format", "{{.State.Pid}}", name],
    ))?;
    text.trim()
        .parse::<u32>()
        .ok()
        .filter(|p| *p > 0)
        .with_context(|| format!("no pid for podman container {name}: {text}"))
}

/// Kills and deletes every container `<base> list` shows (runc, runsc); returns what is left.
pub fn sweep_oci(base: &[OsString], tool: &str) -> Vec<String> {
    let ids = match output_of(&with(base, &["list", "--quiet"])) {
        Ok(text) => text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect::<Vec<_>>(),
        Err(e) => return vec![format!("{tool} list: {e:#}")],
    };
    let mut problems = Vec::new();
    for id in ids {
        let _ = run_quiet(&with(base, &["kill", &id, "KILL"]));
        if let Err(e) = run_quiet(&with(base, &["delete", "--force", &id])) {
            // A container killed a moment ago may still be stopping.
            std::thread::sleep(Duration::from_millis(300));
            if run_quiet(&with(base, &["delete", "--force", &id])).is_err() {
                problems.push(format!("{tool} container {id}: {e:#}"));
            }
        }
    }
    problems
}

/// Removes every container of the bench's podman storage; returns what is left.
pub fn sweep_podman(base: &[OsString]) -> Vec<String> {
    let listed = |what: &[&str]| -> Vec<String> {
        output_of(&with(base, what))
            .map(|t| {
                t.lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty())
                    .map(String::from)
                    .collect()
            })
            .unwrap_or_default()
    };
    if listed(&["ps", "-aq"]).is_empty() {
        return Vec::new();
    }
    let mut problems = Vec::new();
    if let Err(e) = run_quiet(&with(base, &["rm", "--all", "--force", "--time", "0"])) {
        problems.push(format!("podman rm --all: {e:#}"));
    }
    for id in listed(&["ps", "-aq"]) {
        problems.push(format!("podman container {id} is still there"));
    }
    problems
}

/// Writes an OCI bundle (`config.json` only; the root is `rootfs`, read-only) running `args`.
pub fn write_oci_bundle(dir: &Path, rootfs: &Path, args: &[&str]) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
    let caps = ["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"];
    let spec = serde_json::json!({
        "ociVersion": "1.0.0",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "inheritable": caps, "permitted": caps
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}]
        },
        "root": {"path": rootfs, "readonly": true},
        "hostname": "runsc",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]}
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"},
                {"type": "uts"}, {"type": "mount"}
            ]
        }
    });
    let path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&spec)?;
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))
}

/// Pids of the direct children of `pid`.
pub fn children(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// A descendant of `pid` whose `comm` is `name`.
pub fn find_descendant(pid: u32, name: &str) -> Option<u32> {
    let mut todo = children(pid);
    while let Some(p) = todo.pop() {
        let comm = std::fs::read_to_string(format!("/proc/{p}/comm")).unwrap_or_default();
        if comm.trim() == name {
            return Some(p);
        }
        todo.extend(children(p));
    }
    None
}

/// Every process id in /proc now.
pub fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|s| s.parse().ok()))
                .collect()
        })
        .unwrap_or_default()
}

/// A process whose cgroup path (any hierarchy) contains `needle` and that is PID 1 of its pid
/// namespace: the init of a moat sandbox.
pub fn find_sandbox_init(needle: &str) -> Option<u32> {
    for pid in pids() {
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if !cgroup.contains(needle) {
            continue;
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let ns_pid_is_1 = status
            .lines()
            .find(|l| l.starts_with("NSpid:"))
            .and_then(|l| l.split_whitespace().last())
            == Some("1");
        if ns_pid_is_1 {
            return Some(pid);
        }
    }
    None
}

/// What `/proc` shows of `pid`'s isolation, compared with this process: the namespaces it does not
/// share, where its root maps on the host, its seccomp mode and whether it runs in a cgroup of its
/// own.
pub fn describe_isolation(pid: u32) -> String {
    let mut own = Vec::new();
    for ns in ["user", "pid", "mnt", "net", "uts", "ipc", "cgroup"] {
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).ok();
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).ok();
        if theirs.is_some() && theirs != ours {
            own.push(ns);
        }
    }
    let mut parts = vec![format!("own ns: {}", own.join(", "))];
    if own.contains(&"user") {
        let map = std::fs::read_to_string(format!("/proc/{pid}/uid_map")).unwrap_or_default();
        if let Some(first) = map.lines().next() {
            let f: Vec<&str> = first.split_whitespace().collect();
            if let [inside, host, count] = f[..] {
                parts.push(format!("uid {inside}→host {host} (×{count})"));
            }
        }
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let seccomp = status
        .lines()
        .find(|l| l.starts_with("Seccomp:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or("?");
    parts.push(match seccomp {
        "0" => "no seccomp".to_string(),
        "2" => "seccomp filter".to_string(),
        other => format!("seccomp mode {other}"),
    });
    parts.join("; ")
}

/// The cgroup limits that apply to `pid` (cpu quota, memory, pids), read from its own cgroup in each
/// hierarchy; `no cgroup limits` when none is set.
pub fn describe_cgroup_limits(pid: u32) -> String {
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let mut dirs: Vec<(String, PathBuf)> = Vec::new();
    for line in cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if ctrls.is_empty() {
            dirs.push(("v2".into(), Path::new("/sys/fs/cgroup").join(rel)));
            dirs.push(("v2".into(), Path::new("/sys/fs/cgroup/unified").join(rel)));
        } else {
            for c in ctrls.split(',') {
                dirs.push((c.to_string(), Path::new("/sys/fs/cgroup").join(c).join(rel)));
            }
        }
    }
    let read = |ctrl: &str, file: &str| -> Option<String> {
        dirs.iter()
            .filter(|(c, _)| c == ctrl)
            .find_map(|(_, d)| std::fs::read_to_string(d.join(file)).ok())
            .map(|s| s.trim().to_string())
    };
    let mut limits = Vec::new();
    let quota = read("cpu", "cpu.cfs_quota_us").and_then(|q| q.parse::<i64>().ok());
    let period = read("cpu", "cpu.cfs_period_us").and_then(|q| q.parse::<i64>().ok());
    if let (Some(q), Some(p)) = (quota, period) {
        if q > 0 && p > 0 {
            limits.push(format!("cpu {:.2}", q as f64 / p as f64));
        }
    } else if let Some(max) = read("v2", "cpu.max") {
        let mut f = max.split_whitespace();
        if let (Some(Ok(q)), Some(Ok(p))) = (
            f.next().map(str::parse::<f64>),
            f.next().map(str::parse::<f64>),
        ) {
            limits.push(format!("cpu {:.2}", q / p));
        }
    }
    let mem = read("memory", "memory.limit_in_bytes").or_else(|| read("v2", "memory.max"));
    if let Some(bytes) = mem.and_then(|m| m.parse::<u64>().ok()) {
        if bytes < 1 << 60 {
            limits.push(format!("memory {} MiB", bytes >> 20));
        }
    }
    let pids = read("pids", "pids.max").or_else(|| read("v2", "pids.max"));
    if let Some(p) = pids.filter(|p| p != "max") {
        limits.push(format!("pids {p}"));
    }
    if limits.is_empty() {
        "no cgroup limits".into()
    } else {
        format!("cgroup limits: {}", limits.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_line_is_short_and_table_safe() {
        assert_eq!(last_line("a\nb | c\n\n"), "b / c");
        assert_eq!(last_line(""), "(no output)");
        assert_eq!(last_line(&"x".repeat(500)).chars().count(), 161);
    }

    #[test]
    fn argv_shapes() {
        let r = Path::new("/r");
        let b = bwrap_argv(r, &["/bin/true"]);
        assert_eq!(b[0], "bwrap");
        assert_eq!(b.last().map(|s| s.as_os_str()), Some("/bin/true".as_ref()));
        let d = runsc_do_argv(Path::new("/s"), r);
        let d: Vec<_> = d.iter().map(|s| s.to_string_lossy()).collect();
        assert_eq!(
            d.join(" "),
            "runsc --root /s --network=none do -root /r -cwd / /bin/true"
        );
    }

    #[test]
    fn own_process_shares_every_namespace() {
        let d = describe_isolation(std::process::id());
        assert!(d.starts_with("own ns: ;"), "{d}");
    }
}
