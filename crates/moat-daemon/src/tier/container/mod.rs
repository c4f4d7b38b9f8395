//! The `container` tier: Linux namespaces (user with a per-sandbox host uid range, pid, mount, uts, ipc,
//! net, cgroup), a cgroup per sandbox, and an overlay of the read-only template (idmapped to the sandbox's
//! uid range) plus a per-sandbox writable layer as the root filesystem.
//!
//! Layout of a sandbox on the host, under `<data_dir>/sandboxes/<id>/`:
//! `lower` (idmapped read-only template mount), `upper` + `work` (the writable layer), `rootfs` (the
//! overlay), `agent.sock` (the agent's listening socket; only the daemon can reach this path). With a
//! disk quota (`disk_mb` > 0) the writable layer is `disk/upper` + `disk/work` on `disk`, an ext4 image
//! (`disk.img`) on a loop device (see `host::diskimage`). A /tmp quota (`tmp_mb` > 0) is a tmpfs mounted
//! at `rootfs/tmp` (before the sandbox's mount namespace is made, so it inherits it locked); the
//! sandbox's OOM counter file is bind-mounted read-only at `/run/moat/memory.events` by the sandbox's
//! init, inside its own mount namespace.

pub mod init;

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use moat_api::{Isolation, TierInfo};
use serde::{Deserialize, Serialize};

use super::{
    AgentStream, SandboxSpec, Tier, TierCapabilities, TierUsage, IDS_PER_SANDBOX, MAX_SLOTS,
};
use crate::host::cgroup::{self, CgroupLayout, Limits};
use crate::host::{mount, proc};

/// Where the sandbox's cgroup OOM counter appears inside it (read-only).
pub const OOM_COUNTER_INSIDE: &str = "/run/moat/memory.events";

/// A container sandbox's cgroup limits: its quota, memory and pids, and as many CPUs as its quota
/// rounds up to (so that `nproc` and the CPU count it reads say what it may use; docs/resources.md).
fn cgroup_limits(id: &str, l: &moat_api::SandboxLimits, allowed: &[u32]) -> Limits {
    Limits {
        cpu: l.cpu,
        memory_bytes: l.memory_mb << 20,
        pids: l.pids,
        cpus: (!allowed.is_empty()).then(|| cgroup::pick_cpus(id, l.cpu, allowed)),
    }
}

/// What the daemon stores to find a container sandbox again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContainerState {
    /// Host pid of the sandbox's PID 1 (the agent).
    pub agent_pid: u32,
    /// Its start time, so a recycled pid is never taken for it.
    pub agent_start_ticks: u64,
    /// Host uid (and gid) that root inside the sandbox maps to.
    pub host_uid: u32,
    /// Its slot (uid range and network address), when it has a network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_slot: Option<u32>,
}

pub struct ContainerTier {
    /// `<data_dir>/sandboxes`
    root: PathBuf,
    cgroups: CgroupLayout,
    /// Static agent binary to bind-mount (a root-owned copy in the data dir).
    agent: PathBuf,
    /// The `moat` binary, re-executed as the init helper.
    self_exe: PathBuf,
    uid_base: u32,
    /// Capability drop, seccomp and masked /proc paths (off only with `--no-hardening`).
    harden: bool,
    /// Sandbox networking (None: loopback only).
    net: Option<crate::host::net::Network>,
    /// LXCFS, whose /proc and /sys files are bound over each sandbox's (None: the host's view).
    lxcfs: Option<Arc<crate::host::lxcfs::Lxcfs>>,
}

