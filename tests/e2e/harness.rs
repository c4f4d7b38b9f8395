//! Test harness: a real `moat serve` daemon on a loopback port with its own data directory, a client for
//! it, and host-side probes (mounts, cgroups, processes) that the isolation and no-leak tests read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::StreamExt;
use moat_api::{CreateSandboxRequest, ExitStatus, ProcessEvent, Sandbox, StartProcessRequest};
use moat_client::Client;

pub fn moat_bin() -> &'static str {
    env!("CARGO_BIN_EXE_moat")
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// The static agent: `MOAT_AGENT`, or the debug build `scripts/build-agent.sh` leaves in target/.
pub fn agent_path() -> PathBuf {
    if let Ok(p) = std::env::var("MOAT_AGENT") {
        return PathBuf::from(p);
    }
    let p = workspace_root().join("target/x86_64-unknown-linux-gnu/debug/moat-agent");
    assert!(
        p.is_file(),
        "no static agent at {}: run scripts/build-agent.sh (or scripts/test.sh) first, or set MOAT_AGENT",
        p.display()
    );
    p
}

/// The isolation tier every daemon of this run gives sandboxes created without one
/// (`MOAT_E2E_ISOLATION`: container, the default, or gvisor): scripts/test.sh runs the suite once per
/// tier, so every test runs on every tier that works on the host.
pub fn isolation() -> moat_api::Isolation {
    static TIER: OnceLock<moat_api::Isolation> = OnceLock::new();
    *TIER.get_or_init(|| match std::env::var("MOAT_E2E_ISOLATION") {
        Ok(v) if !v.is_empty() => v.parse().expect("MOAT_E2E_ISOLATION"),
        _ => moat_api::Isolation::Container,
    })
}

/// Whether this run's sandboxes are containers (host processes with a uid range of their own).
pub fn is_container() -> bool {
    isolation() == moat_api::Isolation::Container
}

