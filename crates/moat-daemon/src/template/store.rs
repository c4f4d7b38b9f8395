//! The template store: `<data_dir>/templates/<name>/rootfs`, with each template's status in the database.
//!
//! A template is built or imported into a staging directory and renamed into place only when complete,
//! so a crash never leaves a half-built template that looks ready.

use std::path::{Path, PathBuf};

use anyhow::Context;
use moat_api::{BuildEvent, Template, TemplateSource, TemplateStatus};
use tokio::sync::mpsc;

use super::{debootstrap, import, oci};
use crate::clock::rfc3339;
use crate::db::{Db, TemplateRecord};
use crate::error::Error;

pub struct TemplateStore {
    dir: PathBuf,
    cache_dir: PathBuf,
    /// One build or import at a time: they are disk- and network-heavy, and two builds of the same
    /// template must not race.
    build_lock: tokio::sync::Mutex<()>,
}

pub fn to_api(r: &TemplateRecord) -> Template {
    Template {
        name: r.name.clone(),
        source: r.source,
        status: r.status,
        size_bytes: r.size_bytes,
        created_at: rfc3339(r.created_at_ms),
        error: r.error.clone(),
        from: r.from_desc.clone(),
        layers: r.layers.clone(),
        config: r.config.clone(),
        build_id: r.build_id.clone(),
    }
}

/// The one template moat knows how to build from scratch.
pub const BASE: &str = "base";

impl TemplateStore {
    pub fn new(data_dir: &Path) -> anyhow::Result<TemplateStore> {
        let dir = data_dir.join("templates");
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        Ok(TemplateStore {
            dir,
            cache_dir: data_dir.join("cache").join("debootstrap"),
            build_lock: tokio::sync::Mutex::new(()),
        })
    }

    pub fn rootfs(&self, name: &str) -> PathBuf {
        self.dir.join(name).join("rootfs")
    }

    fn staging(&self, name: &str) -> PathBuf {
        self.dir.join(format!(".{name}.staging"))
    }

