//! Isolation tiers. One trait, one module per tier; nothing tier-specific lives outside its module,
//! and a tier knows nothing of a sandbox's lifecycle (that is `sandboxes`).
//!
//! A tier turns a [`SandboxSpec`] into a running agent reachable over one byte stream, and tears it
//! down again. Each tier implements [`Tier`] with a typed state of its own ([`Tier::State`]): what
//! it must remember to find its sandbox after a daemon restart. The daemon stores that state as
//! JSON with the sandbox and holds tiers as [`IsolationTier`] objects whose state is that stored
//! value: only the tier decodes it (the blanket implementation below), so nothing else depends on
//! its shape.

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use anyhow::Result;
use moat_api::{Isolation, SandboxLimits, TierInfo};
use serde::de::DeserializeOwned;
use serde::Serialize;

pub mod container;
#[cfg(test)]
pub mod fake;
pub mod gvisor;
pub mod layer;
pub mod microvm;

/// Host ids each sandbox's user namespace maps (0..65535 inside), from the uid range of its slot.
pub const IDS_PER_SANDBOX: u32 = 65_536;
/// Largest number of sandbox slots (each a host uid range and a network address; the ranges stay
/// below 2^32).
pub const MAX_SLOTS: u32 = 4096;

/// Everything a tier needs to start a sandbox.
#[derive(Debug, Clone)]
pub struct SandboxSpec {
    pub id: String,
    pub hostname: String,
    /// Read-only root filesystem of the template.
    pub template_rootfs: PathBuf,
    /// Read-only layers stacked over the template (a snapshot's), bottom first.
    pub layers: Vec<PathBuf>,
    /// The environment the agent (and so every process) starts with.
    pub env: BTreeMap<String, String>,
    pub limits: SandboxLimits,
    /// Index of the sandbox's host uid/gid range (and of its network address).
    pub slot: u32,
    /// Egress policy; None: loopback only.
    pub network: Option<moat_api::NetworkPolicy>,
    /// Start over the writable layer an earlier instance left ([`Tier::release`]) instead of
    /// an empty one: a paused sandbox whose processes ended with the host comes back with its files.
    pub keep_files: bool,
    /// A full-state snapshot's image ([`Tier::checkpoint`]) to continue from: the sandbox's
    /// processes go on from where they were, over `layers`. None: the agent starts afresh.
    pub restore: Option<PathBuf>,
}

/// What a tier's operations fail with.
#[derive(Debug, thiserror::Error)]
pub enum TierError {
    /// The sandbox's own state rules the operation out (not a failure of the host): a full-state
    /// snapshot of a sandbox holding sockets the tier cannot save. The API answers 409.
    #[error("{0}")]
    Refused(String),
    /// The operation is not possible on this tier or host (sandbox networking is off, no runsc).
    #[error("{0}")]
    Unsupported(String),
    /// The host failed, with the cause.
    #[error("{0:#}")]
    Failed(#[from] anyhow::Error),
}

impl From<tokio::task::JoinError> for TierError {
    fn from(e: tokio::task::JoinError) -> TierError {
        TierError::Failed(anyhow::anyhow!("a tier worker thread: {e}"))
    }
}

impl From<std::io::Error> for TierError {
    fn from(e: std::io::Error) -> TierError {
        TierError::Failed(e.into())
    }
}

/// What a sandbox uses now.
#[derive(Debug, Clone, Copy, Default)]
pub struct TierUsage {
    pub cpu_usage_us: u64,
    pub memory_bytes: u64,
    pub memory_peak_bytes: u64,
    pub pids: u64,
    pub oom_kills: u64,
    pub disk_bytes: u64,
    pub disk_inodes: u64,
    /// What its writable layer can still take (its quota image's available bytes); None where the
    /// host cannot tell (no quota image, a VM's own filesystem).
    pub disk_free_bytes: Option<u64>,
}

impl TierUsage {
    /// A sandbox's cgroup usage and its writable layer's (bytes, inodes).
    pub fn new(cgroup: crate::host::cgroup::Usage, (disk_bytes, disk_inodes): (u64, u64)) -> Self {
        TierUsage {
            cpu_usage_us: cgroup.cpu_usage_us,
            memory_bytes: cgroup.memory_bytes,
            memory_peak_bytes: cgroup.memory_peak_bytes,
            pids: cgroup.pids,
            oom_kills: cgroup.oom_kills,
            disk_bytes,
            disk_inodes,
            disk_free_bytes: None,
        }
    }

