//! Filesystem endpoints. Paths are inside the sandbox (absolute, or relative to `/root`).

use moat_api::{
    DirListing, EntryInfo, ExistsResponse, FsEvent, MkdirRequest, MkdirResponse, RenameRequest,
};
use reqwest::Method;

use crate::{byte_response, ndjson_response, ByteStream, Client, EventStream, Result};

/// Options of [`Client::write_file`].
#[derive(Debug, Clone, Default)]
pub struct WriteOptions {
    /// Octal permission bits such as `644` or `0755`.
    pub mode: Option<String>,
    /// Owner of the file and created parents (name or uid).
    pub user: Option<String>,
}

impl Client {
    /// `GET .../files?path=`: the file's bytes as they arrive.
    pub async fn read_file(&self, id: &str, path: &str) -> Result<ByteStream> {
        let resp = self
            .send(
                self.request(Method::GET, &["v1", "sandboxes", id, "files"])
                    .query(&[("path", path)]),
            )
            .await?;
        Ok(byte_response(resp))
    }

    /// `PUT .../files?path=&mode=&user=`: writes (atomically replaces) a file. Pass a streamed
    /// `reqwest::Body` (e.g. `Body::wrap_stream(ReaderStream::new(file))`) for large files.
    pub async fn write_file(
        &self,
        id: &str,
        path: &str,
        body: impl Into<reqwest::Body>,
        opts: &WriteOptions,
    ) -> Result<EntryInfo> {
        let mut query = vec![("path", path)];
        if let Some(mode) = &opts.mode {
            query.push(("mode", mode));
        }
        if let Some(user) = &opts.user {
            query.push(("user", user));
        }
        self.send_json(
            self.request(Method::PUT, &["v1", "sandboxes", id, "files"])
                .query(&query)
                .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
                .body(body),
        )
        .await
    }

    /// `GET .../fs/stat?path=`
    pub async fn stat(&self, id: &str, path: &str) -> Result<EntryInfo> {
        self.send_json(
            self.request(Method::GET, &["v1", "sandboxes", id, "fs", "stat"])
                .query(&[("path", path)]),
        )
        .await
    }

    /// `GET .../fs/exists?path=`
    pub async fn exists(&self, id: &str, path: &str) -> Result<bool> {
        let r: ExistsResponse = self
            .send_json(
                self.request(Method::GET, &["v1", "sandboxes", id, "fs", "exists"])
                    .query(&[("path", path)]),
            )
            .await?;
        Ok(r.exists)
    }

    /// `GET .../fs/list?path=&depth=`
    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        depth: Option<u32>,
    ) -> Result<Vec<EntryInfo>> {
        let mut req = self
            .request(Method::GET, &["v1", "sandboxes", id, "fs", "list"])
            .query(&[("path", path)]);
        if let Some(depth) = depth {
            req = req.query(&[("depth", depth)]);
        }
        let listing: DirListing = self.send_json(req).await?;
        Ok(listing.entries)
    }

    /// `POST .../fs/mkdir` (like `mkdir -p`).
    pub async fn mkdir(&self, id: &str, req: &MkdirRequest) -> Result<MkdirResponse> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "fs", "mkdir"])
                .json(req),
        )
        .await
    }

    /// `POST .../fs/rename`
    pub async fn rename(&self, id: &str, from: &str, to: &str) -> Result<EntryInfo> {
        self.send_json(
            self.request(Method::POST, &["v1", "sandboxes", id, "fs", "rename"])
                .json(&RenameRequest {
                    from: from.to_string(),
                    to: to.to_string(),
                }),
        )
        .await
    }

    /// `DELETE .../fs?path=&recursive=`
    pub async fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<()> {
        let mut req = self
            .request(Method::DELETE, &["v1", "sandboxes", id, "fs"])
            .query(&[("path", path)]);
        if recursive {
            req = req.query(&[("recursive", "true")]);
        }
        self.send_empty(req).await
    }

    /// `GET .../fs/tar?path=`: a tar archive of a directory (entries relative to it) or one file.
    pub async fn download_tar(&self, id: &str, path: &str) -> Result<ByteStream> {
        let resp = self
            .send(
                self.request(Method::GET, &["v1", "sandboxes", id, "fs", "tar"])
                    .query(&[("path", path)]),
            )
            .await?;
        Ok(byte_response(resp))
    }

    /// `PUT .../fs/tar?path=`: extracts a tar archive into the directory `path`.
    pub async fn upload_tar(
        &self,
        id: &str,
        path: &str,
        body: impl Into<reqwest::Body>,
    ) -> Result<()> {
        self.send_empty(
            self.request(Method::PUT, &["v1", "sandboxes", id, "fs", "tar"])
                .query(&[("path", path)])
                .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
                .body(body),
        )
        .await
    }

    /// `GET .../fs/watch?path=&recursive=`: filesystem events as they happen.
    pub async fn watch(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<EventStream<FsEvent>> {
        let resp = self
            .send(
                self.request(Method::GET, &["v1", "sandboxes", id, "fs", "watch"])
                    .query(&[("path", path)])
                    .query(&[("recursive", recursive)]),
            )
            .await?;
        Ok(ndjson_response(resp))
    }
}
