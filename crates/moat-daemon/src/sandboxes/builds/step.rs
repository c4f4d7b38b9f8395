//! One step of a build: a sandbox over the layers so far, the step's command (or files) in it with
//! only the network the step needs, and what it changed taken as a layer.

use moat_api::{BuildStep, ProcessEvent, StartProcessRequest, TemplateConfig, TemplateSpec};

use std::collections::BTreeMap;

use moat_api::CreateSandboxRequest;

use super::super::core::Stack;
use super::log::{Lines, LiveBuild};
use super::Builds;
use super::{StepState, BUILD_LABEL, DEFAULT_STEP_TIMEOUT};
use crate::clock::now_ms;
use crate::db::BuildRecord;
use crate::db::{Claim, SandboxRecord};
use crate::error::Error;
use crate::template::spec::{self, CopySource};

impl Builds {
    /// Runs one step in a sandbox of its own over `stack`; returns the layer it made (None when it
    /// changed no file). The sandbox is removed whatever happens.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_step(
        &self,
        live: &LiveBuild,
        rec: &BuildRecord,
        index: u32,
        spec: &TemplateSpec,
        step: &BuildStep,
        stack: &Stack,
        state: &StepState,
        copy: Option<&CopySource>,
        key: &str,
    ) -> Result<Option<(String, u64)>, String> {
        let mut bare = stack.clone();
        bare.env = state.env.clone();
        bare.runtime = TemplateConfig::default();
        let sbx = self
            .build_sandbox(&rec.id, &rec.template, index, spec, bare)
            .await
            .map_err(|e| e.to_string())?;
        let result = self
            .step_in(live, index, spec, step, &sbx, state, copy, key)
            .await;
        self.destroy_quietly(sbx).await;
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn step_in(
        &self,
        live: &LiveBuild,
        index: u32,
        spec: &TemplateSpec,
        step: &BuildStep,
        sbx: &SandboxRecord,
        state: &StepState,
        copy: Option<&CopySource>,
        key: &str,
    ) -> Result<Option<(String, u64)>, String> {
        let agent = self.agent(&sbx.id).await.map_err(|e| e.to_string())?;
        let timeout = spec.build.step_timeout.unwrap_or(DEFAULT_STEP_TIMEOUT) as f64;
        // The network the step needs: its registry, or what the spec allows `run` steps.
        if sbx.network.is_some() {
            let apt_hosts = match step {
                BuildStep::Apt(_) if self.settings.registries.apt_sources.is_empty() => {
                    let mut text = String::new();
                    let req = StartProcessRequest {
                        command: Some(
                            "cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null; true".into(),
                        ),
                        user: Some("root".into()),
                        timeout: Some(30.0),
                        ..Default::default()
                    };
                    agent
                        .run_streamed(&req, |ev| {
                            if let ProcessEvent::Stdout(c) = ev {
                                text.push_str(&String::from_utf8_lossy(
                                    &crate::agent::chunk_bytes(c),
                                ));
                            }
                        })
                        .await
                        .map_err(|e| format!("read the image's apt sources: {e:#}"))?;
                    spec::apt_source_hosts(&text)
                }
                BuildStep::Apt(_) => self
                    .settings
                    .registries
                    .apt_sources
                    .iter()
                    .flat_map(|l| spec::apt_source_hosts(l))
                    .collect(),
                _ => Vec::new(),
            };
            let allow_out = spec::step_allow_out(step, spec, &self.settings.registries, &apt_hosts);
            if !allow_out.is_empty() {
                live.log(index, format!("[moat] network: {}", allow_out.join(" ")));
                let policy = moat_api::NetworkPolicy {
                    allow_internet: false,
                    allow_out,
                    ..Default::default()
                };
                self.set_network(&sbx.id, policy)
                    .await
                    .map_err(|e| format!("network policy: {e}"))?;
            }
        } else if matches!(
            step,
            BuildStep::Apt(_) | BuildStep::Pip(_) | BuildStep::Npm(_)
        ) {
            live.log(
                index,
                "[moat] note: this daemon runs sandboxes without networking (--network none): the step cannot reach a package registry",
            );
        }
        let mut lines = Lines::default();
        let out = Logged {
            agent: &agent,
            live,
            index,
            timeout,
        };
        let mut env = state.env.clone();
        env.extend(spec::step_env(step, &self.settings.registries));
        match step {
            BuildStep::Run(cmd) => {
                out.run(
                    &mut lines,
                    StartProcessRequest {
                        command: Some(cmd.clone()),
                        user: state.user.clone().or(Some("root".into())),
                        cwd: state.workdir.clone(),
                        env,
                        timeout: Some(timeout),
                        ..Default::default()
                    },
                )
                .await?
            }
            BuildStep::Copy(c) => {
                let cs = copy.ok_or("the copy source is missing")?;
                let body = tokio::fs::read(&cs.tar)
                    .await
                    .map_err(|e| format!("read {}: {e}", cs.tar.display()))?;
                agent
                    .upload_tar(&cs.dir, axum::body::Body::from(body))
                    .await
                    .map_err(|e| format!("unpacking into {} failed: {e}", cs.dir))?;
                live.log(index, format!("[moat] copied {} to {}", c.src, c.dest));
                if let Some(owner) = &c.owner {
                    let target = if c.dest.ends_with('/') {
                        format!(
                            "{}/{}",
                            c.dest.trim_end_matches('/'),
                            c.src.trim_end_matches('/').rsplit('/').next().unwrap_or("")
                        )
                    } else {
                        c.dest.clone()
                    };
                    out.run(
                        &mut lines,
                        StartProcessRequest {
                            cmd: Some(vec!["chown".into(), "-R".into(), owner.clone(), target]),
                            user: Some("root".into()),
                            timeout: Some(timeout),
                            ..Default::default()
                        },
                    )
                    .await?
                }
            }
            _ => {
                let script = spec::root_script(step, &self.settings.registries)
                    .ok_or("this step runs no command")?;
                out.run(
                    &mut lines,
                    StartProcessRequest {
                        cmd: Some(vec!["/bin/sh".into(), "-c".into(), script]),
                        user: Some("root".into()),
                        env,
                        timeout: Some(timeout),
                        ..Default::default()
                    },
                )
                .await?
            }
        }
        // What the step changed, as a layer.
        let tier = self.tier(sbx.isolation).map_err(|e| e.to_string())?;
        let state_json = sbx.tier_state.clone().unwrap_or_default();
        let scratch = self.layers.scratch().map_err(|e| format!("{e:#}"))?;
        if let Err(e) = tier.export_changes(&sbx.id, &state_json, &scratch).await {
            let _ = crate::host::mount::remove_unmounted_tree(&scratch);
            return Err(format!("taking the step's changes: {e:#}"));
        }
        // The mount point of the sandbox's OOM counter (container tier) is the daemon's, not the
        // step's: it stays out of the layer.
        drop_own_mountpoints(&scratch);
        let empty = std::fs::read_dir(&scratch)
            .map(|mut d| d.next().is_none())
            .unwrap_or(false);
        if empty {
            let _ = std::fs::remove_dir(&scratch);
            self.db
                .cache_put(key, None, 0, now_ms())
                .map_err(|e| format!("{e:#}"))?;
            live.log(index, "[moat] the step changed no file");
            return Ok(None);
        }
        let (digest, size) = self
            .commit_layer(scratch, key)
            .await
            .map_err(|e| format!("store the step's layer: {e:#}"))?;
        Ok(Some((digest, size)))
    }

    /// Starts a sandbox of a build over `stack` (a step's, or the finished template's for the start
    /// check, whose start command runs as in any sandbox of the template).
    pub(super) async fn build_sandbox(
        &self,
        build: &str,
        template: &str,
        index: u32,
        spec: &TemplateSpec,
        stack: Stack,
    ) -> Result<SandboxRecord, Error> {
        let isolation = spec
            .build
            .isolation
            .unwrap_or(self.settings.default_isolation);
        let tier = self.tier(isolation)?;
        let root = stack.root.clone();
        let rootfs = self.root_path(template, root.as_deref()).await?;
        let mut req = CreateSandboxRequest {
            cpu: spec.build.cpu.map(|c| c.min(self.host.cpus)),
            memory_mb: spec.build.memory_mb,
            ..Default::default()
        };
        if req.memory_mb.is_none() {
            // Package installs need more than a default sandbox often has.
            req.memory_mb = Some(
                self.settings
                    .default_limits
                    .memory_mb
                    .max(1024)
                    .min(self.host.memory_mb),
            );
        }
        self.validate(&req)?;
        let limits = self.limits_for(&req);
        self.validate_limits(&limits)?;
        let step_timeout = spec.build.step_timeout.unwrap_or(DEFAULT_STEP_TIMEOUT);
        let now = now_ms();
        let mut metadata = BTreeMap::new();
        metadata.insert(BUILD_LABEL.to_string(), build.to_string());
        metadata.insert("moat.build-step".to_string(), index.to_string());
        let network = self.networking(isolation).then(|| moat_api::NetworkPolicy {
            allow_internet: false,
            ..Default::default()
        });
        let claim = Claim {
            template: template.to_string(),
            created_at_ms: now,
            expires_at_ms: now + 1000 * (step_timeout as i64 + 600),
            metadata,
            env: stack.env.clone(),
            cpu: limits.cpu,
            memory_mb: limits.memory_mb,
            limits,
            on_timeout: moat_api::OnTimeout::Kill,
            network,
            public_traffic: false,
            auto_resume: false,
        };
        let rec = self.new_record(claim, isolation, None, stack);
        self.start_new(rec, tier, rootfs).await
    }

    pub(super) async fn destroy_quietly(&self, rec: SandboxRecord) {
        let id = rec.id.clone();
        if let Err(e) = self.destroy(rec).await {
            tracing::warn!(sandbox = %id, "remove a build sandbox: {e:#}");
        }
    }
}

