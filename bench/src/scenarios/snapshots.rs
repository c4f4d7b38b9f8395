//! Scenario 4: snapshots. A fork of a snapshot against a cold create (with and without redoing the
//! setup the snapshot holds), fork of 10 in one call against 10 concurrent cold creates, reset in
//! place, and the time to take a snapshot against the size of what changed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use moat_api::{CreateSandboxRequest, CreateSnapshotRequest, ForkRequest, ResetRequest};

use super::{progress, Ctx};
use crate::cleanup::LABEL;
use crate::moat::{self, COLD_TEMPLATE};
use crate::report::{self, Row, Section};

pub const TITLE: &str = "4. Snapshots: fork vs cold create, reset, snapshot time";
pub const INTRO: &str =
    "The setup an agent would otherwise repeat: 20 MiB of data and 200 small files written into a \
     fresh sandbox (standing in for installed packages). Its filesystem snapshot is then forked. \
     Rows: one sandbox from the snapshot → exit of `true`; a cold create (template not pooled) → \
     exit of `true` (no setup); a cold create + the setup → exit of `true` (what the fork saves); \
     `fork` of 10 in one call until all 10 answered vs 10 concurrent cold creates; `reset` of a \
     sandbox to the snapshot (processes killed, writable layer replaced) until it runs `true` \
     again. All moat (no peer in this run has a filesystem snapshot + fork in one call; `podman \
     commit` + `podman run` would be the nearest). Sequential, rows interleaved.";

const SETUP: &str = "dd if=/dev/urandom of=/opt/data bs=1M count=20 status=none && mkdir -p \
                     /opt/many && for i in $(seq 200); do echo $i > /opt/many/$i; done";

fn labels() -> BTreeMap<String, String> {
    BTreeMap::from([(LABEL.to_string(), "1".to_string())])
}

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let c = ctx.client;
    let runs = ctx.scale.runs;
    let src = moat::create(c, COLD_TEMPLATE, ctx.cleanup).await?;
    moat::run_argv(c, &src.id, &["sh", "-c", SETUP]).await?;
    let snap = c
        .create_snapshot(&src.id, &CreateSnapshotRequest::default())
        .await
        .context("snapshot")?;
    let result = measure(ctx, section, &snap.id, runs).await;
    moat::delete(c, &src.id, ctx.cleanup).await?;
    c.delete_snapshot(&snap.id)
        .await
        .context("delete snapshot")?;
    result
}

async fn from_snapshot(ctx: &Ctx<'_>, snap: &str) -> Result<String> {
    let sbx = ctx
        .client
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(snap.to_string()),
            timeout: Some(900),
            metadata: labels(),
            ..Default::default()
        })
        .await
        .context("create from the snapshot")?;
    ctx.cleanup.add_sandbox(&sbx.id);
    Ok(sbx.id)
}

