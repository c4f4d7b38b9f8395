//! The scenarios. Each is a module with a `TITLE`, an `INTRO` (what it measures, for the report) and
//! `async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()>` that appends its tables to
//! `section`. Adding a scenario is one such module and one line in [`run_all`].

pub mod burst;
pub mod cold;
pub mod density;
pub mod exec;
pub mod files;
pub mod gvisor;
pub mod hardening;
pub mod microvm;
pub mod neighbour;
pub mod network;
pub mod saturation;
pub mod snapshots;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use moat_client::Client;

use crate::cleanup::Cleanup;
use crate::moat::{self, TEMPLATE};
use crate::peers::{self, argv, oci_run_argv, with};
use crate::report::{Row, RowStatus, Section};

/// How much each scenario does: the full run, or the smoke test's tiny counts.
#[derive(Debug, Clone)]
pub struct Scale {
    /// Timed runs per row of the sequential scenarios.
    pub runs: usize,
    /// Instances started at once in the burst scenario, and how many bursts per row.
    pub burst: usize,
    pub burst_reps: usize,
    /// Idle instances per tool in the density scenario.
    pub density: usize,
    /// Bytes written and read in the files scenario, and the runs per row.
    pub file_bytes: usize,
    pub file_runs: usize,
    /// How long each saturation measurement lasts, and the numbers of concurrent creators.
    pub saturation: Duration,
    pub creators: Vec<usize>,
    /// Wait after dropping caches before reading /proc/meminfo, and how many readings (median).
    pub settle: Duration,
    pub readings: usize,
}

impl Scale {
    pub fn full(runs: usize) -> Scale {
        Scale {
            runs,
            burst: 50,
            burst_reps: 3,
            density: 100,
            file_bytes: 100 << 20,
            file_runs: 5,
            saturation: Duration::from_secs(10),
            creators: vec![2, 4, 8],
            settle: Duration::from_secs(2),
            readings: 5,
        }
    }

    pub fn quick(runs: usize) -> Scale {
        Scale {
            runs,
            burst: 3,
            burst_reps: 1,
            density: 3,
            file_bytes: 1 << 20,
            file_runs: 2,
            saturation: Duration::from_secs(1),
            creators: vec![2],
            settle: Duration::from_millis(200),
            readings: 1,
        }
    }
}

/// Which peers are installed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Tools {
    pub bwrap: bool,
    pub runsc: bool,
    pub runc: bool,
    pub podman: bool,
    pub unshare: bool,
    pub nsenter: bool,
}

impl Tools {
    pub fn detect() -> Tools {
        let has = |p: &str| peers::which(p).is_some();
        Tools {
            bwrap: has("bwrap"),
            runsc: has("runsc"),
            runc: has("runc"),
            podman: has("podman") && has("conmon") && Path::new(peers::PODMAN_RUNTIME).is_file(),
            unshare: has("unshare") && has("chroot"),
            nsenter: has("nsenter"),
        }
    }
}

/// Isolation descriptions, measured on live instances where possible.
#[derive(Debug, Clone, Default)]
pub struct Isolation {
    pub moat: String,
    pub bwrap: String,
    pub runc: String,
    pub podman: String,
}

pub const GVISOR: &str = "gVisor: every syscall served by the Sentry user-space kernel (ptrace \
                          platform), files through a gofer; Sentry under seccomp in its own \
                          namespaces; --network=none; no cgroup limits given";
pub const UNSHARE_ISO: &str =
    "own ns: user (uid 0→host 0), pid, mnt, net, uts, ipc, cgroup; chroot \
                               into the shared rootfs (writable, no overlay, no pivot_root); no \
                               cgroup limits; no seccomp";
const MOAT_STATIC: &str = "overlay rootfs (per-sandbox writable layer over the idmapped \
                           template); no network (`--network none`); no syscall interception \
                           (host kernel)";
const BWRAP_STATIC: &str = "read-only bind of the rootfs, no writable layer";
const RUNC_STATIC: &str =
    "OCI bundle: read-only root, no writable layer; 3 capabilities; no seccomp \
                           profile (the bundle gives none); net ns with no interface but lo";
const PODMAN_STATIC: &str =
    "`--rootfs DIR:O` (overlay over the rootfs, writes discarded); podman's \
                             default capabilities and seccomp profile; `--network none`";

/// The isolation of moat's rows in the tables after scenario 1, which gives it in full.
pub const MOAT_SHORT: &str = "as in scenario 1: own user ns (unprivileged host uid range) and \
                              pid/mnt/net/uts/ipc/cgroup ns, seccomp, capabilities dropped, cgroup \
                              limits, per-sandbox overlay";

