//! `moat audit`: the daemon's audit log.

use clap::Args;
use moat_api::AuditQuery;
use moat_client::Client;

use crate::output::print_table;

#[derive(Debug, Clone, Args)]
pub struct AuditArgs {
    /// Only entries of this sandbox.
    #[arg(long)]
    pub sandbox: Option<String>,
    /// Only this action, e.g. `command.exit` or `POST /v1/sandboxes`.
    #[arg(long)]
    pub action: Option<String>,
    /// Only this actor (an API key id, `anonymous` or `daemon`).
    #[arg(long)]
    pub actor: Option<String>,
    /// At or after this time: RFC 3339 or Unix milliseconds.
    #[arg(long)]
    pub since: Option<String>,
    /// Before this time: RFC 3339 or Unix milliseconds.
    #[arg(long)]
    pub until: Option<String>,
    /// At most this many entries (the daemon's default is 100, at most 10000).
    #[arg(long)]
    pub limit: Option<u32>,
}

pub async fn run(client: &Client, args: &AuditArgs, json: bool) -> anyhow::Result<i32> {
    let q = AuditQuery {
        sandbox: None,
        action: args.action.clone(),
        actor: args.actor.clone(),
        since: args.since.clone(),
        until: args.until.clone(),
        limit: args.limit,
        format: None,
    };
    let entries = match &args.sandbox {
        Some(id) => client.sandbox_audit(id, &q).await?,
        None => client.audit(&q).await?,
    };
    if json {
        for e in &entries {
            println!("{}", serde_json::to_string(e)?);
        }
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                e.at.clone(),
                e.actor.clone(),
                e.action.clone(),
                e.sandbox_id.clone().unwrap_or_default(),
                e.status.map(|s| s.to_string()).unwrap_or_default(),
                summary(&e.detail),
            ]
        })
        .collect();
    print_table(
        &["TIME", "ACTOR", "ACTION", "SANDBOX", "STATUS", "DETAIL"],
        &rows,
    );
    Ok(0)
}

/// The interesting part of an entry's detail, on one line.
fn summary(d: &serde_json::Value) -> String {
    let mut parts = Vec::new();
    if let Some(argv) = d.get("argv").and_then(|v| v.as_array()) {
        let argv: Vec<&str> = argv.iter().filter_map(|a| a.as_str()).collect();
        parts.push(argv.join(" "));
    }
    for k in ["signal", "reason", "duration_ms", "query", "error"] {
        match d.get(k) {
            Some(serde_json::Value::Null) | None => {}
            Some(serde_json::Value::String(s)) => parts.push(format!("{k}={s}")),
            Some(v) => parts.push(format!("{k}={v}")),
        }
    }
    parts.join(" ")
}
