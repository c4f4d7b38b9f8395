//! The moat daemon: REST API, sandbox lifecycle, isolation tiers and the host mechanisms under them.
//!
//! Request path: `api` (routing, auth, validation, the HTTP status of every error) → `sandboxes`
//! (lifecycle, state in `db`) → a `tier` (how a sandbox is isolated) → `host` mechanisms (cgroups,
//! mounts, /proc). Process and file requests go from `api::proxy` through `agent` (typed calls of
//! `moat_api::protocol`'s route table) to the in-sandbox agent.
//!
//! Layers, bottom first; a module uses only modules below it (`tests/layering.rs` checks it):
//! `clock`, `ids` · `host` · `agent` · `db`, `layers` · `tier` · `error` · `template` ·
//! `sandboxes`, `code` · `audit` · `netlog` · `api` · `e2b` · `config` (the flags) · this file.

pub mod agent;
pub mod api;
pub mod audit;
pub mod clock;
pub mod code;
pub mod config;
pub mod db;
pub mod e2b;
pub mod error;
pub mod host;
pub mod ids;
pub mod layers;
pub mod netlog;
pub mod sandboxes;
pub mod secrets;
pub mod template;
pub mod tier;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use rand::RngCore;
use sha2::Digest;

pub use config::ServeArgs;

