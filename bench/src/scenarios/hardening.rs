//! Scenario 8: what hardening costs (hardened daemon vs `--no-hardening`, same run).

use std::ffi::OsString;
use std::time::Instant;

use anyhow::Result;

use super::{progress, Ctx};
use crate::moat::{self, COLD_TEMPLATE};
use crate::peers;
use crate::report::{self, Row, Section};

pub const TITLE: &str = "8. What hardening costs";
pub const INTRO: &str = "The same cold create (template not pooled) and the same syscall-heavy \
     command (`dd if=/dev/zero of=/dev/null bs=1 count=200000`: 400,000 read/write syscalls) on a \
     daemon started with `--no-hardening` (no capability drop, no seccomp filter, no /proc masks; \
     same namespaces, uid range and cgroups), interleaved with the hardened runs. Floor: the same \
     `dd` run directly on the host.";

const SYSCALL_HEAVY: [&str; 5] = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=200000"];

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let runs = ctx.scale.runs;
    let (hardened, unhardened) = (ctx.client, ctx.client_u);
    let mut rows = vec![
        Row::new(
            "**moat** cold create → exit of `true` (hardened)",
            "seccomp, capability drop, masks",
        ),
        Row::new(
            "moat cold create → exit of `true` (`--no-hardening`)",
            "namespaces, uid range, cgroups only",
        ),
        Row::new(
            "**moat** syscall-heavy `dd` (hardened)",
            "seccomp filter on every syscall",
        ),
        Row::new(
            "moat syscall-heavy `dd` (`--no-hardening`)",
            "no seccomp filter",
        ),
        Row::new("`dd` on the host (floor)", "no sandbox"),
    ];
    // The ratio column compares with the hardened create; the `dd` rows compare among themselves.
    for r in &mut rows[2..] {
        r.ratio = false;
    }
    let sh = moat::create(hardened, COLD_TEMPLATE, ctx.cleanup).await?;
    let su = moat::create(unhardened, COLD_TEMPLATE, ctx.cleanup_u).await?;
    let host: Vec<OsString> = SYSCALL_HEAVY.iter().map(OsString::from).collect();
    eprintln!("scenario 8: hardening cost, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let (_, h, _) = moat::cold_once(hardened, COLD_TEMPLATE, ctx.cleanup).await?;
        let (_, u, _) = moat::cold_once(unhardened, COLD_TEMPLATE, ctx.cleanup_u).await?;
        let t = Instant::now();
        moat::run_argv(hardened, &sh.id, &SYSCALL_HEAVY).await?;
        let dh = t.elapsed();
        let t = Instant::now();
        moat::run_argv(unhardened, &su.id, &SYSCALL_HEAVY).await?;
        let du = t.elapsed();
        let dhost = peers::time_cmd(&host)?;
        if timed {
            rows[0].samples.push(h);
            rows[1].samples.push(u);
            rows[2].samples.push(dh);
            rows[3].samples.push(du);
            rows[4].samples.push(dhost);
        }
        progress(i, runs);
    }
    moat::delete(hardened, &sh.id, ctx.cleanup).await?;
    moat::delete(unhardened, &su.id, ctx.cleanup_u).await?;
    section.push(report::table(&rows, 0));
    Ok(())
}
