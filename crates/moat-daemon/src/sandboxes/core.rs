//! What every part of the lifecycle shares: the store, the tiers, the layer and template stores,
//! the open agent connections, and the lookups over them. Private to `sandboxes`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use moat_api::{Isolation, Sandbox, SandboxState, SnapshotKind};
use tokio::sync::RwLock;

use super::validate::validate_policy;
use super::Settings;
use crate::agent::AgentClient;
use crate::clock::{now_ms, rfc3339};
use crate::db::{Db, SandboxRecord, SnapshotRecord};
use crate::error::Error;
use crate::ids::valid_sandbox_id;
use crate::layers::LayerStore;
use crate::template::store::TemplateStore;
use crate::tier::{IsolationTier, TierCapabilities};

/// The idle clock is written at most this often per sandbox.
const TOUCH_EVERY_MS: i64 = 1000;

/// What this host can give a sandbox at most.
#[derive(Debug, Clone, Copy)]
pub(super) struct HostLimits {
    pub cpus: f64,
    pub memory_mb: u64,
    /// The daemon's own hard RLIMIT_NOFILE: sandbox processes cannot be given more.
    pub nofile: u64,
    /// Size of the data directory's filesystem, MiB: the largest disk quota that makes sense.
    pub disk_mb: u64,
}

impl HostLimits {
    fn of_this_host(data_dir: &std::path::Path) -> HostLimits {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0);
        let memory_mb = nix::sys::sysinfo::sysinfo()
            .map(|s| s.ram_total() >> 20)
            .unwrap_or(1 << 20);
        let nofile = {
            let mut r = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes into the rlimit we pass and has no other effect.
            if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
                r.rlim_max
            } else {
                1024
            }
        };
        let disk_mb = nix::sys::statvfs::statvfs(data_dir)
            .map(|s| (s.blocks() * s.fragment_size()) >> 20)
            .unwrap_or(1 << 20);
        HostLimits {
            cpus,
            memory_mb,
            nofile,
            disk_mb,
        }
    }
}

/// The largest values this daemon accepts in a request, for the API document (`/openapi.json` states
/// them as `maximum`s so that a client reads the limits it will be held to).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// `--max-timeout`, seconds: sandbox lifetimes, command and idle timeouts.
    pub max_timeout: u64,
    /// Cores of this host.
    pub cpus: f64,
    /// Memory of this host, MiB.
    pub memory_mb: u64,
    /// The daemon's own hard RLIMIT_NOFILE.
    pub nofile: u64,
    /// Size of the data directory's filesystem, MiB.
    pub disk_mb: u64,
}

/// A sandbox that ended without being asked to (its timeout, its agent lost, the OOM killer): what
/// the layers above record as its end (the audit log's `sandbox.ended`).
#[derive(Debug, Clone)]
pub struct Ended {
    pub id: String,
    pub reason: moat_api::Reason,
    pub message: String,
}

pub struct Core {
    pub(super) settings: Settings,
    pub(super) db: Arc<Db>,
    pub(super) templates: Arc<TemplateStore>,
    pub(super) layers: Arc<LayerStore>,
    tiers: HashMap<Isolation, Arc<dyn IsolationTier>>,
    /// Each tier's capabilities, asked once.
    capabilities: HashMap<Isolation, TierCapabilities>,
    /// Open agent connections by sandbox (re-made from the database after a restart).
    pub(super) agents: RwLock<HashMap<String, Arc<AgentClient>>>,
    pub(super) host: HostLimits,
    /// Previous CPU sample per sandbox (when, usage in µs), for `cpu_cores` in stats.
    pub(super) cpu_samples: std::sync::Mutex<HashMap<String, (std::time::Instant, u64)>>,
    /// One at a time per sandbox: snapshot, reset, pause, resume (each changes its frozen state
    /// or its whole instance).
    op_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held while layers are committed and recorded, and while unused ones are removed.
    pub(super) layer_lock: std::sync::Mutex<()>,
    /// Watches of the process whose end is each sandbox's end.
    pub(super) exits: super::exits::Exits,
    /// Sandboxes whose instance is being started now (a create, a reset, a resume over files): a
    /// row `starting` that is not here has no owner and is removed.
    starting: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Idempotency keys with a create in flight (one create per key at a time).
    pub(super) keys_in_flight: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Sandboxes that ended without being asked to, for whoever listens ([`Core::ends`]).
    ends: tokio::sync::broadcast::Sender<Ended>,
    /// A sandbox's disk was capped as it started (the disk guard looks at every one then).
    pub(super) disk_capped_at_start: std::sync::atomic::AtomicBool,
    /// Secrets (docs/secrets.md).
    pub(super) vault: Arc<crate::secrets::Vault>,
    /// Connections open to each sandbox's ports now ([`Core::hold`]): activity for its idle clock.
    held: Arc<std::sync::Mutex<HashMap<String, usize>>>,
}

