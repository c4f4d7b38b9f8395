//! The host's disk: what keeps the data directory's filesystem from filling up.
//!
//! A sandbox's disk quota is a sparse image: it takes the host's space only as the sandbox writes,
//! so quotas may add up to more than the host has (10 GiB each by default). The guard keeps the
//! filesystem's last `reserve` bytes for the daemon (its database, logs, snapshots under way):
//!
//! * **caps**: when a sandbox could write more than the space left above the reserve (its quota is
//!   larger), its image is capped at that space, so that no one sandbox can take the reserve; when
//!   the host is *low* (less than twice the reserve free) the space left is shared out equally
//!   between the sandboxes that can write. A capped sandbox's writes fail with ENOSPC, as at its
//!   own quota: nothing it wrote is harmed. Caps lift as space returns. A disk the host cannot cap
//!   (a microVM's, mounted only by the guest) makes its sandbox paused when, while the host is
//!   low, it grows past its share;
//! * **admission**: while the host is low, creates, forks, snapshots and template builds are
//!   refused with 507 (and what to free);
//! * **the database's own reserve**: a file of space kept beside the database, given up by the
//!   store when a write finds the disk full (so a delete, a timeout change or an audit entry is
//!   still written) and made again here once there is room.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use moat_api::SandboxState;

use super::lifecycle::Lifecycle;
use crate::error::Error;

/// How often the free space is read (one statvfs), and how often near the reserve.
const EVERY: Duration = Duration::from_secs(1);
const EVERY_NEAR: Duration = Duration::from_millis(200);

/// Space of a filesystem, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    pub total: u64,
    /// What an unprivileged writer may still take (statvfs's `f_bavail`).
    pub avail: u64,
}

impl Space {
    pub fn of(dir: &std::path::Path) -> Result<Space, Error> {
        let s = nix::sys::statvfs::statvfs(dir)
            .map_err(|e| Error::internal(format!("statvfs {}: {e}", dir.display())))?;
        let block = s.fragment_size() as u64;
        Ok(Space {
            total: s.blocks() as u64 * block,
            avail: s.blocks_available() as u64 * block,
        })
    }
}

/// The reserve of a filesystem of `total` bytes when none is configured: 5% of it, at least
/// 256 MiB and at most 4 GiB, and never more than a quarter of it.
pub fn default_reserve(total: u64) -> u64 {
    (total / 20).clamp(256 << 20, 4 << 30).min(total / 4)
}

/// The space kept for the database itself: a quarter of the reserve, at most 64 MiB.
fn db_reserve(reserve: u64) -> u64 {
    (reserve / 4).min(64 << 20)
}

/// Whether a filesystem with `avail` bytes free is low, given its `reserve`.
pub fn is_low(avail: u64, reserve: u64) -> bool {
    avail < reserve.saturating_mul(2)
}

/// How many more bytes each sandbox that can write may take: everything above the reserve while
/// the host is not low (one sandbox can take what is left, not the reserve); an equal share of it
/// when low. None: no cap needed (every quota fits in what is left).
pub fn room_each(space: Space, reserve: u64, writers: usize, largest_quota: u64) -> Option<u64> {
    let left = space.avail.saturating_sub(reserve);
    if is_low(space.avail, reserve) {
        Some(left / writers.max(1) as u64)
    } else if left < largest_quota {
        Some(left)
    } else {
        None
    }
}

/// A message for a refusal: how full the host is and what to do.
pub fn refusal(space: Space, reserve: u64) -> String {
    format!(
        "the host's disk is nearly full: {} MiB free of {} MiB, and the last {} MiB are kept in \
         reserve; delete sandboxes, snapshots or templates (GET /v1/system/df shows what uses it)",
        space.avail >> 20,
        space.total >> 20,
        reserve >> 20
    )
}

/// The guard's loop (see the module's documentation).
pub struct DiskGuard {
    sandboxes: Arc<Lifecycle>,
}

/// What the guard remembers between ticks.
#[derive(Default)]
struct Memory {
    /// The room each capped sandbox was last given.
    capped: HashMap<String, u64>,
    /// For a sandbox whose disk cannot be capped: its usage when the host became low.
    uncapped_at: HashMap<String, u64>,
    was_low: bool,
    /// Sandboxes whose cap this guard has set or lifted at least once.
    known: std::collections::HashSet<String>,
    /// Caps set before this daemon started (they live in the kernel, with the mounts) are not
    /// known: the first look sets or lifts every sandbox's.
    started: bool,
}

impl DiskGuard {
    pub(super) fn new(sandboxes: Arc<Lifecycle>) -> DiskGuard {
        DiskGuard { sandboxes }
    }

    pub async fn run(self: Arc<Self>) {
        let mut mem = Memory::default();
        loop {
            let near = match self.tick(&mut mem).await {
                Ok(near) => near,
                Err(e) => {
                    tracing::warn!("disk guard: {e}");
                    false
                }
            };
            tokio::time::sleep(if near { EVERY_NEAR } else { EVERY }).await;
        }
    }