/// Runs the daemon until SIGINT/SIGTERM. Sandboxes outlive the daemon and are re-adopted at the next start.
pub async fn serve(mut args: ServeArgs) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("moat serve must run as root (it creates namespaces, cgroups and mounts)");
    }
    raise_file_limit();
    // Sandboxes' PID 1s are re-parented to the daemon when their init helper exits, so it can reap them.
    nix::sys::prctl::set_child_subreaper(true).context("PR_SET_CHILD_SUBREAPER")?;
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("create {}", args.data_dir.display()))?;
    // Absolute from here on: mount points are found again by comparing with /proc's absolute paths
    // (a relative --data-dir left every sandbox's mounts behind at delete).
    args.data_dir = std::fs::canonicalize(&args.data_dir)
        .with_context(|| format!("resolve {}", args.data_dir.display()))?;
    std::fs::set_permissions(&args.data_dir, std::fs::Permissions::from_mode(0o711))?;
    // One daemon per data dir: two would sweep each other's sandboxes as leftovers.
    let _lock = lock_data_dir(&args.data_dir)?;
    api::extract::MAX_JSON_BODY.store(args.max_json_body, std::sync::atomic::Ordering::Relaxed);

    let api_key = load_or_create_api_key(&args.api_key_path())?;
    write_e2b_api_key(&args.data_dir, &api_key)?;
    let db = Arc::new(db::Db::open(&args.data_dir.join("moat.db"))?);
    let templates = Arc::new(template::store::TemplateStore::new(&args.data_dir)?);
    templates.recover(&db)?;
    let agent = install_agent(&args)?;
    let settings = args.settings()?;
    let audit = audit::Audit::start(db.clone(), args.audit_max_entries);
    let (netlog, events) = netlog::NetLog::start(db.clone(), audit.clone(), args.audit_max_entries);
    let vault = Arc::new(secrets::Vault::new(&args.data_dir, db.clone()));
    let network = network_for(&args, db.clone(), vault.clone(), events).await?;
    let (violations_tx, violations) = tokio::sync::mpsc::unbounded_channel();
    if let Some((_, egress)) = network.as_ref() {
        egress.set_violation_sink(violations_tx);
    }
    if let Some((net, egress)) = network.as_ref().filter(|n| !n.0.deny_files().is_empty()) {
        tokio::spawn(watch_deny_list(net.clone(), egress.clone()));
    }
    let network = network.map(|n| n.0);
    let lxcfs = start_lxcfs(&args)?;
    let container = tier::container::ContainerTier::new(
        args.data_dir.join("sandboxes"),
        agent.clone(),
        args.uid_base,
        &host::cgroup::parent_for(&args.data_dir),
        !args.no_hardening,
        network.clone(),
    )?
    .with_lxcfs(lxcfs.clone());
    let cgroups = container.cgroups().clone();
    if args.no_hardening {
        tracing::warn!(
            "--no-hardening: sandboxes start without the capability drop, seccomp and /proc masks; \
             use it only to measure what hardening costs"
        );
    }
    let agent_path_for_microvm = agent.clone();
    let gvisor = tier::gvisor::GvisorTier::new(
        args.data_dir.join("gvisor"),
        agent,
        cgroups.clone(),
        network.clone(),
    )?;
    let microvm = tier::microvm::MicrovmTier::new(
        &args.data_dir,
        agent_path_for_microvm,
        args.guest_kernel.clone(),
        args.uid_base,
        cgroups.clone(),
        args.microvm_accel,
        network.clone(),
    )?;
    let tiers: Vec<Arc<dyn tier::IsolationTier>> =
        vec![Arc::new(container), Arc::new(gvisor), Arc::new(microvm)];
    let services = sandboxes::Services::new(
        settings,
        db.clone(),
        templates,
        Arc::new(layers::LayerStore::new(args.data_dir.join("layers"))?),
        tiers,
        vault,
    );
    tokio::spawn(audit.clone().record_ends(services.sandboxes.ends()));
    tokio::spawn(act_on_violations(
        violations,
        services.clone(),
        audit.clone(),
    ));
    services.recover().await.context("recover sandboxes")?;
    tokio::spawn(
        netlog
            .clone()
            .retention_loop(args.audit_retention_days, args.audit_max_entries),
    );
    tokio::spawn(
        audit
            .clone()
            .retention_loop(args.audit_retention_days, args.audit_max_entries),
    );
    tokio::spawn(audit.clone().poll_loop(services.sandboxes.clone()));
    services.spawn_background();

    let state = Arc::new(api::AppState {
        sandboxes: services.sandboxes.clone(),
        pool: services.pool.clone(),
        snapshots: services.snapshots.clone(),
        templates: services.templates.clone(),
        builds: services.builds.clone(),
        api_key,
        audit: audit.clone(),
        netlog,
        vault: services.vault.clone(),
    });
    // One count of connections for every API listener: their caps hold together.
    let gate = api::serve::Gate::new(args.listen_limits().within_file_limit());
    if let Some(addr) = args.e2b_addr()? {
        let e2b = e2b::E2b::new(state.clone(), args.e2b_domain_for(addr));
        let gate = gate.clone();
        tokio::spawn(async move {
            if let Err(err) = e2b::serve(e2b, addr, gate, shutdown_signal()).await {
                tracing::error!("{err:#}");
            }
        });
    }
    let app = api::router(state.clone()).merge(api::mcp::routes(state, args.listen)?);
    let tcp = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listen on {}", args.listen))?;
    tracing::info!(addr = %args.listen, data_dir = %args.data_dir.display(), max_connections = gate.limits().max_connections, "moat daemon listening");
    if let Some(path) = &args.unix_socket {
        let _ = std::fs::remove_file(path);
        let uds = tokio::net::UnixListener::bind(path)
            .with_context(|| format!("listen on {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
        let app = app.clone();
        tokio::spawn(api::serve::serve(
            api::serve::Listener::Unix(uds),
            app,
            gate.clone(),
            api::stdin_stream,
            shutdown_signal(),
        ));
        tracing::info!(socket = %path.display(), "also listening on unix socket");
    }
    api::serve::serve(
        api::serve::Listener::Tcp(tcp),
        app,
        gate,
        api::stdin_stream,
        shutdown_signal(),
    )
    .await;
    audit.flush().await;
    // Pooled sandboxes are nobody's: they go with a clean stop (the pool refills at the next start);
    // a crash leaves them to be re-adopted or trimmed then.
    if let Err(e) = services.pool.drain(&args.default_template).await {
        tracing::warn!("draining the warm pool: {e}");
    }
    if cgroups.remove_parent_if_empty() {
        tracing::debug!("removed the empty cgroup parent");
        // No sandbox is left to read through LXCFS: it goes too (the next start makes a new one).
        if let Some(l) = &lxcfs {
            l.stop();
        }
    }
    tracing::info!("stopped; sandboxes keep running and are re-adopted at the next start");
    Ok(())
}

/// LXCFS for the container tier's honest /proc (docs/resources.md), supervised: restarted when
/// its mount stops answering.
fn start_lxcfs(args: &ServeArgs) -> Result<Option<Arc<host::lxcfs::Lxcfs>>> {
    if args.lxcfs == "off" {
        return Ok(None);
    }
    let found = host::lxcfs::find().filter(|_| Path::new("/dev/fuse").exists());
    let Some(binary) = found else {
        if args.lxcfs == "on" {
            bail!("--lxcfs on: the lxcfs binary or /dev/fuse is missing (apt-get install lxcfs)");
        }
        tracing::warn!("lxcfs is not installed (apt-get install lxcfs): container sandboxes see the host's CPU and memory counts");
        return Ok(None);
    };
    for gone in host::lxcfs::sweep_orphans() {
        tracing::warn!(mount = %gone.display(), "swept the lxcfs of a data directory that is gone");
    }
    let name = host::cgroup::parent_for(&args.data_dir);
    let lxcfs = match host::lxcfs::Lxcfs::start(&binary, &args.data_dir, &name) {
        Ok(l) => Arc::new(l),
        Err(e) if args.lxcfs == "auto" => {
            tracing::warn!(
                "lxcfs: {e:#}; container sandboxes see the host's CPU and memory counts"
            );
            return Ok(None);
        }
        Err(e) => return Err(e),
    };
    let watched = lxcfs.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            let l = watched.clone();
            let _ = tokio::task::spawn_blocking(move || {
                if !l.healthy() {
                    tracing::warn!("lxcfs stopped answering; starting it again");
                    if let Err(e) = l.launch() {
                        tracing::error!("lxcfs: {e:#}");
                    }
                }
            })
            .await;
        }
    });
    Ok(Some(lxcfs))
}

