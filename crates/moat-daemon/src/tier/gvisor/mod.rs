//! The `gvisor` tier: the sandbox runs on gVisor's user-space kernel (`runsc`, the Sentry), which
//! serves every system call of the sandbox's processes itself; the host kernel only sees the Sentry's
//! own, seccomp-filtered calls and the gofer's file operations.
//!
//! Layout of a sandbox on the host, under `<data_dir>/gvisor/<id>/`: `config.json` (the OCI runtime
//! spec, generated with `oci-spec`), `rootfs` (a host overlay of the template and snapshot layers under
//! the writable `upper` + `work`, or `disk/upper` + `disk/work` on an ext4 image with a disk quota),
//! `sock/` (where the agent, inside, binds its listening socket: `runsc --host-uds=create` makes it a
//! host socket the daemon connects to), `netns` (the sandbox's network namespace, held by a bind
//! mount, with its veth; gVisor's network stack serves the interface), `console.log` (runsc's and the
//! agent's stderr). runsc's own state lives under `<data_dir>/runsc`.
//!
//! Files inside the sandbox keep their ids on the host (gVisor has no uid remap; the gofer creates
//! them as the ids the sandbox uses), so the writable layer is owned like a template already. Limits
//! are the host cgroup around the Sentry and gofer (memory, CPU, host threads); pause and resume are
//! `runsc pause` / `runsc resume`.

use std::collections::{BTreeMap, HashSet};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use moat_api::{Isolation, TierInfo};
use oci_spec::runtime as oci;
use serde::{Deserialize, Serialize};

use super::{AgentStream, SandboxSpec, Tier, TierCapabilities, TierError, TierUsage};
use crate::host::cgroup::{CgroupLayout, Limits};
use crate::host::{caps, mount, proc};

/// Where the agent binary appears inside the sandbox (read-only).
pub const AGENT_PATH_INSIDE: &str = "/dev/.moat/agent";
/// The directory, inside, where the agent binds its socket (a host directory).
const SOCK_DIR_INSIDE: &str = "/dev/.moat/sock";
const SOCK_NAME: &str = "agent.sock";
use moat_api::checkpoint::{
    QUIESCED as AGENT_QUIESCED, REFUSED as AGENT_REFUSED, REQUEST as AGENT_CHECKPOINT_REQUEST,
};
/// In a sandbox's directory while it is being checkpointed: connecting waits for the agent.
const CHECKPOINTING: &str = "checkpointing";

/// What the daemon stores to find a gvisor sandbox again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GvisorState {
    /// Host pid of the sandbox's Sentry (`runsc-sandbox`).
    pub sandbox_pid: u32,
    /// Its start time, so a recycled pid is never taken for it.
    pub sandbox_start_ticks: u64,
    /// Its slot (network address), when it has a network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net_slot: Option<u32>,
    /// Host processes runsc left running for it (Sentry, gofer): the daemon's children once
    /// `runsc create` exits, reaped when the sandbox goes.
    #[serde(default)]
    pub host_pids: Vec<u32>,
}

/// runsc found at start-up.
#[derive(Debug, Clone)]
struct Runsc {
    path: PathBuf,
    version: String,
}

#[derive(Clone)]
pub struct GvisorTier {
    /// `<data_dir>/gvisor`
    root: PathBuf,
    cgroups: CgroupLayout,
    /// Static agent binary (the root-owned copy in the data dir).
    agent: PathBuf,
    net: Option<crate::host::net::Network>,
    /// None: runsc is not installed (the tier answers so).
    runsc: Option<Runsc>,
}

/// A gVisor sandbox's cgroup limits.
fn cgroup_limits(l: &moat_api::SandboxLimits) -> Limits {
    Limits {
        cpu: l.cpu,
        memory_bytes: l.memory_mb << 20,
        // Host threads of the Sentry, its stubs and the gofer (the sandbox's own processes are not
        // host processes; the Sentry holds them to `pids` itself, RLIMIT_NPROC): the limit bounds
        // what the sandbox costs the host, with room for what its `pids` processes need.
        pids: l
            .pids
            .saturating_mul(HOST_THREADS_PER_PROCESS)
            .saturating_add(SENTRY_THREADS),
        // No pinning: under the ptrace platform the Sentry and its stubs ping-pong, and on one
        // CPU a thread bomb ran 4 times slower (measured).
        cpus: None,
    }
}

/// Host threads the Sentry and gofer need for themselves.
const SENTRY_THREADS: u64 = 256;
/// Host threads per sandbox process: with the ptrace platform each address space is a stub process
/// whose threads the Sentry traces (about 12 per process measured here: 40 `sleep`s took 473).
const HOST_THREADS_PER_PROCESS: u64 = 16;

/// Looks for runsc on PATH (and in /usr/sbin, /usr/bin) and asks its version.
fn find_runsc() -> Option<Runsc> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    dirs.extend(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from));
    let path = dirs
        .into_iter()
        .map(|d| d.join("runsc"))
        .find(|p| p.is_file())?;
    let out = Command::new(&path)
        .arg("--version")
        .stdin(Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text
        .lines()
        .next()
        .unwrap_or("")
        .trim_start_matches("runsc version ")
        .trim()
        .to_string();
    out.status.success().then_some(Runsc { path, version })
}

