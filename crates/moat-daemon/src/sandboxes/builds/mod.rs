//! Template builds from a spec (docs/templates.md). The base comes first (a template, an image pulled
//! into a layer, or a Debian release made with debootstrap into a layer); then each step runs in a
//! sandbox of its own over the layers so far, and what it changed becomes a layer. Every step that
//! ran is recorded in the build cache under a key of its inputs and of everything before it, so an
//! unchanged rebuild runs nothing and a changed step rebuilds from there on. The template switches
//! to the new layers only when every step (and the start check) passed: a failed build leaves the
//! previous version in place and says which step failed, with the end of its output.
//!
//! A build runs in a task of its own (a client that goes away does not stop it); its events go to
//! `<data_dir>/builds/<id>/events.ndjson` and to whoever follows it.

use std::sync::atomic::{AtomicBool, AtomicUsize};

use moat_api::{
    BaseSpec, Build, BuildEvent, BuildStatus, BuildStep, BuildStepInfo, StepStatus, TemplateConfig,
    TemplateSource, TemplateSpec, TemplateStatus,
};

use std::collections::{BTreeMap, HashMap};
use std::ops::Deref;
use std::sync::{Arc, Mutex};

use anyhow::Result;

use super::core::{Core, Stack};
use super::pool::Pool;
use crate::clock::{now_ms, rfc3339};
use crate::db::{BuildRecord, TemplateRecord};
use crate::error::Error;
use crate::template::spec::{self, CopySource};

mod log;
mod step;

pub use log::LiveBuild;

/// Template builds from a spec: started, followed, listed, cancelled; their cache.
pub struct Builds {
    core: Arc<Core>,
    pool: Arc<Pool>,
    /// Template builds running now, by build id.
    live: Mutex<HashMap<String, Arc<LiveBuild>>>,
    /// Registry passwords of running builds' base images, by template (never stored).
    pull_secrets: Mutex<HashMap<String, String>>,
}

impl Deref for Builds {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

/// The label of a build's sandboxes (its value is the build id).
pub const BUILD_LABEL: &str = "moat.build";

/// Finished builds kept, with their logs; older ones are removed when a build starts.
const KEEP_BUILDS: u32 = 200;
/// Seconds one step may run when the spec sets no `build.step_timeout`.
pub(super) const DEFAULT_STEP_TIMEOUT: u64 = 1800;

/// Why a build stopped: the step (index) and what happened.
struct Failure {
    step: u32,
    message: String,
    cancelled: bool,
}

impl Failure {
    fn at(step: u32, message: impl Into<String>) -> Failure {
        Failure {
            step,
            message: message.into(),
            cancelled: false,
        }
    }
}

/// What the steps so far have set for the ones after them.
#[derive(Debug, Clone, Default)]
pub(super) struct StepState {
    pub env: BTreeMap<String, String>,
    pub user: Option<String>,
    pub workdir: Option<String>,
}

fn build_to_api(r: &BuildRecord) -> Build {
    Build {
        id: r.id.clone(),
        template: r.template.clone(),
        status: r.status,
        started_at: rfc3339(r.started_at_ms),
        finished_at: r.finished_at_ms.map(rfc3339),
        steps: r.steps.clone(),
        error: r.error.clone(),
        failed_step: r.failed_step,
        spec: r.spec.clone(),
    }
}

/// The steps of a build as the API lists them before it starts (index 0 is the base, the start check
/// comes last).
fn planned_steps(spec: &TemplateSpec) -> Vec<BuildStepInfo> {
    let mut steps = vec![BuildStepInfo {
        index: 0,
        description: format!("from {}", spec.from.describe()),
        status: StepStatus::Pending,
        duration_ms: None,
        layer: None,
        size_bytes: None,
    }];
    for (i, s) in spec.steps.iter().enumerate() {
        steps.push(BuildStepInfo {
            index: i as u32 + 1,
            description: s.describe(),
            status: StepStatus::Pending,
            duration_ms: None,
            layer: None,
            size_bytes: None,
        });
    }
    if let Some(st) = &spec.start {
        steps.push(BuildStepInfo {
            index: spec.steps.len() as u32 + 1,
            description: BuildStep::Run(st.cmd.clone())
                .describe()
                .replacen("run", "start", 1),
            status: StepStatus::Pending,
            duration_ms: None,
            layer: None,
            size_bytes: None,
        });
    }
    steps
}

impl Builds {
    pub(super) fn new(core: Arc<Core>, pool: Arc<Pool>) -> Builds {
        Builds {
            core,
            pool,
            live: Mutex::new(HashMap::new()),
            pull_secrets: Mutex::new(HashMap::new()),
        }
    }