impl ContainerTier {
    pub fn new(
        root: PathBuf,
        agent: PathBuf,
        uid_base: u32,
        cgroup_parent: &str,
        harden: bool,
        net: Option<crate::host::net::Network>,
    ) -> Result<ContainerTier> {
        std::fs::create_dir_all(&root).with_context(|| format!("mkdir {}", root.display()))?;
        // 0711: the sandbox init (host uid of its range, not root) must traverse it to reach its rootfs;
        // no one but root may list it.
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))?;
        if uid_base as u64 + MAX_SLOTS as u64 * IDS_PER_SANDBOX as u64 > u32::MAX as u64 {
            bail!("uid base {uid_base} leaves no room for {MAX_SLOTS} sandboxes of {IDS_PER_SANDBOX} ids");
        }
        let self_exe = std::fs::read_link("/proc/self/exe").context("find own executable")?;
        Ok(ContainerTier {
            root,
            cgroups: CgroupLayout::detect(cgroup_parent)?,
            agent,
            self_exe,
            uid_base,
            harden,
            net,
            lxcfs: None,
        })
    }

    /// Binds LXCFS's files over every new sandbox's /proc and /sys (docs/resources.md).
    pub fn with_lxcfs(mut self, lxcfs: Option<Arc<crate::host::lxcfs::Lxcfs>>) -> ContainerTier {
        self.lxcfs = lxcfs;
        self
    }

    /// LXCFS's files to bind into a new sandbox: none when there is no LXCFS, or when it does not
    /// answer (the sandbox then sees the host's counts; said in the log).
    fn lxcfs_binds(&self) -> Vec<(PathBuf, String)> {
        match &self.lxcfs {
            Some(l) if l.healthy() => l.binds(),
            Some(l) => {
                tracing::warn!(mount = %l.mountpoint().display(), "lxcfs does not answer: this sandbox sees the host's CPU and memory counts");
                Vec::new()
            }
            None => Vec::new(),
        }
    }

    pub fn cgroups(&self) -> &CgroupLayout {
        &self.cgroups
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    fn host_uid(&self, slot: u32) -> u32 {
        self.uid_base + slot * IDS_PER_SANDBOX
    }

    fn create_blocking(&self, spec: &SandboxSpec) -> Result<ContainerState> {
        if spec.slot >= MAX_SLOTS {
            bail!("uid slot {} out of range", spec.slot);
        }
        let dir = self.dir(&spec.id);
        let host_uid = self.host_uid(spec.slot);
        for sub in ["lower", "rootfs"] {
            std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("mkdir {sub}"))?;
        }
        if spec.restore.is_some() {
            bail!("the container tier cannot restore full-state snapshots");
        }
        let layer = super::layer::prepare(&dir, &spec.limits, spec.keep_files)?;
        // The overlay's root directory is the upper layer's: make it the sandbox root's.
        nix::unistd::chown(
            &layer.join("upper"),
            Some(host_uid.into()),
            Some(host_uid.into()),
        )
        .context("chown upper layer")?;
        std::fs::set_permissions(layer.join("upper"), std::fs::Permissions::from_mode(0o755))?;

        self.cgroups.create(
            &spec.id,
            &cgroup_limits(&spec.id, &spec.limits, &self.cgroups.allowed_cpus()),
        )?;

        let sock_path = dir.join("agent.sock");
        let _ = std::fs::remove_file(&sock_path);
        let listener = UnixListener::bind(&sock_path).context("bind agent socket")?;
        std::fs::set_permissions(&sock_path, std::fs::Permissions::from_mode(0o600))?;
        let (mut ours, theirs) = UnixStream::pair().context("socketpair")?;

        // Paths relative to the sandbox directory (the init helper's working directory, passed as an
        // open descriptor): the sandbox's root is not the host's root, and must not need search
        // permission on the data dir's ancestors (a data dir under /root, 0700, must work too).
        let agent_name = self
            .agent
            .file_name()
            .ok_or_else(|| anyhow!("agent path {} has no file name", self.agent.display()))?;
        if self.agent.parent() != self.root.parent().map(|d| d.join("bin")).as_deref() {
            bail!(
                "the agent {} is not in the data dir's bin/",
                self.agent.display()
            );
        }
        let config = init::InitConfig {
            rootfs: PathBuf::from("rootfs"),
            hostname: spec.hostname.clone(),
            agent: Path::new("../../bin").join(agent_name),
            env: spec.env.clone(),
            oom_counter: self.cgroups.oom_counter_file(&spec.id),
            lxcfs: self.lxcfs_binds(),
            harden: self.harden,
            resolv_conf: match (&self.net, &spec.network) {
                (Some(n), Some(_)) => Some(format!("nameserver {}\n", n.addresses(spec.slot).0)),
                _ => None,
            },
        };
        let dir_fd: OwnedFd = std::fs::File::open(&dir)
            .with_context(|| format!("open {}", dir.display()))?
            .into();
        // The agent's stderr (and the init helper's): a file in the sandbox's host directory, read
        // when the sandbox ends without a request (`last_words`). Only the agent writes it: it is
        // not dumpable and the sandbox has no CAP_SYS_PTRACE, so nothing inside can open its
        // /proc/1/fd/2, and every process it starts gets its own stdio.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(dir.join(AGENT_LOG))
            .with_context(|| format!("create {AGENT_LOG}"))?;
        let mut cmd = Command::new(&self.self_exe);
        cmd.arg(init::INIT_ARG)
            .arg(serde_json::to_string(&config)?)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        let lfd = listener.as_raw_fd();
        let sfd = theirs.as_raw_fd();
        let dfd = dir_fd.as_raw_fd();
        // SAFETY: only async-signal-safe calls (fcntl, dup2) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                // Move both out of the way first (close-on-exec, so the copies die at exec) so neither dup2
                // clobbers the other; dup2 clears close-on-exec on 3 and 4.
                let l = libc::fcntl(lfd, libc::F_DUPFD_CLOEXEC, 10);
                let s = libc::fcntl(sfd, libc::F_DUPFD_CLOEXEC, 10);
                let d = libc::fcntl(dfd, libc::F_DUPFD_CLOEXEC, 10);
                if l < 0
                    || s < 0
                    || d < 0
                    || libc::dup2(l, init::LISTEN_FD) < 0
                    || libc::dup2(s, init::SYNC_FD) < 0
                    || libc::dup2(d, init::DIR_FD) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().context("spawn sandbox init")?;
        drop(theirs);
        drop(dir_fd);
        drop(listener);
        let result = self.finish_start(spec, &dir, &layer, host_uid, child.id(), &mut ours);
        if result.is_err() {
            let _ = child.kill();
        }
        let _ = child.wait();
        result
    }

    fn finish_start(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        layer: &Path,
        host_uid: u32,
        helper: u32,
        sync: &mut UnixStream,
    ) -> Result<ContainerState> {
        sync.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut b = [0u8; 1];
        sync.read_exact(&mut b)
            .context("init helper did not start")?;
        if b[0] != b'U' {
            bail!("init helper: unexpected sync byte");
        }
        let map = format!("0 {host_uid} {IDS_PER_SANDBOX}\n");
        std::fs::write(format!("/proc/{helper}/uid_map"), &map).context("write uid_map")?;
        std::fs::write(format!("/proc/{helper}/gid_map"), &map).context("write gid_map")?;
        let userns: OwnedFd = std::fs::File::open(format!("/proc/{helper}/ns/user"))
            .context("open user namespace")?
            .into();
        mount::idmapped_bind(&spec.template_rootfs, &dir.join("lower"), &userns)?;
        // Snapshot layers over the template, each idmapped the same way; topmost first for overlayfs.
        let mut lowers = Vec::with_capacity(spec.layers.len() + 1);
        for (i, l) in spec.layers.iter().enumerate().rev() {
            let target = dir.join(format!("l{i}"));
            std::fs::create_dir_all(&target).with_context(|| format!("mkdir l{i}"))?;
            mount::idmapped_bind(l, &target, &userns)?;
            lowers.push(target);
        }
        lowers.push(dir.join("lower"));
        mount::overlay(
            &lowers,
            &layer.join("upper"),
            &layer.join("work"),
            &dir.join("rootfs"),
        )?;
        let rootfs = dir.join("rootfs");
        if spec.limits.tmp_mb > 0 {
            mount::tmpfs(
                &rootfs,
                "tmp",
                spec.limits.tmp_mb,
                // One inode per 4 KiB, like a disk.
                (spec.limits.tmp_mb * 256).max(1024),
                host_uid,
            )?;
        }
        self.cgroups.add_process(&spec.id, helper)?;
        sync.write_all(b"G").context("release init helper")?;

        let mut agent_pid = None;
        let mut errors = Vec::new();
        for line in BufReader::new(&*sync).lines() {
            let line = line.context("read from init helper")?;
            if let Some(p) = line.strip_prefix("PID ") {
                agent_pid = p.trim().parse::<u32>().ok();
            } else if let Some(e) = line.strip_prefix("ERR ") {
                errors.push(e.to_string());
            }
        }
        if !errors.is_empty() {
            bail!("sandbox init failed: {}", errors.join("; "));
        }
        let agent_pid = agent_pid.ok_or_else(|| anyhow!("sandbox init reported no pid"))?;
        let agent_start_ticks = proc::start_ticks(agent_pid)
            .ok_or_else(|| anyhow!("sandbox agent {agent_pid} exited at start"))?;
        let net_slot = match (&self.net, &spec.network) {
            (Some(net), Some(policy)) => {
                let t = std::time::Instant::now();
                net.attach(spec.slot, agent_pid, policy)?;
                tracing::debug!(sandbox = %spec.id, slot = spec.slot, took = ?t.elapsed(), "network attached");
                Some(spec.slot)
            }
            _ => None,
        };

        Ok(ContainerState {
            agent_pid,
            agent_start_ticks,
            host_uid,
            net_slot,
        })
    }

    /// Everything of the instance but its writable layer (`upper`, `work`, or the disk image holding
    /// them): see [`IsolationTier::release`].
    fn release_blocking(&self, id: &str, state: Option<ContainerState>) -> Result<()> {
        self.stop_instance(id, state)?;
        let dir = self.dir(id);
        mount::unmount_tree(&dir)?;
        super::layer::remove_all_but_layer(&dir)
    }

    /// Kills the instance's processes and removes its network and cgroup.
    fn stop_instance(&self, id: &str, state: Option<ContainerState>) -> Result<()> {
        if let Some(s) = &state {
            if proc::is_same_process(s.agent_pid, s.agent_start_ticks) {
                // Killing PID 1 of a pid namespace kills every process in it.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(s.agent_pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let killed = self.cgroups.kill_all(id, Duration::from_secs(10));
        if let Some(s) = &state {
            proc::reap(s.agent_pid);
        }
        killed?;
        if let (Some(net), Some(slot)) = (&self.net, state.as_ref().and_then(|s| s.net_slot)) {
            net.detach(slot)?;
        }
        self.cgroups.remove(id)
    }

    fn destroy_blocking(&self, id: &str, state: Option<ContainerState>) -> Result<()> {
        self.stop_instance(id, state)?;
        let dir = self.dir(id);
        mount::unmount_tree(&dir)?;
        mount::remove_unmounted_tree(&dir)
    }
}

/// The agent's stderr, in the sandbox's host directory.
const AGENT_LOG: &str = "agent.log";

#[async_trait::async_trait]
impl Tier for ContainerTier {
    type State = ContainerState;

    fn isolation(&self) -> Isolation {
        Isolation::Container
    }

    fn info(&self) -> TierInfo {
        TierInfo {
            isolation: Isolation::Container,
            available: true,
            note: Some(format!(
                "cgroup {}",
                if self.cgroups.is_v2() { "v2" } else { "v1" }
            )),
        }
    }

    fn capabilities(&self) -> TierCapabilities {
        TierCapabilities {
            oom_counter_inside: Some(OOM_COUNTER_INSIDE.to_string()),
            process_limit_inside: false,
            limits_fixed_at_start: false,
            checkpoint_ends_connections: true,
            min_memory_mb: 0,
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<ContainerState> {
        let this = self.clone_handle();
        let spec2 = spec.clone();
        super::start_or_clean(self, spec, move || this.create_blocking(&spec2)).await
    }

    fn last_words(&self, id: &str, _state: Option<&ContainerState>) -> Vec<String> {
        super::log_tail(&self.dir(id).join(AGENT_LOG), 10)
    }

    async fn connect(&self, id: &str, _state: &ContainerState) -> Result<AgentStream> {
        let path = self.dir(id).join("agent.sock");
        let s = tokio::net::UnixStream::connect(&path)
            .await
            .with_context(|| format!("connect {}", path.display()))?;
        Ok(Box::pin(s))
    }

    fn watched_process(&self, state: &ContainerState) -> Option<(u32, u64)> {
        Some((state.agent_pid, state.agent_start_ticks))
    }

    async fn is_alive(&self, _id: &str, state: &ContainerState) -> proc::Liveness {
        proc::liveness(state.agent_pid, state.agent_start_ticks)
    }

    async fn set_limits(
        &self,
        id: &str,
        _state: &ContainerState,
        limits: &moat_api::SandboxLimits,
    ) -> Result<()> {
        self.cgroups
            .create(id, &cgroup_limits(id, limits, &self.cgroups.allowed_cpus()))
    }

    async fn usage(&self, id: &str, _state: &ContainerState) -> Result<TierUsage> {
        let this = self.clone_handle();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            Ok(TierUsage::new(
                this.cgroups.usage(&id),
                super::layer::usage(&this.dir(&id))?,
            )
            .with_free(super::layer::room(&this.dir(&id))))
        })
        .await?
    }

    async fn cap_disk(
        &self,
        id: &str,
        _state: &ContainerState,
        room: Option<u64>,
    ) -> Result<Option<u64>> {
        super::layer::cap_room(&self.dir(id), room)
    }

    async fn pause(&self, id: &str, _state: &ContainerState) -> Result<()> {
        self.cgroups.set_frozen(id, true)
    }

    async fn resume(&self, id: &str, _state: &ContainerState) -> Result<()> {
        self.cgroups.set_frozen(id, false)
    }

    async fn export_changes(
        &self,
        id: &str,
        state: &ContainerState,
        dest: &Path,
    ) -> Result<Duration> {
        let state = state.clone();
        let this = self.clone_handle();
        let id = id.to_string();
        let dest = dest.to_path_buf();
        tokio::task::spawn_blocking(move || this.export_blocking(&id, &state, &dest)).await?
    }

    fn full_snapshot_unsupported(&self) -> Option<String> {
        criu_unsupported()
    }

    fn host_network(&self) -> Option<&crate::host::net::Network> {
        self.net.as_ref()
    }

    async fn restore_network(
        &self,
        live: &std::collections::BTreeMap<u32, moat_api::NetworkPolicy>,
    ) -> Result<()> {
        let Some(net) = self.net.clone() else {
            return Ok(());
        };
        let live = live.clone();
        tokio::task::spawn_blocking(move || {
            net.install(&live)?;
            let slots: HashSet<u32> = live.keys().copied().collect();
            for slot in net.stale_interfaces(&slots) {
                tracing::warn!(slot, "removing a leftover sandbox interface");
                net.detach(slot)?;
            }
            anyhow::Ok(())
        })
        .await?
    }

    async fn destroy(&self, id: &str, state: Option<&ContainerState>) -> Result<()> {
        let state = state.cloned();
        let this = self.clone_handle();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || this.destroy_blocking(&id, state)).await?
    }

    async fn release(&self, id: &str, state: Option<&ContainerState>) -> Result<()> {
        let state = state.cloned();
        let this = self.clone_handle();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || this.release_blocking(&id, state)).await?
    }

    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>> {
        let mut names: Vec<String> = self.cgroups.list();
        if let Ok(rd) = std::fs::read_dir(&self.root) {
            for e in rd.flatten() {
                if let Some(n) = e.file_name().to_str() {
                    if !names.iter().any(|x| x == n) {
                        names.push(n.to_string());
                    }
                }
            }
        }
        // A crash in the middle of a snapshot leaves the export view of a live sandbox mounted.
        for id in live {
            let view = self.dir(id).join("export");
            if view.exists() {
                mount::unmount_tree(&view)?;
                let _ = std::fs::remove_dir(&view);
            }
        }
        super::destroy_unowned(self, names, live).await
    }
}

