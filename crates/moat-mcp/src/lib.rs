//! moat's MCP (Model Context Protocol) server: the sandbox tools an agent needs, served over stdio
//! (`moat mcp`) and over MCP's streamable HTTP transport (the daemon's `/mcp` endpoint).
//!
//! One tool implementation, written against [`moat_client::Client`], backs both transports: the
//! stdio server talks to a daemon over HTTP, and the daemon's `/mcp` endpoint builds a client
//! pointed at its own listen address.

use std::collections::BTreeMap;

use base64::Engine;
use futures::StreamExt;
use moat_api::{CodeEvent, CodeLanguage, CreateSandboxRequest, ProcessEvent, RunCodeRequest};
use moat_client::{Client, SandboxFilter, WriteOptions};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolResult, ContentBlock as Content, Implementation, ServerCapabilities, ServerConfig,
};
use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler, ServiceExt};
use serde::Deserialize;

/// Most bytes of one output stream (stdout, stderr, a file) returned to the model as text.
pub const MAX_TEXT_BYTES: usize = 256 * 1024;

/// The MCP server: every tool call becomes one or more moat REST calls through `client`.
#[derive(Debug, Clone)]
pub struct MoatMcp {
    client: Client,
    tool_router: ToolRouter<Self>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct CreateSandboxArgs {
    /// Template (root filesystem) to start from, e.g. "base" or "code-interpreter". Default: the daemon's default template.
    #[serde(default)]
    pub template: Option<String>,
    /// Seconds until the sandbox is killed automatically. Default: the daemon's default (300).
    #[serde(default)]
    pub timeout: Option<u64>,
    /// Environment variables set for every command in the sandbox.
    #[serde(default)]
    pub envs: Option<BTreeMap<String, String>>,
    /// Labels to find the sandbox by later (list_sandboxes filters on them).
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ListSandboxesArgs {
    /// Only sandboxes carrying all these metadata labels.
    #[serde(default)]
    pub metadata: Option<BTreeMap<String, String>>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SandboxIdArgs {
    /// The sandbox's id (from create_sandbox or list_sandboxes).
    pub sandbox_id: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RunCommandArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// A shell command line, run with /bin/bash -c (or /bin/sh -c where bash is absent); pipes, redirections and && work.
    pub command: String,
    /// Working directory. Default: /root.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables for this command.
    #[serde(default)]
    pub envs: Option<BTreeMap<String, String>>,
    /// Seconds after which the command is killed. Default: no limit (the sandbox's own timeout applies).
    #[serde(default)]
    pub timeout: Option<f64>,
    /// Start the command and return at once with its pid instead of waiting for it (for servers and other long-running processes).
    #[serde(default)]
    pub background: Option<bool>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct RunCodeArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The code of one cell. State (variables, imports) persists between calls in the same context; the value of the last expression is returned.
    pub code: String,
    /// "python" (default), "javascript" or "bash".
    #[serde(default)]
    pub language: Option<String>,
    /// Code context to run in (default: the language's default context of the sandbox).
    #[serde(default)]
    pub context_id: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ReadFileArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Path of the file in the sandbox (absolute, or relative to /root).
    pub path: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct WriteFileArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Path of the file in the sandbox (absolute, or relative to /root). Missing parent directories are created; an existing file is replaced.
    pub path: String,
    /// The file's new content (UTF-8 text).
    pub content: String,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ListFilesArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Directory to list (absolute, or relative to /root). Default: /root.
    #[serde(default)]
    pub path: Option<String>,
    /// How many levels deep to list (1 = only the directory's own entries). Default: 1.
    #[serde(default)]
    pub depth: Option<u32>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SnapshotArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// A name to find the snapshot by later (fork_snapshot and reset_sandbox take it as well as its id).
    #[serde(default)]
    pub name: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ForkArgs {
    /// The snapshot's id or name (from snapshot_sandbox).
    pub snapshot: String,
    /// How many sandboxes to start from it (1 to 100). Default 1.
    #[serde(default)]
    pub count: Option<u32>,
    /// Seconds until each new sandbox is killed. Default: the daemon's default.
    #[serde(default)]
    pub timeout: Option<u64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ResetArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Reset to this snapshot (id or name) instead of the state the sandbox started from.
    #[serde(default)]
    pub snapshot: Option<String>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SetNetworkArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Whether the sandbox may reach the internet at large (what allow_out/deny_out do not name). Unchanged when absent.
    #[serde(default)]
    pub allow_internet: Option<bool>,
    /// Destinations always allowed: domain names (api.github.com, *.pypi.org), addresses or CIDR ranges. Replaces the list when given.
    #[serde(default)]
    pub allow_out: Option<Vec<String>>,
    /// Destinations always refused (same forms). Replaces the list when given; allow_out wins over deny_out.
    #[serde(default)]
    pub deny_out: Option<Vec<String>>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct NetworkLogArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Only entries with this decision: "allow", "deny" or "audit". Default: all.
    #[serde(default)]
    pub decision: Option<String>,
    /// At most this many entries, oldest first (1 to 1000). Default 100.
    #[serde(default)]
    pub limit: Option<u32>,
}

fn api_error(e: moat_client::Error) -> CallToolResult {
    CallToolResult::error(vec![Content::text(format!("error: {e}"))])
}

fn text(s: impl Into<String>) -> CallToolResult {
    CallToolResult::success(vec![Content::text(s)])
}

/// `s` cut to at most `max` bytes (on a char boundary), with a note when cut.
fn truncated(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n[... truncated: {} of {} bytes shown]",
        &s[..end],
        end,
        s.len()
    )
}

fn to_json(v: &impl serde::Serialize) -> String {
    serde_json::to_string_pretty(v).unwrap_or_else(|e| format!("(cannot encode: {e})"))
}

fn parse_language(s: Option<&str>) -> Result<Option<CodeLanguage>, String> {
    match s.map(|s| s.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") => Ok(None),
        Some("python" | "py" | "python3") => Ok(Some(CodeLanguage::Python)),
        Some("javascript" | "js" | "node") => Ok(Some(CodeLanguage::Javascript)),
        Some("bash" | "sh" | "shell") => Ok(Some(CodeLanguage::Bash)),
        Some(other) => Err(format!(
            "error: unknown language {other:?}: use python, javascript or bash"
        )),
    }
}

fn chunk_text(c: &moat_api::OutputChunk) -> String {
    match (&c.data, &c.data_b64) {
        (Some(d), _) => d.clone(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
            .unwrap_or_default(),
        (None, None) => String::new(),
    }
}

#[tool_router]
impl MoatMcp {
    /// A server whose tools act through `client`.
    pub fn new(client: Client) -> MoatMcp {
        MoatMcp {
            client,
            tool_router: Self::tool_router(),
        }
    }

    #[tool(
        description = "Create a new isolated Linux sandbox (a lightweight VM-like machine with a shell, Python and a filesystem). Returns its id, which the other tools take as sandbox_id. Kill it with kill_sandbox when done."
    )]
    async fn create_sandbox(&self, Parameters(a): Parameters<CreateSandboxArgs>) -> CallToolResult {
        let req = CreateSandboxRequest {
            template: a.template.filter(|t| !t.trim().is_empty()),
            timeout: a.timeout,
            env: a.envs.unwrap_or_default(),
            metadata: a.metadata.unwrap_or_default(),
            ..Default::default()
        };
        match self.client.create_sandbox(&req).await {
            Ok(s) => text(format!(
                "sandbox_id: {}\ntemplate: {}\nexpires_at: {}",
                s.id, s.template, s.expires_at
            )),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "List the running sandboxes (id, template, state, expiry, metadata), optionally only those with all the given metadata labels."
    )]
    async fn list_sandboxes(&self, Parameters(a): Parameters<ListSandboxesArgs>) -> CallToolResult {
        let filter = SandboxFilter {
            metadata: a.metadata.unwrap_or_default(),
            ..Default::default()
        };
        match self.client.list_sandboxes(&filter).await {
            Ok(list) => {
                let rows: Vec<_> = list
                    .iter()
                    .map(|s| {
                        serde_json::json!({
                            "sandbox_id": s.id,
                            "template": s.template,
                            "state": s.state,
                            "created_at": s.created_at,
                            "expires_at": s.expires_at,
                            "metadata": s.metadata,
                        })
                    })
                    .collect();
                text(to_json(&rows))
            }
            Err(e) => api_error(e),
        }
    }

    #[tool(description = "Kill a sandbox: stops everything in it and deletes its filesystem.")]
    async fn kill_sandbox(&self, Parameters(a): Parameters<SandboxIdArgs>) -> CallToolResult {
        match self.client.delete_sandbox(&a.sandbox_id).await {
            Ok(()) => text(format!("killed {}", a.sandbox_id)),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Run a shell command in a sandbox and wait for it to finish. Returns its exit code, stdout and stderr. With background=true, returns at once with the process's pid."
    )]
    async fn run_command(&self, Parameters(a): Parameters<RunCommandArgs>) -> CallToolResult {
        let req = moat_api::StartProcessRequest {
            command: Some(a.command),
            cwd: a.cwd.filter(|c| !c.trim().is_empty()),
            env: a.envs.unwrap_or_default(),
            timeout: a.timeout,
            ..Default::default()
        };
        if a.background.unwrap_or(false) {
            return match self
                .client
                .start_process_background(&a.sandbox_id, &req)
                .await
            {
                Ok(info) => text(format!("started in the background: pid {}", info.pid)),
                Err(e) => api_error(e),
            };
        }
        let mut events = match self.client.start_process_stream(&a.sandbox_id, &req).await {
            Ok(s) => s,
            Err(e) => return api_error(e),
        };
        let (mut stdout, mut stderr, mut exit) = (String::new(), String::new(), None);
        let mut dropped = 0u64;
        let mut broke = None;
        while let Some(ev) = events.next().await {
            match ev {
                Ok(ProcessEvent::Stdout(c)) | Ok(ProcessEvent::Pty(c)) => {
                    if stdout.len() <= MAX_TEXT_BYTES {
                        stdout.push_str(&chunk_text(&c))
                    }
                }
                Ok(ProcessEvent::Stderr(c)) => {
                    if stderr.len() <= MAX_TEXT_BYTES {
                        stderr.push_str(&chunk_text(&c))
                    }
                }
                Ok(ProcessEvent::Dropped { bytes }) => dropped += bytes,
                Ok(ProcessEvent::Exit(st)) => exit = Some(st),
                Ok(ProcessEvent::Start { .. }) => {}
                Ok(ProcessEvent::Error { message }) => broke = Some(message),
                Err(e) => return api_error(e),
            }
        }
        let Some(st) = exit else {
            return CallToolResult::error(vec![Content::text(format!(
                "error: {}\nstdout:\n{}\nstderr:\n{}",
                broke
                    .as_deref()
                    .unwrap_or("the event stream ended without an exit status"),
                truncated(&stdout, MAX_TEXT_BYTES),
                truncated(&stderr, MAX_TEXT_BYTES)
            ))]);
        };
        let mut out = match (st.exit_code, &st.signal) {
            (Some(code), _) => format!("exit code: {code}\n"),
            (None, Some(sig)) => format!("killed by signal {sig}\n"),
            (None, None) => "exit code: unknown\n".to_string(),
        };
        if st.timed_out {
            out.push_str("timed out: the command was killed because its timeout passed\n");
        }
        if let Some(err) = &st.error {
            out.push_str(&format!("error: {err}\n"));
            return CallToolResult::error(vec![Content::text(out)]);
        }
        if dropped > 0 {
            out.push_str(&format!("({dropped} bytes of output were dropped)\n"));
        }
        out.push_str(&format!(
            "stdout:\n{}\nstderr:\n{}",
            truncated(&stdout, MAX_TEXT_BYTES),
            truncated(&stderr, MAX_TEXT_BYTES)
        ));
        text(out)
    }

    #[tool(
        description = "Run a cell of code in a sandbox's stateful interpreter (like a Jupyter notebook: variables persist between calls). Returns printed output, the value of the last expression, charts as PNG images (matplotlib), and errors with their traceback. Charts need the code-interpreter template."
    )]
    async fn run_code(&self, Parameters(a): Parameters<RunCodeArgs>) -> CallToolResult {
        let language = match parse_language(a.language.as_deref()) {
            Ok(l) => l,
            Err(msg) => return CallToolResult::error(vec![Content::text(msg)]),
        };
        let req = RunCodeRequest {
            code: a.code,
            language,
            context_id: a.context_id.filter(|c| !c.trim().is_empty()),
            ..Default::default()
        };
        let mut events = match self.client.run_code(&a.sandbox_id, &req).await {
            Ok(s) => s,
            Err(e) => return api_error(e),
        };
        let (mut stdout, mut stderr) = (String::new(), String::new());
        let mut results: Vec<String> = Vec::new();
        let mut images: Vec<Content> = Vec::new();
        let mut error = None;
        while let Some(ev) = events.next().await {
            match ev {
                Ok(CodeEvent::Stdout { data }) => stdout.push_str(&data),
                Ok(CodeEvent::Stderr { data }) => stderr.push_str(&data),
                Ok(CodeEvent::Result(r)) => {
                    if let Some(png) = &r.png {
                        images.push(Content::image(png.clone(), "image/png"));
                    } else if let Some(jpeg) = &r.jpeg {
                        images.push(Content::image(jpeg.clone(), "image/jpeg"));
                    }
                    if let Some(t) = r.text.as_ref().or(r.markdown.as_ref()) {
                        results.push(t.clone());
                    } else if let Some(j) = &r.json {
                        results.push(to_json(j));
                    }
                }
                Ok(CodeEvent::Error(e)) => error = Some(e),
                Ok(CodeEvent::End { .. }) => {}
                Err(e) => return api_error(e),
            }
        }
        let mut content = Vec::new();
        let mut body = String::new();
        if !stdout.is_empty() {
            body.push_str(&format!(
                "stdout:\n{}\n",
                truncated(&stdout, MAX_TEXT_BYTES)
            ));
        }
        if !stderr.is_empty() {
            body.push_str(&format!(
                "stderr:\n{}\n",
                truncated(&stderr, MAX_TEXT_BYTES)
            ));
        }
        for r in &results {
            body.push_str(&truncated(r, MAX_TEXT_BYTES));
            body.push('\n');
        }
        if let Some(e) = &error {
            body.push_str(&format!("{}: {}\n{}", e.name, e.value, e.traceback));
        }
        if body.is_empty() && images.is_empty() {
            body.push_str("(no output)");
        }
        if !body.is_empty() {
            content.push(Content::text(body.trim_end().to_string()));
        }
        content.extend(images);
        if error.is_some() {
            CallToolResult::error(content)
        } else {
            CallToolResult::success(content)
        }
    }

