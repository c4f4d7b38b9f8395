//! The `microvm` tier: each sandbox is a QEMU `microvm` machine with its own guest kernel (Debian's
//! cloud kernel), KVM where KVM can boot a guest and TCG (software emulation) elsewhere. The agent is
//! the guest's PID 1 (`moat-agent --vm`, from an initramfs moat builds) and speaks the same protocol
//! as on the other tiers, over a virtio-serial port that QEMU serves on a host unix socket.
//!
//! Layout under `<data_dir>/microvm/<id>/` (root's, 0700): `config.img` (this VM's configuration
//! disk), `disk.img` (the VM's writable ext4 disk: the guest's overlay upper layer), `run/` (the
//! agent's and QMP's listening sockets, bound by the daemon), `qemu.log` (QEMU's own stderr). Base
//! images (one ext4 image per template + snapshot layer stack, read-only, shared) and the shared
//! initramfs (the agent and the kernel modules) live under `<data_dir>/microvm-images/`. QEMU opens
//! none of these by name: it inherits a descriptor of each.
//!
//! QEMU runs as the sandbox's own unprivileged host uid, in the sandbox's cgroup, in new network,
//! IPC and UTS namespaces, with no new privileges and its seccomp filter on (`-sandbox on` denying
//! spawn, privilege changes and resource control). See docs/microvm-tier.md.

pub mod control;
pub mod image;
pub mod initramfs;
pub mod qmp;

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use moat_api::{Isolation, TierInfo};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{AgentStream, SandboxSpec, Tier, TierCapabilities, TierError, TierUsage};
use crate::host::cgroup::{CgroupLayout, Limits};
use crate::host::proc;

/// Guest memory on top of the sandbox's memory limit: the guest kernel and the agent.
const GUEST_OVERHEAD_MB: u64 = 96;

/// The least `memory_mb` a microVM boots with: its guest's RAM (this plus its overhead) also holds
/// the kernel, the unpacked initrd with the agent, and init; with less the guest cannot start
/// (found by the API fuzzer: 64 MiB did not boot, 96 MiB did, with a debug build's agent).
const MIN_MEMORY_MB: u64 = 128;
/// Host memory QEMU itself needs besides guest memory (TCG's translation cache included).
const QEMU_OVERHEAD_MB: u64 = 320;
/// Size of the writable disk of a sandbox without a disk quota (sparse: costs what is written).
const DEFAULT_DISK_MB: u64 = 8192;
/// How long a guest may take from QEMU's start to the agent's port being open: under KVM, and
/// under TCG, where the boot is emulated (about 5 s alone on this project's 2-core machine) and
/// several at once on a busy host share its cores.
const BOOT_TIMEOUT: Duration = Duration::from_secs(60);
const BOOT_TIMEOUT_TCG: Duration = Duration::from_secs(180);
/// Size of the guest console's ring buffer in QEMU (the last lines, for errors).
const CONSOLE_RING: u32 = 65536;
const AGENT_SOCK: &str = "agent.sock";
const CONTROL_SOCK: &str = "control.sock";
const QMP_SOCK: &str = "qmp.sock";
/// In a VM's directory: how many of the sandbox's layers (bottom first) its base image is made of,
/// kept with its disk by a release (see `IsolationTier::layers_under_writable`).
const LAYER_BASE: &str = "layer-base";
/// In a VM's directory: the bytes its disk image held when it was made (a new filesystem's own
/// metadata, or a restored snapshot's disk), which its disk usage does not count.
const DISK_BASELINE: &str = "disk-baseline";
/// In a full-state snapshot's image directory: QEMU's migration stream of the stopped VM (its
/// memory and devices), the VM's disks of that instant, and [`ImageMeta`].
const IMAGE_MEMORY: &str = "memory";
const IMAGE_META: &str = "moat-vm.json";
/// 2: every VM has a virtio-net device (a restore must start the same devices).
const IMAGE_FORMAT: u32 = 2;
/// How long QEMU may take to write a VM's memory to a snapshot image.
const SAVE_TIMEOUT: Duration = Duration::from_secs(300);

/// How the tier runs guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// `--microvm-accel`: auto (probe whether KVM boots the guest kernel), kvm or tcg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccelChoice {
    Auto,
    Force(Accel),
}

impl std::str::FromStr for AccelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(AccelChoice::Auto),
            "kvm" => Ok(AccelChoice::Force(Accel::Kvm)),
            "tcg" => Ok(AccelChoice::Force(Accel::Tcg)),
            other => Err(format!("unknown accelerator {other:?} (auto, kvm, tcg)")),
        }
    }
}

/// What the daemon stores to find a VM again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MicrovmState {
    pub qemu_pid: u32,
    pub qemu_start_ticks: u64,
    /// The host uid QEMU runs as (it owns the VM's sockets).
    pub uid: u32,
    pub accel: Accel,
    /// The base image the VM runs over (a full-state snapshot keeps a link to it).
    #[serde(default)]
    pub base: Option<PathBuf>,
    /// How many of the sandbox's layers its base image is made of.
    #[serde(default)]
    pub base_layers: Option<usize>,
    /// The machine QEMU was started as (a restore starts the same one).
    #[serde(default)]
    pub vcpus: u64,
    #[serde(default)]
    pub mem_mb: u64,
    /// The slot whose host interface (a TAP device) is the VM's link; None: no network.
    #[serde(default)]
    pub net_slot: Option<u32>,
}

/// How a snapshotted VM was started: a restore must start the same machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ImageMeta {
    format: u32,
    accel: Accel,
    vcpus: u64,
    mem_mb: u64,
    base_layers: usize,
}

#[derive(Clone)]
pub struct MicrovmTier {
    /// `<data_dir>/microvm`
    root: PathBuf,
    /// `<data_dir>/microvm-images`
    images: PathBuf,
    cgroups: CgroupLayout,
    agent: PathBuf,
    /// Directory with `vmlinuz`, `modules/` and `modules.order` (scripts/guest-kernel.sh).
    guest_kernel: PathBuf,
    uid_base: u32,
    qemu: Option<PathBuf>,
    choice: AccelChoice,
    accel: Arc<Mutex<Option<(Accel, String)>>>,
    /// Held while a base image or the shared initramfs is built.
    build_lock: Arc<Mutex<()>>,
    /// Bounds how many guests boot at once: a boot is CPU-bound (under TCG entirely), and twenty
    /// kernels booting on two cores each stall in early boot far past the boot timeout, while the
    /// same twenty booted a few at a time are all up sooner.
    boot_gate: Arc<tokio::sync::Semaphore>,
    /// The tier's connections to its VMs' control ports.
    controls: control::Connections,
    ports: PortState,
    /// The host's sandbox network (shared with the other tiers); None with `--network none`.
    net: Option<crate::host::net::Network>,
}