impl GvisorTier {
    pub fn new(
        root: PathBuf,
        agent: PathBuf,
        cgroups: CgroupLayout,
        net: Option<crate::host::net::Network>,
    ) -> Result<GvisorTier> {
        std::fs::create_dir_all(&root).with_context(|| format!("mkdir {}", root.display()))?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))?;
        let runsc = find_runsc();
        match &runsc {
            Some(r) => {
                tracing::info!(runsc = %r.path.display(), version = %r.version, "gvisor tier available")
            }
            None => tracing::warn!(
                "runsc not found: the gvisor tier is unavailable (apt-get install runsc)"
            ),
        }
        Ok(GvisorTier {
            root,
            cgroups,
            agent,
            net,
            runsc,
        })
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    /// runsc's own state (`--root`), next to the sandboxes' directories: `<data_dir>/runsc`.
    fn state_root(&self) -> PathBuf {
        self.root.with_file_name("runsc")
    }

    fn runsc(&self) -> Result<&Runsc> {
        self.runsc
            .as_ref()
            .ok_or_else(|| anyhow!("the gvisor tier needs runsc, which is not installed on this host (apt-get install runsc)"))
    }

    /// A runsc command with the flags every call for this sandbox uses.
    fn command(&self, networked: bool) -> Result<Command> {
        let mut cmd = Command::new(&self.runsc()?.path);
        cmd.arg(format!("--root={}", self.state_root().display()))
            // The agent binds its socket in a host directory; nothing may connect out to host sockets.
            .arg("--host-uds=create")
            .arg("--file-access=shared")
            .arg(if networked {
                "--network=sandbox"
            } else {
                "--network=none"
            })
            // The daemon puts runsc into the sandbox's cgroup itself (v1 and v2 alike). (Letting runsc
            // manage it would size the Sentry from the cgroup, `free` inside then honest, but broke
            // the fork bomb, chaos and full-disk trials under load: docs/resources.md.)
            .arg("--ignore-cgroups")
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .stdin(Stdio::null());
        Ok(cmd)
    }

    /// Runs a runsc subcommand to completion; its stderr becomes the error.
    fn runsc_run(&self, networked: bool, args: &[&str]) -> Result<()> {
        let out = self
            .command(networked)?
            .args(args)
            .output()
            .with_context(|| format!("run runsc {}", args[0]))?;
        if !out.status.success() {
            bail!(
                "runsc {}: {}",
                args[0],
                last_line(&String::from_utf8_lossy(&out.stderr))
            );
        }
        Ok(())
    }

    fn create_blocking(&self, spec: &SandboxSpec) -> Result<GvisorState> {
        self.runsc()?;
        let dir = self.dir(&spec.id);
        std::fs::create_dir_all(dir.join("rootfs")).context("mkdir rootfs")?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let layer = super::layer::prepare(&dir, &spec.limits, spec.keep_files)?;
        std::fs::set_permissions(layer.join("upper"), std::fs::Permissions::from_mode(0o755))?;
        let mut lowers: Vec<PathBuf> = spec.layers.iter().rev().cloned().collect();
        lowers.push(spec.template_rootfs.clone());
        let rootfs = dir.join("rootfs");
        mount::overlay(&lowers, &layer.join("upper"), &layer.join("work"), &rootfs)?;
        // /tmp is served from the root filesystem (runsc would otherwise put a tmpfs in the Sentry's
        // memory there), or from a host tmpfs of its own size with a /tmp quota.
        mount::mkdir_no_symlinks(&rootfs, "tmp")?;
        std::fs::set_permissions(rootfs.join("tmp"), std::fs::Permissions::from_mode(0o1777))?;
        if spec.limits.tmp_mb > 0 {
            mount::tmpfs(
                &rootfs,
                "tmp",
                spec.limits.tmp_mb,
                (spec.limits.tmp_mb * 256).max(1024),
                0,
            )?;
        }
        let networked = matches!((&self.net, &spec.network), (Some(_), Some(_)));
        if let (Some(net), true) = (&self.net, networked) {
            let etc = mount::mkdir_no_symlinks(&rootfs, "etc")?;
            let resolv = etc.join("resolv.conf");
            // A symlink left by the template or an earlier instance is replaced, never followed.
            let _ = std::fs::remove_file(&resolv);
            std::fs::write(
                &resolv,
                format!("nameserver {}\n", net.addresses(spec.slot).0),
            )
            .context("write /etc/resolv.conf")?;
        }

        let sock = dir.join("sock");
        let _ = std::fs::remove_dir_all(&sock);
        std::fs::create_dir(&sock).context("mkdir sock")?;
        // Root of the sandbox only: the agent's socket runs commands as any user.
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o700))?;
        let netns = dir.join("netns");
        let net_slot = match (&self.net, &spec.network) {
            (Some(net), Some(policy)) => {
                make_netns(&netns)?;
                net.attach_netns(spec.slot, &netns, policy)?;
                Some(spec.slot)
            }
            _ => None,
        };
        let config = self.oci_spec(spec, &dir, net_slot.map(|_| netns.as_path()))?;
        config
            .save(dir.join("config.json"))
            .context("write config.json")?;

        self.cgroups
            .create(&spec.id, &cgroup_limits(&spec.limits))?;
        let state = match &spec.restore {
            Some(image) => {
                check_image(image, &self.agent)?;
                self.restore_instance(&spec.id, image, net_slot, Some(&spec.hostname))?
            }
            None => {
                let console =
                    std::fs::File::create(dir.join("console.log")).context("create console.log")?;
                let mut cmd = self.command(net_slot.is_some())?;
                cmd.arg("create")
                    .arg(format!("--bundle={}", dir.display()))
                    .arg(format!("--pid-file={}", dir.join("pid").display()))
                    .arg(&spec.id)
                    .stdout(console.try_clone()?)
                    .stderr(console);
                self.in_sandbox_cgroup(&mut cmd, &spec.id, false)?;
                let status = cmd.status().context("run runsc create")?;
                if !status.success() {
                    bail!("runsc create: {}", self.console_tail(&spec.id));
                }
                self.start(&spec.id, net_slot.is_some())?;
                self.instance_state(&spec.id, net_slot)?
            }
        };
        Ok(state)
    }

    /// The state of the sandbox runsc just started (its pid file, the host processes of its cgroup).
    fn instance_state(&self, id: &str, net_slot: Option<u32>) -> Result<GvisorState> {
        let pid: u32 = std::fs::read_to_string(self.dir(id).join("pid"))
            .context("read runsc's pid file")?
            .trim()
            .parse()
            .context("parse runsc's pid file")?;
        let sandbox_start_ticks = proc::start_ticks(pid).ok_or_else(|| {
            anyhow!(
                "the gVisor sandbox exited at start: {}",
                self.console_tail(id)
            )
        })?;
        Ok(GvisorState {
            sandbox_pid: pid,
            sandbox_start_ticks,
            net_slot,
            host_pids: self.cgroups.pids(id),
        })
    }

    /// Makes `cmd` (a runsc that starts the sandbox's Sentry and gofer) start inside the sandbox's
    /// cgroup, so that everything it forks is limited and accounted there; with `private_net_proc`
    /// also in a private mount namespace with an empty /proc/sys/net (see [`Self::start`]).
    fn in_sandbox_cgroup(&self, cmd: &mut Command, id: &str, private_net_proc: bool) -> Result<()> {
        let procs = self.cgroups.procs_files(id)?;
        // SAFETY: between fork and exec only open/write/close/unshare/mount, which are
        // async-signal-safe, on C strings made before the fork; nothing is allocated.
        unsafe {
            cmd.pre_exec(move || {
                crate::host::cgroup::join_from_pre_exec(&procs)?;
                if private_net_proc && !hide_proc_sys_net() {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    /// Starts the sandbox `id` (its bundle is in place) from the checkpoint `image`, its processes
    /// where they were, and lets its agent listen again.
    /// Restores a full-state image as sandbox `id`; a fork of another sandbox's image gets its own
    /// `hostname` (the restored kernel has the snapshotted one's).
    fn restore_instance(
        &self,
        id: &str,
        image: &Path,
        net_slot: Option<u32>,
        hostname: Option<&str>,
    ) -> Result<GvisorState> {
        let dir = self.dir(id);
        let console = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("console.log"))
            .context("open console.log")?;
        let networked = net_slot.is_some();
        let mut cmd = self.command(networked)?;
        cmd.arg("restore")
            .arg("--detach")
            .arg(format!("--image-path={}", image.display()))
            .arg(format!("--bundle={}", dir.display()))
            .arg(format!("--pid-file={}", dir.join("pid").display()))
            .arg(id)
            .stdout(console.try_clone()?)
            .stderr(console);
        self.in_sandbox_cgroup(&mut cmd, id, networked)?;
        let status = cmd.status().context("run runsc restore")?;
        if !status.success() {
            bail!("runsc restore: {}", self.console_tail(id));
        }
        let state = self.instance_state(id, net_slot)?;
        self.wake_agent(id, networked)?;
        if let Some(name) = hostname {
            // The agent has no CAP_SYS_ADMIN; this one process of the trusted, read-only agent
            // binary gets it (docs/snapshots.md, "Fork safety").
            self.runsc_run(
                networked,
                &[
                    "exec",
                    "--cap",
                    "CAP_SYS_ADMIN",
                    id,
                    AGENT_PATH_INSIDE,
                    "--hostname",
                    name,
                ],
            )
            .context("set the restored sandbox's hostname")?;
        }
        Ok(state)
    }

    /// The agent's socket file, opened as a path only (O_PATH) and never through a symlink.
    fn open_agent_socket(&self, id: &str) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(self.dir(id).join("sock").join(SOCK_NAME))
    }

    /// Whether the agent's socket takes a connection (opened without following a symlink).
    fn agent_listens(&self, id: &str) -> bool {
        let Ok(file) = self.open_agent_socket(id) else {
            return false;
        };
        file.metadata().is_ok_and(|m| m.file_type().is_socket())
            && std::os::unix::net::UnixStream::connect(format!(
                "/proc/self/fd/{}",
                file.as_raw_fd()
            ))
            .is_ok()
    }

    /// Tells a quiesced agent (SIGUSR1, [`Self::checkpoint_blocking`]) to listen again, and waits
    /// for its socket.
    fn wake_agent(&self, id: &str, networked: bool) -> Result<()> {
        let sock = self.dir(id).join("sock").join(SOCK_NAME);
        // The agent binds a new socket file; the old one (no longer bound) is in the way.
        remove_if_exists(&sock)?;
        self.runsc_run(networked, &["kill", id, "USR2"])?;
        if !wait_for(Duration::from_secs(10), || sock.exists()) {
            bail!("the sandbox's agent did not listen again after its checkpoint");
        }
        Ok(())
    }

    /// `runsc start`. With a network, it runs in a private mount namespace with an empty /proc/sys/net:
    /// this runsc build takes a namespace that shows /proc/sys/net/core/rmem_default for the host's
    /// own and refuses to serve it, and kernels since 5.x show that file in every namespace. Hiding it
    /// from `runsc start` (which hands the sandbox's interfaces to gVisor's network stack) is enough.
    fn start(&self, id: &str, networked: bool) -> Result<()> {
        let mut cmd = self.command(networked)?;
        cmd.args(["start", id]);
        if networked {
            // SAFETY: unshare and mount are plain system calls (async-signal-safe) on static C
            // strings; nothing is allocated between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    if !hide_proc_sys_net() {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let out = cmd.output().context("run runsc start")?;
        if !out.status.success() {
            bail!(
                "runsc start: {}",
                last_line(&String::from_utf8_lossy(&out.stderr))
            );
        }
        Ok(())
    }

    /// The last line of the sandbox's console log (where runsc reports why it failed).
    fn console_tail(&self, id: &str) -> String {
        std::fs::read_to_string(self.dir(id).join("console.log"))
            .map(|t| last_line(&t))
            .unwrap_or_else(|_| "no message".into())
    }

    /// The OCI runtime spec of a sandbox.
    fn oci_spec(&self, spec: &SandboxSpec, dir: &Path, netns: Option<&Path>) -> Result<oci::Spec> {
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        env.insert(
            "PATH".into(),
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
        );
        env.extend(spec.env.clone());
        let cap_set: HashSet<oci::Capability> = caps::KEPT
            .iter()
            .map(|(_, name)| oci::Capability::from_str(name.trim_start_matches("CAP_")))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow!("capability name: {e}"))?;
        let capabilities = oci::LinuxCapabilitiesBuilder::default()
            .bounding(cap_set.clone())
            .effective(cap_set.clone())
            .permitted(cap_set.clone())
            .inheritable(HashSet::new())
            .ambient(HashSet::new())
            .build()?;
        let process = oci::ProcessBuilder::default()
            .terminal(false)
            .user(oci::UserBuilder::default().uid(0u32).gid(0u32).build()?)
            .args(vec![
                AGENT_PATH_INSIDE.to_string(),
                "--listen".into(),
                format!("{SOCK_DIR_INSIDE}/{SOCK_NAME}"),
            ])
            .env(
                env.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>(),
            )
            .cwd("/")
            .capabilities(capabilities)
            .rlimits(vec![oci::PosixRlimitBuilder::default()
                .typ(oci::PosixRlimitType::RlimitNofile)
                .soft(1u64 << 20)
                .hard(1u64 << 20)
                .build()?])
            .no_new_privileges(true)
            .build()?;
        let bind = |src: &Path, dst: &str, ro: bool| -> Result<oci::Mount> {
            let mut options = vec!["rbind".to_string(), "nosuid".into(), "nodev".into()];
            if ro {
                options.push("ro".into());
            }
            Ok(oci::MountBuilder::default()
                .destination(dst)
                .typ("bind")
                .source(src)
                .options(options)
                .build()?)
        };
        let mut mounts = oci::get_default_mounts();
        // gVisor's own /sys is enough; the host's cgroup tree is none of the sandbox's business.
        mounts.retain(|m| m.destination() != Path::new("/sys/fs/cgroup"));
        mounts.push(bind(&self.agent, AGENT_PATH_INSIDE, true)?);
        mounts.push(bind(&dir.join("sock"), SOCK_DIR_INSIDE, false)?);
        mounts.push(bind(&dir.join("rootfs/tmp"), "/tmp", false)?);
        let namespaces: Vec<oci::LinuxNamespace> = [
            oci::LinuxNamespaceType::Pid,
            oci::LinuxNamespaceType::Ipc,
            oci::LinuxNamespaceType::Uts,
            oci::LinuxNamespaceType::Mount,
            oci::LinuxNamespaceType::Network,
        ]
        .into_iter()
        .map(|t| {
            let mut b = oci::LinuxNamespaceBuilder::default().typ(t);
            if let (oci::LinuxNamespaceType::Network, Some(p)) = (t, netns) {
                b = b.path(p);
            }
            b.build()
        })
        .collect::<Result<_, _>>()?;
        let linux = oci::LinuxBuilder::default()
            .namespaces(namespaces)
            .masked_paths(oci::get_default_maskedpaths())
            .readonly_paths(oci::get_default_readonly_paths())
            .build()?;
        let root = oci::RootBuilder::default()
            .path(dir.join("rootfs"))
            .readonly(false)
            .build()?;
        let mut s = oci::Spec::default();
        s.set_hostname(Some(spec.hostname.clone()))
            .set_process(Some(process))
            .set_root(Some(root))
            .set_mounts(Some(mounts))
            .set_linux(Some(linux))
            .set_annotations(None);
        Ok(s)
    }

    /// Kills the sandbox and removes runsc's record of it, its cgroup and its network.
    fn stop_instance(&self, id: &str, state: Option<&GvisorState>) -> Result<()> {
        // runsc's sandbox and gofer outlive the `runsc create` that started them and are re-parented
        // to the daemon (a subreaper): reap each once killed, or they stay zombies.
        let mut ours = self.cgroups.pids(id);
        if let Some(s) = state {
            ours.push(s.sandbox_pid);
            ours.extend(&s.host_pids);
        }
        ours.sort_unstable();
        ours.dedup();
        // A frozen sandbox (paused) must thaw to die.
        let _ = self.cgroups.set_frozen(id, false);
        // SIGKILL to every process of the cgroup first: `runsc kill` + `runsc delete` alone wait
        // seconds for the Sentry to wind down.
        let killed = self.cgroups.kill_all(id, Duration::from_secs(10));
        for pid in ours {
            crate::host::proc::reap(pid);
        }
        if self.runsc.is_some() {
            let networked = state.is_some_and(|s| s.net_slot.is_some());
            // runsc's record of the container; it may be gone already (a sweep, a failed create).
            let _ = self.runsc_run(networked, &["delete", "--force", id]);
        }
        killed?;
        let slot = state.and_then(|s| s.net_slot);
        if let (Some(net), Some(slot)) = (&self.net, slot) {
            net.detach(slot)?;
        }
        self.cgroups.remove(id)
    }

    fn release_blocking(&self, id: &str, state: Option<GvisorState>) -> Result<()> {
        self.stop_instance(id, state.as_ref())?;
        let dir = self.dir(id);
        mount::unmount_tree(&dir)?;
        super::layer::remove_all_but_layer(&dir)
    }

    fn destroy_blocking(&self, id: &str, state: Option<GvisorState>) -> Result<()> {
        self.stop_instance(id, state.as_ref())?;
        let dir = self.dir(id);
        mount::unmount_tree(&dir)?;
        mount::remove_unmounted_tree(&dir)
    }

    /// runsc's status of the container (`running`, `paused`, ...), None when runsc does not know it.
    fn runsc_status(&self, id: &str, networked: bool) -> Result<Option<String>> {
        let out = self
            .command(networked)?
            .args(["state", id])
            .output()
            .context("run runsc state")?;
        Ok(serde_json::from_slice::<serde_json::Value>(&out.stdout)
            .ok()
            .and_then(|v| v.get("status")?.as_str().map(str::to_string)))
    }

    /// Runs `moat-agent --sync` inside the sandbox: what the Sentry caches reaches the host files.
    fn sync_inside(&self, id: &str, networked: bool) -> Result<()> {
        self.runsc_run(networked, &["exec", id, AGENT_PATH_INSIDE, "--sync"])
    }

    fn export_blocking(&self, id: &str, state: &GvisorState, dest: &Path) -> Result<Duration> {
        let networked = state.net_slot.is_some();
        let dir = self.dir(id);
        let upper = super::layer::upper(&dir);
        // A paused sandbox is frozen (and was synced when it paused).
        let was_paused = self.cgroups.is_frozen(id);
        if !was_paused {
            self.sync_inside(id, networked)?;
        }
        let started = std::time::Instant::now();
        if !was_paused {
            self.runsc_run(networked, &["pause", id])?;
        }
        let copied = super::layer::copy(&upper, dest);
        let frozen_for = started.elapsed();
        let resumed = if was_paused {
            Ok(())
        } else {
            self.runsc_run(networked, &["resume", id])
        };
        copied?;
        resumed?;
        Ok(frozen_for)
    }

    /// (inode, path inside) of the Unix sockets bound to a file path that the sandbox's gofer holds
    /// (the host sockets `--host-uds=create` makes, the agent's included), read on the host from
    /// the gofer's descriptors and its network namespace's socket table.
    fn gofer_sockets(&self, id: &str) -> Vec<(String, String)> {
        let mut held = Vec::new();
        for pid in self.cgroups.pids(id) {
            let is_gofer = std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"runsc-gofer"));
            if !is_gofer {
                continue;
            }
            let inodes: HashSet<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy();
                    Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .collect();
            let table =
                std::fs::read_to_string(format!("/proc/{pid}/net/unix")).unwrap_or_default();
            held.extend(
                moat_api::unix_sockets_bound_to_paths(&table)
                    .into_iter()
                    .filter(|(inode, _)| inodes.contains(inode)),
            );
        }
        held
    }

    /// Full-state snapshot: the agent lets go of its host socket (gVisor cannot save one, nor a
    /// socket a process bound to a file: the agent refuses then), runsc pauses the sandbox and
    /// writes its memory and processes to `image`, the checkpointed Sentry is ended (this runsc
    /// ends it on resume anyway), the writable layer (complete on the host: the Sentry flushes what
    /// it caches before it saves) is copied to `changes`, and the same sandbox is restored from the
    /// image in its own directory, cgroup and network namespace, its processes going on.
    fn checkpoint_blocking(
        &self,
        id: &str,
        state: &GvisorState,
        changes: &Path,
        image: &Path,
    ) -> Result<(Duration, GvisorState), TierError> {
        let marker = self.dir(id).join(CHECKPOINTING);
        std::fs::File::create(&marker).context("create the checkpoint marker")?;
        let res = self.checkpoint_inner(id, state, changes, image);
        let _ = std::fs::remove_file(&marker);
        res
    }

    fn checkpoint_inner(
        &self,
        id: &str,
        state: &GvisorState,
        changes: &Path,
        image: &Path,
    ) -> Result<(Duration, GvisorState), TierError> {
        let networked = state.net_slot.is_some();
        let dir = self.dir(id);
        let sock = dir.join("sock").join(SOCK_NAME);
        std::fs::write(
            image.join(IMAGE_META),
            serde_json::to_vec(&ImageMeta {
                agent: self.agent.clone(),
                runsc: self.runsc()?.version.clone(),
            })
            .context("encode the image description")?,
        )
        .context("write the image description")?;
        let was_paused = self.cgroups.is_frozen(id);
        if was_paused {
            // The agent must run to let go of its socket; it is paused again at the end.
            self.cgroups.set_frozen(id, false)?;
            if self.runsc_status(id, networked)?.as_deref() == Some("paused") {
                self.runsc_run(networked, &["resume", id])?;
            }
        }
        let repause = |this: &Self| -> Result<()> {
            if was_paused {
                this.sync_inside(id, networked)?;
                this.runsc_run(networked, &["pause", id])?;
                this.cgroups.set_frozen(id, true)?;
            }
            Ok(())
        };
        // The agent lets go of its socket on SIGUSR1 when asked for it here first, and says so with
        // a file (inside, gVisor cannot remove a host socket's file: the daemon does). The
        // directory is writable from inside: nothing in it is followed or trusted.
        let sock_dir = dir.join("sock");
        let request = sock_dir.join(AGENT_CHECKPOINT_REQUEST);
        let quiesced = sock_dir.join(AGENT_QUIESCED);
        let refused = sock_dir.join(AGENT_REFUSED);
        for f in [&request, &quiesced, &refused] {
            remove_if_exists(f)?;
        }
        // Host sockets that exist before the agent looks (a socket bound later is one it missed).
        let before: HashSet<String> = self
            .gofer_sockets(id)
            .into_iter()
            .map(|(inode, _)| inode)
            .collect();
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&request)
            .context("create the checkpoint request")?;
        self.runsc_run(networked, &["kill", id, "USR1"])?;
        let answered = wait_for(Duration::from_secs(10), || {
            std::fs::symlink_metadata(&quiesced).is_ok()
                || std::fs::symlink_metadata(&refused).is_ok()
        });
        let refusal = read_small_file(&refused);
        let let_go = std::fs::symlink_metadata(&quiesced).is_ok();
        for f in [&request, &quiesced, &refused] {
            remove_if_exists(f)?;
        }
        if let Some(paths) = refusal.filter(|_| !let_go) {
            repause(self)?;
            return Err(refused_for_sockets(id, &paths));
        }
        remove_if_exists(&sock)?;
        if !answered || !let_go {
            let _ = self.wake_agent(id, networked);
            repause(self)?;
            return Err(anyhow!(
                "the sandbox's agent did not let go of its socket for the checkpoint"
            )
            .into());
        }
        let started = std::time::Instant::now();
        // A checkpoint that fails ends the sandbox (this runsc's Sentry exits, or exits when
        // resumed), so what would make it fail is ruled out first. The agent found no socket bound
        // to a file (runsc cannot save those host sockets); paused, the sandbox can bind no new one,
        // and one bound since the agent looked is a new socket of the gofer.
        let resume_and_wake = |this: &Self| -> Result<()> {
            this.runsc_run(networked, &["resume", id])?;
            let woke = this.wake_agent(id, networked);
            repause(this)?;
            woke
        };
        self.runsc_run(networked, &["pause", id])?;
        let new: Vec<String> = self
            .gofer_sockets(id)
            .into_iter()
            .filter(|(inode, _)| !before.contains(inode))
            .map(|(_, path)| path)
            .collect();
        if !new.is_empty() {
            resume_and_wake(self)?;
            return Err(refused_for_sockets(id, &new.join("\n")));
        }
        let out = self
            .command(networked)?
            .args([
                "checkpoint",
                &format!("--image-path={}", image.display()),
                id,
            ])
            .output()
            .context("run runsc checkpoint")?;
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let _ = resume_and_wake(self);
            // runsc's message ends with a dump of the object it could not save: keep its head.
            let msg: String = last_line(&stderr).chars().take(400).collect();
            return Err(anyhow!("runsc checkpoint: {msg}").into());
        }
        // The checkpointed Sentry would end when resumed: end it (and the gofer) now, and drop
        // runsc's record of the container; the cgroup, network and mounts stay for the restore.
        self.cgroups.kill_all(id, Duration::from_secs(10))?;
        let mut gone = state.host_pids.clone();
        gone.push(state.sandbox_pid);
        for pid in gone {
            crate::host::proc::reap(pid);
        }
        let _ = self.runsc_run(networked, &["delete", "--force", id]);
        let copied = super::layer::copy(&super::layer::upper(&dir), changes);
        if let (Some(net), Some(slot)) = (&self.net, state.net_slot) {
            net.reconfigure_netns(slot, &dir.join("netns"))?;
        }
        let restored = self.restore_instance(id, image, state.net_slot, None);
        let stopped_for = started.elapsed();
        let restored = restored.context("the sandbox did not come back after its checkpoint")?;
        copied?;
        repause(self)?;
        Ok((stopped_for, restored))
    }
}