/// A sandbox's directory in the data dir (each tier has its own).
pub fn sandbox_dir(data_dir: &Path, id: &str) -> PathBuf {
    let tier = match isolation() {
        moat_api::Isolation::Gvisor => "gvisor",
        moat_api::Isolation::Microvm => "microvm",
        _ => "sandboxes",
    };
    data_dir.join(tier).join(id)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A daemon process. Dropping it does not stop it (sandboxes are meant to outlive daemons); tests that
/// start their own call `stop` or `kill9`.
pub struct Daemon {
    pub url: String,
    pub data_dir: PathBuf,
    pub port: u16,
    extra_args: Vec<String>,
    child: Mutex<Option<Running>>,
    /// Network namespace the daemon runs in (its API is reached through its unix socket).
    netns: Option<String>,
}

struct Running {
    pid: u32,
    exit: std::sync::mpsc::Receiver<String>,
}

impl Daemon {
    pub fn start(data_dir: &Path) -> Daemon {
        Daemon::start_with(data_dir, &[])
    }

    /// A daemon with extra `moat serve` flags and a host uid range of its own.
    pub fn start_with(data_dir: &Path, extra: &[&str]) -> Daemon {
        let args = ["--uid-base".to_string(), next_uid_base()]
            .into_iter()
            .chain(extra.iter().map(|s| s.to_string()))
            .collect();
        Daemon::launch(data_dir, args)
    }

    /// The daemon most tests share keeps the default uid base; every other one gets its own. No warm
    /// pool: pooled sandboxes would outlive the test run (pool.rs tests the pool with its own daemon).
    fn start_shared(data_dir: &Path) -> Daemon {
        Daemon::launch(data_dir, vec!["--pool-size".into(), "0".into()])
    }

    fn launch(data_dir: &Path, extra_args: Vec<String>) -> Daemon {
        let port = free_port();
        let d = Daemon {
            url: format!("http://127.0.0.1:{port}"),
            data_dir: data_dir.to_path_buf(),
            port,
            extra_args,
            child: Mutex::new(None),
            netns: None,
        };
        d.spawn();
        d
    }

    /// A daemon inside the network namespace `netns` (made by the test), with extra flags and a uid
    /// range of its own. Its TCP listener is inside the namespace; `url` is a forwarder on this side's
    /// loopback to its unix socket.
    pub fn start_in_netns(data_dir: &Path, netns: &str, extra: &[&str]) -> Daemon {
        std::fs::create_dir_all(data_dir).unwrap();
        let fwd = unix_forwarder(data_dir.join("api.sock"));
        let d = Daemon {
            url: format!("http://127.0.0.1:{fwd}"),
            data_dir: data_dir.to_path_buf(),
            port: free_port(),
            extra_args: ["--uid-base".to_string(), next_uid_base()]
                .into_iter()
                .chain(extra.iter().map(|s| s.to_string()))
                .collect(),
            child: Mutex::new(None),
            netns: Some(netns.to_string()),
        };
        d.spawn();
        d
    }

    fn spawn(&self) {
        std::fs::create_dir_all(&self.data_dir).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data_dir.join("daemon.log"))
            .unwrap();
        let mut cmd = match &self.netns {
            // nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup hierarchies.
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(moat_bin());
                c
            }
            None => Command::new(moat_bin()),
        };
        cmd.args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", self.port),
            "--data-dir",
        ])
        .arg(&self.data_dir)
        .arg("--agent")
        .arg(agent_path())
        .arg("--unix-socket")
        .arg(self.data_dir.join("api.sock"))
        .args(["--default-isolation", isolation().as_str()])
        .args(&self.extra_args)
        // No sandbox traffic leaves this machine in a test: networking only where a test passes
        // --network itself (inside namespaces it made, tests/e2e/network.rs).
        .args(if self.extra_args.iter().any(|a| a == "--network") {
            &[][..]
        } else {
            &["--network", "none"][..]
        })
        // Many daemons run at once: none takes the E2B API's default port unless a test asks.
        .args(if self.extra_args.iter().any(|a| a == "--e2b-listen") {
            &[][..]
        } else {
            &["--e2b-listen", "off"][..]
        })
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
        // SAFETY: prctl is async-signal-safe. The daemon gets SIGTERM when the thread that forked it
        // ends; that thread (below) lives until the daemon exits or the test binary does.
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        let (pid_tx, pid_rx) = std::sync::mpsc::channel();
        let (exit_tx, exit_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut child: Child = cmd.spawn().expect("start moat serve");
            pid_tx.send(child.id()).unwrap();
            let status = child.wait();
            let _ = exit_tx.send(status.map(|s| s.to_string()).unwrap_or_default());
        });
        let pid = pid_rx.recv().unwrap();
        *self.child.lock().unwrap() = Some(Running { pid, exit: exit_rx });
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let up = match self.netns {
                Some(_) => {
                    std::os::unix::net::UnixStream::connect(self.data_dir.join("api.sock")).is_ok()
                }
                None => std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok(),
            };
            if up {
                break;
            }
            if let Ok(status) = self.child.lock().unwrap().as_ref().unwrap().exit.try_recv() {
                let log =
                    std::fs::read_to_string(self.data_dir.join("daemon.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                panic!(
                    "daemon exited with {status}; {}/daemon.log ends:\n{}",
                    self.data_dir.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            assert!(
                Instant::now() < deadline,
                "daemon did not listen within 60 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.lock().unwrap().as_ref().unwrap().pid
    }

    pub fn api_key(&self) -> String {
        std::fs::read_to_string(self.data_dir.join("api-key"))
            .unwrap()
            .trim()
            .to_string()
    }

    pub fn client(&self) -> Client {
        Client::new(&self.url, self.api_key()).unwrap()
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&self) {
        self.signal_and_wait(nix::sys::signal::Signal::SIGKILL);
    }

    /// SIGTERM and wait.
    pub fn stop(&self) {
        self.signal_and_wait(nix::sys::signal::Signal::SIGTERM);
    }

    fn signal_and_wait(&self, sig: nix::sys::signal::Signal) {
        if let Some(r) = self.child.lock().unwrap().take() {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(r.pid as i32), sig);
            let _ = r.exit.recv_timeout(Duration::from_secs(30));
        }
    }

    pub fn restart(&self) {
        self.spawn();
    }

    /// VmRSS of the daemon in KiB.
    pub fn rss_kib(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    }
}

/// The daemon most tests share, with the `base` template built (debootstrap on the first run; the data
/// dir persists under target/ so later local runs reuse it). Started once per test binary and stopped
/// when the binary exits.
pub fn shared() -> &'static Daemon {
    static SHARED: OnceLock<Daemon> = OnceLock::new();
    SHARED.get_or_init(|| {
        let dir = std::env::var("MOAT_TEST_DATA_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| workspace_root().join("target/moat-e2e"));
        let d = Daemon::start_shared(&dir);
        let client = d.client();
        ensure_template(client, "base");
        d
    })
}

pub fn shared_client() -> Client {
    shared().client()
}

/// Creates a sandbox from `base` with a short timeout; deleted by `Sbx::drop`... explicitly via `delete`.
pub async fn create(client: &Client, template: &str) -> Sandbox {
    client
        .create_sandbox(&CreateSandboxRequest {
            template: Some(template.into()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .expect("create sandbox")
}

/// Output of a finished command.
#[derive(Debug, Default)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    pub exit: ExitStatus,
    pub pid: u32,
}

pub fn decode(c: &moat_api::OutputChunk) -> Vec<u8> {
    use base64::Engine;
    match (&c.data, &c.data_b64) {
        (Some(d), _) => d.as_bytes().to_vec(),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD.decode(b).unwrap(),
        _ => Vec::new(),
    }
}

pub async fn run_req(client: &Client, id: &str, req: StartProcessRequest) -> Output {
    try_run_req(client, id, req)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// [`run_req`], with a stream that breaks (the sandbox ended under the process) as an error.
pub async fn try_run_req(
    client: &Client,
    id: &str,
    req: StartProcessRequest,
) -> Result<Output, String> {
    let mut events = client
        .start_process_stream(id, &req)
        .await
        .map_err(|e| format!("start process: {e:?}"))?;
    let mut out = Output::default();
    let (mut so, mut se) = (Vec::new(), Vec::new());
    let mut exited = false;
    while let Some(ev) = events.next().await {
        match ev.map_err(|e| format!("process event: {e:?}"))? {
            ProcessEvent::Start { pid, .. } => out.pid = pid,
            ProcessEvent::Stdout(c) | ProcessEvent::Pty(c) => so.extend(decode(&c)),
            ProcessEvent::Stderr(c) => se.extend(decode(&c)),
            ProcessEvent::Dropped { bytes } => {
                panic!("{bytes} bytes dropped in a foreground stream")
            }
            ProcessEvent::Exit(e) => {
                out.exit = e;
                exited = true;
            }
            ProcessEvent::Error { message } => return Err(format!("the stream broke: {message}")),
        }
    }
    if !exited {
        return Err("stream ended without an exit event".into());
    }
    out.stdout = String::from_utf8_lossy(&so).into_owned();
    out.stderr = String::from_utf8_lossy(&se).into_owned();
    Ok(out)
}

/// Runs `sh -c CMD` as root and returns its output.
pub async fn sh(client: &Client, id: &str, cmd: &str) -> Output {
    run_req(
        client,
        id,
        StartProcessRequest {
            cmd: Some(vec!["/bin/sh".into(), "-c".into(), cmd.into()]),
            ..Default::default()
        },
    )
    .await
}

/// Host-side facts about a sandbox, read before it is deleted so the no-leak checks know what to look for.
#[derive(Debug, Clone)]
pub struct HostFacts {
    pub id: String,
    pub pids: Vec<u32>,
    pub host_uid: u32,
    pub netns: String,
    pub pidns: String,
}

pub fn cgroup_procs(id: &str) -> Vec<u32> {
    cgroup_file(id, "pids", "cgroup.procs")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

pub fn uid_of(pid: u32) -> u32 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap()
}

/// The host process that runs the sandbox: its PID 1 (container tier), or gVisor's Sentry
/// (`runsc-sandbox`; the other processes of the cgroup are its gofer and ptrace stubs).
pub fn main_pid(pids: &[u32]) -> u32 {
    if is_container() {
        return *pids.iter().min().unwrap();
    }
    if isolation() == moat_api::Isolation::Microvm {
        // The VM's QEMU (its only process on the host).
        return *pids
            .iter()
            .find(|p| {
                std::fs::read_link(format!("/proc/{p}/exe"))
                    .is_ok_and(|e| e.ends_with("qemu-system-x86_64"))
            })
            .unwrap_or_else(|| panic!("no qemu-system-x86_64 among {pids:?}"));
    }
    *pids
        .iter()
        .find(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .is_ok_and(|c| c.starts_with(b"runsc-sandbox"))
        })
        .unwrap_or_else(|| panic!("no runsc-sandbox among {pids:?}"))
}

pub fn host_facts(id: &str) -> HostFacts {
    let pids = cgroup_procs(id);
    assert!(
        !pids.is_empty(),
        "sandbox {id} has no processes in its cgroup"
    );
    // The lowest pid holds the sandbox's namespaces: its PID 1 (container), or runsc's gofer (gVisor's
    // Sentry itself stays in the host's pid namespace; its tasks are not host processes).
    // A microVM's QEMU holds its namespaces (network, IPC, UTS; it stays in the host's pid namespace).
    let pid1 = if isolation() == moat_api::Isolation::Microvm {
        main_pid(&pids)
    } else {
        *pids.iter().min().unwrap()
    };
    HostFacts {
        id: id.to_string(),
        host_uid: uid_of(pid1),
        netns: std::fs::read_link(format!("/proc/{pid1}/ns/net"))
            .unwrap()
            .display()
            .to_string(),
        pidns: std::fs::read_link(format!("/proc/{pid1}/ns/pid"))
            .unwrap()
            .display()
            .to_string(),
        pids,
    }
}

/// Asserts nothing of the sandbox is left on the host: no mount, cgroup, directory, process, namespace.
pub fn assert_no_leaks(facts: &HostFacts, data_dir: &Path) {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mountinfo.contains(&facts.id),
        "mount left for {}:\n{mountinfo}",
        facts.id
    );
    let left = cgroup_dirs(&facts.id);
    assert!(left.is_empty(), "cgroups left: {left:?}");
    let dir = sandbox_dir(data_dir, &facts.id);
    assert!(!dir.exists(), "{} left", dir.display());
    // An agent re-parented to the host's init (after a daemon restart) is reaped by init, which may
    // take a moment: give namespaces held by such zombies a few seconds to go.
    let deadline = Instant::now() + Duration::from_secs(15);
    // The disk image's loop device detaches itself (autoclear) once its filesystem is released.
    loop {
        let loops = loops_of(&facts.id);
        if loops.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "loop devices left for {}: {loops:?}",
            facts.id
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    loop {
        match namespace_holders(facts) {
            None => break,
            Some(who) if Instant::now() > deadline => panic!("{who}"),
            Some(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    assert!(!netns.contains(&facts.id), "ip netns lists {}", facts.id);
}

/// Loop devices whose backing file's path names `id`.
pub fn loops_of(id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/sys/block")
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if b.contains(id) {
                out.push(name);
            }
        }
    }
    out
}

/// Polls `f` until it is true or `timeout` passes.
pub async fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    f()
}

pub fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A daemon of the test's own (data dir `tmp/data`) without a warm pool whose default template is
/// `bb`, a [`busybox_rootfs`], registered; `extra` flags are added to `moat serve`'s.
pub async fn busybox_daemon(tmp: &Path, extra: &[&str]) -> (Daemon, Client) {
    let rootfs = busybox_rootfs(tmp);
    let mut args = vec!["--default-template", "bb", "--pool-size", "0"];
    args.extend_from_slice(extra);
    let d = Daemon::start_with(&tmp.join("data"), &args);
    let c = d.client();
    c.register_template(&moat_api::RegisterTemplateRequest {
        name: "bb".into(),
        path: rootfs.display().to_string(),
    })
    .await
    .unwrap();
    (d, c)
}

/// A tiny busybox root filesystem (from Debian's busybox-static) for tests that need their own daemon.
pub fn busybox_rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("bbroot");
    for d in ["bin", "etc", "root", "tmp"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("busybox-static is installed");
    std::fs::copy(busybox, root.join("bin/busybox")).unwrap();
    for c in [
        "sh", "echo", "cat", "sleep", "ls", "id", "hostname", "ps", "true", "kill",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(c)).unwrap();
    }
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(root.join("etc/group"), "root:x:0:\n").unwrap();
    root
}

/// Registers the busybox root filesystem of [`busybox_rootfs`] as template `bb` (fast: no debootstrap).
pub async fn register_bb(c: &Client, rootfs: &Path) {
    c.register_template(&moat_api::RegisterTemplateRequest {
        name: "bb".into(),
        path: rootfs.display().to_string(),
    })
    .await
    .expect("register the busybox template");
}

/// Waits until the sandbox is gone: deleted (not found) or ended (`state: ended`, kept with why;
/// its row goes last, after the host cleanup).
pub async fn wait_not_found(c: &Client, id: &str) {
    for _ in 0..100 {
        if gone(c, id).await.is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("sandbox {id} still listed");
}

/// How the daemon tells that sandbox `id` is gone: its 404's message (deleted), or its end
/// ("ended at T (REASON): MESSAGE") when it ended without a request; None while it lives.
pub async fn gone(c: &Client, id: &str) -> Option<String> {
    match c.get_sandbox(id).await {
        Err(e) if e.is_not_found() => Some(e.to_string()),
        Ok(s) if s.state == moat_api::SandboxState::Ended => {
            let end = s.ended.expect("an ended sandbox says why");
            Some(format!(
                "sandbox {id} ended at {} ({}): {}",
                end.at,
                end.reason.as_str(),
                end.message
            ))
        }
        _ => None,
    }
}

/// A process that still runs as the sandbox's host uid or holds one of its namespaces, if any.
fn namespace_holders(facts: &HostFacts) -> Option<String> {
    let mut namespaces_in_use: Vec<(String, String)> = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap_or("");
            let zombie = status
                .lines()
                .any(|l| l.starts_with("State:") && l.contains('Z'));
            let as_sandbox_uid = uid_line
                .split_whitespace()
                .any(|u| u == facts.host_uid.to_string());
            // A container sandbox and a microVM's QEMU run as host ids of their own (gVisor's run
            // as runsc's).
            if !zombie && as_sandbox_uid && isolation() != moat_api::Isolation::Gvisor {
                return Some(format!(
                    "process {pid} still runs as the sandbox's host uid {}",
                    facts.host_uid
                ));
            }
        }
        for ns in ["net", "pid"] {
            if let Ok(l) = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")) {
                let cmd = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                    .unwrap_or_default()
                    .replace('\0', " ");
                namespaces_in_use.push((l.display().to_string(), format!("pid {pid}: {cmd}")));
            }
        }
    }
    namespaces_in_use
        .into_iter()
        .find(|(ns, _)| {
            ns == &facts.netns
                // A microVM's QEMU is in the host's pid namespace: that one stays, of course.
                || (ns == &facts.pidns && isolation() != moat_api::Isolation::Microvm)
        })
        .map(|(ns, who)| format!("namespace {ns} of {} still in use by {who}", facts.id))
}