    /// With what the writable layer can still take.
    pub fn with_free(mut self, free: Option<u64>) -> Self {
        self.disk_free_bytes = free;
        self
    }
}

pub use crate::agent::AgentStream;
pub use crate::host::proc::Liveness;

/// How a tier differs from the others in ways the lifecycle must know, fixed for the tier's life.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierCapabilities {
    /// Path inside the sandbox of a read-only file whose `oom_kill N` line counts its OOM kills,
    /// for the agent to tell an OOM kill from another SIGKILL (and for stats, where the host's
    /// cgroup does not see the sandbox's processes); None when the tier has none.
    pub oom_counter_inside: Option<String>,
    /// The sandbox's processes are not host processes (so a host cgroup cannot count them): the
    /// agent gives every process it starts RLIMIT_NPROC = the sandbox's `pids` limit.
    pub process_limit_inside: bool,
    /// CPU, memory and pids limits are fixed when the sandbox starts (a microVM's vCPUs and RAM):
    /// a pooled sandbox cannot take other ones.
    pub limits_fixed_at_start: bool,
    /// A full-state snapshot ends the connection to the sandbox's agent (the next request makes
    /// a new one).
    pub checkpoint_ends_connections: bool,
    /// The least `memory_mb` a sandbox of the tier starts with (0: the API's own floor); a create
    /// asking for less is refused naming `memory_mb`.
    pub min_memory_mb: u64,
}

impl TierCapabilities {
    /// Whether a sandbox started with `started` can be given `wanted` by `set_limits` (a sandbox
    /// of the warm pool, started with the defaults, taken by a create asking for others).
    pub fn can_take_limits(&self, started: &SandboxLimits, wanted: &SandboxLimits) -> bool {
        let fixed = |l: &SandboxLimits| (l.cpu.to_bits(), l.memory_mb, l.pids);
        !self.limits_fixed_at_start || fixed(started) == fixed(wanted)
    }
}

