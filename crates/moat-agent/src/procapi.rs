//! Process endpoints: start, list, events (re-attach), stdin, close-stdin, signal, resize.

use moat_api::protocol::endpoint;
use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use moat_api::{ProcessEvent, ProcessList, ProcessSelector, NDJSON};
use tokio::sync::mpsc;

use crate::http::{json, ndjson_line, no_content, streamed, ApiError, HandlerResult};
use crate::process::{arm_timeout, master_fd, signal_group, Proc, SpawnSpec};
use crate::ring::{Item, Reader};
use crate::server::Agent;
use crate::users;

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `POST /processes`
pub async fn start(agent: &Agent, body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::StartProcess, _>(body).await?;
    let argv = match (&req.cmd, &req.command) {
        (Some(cmd), None) if !cmd.is_empty() => cmd.clone(),
        (None, Some(command)) => {
            let shell = if Path::new("/bin/bash").exists() {
                "/bin/bash"
            } else {
                "/bin/sh"
            };
            vec![shell.to_string(), "-c".to_string(), command.clone()]
        }
        _ => {
            return Err(ApiError::invalid(
                "cmd",
                "exactly one of cmd (a non-empty argv) or command must be given",
            ))
        }
    };
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid(
            "cmd",
            "arguments may not contain NUL bytes",
        ));
    }
    if let Some(tag) = &req.tag {
        moat_api::validate_tag(tag).map_err(|e| ApiError::invalid("tag", e))?;
    }
    if let Some(t) = req.timeout {
        if !t.is_finite() || t < 0.0 {
            return Err(ApiError::invalid(
                "timeout",
                "timeout must be a non-negative number of seconds",
            ));
        }
    }
    if let Some(size) = req.pty {
        if size.cols == 0 || size.rows == 0 {
            return Err(ApiError::invalid(
                "pty",
                "pty cols and rows must be at least 1",
            ));
        }
    }
    let (default_user, default_cwd) = agent.procs.defaults();
    let user = users::lookup(
        req.user.as_deref().or(default_user.as_deref()),
        Path::new("/etc"),
    )
    .map_err(|e| ApiError::invalid("user", e))?;
    let base_env = agent
        .base_env
        .read()
        .map_err(|_| ApiError::internal("environment lock poisoned"))?
        .clone();
    let env = build_env(&base_env, &req.env, &user, req.pty.is_some())?;
    let home = PathBuf::from(&user.home);
    let cwd = match &req.cwd {
        Some(c) => {
            let p = home.join(c);
            if !p.is_dir() {
                return Err(ApiError::invalid(
                    "cwd",
                    format!("working directory {c:?} does not exist"),
                ));
            }
            p
        }
        None => match default_cwd.map(PathBuf::from).filter(|p| p.is_dir()) {
            Some(p) => p,
            None if home.is_dir() => home,
            None => PathBuf::from("/"),
        },
    };
    let path_var = env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or(DEFAULT_PATH);
    let program = resolve_program(&argv[0], path_var, &cwd)
        .ok_or_else(|| ApiError::invalid("cmd", format!("program {:?} not found", argv[0])))?;
    let spec = SpawnSpec {
        program,
        argv,
        env,
        asked_env: req.env.clone(),
        cwd,
        user,
        pty: req.pty,
        stdin: req.stdin,
        tag: req.tag.clone(),
    };
    let (proc, reader) = agent.procs.spawn(spec, !req.background)?;
    let default_timeout = agent
        .procs
        .default_timeout_ms
        .load(std::sync::atomic::Ordering::SeqCst) as f64
        / 1000.0;
    // A request's own timeout wins (0 means none); without one the sandbox's default applies.
    if let Some(t) = req.timeout.or(Some(default_timeout)).filter(|t| *t > 0.0) {
        arm_timeout(Arc::clone(&proc), t);
    }
    match reader {
        Some(reader) => Ok(event_stream(proc, reader)),
        None => json(StatusCode::CREATED, &proc.info()),
    }
}