    #[tool(
        description = "Read a file from a sandbox. Text files come back as text; binary files as base64."
    )]
    async fn read_file(&self, Parameters(a): Parameters<ReadFileArgs>) -> CallToolResult {
        let mut stream = match self.client.read_file(&a.sandbox_id, &a.path).await {
            Ok(s) => s,
            Err(e) => return api_error(e),
        };
        let mut data = Vec::new();
        let mut total = 0usize;
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(b) => {
                    total += b.len();
                    if data.len() < MAX_TEXT_BYTES {
                        data.extend_from_slice(&b);
                    }
                }
                Err(e) => return api_error(e),
            }
        }
        let cut = data.len() > MAX_TEXT_BYTES;
        data.truncate(MAX_TEXT_BYTES);
        let note = if cut || total > data.len() {
            format!("\n[... truncated: {} of {total} bytes shown]", data.len())
        } else {
            String::new()
        };
        match std::str::from_utf8(&data) {
            Ok(s) => text(format!("{s}{note}")),
            // A cut may split a UTF-8 sequence: accept text whose only fault is a truncated tail.
            Err(e) if cut && e.error_len().is_none() => text(format!(
                "{}{note}",
                String::from_utf8_lossy(&data[..e.valid_up_to()])
            )),
            Err(_) => text(format!(
                "(binary file, {total} bytes, base64-encoded below){note}\n{}",
                base64::engine::general_purpose::STANDARD.encode(&data)
            )),
        }
    }

    #[tool(
        description = "Write a text file in a sandbox (creates parent directories, replaces an existing file)."
    )]
    async fn write_file(&self, Parameters(a): Parameters<WriteFileArgs>) -> CallToolResult {
        let len = a.content.len();
        match self
            .client
            .write_file(&a.sandbox_id, &a.path, a.content, &WriteOptions::default())
            .await
        {
            Ok(info) => text(format!("wrote {len} bytes to {}", info.path)),
            Err(e) => api_error(e),
        }
    }

    #[tool(description = "List the entries of a directory in a sandbox (name, type, size, path).")]
    async fn list_files(&self, Parameters(a): Parameters<ListFilesArgs>) -> CallToolResult {
        let path = a
            .path
            .filter(|p| !p.trim().is_empty())
            .unwrap_or_else(|| "/root".to_string());
        match self.client.list_dir(&a.sandbox_id, &path, a.depth).await {
            Ok(entries) => {
                if entries.is_empty() {
                    return text(format!("{path} is empty"));
                }
                let lines: Vec<String> = entries
                    .iter()
                    .map(|e| {
                        let kind = serde_json::to_value(e.file_type)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                            .unwrap_or_else(|| "?".into());
                        format!("{kind}\t{}\t{}", e.size, e.path)
                    })
                    .collect();
                text(format!("type\tsize\tpath\n{}", lines.join("\n")))
            }
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Save a sandbox's filesystem as a snapshot (the sandbox keeps running). Returns the snapshot's id; fork_snapshot starts new sandboxes from it, reset_sandbox brings a sandbox back to it."
    )]
    async fn snapshot_sandbox(&self, Parameters(a): Parameters<SnapshotArgs>) -> CallToolResult {
        let req = moat_api::CreateSnapshotRequest {
            name: a.name.filter(|n| !n.trim().is_empty()),
            ..Default::default()
        };
        match self.client.create_snapshot(&a.sandbox_id, &req).await {
            Ok(s) => text(format!(
                "snapshot_id: {}
name: {}
size_bytes: {}",
                s.id,
                s.name.as_deref().unwrap_or("-"),
                s.size_bytes
            )),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Start count new sandboxes from a snapshot, each with the snapshot's files (for trying several approaches from one state). Returns their ids."
    )]
    async fn fork_snapshot(&self, Parameters(a): Parameters<ForkArgs>) -> CallToolResult {
        let req = moat_api::ForkRequest {
            count: a.count.unwrap_or(1),
            timeout: a.timeout,
            ..Default::default()
        };
        match self.client.fork(&a.snapshot, &req).await {
            Ok(list) => text(format!(
                "sandbox_ids:\n{}",
                list.iter()
                    .map(|s| s.id.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            )),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Reset a sandbox's filesystem to the state it started from (or to a snapshot): every change since is gone and its processes start afresh. The sandbox keeps its id."
    )]
    async fn reset_sandbox(&self, Parameters(a): Parameters<ResetArgs>) -> CallToolResult {
        let req = moat_api::ResetRequest {
            snapshot: a.snapshot.filter(|s| !s.trim().is_empty()),
        };
        match self.client.reset_sandbox(&a.sandbox_id, &req).await {
            Ok(s) => text(format!("reset {} (state: {})", s.id, s.state.as_str())),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Pause a sandbox: every process is frozen (no CPU), memory and files are kept, and it does not expire while paused. resume_sandbox continues it."
    )]
    async fn pause_sandbox(&self, Parameters(a): Parameters<SandboxIdArgs>) -> CallToolResult {
        match self.client.pause_sandbox(&a.sandbox_id).await {
            Ok(r) => text(format!("paused {}", r.sandbox.id)),
            Err(e) => api_error(e),
        }
    }

    #[tool(description = "Resume a paused sandbox: its processes continue where they were.")]
    async fn resume_sandbox(&self, Parameters(a): Parameters<SandboxIdArgs>) -> CallToolResult {
        match self
            .client
            .resume_sandbox(&a.sandbox_id, &Default::default())
            .await
        {
            Ok(r) => text(format!(
                "resumed {} (processes kept: {}, expires_at: {})",
                r.sandbox.id, r.processes_kept, r.sandbox.expires_at
            )),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Show a sandbox's network egress policy: whether it may reach the internet, the destinations always allowed (allow_out) and always refused (deny_out), and its address."
    )]
    async fn get_network_policy(&self, Parameters(a): Parameters<SandboxIdArgs>) -> CallToolResult {
        match self.client.get_network(&a.sandbox_id).await {
            Ok(n) => text(to_json(&n)),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "Change a sandbox's network egress policy, live: allow_internet, allow_out and deny_out (each unchanged when absent). Returns the new policy."
    )]
    async fn set_network_policy(
        &self,
        Parameters(a): Parameters<SetNetworkArgs>,
    ) -> CallToolResult {
        let mut policy = match self.client.get_network(&a.sandbox_id).await {
            Ok(n) => n.policy,
            Err(e) => return api_error(e),
        };
        if let Some(v) = a.allow_internet {
            policy.allow_internet = v;
        }
        if let Some(v) = a.allow_out {
            policy.allow_out = v;
        }
        if let Some(v) = a.deny_out {
            policy.deny_out = v;
        }
        match self.client.set_network(&a.sandbox_id, &policy).await {
            Ok(n) => text(to_json(&n.policy)),
            Err(e) => api_error(e),
        }
    }

    #[tool(
        description = "The sandbox's connection log: every outbound connection and DNS question, oldest first, with the decision (allow/deny/audit), the rule that decided and the bytes moved. Use it to see what a program tried to reach."
    )]
    async fn network_log(&self, Parameters(a): Parameters<NetworkLogArgs>) -> CallToolResult {
        let decision = match a.decision.as_deref().map(str::trim) {
            None | Some("") => None,
            Some(d) => match serde_json::from_value(serde_json::Value::String(d.to_string())) {
                Ok(d) => Some(d),
                Err(_) => {
                    return CallToolResult::error(vec![Content::text(format!(
                        "error: decision {d:?}: use allow, deny or audit"
                    ))])
                }
            },
        };
        let q = moat_api::NetworkLogQuery {
            decision,
            limit: Some(a.limit.unwrap_or(100).clamp(1, 1000)),
            ..Default::default()
        };
        match self.client.network_log(&a.sandbox_id, &q).await {
            Ok(entries) if entries.is_empty() => text("no connections logged"),
            Ok(entries) => {
                let lines: Vec<String> = entries
                    .iter()
                    .map(|e| {
                        let dst = match (&e.name, &e.dst_ip, e.dst_port) {
                            (Some(n), _, Some(p)) => format!("{n}:{p}"),
                            (Some(n), _, None) => n.clone(),
                            (None, Some(ip), Some(p)) => format!("{ip}:{p}"),
                            (None, Some(ip), None) => ip.clone(),
                            (None, None, _) => "?".into(),
                        };
                        let decision = serde_json::to_value(e.decision)
                            .ok()
                            .and_then(|v| v.as_str().map(str::to_string))
                            .unwrap_or_default();
                        format!(
                            "{}\t{}\t{}\t{}\t{}\t{}/{}",
                            e.at, e.protocol, dst, decision, e.rule, e.bytes_out, e.bytes_in
                        )
                    })
                    .collect();
                text(truncated(
                    &format!(
                        "at\tprotocol\tdestination\tdecision\trule\tbytes out/in\n{}",
                        lines.join("\n")
                    ),
                    MAX_TEXT_BYTES,
                ))
            }
            Err(e) => api_error(e),
        }
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for MoatMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("moat", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "moat runs isolated Linux sandboxes. Create one with create_sandbox, then run shell \
                 commands (run_command), stateful code cells (run_code) and read/write files in it \
                 by its sandbox_id. Save a state with snapshot_sandbox, start copies of it with \
                 fork_snapshot, go back with reset_sandbox; pause_sandbox/resume_sandbox freeze \
                 and continue it; get_network_policy/set_network_policy and network_log show and \
                 change what it may reach. Kill it with kill_sandbox when done.",
            )
    }
}

