//! The daemon's side of the host↔agent protocol: HTTP/2 (prior knowledge) over one byte stream that the
//! sandbox's tier provides. One connection per sandbox carries every request as its own stream, with
//! HTTP/2 flow control bounding what is in flight, so a flood of output never piles up in the daemon.
//!
//! The agent runs inside the sandbox and is as untrusted as the code there: its answers are only ever
//! passed back to the owner of that sandbox, and hyper bounds header sizes and frame lengths.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::Mutex;

use crate::tier::{AgentStream, IsolationTier};

/// Speaks HTTP/2 (prior knowledge) over `stream` to an agent of sandbox `id`; the connection runs
/// in a task of its own until every sender is gone.
pub async fn handshake(stream: AgentStream, id: &str) -> Result<SendRequest<Body>> {
    let (sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(4 << 20)
        .max_frame_size(1 << 16)
        .keep_alive_interval(None)
        .handshake(TokioIo::new(stream))
        .await
        .context("HTTP/2 handshake with the agent")?;
    let id = id.to_string();
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(sandbox = %id, "agent connection ended: {e}");
        }
    });
    Ok(sender)
}

/// A lazily (re)connected HTTP/2 client to one sandbox's agent.
pub struct AgentClient {
    id: String,
    tier: Arc<dyn IsolationTier>,
    tier_state: serde_json::Value,
    sender: Mutex<Option<SendRequest<Body>>>,
}

impl AgentClient {
    pub fn new(
        id: String,
        tier: Arc<dyn IsolationTier>,
        tier_state: serde_json::Value,
    ) -> AgentClient {
        AgentClient {
            id,
            tier,
            tier_state,
            sender: Mutex::new(None),
        }
    }

    async fn sender(&self) -> Result<SendRequest<Body>> {
        let mut guard = self.sender.lock().await;
        if let Some(s) = guard.as_ref() {
            if !s.is_closed() {
                return Ok(s.clone());
            }
        }
        let stream: AgentStream = self.tier.connect(&self.id, &self.tier_state).await?;
        let sender = handshake(stream, &self.id).await?;
        *guard = Some(sender.clone());
        Ok(sender)
    }

    /// Sends a request to the agent. `path_and_query` starts with `/`.
    pub async fn send(
        &self,
        method: http::Method,
        path_and_query: &str,
        content_type: Option<&str>,
        body: Body,
    ) -> Result<Response<Incoming>> {
        let mut sender = self.sender().await?;
        let mut b = Request::builder()
            .method(method)
            .uri(format!("http://agent{path_and_query}"));
        if let Some(ct) = content_type {
            b = b.header(http::header::CONTENT_TYPE, ct);
        }
        let req = b.body(body).context("build agent request")?;
        sender.ready().await.context("agent connection")?;
        sender
            .send_request(req)
            .await
            .map_err(|e| anyhow!("agent request {path_and_query}: {e}"))
    }

