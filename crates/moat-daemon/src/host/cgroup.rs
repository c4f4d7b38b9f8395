//! Control groups: v1 (one hierarchy per controller) and v2 (unified) behind one interface.
//!
//! Every sandbox gets `moat/<name>` in each hierarchy the daemon uses. Limits are written at create;
//! `kill_all` and `remove` tear the group down. The v2 file formats are unit-tested here because the
//! development hosts run v1.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// Group every moat cgroup lives under, in each hierarchy, for the default data directory. Daemons
/// with another data directory use `moat-<hash>` (see `parent_for`), so two daemons on one host never
/// take each other's sandboxes for leftovers.
pub const PARENT: &str = "moat";

/// The cgroup parent of a daemon with this data directory.
pub fn parent_for(data_dir: &Path) -> String {
    if data_dir == Path::new("/var/lib/moat") {
        return PARENT.to_string();
    }
    use sha2::Digest;
    let h = sha2::Sha256::digest(data_dir.as_os_str().as_encoded_bytes());
    format!("{PARENT}-{}", &hex::encode(h)[..8])
}

const V1_CONTROLLERS: &[&str] = &["cpu", "cpuacct", "memory", "pids", "freezer", "cpuset"];

/// Which cgroup layout the host has.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupLayout {
    /// One directory per controller (`/sys/fs/cgroup/memory`, ...).
    V1 { root: PathBuf, parent: String },
    /// One unified hierarchy.
    V2 { root: PathBuf, parent: String },
}

/// Limits applied to a group.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// CPU cores (fractional).
    pub cpu: f64,
    /// Hard memory limit in bytes (swap is not allowed on top of it).
    pub memory_bytes: u64,
    /// Largest number of tasks.
    pub pids: u64,
    /// The CPUs its tasks may run on (`cpuset.cpus`); None leaves the group's as they are (all of
    /// the parent's, at creation).
    pub cpus: Option<Vec<u32>>,
}

/// What a group uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    /// CPU time of all its tasks, microseconds.
    pub cpu_usage_us: u64,
    pub memory_bytes: u64,
    pub memory_peak_bytes: u64,
    pub pids: u64,
    /// Processes the OOM killer ended in this group.
    pub oom_kills: u64,
}

/// The value of `key` in a flat-keyed cgroup file (`key value` per line: `cpu.stat`, `memory.events`,
/// v1 `memory.oom_control`).
pub fn keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == key).then(|| it.next()?.parse().ok())?
    })
}

/// CFS period used for CPU quotas, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;

impl CgroupLayout {
    /// Detects the layout of the cgroup mount at `/sys/fs/cgroup`.
    pub fn detect(parent: &str) -> Result<CgroupLayout> {
        let parent = parent.to_string();
        let root = PathBuf::from("/sys/fs/cgroup");
        let fs = nix::sys::statfs::statfs(&root).context("statfs /sys/fs/cgroup")?;
        if fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC {
            Ok(CgroupLayout::V2 { root, parent })
        } else if root.join("memory").is_dir() {
            Ok(CgroupLayout::V1 { root, parent })
        } else {
            bail!("no usable cgroup hierarchy at /sys/fs/cgroup (neither cgroup2 nor a v1 memory controller)")
        }
    }

    pub fn is_v2(&self) -> bool {
        matches!(self, CgroupLayout::V2 { .. })
    }

    /// Directories of the group `name` (one per hierarchy; v1 hierarchies mounted together are listed once).
    /// The `cgroup.procs` files of cgroup `name` in every hierarchy, as C strings for
    /// [`join_from_pre_exec`] (made before a fork: nothing may be allocated after it).
    pub fn procs_files(&self, name: &str) -> Result<Vec<std::ffi::CString>> {
        self.dirs(name)
            .iter()
            .map(|d| std::ffi::CString::new(d.join("cgroup.procs").as_os_str().as_encoded_bytes()))
            .collect::<Result<_, _>>()
            .map_err(Into::into)
    }