/// Removes `run/moat` (where the container tier mounts the sandbox's OOM counter) from a step's
/// changes, and `run` with it when that leaves it empty.
fn drop_own_mountpoints(layer: &std::path::Path) {
    let run = layer.join("run");
    if std::fs::symlink_metadata(run.join("moat")).is_ok_and(|m| m.is_dir()) {
        let _ = std::fs::remove_dir_all(run.join("moat"));
        let _ = std::fs::remove_dir(&run);
    }
}

/// Runs a step's process and logs its output lines under the step.
struct Logged<'a> {
    agent: &'a crate::agent::AgentClient,
    live: &'a LiveBuild,
    index: u32,
    timeout: f64,
}

impl Logged<'_> {
    async fn run(&self, lines: &mut Lines, req: StartProcessRequest) -> Result<(), String> {
        let (live, index) = (self.live, self.index);
        let exit = self
            .agent
            .run_streamed(&req, |ev| {
                let (s, c) = match ev {
                    ProcessEvent::Stdout(c) => (0, c),
                    ProcessEvent::Stderr(c) => (1, c),
                    _ => return,
                };
                lines.push(s, &crate::agent::chunk_bytes(c), &mut |l| {
                    live.log(index, l)
                });
            })
            .await
            .map_err(|e| format!("{e:#}"))?;
        lines.flush(&mut |l| live.log(index, l));
        if exit.exit_code == Some(0) {
            return Ok(());
        }
        let how = if exit.timed_out {
            format!("it ran past the step timeout ({} s)", self.timeout)
        } else if let Some(err) = &exit.error {
            err.clone()
        } else if let Some(r) = &exit.reason {
            format!("{r} ({})", exit.signal.clone().unwrap_or_default())
        } else if let Some(s) = &exit.signal {
            format!("killed by {s}")
        } else {
            format!("exit code {}", exit.exit_code.unwrap_or(-1))
        };
        Err(format!("{how}; last output:\n{}", lines.tail()))
    }
}