/// Raises the daemon's soft open-file limit to its hard one: every connection, sandbox and proxied
/// connection holds descriptors, and the connection caps are taken from it.
fn raise_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            if let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!("raise the open-file limit from {soft} to {hard}: {e}");
            }
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Takes an exclusive lock on `<data_dir>/daemon.lock` for the daemon's lifetime (the kernel drops it
/// when the process dies, so a crash never leaves a stale lock).
fn lock_data_dir(dir: &Path) -> Result<std::fs::File> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let path = dir.join("daemon.lock");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("open {}", path.display()))?;
    // SAFETY: flock on a descriptor we own; no memory is involved.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut other = String::new();
        let _ = f.read_to_string(&mut other);
        bail!(
            "another moat daemon (pid {}) is using {}",
            other.trim(),
            dir.display()
        );
    }
    f.set_len(0)?;
    write!(f, "{}", std::process::id())?;
    Ok(f)
}

/// Reads the API key, creating it (0600) on first start.
pub fn load_or_create_api_key(path: &Path) -> Result<String> {
    match std::fs::read_to_string(path) {
        Ok(k) if !k.trim().is_empty() => return Ok(k.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    let mut b = [0u8; 24];
    rand::rngs::OsRng.fill_bytes(&mut b);
    let key = format!("moat_{}", hex::encode(b));
    write_private(path, &key)?;
    tracing::info!(path = %path.display(), "generated a new API key");
    Ok(key)
}

/// Writes `<data_dir>/e2b-api-key`: the API key in the form E2B's SDKs accept (`e2b_` + hex; some
/// releases refuse any other before sending it), for the E2B-compatible API. Rewritten at each
/// start, so it follows a changed API key.
pub fn write_e2b_api_key(data_dir: &Path, api_key: &str) -> Result<()> {
    let path = data_dir.join("e2b-api-key");
    let key = e2b::e2b_api_key(api_key);
    if std::fs::read_to_string(&path).is_ok_and(|k| k.trim() == key) {
        return Ok(());
    }
    write_private(&path, &key)
}

/// Writes `text` and a newline to `path`, readable by its owner only, atomically.
fn write_private(path: &Path, text: &str) -> Result<()> {
    let tmp = path.with_extension("tmp");
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("create {}", tmp.display()))?;
        writeln!(f, "{text}")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Finds the static agent binary and copies it, content-addressed, into `<data_dir>/bin`, so what
/// sandboxes bind-mount is root-owned and never changes under a running sandbox.
/// Where to look for the agent when `--agent` names none: beside the `moat` binary, the static
/// build `scripts/build-agent.sh` leaves in the same cargo target directory (a daemon started from
/// the build tree: cargo leaves a dynamically linked `moat-agent` beside it), then where
/// `scripts/setup.sh` installs it.
fn agent_candidates(exe: Option<&Path>) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(dir) = exe.and_then(Path::parent) {
        v.push(dir.join("moat-agent"));
        // <target>/<profile>/moat → <target>/x86_64-unknown-linux-gnu/<profile>/moat-agent
        if let (Some(profile), Some(target)) = (dir.file_name(), dir.parent()) {
            v.push(
                target
                    .join("x86_64-unknown-linux-gnu")
                    .join(profile)
                    .join("moat-agent"),
            );
        }
    }
    v.push(PathBuf::from("/usr/local/lib/moat/moat-agent"));
    v
}

/// The first candidate that is a static ELF binary, with its bytes; the error says what each
/// other one was and what to do.
fn pick_agent(candidates: &[PathBuf]) -> Result<(PathBuf, Vec<u8>)> {
    let mut skipped = Vec::new();
    for p in candidates {
        let mut bytes = Vec::new();
        match std::fs::File::open(p).and_then(|mut f| f.read_to_end(&mut bytes)) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                skipped.push(format!("{}: not there", p.display()))
            }
            Err(e) => skipped.push(format!("{}: {e}", p.display())),
            Ok(_) => match elf_has_interpreter(&bytes) {
                Ok(false) => return Ok((p.clone(), bytes)),
                Ok(true) => skipped.push(format!(
                    "{}: dynamically linked (sandboxes need a static one)",
                    p.display()
                )),
                Err(e) => skipped.push(format!("{}: {e:#}", p.display())),
            },
        }
    }
    bail!(
        "no static agent binary found ({}); build one with scripts/build-agent.sh (or run \
         scripts/setup.sh) and pass its path with --agent",
        skipped.join("; ")
    )
}