    /// A small file inside the sandbox as text (a kernel interface file, say); at most 1 MiB.
    pub async fn read_text(&self, path: &str) -> Result<String> {
        use http_body_util::{BodyExt, Limited};
        let q: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("path", path)
            .finish();
        let resp = self
            .send(
                http::Method::GET,
                &format!("/files?{q}"),
                None,
                Body::empty(),
            )
            .await?;
        if !resp.status().is_success() {
            bail!("agent: read {path}: {}", resp.status());
        }
        let body = Limited::new(resp.into_body(), 1 << 20)
            .collect()
            .await
            .map_err(|e| anyhow!("agent: read {path}: {e}"))?
            .to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// POSTs `body` as JSON to the agent.
    async fn post(&self, path: &str, body: &impl serde::Serialize) -> Result<Response<Incoming>> {
        self.send(
            http::Method::POST,
            path,
            Some("application/json"),
            Body::from(serde_json::to_vec(body)?),
        )
        .await
    }

    /// A byte stream to TCP `port` inside the sandbox (the agent's `POST /tcp`), as one end of an
    /// in-memory duplex pipe pumped to and from the agent's HTTP/2 stream.
    pub async fn tcp_tunnel(&self, port: u16) -> Result<tokio::io::DuplexStream> {
        use futures::StreamExt;
        use http_body_util::BodyExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(8);
        let body = Body::from_stream(crate::api::receiver_stream(rx));
        let resp = self
            .send(http::Method::POST, &format!("/tcp?port={port}"), None, body)
            .await?;
        if !resp.status().is_success() {
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let msg = serde_json::from_slice::<moat_api::ErrorBody>(&bytes)
                .map(|b| b.error.message)
                .unwrap_or_else(|_| format!("agent answered {status}"));
            bail!("{msg}");
        }
        let (ours, theirs) = tokio::io::duplex(64 << 10);
        let (mut rd, mut wr) = tokio::io::split(theirs);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx
                            .send(Ok(bytes::Bytes::copy_from_slice(&buf[..n])))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }
            }
        });
        let mut incoming = resp.into_body().into_data_stream();
        tokio::spawn(async move {
            while let Some(Ok(chunk)) = incoming.next().await {
                if wr.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            let _ = wr.shutdown().await;
        });
        Ok(ours)
    }

    /// GETs JSON from the agent.
    pub async fn get_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T> {
        use http_body_util::BodyExt;
        let resp = self
            .send(http::Method::GET, path, None, Body::empty())
            .await?;
        let status = resp.status();
        let limited = http_body_util::Limited::new(resp.into_body(), 1 << 20);
        let bytes = limited
            .collect()
            .await
            .map_err(|e| anyhow!("read agent answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            bail!(
                "agent answered {status} to {path}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        serde_json::from_slice(&bytes).with_context(|| format!("decode agent answer to {path}"))
    }

    /// Runs a process in the foreground, handing each of its events to `on_event`, and returns how it
    /// ended. An answer other than an event stream (the agent refused the request) is an error with
    /// the agent's message.
    pub async fn run_streamed(
        &self,
        req: &moat_api::StartProcessRequest,
        on_event: impl FnMut(&moat_api::ProcessEvent),
    ) -> Result<moat_api::ExitStatus> {
        let resp = self.post("/processes", req).await?;
        read_events(resp, on_event).await
    }

    /// Replays the events of process `sel` (a pid or tag) from its start, to its exit or to now.
    pub async fn replay(
        &self,
        sel: &str,
        on_event: impl FnMut(&moat_api::ProcessEvent),
    ) -> Result<moat_api::ExitStatus> {
        let resp = self
            .send(
                http::Method::GET,
                &format!("/processes/{sel}/events?replay=true"),
                None,
                Body::empty(),
            )
            .await?;
        read_events(resp, on_event).await
    }

    /// POSTs JSON to the agent and decodes its JSON answer.
    pub async fn post_json<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<T> {
        use http_body_util::BodyExt;
        let resp = self.post(path, body).await?;
        let status = resp.status();
        let bytes = http_body_util::Limited::new(resp.into_body(), 1 << 20)
            .collect()
            .await
            .map_err(|e| anyhow!("read agent answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            let msg = serde_json::from_slice::<moat_api::ErrorBody>(&bytes)
                .map(|b| b.error.message)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
            bail!("agent answered {status} to {path}: {msg}");
        }
        serde_json::from_slice(&bytes).with_context(|| format!("decode agent answer to {path}"))
    }

    /// Merges variables into the environment of processes the agent starts from now on.
    pub async fn set_env(&self, env: &std::collections::BTreeMap<String, String>) -> Result<()> {
        let resp = self
            .post("/env", &moat_api::EnvUpdate { env: env.clone() })
            .await?;
        if !resp.status().is_success() {
            bail!("agent refused the environment: {}", resp.status());
        }
        Ok(())
    }

    /// Gives the agent the sandbox's per-process limits (open files, output buffer, default timeout) and
    /// where its OOM counter is.
    pub async fn configure(&self, config: &moat_api::AgentConfig) -> Result<()> {
        let resp = self.post("/config", config).await?;
        if !resp.status().is_success() {
            bail!("agent refused its configuration: {}", resp.status());
        }
        Ok(())
    }

    /// Waits until the agent answers `/health` with the protocol version this daemon speaks.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        #[derive(serde::Deserialize)]
        struct AgentHealth {
            protocol: u32,
        }
        let deadline = tokio::time::Instant::now() + timeout;
        let mut last = anyhow!("agent did not answer");
        while tokio::time::Instant::now() < deadline {
            match tokio::time::timeout(
                Duration::from_secs(2),
                self.get_json::<AgentHealth>("/health"),
            )
            .await
            {
                Ok(Ok(h)) if h.protocol == moat_api::AGENT_PROTOCOL_VERSION => return Ok(()),
                Ok(Ok(h)) => bail!(
                    "agent speaks protocol {} but the daemon speaks {}",
                    h.protocol,
                    moat_api::AGENT_PROTOCOL_VERSION
                ),
                Ok(Err(e)) => last = e,
                Err(_) => last = anyhow!("agent health check timed out"),
            }
            *self.sender.lock().await = None;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Err(last.context(format!("agent of {} not ready after {timeout:?}", self.id)))
    }
}

/// Reads an agent's process-event stream to its end. Without an `exit` event (the process was still
/// running, or the stream broke) the result is an error.
async fn read_events(
    resp: Response<Incoming>,
    mut on_event: impl FnMut(&moat_api::ProcessEvent),
) -> Result<moat_api::ExitStatus> {
    use http_body_util::BodyExt;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let bytes = http_body_util::Limited::new(body, 1 << 20)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let msg = serde_json::from_slice::<moat_api::ErrorBody>(&bytes)
            .map(|b| b.error.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        bail!("the agent refused ({status}): {msg}");
    }
    let mut lines = ProcessEventLines::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| anyhow!("agent event stream: {e}"))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        for ev in lines.push(&data)? {
            on_event(&ev);
            if let moat_api::ProcessEvent::Exit(e) = ev {
                return Ok(e);
            }
        }
    }
    bail!("the process's event stream ended before its exit")
}

