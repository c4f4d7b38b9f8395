//! Scenario 13: a noisy neighbour. One sandbox runs a fork bomb, a memory bomb and a disk fill at
//! once (each within its default limits); what a quiet sandbox beside it and the API feel.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use moat_api::StartProcessRequest;

use super::Ctx;
use crate::moat::{self, TEMPLATE};
use crate::report::Section;

pub const TITLE: &str =
    "13. Noisy neighbour: a quiet sandbox beside a fork bomb, a memory bomb and a disk fill";
pub const INTRO: &str = "Two sandboxes with the daemon's default limits. The quiet one runs `true` \
     in a loop (each until its `exit` event) while a second client reads `GET /v1/sandboxes/{id}` \
     every 20 ms, first with nothing else running (calm), then while the other sandbox runs, all at \
     once: a fork bomb (`f(){ f|f& }; f`, up to its pids limit), a memory bomb (`tail /dev/zero` \
     again and again, each ended by its memory limit) and a disk fill (`dd` of 2 GiB in a loop, \
     deleted after each). Latency of each probe: median, p99 and worst; the host's 1-minute load \
     average at the end of each phase. Targets (issue 32): neighbour exec p99 ≤ 50 ms, API p99 ≤ 20 ms \
     under abuse.";

/// What the abusive sandbox runs: the memory bomb and the disk fill first, the fork bomb last (it
/// then takes every pid the sandbox may have: the shell starting them forks nothing after it), all
/// in the background.
pub const ABUSE: &str = "(while true; do tail /dev/zero; done) >/dev/null 2>&1 & \
     (while true; do dd if=/dev/zero of=/fill bs=1M count=2048 2>/dev/null; rm -f /fill; done) >/dev/null 2>&1 & \
     (f(){ f|f& }; f) >/dev/null 2>&1 &";

struct Probes {
    exec: Vec<Duration>,
    api: Vec<Duration>,
    failures: usize,
    load: f64,
}

fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Probes the quiet sandbox `id` and the API for `dur`.
async fn probe(ctx: &Ctx<'_>, id: &str, dur: Duration) -> Probes {
    let deadline = Instant::now() + dur;
    let exec = async {
        let (mut samples, mut failures) = (Vec::new(), 0usize);
        while Instant::now() < deadline {
            let t = Instant::now();
            match moat::run_true(ctx.client, id).await {
                Ok(()) => samples.push(t.elapsed()),
                Err(e) => {
                    failures += 1;
                    eprintln!("  neighbour exec failed: {e:#}");
                }
            }
        }
        (samples, failures)
    };
    let api = async {
        let (mut samples, mut failures) = (Vec::new(), 0usize);
        while Instant::now() < deadline {
            let t = Instant::now();
            match ctx.client.get_sandbox(id).await {
                Ok(_) => samples.push(t.elapsed()),
                Err(e) => {
                    failures += 1;
                    eprintln!("  API read failed: {e:#}");
                }
            }
            tokio::time::sleep(Duration::from_millis(20).saturating_sub(t.elapsed())).await;
        }
        (samples, failures)
    };
    let ((exec, f1), (api, f2)) = tokio::join!(exec, api);
    Probes {
        exec,
        api,
        failures: f1 + f2,
        load: load1(),
    }
}

/// (median, p99, max) in ms.
fn spread(samples: &[Duration]) -> Option<(f64, f64, f64)> {
    if samples.is_empty() {
        return None;
    }
    let mut s: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    s.sort_by(f64::total_cmp);
    let at = |p: usize| s[((p * s.len()).div_ceil(100)).clamp(1, s.len()) - 1];
    Some((at(50), at(99), s[s.len() - 1]))
}

fn row(phase: &str, what: &str, samples: &[Duration], load: f64) -> String {
    match spread(samples) {
        Some((p50, p99, max)) => format!(
            "| {phase} | {what} | {p50:.1} | {p99:.1} | {max:.1} | {} | {load:.1} |",
            samples.len()
        ),
        None => format!("| {phase} | {what} | – | – | – | 0 | {load:.1} |"),
    }
}

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let dur = if ctx.quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(30)
    };
    let quiet = moat::create(ctx.client, TEMPLATE, ctx.cleanup).await?;
    let noisy = moat::create(ctx.client, TEMPLATE, ctx.cleanup).await?;
    moat::run_true(ctx.client, &quiet.id).await?;
    eprintln!("scenario 13: noisy neighbour, {} s calm", dur.as_secs());
    let calm = probe(ctx, &quiet.id, dur).await;
    eprintln!("  the abuse starts; {} s measured", dur.as_secs());
    let (code, _, err) = moat::run_collect(
        ctx.client,
        &noisy.id,
        StartProcessRequest {
            cmd: Some(vec!["bash".into(), "-c".into(), ABUSE.into()]),
            ..Default::default()
        },
    )
    .await
    .context("start the abuse")?;
    anyhow::ensure!(code == Some(0), "the abuse did not start: {err}");
    // Let the bombs reach their limits before measuring.
    tokio::time::sleep(if ctx.quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(5)
    })
    .await;
    let abused = probe(ctx, &quiet.id, dur).await;
    let t = Instant::now();
    moat::delete(ctx.client, &noisy.id, ctx.cleanup)
        .await
        .context("delete the noisy sandbox")?;
    let delete_ms = t.elapsed().as_secs_f64() * 1e3;
    moat::delete(ctx.client, &quiet.id, ctx.cleanup).await?;
    anyhow::ensure!(
        calm.failures + abused.failures == 0,
        "{} probes failed (calm {}, abused {})",
        calm.failures + abused.failures,
        calm.failures,
        abused.failures
    );
    let mut md = String::from(
        "| phase | probe | median ms | p99 ms | max ms | probes | load (1 min) |\n|---|---|---|---|---|---|---|\n",
    );
    for (phase, p) in [("calm", &calm), ("abused", &abused)] {
        md.push_str(&row(phase, "neighbour exec `true`", &p.exec, p.load));
        md.push('\n');
        md.push_str(&row(phase, "API `GET /v1/sandboxes/{id}`", &p.api, p.load));
        md.push('\n');
    }
    section.push(md);
    section.push(format!(
        "Deleting the abusive sandbox (its bombs still running) took {delete_ms:.0} ms."
    ));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_is_median_p99_and_max() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(spread(&s), Some((50.0, 99.0, 100.0)));
        assert_eq!(spread(&[]), None);
    }
}
