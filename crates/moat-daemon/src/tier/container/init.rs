//! The sandbox init helper: a fresh, single-threaded `moat __sandbox-init CONFIG` process that the
//! container tier spawns for each sandbox. It enters new namespaces, waits while the daemon writes its
//! uid/gid maps and mounts the root filesystem, then forks the sandbox's PID 1, which builds /proc, /dev
//! and the agent mount, pivots into the root filesystem, hardens itself (masked /proc and /sys paths,
//! capability bounding set, no_new_privs, seccomp; see docs/hardening.md) and execs the agent.
//!
//! File descriptors: 3 = the agent's listening unix socket (kept across exec), 4 = the sync socket to the
//! daemon (close-on-exec, so the daemon sees EOF once the agent runs). Messages on the sync socket:
//! helper → daemon `U` (user namespace made), daemon → helper `G` (maps, mounts and cgroup done),
//! helper → daemon `PID <n>\n` (host pid of the sandbox's PID 1), child → daemon `ERR <message>\n`.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::unistd::{fork, ForkResult};
use serde::{Deserialize, Serialize};

use crate::host::{caps, seccomp};

/// argv[1] that selects the init helper.
pub const INIT_ARG: &str = "__sandbox-init";
/// Where the agent binary appears inside the sandbox (a read-only bind mount on the sandbox's own /dev
/// tmpfs, so no file is added to the root filesystem).
pub const AGENT_PATH_INSIDE: &str = "/dev/.moat/agent";
pub const LISTEN_FD: i32 = 3;
pub const SYNC_FD: i32 = 4;
/// The sandbox's directory on the host; the helper works from it, so `rootfs` and the agent are
/// reached by relative paths that never need search permission above the data dir.
pub const DIR_FD: i32 = 5;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitConfig {
    /// The overlay root, relative to the sandbox directory.
    pub rootfs: PathBuf,
    pub hostname: String,
    /// The agent binary, relative to the sandbox directory.
    pub agent: PathBuf,
    pub env: BTreeMap<String, String>,
    /// Host path of the sandbox's own OOM-kill counter (a cgroup file), shown read-only to the agent at
    /// `/run/moat/memory.events`. Bound inside the sandbox's mount namespace, so the host's mount table
    /// never lists a cgroup file mount (other container runtimes parse it).
    #[serde(default)]
    pub oom_counter: Option<PathBuf>,
    /// LXCFS's files (host path, path under the root) bound over the sandbox's /proc and /sys, so
    /// that its CPU and memory counts are its own. Host paths resolve in the init's copy of the
    /// host's mounts (a mount of another namespace cannot be bound), so LXCFS is mounted where the
    /// sandbox's uid may search every directory above it (host::lxcfs).
    #[serde(default)]
    pub lxcfs: Vec<(PathBuf, String)>,
    /// Drop capabilities, install seccomp and mask /proc and /sys. Only `moat serve --no-hardening`
    /// (for measuring what hardening costs) turns it off.
    #[serde(default = "yes")]
    pub harden: bool,
    /// Contents of the sandbox's /etc/resolv.conf (its DNS is its gateway), written after the pivot;
    /// None leaves the template's.
    #[serde(default)]
    pub resolv_conf: Option<String>,
}

fn yes() -> bool {
    true
}

/// Entry point of the helper. Returns the exit code.
pub fn main(config_json: &str) -> i32 {
    // SAFETY: the daemon passes the sync socket as fd 4 and nothing else in this fresh process owns it.
    let mut sync = unsafe { UnixStream::from_raw_fd(SYNC_FD) };
    // SAFETY: fcntl on an fd we own; close-on-exec keeps it out of the agent.
    unsafe { libc::fcntl(SYNC_FD, libc::F_SETFD, libc::FD_CLOEXEC) };
    let result = serde_json::from_str::<InitConfig>(config_json)
        .context("parse init config")
        .and_then(|cfg| run(&cfg, &mut sync));
    match result {
        Ok(()) => 0,
        Err(e) => {
            let _ = writeln!(sync, "ERR {}", format!("{e:#}").replace('\n', " "));
            1
        }
    }
}

