//! Sandbox lifecycle: create, look up, list, extend, delete; expiry; re-adoption after a restart.
//!
//! State lives in the database; the only in-memory state is the open agent connections, which are
//! re-established from the database after a restart.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use moat_api::{CreateSandboxRequest, ErrorCode, Isolation, Sandbox, SandboxState};
use rand::RngCore;
use tokio::sync::RwLock;

use crate::agent::AgentClient;
use crate::config::ServeArgs;
use crate::db::{Claim, Db, SandboxRecord};
use crate::error::{ApiError, ApiResult};
use crate::template::store::TemplateStore;
use crate::tier::container::MAX_SLOTS;
use crate::tier::{IsolationTier, SandboxSpec};

pub struct Sandboxes {
    pub args: ServeArgs,
    pub db: Arc<Db>,
    pub templates: Arc<TemplateStore>,
    tiers: HashMap<Isolation, Arc<dyn IsolationTier>>,
    agents: RwLock<HashMap<String, Arc<AgentClient>>>,
    pool_wake: tokio::sync::Notify,
    pool_paused: std::sync::atomic::AtomicBool,
    host_cpus: f64,
    host_memory_mb: u64,
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn rfc3339(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// `sbx_` + 26 base32 characters of 128 random bits from the OS.
pub fn new_sandbox_id() -> String {
    let mut b = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut b);
    format!("sbx_{}", base32(&b))
}

fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let mut out = String::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for &b in bytes {
        acc = (acc << 8) | b as u32;
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((acc >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((acc << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// Whether `s` looks like a sandbox id (so garbage never reaches the database or a path).
pub fn valid_sandbox_id(s: &str) -> bool {
    s.len() == 30
        && s.starts_with("sbx_")
        && s[4..]
            .bytes()
            .all(|b| b.is_ascii_lowercase() || (b'2'..=b'7').contains(&b))
}

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
    }
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
        tiers: Vec<Arc<dyn IsolationTier>>,
    ) -> Sandboxes {
        let host_cpus = std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0);
        let host_memory_mb = nix::sys::sysinfo::sysinfo()
            .map(|s| s.ram_total() >> 20)
            .unwrap_or(1 << 20);
        Sandboxes {
            args,
            db,
            templates,
            tiers: tiers.into_iter().map(|t| (t.isolation(), t)).collect(),
            agents: RwLock::new(HashMap::new()),
            pool_wake: tokio::sync::Notify::new(),
            pool_paused: std::sync::atomic::AtomicBool::new(false),
            host_cpus,
            host_memory_mb,
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

    fn tier(&self, i: Isolation) -> ApiResult<Arc<dyn IsolationTier>> {
        self.tiers.get(&i).cloned().ok_or_else(|| {
            ApiError::invalid(
                "isolation",
                format!(
                    "isolation {} is not available in this version of moat",
                    i.as_str()
                ),
            )
        })
    }

    fn validate(&self, req: &CreateSandboxRequest) -> ApiResult<()> {
        if let Some(t) = req.timeout {
            if t == 0 || t > self.args.max_timeout {
                return Err(ApiError::invalid(
                    "timeout",
                    format!(
                        "timeout must be 1..={} seconds, got {t}",
                        self.args.max_timeout
                    ),
                ));
            }
        }
        if let Some(c) = req.cpu {
            if !c.is_finite() || c < 0.01 || c > self.host_cpus {
                return Err(ApiError::invalid(
                    "cpu",
                    format!("cpu must be 0.01..={} cores, got {c}", self.host_cpus),
                ));
            }
        }
        if let Some(m) = req.memory_mb {
            if !(16..=self.host_memory_mb).contains(&m) {
                return Err(ApiError::invalid(
                    "memory_mb",
                    format!("memory_mb must be 16..={}, got {m}", self.host_memory_mb),
                ));
            }
        }
        if req.env.len() > 1000 {
            return Err(ApiError::invalid(
                "env",
                "at most 1000 environment variables",
            ));
        }
        for (k, v) in &req.env {
            if k.is_empty()
                || k.contains('=')
                || k.contains('\0')
                || v.contains('\0')
                || k.len() > 4096
                || v.len() > 128 * 1024
            {
                return Err(ApiError::invalid(&format!("env.{k}"), "environment names must be non-empty without '=' or NUL; values without NUL and at most 128 KiB"));
            }
        }
        if req.metadata.len() > 64 {
            return Err(ApiError::invalid("metadata", "at most 64 metadata labels"));
        }
        for (k, v) in &req.metadata {
            if k.is_empty() || k.len() > 128 || v.len() > 1024 || k.contains('=') {
                return Err(ApiError::invalid(
                    &format!("metadata.{k}"),
                    "metadata keys must be 1-128 characters without '='; values at most 1024",
                ));
            }
        }
        Ok(())
    }

    pub async fn create(&self, req: CreateSandboxRequest) -> ApiResult<Sandbox> {
        self.validate(&req)?;
        let isolation = req.isolation.unwrap_or_default();
        let tier = self.tier(isolation)?;
        let template = req
            .template
            .clone()
            .unwrap_or_else(|| self.args.default_template.clone());
        moat_api::validate_template_name(&template)
            .map_err(|m| ApiError::invalid("template", m))?;
        let template_rootfs = self.templates.ensure(&self.db, &template).await?;

        let now = now_ms();
        let claim = Claim {
            template: template.clone(),
            created_at_ms: now,
            expires_at_ms: now + 1000 * req.timeout.unwrap_or(self.args.default_timeout) as i64,
            metadata: req.metadata,
            env: req.env,
            cpu: req.cpu.unwrap_or(self.args.default_cpu),
            memory_mb: req.memory_mb.unwrap_or(self.args.default_memory_mb),
        };
        if self.pool_serves(&template, isolation) {
            if let Some(rec) = self.claim(&claim, &tier).await {
                return Ok(to_api(&rec));
            }
        }
        let id = new_sandbox_id();
        let rec = SandboxRecord {
            hostname: format!("sbx-{}", &id[4..16]),
            id,
            template,
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
        };
        let rec = self.start_new(rec, tier, template_rootfs).await?;
        tracing::info!(sandbox = %rec.id, template = %rec.template, "created");
        Ok(to_api(&rec))
    }

    fn pool_serves(&self, template: &str, isolation: Isolation) -> bool {
        self.args.pool_size > 0
            && template == self.args.default_template
            && isolation == Isolation::Container
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
            if (claim.cpu, claim.memory_mb) != (self.args.default_cpu, self.args.default_memory_mb)
            {
                tier.set_limits(&rec.id, &state, claim.cpu, claim.memory_mb)
                    .await?;
            }
            if !claim.env.is_empty() {
                self.agent(&rec.id)
                    .await
                    .map_err(|e| anyhow::anyhow!("{}", e.0))?
                    .set_env(&claim.env)
                    .await?;
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
    ) -> ApiResult<SandboxRecord> {
        self.db
            .insert_sandbox(&mut rec, MAX_SLOTS)
            .map_err(|e| ApiError::new(ErrorCode::Conflict, format!("{e:#}")))?;
        let id = rec.id.clone();
        let spec = SandboxSpec {
            id: id.clone(),
            hostname: rec.hostname.clone(),
            template_rootfs,
            env: rec.env.clone(),
            cpu: rec.cpu,
            memory_mb: rec.memory_mb,
            slot: rec.slot,
        };
        let started = async {
            let state = tier.create(&spec).await?;
            // Record the tier state before anything else can fail, so a crash here is swept or adopted.
            self.db
                .set_tier_state(&id, SandboxState::Starting, &state)?;
            let agent = Arc::new(AgentClient::new(id.clone(), tier.clone(), state.clone()));
            agent.wait_ready(Duration::from_secs(20)).await?;
            self.db.set_tier_state(&id, SandboxState::Running, &state)?;
            anyhow::Ok((agent, state))
        }
        .await;
        match started {
            Ok((agent, state)) => {
                self.agents.write().await.insert(id.clone(), agent);
                rec.state = SandboxState::Running;
                rec.tier_state = Some(state);
                Ok(rec)
            }
            Err(e) => {
                let state = self
                    .db
                    .get_sandbox(&id)
                    .ok()
                    .flatten()
                    .and_then(|r| r.tier_state);
                if let Err(c) = tier.destroy(&id, state.as_ref()).await {
                    tracing::error!(sandbox = %id, "cleanup of failed create: {c:#}");
                }
                let _ = self.db.delete_sandbox(&id);
                Err(ApiError::internal(format!(
                    "could not start sandbox: {e:#}"
                )))
            }
        }
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
                tracing::warn!("warm pool: {}", e.0);
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }

    async fn fill_one(&self, template: &str) -> ApiResult<()> {
        let tier = self.tier(Isolation::Container)?;
        let rootfs = self.templates.rootfs(template);
        let id = new_sandbox_id();
        let rec = SandboxRecord {
            hostname: format!("sbx-{}", &id[4..16]),
            id,
            template: template.to_string(),
            isolation: Isolation::Container,
            state: SandboxState::Starting,
            created_at_ms: now_ms(),
            expires_at_ms: i64::MAX / 2,
            metadata: BTreeMap::new(),
            env: BTreeMap::new(),
            cpu: self.args.default_cpu,
            memory_mb: self.args.default_memory_mb,
            slot: 0,
            tier_state: None,
            pooled: true,
        };
        let rec = self.start_new(rec, tier, rootfs).await?;
        tracing::debug!(sandbox = %rec.id, "added to the warm pool");
        Ok(())
    }

    /// Removes the pooled sandboxes of a template (before it is rebuilt or removed) and stops refilling
    /// until `resume_pool`.
    pub async fn drain_pool(&self, template: &str) -> ApiResult<()> {
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

    fn record(&self, id: &str) -> ApiResult<SandboxRecord> {
        if !valid_sandbox_id(id) {
            return Err(ApiError::not_found(
                "id",
                format!("sandbox {id:?} not found"),
            ));
        }
        self.db
            .get_sandbox(id)?
            .filter(|r| !r.pooled)
            .ok_or_else(|| ApiError::not_found("id", format!("sandbox {id} not found")))
    }

    pub fn get(&self, id: &str) -> ApiResult<Sandbox> {
        self.record(id).map(|r| to_api(&r))
    }

    pub fn list(&self, filter: &ListFilter) -> ApiResult<Vec<Sandbox>> {
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
            .map(to_api)
            .collect())
    }

    pub fn set_timeout(&self, id: &str, timeout: u64) -> ApiResult<Sandbox> {
        let rec = self.record(id)?;
        if timeout == 0 || timeout > self.args.max_timeout {
            return Err(ApiError::invalid(
                "timeout",
                format!(
                    "timeout must be 1..={} seconds, got {timeout}",
                    self.args.max_timeout
                ),
            ));
        }
        if rec.state == SandboxState::Stopping {
            return Err(ApiError::conflict(format!("sandbox {id} is stopping")));
        }
        let at = now_ms() + 1000 * timeout as i64;
        self.db.set_expiry(id, at)?;
        self.get(id)
    }

    /// The agent connection of a running sandbox.
    pub async fn agent(&self, id: &str) -> ApiResult<Arc<AgentClient>> {
        let rec = self.record(id)?;
        if rec.state != SandboxState::Running {
            return Err(ApiError::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        }
        if let Some(a) = self.agents.read().await.get(id) {
            return Ok(a.clone());
        }
        let (Some(state), Ok(tier)) = (rec.tier_state.clone(), self.tier(rec.isolation)) else {
            return Err(ApiError::conflict(format!("sandbox {id} has no agent")));
        };
        let agent = Arc::new(AgentClient::new(id.to_string(), tier, state));
        self.agents
            .write()
            .await
            .insert(id.to_string(), agent.clone());
        Ok(agent)
    }

    pub async fn delete(&self, id: &str) -> ApiResult<()> {
        let rec = self.record(id)?;
        if rec.state == SandboxState::Starting {
            return Err(ApiError::conflict(format!(
                "sandbox {id} is still starting"
            )));
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
            let ids = match self.db.expired(now_ms()) {
                Ok(ids) => ids,
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
                    tracing::info!(sandbox = %id, "timeout passed");
                    if let Err(e) = self.destroy(rec).await {
                        tracing::error!(sandbox = %id, "expire: {e:#}");
                    }
                }
            }
        }
    }

    async fn remove_dead(&self) {
        let Ok(all) = self.db.list_sandboxes() else {
            return;
        };
        for rec in all {
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
            tracing::warn!(sandbox = %rec.id, "its PID 1 is gone; removing the sandbox");
            if let Err(e) = self.destroy(rec).await {
                tracing::error!("{e:#}");
            }
        }
    }

    /// At start: re-adopts sandboxes whose agent still runs, removes the rest, and sweeps leftovers that
    /// no database row owns.
    pub async fn recover(&self) -> Result<()> {
        let mut live = HashSet::new();
        for rec in self.db.list_sandboxes()? {
            let Some(tier) = self.tiers.get(&rec.isolation).cloned() else {
                continue;
            };
            let alive = match (&rec.state, &rec.tier_state) {
                (SandboxState::Running | SandboxState::Paused, Some(s)) => {
                    tier.is_alive(&rec.id, s).await
                }
                _ => false,
            };
            if alive {
                let agent = Arc::new(AgentClient::new(
                    rec.id.clone(),
                    tier.clone(),
                    rec.tier_state.clone().unwrap_or_default(),
                ));
                if rec.state == SandboxState::Paused
                    || agent.wait_ready(Duration::from_secs(5)).await.is_ok()
                {
                    self.agents.write().await.insert(rec.id.clone(), agent);
                    live.insert(rec.id.clone());
                    tracing::info!(sandbox = %rec.id, "re-adopted");
                    continue;
                }
            }
            tracing::warn!(sandbox = %rec.id, state = rec.state.as_str(), "not running any more; removing");
            if let Err(e) = self.destroy(rec).await {
                tracing::error!("{e:#}");
            }
        }
        for tier in self.tiers.values() {
            for name in tier.sweep(&live).await? {
                tracing::warn!(leftover = %name, "swept");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_well_formed_and_distinct() {
        let a = new_sandbox_id();
        let b = new_sandbox_id();
        assert_ne!(a, b);
        assert!(valid_sandbox_id(&a), "{a}");
        assert!(!valid_sandbox_id("sbx_../../etc"));
        assert!(!valid_sandbox_id("sbx_ABCDEFGHIJKLMNOPQRSTUVWXYZ"));
    }

    #[test]
    fn base32_known_values() {
        assert_eq!(base32(b"f"), "my");
        assert_eq!(base32(b"foobar"), "mzxw6ytboi");
    }

    #[test]
    fn time_format() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
    }
}