/// Every cgroup directory of a sandbox, whichever daemon (cgroup parent `moat*`) made it.
pub fn cgroup_dirs(id: &str) -> Vec<PathBuf> {
    let mut bases = vec![PathBuf::from("/sys/fs/cgroup")];
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        bases.extend(rd.flatten().map(|e| e.path()));
    }
    let mut out = Vec::new();
    for base in bases {
        let Ok(rd) = std::fs::read_dir(&base) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("moat") && e.path().join(id).is_dir() {
                out.push(e.path().join(id));
            }
        }
    }
    out
}

/// Contents of a control file of a sandbox's cgroup: `controller` names the v1 hierarchy (ignored on v2).
pub fn cgroup_file(id: &str, controller: &str, file: &str) -> std::io::Result<String> {
    let dirs = cgroup_dirs(id);
    let dir = dirs
        .iter()
        .find(|d| {
            d.parent()
                .and_then(|p| p.parent())
                .is_some_and(|c| c.ends_with(controller))
        })
        .or_else(|| dirs.iter().find(|d| d.join(file).exists()))
        .ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("no cgroup for {id}"))
        })?;
    std::fs::read_to_string(dir.join(file))
}

/// A distinct host uid range for every extra daemon a test starts (ranges must not overlap between
/// daemons, or the no-leak checks would see another daemon's sandbox as a leftover).
/// The uid bases of the daemons of this test binary that are still alive.
static UID_BASES_IN_USE: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// A host uid base for a test's own daemon: one of ten disjoint ranges, never one a live daemon of
/// this run holds (two daemons on one base give two sandboxes the same host uid, and the no-leak
/// checks of one then see the other's processes). Held until the daemon is dropped.
pub fn next_uid_base() -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        {
            let mut used = UID_BASES_IN_USE.lock().unwrap_or_else(|e| e.into_inner());
            for _ in 0..10 {
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10;
                let base = 1_300_000_000u64 + n as u64 * 300_000_000;
                if !used.contains(&base) {
                    used.push(base);
                    return base.to_string();
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "ten daemons of this run hold every uid base"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Gives back the uid base in `args` (`--uid-base N`), if any.
fn release_uid_base(args: &[String]) {
    if let Some(base) = args
        .windows(2)
        .find(|w| w[0] == "--uid-base")
        .and_then(|w| w[1].parse::<u64>().ok())
    {
        UID_BASES_IN_USE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|b| *b != base);
    }
}

/// The shared daemon with the `code-interpreter` template (base + numpy, pandas, matplotlib) built
/// too; built once (a few minutes on a fresh machine) and reused by later runs.
pub fn code_interpreter() -> &'static Daemon {
    static BUILT: OnceLock<()> = OnceLock::new();
    let d = shared();
    BUILT.get_or_init(|| ensure_template(d.client(), "code-interpreter"));
    d
}

/// Builds template `name` unless it is ready. On a thread of its own: the first caller may be inside
/// a test's runtime.
fn ensure_template(client: Client, name: &'static str) {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            if let Ok(t) = client.get_template(name).await {
                if t.status == moat_api::TemplateStatus::Ready {
                    return;
                }
            }
            let mut events = client
                .build_template(name)
                .await
                .unwrap_or_else(|e| panic!("build template {name}: {e}"));
            let mut last = None;
            while let Some(ev) = events.next().await {
                last = Some(ev.expect("build event"));
            }
            match last {
                Some(moat_api::BuildEvent::Done { .. }) => {}
                other => panic!("template {name} build did not finish: {other:?}"),
            }
        })
    })
    .join()
    .unwrap_or_else(|_| panic!("template {name} build"));
}

