//! Snapshots, forks and reset (docs/snapshots.md).
//!
//! A filesystem snapshot is the sandbox's layer stack plus one new layer: a copy of its writable layer
//! taken while its processes are frozen, stored once by content digest (`layers.rs`). Sandboxes started
//! from a snapshot mount its layers read-only under a fresh writable layer of their own, so a fork
//! copies nothing. Reset replaces a sandbox's instance (processes and writable layer) with a fresh one
//! over the chosen layers, keeping its id, uid range, hostname, limits, environment and timeout.

use std::ops::Deref;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use futures::StreamExt;
use moat_api::{
    CreateSandboxRequest, CreateSnapshotRequest, ForkRequest, ResetRequest, Sandbox, SandboxState,
    Snapshot, SnapshotKind,
};

use super::core::{detached, files_only, Core};
use super::lifecycle::Lifecycle;
use super::validate::validate_metadata;
use crate::clock::{now_ms, rfc3339};
use crate::db::SnapshotRecord;
use crate::error::Error;

/// Bytes of the regular files under `dir` (a checkpoint image: flat, runsc's files).
fn dir_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                // Allocated bytes: a VM's disk image is sparse.
                .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// Deepest layer stack a snapshot may have (overlayfs' mount options must fit in one page).
pub const MAX_LAYERS: usize = 48;
/// Most sandboxes one fork call starts.
pub const MAX_FORKS: u32 = 100;

fn snapshot_to_api(r: &SnapshotRecord) -> Snapshot {
    Snapshot {
        id: r.id.clone(),
        name: r.name.clone(),
        kind: r.kind,
        sandbox_id: r.sandbox_id.clone(),
        template: r.template.clone(),
        isolation: r.isolation,
        layers: r.layers.clone(),
        size_bytes: r.size_bytes,
        created_at: rfc3339(r.created_at_ms),
        frozen_ms: r.frozen_ms,
        limits: r.limits.clone(),
        env_keys: r.env.keys().cloned().collect(),
        metadata: r.metadata.clone(),
    }
}

pub struct Snapshots {
    core: Arc<Core>,
    sandboxes: Arc<Lifecycle>,
}

impl Deref for Snapshots {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Snapshots {
    pub(super) fn new(core: Arc<Core>, sandboxes: Arc<Lifecycle>) -> Snapshots {
        Snapshots { core, sandboxes }
    }

    /// Disk used by templates, the layer store and sandboxes' writable layers.
    pub async fn disk_usage(&self) -> Result<moat_api::DiskUsage, Error> {
        let mut plain_bytes = 0;
        let templates: Vec<moat_api::DiskUsageItem> = self
            .db
            .list_templates()?
            .into_iter()
            .map(|t| {
                if t.source != moat_api::TemplateSource::Spec {
                    plain_bytes += t.size_bytes;
                }
                moat_api::DiskUsageItem {
                    name: t.name,
                    count: 1,
                    bytes: t.size_bytes,
                }
            })
            .collect();
        let (cache_entries, cache_bytes) = self.db.cache_usage()?;
        let store = self.layers.clone();
        let (count, bytes) = tokio::task::spawn_blocking(move || store.usage())
            .await
            .map_err(|e| Error::internal(format!("layer usage: {e}")))?;
        let mut sandboxes = moat_api::DiskUsageItem {
            name: "sandboxes".into(),
            count: 0,
            bytes: 0,
        };
        let mut quota_bytes = 0;
        for rec in self.db.list_sandboxes()? {
            let (Ok(tier), Some(state)) = (self.tier(rec.isolation), &rec.tier_state) else {
                continue;
            };
            sandboxes.count += 1;
            quota_bytes += rec.limits.disk_mb << 20;
            if let Ok(u) = tier.usage(&rec.id, state).await {
                sandboxes.bytes += u.disk_bytes;
            }
        }
        let layers = moat_api::DiskUsageItem {
            name: "layers".into(),
            count,
            bytes,
        };
        let total_bytes = plain_bytes + layers.bytes + sandboxes.bytes;
        let reserve = self.disk_reserve();
        let filesystem = super::disk::Space::of(&self.settings.data_dir)
            .ok()
            .map(|s| moat_api::FilesystemUsage {
                total_bytes: s.total,
                free_bytes: s.avail,
                reserve_bytes: reserve,
                low: super::disk::is_low(s.avail, reserve),
                quota_bytes,
            });
        Ok(moat_api::DiskUsage {
            templates,
            layers,
            build_cache: moat_api::DiskUsageItem {
                name: "build cache".into(),
                count: cache_entries,
                bytes: cache_bytes,
            },
            snapshots: self.db.list_snapshots()?.len() as u64,
            sandboxes,
            total_bytes,
            filesystem,
        })
    }

