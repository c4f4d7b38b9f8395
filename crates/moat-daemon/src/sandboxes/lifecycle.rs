//! The lifecycle of one sandbox as the fronts see it: create (from the warm pool when one fits),
//! look up, list, extend, stats, network policy, pause and resume, delete.

use std::collections::BTreeMap;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use moat_api::{
    CreateSandboxRequest, PauseResult, ResumeRequest, Sandbox, SandboxLimits, SandboxState,
    SandboxStats,
};

use super::core::{detached, files_only, Core, Stack, START_DEADLINE};
use super::pool::Pool;
use super::validate::limits_over;
use crate::clock::now_ms;
use crate::db::{Claim, SandboxRecord};
use crate::error::Error;
use crate::tier::IsolationTier;

/// Filter of `GET /v1/sandboxes`.
#[derive(Debug, Default)]
pub struct ListFilter {
    pub state: Option<SandboxState>,
    pub metadata: BTreeMap<String, String>,
}

impl ListFilter {
    /// Whether `metadata` has every label the filter asks for.
    fn labels_match(&self, metadata: &BTreeMap<String, String>) -> bool {
        self.metadata
            .iter()
            .all(|(k, v)| metadata.get(k) == Some(v))
    }
}

pub struct Lifecycle {
    core: Arc<Core>,
    pool: Arc<Pool>,
}

impl Deref for Lifecycle {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Lifecycle {
    pub(super) fn new(core: Arc<Core>, pool: Arc<Pool>) -> Lifecycle {
        Lifecycle { core, pool }
    }

    pub(super) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Whether sandboxes of the default tier get a network.
    pub fn networking_default(&self) -> bool {
        self.networking(self.settings.default_isolation)
    }

    /// Size of the data directory's filesystem, MiB.
    pub fn host_disk_mb(&self) -> u64 {
        self.host.disk_mb
    }

    /// Creates a sandbox (from the warm pool when one fits). It runs to its end whatever the caller
    /// does: a create whose client went away leaves a running sandbox (with its timeout) or
    /// nothing, never one stuck `starting`.
    pub async fn create(self: &Arc<Self>, req: CreateSandboxRequest) -> Result<Sandbox, Error> {
        let this = self.clone();
        detached(async move { this.create_now(req).await }).await
    }

    pub(super) async fn create_now(&self, req: CreateSandboxRequest) -> Result<Sandbox, Error> {
        self.validate(&req)?;
        self.check_disk()?;
        let snapshot = match &req.snapshot {
            Some(s) => Some(self.snapshot_for_create(s, &req)?),
            None => None,
        };
        let isolation = snapshot
            .as_ref()
            .map(|s| s.isolation)
            .or(req.isolation)
            .unwrap_or(self.settings.default_isolation);
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
            (None, None) => self.settings.default_template.clone(),
        };
        moat_api::validate_template_name(&template).map_err(|m| Error::invalid("template", m))?;
        let stack = match &snapshot {
            Some(s) => Stack::of_snapshot(s),
            None => Stack::of_template(&self.templates.ensure(&self.db, &template).await?),
        };
        let template_rootfs = self.root_path(&template, stack.root.as_deref()).await?;

