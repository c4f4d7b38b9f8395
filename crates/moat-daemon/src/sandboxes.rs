//! Sandbox lifecycle: create, look up, list, extend, delete; expiry; re-adoption after a restart.
//!
//! State lives in the database; the only in-memory state is the open agent connections, which are
//! re-established from the database after a restart.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use moat_api::{
    AgentConfig, CreateSandboxRequest, Isolation, Sandbox, SandboxLimits, SandboxState,
    SandboxStats,
};
use tokio::sync::RwLock;

use crate::agent::AgentClient;
use crate::clock::now_ms;
use crate::clock::rfc3339;
use crate::config::ServeArgs;
use crate::db::{Claim, Db, SandboxRecord};
use crate::error::Error;
use crate::ids::{new_access_token, new_sandbox_id, valid_sandbox_id};
use crate::layers::LayerStore;
use crate::template::store::TemplateStore;
use crate::tier::container::MAX_SLOTS;
use crate::tier::{IsolationTier, SandboxSpec};

pub mod builds;
mod snapshots;
mod start;

pub struct Sandboxes {
    pub args: ServeArgs,
    pub db: Arc<Db>,
    pub templates: Arc<TemplateStore>,
    pub layers: Arc<LayerStore>,
    tiers: HashMap<Isolation, Arc<dyn IsolationTier>>,
    agents: RwLock<HashMap<String, Arc<AgentClient>>>,
    pool_wake: tokio::sync::Notify,
    pool_paused: std::sync::atomic::AtomicBool,
    host_cpus: f64,
    host_memory_mb: u64,
    /// The daemon's own hard RLIMIT_NOFILE: sandbox processes cannot be given more.
    host_nofile: u64,
    /// Size of the data directory's filesystem, MiB: the largest disk quota that makes sense.
    host_disk_mb: u64,
    /// Previous CPU sample per sandbox (when, usage in µs), for `cpu_cores` in stats.
    cpu_samples: std::sync::Mutex<HashMap<String, (std::time::Instant, u64)>>,
    /// One at a time per sandbox: snapshot, reset, pause, resume (each changes its frozen state or
    /// its whole instance).
    op_locks: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held while layers are committed and recorded, and while unused ones are removed.
    layer_lock: std::sync::Mutex<()>,
    /// The egress policy of sandboxes created without one (`--default-network`).
    default_network: moat_api::NetworkPolicy,
    /// Template builds running now, by build id.
    builds: std::sync::Mutex<HashMap<String, Arc<builds::LiveBuild>>>,
    /// The package registries build steps install from (`--build-*`).
    registries: crate::template::spec::Registries,
    /// Registry passwords of running builds' base images, by template (never stored).
    pull_secrets: std::sync::Mutex<HashMap<String, String>>,
}

/// The policy `--default-network` gives (JSON, or `@FILE` holding JSON), checked like a create's.
pub fn default_network(args: &ServeArgs) -> anyhow::Result<moat_api::NetworkPolicy> {
    let Some(v) = &args.default_network else {
        return Ok(moat_api::NetworkPolicy::default());
    };
    let text = match v.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--default-network {v}: {e}"))?,
        None => v.clone(),
    };
    let p: moat_api::NetworkPolicy =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--default-network: {e}"))?;
    validate_policy(&p).map_err(|e| {
        anyhow::anyhow!("--default-network: {}: {e}", e.field().unwrap_or_default())
    })?;
    Ok(p)
}

/// Per-process output buffer bounds, bytes.
const OUTPUT_BYTES_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(256 << 20);
/// Largest pids limit (the kernel's pid_max ceiling).
const MAX_PIDS: u64 = 4_194_304;
/// Smallest pids limit: the agent itself needs a handful of threads.
const MIN_PIDS: u64 = 16;
/// The idle clock is written at most this often per sandbox.
const TOUCH_EVERY_MS: i64 = 1000;

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
        isolation_note: None,
    }
}

/// Checks every entry of an egress policy (the error names the entry).
fn validate_policy(p: &moat_api::NetworkPolicy) -> Result<(), Error> {
    if p.egress_mbps.is_some_and(|m| !(1..=100_000).contains(&m)) {
        return Err(Error::invalid(
            "network.egress_mbps",
            "egress_mbps must be 1..=100000",
        ));
    }
    if p.connections_per_second
        .is_some_and(|n| !(1..=100_000).contains(&n))
    {
        return Err(Error::invalid(
            "network.connections_per_second",
            "connections_per_second must be 1..=100000",
        ));
    }
    for (list, entries) in [("allow_out", &p.allow_out), ("deny_out", &p.deny_out)] {
        if entries.len() > 1000 {
            return Err(Error::invalid(
                &format!("network.{list}"),
                "at most 1000 entries",
            ));
        }
        for (i, e) in entries.iter().enumerate() {
            moat_api::parse_destination(e)
                .map_err(|m| Error::invalid(&format!("network.{list}[{i}]"), m))?;
        }
    }
    Ok(())
}

/// Checks metadata labels (of a sandbox or a snapshot).
fn validate_metadata(md: &BTreeMap<String, String>) -> Result<(), Error> {
    if md.len() > 64 {
        return Err(Error::invalid("metadata", "at most 64 metadata labels"));
    }
    for (k, v) in md {
        if k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains('=') {
            return Err(Error::invalid(
                &format!("metadata.{k}"),
                "metadata keys must be 1-128 characters without '='; values at most 1024",
            ));
        }
    }
    Ok(())
}