    /// Largest build context accepted, bytes (`--max-build-context-mb`).
    pub fn max_context_bytes(&self) -> u64 {
        self.settings.max_build_context_mb << 20
    }

    /// `<data_dir>/builds/<id>`: a build's events and, while it runs, its context.
    pub fn build_dir(&self, id: &str) -> std::path::PathBuf {
        self.settings.data_dir.join("builds").join(id)
    }

    /// A new build id and its (empty) directory, for the API to store a build context in before the
    /// build starts.
    pub fn new_dir(&self) -> Result<(String, std::path::PathBuf), Error> {
        self.check_disk()?;
        let id = crate::ids::new_id("bld");
        let dir = self.build_dir(&id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::internal(format!("create {}: {e}", dir.display())))?;
        Ok((id, dir))
    }

    /// Starts building `template` from `spec` (with the build context at `<dir>/context.tar` when
    /// `context`); the build goes on in its own task. Checks what can be checked before it starts.
    pub async fn start(
        self: &Arc<Self>,
        id: String,
        template: &str,
        mut spec: TemplateSpec,
        context: bool,
        no_cache: bool,
    ) -> Result<Arc<LiveBuild>, Error> {
        let dir = self.build_dir(&id);
        let started = self
            .prepare_build(&id, template, &mut spec, context, no_cache)
            .await;
        if started.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        started
    }

