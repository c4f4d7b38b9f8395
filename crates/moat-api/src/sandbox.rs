//! Sandbox lifecycle types.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Isolation tier of a sandbox, chosen per sandbox at create.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// Linux namespaces, user-namespace root remap, cgroups and overlayfs (the fast default).
    #[default]
    Container,
    /// gVisor's user-space kernel (runsc).
    Gvisor,
    /// A QEMU microvm with its own guest kernel.
    Microvm,
}

impl Isolation {
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Container => "container",
            Isolation::Gvisor => "gvisor",
            Isolation::Microvm => "microvm",
        }
    }
}

impl std::str::FromStr for Isolation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "container" => Ok(Isolation::Container),
            "gvisor" => Ok(Isolation::Gvisor),
            "microvm" => Ok(Isolation::Microvm),
            other => Err(format!(
                "unknown isolation {other:?} (container, gvisor, microvm)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Being created; not yet reachable.
    Starting,
    /// Its agent answers; commands and files work.
    Running,
    /// Frozen; resumes where it stopped.
    Paused,
    /// Being torn down.
    Stopping,
    /// Gone, for a reason other than a request (`ended` says which); kept 24 h so that a client
    /// can learn why. A deleted sandbox is simply not found.
    Ended,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Paused => "paused",
            SandboxState::Stopping => "stopping",
            SandboxState::Ended => "ended",
        }
    }
}

impl std::str::FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "starting" => Ok(SandboxState::Starting),
            "running" => Ok(SandboxState::Running),
            "paused" => Ok(SandboxState::Paused),
            "stopping" => Ok(SandboxState::Stopping),
            "ended" => Ok(SandboxState::Ended),
            other => Err(format!(
                "unknown state {other:?} (starting, running, paused, stopping, ended)"
            )),
        }
    }
}

/// `POST /v1/sandboxes`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Template name; the daemon's default template (`base`) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Seconds until the sandbox is killed, counted from when it is ready (a microVM's boot does
    /// not use them up); the daemon default (300) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Environment variables every command in the sandbox starts with.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Labels for filtering in list; not visible inside the sandbox.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// CPU limit in cores, fractional allowed (e.g. 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// Memory limit in MiB (hard limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// Isolation tier; `container` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation: Option<Isolation>,
    /// Largest number of processes and threads (cgroup pids limit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<u64>,
    /// Open files per process (RLIMIT_NOFILE, soft and hard).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nofile: Option<u64>,
    /// Size of the writable layer (everything written outside /tmp) in MiB; 0: no disk quota.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    /// Number of files and directories the writable layer can hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_inodes: Option<u64>,
    /// Size of /tmp (a tmpfs, counted against the memory limit) in MiB; 0: /tmp is on the writable layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tmp_mb: Option<u64>,
    /// Output each process keeps for re-attach and slow readers, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<u64>,
    /// Timeout in seconds of commands that give none; 0: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_timeout: Option<u64>,
    /// Seconds without an API request for the sandbox after which it is killed; 0: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout: Option<u64>,
    /// Start from this snapshot (id or name) instead of a template's clean state; its template, and
    /// its limits and environment unless given here, apply.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// `kill` (default) or `pause` when the timeout or idle timeout passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<crate::OnTimeout>,
    /// Egress policy (see docs/network.md); the daemon's default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::NetworkPolicy>,
    /// Let anyone reach the sandbox's exposed ports (preview URLs) without its access token
    /// (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_public_traffic: Option<bool>,
    /// Resume the sandbox when it is paused (by `pause`, or at its timeout or idle timeout with
    /// `on_timeout: pause`) and a request for it comes: a command, a file, code, a port's traffic
    /// (default false: such a request is a 409).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
    /// Secrets kept out of the sandbox (docs/secrets.md): each is `$NAME` = a placeholder inside,
    /// and its value goes on the wire only in TLS requests to its hosts. Needs sandbox networking.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<crate::SecretSpec>,
}

