//! Template endpoints.

use moat_api::{
    Build, BuildEvent, BuildList, BuildRequest, PruneResult, RegisterTemplateRequest, Template,
    TemplateList, TemplateSpec,
};
use reqwest::Method;

use crate::{ndjson_response, Client, EventStream, Result};

impl Client {
    /// `GET /v1/templates`
    pub async fn list_templates(&self) -> Result<Vec<Template>> {
        let list: TemplateList = self
            .send_json(self.request(Method::GET, &["v1", "templates"]))
            .await?;
        Ok(list.templates)
    }

    /// `GET /v1/templates/{name}`
    pub async fn get_template(&self, name: &str) -> Result<Template> {
        self.send_json(self.request(Method::GET, &["v1", "templates", name]))
            .await
    }

    /// `POST /v1/templates`: register a root filesystem directory or tarball on the daemon's host.
    pub async fn register_template(&self, req: &RegisterTemplateRequest) -> Result<Template> {
        self.send_json(self.request(Method::POST, &["v1", "templates"]).json(req))
            .await
    }

    /// `POST /v1/templates/{name}/pull`: a template from an image in an OCI registry.
    pub async fn pull_template(
        &self,
        name: &str,
        req: &moat_api::PullTemplateRequest,
    ) -> Result<Template> {
        self.send_json(
            self.request(Method::POST, &["v1", "templates", name, "pull"])
                .json(req),
        )
        .await
    }

    /// `POST /v1/templates/{name}/build`: progress and log events, then `done` or `failed`.
    pub async fn build_template(&self, name: &str) -> Result<EventStream<BuildEvent>> {
        let resp = self
            .send(self.request(Method::POST, &["v1", "templates", name, "build"]))
            .await?;
        Ok(ndjson_response(resp))
    }

    /// `POST /v1/templates/{name}/build` with a spec and no build context (no `copy` steps).
    pub async fn build_template_spec(
        &self,
        name: &str,
        spec: &TemplateSpec,
        no_cache: bool,
    ) -> Result<EventStream<BuildEvent>> {
        let req = BuildRequest {
            spec: spec.clone(),
            no_cache,
        };
        let resp = self
            .send(
                self.request(Method::POST, &["v1", "templates", name, "build"])
                    .json(&req),
            )
            .await?;
        Ok(ndjson_response(resp))
    }

    /// `POST /v1/templates/{name}/build` with a build context: a tar holding the spec (at `spec`,
    /// `moat.toml` when None) and the files its `copy` steps take (see [`crate::context_tar`]).
    pub async fn build_template_context(
        &self,
        name: &str,
        context: Vec<u8>,
        spec: Option<&str>,
        no_cache: bool,
    ) -> Result<EventStream<BuildEvent>> {
        let mut req = self
            .request(Method::POST, &["v1", "templates", name, "build"])
            .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
            .body(context);
        let mut query: Vec<(&str, &str)> = Vec::new();
        if no_cache {
            query.push(("no_cache", "true"));
        }
        if let Some(s) = spec {
            query.push(("spec", s));
        }
        if !query.is_empty() {
            req = req.query(&query);
        }
        let resp = self.send(req).await?;
        Ok(ndjson_response(resp))
    }

    /// `GET /v1/builds`, newest first.
    pub async fn list_builds(&self, template: Option<&str>, limit: u32) -> Result<Vec<Build>> {
        let mut req = self
            .request(Method::GET, &["v1", "builds"])
            .query(&[("limit", limit.to_string())]);
        if let Some(t) = template {
            req = req.query(&[("template", t)]);
        }
        let list: BuildList = self.send_json(req).await?;
        Ok(list.builds)
    }

    /// `GET /v1/builds/{id}`
    pub async fn get_build(&self, id: &str) -> Result<Build> {
        self.send_json(self.request(Method::GET, &["v1", "builds", id]))
            .await
    }

    /// `GET /v1/builds/{id}/events`: every event from the build's start, following a running build.
    pub async fn build_events(&self, id: &str) -> Result<EventStream<BuildEvent>> {
        let resp = self
            .send(self.request(Method::GET, &["v1", "builds", id, "events"]))
            .await?;
        Ok(ndjson_response(resp))
    }

    /// `POST /v1/builds/{id}/cancel`
    pub async fn cancel_build(&self, id: &str) -> Result<Build> {
        self.send_json(self.request(Method::POST, &["v1", "builds", id, "cancel"]))
            .await
    }

    /// `DELETE /v1/build-cache`
    pub async fn prune_build_cache(&self) -> Result<PruneResult> {
        self.send_json(self.request(Method::DELETE, &["v1", "build-cache"]))
            .await
    }

    /// `DELETE /v1/templates/{name}`
    pub async fn delete_template(&self, name: &str) -> Result<()> {
        self.send_empty(self.request(Method::DELETE, &["v1", "templates", name]))
            .await
    }
}

/// A build context: a tar with `spec_text` at `moat.toml` and each path the spec's `copy` steps read
/// from `dir` (files, directories and symlinks as they are; symlinks are not followed).
pub fn context_tar(
    dir: &std::path::Path,
    spec_text: &str,
    spec: &TemplateSpec,
) -> std::io::Result<Vec<u8>> {
    let mut b = tar::Builder::new(Vec::new());
    b.follow_symlinks(false);
    let mut h = tar::Header::new_gnu();
    h.set_size(spec_text.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append_data(&mut h, moat_api::SPEC_FILE, spec_text.as_bytes())?;
    let mut seen = std::collections::HashSet::new();
    for src in spec.context_paths() {
        let rel = src.trim_end_matches('/');
        let rel = rel.strip_prefix("./").unwrap_or(rel);
        if !seen.insert(rel.to_string()) {
            continue;
        }
        moat_api::check_context_path(rel)
            .map_err(|m| std::io::Error::new(std::io::ErrorKind::InvalidInput, m))?;
        let path = dir.join(rel);
        let meta = std::fs::symlink_metadata(&path).map_err(|e| {
            std::io::Error::new(e.kind(), format!("copy source {}: {e}", path.display()))
        })?;
        if meta.is_dir() {
            b.append_dir_all(rel, &path)?;
        } else {
            b.append_path_with_name(&path, rel)?;
        }
    }
    b.into_inner()
}