/// The bytes of an output chunk (`data` as UTF-8, or `data_b64` decoded).
pub fn chunk_bytes(c: &moat_api::OutputChunk) -> Vec<u8> {
    use base64::Engine;
    match (&c.data, &c.data_b64) {
        (Some(d), _) => d.as_bytes().to_vec(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .unwrap_or_default(),
        _ => Vec::new(),
    }
}

/// Longest NDJSON line accepted from an agent: a bound on what a hostile agent can make the daemon
/// hold while it waits for a newline.
pub const MAX_EVENT_LINE: usize = 16 << 20;

/// Splits an agent's NDJSON process-event stream, fed chunk by chunk, into events. Lines that do not
/// parse are skipped; a line longer than [`MAX_EVENT_LINE`] is an error.
#[derive(Default)]
pub struct ProcessEventLines {
    buf: bytes::BytesMut,
}

impl ProcessEventLines {
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<moat_api::ProcessEvent>> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
            let line = self.buf.split_to(i + 1);
            if let Ok(ev) = serde_json::from_slice(&line[..i]) {
                out.push(ev);
            }
        }
        if self.buf.len() > MAX_EVENT_LINE {
            bail!("the agent sent an event line longer than {MAX_EVENT_LINE} bytes");
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_lines_split_across_chunks_and_are_bounded() {
        let mut l = ProcessEventLines::default();
        assert!(l.push(br#"{"type":"start","pi"#).unwrap().is_empty());
        let evs = l
            .push(b"d\":7}\nnot json\n{\"type\":\"exit\",\"exit_code\":0}\n")
            .unwrap();
        assert_eq!(evs.len(), 2);
        assert!(matches!(
            evs[0],
            moat_api::ProcessEvent::Start { pid: 7, .. }
        ));
        assert!(l.push(&vec![b'x'; MAX_EVENT_LINE + 1]).is_err());
    }
}
