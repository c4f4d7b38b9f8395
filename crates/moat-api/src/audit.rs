//! The audit log: API actions and commands started in sandboxes (`GET /v1/audit`,
//! `GET /v1/sandboxes/{id}/audit`). See docs/audit.md.

use serde::{Deserialize, Serialize};

/// One audit log entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    /// Increasing with insertion.
    pub id: i64,
    /// When it happened, milliseconds since the Unix epoch (API actions: when the request arrived;
    /// `command.start`: when the process started; `command.exit`: when the daemon saw the exit).
    pub at_ms: i64,
    /// The same time, RFC 3339.
    pub at: String,
    /// Who: the API key's id (first 12 hex digits of its SHA-256), `anonymous` for a request without a
    /// valid key, `daemon` for what the daemon observed itself.
    pub actor: String,
    /// What: `METHOD /path/{template}` for API actions, or `command.start` / `command.exit`.
    pub action: String,
    /// Which sandbox, when the action concerns one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// Outcome: the HTTP status of API actions, the exit code of `command.exit` (absent when a signal
    /// ended it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<i64>,
    /// Details: argv, cwd, user, pid, tag, exit_code, signal, reason, timed_out, duration_ms, error.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    #[serde(default)]
    pub detail: serde_json::Value,
}

/// Answer of `GET /v1/audit` (`format=json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditList {
    pub entries: Vec<AuditEntry>,
}

/// Filters of `GET /v1/audit` and `GET /v1/sandboxes/{id}/audit`; entries come oldest first.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only entries of this sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// Only this action (exact), e.g. `command.exit` or `POST /v1/sandboxes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<String>,
    /// Only this actor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    /// At or after: RFC 3339 or Unix milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// Before: RFC 3339 or Unix milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    /// At most this many entries (default 100, at most 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 10000))]
    pub limit: Option<u32>,
    /// `json` (default) or `jsonl` (one entry per line, `application/x-ndjson`: the export format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(pattern = "^(json|jsonl)$"))]
    pub format: Option<String>,
}