impl Peer {
    /// The peer's isolation in a few words (scenario 1 gives it in full).
    pub fn short_isolation(self) -> &'static str {
        match self {
            Peer::Bwrap => {
                "all namespaces, root = host root, no seccomp, no cgroup, read-only rootfs"
            }
            Peer::RunscDo | Peer::RunscRun => "gVisor user-space kernel, --network=none",
            Peer::RuncRun => {
                "pid/mnt/net/uts/ipc ns, root = host root, no seccomp, own cgroup, read-only rootfs"
            }
            Peer::PodmanRun => {
                "pid/mnt/net/uts/ipc ns, root = host root, default seccomp and capabilities, own \
                 cgroup, overlay over the rootfs"
            }
            Peer::Unshare => "namespaces and chroot only",
        }
    }
}

/// The scenarios' names for `--only`, in the order they run.
pub const NAMES: [&str; 12] = [
    "cold",
    "burst",
    "exec",
    "snapshots",
    "density",
    "files",
    "saturation",
    "hardening",
    "network",
    "gvisor",
    "microvm",
    "neighbour",
];

/// Everything a scenario needs.
pub struct Ctx<'a> {
    /// The bench's daemon (hardened, warm pool of 2).
    pub client: &'a Client,
    pub cleanup: &'a Cleanup,
    /// The `--no-hardening` daemon (no pool) of the hardening scenario.
    pub client_u: &'a Client,
    pub cleanup_u: &'a Cleanup,
    /// The `base` template's root filesystem, which every peer runs on.
    pub rootfs: PathBuf,
    /// The peers' bundles, logs and files.
    pub scratch: PathBuf,
    pub scale: Scale,
    pub tools: Tools,
    pub iso: Isolation,
    pub quick: bool,
    /// What the network scenario starts its own daemon with.
    pub moat_bin: PathBuf,
    pub agent: PathBuf,
    pub data_dir: PathBuf,
}

impl Ctx<'_> {
    /// A container name unique to this bench process: `moat-bench-<pid>-<tag>`.
    pub fn name(&self, tag: &str) -> String {
        format!("moat-bench-{}-{tag}", std::process::id())
    }

    pub fn runsc_base(&self) -> Option<Vec<OsString>> {
        let state = self.cleanup.peers.runsc.as_ref()?;
        self.tools.runsc.then(|| peers::runsc_base(state))
    }

    pub fn runc_base(&self) -> Option<Vec<OsString>> {
        let root = self.cleanup.peers.runc.as_ref()?;
        self.tools.runc.then(|| peers::runc_base(root))
    }

    pub fn podman_base(&self) -> Option<Vec<OsString>> {
        let base = self.cleanup.peers.podman.as_ref()?;
        self.tools.podman.then(|| base.clone())
    }

    /// An OCI bundle running `args` over the shared rootfs, written once under the scratch dir.
    pub fn bundle(&self, name: &str, args: &[&str]) -> Result<PathBuf> {
        let dir = self.scratch.join(name);
        peers::write_oci_bundle(&dir, &self.rootfs, args)?;
        Ok(dir)
    }
}

/// Runs every scenario in order; a scenario that fails says so in its section and the ones after it
/// still run (with whatever it left behind removed first).
pub async fn run_all(ctx: &Ctx<'_>, only: &[String]) -> Vec<Section> {
    let mut out = Vec::new();
    macro_rules! scenario {
        ($m:ident) => {{
            if !only.is_empty() && !only.iter().any(|o| o == stringify!($m)) {
                eprintln!("scenario {}: skipped (--only)", stringify!($m));
            } else {
                let mut s = Section::new($m::TITLE, $m::INTRO);
                let t = Instant::now();
                if let Err(e) = $m::run(ctx, &mut s).await {
                    eprintln!("scenario \"{}\" failed: {e:#}", $m::TITLE);
                    let mut why = format!("{e:#}");
                    let problems = ctx.cleanup.finish(ctx.client).await;
                    if !problems.is_empty() {
                        why.push_str(&format!(" (cleanup afterwards: {})", problems.join("; ")));
                    }
                    s.failed = Some(why);
                }
                eprintln!("  ({} took {:.0} s)", $m::TITLE, t.elapsed().as_secs_f64());
                out.push(s);
            }
        }};
    }
    scenario!(cold);
    scenario!(burst);
    scenario!(exec);
    scenario!(snapshots);
    scenario!(density);
    scenario!(files);
    scenario!(saturation);
    scenario!(hardening);
    scenario!(network);
    scenario!(gvisor);
    scenario!(microvm);
    scenario!(neighbour);
    out
}

/// The status of a row whose tool is missing.
pub fn missing(pkg: &str) -> RowStatus {
    RowStatus::NotInstalled(format!("apt-get install -y {pkg}"))
}

