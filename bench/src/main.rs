//! `moat-bench`: how fast moat creates sandboxes and runs commands in them, next to peer isolation
//! tools (bubblewrap, gVisor's runsc, plain namespaces) on the same root filesystem.
//!
//! `cargo run -p moat-bench --release -- [--quick] [--runs N] [--out FILE]`
//!
//! The bench starts its own daemon (its own data directory and a free loopback port), makes sure the
//! `base` template is there, runs every row interleaved (A B C A B C ...) so machine noise hits all
//! rows alike, deletes every sandbox it made, stops the daemon and writes a markdown report. `--quick`
//! runs the same code with 5 runs per row: a smoke test that judges success, never speed.

mod daemon;
mod peers;
mod report;
mod stats;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{anyhow, bail, Context, Result};
use clap::Parser;
use futures::StreamExt;
use moat_api::{CreateSandboxRequest, ProcessEvent, StartProcessRequest};
use moat_client::{Client, SandboxFilter};

use daemon::Daemon;
use peers::{argv, which};
use report::{Row, RowStatus};

/// Label put on every sandbox the bench makes, so a crashed run's leftovers are found and deleted.
const LABEL: &str = "moat-bench";
const TEMPLATE: &str = "base";
/// The same root filesystem under another name: the daemon's warm pool only serves its default
/// template (`base`), so creates of this one always start a sandbox from nothing.
const COLD_TEMPLATE: &str = "bench-cold";

#[derive(Debug, Parser)]
#[command(about = "Benchmark moat against bubblewrap, gVisor (runsc) and plain namespaces")]
struct Args {
    /// Smoke test: 5 runs per row (unless --runs), no judging of timings.
    #[arg(long)]
    quick: bool,
    /// Timed runs per row (after one untimed warm-up run); default 100, 5 with --quick.
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
    let template_rootfs = args
        .template_rootfs
        .clone()
        .unwrap_or_else(|| target.join("moat-e2e/templates/base/rootfs"));
    let started = SystemTime::now();
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
    let mut cleanup = Cleanup::default();
    let mut cleanup_u = Cleanup::default();
    let result = tokio::select! {
        r = async {
            let mut results = bench(&client, &daemon, &template_rootfs, runs, &mut cleanup).await?;
            daemon::ensure_template(&client_u, COLD_TEMPLATE, Some(&template_rootfs)).await?;
            results.hardening =
                hardening_cost(&client, &client_u, runs, &mut cleanup, &mut cleanup_u).await?;
            anyhow::Ok(results)
        } => r,
        sig = interrupted() => Err(anyhow!("interrupted by {sig}")),
    };
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
    let markdown = results.markdown(&ws, &date, &time, &command, runs, args.quick);
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
    eprintln!("report written to {}", out.display());
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

/// What the bench made and must remove, whatever happens.
#[derive(Default)]
struct Cleanup {
    sandboxes: Vec<String>,
    /// (runsc state dir, container id)
    runsc: Vec<(PathBuf, String)>,
    bwrap: Option<Child>,
}

impl Cleanup {
    /// Removes everything; returns what could not be removed.
    async fn finish(&mut self, client: &Client) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(mut child) = self.bwrap.take() {
            // --die-with-parent takes the sandbox down with bwrap.
            let _ = child.kill();
            let _ = child.wait();
        }
        for (state, id) in self.runsc.drain(..) {
            let mut kill = peers::runsc_base(&state);
            kill.extend(argv(["kill", id.as_str(), "KILL"]));
            let _ = peers::run_quiet(&kill);
            let mut delete = peers::runsc_base(&state);
            delete.extend(argv(["delete", "--force", id.as_str()]));
            if let Err(e) = peers::run_quiet(&delete) {
                problems.push(format!("runsc container {id}: {e:#}"));
            }
        }
        // Sandboxes outlive the daemon by design: delete each one explicitly, then sweep by label.
        let mut ids: Vec<String> = self.sandboxes.drain(..).collect();
        let filter = label_filter();
        if let Ok(list) = client.list_sandboxes(&filter).await {
            for s in list {
                if !ids.contains(&s.id) {
                    ids.push(s.id);
                }
            }
        }
        for id in ids {
            if let Err(e) = client.delete_sandbox(&id).await {
                if !e.is_not_found() {
                    problems.push(format!("sandbox {id}: {e}"));
                }
            }
        }
        problems
    }
}

fn label_filter() -> SandboxFilter {
    let mut filter = SandboxFilter::default();
    filter.metadata.insert(LABEL.into(), "1".into());
    filter
}

