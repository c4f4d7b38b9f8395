//! Scenario 3: the round trip of one command (`true`) in an already running sandbox.

use std::ffi::OsString;

use anyhow::{Context, Result};

use super::{
    missing, progress, start_bwrap_sleeper, start_oci_sleeper, start_podman_sleeper, Ctx, GVISOR,
};
use crate::moat::{self, TEMPLATE};
use crate::peers::{self, argv, with};
use crate::report::{self, Row, Section};

pub const TITLE: &str = "3. Exec round trip: `true` in an already running sandbox";
pub const INTRO: &str =
    "moat: `POST .../processes {\"cmd\":[\"true\"]}` until the `exit` event, in \
     one long-lived sandbox. Peers: `runsc exec`, `runc exec` and `podman exec` into a running \
     container of theirs (`sleep infinity`, started detached on the same rootfs). Floor: `nsenter \
     --all` into a running bwrap sandbox. Sequential, rows interleaved.";

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let runs = ctx.scale.runs;
    let mut rows = vec![
        Row::new("**moat** exec `true`", ctx.iso.moat.clone()),
        Row::new("runsc exec", format!("{GVISOR}; read-only root")),
        Row::new("runc exec", ctx.iso.runc.clone()),
        Row::new("podman exec (runc)", ctx.iso.podman.clone()),
        Row::new("nsenter --all into bwrap (floor)", ctx.iso.bwrap.clone()),
    ];
    let sbx = moat::create(ctx.client, TEMPLATE, ctx.cleanup).await?;
    let mut cmds: Vec<(usize, Vec<OsString>)> = Vec::new();
    let id = ctx.name("exec");

    for (idx, base, pkg) in [(1, ctx.runsc_base(), "runsc"), (2, ctx.runc_base(), "runc")] {
        let Some(base) = base else {
            rows[idx].status = missing(pkg);
            continue;
        };
        let started = ctx
            .bundle("bundle-sleep", &["/bin/sleep", "infinity"])
            .and_then(|b| start_oci_sleeper(ctx, &base, &b, &id));
        match started {
            Ok(_) => cmds.push((idx, with(&base, &["exec", &id, "/bin/true"]))),
            Err(e) => rows[idx].fail(format!("cannot start the container: {e:#}")),
        }
    }
    match ctx.podman_base() {
        Some(base) => match start_podman_sleeper(ctx, &base, &id) {
            Ok(_) => cmds.push((3, with(&base, &["exec", &id, "/bin/true"]))),
            Err(e) => rows[3].fail(format!("cannot start the container: {e:#}")),
        },
        None => rows[3].status = missing("podman runc"),
    }
    if ctx.tools.bwrap && ctx.tools.nsenter {
        match start_bwrap_sleeper(&ctx.rootfs) {
            Ok((child, pid)) => {
                ctx.cleanup.add_child(child);
                let pid = pid.to_string();
                cmds.push((
                    4,
                    argv([
                        "nsenter",
                        "--target",
                        &pid,
                        "--all",
                        "--root",
                        "--wd",
                        "/bin/true",
                    ]),
                ));
            }
            Err(e) => rows[4].fail(format!("{e:#}")),
        }
    } else {
        rows[4].status = missing("bubblewrap util-linux");
    }

    eprintln!("scenario 3: exec round trip, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let t = std::time::Instant::now();
        moat::run_true(ctx.client, &sbx.id)
            .await
            .with_context(|| format!("moat exec, run {i}"))?;
        if timed {
            rows[0].samples.push(t.elapsed());
        }
        for (idx, cmd) in &cmds {
            if !rows[*idx].ok() {
                continue;
            }
            match peers::time_cmd(cmd) {
                Ok(d) if timed => rows[*idx].samples.push(d),
                Ok(_) => {}
                Err(e) => rows[*idx].fail(format!("{e:#}")),
            }
        }
        progress(i, runs);
    }
    moat::delete(ctx.client, &sbx.id, ctx.cleanup).await?;
    // The sleepers go now rather than at the end: the density scenario counts memory.
    ctx.cleanup.kill_children();
    let leftovers = ctx.cleanup.sweep_peers();
    if !leftovers.is_empty() {
        anyhow::bail!("could not remove the sleepers: {}", leftovers.join("; "));
    }
    section.push(report::table(&rows, 0));
    Ok(())
}