/// The resource limits of a sandbox, as set at create (defaults from the daemon's configuration).
/// See docs/resources.md.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct SandboxLimits {
    /// CPU cores (CFS quota).
    pub cpu: f64,
    /// Hard memory limit in MiB, no swap.
    pub memory_mb: u64,
    /// Processes and threads.
    pub pids: u64,
    /// Open files per process.
    pub nofile: u64,
    /// Writable layer size in MiB; 0: no quota.
    pub disk_mb: u64,
    /// Writable layer inodes; 0: no quota.
    pub disk_inodes: u64,
    /// /tmp tmpfs size in MiB; 0: /tmp is on the writable layer.
    pub tmp_mb: u64,
    /// Per-process output buffer in bytes.
    pub output_bytes: u64,
    /// Default command timeout in seconds; 0: none.
    pub command_timeout: u64,
    /// Idle timeout in seconds; 0: none.
    pub idle_timeout: u64,
}

/// `GET /v1/sandboxes/{id}/stats`: live usage, read on the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxStats {
    pub id: String,
    /// CPU time used by all of the sandbox's processes, microseconds.
    pub cpu_usage_us: u64,
    /// Average cores used since the previous stats request for this sandbox (or over a short sample
    /// on the first).
    pub cpu_cores: f64,
    /// Memory in use now (including page cache and tmpfs), bytes.
    pub memory_bytes: u64,
    /// Highest memory use seen, bytes.
    pub memory_peak_bytes: u64,
    /// Processes and threads now.
    pub pids: u64,
    /// Bytes used in the writable layer.
    pub disk_bytes: u64,
    /// Inodes used in the writable layer.
    pub disk_inodes: u64,
    /// How many processes the OOM killer ended.
    pub oom_kills: u64,
    pub limits: SandboxLimits,
}

/// A sandbox as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Sandbox {
    /// Unguessable id, `sbx_` followed by 26 base32 characters.
    pub id: String,
    pub template: String,
    pub isolation: Isolation,
    pub state: SandboxState,
    /// RFC 3339.
    pub created_at: String,
    /// RFC 3339; the sandbox is killed at this time unless the timeout is extended.
    pub expires_at: String,
    pub metadata: BTreeMap<String, String>,
    /// Names of the environment variables set at create (values are not echoed back).
    pub env_keys: Vec<String>,
    /// CPU limit in cores.
    pub cpu: f64,
    /// Memory limit in MiB.
    pub memory_mb: u64,
    /// Hostname inside the sandbox.
    pub hostname: String,
    /// Every resource limit (`cpu` and `memory_mb` repeat the fields above).
    #[serde(default)]
    pub limits: SandboxLimits,
    /// What happens at the timeout: `kill` or `pause`.
    #[serde(default)]
    pub on_timeout: crate::OnTimeout,
    /// The snapshot the sandbox started from (or was last reset to); absent for a template's clean
    /// state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Its address and egress policy; absent when the daemon runs without sandbox networking
    /// (`--network none`: loopback only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::NetworkInfo>,
    /// Token that opens the sandbox's ports (`X-Moat-Access-Token` header or `moat_access_token`
    /// query parameter) to someone without the API key; see docs/ports.md.
    #[serde(default)]
    pub access_token: String,
    /// Ports reachable without any token.
    #[serde(default)]
    pub allow_public_traffic: bool,
    /// A request for the sandbox while it is paused resumes it.
    #[serde(default)]
    pub auto_resume: bool,
    /// How the sandbox's isolation runs on this host, where that is worth a warning: a microVM
    /// under TCG (software emulation, where the host's KVM cannot run the guest) says so here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isolation_note: Option<String>,
    /// Why it ended, when `state` is `ended` (it ended without a request: its timeout, the OOM
    /// killer, its agent lost, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<Cause>,
    /// What went wrong in it while it ran without ending it, the latest of each reason: a process
    /// the OOM killer ended (`oom`), a fork refused at its pids limit (`pids_exhausted`), its disk
    /// quota full (`disk_full`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Cause>,
}