/// The measured rows of both scenarios.
struct Results {
    machine_moat_version: String,
    cold: Vec<Row>,
    exec: Vec<Row>,
    hardening: Vec<Row>,
    rootfs: PathBuf,
    wall: Duration,
}

impl Results {
    fn markdown(
        &self,
        ws: &Path,
        date: &str,
        time: &str,
        command: &str,
        runs: usize,
        quick: bool,
    ) -> String {
        let mut md = format!("# moat benchmark, {date} {time} UTC\n\n");
        if quick {
            md.push_str(
                "**Quick mode (smoke test): too few runs for the numbers to mean anything.**\n\n",
            );
        }
        md.push_str(&format!("Command: `{command}`\n\n"));
        md.push_str(&format!(
            "{runs} timed runs per row after one untimed warm-up run, rows interleaved \
             (A B C A B C ...), sequential, all on the same root filesystem (the `base` template's \
             rootfs, `{}`). Total bench time {:.0} s.\n\n",
            self.rootfs.display(),
            self.wall.as_secs_f64()
        ));
        md.push_str("## Machine\n\n");
        md.push_str(&report::machine(ws, &self.machine_moat_version));
        md.push_str(
            "\n## 1. Cold start: from nothing to the exit of `true` in a new isolated environment\n\n",
        );
        md.push_str(
            "moat: `POST /v1/sandboxes` + `POST .../processes {\"cmd\":[\"true\"]}` until the `exit` \
             event, over HTTP on loopback with the Rust client. Its delete is timed separately. \
             Peers: the wall time of one command from spawn to exit (their teardown is inside it).\n\n",
        );
        md.push_str(&report::table(&self.cold, 0));
        md.push_str("\n## 2. Exec round trip: `true` in an already running sandbox\n\n");
        md.push_str(
            "moat: `POST .../processes {\"cmd\":[\"true\"]}` until the `exit` event. runsc: \
             `runsc exec` into a running container (`sleep infinity`). Floor: `nsenter --all` \
             into a running bwrap sandbox.\n\n",
        );
        md.push_str(&report::table(&self.exec, 0));
        md.push_str("\n## 3. What hardening costs\n\n");
        md.push_str(
            "The same cold create (template not pooled) and the same syscall-heavy command \
             (`dd if=/dev/zero of=/dev/null bs=1 count=200000`: 400,000 read/write syscalls) on a \
             daemon started with `--no-hardening` (no capability drop, no seccomp filter, no /proc \
             masks; same namespaces, uid range and cgroups), interleaved with the hardened runs. \
             Floor: the same `dd` run directly on the host.\n\n",
        );
        md.push_str(&report::table(&self.hardening, 0));
        md.push_str(
            "\nIsolation: namespaces, uid mapping, seccomp and cgroup limits marked *measured* \
             were read from `/proc` of a live instance (compared with the bench's own process); \
             the rest is what the tool is documented to do.\n",
        );
        md
    }
}

async fn bench(
    client: &Client,
    daemon: &Daemon,
    template_rootfs: &Path,
    runs: usize,
    cleanup: &mut Cleanup,
) -> Result<Results> {
    let t0 = Instant::now();
    // Leftovers of a run that crashed.
    for s in client.list_sandboxes(&label_filter()).await? {
        eprintln!("deleting the leftover sandbox {}", s.id);
        client.delete_sandbox(&s.id).await?;
    }
    daemon::ensure_template(client, TEMPLATE, Some(template_rootfs)).await?;
    daemon::ensure_template(client, COLD_TEMPLATE, Some(template_rootfs)).await?;
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
    let version = client.health().await?.version;
    let scratch = daemon.data_dir.join("bench-peers");
    let state = scratch.join("runsc-state");
    std::fs::create_dir_all(&state).with_context(|| format!("mkdir {}", state.display()))?;

    let iso = probe_isolation(client, &rootfs, cleanup).await?;
    let cold = cold_start(client, &rootfs, &scratch, &state, runs, &iso, cleanup).await?;
    let exec = exec_round_trip(client, &rootfs, &scratch, &state, runs, &iso, cleanup).await?;
    Ok(Results {
        machine_moat_version: version,
        cold,
        exec,
        hardening: Vec::new(),
        rootfs,
        wall: t0.elapsed(),
    })
}

/// Isolation descriptions, measured on live instances where possible.
struct Isolation {
    moat: String,
    bwrap: String,
}