    /// Takes a snapshot of a running or paused sandbox.
    pub async fn snapshot(
        self: &Arc<Self>,
        id: &str,
        req: CreateSnapshotRequest,
    ) -> Result<Snapshot, Error> {
        let (this, id) = (self.clone(), id.to_string());
        detached(async move { this.snapshot_now(&id, req).await }).await
    }

    async fn snapshot_now(&self, id: &str, req: CreateSnapshotRequest) -> Result<Snapshot, Error> {
        self.check_disk()?;
        if let Some(n) = &req.name {
            moat_api::validate_snapshot_name(n).map_err(|m| Error::invalid("name", m))?;
            if self.db.get_snapshot(n)?.is_some() {
                return Err(Error::conflict(format!(
                    "a snapshot named {n} exists already"
                )));
            }
        }
        validate_metadata(&req.metadata)?;
        let rec = self.record(id)?;
        let tier = self.tier(rec.isolation)?;
        if req.kind == Some(SnapshotKind::Full) {
            if let Some(why) = tier.full_snapshot_unsupported() {
                return Err(Error::unavailable("kind", why));
            }
        }
        if rec.layers.len() >= MAX_LAYERS {
            return Err(Error::conflict(format!(
                "sandbox {id} already stacks {} layers (at most {MAX_LAYERS}); snapshot a sandbox started from the template instead",
                rec.layers.len()
            )));
        }
        let lock = self.op_lock(id);
        let _op = lock.lock().await;
        // Re-read under the lock: a reset or delete may have changed it.
        let rec = self.record(id)?;
        if files_only(&rec) {
            return Err(Error::conflict(format!(
                "sandbox {id} is paused with its files only (its processes ended with the host); resume it first"
            )));
        }
        let (SandboxState::Running | SandboxState::Paused, Some(state)) =
            (rec.state, rec.tier_state.as_ref())
        else {
            return Err(Error::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        };
        let snap_id = crate::ids::new_id("snap");
        let full = req.kind == Some(SnapshotKind::Full);
        let scratch = self.layers.scratch()?;
        let (frozen, image) = if full {
            let image = self.checkpoint_dir(&snap_id);
            let made = std::fs::create_dir_all(&image).and_then(|()| {
                std::fs::set_permissions(&image, std::fs::Permissions::from_mode(0o700))
            });
            if let Err(e) = made {
                let _ = crate::host::mount::remove_unmounted_tree(&scratch);
                return Err(Error::internal(format!("create {}: {e}", image.display())));
            }
            // The agent's connection ends with the checkpoint (on most tiers); the next request
            // reconnects.
            let ends = self.capabilities(rec.isolation).checkpoint_ends_connections;
            if ends {
                self.agents.write().await.remove(id);
            }
            match tier.checkpoint(id, state, &scratch, &image).await {
                Ok((d, new_state)) => {
                    self.db.set_tier_state(id, rec.state, &new_state)?;
                    self.watch_exit(id, tier.as_ref(), &new_state);
                    if ends {
                        self.agents.write().await.remove(id);
                    }
                    (d, Some(image))
                }
                Err(e) => {
                    let _ = crate::host::mount::remove_unmounted_tree(&scratch);
                    let _ = std::fs::remove_dir_all(&image);
                    return Err(Error::tier(format!("full-state snapshot of {id}"), e));
                }
            }
        } else {
            match tier.export_changes(id, state, &scratch).await {
                Ok(d) => (d, None),
                Err(e) => {
                    let _ = crate::host::mount::remove_unmounted_tree(&scratch);
                    return Err(Error::tier(format!("snapshot of {id}"), e));
                }
            }
        };
        // Hashed off the async threads; moved into the store below, under the layer lock, together
        // with the snapshot's row (a collection in between would take the new layer away).
        let hashed = {
            let scratch = scratch.clone();
            tokio::task::spawn_blocking(move || crate::layers::digest_tree(&scratch))
                .await
                .map_err(|e| Error::internal(format!("snapshot of {id}: {e}")))?
        };
        let (digest, size_bytes) = match hashed {
            Ok(v) => v,
            Err(e) => {
                let _ = crate::host::mount::remove_unmounted_tree(&scratch);
                if let Some(image) = &image {
                    let _ = std::fs::remove_dir_all(image);
                }
                return Err(Error::internal(format!("snapshot of {id}: {e:#}")));
            }
        };
        let size_bytes = size_bytes + image.as_deref().map_or(0, dir_bytes);
        let mut stack = rec.layers.clone();
        if let Some(n) = tier.layers_under_writable(state) {
            stack.truncate(n);
        }
        stack.push(digest);
        let snap = SnapshotRecord {
            id: snap_id,
            name: req.name,
            kind: if full {
                SnapshotKind::Full
            } else {
                SnapshotKind::Filesystem
            },
            sandbox_id: rec.id.clone(),
            template: rec.template.clone(),
            isolation: rec.isolation,
            layers: stack,
            size_bytes,
            created_at_ms: now_ms(),
            frozen_ms: frozen.as_millis() as u64,
            limits: rec.limits.clone(),
            env: rec.env.clone(),
            metadata: req.metadata,
            root: rec.root.clone(),
            runtime: rec.runtime.clone(),
        };
        {
            let _g = self
                .layer_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let digest = snap.layers.last().cloned().unwrap_or_default();
            if let Err(e) = self.layers.commit_hashed(&scratch, &digest, size_bytes) {
                drop(_g);
                let _ = crate::host::mount::remove_unmounted_tree(&scratch);
                if let Some(image) = &image {
                    let _ = std::fs::remove_dir_all(image);
                }
                return Err(Error::internal(format!("snapshot of {id}: {e:#}")));
            }
            if let Err(e) = self.db.insert_snapshot(&snap) {
                drop(_g);
                if let Some(image) = &image {
                    let _ = std::fs::remove_dir_all(image);
                }
                self.gc_layers();
                let msg = format!("{e:#}");
                return Err(if msg.contains("UNIQUE") {
                    Error::conflict("a snapshot with that name exists already")
                } else {
                    Error::internal(format!("record snapshot: {msg}"))
                });
            }
        }
        tracing::info!(sandbox = %id, snapshot = %snap.id, bytes = size_bytes, frozen_ms = snap.frozen_ms, "snapshot taken");
        Ok(snapshot_to_api(&snap))
    }

    pub fn list(&self) -> Result<Vec<Snapshot>, Error> {
        Ok(self
            .db
            .list_snapshots()?
            .iter()
            .map(snapshot_to_api)
            .collect())
    }

    pub fn get(&self, id_or_name: &str) -> Result<Snapshot, Error> {
        self.snapshot_record("id", id_or_name)
            .map(|s| snapshot_to_api(&s))
    }

    /// Deletes a snapshot; its layers stay while sandboxes started from it run.
    pub fn delete(&self, id_or_name: &str) -> Result<(), Error> {
        let snap = self.snapshot_record("id", id_or_name)?;
        self.db.delete_snapshot(&snap.id)?;
        let image = self.checkpoint_dir(&snap.id);
        if image.exists() {
            if let Err(e) = std::fs::remove_dir_all(&image) {
                tracing::warn!(snapshot = %snap.id, "remove {}: {e}", image.display());
            }
        }
        self.gc_layers();
        tracing::info!(snapshot = %snap.id, "snapshot deleted");
        Ok(())
    }

    /// Starts `req.count` sandboxes from one snapshot; all or none (on a failure the ones already
    /// started are removed).
    pub async fn fork(
        self: &Arc<Self>,
        id_or_name: &str,
        req: ForkRequest,
    ) -> Result<Vec<Sandbox>, Error> {
        let (this, id) = (self.clone(), id_or_name.to_string());
        detached(async move { this.fork_now(&id, req).await }).await
    }

    async fn fork_now(&self, id_or_name: &str, req: ForkRequest) -> Result<Vec<Sandbox>, Error> {
        self.check_disk()?;
        if !(1..=MAX_FORKS).contains(&req.count) {
            return Err(Error::invalid(
                "count",
                format!("count must be 1..={MAX_FORKS}, got {}", req.count),
            ));
        }
        let snap = self.snapshot_record("id", id_or_name)?;
        // Starts overlap their waits (mounts, the agent's start): as many at once as a client issuing
        // concurrent creates would, up to 16.
        let parallel = (req.count as usize).clamp(1, 16);
        let requests = (0..req.count).map(|i| {
            let mut metadata = req.metadata.clone();
            metadata.insert("moat.fork-index".into(), i.to_string());
            CreateSandboxRequest {
                snapshot: Some(snap.id.clone()),
                timeout: req.timeout,
                metadata,
                env: req.env.clone(),
                on_timeout: req.on_timeout,
                ..Default::default()
            }
        });
        let results: Vec<Result<Sandbox, Error>> = futures::stream::iter(requests)
            .map(|r| self.sandboxes.create(r))
            .buffered(parallel)
            .collect()
            .await;
        let mut made = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok(s) => made.push(s),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            for s in &made {
                if let Err(d) = self.sandboxes.delete(&s.id).await {
                    tracing::error!(sandbox = %s.id, "remove after failed fork: {d}");
                }
            }
            return Err(e);
        }
        tracing::info!(snapshot = %snap.id, count = req.count, "forked");
        Ok(made)
    }