    async fn prepare_build(
        self: &Arc<Self>,
        id: &str,
        template: &str,
        spec: &mut TemplateSpec,
        context: bool,
        no_cache: bool,
    ) -> Result<Arc<LiveBuild>, Error> {
        moat_api::validate_template_name(template).map_err(|m| Error::invalid("name", m))?;
        spec::check(spec)?;
        if !context {
            if let Some(i) = spec
                .steps
                .iter()
                .position(|s| matches!(s, BuildStep::Copy(_)))
            {
                return Err(Error::invalid(
                    &format!("spec.steps[{i}].copy"),
                    "copy steps need a build context: send the spec and its files as a tar (`moat template build NAME -f moat.toml` does)",
                ));
            }
        }
        let existing = self.db.get_template(template)?;
        if let Some(t) = &existing {
            if t.source != TemplateSource::Spec && t.status != TemplateStatus::Failed {
                return Err(Error::conflict(format!(
                    "template {template} is not built from a spec (it is a {} template); remove it first or build under another name",
                    serde_json::to_value(t.source).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
                )));
            }
        }
        if let Some(base) = &spec.from.template {
            if base == template {
                return Err(Error::invalid(
                    "spec.from.template",
                    format!("template {template} cannot start from itself"),
                ));
            }
            match self.db.get_template(base)? {
                None if base != crate::template::store::BASE => {
                    return Err(Error::invalid(
                        "spec.from.template",
                        format!("template {base} not found"),
                    ))
                }
                Some(t)
                    if t.status != TemplateStatus::Ready
                        && base != crate::template::store::BASE =>
                {
                    return Err(Error::invalid(
                        "spec.from.template",
                        format!(
                            "template {base} is not ready ({})",
                            t.error.clone().unwrap_or_else(|| t.status_str())
                        ),
                    ))
                }
                _ => {}
            }
        }
        let isolation = spec
            .build
            .isolation
            .unwrap_or(self.settings.default_isolation);
        let tier = self
            .tier(isolation)
            .map_err(|e| Error::invalid("spec.build.isolation", e.to_string()))?;
        if !tier.info().available {
            return Err(Error::invalid(
                "spec.build.isolation",
                format!(
                    "isolation {} is not available on this host: {}",
                    isolation.as_str(),
                    tier.info().note.unwrap_or_default()
                ),
            ));
        }
        if let Some(pw) = spec.from.password.take() {
            // Kept in memory for the pull, never stored: the build's spec is shown by the API.
            self.hold_pull_password(template, Some(pw));
            spec.from.password = Some("(redacted)".into());
        }
        let live = {
            let mut builds = self
                .live
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(other) = builds.values().find(|b| b.template == template) {
                return Err(Error::conflict(format!(
                    "template {template} is being built (build {}); wait for it or cancel it",
                    other.id
                )));
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.build_dir(id).join("events.ndjson"))
                .map_err(|e| Error::internal(format!("build log: {e}")))?;
            let live = Arc::new(LiveBuild {
                id: id.to_string(),
                template: template.to_string(),
                state: std::sync::Mutex::new((Vec::new(), false)),
                logged: AtomicUsize::new(0),
                truncated: AtomicBool::new(false),
                changed: tokio::sync::Notify::new(),
                cancel: tokio_util::sync::CancellationToken::new(),
                file: std::sync::Mutex::new(Some(file)),
            });
            builds.insert(id.to_string(), live.clone());
            live
        };
        let rec = BuildRecord {
            id: id.to_string(),
            template: template.to_string(),
            status: BuildStatus::Running,
            started_at_ms: now_ms(),
            finished_at_ms: None,
            spec: spec.clone(),
            steps: planned_steps(spec),
            error: None,
            failed_step: None,
        };
        let recorded = self.db.upsert_build(&rec).and_then(|()| {
            if existing.is_none() {
                let mut t =
                    TemplateRecord::plain(template, TemplateSource::Spec, TemplateStatus::Building);
                t.from_desc = Some(spec.from.describe());
                t.build_id = Some(id.to_string());
                self.db.upsert_template(&t)?;
            }
            Ok(())
        });
        if let Err(e) = recorded {
            self.forget_build(id);
            return Err(e.into());
        }
        live.emit(&BuildEvent::Started(Box::new(moat_api::BuildStarted {
            build: build_to_api(&rec),
        })));
        for old in self.db.prune_builds(KEEP_BUILDS).unwrap_or_default() {
            let _ = std::fs::remove_dir_all(self.build_dir(&old));
        }
        tracing::info!(build = %id, template, "build started");
        let this = self.clone();
        let task_live = live.clone();
        tokio::spawn(async move { this.run_build(task_live, rec, no_cache).await });
        Ok(live)
    }

    fn forget_build(&self, id: &str) {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(id);
    }

    /// A running build's live events, if it runs.
    pub fn live_build(&self, id: &str) -> Option<Arc<LiveBuild>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    pub fn get(&self, id: &str) -> Result<Build, Error> {
        if !crate::ids::valid_id("bld", id) {
            return Err(Error::not_found("id", format!("build {id:?} not found")));
        }
        self.db
            .get_build(id)?
            .map(|b| build_to_api(&b))
            .ok_or_else(|| Error::not_found("id", format!("build {id} not found")))
    }

    pub fn list(&self, template: Option<&str>, limit: u32) -> Result<Vec<Build>, Error> {
        Ok(self
            .db
            .list_builds(template, limit)?
            .iter()
            .map(build_to_api)
            .collect())
    }

    /// The event log of a finished build.
    pub fn events_file(&self, id: &str) -> Result<std::path::PathBuf, Error> {
        self.get(id)?;
        Ok(self.build_dir(id).join("events.ndjson"))
    }

