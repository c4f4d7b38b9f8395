//! `moat-bench`: how fast moat creates sandboxes and runs commands in them, how many fit in memory,
//! how fast files go in and out, and how many can be created per second — next to peer isolation
//! tools (bubblewrap, gVisor's runsc, runc, podman, plain namespaces) on the same root filesystem.
//!
//! `cargo run -p moat-bench --release -- [--quick] [--runs N] [--out FILE]`
//!
//! The bench starts its own daemon (its own data directory and a free loopback port), makes sure the
//! `base` template is there, runs the scenarios of `scenarios/` (rows interleaved, A B C A B C ..., so
//! machine noise hits all rows alike), removes every sandbox and container it made, stops the daemon
//! and writes a markdown report. `--quick` runs the same code with tiny counts: a smoke test that
//! judges success and cleanup, never speed.

mod cleanup;
mod daemon;
mod mem;
mod moat;
mod peers;
mod report;
mod scenarios;
mod stats;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use moat_client::Client;

use cleanup::{label_filter, Cleanup, PeerState};
use daemon::Daemon;
use moat::{COLD_TEMPLATE, TEMPLATE};
use report::Section;
use scenarios::{Ctx, Isolation, Scale, Tools};

#[derive(Debug, Parser)]
#[command(
    about = "Benchmark moat against bubblewrap, gVisor (runsc), runc, podman and plain namespaces"
)]
struct Args {
    /// Smoke test: tiny counts (5 runs per row unless --runs, bursts of 3, 3 idle instances, a
    /// 1 MiB file, 1 s of saturation); no judging of timings.
    #[arg(long)]
    quick: bool,
    /// Timed runs per row of the sequential scenarios (after one untimed warm-up run); default
    /// 100, 5 with --quick.
    #[arg(long)]
    runs: Option<usize>,
    /// Report file; default bench/results/<UTC date>-<time>.md (target/moat-bench/results/ with
    /// --quick, so smoke tests leave the tree clean).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The `moat` binary to run the daemon with.
    #[arg(long)]
    moat_bin: Option<PathBuf>,
    /// The static agent binary (scripts/build-agent.sh --release prints its path).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Data directory of the bench's daemon; kept between runs so the template is reused.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Run only these scenarios (comma-separated: cold, burst, exec, snapshots, density, files, saturation,
    /// hardening, network, gvisor, microvm, neighbour); default all.
    #[arg(long, value_delimiter = ',', value_parser = clap::builder::PossibleValuesParser::new(scenarios::NAMES))]
    only: Vec<String>,
    /// Root filesystem directory registered as the `base` template when the bench's daemon lacks
    /// one; when absent too, the bench builds `base` (debootstrap).
    #[arg(long)]
    template_rootfs: Option<PathBuf>,
}

