//! Code interpreter endpoints: run cells with rich results, manage contexts.

use moat_api::{
    CodeContext, CodeContextList, CodeEvent, CodeLanguage, CreateCodeContextRequest, RunCodeRequest,
};
use reqwest::Method;

use crate::{ndjson_response, Client, EventStream, Result};

impl Client {
    /// `POST /v1/sandboxes/{id}/code`: the cell's events as they happen (`end` last).
    pub async fn run_code(&self, id: &str, req: &RunCodeRequest) -> Result<EventStream<CodeEvent>> {
        let resp = self
            .send(
                self.request(Method::POST, &["v1", "sandboxes", id, "code"])
                    .json(req),
            )
            .await?;
        Ok(ndjson_response(resp))
    }

    /// `POST /v1/sandboxes/{id}/code/contexts`
    pub async fn create_code_context(
        &self,
        id: &str,
        language: CodeLanguage,
        cwd: Option<&str>,
    ) -> Result<CodeContext> {
        let req = CreateCodeContextRequest {
            language: Some(language),
            cwd: cwd.map(str::to_string),
        };
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "code", "contexts"])
                .json(&req),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/code/contexts`
    pub async fn list_code_contexts(&self, id: &str) -> Result<Vec<CodeContext>> {
        let list: CodeContextList = self
            .send_json(self.request(Method::GET, &["v1", "sandboxes", id, "code", "contexts"]))
            .await?;
        Ok(list.contexts)
    }

    /// `POST /v1/sandboxes/{id}/code/contexts/{ctx}/restart`: same context, fresh state.
    pub async fn restart_code_context(&self, id: &str, ctx: &str) -> Result<CodeContext> {
        self.send_json(self.request(
            Method::POST,
            &["v1", "sandboxes", id, "code", "contexts", ctx, "restart"],
        ))
        .await
    }

    /// `DELETE /v1/sandboxes/{id}/code/contexts/{ctx}`
    pub async fn delete_code_context(&self, id: &str, ctx: &str) -> Result<()> {
        self.send_empty(self.request(
            Method::DELETE,
            &["v1", "sandboxes", id, "code", "contexts", ctx],
        ))
        .await
    }
}
