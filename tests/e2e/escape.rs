//! The escape suite: attacks as data (`tests/escape/cases.json`), run here against real sandboxes of the
//! `base` template. The test fails listing every case that did not hold, and writes
//! `docs/escape-report.md` (`docs/escape-report-<tier>.md` for the other tiers). Skipped and not-yet-applicable (`tier_todo`) cases are reported as such and
//! never count as passed. Around every case the runner also checks the host itself ([`HostState`]):
//! on the microvm tier, where the guest's root may legitimately act on its own kernel, that is what
//! tells an in-guest effect from an escape. `MOAT_ESCAPE_ONLY=id,id` runs only those cases (and
//! writes no report); `MOAT_ESCAPE_DUMP=DIR` keeps every case's output.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use futures::StreamExt;
use moat_api::{CreateSandboxRequest, ProcessEvent, StartProcessRequest};
use moat_client::Client;
use serde::Deserialize;

use crate::harness::*;

const CASES: &str = include_str!("../escape/cases.json");
/// Sandboxes that share the ordinary cases (the machine has 2 cores).
const WORKERS: usize = 3;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Suite {
    version: u32,
    #[allow(dead_code)]
    comment: String,
    prelude: Vec<String>,
    cases: Vec<Case>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    id: String,
    category: String,
    source: String,
    #[serde(default)]
    kind: Kind,
    #[serde(default)]
    attack: Vec<String>,
    #[serde(default)]
    setup: Vec<String>,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    expect_stdout_contains: Vec<String>,
    #[serde(default)]
    expect_stdout_not_contains: Vec<String>,
    #[serde(default)]
    expect_exit: Option<i32>,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    memory_mb: Option<u64>,
    #[serde(default)]
    cpu: Option<f64>,
    /// Process limit of the attack sandbox (resource cases).
    #[serde(default)]
    pids: Option<u64>,
    /// Writable-layer quota of the attack sandbox (resource cases).
    #[serde(default)]
    disk_mb: Option<u64>,
    /// A resource attack started in the background, its output read by nobody while it runs (an
    /// output flood): held when the agent kept only its buffer (output was dropped), the daemon's
    /// and the sandbox's memory did not grow with what was written, and its last output is there.
    #[serde(default)]
    background: bool,
    /// Names the test's own upstream DNS server must never be asked for (network cases: its query
    /// log is read after the case).
    #[serde(default)]
    upstream_never_sees: Vec<String>,
    /// Host files that must read the same after the case as before it (on every tier): what a
    /// write inside the sandbox (a sysctl, a hostname) must not reach.
    #[serde(default)]
    host_unchanged: Vec<String>,
    #[serde(default)]
    tier_todo: Option<String>,
    #[serde(default)]
    skip: Option<String>,
    /// Expectations that replace the case's own on one tier (`"gvisor": {...}`): the same attack is
    /// refused there in another way (another errno, a Sentry-only effect). Each says why.
    #[serde(default)]
    tiers: BTreeMap<String, TierExpect>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierExpect {
    /// Why this tier's outcome is still a held attack.
    why: String,
    #[serde(default)]
    expect_stdout_contains: Option<Vec<String>>,
    #[serde(default)]
    expect_stdout_not_contains: Option<Vec<String>>,
    #[serde(default)]
    expect_exit: Option<i32>,
    /// The case does not hold on this tier yet: reported as skipped with this reason, never passed.
    #[serde(default)]
    todo: Option<String>,
    /// On this tier the attack may end the sandbox itself (a guest that powers itself off or
    /// panics its own kernel): held when the sandbox is gone and the daemon and a new sandbox go on.
    #[serde(default)]
    may_end_sandbox: bool,
    /// With `may_end_sandbox`: the reason the daemon must give for the end (its 404 says
    /// "ended at ... (REASON)"), e.g. `oom` when the host's OOM killer ended a gVisor Sentry.
    #[serde(default)]
    ended_by: Option<String>,
    /// A resource case judged from the host: the CPU time the sandbox's cgroup used over the
    /// attack (the daemon's stats, read on the host) must stay within its `cpu` limit.
    #[serde(default)]
    host_cpu: bool,
}

impl Case {
    /// The case as it applies to this run's tier.
    fn for_tier(&self) -> Case {
        let mut c = self.clone();
        if let Some(t) = self.tiers.get(isolation().as_str()) {
            if let Some(v) = &t.expect_stdout_contains {
                c.expect_stdout_contains = v.clone();
            }
            if let Some(v) = &t.expect_stdout_not_contains {
                c.expect_stdout_not_contains = v.clone();
            }
            if t.expect_exit.is_some() {
                c.expect_exit = t.expect_exit;
            }
            if let Some(todo) = &t.todo {
                c.tier_todo = Some(format!("{}: {todo}", isolation().as_str()));
            }
        }
        c
    }

    /// Whether the attack may end its sandbox on this run's tier.
    fn may_end_sandbox(&self) -> bool {
        self.tiers
            .get(isolation().as_str())
            .is_some_and(|t| t.may_end_sandbox)
    }

    /// The reason the daemon must give when the attack ends its sandbox on this run's tier.
    fn ended_by(&self) -> Option<&str> {
        self.tiers
            .get(isolation().as_str())
            .and_then(|t| t.ended_by.as_deref())
    }

    /// Whether this run's tier judges the case's CPU use from the host.
    fn host_cpu(&self) -> bool {
        self.tiers
            .get(isolation().as_str())
            .is_some_and(|t| t.host_cpu)
    }

    /// Why the tier has expectations of its own, if it has.
    fn tier_why(&self) -> Option<&str> {
        self.tiers.get(isolation().as_str()).map(|t| t.why.as_str())
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "snake_case")]
enum Kind {
    #[default]
    Shell,
    Resource,
    ApiRead,
    ApiTar,
    ApiWrite,
    /// An attack on the sandbox network, run on a daemon of its own in a test-made network.
    Network,
}

#[derive(Debug, Clone)]
enum Verdict {
    Held(String),
    Failed(String),
    Skipped(String),
}

/// Values the cases' placeholders stand for.
struct Vars {
    secret: String,
    secret_path: String,
    write_path: String,
    api_key_b64: String,
    daemon_port: u16,
    /// The host kernel's boot id: a procfs that shows it is the host's.
    host_boot_id: String,
    dir: std::path::PathBuf,
}

impl Vars {
    fn fill(&self, s: &str) -> String {
        s.replace("{SECRET_PATH}", &self.secret_path)
            .replace("{SECRET}", &self.secret)
            .replace("{WRITE_PATH}", &self.write_path)
            .replace("{API_KEY_B64}", &self.api_key_b64)
            .replace("{DAEMON_PORT}", &self.daemon_port.to_string())
            .replace("{HOST_BOOT_ID}", &self.host_boot_id)
    }
}

fn one_line(s: &str, max: usize) -> String {
    let flat: String = s
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|");
    if flat.chars().count() <= max {
        return flat;
    }
    let tail: String = flat
        .chars()
        .rev()
        .take(max)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    format!("…{tail}")
}

fn judge(case: &Case, vars: &Vars, out: &Output) -> Verdict {
    dump(case, out);
    let case = &case.for_tier();
    let observed = one_line(&format!("{} {}", out.stdout, out.stderr), 120);
    let mut why = Vec::new();
    if out.stdout.contains("ESCAPED") {
        why.push("printed ESCAPED".to_string());
    }
    for want in &case.expect_stdout_contains {
        let want = vars.fill(want);
        if !out.stdout.contains(&want) {
            why.push(format!("missing {want:?}"));
        }
    }
    for bad in &case.expect_stdout_not_contains {
        let bad = vars.fill(bad);
        if out.stdout.contains(&bad) {
            why.push(format!("contains {bad:?}"));
        }
    }
    if let Some(code) = case.expect_exit {
        if out.exit.exit_code != Some(code) {
            why.push(format!("exit {:?}, want {code}", out.exit.exit_code));
        }
    }
    if why.is_empty() {
        Verdict::Held(observed)
    } else {
        Verdict::Failed(format!("{}; observed: {observed}", why.join(", ")))
    }
}

/// What the runner checks on the host around every case, whatever the case prints: the host files
/// it names (`host_unchanged`) read the same, the host file {SECRET} is intact, {WRITE_PATH} was not
/// made, the daemon answers, and on the microvm tier the sandbox's VMM is the same unprivileged QEMU
/// process as before (same pid and credentials, no capabilities, `no_new_privs`, seccomp) and alone
/// in its cgroup: an attack that acts on its own guest kernel leaves all of that as it was. On the
/// gvisor tier, likewise, the Sentry is the same unprivileged process (not root, `no_new_privs`,
/// seccomp), every host process of the sandbox is under `no_new_privs` and seccomp, and none is in a
/// user namespace that was not there before the case.
struct HostState {
    files: Vec<(String, Option<Vec<u8>>)>,
    vmm: Option<Result<Vmm, String>>,
    sentry: Option<Result<Sentry, String>>,
}

/// A gVisor sandbox as the host sees it: its Sentry (`runsc-sandbox`) and the user namespaces its
/// processes (Sentry, gofer, syscall stubs) live in.
#[derive(Debug, PartialEq)]
struct Sentry {
    pid: u32,
    /// The credential lines of the Sentry's /proc/PID/status.
    status: Vec<String>,
    userns: BTreeSet<String>,
}

/// The credential lines of host process `pid`'s /proc/PID/status, whitespace folded (None: gone).
fn status_lines(pid: u32) -> Option<Vec<String>> {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(
        st.lines()
            .filter(|l| {
                ["Uid:", "Gid:", "Groups:", "Cap", "NoNewPrivs:", "Seccomp:"]
                    .iter()
                    .any(|k| l.starts_with(k))
            })
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect(),
    )
}

/// The sandbox's Sentry on the host (gvisor tier only), checked to run unprivileged: every host
/// process of the sandbox is under `no_new_privs` and a seccomp filter, the Sentry and its stubs as a
/// uid other than root. A user namespace, a mount or a syscall that an attack makes inside is the
/// Sentry's own emulation; what the host would show of one that escaped is a process of the
/// sandbox's cgroup in a user namespace that was not there before, a new Sentry, or credentials
/// that changed — what `changes` compares.
fn sentry_of(sbx: &str) -> Result<Sentry, String> {
    let pids = cgroup_procs(sbx);
    let mut sentry = None;
    let mut userns = BTreeSet::new();
    for pid in pids {
        let Some(status) = status_lines(pid) else {
            continue; // gone meanwhile (a stub whose address space ended)
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let has = |want: &str| status.iter().any(|l| l == want);
        if !has("NoNewPrivs: 1") || !has("Seccomp: 2") {
            return Err(format!("host process {pid} of the sandbox runs without no_new_privs and seccomp: {status:?}"));
        }
        let gofer = cmdline.starts_with(b"runsc-gofer");
        let root = status
            .iter()
            .filter(|l| l.starts_with("Uid:"))
            .any(|l| l.split_whitespace().skip(1).any(|id| id == "0"));
        if root && !gofer {
            return Err(format!(
                "host process {pid} of the sandbox runs as root: {status:?}"
            ));
        }
        if let Ok(ns) = std::fs::read_link(format!("/proc/{pid}/ns/user")) {
            userns.insert(ns.display().to_string());
        }
        if cmdline.starts_with(b"runsc-sandbox") {
            if sentry.is_some() {
                return Err("two Sentries in one sandbox".into());
            }
            sentry = Some((pid, status));
        }
    }
    let (pid, status) = sentry.ok_or("no runsc-sandbox in the sandbox's cgroup")?;
    Ok(Sentry {
        pid,
        status,
        userns,
    })
}

#[derive(Debug, PartialEq)]
struct Vmm {
    pid: u32,
    /// The credential lines of its /proc/PID/status.
    status: Vec<String>,
}

/// Whether host process `pid` runs QEMU.
fn is_qemu(pid: u32) -> bool {
    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|e| e.ends_with("qemu-system-x86_64"))
}

/// The sandbox's QEMU on the host, checked to hold no privilege (microvm tier only).
fn vmm_of(sbx: &str) -> Result<Vmm, String> {
    let pids = cgroup_procs(sbx);
    let qemu: Vec<u32> = pids.iter().copied().filter(|p| is_qemu(*p)).collect();
    if qemu.len() != 1 || pids.len() != 1 {
        return Err(format!(
            "the sandbox's cgroup holds {pids:?}, not one QEMU process"
        ));
    }
    let pid = qemu[0];
    let status = status_lines(pid).ok_or_else(|| format!("QEMU (pid {pid}) is gone"))?;
    let has = |want: &str| status.iter().any(|l| l == want);
    let root = status
        .iter()
        .filter(|l| l.starts_with("Uid:") || l.starts_with("Gid:"))
        .any(|l| l.split_whitespace().skip(1).any(|id| id == "0"));
    if root
        || !has("CapPrm: 0000000000000000")
        || !has("CapEff: 0000000000000000")
        || !has("NoNewPrivs: 1")
        || !has("Seccomp: 2")
    {
        return Err(format!("QEMU (pid {pid}) holds privilege: {status:?}"));
    }
    Ok(Vmm { pid, status })
}

impl HostState {
    fn read(sbx: &str, case: &Case, vars: &Vars) -> HostState {
        HostState {
            files: case
                .host_unchanged
                .iter()
                .map(|f| {
                    let f = vars.fill(f);
                    let v = std::fs::read(&f).ok();
                    (f, v)
                })
                .collect(),
            vmm: (isolation() == moat_api::Isolation::Microvm).then(|| vmm_of(sbx)),
            sentry: (isolation() == moat_api::Isolation::Gvisor).then(|| sentry_of(sbx)),
        }
    }

    /// What changed on the host during the case (empty: nothing).
    async fn changes(&self, c: &Client, sbx: &str, vars: &Vars) -> Vec<String> {
        let mut bad = Vec::new();
        for (f, before) in &self.files {
            let after = std::fs::read(f).ok();
            if &after != before {
                bad.push(format!(
                    "host file {f} changed: {:?} -> {:?}",
                    before.as_deref().map(String::from_utf8_lossy),
                    after.as_deref().map(String::from_utf8_lossy)
                ));
            }
        }
        if std::fs::read_to_string(&vars.secret_path).ok().as_deref() != Some(vars.secret.as_str())
        {
            bad.push(format!("host file {} changed", vars.secret_path));
        }
        if std::path::Path::new(&vars.write_path).exists() {
            bad.push(format!("{} appeared on the host", vars.write_path));
        }
        match tokio::time::timeout(Duration::from_secs(10), c.health()).await {
            Ok(Ok(_)) => {}
            other => bad.push(format!("daemon health after the case: {other:?}")),
        }
        match &self.vmm {
            None => {}
            Some(Err(e)) => bad.push(format!("before the case: {e}")),
            Some(Ok(before)) => {
                if gone(c, sbx).await.is_some() {
                    // The VM ended itself: its QEMU must be gone, not left running.
                    if is_qemu(before.pid) {
                        bad.push(format!("QEMU (pid {}) outlived its sandbox", before.pid));
                    }
                } else {
                    match vmm_of(sbx) {
                        Ok(after) if &after == before => {}
                        Ok(after) => bad.push(format!("the VMM changed: {before:?} -> {after:?}")),
                        Err(e) => bad.push(format!("after the case: {e}")),
                    }
                }
            }
        }
        match &self.sentry {
            None => {}
            Some(Err(e)) => bad.push(format!("before the case: {e}")),
            Some(Ok(before)) => {
                if gone(c, sbx).await.is_some() {
                    if std::path::Path::new(&format!("/proc/{}", before.pid)).exists() {
                        bad.push(format!(
                            "the Sentry (pid {}) outlived its sandbox",
                            before.pid
                        ));
                    }
                } else {
                    match sentry_of(sbx) {
                        Ok(after) => {
                            if (after.pid, &after.status) != (before.pid, &before.status) {
                                bad.push(format!("the Sentry changed: {before:?} -> {after:?}"));
                            }
                            let new: Vec<_> = after.userns.difference(&before.userns).collect();
                            if !new.is_empty() {
                                bad.push(format!(
                                    "a host process of the sandbox is in a user namespace made during the case: {new:?}"
                                ));
                            }
                        }
                        Err(e) => bad.push(format!("after the case: {e}")),
                    }
                }
            }
        }
        bad
    }
}

/// A case's verdict with the runner's host-side checks folded in.
fn with_host_checks(v: Verdict, bad: Vec<String>) -> Verdict {
    if bad.is_empty() {
        return v;
    }
    match v {
        Verdict::Held(o) => Verdict::Failed(format!("{}; observed: {o}", bad.join(", "))),
        Verdict::Failed(o) => Verdict::Failed(format!("{}; {o}", bad.join(", "))),
        other => other,
    }
}

/// With `MOAT_ESCAPE_DUMP=DIR`, each case's whole output goes to `DIR/<id>.txt` (for writing a tier's
/// expectations).
fn dump(case: &Case, out: &Output) {
    if let Some(dir) = std::env::var_os("MOAT_ESCAPE_DUMP") {
        let _ = std::fs::create_dir_all(&dir);
        let _ = std::fs::write(
            std::path::Path::new(&dir).join(format!("{}.txt", case.id)),
            format!(
                "exit {:?}\n--- stdout\n{}--- stderr\n{}",
                out.exit.exit_code, out.stdout, out.stderr
            ),
        );
    }
}

async fn run_script(
    c: &Client,
    id: &str,
    script: &str,
    user: Option<String>,
    secs: u64,
) -> Result<Output, String> {
    let req = StartProcessRequest {
        cmd: Some(vec!["/bin/bash".into(), "-c".into(), script.into()]),
        user,
        timeout: Some(secs as f64),
        ..Default::default()
    };
    match tokio::time::timeout(Duration::from_secs(secs + 30), try_run_req(c, id, req)).await {
        Ok(o) => o,
        Err(_) => Ok(Output {
            stderr: format!("runner: no exit within {} s", secs + 30),
            ..Default::default()
        }),
    }
}

/// The network cases, on a daemon of their own in a test-made network (topology.rs: its only uplink
/// is a namespace of the test's own servers, DNS included) with sandbox networking on, in a busybox
/// sandbox whose policy is the one an agent with a narrow allow list gets: internet off, one domain
/// (`good.example`) allowed. A second sandbox serves a marker on port 7000 (its own loopback proves
/// it). Placeholders: {INTERNET}, {METADATA}, {EVIL} (addresses of the test's servers), {OTHER_IP}
/// and {OTHER_MARKER} (the second sandbox), {EXFIL} (a name no one asked for before).
async fn run_network(cases: &[Case], vars: &Vars) -> Vec<(String, Verdict)> {
    use crate::topology::{networked_daemon, EVIL, INTERNET, METADATA};
    let all_failed = |why: String| -> Vec<(String, Verdict)> {
        cases
            .iter()
            .map(|k| (k.id.clone(), Verdict::Failed(why.clone())))
            .collect()
    };
    let tmp = tempfile::tempdir().unwrap();
    let (topo, d, c, _deny) = networked_daemon(
        tmp.path(),
        "10.204.0.0/16",
        &[
            "--default-network",
            r#"{"allow_internet": false, "allow_out": ["good.example"]}"#,
        ],
    )
    .await;
    let bb = || CreateSandboxRequest {
        template: Some("bb".into()),
        timeout: Some(600),
        ..Default::default()
    };
    let (other, attacker) = match (c.create_sandbox(&bb()).await, c.create_sandbox(&bb()).await) {
        (Ok(o), Ok(a)) => (o, a),
        other => return all_failed(format!("create the network sandboxes: {other:?}")),
    };
    let marker = format!("other-sandbox-{:016x}", rand_u64());
    let serve = StartProcessRequest {
        cmd: Some(vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("while true; do echo {marker} | busybox nc -l -p 7000; done"),
        ]),
        ..Default::default()
    };
    if let Err(e) = c.start_process_background(&other.id, &serve).await {
        return all_failed(format!("start the second sandbox's server: {e}"));
    }
    // Positive controls: the second sandbox serves (on its own loopback), and the test's DNS server
    // logs the queries it gets (a name the policy allows).
    let mut serves = false;
    for _ in 0..50 {
        if sh(&c, &other.id, "busybox nc -w 2 127.0.0.1 7000")
            .await
            .stdout
            .contains(&marker)
        {
            serves = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dns_log = || std::fs::read_to_string(tmp.path().join("dnsmasq.log")).unwrap_or_default();
    let allowed = sh(&c, &attacker.id, "busybox nslookup good.example").await;
    if !serves || !allowed.stdout.contains(INTERNET) || !dns_log().contains("good.example") {
        return all_failed(format!(
            "the network cases' controls failed: second sandbox serving {serves}, allowed name              resolved {:?}, DNS log {:?}",
            allowed.stdout,
            one_line(&dns_log(), 200)
        ));
    }
    let other_ip = other
        .network
        .as_ref()
        .map(|n| n.ip.clone())
        .unwrap_or_default();
    let exfil = format!("x{:012x}", rand_u64() & 0xffff_ffff_ffff);
    let fill = |s: &str| {
        s.replace("{INTERNET}", INTERNET)
            .replace("{METADATA}", METADATA)
            .replace("{EVIL}", EVIL)
            .replace("{OTHER_IP}", &other_ip)
            .replace("{OTHER_MARKER}", &marker)
            .replace("{EXFIL}", &exfil)
    };
    let mut out = Vec::new();
    for case in cases {
        let mut k = case.clone();
        for v in [
            &mut k.attack,
            &mut k.expect_stdout_contains,
            &mut k.expect_stdout_not_contains,
            &mut k.upstream_never_sees,
        ] {
            *v = v.iter().map(|s| fill(s)).collect();
        }
        let req = StartProcessRequest {
            cmd: Some(vec!["/bin/sh".into(), "-c".into(), k.attack.join("\n")]),
            timeout: Some(k.timeout.unwrap_or(60) as f64),
            ..Default::default()
        };
        let v = match try_run_req(&c, &attacker.id, req).await {
            Ok(o) => judge(&k, vars, &o),
            Err(e) => Verdict::Failed(format!("the attack's stream broke: {e}")),
        };
        let log = dns_log();
        let seen: Vec<&String> = k
            .upstream_never_sees
            .iter()
            .filter(|n| log.contains(n.as_str()))
            .collect();
        let v = match v {
            Verdict::Held(o) if seen.is_empty() => {
                Verdict::Held(if k.upstream_never_sees.is_empty() {
                    o
                } else {
                    format!(
                        "{o}; the upstream DNS server was never asked for {:?}",
                        k.upstream_never_sees
                    )
                })
            }
            Verdict::Held(_) => {
                Verdict::Failed(format!("the upstream DNS server was asked for {seen:?}"))
            }
            other => other,
        };
        out.push((case.id.clone(), v));
    }
    for id in [&attacker.id, &other.id] {
        let _ = c.delete_sandbox(id).await;
    }
    d.stop();
    drop(topo);
    out
}

/// Runs `script` as a background process whose output nobody reads while it runs; once it has
/// exited, its output as the agent kept it (the last `output_bytes`), as one `Output` whose stdout
/// ends with `dropped-bytes=N`, N the output the agent let go. Err when the sandbox ended.
async fn run_unread(c: &Client, id: &str, script: &str, secs: u64) -> Result<Output, String> {
    let req = StartProcessRequest {
        cmd: Some(vec!["/bin/bash".into(), "-c".into(), script.into()]),
        timeout: Some(secs as f64),
        ..Default::default()
    };
    let p = c
        .start_process_background(id, &req)
        .await
        .map_err(|e| format!("start the background process: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(secs + 30);
    loop {
        let list = c
            .list_processes(id)
            .await
            .map_err(|e| format!("list processes: {e}"))?;
        if !list.iter().any(|q| q.pid == p.pid && q.running) {
            break;
        }
        if Instant::now() > deadline {
            return Ok(Output {
                stderr: format!("runner: no exit within {} s", secs + 30),
                ..Default::default()
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let mut events = c
        .attach(id, &p.pid.to_string(), true)
        .await
        .map_err(|e| format!("attach: {e}"))?;
    let (mut tail, mut dropped, mut out) = (Vec::new(), 0u64, Output::default());
    while let Some(ev) = events.next().await {
        match ev.map_err(|e| format!("process event: {e:?}"))? {
            ProcessEvent::Stdout(ch) | ProcessEvent::Stderr(ch) => {
                tail.extend(decode(&ch));
                // Only the end matters: what the flood printed last.
                if tail.len() > 128 << 10 {
                    tail.drain(..tail.len() - (64 << 10));
                }
            }
            ProcessEvent::Dropped { bytes } => dropped += bytes,
            ProcessEvent::Exit(e) => out.exit = e,
            _ => {}
        }
    }
    out.pid = p.pid;
    out.stdout = format!(
        "{}\ndropped-bytes={dropped}\n",
        String::from_utf8_lossy(&tail)
    );
    Ok(out)
}

/// The verdict on a case whose sandbox ended under it (`broke`: what the runner saw).
async fn judge_ended(c: &Client, sbx: &str, case: &Case, broke: &str) -> Verdict {
    if !case.may_end_sandbox() {
        return Verdict::Failed(format!("the sandbox ended under the case: {broke}"));
    }
    // Held when the sandbox is gone (nothing of it left running) and the daemon serves a new one.
    let mut gone = None;
    for _ in 0..100 {
        if let Some(said) = crate::harness::gone(c, sbx).await {
            gone = Some(said);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(said) = gone else {
        return Verdict::Failed(format!(
            "the case broke its sandbox's stream ({broke}) but the sandbox is still listed"
        ));
    };
    if let Some(reason) = case.ended_by() {
        if !said.contains(&format!("({reason})")) {
            return Verdict::Failed(format!(
                "the sandbox ended, but not by {reason} as the daemon tells it: {said}"
            ));
        }
    }
    let fresh = create(c, "base").await;
    let alive = sh(c, &fresh.id, "echo alive").await.stdout;
    let _ = c.delete_sandbox(&fresh.id).await;
    if alive != "alive\n" {
        return Verdict::Failed(format!("after the case a new sandbox answered {alive:?}"));
    }
    Verdict::Held(format!(
        "the sandbox ended itself ({}); the daemon said: {}; the daemon and a new sandbox went on",
        case.tier_why().unwrap_or("its own kernel"),
        one_line(&said, 160)
    ))
}

fn script(suite: &Suite, case: &Case, vars: &Vars) -> String {
    let mut s = vars.fill(&suite.prelude.join("\n"));
    s.push('\n');
    s.push_str(&vars.fill(&case.attack.join("\n")));
    s.push('\n');
    s
}

async fn run_shell(c: &Client, sbx: &str, suite: &Suite, case: &Case, vars: &Vars) -> Verdict {
    let secs = case.timeout.unwrap_or(30);
    match run_script(c, sbx, &script(suite, case, vars), case.user.clone(), secs).await {
        Ok(out) => judge(case, vars, &out),
        Err(broke) => judge_ended(c, sbx, case, &broke).await,
    }
}

async fn read_stream(st: moat_client::Result<moat_client::ByteStream>) -> Result<Vec<u8>, String> {
    let mut st = st.map_err(|e| e.to_string())?;
    let mut v = Vec::new();
    while let Some(b) = st.next().await {
        v.extend_from_slice(&b.map_err(|e| e.to_string())?);
    }
    Ok(v)
}

async fn run_api(c: &Client, sbx: &str, case: &Case, vars: &Vars) -> Verdict {
    if !case.setup.is_empty() {
        let out = match run_script(c, sbx, &vars.fill(&case.setup.join("\n")), None, 30).await {
            Ok(o) => o,
            Err(e) => return Verdict::Failed(format!("setup: {e}")),
        };
        if out.exit.exit_code != Some(0) {
            return Verdict::Failed(format!("setup failed: {}", one_line(&out.stderr, 120)));
        }
    }
    let path = vars.fill(case.path.as_deref().unwrap_or("/"));
    match case.kind {
        Kind::ApiRead | Kind::ApiTar => {
            let got = if case.kind == Kind::ApiRead {
                read_stream(c.read_file(sbx, &path).await).await
            } else {
                read_stream(c.download_tar(sbx, &path).await).await
            };
            match got {
                Ok(bytes)
                    if bytes
                        .windows(vars.secret.len())
                        .any(|w| w == vars.secret.as_bytes()) =>
                {
                    Verdict::Failed("the host file's content came back".into())
                }
                Ok(bytes) => Verdict::Held(format!(
                    "{} bytes, none of them the host file's",
                    bytes.len()
                )),
                Err(e) => Verdict::Held(format!("refused: {}", one_line(&e, 100))),
            }
        }
        Kind::ApiWrite => {
            let r = c
                .write_file(sbx, &path, "moat-escape-write", &Default::default())
                .await;
            if std::path::Path::new(&vars.write_path).exists() {
                Verdict::Failed(format!("{} appeared on the host", vars.write_path))
            } else {
                Verdict::Held(match r {
                    Ok(_) => "written inside the sandbox only".into(),
                    Err(e) => format!("refused: {}", one_line(&e.to_string(), 100)),
                })
            }
        }
        _ => unreachable!(),
    }
}

/// Runs a resource attack in a sandbox of its own while a neighbour's exec and the daemon must keep
/// answering.
async fn run_resource(
    c: &Client,
    neighbour: &str,
    suite: &Suite,
    case: &Case,
    vars: &Vars,
) -> Verdict {
    let sbx = match c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("base".into()),
            timeout: Some(600),
            memory_mb: case.memory_mb,
            disk_mb: case.disk_mb,
            pids: case.pids,
            // Half a core unless the case says otherwise: the host (2 cores in CI) must keep room for
            // the neighbour and the daemon, which is what these cases check.
            cpu: case.cpu.or(Some(0.5)),
            ..Default::default()
        })
        .await
    {
        Ok(s) => s,
        Err(e) => return Verdict::Failed(format!("create attack sandbox: {e}")),
    };
    let host = HostState::read(&sbx.id, case, vars);
    let cpu_limit = case.cpu.unwrap_or(0.5);
    let cpu_at = |c: Client, id: String| async move {
        let st = c.sandbox_stats(&id).await.ok()?;
        Some((Instant::now(), st.cpu_usage_us))
    };
    let cpu_before = cpu_at(c.clone(), sbx.id.clone()).await;
    let secs = case.timeout.unwrap_or(30);
    let daemon_rss = shared().rss_kib();
    let sandbox_memory = c
        .sandbox_stats(&sbx.id)
        .await
        .map(|s| s.memory_bytes)
        .unwrap_or(0);
    let attack = {
        let (c, id, s, user) = (
            c.clone(),
            sbx.id.clone(),
            script(suite, case, vars),
            case.user.clone(),
        );
        let background = case.background;
        tokio::spawn(async move {
            if background {
                run_unread(&c, &id, &s, secs).await
            } else {
                run_script(&c, &id, &s, user, secs).await
            }
        })
    };
    let mut probe_failures = Vec::new();
    let mut probes = 0;
    tokio::time::sleep(Duration::from_millis(500)).await;
    while !attack.is_finished() {
        let t = Instant::now();
        let probe = tokio::time::timeout(
            Duration::from_secs(45),
            run_script(c, neighbour, "echo neighbour-ok", None, 30),
        )
        .await;
        match probe {
            Ok(Ok(o)) if o.stdout == "neighbour-ok\n" => {}
            Ok(Err(e)) => probe_failures.push(format!("neighbour exec: {e}")),
            Ok(Ok(o)) => probe_failures.push(format!(
                "neighbour exec: {} {:?}",
                one_line(&format!("{} {}", o.stdout, o.stderr), 80),
                o.exit
            )),
            Err(_) => probe_failures.push("neighbour exec took over 45 s".into()),
        }
        // Generous for a loaded 2-core CI machine running other tests in parallel; a neighbour
        // starved by the attack would not answer at all.
        if t.elapsed() > Duration::from_secs(20) {
            probe_failures.push(format!("neighbour exec took {:?}", t.elapsed()));
        }
        match tokio::time::timeout(Duration::from_secs(5), c.health()).await {
            Ok(Ok(_)) => {}
            other => probe_failures.push(format!("daemon health: {other:?}")),
        }
        probes += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let verdict = match attack.await {
        Ok(Ok(out)) => judge(case, vars, &out),
        Ok(Err(broke)) => judge_ended(c, &sbx.id, case, &broke).await,
        Err(e) => Verdict::Failed(format!("runner: {e}")),
    };
    let verdict = match verdict {
        Verdict::Held(o) if case.background => {
            // Gigabytes went through the agent: what it and the daemon hold must not follow. (A
            // microVM's own memory is its guest's, hundreds of MiB: its growth is what counts.)
            let grew = shared().rss_kib().saturating_sub(daemon_rss);
            let memory = c.sandbox_stats(&sbx.id).await.map(|s| s.memory_bytes);
            match memory {
                Ok(m) if grew < 64 << 10 && m.saturating_sub(sandbox_memory) < 128 << 20 => {
                    Verdict::Held(format!(
                        "{o}; the daemon's memory grew {grew} KiB, the sandbox's {} KiB",
                        m.saturating_sub(sandbox_memory) >> 10
                    ))
                }
                other => Verdict::Failed(format!(
                    "memory grew with the flood: the daemon by {grew} KiB, the sandbox: {other:?}"
                )),
            }
        }
        Verdict::Held(o) if case.host_cpu() => {
            match (cpu_before, cpu_at(c.clone(), sbx.id.clone()).await) {
                (Some((t0, u0)), Some((t1, u1))) => {
                    let cores =
                        (u1.saturating_sub(u0)) as f64 / 1e6 / (t1 - t0).as_secs_f64().max(0.001);
                    // The quota, with room for the accounting of one CFS period and the probes.
                    if cores <= cpu_limit * 1.3 + 0.05 {
                        Verdict::Held(format!(
                            "{o}; on the host the sandbox's cgroup used {cores:.2} cores (limit {cpu_limit})"
                        ))
                    } else {
                        Verdict::Failed(format!(
                            "the sandbox's cgroup used {cores:.2} cores, over its limit of {cpu_limit}"
                        ))
                    }
                }
                _ => Verdict::Failed("could not read the sandbox's CPU time on the host".into()),
            }
        }
        other => other,
    };
    let verdict = with_host_checks(verdict, host.changes(c, &sbx.id, vars).await);
    let _ = c.delete_sandbox(&sbx.id).await;
    if probes == 0 {
        probe_failures.push("the attack ended before the neighbour was probed".into());
    }
    match verdict {
        Verdict::Held(o) if probe_failures.is_empty() => {
            Verdict::Held(format!("{o} (neighbour and daemon answered {probes}×)"))
        }
        Verdict::Held(o) => {
            Verdict::Failed(format!("{}; observed: {o}", probe_failures.join(", ")))
        }
        other => other,
    }
}

fn write_report(
    suite: &Suite,
    results: &BTreeMap<String, Verdict>,
    write: bool,
) -> (usize, usize, usize) {
    let (mut held, mut failed, mut skipped) = (0, 0, 0);
    let mut rows = String::new();
    for case in &suite.cases {
        let (result, observed) = match &results[&case.id] {
            Verdict::Held(o) => {
                held += 1;
                match case.tier_why() {
                    Some(why) => (
                        format!(
                            "held ({} expectation: {})",
                            isolation().as_str(),
                            one_line(why, 160)
                        ),
                        o.clone(),
                    ),
                    None => ("held".to_string(), o.clone()),
                }
            }
            Verdict::Failed(o) => {
                failed += 1;
                ("**FAILED**".to_string(), o.clone())
            }
            Verdict::Skipped(why) => {
                skipped += 1;
                (format!("skipped ({})", one_line(why, 100)), String::new())
            }
        };
        let _ = writeln!(
            rows,
            "| `{}` | {} | {} | {result} | {} |",
            case.id,
            case.category,
            isolation().as_str(),
            one_line(&observed, 140)
        );
    }
    let mut md = String::new();
    let _ = writeln!(md, "# Escape suite report\n");
    let _ = writeln!(
        md,
        "Generated by `cargo test -p moat-cli --test e2e escape` (tests/e2e/escape.rs) from \
         `tests/escape/cases.json` (version {}). Do not edit by hand.\n",
        suite.version
    );
    let _ = writeln!(
        md,
        "Tier `{}`: {} cases, **{held} held, {failed} failed, {skipped} skipped** (skipped cases \
         are not counted as passed).\n",
        isolation().as_str(),
        suite.cases.len()
    );
    let _ = writeln!(md, "| case | category | tier | result | observed |");
    let _ = writeln!(md, "|---|---|---|---|---|");
    md.push_str(&rows);
    let _ = writeln!(md, "\n## Sources\n");
    for case in &suite.cases {
        let _ = writeln!(md, "- `{}`: {}", case.id, case.source);
    }
    // One report per tier: docs/escape-report.md (container), docs/escape-report-gvisor.md, ...
    let name = if is_container() {
        "escape-report.md".to_string()
    } else {
        format!("escape-report-{}.md", isolation().as_str())
    };
    if write {
        std::fs::write(workspace_root().join("docs").join(name), md).unwrap();
    }
    (held, failed, skipped)
}

#[tokio::test(flavor = "multi_thread")]
async fn escape_suite() {
    let suite: Suite = serde_json::from_str(CASES).expect("parse tests/escape/cases.json");
    assert_eq!(suite.version, 1);
    for case in &suite.cases {
        for (tier, t) in &case.tiers {
            assert!(
                tier.parse::<moat_api::Isolation>().is_ok() && !t.why.trim().is_empty(),
                "case {}: tier expectations need a known tier and a reason",
                case.id
            );
        }
        let case = &case.for_tier();
        let runnable = case.tier_todo.is_none() && case.skip.is_none();
        let api = matches!(case.kind, Kind::ApiRead | Kind::ApiTar | Kind::ApiWrite);
        assert!(
            !runnable
                || api
                || !case.expect_stdout_contains.is_empty()
                || case.expect_exit.is_some(),
            "case {} has nothing positive to observe",
            case.id
        );
    }
    // The shared daemon's first start blocks on a runtime of its own: not from inside this one.
    let d = std::thread::spawn(shared).join().unwrap();
    let c = d.client();

    let dir = std::env::temp_dir().join(format!("moat-escape-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = format!("moat-host-secret-{:016x}", rand_u64());
    let secret_path = dir.join("secret");
    std::fs::write(&secret_path, &secret).unwrap();
    use base64::Engine;
    let vars = Vars {
        secret,
        secret_path: secret_path.display().to_string(),
        write_path: dir.join("written").display().to_string(),
        api_key_b64: base64::engine::general_purpose::STANDARD.encode(d.api_key()),
        daemon_port: d.port,
        host_boot_id: std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .unwrap()
            .trim()
            .to_string(),
        dir,
    };

    let mut results: BTreeMap<String, Verdict> = BTreeMap::new();
    let mut ordinary = Vec::new();
    let mut resource = Vec::new();
    let mut network = Vec::new();
    // MOAT_ESCAPE_ONLY=id,id runs those cases only (while writing a tier's expectations); the report
    // is then not written.
    let only: Option<Vec<String>> = std::env::var("MOAT_ESCAPE_ONLY")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect());
    for case in suite.cases.iter().map(Case::for_tier) {
        let case = &case;
        if only.as_ref().is_some_and(|o| !o.contains(&case.id)) {
            results.insert(
                case.id.clone(),
                Verdict::Skipped("not in MOAT_ESCAPE_ONLY".into()),
            );
        } else if let Some(why) = &case.tier_todo {
            results.insert(
                case.id.clone(),
                Verdict::Skipped(format!("tier_todo: {why}")),
            );
        } else if let Some(why) = &case.skip {
            results.insert(case.id.clone(), Verdict::Skipped(why.clone()));
        } else if case.kind == Kind::Resource {
            resource.push(case.clone());
        } else if case.kind == Kind::Network {
            network.push(case.clone());
        } else {
            ordinary.push(case.clone());
        }
    }

    let mut workers = Vec::new();
    for _ in 0..WORKERS.min(ordinary.len()) {
        workers.push(create(&c, "base").await);
    }
    let suite_ref = &suite;
    let vars_ref = &vars;
    let runs = workers.iter().enumerate().map(|(w, sbx)| {
        let c = c.clone();
        let mine: Vec<Case> = ordinary
            .iter()
            .enumerate()
            .filter(|(i, _)| i % WORKERS == w)
            .map(|(_, k)| k.clone())
            .collect();
        async move {
            let mut out = Vec::new();
            let mut id = sbx.id.clone();
            for case in mine {
                let host = HostState::read(&id, &case, vars_ref);
                let v = if case.kind == Kind::Shell {
                    run_shell(&c, &id, suite_ref, &case, vars_ref).await
                } else {
                    run_api(&c, &id, &case, vars_ref).await
                };
                let v = with_host_checks(v, host.changes(&c, &id, vars_ref).await);
                // A case that ended its worker (held or not) leaves the rest a new one.
                if gone(&c, &id).await.is_some() {
                    id = create(&c, "base").await.id;
                }
                out.push((case.id.clone(), v));
            }
            (id, out)
        }
    });
    // The workers as they are now (one a case ended was replaced).
    let mut live = Vec::new();
    for (id, batch) in futures::future::join_all(runs).await {
        live.push(id);
        results.extend(batch);
    }
    if live.is_empty() && !resource.is_empty() {
        // No ordinary case ran (MOAT_ESCAPE_ONLY): the resource cases still need a neighbour.
        live.push(create(&c, "base").await.id);
    }
    for case in &resource {
        let v = run_resource(&c, &live[0], &suite, case, &vars).await;
        results.insert(case.id.clone(), v);
    }
    for id in &live {
        let _ = c.delete_sandbox(id).await;
    }
    if !network.is_empty() {
        results.extend(run_network(&network, &vars).await);
    }
    let _ = std::fs::remove_dir_all(&vars.dir);

    let (held, failed, skipped) = write_report(&suite, &results, only.is_none());
    let failures: Vec<String> = suite
        .cases
        .iter()
        .filter_map(|k| match &results[&k.id] {
            Verdict::Failed(why) => Some(format!("  {} ({}): {why}", k.id, k.category)),
            _ => None,
        })
        .collect();
    if only.is_some() {
        for (id, v) in &results {
            if !matches!(v, Verdict::Skipped(w) if w == "not in MOAT_ESCAPE_ONLY") {
                eprintln!("{id}: {v:?}");
            }
        }
    }
    eprintln!(
        "escape suite: {} cases, {held} held, {failed} failed, {skipped} skipped",
        suite.cases.len()
    );
    assert!(
        failures.is_empty(),
        "{} escape case(s) did not hold:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u64::from_le_bytes(b)
}