    /// Asks a running build to stop: its running step is killed, its sandbox removed, and the
    /// template stays as it was.
    pub fn cancel(&self, id: &str) -> Result<Build, Error> {
        let b = self.get(id)?;
        match self.live_build(id) {
            Some(live) => {
                live.cancel.cancel();
                Ok(b)
            }
            None => Err(Error::conflict(format!(
                "build {id} is {}, not running",
                b.status.as_str()
            ))),
        }
    }

    /// Empties the build cache and removes the layers only it held.
    pub fn prune_cache(&self) -> Result<moat_api::PruneResult, Error> {
        let entries = {
            let _g = self
                .layer_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.db.cache_clear()?
        };
        let before = self.layers.usage().0;
        self.gc_layers();
        let after = self.layers.usage().0;
        Ok(moat_api::PruneResult {
            entries,
            layers: before.saturating_sub(after),
        })
    }

    /// At start-up: builds that were running when the daemon stopped have failed.
    pub(super) fn recover(&self) -> Result<()> {
        for mut b in self.db.list_builds(None, u32::MAX)? {
            if b.status == BuildStatus::Running {
                b.status = BuildStatus::Failed;
                b.finished_at_ms = Some(now_ms());
                b.error = Some("the daemon stopped during the build".into());
                self.db.upsert_build(&b)?;
                let _ = std::fs::remove_file(self.build_dir(&b.id).join("context.tar"));
                tracing::warn!(build = %b.id, template = %b.template, "build ended by a daemon stop");
            }
        }
        Ok(())
    }

    async fn run_build(
        self: Arc<Self>,
        live: Arc<LiveBuild>,
        mut rec: BuildRecord,
        no_cache: bool,
    ) {
        let result = tokio::select! {
            r = self.build_steps(&live, &mut rec, no_cache) => r,
            () = live.cancel.cancelled() => Err(Failure {
                step: u32::MAX,
                message: "cancelled".into(),
                cancelled: true,
            }),
        };
        self.hold_pull_password(&rec.template, None);
        rec.finished_at_ms = Some(now_ms());
        let last = match result {
            Ok(t) => {
                rec.status = BuildStatus::Succeeded;
                tracing::info!(build = %rec.id, template = %rec.template, "build succeeded");
                BuildEvent::Done {
                    template: Box::new(t),
                }
            }
            Err(f) => {
                rec.status = if f.cancelled {
                    BuildStatus::Cancelled
                } else {
                    BuildStatus::Failed
                };
                let step = if f.cancelled {
                    rec.steps
                        .iter()
                        .find(|s| s.status == StepStatus::Running)
                        .map_or(0, |s| s.index)
                } else {
                    f.step
                };
                for s in rec
                    .steps
                    .iter_mut()
                    .filter(|s| s.status == StepStatus::Running)
                {
                    s.status = StepStatus::Failed;
                }
                let f = Failure { step, ..f };
                rec.error = Some(f.message.clone());
                rec.failed_step = Some(f.step);
                tracing::warn!(build = %rec.id, template = %rec.template, step = f.step, "build {}: {}", rec.status.as_str(), f.message);
                if let Ok(Some(mut t)) = self.db.get_template(&rec.template) {
                    if t.status == TemplateStatus::Building {
                        t.status = TemplateStatus::Failed;
                        t.error = Some(f.message.clone());
                        let _ = self.db.upsert_template(&t);
                    }
                }
                BuildEvent::Failed {
                    message: f.message,
                    step: Some(f.step),
                }
            }
        };
        if let Err(e) = self.db.upsert_build(&rec) {
            tracing::error!(build = %rec.id, "record build: {e:#}");
        }
        // A cancelled or failed build may leave step sandboxes behind (the future running the step
        // was dropped mid-way): remove every sandbox of this build.
        self.remove_build_sandboxes(&rec.id).await;
        let dir = self.build_dir(&rec.id);
        let _ = std::fs::remove_file(dir.join("context.tar"));
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("copy-") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        live.emit(&last);
        live.finish();
        self.forget_build(&rec.id);
        self.gc_layers();
    }

