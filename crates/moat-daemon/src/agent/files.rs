//! File calls: read and write (streamed), stat, exists, list, mkdir, rename, remove, tar both
//! ways, watch. Every path is resolved by the agent inside the sandbox's own root.

use axum::body::Body;
use http::Response;
use hyper::body::Incoming;
use moat_api::protocol::{endpoint, NoQuery};
use moat_api::{
    DirListing, EntryInfo, ListQuery, MkdirRequest, MkdirResponse, PathQuery, RemoveQuery,
    RenameRequest, WatchQuery, WriteQuery,
};

use super::wire::{self, AgentError};
use super::AgentClient;

fn at(path: &str) -> PathQuery {
    PathQuery {
        path: path.to_string(),
    }
}

impl AgentClient {
    /// A file's bytes, streamed.
    pub async fn read_file(&self, path: &str) -> Result<Response<Incoming>, AgentError> {
        self.request::<endpoint::ReadFile>(None, &at(path), None, Body::empty())
            .await
    }

    /// A small file inside the sandbox (a kernel interface file, say) as text; at most `limit`
    /// bytes.
    pub async fn read_text(&self, path: &str, limit: usize) -> Result<String, AgentError> {
        let bytes = wire::read_all(self.read_file(path).await?, limit).await?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Writes a file from `body` (streamed), replacing it atomically.
    pub async fn write_file(
        &self,
        query: &WriteQuery,
        body: Body,
    ) -> Result<EntryInfo, AgentError> {
        let resp = self
            .request::<endpoint::WriteFile>(None, query, Some("application/octet-stream"), body)
            .await?;
        wire::read_json(resp).await
    }

    /// Describes a path (not following a final symlink).
    pub async fn stat(&self, path: &str) -> Result<EntryInfo, AgentError> {
        self.call::<endpoint::Stat>(None, &at(path), &()).await
    }

    /// Whether a path exists.
    pub async fn exists(&self, path: &str) -> Result<bool, AgentError> {
        Ok(self
            .call::<endpoint::Exists>(None, &at(path), &())
            .await?
            .exists)
    }

    /// A directory's entries, `depth` levels down.
    pub async fn list_dir(&self, path: &str, depth: u32) -> Result<DirListing, AgentError> {
        let q = ListQuery {
            path: path.to_string(),
            depth: Some(depth),
        };
        self.call::<endpoint::ListDir>(None, &q, &()).await
    }

    /// Makes a directory and its parents.
    pub async fn mkdir(&self, req: &MkdirRequest) -> Result<MkdirResponse, AgentError> {
        self.call::<endpoint::Mkdir>(None, &NoQuery {}, req).await
    }

    /// Renames or moves a path.
    pub async fn rename(&self, from: &str, to: &str) -> Result<EntryInfo, AgentError> {
        let req = RenameRequest {
            from: from.to_string(),
            to: to.to_string(),
        };
        self.call::<endpoint::Rename>(None, &NoQuery {}, &req).await
    }

    /// Removes a file, or a directory (with its contents when `recursive`).
    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), AgentError> {
        let q = RemoveQuery {
            path: path.to_string(),
            recursive: Some(recursive),
        };
        self.call::<endpoint::Remove>(None, &q, &()).await
    }

    /// Unpacks a tar stream into directory `dir`.
    pub async fn upload_tar(&self, dir: &str, body: Body) -> Result<(), AgentError> {
        let resp = self
            .request::<endpoint::UploadTar>(None, &at(dir), Some("application/x-tar"), body)
            .await?;
        wire::read_json(resp).await
    }

    /// inotify events of a directory as an NDJSON stream of `FsEvent`.
    pub async fn watch(
        &self,
        path: &str,
        recursive: bool,
    ) -> Result<Response<Incoming>, AgentError> {
        let q = WatchQuery {
            path: path.to_string(),
            recursive: Some(recursive),
        };
        self.request::<endpoint::Watch>(None, &q, None, Body::empty())
            .await
    }
}