/// A connection to a sandbox's port, open: the sandbox is not idle while one is held.
pub struct Hold {
    held: Arc<std::sync::Mutex<HashMap<String, usize>>>,
    id: String,
}

impl Drop for Hold {
    fn drop(&mut self) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = held.get_mut(&self.id) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.id);
            }
        }
    }
}

/// How long a start in flight may keep a sandbox `starting` before a delete stops waiting for it.
pub(super) const START_DEADLINE: std::time::Duration = std::time::Duration::from_secs(900);

/// A sandbox's instance being started; dropping it ends that (whatever happened).
pub(super) struct Starting<'a> {
    core: &'a Core,
    id: String,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.core
            .starting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.id);
    }
}

/// Runs `op` in a task of its own and waits for it. A client that goes away drops the waiting,
/// not the operation: a create, a reset, a pause or a delete finishes (or cleans up after itself)
/// whatever the caller does, so no sandbox is left half-made in `starting`.
pub(super) async fn detached<T: Send + 'static>(
    op: impl std::future::Future<Output = Result<T, Error>> + Send + 'static,
) -> Result<T, Error> {
    tokio::spawn(op)
        .await
        .map_err(|e| Error::internal(format!("a lifecycle task failed: {e}")))?
}

/// A sandbox row as the API shows it (without what the tier knows).
fn to_api(r: &SandboxRecord) -> Sandbox {
    Sandbox {
        id: r.id.clone(),
        template: r.template.clone(),
        isolation: r.isolation,
        state: r.state,
        created_at: rfc3339(r.created_at_ms),
        expires_at: rfc3339(r.expires_at_ms),
        metadata: r.metadata.clone(),
        env_keys: r.env.keys().cloned().collect(),
        cpu: r.cpu,
        memory_mb: r.memory_mb,
        hostname: r.hostname.clone(),
        limits: r.limits.clone(),
        on_timeout: r.on_timeout,
        snapshot: r.snapshot.clone(),
        network: None,
        access_token: r.access_token.clone(),
        allow_public_traffic: r.public_traffic,
        auto_resume: r.auto_resume,
        isolation_note: None,
        ended: None,
        conditions: Vec::new(),
    }
}

/// Whether a sandbox is paused with its files only: its processes ended with the host, and a
/// resume starts it over its files.
pub(super) fn files_only(rec: &SandboxRecord) -> bool {
    rec.state == SandboxState::Paused && rec.tier_state.as_ref().is_none_or(|v| v.is_null())
}

/// A client of a sandbox's agent that dials through its tier.
pub(super) fn agent_client(
    id: &str,
    tier: &Arc<dyn IsolationTier>,
    state: &serde_json::Value,
) -> AgentClient {
    let (tier, sid, state) = (tier.clone(), id.to_string(), state.clone());
    let dial: crate::agent::Dial = Arc::new(move || {
        let (tier, id, state) = (tier.clone(), sid.clone(), state.clone());
        Box::pin(async move { Ok(tier.connect(&id, &state).await?) })
    });
    AgentClient::new(id, dial)
}