/// What each tier implements, with its own typed state. Failures are `anyhow` errors with their
/// cause, except where the sandbox's own state can refuse an operation ([`TierError`]).
#[async_trait::async_trait]
pub trait Tier: Send + Sync + 'static {
    /// What the tier keeps of one sandbox (stored as JSON with it).
    type State: Serialize + DeserializeOwned + Clone + Send + Sync + 'static;

    fn isolation(&self) -> Isolation;

    /// Whether the tier works on this host, and any note on how it runs.
    fn info(&self) -> TierInfo;

    /// How the tier differs from the others (asked once, at start).
    fn capabilities(&self) -> TierCapabilities;

    /// Starts the sandbox; returns the state needed to reach and remove it later.
    async fn create(&self, spec: &SandboxSpec) -> Result<Self::State>;

    /// A warning about how this sandbox's isolation runs on this host, for its API view (a
    /// microVM under TCG); None when there is none.
    fn sandbox_note(&self, _state: &Self::State) -> Option<String> {
        None
    }

    /// Opens a new byte stream to the sandbox's agent.
    async fn connect(&self, id: &str, state: &Self::State) -> Result<AgentStream>;

    /// The last lines of the sandbox's own log (its agent's stderr, its VM's console), for the
    /// record of why it ended; read before `destroy`.
    fn last_words(&self, _id: &str, _state: Option<&Self::State>) -> Vec<String> {
        Vec::new()
    }

    /// Whether the sandbox still runs (re-adoption after a restart, the reaper). `Unknown` when the
    /// host cannot tell (the daemon out of file descriptors): never a reason to remove it.
    async fn is_alive(&self, id: &str, state: &Self::State) -> Liveness;

    /// The host process (pid, start time) whose end is the sandbox's end, for the daemon to be
    /// told when it exits; None when there is none to watch.
    fn watched_process(&self, _state: &Self::State) -> Option<(u32, u64)> {
        None
    }

    /// Changes the CPU, memory and pids limits of a running sandbox (the others are fixed at
    /// create).
    async fn set_limits(&self, id: &str, state: &Self::State, limits: &SandboxLimits)
        -> Result<()>;

    /// Live usage, read on the host.
    async fn usage(&self, id: &str, state: &Self::State) -> Result<TierUsage>;

    /// Caps how much more of the host's disk the sandbox's writable layer may take: `room` bytes
    /// more at most (None: its own quota only). Returns what it may still write; None when the
    /// tier cannot cap it (no quota image on the host, or a disk only the guest mounts).
    async fn cap_disk(
        &self,
        _id: &str,
        _state: &Self::State,
        _room: Option<u64>,
    ) -> Result<Option<u64>> {
        Ok(None)
    }

    /// Freezes every process of the sandbox.
    async fn pause(&self, id: &str, state: &Self::State) -> Result<()>;

    /// Thaws a paused sandbox.
    async fn resume(&self, id: &str, state: &Self::State) -> Result<()>;

    /// Copies every change the sandbox made to its root filesystem (its writable layer: an overlay
    /// upper directory, whiteouts included) into the empty directory `dest`, with file owners as
    /// the template's (root = 0), while the sandbox's processes are frozen (it stays frozen if it
    /// was paused). Returns how long it was frozen.
    async fn export_changes(
        &self,
        id: &str,
        state: &Self::State,
        dest: &std::path::Path,
    ) -> Result<std::time::Duration>;

    /// How many of the sandbox's layers (bottom first) its writable layer sits on; None: all of
    /// them. Fewer after a microvm full-state restore: the restored VM's disk is the snapshotted
    /// VM's writable layer, made over the layers below the snapshot's own, so a later snapshot's
    /// layer (everything that VM changed since its template) replaces the snapshot's layer instead
    /// of stacking on it.
    fn layers_under_writable(&self, _state: &Self::State) -> Option<usize> {
        None
    }

    /// The host's sandbox network (veth pairs, addresses, nft policy) the tier attaches sandboxes
    /// to; None with `--network none`.
    fn host_network(&self) -> Option<&crate::host::net::Network>;

    /// At start-up: (re)installs the network rules with the policies of the live sandboxes of
    /// every tier (slot → policy) and removes what sandboxes that are gone left.
    async fn restore_network(&self, live: &BTreeMap<u32, moat_api::NetworkPolicy>) -> Result<()>;

    /// Why full-state (memory) snapshots cannot be taken on this tier and host; None when they
    /// can.
    fn full_snapshot_unsupported(&self) -> Option<String>;

    /// Takes a full-state snapshot: the sandbox's processes and memory go to `image` (an empty
    /// directory) and the changes of its writable layer to `changes` (as
    /// [`Self::export_changes`]), both of one instant; the sandbox goes on running (or stays
    /// paused). Returns how long its processes were stopped and its state afterwards, which may
    /// have changed.
    async fn checkpoint(
        &self,
        _id: &str,
        _state: &Self::State,
        _changes: &std::path::Path,
        _image: &std::path::Path,
    ) -> Result<(std::time::Duration, Self::State), TierError> {
        Err(TierError::Unsupported(
            self.full_snapshot_unsupported()
                .unwrap_or_else(|| "full-state snapshots are not supported".into()),
        ))
    }

    /// Removes the instance — processes, cgroup, network, mounts — but keeps its writable layer,
    /// for a later `create` with `keep_files`. Idempotent; works from the id alone.
    async fn release(&self, id: &str, state: Option<&Self::State>) -> Result<()>;

    /// Kills the sandbox and removes everything it had on the host. Idempotent; works from the id
    /// alone when the state was lost.
    async fn destroy(&self, id: &str, state: Option<&Self::State>) -> Result<()>;

    /// Removes leftovers of sandboxes that are not in `live` (a crash, a kill -9 mid-create).
    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>>;
}