    /// Removes the sandboxes a build started (normally each is removed at the end of its step).
    async fn remove_build_sandboxes(&self, build: &str) {
        let Ok(all) = self.db.list_sandboxes() else {
            return;
        };
        for rec in all {
            if rec.metadata.get(BUILD_LABEL).map(String::as_str) == Some(build) {
                if let Err(e) = self.destroy(rec).await {
                    tracing::warn!(build, "remove a build sandbox: {e:#}");
                }
            }
        }
    }

    fn mark(&self, rec: &mut BuildRecord, index: u32, f: impl FnOnce(&mut BuildStepInfo)) {
        if let Some(s) = rec.steps.iter_mut().find(|s| s.index == index) {
            f(s);
        }
        if let Err(e) = self.db.upsert_build(rec) {
            tracing::warn!(build = %rec.id, "record build step: {e:#}");
        }
    }

    async fn build_steps(
        &self,
        live: &LiveBuild,
        rec: &mut BuildRecord,
        no_cache: bool,
    ) -> Result<moat_api::Template, Failure> {
        let spec = rec.spec.clone();
        let total = rec.steps.len() as u32;
        let dir = self.build_dir(&rec.id);
        let context = dir.join("context.tar");
        let mut sizes: u64 = 0;

        // Step 0: the base.
        live.emit(&BuildEvent::Step {
            index: 0,
            total,
            description: rec.steps[0].description.clone(),
            cached: false,
        });
        self.mark(rec, 0, |s| s.status = StepStatus::Running);
        let t0 = std::time::Instant::now();
        let (mut stack, mut key, base_layer) = self
            .resolve_base(live, &spec.from, &rec.template, no_cache)
            .await
            .map_err(|m| Failure::at(0, format!("step 0 (from {}): {m}", spec.from.describe())))?;
        if let Some((l, size, _)) = &base_layer {
            sizes += size;
            let (l, size) = (l.clone(), *size);
            self.mark(rec, 0, |s| {
                s.layer = Some(l);
                s.size_bytes = Some(size);
            });
        }
        let base_cached = base_layer.as_ref().is_some_and(|b| b.2);
        let ms = t0.elapsed().as_millis() as u64;
        self.mark(rec, 0, |s| {
            s.status = if base_cached {
                StepStatus::Cached
            } else {
                StepStatus::Done
            };
            s.duration_ms = Some(ms);
        });
        live.emit(&BuildEvent::StepDone {
            index: 0,
            duration_ms: ms,
            layer: base_layer.as_ref().map(|b| b.0.clone()),
            size_bytes: base_layer.as_ref().map_or(0, |b| b.1),
        });

        let mut state = StepState {
            env: stack.env.clone(),
            user: stack.runtime.user.clone(),
            workdir: stack.runtime.workdir.clone(),
        };
        let inherited_start = stack.runtime.start.clone();
        for (i, step) in spec.steps.iter().enumerate() {
            let index = i as u32 + 1;
            let description = step.describe();
            let copy: Option<CopySource> = match step {
                BuildStep::Copy(c) => {
                    let out = dir.join(format!("copy-{index}.tar"));
                    let (ctx, src, dest) = (context.clone(), c.src.clone(), c.dest.clone());
                    let cs = tokio::task::spawn_blocking(move || {
                        spec::copy_source(&ctx, &src, &dest, &out)
                    })
                    .await
                    .map_err(|e| Failure::at(index, format!("{e}")))?
                    .map_err(|e| {
                        Failure::at(index, format!("step {index} ({description}): {e:#}"))
                    })?;
                    Some(cs)
                }
                _ => None,
            };
            let extra = copy.as_ref().map(|c| c.digest.clone()).unwrap_or_default();
            key = spec::step_key(&key, step, &extra, &self.settings.registries);
            match step {
                BuildStep::Env(e) => state.env.extend(e.clone()),
                BuildStep::User(u) => state.user = Some(u.clone()),
                _ => {}
            }
            if !step.makes_layer() {
                live.emit(&BuildEvent::Step {
                    index,
                    total,
                    description,
                    cached: false,
                });
                self.mark(rec, index, |s| {
                    s.status = StepStatus::Done;
                    s.duration_ms = Some(0);
                });
                live.emit(&BuildEvent::StepDone {
                    index,
                    duration_ms: 0,
                    layer: None,
                    size_bytes: 0,
                });
                continue;
            }
            let hit = if no_cache {
                None
            } else {
                self.db
                    .cache_get(&key, now_ms())
                    .ok()
                    .flatten()
                    .filter(|hit| match hit {
                        Some((l, _)) => self.layers.path(l).is_ok_and(|p| p.is_dir()),
                        None => true,
                    })
            };
            if let Some(layer) = hit {
                live.emit(&BuildEvent::Step {
                    index,
                    total,
                    description,
                    cached: true,
                });
                if let Some((l, size)) = &layer {
                    stack.layers.push(l.clone());
                    sizes += size;
                }
                let (l, size) = (layer.clone().map(|x| x.0), layer.as_ref().map(|x| x.1));
                self.mark(rec, index, |s| {
                    s.status = StepStatus::Cached;
                    s.layer = l.clone();
                    s.size_bytes = size;
                    s.duration_ms = Some(0);
                });
                live.emit(&BuildEvent::StepDone {
                    index,
                    duration_ms: 0,
                    layer: l,
                    size_bytes: size.unwrap_or(0),
                });
            } else {
                live.emit(&BuildEvent::Step {
                    index,
                    total,
                    description: description.clone(),
                    cached: false,
                });
                self.mark(rec, index, |s| s.status = StepStatus::Running);
                let t = std::time::Instant::now();
                let made = self
                    .run_step(
                        live,
                        rec,
                        index,
                        &spec,
                        step,
                        &stack,
                        &state,
                        copy.as_ref(),
                        &key,
                    )
                    .await
                    .map_err(|m| {
                        Failure::at(index, format!("step {index} ({description}) failed: {m}"))
                    })?;
                let ms = t.elapsed().as_millis() as u64;
                if let Some((l, size)) = &made {
                    stack.layers.push(l.clone());
                    sizes += size;
                }
                let (l, size) = (made.clone().map(|x| x.0), made.as_ref().map(|x| x.1));
                self.mark(rec, index, |s| {
                    s.status = StepStatus::Done;
                    s.layer = l.clone();
                    s.size_bytes = size;
                    s.duration_ms = Some(ms);
                });
                live.emit(&BuildEvent::StepDone {
                    index,
                    duration_ms: ms,
                    layer: l,
                    size_bytes: size.unwrap_or(0),
                });
            }
            if let BuildStep::Workdir(w) = step {
                state.workdir = Some(w.clone());
            }
            if stack.layers.len() > super::snapshots::MAX_LAYERS - 8 {
                return Err(Failure::at(
                    index,
                    format!(
                        "step {index}: the template would stack more than {} layers; merge run steps",
                        super::snapshots::MAX_LAYERS - 8
                    ),
                ));
            }
        }
        let config = TemplateConfig {
            env: state.env,
            workdir: state.workdir,
            user: state.user,
            start: spec.start.clone().or(inherited_start),
        };
        stack.env = config.env.clone();
        stack.runtime = TemplateConfig {
            env: BTreeMap::new(),
            ..config.clone()
        };
        if spec.start.is_some() {
            let index = total - 1;
            live.emit(&BuildEvent::Step {
                index,
                total,
                description: rec.steps[index as usize].description.clone(),
                cached: false,
            });
            self.mark(rec, index, |s| s.status = StepStatus::Running);
            let t = std::time::Instant::now();
            live.log(
                index,
                "[moat] starting a sandbox of the new template to check its start command",
            );
            let sbx = self
                .build_sandbox(&rec.id, &rec.template, index, &spec, stack.clone())
                .await
                .map_err(|e| {
                    Failure::at(index, format!("step {index} (start check) failed: {}", e))
                })?;
            self.destroy_quietly(sbx).await;
            let ms = t.elapsed().as_millis() as u64;
            live.log(index, "[moat] the start command became ready");
            self.mark(rec, index, |s| {
                s.status = StepStatus::Done;
                s.duration_ms = Some(ms);
            });
            live.emit(&BuildEvent::StepDone {
                index,
                duration_ms: ms,
                layer: None,
                size_bytes: 0,
            });
        }
        let t = TemplateRecord {
            name: rec.template.clone(),
            source: TemplateSource::Spec,
            status: TemplateStatus::Ready,
            size_bytes: sizes,
            created_at_ms: now_ms(),
            error: None,
            root: stack.root.clone(),
            layers: stack.layers.clone(),
            config,
            from_desc: Some(spec.from.describe()),
            build_id: Some(rec.id.clone()),
        };
        {
            let _g = self
                .layer_lock
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            self.db
                .upsert_template(&t)
                .map_err(|e| Failure::at(total - 1, format!("record the template: {e:#}")))?;
        }
        // Pooled sandboxes of the previous version would be handed out from now on: replace them.
        if self.pool.serves(&t.name, self.settings.default_isolation) {
            if let Err(e) = self.pool.drain(&t.name).await {
                tracing::warn!(template = %t.name, "drain the warm pool after a build: {e}");
            }
            self.pool.resume();
        }
        Ok(crate::template::store::to_api(&t))
    }

