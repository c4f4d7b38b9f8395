//! One sandbox's instance on its tier: a new row, the tier's start, the agent's readiness, the
//! start command; and its removal. Every failure removes what was made.

use std::sync::Arc;

use anyhow::Result;
use moat_api::{Isolation, SandboxState};

use super::core::{agent_client, Core, Stack};
use super::validate::agent_config;
use crate::agent::AgentClient;
use crate::clock::now_ms;
use crate::db::{Claim, SandboxRecord};
use crate::error::Error;
use crate::ids::{new_access_token, new_sandbox_id};
use crate::tier::{IsolationTier, SandboxSpec, MAX_SLOTS};

/// What a sandbox is told of itself at every start: its own machine-id (derived from its id),
/// hostname and id; after a
/// full-state restore (a fork of another's memory) random bytes from the host for the guest
/// kernel's entropy pool, and that it was forked (docs/snapshots.md, "Fork safety").
fn identity(rec: &SandboxRecord, restoring: bool) -> moat_api::SandboxIdentity {
    use base64::Engine;
    use rand::RngCore;
    // Its own and stable: a reset or a resume over its files keeps it, a fork (another id) differs.
    let machine_id = {
        use sha2::Digest;
        hex::encode(&sha2::Sha256::digest(format!("moat machine-id {}", rec.id))[..16])
    };
    let entropy = restoring.then(|| {
        let mut b = [0u8; 64];
        rand::rngs::OsRng.fill_bytes(&mut b);
        base64::engine::general_purpose::STANDARD.encode(b)
    });
    moat_api::SandboxIdentity {
        sandbox_id: rec.id.clone(),
        hostname: rec.hostname.clone(),
        machine_id,
        entropy,
        forked: restoring,
    }
}

impl Core {
    /// A new (not yet inserted) sandbox row.
    pub(super) fn new_record(
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
            auto_resume: claim.auto_resume,
            root: stack.root,
            runtime: stack.runtime,
        }
    }

    /// The directory at the bottom of a sandbox's layer stack: its template's rootfs (built on first
    /// use for `base`), another template's (`template:NAME`) or a layer.
    pub(super) async fn root_path(
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

    /// Starts a sandbox from nothing: database row, tier, agent handshake. Removes what it made on failure.
    pub(super) async fn start_new(
        &self,
        mut rec: SandboxRecord,
        tier: Arc<dyn IsolationTier>,
        template_rootfs: std::path::PathBuf,
    ) -> Result<SandboxRecord, Error> {
        let _starting = self.start_of(&rec.id);
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
    pub(super) async fn discard_failed(&self, id: &str, tier: &Arc<dyn IsolationTier>) {
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
    pub(super) async fn boot(
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
        let restoring = spec.restore.is_some();
        let mut config = agent_config(&rec.limits, &self.capabilities(rec.isolation), &rec.runtime);
        config.identity = Some(identity(rec, restoring));
        config.egress_ca = self.vault.ca_pem(&rec.id);
        let state = tier.create(&spec).await?;
        // Record the tier state before anything else can fail, so a crash here is swept or adopted.
        self.db
            .set_tier_state(&id, SandboxState::Starting, &state)?;
        if rec.limits.disk_mb > 0 {
            self.cap_new_disk(&id, tier, &state).await;
        }
        let agent = Arc::new(agent_client(&id, tier, &state));
        let t = std::time::Instant::now();
        agent.wait_ready(self.settings.agent_timeout).await?;
        tracing::debug!(sandbox = %id, took = ?t.elapsed(), "agent ready");
        agent.configure(&config).await?;
        if restoring && !rec.env.is_empty() {
            // The restored agent has the snapshotted sandbox's environment; this one's goes over it.
            agent.set_env(&rec.env).await?;
        }
        if let (Some(start), false) = (&rec.runtime.start, restoring) {
            super::start::run(&agent, start).await?;
        }
        self.db.set_tier_state(&id, SandboxState::Running, &state)?;
        self.watch_exit(&id, tier.as_ref(), &state);
        // The idle clock starts when the sandbox can be used: a guest that took seconds to boot
        // has not been idle for them.
        self.db.touch(&id, now_ms())?;
        Ok((agent, state))
    }

    pub(super) async fn destroy(&self, rec: SandboxRecord) -> Result<()> {
        self.db.set_state(&rec.id, SandboxState::Stopping)?;
        self.agents.write().await.remove(&rec.id);
        let tier = self.tier(rec.isolation)?;
        tier.destroy(&rec.id, rec.tier_state.as_ref()).await?;
        self.db.delete_sandbox(&rec.id)?;
        self.forget(&rec.id);
        if !rec.layers.is_empty() {
            self.gc_layers();
        }
        tracing::info!(sandbox = %rec.id, "deleted");
        Ok(())
    }
}
