//! Scenario 9: what sandbox networking costs — on create, and per connection and per byte through the
//! daemon's TCP proxy — against a plain network namespace (veth, routing and NAT, no proxy) and the
//! host itself, in a topology of network namespaces the bench makes (network safety rules: nothing
//! leaves this machine).

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use moat_api::{CreateSandboxRequest, StartProcessRequest};
use moat_client::Client;

use super::{progress, Ctx};
use crate::daemon::{self, Daemon};
use crate::moat::{self, COLD_TEMPLATE, TEMPLATE};
use crate::report::{self, Row, Section};

pub const TITLE: &str = "9. Network: create with networking, and connections through the proxy";
pub const INTRO: &str =
    "The bench makes three network namespaces: an \"internet\" holding its servers \
     (198.51.100.1: an echo server, a sink and a source, Python threads), a \"host\" whose only uplink \
     is a veth to it, where a second moat daemon runs with `--network nat` (every sandbox TCP \
     connection goes through the daemon's proxy, which looks up the sandbox's policy and logs the \
     connection), and a \"direct\" namespace with a veth to the host and plain routing + NAT, no \
     proxy — what a sandbox's connection costs without moat's proxy. The same Python client \
     (`python3 -c`, timing inside itself) runs in a moat sandbox (the `base` template), in the direct \
     namespace and in the host namespace (the floor: no veth, no NAT). *connect*: connect, send a \
     line, read it back, close; *round trip*: a line back and forth on one open connection; \
     *upload*/*download*: a stream of bytes to a sink / from a source, until the last byte is \
     acknowledged. Rows interleaved; the create rows compare the networked daemon (no pool) with the \
     bench's own `--network none` daemon (cold template).";

