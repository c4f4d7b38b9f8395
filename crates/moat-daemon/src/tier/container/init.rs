//! The sandbox init helper: a fresh, single-threaded `moat __sandbox-init CONFIG` process that the
//! container tier spawns for each sandbox. It enters new namespaces, waits while the daemon writes its
//! uid/gid maps and mounts the root filesystem, then forks the sandbox's PID 1, which builds /proc, /dev
//! and the agent mount, pivots into the root filesystem and execs the agent.
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

/// argv[1] that selects the init helper.
pub const INIT_ARG: &str = "__sandbox-init";
/// Where the agent binary appears inside the sandbox (a read-only bind mount on the sandbox's own /dev
/// tmpfs, so no file is added to the root filesystem).
pub const AGENT_PATH_INSIDE: &str = "/dev/.moat/agent";
pub const LISTEN_FD: i32 = 3;
pub const SYNC_FD: i32 = 4;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitConfig {
    pub rootfs: PathBuf,
    pub hostname: String,
    pub agent: PathBuf,
    pub env: BTreeMap<String, String>,
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

/// Runs as PID 1 of the new pid namespace; only returns on error.
fn sandbox_pid1(cfg: &InitConfig) -> Result<std::convert::Infallible> {
    nix::unistd::sethostname(&cfg.hostname).context("sethostname")?;
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
    setup_dev(root, &cfg.agent)?;

    std::env::set_current_dir(root).context("chdir rootfs")?;
    nix::unistd::pivot_root(".", ".").context("pivot_root")?;
    // The old root is now stacked under the new one at "/"; detach it so no host path stays reachable.
    umount2(".", MntFlags::MNT_DETACH).context("detach old root")?;
    std::env::set_current_dir("/").context("chdir /")?;

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
    let e = nix::unistd::execve(&prog, &argv, &envp).unwrap_err();
    bail!("exec agent: {e}")
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
    // A bind remount must keep the locked flags of the source mount, or the kernel refuses it.
    let src_flags = nix::sys::statvfs::statvfs(agent)
        .context("statvfs agent")?
        .flags();
    let mut flags = MsFlags::MS_REMOUNT
        | MsFlags::MS_BIND
        | MsFlags::MS_RDONLY
        | MsFlags::MS_NOSUID
        | MsFlags::MS_NODEV;
    if src_flags.contains(nix::sys::statvfs::FsFlags::ST_NOEXEC) {
        flags |= MsFlags::MS_NOEXEC;
    }
    if src_flags.contains(nix::sys::statvfs::FsFlags::ST_NOATIME) {
        flags |= MsFlags::MS_NOATIME;
    }
    if src_flags.contains(nix::sys::statvfs::FsFlags::ST_RELATIME) {
        flags |= MsFlags::MS_RELATIME;
    }
    mount(
        None::<&str>,
        &agent_target,
        None::<&str>,
        flags,
        None::<&str>,
    )
    .context("remount agent read-only")?;
    Ok(())
}
