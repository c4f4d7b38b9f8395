//! Accepting connections, serving each with HTTP/2 (prior knowledge) and routing by method + path.

use moat_api::protocol::endpoint;
use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use moat_api::protocol::{resolve, AgentHealth, Resolved, Route};
use moat_api::{ErrorBody, ErrorCode, AGENT_PROTOCOL_VERSION};
use std::path::PathBuf;

use tokio::net::UnixListener;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::JoinSet;

use moat_api::checkpoint;

use crate::http::{full, json, ApiError, HandlerResult, RespBody};
use crate::process::Processes;
use crate::{fsops, procapi, tarops, watch};

/// State shared by all connections.
pub struct Agent {
    pub procs: Arc<Processes>,
    /// The agent's own environment at start, plus what `POST /env` added: the base of every
    /// process's environment.
    pub base_env: std::sync::RwLock<BTreeMap<String, String>>,
}

/// Accepts connections forever.
///
/// With `rebind` (the agent bound its socket at a path, as on the gvisor tier), SIGUSR1 asks the
/// agent to let go of every host resource it holds for the daemon, so that the sandbox can be
/// checkpointed (gVisor cannot save a socket bound to a host file, nor one connected through it).
/// It acts only when the daemon asked for it first ([`checkpoint::REQUEST`] next to the socket): it
/// closes every connection and its listener, then creates [`checkpoint::QUIESCED`] there, which tells the daemon
/// it is done (the socket file itself cannot be removed from inside gVisor: the daemon removes it).
/// It binds the socket again on SIGUSR2 (the daemon sends it once the checkpoint is written, to the
/// sandbox and to every restored copy), or by itself after [`QUIESCE_MAX`].
pub async fn serve(mut listener: UnixListener, agent: Arc<Agent>, rebind: Option<PathBuf>) {
    let signals = match &rebind {
        Some(_) => match (
            signal(SignalKind::user_defined1()),
            signal(SignalKind::user_defined2()),
        ) {
            (Ok(a), Ok(b)) => Some((a, b)),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("moat-agent: signal handlers: {e}");
                None
            }
        },
        None => None,
    };
    let Some((mut quiesce, mut wake)) = signals else {
        let mut conns = JoinSet::new();
        loop {
            accept_one(&listener, &agent, &mut conns).await;
        }
    };
    let Some(path) = rebind else { return };
    let dir = path
        .parent()
        .unwrap_or(std::path::Path::new("/"))
        .to_path_buf();
    loop {
        let mut conns = JoinSet::new();
        loop {
            tokio::select! {
                _ = accept_one(&listener, &agent, &mut conns) => {}
                _ = quiesce.recv() => {
                    if !dir.join(checkpoint::REQUEST).exists() {
                        eprintln!("moat-agent: SIGUSR1 without a checkpoint request; ignored");
                        continue;
                    }
                    let held = host_sockets(&path);
                    if held.is_empty() {
                        break;
                    }
                    // Written whole under another name first: the daemon reads it once it exists.
                    let tmp = dir.join(format!("{}.tmp", checkpoint::REFUSED));
                    if let Err(e) = std::fs::write(&tmp, held.join("\n"))
                        .and_then(|()| std::fs::rename(&tmp, dir.join(checkpoint::REFUSED)))
                    {
                        eprintln!("moat-agent: writing {}: {e}", checkpoint::REFUSED);
                    }
                }
                // A SIGUSR2 while serving means nothing; drained so that it cannot end a later wait.
                _ = wake.recv() => {}
            }
        }
        conns.abort_all();
        while conns.join_next().await.is_some() {}
        drop(listener);
        if let Err(e) = std::fs::write(dir.join(checkpoint::QUIESCED), b"") {
            eprintln!("moat-agent: writing {}: {e}", checkpoint::QUIESCED);
        }
        eprintln!("moat-agent: quiesced for a checkpoint");
        tokio::select! {
            _ = wake.recv() => {}
            _ = tokio::time::sleep(QUIESCE_MAX) => eprintln!("moat-agent: no SIGUSR2; listening again"),
        }
        let _ = std::fs::remove_file(dir.join(checkpoint::QUIESCED));
        listener = loop {
            let _ = std::fs::remove_file(&path);
            match std::os::unix::net::UnixListener::bind(&path)
                .and_then(|l| {
                    l.set_nonblocking(true)?;
                    Ok(l)
                })
                .and_then(UnixListener::from_std)
            {
                Ok(l) => break l,
                Err(e) => {
                    eprintln!("moat-agent: binding {}: {e}", path.display());
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
            }
        };
    }
}

