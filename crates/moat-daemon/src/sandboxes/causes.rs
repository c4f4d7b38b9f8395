//! Failure causes as state: why a sandbox ended without a request (kept 24 h after its end, so
//! that `GET /v1/sandboxes/{id}` answers `state: ended` with the reason), and what degraded it while
//! it ran (its `conditions`: a process the OOM killer ended, a fork refused at the pids limit, its
//! disk full). The kernel says which process it killed and which fork it refused in its log
//! (`host::kmsg`); the daemon maps the cgroup named there to the sandbox.

use moat_api::{Cause, Reason, Sandbox, SandboxState};

use super::core::Core;
use crate::clock::{now_ms, rfc3339};
use crate::db::SandboxRecord;
use crate::error::Error;
use crate::host::kmsg::{KernelEvent, KernelNote};
use crate::ids::valid_sandbox_id;

/// How long an ended sandbox's record and an idempotency key are kept.
pub const KEEP_ENDED_MS: i64 = 24 * 3600 * 1000;

/// Lines of a sandbox's own log kept with its end.
const LOG_LINES: usize = 10;

impl Core {
    /// Ends sandbox `rec` for `reason` (no request asked for it): its last words read, its
    /// resources removed, what it was kept with its cause, the listeners told.
    pub(super) async fn end(
        &self,
        rec: SandboxRecord,
        reason: Reason,
        message: String,
    ) -> anyhow::Result<()> {
        let log = self
            .tier(rec.isolation)
            .map(|t| t.last_words(&rec.id, rec.tier_state.as_ref()))
            .unwrap_or_default();
        let mut last = self.api(&rec);
        let (id, pooled) = (rec.id.clone(), rec.pooled);
        self.destroy(rec).await?;
        let now = now_ms();
        last.state = SandboxState::Ended;
        // Its ports are gone with it: the token that opened them is not kept.
        last.access_token.clear();
        last.ended = Some(Cause {
            reason,
            at: rfc3339(now),
            message: message.clone(),
            process: None,
            count: 0,
            log: log.into_iter().take(LOG_LINES).collect(),
        });
        // A pooled sandbox was nobody's yet: no record to show anyone (the pool makes another).
        let kept = if pooled {
            Ok(())
        } else {
            self.db
                .put_ended(&last, now)
                .and_then(|()| self.db.prune_ended(now - KEEP_ENDED_MS))
        };
        if let Err(e) = kept {
            tracing::error!(sandbox = %id, "keep the record of its end: {e:#}");
        }
        tracing::info!(sandbox = %id, reason = reason.as_str(), "ended: {message}");
        self.ended(&id, reason, message);
        Ok(())
    }

    /// What an ended sandbox was, with why it ended (kept 24 h).
    pub(super) fn ended_sandbox(&self, id: &str) -> Option<Sandbox> {
        if !valid_sandbox_id(id) {
            return None;
        }
        self.db.get_ended(id).ok().flatten()
    }

    /// The not-found error for sandbox `id`, saying why it ended when it ended on its own.
    pub(super) fn gone(&self, id: &str) -> Error {
        if !valid_sandbox_id(id) {
            return Error::not_found("id", format!("sandbox {id:?} not found"));
        }
        match self.ended_sandbox(id).and_then(|s| s.ended) {
            Some(c) => Error::not_found(
                "id",
                format!(
                    "sandbox {id} ended at {} ({}): {}",
                    c.at,
                    c.reason.as_str(),
                    c.message
                ),
            ),
            None => Error::not_found("id", format!("sandbox {id} not found")),
        }
    }

    /// Records a condition of sandbox `id`: the latest of its reason, counted.
    pub(super) fn note_condition(
        &self,
        id: &str,
        reason: Reason,
        message: String,
        process: Option<String>,
    ) {
        let count = self
            .db
            .conditions(id)
            .ok()
            .and_then(|cs| cs.into_iter().find(|c| c.reason == reason))
            .map_or(0, |c| c.count);
        let cause = Cause {
            reason,
            at: rfc3339(now_ms()),
            message,
            process,
            count: count + 1,
            log: Vec::new(),
        };
        tracing::warn!(sandbox = %id, reason = reason.as_str(), "{}", cause.message);
        if let Err(e) = self.db.put_condition(id, &cause) {
            tracing::error!(sandbox = %id, "record a condition: {e:#}");
        }
    }

    /// A note from the kernel's log: a condition of the sandbox whose cgroup it names.
    pub(super) fn kernel_note(&self, note: &KernelNote) {
        let Some(id) = sandbox_of_cgroup(&note.cgroup) else {
            return;
        };
        let Ok(Some(rec)) = self.db.get_sandbox(id) else {
            return;
        };
        match &note.event {
            KernelEvent::OomKill { task, pid } => self.note_condition(
                id,
                Reason::Oom,
                format!(
                    "the kernel's OOM killer ended process {pid} ({task}) at the memory limit ({} MiB)",
                    rec.limits.memory_mb
                ),
                Some(format!("{pid} ({task})")),
            ),
            KernelEvent::ForkRejected => self.note_condition(
                id,
                Reason::PidsExhausted,
                format!(
                    "a fork was refused: the sandbox reached its limit of {} processes and threads",
                    rec.limits.pids
                ),
                None,
            ),
        }
    }

    /// Records `disk_full` when the sandbox's writable layer has (nearly) no room left: under
    /// 1 MiB of its quota image is available.
    pub(super) fn note_disk(&self, rec: &SandboxRecord, usage: &crate::tier::TierUsage) {
        let Some(free) = usage.disk_free_bytes else {
            return;
        };
        if free >= 1 << 20 {
            return;
        }
        let known = self
            .db
            .conditions(&rec.id)
            .is_ok_and(|cs| cs.iter().any(|c| c.reason == Reason::DiskFull));
        if !known {
            self.note_condition(
                &rec.id,
                Reason::DiskFull,
                format!(
                    "its disk is full: {} MiB written, {} KiB left of its {} MiB quota; writes \
                     fail with ENOSPC",
                    usage.disk_bytes >> 20,
                    free >> 10,
                    rec.limits.disk_mb
                ),
                None,
            );
        }
    }
}

/// The sandbox id in a cgroup path (`/moat/sbx_.../...`), if any.
pub fn sandbox_of_cgroup(path: &str) -> Option<&str> {
    path.split('/').find(|p| valid_sandbox_id(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_is_found_by_its_cgroup() {
        let id = crate::ids::new_sandbox_id();
        assert_eq!(
            sandbox_of_cgroup(&format!("/moat/{id}/agent")),
            Some(id.as_str())
        );
        assert_eq!(
            sandbox_of_cgroup(&format!("/moat.slice/{id}")),
            Some(id.as_str())
        );
        assert_eq!(sandbox_of_cgroup("/user.slice/session-1.scope"), None);
    }
}