/// What a new sandbox stands on and starts with: its template's or its snapshot's root, layers,
/// environment, default user and working directory, and start command.
#[derive(Debug, Clone, Default)]
pub struct Stack {
    pub root: Option<String>,
    pub layers: Vec<String>,
    /// Without `env`, which goes into the sandbox's own environment.
    pub runtime: moat_api::TemplateConfig,
    pub env: BTreeMap<String, String>,
}

impl Stack {
    pub fn of_template(t: &crate::db::TemplateRecord) -> Stack {
        let mut runtime = t.config.clone();
        let env = std::mem::take(&mut runtime.env);
        Stack {
            root: t.root.clone(),
            layers: t.layers.clone(),
            runtime,
            env,
        }
    }

    pub fn of_snapshot(s: &SnapshotRecord) -> Stack {
        Stack {
            root: s.root.clone(),
            layers: s.layers.clone(),
            runtime: s.runtime.clone(),
            env: s.env.clone(),
        }
    }
}

impl Core {
    pub(super) fn new(
        settings: Settings,
        db: Arc<Db>,
        templates: Arc<TemplateStore>,
        layers: Arc<LayerStore>,
        tiers: Vec<Arc<dyn IsolationTier>>,
        exits: super::exits::Exits,
        vault: Arc<crate::secrets::Vault>,
    ) -> Core {
        Core {
            exits,
            vault,
            host: HostLimits::of_this_host(&settings.data_dir),
            settings,
            db,
            templates,
            layers,
            capabilities: tiers
                .iter()
                .map(|t| (t.isolation(), t.capabilities()))
                .collect(),
            tiers: tiers.into_iter().map(|t| (t.isolation(), t)).collect(),
            agents: RwLock::new(HashMap::new()),
            cpu_samples: std::sync::Mutex::new(HashMap::new()),
            op_locks: std::sync::Mutex::new(HashMap::new()),
            layer_lock: std::sync::Mutex::new(()),
            starting: std::sync::Mutex::new(std::collections::HashSet::new()),
            keys_in_flight: std::sync::Mutex::new(HashMap::new()),
            ends: tokio::sync::broadcast::channel(4096).0,
            disk_capped_at_start: std::sync::atomic::AtomicBool::new(false),
            held: Arc::default(),
        }
    }

    /// Marks a connection to sandbox `id` open until the returned [`Hold`] is dropped: its idle
    /// timeout does not pass meanwhile.
    pub fn hold(&self, id: &str) -> Hold {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        *held.entry(id.to_string()).or_default() += 1;
        Hold {
            held: self.held.clone(),
            id: id.to_string(),
        }
    }

    /// Whether sandbox `id` is in use though no request came for it: a connection to one of its
    /// ports open, or a command of its own running (not its template's start command, nor an idle
    /// code kernel). The reaper asks before an idle timeout ends or pauses it.
    pub(super) async fn busy(&self, id: &str) -> bool {
        if self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
        {
            return true;
        }
        let Ok(agent) = self.agent_untouched(id).await else {
            return false;
        };
        let Ok(list) = agent.processes().await else {
            return false;
        };
        list.processes.iter().any(|p| {
            p.running
                && !p.tag.as_deref().is_some_and(|t| {
                    t == super::start::TAG || t.starts_with(crate::agent::DAEMON_TAG_PREFIX)
                })
        })
    }

    /// Every sandbox that ends without being asked to from now on.
    pub fn ends(&self) -> tokio::sync::broadcast::Receiver<Ended> {
        self.ends.subscribe()
    }

    /// Tells the listeners that sandbox `id` ended, and why.
    pub(super) fn ended(&self, id: &str, reason: moat_api::Reason, message: String) {
        let _ = self.ends.send(Ended {
            id: id.to_string(),
            reason,
            message,
        });
    }

