//! The reaper: sandboxes whose timeout or idle timeout passed are deleted (or paused, as they
//! asked), and sandboxes whose PID 1 died (an agent that crashed, was OOM-killed or was killed from
//! the host) are removed.

use std::sync::Arc;
use std::time::Duration;

use moat_api::{Reason, SandboxState};
use tokio::sync::mpsc;

use super::core::files_only;
use super::lifecycle::Lifecycle;
use crate::clock::now_ms;
use crate::tier::Liveness;

/// How often timeouts and idle timeouts are checked (two indexed queries, whatever the number of
/// sandboxes).
const EXPIRE_EVERY: Duration = Duration::from_millis(500);
/// How often the sandboxes without an exit notification (a pidfd the host could not give: a
/// kernel older than 5.3; a tier with no process to watch) are looked at, and rows `starting`
/// whose start has no owner.
const SCAN_EVERY: Duration = Duration::from_secs(30);

pub struct Reaper {
    sandboxes: Arc<Lifecycle>,
    /// Ids of sandboxes whose watched process exited (taken by `run`).
    exited: std::sync::Mutex<Option<mpsc::UnboundedReceiver<String>>>,
}

impl Reaper {
    pub(super) fn new(
        sandboxes: Arc<Lifecycle>,
        exited: mpsc::UnboundedReceiver<String>,
    ) -> Reaper {
        Reaper {
            sandboxes,
            exited: std::sync::Mutex::new(Some(exited)),
        }
    }

    /// Kills sandboxes whose timeout passed, and removes sandboxes whose PID 1 died (an agent that
    /// crashed, was OOM-killed or was killed from the host) as soon as it is told; forever.
    pub async fn run(self: Arc<Self>) {
        let exited = self
            .exited
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(mut exited) = exited else {
            return;
        };
        let mut expire = tokio::time::interval(EXPIRE_EVERY);
        let mut scan = tokio::time::interval(SCAN_EVERY);
        loop {
            tokio::select! {
                _ = expire.tick() => self.expire().await,
                _ = scan.tick() => self.remove_dead().await,
                Some(id) = exited.recv() => self.check(&id).await,
            }
        }
    }

    /// Deletes (or pauses, as they asked) the sandboxes whose timeout or idle timeout passed.
    pub(super) async fn expire(&self) {
        let now = now_ms();
        let ids = match (self.sandboxes.db.expired(now), self.sandboxes.db.idle(now)) {
            (Ok(expired), Ok(idle)) => expired
                .into_iter()
                .map(|id| (id, Reason::Timeout))
                .chain(idle.into_iter().map(|id| (id, Reason::Idle)))
                .collect::<Vec<_>>(),
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!("expiry query: {e:#}");
                return;
            }
        };
        for (id, reason) in ids {
            if let Ok(Some(rec)) = self.sandboxes.db.get_sandbox(&id) {
                if rec.state == SandboxState::Starting {
                    continue;
                }
                // Idle means no request, no open connection to its ports and no command of its
                // own running: one still at work has its idle clock restarted.
                if reason == Reason::Idle && self.sandboxes.busy(&id).await {
                    if let Err(e) = self.sandboxes.db.touch(&id, now) {
                        tracing::warn!(sandbox = %id, "idle clock: {e:#}");
                    }
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
                let message = if reason == Reason::Idle {
                    format!(
                        "its idle timeout ({} s) passed without a request for it, a connection \
                         to its ports or a command of its own running",
                        rec.limits.idle_timeout
                    )
                } else {
                    "its timeout passed".into()
                };
                if let Err(e) = self.sandboxes.end(rec, reason, message).await {
                    tracing::error!(sandbox = %id, "expire: {e:#}");
                }
            }
        }
    }

