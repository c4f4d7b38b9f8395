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
        pids: args.pids,
        nofile: args.nofile,
        disk_mb: args.disk_mb,
        disk_inodes: args.disk_inodes,
        tmp_mb: args.tmp_mb,
        output_bytes: args.output_bytes,
        command_timeout: args.command_timeout,
        idle_timeout: args.idle_timeout,
        snapshot: args.snapshot.clone(),
        on_timeout: match args.on_timeout.as_deref() {
            Some("pause") => Some(moat_api::OnTimeout::Pause),
            Some("kill") => Some(moat_api::OnTimeout::Kill),
            _ => None,
        },
        network: args.net.policy(),
        allow_public_traffic: args.public_ports.then_some(true),
        auto_resume: args.auto_resume.then_some(true),
        secrets: args
            .secrets
            .iter()
            .map(|s| secret_flag(s, |n| std::env::var(n).ok()))
            .collect::<anyhow::Result<_>>()?,
    })
}

/// `--secret NAME@HOST[,HOST...]`, its value from `lookup(NAME)` (the CLI's environment).
fn secret_flag(
    flag: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<moat_api::SecretSpec> {
    let (name, hosts) = flag
        .split_once('@')
        .ok_or_else(|| anyhow::anyhow!("--secret {flag:?}: expected NAME@HOST[,HOST...]"))?;
    let value = lookup(name).filter(|v| !v.is_empty()).ok_or_else(|| {
        anyhow::anyhow!(
            "--secret {name}: set the value in this command's environment variable {name}"
        )
    })?;
    Ok(moat_api::SecretSpec {
        name: name.to_string(),
        value,
        hosts: hosts.split(',').map(str::to_string).collect(),
        inject: Default::default(),
        header: None,
        format: None,
        body: false,
    })
}

/// `moat stats [ID]`: one sandbox's usage, or a table of all running ones.
pub async fn stats(client: &Client, id: Option<&str>, json: bool) -> anyhow::Result<i32> {
    let ids: Vec<String> = match id {
        Some(id) => vec![id.to_string()],
        None => client
            .list_sandboxes(&SandboxFilter {
                state: Some(moat_api::SandboxState::Running),
                ..Default::default()
            })
            .await?
            .into_iter()
            .map(|s| s.id)
            .collect(),
    };
    let all = futures::future::join_all(ids.iter().map(|i| client.sandbox_stats(i))).await;
    let mut stats = Vec::new();
    for (i, r) in ids.iter().zip(all) {
        match r {
            Ok(s) => stats.push(s),
            // One named sandbox: its error is the answer. In the table, one that went away meanwhile
            // is left out.
            Err(e) if id.is_some() => return Err(e.into()),
            Err(e) => warn_skipped(i, &e),
        }
    }
    if json {
        match id {
            Some(_) => print_json(&stats[0])?,
            None => print_json(&stats)?,
        }
        return Ok(0);
    }
    let rows: Vec<Vec<String>> = stats.iter().map(stats_row).collect();
    print_table(
        &["ID", "CPU", "MEMORY", "PIDS", "DISK", "INODES", "OOM"],
        &rows,
    );
    Ok(0)
}

fn warn_skipped(id: &str, e: &moat_client::Error) {
    eprintln!("moat: {id}: {e}");
}

fn mib(bytes: u64) -> String {
    format!("{:.1}MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn stats_row(s: &moat_api::SandboxStats) -> Vec<String> {
    let l = &s.limits;
    let of = |used: String, limit: u64, unit: fn(u64) -> String| {
        if limit == 0 {
            used
        } else {
            format!("{used} / {}", unit(limit))
        }
    };
    vec![
        s.id.clone(),
        format!("{:.2} / {}", s.cpu_cores, l.cpu),
        of(mib(s.memory_bytes), l.memory_mb << 20, mib),
        of(s.pids.to_string(), l.pids, |n| n.to_string()),
        of(mib(s.disk_bytes), l.disk_mb << 20, mib),
        of(s.disk_inodes.to_string(), l.disk_inodes, |n| n.to_string()),
        s.oom_kills.to_string(),
    ]
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

/// `moat network ID [policy flags]`: show, or replace the egress policy.
pub async fn network(
    client: &Client,
    id: &str,
    net: &crate::cli::NetArgs,
    json: bool,
) -> anyhow::Result<i32> {
    let info = match net.policy() {
        Some(p) => client.set_network(id, &p).await?,
        None => client.get_network(id).await?,
    };
    if json {
        print_json(&info)?;
    } else {
        let p = &info.policy;
        println!("ip {} gateway {}", info.ip, info.gateway);
        println!(
            "internet {}",
            if p.allow_internet {
                "allowed"
            } else {
                "blocked"
            }
        );
        for a in &p.allow_out {
            println!("allow {a}");
        }
        for d in &p.deny_out {
            println!("deny {d}");
        }
        if p.mode == moat_api::NetworkMode::Audit {
            println!("mode audit (refuses nothing; logs what it would refuse)");
        }
    }
    Ok(0)
}

fn print_log_entry(e: &moat_api::NetworkLogEntry, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(e)?);
        return Ok(());
    }
    let dst = match (&e.dst_ip, e.dst_port) {
        (Some(ip), Some(p)) => format!("{ip}:{p}"),
        _ => "-".into(),
    };
    let name = match (&e.name, &e.name_source) {
        (Some(n), Some(s)) => format!("{n} ({s})"),
        (Some(n), None) => n.clone(),
        _ => "-".into(),
    };
    println!(
        "{} {:<3} {:<5} {:<21} {:<40} {:<22} out {} in {} {}ms{}",
        e.at,
        e.protocol,
        e.decision.as_str(),
        dst,
        name,
        e.rule,
        e.bytes_out,
        e.bytes_in,
        e.duration_ms,
        e.error
            .as_ref()
            .map(|x| format!(" error: {x}"))
            .unwrap_or_default()
    );
    Ok(())
}

/// `moat network-log ID [--follow] [--decision D]`
pub async fn network_log(
    client: &Client,
    id: &str,
    follow: bool,
    decision: Option<String>,
    limit: u32,
    json: bool,
) -> anyhow::Result<i32> {
    let decision = decision
        .map(|d| {
            serde_json::from_value::<moat_api::NetDecision>(serde_json::Value::String(d.clone()))
                .map_err(|_| anyhow::anyhow!("--decision must be allow, deny or audit, got {d:?}"))
        })
        .transpose()?;
    let q = moat_api::NetworkLogQuery {
        decision,
        limit: Some(limit),
        ..Default::default()
    };
    if !follow {
        for e in client.network_log(id, &q).await? {
            print_log_entry(&e, json)?;
        }
        return Ok(0);
    }
    let mut events = client.follow_network_log(id, &q).await?;
    while let Some(e) = futures::StreamExt::next(&mut events).await {
        print_log_entry(&e?, json)?;
    }
    Ok(0)
}

/// `moat network-proposal ID | --template NAME`
pub async fn network_proposal(
    client: &Client,
    id: Option<String>,
    template: Option<String>,
    json: bool,
) -> anyhow::Result<i32> {
    let p = match (id, template) {
        (Some(id), _) => client.network_proposal(&id).await?,
        (None, Some(t)) => client.template_network_proposal(&t).await?,
        (None, None) => anyhow::bail!("give a sandbox id or --template"),
    };
    if json {
        print_json(&p)?;
        return Ok(0);
    }
    println!("# from {} log entries", p.entries);
    for o in &p.observed {
        println!(
            "--allow-out {:<32} # {} x: {}",
            o.entry,
            o.count,
            o.covers.join(", ")
        );
    }
    if p.observed.is_empty() {
        println!("# nothing observed: --no-internet allows all of it");
    } else {
        println!("# with --no-internet");
    }
    Ok(0)
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    #[test]
    fn secret_flags_take_values_from_the_environment() {
        let env = |n: &str| (n == "GH").then(|| "v".to_string());
        let s = secret_flag("GH@api.github.com,uploads.github.com", env).unwrap();
        assert_eq!((s.name.as_str(), s.value.as_str()), ("GH", "v"));
        assert_eq!(s.hosts, ["api.github.com", "uploads.github.com"]);
        assert!(secret_flag("GH", env).is_err());
        assert!(secret_flag("NOPE@x.example", env)
            .unwrap_err()
            .to_string()
            .contains("environment variable NOPE"));
    }
}
