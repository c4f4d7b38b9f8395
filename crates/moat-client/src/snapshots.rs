//! Snapshots, forks, reset, pause and resume.

use moat_api::{
    CreateSnapshotRequest, ForkRequest, ForkResponse, PauseResult, ResetRequest, ResumeRequest,
    Sandbox, Snapshot, SnapshotList,
};
use reqwest::Method;

use crate::{Client, Result};

impl Client {
    /// `POST /v1/sandboxes/{id}/snapshots`
    pub async fn create_snapshot(&self, id: &str, req: &CreateSnapshotRequest) -> Result<Snapshot> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "snapshots"])
                .json(req),
        )
        .await
    }

    /// `GET /v1/snapshots`
    pub async fn list_snapshots(&self) -> Result<Vec<Snapshot>> {
        let list: SnapshotList = self
            .send_json(self.request(Method::GET, &["v1", "snapshots"]))
            .await?;
        Ok(list.snapshots)
    }

    /// `GET /v1/snapshots/{id}` (id or name)
    pub async fn get_snapshot(&self, id: &str) -> Result<Snapshot> {
        self.send_json(self.request(Method::GET, &["v1", "snapshots", id]))
            .await
    }

    /// `DELETE /v1/snapshots/{id}` (id or name)
    pub async fn delete_snapshot(&self, id: &str) -> Result<()> {
        self.send_empty(self.request(Method::DELETE, &["v1", "snapshots", id]))
            .await
    }

    /// `POST /v1/snapshots/{id}/fork`: `req.count` new sandboxes from one snapshot.
    pub async fn fork(&self, snapshot: &str, req: &ForkRequest) -> Result<Vec<Sandbox>> {
        let r: ForkResponse = self
            .send_json(
                self.request(Method::POST, &["v1", "snapshots", snapshot, "fork"])
                    .json(req),
            )
            .await?;
        Ok(r.sandboxes)
    }

    /// `POST /v1/sandboxes/{id}/reset`
    pub async fn reset_sandbox(&self, id: &str, req: &ResetRequest) -> Result<Sandbox> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "reset"])
                .json(req),
        )
        .await
    }

    /// `GET /v1/system/df`
    pub async fn disk_usage(&self) -> Result<moat_api::DiskUsage> {
        self.send_json(self.request(Method::GET, &["v1", "system", "df"]))
            .await
    }

    /// `POST /v1/sandboxes/{id}/pause`
    pub async fn pause_sandbox(&self, id: &str) -> Result<PauseResult> {
        self.send_json(self.request(Method::POST, &["v1", "sandboxes", id, "pause"]))
            .await
    }

    /// `POST /v1/sandboxes/{id}/resume`
    pub async fn resume_sandbox(&self, id: &str, req: &ResumeRequest) -> Result<PauseResult> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "resume"])
                .json(req),
        )
        .await
    }
}