    /// Puts a sandbox back into a snapshot's state (or the state it was created in): every process is
    /// killed and its writable layer replaced by an empty one over the snapshot's layers. The id, uid
    /// range, hostname, limits, environment, metadata and timeout stay.
    pub async fn reset(self: &Arc<Self>, id: &str, req: ResetRequest) -> Result<Sandbox, Error> {
        let (this, id) = (self.clone(), id.to_string());
        detached(async move { this.reset_now(&id, req).await }).await
    }

    async fn reset_now(&self, id: &str, req: ResetRequest) -> Result<Sandbox, Error> {
        let lock = self.op_lock(id);
        let _op = lock.lock().await;
        let rec = self.record(id)?;
        if !matches!(rec.state, SandboxState::Running | SandboxState::Paused) {
            return Err(Error::conflict(format!(
                "sandbox {id} is {}",
                rec.state.as_str()
            )));
        }
        let (layers, snapshot) = match &req.snapshot {
            Some(s) => {
                let snap = self.snapshot_record("snapshot", s)?;
                if snap.template != rec.template || snap.isolation != rec.isolation {
                    return Err(Error::invalid(
                        "snapshot",
                        format!(
                            "snapshot {} is of template {} on the {} tier; sandbox {id} runs template {} on the {} tier",
                            snap.id,
                            snap.template,
                            snap.isolation.as_str(),
                            rec.template,
                            rec.isolation.as_str()
                        ),
                    ));
                }
                if snap.root != rec.root {
                    return Err(Error::invalid(
                        "snapshot",
                        format!(
                            "snapshot {} stands on another build of template {} than sandbox {id}",
                            snap.id, rec.template
                        ),
                    ));
                }
                (snap.layers, Some(snap.id))
            }
            None => (rec.layers.clone(), rec.snapshot.clone()),
        };
        let tier = self.tier(rec.isolation)?;
        let rootfs = self.root_path(&rec.template, rec.root.as_deref()).await?;
        let _starting = self.start_of(id);
        self.db.set_state(id, SandboxState::Starting)?;
        self.agents.write().await.remove(id);
        let restarted = async {
            tier.destroy(id, rec.tier_state.as_ref()).await?;
            self.db.set_layers(id, &layers, snapshot.as_deref(), None)?;
            let mut next = rec.clone();
            next.layers = layers.clone();
            next.snapshot = snapshot.clone();
            self.boot(&next, &tier, rootfs, false).await
        }
        .await;
        match restarted {
            Ok((agent, _state)) => {
                self.agents.write().await.insert(id.to_string(), agent);
                if layers != rec.layers {
                    self.gc_layers();
                }
                tracing::info!(sandbox = %id, snapshot = ?snapshot, "reset");
                self.sandboxes.get(id)
            }
            Err(e) => {
                self.discard_failed(id, &tier).await;
                self.gc_layers();
                Err(Error::internal(format!(
                    "reset of {id} failed and the sandbox was removed: {e:#}"
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn snapshot_ids_are_well_formed() {
        let a = crate::ids::new_id("snap");
        assert!(a.starts_with("snap_") && a.len() == 31, "{a}");
        assert_ne!(a, crate::ids::new_id("snap"));
        assert!(moat_api::validate_snapshot_name(&a).is_err());
    }

    #[test]
    fn on_timeout_default_is_kill() {
        assert_eq!(moat_api::OnTimeout::default(), moat_api::OnTimeout::Kill);
    }
}
