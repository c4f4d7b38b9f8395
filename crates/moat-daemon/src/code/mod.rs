//! Code interpreter: stateful cells with rich results, E2B's `run_code` done with moat's own pieces.
//!
//! Each code context is one long-running kernel process inside the sandbox, started through the agent
//! as a background process with `stdin: true` and the tag `moat-kernel-<context>`. The daemon keeps no
//! state of its own about contexts: the agent's process list (running processes with that tag prefix)
//! is the list of contexts, so contexts survive a daemon restart.
//!
//! * python / javascript: `kernel.py` / `kernel.js` (embedded here, written to `/tmp/.moat/` in the
//!   sandbox when a context starts) read one JSON request per line on stdin and answer with JSON
//!   lines on their stdout, each tagged with the request's id (see the scripts).
//! * bash: a plain `bash` fed `. cellfile` plus an end marker that carries the exit status.
//!
//! One cell runs at a time per context (a tokio mutex per context). A cell past its timeout gets
//! SIGINT (Python's KeyboardInterrupt, node's `breakOnSigint`, bash's INT trap): it ends with a
//! `TimeoutError` and the context keeps its state. A kernel that ignores SIGINT for 5 s is killed and
//! started again (state lost, said in the error).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex as StdMutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::BytesMut;
use http_body_util::BodyExt;
use moat_api::{
    CodeContext, CodeError, CodeEvent, CodeLanguage, CodeResult, ProcessEvent, ProcessInfo,
    ProcessList, ProcessSelector, RunCodeRequest, StartProcessRequest, WriteQuery,
};
use tokio::sync::mpsc;

use crate::agent::{AgentClient, AgentError};
use crate::error::Error;

pub const KERNEL_PY: &str = include_str!("kernel.py");
pub const KERNEL_JS: &str = include_str!("kernel.js");

const DIR: &str = "/tmp/.moat";
const TAG_PREFIX: &str = "moat-kernel-";
/// Default cell timeout in seconds.
pub const DEFAULT_TIMEOUT: f64 = 60.0;
const MAX_TIMEOUT: f64 = 86_400.0;
/// How long a kernel may take to honour SIGINT before it is killed and restarted.
const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

fn tag(ctx: &str) -> String {
    format!("{TAG_PREFIX}{ctx}")
}

/// The id of a language's default context.
pub fn default_context_id(lang: CodeLanguage) -> String {
    format!("default-{lang}")
}

/// Per (sandbox, context): the lock that serializes cells, holding the daemon-side execution count
/// (used for bash; python and javascript count in the kernel).
type ExecLock = Arc<tokio::sync::Mutex<u64>>;
static LOCKS: LazyLock<StdMutex<HashMap<(String, String), ExecLock>>> =
    LazyLock::new(|| StdMutex::new(HashMap::new()));

fn lock_for(sandbox: &str, ctx: &str) -> ExecLock {
    let mut m = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    m.entry((sandbox.to_string(), ctx.to_string()))
        .or_default()
        .clone()
}

fn forget_lock(sandbox: &str, ctx: &str) {
    let mut m = LOCKS.lock().unwrap_or_else(|p| p.into_inner());
    m.remove(&(sandbox.to_string(), ctx.to_string()));
}

fn agent_err(e: AgentError) -> Error {
    Error::Agent(e)
}

fn kernel(ctx: &str) -> ProcessSelector {
    ProcessSelector::Tag(tag(ctx))
}

fn language_of(info: &ProcessInfo) -> CodeLanguage {
    if info.cmd.iter().any(|a| a.ends_with("kernel.js")) {
        CodeLanguage::Javascript
    } else if info.cmd.iter().any(|a| a.ends_with("kernel.py")) {
        CodeLanguage::Python
    } else {
        CodeLanguage::Bash
    }
}