/// A tier as the lifecycle holds it: every [`Tier`], its state the stored JSON value (opaque
/// outside the tier), its failures [`TierError`]. See [`Tier`] for what each call does.
#[async_trait::async_trait]
pub trait IsolationTier: Send + Sync {
    fn isolation(&self) -> Isolation;
    fn info(&self) -> TierInfo;
    fn capabilities(&self) -> TierCapabilities;
    async fn create(&self, spec: &SandboxSpec) -> Result<serde_json::Value, TierError>;
    fn sandbox_note(&self, state: &serde_json::Value) -> Option<String>;
    async fn connect(&self, id: &str, state: &serde_json::Value) -> Result<AgentStream, TierError>;
    fn last_words(&self, id: &str, state: Option<&serde_json::Value>) -> Vec<String>;
    async fn is_alive(&self, id: &str, state: &serde_json::Value) -> Liveness;
    fn watched_process(&self, state: &serde_json::Value) -> Option<(u32, u64)>;
    async fn set_limits(
        &self,
        id: &str,
        state: &serde_json::Value,
        limits: &SandboxLimits,
    ) -> Result<(), TierError>;
    async fn usage(&self, id: &str, state: &serde_json::Value) -> Result<TierUsage, TierError>;
    async fn cap_disk(
        &self,
        id: &str,
        state: &serde_json::Value,
        room: Option<u64>,
    ) -> Result<Option<u64>, TierError>;
    async fn pause(&self, id: &str, state: &serde_json::Value) -> Result<(), TierError>;
    async fn resume(&self, id: &str, state: &serde_json::Value) -> Result<(), TierError>;
    async fn export_changes(
        &self,
        id: &str,
        state: &serde_json::Value,
        dest: &std::path::Path,
    ) -> Result<std::time::Duration, TierError>;
    fn layers_under_writable(&self, state: &serde_json::Value) -> Option<usize>;
    /// The sandbox's (gateway, address) when the tier gives sandboxes a network.
    fn network_addresses(&self, slot: u32) -> Option<(std::net::Ipv4Addr, std::net::Ipv4Addr)>;
    /// Replaces a running sandbox's egress policy.
    async fn set_network_policy(
        &self,
        slot: u32,
        policy: &moat_api::NetworkPolicy,
    ) -> Result<(), TierError>;
    async fn restore_network(
        &self,
        live: &BTreeMap<u32, moat_api::NetworkPolicy>,
    ) -> Result<(), TierError>;
    fn full_snapshot_unsupported(&self) -> Option<String>;
    async fn checkpoint(
        &self,
        id: &str,
        state: &serde_json::Value,
        changes: &std::path::Path,
        image: &std::path::Path,
    ) -> Result<(std::time::Duration, serde_json::Value), TierError>;
    async fn release(&self, id: &str, state: Option<&serde_json::Value>) -> Result<(), TierError>;
    async fn destroy(&self, id: &str, state: Option<&serde_json::Value>) -> Result<(), TierError>;
    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>, TierError>;
}

/// A stored state decoded as tier `T`'s.
fn decode<T: Tier>(v: &serde_json::Value) -> Result<T::State, TierError> {
    serde_json::from_value(v.clone())
        .map_err(|e| TierError::Failed(anyhow::anyhow!("the stored tier state: {e}")))
}

