//! A template's start command (`[start]` of its spec): started in the background with tag `start`
//! whenever a sandbox of the template boots (create, reset, resume over its files), then waited for
//! until its ready check passes. A create fails, with the command's output, when it ends first or
//! the check does not pass in time.

use std::time::Duration;

use anyhow::{bail, Result};
use moat_api::{
    ProcessEvent, ProcessInfo, ProcessList, ReadyCheck, StartProcessRequest, StartSpec,
};

use crate::agent::{chunk_bytes, AgentClient};

/// The tag of the start command's process (`GET /v1/sandboxes/{id}/processes/start/events`).
pub const TAG: &str = "start";

/// How often the ready check is tried.
const POLL: Duration = Duration::from_millis(200);

/// Most bytes of the command's output an error shows.
const TAIL: usize = 4096;

pub async fn run(agent: &AgentClient, start: &StartSpec) -> Result<()> {
    let req = StartProcessRequest {
        command: Some(start.cmd.clone()),
        background: true,
        tag: Some(TAG.into()),
        ..Default::default()
    };
    let info: ProcessInfo = agent
        .start_background(&req)
        .await
        .map_err(|e| anyhow::anyhow!("the start command {:?} did not start: {e}", start.cmd))?;
    let Some(check) = &start.ready else {
        return Ok(());
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(start.timeout);
    loop {
        if is_ready(agent, check).await {
            return Ok(());
        }
        let procs: ProcessList = agent.processes().await?;
        if let Some(p) = procs
            .processes
            .iter()
            .find(|p| p.pid == info.pid && !p.running)
        {
            let how = match &p.exit {
                Some(e) => match (&e.exit_code, &e.signal, &e.error) {
                    (_, _, Some(err)) => err.clone(),
                    (Some(c), _, _) => format!("exit code {c}"),
                    (_, Some(s), _) => format!("signal {s}"),
                    _ => "ended".into(),
                },
                None => "ended".into(),
            };
            bail!(
                "the start command {:?} ended ({how}) before the sandbox was ready ({}); its output:\n{}",
                start.cmd,
                describe(check),
                output_tail(agent, info.pid).await
            );
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "the start command {:?} was not ready ({}) after {} s; its output so far:\n{}",
                start.cmd,
                describe(check),
                start.timeout,
                output_tail(agent, info.pid).await
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The check as the errors name it.
pub fn describe(check: &ReadyCheck) -> String {
    match check {
        ReadyCheck::Port(p) => format!("port {p} accepting connections"),
        ReadyCheck::File(f) => format!("file {f} existing"),
        ReadyCheck::Command(c) => format!("command {c:?} exiting 0"),
    }
}

async fn is_ready(agent: &AgentClient, check: &ReadyCheck) -> bool {
    match check {
        // The agent connects to the port inside the sandbox and answers an error when nothing listens.
        ReadyCheck::Port(p) => agent.tcp_tunnel(*p).await.is_ok(),
        ReadyCheck::File(f) => agent.exists(f).await.unwrap_or(false),
        ReadyCheck::Command(c) => {
            let req = StartProcessRequest {
                command: Some(c.clone()),
                timeout: Some(10.0),
                ..Default::default()
            };
            agent
                .run_streamed(&req, |_| {})
                .await
                .is_ok_and(|e| e.exit_code == Some(0))
        }
    }
}

/// The last [`TAIL`] bytes of a process's output (what the agent still holds of it).
async fn output_tail(agent: &AgentClient, pid: u32) -> String {
    let mut out: Vec<u8> = Vec::new();
    let sel = moat_api::ProcessSelector::Pid(pid);
    let collect = agent.replay(&sel, |ev| {
        if let ProcessEvent::Stdout(c) | ProcessEvent::Stderr(c) | ProcessEvent::Pty(c) = ev {
            out.extend(chunk_bytes(c));
            if out.len() > 2 * TAIL {
                out.drain(..out.len() - TAIL);
            }
        }
    });
    // A running process's stream does not end: take what came within a moment.
    let _ = tokio::time::timeout(Duration::from_millis(500), collect).await;
    let start = out.len().saturating_sub(TAIL);
    String::from_utf8_lossy(&out[start..]).into_owned()
}