fn run(cfg: &InitConfig, sync: &mut UnixStream) -> Result<()> {
    unshare(CloneFlags::CLONE_NEWUSER).context("unshare(CLONE_NEWUSER)")?;
    sync.write_all(b"U").context("sync write")?;
    let mut b = [0u8; 1];
    sync.read_exact(&mut b).context("sync read")?;
    if b[0] != b'G' {
        bail!("daemon aborted the start");
    }
    // Root of the new user namespace (mapped by the daemon to the sandbox's host uid range).
    nix::unistd::setresgid(0.into(), 0.into(), 0.into()).context("setresgid(0)")?;
    nix::unistd::setresuid(0.into(), 0.into(), 0.into()).context("setresuid(0)")?;
    // The working directory moves into the new mount namespace's copy of the tree with the unshare.
    nix::unistd::fchdir(DIR_FD).context("fchdir to the sandbox directory")?;
    nix::unistd::close(DIR_FD).context("close the sandbox directory")?;
    unshare(
        CloneFlags::CLONE_NEWNS
            | CloneFlags::CLONE_NEWUTS
            | CloneFlags::CLONE_NEWIPC
            | CloneFlags::CLONE_NEWNET
            | CloneFlags::CLONE_NEWCGROUP
            | CloneFlags::CLONE_NEWPID,
    )
    .context("unshare namespaces")?;
    // SAFETY: this process is single-threaded (a fresh exec that started no threads), so fork is sound.
    match unsafe { fork() }.context("fork")? {
        ForkResult::Parent { child } => {
            writeln!(sync, "PID {child}").context("sync write pid")?;
            Ok(())
        }
        ForkResult::Child => {
            let err = match sandbox_pid1(cfg) {
                Ok(never) => match never {},
                Err(e) => e,
            };
            let _ = writeln!(sync, "ERR {}", format!("{err:#}").replace('\n', " "));
            // SAFETY: _exit ends the forked child without running the parent's atexit handlers.
            unsafe { libc::_exit(1) }
        }
    }
}

/// Files under /proc and /sys that show host-wide state (kernel memory, keys, timers of every process,
/// hardware) or drive host hardware: covered by /dev/null (files) or an empty read-only tmpfs (dirs), as
/// runc does for Docker.
const MASKED_PATHS: &[&str] = &[
    "proc/acpi",
    "proc/asound",
    "proc/kcore",
    "proc/keys",
    "proc/latency_stats",
    "proc/timer_list",
    "proc/timer_stats",
    "proc/sched_debug",
    "proc/scsi",
    "sys/firmware",
    "sys/devices/virtual/powercap",
];
/// Made read-only (kernel tunables, IRQ affinity, the magic SysRq key), as runc does for Docker.
const READONLY_PATHS: &[&str] = &[
    "proc/bus",
    "proc/fs",
    "proc/irq",
    "proc/sys",
    "proc/sysrq-trigger",
];

