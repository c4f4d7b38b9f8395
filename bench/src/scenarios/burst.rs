//! Scenario 2: a burst of concurrent cold starts (create → exit of `true`), all at once.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::{true_peer, Ctx, ALL_PEERS, MOAT_SHORT};
use crate::moat::{self, COLD_TEMPLATE};
use crate::peers;
use crate::report::{grid, status_cell, Row, Section};
use crate::stats::{fmt_ms, summarize};

pub const TITLE: &str = "2. Burst: many cold starts at once";
pub const INTRO: &str = "The same create → exit of `true` as scenario 1, but the whole burst is \
     started at the same moment. moat: that many concurrent API calls (create of the unpooled \
     template, then `true`), each on its own connection; the sandboxes are deleted after the burst, \
     untimed. Peers: that many concurrent processes, released together by a barrier. *Wall* is from \
     the release to the last exit; *per item* is each one's own start → exit. Bursts of each row are \
     interleaved with the other rows'.";

struct Burst {
    row: Row,
    walls: Vec<Duration>,
}

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let n = ctx.scale.burst;
    let reps = ctx.scale.burst_reps;
    let mut rows = vec![Burst {
        row: Row::new("**moat** (no warm pool)", MOAT_SHORT),
        walls: Vec::new(),
    }];
    let mut launches = Vec::new();
    for peer in ALL_PEERS {
        let (mut row, launch) = true_peer(ctx, peer, "burst");
        row.isolation = peer.short_isolation().to_string();
        if let Some(l) = launch {
            launches.push((rows.len(), l));
        }
        rows.push(Burst {
            row,
            walls: Vec::new(),
        });
    }

    eprintln!("scenario 2: bursts of {n}, {reps} per row");
    for rep in 0..reps {
        // moat
        let t0 = Instant::now();
        let results = futures::future::join_all(
            (0..n).map(|_| moat::create_and_true(ctx.client, COLD_TEMPLATE, ctx.cleanup)),
        )
        .await;
        let wall = t0.elapsed();
        let mut ids = Vec::new();
        let mut first_err = None;
        for r in results {
            match r {
                Ok((id, d)) => {
                    ids.push(id);
                    rows[0].row.samples.push(d);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        rows[0].walls.push(wall);
        moat::delete_all(ctx.client, &ids, ctx.cleanup).await?;
        if let Some(e) = first_err {
            return Err(e.context(format!("moat burst {rep}")));
        }

        for (idx, launch) in &launches {
            if !rows[*idx].row.ok() {
                continue;
            }
            let cmds: Vec<_> = (0..n).map(|k| launch.argv(&format!("{rep}-{k}"))).collect();
            let (wall, items) = tokio::task::block_in_place(|| burst_of(&cmds));
            let mut failed = None;
            for item in items {
                match item {
                    Ok(d) => rows[*idx].row.samples.push(d),
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            rows[*idx].walls.push(wall);
            if let Some(e) = failed {
                rows[*idx].row.fail(format!("{e:#}"));
            }
        }
        eprintln!("  {}/{reps}", rep + 1);
    }

    let moat_wall = summarize(&rows[0].walls).map(|s| s.median);
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|b| {
            let mut cells = vec![b.row.name.clone()];
            match (
                status_cell(&b.row.status),
                summarize(&b.walls),
                summarize(&b.row.samples),
            ) {
                (None, Some(w), Some(s)) => {
                    let ratio = match moat_wall {
                        Some(m) if !m.is_zero() => {
                            format!("{:.2}×", w.median.as_secs_f64() / m.as_secs_f64())
                        }
                        _ => "—".into(),
                    };
                    cells.extend([
                        fmt_ms(w.median),
                        fmt_ms(w.p95),
                        fmt_ms(s.median),
                        fmt_ms(s.p95),
                        s.runs.to_string(),
                        ratio,
                    ]);
                }
                (Some(why), _, _) => {
                    cells.push(why);
                    cells.extend(std::iter::repeat_n(String::new(), 5));
                }
                _ => {
                    cells.push("no samples".into());
                    cells.extend(std::iter::repeat_n(String::new(), 5));
                }
            }
            cells.push(b.row.isolation.clone());
            cells
        })
        .collect();
    section.push(format!(
        "{reps} burst(s) of {n} per row; wall: median and worst of the bursts; per item: over all \
         {} items of the row.\n",
        reps * n
    ));
    section.push(grid(
        &[
            ("row", false),
            ("burst wall median ms", true),
            ("burst wall max ms", true),
            ("per item median ms", true),
            ("per item p95 ms", true),
            ("items", true),
            ("× moat (wall)", true),
            ("isolation", false),
        ],
        &table,
    ));
    Ok(())
}

/// Runs `cmds` all at once from threads released together; the wall time from the release to the
/// last exit and each command's own time.
fn burst_of(cmds: &[Vec<std::ffi::OsString>]) -> (Duration, Vec<Result<Duration>>) {
    let barrier = Barrier::new(cmds.len() + 1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = cmds
            .iter()
            .map(|cmd| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    peers::time_cmd_sync(cmd)
                })
            })
            .collect();
        barrier.wait();
        let t0 = Instant::now();
        let items: Vec<Result<Duration>> = handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a burst thread panicked")))
            })
            .collect();
        (t0.elapsed(), items)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_of_true() {
        let cmds = vec![vec!["true".into()]; 4];
        let (wall, items) = burst_of(&cmds);
        assert_eq!(items.len(), 4);
        for i in &items {
            assert!(*i.as_ref().unwrap() <= wall + Duration::from_millis(50));
        }
        let (_, items) = burst_of(&[vec!["false".into()]]);
        assert!(items[0].is_err());
    }
}