/// Paths of the Unix sockets processes of the sandbox have bound to files on a filesystem other
/// than a tmpfs (one the gofer serves: gVisor makes them host sockets, which runsc cannot save),
/// except the agent's own `own`.
fn host_sockets(own: &std::path::Path) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    let mut held: Vec<String> = moat_api::unix_sockets_bound_to_paths(&table)
        .into_iter()
        .map(|(_, p)| p)
        .filter(|p| std::path::Path::new(p) != own && !on_tmpfs(p))
        .collect();
    held.sort();
    held.dedup();
    held
}

/// Whether the directory of `path` is on a tmpfs (in the Sentry's memory).
fn on_tmpfs(path: &str) -> bool {
    let dir = std::path::Path::new(path)
        .parent()
        .unwrap_or(std::path::Path::new("/"));
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    // SAFETY: statfs writes into the zeroed struct we own; `c` is a valid C string.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC
    }
}

/// Longest the agent stays unreachable after SIGUSR1 without a SIGUSR2.
pub const QUIESCE_MAX: std::time::Duration = std::time::Duration::from_secs(60);

/// Accepts one connection and serves it in a task of `conns` (finished ones are reaped as it goes).
async fn accept_one(listener: &UnixListener, agent: &Arc<Agent>, conns: &mut JoinSet<()>) {
    while conns.try_join_next().is_some() {}
    let stream = match listener.accept().await {
        Ok((s, _)) => s,
        Err(e) => {
            eprintln!("moat-agent: accept: {e}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            return;
        }
    };
    conns.spawn(serve_stream(stream, Arc::clone(agent)));
}

/// Serves one HTTP/2 connection over any byte stream (a unix socket, a VM's serial port).
pub async fn serve_stream<S>(stream: S, agent: Arc<Agent>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let svc = service_fn(move |req| handle(Arc::clone(&agent), req));
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(4 << 20)
        .max_concurrent_streams(1024);
    if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
        eprintln!("moat-agent: connection ended: {e}");
    }
}

/// Answers one request; errors become JSON error responses, never panics.
pub async fn handle(
    agent: Arc<Agent>,
    req: Request<Incoming>,
) -> Result<Response<RespBody>, Infallible> {
    let (parts, body) = req.into_parts();
    let resp = route(
        &agent,
        &parts.method,
        parts.uri.path(),
        parts.uri.query(),
        body,
    )
    .await
    .unwrap_or_else(ApiError::into_response);
    Ok(resp)
}

fn method_not_allowed(method: &Method, path: &str, allowed: &[Method]) -> HandlerResult {
    let body = ErrorBody::new(
        ErrorCode::InvalidArgument,
        format!("method {method} is not allowed on {path}"),
    );
    let mut resp = Response::new(full(serde_json::to_vec(&body).unwrap_or_default()));
    *resp.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    let allow: Vec<&str> = allowed.iter().map(Method::as_str).collect();
    if let Ok(v) = header::HeaderValue::from_str(&allow.join(", ")) {
        resp.headers_mut().insert(header::ALLOW, v);
    }
    Ok(resp)
}

