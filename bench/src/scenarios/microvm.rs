//! Scenario 11: the microvm tier against the container and gvisor tiers, in the same run.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use moat_api::Isolation;

use super::{missing, progress, Ctx};
use crate::moat::{self, COLD_TEMPLATE};
use crate::report::{self, Row, Section};

pub const TITLE: &str = "11. The microvm tier";
pub const INTRO: &str =
    "moat's `microvm` tier (QEMU `microvm`, Debian's cloud kernel, the agent as \
     the guest's PID 1 over virtio-serial; KVM where it boots a guest, TCG — software emulation — \
     elsewhere: the daemon's log and `GET /v1/system` say which) against the `container` and \
     `gvisor` tiers, interleaved: a cold create → exit of `true` (boot to the agent included; no \
     pool), one `true` exec'd in a running sandbox, the syscall-heavy `dd` of scenario 10 \
     (40,000 syscalls, served by the guest's own kernel), and full-state snapshots: taking one of a \
     running sandbox (microvm: QEMU saves the stopped VM's memory and devices to a file, and its \
     disk is copied) and starting a sandbox from it until a `true` has run in it (microvm: QEMU \
     loads the memory instead of booting; gvisor: `runsc restore`).";

const SYSCALL_HEAVY: [&str; 5] = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=20000"];

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let runs = ctx.scale.runs;
    let client = ctx.client;
    let mut rows = vec![
        Row::new(
            "**moat microvm** cold create → exit of `true`",
            "QEMU microvm + guest kernel boot, moat agent",
        ),
        Row::new(
            "moat container cold create → exit of `true`",
            "namespaces, seccomp, cgroups",
        ),
        Row::new(
            "moat gvisor cold create → exit of `true`",
            "gVisor Sentry + gofer",
        ),
        Row::new("**moat microvm** exec `true`", "running sandbox"),
        Row::new("moat container exec `true`", "running sandbox"),
        Row::new("**moat microvm** syscall-heavy `dd`", "guest kernel"),
        Row::new(
            "moat container syscall-heavy `dd`",
            "host kernel, seccomp filter",
        ),
        Row::new(
            "**moat microvm** full-state snapshot",
            "QMP stop + migrate to a file, disk copy",
        ),
        Row::new("moat gvisor full-state snapshot", "runsc checkpoint"),
        Row::new(
            "**moat microvm** restore → exit of `true`",
            "QEMU -incoming from the snapshot",
        ),
        Row::new("moat gvisor restore → exit of `true`", "runsc restore"),
    ];
    for r in &mut rows[3..] {
        r.ratio = false;
    }
    if !Path::new("/usr/bin/qemu-system-x86_64").is_file() {
        for i in [0, 3, 5, 7, 9] {
            rows[i].status = missing("qemu-system-x86");
        }
        section.push(report::table(&rows, 0));
        return Ok(());
    }
    let gvisor = ctx.tools.runsc;
    if !gvisor {
        for i in [2, 8, 10] {
            rows[i].status = missing("runsc");
        }
    }
    let vm = moat::create_on(client, COLD_TEMPLATE, Some(Isolation::Microvm), ctx.cleanup).await?;
    let ct = moat::create_on(
        client,
        COLD_TEMPLATE,
        Some(Isolation::Container),
        ctx.cleanup,
    )
    .await?;
    let gv = match gvisor {
        true => Some(
            moat::create_on(client, COLD_TEMPLATE, Some(Isolation::Gvisor), ctx.cleanup).await?,
        ),
        false => None,
    };
    eprintln!("scenario 11: microvm tier, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let mut sample = Vec::with_capacity(rows.len());
        for iso in [Isolation::Microvm, Isolation::Container, Isolation::Gvisor] {
            if iso == Isolation::Gvisor && !gvisor {
                sample.push(None);
                continue;
            }
            let t = Instant::now();
            let s = moat::create_on(client, COLD_TEMPLATE, Some(iso), ctx.cleanup).await?;
            moat::run_true(client, &s.id).await?;
            sample.push(Some(t.elapsed()));
            moat::delete(client, &s.id, ctx.cleanup).await?;
        }
        for id in [&vm.id, &ct.id] {
            let t = Instant::now();
            moat::run_true(client, id).await?;
            sample.push(Some(t.elapsed()));
        }
        for id in [&vm.id, &ct.id] {
            let t = Instant::now();
            moat::run_argv(client, id, &SYSCALL_HEAVY).await?;
            sample.push(Some(t.elapsed()));
        }
        let (vm_snap, vm_restore) =
            moat::full_snapshot_and_restore(client, &vm.id, ctx.cleanup).await?;
        let (gv_snap, gv_restore) = match &gv {
            Some(g) => {
                let (a, b) = moat::full_snapshot_and_restore(client, &g.id, ctx.cleanup).await?;
                (Some(a), Some(b))
            }
            None => (None, None),
        };
        sample.extend([Some(vm_snap), gv_snap, Some(vm_restore), gv_restore]);
        if timed {
            for (r, d) in rows.iter_mut().zip(sample) {
                if let Some(d) = d {
                    r.samples.push(d);
                }
            }
        }
        progress(i, runs);
    }
    moat::delete(client, &vm.id, ctx.cleanup).await?;
    moat::delete(client, &ct.id, ctx.cleanup).await?;
    if let Some(g) = &gv {
        moat::delete(client, &g.id, ctx.cleanup).await?;
    }
    section.push(report::table(&rows, 0));
    Ok(())
}