fn install_agent(args: &ServeArgs) -> Result<PathBuf> {
    let candidates = match &args.agent {
        Some(p) => vec![p.clone()],
        None => agent_candidates(std::env::current_exe().ok().as_deref()),
    };
    let (src, bytes) = pick_agent(&candidates)?;
    tracing::debug!(agent = %src.display(), "agent found");
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let dir = args.data_dir.join("bin");
    std::fs::create_dir_all(&dir)?;
    let dst = dir.join(format!("moat-agent-{}", &digest[..16]));
    if !dst.exists() {
        let tmp = dir.join(format!(".agent-{}", std::process::id()));
        std::fs::write(&tmp, &bytes)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, &dst)?;
    }
    tracing::info!(agent = %dst.display(), "agent installed");
    Ok(dst)
}

/// Whether an ELF64 file has a PT_INTERP program header (i.e. needs a dynamic loader).
fn elf_has_interpreter(b: &[u8]) -> Result<bool> {
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 {
        bail!("agent binary is not an ELF64 file");
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let phoff = u64::from_le_bytes(b[32..40].try_into()?) as usize;
    let (phentsize, phnum) = (u16_at(54), u16_at(56));
    for i in 0..phnum {
        let o = phoff + i * phentsize;
        if o + 4 > b.len() {
            bail!("truncated ELF program headers");
        }
        if u32::from_le_bytes(b[o..o + 4].try_into()?) == 3 {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The container tier starts each sandbox through a fresh, single-threaded copy of the `moat` binary
/// (`moat __sandbox-init ...`). Call this first thing in `main`, before any runtime or thread starts:
/// it returns `Some(exit_code)` when this process is such an init helper.
pub fn maybe_sandbox_init() -> Option<i32> {
    let mut args = std::env::args_os();
    if args.nth(1).as_deref() != Some(std::ffi::OsStr::new(tier::container::init::INIT_ARG)) {
        return None;
    }
    let config = args
        .next()
        .and_then(|a| a.into_string().ok())
        .unwrap_or_default();
    Some(tier::container::init::main(&config))
}

/// What follows a secret's placeholder headed where it does not belong (the proxy or resolver has
/// refused it already): an audit entry, and what the sandbox's policy asks (`on_secret_violation`):
/// nothing more, a pause, or a snapshot of its files named in the entry. At most one action per
/// sandbox every 10 s (a loop of attempts is one incident).
async fn act_on_violations(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(String, host::egress::intercept::Violation)>,
    services: sandboxes::Services,
    audit: Arc<audit::Audit>,
) {
    use moat_api::SecretViolation;
    // Keyed by the action too: a policy changed after an incident acts on the next one.
    let mut last: std::collections::HashMap<(String, SecretViolation), std::time::Instant> =
        Default::default();
    while let Some((id, v)) = rx.recv().await {
        let policy = services
            .sandboxes
            .get(&id)
            .ok()
            .and_then(|s| s.network)
            .map(|n| n.policy.on_secret_violation)
            .unwrap_or_default();
        let now = std::time::Instant::now();
        let repeat = last
            .get(&(id.clone(), policy))
            .is_some_and(|t| now.duration_since(*t) < std::time::Duration::from_secs(10));
        last.retain(|_, t| now.duration_since(*t) < std::time::Duration::from_secs(10));
        let mut detail = serde_json::json!({
            "secret": v.secret, "host": v.host, "place": v.place,
            "on_secret_violation": policy,
        });
        if !repeat {
            last.insert((id.clone(), policy), now);
            match policy {
                SecretViolation::Block => {}
                SecretViolation::BlockAndPause => match services.sandboxes.pause(&id).await {
                    Ok(_) => detail["paused"] = true.into(),
                    Err(e) => detail["error"] = format!("pause: {e}").into(),
                },
                SecretViolation::BlockAndKill => {
                    let why = format!(
                        "its policy (on_secret_violation: block_and_kill) ended it: the placeholder \
                         of secret {} headed to {} (in the {})",
                        v.secret, v.host, v.place
                    );
                    match services.sandboxes.end_by_policy(&id, why).await {
                        Ok(()) => detail["ended"] = true.into(),
                        Err(e) => detail["error"] = format!("end: {e}").into(),
                    }
                }
                SecretViolation::BlockAndSnapshot => {
                    let req = moat_api::CreateSnapshotRequest {
                        name: Some(format!(
                            "secret-violation-{}-{}",
                            id.trim_start_matches("sbx_").get(..8).unwrap_or("x"),
                            clock::now_ms()
                        )),
                        metadata: [
                            ("moat.reason".to_string(), "secret_violation".to_string()),
                            ("moat.secret".to_string(), v.secret.clone()),
                            ("moat.host".to_string(), v.host.clone()),
                        ]
                        .into(),
                        ..Default::default()
                    };
                    match services.snapshots.snapshot(&id, req).await {
                        Ok(s) => detail["snapshot"] = s.id.into(),
                        Err(e) => detail["error"] = format!("snapshot: {e}").into(),
                    }
                }
            }
        } else {
            detail["repeated"] = true.into();
        }
        audit
            .record(audit::NewEntry {
                at_ms: clock::now_ms(),
                actor: audit::DAEMON.into(),
                action: "secret.violation".into(),
                sandbox_id: Some(id),
                status: None,
                detail,
            })
            .await;
    }
}

/// Where the egress proxy and resolver find a slot's sandbox, policy and secrets: the database.
struct DbSlots(Arc<db::Db>, Arc<secrets::Vault>);

impl host::egress::PolicySource for DbSlots {
    fn by_slot(&self, slot: u32) -> Option<host::egress::SlotPolicy> {
        match self.0.network_by_slot(slot) {
            Ok(Some((sandbox_id, template, Some(policy)))) => Some(host::egress::SlotPolicy {
                secrets: self.1.for_proxy(&sandbox_id, &template),
                sandbox_id,
                template,
                policy,
            }),
            Ok(_) => None,
            Err(e) => {
                tracing::error!("egress: slot {slot}: {e:#}");
                None
            }
        }
    }
}

/// Binds a UDP socket and a TCP listener on one free port of all addresses (the resolver's); nftables
/// lets only sandboxes reach it.
async fn bind_dns() -> Result<(tokio::net::UdpSocket, tokio::net::TcpListener)> {
    for _ in 0..20 {
        let udp = tokio::net::UdpSocket::bind("0.0.0.0:0").await?;
        let port = udp.local_addr()?.port();
        if let Ok(tcp) = tokio::net::TcpListener::bind(("0.0.0.0", port)).await {
            return Ok((udp, tcp));
        }
    }
    bail!("no free port for the sandbox resolver (UDP and TCP)")
}

type NetworkAndEgress = (host::net::Network, Arc<host::egress::Egress>);

/// Sandbox networking as configured (`--network`, `--subnet`, `--uplink`, `--dns`), with the egress
/// resolver and proxy started.
async fn network_for(
    args: &config::ServeArgs,
    db: Arc<db::Db>,
    vault: Arc<secrets::Vault>,
    events: tokio::sync::mpsc::Sender<host::egress::Event>,
) -> Result<Option<NetworkAndEgress>> {
    if args.network == "none" {
        tracing::info!("sandbox networking off (--network none): sandboxes have loopback only");
        return Ok(None);
    }
    let dns = match args.dns {
        Some(d) => d,
        None => ["/etc/resolv.conf", "/run/systemd/resolve/resolv.conf"]
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .find_map(|t| host::net::upstream_dns(&t))
            .context(
                "no non-loopback nameserver in /etc/resolv.conf for sandbox DNS; pass --dns",
            )?,
    };
    let uplink = args
        .uplink
        .clone()
        .or_else(host::net::default_route_interface);
    let h = hex::encode(sha2::Sha256::digest(
        args.data_dir.as_os_str().as_encoded_bytes(),
    ));
    let net = host::net::Network::new(&h, &args.subnet, uplink.clone(), dns, tier::MAX_SLOTS)?
        .with_deny_files(args.deny_list.clone())?;
    let (dns_udp, dns_tcp) = bind_dns().await?;
    let proxy = tokio::net::TcpListener::bind("0.0.0.0:0").await?;
    let (dns_port, proxy_port) = (dns_udp.local_addr()?.port(), proxy.local_addr()?.port());
    let net = net.with_ports(dns_port, proxy_port);
    let egress = host::egress::Egress::new(
        net.subnet(),
        std::net::SocketAddr::new(dns.into(), 53),
        Arc::new(DbSlots(db, vault)),
        host::egress::DenyList {
            entries: net.deny_list()?,
        },
        events,
        host::egress::Limits {
            connections: args.max_connections_per_sandbox as usize,
            ..Default::default()
        },
    );
    egress.set_extra_roots(args.egress_ca_file.clone());
    tokio::spawn(host::egress::dns::serve_udp(dns_udp, egress.clone()));
    tokio::spawn(host::egress::dns::serve_tcp(dns_tcp, egress.clone()));
    tokio::spawn(host::egress::proxy::serve(proxy, egress.clone()));
    let nflog = host::egress::nflog::open(net.log_group())
        .context("the connection log's NFLOG socket (nfnetlink_log)")?;
    let e = egress.clone();
    std::thread::Builder::new()
        .name("nflog".into())
        .spawn(move || host::egress::nflog::read_loop(nflog, e))
        .context("start the NFLOG reader")?;
    tracing::info!(subnet = %args.subnet, uplink = ?uplink, %dns, dns_port, proxy_port, "sandbox networking: NAT, DNS and TCP through the daemon");
    Ok(Some((net, egress)))
}

/// Reloads the daemon-wide deny list when one of its files changes (size or modification time,
/// checked every 2 s: a threat feed can be large, so it is read only when it changed) or on SIGHUP.
/// A file that no longer parses is logged and the list in force stays as it was.
async fn watch_deny_list(net: host::net::Network, egress: Arc<host::egress::Egress>) {
    type Stamp = Option<(u64, Option<std::time::SystemTime>)>;
    let read = |net: &host::net::Network| -> Vec<Stamp> {
        net.deny_files()
            .iter()
            .map(|f| {
                std::fs::metadata(f)
                    .ok()
                    .map(|m| (m.len(), m.modified().ok()))
            })
            .collect()
    };
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler: the deny list reloads on change only");
            None
        }
    };
    let mut seen = read(&net);
    loop {
        let forced = tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(2)) => false,
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => None } } => true,
        };
        let now = read(&net);
        if !forced && now == seen {
            continue;
        }
        seen = now;
        let n = net.clone();
        match tokio::task::spawn_blocking(move || n.reload_deny_list()).await {
            Ok(Ok(entries)) => {
                tracing::info!(entries = entries.len(), "deny list reloaded");
                egress.set_deny_list(host::egress::DenyList { entries });
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "deny list not reloaded; the previous one stays in force")
            }
            Err(e) => tracing::warn!(error = %e, "deny list reload failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_is_created_once() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("api-key");
        let a = load_or_create_api_key(&p).unwrap();
        let b = load_or_create_api_key(&p).unwrap();
        assert_eq!(a, b);
        assert!(a.starts_with("moat_") && a.len() == 53);
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn the_e2b_form_of_the_key_is_written_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let key = load_or_create_api_key(&dir.path().join("api-key")).unwrap();
        write_e2b_api_key(dir.path(), &key).unwrap();
        let p = dir.path().join("e2b-api-key");
        let e2b = std::fs::read_to_string(&p).unwrap();
        assert_eq!(e2b.trim(), format!("e2b_{}", &key["moat_".len()..]));
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }

    #[test]
    fn second_daemon_on_a_data_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_data_dir(dir.path()).unwrap();
        let err = lock_data_dir(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        lock_data_dir(dir.path()).unwrap();
    }

    #[test]
    fn own_binary_is_dynamic() {
        let exe = std::fs::read("/proc/self/exe").unwrap();
        // The test binary is linked dynamically against glibc.
        assert!(elf_has_interpreter(&exe).unwrap());
        assert!(elf_has_interpreter(b"not an elf").is_err());
    }

    #[test]
    fn a_daemon_in_the_build_tree_finds_the_static_agent_and_skips_the_dynamic_one() {
        let c = agent_candidates(Some(Path::new("/src/moat/target/debug/moat")));
        assert_eq!(
            c,
            [
                PathBuf::from("/src/moat/target/debug/moat-agent"),
                PathBuf::from("/src/moat/target/x86_64-unknown-linux-gnu/debug/moat-agent"),
                PathBuf::from("/usr/local/lib/moat/moat-agent"),
            ]
        );
        let dir = tempfile::tempdir().unwrap();
        // A dynamic one beside the daemon (as cargo leaves it), a static one further on: an ELF64
        // header whose program headers hold no PT_INTERP.
        let dynamic = dir.path().join("moat-agent");
        std::fs::copy("/proc/self/exe", &dynamic).unwrap();
        let mut header = vec![0u8; 64];
        header[..5].copy_from_slice(b"\x7fELF\x02");
        let static_one = dir.path().join("static-agent");
        std::fs::write(&static_one, &header).unwrap();
        let missing = dir.path().join("missing");
        let (found, _) =
            pick_agent(&[missing.clone(), dynamic.clone(), static_one.clone()]).unwrap();
        assert_eq!(found, static_one);
        let err = format!("{:#}", pick_agent(&[missing, dynamic]).unwrap_err());
        assert!(err.contains("not there"), "{err}");
        assert!(err.contains("dynamically linked"), "{err}");
        assert!(err.contains("scripts/build-agent.sh"), "{err}");
    }
}