fn encode<S: Serialize>(s: &S) -> Result<serde_json::Value, TierError> {
    serde_json::to_value(s)
        .map_err(|e| TierError::Failed(anyhow::anyhow!("encode tier state: {e}")))
}

#[async_trait::async_trait]
impl<T: Tier> IsolationTier for T {
    fn isolation(&self) -> Isolation {
        Tier::isolation(self)
    }
    fn info(&self) -> TierInfo {
        Tier::info(self)
    }
    fn capabilities(&self) -> TierCapabilities {
        Tier::capabilities(self)
    }
    async fn create(&self, spec: &SandboxSpec) -> Result<serde_json::Value, TierError> {
        encode(&Tier::create(self, spec).await?)
    }
    fn sandbox_note(&self, state: &serde_json::Value) -> Option<String> {
        Tier::sandbox_note(self, &decode::<T>(state).ok()?)
    }
    async fn connect(&self, id: &str, state: &serde_json::Value) -> Result<AgentStream, TierError> {
        Ok(Tier::connect(self, id, &decode::<T>(state)?).await?)
    }
    fn last_words(&self, id: &str, state: Option<&serde_json::Value>) -> Vec<String> {
        let state = state.and_then(|s| decode::<T>(s).ok());
        Tier::last_words(self, id, state.as_ref())
    }
    fn watched_process(&self, state: &serde_json::Value) -> Option<(u32, u64)> {
        Tier::watched_process(self, &decode::<T>(state).ok()?)
    }
    async fn is_alive(&self, id: &str, state: &serde_json::Value) -> Liveness {
        match decode::<T>(state) {
            Ok(s) => Tier::is_alive(self, id, &s).await,
            // A state no one can read points at no process.
            Err(_) => Liveness::Gone,
        }
    }
    async fn set_limits(
        &self,
        id: &str,
        state: &serde_json::Value,
        limits: &SandboxLimits,
    ) -> Result<(), TierError> {
        Ok(Tier::set_limits(self, id, &decode::<T>(state)?, limits).await?)
    }
    async fn usage(&self, id: &str, state: &serde_json::Value) -> Result<TierUsage, TierError> {
        Ok(Tier::usage(self, id, &decode::<T>(state)?).await?)
    }
    async fn cap_disk(
        &self,
        id: &str,
        state: &serde_json::Value,
        room: Option<u64>,
    ) -> Result<Option<u64>, TierError> {
        Ok(Tier::cap_disk(self, id, &decode::<T>(state)?, room).await?)
    }
    async fn pause(&self, id: &str, state: &serde_json::Value) -> Result<(), TierError> {
        Ok(Tier::pause(self, id, &decode::<T>(state)?).await?)
    }
    async fn resume(&self, id: &str, state: &serde_json::Value) -> Result<(), TierError> {
        Ok(Tier::resume(self, id, &decode::<T>(state)?).await?)
    }
    async fn export_changes(
        &self,
        id: &str,
        state: &serde_json::Value,
        dest: &std::path::Path,
    ) -> Result<std::time::Duration, TierError> {
        Ok(Tier::export_changes(self, id, &decode::<T>(state)?, dest).await?)
    }
    fn layers_under_writable(&self, state: &serde_json::Value) -> Option<usize> {
        Tier::layers_under_writable(self, &decode::<T>(state).ok()?)
    }
    fn network_addresses(&self, slot: u32) -> Option<(std::net::Ipv4Addr, std::net::Ipv4Addr)> {
        self.host_network().map(|n| n.addresses(slot))
    }
    async fn set_network_policy(
        &self,
        slot: u32,
        policy: &moat_api::NetworkPolicy,
    ) -> Result<(), TierError> {
        let Some(net) = self.host_network().cloned() else {
            return Err(TierError::Unsupported(
                "sandbox networking is off (moat serve --network none)".into(),
            ));
        };
        let policy = policy.clone();
        Ok(tokio::task::spawn_blocking(move || net.set_policy(slot, &policy)).await??)
    }
    async fn restore_network(
        &self,
        live: &BTreeMap<u32, moat_api::NetworkPolicy>,
    ) -> Result<(), TierError> {
        Ok(Tier::restore_network(self, live).await?)
    }
    fn full_snapshot_unsupported(&self) -> Option<String> {
        Tier::full_snapshot_unsupported(self)
    }
    async fn checkpoint(
        &self,
        id: &str,
        state: &serde_json::Value,
        changes: &std::path::Path,
        image: &std::path::Path,
    ) -> Result<(std::time::Duration, serde_json::Value), TierError> {
        let state = decode::<T>(state)?;
        let (took, state) = Tier::checkpoint(self, id, &state, changes, image).await?;
        Ok((took, encode(&state)?))
    }
    async fn release(&self, id: &str, state: Option<&serde_json::Value>) -> Result<(), TierError> {
        // A state that does not decode is as good as none: release works from the id alone.
        let state = state.and_then(|s| decode::<T>(s).ok());
        Ok(Tier::release(self, id, state.as_ref()).await?)
    }
    async fn destroy(&self, id: &str, state: Option<&serde_json::Value>) -> Result<(), TierError> {
        let state = state.and_then(|s| decode::<T>(s).ok());
        Ok(Tier::destroy(self, id, state.as_ref()).await?)
    }
    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>, TierError> {
        Ok(Tier::sweep(self, live).await?)
    }
}