    /// One look at the disk; whether the host is near its reserve (the next look comes sooner).
    async fn tick(&self, mem: &mut Memory) -> Result<bool, Error> {
        let core = &self.sandboxes;
        let reserve = core.disk_reserve();
        let space = Space::of(&core.settings.data_dir)?;
        let low = is_low(space.avail, reserve);
        if low != mem.was_low {
            if low {
                tracing::warn!("{}", refusal(space, reserve));
            } else {
                tracing::info!(
                    "the host's disk has room again: {} MiB free",
                    space.avail >> 20
                );
            }
            mem.was_low = low;
        }
        if !low && space.avail > reserve * 2 + db_reserve(reserve) {
            let db = core.db.clone();
            let bytes = db_reserve(reserve);
            match tokio::task::spawn_blocking(move || db.keep_reserve(bytes)).await {
                Ok(Ok(true)) => tracing::info!("made the database's reserve ({} MiB)", bytes >> 20),
                Ok(Ok(false)) => {}
                Ok(Err(e)) => tracing::warn!("the database's reserve: {e}"),
                Err(e) => tracing::warn!("the database's reserve: {e}"),
            }
        }
        let room = core.disk_room(space, reserve)?;
        // A sandbox started since the last look was capped as it started (`Core::cap_new_disk`).
        let started_capped = core.disk_capped_at_start.swap(false, Ordering::SeqCst);
        if room.is_none()
            && mem.capped.is_empty()
            && mem.uncapped_at.is_empty()
            && mem.started
            && !started_capped
        {
            return Ok(space.avail < reserve * 4);
        }
        self.apply(mem, room, low).await?;
        mem.started = true;
        Ok(space.avail < reserve * 4)
    }

    /// Caps (or uncaps) every live sandbox's disk at `room`.
    async fn apply(&self, mem: &mut Memory, room: Option<u64>, low: bool) -> Result<(), Error> {
        let core = &self.sandboxes;
        let mut seen = std::collections::HashSet::new();
        for rec in core.db.list_sandboxes()? {
            if rec.limits.disk_mb == 0
                || !matches!(rec.state, SandboxState::Running | SandboxState::Paused)
            {
                continue;
            }
            let (Some(state), Ok(tier)) = (&rec.tier_state, core.tier(rec.isolation)) else {
                continue;
            };
            seen.insert(rec.id.clone());
            let last = mem.capped.get(&rec.id).copied();
            let known = mem.known.contains(&rec.id);
            // Written again when the room moved by more than 1/32 (or 1 MiB): a sandbox that
            // writes moves it every tick.
            let moved = match (room, last) {
                (Some(r), Some(l)) => r.abs_diff(l) > (l / 32).max(1 << 20),
                // One the guard never set (capped as it started, or before a restart).
                (None, None) => !known,
                _ => true,
            };
            if moved && !mem.uncapped_at.contains_key(&rec.id) {
                match tier.cap_disk(&rec.id, state, room).await {
                    Ok(Some(_)) => match room.inspect(|_| {
                        mem.known.insert(rec.id.clone());
                    }) {
                        Some(r) => {
                            mem.capped.insert(rec.id.clone(), r);
                        }
                        None => {
                            mem.capped.remove(&rec.id);
                            mem.known.insert(rec.id.clone());
                        }
                    },
                    Ok(None) => {
                        // A disk the host cannot cap: measured, and paused past its share.
                        if let Ok(u) = tier.usage(&rec.id, state).await {
                            mem.uncapped_at
                                .entry(rec.id.clone())
                                .or_insert(u.disk_bytes);
                        }
                    }
                    Err(e) => tracing::warn!(sandbox = %rec.id, "cap its disk: {e}"),
                }
            }
            if low && rec.state == SandboxState::Running {
                if let (Some(&at), Some(r)) = (mem.uncapped_at.get(&rec.id), room) {
                    let now = tier
                        .usage(&rec.id, state)
                        .await
                        .map(|u| u.disk_bytes)
                        .unwrap_or(at);
                    if now.saturating_sub(at) > r {
                        tracing::warn!(
                            sandbox = %rec.id,
                            "the host's disk is nearly full and this sandbox's disk (which the host \
                             cannot cap) grew {} MiB: paused",
                            (now - at) >> 20
                        );
                        if let Err(e) = core.pause(&rec.id).await {
                            tracing::warn!(sandbox = %rec.id, "pause for the disk: {e}");
                        }
                    }
                }
            }
        }
        if room.is_none() || !low {
            mem.uncapped_at.clear();
        }
        mem.capped.retain(|id, _| seen.contains(id));
        mem.known.retain(|id| seen.contains(id));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn reserve_by_size() {
        assert_eq!(default_reserve(100 << 30), 4 << 30);
        assert_eq!(default_reserve(20 << 30), 1 << 30);
        assert_eq!(default_reserve(2 << 30), 256 * MIB);
        assert_eq!(default_reserve(512 * MIB), 128 * MIB);
        assert_eq!(db_reserve(4 << 30), 64 * MIB);
        assert_eq!(db_reserve(128 * MIB), 32 * MIB);
    }

    #[test]
    fn caps_only_where_a_quota_could_take_the_reserve() {
        let space = |avail| Space {
            total: 100 << 30,
            avail,
        };
        let r = 1 << 30;
        // Plenty of room for the largest quota: no cap.
        assert_eq!(room_each(space(50 << 30), r, 1, 10 << 30), None);
        // Less left than a quota: each may take what is left above the reserve.
        assert_eq!(room_each(space(5 << 30), r, 1, 10 << 30), Some(4 << 30));
        // Low (under twice the reserve): shared out.
        assert_eq!(
            room_each(space(1536 * MIB), r, 4, 10 << 30),
            Some(128 * MIB)
        );
        // Down to the reserve: nothing more for anyone.
        assert_eq!(room_each(space(512 * MIB), r, 4, 10 << 30), Some(0));
        assert!(is_low(512 * MIB, r) && !is_low(2 << 30, r));
        assert!(refusal(space(512 * MIB), r).contains("512 MiB free"));
    }
}
