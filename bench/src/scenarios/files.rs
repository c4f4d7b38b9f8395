//! Scenario 6: writing a file into a sandbox and reading it back through the files API, next to a
//! local copy on the host and `podman cp`.

use std::ffi::OsString;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use moat_client::WriteOptions;

use super::{missing, start_podman_sleeper, stop_podman, Ctx, Peer, MOAT_SHORT};
use crate::moat::{self, TEMPLATE};
use crate::peers::{self, argv, with};
use crate::report::{grid, status_cell, Row, Section};
use crate::stats::summarize;

pub const TITLE: &str = "6. File throughput: write a file into a sandbox and read it back";
pub const INTRO: &str = "moat: `PUT /v1/sandboxes/{id}/files?path=/root/bench.bin` with the whole \
     file as the body (the agent writes a temporary file, fsyncs it and renames it over the target), \
     then `GET` of the same path streamed to the client and compared byte for byte. Host floor: \
     `cp` of the same file between two paths of the data directory's filesystem, with `sync FILE` \
     (an fsync, as moat's write does) and without, and `cat FILE > /dev/null` for the read. podman: \
     `podman cp` into and out of a running container (`sleep infinity`, overlay over the rootfs). \
     The file is random bytes; everything runs from the page cache (no cache drop between runs). \
     MiB/s = size / wall time of the call; rows interleaved.";

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let size = ctx.scale.file_bytes;
    let runs = ctx.scale.file_runs;
    let mib = size as f64 / 1048576.0;
    let data = random_bytes(size);
    let dir = ctx.scratch.join("files");
    std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
    let src = dir.join("src.bin");
    let dst = dir.join("dst.bin");
    let back = dir.join("back.bin");
    std::fs::write(&src, &data).with_context(|| format!("write {}", src.display()))?;

    let mut rows = [
        Row::new("**moat** write (`PUT .../files`)", MOAT_SHORT),
        Row::new("**moat** read (`GET .../files`)", MOAT_SHORT),
        Row::new("host `cp` + `sync FILE` (write, fsync)", "no sandbox"),
        Row::new("host `cp` (write, page cache only)", "no sandbox"),
        Row::new("host `cat FILE > /dev/null` (read)", "no sandbox"),
        Row::new(
            "podman cp into a container (runc)",
            Peer::PodmanRun.short_isolation(),
        ),
        Row::new(
            "podman cp out of a container",
            Peer::PodmanRun.short_isolation(),
        ),
    ];
    let s = |p: &std::path::Path| p.display().to_string();
    let sh = |script: String| argv(["sh", "-c", script.as_str()]);
    let mut cmds: Vec<(usize, Vec<OsString>)> = vec![
        (
            2,
            sh(format!(
                "cp '{}' '{}' && sync '{}'",
                s(&src),
                s(&dst),
                s(&dst)
            )),
        ),
        (3, argv(["cp", &s(&src), &s(&dst)])),
        (4, argv(["cat", &s(&dst)])),
    ];
    let name = ctx.name("files");
    let podman = ctx.podman_base();
    match &podman {
        Some(base) => match start_podman_sleeper(ctx, base, &name) {
            Ok(_) => {
                let inside = format!("{name}:/root/bench.bin");
                cmds.push((5, with(base, &["cp", &s(&src), &inside])));
                cmds.push((6, with(base, &["cp", &inside, &s(&back)])));
            }
            Err(e) => {
                rows[5].fail(format!("cannot start the container: {e:#}"));
                rows[6].fail("see above");
            }
        },
        None => {
            rows[5].status = missing("podman runc");
            rows[6].status = missing("podman runc");
        }
    }

    let sbx = moat::create(ctx.client, TEMPLATE, ctx.cleanup).await?;
    eprintln!("scenario 6: file throughput, {mib:.0} MiB, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let body = data.clone();
        let t = Instant::now();
        let info = ctx
            .client
            .write_file(&sbx.id, "/root/bench.bin", body, &WriteOptions::default())
            .await
            .context("write the file through the API")?;
        let w = t.elapsed();
        if info.size != size as u64 {
            bail!("the written file has {} bytes, not {size}", info.size);
        }
        let t = Instant::now();
        let mut stream = ctx
            .client
            .read_file(&sbx.id, "/root/bench.bin")
            .await
            .context("read the file through the API")?;
        let mut at = 0usize;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.context("read the file's bytes")?;
            let end = at + chunk.len();
            if end > size || data[at..end] != chunk[..] {
                bail!("the file read back differs from the one written (at byte {at})");
            }
            at = end;
        }
        let r = t.elapsed();
        if at != size {
            bail!("read back {at} bytes of {size}");
        }
        if timed {
            rows[0].samples.push(w);
            rows[1].samples.push(r);
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
        if rows[6].ok()
            && timed
            && std::fs::metadata(&back).map(|m| m.len()).ok() != Some(size as u64)
        {
            rows[6].fail("the copy out has the wrong size");
        }
    }
    moat::delete(ctx.client, &sbx.id, ctx.cleanup).await?;
    if let Some(base) = &podman {
        tokio::task::block_in_place(|| stop_podman(base, &[name]))?;
    }
    for f in [&src, &dst, &back] {
        let _ = std::fs::remove_file(f);
    }

    let moat_write = summarize(&rows[0].samples).map(|s| s.median);
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|row| {
            let mut cells = vec![row.name.clone()];
            match (status_cell(&row.status), summarize(&row.samples)) {
                (None, Some(st)) => {
                    let rate = |d: Duration| mib / d.as_secs_f64().max(1e-9);
                    let ratio = match moat_write {
                        Some(m) => format!("{:.2}×", rate(st.median) / rate(m)),
                        None => "—".into(),
                    };
                    cells.extend([
                        format!("{:.0}", rate(st.median)),
                        format!("{:.0}", rate(st.p95)),
                        format!("{:.0}", rate(st.min)),
                        format!("{:.1}", st.median.as_secs_f64() * 1000.0),
                        st.runs.to_string(),
                        ratio,
                    ]);
                }
                (Some(why), _) => {
                    cells.push(why);
                    cells.extend(std::iter::repeat_n(String::new(), 5));
                }
                (None, None) => {
                    cells.push("no samples".into());
                    cells.extend(std::iter::repeat_n(String::new(), 5));
                }
            }
            cells.push(row.isolation.clone());
            cells
        })
        .collect();
    section.push(format!(
        "File size {mib:.0} MiB; {runs} timed runs per row after one warm-up."
    ));
    section.push(grid(
        &[
            ("row", false),
            ("MiB/s (median)", true),
            ("MiB/s (slowest, p95)", true),
            ("MiB/s (fastest)", true),
            ("median ms", true),
            ("runs", true),
            ("× moat write (MiB/s)", true),
            ("isolation", false),
        ],
        &table,
    ));
    Ok(())
}

/// `n` pseudo-random bytes (xorshift; incompressible enough, no dependency).
fn random_bytes(n: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

#[cfg(test)]
mod tests {
    #[test]
    fn random_bytes_are_sized_and_varied() {
        let v = super::random_bytes(1001);
        assert_eq!(v.len(), 1001);
        assert!(v.iter().filter(|b| **b == 0).count() < 50);
    }
}