/// Runs as PID 1 of the new pid namespace; only returns on error.
fn sandbox_pid1(cfg: &InitConfig) -> Result<std::convert::Infallible> {
    // Compiled first so a bad policy fails the start with a clear message.
    let filters = if cfg.harden {
        Some(seccomp::compile()?)
    } else {
        None
    };
    nix::unistd::sethostname(&cfg.hostname).context("sethostname")?;
    // Needs CAP_NET_ADMIN, which the agent no longer has.
    loopback_up().context("bring lo up")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("make / private")?;
    let root = &cfg.rootfs;
    mount(
        Some(root),
        root,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .context("bind rootfs")?;

    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let proc_dir = mkdir(root, "proc")?;
    mount(
        Some("proc"),
        &proc_dir,
        Some("proc"),
        nosuid_nodev_noexec,
        None::<&str>,
    )
    .context("mount /proc")?;
    // Without CAP_NET_RAW, ping needs ICMP datagram sockets: allow them for every group of the sandbox
    // (its own network namespace's setting). Best effort: a kernel without it only loses ping.
    let _ = std::fs::write(proc_dir.join("sys/net/ipv4/ping_group_range"), "0 65535");
    let sys_dir = mkdir(root, "sys")?;
    // sysfs needs a network namespace of our own (we have one); read-only either way.
    if mount(
        Some("sysfs"),
        &sys_dir,
        Some("sysfs"),
        nosuid_nodev_noexec | MsFlags::MS_RDONLY,
        None::<&str>,
    )
    .is_err()
    {
        mount(
            Some("tmpfs"),
            &sys_dir,
            Some("tmpfs"),
            nosuid_nodev_noexec | MsFlags::MS_RDONLY,
            Some("size=4k"),
        )
        .context("mount /sys")?;
    }
    if let Some(src) = &cfg.oom_counter {
        let target = crate::host::mount::mkdir_no_symlinks(root, "run/moat")?.join("memory.events");
        if !target.is_file() {
            std::fs::File::create(&target).context("create the OOM counter mount point")?;
        }
        bind(src, &target).context("bind the OOM counter")?;
        remount_readonly(&target, src)?;
    }
    for (src, rel) in &cfg.lxcfs {
        // Only files the sandbox's own /proc and /sys have (a name that is not there is skipped:
        // nothing is created under /proc or a read-only /sys).
        let target = root.join(rel);
        if target.is_file() {
            bind(src, &target).with_context(|| format!("bind lxcfs's {rel}"))?;
        }
    }
    if cfg.harden {
        mask_paths(root)?;
    }
    setup_dev(root, &cfg.agent)?;

    std::env::set_current_dir(root).context("chdir rootfs")?;
    nix::unistd::pivot_root(".", ".").context("pivot_root")?;
    // The old root is now stacked under the new one at "/"; detach it so no host path stays reachable.
    umount2(".", MntFlags::MNT_DETACH).context("detach old root")?;
    std::env::set_current_dir("/").context("chdir /")?;
    if let Some(text) = &cfg.resolv_conf {
        // After the pivot: whatever /etc holds (a symlink a snapshot planted, say) resolves inside
        // the sandbox. Best effort: a root filesystem without /etc keeps working.
        let _ = std::fs::remove_file("/etc/resolv.conf");
        let _ = std::fs::write("/etc/resolv.conf", text);
    }

    let mut env = cfg.env.clone();
    env.entry("PATH".into())
        .or_insert_with(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    env.entry("HOSTNAME".into())
        .or_insert_with(|| cfg.hostname.clone());
    let envp: Vec<CString> = env
        .iter()
        .filter_map(|(k, v)| CString::new(format!("{k}={v}")).ok())
        .collect();
    let prog = CString::new(AGENT_PATH_INSIDE).context("agent path")?;
    let argv = [
        CString::new("moat-agent").context("argv")?,
        CString::new("--listen-fd").context("argv")?,
        CString::new(LISTEN_FD.to_string()).context("argv")?,
    ];
    // Last: from here on this process is as confined as everything it will start.
    if let Some(filters) = &filters {
        caps::restrict()?;
        seccomp::install(filters)?;
    }
    let e = nix::unistd::execve(&prog, &argv, &envp).unwrap_err();
    bail!("exec agent: {e}")
}

/// Binds `src` over `target` (not recursively).
fn bind(src: &Path, target: &Path) -> nix::Result<()> {
    mount(
        Some(src),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
}

fn mkdir(root: &Path, rel: &str) -> Result<PathBuf> {
    let p = root.join(rel);
    std::fs::create_dir_all(&p).with_context(|| format!("mkdir {rel}"))?;
    Ok(p)
}

/// A minimal /dev: a tmpfs with the harmless host device nodes bind-mounted in (a user namespace may not
/// create device nodes), a private devpts instance, /dev/shm, and the agent binary read-only.
fn setup_dev(root: &Path, agent: &Path) -> Result<()> {
    let dev = mkdir(root, "dev")?;
    mount(
        Some("tmpfs"),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=755,size=65536k"),
    )
    .context("mount /dev")?;
    for node in ["null", "zero", "full", "random", "urandom", "tty"] {
        let target = dev.join(node);
        std::fs::File::create(&target).with_context(|| format!("create /dev/{node}"))?;
        mount(
            Some(&Path::new("/dev").join(node)),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .with_context(|| format!("bind /dev/{node}"))?;
    }
    let pts = dev.join("pts");
    std::fs::create_dir(&pts).context("mkdir /dev/pts")?;
    mount(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620,gid=5"),
    )
    .context("mount /dev/pts")?;
    std::os::unix::fs::symlink("pts/ptmx", dev.join("ptmx")).context("symlink /dev/ptmx")?;
    let shm = dev.join("shm");
    std::fs::create_dir(&shm).context("mkdir /dev/shm")?;
    mount(
        Some("tmpfs"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777,size=65536k"),
    )
    .context("mount /dev/shm")?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(target, dev.join(name))
            .with_context(|| format!("symlink /dev/{name}"))?;
    }
    let moat = dev.join(".moat");
    std::fs::create_dir(&moat).context("mkdir /dev/.moat")?;
    let agent_target = moat.join("agent");
    std::fs::File::create(&agent_target).context("create agent mount point")?;
    mount(
        Some(agent),
        &agent_target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .context("bind agent")?;
    remount_readonly(&agent_target, agent).context("remount agent read-only")?;
    Ok(())
}

/// Remounts the bind mount at `target` read-only, nosuid and nodev. A bind remount must keep the locked
/// flags of the mount it copies (`source`) or the kernel refuses it, so noexec and the atime mode are
/// carried over.
fn remount_readonly(target: &Path, source: &Path) -> Result<()> {
    use nix::sys::statvfs::FsFlags;
    let src_flags = nix::sys::statvfs::statvfs(source)
        .with_context(|| format!("statvfs {}", source.display()))?
        .flags();
    let mut flags = MsFlags::MS_REMOUNT
        | MsFlags::MS_BIND
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV;
    for (have, set) in [
        (FsFlags::ST_NOEXEC, MsFlags::MS_NOEXEC),
        (FsFlags::ST_NOATIME, MsFlags::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, MsFlags::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, MsFlags::MS_RELATIME),
    ] {
        if src_flags.contains(have) {
            flags |= set;
        }
    }
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
        .with_context(|| format!("remount {} read-only", target.display()))
}

/// Masks [`MASKED_PATHS`] and makes [`READONLY_PATHS`] read-only under the new root's /proc and /sys.
/// Paths this kernel does not have are skipped. The sandbox cannot undo any of it: umount and mount are
/// denied by seccomp and CAP_SYS_ADMIN is out of its bounding set.
fn mask_paths(root: &Path) -> Result<()> {
    let ro = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    for rel in MASKED_PATHS {
        let p = root.join(rel);
        let Ok(meta) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if meta.is_dir() {
            mount(
                Some("tmpfs"),
                &p,
                Some("tmpfs"),
                ro,
                Some("size=4k,mode=555"),
            )
            .with_context(|| format!("mask /{rel}"))?;
        } else {
            mount(
                Some("/dev/null"),
                &p,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .with_context(|| format!("mask /{rel}"))?;
        }
    }
    for rel in READONLY_PATHS {
        let p = root.join(rel);
        if std::fs::symlink_metadata(&p).is_err() {
            continue;
        }
        mount(
            Some(&p),
            &p,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .with_context(|| format!("bind /{rel}"))?;
        remount_readonly(&p, &p).with_context(|| format!("make /{rel} read-only"))?;
    }
    Ok(())
}

/// Sets IFF_UP on `lo` of the sandbox's network namespace (needs CAP_NET_ADMIN, so before the drop).
fn loopback_up() -> std::io::Result<()> {
    // SAFETY: socket() has no memory preconditions; the fd is owned (and closed) by `sock`.
    let raw = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh fd nothing else owns.
    let sock = unsafe { std::os::fd::OwnedFd::from_raw_fd(raw) };
    use std::os::fd::AsRawFd;
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: `ifr` is a valid ifreq naming "lo"; SIOCGIFFLAGS fills ifru_flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut ifr) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the kernel just wrote ifru_flags, the union member we read and update.
    unsafe { ifr.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
    // SAFETY: as above; SIOCSIFFLAGS reads ifr_name and ifru_flags.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &ifr) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