        let network = self.network_policy(isolation, req.network.as_ref())?;
        if !req.secrets.is_empty() && network.is_none() {
            return Err(Error::conflict(
                "secrets need sandbox networking (the proxy puts them on the wire), and this \
                 daemon runs with --network none",
            ));
        }
        // A sandbox with secrets gets its placeholders and authority at its own start: never
        // one from the warm pool.
        let with_secrets = network.is_some()
            && (!req.secrets.is_empty() || self.vault.applies_to_template(&template)?);
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
            expires_at_ms: now + 1000 * req.timeout.unwrap_or(self.settings.default_timeout) as i64,
            metadata: req.metadata,
            env,
            cpu: limits.cpu,
            memory_mb: limits.memory_mb,
            limits,
            on_timeout: req.on_timeout.unwrap_or_default(),
            network,
            public_traffic: req.allow_public_traffic.unwrap_or(false),
            auto_resume: req.auto_resume.unwrap_or(false),
        };
        let defaults = self.limits_for(&CreateSandboxRequest::default());
        // What a pooled sandbox cannot change after its start: the layer's filesystem and /tmp.
        let fixed = |l: &SandboxLimits| (l.disk_mb, l.disk_inodes, l.tmp_mb);
        if snapshot.is_none()
            && !with_secrets
            && self.pool.serves(&template, isolation)
            && fixed(&claim.limits) == fixed(&defaults)
            && self
                .capabilities(isolation)
                .can_take_limits(&defaults, &claim.limits)
        {
            if let Some(rec) = self.pool.claim(&claim, &tier).await {
                return Ok(self.api(&rec));
            }
        }
        let mut rec = self.new_record(claim, isolation, snapshot.as_ref(), stack);
        if with_secrets {
            // Its placeholders go over any of the same names (a snapshot's are another sandbox's).
            let (env, _) = self
                .vault
                .prepare(&rec.id, &template, &req.secrets)
                .inspect_err(|_| {
                    let _ = self.db.delete_sandbox(&rec.id);
                })?;
            rec.env.extend(env);
        }
        let rec = self.start_new(rec, tier, template_rootfs).await?;
        tracing::info!(sandbox = %rec.id, template = %rec.template, snapshot = ?rec.snapshot, "created");
        Ok(self.api(&rec))
    }

    /// A sandbox: a live one (its disk looked at for `disk_full`), or what one that ended without
    /// a request was, with why (`state: ended`; kept 24 h).
    pub async fn inspect(&self, id: &str) -> Result<Sandbox, Error> {
        let rec = match self.record(id) {
            Ok(r) => r,
            Err(e @ Error::NotFound { .. }) => return self.ended_sandbox(id).ok_or(e),
            Err(e) => return Err(e),
        };
        if let (SandboxState::Running, Some(state), true) =
            (rec.state, &rec.tier_state, rec.limits.disk_mb > 0)
        {
            if let Ok(u) = self.tier(rec.isolation)?.usage(id, state).await {
                self.note_disk(&rec, &u);
            }
        }
        Ok(self.api(&rec))
    }

    pub fn list(&self, filter: &ListFilter) -> Result<Vec<Sandbox>, Error> {
        if filter.state == Some(SandboxState::Ended) {
            return Ok(self
                .db
                .list_ended()?
                .into_iter()
                .filter(|s| filter.labels_match(&s.metadata))
                .collect());
        }
        Ok(self
            .db
            .list_sandboxes()?
            .iter()
            .filter(|r| !r.pooled)
            .filter(|r| filter.state.is_none_or(|s| s == r.state))
            .filter(|r| filter.labels_match(&r.metadata))
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

    /// Deletes a sandbox in any state. One being started is deleted once its start ends (a
    /// start finishes or cleans up by itself); one whose start has no owner any more at once.
    pub async fn delete(self: &Arc<Self>, id: &str) -> Result<(), Error> {
        let (this, id) = (self.clone(), id.to_string());
        detached(async move { this.delete_now(&id).await }).await
    }

    async fn delete_now(&self, id: &str) -> Result<(), Error> {
        let mut rec = self.record(id)?;
        if rec.state == SandboxState::Starting && self.is_starting(id) {
            let deadline = tokio::time::Instant::now() + START_DEADLINE;
            while self.is_starting(id) {
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::conflict(format!(
                        "sandbox {id} is still starting after {} s",
                        START_DEADLINE.as_secs()
                    )));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            rec = match self.db.get_sandbox(id)? {
                Some(r) => r,
                // Its start failed and took it away.
                None => return Ok(()),
            };
        }
        self.destroy(rec).await.map_err(Into::into)
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
        self.note_disk(&rec, &u);
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
        if let (Some(path), SandboxState::Running) = (
            self.capabilities(rec.isolation).oom_counter_inside,
            rec.state,
        ) {
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

    /// Freezes every process of a running sandbox; it keeps its memory and files, uses no CPU, and
    /// does not expire while paused.
    pub async fn pause(self: &Arc<Self>, id: &str) -> Result<PauseResult, Error> {
        let (this, id) = (self.clone(), id.to_string());
        detached(async move { this.pause_now(&id).await }).await
    }

    async fn pause_now(&self, id: &str) -> Result<PauseResult, Error> {
        let lock = self.op_lock(id);
        let _op = lock.lock().await;
        let rec = self.record(id)?;
        match rec.state {
            SandboxState::Running => {}
            SandboxState::Paused => {
                return Err(Error::conflict(format!("sandbox {id} is already paused")))
            }
            s => return Err(Error::conflict(format!("sandbox {id} is {}", s.as_str()))),
        }
        let tier = self.tier(rec.isolation)?;
        let state = rec.tier_state.clone().unwrap_or_default();
        tier.pause(id, &state)
            .await
            .map_err(|e| Error::internal(format!("pause {id}: {e:#}")))?;
        self.db.set_state(id, SandboxState::Paused)?;
        tracing::info!(sandbox = %id, "paused");
        Ok(PauseResult {
            sandbox: self.get(id)?,
            processes_kept: true,
        })
    }

    /// The agent connection of a running sandbox, for a request that reaches into it (every front
    /// comes through here: REST, E2B, MCP, ports). A paused sandbox created with `auto_resume` is
    /// resumed first, as `resume` would (its timeout restarts at the daemon's default); without it
    /// the answer is a 409. Shadows [`Core::agent`], which never resumes.
    pub async fn agent(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<Arc<crate::agent::AgentClient>, Error> {
        let rec = self.record(id)?;
        if rec.state == SandboxState::Paused && rec.auto_resume {
            match self.resume(id, ResumeRequest::default()).await {
                Ok(_) => tracing::info!(sandbox = %id, "resumed by a request for it (auto_resume)"),
                // Another request resumed it first.
                Err(Error::Conflict(_)) if self.record(id)?.state == SandboxState::Running => {}
                Err(e) => return Err(e),
            }
        }
        Core::agent(self, id).await
    }

    /// Thaws a paused sandbox; its timeout restarts (`timeout` seconds, or the daemon default).
    pub async fn resume(
        self: &Arc<Self>,
        id: &str,
        req: ResumeRequest,
    ) -> Result<PauseResult, Error> {
        let (this, id) = (self.clone(), id.to_string());
        detached(async move { this.resume_now(&id, req).await }).await
    }

    async fn resume_now(&self, id: &str, req: ResumeRequest) -> Result<PauseResult, Error> {
        let timeout = req.timeout.unwrap_or(self.settings.default_timeout);
        self.check_timeout(timeout)?;
        let lock = self.op_lock(id);
        let _op = lock.lock().await;
        let rec = self.record(id)?;
        if rec.state != SandboxState::Paused {
            return Err(Error::conflict(format!(
                "sandbox {id} is {}, not paused",
                rec.state.as_str()
            )));
        }
        let tier = self.tier(rec.isolation)?;
        if files_only(&rec) {
            return self.resume_files(rec, tier, timeout).await;
        }
        let state = rec.tier_state.clone().unwrap_or_default();
        tier.resume(id, &state)
            .await
            .map_err(|e| Error::internal(format!("resume {id}: {e:#}")))?;
        self.db.set_expiry(id, now_ms() + 1000 * timeout as i64)?;
        self.db.touch(id, now_ms())?;
        self.db.set_state(id, SandboxState::Running)?;
        tracing::info!(sandbox = %id, "resumed");
        Ok(PauseResult {
            sandbox: self.get(id)?,
            processes_kept: true,
        })
    }

    /// Resume of a paused sandbox whose processes ended with the host: a new instance over the files
    /// it had (its writable layer), `processes_kept: false`. When that fails the sandbox stays paused
    /// with its files.
    async fn resume_files(
        &self,
        rec: SandboxRecord,
        tier: Arc<dyn IsolationTier>,
        timeout: u64,
    ) -> Result<PauseResult, Error> {
        let id = rec.id.clone();
        let rootfs = self.root_path(&rec.template, rec.root.as_deref()).await?;
        let _starting = self.start_of(&id);
        self.db.set_state(&id, SandboxState::Starting)?;
        match self.boot(&rec, &tier, rootfs, true).await {
            Ok((agent, _state)) => {
                self.agents.write().await.insert(id.clone(), agent);
                self.db.set_expiry(&id, now_ms() + 1000 * timeout as i64)?;
                self.db.touch(&id, now_ms())?;
                tracing::info!(sandbox = %id, "resumed over its files; its processes were not kept");
                Ok(PauseResult {
                    sandbox: self.get(&id)?,
                    processes_kept: false,
                })
            }
            Err(e) => {
                let released = tier.release(&id, None).await;
                self.db
                    .set_tier_state(&id, SandboxState::Paused, &serde_json::Value::Null)?;
                if let Err(r) = released {
                    tracing::error!(sandbox = %id, "after a failed resume: {r:#}");
                }
                Err(Error::internal(format!(
                    "resume of {id} over its files failed (it stays paused with them): {e:#}"
                )))
            }
        }
    }

    /// A sandbox's environment, values included (E2B's `/envs`).
    pub fn environment(&self, id: &str) -> Result<BTreeMap<String, String>, Error> {
        Ok(self.record(id)?.env)
    }

    /// What a sandbox's template (or snapshot) gave it: default user, working directory, start
    /// command.
    pub fn runtime(&self, id: &str) -> Result<moat_api::TemplateConfig, Error> {
        Ok(self.record(id)?.runtime)
    }

    /// Whether sandbox `id` exists (for the daemon's own polling; it counts as no activity).
    pub fn exists(&self, id: &str) -> bool {
        matches!(self.db.get_sandbox(id), Ok(Some(_)))
    }
}