    pub fn dirs(&self, name: &str) -> Vec<PathBuf> {
        match self {
            CgroupLayout::V2 { root, parent } => vec![root.join(parent).join(name)],
            CgroupLayout::V1 { root, parent } => {
                let mut seen: Vec<PathBuf> = Vec::new();
                let mut out = Vec::new();
                for c in V1_CONTROLLERS {
                    let base = root.join(c);
                    if !base.is_dir() {
                        continue;
                    }
                    let real = std::fs::canonicalize(&base).unwrap_or(base.clone());
                    if seen.contains(&real) {
                        continue;
                    }
                    seen.push(real);
                    out.push(base.join(parent).join(name));
                }
                out
            }
        }
    }

    /// Names of all groups under `moat/` in any hierarchy.
    pub fn list(&self) -> Vec<String> {
        let mut names = Vec::new();
        for parent in self.parents() {
            if let Ok(rd) = std::fs::read_dir(&parent) {
                for e in rd.flatten() {
                    if e.path().is_dir() {
                        if let Some(n) = e.file_name().to_str() {
                            if !names.iter().any(|x: &String| x == n) {
                                names.push(n.to_string());
                            }
                        }
                    }
                }
            }
        }
        names
    }

    fn parents(&self) -> Vec<PathBuf> {
        self.dirs("x")
            .into_iter()
            .filter_map(|d| d.parent().map(Path::to_path_buf))
            .collect()
    }