    /// A sandbox as the API shows it (with its network, which the tier knows, and its conditions).
    pub(super) fn api(&self, r: &SandboxRecord) -> Sandbox {
        let mut out = to_api(r);
        out.conditions = self.db.conditions(&r.id).unwrap_or_else(|e| {
            tracing::warn!(sandbox = %r.id, "conditions: {e:#}");
            Vec::new()
        });
        if let (Some(state), Some(tier)) = (&r.tier_state, self.tiers.get(&r.isolation)) {
            out.isolation_note = tier.sandbox_note(state);
        }
        if let (Some(policy), Some(tier)) = (&r.network, self.tiers.get(&r.isolation)) {
            if let Some((gw, ip)) = tier.network_addresses(r.slot) {
                out.network = Some(moat_api::NetworkInfo {
                    ip: ip.to_string(),
                    gateway: gw.to_string(),
                    policy: policy.clone(),
                });
            }
        }
        out
    }

    /// Whether sandboxes of this tier get a network (`moat serve --network nat`).
    pub(super) fn networking(&self, isolation: Isolation) -> bool {
        self.tiers
            .get(&isolation)
            .is_some_and(|t| t.network_addresses(0).is_some())
    }

    /// Bytes of the data directory's filesystem kept free (see [`super::disk`]).
    pub fn disk_reserve(&self) -> u64 {
        match self.settings.disk_reserve {
            0 => super::disk::default_reserve(self.host.disk_mb << 20),
            n => n,
        }
    }

    /// How many more bytes each sandbox's disk may take now (see [`super::disk::room_each`]);
    /// None: no cap needed.
    pub(super) fn disk_room(
        &self,
        space: super::disk::Space,
        reserve: u64,
    ) -> Result<Option<u64>, Error> {
        // Read at every look (one aggregate query): a sandbox created a moment ago may write at
        // once.
        let largest_quota = self.db.largest_disk_quota_mb()? << 20;
        let writers = if super::disk::is_low(space.avail, reserve) {
            self.db
                .list_sandboxes()?
                .iter()
                .filter(|r| r.limits.disk_mb > 0 && !r.pooled)
                .count()
        } else {
            1
        };
        Ok(super::disk::room_each(
            space,
            reserve,
            writers,
            largest_quota,
        ))
    }

    /// Caps a sandbox's disk as it starts, before anything runs in it, at what the disk guard
    /// would give it: a write in its first second cannot take the host's reserve. The guard takes
    /// it over at its next look.
    pub(super) async fn cap_new_disk(
        &self,
        id: &str,
        tier: &Arc<dyn IsolationTier>,
        state: &serde_json::Value,
    ) {
        let reserve = self.disk_reserve();
        let room = super::disk::Space::of(&self.settings.data_dir)
            .and_then(|space| self.disk_room(space, reserve));
        if let Ok(Some(room)) = room {
            match tier.cap_disk(id, state, Some(room)).await {
                Ok(Some(_)) => self
                    .disk_capped_at_start
                    .store(true, std::sync::atomic::Ordering::SeqCst),
                Ok(None) => {}
                Err(e) => tracing::warn!(sandbox = %id, "cap its disk: {e}"),
            }
        }
    }

    /// Refuses to make something new (a sandbox, a snapshot, a template) while the host's disk is
    /// down to twice its reserve.
    pub(super) fn check_disk(&self) -> Result<(), Error> {
        let reserve = self.disk_reserve();
        let space = super::disk::Space::of(&self.settings.data_dir)?;
        if super::disk::is_low(space.avail, reserve) {
            return Err(Error::NoSpace(super::disk::refusal(space, reserve)));
        }
        Ok(())
    }

    /// What this daemon accepts at most (see [`Bounds`]).
    pub fn bounds(&self) -> Bounds {
        Bounds {
            max_timeout: self.settings.max_timeout,
            cpus: self.host.cpus,
            memory_mb: self.host.memory_mb,
            nofile: self.host.nofile,
            disk_mb: self.host.disk_mb.max(16),
        }
    }