/// The sandbox's code contexts: its running kernels, by tag.
pub async fn list(agent: &AgentClient) -> Result<Vec<CodeContext>, Error> {
    let procs: ProcessList = agent.processes().await.map_err(agent_err)?;
    let mut out: Vec<CodeContext> = procs
        .processes
        .iter()
        .filter(|p| p.running)
        .filter_map(|p| {
            let id = p.tag.as_deref()?.strip_prefix(TAG_PREFIX)?;
            Some(CodeContext {
                id: id.to_string(),
                language: language_of(p),
                cwd: p.cwd.clone(),
            })
        })
        .collect();
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

pub async fn find(agent: &AgentClient, ctx: &str) -> Result<Option<CodeContext>, Error> {
    Ok(list(agent).await?.into_iter().find(|c| c.id == ctx))
}

/// Looks up a context named in a request: 400 for a malformed id, 404 for an unknown one.
pub async fn get(agent: &AgentClient, ctx: &str, field: &str) -> Result<CodeContext, Error> {
    moat_api::validate_context_id(ctx).map_err(|m| Error::invalid(field, m))?;
    find(agent, ctx)
        .await?
        .ok_or_else(|| Error::not_found(field, format!("code context {ctx} not found")))
}

async fn put_file(agent: &AgentClient, path: &str, content: Vec<u8>) -> Result<(), Error> {
    let q = WriteQuery {
        path: path.to_string(),
        mode: None,
        user: None,
    };
    agent
        .write_file(&q, Body::from(content))
        .await
        .map(drop)
        .map_err(|e| Error::internal(format!("writing {path} in the sandbox failed: {e}")))
}

/// Starts a kernel for context `id`. `cwd` is checked by the agent (400 naming `cwd`).
pub async fn start(
    agent: &AgentClient,
    id: &str,
    lang: CodeLanguage,
    cwd: Option<String>,
) -> Result<CodeContext, Error> {
    moat_api::validate_context_id(id).map_err(|m| Error::invalid("context_id", m))?;
    // SIGINT must interrupt cells even when the agent's processes inherited it ignored.
    let mut cmd: Vec<String> = vec!["env".into(), "--default-signal=INT".into()];
    match lang {
        CodeLanguage::Python => {
            let path = format!("{DIR}/kernel.py");
            put_file(agent, &path, KERNEL_PY.as_bytes().to_vec()).await?;
            cmd.extend(["python3".into(), "-u".into(), path]);
        }
        CodeLanguage::Javascript => {
            if !has_program(agent, "node").await? {
                return Err(Error::invalid(
                    "language",
                    "language javascript needs `node` in the sandbox, and this sandbox's template has none",
                ));
            }
            let path = format!("{DIR}/kernel.js");
            put_file(agent, &path, KERNEL_JS.as_bytes().to_vec()).await?;
            cmd.extend(["node".into(), path]);
        }
        CodeLanguage::Bash => {
            cmd.extend(["bash".into(), "--noprofile".into(), "--norc".into()]);
        }
    }
    let req = StartProcessRequest {
        cmd: Some(cmd),
        cwd,
        stdin: true,
        background: true,
        tag: Some(tag(id)),
        ..Default::default()
    };
    let refusal = match agent.start_background(&req).await {
        Ok(info) => {
            return Ok(CodeContext {
                id: id.to_string(),
                language: lang,
                cwd: info.cwd,
            })
        }
        Err(AgentError::Refused { status, body }) => (status, body),
        Err(e) => return Err(agent_err(e)),
    };
    let (status, body) = refusal;
    let message = body.error.message;
    match (status.as_u16(), body.error.field.as_deref()) {
        (400, Some("cwd")) => Err(Error::invalid("cwd", message)),
        (400, Some("cmd")) => Err(Error::invalid(
            "language",
            format!("language {lang} cannot start in this sandbox: {message}"),
        )),
        (409, _) => Err(Error::conflict(format!("code context {id} exists already"))),
        _ => Err(Error::internal(format!(
            "starting the {lang} kernel failed ({status}): {message}"
        ))),
    }
}

/// Whether `program` is on the sandbox's PATH.
async fn has_program(agent: &AgentClient, program: &str) -> Result<bool, Error> {
    let req = StartProcessRequest {
        cmd: Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("command -v {program}"),
        ]),
        ..Default::default()
    };
    Ok(agent
        .run_streamed(&req, |_| {})
        .await
        .is_ok_and(|e| e.exit_code == Some(0)))
}