    /// Creates the group `name` with `limits`. Idempotent.
    pub fn create(&self, name: &str, limits: &Limits) -> Result<()> {
        match self {
            CgroupLayout::V2 { root, parent } => {
                let parent = root.join(parent);
                std::fs::create_dir_all(&parent)
                    .with_context(|| format!("mkdir {}", parent.display()))?;
                // Controllers must be enabled top-down for the leaf to get their files.
                for dir in [root.clone(), parent.clone()] {
                    let _ =
                        std::fs::write(dir.join("cgroup.subtree_control"), "+cpu +memory +pids");
                    // Best effort: a host without the cpuset controller keeps every CPU.
                    let _ = std::fs::write(dir.join("cgroup.subtree_control"), "+cpuset");
                }
            }
            CgroupLayout::V1 { root, parent } => {
                let base = root.join("cpuset");
                if base.is_dir() {
                    prepare_v1_cpuset(&base, &base.join(parent))?;
                }
            }
        }
        for dir in self.dirs(name) {
            std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        }
        for (file, value) in self.limit_files(limits) {
            let Some(path) = self.file_in(name, &file) else {
                continue;
            };
            if path.exists() {
                std::fs::write(&path, &value)
                    .with_context(|| format!("write {value:?} to {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// The files and values that express `limits` in this layout.
    pub fn limit_files(&self, limits: &Limits) -> Vec<(String, String)> {
        let mut files = self.quota_files(limits);
        if let Some(cpus) = &limits.cpus {
            files.push(("cpuset.cpus".into(), cpu_list(cpus)));
        }
        files
    }

    /// The CPUs the daemon's groups may use (the root cpuset's), ascending; empty when unknown.
    pub fn allowed_cpus(&self) -> Vec<u32> {
        let file = match self {
            CgroupLayout::V2 { root, .. } => root.join("cpuset.cpus.effective"),
            CgroupLayout::V1 { root, .. } => root.join("cpuset").join("cpuset.cpus"),
        };
        std::fs::read_to_string(file)
            .ok()
            .and_then(|t| parse_cpu_list(&t))
            .or_else(|| {
                std::fs::read_to_string("/sys/devices/system/cpu/online")
                    .ok()
                    .and_then(|t| parse_cpu_list(&t))
            })
            .unwrap_or_default()
    }

    fn quota_files(&self, limits: &Limits) -> Vec<(String, String)> {
        let quota = (limits.cpu * CPU_PERIOD_US as f64).round().max(1000.0) as u64;
        match self {
            CgroupLayout::V2 { .. } => vec![
                ("cpu.max".into(), format!("{quota} {CPU_PERIOD_US}")),
                ("memory.max".into(), limits.memory_bytes.to_string()),
                ("memory.swap.max".into(), "0".into()),
                ("pids.max".into(), limits.pids.to_string()),
            ],
            CgroupLayout::V1 { .. } => vec![
                ("cpu.cfs_period_us".into(), CPU_PERIOD_US.to_string()),
                ("cpu.cfs_quota_us".into(), quota.to_string()),
                (
                    "memory.limit_in_bytes".into(),
                    limits.memory_bytes.to_string(),
                ),
                // memsw = memory + swap; equal to the memory limit means no swap.
                (
                    "memory.memsw.limit_in_bytes".into(),
                    limits.memory_bytes.to_string(),
                ),
                ("pids.max".into(), limits.pids.to_string()),
            ],
        }
    }

    /// Path of a control file of group `name` (`memory.max`, `pids.max`, ...).
    pub fn file_in(&self, name: &str, file: &str) -> Option<PathBuf> {
        match self {
            CgroupLayout::V2 { root, parent } => Some(root.join(parent).join(name).join(file)),
            CgroupLayout::V1 { root, parent } => {
                let controller = file.split('.').next()?;
                Some(root.join(controller).join(parent).join(name).join(file))
            }
        }
    }

    /// The file whose `oom_kill N` line counts the group's OOM kills.
    pub fn oom_counter_file(&self, name: &str) -> Option<PathBuf> {
        match self {
            CgroupLayout::V2 { .. } => self.file_in(name, "memory.events"),
            CgroupLayout::V1 { .. } => self.file_in(name, "memory.oom_control"),
        }
    }

    /// The files `usage` reads, in this layout: (cpu, memory, peak, pids).
    fn usage_files(&self) -> [&'static str; 4] {
        match self {
            CgroupLayout::V2 { .. } => {
                ["cpu.stat", "memory.current", "memory.peak", "pids.current"]
            }
            CgroupLayout::V1 { .. } => [
                "cpuacct.usage",
                "memory.usage_in_bytes",
                "memory.max_usage_in_bytes",
                "pids.current",
            ],
        }
    }

    /// Current usage of group `name`, parsed from the texts of its files (`read` maps a file name to its
    /// content; a missing file reads as 0).
    pub fn parse_usage(&self, read: impl Fn(&str) -> Option<String>) -> Usage {
        let [cpu, mem, peak, pids] = self.usage_files();
        let num = |f: &str| {
            read(f)
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let cpu_usage_us = match self {
            CgroupLayout::V2 { .. } => read(cpu)
                .and_then(|s| keyed_value(&s, "usage_usec"))
                .unwrap_or(0),
            CgroupLayout::V1 { .. } => num(cpu) / 1000,
        };
        let oom_file = match self {
            CgroupLayout::V2 { .. } => "memory.events",
            CgroupLayout::V1 { .. } => "memory.oom_control",
        };
        let memory_bytes = num(mem);
        Usage {
            cpu_usage_us,
            memory_bytes,
            memory_peak_bytes: num(peak).max(memory_bytes),
            pids: num(pids),
            oom_kills: read(oom_file)
                .and_then(|s| keyed_value(&s, "oom_kill"))
                .unwrap_or(0),
        }
    }

    /// Current usage of group `name`.
    pub fn usage(&self, name: &str) -> Usage {
        self.parse_usage(|f| std::fs::read_to_string(self.file_in(name, f)?).ok())
    }

    /// Moves process `pid` (and so its future children) into the group.
    pub fn add_process(&self, name: &str, pid: u32) -> Result<()> {
        for dir in self.dirs(name) {
            let f = dir.join("cgroup.procs");
            std::fs::write(&f, pid.to_string())
                .with_context(|| format!("add pid {pid} to {}", f.display()))?;
        }
        Ok(())
    }

    /// Pids in the group (from the first hierarchy; every process is in all of them).
    pub fn pids(&self, name: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for dir in self.dirs(name) {
            if let Ok(s) = std::fs::read_to_string(dir.join("cgroup.procs")) {
                for l in s.lines() {
                    if let Ok(p) = l.trim().parse::<u32>() {
                        if !out.contains(&p) {
                            out.push(p);
                        }
                    }
                }
            }
        }
        out
    }

    /// SIGKILLs every process in the group and waits (up to `wait`) until it is empty.
    pub fn kill_all(&self, name: &str, wait: Duration) -> Result<()> {
        let deadline = Instant::now() + wait;
        if let CgroupLayout::V2 { .. } = self {
            if let Some(f) = self.file_in(name, "cgroup.kill") {
                let _ = std::fs::write(f, "1");
            }
        }
        loop {
            let pids = self.pids(name);
            if pids.is_empty() {
                return Ok(());
            }
            // A frozen group must be thawed for SIGKILL to be acted on.
            self.set_frozen(name, false).ok();
            for p in &pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*p as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if Instant::now() > deadline {
                bail!("cgroup {name} still has processes {pids:?} after SIGKILL");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Freezes or thaws the group (the freezer controller in v1, `cgroup.freeze` in v2).
    pub fn set_frozen(&self, name: &str, frozen: bool) -> Result<()> {
        let (file, value) = match self {
            CgroupLayout::V2 { .. } => ("cgroup.freeze", if frozen { "1" } else { "0" }),
            CgroupLayout::V1 { .. } => ("freezer.state", if frozen { "FROZEN" } else { "THAWED" }),
        };
        let Some(path) = self.file_in(name, file) else {
            bail!("no {file} for {name}");
        };
        if !path.exists() {
            return Ok(());
        }
        std::fs::write(&path, value)
            .with_context(|| format!("write {value} to {}", path.display()))?;
        if !frozen {
            return Ok(());
        }
        // Freezing is asynchronous: wait until every task has stopped.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.is_frozen(name) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("cgroup {name} did not freeze within 10 s");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Whether every task of the group is frozen.
    pub fn is_frozen(&self, name: &str) -> bool {
        match self {
            CgroupLayout::V2 { .. } => self
                .file_in(name, "cgroup.events")
                .and_then(|p| std::fs::read_to_string(p).ok())
                .is_some_and(|t| frozen_v2(&t)),
            CgroupLayout::V1 { .. } => self
                .file_in(name, "freezer.state")
                .and_then(|p| std::fs::read_to_string(p).ok())
                .is_some_and(|t| t.trim() == "FROZEN"),
        }
    }

    /// Removes the group's directories (it must be empty: call `kill_all` first). Missing is fine.
    pub fn remove(&self, name: &str) -> Result<()> {
        let mut last_err = None;
        for dir in self.dirs(name) {
            for attempt in 0..50 {
                match std::fs::remove_dir(&dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    // EBUSY while the kernel finishes releasing exited tasks.
                    Err(e) if attempt < 49 => {
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => last_err = Some(anyhow::anyhow!("rmdir {}: {e}", dir.display())),
                }
            }
        }
        match last_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Removes this daemon's parent group in every hierarchy when no sandbox group is left in it;
    /// true when they are all gone.
    pub fn remove_parent_if_empty(&self) -> bool {
        if !self.list().is_empty() {
            return false;
        }
        self.parents()
            .iter()
            .all(|p| std::fs::remove_dir(p).is_ok() || !p.exists())
    }

    /// Whether any directory of the group exists.
    pub fn exists(&self, name: &str) -> bool {
        self.dirs(name).iter().any(|d| d.exists())
    }
}

/// Whether a cgroup v2 `cgroup.events` says the group is frozen.
fn frozen_v2(events: &str) -> bool {
    events
        .lines()
        .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["frozen", "1"])
}

/// Moves the calling process into the cgroups whose `cgroup.procs` files are `procs` (from
/// [`CgroupLayout::procs_files`]). Only open, write and close, which are async-signal-safe: it is
/// meant for a `pre_exec` hook, between fork and exec.
pub fn join_from_pre_exec(procs: &[std::ffi::CString]) -> std::io::Result<()> {
    for p in procs {
        // SAFETY: `p` is a NUL-terminated path; open/write/close are async-signal-safe and the
        // descriptor is closed before returning.
        unsafe {
            let fd = libc::open(p.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let ok = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
            libc::close(fd);
            if !ok {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// Gives the v1 cpuset parent `dir` the CPUs and memory nodes of `base` (the hierarchy's root) and
/// has its new children inherit them (`cgroup.clone_children`): a v1 cpuset group without CPUs
/// takes no task.
fn prepare_v1_cpuset(base: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
    for f in ["cpuset.cpus", "cpuset.mems"] {
        let now = std::fs::read_to_string(dir.join(f)).unwrap_or_default();
        if now.trim().is_empty() {
            let from = std::fs::read_to_string(base.join(f))
                .with_context(|| format!("read {}", base.join(f).display()))?;
            std::fs::write(dir.join(f), from.trim())
                .with_context(|| format!("write {}", dir.join(f).display()))?;
        }
    }
    std::fs::write(dir.join("cgroup.clone_children"), "1")
        .with_context(|| format!("write {}/cgroup.clone_children", dir.display()))
}

/// `0-3,6` → [0, 1, 2, 3, 6]; None when it is not a CPU list.
pub fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
            None => out.push(part.parse().ok()?),
        }
    }
    (!out.is_empty()).then_some(out)
}

/// [0, 1, 3] → `0,1,3`.
pub fn cpu_list(cpus: &[u32]) -> String {
    cpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The CPUs a group `name` with a quota of `cpu` cores runs on: as many as the quota rounds up to
/// (at least one), consecutive from a place chosen by the name (so that groups spread over the
/// host), or all of `allowed` when the quota is as large. `nproc` inside then says what the quota
/// allows.
pub fn pick_cpus(name: &str, cpu: f64, allowed: &[u32]) -> Vec<u32> {
    let n = (cpu.ceil().max(1.0) as usize).min(allowed.len());
    if n == allowed.len() {
        return allowed.to_vec();
    }
    let start = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) as usize
        % allowed.len();
    let mut picked: Vec<u32> = (0..n)
        .map(|i| allowed[(start + i) % allowed.len()])
        .collect();
    picked.sort_unstable();
    picked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_frozen_flag() {
        assert!(frozen_v2("populated 1\nfrozen 1\n"));
        assert!(!frozen_v2("populated 1\nfrozen 0\n"));
        assert!(!frozen_v2(""));
    }

    fn limits() -> Limits {
        Limits {
            cpu: 0.5,
            memory_bytes: 256 << 20,
            pids: 1024,
            cpus: None,
        }
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-3,6\n"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("x"), None);
        assert_eq!(cpu_list(&[0, 1, 3]), "0,1,3");
    }

    #[test]
    fn a_quota_gets_as_many_cpus_as_it_rounds_up_to_spread_by_name() {
        let all: Vec<u32> = (0..8).collect();
        assert_eq!(pick_cpus("a", 0.5, &all).len(), 1);
        assert_eq!(pick_cpus("a", 2.5, &all).len(), 3);
        assert_eq!(pick_cpus("a", 8.0, &all), all);
        assert_eq!(pick_cpus("a", 64.0, &all), all);
        assert_eq!(pick_cpus("a", 3.0, &all), pick_cpus("a", 3.0, &all));
        let firsts: std::collections::HashSet<u32> = (0..64)
            .map(|i| pick_cpus(&format!("sbx_{i}"), 1.0, &all)[0])
            .collect();
        assert!(firsts.len() >= 6, "spread over the host: {firsts:?}");
        // Holes in the allowed set are kept out.
        assert!(pick_cpus("a", 2.0, &[1, 5, 9])
            .iter()
            .all(|c| [1, 5, 9].contains(c)));
        let l = CgroupLayout::V2 {
            root: "/x".into(),
            parent: PARENT.into(),
        };
        let files = l.limit_files(&Limits {
            cpus: Some(vec![2, 3]),
            ..limits()
        });
        assert!(files.contains(&("cpuset.cpus".into(), "2,3".into())));
    }

    #[test]
    fn v2_files() {
        let l = CgroupLayout::V2 {
            root: "/sys/fs/cgroup".into(),
            parent: PARENT.into(),
        };
        let files = l.limit_files(&limits());
        assert!(files.contains(&("cpu.max".into(), "50000 100000".into())));
        assert!(files.contains(&("memory.max".into(), "268435456".into())));
        assert!(files.contains(&("memory.swap.max".into(), "0".into())));
        assert!(files.contains(&("pids.max".into(), "1024".into())));
        assert_eq!(
            l.file_in("sbx", "memory.max").unwrap(),
            PathBuf::from("/sys/fs/cgroup/moat/sbx/memory.max")
        );
        assert_eq!(
            l.dirs("sbx"),
            vec![PathBuf::from("/sys/fs/cgroup/moat/sbx")]
        );
    }

    #[test]
    fn v1_files() {
        let l = CgroupLayout::V1 {
            root: "/sys/fs/cgroup".into(),
            parent: PARENT.into(),
        };
        let files = l.limit_files(&limits());
        assert!(files.contains(&("cpu.cfs_quota_us".into(), "50000".into())));
        assert!(files.contains(&("memory.memsw.limit_in_bytes".into(), "268435456".into())));
        assert_eq!(
            l.file_in("sbx", "memory.limit_in_bytes").unwrap(),
            PathBuf::from("/sys/fs/cgroup/memory/moat/sbx/memory.limit_in_bytes")
        );
        assert_eq!(
            l.file_in("sbx", "freezer.state").unwrap(),
            PathBuf::from("/sys/fs/cgroup/freezer/moat/sbx/freezer.state")
        );
    }

    #[test]
    fn v2_usage_files() {
        let l = CgroupLayout::V2 {
            root: "/sys/fs/cgroup".into(),
            parent: PARENT.into(),
        };
        let files: std::collections::HashMap<&str, &str> = [
            (
                "cpu.stat",
                "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\nnr_periods 10\n",
            ),
            ("memory.current", "104857600\n"),
            ("memory.peak", "209715200\n"),
            ("pids.current", "3\n"),
            (
                "memory.events",
                "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n",
            ),
        ]
        .into();
        let u = l.parse_usage(|f| files.get(f).map(|s| s.to_string()));
        assert_eq!(
            u,
            Usage {
                cpu_usage_us: 2_500_000,
                memory_bytes: 100 << 20,
                memory_peak_bytes: 200 << 20,
                pids: 3,
                oom_kills: 2,
            }
        );
        assert_eq!(
            l.oom_counter_file("sbx").unwrap(),
            PathBuf::from("/sys/fs/cgroup/moat/sbx/memory.events")
        );
        // An older kernel without memory.peak: the peak is at least the current use.
        let u = l.parse_usage(|f| (f == "memory.current").then(|| "42\n".to_string()));
        assert_eq!(
            (u.memory_bytes, u.memory_peak_bytes, u.oom_kills),
            (42, 42, 0)
        );
    }

    #[test]
    fn v1_usage_files() {
        let l = CgroupLayout::V1 {
            root: "/sys/fs/cgroup".into(),
            parent: PARENT.into(),
        };
        let files: std::collections::HashMap<&str, &str> = [
            ("cpuacct.usage", "2500000123\n"),
            ("memory.usage_in_bytes", "1000\n"),
            ("memory.max_usage_in_bytes", "2000\n"),
            ("pids.current", "7\n"),
            (
                "memory.oom_control",
                "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
            ),
        ]
        .into();
        let u = l.parse_usage(|f| files.get(f).map(|s| s.to_string()));
        assert_eq!(
            (
                u.cpu_usage_us,
                u.memory_bytes,
                u.memory_peak_bytes,
                u.pids,
                u.oom_kills
            ),
            (2_500_000, 1000, 2000, 7, 1)
        );
        assert_eq!(
            l.oom_counter_file("sbx").unwrap(),
            PathBuf::from("/sys/fs/cgroup/memory/moat/sbx/memory.oom_control")
        );
    }

    #[test]
    fn v2_pids_and_swap_limits() {
        let l = CgroupLayout::V2 {
            root: "/x".into(),
            parent: PARENT.into(),
        };
        let files = l.limit_files(&Limits {
            pids: 64,
            ..limits()
        });
        assert!(files.contains(&("pids.max".into(), "64".into())));
        assert!(files.contains(&("memory.swap.max".into(), "0".into())));
    }

    #[test]
    fn parent_per_data_dir() {
        assert_eq!(parent_for(Path::new("/var/lib/moat")), "moat");
        let a = parent_for(Path::new("/tmp/a"));
        assert!(a.starts_with("moat-") && a.len() == 13, "{a}");
        assert_ne!(a, parent_for(Path::new("/tmp/b")));
    }

    #[test]
    fn tiny_cpu_quota_is_floored() {
        let l = CgroupLayout::V2 {
            root: "/x".into(),
            parent: PARENT.into(),
        };
        let files = l.limit_files(&Limits {
            cpu: 0.0001,
            ..limits()
        });
        assert!(files.contains(&("cpu.max".into(), "1000 100000".into())));
    }
}