/// `base` with what `req` sets replaced (a disk quota without an inode count gets one inode per
/// 16 KiB, like mkfs.ext4's default).
fn limits_over(base: &SandboxLimits, req: &CreateSandboxRequest) -> SandboxLimits {
    let disk_mb = req.disk_mb.unwrap_or(base.disk_mb);
    let inodes = match req.disk_inodes {
        Some(n) => n,
        None if req.disk_mb.is_some() => 0,
        None => base.disk_inodes,
    };
    let disk_inodes = match (disk_mb, inodes) {
        (0, _) => 0,
        (mb, 0) => (mb * 64).clamp(1024, u32::MAX as u64),
        (_, n) => n,
    };
    SandboxLimits {
        cpu: req.cpu.unwrap_or(base.cpu),
        memory_mb: req.memory_mb.unwrap_or(base.memory_mb),
        pids: req.pids.unwrap_or(base.pids),
        nofile: req.nofile.unwrap_or(base.nofile),
        disk_mb,
        disk_inodes,
        tmp_mb: req.tmp_mb.unwrap_or(base.tmp_mb),
        output_bytes: req.output_bytes.unwrap_or(base.output_bytes),
        command_timeout: req.command_timeout.unwrap_or(base.command_timeout),
        idle_timeout: req.idle_timeout.unwrap_or(base.idle_timeout),
    }
}

fn agent_config(
    l: &SandboxLimits,
    tier: &dyn IsolationTier,
    runtime: &moat_api::TemplateConfig,
) -> AgentConfig {
    AgentConfig {
        nofile: Some(l.nofile),
        output_bytes: Some(l.output_bytes),
        command_timeout: Some(l.command_timeout as f64),
        oom_counter: tier.capabilities().oom_counter_inside,
        nproc: tier.capabilities().process_limit_inside.then_some(l.pids),
        user: runtime.user.clone(),
        cwd: runtime.workdir.clone(),
    }
}

/// What a new sandbox stands on and starts with: its template's or its snapshot's root, layers,
/// environment, default user and working directory, and start command.
#[derive(Debug, Clone, Default)]
pub(crate) struct Stack {
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

    fn of_snapshot(s: &crate::db::SnapshotRecord) -> Stack {
        Stack {
            root: s.root.clone(),
            layers: s.layers.clone(),
            runtime: s.runtime.clone(),
            env: s.env.clone(),
        }
    }
}

/// Whether a sandbox is paused with its files only: its processes ended with the host, and a resume
/// starts it over its files.
pub fn files_only(rec: &SandboxRecord) -> bool {
    rec.state == SandboxState::Paused && rec.tier_state.as_ref().is_none_or(|v| v.is_null())
}

