//! LXCFS: a FUSE filesystem (Debian's `lxcfs`) whose /proc files (cpuinfo, meminfo, stat, loadavg,
//! uptime, diskstats, swaps) and /sys/devices/system/cpu/online answer each reader with its own
//! cgroup's limits and usage instead of the host's. The container tier binds them over a sandbox's
//! own /proc and /sys, so that `free`, `nproc`, `os.cpu_count()` and `psutil` report the sandbox.
//!
//! One LXCFS per data directory, mounted at `/run/moat-lxcfs/<cgroup parent>`, its pid file and log
//! in the data directory, started in a session of its own:
//! sandboxes outlive a daemon restart, and their binds need the same LXCFS. A daemon adopts the
//! one it finds alive (its pid file and a read through the mount), else removes what is left of an
//! old one (a lazy unmount) and starts a new one. The daemon's supervisor restarts it if it ends
//! (sandboxes started meanwhile got no binds; those bound to the dead one read ENOTCONN until they
//! are recreated: docs/resources.md says so). `stop` ends it and unmounts.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The files bound over a sandbox's own, relative to the mount (and to the sandbox's root).
pub const FILES: &[&str] = &[
    "proc/cpuinfo",
    "proc/meminfo",
    "proc/stat",
    "proc/loadavg",
    "proc/uptime",
    "proc/diskstats",
    "proc/swaps",
    "sys/devices/system/cpu/online",
];

/// Where LXCFS mounts are made.
pub const RUN_DIR: &str = "/run/moat-lxcfs";

/// An LXCFS this daemon started or adopted.
#[derive(Debug, Clone)]
pub struct Lxcfs {
    binary: PathBuf,
    mountpoint: PathBuf,
    pidfile: PathBuf,
    log: PathBuf,
}

impl Lxcfs {
    /// LXCFS at `/run/moat-lxcfs/<name>` (`name`: the daemon's cgroup parent, one per data
    /// directory), adopted when one serves there, else started. Not in the data directory: a
    /// sandbox's init resolves the path as the sandbox's uid, which must be able to search every
    /// directory above the mount (/run is world-searchable; a data directory's parent may not be).
    pub fn start(binary: &Path, data_dir: &Path, name: &str) -> Result<Lxcfs> {
        let l = Lxcfs {
            binary: binary.to_path_buf(),
            mountpoint: Path::new(RUN_DIR).join(name),
            pidfile: data_dir.join("lxcfs.pid"),
            log: data_dir.join("lxcfs.log"),
        };
        if l.healthy() && l.pid().is_some() {
            tracing::info!(mount = %l.mountpoint.display(), "lxcfs: adopted the one running");
            return Ok(l);
        }
        l.launch()?;
        Ok(l)
    }

    /// Where it is mounted.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Whether a read through the mount answers.
    pub fn healthy(&self) -> bool {
        std::fs::read(self.mountpoint.join("proc/meminfo")).is_ok_and(|b| !b.is_empty())
    }

    /// The pid of the LXCFS serving the mount, from its pid file, if it runs.
    pub fn pid(&self) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(&self.pidfile)
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        (comm.trim() == "lxcfs").then_some(pid)
    }

    /// The (source, target) pairs to bind into a sandbox: what the mount serves of [`FILES`].
    pub fn binds(&self) -> Vec<(PathBuf, String)> {
        FILES
            .iter()
            .map(|f| (self.mountpoint.join(f), f.to_string()))
            .filter(|(src, _)| src.exists())
            .collect()
    }

    /// Starts LXCFS (after removing what an old one left) and waits until its mount answers.
    pub fn launch(&self) -> Result<()> {
        if let Some(pid) = self.pid() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = nix::mount::umount2(&self.mountpoint, nix::mount::MntFlags::MNT_DETACH);
        std::fs::create_dir_all(&self.mountpoint)
            .with_context(|| format!("mkdir {}", self.mountpoint.display()))?;
        for dir in [Path::new(RUN_DIR), &self.mountpoint] {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("chmod {}", dir.display()))?;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&self.log)
            .with_context(|| format!("create {}", self.log.display()))?;
        let mut cmd = Command::new(&self.binary);
        // -f: in the foreground of its own session (it outlives the daemon, never its terminal);
        // --enable-cfs: CPU counts from the CFS quota and cpuset; -l: per-cgroup load averages;
        // -u: no swap shown (sandboxes have none).
        cmd.arg("-f")
            .arg("--enable-cfs")
            .arg("-l")
            .arg("-u")
            .arg("-p")
            .arg(&self.pidfile)
            .arg(&self.mountpoint)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // SAFETY: setsid is async-signal-safe and touches only the child.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start {}", self.binary.display()))?;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !self.healthy() {
            if let Ok(Some(status)) = child.try_wait() {
                bail!(
                    "lxcfs exited ({status}): {}",
                    std::fs::read_to_string(&self.log)
                        .unwrap_or_default()
                        .lines()
                        .last()
                        .unwrap_or("")
                );
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "lxcfs did not answer at {} in 10 s",
                    self.mountpoint.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // Reaped when it ends: a thread waits on it (an adopted one is another's child).
        std::thread::Builder::new()
            .name("lxcfs-wait".into())
            .spawn(move || {
                let status = child.wait();
                tracing::warn!("lxcfs ended: {status:?}");
            })
            .context("spawn the lxcfs waiter")?;
        tracing::info!(mount = %self.mountpoint.display(), "lxcfs started");
        Ok(())
    }

    /// Ends LXCFS and unmounts it (no sandbox may be bound to it any more).
    pub fn stop(&self) {
        if let Some(pid) = self.pid() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        let _ = nix::mount::umount2(&self.mountpoint, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(&self.mountpoint);
        let _ = std::fs::remove_file(&self.pidfile);
    }
}

/// Ends the LXCFS processes of data directories that are gone (a daemon's directory removed
/// while its LXCFS ran: nothing can use that one any more) and removes their mounts. Returns their
/// mount points.
pub fn sweep_orphans() -> Vec<PathBuf> {
    let mut swept = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return swept;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let (Some(pidfile), Some(mountpoint)) = (
            args.iter()
                .position(|a| a == "-p")
                .and_then(|i| args.get(i + 1)),
            args.iter().rev().find(|a| !a.is_empty()),
        ) else {
            continue;
        };
        let ours = Path::new(&args[0])
            .file_name()
            .is_some_and(|n| n == "lxcfs")
            && Path::new(mountpoint).starts_with(RUN_DIR);
        let data_dir = Path::new(pidfile).parent();
        if !ours || data_dir.is_none_or(Path::exists) {
            continue;
        }
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = nix::mount::umount2(Path::new(mountpoint), nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(mountpoint);
        swept.push(PathBuf::from(mountpoint));
    }
    swept
}

/// The `lxcfs` binary on PATH, if installed.
pub fn find() -> Option<PathBuf> {
    ["/usr/bin/lxcfs", "/usr/local/bin/lxcfs", "/bin/lxcfs"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}
