//! The reaper: sandboxes whose timeout or idle timeout passed are deleted (or paused, as they
//! asked), and sandboxes whose PID 1 died (an agent that crashed, was OOM-killed or was killed from
//! the host) are removed.

use std::sync::Arc;
use std::time::Duration;

use moat_api::SandboxState;

use super::lifecycle::Lifecycle;
use crate::clock::now_ms;
use crate::tier::Liveness;

pub struct Reaper {
    sandboxes: Arc<Lifecycle>,
}

impl Reaper {
    pub(super) fn new(sandboxes: Arc<Lifecycle>) -> Reaper {
        Reaper { sandboxes }
    }

    /// Kills sandboxes whose timeout passed, and removes sandboxes whose PID 1 died (an agent that
    /// crashed, was OOM-killed or was killed from the host); runs every `period` forever.
    pub async fn run(self: Arc<Self>, period: Duration) {
        let mut tick = tokio::time::interval(period);
        let mut n: u64 = 0;
        loop {
            tick.tick().await;
            n += 1;
            if n.is_multiple_of(4) {
                self.remove_dead().await;
            }
            self.expire().await;
        }
    }

    /// Deletes (or pauses, as they asked) the sandboxes whose timeout or idle timeout passed.
    pub(super) async fn expire(&self) {
        let now = now_ms();
        let ids = match self.sandboxes.db.expired(now) {
            Ok(mut ids) => {
                ids.extend(self.idle(now));
                ids
            }
            Err(e) => {
                tracing::error!("expiry query: {e:#}");
                return;
            }
        };
        for id in ids {
            if let Ok(Some(rec)) = self.sandboxes.db.get_sandbox(&id) {
                if rec.state == SandboxState::Starting {
                    continue;
                }
                if rec.on_timeout == moat_api::OnTimeout::Pause {
                    tracing::info!(sandbox = %id, "timeout or idle timeout passed: pausing");
                    if let Err(e) = self.sandboxes.pause(&id).await {
                        tracing::error!(sandbox = %id, "pause at timeout: {e}");
                    }
                    continue;
                }
                tracing::info!(sandbox = %id, "timeout or idle timeout passed");
                if let Err(e) = self.sandboxes.destroy(rec).await {
                    tracing::error!(sandbox = %id, "expire: {e:#}");
                }
            }
        }
    }

    /// Ids of sandboxes whose idle timeout passed.
    pub(super) fn idle(&self, now: i64) -> Vec<String> {
        self.sandboxes
            .db
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

    /// Removes sandboxes whose PID 1 died, and rows `starting` whose start has no owner any more.
    pub(super) async fn remove_dead(&self) {
        let Ok(all) = self.sandboxes.db.list_sandboxes() else {
            return;
        };
        for rec in all {
            if rec.state == SandboxState::Starting {
                // Re-read after the check: a start may have ended (and so left `starting`) since
                // the list was taken.
                if !self.sandboxes.is_starting(&rec.id)
                    && matches!(self.sandboxes.db.get_sandbox(&rec.id), Ok(Some(r)) if r.state == SandboxState::Starting)
                {
                    tracing::warn!(sandbox = %rec.id, "starting with no start in flight; removing it");
                    if let Err(e) = self.sandboxes.destroy(rec).await {
                        tracing::error!("{e:#}");
                    }
                }
                continue;
            }
            // A snapshot, reset, pause or resume in progress may replace the sandbox's processes (a
            // full-state snapshot restores them): it is looked at next time.
            let lock = self.sandboxes.op_lock(&rec.id);
            let Ok(_op) = lock.try_lock() else {
                continue;
            };
            let Ok(Some(rec)) = self.sandboxes.db.get_sandbox(&rec.id) else {
                continue;
            };
            let (SandboxState::Running | SandboxState::Paused, Some(state), Some(tier)) = (
                rec.state,
                rec.tier_state.as_ref(),
                self.sandboxes.tier(rec.isolation).ok(),
            ) else {
                continue;
            };
            match tier.is_alive(&rec.id, state).await {
                Liveness::Alive => continue,
                Liveness::Unknown => {
                    // The daemon's own trouble (out of file descriptors): never a reason to
                    // remove a sandbox; it is looked at again next time.
                    tracing::debug!(sandbox = %rec.id, "liveness unknown; not removing it");
                    continue;
                }
                Liveness::Gone => {}
            }
            // Re-read: a delete may have started since the list was taken.
            if !matches!(self.sandboxes.db.get_sandbox(&rec.id), Ok(Some(r)) if r.state == rec.state)
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
            if let Err(e) = self.sandboxes.destroy(rec).await {
                tracing::error!("{e:#}");
            }
        }
    }
}