/// A client of a sandbox's agent that dials through its tier.
pub(crate) fn agent_client(
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

/// Filter of `GET /v1/sandboxes`.
#[derive(Debug, Default)]
pub struct ListFilter {
    pub state: Option<SandboxState>,
    pub metadata: BTreeMap<String, String>,
}

impl Sandboxes {
    pub fn new(
        args: ServeArgs,
        db: Arc<Db>,
        templates: Arc<TemplateStore>,
        layers: Arc<LayerStore>,
        tiers: Vec<Arc<dyn IsolationTier>>,
        default_network: moat_api::NetworkPolicy,
    ) -> Sandboxes {
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0);
        let host_memory_mb = nix::sys::sysinfo::sysinfo()
            .map(|s| s.ram_total() >> 20)
            .unwrap_or(1 << 20);
        let host_nofile = {
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
        let host_disk_mb = nix::sys::statvfs::statvfs(&args.data_dir)
            .map(|s| (s.blocks() * s.fragment_size()) >> 20)
            .unwrap_or(1 << 20);
        let registries = crate::template::spec::Registries::from_args(&args).unwrap_or_default();
        Sandboxes {
            args,
            db,
            templates,
            layers,
            tiers: tiers.into_iter().map(|t| (t.isolation(), t)).collect(),
            agents: RwLock::new(HashMap::new()),
            pool_wake: tokio::sync::Notify::new(),
            pool_paused: std::sync::atomic::AtomicBool::new(false),
            host_cpus,
            host_memory_mb,
            host_nofile,
            host_disk_mb,
            cpu_samples: std::sync::Mutex::new(HashMap::new()),
            op_locks: std::sync::Mutex::new(HashMap::new()),
            layer_lock: std::sync::Mutex::new(()),
            default_network,
            builds: std::sync::Mutex::new(HashMap::new()),
            registries,
            pull_secrets: std::sync::Mutex::new(HashMap::new()),
        }
    }

    /// The limits of a sandbox created with `req` (the daemon's defaults where it gives none).
    pub fn limits_for(&self, req: &CreateSandboxRequest) -> SandboxLimits {
        let a = &self.args;
        let defaults = SandboxLimits {
            cpu: a.default_cpu,
            memory_mb: a.default_memory_mb,
            pids: a.default_pids,
            nofile: a.default_nofile.min(self.host_nofile),
            disk_mb: a.default_disk_mb,
            disk_inodes: a.default_disk_inodes,
            tmp_mb: a.default_tmp_mb,
            output_bytes: a.default_output_bytes,
            command_timeout: a.default_command_timeout,
            idle_timeout: a.default_idle_timeout,
        };
        limits_over(&defaults, req)
    }

    /// Checks the limits that come from `req` or the defaults (a bad default is reported on the field
    /// too, so a misconfigured daemon is visible at the first create).
    fn validate_limits(&self, l: &SandboxLimits) -> Result<(), Error> {
        let range = |field: &str, v: u64, r: std::ops::RangeInclusive<u64>, zero_ok: bool| {
            if (zero_ok && v == 0) || r.contains(&v) {
                Ok(())
            } else {
                Err(Error::invalid(
                    field,
                    format!(
                        "{field} must be {}{}..={}, got {v}",
                        if zero_ok { "0 or " } else { "" },
                        r.start(),
                        r.end()
                    ),
                ))
            }
        };
        range("pids", l.pids, MIN_PIDS..=MAX_PIDS, false)?;
        range("nofile", l.nofile, 16..=self.host_nofile, false)?;
        range("disk_mb", l.disk_mb, 16..=self.host_disk_mb.max(16), true)?;
        if l.disk_mb > 0 {
            // At most one inode per 4 KiB block (ext4's limit).
            range(
                "disk_inodes",
                l.disk_inodes,
                1024..=(l.disk_mb * 256).min(u32::MAX as u64),
                false,
            )?;
        }
        range("tmp_mb", l.tmp_mb, 1..=l.memory_mb, true)?;
        range("output_bytes", l.output_bytes, OUTPUT_BYTES_RANGE, false)?;
        range(
            "command_timeout",
            l.command_timeout,
            1..=self.args.max_timeout,
            true,
        )?;
        range(
            "idle_timeout",
            l.idle_timeout,
            1..=self.args.max_timeout,
            true,
        )?;
        Ok(())
    }

    /// A sandbox as the API shows it (with its network, which the tier knows).
    fn api(&self, r: &SandboxRecord) -> Sandbox {
        let mut out = to_api(r);
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

    /// Whether sandboxes of the default tier get a network.
    pub fn networking_default(&self) -> bool {
        self.networking(self.args.default_isolation)
    }

    /// Size of the data directory's filesystem, MiB.
    pub fn host_disk_mb(&self) -> u64 {
        self.host_disk_mb
    }

    /// Whether sandboxes of this tier get a network (`moat serve --network nat`).
    fn networking(&self, isolation: Isolation) -> bool {
        self.tiers
            .get(&isolation)
            .is_some_and(|t| t.network_addresses(0).is_some())
    }

    /// The egress policy a create asks for, checked; None without networking.
    fn network_policy(
        &self,
        isolation: Isolation,
        asked: Option<&moat_api::NetworkPolicy>,
    ) -> Result<Option<moat_api::NetworkPolicy>, Error> {
        if !self.networking(isolation) {
            return match asked {
                Some(_) => Err(Error::invalid(
                    "network",
                    "sandbox networking is off on this daemon (moat serve --network none)",
                )),
                None => Ok(None),
            };
        }
        let policy = asked
            .cloned()
            .unwrap_or_else(|| self.default_network.clone());
        validate_policy(&policy)?;
        Ok(Some(policy))
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

    fn tier(&self, i: Isolation) -> Result<Arc<dyn IsolationTier>, Error> {
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

    /// A sandbox lifetime in seconds: 1..=`--max-timeout`.
    fn check_timeout(&self, t: u64) -> Result<(), Error> {
        if t == 0 || t > self.args.max_timeout {
            return Err(Error::invalid(
                "timeout",
                format!(
                    "timeout must be 1..={} seconds, got {t}",
                    self.args.max_timeout
                ),
            ));
        }
        Ok(())
    }

    fn validate(&self, req: &CreateSandboxRequest) -> Result<(), Error> {
        if let Some(t) = req.timeout {
            self.check_timeout(t)?;
        }
        if let Some(c) = req.cpu {
            if !c.is_finite() || c < 0.01 || c > self.host_cpus {
                return Err(Error::invalid(
                    "cpu",
                    format!("cpu must be 0.01..={} cores, got {c}", self.host_cpus),
                ));
            }
        }
        if let Some(m) = req.memory_mb {
            if !(16..=self.host_memory_mb).contains(&m) {
                return Err(Error::invalid(
                    "memory_mb",
                    format!("memory_mb must be 16..={}, got {m}", self.host_memory_mb),
                ));
            }
        }
        if req.disk_inodes.is_some_and(|n| n > 0) && req.disk_mb == Some(0) {
            return Err(Error::invalid(
                "disk_inodes",
                "disk_inodes needs a disk quota (disk_mb > 0)",
            ));
        }
        if req.env.len() > 1000 {
            return Err(Error::invalid("env", "at most 1000 environment variables"));
        }
        for (k, v) in &req.env {
            if k.is_empty()
                || k.contains('=')
                || k.contains('\0')
                || v.contains('\0')
                || k.len() > 4096
                || v.len() > 128 * 1024
            {
                return Err(Error::invalid(&format!("env.{k}"), "environment names must be non-empty without '=' or NUL; values without NUL and at most 128 KiB"));
            }
        }
        validate_metadata(&req.metadata)
    }

    pub async fn create(&self, req: CreateSandboxRequest) -> Result<Sandbox, Error> {
        self.validate(&req)?;
        let snapshot = match &req.snapshot {
            Some(s) => Some(self.snapshot_for_create(s, &req)?),
            None => None,
        };
        let isolation = snapshot
            .as_ref()
            .map(|s| s.isolation)
            .or(req.isolation)
            .unwrap_or(self.args.default_isolation);
        let tier = self.tier(isolation)?;
        let info = tier.info();
        if !info.available {
            return Err(Error::invalid(
                "isolation",
                format!(
                    "isolation {} is not available on this host: {}",
                    isolation.as_str(),
                    info.note.unwrap_or_default()
                ),
            ));
        }
        let template = match (&snapshot, &req.template) {
            (Some(s), _) => s.template.clone(),
            (None, Some(t)) => t.clone(),
            (None, None) => self.args.default_template.clone(),
        };
        moat_api::validate_template_name(&template).map_err(|m| Error::invalid("template", m))?;
        let stack = match &snapshot {
            Some(s) => Stack::of_snapshot(s),
            None => Stack::of_template(&self.templates.ensure(&self.db, &template).await?),
        };
        let template_rootfs = self.root_path(&template, stack.root.as_deref()).await?;

        let network = self.network_policy(isolation, req.network.as_ref())?;
        let limits = match &snapshot {
            Some(s) => limits_over(&s.limits, &req),
            None => self.limits_for(&req),
        };
        self.validate_limits(&limits)?;
        let mut env = stack.env.clone();
        env.extend(req.env);
        let now = now_ms();
        let claim = Claim {
            template: template.clone(),
            created_at_ms: now,
            expires_at_ms: now + 1000 * req.timeout.unwrap_or(self.args.default_timeout) as i64,
            metadata: req.metadata,
            env,
            cpu: limits.cpu,
            memory_mb: limits.memory_mb,
            limits,
            on_timeout: req.on_timeout.unwrap_or_default(),
            network,
            public_traffic: req.allow_public_traffic.unwrap_or(false),
        };
        let defaults = self.limits_for(&CreateSandboxRequest::default());
        // What a pooled sandbox cannot change after its start: the layer's filesystem and /tmp.
        let fixed = |l: &SandboxLimits| (l.disk_mb, l.disk_inodes, l.tmp_mb);
        if snapshot.is_none()
            && self.pool_serves(&template, isolation)
            && fixed(&claim.limits) == fixed(&defaults)
            && tier
                .capabilities()
                .can_take_limits(&defaults, &claim.limits)
        {
            if let Some(rec) = self.claim(&claim, &tier).await {
                return Ok(self.api(&rec));
            }
        }
        let rec = self.new_record(claim, isolation, snapshot.as_ref(), stack);
        let rec = self.start_new(rec, tier, template_rootfs).await?;
        tracing::info!(sandbox = %rec.id, template = %rec.template, snapshot = ?rec.snapshot, "created");
        Ok(self.api(&rec))
    }

    /// A new (not yet inserted) sandbox row.
    fn new_record(
        &self,
        claim: Claim,
        isolation: Isolation,
        snapshot: Option<&crate::db::SnapshotRecord>,
        stack: Stack,
    ) -> SandboxRecord {
        let id = new_sandbox_id();
        SandboxRecord {
            hostname: format!("sbx-{}", &id[4..16]),
            id,
            template: claim.template,
            isolation,
            state: SandboxState::Starting,
            created_at_ms: claim.created_at_ms,
            expires_at_ms: claim.expires_at_ms,
            metadata: claim.metadata,
            env: claim.env,
            cpu: claim.cpu,
            memory_mb: claim.memory_mb,
            slot: 0,
            tier_state: None,
            pooled: false,
            limits: claim.limits,
            last_active_ms: claim.created_at_ms,
            layers: stack.layers,
            snapshot: snapshot.map(|s| s.id.clone()),
            on_timeout: claim.on_timeout,
            network: claim.network,
            access_token: new_access_token(),
            public_traffic: claim.public_traffic,
            root: stack.root,
            runtime: stack.runtime,
        }
    }

    /// The directory at the bottom of a sandbox's layer stack: its template's rootfs (built on first
    /// use for `base`), another template's (`template:NAME`) or a layer.
    pub(crate) async fn root_path(
        &self,
        template: &str,
        root: Option<&str>,
    ) -> Result<std::path::PathBuf, Error> {
        let name = match root {
            None => template,
            Some(digest) if digest.starts_with("sha256:") => {
                let p = self.layers.path(digest)?;
                if !p.is_dir() {
                    return Err(Error::internal(format!(
                        "the base layer {digest} of template {template} is missing"
                    )));
                }
                return Ok(p);
            }
            Some(r) => r.strip_prefix("template:").unwrap_or(r),
        };
        self.templates.ensure(&self.db, name).await?;
        Ok(self.templates.rootfs(name))
    }

    fn pool_serves(&self, template: &str, isolation: Isolation) -> bool {
        self.args.pool_size > 0
            && template == self.args.default_template
            && isolation == self.args.default_isolation
    }

    /// Takes a sandbox from the warm pool and gives it the creator's limits and environment.
    async fn claim(&self, claim: &Claim, tier: &Arc<dyn IsolationTier>) -> Option<SandboxRecord> {
        let rec = match self.db.claim_pooled(claim) {
            Ok(Some(rec)) => rec,
            Ok(None) => return None,
            Err(e) => {
                tracing::error!("pool claim: {e:#}");
                return None;
            }
        };
        self.pool_wake.notify_one();
        let prepared = async {
            let state = rec.tier_state.clone().unwrap_or_default();
            let defaults = self.limits_for(&CreateSandboxRequest::default());
            let cg = |l: &SandboxLimits| (l.cpu, l.memory_mb, l.pids);
            if cg(&claim.limits) != cg(&defaults) {
                tier.set_limits(&rec.id, &state, &claim.limits).await?;
            }
            if let Some(policy) = &claim.network {
                if *policy != moat_api::NetworkPolicy::default() {
                    tier.set_network_policy(rec.slot, policy).await?;
                }
            }
            let agent = self
                .agent(&rec.id)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if claim.limits != defaults {
                agent
                    .configure(&agent_config(&claim.limits, tier.as_ref(), &rec.runtime))
                    .await?;
            }
            if !claim.env.is_empty() {
                agent.set_env(&claim.env).await?;
            }
            anyhow::Ok(())
        }
        .await;
        match prepared {
            Ok(()) => {
                tracing::info!(sandbox = %rec.id, template = %rec.template, "created (from the warm pool)");
                Some(rec)
            }
            Err(e) => {
                tracing::warn!(sandbox = %rec.id, "pooled sandbox unusable, starting a new one: {e:#}");
                if let Err(e) = self.destroy(rec).await {
                    tracing::error!("{e:#}");
                }
                None
            }
        }
    }

    /// Starts a sandbox from nothing: database row, tier, agent handshake. Removes what it made on failure.
    async fn start_new(
        &self,
        mut rec: SandboxRecord,
        tier: Arc<dyn IsolationTier>,
        template_rootfs: std::path::PathBuf,
    ) -> Result<SandboxRecord, Error> {
        self.db.insert_sandbox(&mut rec, MAX_SLOTS)?;
        let id = rec.id.clone();
        match self.boot(&rec, &tier, template_rootfs, false).await {
            Ok((agent, state)) => {
                // The timeout counts from when the sandbox is ready, as the idle clock does: a
                // microVM that booted for seconds keeps the whole lifetime it was created with.
                let now = now_ms();
                let shifted = now.saturating_sub(rec.created_at_ms);
                if shifted > 0 && rec.expires_at_ms < i64::MAX / 4 {
                    rec.expires_at_ms = rec.expires_at_ms.saturating_add(shifted);
                    if let Err(e) = self.db.set_expiry(&id, rec.expires_at_ms) {
                        tracing::warn!(sandbox = %id, "record the expiry: {e:#}");
                    }
                }
                self.agents.write().await.insert(id.clone(), agent);
                rec.state = SandboxState::Running;
                rec.tier_state = Some(state);
                Ok(rec)
            }
            Err(e) => {
                self.discard_failed(&id, &tier).await;
                Err(Error::internal(format!("could not start sandbox: {e:#}")))
            }
        }
    }

    /// Removes what a failed start left: the tier's instance and the row.
    async fn discard_failed(&self, id: &str, tier: &Arc<dyn IsolationTier>) {
        let state = self
            .db
            .get_sandbox(id)
            .ok()
            .flatten()
            .and_then(|r| r.tier_state);
        if let Err(c) = tier.destroy(id, state.as_ref()).await {
            tracing::error!(sandbox = %id, "cleanup of failed create: {c:#}");
        }
        let _ = self.db.delete_sandbox(id);
    }

    /// Starts the tier's instance of an inserted sandbox row (with its layers, limits and environment)
    /// and waits for its agent; the row is `running` with the new tier state when this succeeds.
    async fn boot(
        &self,
        rec: &SandboxRecord,
        tier: &Arc<dyn IsolationTier>,
        template_rootfs: std::path::PathBuf,
        keep_files: bool,
    ) -> Result<(Arc<AgentClient>, serde_json::Value)> {
        let id = rec.id.clone();
        let layers = rec
            .layers
            .iter()
            .map(|d| self.layers.path(d))
            .collect::<Result<Vec<_>>>()?;
        let spec = SandboxSpec {
            id: id.clone(),
            hostname: rec.hostname.clone(),
            template_rootfs,
            layers,
            env: rec.env.clone(),
            limits: rec.limits.clone(),
            slot: rec.slot,
            network: rec.network.clone(),
            keep_files,
            restore: if keep_files {
                None
            } else {
                self.full_image_of(rec.snapshot.as_deref())?
            },
        };
        let config = agent_config(&rec.limits, tier.as_ref(), &rec.runtime);
        let restoring = spec.restore.is_some();
        let state = tier.create(&spec).await?;
        // Record the tier state before anything else can fail, so a crash here is swept or adopted.
        self.db
            .set_tier_state(&id, SandboxState::Starting, &state)?;
        let agent = Arc::new(agent_client(&id, tier, &state));
        let t = std::time::Instant::now();
        agent.wait_ready(Duration::from_secs(20)).await?;
        tracing::debug!(sandbox = %id, took = ?t.elapsed(), "agent ready");
        agent.configure(&config).await?;
        if restoring && !rec.env.is_empty() {
            // The restored agent has the snapshotted sandbox's environment; this one's goes over it.
            agent.set_env(&rec.env).await?;
        }
        if let (Some(start), false) = (&rec.runtime.start, restoring) {
            start::run(&agent, start).await?;
        }
        self.db.set_tier_state(&id, SandboxState::Running, &state)?;
        // The idle clock starts when the sandbox can be used: a guest that took seconds to boot
        // has not been idle for them.
        self.db.touch(&id, now_ms())?;
        Ok((agent, state))
    }

    /// Keeps `pool_size` sandboxes of the default template started, forever. Only fills from a
    /// template that is ready: it never starts a template build.
    pub async fn pool_loop(self: Arc<Self>) {
        if self.args.pool_size == 0 {
            return;
        }
        let template = self.args.default_template.clone();
        loop {
            let ready = matches!(self.db.get_template(&template), Ok(Some(t)) if t.status == moat_api::TemplateStatus::Ready);
            let have = self.db.pooled_count(&template).unwrap_or(u64::MAX);
            if !ready
                || self.pool_paused.load(std::sync::atomic::Ordering::Relaxed)
                || have >= self.args.pool_size as u64
            {
                let _ =
                    tokio::time::timeout(Duration::from_secs(2), self.pool_wake.notified()).await;
                continue;
            }
            if let Err(e) = self.fill_one(&template).await {
                tracing::warn!("warm pool: {e}");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }

    async fn fill_one(&self, template: &str) -> Result<(), Error> {
        let tier = self.tier(self.args.default_isolation)?;
        let stack = match self.db.get_template(template)? {
            Some(t) => Stack::of_template(&t),
            None => return Err(Error::conflict(format!("template {template} is gone"))),
        };
        let rootfs = self.root_path(template, stack.root.as_deref()).await?;
        let id = new_sandbox_id();
        let rec = SandboxRecord {
            hostname: format!("sbx-{}", &id[4..16]),
            id,
            template: template.to_string(),
            isolation: self.args.default_isolation,
            state: SandboxState::Starting,
            created_at_ms: now_ms(),
            expires_at_ms: i64::MAX / 2,
            metadata: BTreeMap::new(),
            env: stack.env,
            cpu: self.args.default_cpu,
            memory_mb: self.args.default_memory_mb,
            slot: 0,
            tier_state: None,
            pooled: true,
            limits: self.limits_for(&CreateSandboxRequest::default()),
            last_active_ms: 0,
            layers: stack.layers,
            snapshot: None,
            on_timeout: moat_api::OnTimeout::Kill,
            network: self
                .networking(Isolation::Container)
                .then(moat_api::NetworkPolicy::default),
            access_token: new_access_token(),
            public_traffic: false,
            root: stack.root,
            runtime: stack.runtime,
        };
        let rec = self.start_new(rec, tier, rootfs).await?;
        tracing::debug!(sandbox = %rec.id, "added to the warm pool");
        Ok(())
    }

    /// Removes the pooled sandboxes of a template (before it is rebuilt or removed) and stops refilling
    /// until `resume_pool`.
    pub async fn drain_pool(&self, template: &str) -> Result<(), Error> {
        self.pool_paused
            .store(true, std::sync::atomic::Ordering::Relaxed);
        for rec in self.db.list_sandboxes()? {
            if rec.pooled && rec.template == template && rec.state != SandboxState::Starting {
                self.destroy(rec).await?;
            }
        }
        Ok(())
    }

    pub fn pool_info(&self) -> Option<moat_api::PoolInfo> {
        if self.args.pool_size == 0 {
            return None;
        }
        let template = self.args.default_template.clone();
        let ready = self
            .db
            .list_sandboxes()
            .map(|all| {
                all.iter()
                    .filter(|r| {
                        r.pooled && r.template == template && r.state == SandboxState::Running
                    })
                    .count() as u32
            })
            .unwrap_or(0);
        Some(moat_api::PoolInfo {
            template,
            size: self.args.pool_size,
            ready,
        })
    }

    pub fn resume_pool(&self) {
        self.pool_paused
            .store(false, std::sync::atomic::Ordering::Relaxed);
        self.pool_wake.notify_one();
    }

    fn record(&self, id: &str) -> Result<SandboxRecord, Error> {
        if !valid_sandbox_id(id) {
            return Err(Error::not_found("id", format!("sandbox {id:?} not found")));
        }
        let rec = self
            .db
            .get_sandbox(id)?
            .filter(|r| !r.pooled)
            .ok_or_else(|| Error::not_found("id", format!("sandbox {id} not found")))?;
        // Every request for a sandbox goes through here: it restarts the idle clock.
        let now = now_ms();
        if now - rec.last_active_ms >= TOUCH_EVERY_MS {
            if let Err(e) = self.db.touch(id, now) {
                tracing::warn!(sandbox = %id, "idle clock: {e:#}");
            }
        }
        Ok(rec)
    }

    /// Live usage of a sandbox, read on the host.
    pub async fn stats(&self, id: &str) -> Result<SandboxStats, Error> {
        let rec = self.record(id)?;
        let (Some(state), SandboxState::Running | SandboxState::Paused) =
            (rec.tier_state.as_ref(), rec.state)
        else {
            return Err(Error::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        };
        let tier = self.tier(rec.isolation)?;
        let read = || async {
            tier.usage(id, state)
                .await
                .map_err(|e| Error::internal(format!("sandbox {id}: usage: {e:#}")))
        };
        let mut u = read().await?;
        let now = std::time::Instant::now();
        let prev = self
            .cpu_samples
            .lock()
            .ok()
            .and_then(|m| m.get(id).copied());
        let (since, before) = match prev {
            Some(p) if now.duration_since(p.0) >= Duration::from_millis(50) => p,
            _ => {
                // No earlier sample (or one too recent to mean anything): take two now.
                let first = (now, u.cpu_usage_us);
                tokio::time::sleep(Duration::from_millis(200)).await;
                u = read().await?;
                first
            }
        };
        let at = std::time::Instant::now();
        let wall_us = at.duration_since(since).as_micros().max(1) as f64;
        let cpu_cores = u.cpu_usage_us.saturating_sub(before) as f64 / wall_us;
        if let Ok(mut m) = self.cpu_samples.lock() {
            m.insert(id.to_string(), (at, u.cpu_usage_us));
        }
        // A tier whose sandbox processes are in a cgroup inside (a microVM's guest) counts their OOM
        // kills there; the host cgroup's count is QEMU's. Read through the agent, unless paused.
        if let (Some(path), SandboxState::Running) =
            (tier.capabilities().oom_counter_inside, rec.state)
        {
            if let Some(n) = self.inner_oom_kills(id, &path).await {
                u.oom_kills = u.oom_kills.max(n);
            }
        }
        Ok(SandboxStats {
            id: id.to_string(),
            cpu_usage_us: u.cpu_usage_us,
            cpu_cores: (cpu_cores * 1000.0).round() / 1000.0,
            memory_bytes: u.memory_bytes,
            memory_peak_bytes: u.memory_peak_bytes,
            pids: u.pids,
            disk_bytes: u.disk_bytes,
            disk_inodes: u.disk_inodes,
            oom_kills: u.oom_kills,
            limits: rec.limits.clone(),
        })
    }

    /// The `oom_kill` count of a cgroup's `memory.events` inside the sandbox, read by its agent.
    async fn inner_oom_kills(&self, id: &str, path: &str) -> Option<u64> {
        let agent = self.agent_untouched(id).await.ok()?;
        let text = tokio::time::timeout(Duration::from_secs(5), agent.read_text(path, 1 << 20))
            .await
            .ok()?
            .ok()?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
    }

    pub fn get(&self, id: &str) -> Result<Sandbox, Error> {
        self.record(id).map(|r| self.api(&r))
    }

    pub fn list(&self, filter: &ListFilter) -> Result<Vec<Sandbox>, Error> {
        Ok(self
            .db
            .list_sandboxes()?
            .iter()
            .filter(|r| !r.pooled)
            .filter(|r| filter.state.is_none_or(|s| s == r.state))
            .filter(|r| {
                filter
                    .metadata
                    .iter()
                    .all(|(k, v)| r.metadata.get(k) == Some(v))
            })
            .map(|r| self.api(r))
            .collect())
    }

    pub fn set_timeout(&self, id: &str, timeout: u64) -> Result<Sandbox, Error> {
        let rec = self.record(id)?;
        self.check_timeout(timeout)?;
        if rec.state == SandboxState::Stopping {
            return Err(Error::conflict(format!("sandbox {id} is stopping")));
        }
        let at = now_ms() + 1000 * timeout as i64;
        self.db.set_expiry(id, at)?;
        self.get(id)
    }

    /// The agent connection of a running sandbox.
    pub async fn agent(&self, id: &str) -> Result<Arc<AgentClient>, Error> {
        let rec = self.record(id)?;
        self.agent_of(rec).await
    }

    /// The agent connection of a running sandbox, without counting as activity (for the daemon's own
    /// polling, which must not keep a sandbox from its idle timeout).
    pub async fn agent_untouched(&self, id: &str) -> Result<Arc<AgentClient>, Error> {
        let rec = self
            .db
            .get_sandbox(id)?
            .filter(|r| !r.pooled)
            .ok_or_else(|| Error::not_found("id", format!("sandbox {id} not found")))?;
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

    pub async fn delete(&self, id: &str) -> Result<(), Error> {
        let rec = self.record(id)?;
        if rec.state == SandboxState::Starting {
            return Err(Error::conflict(format!("sandbox {id} is still starting")));
        }
        self.destroy(rec).await.map_err(Into::into)
    }

    async fn destroy(&self, rec: SandboxRecord) -> Result<()> {
        self.db.set_state(&rec.id, SandboxState::Stopping)?;
        self.agents.write().await.remove(&rec.id);
        let tier = self
            .tiers
            .get(&rec.isolation)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("no tier {}", rec.isolation.as_str()))?;
        tier.destroy(&rec.id, rec.tier_state.as_ref()).await?;
        self.db.delete_sandbox(&rec.id)?;
        if let Ok(mut m) = self.cpu_samples.lock() {
            m.remove(&rec.id);
        }
        if let Ok(mut m) = self.op_locks.lock() {
            m.remove(&rec.id);
        }
        if !rec.layers.is_empty() {
            self.gc_layers();
        }
        tracing::info!(sandbox = %rec.id, "deleted");
        Ok(())
    }

    /// Kills sandboxes whose timeout passed, and removes sandboxes whose PID 1 died (an agent that
    /// crashed, was OOM-killed or was killed from the host); runs every `period` forever.
    pub async fn expire_loop(self: Arc<Self>, period: Duration) {
        let mut tick = tokio::time::interval(period);
        let mut n: u64 = 0;
        loop {
            tick.tick().await;
            n += 1;
            if n.is_multiple_of(4) {
                self.remove_dead().await;
            }
            let now = now_ms();
            let ids = match self.db.expired(now) {
                Ok(mut ids) => {
                    ids.extend(self.idle(now));
                    ids
                }
                Err(e) => {
                    tracing::error!("expiry query: {e:#}");
                    continue;
                }
            };
            for id in ids {
                if let Ok(Some(rec)) = self.db.get_sandbox(&id) {
                    if rec.state == SandboxState::Starting {
                        continue;
                    }
                    if rec.on_timeout == moat_api::OnTimeout::Pause {
                        tracing::info!(sandbox = %id, "timeout or idle timeout passed: pausing");
                        if let Err(e) = self.pause(&id).await {
                            tracing::error!(sandbox = %id, "pause at timeout: {e}");
                        }
                        continue;
                    }
                    tracing::info!(sandbox = %id, "timeout or idle timeout passed");
                    if let Err(e) = self.destroy(rec).await {
                        tracing::error!(sandbox = %id, "expire: {e:#}");
                    }
                }
            }
        }
    }

    /// Ids of sandboxes whose idle timeout passed.
    fn idle(&self, now: i64) -> Vec<String> {
        self.db
            .list_sandboxes()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| {
                !r.pooled
                    && r.state == SandboxState::Running
                    && r.limits.idle_timeout > 0
                    && r.last_active_ms + 1000 * r.limits.idle_timeout as i64 <= now
            })
            .map(|r| r.id)
            .collect()
    }

    async fn remove_dead(&self) {
        let Ok(all) = self.db.list_sandboxes() else {
            return;
        };
        for rec in all {
            // A snapshot, reset, pause or resume in progress may replace the sandbox's processes (a
            // full-state snapshot restores them): it is looked at next time.
            let lock = self.op_lock(&rec.id);
            let Ok(_op) = lock.try_lock() else {
                continue;
            };
            let Ok(Some(rec)) = self.db.get_sandbox(&rec.id) else {
                continue;
            };
            let (SandboxState::Running | SandboxState::Paused, Some(state), Some(tier)) = (
                rec.state,
                rec.tier_state.as_ref(),
                self.tiers.get(&rec.isolation),
            ) else {
                continue;
            };
            // Re-read: a delete may have started since the list was taken.
            if tier.is_alive(&rec.id, state).await
                || !matches!(self.db.get_sandbox(&rec.id), Ok(Some(r)) if r.state == rec.state)
            {
                continue;
            }
            // Its cgroup is still there: an OOM kill counted there says why (on gvisor the host's OOM
            // killer ends the Sentry, and the sandbox with it, when the memory limit is hit).
            let oom_kills = tier
                .usage(&rec.id, state)
                .await
                .map(|u| u.oom_kills)
                .unwrap_or(0);
            if oom_kills > 0 {
                tracing::warn!(sandbox = %rec.id, oom_kills, "it ran out of memory: the host's OOM killer ended it; removing the sandbox");
            } else {
                tracing::warn!(sandbox = %rec.id, "its PID 1 is gone; removing the sandbox");
            }
            if let Err(e) = self.destroy(rec).await {
                tracing::error!("{e:#}");
            }
        }
    }

    /// At start: re-adopts sandboxes whose agent still runs, removes the rest, and sweeps leftovers that
    /// no database row owns.
    pub async fn recover(&self) -> Result<()> {
        self.recover_builds()?;
        let mut live = HashSet::new();
        // Paused sandboxes without processes: files only, not swept.
        let mut kept_files = HashSet::new();
        for rec in self.db.list_sandboxes()? {
            let Some(tier) = self.tiers.get(&rec.isolation).cloned() else {
                continue;
            };
            if rec.metadata.contains_key(builds::BUILD_LABEL) {
                // Its build ended with the daemon.
                tracing::info!(sandbox = %rec.id, "removing a sandbox of an interrupted build");
                if let Err(e) = self.destroy(rec).await {
                    tracing::error!("{e:#}");
                }
                continue;
            }
            let alive = match (&rec.state, &rec.tier_state) {
                (SandboxState::Running | SandboxState::Paused, Some(s)) => {
                    tier.is_alive(&rec.id, s).await
                }
                _ => false,
            };
            if alive {
                let agent = Arc::new(agent_client(
                    &rec.id,
                    &tier,
                    &rec.tier_state.clone().unwrap_or_default(),
                ));
                if rec.state == SandboxState::Running {
                    // A crash during a snapshot can leave a running sandbox frozen.
                    if let Err(e) = tier
                        .resume(
                            &rec.id,
                            rec.tier_state.as_ref().unwrap_or(&serde_json::Value::Null),
                        )
                        .await
                    {
                        tracing::warn!(sandbox = %rec.id, "thaw at start-up: {e:#}");
                    }
                }
                if rec.state == SandboxState::Paused
                    || agent.wait_ready(Duration::from_secs(5)).await.is_ok()
                {
                    self.agents.write().await.insert(rec.id.clone(), agent);
                    live.insert(rec.id.clone());
                    tracing::info!(sandbox = %rec.id, "re-adopted");
                    continue;
                }
            }
            if rec.state == SandboxState::Paused {
                // Its processes ended with the host (a reboot): keep its files for a resume.
                match tier.release(&rec.id, rec.tier_state.as_ref()).await {
                    Ok(()) => {
                        self.db.set_tier_state(
                            &rec.id,
                            SandboxState::Paused,
                            &serde_json::Value::Null,
                        )?;
                        kept_files.insert(rec.id.clone());
                        tracing::warn!(sandbox = %rec.id, "paused, its processes are gone: kept its files; resume starts it over them");
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(sandbox = %rec.id, "keep the files of a paused sandbox: {e:#}")
                    }
                }
            }
            tracing::warn!(sandbox = %rec.id, state = rec.state.as_str(), "not running any more; removing");
            if let Err(e) = self.destroy(rec).await {
                tracing::error!("{e:#}");
            }
        }
        // One host network serves every tier (one nft table, one address space): each tier gets the
        // policies of all live sandboxes.
        let mut policies = std::collections::BTreeMap::<u32, moat_api::NetworkPolicy>::new();
        for rec in self.db.list_sandboxes()? {
            if let (true, Some(p)) = (live.contains(&rec.id), rec.network) {
                policies.insert(rec.slot, p);
            }
        }
        for tier in self.tiers.values() {
            tier.restore_network(&policies)
                .await
                .context("restore sandbox networking")?;
            let keep: HashSet<String> = live.union(&kept_files).cloned().collect();
            for name in tier.sweep(&keep).await? {
                tracing::warn!(leftover = %name, "swept");
            }
        }
        self.gc_layers();
        self.sweep_checkpoints();
        self.trim_pool().await
    }

    /// Removes pooled sandboxes this configuration would not keep: of another template than the
    /// default, or more than `pool_size` (e.g. after a restart with a smaller pool, or none).
    async fn trim_pool(&self) -> Result<()> {
        let mut kept = 0u32;
        for rec in self.db.list_sandboxes()? {
            if !rec.pooled {
                continue;
            }
            if rec.template == self.args.default_template && kept < self.args.pool_size {
                kept += 1;
                continue;
            }
            tracing::info!(sandbox = %rec.id, "removing a pooled sandbox the configuration does not keep");
            self.destroy(rec).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_network_from_json_or_a_file() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        let args = |v: Option<&str>| {
            let mut argv = vec!["moat"];
            if let Some(v) = v {
                argv.extend(["--default-network", v]);
            }
            <Cli as clap::Parser>::try_parse_from(argv).unwrap().serve
        };
        assert_eq!(
            default_network(&args(None)).unwrap(),
            moat_api::NetworkPolicy::default()
        );
        let p = default_network(&args(Some(
            r#"{"allow_internet":false,"allow_out":["@pypi"]}"#,
        )))
        .unwrap();
        assert!(!p.allow_internet);
        assert_eq!(p.allow_out, ["@pypi"]);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("net.json");
        std::fs::write(&f, r#"{"deny_out":["203.0.113.0/24"]}"#).unwrap();
        let from_file = format!("@{}", f.display());
        assert_eq!(
            default_network(&args(Some(&from_file))).unwrap().deny_out,
            ["203.0.113.0/24"]
        );
        let bad = default_network(&args(Some(r#"{"allow_out":["exa mple.com"]}"#))).unwrap_err();
        assert!(bad.to_string().contains("network.allow_out[0]"), "{bad}");
        assert!(default_network(&args(Some("{not json"))).is_err());
        assert!(default_network(&args(Some("@/nonexistent"))).is_err());
    }
}