const CLIENT: &str = r#"
import json, socket, sys, time
mode, host, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
out = []
def conn():
    s = socket.create_connection((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s
if mode == "connect":
    for _ in range(n):
        t = time.perf_counter_ns(); s = conn(); s.sendall(b"ping\n"); assert s.recv(64); s.close()
        out.append(time.perf_counter_ns() - t)
elif mode == "rtt":
    s = conn(); s.sendall(b"ping\n"); s.recv(64)
    for _ in range(n):
        t = time.perf_counter_ns(); s.sendall(b"ping\n"); assert s.recv(64)
        out.append(time.perf_counter_ns() - t)
    s.close()
elif mode == "upload":
    buf = bytes(1 << 16); t = time.perf_counter_ns(); s = conn(); left = n
    while left > 0:
        k = min(left, len(buf)); s.sendall(buf[:k]); left -= k
    s.shutdown(socket.SHUT_WR); got = int(s.recv(64)); s.close()
    assert got == n, got
    out.append(time.perf_counter_ns() - t)
elif mode == "download":
    t = time.perf_counter_ns(); s = conn(); s.sendall(b"%d\n" % n); got = 0
    while True:
        b = s.recv(1 << 16)
        if not b: break
        got += len(b)
    assert got == n, got
    out.append(time.perf_counter_ns() - t)
print(json.dumps(out))
"#;

const SERVERS: &str = r#"
import socket, threading
def serve(port, h):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("198.51.100.1", port)); s.listen(256)
    def loop():
        while True:
            c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=h, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
def echo(c):
    while True:
        b = c.recv(4096)
        if not b: break
        c.sendall(b)
    c.close()
def sink(c):
    n = 0
    while True:
        b = c.recv(1 << 16)
        if not b: break
        n += len(b)
    c.sendall(str(n).encode()); c.close()
def source(c):
    n = int(c.recv(64)); buf = bytes(1 << 16)
    while n > 0:
        k = min(n, len(buf)); c.sendall(buf[:k]); n -= k
    c.close()
serve(9001, echo); serve(9000, sink); serve(9002, source)
threading.Event().wait()
"#;

const INTERNET: &str = "198.51.100.1";

/// The namespaces and servers; removed on drop.
struct Topology {
    host: String,
    internet: String,
    direct: String,
    servers: Option<Child>,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

fn in_ns(ns: &str, argv: &[&str]) -> Command {
    let mut c = Command::new("nsenter");
    c.arg(format!("--net=/run/netns/{ns}")).args(argv);
    c
}

impl Topology {
    fn new() -> Result<Topology> {
        let tag = std::process::id() % 100_000;
        let t = Topology {
            host: format!("mbn{tag}h"),
            internet: format!("mbn{tag}i"),
            direct: format!("mbn{tag}d"),
            servers: None,
        };
        let (h, i, d) = (&t.host, &t.internet, &t.direct);
        for ns in [h, i, d] {
            ip(&["netns", "add", ns])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        let (hi, ih, hd, dh) = (
            format!("mbn{tag}a"),
            format!("mbn{tag}b"),
            format!("mbn{tag}c"),
            format!("mbn{tag}e"),
        );
        ip(&[
            "link", "add", &hi, "netns", h, "type", "veth", "peer", "name", &ih, "netns", i,
        ])?;
        ip(&[
            "link", "add", &hd, "netns", h, "type", "veth", "peer", "name", &dh, "netns", d,
        ])?;
        for (ns, cmd) in [
            (h, vec!["addr", "add", "198.51.100.2/24", "dev", &hi]),
            (h, vec!["link", "set", &hi, "up"]),
            (h, vec!["route", "add", "default", "via", INTERNET]),
            (h, vec!["addr", "add", "10.250.0.1/30", "dev", &hd]),
            (h, vec!["link", "set", &hd, "up"]),
            (i, vec!["addr", "add", "198.51.100.1/24", "dev", &ih]),
            (i, vec!["link", "set", &ih, "up"]),
            (d, vec!["addr", "add", "10.250.0.2/30", "dev", &dh]),
            (d, vec!["link", "set", &dh, "up"]),
            (d, vec!["route", "add", "default", "via", "10.250.0.1"]),
        ] {
            let mut args = vec!["-n", ns.as_str()];
            args.extend(cmd);
            ip(&args)?;
        }
        // The direct namespace: routed and NATed by the (test-made) host namespace, as a sandbox's
        // UDP is.
        let nat = format!(
            "table ip mbn_direct {{\n chain post {{\n  type nat hook postrouting priority srcnat;\n  \
             iifname \"{hd}\" oifname \"{hi}\" masquerade\n }}\n}}\n"
        );
        let mut nft = in_ns(h, &["nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .context("nft")?;
        std::io::Write::write_all(nft.stdin.as_mut().context("nft stdin")?, nat.as_bytes())?;
        drop(nft.stdin.take());
        if !nft.wait()?.success() {
            bail!("nft in the host namespace failed");
        }
        let st = in_ns(h, &["sysctl", "-qw", "net.ipv4.ip_forward=1"])
            .status()
            .context("sysctl")?;
        if !st.success() {
            bail!("enabling forwarding in the host namespace failed");
        }
        Ok(t)
    }

    fn start_servers(&mut self) -> Result<()> {
        let child = in_ns(&self.internet, &["python3", "-c", SERVERS])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start the servers (python3)")?;
        self.servers = Some(child);
        for _ in 0..100 {
            if client_in(&self.host, "connect", 1).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("the bench's servers did not come up")
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Some(c) = self.servers.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in [&self.host, &self.internet, &self.direct] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn port_of(mode: &str) -> &'static str {
    match mode {
        "upload" => "9000",
        "download" => "9002",
        _ => "9001",
    }
}

fn parse_samples(stdout: &str) -> Result<Vec<Duration>> {
    let v: Vec<u64> =
        serde_json::from_str(stdout.trim()).with_context(|| format!("client output {stdout:?}"))?;
    Ok(v.into_iter().map(Duration::from_nanos).collect())
}

/// Runs the client in network namespace `ns` (on the host's Python).
fn client_in(ns: &str, mode: &str, n: usize) -> Result<Vec<Duration>> {
    let n = n.to_string();
    let out = in_ns(
        ns,
        &["python3", "-c", CLIENT, mode, INTERNET, port_of(mode), &n],
    )
    .output()
    .context("run the client")?;
    if !out.status.success() {
        bail!("client: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    parse_samples(&String::from_utf8_lossy(&out.stdout))
}

/// Runs the client in a moat sandbox.
async fn client_in_sandbox(c: &Client, id: &str, mode: &str, n: usize) -> Result<Vec<Duration>> {
    let req = StartProcessRequest {
        cmd: Some(vec![
            "python3".into(),
            "-c".into(),
            CLIENT.into(),
            mode.into(),
            INTERNET.into(),
            port_of(mode).into(),
            n.to_string(),
        ]),
        ..Default::default()
    };
    let (code, stdout, stderr) = moat::run_collect(c, id, req).await?;
    if code != Some(0) {
        bail!("client in the sandbox exited {code:?}: {stderr}");
    }
    parse_samples(&stdout)
}

pub async fn run(ctx: &Ctx<'_>, section: &mut Section) -> Result<()> {
    let mut topo = Topology::new()?;
    topo.start_servers()?;
    let data_dir = ctx.data_dir.with_file_name(format!(
        "{}-network",
        ctx.data_dir
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("moat-bench")
    ));
    let (mut d, c) = Daemon::start_in(
        &ctx.moat_bin,
        &ctx.agent,
        &data_dir,
        Duration::from_secs(30),
        &[
            "--network",
            "nat",
            "--dns",
            INTERNET,
            "--subnet",
            "10.203.0.0/16",
            "--pool-size",
            "0",
            "--uid-base",
            "3200000000",
        ],
        Some(&topo.host),
    )
    .await?;
    let r = measure(ctx, &c, &topo, section).await;
    for s in c
        .list_sandboxes(&Default::default())
        .await
        .unwrap_or_default()
    {
        let _ = c.delete_sandbox(&s.id).await;
    }
    d.stop();
    r
}

async fn measure(ctx: &Ctx<'_>, c: &Client, topo: &Topology, section: &mut Section) -> Result<()> {
    daemon::ensure_template(c, TEMPLATE, Some(&ctx.rootfs)).await?;
    let runs = ctx.scale.runs.min(if ctx.quick { 3 } else { 20 });
    let bytes = if ctx.quick { 2 << 20 } else { 100 << 20 };
    let (connects, rtts) = if ctx.quick { (10, 20) } else { (50, 200) };

    // Create with and without networking.
    let mut create = vec![
        Row::new(
            "**moat** create → exit of `true`, `--network nat` (cold)",
            "veth pair, /30, nft chain, DNS and TCP through the daemon",
        ),
        Row::new(
            "moat create → exit of `true`, `--network none` (cold)",
            "loopback only",
        ),
    ];
    eprintln!("scenario 9: create with networking, {runs} runs per row (+1 warm-up)");
    let none = ctx.cleanup;
    for i in 0..=runs {
        let t = std::time::Instant::now();
        let s = c
            .create_sandbox(&CreateSandboxRequest {
                template: Some(TEMPLATE.into()),
                timeout: Some(300),
                ..Default::default()
            })
            .await?;
        moat::run_true(c, &s.id).await?;
        let took = t.elapsed();
        c.delete_sandbox(&s.id).await?;
        let (_, without, _) = moat::cold_once(ctx.client, COLD_TEMPLATE, none).await?;
        if i > 0 {
            create[0].samples.push(took);
            create[1].samples.push(without);
        }
        progress(i, runs);
    }
    section.push("**Create**");
    section.push(report::table(&create, 0));

    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some(TEMPLATE.into()),
            timeout: Some(1800),
            ..Default::default()
        })
        .await?;
    let mb = bytes >> 20;
    for (mode, n, what) in [
        (
            "connect",
            connects,
            "connect, a line each way, close (per connection)",
        ),
        (
            "rtt",
            rtts,
            "a line each way on an open connection (per round trip)",
        ),
        (
            "upload",
            bytes,
            &*format!("upload {mb} MiB (sandbox → server)"),
        ),
        (
            "download",
            bytes,
            &*format!("download {mb} MiB (server → sandbox)"),
        ),
    ] {
        let mut rows = vec![
            Row::new(
                format!("**moat sandbox** (through the proxy): {what}"),
                "moat sandbox, `--network nat`",
            ),
            Row::new(
                format!("plain netns, veth + NAT, no proxy: {what}"),
                "network namespace only",
            ),
            Row::new(format!("host namespace (floor): {what}"), "none"),
        ];
        eprintln!("scenario 9: {mode}, {runs} runs per row");
        for i in 0..runs {
            let sandbox = client_in_sandbox(c, &sbx.id, mode, n).await?;
            let direct = tokio::task::block_in_place(|| client_in(&topo.direct, mode, n))?;
            let host = tokio::task::block_in_place(|| client_in(&topo.host, mode, n))?;
            rows[0].samples.extend(sandbox);
            rows[1].samples.extend(direct);
            rows[2].samples.extend(host);
            progress(i + 1, runs);
        }
        section.push(format!("**{what}**"));
        section.push(report::table(&rows, 0));
    }
    c.delete_sandbox(&sbx.id).await?;
    Ok(())
}