/// Prints progress roughly every tenth of the runs.
pub fn progress(i: usize, runs: usize) {
    let tenth = |n: usize| n * 10 / runs.max(1);
    if i == runs || (i > 0 && tenth(i) != tenth(i - 1)) {
        eprintln!("  {i}/{runs}");
    }
}

/// How a peer runs `/bin/true` once in a fresh instance.
#[derive(Debug, Clone)]
pub enum Launch {
    Fixed(Vec<OsString>),
    /// `runc run` / `runsc run`: a fresh container id each time (`<prefix>-<tag>`).
    Oci {
        base: Vec<OsString>,
        bundle: PathBuf,
        prefix: String,
    },
}

impl Launch {
    /// The command of one start; `tag` makes container ids unique.
    pub fn argv(&self, tag: &str) -> Vec<OsString> {
        match self {
            Launch::Fixed(v) => v.clone(),
            Launch::Oci {
                base,
                bundle,
                prefix,
            } => oci_run_argv(base, bundle, &format!("{prefix}-{tag}")),
        }
    }
}

/// Which peers take part: bwrap, runsc do, runsc run, runc run, podman run, unshare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    Bwrap,
    RunscDo,
    RunscRun,
    RuncRun,
    PodmanRun,
    Unshare,
}

pub const ALL_PEERS: [Peer; 6] = [
    Peer::Bwrap,
    Peer::RunscDo,
    Peer::RunscRun,
    Peer::RuncRun,
    Peer::PodmanRun,
    Peer::Unshare,
];

/// A row for `peer` running `/bin/true` in a fresh instance, and how to launch it (`None` when it
/// cannot run: the row says why).
pub fn true_peer(ctx: &Ctx<'_>, peer: Peer, tag: &str) -> (Row, Option<Launch>) {
    let prefix = ctx.name(tag);
    let bundle = || ctx.bundle("bundle-true", &["/bin/true"]);
    // An OCI runtime (runc, runsc) running the `/bin/true` bundle; `pkg` names it when missing.
    let oci = |base: Option<Vec<OsString>>, pkg: &str| match base {
        Some(base) => bundle()
            .map(|bundle| Launch::Oci {
                base,
                bundle,
                prefix: prefix.clone(),
            })
            .map_err(|e| RowStatus::Failed(format!("{e:#}"))),
        None => Err(missing(pkg)),
    };
    let (name, iso, launch): (&str, String, Result<Launch, RowStatus>) = match peer {
        Peer::Bwrap => (
            "bwrap --unshare-all",
            ctx.iso.bwrap.clone(),
            if ctx.tools.bwrap {
                Ok(Launch::Fixed(peers::bwrap_argv(
                    &ctx.rootfs,
                    &["/bin/true"],
                )))
            } else {
                Err(missing("bubblewrap"))
            },
        ),
        Peer::RunscDo => (
            "runsc do",
            format!("{GVISOR}; tmpfs overlay over the rootfs (writable, discarded)"),
            match ctx.cleanup.peers.runsc.as_ref().filter(|_| ctx.tools.runsc) {
                Some(state) => Ok(Launch::Fixed(peers::runsc_do_argv(state, &ctx.rootfs))),
                None => Err(missing("runsc")),
            },
        ),
        Peer::RunscRun => (
            "runsc run (OCI bundle)",
            format!("{GVISOR}; pid, net, ipc, uts, mount ns in the spec; read-only root"),
            oci(ctx.runsc_base(), "runsc"),
        ),
        Peer::RuncRun => (
            "runc run (OCI bundle)",
            ctx.iso.runc.clone(),
            oci(ctx.runc_base(), "runc"),
        ),
        Peer::PodmanRun => (
            "podman run --rm (runc)",
            ctx.iso.podman.clone(),
            match ctx.podman_base() {
                Some(base) => Ok(Launch::Fixed(peers::podman_run_argv(
                    &base,
                    &ctx.rootfs,
                    &["--rm"],
                    &["/bin/true"],
                ))),
                None => Err(missing("podman runc")),
            },
        ),
        Peer::Unshare => (
            "unshare + chroot (floor)",
            UNSHARE_ISO.to_string(),
            if ctx.tools.unshare {
                Ok(Launch::Fixed(peers::unshare_argv(&ctx.rootfs)))
            } else {
                Err(missing("util-linux coreutils"))
            },
        ),
    };
    let mut row = Row::new(name, iso);
    match launch {
        Ok(l) => (row, Some(l)),
        Err(status) => {
            row.status = status;
            (row, None)
        }
    }
}