fn find_qemu() -> Option<PathBuf> {
    [
        "/usr/bin/qemu-system-x86_64",
        "/usr/local/bin/qemu-system-x86_64",
    ]
    .into_iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

impl MicrovmTier {
    pub fn new(
        data_dir: &Path,
        agent: PathBuf,
        guest_kernel: PathBuf,
        uid_base: u32,
        cgroups: CgroupLayout,
        choice: AccelChoice,
        net: Option<crate::host::net::Network>,
    ) -> Result<MicrovmTier> {
        let root = data_dir.join("microvm");
        let images = data_dir.join("microvm-images");
        for d in [&root, &images] {
            std::fs::create_dir_all(d).with_context(|| format!("mkdir {}", d.display()))?;
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))?;
        }
        let qemu = find_qemu();
        let ports = PortState::default();
        let tier = MicrovmTier {
            root,
            images,
            cgroups,
            agent,
            guest_kernel,
            uid_base,
            qemu,
            choice,
            accel: Arc::new(Mutex::new(None)),
            build_lock: Arc::new(Mutex::new(())),
            boot_gate: Arc::new(tokio::sync::Semaphore::new(concurrent_boots())),
            controls: control::Connections::new(ports.clone()),
            ports,
            net,
        };
        match tier.unavailable() {
            None => tracing::info!(kernel = %tier.guest_kernel.display(), "microvm tier available"),
            Some(why) => tracing::warn!("the microvm tier is unavailable: {why}"),
        }
        Ok(tier)
    }

    /// Why the tier cannot start VMs on this host; None when it can.
    fn unavailable(&self) -> Option<String> {
        if self.qemu.is_none() {
            return Some(
                "qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)".into(),
            );
        }
        if !self.guest_kernel.join("vmlinuz").is_file()
            || !self.guest_kernel.join("modules.order").is_file()
        {
            return Some(format!(
                "no guest kernel in {} (run scripts/guest-kernel.sh)",
                self.guest_kernel.display()
            ));
        }
        None
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.root.join(id)
    }

    fn qemu(&self) -> Result<&Path> {
        if let Some(why) = self.unavailable() {
            bail!("the microvm tier is unavailable on this host: {why}");
        }
        Ok(self.qemu.as_deref().expect("checked by unavailable"))
    }

    fn uid(&self, slot: u32) -> u32 {
        self.uid_base + slot * super::IDS_PER_SANDBOX
    }

    /// The shared initramfs (agent + modules), built on first use for this agent and kernel.
    fn shared_initrd(&self) -> Result<PathBuf> {
        let version =
            std::fs::read_to_string(self.guest_kernel.join("version")).unwrap_or_default();
        let agent_name = self
            .agent
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let path = self
            .images
            .join(format!("initrd-{agent_name}-{}.cpio", version.trim()));
        let _guard = self
            .build_lock
            .lock()
            .map_err(|_| anyhow!("build lock poisoned"))?;
        if !path.exists() {
            initramfs::shared(&self.agent, &self.guest_kernel, &path)?;
        }
        Ok(path)
    }

    /// The base image of a layer stack, built on first use.
    fn base_image(&self, template_rootfs: &Path, layers: &[PathBuf]) -> Result<PathBuf> {
        let key = image::key(template_rootfs, layers)?;
        let path = self.images.join(format!("base-{key}.ext4"));
        let _guard = self
            .build_lock
            .lock()
            .map_err(|_| anyhow!("build lock poisoned"))?;
        if !path.exists() {
            image::build_base(template_rootfs, layers, &path)?;
        }
        Ok(path)
    }

    /// The accelerator guests run with: forced, or probed once (does KVM boot the guest kernel?).
    fn accel(&self) -> Result<(Accel, String)> {
        let mut guard = self
            .accel
            .lock()
            .map_err(|_| anyhow!("accel lock poisoned"))?;
        if let Some(a) = guard.clone() {
            return Ok(a);
        }
        let chosen = match self.choice {
            AccelChoice::Force(a) => (a, format!("{} (forced with --microvm-accel)", a.as_str())),
            AccelChoice::Auto => self.probe_kvm()?,
        };
        if chosen.0 == Accel::Tcg {
            tracing::warn!("microvm tier: {}", chosen.1);
        } else {
            tracing::info!("microvm tier: {}", chosen.1);
        }
        *guard = Some(chosen.clone());
        Ok(chosen)
    }

    /// Boots the guest kernel under KVM with the shared initramfs and no configuration: the agent
    /// starts (so the kernel booted), finds no configuration and powers the VM off. A kernel that
    /// hangs under this host's KVM (a paravirtual one that cannot run stock guests) never gets there.
    fn probe_kvm(&self) -> Result<(Accel, String)> {
        if !Path::new("/dev/kvm").exists() {
            return Ok((Accel::Tcg, "TCG (software emulation): this host has no /dev/kvm; guests run 10-50x slower than under KVM".into()));
        }
        let initrd = self.shared_initrd()?;
        let log = self.images.join("kvm-probe.log");
        let _ = std::fs::remove_file(&log);
        let started = std::time::Instant::now();
        let mut child = Command::new(self.qemu()?)
            .args([
                "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "256", "-smp", "1",
            ])
            .args([
                "-nodefaults",
                "-no-user-config",
                "-display",
                "none",
                "-no-reboot",
            ])
            .arg("-kernel")
            .arg(self.guest_kernel.join("vmlinuz"))
            .arg("-initrd")
            .arg(&initrd)
            .args([
                "-append",
                "console=ttyS0 panic=-1 reboot=t rdinit=/init -- --vm",
            ])
            .arg("-serial")
            .arg(format!("file:{}", log.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("start the KVM probe")?;
        let until = started + Duration::from_secs(20);
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break Some(s);
            }
            if std::time::Instant::now() > until {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let console = std::fs::read_to_string(&log).unwrap_or_default();
        let booted = console.contains("moat-agent: guest boot failed");
        Ok(if booted {
            (
                Accel::Kvm,
                format!(
                    "KVM (a guest booted to its agent in {:?})",
                    started.elapsed()
                ),
            )
        } else {
            let why = match status {
                None => "a guest kernel did not reach its init within 20 s".to_string(),
                Some(s) => {
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        let _ = std::io::Read::read_to_string(&mut e, &mut err);
                    }
                    format!("QEMU with KVM ended ({s}): {}", tail(&err, 1))
                }
            };
            (Accel::Tcg, format!("TCG (software emulation): /dev/kvm is here but cannot run a stock guest kernel ({why}); guests run 10-50x slower than under KVM (--microvm-accel kvm overrides)"))
        })
    }

    /// The host cgroup around QEMU. The guest's CPU is bounded by its vCPUs (the sandbox's `cpu`
    /// rounded up); the cgroup allows one core more for QEMU's own threads. A tighter CFS quota
    /// throttles QEMU's main loop with its vCPUs, and a TCG guest then stalls in early boot
    /// (measured here: no progress in 60 s at 0.5 and at 1 core).
    fn cgroup_limits(l: &moat_api::SandboxLimits) -> Limits {
        Limits {
            cpu: vcpus(l) as f64 + 1.0,
            memory_bytes: (l.memory_mb + GUEST_OVERHEAD_MB + QEMU_OVERHEAD_MB) << 20,
            // QEMU's own threads (vCPUs, I/O workers); the guest's processes are not host processes.
            pids: 256,
            // The guest sees its own vCPUs.
            cpus: None,
        }
    }

    /// The guest's side of the sandbox's link: its address on the slot's /30, the host's end as
    /// gateway and resolver. None when the sandbox has no network.
    fn guest_network(&self, spec: &SandboxSpec) -> Option<moat_api::guest::GuestNetwork> {
        let net = self.net.as_ref()?;
        spec.network.as_ref()?;
        let (gateway, address) = net.addresses(spec.slot);
        Some(moat_api::guest::GuestNetwork {
            address,
            prefix_len: 30,
            gateway,
            nameserver: gateway,
        })
    }

    fn create_blocking(&self, spec: &SandboxSpec) -> Result<MicrovmState> {
        let qemu = self.qemu()?.to_path_buf();
        let (accel, _) = self.accel()?;
        let vcpus = vcpus(&spec.limits);
        let mem_mb = spec.limits.memory_mb + GUEST_OVERHEAD_MB;
        let restore = match &spec.restore {
            Some(image) => Some((
                image.clone(),
                self.check_image(image, accel, vcpus, mem_mb)?,
            )),
            None => None,
        };
        let dir = self.dir(&spec.id);
        std::fs::create_dir_all(&dir).context("mkdir the VM's directory")?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
        let uid = self.uid(spec.slot);
        let shared = self.shared_initrd()?;
        let config_disk = dir.join("config.img");
        let disk = dir.join("disk.img");
        let _ = std::fs::remove_file(&config_disk);
        let (base, base_layers) = match &restore {
            // The machine of the snapshot: its disks as they were (its memory knows them).
            Some((image, meta)) => {
                let _ = std::fs::remove_file(&disk);
                crate::host::diskimage::copy_sparse(&image.join("disk.img"), &disk)?;
                std::fs::copy(image.join("config.img"), &config_disk)
                    .context("copy the snapshot's configuration disk")?;
                (image.join("base.img"), meta.base_layers)
            }
            None => {
                // A VM coming back over its disk keeps the base that disk was made over.
                let n = match std::fs::read_to_string(dir.join(LAYER_BASE)) {
                    Ok(t) if spec.keep_files && disk.exists() => t
                        .trim()
                        .parse::<usize>()
                        .ok()
                        .filter(|n| *n <= spec.layers.len())
                        .unwrap_or(spec.layers.len()),
                    _ => spec.layers.len(),
                };
                let base = self.base_image(&spec.template_rootfs, &spec.layers[..n])?;
                let config = moat_api::guest::GuestConfig {
                    hostname: spec.hostname.clone(),
                    env: spec.env.clone(),
                    memory_bytes: spec.limits.memory_mb << 20,
                    pids: spec.limits.pids,
                    tmp_mb: spec.limits.tmp_mb,
                    // Whole cores are the VM's vCPUs; a fraction is a quota inside.
                    cpu: if spec.limits.cpu.fract() > 0.0 {
                        spec.limits.cpu
                    } else {
                        0.0
                    },
                    network: self.guest_network(spec),
                };
                std::fs::write(&config_disk, moat_api::guest::encode_config_disk(&config))
                    .context("write the configuration disk")?;
                if !(spec.keep_files && disk.exists()) {
                    let size = if spec.limits.disk_mb > 0 {
                        spec.limits.disk_mb
                    } else {
                        DEFAULT_DISK_MB
                    };
                    image::create_rw_disk(&disk, size, spec.limits.disk_inodes)?;
                }
                (base, n)
            }
        };
        std::fs::set_permissions(&config_disk, std::fs::Permissions::from_mode(0o600))?;
        std::fs::write(dir.join(LAYER_BASE), base_layers.to_string())?;
        if !(spec.keep_files && dir.join(DISK_BASELINE).exists()) {
            std::fs::write(dir.join(DISK_BASELINE), allocated(&disk).to_string())?;
        }
        // QEMU opens nothing of the host by name: the daemon opens every file and binds the sockets,
        // and QEMU gets the descriptors (drives through fd sets, so no permission of the VM's uid on
        // any host path is needed, and a path in its arguments names nothing it could reopen).
        let open = |p: &Path, write: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .open(p)
                .with_context(|| format!("open {}", p.display()))
        };
        let kernel_f = open(&self.guest_kernel.join("vmlinuz"), false)?;
        let initrd_f = open(&shared, false)?;
        let base_f = open(&base, false)?;
        let disk_f = open(&disk, true)?;
        // QEMU opens a writable drive read-only first (to probe it), then read-write: its fd set
        // holds one descriptor of each access mode.
        let disk_ro_f = open(&disk, false)?;
        let config_f = open(&config_disk, false)?;
        let memory_f = match &restore {
            Some((image, _)) => Some(open(&image.join(IMAGE_MEMORY), false)?),
            None => None,
        };
        let run = dir.join("run");
        let _ = std::fs::remove_dir_all(&run);
        std::fs::create_dir(&run)?;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700))?;
        let listen = |name: &str| -> Result<std::os::unix::net::UnixListener> {
            let path = run.join(name);
            let l = std::os::unix::net::UnixListener::bind(&path)
                .with_context(|| format!("bind {}", path.display()))?;
            // The daemon connects only to a socket of the VM's uid (qmp::connect_owned).
            std::os::unix::fs::chown(&path, Some(uid), Some(uid))?;
            Ok(l)
        };
        let agent_l = listen(AGENT_SOCK)?;
        let control_l = listen(CONTROL_SOCK)?;
        let qmp_l = listen(QMP_SOCK)?;
        // The VM's link: a TAP device as the slot's host interface (its descriptor goes to QEMU;
        // the device goes with QEMU's end).
        let tap = match (&self.net, &spec.network) {
            (Some(net), Some(policy)) => Some(net.attach_tap(spec.slot, policy)?),
            _ => None,
        };

        self.cgroups
            .create(&spec.id, &Self::cgroup_limits(&spec.limits))?;
        let log = std::fs::File::create(dir.join("qemu.log")).context("create qemu.log")?;
        use std::os::fd::AsRawFd;
        let fds = QemuFds {
            kernel: kernel_f.as_raw_fd(),
            initrd: initrd_f.as_raw_fd(),
            base: base_f.as_raw_fd(),
            disk: disk_f.as_raw_fd(),
            disk_ro: disk_ro_f.as_raw_fd(),
            config: config_f.as_raw_fd(),
            agent: agent_l.as_raw_fd(),
            control: control_l.as_raw_fd(),
            qmp: qmp_l.as_raw_fd(),
            incoming: memory_f.as_ref().map(AsRawFd::as_raw_fd),
            tap: tap.as_ref().map(AsRawFd::as_raw_fd),
        };
        let mut cmd = Command::new(&qemu);
        cmd.args(qemu_args(&QemuArgs {
            accel,
            vcpus,
            mem_mb,
            fds,
            tsc_khz: match accel {
                Accel::Tcg => host_tsc_khz(),
                Accel::Kvm => None,
            },
        }))
        .env_clear()
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
        self.confine(&mut cmd, &spec.id, uid, accel, fds.all())?;
        let started = std::time::Instant::now();
        let mut child = cmd.spawn().context("start qemu-system-x86_64")?;
        let pid = child.id();
        let state = MicrovmState {
            qemu_pid: pid,
            qemu_start_ticks: proc::start_ticks(pid).unwrap_or(0),
            uid,
            accel,
            base: Some(base),
            base_layers: Some(base_layers),
            vcpus,
            mem_mb,
            net_slot: tap.as_ref().map(|_| spec.slot),
        };
        // QEMU holds the TAP now: the daemon's descriptor is not needed (nor kept, so the device
        // goes with the VM).
        drop(tap);
        // Wait for the guest to open the agent's port (a restored guest: for QEMU to have loaded
        // the snapshot, then let it go on).
        let mut loading = restore.is_some();
        let mut qmp: Option<qmp::Qmp> = None;
        let ready = loop {
            if let Some(status) = child.try_wait()? {
                break Err(anyhow!(
                    "the VM ended while {} ({status}): {}",
                    if restore.is_some() {
                        "restoring its snapshot"
                    } else {
                        "booting"
                    },
                    self.failure_text(&spec.id, None)
                ));
            }
            let deadline = match accel {
                Accel::Tcg => BOOT_TIMEOUT_TCG,
                _ => BOOT_TIMEOUT,
            };
            if started.elapsed() > deadline {
                break Err(anyhow!(
                    "the VM's agent was not up after {deadline:?}: {}",
                    self.failure_text(&spec.id, Some(uid))
                ));
            }
            // One QMP connection for the whole wait (made again only if it fails).
            if qmp.is_none() {
                qmp = self.qmp(&spec.id, uid).ok();
            }
            if let Some(q) = qmp.as_mut() {
                let step = if loading {
                    snapshot_loaded(q).map(|done| {
                        loading = !done;
                        false
                    })
                } else {
                    agent_port_open(q)
                };
                match step {
                    Ok(true) => break Ok(()),
                    Ok(false) => {}
                    Err(e) if loading => break Err(e),
                    Err(_) => qmp = None,
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if let Err(e) = ready {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
        tracing::debug!(sandbox = %spec.id, accel = accel.as_str(), restored = restore.is_some(), "guest up to its agent in {:?}", started.elapsed());
        // The Child handle is dropped; the daemon (a subreaper) reaps QEMU in `stop_instance`.
        Ok(state)
    }

    /// Reads a full-state snapshot's description and checks it can be restored as this sandbox.
    fn check_image(
        &self,
        image: &Path,
        accel: Accel,
        vcpus: u64,
        mem_mb: u64,
    ) -> Result<ImageMeta> {
        let meta: ImageMeta = serde_json::from_slice(
            &std::fs::read(image.join(IMAGE_META))
                .with_context(|| format!("read {}", image.join(IMAGE_META).display()))?,
        )
        .context("the snapshot image's description")?;
        if meta.format != IMAGE_FORMAT {
            bail!(
                "the snapshot image has format {} and this moat reads format {IMAGE_FORMAT}",
                meta.format
            );
        }
        if meta.accel != accel {
            bail!(
                "the snapshot was taken under {} and this host runs microVMs under {}",
                meta.accel.as_str(),
                accel.as_str()
            );
        }
        if (meta.vcpus, meta.mem_mb) != (vcpus, mem_mb) {
            bail!(
                "the snapshot is of a VM with {} vCPUs and {} MiB; this sandbox's limits make {vcpus} and {mem_mb} MiB",
                meta.vcpus,
                meta.mem_mb
            );
        }
        Ok(meta)
    }

    /// Puts QEMU in the sandbox's cgroup and new network/IPC/UTS namespaces, in a session of its own,
    /// as the sandbox's uid with no new privileges (the kvm group only when it uses KVM).
    fn confine(
        &self,
        cmd: &mut Command,
        id: &str,
        uid: u32,
        accel: Accel,
        inherit: Vec<std::os::fd::RawFd>,
    ) -> Result<()> {
        let procs = self.cgroups.procs_files(id)?;
        let kvm_gid: Option<libc::gid_t> = if accel == Accel::Kvm {
            nix::unistd::Group::from_name("kvm")
                .ok()
                .flatten()
                .map(|g| g.gid.as_raw())
        } else {
            None
        };
        // SAFETY: between fork and exec only async-signal-safe system calls (open, write, close,
        // fcntl, setsid, unshare, setgroups, setgid, setuid, prctl) on data prepared before the fork.
        unsafe {
            cmd.pre_exec(move || {
                // The descriptors QEMU is given stay open across exec (the daemon opens all with
                // O_CLOEXEC); they are open in the daemon until after the spawn.
                for &fd in &inherit {
                    if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                crate::host::cgroup::join_from_pre_exec(&procs)?;
                if libc::setsid() < 0
                    || libc::unshare(libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS)
                        < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                let groups: [libc::gid_t; 1] = [kvm_gid.unwrap_or(0)];
                let n = usize::from(kvm_gid.is_some());
                if libc::setgroups(n, groups.as_ptr()) < 0
                    || libc::setgid(uid) < 0
                    || libc::setuid(uid) < 0
                    || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }

    fn qmp(&self, id: &str, uid: u32) -> Result<qmp::Qmp> {
        qmp::Qmp::connect(
            &self.dir(id).join("run").join(QMP_SOCK),
            uid,
            Duration::from_secs(30),
        )
    }

    /// The last lines of the guest's console and of QEMU's stderr, for an error message.
    fn failure_text(&self, id: &str, uid: Option<u32>) -> String {
        let mut parts = Vec::new();
        if let Some(uid) = uid {
            if let Ok(text) = self.qmp(id, uid).and_then(|mut q| {
                q.execute(
                    "ringbuf-read",
                    json!({"device": "console", "size": CONSOLE_RING, "format": "utf8"}),
                )
            }) {
                parts.push(format!("console: {}", tail(text.as_str().unwrap_or(""), 5)));
            }
        }
        let log = std::fs::read_to_string(self.dir(id).join("qemu.log")).unwrap_or_default();
        if !log.trim().is_empty() {
            parts.push(format!("qemu: {}", tail(&log, 3)));
        }
        if parts.is_empty() {
            "no message".into()
        } else {
            parts.join("; ")
        }
    }

    fn stop_instance(&self, id: &str, state: Option<&MicrovmState>) -> Result<()> {
        let mut pids = self.cgroups.pids(id);
        if let Some(s) = state {
            if proc::is_same_process(s.qemu_pid, s.qemu_start_ticks) {
                pids.push(s.qemu_pid);
            }
        }
        pids.sort_unstable();
        pids.dedup();
        let _ = self.cgroups.set_frozen(id, false);
        let killed = self.cgroups.kill_all(id, Duration::from_secs(10));
        for pid in pids {
            crate::host::proc::reap(pid);
        }
        killed?;
        // The TAP device went with QEMU's descriptor; the slot's policy chain is removed here.
        if let (Some(net), Some(slot)) = (&self.net, state.and_then(|s| s.net_slot)) {
            net.detach(slot)?;
        }
        self.cgroups.remove(id)
    }

    fn destroy_blocking(&self, id: &str, state: Option<MicrovmState>) -> Result<()> {
        self.stop_instance(id, state.as_ref())?;
        let dir = self.dir(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e).with_context(|| format!("remove {}", dir.display())),
        }
    }

    fn release_blocking(&self, id: &str, state: Option<MicrovmState>) -> Result<()> {
        self.stop_instance(id, state.as_ref())?;
        super::layer::remove_all_but_layer(&self.dir(id))
    }

    fn qmp_blocking(&self, id: &str, state: &MicrovmState, command: &'static str) -> Result<()> {
        let s = state.clone();
        self.qmp(id, s.uid)?.execute(command, json!({}))?;
        Ok(())
    }

    async fn qmp_async(&self, id: &str, state: &MicrovmState, command: &'static str) -> Result<()> {
        let (this, id, state) = (self.clone(), id.to_string(), state.clone());
        tokio::task::spawn_blocking(move || this.qmp_blocking(&id, &state, command)).await?
    }

    /// Whether the VM is stopped (paused).
    async fn is_paused(&self, id: &str, s: &MicrovmState) -> Result<bool> {
        let (this, id, uid) = (self.clone(), id.to_string(), s.uid);
        tokio::task::spawn_blocking(move || {
            let st = this.qmp(&id, uid)?.execute("query-status", json!({}))?;
            Ok(st["running"].as_bool() == Some(false))
        })
        .await?
    }

    fn control(&self, id: &str, uid: u32) -> control::Target {
        control::Target {
            id: id.to_string(),
            sock: self.dir(id).join("run").join(CONTROL_SOCK),
            uid,
        }
    }

    /// The most file data a VM's writable layer can hold: its disk's size.
    fn layer_bytes_max(&self, id: &str) -> u64 {
        std::fs::metadata(self.dir(id).join("disk.img")).map_or(DEFAULT_DISK_MB << 20, |m| m.len())
    }

    /// Saves the running VM `id` into the empty directory `image`: stops it, has QEMU write its
    /// memory and devices there (a migration to a file), then copies its writable disk (sparse)
    /// and links its base image and configuration disk. The VM stays stopped.
    fn save_blocking(&self, id: &str, s: &MicrovmState, image: &Path) -> Result<()> {
        use std::os::fd::AsFd;
        use std::os::unix::fs::OpenOptionsExt;
        let base = s.base.clone().ok_or_else(|| {
            anyhow!("this VM was started by an older moat; restart it to snapshot it in full")
        })?;
        let dir = self.dir(id);
        let mut q = self.qmp(id, s.uid)?;
        q.execute("stop", json!({}))?;
        let memory = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(image.join(IMAGE_MEMORY))
            .context("create the snapshot's memory file")?;
        q.execute_with_fd("getfd", json!({"fdname": "moat-snapshot"}), memory.as_fd())?;
        // The default bandwidth cap (32 MiB/s) is for live migration over a network.
        q.execute(
            "migrate-set-parameters",
            json!({"max-bandwidth": 64u64 << 30}),
        )?;
        let started = std::time::Instant::now();
        q.execute("migrate", json!({"uri": "fd:moat-snapshot"}))?;
        loop {
            let m = q.execute("query-migrate", json!({}))?;
            match m["status"].as_str().unwrap_or("") {
                "completed" => break,
                "failed" | "cancelled" => bail!(
                    "QEMU could not save the VM: {}",
                    m["error-desc"].as_str().unwrap_or("no reason given")
                ),
                _ if started.elapsed() > SAVE_TIMEOUT => {
                    let _ = q.execute("migrate_cancel", json!({}));
                    bail!("QEMU did not save the VM within {SAVE_TIMEOUT:?}");
                }
                _ => std::thread::sleep(Duration::from_millis(2)),
            }
        }
        drop(memory);
        tracing::debug!(sandbox = %id, took = ?started.elapsed(), "VM memory saved");
        crate::host::diskimage::copy_sparse(&dir.join("disk.img"), &image.join("disk.img"))?;
        std::fs::copy(dir.join("config.img"), image.join("config.img"))
            .context("copy the configuration disk")?;
        // The base image is shared and read-only: a link keeps it for the snapshot (a copy where
        // the image directory is on another filesystem).
        if std::fs::hard_link(&base, image.join("base.img")).is_err() {
            std::fs::copy(&base, image.join("base.img")).context("copy the base image")?;
        }
        let meta = ImageMeta {
            format: IMAGE_FORMAT,
            accel: s.accel,
            vcpus: s.vcpus,
            mem_mb: s.mem_mb,
            base_layers: s.base_layers.unwrap_or(0),
        };
        std::fs::write(image.join(IMAGE_META), serde_json::to_vec_pretty(&meta)?)
            .context("write the snapshot image's description")?;
        Ok(())
    }
}

/// Bytes a (sparse) file has allocated.
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// Whether the guest has opened the serial ports of each of `chardevs`.
fn ports_open(q: &mut qmp::Qmp, chardevs: &[&str]) -> Result<bool> {
    let devs = q.execute("query-chardev", json!({}))?;
    let open = |label: &str| {
        devs.as_array()
            .into_iter()
            .flatten()
            .any(|d| d["label"] == label && d["frontend-open"].as_bool() == Some(true))
    };
    Ok(chardevs.iter().all(|c| open(c)))
}

/// Whether the guest has opened both of the agent's serial ports (its agent serves).
fn agent_port_open(q: &mut qmp::Qmp) -> Result<bool> {
    ports_open(q, &[AGENT_PORT_DEV.1, CONTROL_PORT_DEV.1])
}

/// The VM's two virtio-serial ports.
const AGENT_PORT_DEV: PortDev = ("agentport", "agent", 1, moat_api::guest::AGENT_PORT);
pub(crate) const CONTROL_PORT_DEV: PortDev =
    ("controlport", "control", 2, moat_api::guest::CONTROL_PORT);

fn serial_port((id, chardev, nr, name): PortDev) -> String {
    format!("virtserialport,id={id},chardev={chardev},nr={nr},name={name}")
}

/// Whether QEMU has loaded a snapshot's migration stream; once it has, lets the VM go on.
///
/// The snapshotted guest's agent was in the middle of a connection on each port, and a
/// virtio-serial port has no connection boundaries: a new host connection would read as more of
/// the old one. So both ports are unplugged and plugged in again as soon as the VM goes on (QEMU 7.2
/// crashes on a port unplugged before that), and before any host connects: the guest sees its old
/// ports go (their descriptors fail) and new ones come, which the agent opens afresh.
fn snapshot_loaded(q: &mut qmp::Qmp) -> Result<bool> {
    let status = q.execute("query-status", json!({}))?;
    match status["status"].as_str().unwrap_or("") {
        "inmigrate" => Ok(false),
        "paused" | "postmigrate" | "prelaunch" => {
            q.execute("cont", json!({}))?;
            replug(q, &[AGENT_PORT_DEV, CONTROL_PORT_DEV])?;
            Ok(true)
        }
        "running" => Ok(true),
        other => bail!("the VM is {other:?} after loading its snapshot"),
    }
}

/// A virtio-serial port of a VM: (device id, chardev, port number, name in the guest).
type PortDev = (&'static str, &'static str, u32, &'static str);

/// Unplugs the ports `devs` and plugs them in again (the VM must be running). The guest's agent
/// sees its old ports go (their descriptors fail, ending any connection it was in) and opens the
/// new ones.
fn replug(q: &mut qmp::Qmp, devs: &[PortDev]) -> Result<()> {
    for dev in devs {
        q.execute("device_del", json!({"id": dev.0}))?;
    }
    for (id, chardev, nr, name) in devs {
        // A deleted port lets go of its chardev once it is finalized, a moment later.
        let until = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let added = q.execute(
                "device_add",
                json!({"driver": "virtserialport", "id": id, "chardev": chardev, "nr": nr, "name": name}),
            );
            match added {
                Ok(_) => break,
                Err(e)
                    if std::time::Instant::now() < until
                        && ["in use", "Duplicate"]
                            .iter()
                            .any(|m| format!("{e}").contains(m)) =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e),
            }
        }
    }
    Ok(())
}

/// Which ports of each VM have had no host connection since they were plugged in: a
/// virtio-serial port has no connection boundaries, so a guest that has not yet seen a host
/// connection end (it was stopped when the host closed it, or it has not run since) would read
/// the next one's bytes as more of the old one. A port that may have had a connection is
/// unplugged and plugged in again before the next one ([`replug`]).
#[derive(Clone, Default)]
pub struct PortState(Arc<Mutex<std::collections::HashMap<String, u8>>>);

impl PortState {
    fn bit(dev: PortDev) -> u8 {
        if dev.0 == AGENT_PORT_DEV.0 {
            1
        } else {
            2
        }
    }

    /// Both ports of VM `id` were just plugged in (a boot, a restore).
    fn mark_clean(&self, id: &str) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(id.to_string(), 3);
        }
    }

    fn forget(&self, id: &str) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(id);
        }
    }

    /// Before a new host connection to port `dev` of the VM `id` (whose sockets are in `run`).
    pub fn prepare(&self, run: &Path, id: &str, uid: u32, dev: PortDev) -> Result<()> {
        {
            let mut m = self.0.lock().map_err(|_| anyhow!("port state poisoned"))?;
            let e = m.entry(id.to_string()).or_insert(0);
            if *e & Self::bit(dev) != 0 {
                *e &= !Self::bit(dev);
                return Ok(());
            }
        }
        let mut q = qmp::Qmp::connect(&run.join(QMP_SOCK), uid, Duration::from_secs(30))?;
        // (QEMU 7.2 can crash unplugging a port of a stopped VM.)
        let status = q.execute("query-status", json!({}))?;
        if status["running"].as_bool() != Some(true) {
            if let Ok(mut m) = self.0.lock() {
                m.entry(id.to_string())
                    .and_modify(|e| *e &= !Self::bit(dev));
            }
            bail!("the VM is stopped: its agent cannot be reached until it runs again");
        }
        replug(&mut q, &[dev])?;
        let until = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            if ports_open(&mut q, &[dev.1])? {
                return Ok(());
            }
            if std::time::Instant::now() > until {
                bail!("the VM's agent did not open its port {} again", dev.3);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// The guest kernel's command line (before the agent's own arguments).
const KERNEL_CMDLINE: &str = "console=ttyS0 quiet panic=-1 reboot=t rdinit=/init";

/// The host's TSC frequency in kHz, measured once against the monotonic clock (also the guest's
/// clock rate: see `qemu_args`). Under TCG the guest's
/// TSC is the host's, but the guest kernel calibrates it against the emulated PIT in a tight
/// timing loop; when QEMU's thread is descheduled mid-loop (two busy cores, a CFS quota) calibration
/// fails, the kernel marks the TSC unusable and then waits forever for a timer tick in its delay-loop
/// calibration (measured here: 6 of 6 guests booting at once on 2 cores hung so; with the frequency
/// on the command line, 6 of 6 booted). None off x86-64.
fn host_tsc_khz() -> Option<u64> {
    static KHZ: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *KHZ.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::time::Instant;
            // SAFETY: RDTSC reads the time-stamp counter; it has no memory effects (x86-64 always has it).
            let tsc = || unsafe { core::arch::x86_64::_rdtsc() };
            // Over 250 ms, each counter read taken right after a clock read: a pairing error of some
            // microseconds is some ppm of the guest's clock rate.
            let (t0, c0) = (Instant::now(), tsc());
            std::thread::sleep(Duration::from_millis(250));
            let (t1, c1) = (Instant::now(), tsc());
            let ns = t1.duration_since(t0).as_nanos() as u64;
            let khz = (c1.checked_sub(c0)? as u128 * 1_000_000 / ns.max(1) as u128) as u64;
            (khz > 10_000).then_some(khz)
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    })
}

/// How many guests may boot at once: one per host core (a TCG boot keeps a core busy for seconds;
/// a KVM boot is short, and the bound only smooths bursts).
fn concurrent_boots() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get())
}

