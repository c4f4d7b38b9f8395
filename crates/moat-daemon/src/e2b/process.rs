//! envd's `process.Process` service on moat's agent: every E2B process is a background process of
//! the agent (so it outlives the stream that started it, as envd's do), addressed by pid or tag; its
//! output streams come from the agent's re-attach (`/processes/{pid}/events`).

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use moat_api::{
    ExitStatus, ProcessEvent, ProcessInfo, ProcessSelector, PtySize, StartProcessRequest,
};
use moat_e2b_proto::process as pb;
use tokio::sync::mpsc;

use super::connect::{self, Code, ConnectError, ConnectResult, Envelopes};
use super::{E2b, User};
use crate::agent::{AgentClient, AgentError, ProcessEventLines};

/// The Connect error for an agent call's error.
pub(super) fn agent_error(e: AgentError) -> ConnectError {
    let (status, message) = match e {
        AgentError::Refused { status, body } => (status, body.error.message),
        AgentError::Unreachable(_) => return ConnectError::new(Code::Unavailable, e.to_string()),
        AgentError::BadAnswer(_) | AgentError::Call(_) => {
            return ConnectError::new(Code::Internal, e.to_string())
        }
    };
    let code = match status.as_u16() {
        400 => Code::InvalidArgument,
        404 => Code::NotFound,
        // envd forgets a process when it exits: for E2B's clients it is not found any more.
        409 if message.contains("has exited") => Code::NotFound,
        409 => Code::FailedPrecondition,
        413 | 429 => Code::ResourceExhausted,
        501 => Code::Unimplemented,
        503 => Code::Unavailable,
        _ => Code::Internal,
    };
    ConnectError::new(code, message)
}

/// The agent's selector of an E2B process selector.
fn selector(s: Option<&pb::ProcessSelector>) -> ConnectResult<ProcessSelector> {
    match s.and_then(|s| s.selector.as_ref()) {
        Some(pb::process_selector::Selector::Pid(pid)) => Ok(ProcessSelector::Pid(*pid)),
        Some(pb::process_selector::Selector::Tag(tag)) => {
            // moat's selectors tell pids from tags by digits: an all-digit tag cannot name one.
            match ProcessSelector::parse(tag) {
                Ok(sel @ ProcessSelector::Tag(_)) => Ok(sel),
                Ok(ProcessSelector::Pid(_)) => Err(ConnectError::new(
                    Code::InvalidArgument,
                    format!("tag {tag:?} is all digits, which moat reads as a pid"),
                )),
                Err(m) => Err(ConnectError::new(Code::InvalidArgument, m)),
            }
        }
        None => Err(ConnectError::new(
            Code::InvalidArgument,
            "process selector (pid or tag) is missing",
        )),
    }
}

/// Go's `ProcessState.String()` for a signal, which E2B's clients show.
fn signal_text(sig: &str) -> &'static str {
    match sig {
        "SIGKILL" => "killed",
        "SIGTERM" => "terminated",
        "SIGINT" => "interrupt",
        "SIGHUP" => "hangup",
        "SIGQUIT" => "quit",
        "SIGSEGV" => "segmentation fault",
        "SIGABRT" => "aborted",
        "SIGPIPE" => "broken pipe",
        "SIGUSR1" => "user defined signal 1",
        "SIGUSR2" => "user defined signal 2",
        _ => "signal",
    }
}

/// envd's end event for a moat exit status.
pub(super) fn end_event(e: &ExitStatus) -> pb::process_event::EndEvent {
    match (e.exit_code, &e.signal) {
        (Some(code), _) => pb::process_event::EndEvent {
            exit_code: code,
            exited: true,
            status: format!("exit status {code}"),
            error: (code != 0).then(|| format!("exit status {code}")),
        },
        (None, Some(sig)) => {
            let text = format!("signal: {}", signal_text(sig));
            pb::process_event::EndEvent {
                exit_code: -1,
                exited: false,
                status: text.clone(),
                error: Some(match &e.reason {
                    Some(r) => format!("{text} ({r})"),
                    None => text,
                }),
            }
        }
        (None, None) => pb::process_event::EndEvent {
            exit_code: -1,
            exited: false,
            status: "failed".into(),
            error: Some(
                e.error
                    .clone()
                    .unwrap_or_else(|| "the process ended".into()),
            ),
        },
    }
}

fn event(ev: pb::process_event::Event) -> Bytes {
    connect::message(&pb::StartResponse {
        event: Some(pb::ProcessEvent { event: Some(ev) }),
    })
}