/// Dispatches by the protocol's route table (`moat_api::protocol`): 404 and 405 come from the
/// table, and the `match` names every route, so the agent serves exactly what the daemon can ask.
async fn route(
    agent: &Agent,
    method: &Method,
    path: &str,
    query: Option<&str>,
    body: Incoming,
) -> HandlerResult {
    let (route, sel) = match resolve(method, path) {
        Resolved::Found { route, process } => (route, process.unwrap_or("")),
        Resolved::MethodNotAllowed(allowed) => return method_not_allowed(method, path, &allowed),
        Resolved::NotFound => return Err(ApiError::not_found(format!("no endpoint {path}"))),
    };
    match route {
        Route::Health => json(
            StatusCode::OK,
            &AgentHealth {
                protocol: AGENT_PROTOCOL_VERSION,
                version: env!("CARGO_PKG_VERSION").to_string(),
            },
        ),
        Route::SetEnv => set_env(agent, body).await,
        Route::Configure => set_config(agent, body).await,
        Route::ListProcesses => procapi::list(agent),
        Route::Journal => procapi::journal(agent, query),
        Route::StartProcess => procapi::start(agent, body).await,
        Route::ProcessEvents => procapi::events(agent, sel, query),
        Route::ProcessStdin => procapi::stdin(agent, sel, body).await,
        Route::ProcessCloseStdin => procapi::close_stdin(agent, sel),
        Route::ProcessSignal => procapi::signal(agent, sel, body).await,
        Route::ProcessResize => procapi::resize(agent, sel, body).await,
        Route::ReadFile => fsops::read_file(query).await,
        Route::WriteFile => fsops::write_file(query, body).await,
        Route::Stat => fsops::stat(query),
        Route::Exists => fsops::exists(query),
        Route::ListDir => fsops::list(query).await,
        Route::Mkdir => fsops::mkdir(body).await,
        Route::Rename => fsops::rename(body).await,
        Route::Remove => fsops::remove(query).await,
        Route::DownloadTar => tarops::download(query),
        Route::UploadTar => tarops::upload(query, body).await,
        Route::Watch => watch::watch(query),
        Route::Tcp => crate::tcp::tunnel(query, body).await,
        Route::VmFreeze => crate::layerops::freeze(body).await,
        Route::VmClock => crate::layerops::set_clock(body).await,
        Route::VmNetwork => crate::layerops::set_network(body).await,
        Route::VmLayer => crate::layerops::download(query),
    }
}

/// `POST /config`: the sandbox's per-process limits and its OOM counter file (see docs/resources.md).
async fn set_config(agent: &Agent, body: Incoming) -> HandlerResult {
    let c = crate::http::body_of::<endpoint::Configure, _>(body).await?;
    if c.nofile.is_some_and(|n| n < 16) {
        return Err(ApiError::invalid("nofile", "nofile must be at least 16"));
    }
    if c.output_bytes
        .is_some_and(|n| !(4096..=1 << 30).contains(&n))
    {
        return Err(ApiError::invalid(
            "output_bytes",
            "output_bytes must be 4096..=1073741824",
        ));
    }
    if c.command_timeout
        .is_some_and(|t| !t.is_finite() || !(0.0..=1e9).contains(&t))
    {
        return Err(ApiError::invalid(
            "command_timeout",
            "command_timeout must be a non-negative number of seconds",
        ));
    }
    if let Some(id) = &c.identity {
        if id.machine_id.len() != 32 || !id.machine_id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(ApiError::invalid(
                "identity.machine_id",
                "a machine id is 32 hex digits",
            ));
        }
        if id.hostname.is_empty() || id.hostname.len() > 64 || id.hostname.contains('\0') {
            return Err(ApiError::invalid(
                "identity.hostname",
                "a hostname is 1 to 64 bytes",
            ));
        }
        for missed in crate::identity::apply(id, &agent.base_env) {
            eprintln!("moat-agent: identity: {missed}");
        }
    }
    if let Some(pem) = &c.egress_ca {
        if !pem.starts_with("-----BEGIN CERTIFICATE-----") || pem.len() > 64 * 1024 {
            return Err(ApiError::invalid(
                "egress_ca",
                "a PEM certificate of at most 64 KiB",
            ));
        }
        for missed in crate::trust::install(pem, &agent.base_env) {
            eprintln!("moat-agent: egress CA: {missed}");
        }
    }
    agent.procs.configure(&c);
    crate::http::no_content()
}

/// `POST /env`: merges variables into the base environment of processes started from now on (a
/// sandbox taken from the warm pool gets the environment its creator asked for this way).
async fn set_env(agent: &Agent, body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::SetEnv, _>(body).await?;
    for k in req.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ApiError::invalid(
                &format!("env.{k}"),
                "invalid environment variable name",
            ));
        }
    }
    if req.env.values().any(|v| v.contains('\0')) {
        return Err(ApiError::invalid(
            "env",
            "environment values may not contain NUL",
        ));
    }
    let mut env = agent
        .base_env
        .write()
        .map_err(|_| ApiError::internal("environment lock poisoned"))?;
    env.extend(req.env);
    crate::http::no_content()
}