/// Serves MCP over this process's stdin/stdout until the client disconnects.
pub async fn serve_stdio(client: Client) -> anyhow::Result<()> {
    let service = MoatMcp::new(client)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| anyhow::anyhow!("MCP initialization failed: {e}"))?;
    service.waiting().await?;
    Ok(())
}

/// A tower service speaking MCP's streamable HTTP transport; each session's tools act through a
/// clone of `client`. Mount it at `/mcp` behind the API-key check.
pub fn http_service(
    client: Client,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    MoatMcp,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService,
    };
    StreamableHttpService::new(
        move || Ok(MoatMcp::new(client.clone())),
        Default::default(),
        // The API key guards the endpoint; the daemon may be reached by any host name.
        StreamableHttpServerConfig::default().disable_allowed_hosts(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_char_boundaries() {
        assert_eq!(truncated("abc", 5), "abc");
        let t = truncated("héllo", 2);
        assert!(t.starts_with("h\n[... truncated: 1 of 6 bytes"), "{t}");
    }

    #[test]
    fn languages() {
        assert_eq!(parse_language(None), Ok(None));
        assert_eq!(
            parse_language(Some("JS")),
            Ok(Some(CodeLanguage::Javascript))
        );
        assert!(parse_language(Some("cobol")).is_err());
    }

    #[test]
    fn tools_are_listed() {
        let client = Client::new("http://127.0.0.1:1", "k").unwrap();
        let names: Vec<String> = MoatMcp::new(client)
            .tool_router
            .list_all()
            .into_iter()
            .map(|t| t.name.to_string())
            .collect();
        for n in [
            "create_sandbox",
            "list_sandboxes",
            "kill_sandbox",
            "run_command",
            "run_code",
            "read_file",
            "write_file",
            "list_files",
            "snapshot_sandbox",
            "fork_snapshot",
            "reset_sandbox",
            "pause_sandbox",
            "resume_sandbox",
            "get_network_policy",
            "set_network_policy",
            "network_log",
        ] {
            assert!(names.iter().any(|x| x == n), "missing {n} in {names:?}");
        }
    }
}