/// The environment of a new process: the agent's, the user's variables, the request's, then defaults.
fn build_env(
    base: &BTreeMap<String, String>,
    extra: &BTreeMap<String, String>,
    user: &users::User,
    pty: bool,
) -> Result<Vec<(String, String)>, ApiError> {
    let mut env = base.clone();
    env.insert("HOME".into(), user.home.clone());
    env.insert("USER".into(), user.name.clone());
    env.insert("LOGNAME".into(), user.name.clone());
    env.insert("SHELL".into(), user.shell.clone());
    for (k, v) in extra {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ApiError::invalid(
                "env",
                format!("invalid environment variable {k:?}"),
            ));
        }
        env.insert(k.clone(), v.clone());
    }
    env.entry("PATH".into())
        .or_insert_with(|| DEFAULT_PATH.into());
    if pty {
        env.entry("TERM".into())
            .or_insert_with(|| "xterm-256color".into());
    }
    Ok(env.into_iter().collect())
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Finds the program like execvp would: names with a '/' are paths (relative to `cwd`), others are
/// looked up in `path_var`.
pub fn resolve_program(prog: &str, path_var: &str, cwd: &Path) -> Option<PathBuf> {
    if prog.is_empty() {
        return None;
    }
    if prog.contains('/') {
        let p = cwd.join(prog);
        return is_executable(&p).then_some(p);
    }
    path_var
        .split(':')
        .map(|dir| {
            if dir.is_empty() {
                cwd.to_path_buf()
            } else {
                cwd.join(dir)
            }
        })
        .map(|dir| dir.join(prog))
        .find(|p| is_executable(p))
}

/// NDJSON response of `start`, then `reader`'s items until `exit`.
fn event_stream(proc: Arc<Proc>, mut reader: Reader) -> http::Response<crate::http::RespBody> {
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(16);
    let start = ProcessEvent::Start {
        pid: proc.pid,
        tag: proc.tag.clone(),
    };
    tokio::spawn(async move {
        if tx.send(Ok(ndjson_line(&start))).await.is_err() {
            return;
        }
        loop {
            let item = tokio::select! {
                item = reader.next() => item,
                _ = tx.closed() => return,
            };
            let (event, last) = match item {
                Item::Chunk(c) => (c.to_event(), false),
                Item::Dropped(bytes) => (ProcessEvent::Dropped { bytes }, false),
                Item::Exit(status) => (ProcessEvent::Exit(status), true),
            };
            if tx.send(Ok(ndjson_line(&event))).await.is_err() || last {
                return;
            }
        }
    });
    streamed(NDJSON, rx, None)
}

fn selected(agent: &Agent, sel: &str) -> Result<Arc<Proc>, ApiError> {
    let sel = ProcessSelector::parse(sel).map_err(|e| ApiError::invalid("process", e))?;
    agent
        .procs
        .find(&sel)
        .ok_or_else(|| ApiError::not_found(format!("process {sel} not found")))
}

/// `GET /processes`
pub fn list(agent: &Agent) -> HandlerResult {
    json(
        StatusCode::OK,
        &ProcessList {
            processes: agent.procs.list(),
        },
    )
}

/// `GET /journal`
pub fn journal(agent: &Agent, query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::Journal>(query)?;
    json(StatusCode::OK, &agent.procs.journal.read(&q))
}

/// `GET /processes/{sel}/events`
pub fn events(agent: &Agent, sel: &str, query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::ProcessEvents>(query)?;
    let proc = selected(agent, sel)?;
    let reader = proc.ring.attach(q.replay.unwrap_or(true));
    Ok(event_stream(proc, reader))
}