/// Why the container tier cannot checkpoint process memory here (CRIU); checked once.
fn criu_unsupported() -> Option<String> {
    static ANSWER: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ANSWER
        .get_or_init(|| {
            match Command::new("criu")
                .arg("check")
                .stdin(Stdio::null())
                .output()
            {
                Err(_) => Some(
                    "full-state snapshots of the container tier need CRIU, which is not installed on this host; \
                     take a filesystem snapshot (kind \"filesystem\") instead"
                        .into(),
                ),
                Ok(o) if !o.status.success() => {
                    let why = String::from_utf8_lossy(&o.stderr)
                        .lines()
                        .chain(String::from_utf8_lossy(&o.stdout).lines())
                        .map(str::trim)
                        .find(|l| !l.is_empty())
                        .unwrap_or("no message")
                        .to_string();
                    Some(format!(
                        "full-state snapshots of the container tier are not supported on this host: `criu check` fails ({why}); \
                         take a filesystem snapshot (kind \"filesystem\") instead"
                    ))
                }
                // CRIU works, but moat does not drive it yet: say so rather than pretend.
                Ok(_) => Some(
                    "full-state snapshots of the container tier are not implemented yet (CRIU passes `criu check` here); \
                     take a filesystem snapshot (kind \"filesystem\") instead"
                        .into(),
                ),
            }
        })
        .clone()
}