/// Starts `bwrap ... sleep infinity`; returns bwrap and the host pid of the sleep inside.
pub fn start_bwrap_sleeper(rootfs: &Path) -> Result<(Child, u32)> {
    use std::os::unix::process::CommandExt;
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

/// Starts a detached `sleep infinity` container `id` with `runc run --detach` or `runsc run
/// --detach` (`base`); returns the host pid of its init.
pub fn start_oci_sleeper(ctx: &Ctx<'_>, base: &[OsString], bundle: &Path, id: &str) -> Result<u32> {
    let mut run = with(base, &["run", "--detach", "--bundle"]);
    run.push(bundle.into());
    run.push(id.into());
    peers::run_detached(&run, &ctx.scratch.join(format!("{id}.log")))?;
    peers::oci_pid(base, id)
}

/// Stops and deletes container `id` (runc, runsc): `delete --force` kills it first. Blocking, no
/// runtime needed (it is called from worker threads).
pub fn stop_oci(base: &[OsString], id: &str) -> Result<()> {
    peers::time_cmd_sync(&with(base, &["delete", "--force", id])).map(drop)
}

/// Runs `f` on every item from `workers` threads at once; the first error.
pub fn parallel<T: Sync>(
    items: &[T],
    workers: usize,
    f: impl Fn(&T) -> Result<()> + Sync,
) -> Result<()> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let errors: Vec<anyhow::Error> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut first = None;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        if let Err(e) = f(item) {
                            first.get_or_insert(e);
                        }
                    }
                    first
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| {
                h.join()
                    .unwrap_or_else(|_| Some(anyhow::anyhow!("a worker panicked")))
            })
            .collect()
    });
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Starts a detached podman container `name` running `sleep infinity`; returns its init's host pid.
pub fn start_podman_sleeper(ctx: &Ctx<'_>, base: &[OsString], name: &str) -> Result<u32> {
    let run = peers::podman_run_argv(
        base,
        &ctx.rootfs,
        &["-d", "--name", name],
        &["/bin/sleep", "infinity"],
    );
    peers::run_detached(&run, &ctx.scratch.join(format!("{name}.log")))?;
    peers::podman_pid(base, name)
}

/// Removes podman containers `names` (one command). Blocking, no runtime needed.
pub fn stop_podman(base: &[OsString], names: &[String]) -> Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    let mut rm = with(base, &["rm", "--force", "--time", "0"]);
    rm.extend(argv(names.iter().map(String::as_str)));
    peers::time_cmd_sync(&rm).map(drop)
}

/// Isolation of moat, bwrap, runc and podman, read from `/proc` of one live instance of each.
pub async fn probe_isolation(ctx: &Ctx<'_>) -> Result<Isolation> {
    let measured = |pid: u32, rest: &str| {
        format!(
            "*measured:* {}; {}; {rest}",
            peers::describe_isolation(pid),
            peers::describe_cgroup_limits(pid)
        )
    };
    let sbx = moat::create(ctx.client, TEMPLATE, ctx.cleanup).await?;
    let moat = match peers::find_sandbox_init(&sbx.id) {
        Some(pid) => measured(pid, MOAT_STATIC),
        None => format!(
            "user (own host uid range), pid, mnt, net, uts, ipc, cgroup ns; cgroup limits; \
             {MOAT_STATIC}"
        ),
    };
    moat::delete(ctx.client, &sbx.id, ctx.cleanup).await?;

    let bwrap = if ctx.tools.bwrap {
        match start_bwrap_sleeper(&ctx.rootfs) {
            Ok((mut child, pid)) => {
                let d = measured(pid, BWRAP_STATIC);
                let _ = child.kill();
                let _ = child.wait();
                d
            }
            Err(e) => format!("({e:#}); {BWRAP_STATIC}"),
        }
    } else {
        BWRAP_STATIC.to_string()
    };

    let runc = match ctx.runc_base() {
        Some(base) => {
            let id = ctx.name("probe");
            let r = ctx
                .bundle("bundle-sleep", &["/bin/sleep", "infinity"])
                .and_then(|b| start_oci_sleeper(ctx, &base, &b, &id));
            let d = match r {
                Ok(pid) => measured(pid, RUNC_STATIC),
                Err(e) => format!("({e:#}); {RUNC_STATIC}"),
            };
            tokio::task::block_in_place(|| stop_oci(&base, &id)).ok();
            d
        }
        None => RUNC_STATIC.to_string(),
    };

    let podman = match ctx.podman_base() {
        Some(base) => {
            let name = ctx.name("probe");
            let d = match start_podman_sleeper(ctx, &base, &name) {
                Ok(pid) => measured(pid, PODMAN_STATIC),
                Err(e) => format!("({e:#}); {PODMAN_STATIC}"),
            };
            tokio::task::block_in_place(|| stop_podman(&base, &[name])).ok();
            d
        }
        None => PODMAN_STATIC.to_string(),
    };
    Ok(Isolation {
        moat,
        bwrap,
        runc,
        podman,
    })
}
