//! The warm pool: sandboxes of the default template and tier kept started ahead of demand, so a
//! create that fits is one database update. Refilled in the background; a template rebuild or
//! removal drains it first.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use moat_api::{CreateSandboxRequest, Isolation, SandboxLimits, SandboxState};
use tokio::sync::Notify;

use super::core::{Core, Stack};
use super::validate::agent_config;
use crate::clock::now_ms;
use crate::db::{Claim, SandboxRecord};
use crate::error::Error;
use crate::ids::{new_access_token, new_sandbox_id};
use crate::tier::IsolationTier;

pub struct Pool {
    core: Arc<Core>,
    wake: Notify,
    paused: AtomicBool,
}

impl Pool {
    pub(super) fn new(core: Arc<Core>) -> Pool {
        Pool {
            core,
            wake: Notify::new(),
            paused: AtomicBool::new(false),
        }
    }

    pub(super) fn serves(&self, template: &str, isolation: Isolation) -> bool {
        self.core.settings.pool_size > 0
            && template == self.core.settings.default_template
            && isolation == self.core.settings.default_isolation
    }

    /// Takes a sandbox from the warm pool and gives it the creator's limits and environment.
    pub(super) async fn claim(
        &self,
        claim: &Claim,
        tier: &Arc<dyn IsolationTier>,
    ) -> Option<SandboxRecord> {
        let rec = match self.core.db.claim_pooled(claim) {
            Ok(Some(rec)) => rec,
            Ok(None) => return None,
            Err(e) => {
                tracing::error!("pool claim: {e:#}");
                return None;
            }
        };
        self.wake.notify_one();
        let prepared = async {
            let state = rec.tier_state.clone().unwrap_or_default();
            let defaults = self.core.limits_for(&CreateSandboxRequest::default());
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
                .core
                .agent(&rec.id)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            if claim.limits != defaults {
                agent
                    .configure(&agent_config(
                        &claim.limits,
                        &self.core.capabilities(rec.isolation),
                        &rec.runtime,
                    ))
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
                if let Err(e) = self.core.destroy(rec).await {
                    tracing::error!("{e:#}");
                }
                None
            }
        }
    }

    /// Keeps `pool_size` sandboxes of the default template started, forever. Only fills from a
    /// template that is ready: it never starts a template build.
    pub async fn run(self: Arc<Self>) {
        if self.core.settings.pool_size == 0 {
            return;
        }
        let template = self.core.settings.default_template.clone();
        loop {
            let ready = matches!(self.core.db.get_template(&template), Ok(Some(t)) if t.status == moat_api::TemplateStatus::Ready);
            let have = self.core.db.pooled_count(&template).unwrap_or(u64::MAX);
            if !ready
                || self.paused.load(Ordering::Relaxed)
                || have >= self.core.settings.pool_size as u64
            {
                let _ = tokio::time::timeout(Duration::from_secs(2), self.wake.notified()).await;
                continue;
            }
            if let Err(e) = self.fill_one(&template).await {
                tracing::warn!("warm pool: {e}");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }

    async fn fill_one(&self, template: &str) -> Result<(), Error> {
        self.core.check_disk()?;
        let tier = self.core.tier(self.core.settings.default_isolation)?;
        let stack = match self.core.db.get_template(template)? {
            Some(t) => Stack::of_template(&t),
            None => return Err(Error::conflict(format!("template {template} is gone"))),
        };
        let rootfs = self.core.root_path(template, stack.root.as_deref()).await?;
        let id = new_sandbox_id();
        let rec = SandboxRecord {
            hostname: format!("sbx-{}", &id[4..16]),
            id,
            template: template.to_string(),
            isolation: self.core.settings.default_isolation,
            state: SandboxState::Starting,
            created_at_ms: now_ms(),
            expires_at_ms: i64::MAX / 2,
            metadata: BTreeMap::new(),
            env: stack.env,
            cpu: self.core.settings.default_limits.cpu,
            memory_mb: self.core.settings.default_limits.memory_mb,
            slot: 0,
            tier_state: None,
            pooled: true,
            limits: self.core.limits_for(&CreateSandboxRequest::default()),
            last_active_ms: 0,
            layers: stack.layers,
            snapshot: None,
            on_timeout: moat_api::OnTimeout::Kill,
            network: self
                .core
                .networking(Isolation::Container)
                .then(moat_api::NetworkPolicy::default),
            access_token: new_access_token(),
            public_traffic: false,
            auto_resume: false,
            root: stack.root,
            runtime: stack.runtime,
        };
        let rec = self.core.start_new(rec, tier, rootfs).await?;
        tracing::debug!(sandbox = %rec.id, "added to the warm pool");
        Ok(())
    }

    /// Removes the pooled sandboxes of a template (before it is rebuilt or removed) and stops refilling
    /// until `resume_pool`.
    pub async fn drain(&self, template: &str) -> Result<(), Error> {
        self.paused.store(true, Ordering::Relaxed);
        for rec in self.core.db.list_sandboxes()? {
            if rec.pooled && rec.template == template && rec.state != SandboxState::Starting {
                self.core.destroy(rec).await?;
            }
        }
        Ok(())
    }

    pub fn info(&self) -> Option<moat_api::PoolInfo> {
        if self.core.settings.pool_size == 0 {
            return None;
        }
        let template = self.core.settings.default_template.clone();
        let ready = self
            .core
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
            size: self.core.settings.pool_size,
            ready,
        })
    }

    pub fn resume(&self) {
        self.paused.store(false, Ordering::Relaxed);
        self.wake.notify_one();
    }

    /// Removes pooled sandboxes this configuration would not keep: of another template than the
    /// default, or more than `pool_size` (e.g. after a restart with a smaller pool, or none).
    pub(super) async fn trim(&self) -> Result<()> {
        let mut kept = 0u32;
        for rec in self.core.db.list_sandboxes()? {
            if !rec.pooled {
                continue;
            }
            if rec.template == self.core.settings.default_template
                && kept < self.core.settings.pool_size
            {
                kept += 1;
                continue;
            }
            tracing::info!(sandbox = %rec.id, "removing a pooled sandbox the configuration does not keep");
            self.core.destroy(rec).await?;
        }
        Ok(())
    }
}
