//! Async Rust client for the moat REST API.
//!
//! ```no_run
//! # async fn demo() -> moat_client::Result<()> {
//! use futures::StreamExt;
//! let client = moat_client::Client::from_env()?;
//! let sbx = client.create_sandbox(&Default::default()).await?;
//! let req = moat_api::StartProcessRequest {
//!     cmd: Some(vec!["echo".into(), "hi".into()]),
//!     ..Default::default()
//! };
//! let mut events = client.start_process_stream(&sbx.id, &req).await?;
//! while let Some(ev) = events.next().await {
//!     println!("{:?}", ev?);
//! }
//! client.delete_sandbox(&sbx.id).await?;
//! # Ok(()) }
//! ```

mod audit;
mod code;
mod error;
mod files;
pub mod ndjson;
mod processes;
mod sandboxes;
mod snapshots;
mod templates;

use std::path::{Path, PathBuf};

use reqwest::{Method, RequestBuilder, Response, Url};
use serde::de::DeserializeOwned;

pub use error::{Error, Result};
pub use files::WriteOptions;
pub use ndjson::{ByteStream, EventStream};
pub use processes::{ProcessStart, WsStream};
pub use sandboxes::SandboxFilter;
pub use templates::context_tar;

pub use moat_api as api;

/// Default API address (same as the daemon's `DEFAULT_URL`).
pub const DEFAULT_URL: &str = "http://127.0.0.1:6628";
/// Default daemon data directory, where the API key file lives (same as the daemon's).
pub const DEFAULT_DATA_DIR: &str = "/var/lib/moat";

/// `<data_dir>/api-key`, the file the daemon writes its API key to.
pub fn api_key_path(data_dir: &Path) -> PathBuf {
    data_dir.join("api-key")
}

/// Reads and trims the API key file of `data_dir`.
pub fn read_api_key_file(data_dir: &Path) -> Result<String> {
    let path = api_key_path(data_dir);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::Config(format!(
            "cannot read the API key file {}: {e} (set MOAT_API_KEY or MOAT_DATA_DIR, or pass --api-key)",
            path.display()
        ))
    })?;
    let key = text.trim();
    if key.is_empty() {
        return Err(Error::Config(format!(
            "the API key file {} is empty",
            path.display()
        )));
    }
    Ok(key.to_string())
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// A handle on one moat daemon. Cheap to clone (the connection pool is shared).
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    api_key: String,
}

impl Client {
    /// A client for the daemon at `base_url` (e.g. `http://127.0.0.1:6628`) using `api_key`.
    pub fn new(base_url: &str, api_key: impl Into<String>) -> Result<Client> {
        let base = Url::parse(base_url.trim())
            .map_err(|e| Error::Config(format!("invalid daemon URL {base_url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(Error::Config(format!(
                "invalid daemon URL {base_url:?}: must be http:// or https://"
            )));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()?;
        Ok(Client {
            http,
            base,
            api_key: api_key.into().trim().to_string(),
        })
    }

    /// A client configured from the environment: `MOAT_URL` (default [`DEFAULT_URL`]) and
    /// `MOAT_API_KEY`, else the key file in `MOAT_DATA_DIR` (default [`DEFAULT_DATA_DIR`]).
    pub fn from_env() -> Result<Client> {
        Client::configured(None, None)
    }

    /// Like [`Client::from_env`], but explicit values win over the environment.
    pub fn configured(url: Option<&str>, api_key: Option<&str>) -> Result<Client> {
        let url = url
            .map(str::to_string)
            .or_else(|| non_empty_env("MOAT_URL"))
            .unwrap_or_else(|| DEFAULT_URL.to_string());
        let key = match api_key
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .or_else(|| non_empty_env("MOAT_API_KEY"))
        {
            Some(k) => k,
            None => {
                let dir = non_empty_env("MOAT_DATA_DIR").unwrap_or_else(|| DEFAULT_DATA_DIR.into());
                read_api_key_file(Path::new(&dir))?
            }
        };
        Client::new(&url, key)
    }

    /// The daemon's base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// URL of `segments` below the base URL; each segment is percent-encoded.
    pub(crate) fn url(&self, segments: &[&str]) -> Url {
        build_url(&self.base, segments)
    }

    pub(crate) fn request(&self, method: Method, segments: &[&str]) -> RequestBuilder {
        self.http
            .request(method, self.url(segments))
            .bearer_auth(&self.api_key)
    }