/// A test's own daemon removes its sandboxes when the test ends, passed or failed: sandboxes outlive
/// their daemon by design, and a panicking test's temporary data dir goes away with it, so nothing
/// else would. (The shared daemon is a static and never dropped; its sandboxes are the tests'.)
impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.lock().map(|c| c.is_none()).unwrap_or(true) {
            release_uid_base(&self.extra_args);
            return;
        }
        let key = std::fs::read_to_string(self.data_dir.join("api-key")).unwrap_or_default();
        let _ = Command::new(moat_bin())
            .args(["rm", "--all"])
            .env("MOAT_URL", &self.url)
            .env("MOAT_API_KEY", key.trim())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        self.stop();
        release_uid_base(&self.extra_args);
    }
}

/// A TCP listener on 127.0.0.1 whose connections are relayed to the unix socket `path` (which may not
/// exist yet); returns its port. Lives as long as the test binary.
pub fn unix_forwarder(path: PathBuf) -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(tcp) = conn else { continue };
            // Streamed answers are many small writes: without it, Nagle and delayed ACKs add ~40 ms.
            let _ = tcp.set_nodelay(true);
            let Ok(unix) = std::os::unix::net::UnixStream::connect(&path) else {
                continue;
            };
            let (mut t2, mut u2) = (tcp.try_clone().unwrap(), unix.try_clone().unwrap());
            let (mut t1, mut u1) = (tcp, unix);
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut t1, &mut u1);
                let _ = u1.shutdown(std::net::Shutdown::Write);
            });
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut u2, &mut t2);
                let _ = t2.shutdown(std::net::Shutdown::Write);
            });
        }
    });
    port
}