/// Why a sandbox ended, or what degraded it, without anyone asking (docs/failures.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The kernel's OOM killer ended a process at the memory limit (the sandbox's first process,
    /// its Sentry or its VM: the sandbox).
    Oom,
    /// A fork or thread was refused at the pids limit.
    PidsExhausted,
    /// The disk quota is full (or the host's disk is down to its reserve).
    DiskFull,
    /// Its timeout passed.
    Timeout,
    /// Its idle timeout passed with no API request for it.
    Idle,
    /// Its agent (the sandbox's first process) exited or was killed.
    AgentLost,
    /// Its processes ended with the host or the daemon's restart.
    HostRestart,
    /// The node it ran on left the cluster.
    NodeLost,
    /// A policy of the daemon ended it.
    KilledByPolicy,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Oom => "oom",
            Reason::PidsExhausted => "pids_exhausted",
            Reason::DiskFull => "disk_full",
            Reason::Timeout => "timeout",
            Reason::Idle => "idle",
            Reason::AgentLost => "agent_lost",
            Reason::HostRestart => "host_restart",
            Reason::NodeLost => "node_lost",
            Reason::KilledByPolicy => "killed_by_policy",
        }
    }
}

/// A sandbox's `ended` or one of its `conditions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Cause {
    pub reason: Reason,
    /// RFC 3339: when it happened (for a condition, the latest time).
    pub at: String,
    /// What happened, in words (for `oom`, which process).
    pub message: String,
    /// For `oom`: the process the OOM killer ended (host pid, name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
    /// For a condition: how many times it happened.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub count: u64,
    /// For an end: the last lines of the sandbox's own log (its agent's, its VM's console).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub log: Vec<String>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/timeout`: the sandbox now expires `timeout` seconds from now.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutRequest {
    pub timeout: u64,
}

/// `GET /healthz`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    pub status: String,
    pub version: String,
    pub tiers: Vec<TierInfo>,
    /// The warm pool: sandboxes started ahead of demand; absent when the pool is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolInfo>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolInfo {
    /// Template the pool keeps ready (creates of other templates start from nothing).
    pub template: String,
    /// How many the daemon keeps ready.
    pub size: u32,
    /// How many are ready now.
    pub ready: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TierInfo {
    pub isolation: Isolation,
    pub available: bool,
    /// Why the tier is unavailable, or a warning about how it runs here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// `GET /v1/system/df`: disk used by templates, snapshot layers and sandboxes' writable layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DiskUsage {
    /// Templates (a spec-built template's bytes are those of its layers, which `layers` counts).
    pub templates: Vec<DiskUsageItem>,
    /// The layer store: every snapshot, template and build layer once, however many snapshots,
    /// templates and sandboxes share it.
    pub layers: DiskUsageItem,
    /// The build cache: entries (`count`) and the bytes of their layers (part of `layers`; `moat
    /// system prune` empties it).
    #[serde(default)]
    pub build_cache: DiskUsageItem,
    pub snapshots: u64,
    /// Writable layers of sandboxes (what they wrote).
    pub sandboxes: DiskUsageItem,
    /// Sum of the above, bytes.
    pub total_bytes: u64,
    /// The filesystem of the daemon's data directory: its space, the reserve the daemon keeps, and
    /// the sandboxes' quotas (which may add up to more than it has: images take space as written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<FilesystemUsage>,
}

/// `GET /v1/system/df`'s `filesystem`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FilesystemUsage {
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Kept free for the daemon: sandboxes' disks are capped so that none can take it.
    pub reserve_bytes: u64,
    /// Under twice the reserve free: creates, forks, snapshots and builds are refused (507) and
    /// what is left above the reserve is shared out between the sandboxes.
    pub low: bool,
    /// Sum of the disk quotas of the sandboxes.
    pub quota_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DiskUsageItem {
    pub name: String,
    /// How many (layers, sandboxes); 1 for a template.
    pub count: u64,
    pub bytes: u64,
}