    /// The base's stack and cache key, and the layer it made (digest, bytes, taken from the cache)
    /// when it is an image or a Debian release.
    async fn resolve_base(
        &self,
        live: &LiveBuild,
        base: &BaseSpec,
        building: &str,
        no_cache: bool,
    ) -> Result<(Stack, String, Option<(String, u64, bool)>), String> {
        if let Some(name) = &base.template {
            let t = self
                .templates
                .ensure(&self.db, name)
                .await
                .map_err(|e| e.to_string())?;
            if t.source == TemplateSource::Spec {
                let identity = format!(
                    "spec:{}:{}:{}",
                    t.root.clone().unwrap_or_default(),
                    t.layers.join(","),
                    serde_json::to_string(&t.config).unwrap_or_default()
                );
                return Ok((Stack::of_template(&t), spec::base_key(&identity), None));
            }
            // A plain template's files change only when it is made again (a new created_at).
            let identity = format!("template:{name}:{}", t.created_at_ms);
            let stack = Stack {
                root: Some(format!("template:{name}")),
                ..Default::default()
            };
            return Ok((stack, spec::base_key(&identity), None));
        }
        let (identity, what) = if let Some(image) = &base.image {
            (
                format!("image:{image}:{}", base.insecure),
                format!("pulling {image}"),
            )
        } else if let Some(release) = &base.debian {
            let opts = crate::template::debootstrap::DebootstrapOptions::from_host(
                self.settings.data_dir.join("cache").join("debootstrap"),
            )
            .map_err(|e| format!("{e:#}"))?;
            let mut pkgs = base.packages.clone();
            pkgs.sort();
            (
                format!("debian:{release}:{}:{}", opts.mirror, pkgs.join(",")),
                format!("debootstrap {release} from {}", opts.mirror),
            )
        } else {
            return Err("no base".into());
        };
        let key = spec::base_key(&identity);
        if !no_cache {
            if let Ok(Some(Some((layer, size)))) = self.db.cache_get(&key, now_ms()) {
                if self.layers.path(&layer).is_ok_and(|p| p.is_dir()) {
                    live.log(
                        0,
                        format!("[moat] {} from the build cache", base.describe()),
                    );
                    let stack = Stack {
                        root: Some(layer.clone()),
                        ..Default::default()
                    };
                    return Ok((stack, key, Some((layer, size, true))));
                }
            }
        }
        live.log(0, format!("[moat] {what}"));
        let scratch = self.layers.scratch().map_err(|e| format!("{e:#}"))?;
        let target = scratch.join("rootfs");
        let made = if let Some(image) = &base.image {
            let opts = crate::template::oci::PullOptions {
                username: base.username.clone(),
                password: self.pull_password(building),
                insecure: base.insecure,
            };
            let work = scratch.join("work");
            let r = async {
                std::fs::create_dir_all(&work)?;
                crate::template::oci::pull(image, &opts, &target, &work).await
            }
            .await;
            let _ = std::fs::remove_dir_all(&work);
            r
        } else {
            let mut opts = crate::template::debootstrap::DebootstrapOptions::from_host(
                self.settings.data_dir.join("cache").join("debootstrap"),
            )
            .map_err(|e| format!("{e:#}"))?;
            opts.suite = base.debian.clone().unwrap_or_default();
            opts.packages = base.packages.clone();
            let (tx, mut rx) = tokio::sync::mpsc::channel(64);
            let r = {
                let fwd = async {
                    while let Some(ev) = rx.recv().await {
                        match ev {
                            BuildEvent::Log { line, .. } => live.log(0, line),
                            p @ BuildEvent::Progress { .. } => live.emit(&p),
                            _ => {}
                        }
                    }
                };
                let run = async {
                    let r = crate::template::debootstrap::build(&opts, &target, &tx).await;
                    drop(tx);
                    r
                };
                tokio::join!(run, fwd).0
            };
            r
        };
        if let Err(e) = made {
            let _ = crate::host::mount::remove_unmounted_tree(&scratch);
            return Err(format!("{e:#}"));
        }
        let (digest, size) = self
            .commit_layer(target, &key)
            .await
            .map_err(|e| format!("{e:#}"))?;
        let _ = std::fs::remove_dir_all(&scratch);
        let stack = Stack {
            root: Some(digest.clone()),
            ..Default::default()
        };
        Ok((stack, key, Some((digest, size, false))))
    }