/// A VM's vCPUs: the sandbox's `cpu`, rounded up.
fn vcpus(l: &moat_api::SandboxLimits) -> u64 {
    (l.cpu.ceil() as u64).clamp(1, 64)
}

/// What a VM's QEMU command line is made of.
struct QemuArgs {
    accel: Accel,
    vcpus: u64,
    mem_mb: u64,
    fds: QemuFds,
    /// The guest's TSC frequency, told to its kernel under TCG (see `host_tsc_khz`).
    tsc_khz: Option<u64>,
}

/// The descriptors QEMU inherits: every file and socket it uses (it opens no host path).
#[derive(Clone, Copy)]
struct QemuFds {
    kernel: std::os::fd::RawFd,
    initrd: std::os::fd::RawFd,
    base: std::os::fd::RawFd,
    disk: std::os::fd::RawFd,
    /// The same disk, read-only.
    disk_ro: std::os::fd::RawFd,
    config: std::os::fd::RawFd,
    /// Listening unix sockets.
    agent: std::os::fd::RawFd,
    control: std::os::fd::RawFd,
    qmp: std::os::fd::RawFd,
    /// A full-state snapshot's migration stream, to start from (`-incoming`).
    incoming: Option<std::os::fd::RawFd>,
    /// The TAP device of the VM's link; None: its NIC has no peer (no network).
    tap: Option<std::os::fd::RawFd>,
}