/// In a child between fork and exec: a private mount namespace with an empty tmpfs over
/// /proc/sys/net (see [`GvisorTier::start`]). False (errno set) when a call failed.
///
/// # Safety
/// Only async-signal-safe system calls on static C strings; callable between fork and exec.
unsafe fn hide_proc_sys_net() -> bool {
    // SAFETY: plain system calls on valid NUL-terminated strings that outlive the calls.
    unsafe {
        libc::unshare(libc::CLONE_NEWNS) == 0
            && libc::mount(
                std::ptr::null(),
                c"/".as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) == 0
            && libc::mount(
                c"none".as_ptr(),
                c"/proc/sys/net".as_ptr(),
                c"tmpfs".as_ptr(),
                libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
                std::ptr::null(),
            ) == 0
    }
}

/// The answer to a full-state snapshot of a sandbox holding Unix sockets bound to files (`paths`,
/// one per line, as the agent wrote them: shown escaped and bounded).
fn refused_for_sockets(id: &str, paths: &str) -> TierError {
    let shown: Vec<String> = paths
        .lines()
        .filter(|l| !l.is_empty())
        .take(8)
        .map(|l| format!("{:?}", l.chars().take(200).collect::<String>()))
        .collect();
    TierError::Refused(format!(
        "processes in sandbox {id} hold Unix sockets bound to files ({}): on gvisor those are host sockets, which runsc cannot save; close them, or bind abstract sockets or sockets on a tmpfs, for a full-state snapshot, or take a filesystem snapshot",
        shown.join(", ")
    ))
}