    /// The registry password of a build's base image: held only in memory while the build runs.
    fn pull_password(&self, template: &str) -> Option<String> {
        self.pull_secrets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(template)
            .cloned()
    }

    /// Keeps a build's registry password in memory until its build ends (the stored spec has it
    /// redacted).
    pub fn hold_pull_password(&self, template: &str, password: Option<String>) {
        let mut m = self
            .pull_secrets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match password {
            Some(p) => {
                m.insert(template.to_string(), p);
            }
            None => {
                m.remove(template);
            }
        }
    }

    /// Hashes `dir` into the layer store and records it under cache `key`, under the layer lock so a
    /// collection in between cannot take the new layer away.
    async fn commit_layer(&self, dir: std::path::PathBuf, key: &str) -> Result<(String, u64)> {
        let store = self.layers.clone();
        let d = dir.clone();
        // Hashing reads every byte: off the async threads.
        let (digest, size) =
            tokio::task::spawn_blocking(move || crate::layers::digest_tree(&d)).await??;
        let _g = self
            .layer_lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (digest2, _) = store.commit_hashed(&dir, &digest, size)?;
        self.db.cache_put(key, Some(&digest2), size, now_ms())?;
        Ok((digest, size))
    }
}

impl crate::db::TemplateRecord {
    fn status_str(&self) -> String {
        serde_json::to_value(self.status)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_ids() {
        let id = crate::ids::new_id("bld");
        assert!(crate::ids::valid_id("bld", &id), "{id}");
        assert!(!crate::ids::valid_id("bld", "bld_../../etc"));
    }

    #[test]
    fn planned_steps_number_base_steps_and_start() {
        let spec: TemplateSpec = serde_json::from_value(serde_json::json!({
            "from": "base", "steps": [{"apt": ["curl"]}], "start": {"cmd": "sleep 9"}
        }))
        .unwrap();
        let p = planned_steps(&spec);
        let d: Vec<&str> = p.iter().map(|s| s.description.as_str()).collect();
        assert_eq!(d, vec!["from template base", "apt curl", "start sleep 9"]);
        assert!(p.iter().all(|s| s.status == StepStatus::Pending));
    }
}