impl QemuFds {
    fn all(&self) -> Vec<std::os::fd::RawFd> {
        let mut v = vec![
            self.kernel,
            self.initrd,
            self.base,
            self.disk,
            self.disk_ro,
            self.config,
            self.agent,
            self.control,
            self.qmp,
        ];
        v.extend(self.incoming);
        v.extend(self.tap);
        v
    }
}

/// QEMU's arguments for a VM: the microvm machine with no firmware ROMs, legacy devices or default
/// devices; virtio over MMIO for the two disks and the serial port; the console in a ring buffer.
fn qemu_args(a: &QemuArgs) -> Vec<String> {
    let f = &a.fds;
    let mut v: Vec<String> = vec![
        "-M".into(),
        "microvm,x-option-roms=off,rtc=off,isa-serial=on".into(),
    ];
    match a.accel {
        Accel::Kvm => v.extend(["-accel".into(), "kvm".into(), "-cpu".into(), "host".into()]),
        Accel::Tcg => v.extend([
            "-accel".into(),
            "tcg,thread=multi,tb-size=128".into(),
            "-cpu".into(),
            "max".into(),
        ]),
    }
    v.extend([
        "-m".into(),
        format!("{}M", a.mem_mb),
        "-smp".into(),
        a.vcpus.to_string(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-sandbox".into(),
        "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
        // The kernel and initramfs are read once at start, through the inherited descriptors.
        "-kernel".into(),
        format!("/proc/self/fd/{}", f.kernel),
        "-initrd".into(),
        format!("/proc/self/fd/{}", f.initrd),
        "-append".into(),
        match a.tsc_khz {
            // The guest's TSC is the host's (constant and invariant): it is the clock. Without
            // `tsc=reliable` the kernel's clocksource watchdog, comparing it with jiffies while QEMU's
            // thread waits for a busy host core, marks it unstable and falls back to jiffies, and the
            // guest's clock then runs off (measured: `time.sleep(2)` over in 1.6 s of host time).
            Some(khz) => {
                format!("{KERNEL_CMDLINE} tsc_early_khz={khz} tsc=reliable clocksource=tsc -- --vm")
            }
            None => format!("{KERNEL_CMDLINE} -- --vm"),
        },
        "-chardev".into(),
        format!("ringbuf,id=console,size={CONSOLE_RING}"),
        "-serial".into(),
        "chardev:console".into(),
    ]);
    // Disks: each descriptor in an fd set of its own, which QEMU duplicates instead of opening.
    let disks = [
        (f.base, "base", true, moat_api::guest::BASE_DISK_SERIAL),
        (f.disk, "rw", false, moat_api::guest::RW_DISK_SERIAL),
        (
            f.config,
            "config",
            true,
            moat_api::guest::CONFIG_DISK_SERIAL,
        ),
    ];
    for (set, (fd, id, readonly, serial)) in (1..).zip(disks) {
        v.extend(["-add-fd".into(), format!("fd={fd},set={set}")]);
        if !readonly {
            v.extend(["-add-fd".into(), format!("fd={},set={set}", f.disk_ro)]);
        }
        v.extend([
            "-drive".into(),
            format!(
                "id={id},file=/dev/fdset/{set},format=raw,if=none,aio=threads{}",
                if readonly {
                    ",readonly=on"
                } else {
                    // No image locks: the VM's disk is its own, and QEMU could not take its
                    // write lock back after a snapshot (its fd set holds two open files, which
                    // lock each other out).
                    ",discard=unmap,file.locking=off"
                }
            ),
            "-device".into(),
            format!("virtio-blk-device,drive={id},serial={serial}"),
        ]);
    }
    v.extend([
        "-device".into(),
        "virtio-serial-device".into(),
        "-chardev".into(),
        format!("socket,id=agent,fd={},server=on,wait=off", f.agent),
        "-device".into(),
        serial_port(AGENT_PORT_DEV),
        "-chardev".into(),
        format!("socket,id=control,fd={},server=on,wait=off", f.control),
        "-device".into(),
        serial_port(CONTROL_PORT_DEV),
        "-chardev".into(),
        format!("socket,id=qmp,fd={},server=on,wait=off", f.qmp),
        "-mon".into(),
        "chardev=qmp,mode=control".into(),
    ]);
    // Every VM has the same devices, networked or not, so that any VM can be restored from any
    // full-state snapshot (a migration stream names its devices): one virtio-net device, whose
    // peer is the sandbox's TAP device or none (frames to it go nowhere).
    match f.tap {
        Some(fd) => v.extend([
            "-netdev".into(),
            format!("tap,id=net0,fd={fd},vhost=off"),
            "-device".into(),
            "virtio-net-device,netdev=net0".into(),
        ]),
        None => v.extend(["-device".into(), "virtio-net-device".into()]),
    }
    if let Some(fd) = f.incoming {
        v.extend(["-incoming".into(), format!("fd:{fd}")]);
    }
    v
}

#[async_trait::async_trait]
impl Tier for MicrovmTier {
    type State = MicrovmState;

    fn isolation(&self) -> Isolation {
        Isolation::Microvm
    }

    fn info(&self) -> TierInfo {
        let why = self.unavailable();
        let accel = self.accel.lock().ok().and_then(|a| a.clone());
        TierInfo {
            isolation: Isolation::Microvm,
            available: why.is_none(),
            note: Some(match (why, accel) {
                (Some(why), _) => why,
                (None, Some((_, how))) => format!("QEMU microvm, {how}"),
                (None, None) => {
                    "QEMU microvm; the accelerator (KVM or TCG) is chosen at the first VM".into()
                }
            }),
        }
    }

    fn capabilities(&self) -> TierCapabilities {
        TierCapabilities {
            // The sandbox's processes run in a cgroup inside the guest; the host's counts QEMU's.
            oom_counter_inside: Some(format!("{}/memory.events", moat_api::guest::SANDBOX_CGROUP)),
            // The guest's processes are no host processes.
            process_limit_inside: true,
            // Guest RAM and vCPUs are the VM's own, fixed at boot, and so are the guest's inner
            // cgroup limits (memory, CPU fraction, processes): a create asking for others boots a
            // VM of its own.
            limits_fixed_at_start: true,
            checkpoint_ends_connections: false,
            min_memory_mb: MIN_MEMORY_MB,
        }
    }

    async fn create(&self, spec: &SandboxSpec) -> Result<MicrovmState> {
        let _boot = self
            .boot_gate
            .acquire()
            .await
            .context("the microvm tier is shutting down")?;
        let this = self.clone();
        let spec2 = spec.clone();
        let state = super::start_or_clean(self, spec, move || this.create_blocking(&spec2)).await?;
        self.ports.mark_clean(&spec.id);
        let t = self.control(&spec.id, state.uid);
        let up = async {
            // The guest's wall clock: the host's (under TCG the guest has none; a restored guest's
            // is the snapshot's).
            self.controls
                .set_clock(&t)
                .await
                .context("set the guest's clock")?;
            if spec.restore.is_some() {
                // The snapshotted guest had the snapshotted sandbox's address (or none): it gets
                // this sandbox's, and forgets the old link's neighbours and routes.
                self.controls
                    .set_network(&t, self.guest_network(spec))
                    .await
                    .context("configure the restored guest's network")?;
                // The snapshot froze the sandbox's processes inside the guest (see `checkpoint`).
                self.controls
                    .set_frozen(&t, false)
                    .await
                    .context("thaw the restored sandbox's processes")?;
            }
            anyhow::Ok(())
        };
        if let Err(e) = up.await {
            let _ = if spec.keep_files {
                self.release(&spec.id, Some(&state)).await
            } else {
                self.destroy(&spec.id, Some(&state)).await
            };
            return Err(e);
        }
        Ok(state)
    }

    fn sandbox_note(&self, state: &MicrovmState) -> Option<String> {
        let s = state;
        (s.accel == Accel::Tcg).then(|| {
            // The tier's own note says why (the KVM probe's finding, or --microvm-accel tcg).
            match self.accel.lock().ok().and_then(|a| a.clone()) {
                Some((Accel::Tcg, why)) => why,
                _ => "TCG (software emulation): guests run 10-50x slower than under KVM".into(),
            }
        })
    }

    fn last_words(&self, id: &str, state: Option<&MicrovmState>) -> Vec<String> {
        // The guest's console (the agent's stderr, the guest kernel's messages) while QEMU lives,
        // then QEMU's own stderr.
        let mut out = Vec::new();
        if let Some(s) = state.filter(|s| proc::is_same_process(s.qemu_pid, s.qemu_start_ticks)) {
            if let Ok(text) = self.qmp(id, s.uid).and_then(|mut q| {
                q.execute(
                    "ringbuf-read",
                    json!({"device": "console", "size": CONSOLE_RING, "format": "utf8"}),
                )
            }) {
                out = super::tail_lines(text.as_str().unwrap_or(""), 10);
            }
        }
        out.extend(super::log_tail(&self.dir(id).join("qemu.log"), 5));
        out
    }

    async fn connect(&self, id: &str, state: &MicrovmState) -> Result<AgentStream> {
        let s = state.clone();
        let run = self.dir(id).join("run");
        let (ports, id) = (self.ports.clone(), id.to_string());
        let std = tokio::task::spawn_blocking(move || {
            ports.prepare(&run, &id, s.uid, AGENT_PORT_DEV)?;
            qmp::connect_owned(&run.join(AGENT_SOCK), s.uid)
        })
        .await??;
        std.set_nonblocking(true)?;
        Ok(Box::pin(tokio::net::UnixStream::from_std(std)?))
    }

    fn watched_process(&self, state: &MicrovmState) -> Option<(u32, u64)> {
        Some((state.qemu_pid, state.qemu_start_ticks))
    }

    async fn is_alive(&self, _id: &str, state: &MicrovmState) -> proc::Liveness {
        proc::liveness(state.qemu_pid, state.qemu_start_ticks)
    }

    async fn set_limits(
        &self,
        id: &str,
        _state: &MicrovmState,
        limits: &moat_api::SandboxLimits,
    ) -> Result<()> {
        // CPU time is the host cgroup's; guest memory and vCPUs are fixed when the VM boots.
        self.cgroups.create(id, &Self::cgroup_limits(limits))
    }

    async fn usage(&self, id: &str, _state: &MicrovmState) -> Result<TierUsage> {
        let dir = self.dir(id);
        let baseline: u64 = std::fs::read_to_string(dir.join(DISK_BASELINE))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        let disk = allocated(&dir.join("disk.img")).saturating_sub(baseline);
        Ok(TierUsage::new(self.cgroups.usage(id), (disk, 0)))
    }

    async fn pause(&self, id: &str, state: &MicrovmState) -> Result<()> {
        // The sandbox's processes are frozen inside first, so that a snapshot of the paused VM can
        // run the guest's agent without running them. A guest whose agent does not answer is
        // stopped all the same.
        let s = state.clone();
        let freeze = tokio::time::timeout(
            Duration::from_secs(15),
            self.controls.set_frozen(&self.control(id, s.uid), true),
        )
        .await
        .unwrap_or_else(|_| Err(anyhow!("no answer in 15 s")));
        if let Err(e) = freeze {
            tracing::warn!(sandbox = %id, "pausing a VM whose processes could not be frozen inside: {e:#}");
        }
        self.qmp_async(id, state, "stop").await
    }

    async fn resume(&self, id: &str, state: &MicrovmState) -> Result<()> {
        self.qmp_async(id, state, "cont").await?;
        let s = state.clone();
        let t = self.control(id, s.uid);
        // The guest's clock stood still while the VM was stopped: it is set again before the
        // sandbox's processes run.
        self.controls
            .set_clock(&t)
            .await
            .context("set the resumed guest's clock")?;
        self.controls
            .set_frozen(&t, false)
            .await
            .context("thaw the sandbox's processes")
    }

    fn layers_under_writable(&self, state: &MicrovmState) -> Option<usize> {
        state.base_layers
    }

    async fn export_changes(
        &self,
        id: &str,
        state: &MicrovmState,
        dest: &Path,
    ) -> Result<Duration> {
        let s = state.clone();
        // Only the guest reads its disk: a paused VM runs again for the export, its processes
        // still frozen inside (pause froze them).
        let paused = self.is_paused(id, &s).await?;
        if paused {
            self.qmp_async(id, state, "cont").await?;
        }
        let started = std::time::Instant::now();
        let exported = self
            .controls
            .export_layer(
                &self.control(id, s.uid),
                true,
                dest,
                self.layer_bytes_max(id),
            )
            .await;
        let frozen_for = started.elapsed();
        if paused {
            self.qmp_async(id, state, "stop").await?;
        }
        exported.context("export the VM's writable layer")?;
        Ok(frozen_for)
    }

    fn host_network(&self) -> Option<&crate::host::net::Network> {
        self.net.as_ref()
    }

    async fn restore_network(&self, _live: &BTreeMap<u32, moat_api::NetworkPolicy>) -> Result<()> {
        // The host's sandbox network (one nft table, one address space) is shared with the container
        // tier, which reinstalls it with the policies of every tier's live sandboxes. A VM's TAP
        // device lives as long as its QEMU.
        Ok(())
    }

    fn full_snapshot_unsupported(&self) -> Option<String> {
        self.unavailable()
    }

    async fn checkpoint(
        &self,
        id: &str,
        state: &MicrovmState,
        changes: &Path,
        image: &Path,
    ) -> Result<(Duration, MicrovmState), TierError> {
        let s = state.clone();
        let t = self.control(id, s.uid);
        let paused = self.is_paused(id, &s).await?;
        if paused {
            self.qmp_async(id, state, "cont").await?;
        }
        let started = std::time::Instant::now();
        // One instant for both: the processes stay frozen inside from the layer's export until the
        // VM has stopped and been saved; the saved memory holds them frozen (a restore thaws them).
        let saved = async {
            self.controls.set_frozen(&t, true).await?;
            self.controls
                .export_layer(&t, false, changes, self.layer_bytes_max(id))
                .await
                .context("export the VM's writable layer")?;
            let (this, id, s, image) =
                (self.clone(), id.to_string(), s.clone(), image.to_path_buf());
            tokio::task::spawn_blocking(move || this.save_blocking(&id, &s, &image)).await?
        }
        .await;
        // Whatever happened, the VM goes on as it was: running with its processes thawed, or paused.
        let back = async {
            if paused {
                self.qmp_async(id, state, "stop").await
            } else {
                self.qmp_async(id, state, "cont").await?;
                // The clock stood still while the VM was stopped for its save.
                self.controls.set_clock(&t).await?;
                self.controls.set_frozen(&t, false).await
            }
        }
        .await;
        let stopped_for = started.elapsed();
        saved?;
        back.context("let the VM go on after its snapshot")?;
        Ok((stopped_for, state.clone()))
    }

    async fn release(&self, id: &str, state: Option<&MicrovmState>) -> Result<()> {
        self.controls.forget(id).await;
        self.ports.forget(id);
        let state = state.cloned();
        let (this, id) = (self.clone(), id.to_string());
        tokio::task::spawn_blocking(move || this.release_blocking(&id, state)).await?
    }

    async fn destroy(&self, id: &str, state: Option<&MicrovmState>) -> Result<()> {
        self.controls.forget(id).await;
        self.ports.forget(id);
        let state = state.cloned();
        let (this, id) = (self.clone(), id.to_string());
        tokio::task::spawn_blocking(move || this.destroy_blocking(&id, state)).await?
    }

    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>> {
        let names: Vec<String> = std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .collect();
        super::destroy_unowned(self, names, live).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FDS: QemuFds = QemuFds {
        kernel: 10,
        initrd: 11,
        base: 12,
        disk: 13,
        disk_ro: 17,
        config: 14,
        agent: 15,
        control: 18,
        qmp: 16,
        incoming: None,
        tap: None,
    };

    #[test]
    fn qemu_runs_sandboxed_with_only_the_devices_it_needs() {
        let args = qemu_args(&QemuArgs {
            accel: Accel::Tcg,
            vcpus: 2,
            mem_mb: 608,
            fds: FDS,
            tsc_khz: Some(2_596_150),
        });
        let after = |flag: &str| -> Vec<&str> {
            args.windows(2)
                .filter(|w| w[0] == flag)
                .map(|w| w[1].as_str())
                .collect()
        };
        assert_eq!(
            after("-M"),
            ["microvm,x-option-roms=off,rtc=off,isa-serial=on"]
        );
        assert_eq!(after("-accel"), ["tcg,thread=multi,tb-size=128"]);
        assert_eq!(after("-m"), ["608M"]);
        assert_eq!(after("-smp"), ["2"]);
        let sandbox = after("-sandbox");
        assert!(sandbox[0].starts_with("on,"));
        for deny in [
            "spawn=deny",
            "elevateprivileges=deny",
            "resourcecontrol=deny",
        ] {
            assert!(sandbox[0].contains(deny), "{sandbox:?}");
        }
        assert!(args.iter().any(|a| a == "-nodefaults"));
        // Nothing is opened by a host path: files come as inherited descriptors, drives as fd sets.
        assert_eq!(after("-kernel"), ["/proc/self/fd/10"]);
        assert_eq!(after("-initrd"), ["/proc/self/fd/11"]);
        assert_eq!(
            after("-add-fd"),
            ["fd=12,set=1", "fd=13,set=2", "fd=17,set=2", "fd=14,set=3"]
        );
        let drives = after("-drive");
        assert!(drives[0].contains("file=/dev/fdset/1") && drives[0].contains("readonly=on"));
        assert!(drives[1].contains("file=/dev/fdset/2") && !drives[1].contains("readonly"));
        assert!(drives[2].contains("file=/dev/fdset/3") && drives[2].contains("readonly=on"));
        let devices = after("-device");
        for serial in ["moat-base", "moat-rw", "moat-config"] {
            assert!(devices
                .iter()
                .any(|d| d.ends_with(&format!("serial={serial}"))));
        }
        let chardevs = after("-chardev");
        assert!(chardevs.contains(&"socket,id=agent,fd=15,server=on,wait=off"));
        assert!(chardevs.contains(&"socket,id=control,fd=18,server=on,wait=off"));
        assert!(chardevs.contains(&"socket,id=qmp,fd=16,server=on,wait=off"));
        assert!(devices.contains(&"virtserialport,id=agentport,chardev=agent,nr=1,name=moat.agent"));
        assert!(devices
            .contains(&"virtserialport,id=controlport,chardev=control,nr=2,name=moat.control"));
        assert_eq!(after("-mon"), ["chardev=qmp,mode=control"]);
        assert!(after("-incoming").is_empty());
        assert!(!args
            .iter()
            .any(|a| a.starts_with('/') && !a.starts_with("/proc/self/fd/")));
        assert!(after("-append")[0]
            .ends_with(" tsc_early_khz=2596150 tsc=reliable clocksource=tsc -- --vm"));
        // Under KVM the host CPU is passed through.
        let kvm = qemu_args(&QemuArgs {
            accel: Accel::Kvm,
            vcpus: 1,
            mem_mb: 128,
            fds: FDS,
            tsc_khz: None,
        });
        assert!(kvm.windows(2).any(|w| w[0] == "-accel" && w[1] == "kvm"));
        assert!(kvm.windows(2).any(|w| w[0] == "-cpu" && w[1] == "host"));
        assert!(!kvm.iter().any(|a| a.contains("tsc")));
        // A restore reads the snapshot's migration stream from an inherited descriptor too.
        let restore = qemu_args(&QemuArgs {
            accel: Accel::Tcg,
            vcpus: 1,
            mem_mb: 128,
            fds: QemuFds {
                incoming: Some(19),
                ..FDS
            },
            tsc_khz: None,
        });
        assert!(restore
            .windows(2)
            .any(|w| w[0] == "-incoming" && w[1] == "fd:19"));
        assert_eq!(
            QemuFds {
                incoming: Some(19),
                ..FDS
            }
            .all()
            .len(),
            10
        );
        // Every VM has one virtio-net device (so any VM restores from any snapshot): without a
        // network it has no peer; with one, its peer is the inherited TAP descriptor.
        assert!(after("-netdev").is_empty());
        assert_eq!(
            devices
                .iter()
                .filter(|d| d.starts_with("virtio-net-device"))
                .collect::<Vec<_>>(),
            [&"virtio-net-device"]
        );
        let tap = QemuFds {
            tap: Some(20),
            ..FDS
        };
        let networked = qemu_args(&QemuArgs {
            accel: Accel::Tcg,
            vcpus: 1,
            mem_mb: 128,
            fds: tap,
            tsc_khz: None,
        });
        assert!(networked
            .windows(2)
            .any(|w| w[0] == "-netdev" && w[1] == "tap,id=net0,fd=20,vhost=off"));
        assert!(networked
            .windows(2)
            .any(|w| w[0] == "-device" && w[1] == "virtio-net-device,netdev=net0"));
        assert!(tap.all().contains(&20));
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_host_tsc_frequency_is_measured() {
        // Every x86-64 host this runs on has a TSC between 100 MHz and 10 GHz.
        let khz = host_tsc_khz().expect("a TSC frequency");
        assert!((100_000..10_000_000).contains(&khz), "{khz} kHz");
    }

    #[test]
    fn accel_choice_parses() {
        assert_eq!("auto".parse::<AccelChoice>(), Ok(AccelChoice::Auto));
        assert_eq!(
            "tcg".parse::<AccelChoice>(),
            Ok(AccelChoice::Force(Accel::Tcg))
        );
        assert_eq!(
            "kvm".parse::<AccelChoice>(),
            Ok(AccelChoice::Force(Accel::Kvm))
        );
        assert!("hvf".parse::<AccelChoice>().is_err());
    }
}