/// Up to 64 KiB of a file the sandbox wrote, never following a symlink; None when it is not there.
fn read_small_file(path: &Path) -> Option<String> {
    use std::io::Read;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::new();
    f.take(64 << 10).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Removes a file (never following a symlink); fine when it is not there.
fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("remove {}", path.display())),
    }
}

/// Polls `done` every 5 ms until it holds (true) or `timeout` passes (false).
fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = std::time::Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if std::time::Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// What a checkpoint image was taken with, next to runsc's files in its directory.
#[derive(Debug, Serialize, Deserialize)]
struct ImageMeta {
    /// The agent binary the sandbox ran: its processes' memory maps it, so a restore needs the same.
    agent: PathBuf,
    runsc: String,
}

const IMAGE_META: &str = "moat-image.json";

/// Checks that a checkpoint image can be restored by this daemon (same agent binary).
fn check_image(image: &Path, agent: &Path) -> Result<()> {
    let meta: ImageMeta = serde_json::from_slice(
        &std::fs::read(image.join(IMAGE_META))
            .with_context(|| format!("read {}", image.join(IMAGE_META).display()))?,
    )
    .context("checkpoint image description")?;
    if meta.agent != agent {
        bail!(
            "this full-state snapshot was taken with agent {} and this daemon runs {}: its processes cannot continue here (start from it as a filesystem snapshot by resetting, or take a new one)",
            meta.agent.display(),
            agent.display()
        );
    }
    Ok(())
}

