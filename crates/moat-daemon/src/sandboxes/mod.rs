//! Sandbox lifecycle, split by responsibility, each part with a narrow interface:
//!
//! * [`Lifecycle`]: create, look up, list, extend, stats, network policy, pause/resume, delete;
//! * [`Pool`]: the warm pool (kept full in the background, claimed by creates);
//! * [`Reaper`]: expiry, idle timeouts and sandboxes whose PID 1 died;
//! * [`disk::DiskGuard`]: the host's disk: its reserve, sandbox disks capped, refusals when low;
//! * [`Snapshots`]: snapshots, forks, reset, disk usage;
//! * [`Templates`]: template operations (list, register, pull, build, delete);
//! * [`Builds`]: template builds from a spec;
//! * recovery at start-up ([`Services::recover`]).
//!
//! They share one [`core::Core`]: the store, the tiers, the layer and template stores, the open
//! agent connections. Its state and helpers are private to this module; the fronts (REST, E2B,
//! MCP) call operations, never fields. State lives in the database; the only in-memory state is
//! the open agent connections, re-made from the database after a restart.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use moat_api::{Isolation, NetworkPolicy, SandboxLimits};

use crate::db::Db;
use crate::layers::LayerStore;
use crate::template::spec::Registries;
use crate::template::store::TemplateStore;
use crate::tier::IsolationTier;

pub mod builds;
pub mod causes;
pub mod core;
pub mod disk;
mod exits;
mod idempotency;
mod instance;
mod lifecycle;
mod pool;
mod reaper;
mod recovery;
mod secrets;
mod snapshots;
mod start;
mod templates;
#[cfg(test)]
mod tests;
mod validate;

pub use builds::{Builds, LiveBuild, BUILD_LABEL};
pub use core::{Bounds, Ended};
pub use idempotency::IDEMPOTENCY_KEY;
pub use lifecycle::{Lifecycle, ListFilter};
pub use pool::Pool;
pub use reaper::Reaper;
pub use snapshots::{Snapshots, MAX_FORKS, MAX_LAYERS};
pub use templates::Templates;
pub use validate::validate_policy;

/// What the lifecycle is configured with (`moat serve`'s flags, read by `config`).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where templates, layers, checkpoint images and build logs live.
    pub data_dir: PathBuf,
    /// Sandbox lifetime when a create gives none, seconds.
    pub default_timeout: u64,
    /// Longest lifetime (and command/idle timeout) a sandbox may be given, seconds.
    pub max_timeout: u64,
    /// Template of creates that name none; the warm pool holds sandboxes of it.
    pub default_template: String,
    /// Tier of creates that name none; the warm pool holds sandboxes of it.
    pub default_isolation: Isolation,
    /// Limits of creates that give none.
    pub default_limits: SandboxLimits,
    /// Sandboxes the warm pool keeps started; 0: no pool.
    pub pool_size: u32,
    /// Egress policy of creates that give none.
    pub default_network: NetworkPolicy,
    /// Largest build context accepted, MiB.
    pub max_build_context_mb: u64,
    /// The package registries build steps install from.
    pub registries: Registries,
    /// How long a new sandbox's agent may take to answer.
    pub agent_timeout: Duration,
    /// Bytes of the data directory's filesystem kept free for the daemon (see [`disk`]); 0: 5%
    /// of it, at least 256 MiB and at most 4 GiB.
    pub disk_reserve: u64,
}

impl Settings {
    /// `moat serve`'s defaults over `data_dir`, but no disk quota (an ext4 image per sandbox needs
    /// root) and no warm pool: for tests and tools.
    pub fn with_defaults(data_dir: PathBuf) -> Settings {
        Settings {
            data_dir,
            default_timeout: 300,
            max_timeout: 86_400,
            default_template: "base".into(),
            default_isolation: Isolation::Container,
            default_limits: SandboxLimits {
                cpu: 1.0,
                memory_mb: 512,
                pids: 4096,
                nofile: 4096,
                disk_mb: 0,
                disk_inodes: 0,
                tmp_mb: 0,
                output_bytes: 4 << 20,
                command_timeout: 0,
                idle_timeout: 0,
            },
            pool_size: 0,
            default_network: NetworkPolicy::default(),
            max_build_context_mb: 2048,
            registries: Registries::default(),
            agent_timeout: Duration::from_secs(20),
            disk_reserve: 0,
        }
    }
}

/// The lifecycle's parts, wired together once at start.
#[derive(Clone)]
pub struct Services {
    pub sandboxes: Arc<Lifecycle>,
    pub pool: Arc<Pool>,
    pub reaper: Arc<Reaper>,
    pub disk: Arc<disk::DiskGuard>,
    pub snapshots: Arc<Snapshots>,
    pub templates: Arc<Templates>,
    pub builds: Arc<Builds>,
    pub vault: Arc<crate::secrets::Vault>,
}

impl Services {
    pub fn new(
        settings: Settings,
        db: Arc<Db>,
        templates: Arc<TemplateStore>,
        layers: Arc<LayerStore>,
        tiers: Vec<Arc<dyn IsolationTier>>,
        vault: Arc<crate::secrets::Vault>,
    ) -> Services {
        let (exits, exited) = exits::Exits::new();
        let core = Arc::new(core::Core::new(
            settings,
            db,
            templates,
            layers,
            tiers,
            exits,
            vault.clone(),
        ));
        let pool = Arc::new(Pool::new(core.clone()));
        let sandboxes = Arc::new(Lifecycle::new(core.clone(), pool.clone()));
        let snapshots = Arc::new(Snapshots::new(core.clone(), sandboxes.clone()));
        let reaper = Arc::new(Reaper::new(sandboxes.clone(), exited));
        let disk = Arc::new(disk::DiskGuard::new(sandboxes.clone()));
        let templates = Arc::new(Templates::new(core.clone(), pool.clone()));
        let builds = Arc::new(Builds::new(core, pool.clone()));
        Services {
            sandboxes,
            pool,
            reaper,
            disk,
            snapshots,
            templates,
            builds,
            vault,
        }
    }

    /// Starts the background work: the reaper, the warm pool and the disk guard.
    pub fn spawn_background(&self) {
        tokio::spawn(self.reaper.clone().run());
        tokio::spawn(self.pool.clone().run());
        tokio::spawn(self.disk.clone().run());
        let (tx, mut notes) = tokio::sync::mpsc::unbounded_channel();
        if crate::host::kmsg::watch(tx) {
            let core = self.sandboxes.core().clone();
            tokio::spawn(async move {
                while let Some(note) = notes.recv().await {
                    core.kernel_note(&note);
                }
            });
        }
    }
}
