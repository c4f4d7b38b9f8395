//! Template endpoints.

use moat_api::{BuildEvent, RegisterTemplateRequest, Template, TemplateList};
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

    /// `DELETE /v1/templates/{name}`
    pub async fn delete_template(&self, name: &str) -> Result<()> {
        self.send_empty(self.request(Method::DELETE, &["v1", "templates", name]))
            .await
    }
}
