//! Scenario 10: the gvisor tier against the container tier and plain `runsc do`, in the same run.

use std::ffi::OsString;
use std::time::Instant;

use anyhow::Result;
use moat_api::Isolation;

use super::{missing, progress, Ctx};
use crate::moat::{self, COLD_TEMPLATE};
use crate::peers;
use crate::report::{self, Row, Section};

pub const TITLE: &str = "10. The gvisor tier";
pub const INTRO: &str = "moat's `gvisor` tier (runsc, platform ptrace, the Sentry in the sandbox's \
     cgroup, the agent's socket bound through `--host-uds=create`) against the `container` tier and \
     plain `runsc do` on the same root filesystem, interleaved: a cold create → exit of `true` (no \
     pool), one `true` exec'd in a running sandbox, and a syscall-heavy command (`dd if=/dev/zero \
     of=/dev/null bs=1 count=20000`: 40,000 read/write syscalls, each one served by gVisor's \
     Sentry on the gvisor tier; a tenth of scenario 8's, as gVisor's ptrace platform makes each one \
     cost tens of microseconds). Floor: the same `dd` on the host. Then a full-state snapshot of the \
     running gvisor sandbox (`kind: \"full\"`) and a sandbox started from it (a fork whose processes \
     continue), to compare with the cold create.";

const SYSCALL_HEAVY: [&str; 5] = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=20000"];

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let runs = ctx.scale.runs;
    let client = ctx.client;
    let mut rows = vec![
        Row::new(
            "**moat gvisor** cold create → exit of `true`",
            "gVisor Sentry + gofer, moat agent",
        ),
        Row::new(
            "moat container cold create → exit of `true`",
            "namespaces, seccomp, cgroups",
        ),
        Row::new("`runsc do /bin/true`", "gVisor, tmpfs overlay, no agent"),
        Row::new("**moat gvisor** exec `true`", "running sandbox"),
        Row::new("moat container exec `true`", "running sandbox"),
        Row::new(
            "**moat gvisor** syscall-heavy `dd`",
            "every syscall in the Sentry",
        ),
        Row::new(
            "moat container syscall-heavy `dd`",
            "host kernel, seccomp filter",
        ),
        Row::new("`runsc do` syscall-heavy `dd`", "gVisor, no agent"),
        Row::new("`dd` on the host (floor)", "no sandbox"),
        Row::new(
            "**moat gvisor** full-state snapshot",
            "runsc checkpoint + the sandbox restored in place",
        ),
        Row::new(
            "**moat gvisor** start from it → exit of `true`",
            "runsc restore, processes continue",
        ),
    ];
    for r in &mut rows[3..] {
        r.ratio = false;
    }
    let runsc_state = ctx.cleanup.peers.runsc.clone().filter(|_| ctx.tools.runsc);
    if runsc_state.is_none() {
        for i in [0, 2, 3, 5, 7, 9, 10] {
            rows[i].status = missing("runsc");
        }
        section.push(report::table(&rows, 0));
        return Ok(());
    }
    let state = runsc_state.expect("checked above");
    let runsc_do = |cmd: &[&str]| -> Vec<OsString> {
        let mut v = peers::runsc_base(&state);
        v.extend(peers::argv(["do", "-root"]));
        v.push(ctx.rootfs.clone().into());
        v.extend(peers::argv(["-cwd", "/"]));
        v.extend(peers::argv(cmd.iter().copied()));
        v
    };
    let gv = moat::create_on(client, COLD_TEMPLATE, Some(Isolation::Gvisor), ctx.cleanup).await?;
    let ct = moat::create_on(
        client,
        COLD_TEMPLATE,
        Some(Isolation::Container),
        ctx.cleanup,
    )
    .await?;
    let host: Vec<OsString> = SYSCALL_HEAVY.iter().map(OsString::from).collect();
    eprintln!("scenario 10: gvisor tier, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let mut sample = Vec::with_capacity(rows.len());
        for iso in [Isolation::Gvisor, Isolation::Container] {
            let t = Instant::now();
            let s = moat::create_on(client, COLD_TEMPLATE, Some(iso), ctx.cleanup).await?;
            moat::run_true(client, &s.id).await?;
            sample.push(t.elapsed());
            moat::delete(client, &s.id, ctx.cleanup).await?;
        }
        sample.push(peers::time_cmd(&runsc_do(&["/bin/true"]))?);
        for id in [&gv.id, &ct.id] {
            let t = Instant::now();
            moat::run_true(client, id).await?;
            sample.push(t.elapsed());
        }
        for id in [&gv.id, &ct.id] {
            let t = Instant::now();
            moat::run_argv(client, id, &SYSCALL_HEAVY).await?;
            sample.push(t.elapsed());
        }
        sample.push(peers::time_cmd(&runsc_do(&SYSCALL_HEAVY))?);
        sample.push(peers::time_cmd(&host)?);
        let (snapshot, restore) =
            moat::full_snapshot_and_restore(client, &gv.id, ctx.cleanup).await?;
        sample.extend([snapshot, restore]);
        if timed {
            for (r, d) in rows.iter_mut().zip(sample) {
                r.samples.push(d);
            }
        }
        progress(i, runs);
    }
    moat::delete(client, &gv.id, ctx.cleanup).await?;
    moat::delete(client, &ct.id, ctx.cleanup).await?;
    section.push(report::table(&rows, 0));
    Ok(())
}
