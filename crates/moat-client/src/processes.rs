//! Process endpoints: start, stream, re-attach, stdin, signals, PTY resize, WebSocket.

use bytes::Bytes;
use moat_api::{
    ProcessEvent, ProcessInfo, ProcessList, PtySize, SignalRequest, StartProcessRequest,
};
use reqwest::Method;
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest, http::HeaderValue};

use crate::{ndjson_response, ws_url, Client, Error, EventStream, Result};

/// The WebSocket of `GET .../processes/{sel}/ws`.
pub type WsStream =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// What [`Client::start_process`] answers with.
pub enum ProcessStart {
    /// The process's events as they happen (`start` first, `exit` last).
    Stream(EventStream<ProcessEvent>),
    /// The request had `background: true`: the process runs; re-attach or use the WebSocket.
    Background(Box<ProcessInfo>),
}

impl std::fmt::Debug for ProcessStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessStart::Stream(_) => f.write_str("ProcessStart::Stream(..)"),
            ProcessStart::Background(info) => f.debug_tuple("Background").field(info).finish(),
        }
    }
}

impl Client {
    /// `POST /v1/sandboxes/{id}/processes`: a stream of events, or the process info when
    /// `req.background` is set.
    pub async fn start_process(&self, id: &str, req: &StartProcessRequest) -> Result<ProcessStart> {
        let resp = self
            .send(
                self.request(Method::POST, &["v1", "sandboxes", id, "processes"])
                    .json(req),
            )
            .await?;
        if req.background {
            let bytes = resp.bytes().await?;
            let info = serde_json::from_slice(&bytes).map_err(|e| Error::Decode(e.to_string()))?;
            Ok(ProcessStart::Background(Box::new(info)))
        } else {
            Ok(ProcessStart::Stream(ndjson_response(resp)))
        }
    }

    /// Starts a process in the foreground (forces `background: false`) and streams its events.
    pub async fn start_process_stream(
        &self,
        id: &str,
        req: &StartProcessRequest,
    ) -> Result<EventStream<ProcessEvent>> {
        let mut req = req.clone();
        req.background = false;
        match self.start_process(id, &req).await? {
            ProcessStart::Stream(s) => Ok(s),
            ProcessStart::Background(_) => Err(Error::Decode("expected an event stream".into())),
        }
    }

    /// Starts a process in the background (forces `background: true`).
    pub async fn start_process_background(
        &self,
        id: &str,
        req: &StartProcessRequest,
    ) -> Result<ProcessInfo> {
        let mut req = req.clone();
        req.background = true;
        match self.start_process(id, &req).await? {
            ProcessStart::Background(info) => Ok(*info),
            ProcessStart::Stream(_) => Err(Error::Decode("expected process info".into())),
        }
    }

    /// `GET /v1/sandboxes/{id}/processes`
    pub async fn list_processes(&self, id: &str) -> Result<Vec<ProcessInfo>> {
        let list: ProcessList = self
            .send_json(self.request(Method::GET, &["v1", "sandboxes", id, "processes"]))
            .await?;
        Ok(list.processes)
    }

    /// `GET .../processes/{sel}/events?replay=`: re-attach to a process's event stream.
    pub async fn attach(
        &self,
        id: &str,
        sel: &str,
        replay: bool,
    ) -> Result<EventStream<ProcessEvent>> {
        let resp = self
            .send(
                self.request(
                    Method::GET,
                    &["v1", "sandboxes", id, "processes", sel, "events"],
                )
                .query(&[("replay", replay)]),
            )
            .await?;
        Ok(ndjson_response(resp))
    }

    /// `POST .../processes/{sel}/stdin` with these bytes.
    pub async fn send_stdin(&self, id: &str, sel: &str, data: impl Into<Bytes>) -> Result<()> {
        self.send_stdin_body(id, sel, reqwest::Body::from(data.into()))
            .await
    }

    /// `POST .../processes/{sel}/stdin` with a streamed body (e.g. `Body::wrap_stream` of the
    /// local stdin); the request ends when the stream ends.
    pub async fn send_stdin_body(&self, id: &str, sel: &str, body: reqwest::Body) -> Result<()> {
        self.send_empty(
            self.request(
                Method::POST,
                &["v1", "sandboxes", id, "processes", sel, "stdin"],
            )
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .body(body),
        )
        .await
    }

    /// `POST .../processes/{sel}/stdin` streaming from a `Stream` of byte chunks.
    pub async fn send_stdin_stream<S>(&self, id: &str, sel: &str, stream: S) -> Result<()>
    where
        S: futures::TryStream + Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        Bytes: From<S::Ok>,
    {
        self.send_stdin_body(id, sel, reqwest::Body::wrap_stream(stream))
            .await
    }

    /// `POST .../processes/{sel}/close-stdin`
    pub async fn close_stdin(&self, id: &str, sel: &str) -> Result<()> {
        self.send_empty(self.request(
            Method::POST,
            &["v1", "sandboxes", id, "processes", sel, "close-stdin"],
        ))
        .await
    }

    /// `POST .../processes/{sel}/signal` (`SIGTERM`, `TERM` or a number).
    pub async fn signal(&self, id: &str, sel: &str, signal: &str) -> Result<()> {
        self.send_empty(
            self.request(
                Method::POST,
                &["v1", "sandboxes", id, "processes", sel, "signal"],
            )
            .json(&SignalRequest {
                signal: signal.to_string(),
            }),
        )
        .await
    }

    /// `POST .../processes/{sel}/resize` (PTY processes only).
    pub async fn resize(&self, id: &str, sel: &str, size: PtySize) -> Result<()> {
        self.send_empty(
            self.request(
                Method::POST,
                &["v1", "sandboxes", id, "processes", sel, "resize"],
            )
            .json(&size),
        )
        .await
    }

    /// `GET .../processes/{sel}/ws`: a WebSocket carrying output (binary), start/exit/dropped events
    /// (text JSON), and taking stdin (binary) and control messages (text JSON).
    pub async fn attach_ws(&self, id: &str, sel: &str) -> Result<WsStream> {
        let url = ws_url(&self.url(&["v1", "sandboxes", id, "processes", sel, "ws"]))?;
        let mut req = url.as_str().into_client_request()?;
        let auth = HeaderValue::from_str(&format!("Bearer {}", self.api_key())).map_err(|_| {
            Error::Config("the API key holds characters not allowed in a header".into())
        })?;
        req.headers_mut().insert("authorization", auth);
        match tokio_tungstenite::connect_async(req).await {
            Ok((ws, _)) => Ok(ws),
            Err(tungstenite::Error::Http(resp)) => {
                let text = resp
                    .body()
                    .as_deref()
                    .map(String::from_utf8_lossy)
                    .unwrap_or_default();
                Err(Error::from_response_body(resp.status().as_u16(), &text))
            }
            Err(e) => Err(e.into()),
        }
    }
}