async fn probe_isolation(
    client: &Client,
    rootfs: &Path,
    cleanup: &mut Cleanup,
) -> Result<Isolation> {
    let sbx = create(client, TEMPLATE, cleanup).await?;
    let moat_static = "overlay rootfs (per-sandbox writable layer over the idmapped template); \
                       no syscall interception (host kernel)";
    let moat = match peers::find_sandbox_init(&sbx.id) {
        Some(pid) => format!(
            "*measured:* {}; {}; {moat_static}",
            peers::describe_isolation(pid),
            peers::describe_cgroup_limits(pid)
        ),
        None => format!(
            "user (own host uid range), pid, mnt, net, uts, ipc, cgroup ns; cgroup limits; {moat_static}"
        ),
    };
    delete(client, &sbx.id, cleanup).await?;
    let bwrap_static = "read-only bind of the rootfs, no writable layer";
    let bwrap = if which("bwrap").is_some() {
        match start_bwrap_sleeper(rootfs) {
            Ok((mut child, pid)) => {
                let d = format!(
                    "*measured:* {}; {}; {bwrap_static}",
                    peers::describe_isolation(pid),
                    peers::describe_cgroup_limits(pid)
                );
                let _ = child.kill();
                let _ = child.wait();
                d
            }
            Err(e) => format!("({e:#}); {bwrap_static}"),
        }
    } else {
        bwrap_static.to_string()
    };
    Ok(Isolation { moat, bwrap })
}

const GVISOR: &str = "gVisor: every syscall served by the Sentry user-space kernel (ptrace \
                      platform), files through a gofer; Sentry under seccomp in its own namespaces; \
                      --network=none; no cgroup limits given";
const UNSHARE_ISO: &str = "own ns: user (uid 0→host 0), pid, mnt, net, uts, ipc, cgroup; chroot \
                           into the shared rootfs (writable, no overlay, no pivot_root); no cgroup \
                           limits; no seccomp";

/// A peer of the cold-start scenario.
enum ColdPeer {
    Fixed(Vec<OsString>),
    /// `runsc run` needs a fresh container id each time.
    RunscRun {
        state: PathBuf,
        bundle: PathBuf,
    },
}

impl ColdPeer {
    fn argv(&self, n: usize) -> (Vec<OsString>, Option<String>) {
        match self {
            ColdPeer::Fixed(v) => (v.clone(), None),
            ColdPeer::RunscRun { state, bundle } => {
                let id = format!("moat-bench-{}-{n}", std::process::id());
                let mut v = peers::runsc_base(state);
                v.push("run".into());
                v.push("--bundle".into());
                v.push(bundle.into());
                v.push(id.clone().into());
                (v, Some(id))
            }
        }
    }
}

fn missing(pkg: &str) -> RowStatus {
    RowStatus::NotInstalled(format!("apt-get install -y {pkg}"))
}

async fn cold_start(
    client: &Client,
    rootfs: &Path,
    scratch: &Path,
    state: &Path,
    runs: usize,
    iso: &Isolation,
    cleanup: &mut Cleanup,
) -> Result<Vec<Row>> {
    let mut rows = vec![
        Row::new(
            "**moat** create → exit of `true` (cold: no warm pool)",
            iso.moat.clone(),
        ),
        Row::new("moat: create alone (201 answered)", "part of the row above"),
        Row::new("moat: delete", "timed separately, not in the row above"),
        Row::new("bwrap --unshare-all", iso.bwrap.clone()),
        Row::new(
            "runsc do",
            format!("{GVISOR}; tmpfs overlay over the rootfs (writable, discarded)"),
        ),
        Row::new(
            "runsc run (OCI bundle)",
            format!("{GVISOR}; pid, net, ipc, uts, mount ns in the spec; read-only root"),
        ),
        Row::new("unshare + chroot (floor)", UNSHARE_ISO),
        Row::new(
            "**moat** create → exit of `true` (warm pool)",
            "the same; the sandbox was started ahead of demand (`--pool-size`, default 2)",
        ),
    ];
    rows[1].ratio = false;
    rows[2].ratio = false;
    let bundle = scratch.join("bundle-true");
    let mut peers: Vec<(usize, ColdPeer)> = Vec::new();
    if which("bwrap").is_some() {
        peers.push((
            3,
            ColdPeer::Fixed(peers::bwrap_argv(rootfs, &["/bin/true"])),
        ));
    } else {
        rows[3].status = missing("bubblewrap");
    }
    if which("runsc").is_some() {
        peers.push((4, ColdPeer::Fixed(peers::runsc_do_argv(state, rootfs))));
        match peers::write_oci_bundle(&bundle, rootfs, &["/bin/true"]) {
            Ok(()) => peers.push((
                5,
                ColdPeer::RunscRun {
                    state: state.to_path_buf(),
                    bundle: bundle.clone(),
                },
            )),
            Err(e) => rows[5].fail(format!("{e:#}")),
        }
    } else {
        rows[4].status = missing("runsc");
        rows[5].status = missing("runsc");
    }
    if which("unshare").is_some() && which("chroot").is_some() {
        peers.push((6, ColdPeer::Fixed(peers::unshare_argv(rootfs))));
    } else {
        rows[6].status = missing("util-linux coreutils");
    }

    eprintln!("scenario 1: cold start, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let (c, total, del) = moat_cold_once(client, COLD_TEMPLATE, cleanup)
            .await
            .with_context(|| format!("moat cold start, run {i}"))?;
        if timed {
            rows[0].samples.push(total);
            rows[1].samples.push(c);
            rows[2].samples.push(del);
        }
        let (_, warm, _) = moat_cold_once(client, TEMPLATE, cleanup)
            .await
            .with_context(|| format!("moat warm-pool start, run {i}"))?;
        if timed {
            rows[7].samples.push(warm);
        }
        for (idx, peer) in &peers {
            if !rows[*idx].ok() {
                continue;
            }
            let (cmd, runsc_id) = peer.argv(i);
            match peers::time_cmd(&cmd) {
                Ok(d) if timed => rows[*idx].samples.push(d),
                Ok(_) => {}
                Err(e) => {
                    rows[*idx].fail(format!("{e:#}"));
                    if let Some(id) = runsc_id {
                        cleanup.runsc.push((state.to_path_buf(), id));
                    }
                }
            }
        }
        progress(i, runs);
    }
    Ok(rows)
}

