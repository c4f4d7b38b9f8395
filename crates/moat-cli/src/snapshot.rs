//! Snapshot, fork, reset, pause and resume commands.

use moat_api::{CreateSnapshotRequest, ForkRequest, ResetRequest, ResumeRequest, SnapshotKind};
use moat_client::Client;

use crate::cli::{ForkArgs, SnapshotCommand};
use crate::output::{print_json, print_table};

pub async fn dispatch(client: &Client, cmd: SnapshotCommand, json: bool) -> anyhow::Result<i32> {
    match cmd {
        SnapshotCommand::Create {
            id,
            name,
            full,
            metadata,
        } => {
            let snap = client
                .create_snapshot(
                    &id,
                    &CreateSnapshotRequest {
                        name,
                        kind: full.then_some(SnapshotKind::Full),
                        metadata: metadata.into_iter().collect(),
                    },
                )
                .await?;
            if json {
                print_json(&snap)?;
            } else {
                println!("{}", snap.id);
            }
        }
        SnapshotCommand::Ls => {
            let snaps = client.list_snapshots().await?;
            if json {
                print_json(&snaps)?;
                return Ok(0);
            }
            let rows: Vec<Vec<String>> = snaps
                .iter()
                .map(|s| {
                    vec![
                        s.id.clone(),
                        s.name.clone().unwrap_or_default(),
                        s.template.clone(),
                        s.layers.len().to_string(),
                        format!("{:.1}MiB", s.size_bytes as f64 / (1u64 << 20) as f64),
                        s.sandbox_id.clone(),
                        s.created_at.clone(),
                    ]
                })
                .collect();
            print_table(
                &[
                    "ID", "NAME", "TEMPLATE", "LAYERS", "SIZE", "FROM", "CREATED",
                ],
                &rows,
            );
        }
        SnapshotCommand::Inspect { id } => print_json(&client.get_snapshot(&id).await?)?,
        SnapshotCommand::Rm { ids } => {
            for id in ids {
                client.delete_snapshot(&id).await?;
                if !json {
                    println!("{id}");
                }
            }
        }
    }
    Ok(0)
}

/// `moat fork SNAPSHOT -n N`: prints the new sandbox ids, one per line.
pub async fn fork(client: &Client, args: &ForkArgs, json: bool) -> anyhow::Result<i32> {
    let made = client
        .fork(
            &args.snapshot,
            &ForkRequest {
                count: args.count,
                timeout: args.timeout,
                metadata: args.metadata.iter().cloned().collect(),
                env: args.env.iter().cloned().collect(),
                on_timeout: None,
            },
        )
        .await?;
    if json {
        print_json(&made)?;
    } else {
        for s in made {
            println!("{}", s.id);
        }
    }
    Ok(0)
}

pub async fn reset(
    client: &Client,
    id: &str,
    snapshot: Option<String>,
    json: bool,
) -> anyhow::Result<i32> {
    let sbx = client.reset_sandbox(id, &ResetRequest { snapshot }).await?;
    if json {
        print_json(&sbx)?;
    } else {
        println!("{}", sbx.id);
    }
    Ok(0)
}

pub async fn pause(client: &Client, id: &str, json: bool) -> anyhow::Result<i32> {
    let r = client.pause_sandbox(id).await?;
    if json {
        print_json(&r)?;
    } else {
        println!("{} paused", r.sandbox.id);
    }
    Ok(0)
}

pub async fn resume(
    client: &Client,
    id: &str,
    timeout: Option<u64>,
    json: bool,
) -> anyhow::Result<i32> {
    let r = client
        .resume_sandbox(id, &ResumeRequest { timeout })
        .await?;
    if json {
        print_json(&r)?;
    } else {
        println!(
            "{} resumed{}; expires at {}",
            r.sandbox.id,
            if r.processes_kept {
                ""
            } else {
                " (its processes were lost: files only)"
            },
            r.sandbox.expires_at
        );
    }
    Ok(0)
}

/// `moat system df`
pub async fn df(client: &Client, json: bool) -> anyhow::Result<i32> {
    let u = client.disk_usage().await?;
    if json {
        print_json(&u)?;
        return Ok(0);
    }
    let mib = |b: u64| format!("{:.1}MiB", b as f64 / (1u64 << 20) as f64);
    let mut rows: Vec<Vec<String>> = u
        .templates
        .iter()
        .map(|t| vec![format!("template {}", t.name), "1".into(), mib(t.bytes)])
        .collect();
    rows.push(vec![
        format!("layers ({} snapshots)", u.snapshots),
        u.layers.count.to_string(),
        mib(u.layers.bytes),
    ]);
    rows.push(vec![
        "  of them the build cache".into(),
        u.build_cache.count.to_string(),
        mib(u.build_cache.bytes),
    ]);
    rows.push(vec![
        "sandbox writable layers".into(),
        u.sandboxes.count.to_string(),
        mib(u.sandboxes.bytes),
    ]);
    rows.push(vec!["total".into(), String::new(), mib(u.total_bytes)]);
    print_table(&["WHAT", "COUNT", "SIZE"], &rows);
    if let Some(fs) = &u.filesystem {
        println!(
            "\nfilesystem: {} free of {}, {} kept in reserve; sandbox quotas add up to {}{}",
            mib(fs.free_bytes),
            mib(fs.total_bytes),
            mib(fs.reserve_bytes),
            mib(fs.quota_bytes),
            if fs.low {
                " (LOW: creates, forks, snapshots and builds are refused)"
            } else {
                ""
            }
        );
    }
    Ok(0)
}
