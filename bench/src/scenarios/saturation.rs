//! Scenario 7: sandboxes created per second at saturation.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::{true_peer, Ctx, Launch, Peer, MOAT_SHORT};
use crate::moat::{self, COLD_TEMPLATE};
use crate::peers;
use crate::report::{grid, status_cell, Row, Section};

pub const TITLE: &str = "7. Saturation: sandboxes created per second";
pub const INTRO: &str = "N creators work concurrently for a fixed time, each in a loop: moat \
     create (unpooled template) → exit of `true` → delete through the API; peers: one command \
     that starts an instance, runs `/bin/true` in it and tears it down. Rate = complete cycles / \
     wall time (from the start until the last cycle begun before the deadline ends). Rows \
     interleaved for each N; the peak over N is the saturation rate on this machine.";

/// The peers measured here: the cheapest (bwrap), the OCI runtime (runc) and a daemon-ful
/// engine (podman).
const PEERS: [Peer; 3] = [Peer::Bwrap, Peer::RuncRun, Peer::PodmanRun];

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let dur = ctx.scale.saturation;
    let creators = ctx.scale.creators.clone();
    let mut rows = vec![Row::new("**moat**", MOAT_SHORT)];
    let mut launches: Vec<(usize, Launch)> = Vec::new();
    for peer in PEERS {
        let (mut row, launch) = true_peer(ctx, peer, "sat");
        row.isolation = peer.short_isolation().to_string();
        if let Some(l) = launch {
            launches.push((rows.len(), l));
        }
        rows.push(row);
    }
    // rates[row][k]: creates per second with creators[k].
    let mut rates: Vec<Vec<Option<f64>>> = vec![Vec::new(); rows.len()];
    for (k, &n) in creators.iter().enumerate() {
        eprintln!(
            "scenario 7: saturation, {n} creators, {} s per row",
            dur.as_secs_f64()
        );
        let t0 = Instant::now();
        let deadline = t0 + dur;
        let counts = futures::future::join_all((0..n).map(|_| async move {
            let mut c = 0usize;
            while Instant::now() < deadline {
                moat::cold_once(ctx.client, COLD_TEMPLATE, ctx.cleanup).await?;
                c += 1;
            }
            anyhow::Ok(c)
        }))
        .await;
        let wall = t0.elapsed();
        let total = counts
            .into_iter()
            .collect::<Result<Vec<usize>>>()?
            .iter()
            .sum::<usize>();
        rates[0].push(Some(total as f64 / wall.as_secs_f64()));

        for (idx, launch) in &launches {
            if !rows[*idx].ok() {
                rates[*idx].push(None);
                continue;
            }
            let (done, wall, err) =
                tokio::task::block_in_place(|| loop_for(launch, n, dur, &format!("{k}")));
            if let Some(e) = err {
                rows[*idx].fail(format!("{e:#}"));
                rates[*idx].push(None);
            } else {
                rates[*idx].push(Some(done as f64 / wall.as_secs_f64()));
            }
        }
    }

    let peak = |r: &[Option<f64>]| {
        r.iter()
            .flatten()
            .copied()
            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
    };
    let moat_peak = peak(&rates[0]);
    let table: Vec<Vec<String>> = rows
        .iter()
        .zip(&rates)
        .map(|(row, r)| {
            let mut cells = vec![row.name.clone()];
            if let Some(why) = status_cell(&row.status) {
                cells.push(why);
                cells.extend(std::iter::repeat_n(String::new(), creators.len() + 1));
            } else {
                for k in 0..creators.len() {
                    cells.push(
                        r.get(k)
                            .copied()
                            .flatten()
                            .map_or("—".into(), |x| format!("{x:.1}")),
                    );
                }
                let p = peak(r);
                cells.push(p.map_or("—".into(), |x| format!("**{x:.1}**")));
                cells.push(match (p, moat_peak) {
                    (Some(p), Some(m)) if m > 0.0 => format!("{:.2}×", p / m),
                    _ => "—".into(),
                });
            }
            cells.push(row.isolation.clone());
            cells
        })
        .collect();
    let heads: Vec<String> = creators.iter().map(|n| format!("N={n} /s")).collect();
    let mut cols: Vec<(&str, bool)> = vec![("row", false)];
    cols.extend(heads.iter().map(|h| (h.as_str(), true)));
    cols.extend([
        ("peak /s", true),
        ("× moat (peak)", true),
        ("isolation", false),
    ]);
    section.push(format!(
        "{} s per measurement; creators N = {}.",
        dur.as_secs_f64(),
        creators
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    section.push(grid(&cols, &table));
    Ok(())
}

/// `n` threads running `launch` in a loop until `dur` has passed: (cycles done, wall, first error).
fn loop_for(
    launch: &Launch,
    n: usize,
    dur: Duration,
    tag: &str,
) -> (usize, Duration, Option<anyhow::Error>) {
    let done = AtomicUsize::new(0);
    let t0 = Instant::now();
    let deadline = t0 + dur;
    let errors: Vec<anyhow::Error> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|w| {
                let done = &done;
                scope.spawn(move || {
                    let mut i = 0usize;
                    while Instant::now() < deadline {
                        peers::time_cmd_sync(&launch.argv(&format!("{tag}-{w}-{i}")))?;
                        done.fetch_add(1, Ordering::Relaxed);
                        i += 1;
                    }
                    anyhow::Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some(anyhow::anyhow!("a creator thread panicked")),
            })
            .collect()
    });
    (done.into_inner(), t0.elapsed(), errors.into_iter().next())
}
