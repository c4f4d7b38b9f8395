//! `GET /v1/sandboxes/{id}/processes/{process}/ws`: a process (usually a PTY) over a WebSocket.
//!
//! Server → client: binary messages carry output bytes; text messages carry the `start`, `dropped` and
//! `exit` events as JSON. Client → server: binary messages are stdin; text messages are controls:
//! `{"type":"resize","cols","rows"}`, `{"type":"signal","signal"}`, `{"type":"close_stdin"}`.
//! Closing the socket detaches; the process keeps running and can be re-attached.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::Path;
use axum::response::{IntoResponse, Response};
use futures::{SinkExt, StreamExt};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use moat_api::{ProcessEvent, ProcessSelector, PtySize};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::error::{ApiError, ApiResult};
use super::St;
use crate::agent::{chunk_bytes, AgentClient, AgentError, ProcessEventLines};

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Control {
    Resize { cols: u16, rows: u16 },
    Signal { signal: String },
    CloseStdin,
}

/// Attach to a process over a WebSocket (PTY use: `moat shell`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}/ws", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path, description = "pid or tag")),
    responses((status = 101, description = "WebSocket: binary = output/stdin bytes, text = JSON events/controls"),
              (status = 404, body = moat_api::ErrorBody)))]
pub async fn process_ws(
    st: St,
    Path((id, process)): Path<(String, String)>,
    ws: WebSocketUpgrade,
) -> ApiResult<Response> {
    let sel = ProcessSelector::parse(&process).map_err(|m| ApiError::invalid("process", m))?;
    let agent = st.sandboxes.agent(&id).await?;
    let resp = match agent.events(&sel, true).await {
        Ok(r) => r,
        Err(AgentError::Refused { status, body }) => {
            return Ok((status, axum::Json(body)).into_response());
        }
        Err(e) => return Err(st.sandboxes.agent_failed(&id, e).await.into()),
    };
    let events = resp.into_body();
    Ok(ws
        .on_upgrade(move |socket| bridge(socket, agent, sel, events))
        .into_response())
}

async fn bridge(
    socket: WebSocket,
    agent: Arc<AgentClient>,
    sel: ProcessSelector,
    events: Incoming,
) {
    let (mut sink, mut stream) = socket.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(16);

    // Agent events → WebSocket messages.
    let out_task = tokio::spawn(async move {
        let mut events = events;
        let mut lines = ProcessEventLines::default();
        while let Some(Ok(frame)) = events.frame().await {
            let Ok(chunk) = frame.into_data() else {
                continue;
            };
            let Ok(evs) = lines.push(&chunk) else {
                break;
            };
            for ev in evs {
                let (msg, last) = match &ev {
                    ProcessEvent::Stdout(c) | ProcessEvent::Stderr(c) | ProcessEvent::Pty(c) => {
                        (Message::Binary(chunk_bytes(c).into()), false)
                    }
                    other => (
                        Message::Text(serde_json::to_string(other).unwrap_or_default().into()),
                        matches!(other, ProcessEvent::Exit(_)),
                    ),
                };
                if out_tx.send(msg).await.is_err() || last {
                    return;
                }
            }
        }
        // The agent's stream ended (or broke) before the process's exit: say so, as the REST
        // stream does, rather than leave the client waiting.
        let ev = ProcessEvent::Error {
            message: "the sandbox's agent ended the stream before the process's exit was known (the sandbox may have ended)".into(),
        };
        let _ = out_tx
            .send(Message::Text(
                serde_json::to_string(&ev).unwrap_or_default().into(),
            ))
            .await;
    });

    // Stdin is one long streaming request to the agent, opened on the first input.
    let mut stdin_tx: Option<
        mpsc::Sender<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>,
    > = None;
    loop {
        tokio::select! {
            msg = out_rx.recv() => {
                let Some(msg) = msg else { break };
                let is_exit = matches!(&msg, Message::Text(t)
                    if t.starts_with("{\"type\":\"exit\"") || t.starts_with("{\"type\":\"error\""));
                if sink.send(msg).await.is_err() {
                    break;
                }
                if is_exit {
                    let _ = sink.send(Message::Close(None)).await;
                    break;
                }
            }
            incoming = stream.next() => {
                match incoming {
                    Some(Ok(Message::Binary(b))) => {
                        if stdin_tx.is_none() {
                            let (tx, rx) = mpsc::channel(16);
                            let body = Body::new(http_body_util::StreamBody::new(ReceiverStream::new(rx)));
                            let (agent, sel) = (agent.clone(), sel.clone());
                            tokio::spawn(async move {
                                let _ = agent.stdin(&sel, body).await;
                            });
                            stdin_tx = Some(tx);
                        }
                        if let Some(tx) = &stdin_tx {
                            let _ = tx.send(Ok(hyper::body::Frame::data(b))).await;
                        }
                    }
                    Some(Ok(Message::Text(t))) => {
                        let done = match serde_json::from_str::<Control>(&t) {
                            Ok(Control::Resize { cols, rows }) => agent.resize(&sel, PtySize { cols, rows }).await,
                            Ok(Control::Signal { signal }) => agent.signal(&sel, &signal).await,
                            Ok(Control::CloseStdin) => {
                                stdin_tx = None;
                                agent.close_stdin(&sel).await
                            }
                            Err(e) => {
                                let err = serde_json::json!({"type": "error", "message": format!("bad control message: {e}")});
                                let _ = sink.send(Message::Text(err.to_string().into())).await;
                                continue;
                            }
                        };
                        if let Err(e) = done {
                            tracing::debug!(sandbox = %agent.id(), "control message: {e}");
                        }
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                    Some(Ok(_)) => {}
                }
            }
        }
    }
    out_task.abort();
}