    /// Removes sandboxes whose PID 1 died, and rows `starting` whose start has no owner any more.
    /// Sandboxes whose process is watched are left to their exit notification: the scan costs
    /// nothing per sandbox the host could give a pidfd for.
    pub(super) async fn remove_dead(&self) {
        let Ok(all) = self.sandboxes.db.states() else {
            return;
        };
        for (id, state) in all {
            if state != SandboxState::Starting && self.sandboxes.exits.is_watched(&id) {
                continue;
            }
            self.check(&id).await;
        }
    }

    /// Removes sandbox `id` if its process is gone (or its row is `starting` with no start in
    /// flight); a sandbox that runs another process than the one watched (a restore) is watched
    /// again.
    pub(super) async fn check(&self, id: &str) {
        let Ok(Some(rec)) = self.sandboxes.db.get_sandbox(id) else {
            return;
        };
        if rec.state == SandboxState::Starting {
            // Re-read after the check: a start may have ended (and so left `starting`) since the
            // row was read.
            if !self.sandboxes.is_starting(id)
                && matches!(self.sandboxes.db.get_sandbox(id), Ok(Some(r)) if r.state == SandboxState::Starting)
            {
                tracing::warn!(sandbox = %id, "starting with no start in flight; removing it");
                if let Err(e) = self.sandboxes.destroy(rec).await {
                    tracing::error!("{e:#}");
                }
            }
            return;
        }
        // A snapshot, reset, pause or resume in progress may replace the sandbox's processes (a
        // full-state snapshot restores them): the next scan looks again.
        let lock = self.sandboxes.op_lock(id);
        let Ok(_op) = lock.try_lock() else {
            return;
        };
        let Ok(Some(rec)) = self.sandboxes.db.get_sandbox(id) else {
            return;
        };
        if files_only(&rec) {
            // Paused with its files only (its processes ended with the host): no process to look
            // for; a resume starts it over its files.
            return;
        }
        let (SandboxState::Running | SandboxState::Paused, Some(state), Some(tier)) = (
            rec.state,
            rec.tier_state.as_ref(),
            self.sandboxes.tier(rec.isolation).ok(),
        ) else {
            return;
        };
        match tier.is_alive(id, state).await {
            Liveness::Alive => {
                // Alive with another process than the watched one: watch that one.
                self.sandboxes.watch_exit(id, tier.as_ref(), state);
                return;
            }
            Liveness::Unknown => {
                // The daemon's own trouble (out of file descriptors): never a reason to remove a
                // sandbox; the next scan looks again.
                tracing::debug!(sandbox = %id, "liveness unknown; not removing it");
                return;
            }
            Liveness::Gone => {}
        }
        // Re-read: a delete may have started meanwhile.
        if !matches!(self.sandboxes.db.get_sandbox(id), Ok(Some(r)) if r.state == rec.state) {
            return;
        }
        // Its cgroup is still there: an OOM kill counted there says why (on gvisor the host's OOM
        // killer ends the Sentry, and the sandbox with it, when the memory limit is hit).
        let oom_kills = tier
            .usage(id, state)
            .await
            .map(|u| u.oom_kills)
            .unwrap_or(0);
        let (reason, message) = if oom_kills > 0 {
            tracing::warn!(sandbox = %id, oom_kills, "it ran out of memory: the host's OOM killer ended it; removing the sandbox");
            let which = self
                .sandboxes
                .db
                .conditions(id)
                .ok()
                .and_then(|cs| cs.into_iter().find(|c| c.reason == Reason::Oom))
                .and_then(|c| c.process)
                .map(|p| format!(" (last killed: process {p})"))
                .unwrap_or_default();
            (Reason::Oom, format!("it reached its memory limit ({} MiB) and the kernel's OOM killer ended it ({oom_kills} kill(s){which})", rec.limits.memory_mb))
        } else {
            tracing::warn!(sandbox = %id, "its PID 1 is gone; removing the sandbox");
            (
                Reason::AgentLost,
                "its agent (the sandbox's first process) exited or was killed".to_string(),
            )
        };
        if let Err(e) = self.sandboxes.end(rec, reason, message).await {
            tracing::error!("{e:#}");
        }
    }
}
