//! Sandbox lifecycle commands: create, ls, inspect, rm, timeout.

use moat_api::{CreateSandboxRequest, Sandbox};
use moat_client::{Client, SandboxFilter};

use crate::cli::{CreateArgs, LsArgs};
use crate::output::{print_json, print_table};

/// The create request for these flags.
pub fn create_request(args: &CreateArgs) -> anyhow::Result<CreateSandboxRequest> {
    Ok(CreateSandboxRequest {
        template: args.template.clone(),
        timeout: args.timeout,
        env: args.env.iter().cloned().collect(),
        metadata: args.metadata.iter().cloned().collect(),
        cpu: args.cpu,
        memory_mb: args.memory_mb,
        isolation: args.isolation()?,
    })
}

pub async fn create(client: &Client, args: &CreateArgs, json: bool) -> anyhow::Result<i32> {
    let sbx = client.create_sandbox(&create_request(args)?).await?;
    if json {
        print_json(&sbx)?;
    } else {
        println!("{}", sbx.id);
    }
    Ok(0)
}

pub async fn list(client: &Client, args: &LsArgs, json: bool) -> anyhow::Result<i32> {
    let filter = SandboxFilter {
        state: args.state,
        metadata: args.metadata.iter().cloned().collect(),
    };
    let sandboxes = client.list_sandboxes(&filter).await?;
    if json {
        print_json(&sandboxes)?;
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = sandboxes.iter().map(row).collect();
    print_table(
        &["ID", "TEMPLATE", "STATE", "CREATED", "EXPIRES", "METADATA"],
        &rows,
    );
    Ok(0)
}

fn row(s: &Sandbox) -> Vec<String> {
    let metadata = s
        .metadata
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    vec![
        s.id.clone(),
        s.template.clone(),
        s.state.as_str().to_string(),
        s.created_at.clone(),
        s.expires_at.clone(),
        metadata,
    ]
}

pub async fn inspect(client: &Client, id: &str) -> anyhow::Result<i32> {
    print_json(&client.get_sandbox(id).await?)?;
    Ok(0)
}

pub async fn remove(client: &Client, ids: &[String], all: bool, json: bool) -> anyhow::Result<i32> {
    let ids: Vec<String> = if all {
        client
            .list_sandboxes(&SandboxFilter::default())
            .await?
            .into_iter()
            .map(|s| s.id)
            .collect()
    } else {
        ids.to_vec()
    };
    let mut code = 0;
    let mut deleted = Vec::new();
    for id in ids {
        match client.delete_sandbox(&id).await {
            Ok(()) => {
                if !json {
                    println!("{id}");
                }
                deleted.push(id);
            }
            Err(e) => {
                eprintln!("error: {id}: {e}");
                code = 1;
            }
        }
    }
    if json {
        print_json(&serde_json::json!({ "deleted": deleted }))?;
    }
    Ok(code)
}

pub async fn set_timeout(client: &Client, id: &str, secs: u64, json: bool) -> anyhow::Result<i32> {
    let sbx = client.set_timeout(id, secs).await?;
    if json {
        print_json(&sbx)?;
    } else {
        println!("{} expires at {}", sbx.id, sbx.expires_at);
    }
    Ok(0)
}
