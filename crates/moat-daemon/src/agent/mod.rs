//! The daemon's side of the host↔agent protocol (`moat_api::protocol`): one client per sandbox,
//! typed calls by concern (`process`, `files`, `vm`, `tcp`), and the wire under them (`wire`).
//!
//! HTTP/2 over one byte stream that the sandbox's tier provides (a [`Dial`] function: this module
//! knows no tier). One connection per sandbox carries every request as its own stream, with
//! HTTP/2 flow control bounding what is in flight, so a flood of output never piles up in the
//! daemon. Every caller (REST proxy, E2B front, code interpreter, WebSocket bridge, template
//! builds, the microvm control port) goes through these calls and maps [`AgentError`] to its own
//! errors; no agent path is written anywhere else.

use std::time::Duration;

use axum::body::Body;
use http::Response;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use moat_api::protocol::{endpoint, Call, Endpoint, NoQuery, Payload};
use moat_api::ProcessSelector;
use tokio::sync::Mutex;

#[cfg(test)]
pub mod fake;
pub mod files;
pub mod process;
pub mod tcp;
pub mod vm;
pub mod wire;

pub use process::{chunk_bytes, ProcessEventLines};

/// Tags of processes the daemon itself keeps in a sandbox (code kernels) begin with this: they do
/// no work of their own between requests, so they never keep a sandbox from being idle.
pub const DAEMON_TAG_PREFIX: &str = "moat-";
pub use wire::{AgentError, AgentStream, Dial};

/// A lazily (re)connected HTTP/2 client to one sandbox's agent.
pub struct AgentClient {
    id: String,
    dial: Dial,
    sender: Mutex<Option<SendRequest<Body>>>,
}

impl AgentClient {
    /// A client of the agent of sandbox `id` that `dial` reaches; it connects on first use.
    pub fn new(id: impl Into<String>, dial: Dial) -> AgentClient {
        AgentClient {
            id: id.into(),
            dial,
            sender: Mutex::new(None),
        }
    }

    /// The sandbox this client's agent belongs to.
    pub fn id(&self) -> &str {
        &self.id
    }

    async fn sender(&self) -> Result<SendRequest<Body>, AgentError> {
        let mut guard = self.sender.lock().await;
        if let Some(s) = guard.as_ref() {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let stream = (self.dial)()
            .await
            .map_err(|e| AgentError::Unreachable(format!("{e:#}")))?;
        let sender = wire::handshake(stream, &self.id).await?;
        *guard = Some(sender.clone());
        Ok(sender)
    }

    /// Drops the connection; the next call makes a new one.
    pub async fn disconnect(&self) {
        *self.sender.lock().await = None;
    }

    /// Sends a call and returns the answer whatever its status (the REST API passes an agent's
    /// refusal through as it is).
    pub async fn send(
        &self,
        call: &Call,
        content_type: Option<&str>,
        body: Body,
    ) -> Result<Response<Incoming>, AgentError> {
        let mut sender = self.sender().await?;
        wire::send(&mut sender, call, content_type, body).await
    }

    /// Calls endpoint `E` with a streamed (or empty) body; a refusal is an error, a success the
    /// answer to read (a stream, a file).
    pub async fn request<E: Endpoint>(
        &self,
        process: Option<&ProcessSelector>,
        query: &E::Query,
        content_type: Option<&str>,
        body: Body,
    ) -> Result<Response<Incoming>, AgentError> {
        let call = Call::new::<E>(process, query)?;
        wire::success(self.send(&call, content_type, body).await?).await
    }

    /// Calls endpoint `E` with its JSON body (none where the route takes none) and decodes its JSON
    /// answer (`()` for an empty one).
    pub async fn call<E: Endpoint>(
        &self,
        process: Option<&ProcessSelector>,
        query: &E::Query,
        body: &E::Body,
    ) -> Result<E::Answer, AgentError> {
        let (ct, body) = match E::ROUTE.spec().request {
            Payload::Json(_) => (
                Some("application/json"),
                Body::from(serde_json::to_vec(body).map_err(|e| {
                    AgentError::Call(moat_api::protocol::CallError(format!("encode: {e}")))
                })?),
            ),
            _ => (None, Body::empty()),
        };
        let resp = self.request::<E>(process, query, ct, body).await?;
        wire::read_json(resp).await
    }

    /// Merges variables into the environment of processes the agent starts from now on.
    pub async fn set_env(
        &self,
        env: &std::collections::BTreeMap<String, String>,
    ) -> Result<(), AgentError> {
        self.call::<endpoint::SetEnv>(None, &NoQuery {}, &moat_api::EnvUpdate { env: env.clone() })
            .await
    }

    /// Gives the agent the sandbox's per-process limits (open files, output buffer, default
    /// timeout) and where its OOM counter is.
    pub async fn configure(&self, config: &moat_api::AgentConfig) -> Result<(), AgentError> {
        self.call::<endpoint::Configure>(None, &NoQuery {}, config)
            .await
    }

    /// Waits until the agent answers `/health` with the protocol version this daemon speaks.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), AgentError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = AgentError::Unreachable("the agent did not answer".into());
        while tokio::time::Instant::now() < deadline {
            let health = self.call::<endpoint::Health>(None, &NoQuery {}, &());
            match tokio::time::timeout(Duration::from_secs(2), health).await {
                Ok(Ok(h)) if h.protocol == moat_api::AGENT_PROTOCOL_VERSION => return Ok(()),
                Ok(Ok(h)) => {
                    return Err(AgentError::BadAnswer(format!(
                        "the agent speaks protocol {} but the daemon speaks {}",
                        h.protocol,
                        moat_api::AGENT_PROTOCOL_VERSION
                    )))
                }
                Ok(Err(e)) => last = e,
                Err(_) => last = AgentError::Unreachable("health check timed out".into()),
            }
            self.disconnect().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Err(AgentError::Unreachable(format!(
            "the agent of {} is not ready after {timeout:?}: {last}",
            self.id
        )))
    }
}
