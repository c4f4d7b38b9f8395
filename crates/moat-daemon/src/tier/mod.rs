//! Isolation tiers. One trait, one module per tier; nothing tier-specific lives outside its module.
//!
//! A tier turns a [`SandboxSpec`] into a running agent reachable over one byte stream, and tears it down
//! again. What a tier must remember to find its sandbox after a daemon restart goes into an opaque JSON
//! value the daemon stores with the sandbox (`tier_state`).

use std::collections::{BTreeMap, HashSet};
use std::path::PathBuf;

use anyhow::Result;
use moat_api::{Isolation, SandboxLimits, TierInfo};

pub mod container;
pub mod gvisor;
pub mod layer;
pub mod microvm;

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
    /// Start over the writable layer an earlier instance left ([`IsolationTier::release`]) instead of
    /// an empty one: a paused sandbox whose processes ended with the host comes back with its files.
    pub keep_files: bool,
    /// A full-state snapshot's image ([`IsolationTier::checkpoint`]) to continue from: the sandbox's
    /// processes go on from where they were, over `layers`. None: the agent starts afresh.
    pub restore: Option<PathBuf>,
}

/// A full-state snapshot the sandbox's own state rules out (not a failure of the host): the API
/// answers 409 with this message.
#[derive(Debug)]
pub struct CheckpointRefused(pub String);

impl std::fmt::Display for CheckpointRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CheckpointRefused {}

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
        }
    }
}

pub use crate::agent::AgentStream;

#[async_trait::async_trait]
pub trait IsolationTier: Send + Sync {
    fn isolation(&self) -> Isolation;

    /// Whether the tier works on this host, and any note on how it runs.
    fn info(&self) -> TierInfo;

    /// Starts the sandbox; returns the state needed to reach and remove it later.
    async fn create(&self, spec: &SandboxSpec) -> Result<serde_json::Value>;

    /// A warning about how this sandbox's isolation runs on this host, for its API view (a microVM
    /// under TCG); None when there is none.
    fn sandbox_note(&self, _state: &serde_json::Value) -> Option<String> {
        None
    }

    /// Opens a new byte stream to the sandbox's agent.
    async fn connect(&self, id: &str, state: &serde_json::Value) -> Result<AgentStream>;

    /// Whether the sandbox described by `state` still runs (used when re-adopting after a restart).
    async fn is_alive(&self, id: &str, state: &serde_json::Value) -> bool;

    /// Changes the CPU, memory and pids limits of a running sandbox (the others are fixed at create).
    async fn set_limits(
        &self,
        id: &str,
        state: &serde_json::Value,
        limits: &SandboxLimits,
    ) -> Result<()>;

    /// Whether a sandbox started with `started` can be given `wanted` by [`Self::set_limits`] (a
    /// sandbox of the warm pool, started with the defaults, taken by a create asking for others).
    /// False where a limit is fixed when the sandbox starts: a microVM's memory and vCPUs.
    fn can_take_limits(&self, _started: &SandboxLimits, _wanted: &SandboxLimits) -> bool {
        true
    }

    /// Live usage, read on the host.
    async fn usage(&self, id: &str, state: &serde_json::Value) -> Result<TierUsage>;

    /// Path inside the sandbox of a read-only file whose `oom_kill N` line counts its OOM kills, for
    /// the agent to tell an OOM kill from another SIGKILL; None when the tier has none.
    fn oom_counter_inside(&self) -> Option<String> {
        None
    }

    /// Whether the sandbox's processes are not host processes (so a cgroup cannot count them): the
    /// agent then gives every process it starts RLIMIT_NPROC = the sandbox's `pids` limit.
    fn process_limit_inside(&self) -> bool {
        false
    }

    /// Freezes every process of the sandbox.
    async fn pause(&self, id: &str, state: &serde_json::Value) -> Result<()>;

    /// Thaws a paused sandbox.
    async fn resume(&self, id: &str, state: &serde_json::Value) -> Result<()>;

    /// Copies every change the sandbox made to its root filesystem (its writable layer: an overlay
    /// upper directory, whiteouts included) into the empty directory `dest`, with file owners as the
    /// template's (root = 0), while the sandbox's processes are frozen (it stays frozen if it was
    /// paused). Returns how long it was frozen.
    async fn export_changes(
        &self,
        id: &str,
        state: &serde_json::Value,
        dest: &std::path::Path,
    ) -> Result<std::time::Duration>;