fn progress(i: usize, runs: usize) {
    // Roughly every tenth of the runs: when i * 10 / runs steps up.
    let tenth = |n: usize| n * 10 / runs.max(1);
    if i == runs || (i > 0 && tenth(i) != tenth(i - 1)) {
        eprintln!("  {i}/{runs}");
    }
}

async fn create(
    client: &Client,
    template: &str,
    cleanup: &mut Cleanup,
) -> Result<moat_api::Sandbox> {
    let req = CreateSandboxRequest {
        template: Some(template.into()),
        // A crashed bench's sandboxes go away by themselves.
        timeout: Some(900),
        metadata: BTreeMap::from([(LABEL.to_string(), "1".to_string())]),
        ..Default::default()
    };
    let sbx = client
        .create_sandbox(&req)
        .await
        .context("create a sandbox")?;
    cleanup.sandboxes.push(sbx.id.clone());
    Ok(sbx)
}

async fn delete(client: &Client, id: &str, cleanup: &mut Cleanup) -> Result<()> {
    client
        .delete_sandbox(id)
        .await
        .with_context(|| format!("delete sandbox {id}"))?;
    cleanup.sandboxes.retain(|s| s != id);
    Ok(())
}

/// One moat cold start: (create alone, create → exit of `true`, delete).
async fn moat_cold_once(
    client: &Client,
    template: &str,
    cleanup: &mut Cleanup,
) -> Result<(Duration, Duration, Duration)> {
    let t0 = Instant::now();
    let sbx = create(client, template, cleanup).await?;
    let created = t0.elapsed();
    run_true(client, &sbx.id).await?;
    let total = t0.elapsed();
    let t1 = Instant::now();
    delete(client, &sbx.id, cleanup).await?;
    Ok((created, total, t1.elapsed()))
}

/// Runs `true` in sandbox `id` and waits for its `exit` event; fails unless it exits 0.
async fn run_true(client: &Client, id: &str) -> Result<()> {
    run_argv(client, id, &["true"]).await
}

