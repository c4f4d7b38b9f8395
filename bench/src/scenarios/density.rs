//! Scenario 5: how much host memory idle sandboxes hold, by the host's own accounting.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::{
    missing, parallel, start_bwrap_sleeper, start_oci_sleeper, start_podman_sleeper, stop_oci,
    stop_podman, Ctx, Peer, MOAT_SHORT,
};
use crate::mem;
use crate::moat::{self, COLD_TEMPLATE};
use crate::peers;
use crate::report::{grid, status_cell, RowStatus, Section};

pub const TITLE: &str = "5. Density: host memory held by idle sandboxes";
pub const INTRO: &str = "Each tool in turn starts N idle instances on the same rootfs (moat: \
     sandboxes of the unpooled template, idle agent as PID 1; bwrap, runc, runsc, podman: `sleep \
     infinity`), then the host's own accounting is read — never a number the tool reports about \
     itself. *Host Δ*: `MemTotal − MemAvailable` from `/proc/meminfo` with the instances running, \
     minus the mean of the same before they started and after they were removed; each reading is \
     taken after `sync; echo 3 > /proc/sys/vm/drop_caches` and a pause, as the median of 5 readings. \
     It includes everything the instances cost the kernel and their supervisors (page tables, \
     mounts, loop devices, the daemon's or conmon's share) but also any other work on the machine \
     at the time; *drift* is how far the baseline moved (after − before), and a row is marked \
     **noisy** when that is more than a quarter of the delta. *Less unrelated processes*: the same \
     with the PSS of every process that is neither the bench's (its daemons and children) nor an \
     instance's subtracted from each reading, which takes out most of what other work allocates \
     or frees meanwhile (its kernel memory stays in); the per-instance column uses this one. *PSS*: the proportional set size (`/proc/PID/smaps_rollup`) of the instances' \
     own processes, summed — shared pages divided among their sharers, kernel memory not included; \
     insensitive to other work. *cgroup*: the median charge of each instance's own memory cgroup \
     (`memory.usage_in_bytes`), where the tool gives it one.";

/// Threads removing peer containers at the end of a density measurement (untimed teardown).
const STOP_WORKERS: usize = 8;

/// Starting stops after this long, whatever the count reached (the row says how many ran).
const START_BUDGET: Duration = Duration::from_secs(120);

#[derive(Default)]
struct Instances {
    /// Container ids / sandbox ids / podman names, to stop them.
    ids: Vec<String>,
    /// One host pid per instance (its init), for its cgroup.
    inits: Vec<u32>,
    /// Strings in the command line or cgroup path of the instances' processes.
    needles: Vec<String>,
    /// Processes that, with their descendants, are the instances (bwrap).
    roots: Vec<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Moat,
    Bwrap,
    Runc,
    Runsc,
    Podman,
}