/// The workspace this crate was built in (defaults are relative to it).
fn workspace() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<()> {
    let runs = args.runs.unwrap_or(if args.quick { 5 } else { 100 });
    if runs == 0 {
        bail!("--runs must be at least 1");
    }
    let ws = workspace();
    let target = ws.join("target");
    let moat_bin = args
        .moat_bin
        .clone()
        .unwrap_or_else(|| target.join("release/moat"));
    let agent = args
        .agent
        .clone()
        .unwrap_or_else(|| target.join("x86_64-unknown-linux-gnu/release/moat-agent"));
    let data_dir = args
        .data_dir
        .clone()
        .unwrap_or_else(|| target.join("moat-bench"));
    // Absolute: podman checks that its storage paths match the ones it was first given.
    let data_dir = std::path::absolute(&data_dir)
        .with_context(|| format!("resolve {}", data_dir.display()))?;
    let template_rootfs = args
        .template_rootfs
        .clone()
        .unwrap_or_else(|| target.join("moat-e2e/templates/base/rootfs"));
    let started = SystemTime::now();
    let t0 = Instant::now();
    let (date, time) = report::utc(started);

    let (mut daemon, client) =
        Daemon::start(&moat_bin, &agent, &data_dir, Duration::from_secs(30), &[]).await?;
    eprintln!("daemon: {} (data dir {})", daemon.url, data_dir.display());
    // A second daemon that starts sandboxes without the capability drop, seccomp and /proc masks, to
    // measure what hardening costs in the same run. Its own uid range and no pool.
    let unhardened_dir = data_dir.with_file_name(format!(
        "{}-unhardened",
        data_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("moat-bench")
    ));
    let (mut daemon_u, client_u) = Daemon::start(
        &moat_bin,
        &agent,
        &unhardened_dir,
        Duration::from_secs(30),
        &[
            "--no-hardening",
            "--pool-size",
            "0",
            "--uid-base",
            "2800000000",
        ],
    )
    .await?;

    // The peers keep their state in directories of the bench's own: everything there is the
    // bench's, so the cleanup removes whatever it finds.
    let scratch = data_dir.join("bench-peers");
    let podman_dir = data_dir.join("podman");
    let tools = Tools::detect();
    let peer_state = PeerState {
        runsc: tools.runsc.then(|| scratch.join("runsc-state")),
        runc: tools.runc.then(|| scratch.join("runc-state")),
        podman: tools.podman.then(|| peers::podman_base(&podman_dir)),
    };
    for dir in [
        scratch.join("runsc-state"),
        scratch.join("runc-state"),
        podman_dir.join("tmp"),
    ] {
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
    }
    let cleanup = Cleanup::new(peer_state);
    let cleanup_u = Cleanup::default();
    let scale = if args.quick {
        Scale::quick(runs)
    } else {
        Scale::full(runs)
    };
    let result = tokio::select! {
        r = bench(&client, &client_u, &daemon, &template_rootfs, &scratch, scale.clone(), tools,
                  args.quick, &args.only, &cleanup, &cleanup_u, (&moat_bin, &agent)) => r,
        sig = interrupted() => Err(anyhow!("interrupted by {sig}")),
    };
    eprintln!("cleaning up");
    let mut problems = cleanup.finish(&client).await;
    problems.extend(cleanup_u.finish(&client_u).await);
    daemon_u.stop();
    if result.is_err() {
        eprintln!("daemon log (last lines):\n{}", daemon.log_tail());
        if let Some(status) = daemon.exit_status() {
            eprintln!("the daemon has exited: {status}");
        }
    }
    daemon.stop();
    for p in &problems {
        eprintln!("warning: cleanup: {p}");
    }
    let results = result?;

    let command = std::iter::once("cargo run -p moat-bench --release --".to_string())
        .chain(std::env::args().skip(1))
        .collect::<Vec<_>>()
        .join(" ");
    let markdown = results.markdown(
        &ws,
        &date,
        &time,
        &command,
        &scale,
        args.quick,
        t0.elapsed(),
    );
    let out = args.out.clone().unwrap_or_else(|| {
        let dir = if args.quick {
            target.join("moat-bench/results")
        } else {
            ws.join("bench/results")
        };
        dir.join(format!("{date}-{}.md", time.replace(':', "")))
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
    }
    std::fs::write(&out, &markdown).with_context(|| format!("write {}", out.display()))?;
    println!("{markdown}");
    eprintln!(
        "report written to {} (the bench took {:.0} s)",
        out.display(),
        t0.elapsed().as_secs_f64()
    );
    let failed: Vec<&str> = results
        .sections
        .iter()
        .filter(|s| s.failed.is_some())
        .map(|s| s.title.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("scenarios failed: {}", failed.join("; "));
    }
    if !problems.is_empty() {
        bail!("cleanup left things behind (see the warnings above)");
    }
    Ok(())
}

/// Waits for SIGINT or SIGTERM; the bench then cleans up before it exits.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    }
}

/// The report's content.
struct Results {
    moat_version: String,
    sections: Vec<Section>,
    rootfs: PathBuf,
}