async fn measure(ctx: &Ctx<'_>, section: &mut Section, snap: &str, runs: usize) -> Result<()> {
    let c = ctx.client;
    let mut rows = vec![
        Row::new(
            "**moat** from the snapshot → exit of `true`",
            "the snapshot's layer over the template, fresh writable layer",
        ),
        Row::new(
            "moat cold create → exit of `true` (no setup)",
            "template only",
        ),
        Row::new(
            "moat cold create + the setup → exit of `true`",
            "template only, setup redone",
        ),
    ];
    eprintln!("scenario 4: fork vs cold, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let t = Instant::now();
        let id = from_snapshot(ctx, snap).await?;
        moat::run_true(c, &id).await?;
        let d0 = t.elapsed();
        moat::delete(c, &id, ctx.cleanup).await?;

        let (id, d1) = moat::create_and_true(c, COLD_TEMPLATE, ctx.cleanup).await?;
        moat::delete(c, &id, ctx.cleanup).await?;

        let t = Instant::now();
        let sbx = moat::create(c, COLD_TEMPLATE, ctx.cleanup).await?;
        moat::run_argv(c, &sbx.id, &["sh", "-c", SETUP]).await?;
        moat::run_true(c, &sbx.id).await?;
        let d2 = t.elapsed();
        moat::delete(c, &sbx.id, ctx.cleanup).await?;
        if timed {
            rows[0].samples.push(d0);
            rows[1].samples.push(d1);
            rows[2].samples.push(d2);
        }
        progress(i, runs);
    }
    section.push(report::table(&rows, 0));

    // Ten at once.
    let reps = ctx.scale.burst_reps.max(1);
    let mut ten = vec![
        Row::new(
            "**moat** `fork` count 10 (one call) → all 10 ran `true`",
            "as above",
        ),
        Row::new(
            "moat 10 concurrent cold creates → all 10 ran `true`",
            "template only",
        ),
    ];
    for _ in 0..reps {
        let t = Instant::now();
        let made = c
            .fork(
                snap,
                &ForkRequest {
                    count: 10,
                    timeout: Some(900),
                    metadata: labels(),
                    ..Default::default()
                },
            )
            .await
            .context("fork 10")?;
        let ids: Vec<String> = made.into_iter().map(|s| s.id).collect();
        for id in &ids {
            ctx.cleanup.add_sandbox(id);
        }
        futures::future::try_join_all(ids.iter().map(|id| moat::run_true(c, id))).await?;
        ten[0].samples.push(t.elapsed());
        moat::delete_all(c, &ids, ctx.cleanup).await?;

        let t = Instant::now();
        let made = futures::future::try_join_all(
            (0..10).map(|_| moat::create_and_true(c, COLD_TEMPLATE, ctx.cleanup)),
        )
        .await?;
        ten[1].samples.push(t.elapsed());
        let ids: Vec<String> = made.into_iter().map(|(id, _)| id).collect();
        moat::delete_all(c, &ids, ctx.cleanup).await?;
    }
    section.push(report::table(&ten, 0));

    // Reset in place.
    let mut reset = vec![Row::new(
        "**moat** `reset` → exit of `true`",
        "processes killed, writable layer replaced by an empty one over the snapshot",
    )];
    let id = from_snapshot(ctx, snap).await?;
    for i in 0..=runs {
        moat::run_argv(c, &id, &["sh", "-c", "echo x > /root/changed"]).await?;
        let t = Instant::now();
        c.reset_sandbox(&id, &ResetRequest::default())
            .await
            .context("reset")?;
        moat::run_true(c, &id).await?;
        if i > 0 {
            reset[0].samples.push(t.elapsed());
        }
    }
    moat::delete(c, &id, ctx.cleanup).await?;
    section.push(report::table(&reset, 0));

    // Snapshot time against the size of the change.
    let sizes: &[u64] = if ctx.quick { &[1] } else { &[1, 10, 100] };
    let reps = if ctx.quick { 1 } else { 5 };
    let mut table = String::from(
        "| change written | snapshot call median ms | frozen median ms | layer MiB | runs |\n|---:|---:|---:|---:|---:|\n",
    );
    for &mib in sizes {
        let sbx = moat::create(c, COLD_TEMPLATE, ctx.cleanup).await?;
        moat::run_argv(
            c,
            &sbx.id,
            &[
                "sh",
                "-c",
                &format!("dd if=/dev/urandom of=/opt/change bs=1M count={mib} status=none"),
            ],
        )
        .await?;
        let (mut calls, mut frozen, mut size) = (Vec::new(), Vec::new(), 0);
        for _ in 0..reps {
            let t = Instant::now();
            let s = c
                .create_snapshot(&sbx.id, &CreateSnapshotRequest::default())
                .await
                .context("snapshot")?;
            calls.push(t.elapsed());
            frozen.push(Duration::from_millis(s.frozen_ms));
            size = s.size_bytes;
            c.delete_snapshot(&s.id).await?;
        }
        moat::delete(c, &sbx.id, ctx.cleanup).await?;
        calls.sort();
        frozen.sort();
        table.push_str(&format!(
            "| {mib} MiB | {:.1} | {:.1} | {:.1} | {reps} |\n",
            calls[calls.len() / 2].as_secs_f64() * 1e3,
            frozen[frozen.len() / 2].as_secs_f64() * 1e3,
            size as f64 / (1u64 << 20) as f64
        ));
    }
    section.push(table);
    Ok(())
}
