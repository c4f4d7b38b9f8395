//! Host memory accounting for the density scenario: what the kernel says is in use (`/proc/meminfo`),
//! the proportional set size of given processes (`smaps_rollup`) and the charge of a process's memory
//! cgroup — never a number the measured tool reports about itself.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// KiB in use on the host: `MemTotal - MemAvailable`.
pub fn used_kib() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let field = |key: &str| -> Option<u64> {
        text.lines()
            .find(|l| l.starts_with(key))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some(field("MemTotal:")?.saturating_sub(field("MemAvailable:")?))
}

/// `sync` and drop the page cache, dentries and inodes, so what stays in use is what the instances
/// hold; false when that was not allowed (not root).
pub fn drop_caches() -> bool {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Host memory in use, KiB, after dropping caches and letting things settle: the median of `n`
/// readings `gap` apart, as it is (`.0`) and less the proportional set size of every process that is
/// neither the bench's nor its descendants' nor matched by `needles` (`.1`: takes out most of what
/// unrelated work on the machine — a compiler, say — allocates or frees meanwhile).
pub fn settled_used_kib(
    settle: Duration,
    n: usize,
    gap: Duration,
    needles: &[String],
) -> Option<(u64, u64)> {
    drop_caches();
    std::thread::sleep(settle);
    let me = std::process::id();
    let (mut raw, mut adjusted) = (Vec::new(), Vec::new());
    for i in 0..n.max(1) {
        if i > 0 {
            std::thread::sleep(gap);
        }
        let ours = select(needles, &[me]);
        let others: u64 = scan()
            .iter()
            .filter(|p| !ours.contains(&p.pid))
            .map(|p| pss_kib(p.pid))
            .sum();
        let used = used_kib()?;
        raw.push(used);
        adjusted.push(used.saturating_sub(others));
    }
    raw.sort_unstable();
    adjusted.sort_unstable();
    Some((raw[raw.len() / 2], adjusted[adjusted.len() / 2]))
}

/// Proportional set size of `pid` in KiB (0 when it is gone).
pub fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Pss:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// One line of the process table.
struct Proc {
    pid: u32,
    ppid: u32,
    /// `cmdline` (NULs as spaces) and `cgroup`, where the instances' ids show up.
    text: String,
}

fn scan() -> Vec<Proc> {
    let mut out = Vec::new();
    for pid in crate::peers::pids() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // `pid (comm) state ppid ...`: comm may hold spaces, so split after its closing parenthesis.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0);
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let mut text: String = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        text.push('\n');
        text.push_str(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default());
        out.push(Proc { pid, ppid, text });
    }
    out
}

/// The processes whose command line or cgroup path contains one of `needles`, or that are one of
/// `roots`, and all their descendants.
pub fn select(needles: &[String], roots: &[u32]) -> Vec<u32> {
    let procs = scan();
    let mut chosen: Vec<u32> = procs
        .iter()
        .filter(|p| roots.contains(&p.pid) || needles.iter().any(|n| p.text.contains(n.as_str())))
        .map(|p| p.pid)
        .collect();
    let mut i = 0;
    while i < chosen.len() {
        let parent = chosen[i];
        for p in &procs {
            if p.ppid == parent && !chosen.contains(&p.pid) {
                chosen.push(p.pid);
            }
        }
        i += 1;
    }
    chosen
}

/// Sum of the proportional set sizes of `pids`, KiB.
pub fn pss_sum_kib(pids: &[u32]) -> u64 {
    pids.iter().map(|p| pss_kib(*p)).sum()
}

/// The memory cgroup directory of `pid`, unless it is the bench's own (then it is not the
/// instance's).
fn memory_cgroup(pid: u32) -> Option<PathBuf> {
    let find = |text: &str| -> Option<(bool, String)> {
        let mut v2 = None;
        for line in text.lines() {
            let mut f = line.splitn(3, ':');
            let (Some(_), Some(ctrls), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            if ctrls.split(',').any(|c| c == "memory") {
                return Some((true, path.to_string()));
            }
            if ctrls.is_empty() {
                v2 = Some((false, path.to_string()));
            }
        }
        v2
    };
    let theirs = find(&std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?)?;
    let ours = find(&std::fs::read_to_string("/proc/self/cgroup").ok()?);
    if Some(&theirs) == ours.as_ref() || theirs.1 == "/" {
        return None;
    }
    let rel = theirs.1.trim_start_matches('/');
    if theirs.0 {
        Some(Path::new("/sys/fs/cgroup/memory").join(rel))
    } else if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        Some(Path::new("/sys/fs/cgroup").join(rel))
    } else {
        Some(Path::new("/sys/fs/cgroup/unified").join(rel))
    }
}

/// What `pid`'s own memory cgroup is charged, bytes: `memory.usage_in_bytes` (v1) or
/// `memory.current` (v2); `None` when it has no cgroup of its own.
pub fn cgroup_bytes(pid: u32) -> Option<u64> {
    let dir = memory_cgroup(pid)?;
    ["memory.usage_in_bytes", "memory.current"]
        .iter()
        .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .and_then(|t| t.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_own_process() {
        assert!(used_kib().is_some_and(|k| k > 0));
        let me = std::process::id();
        assert!(pss_kib(me) > 0);
        let chosen = select(&[], &[me]);
        assert_eq!(chosen.first(), Some(&me));
        // The bench's own cgroup is not an instance's.
        assert_eq!(cgroup_bytes(me), None);
    }
}