    /// Marks templates that were building when the daemon died as failed and removes staging dirs.
    pub fn recover(&self, db: &Db) -> anyhow::Result<()> {
        for t in db.list_templates()? {
            if t.status == TemplateStatus::Building {
                db.upsert_template(&TemplateRecord {
                    status: TemplateStatus::Failed,
                    error: Some("the daemon stopped during the build".into()),
                    ..t
                })?;
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().ends_with(".staging") {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        Ok(())
    }

    pub fn get(&self, db: &Db, name: &str) -> Result<Template, Error> {
        moat_api::validate_template_name(name).map_err(|m| Error::invalid("name", m))?;
        db.get_template(name)?
            .map(|r| to_api(&r))
            .ok_or_else(|| Error::not_found("name", format!("template {name} not found")))
    }

    /// A ready template; the `base` template is built on first use.
    pub async fn ensure(&self, db: &Db, name: &str) -> Result<TemplateRecord, Error> {
        match db.get_template(name)? {
            Some(t) if t.status == TemplateStatus::Ready => Ok(t),
            Some(t) if t.status == TemplateStatus::Building => Err(Error::conflict(format!(
                "template {name} is still building"
            ))),
            _ if name == BASE => {
                tracing::info!("building the base template on first use");
                let (tx, mut rx) = mpsc::channel(64);
                let drain = tokio::spawn(async move { while rx.recv().await.is_some() {} });
                let r = self.build(db, name, tx).await;
                drain.abort();
                r?;
                db.get_template(name)?
                    .ok_or_else(|| Error::internal(format!("template {name} vanished")))
            }
            Some(t) => Err(Error::conflict(format!(
                "template {name} is not ready ({})",
                t.error.unwrap_or_else(|| "failed".into())
            ))),
            None => Err(Error::not_found(
                "template",
                format!("template {name} not found"),
            )),
        }
    }

    /// Builds `name` from Debian packages with debootstrap, reporting progress on `events`.
    pub async fn build(
        &self,
        db: &Db,
        name: &str,
        events: mpsc::Sender<BuildEvent>,
    ) -> Result<Template, Error> {
        moat_api::validate_template_name(name).map_err(|m| Error::invalid("name", m))?;
        let _guard = self.build_lock.lock().await;
        if let Some(t) = db.get_template(name)? {
            if t.status == TemplateStatus::Ready && name == BASE {
                let _ = events
                    .send(BuildEvent::Log {
                        line: format!("template {name} is already built"),
                        step: None,
                    })
                    .await;
                return Ok(to_api(&t));
            }
            if t.source == TemplateSource::Spec && t.status != TemplateStatus::Building {
                return Err(Error::invalid(
                    "spec",
                    format!("template {name} is built from a spec; build it with its spec (moat template build {name} -f moat.toml)"),
                ));
            }
            if t.source != TemplateSource::Debootstrap && t.status == TemplateStatus::Ready {
                return Err(Error::conflict(format!(
                    "template {name} was imported; remove it before building"
                )));
            }
        }
        let users = db.template_users(name)?;
        if users > 0 {
            return Err(Error::conflict(format!(
                "template {name} is used by {users} sandbox(es), snapshot(s) or template(s); remove them first"
            )));
        }
        let mut opts = debootstrap::DebootstrapOptions::from_host(self.cache_dir.clone())?;
        opts.packages.extend(
            debootstrap::template_packages(name)
                .iter()
                .map(|p| p.to_string()),
        );
        self.produce(db, name, TemplateSource::Debootstrap, |target| {
            let events = events.clone();
            async move { debootstrap::build(&opts, &target, &events).await }
        })
        .await
    }

    /// Registers a root filesystem directory or tarball from the host as template `name`.
    pub async fn register(&self, db: &Db, name: &str, path: &str) -> Result<Template, Error> {
        moat_api::validate_template_name(name).map_err(|m| Error::invalid("name", m))?;
        let src = PathBuf::from(path);
        if !src.is_absolute() {
            return Err(Error::invalid(
                "path",
                format!("path {path:?} must be absolute"),
            ));
        }
        let meta =
            std::fs::metadata(&src).map_err(|e| Error::invalid("path", format!("{path}: {e}")))?;
        let _guard = self.build_lock.lock().await;
        if db.get_template(name)?.is_some() {
            return Err(Error::conflict(format!("template {name} exists already")));
        }
        let image = {
            let src = src.clone();
            tokio::task::spawn_blocking(move || oci::detect(&src))
                .await
                .map_err(|e| Error::internal(format!("inspect {path}: {e}")))?
                .map_err(|e| Error::invalid("path", format!("{e:#}")))?
        };
        let source = match (image, meta.is_dir()) {
            (Some(_), _) => TemplateSource::Image,
            (None, true) => TemplateSource::Directory,
            (None, false) => TemplateSource::Tarball,
        };
        self.produce(db, name, source, |target| async move {
            match source {
                TemplateSource::Image => {
                    let work = target.with_file_name("work");
                    let r = tokio::task::spawn_blocking(move || {
                        std::fs::create_dir_all(&work)?;
                        let r = oci::import_archive(&src, &target, &work);
                        let _ = std::fs::remove_dir_all(&work);
                        r
                    })
                    .await?;
                    r
                }
                TemplateSource::Directory => import::import_directory(&src, &target).await,
                _ => import::import_tarball(&src, &target).await,
            }
        })
        .await
    }

    /// Makes template `name` from an image pulled from an OCI registry.
    pub async fn pull(
        &self,
        db: &Db,
        name: &str,
        req: &moat_api::PullTemplateRequest,
    ) -> Result<Template, Error> {
        moat_api::validate_template_name(name).map_err(|m| Error::invalid("name", m))?;
        oci::ImageRef::parse(&req.image).map_err(|e| Error::invalid("image", format!("{e:#}")))?;
        if req.username.is_some() != req.password.is_some() {
            return Err(Error::invalid(
                if req.username.is_some() {
                    "password"
                } else {
                    "username"
                },
                "username and password go together",
            ));
        }
        let _guard = self.build_lock.lock().await;
        if db.get_template(name)?.is_some() {
            return Err(Error::conflict(format!("template {name} exists already")));
        }
        let opts = oci::PullOptions {
            username: req.username.clone(),
            password: req.password.clone(),
            insecure: req.insecure,
        };
        let image = req.image.clone();
        self.produce(db, name, TemplateSource::Image, |target| async move {
            let work = target.with_file_name("work");
            std::fs::create_dir_all(&work)?;
            let r = oci::pull(&image, &opts, &target, &work).await;
            let _ = std::fs::remove_dir_all(&work);
            r
        })
        .await
    }

    async fn produce<F, Fut>(
        &self,
        db: &Db,
        name: &str,
        source: TemplateSource,
        make: F,
    ) -> Result<Template, Error>
    where
        F: FnOnce(PathBuf) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>>,
    {
        let mut rec = TemplateRecord::plain(name, source, TemplateStatus::Building);
        db.upsert_template(&rec)?;
        let staging = self.staging(name);
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).context("mkdir staging")?;
        let rootfs = staging.join("rootfs");
        match make(rootfs.clone()).await {
            Ok(()) => {
                rec.size_bytes = import::disk_usage(&rootfs).unwrap_or(0);
                let final_dir = self.dir.join(name);
                let _ = std::fs::remove_dir_all(&final_dir);
                std::fs::rename(&staging, &final_dir).context("move template into place")?;
                rec.status = TemplateStatus::Ready;
                db.upsert_template(&rec)?;
                tracing::info!(template = name, bytes = rec.size_bytes, "template ready");
                Ok(to_api(&rec))
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                rec.status = TemplateStatus::Failed;
                rec.error = Some(format!("{e:#}"));
                db.upsert_template(&rec)?;
                Err(Error::Internal(e.context(format!("template {name}"))))
            }
        }
    }

    /// Removes a template no sandbox uses (a spec-built template's layers go with the next layer
    /// collection, unless the build cache or others hold them).
    pub fn remove(&self, db: &Db, name: &str) -> Result<(), Error> {
        self.get(db, name)?;
        let users = db.template_users(name)?;
        if users > 0 {
            return Err(Error::conflict(format!(
                "template {name} is used by {users} sandbox(es), snapshot(s) or template(s)"
            )));
        }
        let dir = self.dir.join(name);
        crate::host::mount::remove_unmounted_tree(&dir)?;
        db.delete_template(name)?;
        Ok(())
    }
}