/// Streams a process's events (from the agent's answer `resp`) as envd's: `start` first, output,
/// `end`, then the end of the stream; keepalives while it is quiet.
fn stream_events(
    pid: u32,
    resp: http::Response<hyper::body::Incoming>,
    keepalive: Duration,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let start = event(pb::process_event::Event::Start(
            pb::process_event::StartEvent { pid },
        ));
        if tx.send(start).await.is_err() {
            return;
        }
        let mut body = resp.into_body();
        let mut lines = ProcessEventLines::default();
        let mut tick = tokio::time::interval(keepalive);
        tick.tick().await;
        loop {
            let frame = tokio::select! {
                f = body.frame() => f,
                _ = tick.tick() => {
                    let ka = event(pb::process_event::Event::Keepalive(pb::process_event::KeepAlive {}));
                    if tx.send(ka).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let data = match frame {
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
                Some(Err(e)) => {
                    let err = ConnectError::new(
                        Code::Unavailable,
                        format!("the process's stream broke: {e}"),
                    );
                    let _ = tx.send(connect::end(Some(&err))).await;
                    return;
                }
                None => {
                    let err = ConnectError::new(
                        Code::Unavailable,
                        "the process's stream ended before it exited",
                    );
                    let _ = tx.send(connect::end(Some(&err))).await;
                    return;
                }
            };
            let evs = match lines.push(&data) {
                Ok(evs) => evs,
                Err(e) => {
                    let _ = tx
                        .send(connect::end(Some(&ConnectError::new(
                            Code::Internal,
                            format!("{e:#}"),
                        ))))
                        .await;
                    return;
                }
            };
            for ev in evs {
                use pb::process_event::data_event::Output;
                let out = match &ev {
                    ProcessEvent::Stdout(c) => Some(Output::Stdout(crate::agent::chunk_bytes(c))),
                    ProcessEvent::Stderr(c) => Some(Output::Stderr(crate::agent::chunk_bytes(c))),
                    ProcessEvent::Pty(c) => Some(Output::Pty(crate::agent::chunk_bytes(c))),
                    // envd ends the call of a process killed at its deadline with
                    // `deadline_exceeded` (the SDKs' TimeoutException), not an exit.
                    ProcessEvent::Exit(e) if e.timed_out => {
                        let err = ConnectError::new(
                            Code::DeadlineExceeded,
                            "the command's deadline passed and it was killed",
                        );
                        let _ = tx.send(connect::end(Some(&err))).await;
                        return;
                    }
                    ProcessEvent::Exit(e) => {
                        let _ = tx
                            .send(event(pb::process_event::Event::End(end_event(e))))
                            .await;
                        let _ = tx.send(connect::end(None)).await;
                        return;
                    }
                    ProcessEvent::Error { message } => {
                        let err = ConnectError::new(Code::Unavailable, message.clone());
                        let _ = tx.send(connect::end(Some(&err))).await;
                        return;
                    }
                    ProcessEvent::Start { .. } | ProcessEvent::Dropped { .. } => None,
                };
                if let Some(out) = out {
                    tick.reset();
                    let data = event(pb::process_event::Event::Data(
                        pb::process_event::DataEvent { output: Some(out) },
                    ));
                    if tx.send(data).await.is_err() {
                        // The client went away; the process goes on (as envd's do).
                        return;
                    }
                }
            }
        }
    });
    connect::stream_response(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The agent's re-attach stream of process `sel`.
async fn attach(
    agent: &AgentClient,
    sel: &ProcessSelector,
    replay: bool,
) -> ConnectResult<http::Response<hyper::body::Incoming>> {
    agent.events(sel, replay).await.map_err(agent_error)
}

/// `/process.Process/{method}`.
pub(super) async fn handle(
    e: &E2b,
    id: &str,
    agent: &AgentClient,
    user: &User,
    method: &str,
    headers: &http::HeaderMap,
    body: Body,
) -> Response {
    use axum::response::IntoResponse;
    let stream = connect::is_stream(headers);
    let result = match method {
        "Start" => return start(e, id, agent, user, headers, body).await,
        "Connect" => return connect_to(agent, headers, body).await,
        "StreamInput" => return stream_input(agent, body).await,
        "List" => list(agent).await,
        "SendInput" => send_input(agent, body).await,
        "SendSignal" => send_signal(agent, body).await,
        "CloseStdin" => close_stdin(agent, body).await,
        "Update" => update(agent, body).await,
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("process.Process/{other} is not a method of this service"),
        )),
    };
    match (result, stream) {
        (Ok(r), _) => r,
        (Err(err), true) => connect::stream_error(err),
        (Err(err), false) => err.into_response(),
    }
}

