//! The wire under every agent call: HTTP/2 (prior knowledge) over one byte stream, one request per
//! stream, and the one error type agent calls have.
//!
//! The agent runs inside the sandbox and is as untrusted as the code there: its answers are only
//! ever passed back to the owner of that sandbox, hyper bounds header sizes and frame lengths, and
//! every answer read whole here is bounded.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use moat_api::protocol::{Call, CallError};
use moat_api::{ErrorBody, ErrorCode};
use tokio::io::{AsyncRead, AsyncWrite};

/// A byte stream to a sandbox's agent.
pub trait AgentIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> AgentIo for T {}
pub type AgentStream = Pin<Box<dyn AgentIo>>;

/// Opens a new byte stream to one agent (the tier's business: a unix socket, a VM's serial port).
pub type Dial = Arc<
    dyn Fn() -> Pin<Box<dyn Future<Output = anyhow::Result<AgentStream>> + Send>> + Send + Sync,
>;

/// Largest answer read whole (JSON, error bodies, small files).
pub const MAX_ANSWER: usize = 16 << 20;

/// What can go wrong with a call to an agent. Every caller maps it to its own errors.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No connection could be made, or it broke before the answer's head.
    #[error("agent unreachable: {0}")]
    Unreachable(String),
    /// The agent answered with an error status; `body` is its error (or one made from the status
    /// and the text of an answer that was not one).
    #[error("{}", .body.error.message)]
    Refused { status: StatusCode, body: ErrorBody },
    /// The answer is not what the protocol says: bad JSON, too long, a stream that ended early.
    #[error("bad answer from the agent: {0}")]
    BadAnswer(String),
    /// The daemon could not make the call (a route given the wrong arguments: a bug).
    #[error("{0}")]
    Call(#[from] CallError),
}

impl AgentError {
    /// The agent's status, when it refused.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            AgentError::Refused { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// Speaks HTTP/2 over `stream` to the agent of sandbox `id`; the connection runs in a task of its
/// own until every sender is gone.
pub async fn handshake(stream: AgentStream, id: &str) -> Result<SendRequest<Body>, AgentError> {
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(4 << 20)
        .max_frame_size(1 << 16)
        .keep_alive_interval(None)
        .handshake(TokioIo::new(stream))
        .await
        .map_err(|e| AgentError::Unreachable(format!("HTTP/2 handshake with the agent: {e}")))?;
    let id = id.to_string();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(sandbox = %id, "agent connection ended: {e}");
        }
    });
    Ok(sender)
}

/// Sends `call` on `sender`; the answer whatever its status.
pub async fn send(
    sender: &mut SendRequest<Body>,
    call: &Call,
    content_type: Option<&str>,
    body: Body,
) -> Result<Response<Incoming>, AgentError> {
    let mut b = Request::builder()
        .method(call.route.method())
        .uri(format!("http://agent{}", call.path_and_query()));
    if let Some(ct) = content_type {
        b = b.header(http::header::CONTENT_TYPE, ct);
    }
    let req = b
        .body(body)
        .map_err(|e| CallError(format!("build the request {:?}: {e}", call.route)))?;
    sender
        .ready()
        .await
        .map_err(|e| AgentError::Unreachable(format!("agent connection: {e}")))?;
    sender
        .send_request(req)
        .await
        .map_err(|e| AgentError::Unreachable(format!("{:?}: {e}", call.route)))
}

/// The answer if its status is a success, else the agent's error.
pub async fn success(resp: Response<Incoming>) -> Result<Response<Incoming>, AgentError> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status();
    let bytes = read_all(resp, 1 << 20).await.unwrap_or_default();
    Err(refusal(status, &bytes))
}

/// The error an agent's error answer stands for.
pub fn refusal(status: StatusCode, bytes: &[u8]) -> AgentError {
    let body = serde_json::from_slice::<ErrorBody>(bytes).unwrap_or_else(|_| {
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(4096)]);
        ErrorBody::new(
            ErrorCode::from_status(status.as_u16()),
            format!("agent answered {status}: {}", text.trim()),
        )
    });
    AgentError::Refused { status, body }
}

/// An answer's whole body, at most `limit` bytes.
pub async fn read_all(resp: Response<Incoming>, limit: usize) -> Result<Bytes, AgentError> {
    Limited::new(resp.into_body(), limit)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .map_err(|e| AgentError::BadAnswer(format!("read the answer: {e}")))
}

/// An answer's body as JSON of type `T`.
pub async fn read_json<T: serde::de::DeserializeOwned>(
    resp: Response<Incoming>,
) -> Result<T, AgentError> {
    let bytes = read_all(resp, MAX_ANSWER).await?;
    let bytes: &[u8] = if bytes.is_empty() { b"null" } else { &bytes };
    serde_json::from_slice(bytes).map_err(|e| AgentError::BadAnswer(format!("decode: {e}")))
}