/// Starts `bwrap ... sleep infinity`; returns bwrap and the host pid of the sleep inside.
fn start_bwrap_sleeper(rootfs: &Path) -> Result<(Child, u32)> {
    let cmd = peers::bwrap_argv(rootfs, &["/bin/sleep", "infinity"]);
    let (prog, args) = cmd.split_first().context("empty command")?;
    let mut child = Command::new(prog)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .context("start bwrap")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(pid) = peers::find_descendant(child.id(), "sleep") {
            return Ok((child, pid));
        }
        if Instant::now() > deadline || matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("bwrap's sandboxed sleep did not show up");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

async fn exec_round_trip(
    client: &Client,
    rootfs: &Path,
    scratch: &Path,
    state: &Path,
    runs: usize,
    iso: &Isolation,
    cleanup: &mut Cleanup,
) -> Result<Vec<Row>> {
    let mut rows = vec![
        Row::new("**moat** exec `true`", iso.moat.clone()),
        Row::new("runsc exec", format!("{GVISOR}; read-only root")),
        Row::new("nsenter --all into bwrap (floor)", iso.bwrap.clone()),
    ];
    let sbx = create(client, TEMPLATE, cleanup).await?;
    let mut peers: Vec<(usize, Vec<OsString>)> = Vec::new();

    if which("runsc").is_some() {
        let bundle = scratch.join("bundle-sleep");
        let id = format!("moat-bench-{}-exec", std::process::id());
        let setup =
            peers::write_oci_bundle(&bundle, rootfs, &["/bin/sleep", "infinity"]).and_then(|()| {
                let mut run = peers::runsc_base(state);
                run.push("run".into());
                run.push("--bundle".into());
                run.push(bundle.clone().into());
                run.push("--detach".into());
                run.push(id.clone().into());
                cleanup.runsc.push((state.to_path_buf(), id.clone()));
                peers::run_detached(&run, &scratch.join("runsc-run-detach.log"))
            });
        match setup {
            Ok(()) => {
                let mut exec = peers::runsc_base(state);
                exec.extend(argv(["exec", id.as_str(), "/bin/true"]));
                peers.push((1, exec));
            }
            Err(e) => rows[1].fail(format!("cannot start the container: {e:#}")),
        }
    } else {
        rows[1].status = missing("runsc");
    }

    if which("bwrap").is_some() && which("nsenter").is_some() {
        match start_bwrap_sleeper(rootfs) {
            Ok((child, pid)) => {
                cleanup.bwrap = Some(child);
                let pid = pid.to_string();
                peers.push((
                    2,
                    argv([
                        "nsenter",
                        "--target",
                        pid.as_str(),
                        "--all",
                        "--root",
                        "--wd",
                        "/bin/true",
                    ]),
                ));
            }
            Err(e) => rows[2].fail(format!("{e:#}")),
        }
    } else {
        rows[2].status = missing("bubblewrap util-linux");
    }

    eprintln!("scenario 2: exec round trip, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let t = Instant::now();
        run_true(client, &sbx.id)
            .await
            .with_context(|| format!("moat exec, run {i}"))?;
        if timed {
            rows[0].samples.push(t.elapsed());
        }
        for (idx, cmd) in &peers {
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
    delete(client, &sbx.id, cleanup).await?;
    Ok(rows)
}

const SYSCALL_HEAVY: [&str; 5] = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=200000"];

/// Scenario 3: cold create and a syscall-heavy command, hardened vs `--no-hardening`, interleaved.
async fn hardening_cost(
    hardened: &Client,
    unhardened: &Client,
    runs: usize,
    cleanup: &mut Cleanup,
    cleanup_u: &mut Cleanup,
) -> Result<Vec<Row>> {
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
    let sh = create(hardened, COLD_TEMPLATE, cleanup).await?;
    let su = create(unhardened, COLD_TEMPLATE, cleanup_u).await?;
    eprintln!("scenario 3: hardening cost, {runs} runs per row (+1 warm-up)");
    for i in 0..=runs {
        let timed = i > 0;
        let (_, h, _) = moat_cold_once(hardened, COLD_TEMPLATE, cleanup).await?;
        let (_, u, _) = moat_cold_once(unhardened, COLD_TEMPLATE, cleanup_u).await?;
        let t = Instant::now();
        run_argv(hardened, &sh.id, &SYSCALL_HEAVY).await?;
        let dh = t.elapsed();
        let t = Instant::now();
        run_argv(unhardened, &su.id, &SYSCALL_HEAVY).await?;
        let du = t.elapsed();
        let host: Vec<OsString> = SYSCALL_HEAVY.iter().map(OsString::from).collect();
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
    delete(hardened, &sh.id, cleanup).await?;
    delete(unhardened, &su.id, cleanup_u).await?;
    Ok(rows)
}

/// Runs argv in sandbox `id` and waits for its exit; fails unless it exits 0.
async fn run_argv(client: &Client, id: &str, argv: &[&str]) -> Result<()> {
    let req = StartProcessRequest {
        cmd: Some(argv.iter().map(|s| s.to_string()).collect()),
        ..Default::default()
    };
    let mut events = client
        .start_process_stream(id, &req)
        .await
        .context("start the command")?;
    while let Some(ev) = events.next().await {
        if let ProcessEvent::Exit(status) = ev.context("read the process events")? {
            if status.exit_code == Some(0) {
                return Ok(());
            }
            bail!("{argv:?} ended with {status:?}");
        }
    }
    bail!("the event stream ended without an exit event")
}
