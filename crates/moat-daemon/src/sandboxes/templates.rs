//! Template operations as the fronts see them: list, look up, register a root filesystem or image
//! from this host, pull from a registry, build `base` or `code-interpreter` with debootstrap, and
//! delete (draining the warm pool of the template first). Spec builds are [`super::Builds`].

use std::sync::Arc;

use moat_api::{BuildEvent, PullTemplateRequest, Template};
use tokio::sync::mpsc;

use super::core::{detached, Core};
use super::pool::Pool;
use crate::error::Error;
use crate::template::store::to_api;

pub struct Templates {
    core: Arc<Core>,
    pool: Arc<Pool>,
}

impl Templates {
    pub(super) fn new(core: Arc<Core>, pool: Arc<Pool>) -> Templates {
        Templates { core, pool }
    }

    pub fn list(&self) -> Result<Vec<Template>, Error> {
        Ok(self.core.db.list_templates()?.iter().map(to_api).collect())
    }

    /// One template: 404 naming `name` when there is none.
    pub fn get(&self, name: &str) -> Result<Template, Error> {
        self.core.templates.get(&self.core.db, name)
    }

    /// Whether a template of this name exists (in any state).
    pub fn exists(&self, name: &str) -> bool {
        matches!(self.core.db.get_template(name), Ok(Some(_)))
    }

    /// Registers a root filesystem directory or tarball, an OCI image layout or a `docker save`
    /// archive on this host as template `name`.
    pub async fn register(self: &Arc<Self>, name: &str, path: &str) -> Result<Template, Error> {
        self.core.check_disk()?;
        let (this, name, path) = (self.clone(), name.to_string(), path.to_string());
        detached(async move {
            this.core
                .templates
                .register(&this.core.db, &name, &path)
                .await
        })
        .await
    }

    /// Makes template `name` from an image in an OCI registry.
    pub async fn pull(
        self: &Arc<Self>,
        name: &str,
        req: &PullTemplateRequest,
    ) -> Result<Template, Error> {
        self.core.check_disk()?;
        let (this, name, req) = (self.clone(), name.to_string(), req.clone());
        detached(async move { this.core.templates.pull(&this.core.db, &name, &req).await }).await
    }

    /// Builds `name` (`base`, `code-interpreter`) from Debian packages, with progress on `events`.
    pub async fn build(
        &self,
        name: &str,
        events: mpsc::Sender<BuildEvent>,
    ) -> Result<Template, Error> {
        self.core.check_disk()?;
        self.core.templates.build(&self.core.db, name, events).await
    }

    /// Removes a template no sandbox uses: its pooled sandboxes go first, and a spec-built
    /// template's layers unless the build cache or others hold them.
    pub async fn delete(self: &Arc<Self>, name: &str) -> Result<(), Error> {
        let (this, name) = (self.clone(), name.to_string());
        detached(async move { this.delete_now(&name).await }).await
    }

    async fn delete_now(&self, name: &str) -> Result<(), Error> {
        self.pool.drain(name).await?;
        let removed = self.core.templates.remove(&self.core.db, name);
        self.pool.resume();
        removed?;
        self.core.gc_layers();
        Ok(())
    }
}