struct Measured {
    count: usize,
    start: Duration,
    stop: Duration,
    /// Host memory in use after the instances were removed minus before they started: how much
    /// the rest of the machine moved meanwhile.
    drift_kib: Option<i64>,
    /// The same less the PSS of unrelated processes (see `mem::settled_used_kib`).
    adj_kib: Option<i64>,
    adj_drift_kib: Option<i64>,
    delta_kib: Option<i64>,
    pss_kib: u64,
    cgroup_bytes: Option<u64>,
}

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let n = ctx.scale.density;
    if !mem::drop_caches() {
        section.push(
            "Note: dropping the page cache was not allowed (not root); host Δ includes cache \
             noise.",
        );
    }
    let kinds: [(Kind, &str, String, Option<RowStatus>); 5] = [
        (Kind::Moat, "**moat**", MOAT_SHORT.to_string(), None),
        (
            Kind::Bwrap,
            "bwrap --unshare-all",
            Peer::Bwrap.short_isolation().to_string(),
            (!ctx.tools.bwrap).then(|| missing("bubblewrap")),
        ),
        (
            Kind::Runc,
            "runc run --detach",
            Peer::RuncRun.short_isolation().to_string(),
            ctx.runc_base().is_none().then(|| missing("runc")),
        ),
        (
            Kind::Runsc,
            "runsc run --detach",
            Peer::RunscRun.short_isolation().to_string(),
            ctx.runsc_base().is_none().then(|| missing("runsc")),
        ),
        (
            Kind::Podman,
            "podman run -d (runc)",
            Peer::PodmanRun.short_isolation().to_string(),
            ctx.podman_base().is_none().then(|| missing("podman runc")),
        ),
    ];
    let mut table = Vec::new();
    let mut moat_per: Option<f64> = None;
    for (kind, name, iso, status) in kinds {
        let mut cells = vec![name.to_string()];
        let result = match status {
            Some(s) => Err(status_cell(&s).unwrap_or_default()),
            None => {
                eprintln!("scenario 5: density, {n} idle instances of {name}");
                measure(ctx, kind, n)
                    .await
                    .map_err(|e| format!("failed: {e:#}"))
            }
        };
        match result {
            Ok(m) => {
                let count = m.count.max(1) as f64;
                let per = m.adj_kib.map(|d| d as f64 / 1024.0 / count);
                if matches!(kind, Kind::Moat) {
                    moat_per = per;
                }
                let ratio = match (per, moat_per) {
                    (Some(p), Some(mp)) if mp > 0.0 => format!("{:.2}×", p / mp),
                    _ => "—".into(),
                };
                cells.extend([
                    if m.count < n {
                        format!(
                            "{} (of {n}: start budget of {} s)",
                            m.count,
                            START_BUDGET.as_secs()
                        )
                    } else {
                        m.count.to_string()
                    },
                    format!("{:.1} / {:.1}", m.start.as_secs_f64(), m.stop.as_secs_f64()),
                    delta_cell(m.delta_kib, m.drift_kib),
                    delta_cell(m.adj_kib, m.adj_drift_kib),
                    per.map_or("?".into(), |p| format!("{p:.2}")),
                    ratio,
                    format!("{:.2}", m.pss_kib as f64 / 1024.0 / count),
                    m.cgroup_bytes.map_or("— (none of its own)".into(), |b| {
                        format!("{:.2}", b as f64 / 1048576.0)
                    }),
                ]);
            }
            Err(why) => {
                cells.push(why);
                cells.extend(std::iter::repeat_n(String::new(), 7));
            }
        }
        cells.push(iso);
        table.push(cells);
    }
    section.push(grid(
        &[
            ("row", false),
            ("instances", true),
            ("start / stop all s", true),
            ("host Δ MiB, raw (all; drift)", true),
            ("host Δ MiB, less unrelated processes (all; drift)", true),
            ("host Δ MiB per instance (less unrelated)", true),
            ("× moat (per instance)", true),
            ("PSS MiB per instance", true),
            ("cgroup MiB per instance", true),
            ("isolation", false),
        ],
        &table,
    ));
    Ok(())
}

async fn measure(ctx: &Ctx<'_>, kind: Kind, n: usize) -> Result<Measured> {
    let settle = ctx.scale.settle;
    let readings = ctx.scale.readings;
    let gap = Duration::from_millis(if ctx.quick { 50 } else { 200 });
    let reading = |needles: &[String]| {
        tokio::task::block_in_place(|| mem::settled_used_kib(settle, readings, gap, needles))
    };
    let t0 = Instant::now();
    let mut inst = Instances::default();
    let before = reading(&[]);
    let t_start = Instant::now();
    let started = start(ctx, kind, n, &mut inst).await;
    let start_time = t_start.elapsed();
    let measured = match started {
        Ok(()) => {
            tokio::time::sleep(settle).await;
            let during = reading(&inst.needles);
            let pids = mem::select(&inst.needles, &inst.roots);
            let pss = mem::pss_sum_kib(&pids);
            let mut cg: Vec<u64> = inst
                .inits
                .iter()
                .filter_map(|p| mem::cgroup_bytes(*p))
                .collect();
            cg.sort_unstable();
            Ok((during, pss, cg.get(cg.len() / 2).copied()))
        }
        Err(e) => Err(e),
    };
    let t1 = Instant::now();
    let stopped = stop(ctx, kind, &inst).await;
    let stop_time = t1.elapsed();
    let (during, pss, cgroup_bytes) = measured?;
    stopped?;
    let after = reading(&inst.needles);
    eprintln!(
        "  {} instances: start {:.1} s, stop {:.1} s, all with readings {:.1} s",
        inst.ids.len(),
        start_time.as_secs_f64(),
        stop_time.as_secs_f64(),
        t0.elapsed().as_secs_f64()
    );
    let delta =
        |b: u64, d: u64, a: u64| (d as i64 - (b as i64 + a as i64) / 2, a as i64 - b as i64);
    let (delta_kib, drift_kib, adj_kib, adj_drift_kib) = match (before, during, after) {
        (Some(b), Some(d), Some(a)) => {
            let (raw, drift) = delta(b.0, d.0, a.0);
            let (adj, adj_drift) = delta(b.1, d.1, a.1);
            (Some(raw), Some(drift), Some(adj), Some(adj_drift))
        }
        _ => (None, None, None, None),
    };
    Ok(Measured {
        count: inst.ids.len(),
        start: start_time,
        stop: stop_time,
        drift_kib,
        adj_kib,
        adj_drift_kib,
        delta_kib,
        pss_kib: pss,
        cgroup_bytes,
    })
}