/// Makes a new network namespace held by a bind mount at `path` (an empty file is made for it). The
/// namespace is made by a short-lived thread (unshare applies to the calling thread only), so the
/// daemon's own threads stay in the daemon's namespace.
fn make_netns(path: &Path) -> Result<()> {
    if mount::mounts_under(path)?.iter().any(|m| m == path) {
        mount::unmount_tree(path)?;
    }
    std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
    let target = path.to_path_buf();
    std::thread::spawn(move || -> Result<()> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).context("unshare network")?;
        nix::mount::mount(
            Some("/proc/thread-self/ns/net"),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .context("bind the network namespace")
    })
    .join()
    .map_err(|_| anyhow!("network namespace thread panicked"))?
}

fn last_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("no message")
        .to_string()
}

#[async_trait::async_trait]
impl Tier for GvisorTier {
    type State = GvisorState;

    fn isolation(&self) -> Isolation {
        Isolation::Gvisor
    }

    fn info(&self) -> TierInfo {
        TierInfo {
            isolation: Isolation::Gvisor,
            available: self.runsc.is_some(),
            note: Some(match &self.runsc {
                Some(r) => format!("runsc {} (platform ptrace)", r.version),
                None => "runsc is not installed on this host (apt-get install runsc)".into(),
            }),
        }
    }