/// `POST /processes/{sel}/stdin`: copies the body to stdin frame by frame.
pub async fn stdin(agent: &Agent, sel: &str, mut body: Incoming) -> HandlerResult {
    let proc = selected(agent, sel)?;
    if !proc.running() {
        return Err(ApiError::conflict(format!(
            "process {} has exited",
            proc.pid
        )));
    }
    let Some(file) = proc.stdin() else {
        return Err(ApiError::conflict(format!(
            "stdin of process {} is not open",
            proc.pid
        )));
    };
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ApiError::invalid("body", format!("reading request body: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        let f = Arc::clone(&file);
        tokio::task::spawn_blocking(move || (&*f).write_all(&data))
            .await
            .map_err(|e| ApiError::internal(format!("stdin writer: {e}")))?
            .map_err(|e| {
                ApiError::conflict(format!("writing stdin of process {}: {e}", proc.pid))
            })?;
    }
    no_content()
}

/// `POST /processes/{sel}/close-stdin`
pub fn close_stdin(agent: &Agent, sel: &str) -> HandlerResult {
    let proc = selected(agent, sel)?;
    if !proc.close_stdin() {
        return Err(ApiError::conflict(format!(
            "stdin of process {} is not open",
            proc.pid
        )));
    }
    no_content()
}

/// `POST /processes/{sel}/signal`
pub async fn signal(agent: &Agent, sel: &str, body: Incoming) -> HandlerResult {
    let proc = selected(agent, sel)?;
    let req = crate::http::body_of::<endpoint::ProcessSignal, _>(body).await?;
    let sig = moat_api::parse_signal(&req.signal).map_err(|e| ApiError::invalid("signal", e))?;
    if !proc.running() {
        return Err(ApiError::conflict(format!(
            "process {} has exited",
            proc.pid
        )));
    }
    signal_group(&proc, sig).map_err(|e| match e.raw_os_error() {
        Some(libc::ESRCH) => ApiError::conflict(format!("process {} has exited", proc.pid)),
        _ => ApiError::io("kill", &e),
    })?;
    no_content()
}

/// `POST /processes/{sel}/resize`
pub async fn resize(agent: &Agent, sel: &str, body: Incoming) -> HandlerResult {
    let proc = selected(agent, sel)?;
    let size = crate::http::body_of::<endpoint::ProcessResize, _>(body).await?;
    if size.cols == 0 || size.rows == 0 {
        return Err(ApiError::invalid(
            "cols",
            "cols and rows must be at least 1",
        ));
    }
    let Some(fd) = master_fd(&proc) else {
        return Err(ApiError::conflict(format!(
            "process {} has no pty",
            proc.pid
        )));
    };
    if !proc.running() {
        return Err(ApiError::conflict(format!(
            "process {} has exited",
            proc.pid
        )));
    }
    crate::pty::resize(fd, size).map_err(|e| ApiError::io("resize", &e))?;
    no_content()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn program_resolution() {
        let cwd = Path::new("/");
        assert_eq!(
            resolve_program("sh", DEFAULT_PATH, cwd).map(|p| p.is_absolute()),
            Some(true)
        );
        assert!(resolve_program("definitely-not-a-program-xyz", DEFAULT_PATH, cwd).is_none());
        assert!(resolve_program("/etc/passwd", DEFAULT_PATH, cwd).is_none()); // not executable
        assert!(resolve_program("", DEFAULT_PATH, cwd).is_none());
    }

    #[test]
    fn env_layering() {
        let base: BTreeMap<String, String> = [
            ("A".to_string(), "1".to_string()),
            ("HOME".into(), "/x".into()),
        ]
        .into();
        let extra: BTreeMap<String, String> = [("B".to_string(), "2".to_string())].into();
        let user = users::lookup_in(Some("root"), "", "").unwrap_or_else(|e| panic!("{e}"));
        let env: BTreeMap<String, String> = build_env(&base, &extra, &user, true)
            .unwrap_or_else(|e| panic!("{e:?}"))
            .into_iter()
            .collect();
        assert_eq!(env.get("A").map(String::as_str), Some("1"));
        assert_eq!(env.get("B").map(String::as_str), Some("2"));
        assert_eq!(env.get("HOME").map(String::as_str), Some("/root"));
        assert_eq!(env.get("PATH").map(String::as_str), Some(DEFAULT_PATH));
        assert_eq!(env.get("TERM").map(String::as_str), Some("xterm-256color"));
        let bad: BTreeMap<String, String> = [("A=B".to_string(), "x".to_string())].into();
        assert!(build_env(&base, &bad, &user, false).is_err());
    }
}