/// The start-up sweep's last step on every tier: destroys each of `names` (sandbox directories or
/// runtime ids found on the host) that no live sandbox owns, and returns those it removed.
pub(crate) async fn destroy_unowned<T: Tier + ?Sized>(
    tier: &T,
    names: Vec<String>,
    live: &HashSet<String>,
) -> Result<Vec<String>> {
    use anyhow::Context;
    let mut removed = Vec::new();
    for name in names.into_iter().filter(|n| !live.contains(n)) {
        tier.destroy(&name, None)
            .await
            .with_context(|| format!("sweep {name}"))?;
        removed.push(name);
    }
    Ok(removed)
}

/// Runs a tier's blocking `start` of `spec`; when it fails, removes what it left behind (a sandbox
/// coming back over its files keeps them: release instead of destroy).
pub(crate) async fn start_or_clean<T, S>(
    tier: &T,
    spec: &SandboxSpec,
    start: impl FnOnce() -> Result<S> + Send + 'static,
) -> Result<S>
where
    T: Tier + ?Sized,
    S: Send + 'static,
{
    let t = std::time::Instant::now();
    let res = tokio::task::spawn_blocking(start).await?;
    tracing::debug!(sandbox = %spec.id, tier = tier.isolation().as_str(), took = ?t.elapsed(), ok = res.is_ok(), "sandbox started");
    if res.is_err() {
        let cleanup = if spec.keep_files {
            tier.release(&spec.id, None).await
        } else {
            tier.destroy(&spec.id, None).await
        };
        if let Err(c) = cleanup {
            tracing::warn!(sandbox = %spec.id, "cleanup after failed create: {c:#}");
        }
    }
    res
}

/// The last `lines` lines of a log file, read from its last 16 KiB (a log may be large; its tail
/// is what says why something ended). Lines are cut at 500 characters.
pub fn log_tail(path: &std::path::Path, lines: usize) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let from = len.saturating_sub(16 << 10);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(from)).is_err() || f.take(16 << 10).read_to_end(&mut buf).is_err() {
        return Vec::new();
    }
    tail_lines(&String::from_utf8_lossy(&buf), lines)
}

/// The last `lines` non-empty lines of `text`, each cut at 500 characters.
pub fn tail_lines(text: &str, lines: usize) -> Vec<String> {
    let all: Vec<&str> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .collect();
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| l.chars().take(500).collect())
        .collect()
}
