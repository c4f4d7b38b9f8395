//! The moat side of every scenario: calls through the real API with the Rust client, as an SDK user
//! makes them.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use moat_api::{CreateSandboxRequest, ProcessEvent, StartProcessRequest};
use moat_client::Client;

use crate::cleanup::{Cleanup, LABEL};

/// The daemon's default template; its creates are served from the warm pool when one is ready.
pub const TEMPLATE: &str = "base";
/// The same root filesystem under another name: the daemon's warm pool only serves its default
/// template (`base`), so creates of this one always start a sandbox from nothing.
pub const COLD_TEMPLATE: &str = "bench-cold";

/// Creates a sandbox of `template` carrying the bench's label and a 900 s timeout (a crashed bench's
/// sandboxes go away by themselves); recorded for cleanup.
pub async fn create(
    client: &Client,
    template: &str,
    cleanup: &Cleanup,
) -> Result<moat_api::Sandbox> {
    create_on(client, template, None, cleanup).await
}

/// [`create`] on a given isolation tier (None: the daemon's default).
pub async fn create_on(
    client: &Client,
    template: &str,
    isolation: Option<moat_api::Isolation>,
    cleanup: &Cleanup,
) -> Result<moat_api::Sandbox> {
    let req = CreateSandboxRequest {
        template: Some(template.into()),
        isolation,
        timeout: Some(900),
        metadata: BTreeMap::from([(LABEL.to_string(), "1".to_string())]),
        ..Default::default()
    };
    let sbx = client
        .create_sandbox(&req)
        .await
        .context("create a sandbox")?;
    cleanup.add_sandbox(&sbx.id);
    Ok(sbx)
}

pub async fn delete(client: &Client, id: &str, cleanup: &Cleanup) -> Result<()> {
    client
        .delete_sandbox(id)
        .await
        .with_context(|| format!("delete sandbox {id}"))?;
    cleanup.remove_sandbox(id);
    Ok(())
}

/// One cold start: (create alone, create → exit of `true`, delete).
pub async fn cold_once(
    client: &Client,
    template: &str,
    cleanup: &Cleanup,
) -> Result<(Duration, Duration, Duration)> {
    let t0 = Instant::now();
    let sbx = create(client, template, cleanup).await?;
    let created = t0.elapsed();
    run_true(client, &sbx.id).await?;
    let total = t0.elapsed();
    let t1 = Instant::now();
    delete(client, &sbx.id, cleanup).await?;
    Ok((created, total, t1.elapsed()))
}

/// Create → exit of `true`, timed; returns the sandbox id (not deleted) and the time.
pub async fn create_and_true(
    client: &Client,
    template: &str,
    cleanup: &Cleanup,
) -> Result<(String, Duration)> {
    let t0 = Instant::now();
    let sbx = create(client, template, cleanup).await?;
    run_true(client, &sbx.id).await?;
    Ok((sbx.id, t0.elapsed()))
}

/// Deletes `ids` concurrently; the first error, after trying them all.
pub async fn delete_all(client: &Client, ids: &[String], cleanup: &Cleanup) -> Result<()> {
    let results = futures::future::join_all(ids.iter().map(|id| delete(client, id, cleanup))).await;
    results.into_iter().collect::<Result<Vec<()>>>().map(drop)
}

/// Runs `true` in sandbox `id` and waits for its `exit` event; fails unless it exits 0.
pub async fn run_true(client: &Client, id: &str) -> Result<()> {
    run_argv(client, id, &["true"]).await
}

/// Runs argv in sandbox `id` and waits for its exit; fails unless it exits 0.
pub async fn run_argv(client: &Client, id: &str, argv: &[&str]) -> Result<()> {
    let req = StartProcessRequest {
        cmd: Some(argv.iter().map(|s| s.to_string()).collect()),
        ..Default::default()
    };
    let mut events = client
        .start_process_stream(id, &req)
        .await
        .context("start the command")?;
    while let Some(ev) = events.next().await {
        if let ProcessEvent::Exit(status) = ev.context("read the process events")? {
            if status.exit_code == Some(0) {
                return Ok(());
            }
            bail!("{argv:?} ended with {status:?}");
        }
    }
    bail!("the event stream ended without an exit event")
}

/// Runs `req` in sandbox `id` and collects it: (exit code, stdout, stderr). Output that is not UTF-8
/// is kept lossily (the bench's commands print text).
pub async fn run_collect(
    client: &Client,
    id: &str,
    req: StartProcessRequest,
) -> Result<(Option<i32>, String, String)> {
    let text = |c: &moat_api::OutputChunk| match (&c.data, &c.data_b64) {
        (Some(d), _) => d.clone(),
        (None, Some(b)) => {
            use base64::Engine;
            let raw = base64::engine::general_purpose::STANDARD
                .decode(b)
                .unwrap_or_default();
            String::from_utf8_lossy(&raw).into_owned()
        }
        _ => String::new(),
    };
    let (mut out, mut err) = (String::new(), String::new());
    let mut events = client
        .start_process_stream(id, &req)
        .await
        .context("start the command")?;
    while let Some(ev) = events.next().await {
        match ev.context("read the process events")? {
            ProcessEvent::Stdout(c) => out.push_str(&text(&c)),
            ProcessEvent::Stderr(c) => err.push_str(&text(&c)),
            ProcessEvent::Exit(status) => return Ok((status.exit_code, out, err)),
            _ => {}
        }
    }
    bail!("the event stream ended without an exit event")
}

/// A full-state snapshot of the running sandbox `id`, then a sandbox started from it (a fork of
/// one) until a `true` has run in it: (snapshot, restore) times. Both are removed afterwards.
pub async fn full_snapshot_and_restore(
    client: &Client,
    id: &str,
    cleanup: &Cleanup,
) -> Result<(Duration, Duration)> {
    let t = Instant::now();
    let snap = client
        .create_snapshot(
            id,
            &moat_api::CreateSnapshotRequest {
                kind: Some(moat_api::SnapshotKind::Full),
                ..Default::default()
            },
        )
        .await?;
    let taken = t.elapsed();
    let t = Instant::now();
    let forks = client
        .fork(
            &snap.id,
            &moat_api::ForkRequest {
                count: 1,
                timeout: Some(900),
                metadata: std::collections::BTreeMap::from([(LABEL.to_string(), "1".to_string())]),
                ..Default::default()
            },
        )
        .await?;
    for f in &forks {
        cleanup.add_sandbox(&f.id);
    }
    run_true(client, &forks[0].id).await?;
    let restored = t.elapsed();
    for f in &forks {
        delete(client, &f.id, cleanup).await?;
    }
    client.delete_snapshot(&snap.id).await?;
    Ok((taken, restored))
}