    pub fn tier_infos(&self) -> Vec<moat_api::TierInfo> {
        let mut out: Vec<moat_api::TierInfo> =
            [Isolation::Container, Isolation::Gvisor, Isolation::Microvm]
                .into_iter()
                .map(|i| match self.tiers.get(&i) {
                    Some(t) => t.info(),
                    None => moat_api::TierInfo {
                        isolation: i,
                        available: false,
                        note: Some("not implemented in this version of moat".into()),
                    },
                })
                .collect();
        out.sort_by_key(|t| t.isolation.as_str());
        out
    }

    /// How tier `i` differs from the others (none of the quirks for a tier this daemon lacks).
    pub(super) fn capabilities(&self, i: Isolation) -> TierCapabilities {
        self.capabilities.get(&i).cloned().unwrap_or_default()
    }

    /// Every tier this daemon has.
    pub(super) fn all_tiers(&self) -> impl Iterator<Item = &Arc<dyn IsolationTier>> {
        self.tiers.values()
    }

    pub(super) fn tier(&self, i: Isolation) -> Result<Arc<dyn IsolationTier>, Error> {
        self.tiers.get(&i).cloned().ok_or_else(|| {
            Error::invalid(
                "isolation",
                format!(
                    "isolation {} is not available in this version of moat",
                    i.as_str()
                ),
            )
        })
    }

    pub(super) fn record(&self, id: &str) -> Result<SandboxRecord, Error> {
        if !valid_sandbox_id(id) {
            return Err(Error::not_found("id", format!("sandbox {id:?} not found")));
        }
        let rec = match self.db.get_sandbox(id)?.filter(|r| !r.pooled) {
            Some(r) => r,
            None => return Err(self.gone(id)),
        };
        // Every request for a sandbox goes through here: it restarts the idle clock.
        let now = now_ms();
        if now - rec.last_active_ms >= TOUCH_EVERY_MS {
            if let Err(e) = self.db.touch(id, now) {
                tracing::warn!(sandbox = %id, "idle clock: {e:#}");
            }
        }
        Ok(rec)
    }

    /// The agent connection of a running sandbox.
    pub async fn agent(&self, id: &str) -> Result<Arc<AgentClient>, Error> {
        let rec = self.record(id)?;
        self.agent_of(rec).await
    }

    /// The agent connection of a running sandbox, without counting as activity (for the daemon's own
    /// polling, which must not keep a sandbox from its idle timeout).
    pub async fn agent_untouched(&self, id: &str) -> Result<Arc<AgentClient>, Error> {
        let rec = match self.db.get_sandbox(id)?.filter(|r| !r.pooled) {
            Some(r) => r,
            None => return Err(self.gone(id)),
        };
        self.agent_of(rec).await
    }

