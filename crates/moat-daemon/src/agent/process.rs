//! Process calls: start (streamed or in the background), list, re-attach, stdin, signals, PTY
//! size; and reading an agent's NDJSON event stream.

use axum::body::Body;
use http::Response;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use moat_api::protocol::{endpoint, NoQuery};
use moat_api::{
    AttachQuery, ExitStatus, OutputChunk, ProcessEvent, ProcessInfo, ProcessList, ProcessSelector,
    PtySize, SignalRequest, StartProcessRequest,
};

use super::wire::{self, AgentError};
use super::AgentClient;

impl AgentClient {
    /// Starts a process (`background` set): its info once it runs.
    pub async fn start_background(
        &self,
        req: &StartProcessRequest,
    ) -> Result<ProcessInfo, AgentError> {
        let req = StartProcessRequest {
            background: true,
            ..req.clone()
        };
        let resp = self.start_raw(&req).await?;
        wire::read_json(wire::success(resp).await?).await
    }

    /// Starts a process as asked; the agent's answer whatever its status (an event stream, or a
    /// background process's info).
    pub async fn start_raw(
        &self,
        req: &StartProcessRequest,
    ) -> Result<Response<Incoming>, AgentError> {
        let call = moat_api::protocol::Call::new::<endpoint::StartProcess>(None, &NoQuery {})?;
        let body = serde_json::to_vec(req)
            .map_err(|e| moat_api::protocol::CallError(format!("encode: {e}")))?;
        self.send(&call, Some("application/json"), Body::from(body))
            .await
    }

    /// Runs a process in the foreground, handing each of its events to `on_event`, and returns how
    /// it ended. A refusal is the agent's error.
    pub async fn run_streamed(
        &self,
        req: &StartProcessRequest,
        on_event: impl FnMut(&ProcessEvent),
    ) -> Result<ExitStatus, AgentError> {
        let req = StartProcessRequest {
            background: false,
            ..req.clone()
        };
        let resp = wire::success(self.start_raw(&req).await?).await?;
        read_events(resp, on_event).await
    }

    /// Running processes and the most recent exited ones.
    pub async fn processes(&self) -> Result<ProcessList, AgentError> {
        self.call::<endpoint::ListProcesses>(None, &NoQuery {}, &())
            .await
    }

    /// The agent's process journal after record `after` (0: from the oldest kept).
    pub async fn journal(&self, after: u64) -> Result<moat_api::ProcessJournal, AgentError> {
        let q = moat_api::JournalQuery {
            after: Some(after),
            limit: None,
        };
        self.call::<endpoint::Journal>(None, &q, &()).await
    }

    /// Re-attaches to process `sel`: its event stream (from its start with `replay`).
    pub async fn events(
        &self,
        sel: &ProcessSelector,
        replay: bool,
    ) -> Result<Response<Incoming>, AgentError> {
        let q = AttachQuery {
            replay: Some(replay),
        };
        self.request::<endpoint::ProcessEvents>(Some(sel), &q, None, Body::empty())
            .await
    }

    /// Replays the events of process `sel` from its start, to its exit or to now.
    pub async fn replay(
        &self,
        sel: &ProcessSelector,
        on_event: impl FnMut(&ProcessEvent),
    ) -> Result<ExitStatus, AgentError> {
        read_events(self.events(sel, true).await?, on_event).await
    }

    /// Writes `body` (streamed, as long as it lasts) to the process's stdin.
    pub async fn stdin(&self, sel: &ProcessSelector, body: Body) -> Result<(), AgentError> {
        let resp = self
            .request::<endpoint::ProcessStdin>(
                Some(sel),
                &NoQuery {},
                Some("application/octet-stream"),
                body,
            )
            .await?;
        wire::read_json(resp).await
    }

    /// Closes the process's stdin.
    pub async fn close_stdin(&self, sel: &ProcessSelector) -> Result<(), AgentError> {
        self.call::<endpoint::ProcessCloseStdin>(Some(sel), &NoQuery {}, &())
            .await
    }

    /// Signals the process's group (`SIGTERM`, `TERM`, `15`).
    pub async fn signal(&self, sel: &ProcessSelector, signal: &str) -> Result<(), AgentError> {
        let req = SignalRequest {
            signal: signal.into(),
        };
        self.call::<endpoint::ProcessSignal>(Some(sel), &NoQuery {}, &req)
            .await
    }

    /// Resizes the process's PTY.
    pub async fn resize(&self, sel: &ProcessSelector, size: PtySize) -> Result<(), AgentError> {
        self.call::<endpoint::ProcessResize>(Some(sel), &NoQuery {}, &size)
            .await
    }
}

/// Reads an agent's process-event stream to its end. Without an `exit` event (the process was
/// still running, or the stream broke) the result is an error.
pub async fn read_events(
    resp: Response<Incoming>,
    mut on_event: impl FnMut(&ProcessEvent),
) -> Result<ExitStatus, AgentError> {
    let mut body = resp.into_body();
    let mut lines = ProcessEventLines::default();
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| AgentError::BadAnswer(format!("the event stream broke: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        for ev in lines.push(&data)? {
            on_event(&ev);
            if let ProcessEvent::Exit(e) = ev {
                return Ok(e);
            }
        }
    }
    Err(AgentError::BadAnswer(
        "the process's event stream ended before its exit".into(),
    ))
}

/// The bytes of an output chunk (`data` as UTF-8, or `data_b64` decoded).
pub fn chunk_bytes(c: &OutputChunk) -> Vec<u8> {
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

/// Splits an agent's NDJSON process-event stream, fed chunk by chunk, into events. Lines that do
/// not parse are skipped; a line longer than [`MAX_EVENT_LINE`] is an error.
#[derive(Default)]
pub struct ProcessEventLines {
    buf: bytes::BytesMut,
}

impl ProcessEventLines {
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<ProcessEvent>, AgentError> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
            let line = self.buf.split_to(i + 1);
            if let Ok(ev) = serde_json::from_slice(&line[..i]) {
                out.push(ev);
            }
        }
        if self.buf.len() > MAX_EVENT_LINE {
            return Err(AgentError::BadAnswer(format!(
                "an event line longer than {MAX_EVENT_LINE} bytes"
            )));
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
        assert!(matches!(evs[0], ProcessEvent::Start { pid: 7, .. }));
        assert!(l.push(&vec![b'x'; MAX_EVENT_LINE + 1]).is_err());
    }
}
