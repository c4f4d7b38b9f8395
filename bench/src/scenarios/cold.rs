//! Scenario 1: from nothing to the exit of `true` in a new isolated environment, sequential.

use anyhow::{Context, Result};

use super::{progress, true_peer, Ctx, ALL_PEERS};
use crate::moat::{self, COLD_TEMPLATE, TEMPLATE};
use crate::peers;
use crate::report::{self, Row, Section};

pub const TITLE: &str =
    "1. Cold start: from nothing to the exit of `true` in a new isolated environment";
pub const INTRO: &str =
    "moat: `POST /v1/sandboxes` + `POST .../processes {\"cmd\":[\"true\"]}` until \
     the `exit` event, over HTTP on loopback with the Rust client; its delete is timed separately. \
     Peers: the wall time of one command from spawn to exit (their teardown is inside it). \
     Sequential, rows interleaved.";

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let runs = ctx.scale.runs;
    let mut rows = vec![
        Row::new(
            "**moat** create → exit of `true` (cold: no warm pool)",
            ctx.iso.moat.clone(),
        ),
        Row::new("moat: create alone (201 answered)", "part of the row above"),
        Row::new("moat: delete", "timed separately, not in the row above"),
    ];
    rows[1].ratio = false;
    rows[2].ratio = false;
    let mut launches = Vec::new();
    for peer in ALL_PEERS {
        let (row, launch) = true_peer(ctx, peer, "cold");
        if let Some(l) = launch {
            launches.push((rows.len(), l));
        }
        rows.push(row);
    }
    let warm = rows.len();
    rows.push(Row::new(
        "**moat** create → exit of `true` (warm pool)",
        "the same; the sandbox was started ahead of demand (`--pool-size`, default 2)",
    ));

    eprintln!("scenario 1: cold start, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let (c, total, del) = moat::cold_once(ctx.client, COLD_TEMPLATE, ctx.cleanup)
            .await
            .with_context(|| format!("moat cold start, run {i}"))?;
        if timed {
            rows[0].samples.push(total);
            rows[1].samples.push(c);
            rows[2].samples.push(del);
        }
        let (_, w, _) = moat::cold_once(ctx.client, TEMPLATE, ctx.cleanup)
            .await
            .with_context(|| format!("moat warm-pool start, run {i}"))?;
        if timed {
            rows[warm].samples.push(w);
        }
        for (idx, launch) in &launches {
            if !rows[*idx].ok() {
                continue;
            }
            match peers::time_cmd(&launch.argv(&i.to_string())) {
                Ok(d) if timed => rows[*idx].samples.push(d),
                Ok(_) => {}
                Err(e) => rows[*idx].fail(format!("{e:#}")),
            }
        }
        progress(i, runs);
    }
    section.push(report::table(&rows, 0));
    Ok(())
}