    async fn agent_of(&self, rec: SandboxRecord) -> Result<Arc<AgentClient>, Error> {
        let id = rec.id.as_str();
        if rec.state == SandboxState::Paused {
            return Err(Error::conflict(format!(
                "sandbox {id} is paused; resume it first (POST /v1/sandboxes/{id}/resume)"
            )));
        }
        if rec.state != SandboxState::Running {
            return Err(Error::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        }
        if let Some(a) = self.agents.read().await.get(id) {
            return Ok(a.clone());
        }
        let (Some(state), Ok(tier)) = (rec.tier_state.clone(), self.tier(rec.isolation)) else {
            return Err(Error::conflict(format!("sandbox {id} has no agent")));
        };
        let agent = Arc::new(agent_client(id, &tier, &state));
        self.agents
            .write()
            .await
            .insert(id.to_string(), agent.clone());
        Ok(agent)
    }

    /// Marks sandbox `id`'s instance as being started until the guard is dropped.
    pub(super) fn start_of(&self, id: &str) -> Starting<'_> {
        self.starting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id.to_string());
        Starting {
            core: self,
            id: id.to_string(),
        }
    }

    /// Whether sandbox `id`'s instance is being started now.
    pub(super) fn is_starting(&self, id: &str) -> bool {
        self.starting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(id)
    }

    /// Has the daemon told when the process whose end is sandbox `id`'s end exits.
    pub(super) fn watch_exit(&self, id: &str, tier: &dyn IsolationTier, state: &serde_json::Value) {
        self.exits.watch(id, tier.watched_process(state));
    }

    /// Forgets what is kept in memory of a sandbox that is gone.
    pub(super) fn forget(&self, id: &str) {
        self.exits.forget(id);
        self.vault.forget(id);
        if let Ok(mut m) = self.cpu_samples.lock() {
            m.remove(id);
        }
        if let Ok(mut m) = self.op_locks.lock() {
            m.remove(id);
        }
    }

    /// The lock that keeps snapshot, reset, pause and resume of one sandbox from interleaving.
    /// What a call to sandbox `id`'s agent that got no answer means for the client: the agent's own
    /// refusal as it is; otherwise, a sandbox that is gone, no longer running, or in the middle of a
    /// pause, reset or snapshot (the request raced it) is the client's 404 or 409, not a failure of
    /// the host; only a running sandbox whose agent breaks is one.
    /// A running sandbox whose process is gone (its agent died, the OOM killer ended it) has ended
    /// whatever its row says for the moment (the reaper, woken by the exit, is removing it): that is
    /// said, as a conflict, not reported as the host's failure.
    pub async fn agent_failed(&self, id: &str, e: crate::agent::AgentError) -> Error {
        use crate::agent::AgentError;
        if matches!(e, AgentError::Refused { .. } | AgentError::Call(_)) {
            return Error::Agent(e);
        }
        let rec = match self.db.get_sandbox(id) {
            Ok(None) => return Error::not_found("id", format!("sandbox {id} not found")),
            Ok(Some(r)) if r.state != SandboxState::Running => {
                return Error::conflict(format!("sandbox {id} is {}", r.state.as_str()))
            }
            Ok(Some(_)) if self.op_lock(id).try_lock().is_err() => {
                return Error::conflict(format!(
                    "sandbox {id} is being paused, reset or snapshotted; try again when that is done"
                ))
            }
            Ok(Some(r)) => r,
            Err(_) => return Error::Agent(e),
        };
        if let (Some(state), Ok(tier)) = (rec.tier_state.as_ref(), self.tier(rec.isolation)) {
            if tier.is_alive(id, state).await == crate::tier::Liveness::Gone {
                return Error::conflict(format!(
                    "sandbox {id} has ended: its agent is gone ({e}); it is being removed"
                ));
            }
        }
        Error::Agent(e)
    }

    /// [`Core::agent_failed`] for an error that may have come from sandbox `id`'s agent.
    pub async fn agent_error(&self, id: &str, e: Error) -> Error {
        match e {
            Error::Agent(a) => self.agent_failed(id, a).await,
            e => e,
        }
    }

    pub(super) fn op_lock(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self
            .op_locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        m.entry(id.to_string()).or_default().clone()
    }

    pub(super) fn snapshot_record(
        &self,
        field: &str,
        id_or_name: &str,
    ) -> Result<SnapshotRecord, Error> {
        if id_or_name.is_empty() || id_or_name.len() > 64 {
            return Err(Error::not_found(
                field,
                format!("snapshot {id_or_name:?} not found"),
            ));
        }
        self.db
            .get_snapshot(id_or_name)?
            .ok_or_else(|| Error::not_found(field, format!("snapshot {id_or_name} not found")))
    }

    /// The snapshot a create asks to start from, checked against the rest of the request.
    pub(super) fn snapshot_for_create(
        &self,
        id_or_name: &str,
        req: &moat_api::CreateSandboxRequest,
    ) -> Result<SnapshotRecord, Error> {
        let snap = self.snapshot_record("snapshot", id_or_name)?;
        if let Some(i) = req.isolation.filter(|i| *i != snap.isolation) {
            return Err(Error::invalid(
                "isolation",
                format!(
                    "snapshot {} was taken on the {} tier, not {}; leave isolation out",
                    snap.id,
                    snap.isolation.as_str(),
                    i.as_str()
                ),
            ));
        }
        if let Some(t) = req.template.as_ref().filter(|t| **t != snap.template) {
            return Err(Error::invalid(
                "template",
                format!(
                    "snapshot {} is of template {}, not {t}; leave template out",
                    snap.id, snap.template
                ),
            ));
        }
        Ok(snap)
    }

    /// Where the checkpoint image of full-state snapshot `snap_id` lives:
    /// `<data_dir>/checkpoints/<snap_id>` (written by the tier, removed with the snapshot).
    pub(super) fn checkpoint_dir(&self, snap_id: &str) -> std::path::PathBuf {
        self.settings.data_dir.join("checkpoints").join(snap_id)
    }

    /// The checkpoint image a sandbox started from snapshot `snap` continues from: Some for a
    /// full-state snapshot that still exists.
    pub(super) fn full_image_of(
        &self,
        snap: Option<&str>,
    ) -> Result<Option<std::path::PathBuf>, Error> {
        let Some(snap) = snap else { return Ok(None) };
        Ok(self
            .db
            .get_snapshot(snap)?
            .filter(|s| s.kind == SnapshotKind::Full)
            .map(|s| self.checkpoint_dir(&s.id)))
    }

    /// At start-up: removes checkpoint images whose snapshot is gone (a crash between writing the
    /// image and recording the snapshot, or during a delete).
    pub(super) fn sweep_checkpoints(&self) {
        let root = self.settings.data_dir.join("checkpoints");
        let Ok(entries) = std::fs::read_dir(&root) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if matches!(self.db.get_snapshot(&name), Ok(Some(s)) if s.id == name) {
                continue;
            }
            tracing::warn!(leftover = %name, "removing a checkpoint image without a snapshot");
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                tracing::warn!("remove {}: {err}", e.path().display());
            }
        }
    }

    /// Removes layers no sandbox or snapshot uses any more.
    pub(super) fn gc_layers(&self) {
        let _g = self
            .layer_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = self
            .db
            .layers_in_use()
            .map_err(anyhow::Error::from)
            .and_then(|keep| self.layers.gc(&keep));
        match result {
            Ok(removed) if !removed.is_empty() => {
                tracing::info!(?removed, "removed unused layers")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("layer gc: {e:#}"),
        }
    }

    /// `PUT /v1/sandboxes/{id}/network`: a new egress policy, in force at once.
    pub async fn set_network(
        &self,
        id: &str,
        policy: moat_api::NetworkPolicy,
    ) -> Result<moat_api::NetworkInfo, Error> {
        let rec = self.record(id)?;
        if rec.network.is_none() {
            return Err(Error::conflict(format!(
                "sandbox {id} has no network (moat serve --network none)"
            )));
        }
        validate_policy(&policy)?;
        let tier = self.tier(rec.isolation)?;
        tier.set_network_policy(rec.slot, &policy)
            .await
            .map_err(|e| Error::internal(format!("network policy of {id}: {e:#}")))?;
        self.db.set_network(id, &policy)?;
        tracing::info!(sandbox = %id, ?policy, "network policy replaced");
        self.network(id)
    }

    /// `GET /v1/sandboxes/{id}/network`
    pub fn network(&self, id: &str) -> Result<moat_api::NetworkInfo, Error> {
        self.get(id)?.network.ok_or_else(|| {
            Error::conflict(format!(
                "sandbox {id} has no network (moat serve --network none)"
            ))
        })
    }

    pub fn get(&self, id: &str) -> Result<Sandbox, Error> {
        self.record(id).map(|r| self.api(&r))
    }
}