async fn start(ctx: &Ctx<'_>, kind: Kind, n: usize, inst: &mut Instances) -> Result<()> {
    let t0 = Instant::now();
    let sleep = ["/bin/sleep", "infinity"];
    let bundle = match kind {
        // Its own bundle directory: runsc's sandbox and gofer carry its path on their command lines.
        Kind::Runsc => Some(ctx.bundle("bundle-density", &sleep)?),
        Kind::Runc => Some(ctx.bundle("bundle-sleep", &sleep)?),
        _ => None,
    };
    match kind {
        Kind::Runsc => inst.needles.push(path_str(bundle.as_deref())),
        Kind::Runc => inst.needles.push(ctx.name("dens-runc-")),
        Kind::Podman => {
            if let Some(base) = ctx.podman_base() {
                // conmon's command line names the bench's podman storage; the container is its child.
                inst.needles.extend(
                    base.iter()
                        .skip(2)
                        .take(1)
                        .map(|p| p.to_string_lossy().into_owned()),
                );
            }
        }
        _ => {}
    }
    for i in 0..n {
        if t0.elapsed() > START_BUDGET && i > 0 {
            break;
        }
        let id = ctx.name(&format!("dens-{}-{i:03}", kind_tag(kind)));
        match kind {
            Kind::Moat => {
                let sbx = moat::create(ctx.client, COLD_TEMPLATE, ctx.cleanup).await?;
                inst.needles.push(sbx.id.clone());
                if let Some(pid) = peers::find_sandbox_init(&sbx.id) {
                    inst.inits.push(pid);
                }
                inst.ids.push(sbx.id);
            }
            Kind::Bwrap => {
                let (child, pid) = start_bwrap_sleeper(&ctx.rootfs)?;
                inst.roots.push(child.id());
                inst.inits.push(pid);
                ctx.cleanup.add_child(child);
                inst.ids.push(id);
            }
            Kind::Runc | Kind::Runsc => {
                let base = if matches!(kind, Kind::Runc) {
                    ctx.runc_base()
                } else {
                    ctx.runsc_base()
                };
                let (Some(base), Some(bundle)) = (base, bundle.as_deref()) else {
                    anyhow::bail!("not installed");
                };
                // Recorded first: a failed start may leave a created container behind.
                inst.ids.push(id.clone());
                inst.inits.push(start_oci_sleeper(ctx, &base, bundle, &id)?);
            }
            Kind::Podman => {
                let Some(base) = ctx.podman_base() else {
                    anyhow::bail!("not installed");
                };
                inst.ids.push(id.clone());
                inst.inits.push(start_podman_sleeper(ctx, &base, &id)?);
            }
        }
    }
    Ok(())
}

async fn stop(ctx: &Ctx<'_>, kind: Kind, inst: &Instances) -> Result<()> {
    match kind {
        Kind::Moat => {
            for chunk in inst.ids.chunks(10) {
                moat::delete_all(ctx.client, chunk, ctx.cleanup).await?;
            }
        }
        Kind::Bwrap => ctx.cleanup.kill_children(),
        Kind::Runc | Kind::Runsc => {
            let base = if matches!(kind, Kind::Runc) {
                ctx.runc_base()
            } else {
                ctx.runsc_base()
            };
            if let Some(base) = base {
                tokio::task::block_in_place(|| {
                    parallel(&inst.ids, STOP_WORKERS, |id| stop_oci(&base, id))
                })?;
            }
        }
        Kind::Podman => {
            if let Some(base) = ctx.podman_base() {
                let chunks: Vec<Vec<String>> =
                    inst.ids.chunks(10).map(<[String]>::to_vec).collect();
                tokio::task::block_in_place(|| {
                    parallel(&chunks, STOP_WORKERS, |c| stop_podman(&base, c))
                })?;
            }
        }
    }
    Ok(())
}

/// `Δ (drift ±D)`, flagged noisy when the baseline moved by more than a quarter of the delta (and
/// 32 MiB): other work on the machine then swamped the measurement.
fn delta_cell(delta: Option<i64>, drift: Option<i64>) -> String {
    match (delta, drift) {
        (Some(d), Some(drift)) => {
            let noisy = drift.abs() > (d.abs() / 4).max(32 << 10);
            format!(
                "{:.0} (drift {:+.0}{})",
                d as f64 / 1024.0,
                drift as f64 / 1024.0,
                if noisy { ", **noisy**" } else { "" }
            )
        }
        _ => "?".into(),
    }
}

fn kind_tag(kind: Kind) -> &'static str {
    match kind {
        Kind::Moat => "moat",
        Kind::Bwrap => "bwrap",
        Kind::Runc => "runc",
        Kind::Runsc => "runsc",
        Kind::Podman => "podman",
    }
}

fn path_str(p: Option<&Path>) -> String {
    p.map(|p| p.display().to_string()).unwrap_or_default()
}