impl ContainerTier {
    /// See [`IsolationTier::export_changes`]. The writable layer is read through an idmapped view that
    /// maps the sandbox's host ids back to 0..65535, so the copy is owned like a template and can be
    /// idmapped into any other sandbox's range; `cp` keeps modes (setuid included), hard links, sparse
    /// files, device nodes (whiteouts) and extended attributes (opaque directories, file capabilities).
    fn export_blocking(&self, id: &str, state: &ContainerState, dest: &Path) -> Result<Duration> {
        let dir = self.dir(id);
        let upper = super::layer::upper(&dir);
        let view = dir.join("export");
        std::fs::create_dir_all(&view).context("mkdir export")?;
        let userns = crate::host::userns::with_map(state.host_uid, 0, IDS_PER_SANDBOX)?;
        let was_frozen = self.cgroups.is_frozen(id);
        let started = std::time::Instant::now();
        if !was_frozen {
            self.cgroups.set_frozen(id, true)?;
        }
        let copied = (|| {
            mount::idmapped_bind(&upper, &view, &userns)?;
            super::layer::copy(&view, dest)
        })();
        let frozen_for = started.elapsed();
        let unmounted = mount::unmount_tree(&view);
        let thawed = if was_frozen {
            Ok(())
        } else {
            self.cgroups.set_frozen(id, false)
        };
        let _ = std::fs::remove_dir(&view);
        copied?;
        unmounted?;
        thawed?;
        Ok(frozen_for)
    }

    fn clone_handle(&self) -> ContainerTier {
        ContainerTier {
            root: self.root.clone(),
            cgroups: self.cgroups.clone(),
            agent: self.agent.clone(),
            self_exe: self.self_exe.clone(),
            uid_base: self.uid_base,
            harden: self.harden,
            net: self.net.clone(),
            lxcfs: self.lxcfs.clone(),
        }
    }
}