impl Results {
    #[allow(clippy::too_many_arguments)]
    fn markdown(
        &self,
        ws: &Path,
        date: &str,
        time: &str,
        command: &str,
        scale: &Scale,
        quick: bool,
        wall: Duration,
    ) -> String {
        let mut md = format!("# moat benchmark, {date} {time} UTC\n\n");
        if quick {
            md.push_str(
                "**Quick mode (smoke test): too few runs for the numbers to mean anything.**\n\n",
            );
        }
        md.push_str(&format!("Command: `{command}`\n\n"));
        md.push_str(&format!(
            "Sequential scenarios: {} timed runs per row after one untimed warm-up run, rows \
             interleaved (A B C A B C ...). Bursts of {} ({} per row); {} idle instances per tool \
             for density; a {:.0} MiB file ({} runs); saturation {} s per measurement with N = {} \
             creators. Everything on the same root filesystem (the `base` template's rootfs, `{}`); \
             peers without network. Total bench time {:.0} s.\n\n",
            scale.runs,
            scale.burst,
            scale.burst_reps,
            scale.density,
            scale.file_bytes as f64 / 1048576.0,
            scale.file_runs,
            scale.saturation.as_secs_f64(),
            scale
                .creators
                .iter()
                .map(|n| n.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            self.rootfs.display(),
            wall.as_secs_f64()
        ));
        md.push_str("## Machine\n\n");
        md.push_str(&report::machine(ws, &self.moat_version));
        for s in &self.sections {
            md.push('\n');
            md.push_str(&s.markdown());
        }
        md.push_str(
            "\nIsolation: namespaces, uid mapping, seccomp and cgroup limits marked *measured* \
             were read from `/proc` of a live instance (compared with the bench's own process); \
             the rest is what the tool is documented to do and what the bench asked for.\n",
        );
        md
    }
}

#[allow(clippy::too_many_arguments)]
async fn bench(
    client: &Client,
    client_u: &Client,
    daemon: &Daemon,
    template_rootfs: &Path,
    scratch: &Path,
    scale: Scale,
    tools: Tools,
    quick: bool,
    only: &[String],
    cleanup: &Cleanup,
    cleanup_u: &Cleanup,
    (moat_bin, agent): (&Path, &Path),
) -> Result<Results> {
    // Leftovers of a run that crashed.
    for s in client.list_sandboxes(&label_filter()).await? {
        eprintln!("deleting the leftover sandbox {}", s.id);
        client.delete_sandbox(&s.id).await?;
    }
    let left = cleanup.sweep_peers();
    if !left.is_empty() {
        bail!(
            "cannot remove an earlier run's containers: {}",
            left.join("; ")
        );
    }
    daemon::ensure_template(client, TEMPLATE, Some(template_rootfs)).await?;
    daemon::ensure_template(client, COLD_TEMPLATE, Some(template_rootfs)).await?;
    daemon::ensure_template(client_u, COLD_TEMPLATE, Some(template_rootfs)).await?;
    let rootfs = daemon
        .data_dir
        .join("templates")
        .join(TEMPLATE)
        .join("rootfs");
    if !rootfs.join("bin/true").exists() {
        bail!(
            "the template's root filesystem is not at {} (the peers need it); has the daemon's \
             template layout changed?",
            rootfs.display()
        );
    }
    let moat_version = client.health().await?.version;
    let mut ctx = Ctx {
        client,
        cleanup,
        client_u,
        cleanup_u,
        rootfs: rootfs.clone(),
        scratch: scratch.to_path_buf(),
        scale,
        tools,
        iso: Isolation::default(),
        quick,
        moat_bin: moat_bin.to_path_buf(),
        agent: agent.to_path_buf(),
        data_dir: daemon.data_dir.clone(),
    };
    ctx.iso = scenarios::probe_isolation(&ctx).await?;
    let sections = scenarios::run_all(&ctx, only).await;
    Ok(Results {
        moat_version,
        sections,
        rootfs,
    })
}