    /// How many of the sandbox's layers (bottom first) its writable layer sits on; None: all of them.
    /// Fewer after a microvm full-state restore: the restored VM's disk is the snapshotted VM's
    /// writable layer, made over the layers below the snapshot's own, so a later snapshot's layer
    /// (everything that VM changed since its template) replaces the snapshot's layer instead of
    /// stacking on it.
    fn layers_under_writable(&self, _state: &serde_json::Value) -> Option<usize> {
        None
    }

    /// The host's sandbox network (veth pairs, addresses, nft policy) the tier attaches sandboxes to;
    /// None with `--network none`.
    fn host_network(&self) -> Option<&crate::host::net::Network>;

    /// The sandbox's (gateway, address) when the tier gives sandboxes a network.
    fn network_addresses(&self, slot: u32) -> Option<(std::net::Ipv4Addr, std::net::Ipv4Addr)> {
        self.host_network().map(|n| n.addresses(slot))
    }

    /// Replaces a running sandbox's egress policy.
    async fn set_network_policy(&self, slot: u32, policy: &moat_api::NetworkPolicy) -> Result<()> {
        let Some(net) = self.host_network().cloned() else {
            anyhow::bail!("sandbox networking is off (moat serve --network none)");
        };
        let policy = policy.clone();
        tokio::task::spawn_blocking(move || net.set_policy(slot, &policy)).await?
    }

    /// At start-up: (re)installs the network rules with the policies of the live sandboxes of every
    /// tier (slot → policy) and removes what sandboxes that are gone left.
    async fn restore_network(
        &self,
        live: &std::collections::BTreeMap<u32, moat_api::NetworkPolicy>,
    ) -> Result<()>;

    /// Why full-state (memory) snapshots cannot be taken on this tier and host; None when they can.
    fn full_snapshot_unsupported(&self) -> Option<String>;

    /// Whether a full-state snapshot ends the connection to the sandbox's agent (the next request
    /// then makes a new one).
    fn checkpoint_ends_connections(&self) -> bool {
        true
    }

    /// Takes a full-state snapshot: the sandbox's processes and memory go to `image` (an empty
    /// directory) and the changes of its writable layer to `changes` (as [`Self::export_changes`]),
    /// both of one instant; the sandbox goes on running (or stays paused). Returns how long its
    /// processes were stopped and its tier state afterwards, which may have changed.
    async fn checkpoint(
        &self,
        _id: &str,
        _state: &serde_json::Value,
        _changes: &std::path::Path,
        _image: &std::path::Path,
    ) -> Result<(std::time::Duration, serde_json::Value)> {
        anyhow::bail!(
            "{}",
            self.full_snapshot_unsupported()
                .unwrap_or_else(|| "full-state snapshots are not supported".into())
        )
    }

    /// Removes the instance — processes, cgroup, network, mounts — but keeps its writable layer, for
    /// a later `create` with `keep_files`. Idempotent; works from the id alone.
    async fn release(&self, id: &str, state: Option<&serde_json::Value>) -> Result<()>;

    /// Kills the sandbox and removes everything it had on the host. Idempotent; works from the id
    /// alone when the state was lost.
    async fn destroy(&self, id: &str, state: Option<&serde_json::Value>) -> Result<()>;

    /// Removes leftovers of sandboxes that are not in `live` (a crash, a kill -9 mid-create).
    async fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>>;
}

/// Runs a tier's blocking `start` of `spec`; when it fails, removes what it left behind (a sandbox
/// coming back over its files keeps them: release instead of destroy).
/// The start-up sweep's last step on every tier: destroys each of `names` (sandbox directories or
/// runtime ids found on the host) that no live sandbox owns, and returns those it removed.
pub(crate) async fn destroy_unowned<T: IsolationTier + ?Sized>(
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

pub(crate) async fn start_or_clean<T, S>(
    tier: &T,
    spec: &SandboxSpec,
    start: impl FnOnce() -> Result<S> + Send + 'static,
) -> Result<serde_json::Value>
where
    T: IsolationTier + ?Sized,
    S: serde::Serialize + Send + 'static,
{
    let t = std::time::Instant::now();
    let res = tokio::task::spawn_blocking(start).await?;
    tracing::debug!(sandbox = %spec.id, tier = tier.isolation().as_str(), took = ?t.elapsed(), ok = res.is_ok(), "sandbox started");
    match res {
        Ok(state) => Ok(serde_json::to_value(state)?),
        Err(e) => {
            let cleanup = if spec.keep_files {
                tier.release(&spec.id, None).await
            } else {
                tier.destroy(&spec.id, None).await
            };
            if let Err(c) = cleanup {
                tracing::warn!(sandbox = %spec.id, "cleanup after failed create: {c:#}");
            }
            Err(e)
        }
    }
}