async fn start(
    e: &E2b,
    id: &str,
    agent: &AgentClient,
    user: &User,
    headers: &http::HeaderMap,
    body: Body,
) -> Response {
    let req: pb::StartRequest = match Envelopes::new(body).next().await {
        Ok(Some(r)) => r,
        Ok(None) => {
            return connect::stream_error(ConnectError::new(
                Code::InvalidArgument,
                "no request message",
            ))
        }
        Err(err) => return connect::stream_error(err),
    };
    let Some(p) = req.process else {
        return connect::stream_error(ConnectError::new(
            Code::InvalidArgument,
            "process is missing",
        ));
    };
    if p.cmd.is_empty() {
        return connect::stream_error(ConnectError::new(
            Code::InvalidArgument,
            "process.cmd is empty",
        ));
    }
    let mut cmd = vec![p.cmd.clone()];
    cmd.extend(p.args.iter().cloned());
    let pty = req
        .pty
        .as_ref()
        .and_then(|t| t.size.as_ref())
        .map(|s| PtySize {
            cols: s.cols.clamp(1, u16::MAX as u32) as u16,
            rows: s.rows.clamp(1, u16::MAX as u32) as u16,
        });
    let start = StartProcessRequest {
        cmd: Some(cmd),
        command: None,
        cwd: Some(user.resolve(p.cwd.as_deref().unwrap_or(""))),
        env: p.envs.into_iter().collect(),
        user: Some(user.name.clone()),
        // envd kills a process at its call's deadline, and never otherwise.
        timeout: Some(connect::timeout(headers).map_or(0.0, |d| d.as_secs_f64())),
        stdin: pty.is_some() || req.stdin.unwrap_or(true),
        tag: req.tag.clone(),
        pty,
        background: true,
    };
    let info: ProcessInfo = match agent.start_background(&start).await {
        Ok(i) => i,
        Err(err) => return connect::stream_error(agent_error(err)),
    };
    e.app.audit.watch(id);
    match attach(agent, &ProcessSelector::Pid(info.pid), true).await {
        Ok(resp) => stream_events(info.pid, resp, connect::keepalive(headers)),
        Err(err) => connect::stream_error(err),
    }
}

async fn connect_to(agent: &AgentClient, headers: &http::HeaderMap, body: Body) -> Response {
    let req: pb::ConnectRequest = match Envelopes::new(body).next().await {
        Ok(Some(r)) => r,
        Ok(None) => {
            return connect::stream_error(ConnectError::new(
                Code::InvalidArgument,
                "no request message",
            ))
        }
        Err(err) => return connect::stream_error(err),
    };
    let sel = match selector(req.process.as_ref()) {
        Ok(s) => s,
        Err(err) => return connect::stream_error(err),
    };
    let pid = match find(agent, &sel).await {
        Ok(p) => p.pid,
        Err(err) => return connect::stream_error(err),
    };
    // envd's connect streams from now on: what was written before is not replayed.
    match attach(agent, &ProcessSelector::Pid(pid), false).await {
        Ok(resp) => stream_events(pid, resp, connect::keepalive(headers)),
        Err(err) => connect::stream_error(err),
    }
}

/// The process `sel` names (a pid, or the tag of a running one).
async fn find(agent: &AgentClient, sel: &ProcessSelector) -> ConnectResult<ProcessInfo> {
    let list = agent.processes().await.map_err(agent_error)?;
    let by_pid = match sel {
        ProcessSelector::Pid(pid) => Some(*pid),
        ProcessSelector::Tag(_) => None,
    };
    list.processes
        .into_iter()
        .find(|p| match sel {
            // envd knows only running processes: one that exited is not found.
            ProcessSelector::Pid(pid) => p.running && p.pid == *pid,
            ProcessSelector::Tag(tag) => p.running && p.tag.as_ref() == Some(tag),
        })
        .ok_or_else(|| {
            ConnectError::new(
                Code::NotFound,
                format!(
                    "process with {} {sel} not found",
                    if by_pid.is_some() { "pid" } else { "tag" }
                ),
            )
        })
}

async fn list(agent: &AgentClient) -> ConnectResult<Response> {
    let list = agent.processes().await.map_err(agent_error)?;
    let processes = list
        .processes
        .into_iter()
        .filter(|p| p.running)
        .map(|p| {
            let mut argv = p.cmd.into_iter();
            pb::ProcessInfo {
                config: Some(pb::ProcessConfig {
                    cmd: argv.next().unwrap_or_default(),
                    args: argv.collect(),
                    envs: p.env.into_iter().collect(),
                    cwd: Some(p.cwd),
                }),
                pid: p.pid,
                tag: p.tag,
            }
        })
        .collect();
    Ok(connect::unary_response(&pb::ListResponse { processes }))
}