    fn capabilities(&self) -> TierCapabilities {
        TierCapabilities {
            oom_counter_inside: None,
            // The Sentry enforces RLIMIT_NPROC; the host cgroup only bounds its own threads.
            process_limit_inside: true,
            limits_fixed_at_start: false,
            checkpoint_ends_connections: true,
            min_memory_mb: 0,
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<GvisorState> {
        let this = self.clone();
        let spec2 = spec.clone();
        super::start_or_clean(self, spec, move || this.create_blocking(&spec2)).await
    }

    fn last_words(&self, id: &str, _state: Option<&GvisorState>) -> Vec<String> {
        super::log_tail(&self.dir(id).join("console.log"), 10)
    }

    async fn connect(&self, id: &str, _state: &GvisorState) -> Result<AgentStream> {
        // The socket's directory is writable from inside the sandbox: open the name without following
        // a symlink, check it is a socket, and connect through the descriptor, so a hostile sandbox
        // cannot point the daemon at another socket of the host.
        let path = self.dir(id).join("sock").join(SOCK_NAME);
        let open = || self.open_agent_socket(id);
        // While a full-state snapshot is taken the agent has no socket: wait for it (bounded).
        let marker = self.dir(id).join(CHECKPOINTING);
        let mut file = open();
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while file.is_err() && marker.exists() && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
            file = open();
        }
        let file = file.with_context(|| format!("open {}", path.display()))?;
        if !file.metadata()?.file_type().is_socket() {
            bail!("{} is not a socket", path.display());
        }
        let via = format!("/proc/self/fd/{}", file.as_raw_fd());
        let s = tokio::net::UnixStream::connect(&via)
            .await
            .with_context(|| format!("connect {}", path.display()))?;
        drop(file);
        Ok(Box::pin(s))
    }

    fn watched_process(&self, state: &GvisorState) -> Option<(u32, u64)> {
        Some((state.sandbox_pid, state.sandbox_start_ticks))
    }

    async fn is_alive(&self, _id: &str, state: &GvisorState) -> proc::Liveness {
        proc::liveness(state.sandbox_pid, state.sandbox_start_ticks)
    }

    async fn set_limits(
        &self,
        id: &str,
        _state: &GvisorState,
        limits: &moat_api::SandboxLimits,
    ) -> Result<()> {
        self.cgroups.create(id, &cgroup_limits(limits))
    }

    async fn usage(&self, id: &str, _state: &GvisorState) -> Result<TierUsage> {
        let this = self.clone();
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
        _state: &GvisorState,
        room: Option<u64>,
    ) -> Result<Option<u64>> {
        super::layer::cap_room(&self.dir(id), room)
    }

    async fn pause(&self, id: &str, state: &GvisorState) -> Result<()> {
        let networked = state.net_slot.is_some();
        let this = self.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            // What the Sentry caches reaches the host files first: a paused sandbox's files are
            // complete on disk (for snapshots, and for a host that goes down while it is paused).
            this.sync_inside(&id, networked)?;
            this.runsc_run(networked, &["pause", &id])?;
            // The Sentry's own threads (timers, the ptrace platform) would still use CPU: freeze
            // the whole cgroup too, so a paused sandbox costs no CPU at all.
            this.cgroups.set_frozen(&id, true)
        })
        .await?
    }

    async fn resume(&self, id: &str, state: &GvisorState) -> Result<()> {
        let networked = state.net_slot.is_some();
        let this = self.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || {
            this.cgroups.set_frozen(&id, false)?;
            // Resume also thaws running sandboxes at start-up (a crash mid-snapshot): only a
            // sandbox runsc holds paused needs `runsc resume`, which refuses a running one.
            if this.runsc_status(&id, networked)?.as_deref() == Some("paused") {
                this.runsc_run(networked, &["resume", &id])?;
            }
            // A daemon that went down during a full-state snapshot may have left the agent
            // without its socket: it listens again.
            let marker = this.dir(&id).join(CHECKPOINTING);
            if marker.exists() {
                if !this.agent_listens(&id) {
                    this.wake_agent(&id, networked)?;
                }
                remove_if_exists(&marker)?;
            }
            Ok(())
        })
        .await?
    }

    async fn export_changes(&self, id: &str, state: &GvisorState, dest: &Path) -> Result<Duration> {
        let state = state.clone();
        let this = self.clone();
        let id = id.to_string();
        let dest = dest.to_path_buf();
        tokio::task::spawn_blocking(move || this.export_blocking(&id, &state, &dest)).await?
    }

    fn full_snapshot_unsupported(&self) -> Option<String> {
        self.runsc
            .is_none()
            .then(|| "the gvisor tier needs runsc, which is not installed on this host".into())
    }

    async fn checkpoint(
        &self,
        id: &str,
        state: &GvisorState,
        changes: &Path,
        image: &Path,
    ) -> Result<(Duration, GvisorState), TierError> {
        let state = state.clone();
        let this = self.clone();
        let id = id.to_string();
        let (changes, image) = (changes.to_path_buf(), image.to_path_buf());
        tokio::task::spawn_blocking(move || this.checkpoint_blocking(&id, &state, &changes, &image))
            .await?
    }

    fn host_network(&self) -> Option<&crate::host::net::Network> {
        self.net.as_ref()
    }

    async fn restore_network(&self, _live: &BTreeMap<u32, moat_api::NetworkPolicy>) -> Result<()> {
        // The host's sandbox network (one nft table, one address space) is shared with the container
        // tier, which reinstalls it with the policies of every tier's live sandboxes.
        Ok(())
    }

    async fn destroy(&self, id: &str, state: Option<&GvisorState>) -> Result<()> {
        let state = state.cloned();
        let this = self.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || this.destroy_blocking(&id, state)).await?
    }

    async fn release(&self, id: &str, state: Option<&GvisorState>) -> Result<()> {
        let state = state.cloned();
        let this = self.clone();
        let id = id.to_string();
        tokio::task::spawn_blocking(move || this.release_blocking(&id, state)).await?
    }

    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>> {
        let mut names: Vec<String> = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.root) {
            for e in rd.flatten() {
                if let Some(n) = e.file_name().to_str() {
                    names.push(n.to_string());
                }
            }
        }
        // Containers runsc still knows of (a crash between its create and ours).
        if self.runsc.is_some() {
            if let Ok(out) = self.command(false)?.args(["list", "--quiet"]).output() {
                for id in String::from_utf8_lossy(&out.stdout).lines().map(str::trim) {
                    if !id.is_empty() && !names.iter().any(|n| n == id) {
                        names.push(id.to_string());
                    }
                }
            }
        }
        super::destroy_unowned(self, names, live).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier() -> GvisorTier {
        GvisorTier {
            root: PathBuf::from("/data/gvisor"),
            cgroups: CgroupLayout::V2 {
                root: PathBuf::from("/sys/fs/cgroup"),
                parent: "moat".into(),
            },
            agent: PathBuf::from("/data/bin/moat-agent-0123"),
            net: None,
            runsc: None,
        }
    }

    fn spec() -> SandboxSpec {
        SandboxSpec {
            id: "sbx_test".into(),
            hostname: "sbx-test".into(),
            template_rootfs: PathBuf::from("/data/templates/bb/rootfs"),
            layers: vec![],
            env: BTreeMap::from([("FOO".to_string(), "bar".to_string())]),
            limits: moat_api::SandboxLimits::default(),
            slot: 3,
            network: None,
            keep_files: false,
            restore: None,
        }
    }

    #[test]
    fn spec_runs_the_agent_with_moat_capabilities_and_no_host_cgroups() {
        let t = tier();
        let dir = t.dir("sbx_test");
        let s = t.oci_spec(&spec(), &dir, None).unwrap();
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["hostname"], "sbx-test");
        assert_eq!(v["root"]["path"], "/data/gvisor/sbx_test/rootfs");
        let args: Vec<&str> = v["process"]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            args,
            [AGENT_PATH_INSIDE, "--listen", "/dev/.moat/sock/agent.sock"]
        );
        let env: Vec<&str> = v["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert!(env.contains(&"FOO=bar"), "{env:?}");
        assert!(env.iter().any(|e| e.starts_with("PATH=")), "{env:?}");
        let bounding = v["process"]["capabilities"]["bounding"].as_array().unwrap();
        assert_eq!(bounding.len(), caps::KEPT.len());
        assert!(!bounding
            .iter()
            .any(|c| c == "CAP_SYS_ADMIN" || c == "CAP_NET_RAW"));
        assert_eq!(v["process"]["noNewPrivileges"], true);
        let mounts = v["mounts"].as_array().unwrap();
        let agent = mounts
            .iter()
            .find(|m| m["destination"] == AGENT_PATH_INSIDE)
            .unwrap();
        assert_eq!(agent["source"], "/data/bin/moat-agent-0123");
        assert!(agent["options"].as_array().unwrap().contains(&"ro".into()));
        assert!(!mounts.iter().any(|m| m["destination"] == "/sys/fs/cgroup"));
        // No cgroup path: the daemon, not runsc, places the sandbox in its cgroup.
        assert!(v["linux"].get("cgroupsPath").is_none());
        let net = v["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["type"] == "network")
            .unwrap()
            .clone();
        assert!(net.get("path").is_none());
        let with_net = t.oci_spec(&spec(), &dir, Some(&dir.join("netns"))).unwrap();
        let v = serde_json::to_value(&with_net).unwrap();
        assert!(v["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["type"] == "network" && n["path"] == "/data/gvisor/sbx_test/netns"));
    }

    #[test]
    fn pids_limit_leaves_room_for_the_sentry() {
        let l = moat_api::SandboxLimits {
            pids: 64,
            ..Default::default()
        };
        assert_eq!(cgroup_limits(&l).pids, 64 * 16 + 256);
    }

    #[test]
    fn runsc_errors_are_their_last_line() {
        assert_eq!(last_line("a\nrunsc: boom\n\n"), "runsc: boom");
        assert_eq!(last_line(""), "no message");
    }
}
