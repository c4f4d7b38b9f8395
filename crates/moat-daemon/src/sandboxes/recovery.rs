//! At start-up: sandboxes whose agent still runs are re-adopted, paused ones whose processes ended
//! with the host keep their files, the rest are removed; then every tier sweeps what no live
//! sandbox owns, and unused layers and checkpoint images go.

use std::collections::HashSet;
use std::sync::Arc;

use anyhow::{Context, Result};
use moat_api::SandboxState;

use crate::tier::Liveness;

use super::core::agent_client;
use super::{Services, BUILD_LABEL};

impl Services {
    /// At start: re-adopts sandboxes whose agent still runs, removes the rest, and sweeps leftovers that
    /// no database row owns.
    pub async fn recover(&self) -> Result<()> {
        let core = self.sandboxes.core();
        self.builds.recover()?;
        let mut live = HashSet::new();
        // Paused sandboxes without processes: files only, not swept.
        let mut kept_files = HashSet::new();
        for rec in core.db.list_sandboxes()? {
            let Some(tier) = core.tier(rec.isolation).ok() else {
                continue;
            };
            if rec.metadata.contains_key(BUILD_LABEL) {
                // Its build ended with the daemon.
                tracing::info!(sandbox = %rec.id, "removing a sandbox of an interrupted build");
                if let Err(e) = core.destroy(rec).await {
                    tracing::error!("{e:#}");
                }
                continue;
            }
            // A sandbox whose process runs (or whose liveness the host cannot tell now) is
            // re-adopted without waiting for its agent: one that is slow under load is not
            // removed, and the API does not wait for it (its agent is reached on first use).
            let alive = match (&rec.state, &rec.tier_state) {
                (SandboxState::Running | SandboxState::Paused, Some(s)) => {
                    tier.is_alive(&rec.id, s).await != Liveness::Gone
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
                core.agents.write().await.insert(rec.id.clone(), agent);
                if let Some(s) = &rec.tier_state {
                    core.watch_exit(&rec.id, tier.as_ref(), s);
                }
                live.insert(rec.id.clone());
                tracing::info!(sandbox = %rec.id, "re-adopted");
                continue;
            }
            if rec.state == SandboxState::Paused {
                // Its processes ended with the host (a reboot): keep its files for a resume.
                match tier.release(&rec.id, rec.tier_state.as_ref()).await {
                    Ok(()) => {
                        core.db.set_tier_state(
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
            // The host booted after the sandbox was made: its processes ended with the host.
            let (reason, message) = match crate::host::proc::boot_time_ms() {
                Some(boot) if boot > rec.created_at_ms => (
                    moat_api::Reason::HostRestart,
                    "its processes ended with the host (it restarted while the sandbox ran)".to_string(),
                ),
                _ => (
                    moat_api::Reason::AgentLost,
                    "its processes ended while the daemon was down (its agent exited or was killed)"
                        .to_string(),
                ),
            };
            if let Err(e) = core.end(rec, reason, message).await {
                tracing::error!("{e:#}");
            }
        }
        // One host network serves every tier (one nft table, one address space): each tier gets the
        // policies of all live sandboxes.
        let mut policies = std::collections::BTreeMap::<u32, moat_api::NetworkPolicy>::new();
        for rec in core.db.list_sandboxes()? {
            if let (true, Some(p)) = (live.contains(&rec.id), rec.network) {
                policies.insert(rec.slot, p);
            }
        }
        for tier in core.all_tiers() {
            tier.restore_network(&policies)
                .await
                .context("restore sandbox networking")?;
            let keep: HashSet<String> = live.union(&kept_files).cloned().collect();
            for name in tier.sweep(&keep).await? {
                tracing::warn!(leftover = %name, "swept");
            }
        }
        core.gc_layers();
        core.sweep_checkpoints();
        self.pool.trim().await
    }
}