/// Writes input bytes to a process's stdin (or its PTY).
async fn write_input(
    agent: &AgentClient,
    sel: &ProcessSelector,
    input: Option<pb::ProcessInput>,
) -> ConnectResult<()> {
    let bytes = match input.and_then(|i| i.input) {
        Some(pb::process_input::Input::Stdin(b)) | Some(pb::process_input::Input::Pty(b)) => b,
        None => return Err(ConnectError::new(Code::InvalidArgument, "input is missing")),
    };
    agent
        .stdin(sel, Body::from(bytes))
        .await
        .map_err(agent_error)
}

async fn send_input(agent: &AgentClient, body: Body) -> ConnectResult<Response> {
    let req: pb::SendInputRequest = connect::unary_request(body).await?;
    let sel = selector(req.process.as_ref())?;
    write_input(agent, &sel, req.input).await?;
    Ok(connect::unary_response(&pb::SendInputResponse {}))
}

/// A client stream: `start` names the process, then `data` messages carry its input, in order.
async fn stream_input(agent: &AgentClient, body: Body) -> Response {
    let result = async {
        let mut env = Envelopes::new(body);
        let mut sel: Option<ProcessSelector> = None;
        while let Some(msg) = env.next::<pb::StreamInputRequest>().await? {
            use pb::stream_input_request::Event;
            match msg.event {
                Some(Event::Start(s)) => sel = Some(selector(s.process.as_ref())?),
                Some(Event::Data(d)) => {
                    let Some(sel) = &sel else {
                        return Err(ConnectError::new(
                            Code::InvalidArgument,
                            "the stream's first message must be start",
                        ));
                    };
                    write_input(agent, sel, d.input).await?;
                }
                Some(Event::Keepalive(_)) | None => {}
            }
        }
        Ok(())
    }
    .await;
    let body = match result {
        Ok(()) => vec![
            connect::message(&pb::StreamInputResponse {}),
            connect::end(None),
        ],
        Err(err) => vec![connect::end(Some(&err))],
    };
    connect::stream_response(futures::stream::iter(body))
}

async fn send_signal(agent: &AgentClient, body: Body) -> ConnectResult<Response> {
    let req: pb::SendSignalRequest = connect::unary_request(body).await?;
    let sel = selector(req.process.as_ref())?;
    let signal = match req.signal() {
        pb::Signal::Sigkill => "SIGKILL",
        pb::Signal::Sigterm => "SIGTERM",
        pb::Signal::Unspecified => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM",
            ))
        }
    };
    agent.signal(&sel, signal).await.map_err(agent_error)?;
    Ok(connect::unary_response(&pb::SendSignalResponse {}))
}

async fn close_stdin(agent: &AgentClient, body: Body) -> ConnectResult<Response> {
    let req: pb::CloseStdinRequest = connect::unary_request(body).await?;
    let sel = selector(req.process.as_ref())?;
    agent.close_stdin(&sel).await.map_err(agent_error)?;
    Ok(connect::unary_response(&pb::CloseStdinResponse {}))
}

async fn update(agent: &AgentClient, body: Body) -> ConnectResult<Response> {
    let req: pb::UpdateRequest = connect::unary_request(body).await?;
    let sel = selector(req.process.as_ref())?;
    if let Some(size) = req.pty.and_then(|p| p.size) {
        let size = PtySize {
            cols: size.cols.clamp(1, u16::MAX as u32) as u16,
            rows: size.rows.clamp(1, u16::MAX as u32) as u16,
        };
        agent.resize(&sel, size).await.map_err(agent_error)?;
    }
    Ok(connect::unary_response(&pb::UpdateResponse {}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_read_as_envd_writes_them() {
        let ok = end_event(&ExitStatus {
            exit_code: Some(0),
            ..Default::default()
        });
        assert_eq!(
            (ok.exit_code, ok.exited, ok.error.is_none()),
            (0, true, true)
        );
        let failed = end_event(&ExitStatus {
            exit_code: Some(3),
            ..Default::default()
        });
        assert_eq!(failed.error.as_deref(), Some("exit status 3"));
        let killed = end_event(&ExitStatus {
            signal: Some("SIGKILL".into()),
            ..Default::default()
        });
        assert_eq!(
            (killed.exit_code, killed.status.as_str()),
            (-1, "signal: killed")
        );
    }

    #[test]
    fn selectors() {
        let pid = pb::ProcessSelector {
            selector: Some(pb::process_selector::Selector::Pid(7)),
        };
        assert_eq!(selector(Some(&pid)).unwrap(), ProcessSelector::Pid(7));
        let tag = pb::ProcessSelector {
            selector: Some(pb::process_selector::Selector::Tag("123".into())),
        };
        assert_eq!(
            selector(Some(&tag)).unwrap_err().code,
            Code::InvalidArgument
        );
        assert!(selector(None).is_err());
    }
}
