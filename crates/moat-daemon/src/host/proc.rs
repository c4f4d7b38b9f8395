//! Facts about host processes read from /proc: identity (pid + start time, so a recycled pid is never
//! mistaken for a sandbox's agent), uid maps and liveness.

use anyhow::{Context, Result};

/// Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), None if it is gone.
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_start_ticks(&stat)
}

/// Field 22 of a /proc/PID/stat line (the command name in parentheses may hold spaces).
pub fn parse_start_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // After ')' come fields 3.. ; starttime is field 22, i.e. the 20th here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether a process still runs, as far as the host can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// It is gone: no such pid, a zombie, or another process under its pid.
    Gone,
    /// The host could not tell (out of file descriptors, say): not a reason to remove anything.
    Unknown,
}

impl Liveness {
    pub fn is_alive(self) -> bool {
        self == Liveness::Alive
    }
}

/// True when `pid` exists, is not a zombie, and started at `ticks`.
pub fn is_same_process(pid: u32, ticks: u64) -> bool {
    liveness(pid, ticks) == Liveness::Alive
}

/// Whether `pid`, started at `ticks`, still runs. Only the kernel's "no such process" is taken for
/// gone: an error of the daemon's own (EMFILE, ENOMEM, EINTR) is [`Liveness::Unknown`].
pub fn liveness(pid: u32, ticks: u64) -> Liveness {
    liveness_of(std::fs::read_to_string(format!("/proc/{pid}/stat")), ticks)
}

/// [`liveness`] from the read of a /proc/PID/stat.
fn liveness_of(read: std::io::Result<String>, ticks: u64) -> Liveness {
    let stat = match read {
        Ok(s) => s,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT) | Some(libc::ESRCH)) => {
            return Liveness::Gone
        }
        Err(_) => return Liveness::Unknown,
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .unwrap_or("");
    if state != "Z" && parse_start_ticks(&stat) == Some(ticks) {
        Liveness::Alive
    } else {
        Liveness::Gone
    }
}

/// Effective uid of `pid` on the host (from /proc/PID/status).
pub fn host_uid(pid: u32) -> Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .context("no Uid line")
}

/// A pidfd of `pid` (readable once it exits; Linux ≥ 5.3).
pub fn pidfd_open(pid: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; nothing of ours
    // is read or written.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just gave us this descriptor; nothing else owns it.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Reaps `pid` if it is our child (the daemon is the sandboxes' subreaper); otherwise its parent does.
pub fn reap(pid: u32) {
    let p = nix::unistd::Pid::from_raw(pid as i32);
    for _ in 0..100 {
        match nix::sys::wait::waitpid(p, Some(nix::sys::wait::WaitPidFlag::WNOHANG)) {
            Ok(nix::sys::wait::WaitStatus::StillAlive) => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            _ => return,
        }
    }
}

/// When the host booted, milliseconds since the epoch (`btime` of /proc/stat).
pub fn boot_time_ms() -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: i64 = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(secs * 1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_no_such_process_is_gone() {
        let line = "7 (a b) S 1 7 7 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 4242 0 0";
        assert_eq!(liveness_of(Ok(line.into()), 4242), Liveness::Alive);
        assert_eq!(liveness_of(Ok(line.into()), 4243), Liveness::Gone);
        let zombie = line.replace(") S ", ") Z ");
        assert_eq!(liveness_of(Ok(zombie), 4242), Liveness::Gone);
        let err = |n| Err(std::io::Error::from_raw_os_error(n));
        assert_eq!(liveness_of(err(libc::ENOENT), 1), Liveness::Gone);
        assert_eq!(liveness_of(err(libc::ESRCH), 1), Liveness::Gone);
        // The daemon's own trouble says nothing about the sandbox.
        assert_eq!(liveness_of(err(libc::EMFILE), 1), Liveness::Unknown);
        assert_eq!(liveness_of(err(libc::ENFILE), 1), Liveness::Unknown);
        assert_eq!(liveness_of(err(libc::ENOMEM), 1), Liveness::Unknown);
    }

    #[test]
    fn start_ticks_of_stat_line() {
        let line =
            "1234 (a b) c) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 98765 1000 200";
        assert_eq!(parse_start_ticks(line), Some(98765));
    }

    #[test]
    fn own_process_identity() {
        let me = std::process::id();
        let t = start_ticks(me).unwrap();
        assert!(is_same_process(me, t));
        assert!(!is_same_process(me, t + 1));
    }
}