    pub(crate) fn api_key(&self) -> &str {
        &self.api_key
    }

    /// Sends a request; a non-2xx answer becomes [`Error::Api`].
    pub(crate) async fn send(&self, req: RequestBuilder) -> Result<Response> {
        let resp = req.send().await?;
        check(resp).await
    }

    /// Sends a request and decodes its JSON answer.
    pub(crate) async fn send_json<T: DeserializeOwned>(&self, req: RequestBuilder) -> Result<T> {
        let resp = self.send(req).await?;
        let bytes = resp.bytes().await?;
        serde_json::from_slice(&bytes).map_err(|e| Error::Decode(e.to_string()))
    }

    /// Sends a request whose answer has no body (204).
    pub(crate) async fn send_empty(&self, req: RequestBuilder) -> Result<()> {
        self.send(req).await.map(drop)
    }

    /// `GET /healthz`
    pub async fn health(&self) -> Result<moat_api::Health> {
        self.send_json(self.request(Method::GET, &["healthz"]))
            .await
    }
}

/// Turns a non-2xx response into [`Error::Api`].
pub(crate) async fn check(resp: Response) -> Result<Response> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let text = resp.text().await.unwrap_or_default();
    Err(Error::from_response_body(status.as_u16(), &text))
}

pub(crate) fn build_url(base: &Url, segments: &[&str]) -> Url {
    let mut url = base.clone();
    url.set_query(None);
    url.set_fragment(None);
    if let Ok(mut path) = url.path_segments_mut() {
        path.pop_if_empty().extend(segments);
    }
    url
}

/// The `ws://`/`wss://` form of an `http://`/`https://` URL.
pub(crate) fn ws_url(url: &Url) -> Result<Url> {
    let scheme = match url.scheme() {
        "http" => "ws",
        "https" => "wss",
        other => return Err(Error::Config(format!("unsupported URL scheme {other:?}"))),
    };
    // Url::set_scheme refuses special→non-special changes, so rebuild from the string.
    let rest = &url.as_str()[url.scheme().len()..];
    Url::parse(&format!("{scheme}{rest}")).map_err(|e| Error::Config(e.to_string()))
}

/// Decodes a streamed NDJSON response.
pub(crate) fn ndjson_response<T: DeserializeOwned + Send + 'static>(
    resp: Response,
) -> EventStream<T> {
    ndjson::decode(resp.bytes_stream())
}

/// A streamed raw-bytes response.
pub(crate) fn byte_response(resp: Response) -> ByteStream {
    use futures::TryStreamExt;
    Box::pin(resp.bytes_stream().map_err(Error::from))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let c = Client::new("http://127.0.0.1:6628", "k").unwrap();
        assert_eq!(
            c.url(&["v1", "sandboxes", "sbx_1"]).as_str(),
            "http://127.0.0.1:6628/v1/sandboxes/sbx_1"
        );
        let c = Client::new("http://h:1/prefix/", "k").unwrap();
        assert_eq!(
            c.url(&["v1", "templates", "a b/c"]).as_str(),
            "http://h:1/prefix/v1/templates/a%20b%2Fc"
        );
        let c = Client::new("https://h/api?x=1", " key\n").unwrap();
        assert_eq!(c.url(&["healthz"]).as_str(), "https://h/api/healthz");
        assert_eq!(c.api_key(), "key");
    }

    #[test]
    fn ws_urls() {
        let u = Url::parse("http://127.0.0.1:6628/v1/sandboxes/s/processes/1/ws").unwrap();
        assert_eq!(
            ws_url(&u).unwrap().as_str(),
            "ws://127.0.0.1:6628/v1/sandboxes/s/processes/1/ws"
        );
        let u = Url::parse("https://h/p/ws").unwrap();
        assert_eq!(ws_url(&u).unwrap().as_str(), "wss://h/p/ws");
    }

    #[test]
    fn bad_urls() {
        assert!(matches!(Client::new("nope", "k"), Err(Error::Config(_))));
        assert!(matches!(
            Client::new("ftp://h/", "k"),
            Err(Error::Config(_))
        ));
    }

    #[test]
    fn key_file() {
        let dir = std::env::temp_dir().join(format!("moat-client-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = read_api_key_file(&dir).unwrap_err().to_string();
        assert!(err.contains("api-key"), "{err}");
        std::fs::write(api_key_path(&dir), "  secret\n").unwrap();
        assert_eq!(read_api_key_file(&dir).unwrap(), "secret");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