/// Kills a context's kernel and waits until its tag is free.
async fn kill(agent: &AgentClient, ctx: &str) -> Result<(), Error> {
    match agent.signal(&kernel(ctx), "SIGKILL").await {
        Ok(()) => {}
        // Gone already, or exited.
        Err(e) if matches!(e.status().map(|s| s.as_u16()), Some(404 | 409)) => {}
        Err(e) => {
            return Err(Error::internal(format!(
                "stopping code context {ctx} failed: {e}"
            )))
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while find(agent, ctx).await?.is_some() {
        if Instant::now() > deadline {
            return Err(Error::internal(format!(
                "the kernel of code context {ctx} did not exit"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Deletes a context (its kernel and state).
pub async fn delete(agent: &AgentClient, sandbox: &str, ctx: &CodeContext) -> Result<(), Error> {
    kill(agent, &ctx.id).await?;
    forget_lock(sandbox, &ctx.id);
    Ok(())
}

/// Restarts a context: a fresh kernel, same id, language and cwd; state is gone. Waits for a running
/// cell to finish first.
pub async fn restart(
    agent: &AgentClient,
    sandbox: &str,
    ctx: &CodeContext,
) -> Result<CodeContext, Error> {
    let lock = lock_for(sandbox, &ctx.id);
    let mut count = lock.lock().await;
    kill(agent, &ctx.id).await?;
    *count = 0;
    start(agent, &ctx.id, ctx.language, Some(ctx.cwd.clone())).await
}

/// Checks a run request and finds (or, for a default context, starts) its context. Errors here are
/// answered before the event stream starts.
pub async fn prepare(
    agent: &AgentClient,
    sandbox: &str,
    req: &RunCodeRequest,
) -> Result<CodeContext, Error> {
    if req.code.trim().is_empty() {
        return Err(Error::invalid("code", "code is empty"));
    }
    if let Some(t) = req.timeout {
        if !t.is_finite() || t <= 0.0 || t > MAX_TIMEOUT {
            return Err(Error::invalid(
                "timeout",
                format!("timeout must be a number of seconds in (0, {MAX_TIMEOUT}]"),
            ));
        }
    }
    for k in req.env.keys() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(Error::invalid(
                &format!("env.{k}"),
                format!("environment variable name {k:?} is invalid"),
            ));
        }
    }
    if req.env.values().any(|v| v.contains('\0')) {
        return Err(Error::invalid("env", "environment values may not hold NUL"));
    }
    if let Some(id) = &req.context_id {
        let ctx = get(agent, id, "context_id").await?;
        if let Some(lang) = req.language {
            if lang != ctx.language {
                return Err(Error::invalid(
                    "language",
                    format!("context {id} runs {}, not {lang}", ctx.language),
                ));
            }
        }
        return Ok(ctx);
    }
    let lang = req.language.unwrap_or_default();
    let id = default_context_id(lang);
    // One creator at a time per sandbox, so two first calls do not both start the default kernel.
    let create_lock = lock_for(sandbox, "");
    let _g = create_lock.lock().await;
    if let Some(ctx) = find(agent, &id).await? {
        return Ok(ctx);
    }
    start(agent, &id, lang, None).await
}

/// What becomes of a cell whose client went away (nobody reads its events any more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// It runs on to its end or its timeout (moat's API: a client may come back for the result's
    /// side effects).
    RunsOn,
    /// It is interrupted like a cell past its timeout (E2B's: the client's timeout is the cell's,
    /// and a cell left running would hold every later cell of its context).
    Interrupted,
}

/// Runs a cell, sending its events to `tx`; `end` is always the last one sent.
pub async fn run(
    agent: Arc<AgentClient>,
    sandbox: String,
    ctx: CodeContext,
    req: RunCodeRequest,
    tx: mpsc::Sender<CodeEvent>,
    abandoned: Abandoned,
) {
    let started = Instant::now();
    let lock = lock_for(&sandbox, &ctx.id);
    let mut count = lock.lock().await;
    let timeout = Duration::from_secs_f64(req.timeout.unwrap_or(DEFAULT_TIMEOUT));
    let exec_count = match execute(&agent, &ctx, &req, timeout, *count, &tx, abandoned).await {
        Ok(n) => n,
        Err(e) => {
            let _ = tx
                .send(CodeEvent::Error(CodeError {
                    name: "InterpreterError".into(),
                    value: e.to_string(),
                    traceback: String::new(),
                }))
                .await;
            *count + 1
        }
    };
    *count = exec_count;
    let _ = tx
        .send(CodeEvent::End {
            execution_count: exec_count,
            duration_ms: started.elapsed().as_millis() as u64,
        })
        .await;
}

/// How a kernel's output is turned into events.
enum Decoder {
    /// python / javascript: JSON lines on stdout.
    Json { lines: BytesMut },
    /// bash: raw output up to an end marker on each stream.
    Bash {
        out: MarkerScanner,
        err: MarkerScanner,
        status: Option<i32>,
        err_done: bool,
    },
}

/// What one kernel output chunk meant.
#[derive(Default)]
struct Step {
    events: Vec<CodeEvent>,
    /// The kernel said the cell ended (execution count for python/javascript).
    ended: Option<Option<u64>>,
}

impl Decoder {
    fn stdout(&mut self, exec_id: &str, data: &[u8]) -> Step {
        let mut step = Step::default();
        match self {
            Decoder::Json { lines } => {
                lines.extend_from_slice(data);
                while let Some(i) = lines.iter().position(|b| *b == b'\n') {
                    let line = lines.split_to(i + 1);
                    kernel_message(exec_id, &line[..i], &mut step);
                }
            }
            Decoder::Bash {
                out,
                status,
                err_done,
                ..
            } => {
                let (text, rc) = out.push(data);
                if !text.is_empty() {
                    step.events.push(CodeEvent::Stdout { data: text });
                }
                if rc.is_some() {
                    *status = rc;
                }
                if status.is_some() && *err_done {
                    step.ended = Some(None);
                }
            }
        }
        step
    }

    fn stderr(&mut self, data: &[u8]) -> Step {
        let mut step = Step::default();
        match self {
            // The kernel's fd 2 is captured; what reaches the process's stderr is the kernel's own
            // trouble (e.g. a crash before it started), worth showing.
            Decoder::Json { .. } => step.events.push(CodeEvent::Stderr {
                data: String::from_utf8_lossy(data).into_owned(),
            }),
            Decoder::Bash {
                err,
                status,
                err_done,
                ..
            } => {
                let (text, rc) = err.push(data);
                if !text.is_empty() {
                    step.events.push(CodeEvent::Stderr { data: text });
                }
                if rc.is_some() {
                    *err_done = true;
                }
                if status.is_some() && *err_done {
                    step.ended = Some(None);
                }
            }
        }
        step
    }
}

fn kernel_message(exec_id: &str, line: &[u8], step: &mut Step) {
    let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<serde_json::Value>(line)
    else {
        return;
    };
    if m.get("id").and_then(|v| v.as_str()) != Some(exec_id) {
        return; // a message of an earlier, interrupted cell, or the kernel's "ready"
    }
    let s = |m: &serde_json::Map<String, serde_json::Value>, k: &str| {
        m.get(k).and_then(|v| v.as_str()).map(str::to_string)
    };
    match m.get("type").and_then(|v| v.as_str()) {
        Some("stdout") => step.events.push(CodeEvent::Stdout {
            data: s(&m, "data").unwrap_or_default(),
        }),
        Some("stderr") => step.events.push(CodeEvent::Stderr {
            data: s(&m, "data").unwrap_or_default(),
        }),
        Some("result") => step.events.push(CodeEvent::Result(CodeResult {
            text: s(&m, "text"),
            html: s(&m, "html"),
            markdown: s(&m, "markdown"),
            png: s(&m, "png"),
            jpeg: s(&m, "jpeg"),
            svg: s(&m, "svg"),
            latex: s(&m, "latex"),
            json: m.remove("json"),
            is_main_result: m
                .get("is_main_result")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
        })),
        Some("error") => step.events.push(CodeEvent::Error(CodeError {
            name: s(&m, "name").unwrap_or_default(),
            value: s(&m, "value").unwrap_or_default(),
            traceback: s(&m, "traceback").unwrap_or_default(),
        })),
        Some("end") => {
            step.ended = Some(m.get("execution_count").and_then(|v| v.as_u64()));
        }
        _ => {}
    }
}

/// Finds `<prefix><digits>__\n` in a raw output stream, passing everything before it through and
/// holding back only what could be the start of the marker.
struct MarkerScanner {
    prefix: Vec<u8>,
    buf: Vec<u8>,
    /// The marker was seen; later output is not this cell's.
    done: bool,
}

impl MarkerScanner {
    fn new(prefix: String) -> MarkerScanner {
        MarkerScanner {
            prefix: prefix.into_bytes(),
            buf: Vec::new(),
            done: false,
        }
    }

    /// Text to pass on, and the marker's number once it is complete.
    fn push(&mut self, data: &[u8]) -> (String, Option<i32>) {
        if self.done {
            return (String::new(), None);
        }
        self.buf.extend_from_slice(data);
        if let Some(pos) = find_bytes(&self.buf, &self.prefix) {
            let rest = &self.buf[pos + self.prefix.len()..];
            if let Some(nl) = rest.iter().position(|b| *b == b'\n') {
                let num = std::str::from_utf8(&rest[..nl])
                    .ok()
                    .and_then(|s| s.trim_end_matches('_').parse::<i32>().ok())
                    .unwrap_or(0);
                let text = String::from_utf8_lossy(&self.buf[..pos]).into_owned();
                self.buf.clear();
                self.done = true;
                return (text, Some(num));
            }
            let text = String::from_utf8_lossy(&self.buf[..pos]).into_owned();
            self.buf.drain(..pos);
            return (text, None);
        }
        // Keep the longest tail that is a prefix of the marker, and an unfinished UTF-8 sequence.
        let mut keep = (1..self.prefix.len().min(self.buf.len() + 1))
            .rev()
            .find(|&n| self.buf.ends_with(&self.prefix[..n]))
            .unwrap_or(0);
        let cut = self.buf.len() - keep;
        let valid = match std::str::from_utf8(&self.buf[..cut]) {
            Ok(_) => cut,
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => cut,
        };
        keep += cut - valid;
        let emit: Vec<u8> = self.buf.drain(..self.buf.len() - keep).collect();
        (String::from_utf8_lossy(&emit).into_owned(), None)
    }
}

fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Signals a context's kernel; a kernel that is gone is not an error here (the output stream
/// says so).
async fn signal(agent: &AgentClient, ctx: &str, sig: &str) -> Result<(), Error> {
    match agent.signal(&kernel(ctx), sig).await {
        Ok(()) | Err(AgentError::Refused { .. }) => Ok(()),
        Err(e) => Err(agent_err(e)),
    }
}

/// Sends the cell to the kernel and turns its output into events until the cell ends. Returns the
/// context's execution count after this cell.
async fn execute(
    agent: &AgentClient,
    ctx: &CodeContext,
    req: &RunCodeRequest,
    timeout: Duration,
    count_before: u64,
    tx: &mpsc::Sender<CodeEvent>,
    abandoned: Abandoned,
) -> Result<u64, Error> {
    let exec_id = format!("{:016x}", rand::random::<u64>());
    // Attach first, so no output of this cell can come before we listen.
    let resp = match agent.events(&kernel(&ctx.id), false).await {
        Ok(r) => r,
        Err(AgentError::Refused { status, .. }) => {
            return Err(Error::internal(format!(
                "the kernel of code context {} is gone ({status})",
                ctx.id
            )))
        }
        Err(e) => return Err(agent_err(e)),
    };
    let mut body = resp.into_body();

    let (line, mut decoder) = match ctx.language {
        CodeLanguage::Python | CodeLanguage::Javascript => {
            let msg = serde_json::json!({"id": exec_id, "code": req.code, "env": req.env});
            let mut line = serde_json::to_vec(&msg).map_err(Error::internal)?;
            line.push(b'\n');
            (
                line,
                Decoder::Json {
                    lines: BytesMut::new(),
                },
            )
        }
        CodeLanguage::Bash => {
            let cell = format!("{DIR}/cell-{}.sh", ctx.id);
            let mut script = String::new();
            for (k, v) in &req.env {
                script.push_str(&format!("export {}={}\n", shell_quote(k), shell_quote(v)));
            }
            script.push_str(&req.code);
            script.push('\n');
            put_file(agent, &cell, script.into_bytes()).await?;
            let marker = format!("__MOAT_END_{exec_id}_");
            let line = format!(
                "trap 'return 130 2>/dev/null' INT; . {cell} </dev/null; __moat_rc=$?; \
                 printf '%s%d__\\n' '{marker}' \"$__moat_rc\"; printf '%s0__\\n' '{marker}' >&2\n"
            );
            (
                line.into_bytes(),
                Decoder::Bash {
                    out: MarkerScanner::new(marker.clone()),
                    err: MarkerScanner::new(marker),
                    status: None,
                    err_done: false,
                },
            )
        }
    };
    agent
        .stdin(&kernel(&ctx.id), Body::from(line))
        .await
        .map_err(|e| Error::internal(format!("sending the cell to the kernel failed: {e}")))?;

    let mut deadline = tokio::time::Instant::now() + timeout;
    let mut interrupted = false;
    let mut events = crate::agent::ProcessEventLines::default();
    loop {
        let frame = tokio::select! {
            f = body.frame() => f,
            _ = tx.closed(), if abandoned == Abandoned::Interrupted && !interrupted => {
                interrupted = true;
                signal(agent, &ctx.id, "SIGINT").await?;
                deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                continue;
            }
            _ = tokio::time::sleep_until(deadline) => {
                if !interrupted {
                    interrupted = true;
                    signal(agent, &ctx.id, "SIGINT").await?;
                    deadline = tokio::time::Instant::now() + INTERRUPT_GRACE;
                    continue;
                }
                // The kernel ignored SIGINT: start it afresh.
                let _ = tx.send(CodeEvent::Error(timeout_error(timeout, true))).await;
                kill(agent, &ctx.id).await?;
                start(agent, &ctx.id, ctx.language, Some(ctx.cwd.clone())).await?;
                return Ok(0);
            }
        };
        let chunk = match frame {
            Some(Ok(f)) => match f.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
            Some(Err(e)) => {
                return Err(Error::internal(format!(
                    "the kernel's output stream broke: {e}"
                )))
            }
            None => return Err(Error::internal("the kernel's output stream ended early")),
        };
        let evs = events
            .push(&chunk)
            .map_err(|e| Error::internal(e.to_string()))?;
        for ev in evs {
            let step = match ev {
                ProcessEvent::Stdout(c) => decoder.stdout(&exec_id, &crate::agent::chunk_bytes(&c)),
                ProcessEvent::Stderr(c) => decoder.stderr(&crate::agent::chunk_bytes(&c)),
                ProcessEvent::Exit(e) => {
                    let how = match (&e.exit_code, &e.signal) {
                        (Some(c), _) => format!("exit code {c}"),
                        (None, Some(s)) => format!("signal {s}"),
                        _ => "an unknown status".into(),
                    };
                    let _ = tx
                        .send(CodeEvent::Error(CodeError {
                            name: "KernelExited".into(),
                            value: format!(
                                "the {} kernel of context {} exited with {how}; its state is lost",
                                ctx.language, ctx.id
                            ),
                            traceback: String::new(),
                        }))
                        .await;
                    return Ok(count_before + 1);
                }
                _ => Step::default(),
            };
            for mut ev in step.events {
                if interrupted {
                    if let CodeEvent::Error(e) = &mut ev {
                        if e.name == "KeyboardInterrupt" {
                            let t = timeout_error(timeout, false);
                            e.name = t.name;
                            e.value = t.value;
                        }
                    }
                }
                // A client that went away does not stop the cell; its events are dropped.
                let _ = tx.send(ev).await;
            }
            if let Some(n) = step.ended {
                if let Decoder::Bash {
                    status: Some(rc), ..
                } = &decoder
                {
                    if interrupted {
                        let _ = tx
                            .send(CodeEvent::Error(timeout_error(timeout, false)))
                            .await;
                    } else if *rc != 0 {
                        let _ = tx
                            .send(CodeEvent::Error(CodeError {
                                name: "ExitCodeError".into(),
                                value: format!("the cell exited with status {rc}"),
                                traceback: String::new(),
                            }))
                            .await;
                    }
                }
                return Ok(n.unwrap_or(count_before + 1));
            }
        }
    }
}

fn timeout_error(timeout: Duration, restarted: bool) -> CodeError {
    let mut value = format!(
        "the cell did not finish within its timeout of {} s and was interrupted",
        timeout.as_secs_f64()
    );
    if restarted {
        value.push_str("; the kernel ignored the interrupt and was restarted, its state is lost");
    }
    CodeError {
        name: "TimeoutError".into(),
        value,
        traceback: String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_carry_the_daemon_s_tag_prefix() {
        // So that an idle kernel never keeps its sandbox from being idle (Core::busy).
        assert!(tag("ctx").starts_with(crate::agent::DAEMON_TAG_PREFIX));
    }

    #[test]
    fn marker_scanner_finds_split_markers() {
        let mut s = MarkerScanner::new("__MOAT_END_ab_".into());
        let (t, rc) = s.push(b"hello\n__MOAT");
        assert_eq!((t.as_str(), rc), ("hello\n", None));
        let (t, rc) = s.push(b"_EN");
        assert_eq!((t.as_str(), rc), ("", None));
        let (t, rc) = s.push(b"D_ab_3");
        assert_eq!((t.as_str(), rc), ("", None));
        let (t, rc) = s.push(b"__\n");
        assert_eq!((t.as_str(), rc), ("", Some(3)));

        let mut s = MarkerScanner::new("__MOAT_END_ab_".into());
        let (t, rc) = s.push(b"no newline__MOAT_END_ab_0__\n");
        assert_eq!((t.as_str(), rc), ("no newline", Some(0)));

        // An underscore that turns out not to start the marker is passed on later.
        let mut s = MarkerScanner::new("__MOAT_END_ab_".into());
        assert_eq!(s.push(b"a_").0, "a");
        assert_eq!(s.push(b"b").0, "_b");
        // A split UTF-8 character is held back until complete.
        let mut s = MarkerScanner::new("__MOAT_END_ab_".into());
        assert_eq!(s.push(&[b'x', 0xc3]).0, "x");
        assert_eq!(s.push(&[0xa9]).0, "é");
    }

    #[test]
    fn kernel_messages_for_other_cells_are_ignored() {
        let mut d = Decoder::Json {
            lines: BytesMut::new(),
        };
        let step = d.stdout(
            "x",
            b"{\"id\":\"old\",\"type\":\"stdout\",\"data\":\"a\"}\n{\"id\":\"x\",\"type\":\"res",
        );
        assert!(step.events.is_empty() && step.ended.is_none());
        let step = d.stdout(
            "x",
            b"ult\",\"text\":\"2\",\"is_main_result\":true}\n{\"id\":\"x\",\"type\":\"end\",\"execution_count\":4}\n",
        );
        assert_eq!(
            step.events,
            vec![CodeEvent::Result(CodeResult {
                text: Some("2".into()),
                is_main_result: true,
                ..Default::default()
            })]
        );
        assert_eq!(step.ended, Some(Some(4)));
    }

    #[test]
    fn kernel_scripts_are_embedded() {
        assert!(KERNEL_PY.contains("def main()"));
        assert!(KERNEL_JS.contains("runInContext"));
        assert_eq!(shell_quote("a'b"), "'a'\\''b'");
    }
}
