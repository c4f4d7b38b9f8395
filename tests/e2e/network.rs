//! Sandbox networking and the egress policy, in a topology this test makes out of network namespaces
//! (network safety rules): the daemon runs in a "host" namespace whose only uplink is a veth to an
//! "internet" namespace holding the test's own HTTP servers (on a public-looking address, on a private
//! address and on the cloud-metadata address) and its own DNS server. Nothing leaves this machine.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use moat_api::{CreateSandboxRequest, ErrorCode, NetworkPolicy};
use moat_client::Client;

use crate::harness::*;

const INTERNET: &str = "198.51.100.1";
const HOST_UPLINK: &str = "198.51.100.2";
const PRIVATE: &str = "10.99.0.1";
const METADATA: &str = "169.254.169.254";

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

struct Topology {
    host: String,
    internet: String,
    servers: Vec<Child>,
}

impl Topology {
    fn new(dir: &Path) -> Topology {
        let r = &next_uid_base()[..4];
        let tag = format!("{r}{}", std::process::id() % 10_000);
        let host = format!("mtt{tag}h");
        let internet = format!("mtt{tag}i");
        let (a, b) = (format!("mtt{tag}a"), format!("mtt{tag}b"));
        let mut t = Topology {
            host: host.clone(),
            internet: internet.clone(),
            servers: Vec::new(),
        };
        ip(&["netns", "add", &host]);
        ip(&["netns", "add", &internet]);
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b]);
        ip(&["link", "set", &a, "netns", &host]);
        ip(&["link", "set", &b, "netns", &internet]);
        for (ns, cmds) in [
            (
                &host,
                vec![
                    vec!["addr", "add", "198.51.100.2/24", "dev", &a],
                    vec!["link", "set", &a, "up"],
                    vec!["link", "set", "lo", "up"],
                    vec!["route", "add", "default", "via", INTERNET],
                ],
            ),
            (
                &internet,
                vec![
                    vec!["addr", "add", "198.51.100.1/24", "dev", &b],
                    vec!["addr", "add", "10.99.0.1/32", "dev", &b],
                    vec!["addr", "add", "169.254.169.254/32", "dev", &b],
                    vec!["link", "set", &b, "up"],
                    vec!["link", "set", "lo", "up"],
                ],
            ),
        ] {
            for c in cmds {
                let mut args = vec!["-n", ns.as_str()];
                args.extend(c);
                ip(&args);
            }
        }
        let www = dir.join("www");
        std::fs::create_dir_all(&www).unwrap();
        std::fs::write(www.join("index.html"), "hello").unwrap();
        let spawn = |ns: &str, argv: &[&str]| -> Child {
            Command::new("ip")
                .args(["netns", "exec", ns])
                .args(argv)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start a test server")
        };
        let www = www.display().to_string();
        t.servers.push(spawn(
            &internet,
            &[
                "python3",
                "-m",
                "http.server",
                "8080",
                "--bind",
                "0.0.0.0",
                "--directory",
                &www,
            ],
        ));
        t.servers.push(spawn(
            &internet,
            &[
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--conf-file=/dev/null",
                "--user=root",
                "--listen-address=198.51.100.1",
                "--bind-interfaces",
                "--address=/test.example/198.51.100.1",
            ],
        ));
        // A sink: reads 3 MB, answers how much it got.
        t.servers.push(spawn(
            &internet,
            &[
                "python3",
                "-c",
                "import socket, threading\n\
                 s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                 s.bind(('0.0.0.0', 9000)); s.listen(64)\n\
                 def h(c):\n    n = 0\n    while n < 3000000:\n        b = c.recv(65536)\n        if not b: break\n        n += len(b)\n    c.sendall(str(n).encode()); c.close()\n\
                 while True:\n    c, _ = s.accept(); threading.Thread(target=h, args=(c,)).start()\n",
            ],
        ));
        // A server on the "host" itself, which sandboxes must not reach.
        t.servers.push(spawn(
            &host,
            &[
                "python3",
                "-m",
                "http.server",
                "8081",
                "--bind",
                "0.0.0.0",
                "--directory",
                &www,
            ],
        ));
        for url in [
            format!("http://{INTERNET}:8080/"),
            format!("http://{PRIVATE}:8080/"),
            format!("http://{HOST_UPLINK}:8081/"),
        ] {
            assert!(
                t.curl_from_host(&url).as_deref() == Some("hello"),
                "test server {url} did not come up"
            );
        }
        t
    }

    /// GET from the "host" namespace itself (proves a server is up, so a failure from a sandbox means
    /// the policy and not a dead server).
    fn curl_from_host(&self, url: &str) -> Option<String> {
        for _ in 0..50 {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.host, "curl", "-s", "-m", "2", url])
                .output()
                .unwrap();
            if out.status.success() {
                return Some(String::from_utf8_lossy(&out.stdout).into_owned());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }

    /// `ip -o addr` of the "host" namespace.
    fn host_interfaces(&self) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.host, "-o", "addr"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for c in &mut self.servers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.host])
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.internet])
            .status();
    }
}

/// An HTTP GET from inside a sandbox (busybox nc: the static busybox's wget crashes without NSS
/// libraries): Some(body) when the server answered, None when the connection failed.
async fn fetch(c: &Client, id: &str, url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://").expect("http URL");
    let (hostport, path) = rest.split_once('/').unwrap_or((rest, ""));
    let (host, port) = hostport.split_once(':').unwrap_or((hostport, "80"));
    let out = sh(
        c,
        id,
        &format!("printf 'GET /{path} HTTP/1.0\\r\\n\\r\\n' | busybox nc -w 3 {host} {port}"),
    )
    .await;
    let (head, body) = out.stdout.split_once("\r\n\r\n")?;
    (out.exit.exit_code == Some(0) && head.starts_with("HTTP/1.") && head.contains(" 200 "))
        .then(|| body.to_string())
}

async fn create_bb(c: &Client, network: Option<NetworkPolicy>) -> moat_api::Sandbox {
    c.create_sandbox(&CreateSandboxRequest {
        template: Some("bb".into()),
        timeout: Some(300),
        network,
        ..Default::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn egress_policy_in_a_test_made_network() {
    let tmp = tempfile::tempdir().unwrap();
    let topo = Topology::new(tmp.path());
    let rootfs = busybox_rootfs(tmp.path());
    let deny_file = tmp.path().join("deny.txt");
    std::fs::write(&deny_file, "# known-bad destinations\n").unwrap();
    let d = Daemon::start_in_netns(
        &tmp.path().join("data"),
        &topo.host,
        &[
            "--deny-list",
            deny_file.to_str().unwrap(),
            "--network",
            "nat",
            "--dns",
            INTERNET,
            "--subnet",
            "10.201.0.0/16",
            "--pool-size",
            "0",
        ],
    );
    let c = d.client();
    register_bb(&c, &rootfs).await;

    // Default policy: the public internet, nothing else.
    let a = create_bb(&c, None).await;
    let net = a.network.clone().expect("a network");
    assert!(net.ip.starts_with("10.201."), "{net:?}");
    assert!(net.policy.allow_internet);
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{INTERNET}:8080/"))
            .await
            .as_deref(),
        Some("hello")
    );
    // The daemon-wide deny list is reloaded when its file changes and beats the sandbox's policy;
    // a malformed file leaves the list in force as it was.
    let hello = format!("http://{INTERNET}:8080/");
    let reachable = |want: bool| {
        let (c, id, url) = (&c, a.id.clone(), hello.clone());
        async move {
            for _ in 0..20 {
                if fetch(c, &id, &url).await.is_some() == want {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            false
        }
    };
    std::fs::write(
        &deny_file,
        format!("# known-bad destinations\n{INTERNET}/32\n"),
    )
    .unwrap();
    assert!(reachable(false).await, "a denied address stayed reachable");
    std::fs::write(&deny_file, "not an address\n").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        reachable(false).await,
        "a malformed deny list dropped the old one"
    );
    std::fs::write(&deny_file, "# emptied\n").unwrap();
    assert!(
        reachable(true).await,
        "the deny list's entry outlived its removal"
    );
    // DNS goes to the daemon's resolver whatever server the sandbox asks (here 203.0.113.53, a
    // documentation address no server of the test holds).
    let out = sh(
        &c,
        &a.id,
        "busybox nslookup test.example; busybox nslookup test.example 203.0.113.53",
    )
    .await;
    assert!(out.stdout.matches("198.51.100.1").count() >= 2, "{out:?}");
    for blocked in [
        format!("http://{PRIVATE}:8080/"),
        format!("http://{METADATA}:8080/"),
        format!("http://{HOST_UPLINK}:8081/"),
        format!("http://{}:8081/", net.gateway),
    ] {
        assert_eq!(
            fetch(&c, &a.id, &blocked).await,
            None,
            "{blocked} was reachable"
        );
    }
    // No IPv6 beyond loopback and link-local: nothing routes it.
    let v6 = sh(&c, &a.id, "cat /proc/net/if_inet6").await.stdout;
    assert!(
        v6.lines()
            .all(|l| l.split_whitespace().nth(3) != Some("00")),
        "a global IPv6 address: {v6}"
    );

    // Another sandbox is out of reach, though it serves (its own loopback proves it).
    let b = create_bb(&c, None).await;
    c.start_process_background(
        &b.id,
        &moat_api::StartProcessRequest {
            command: Some("busybox httpd -f -p 8000 -h /etc".into()),
            background: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(fetch(&c, &b.id, "http://127.0.0.1:8000/passwd")
        .await
        .is_some());
    let b_ip = b.network.clone().unwrap().ip;
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{b_ip}:8000/passwd")).await,
        None
    );

    // Internet off, one private address allowed.
    let p = create_bb(
        &c,
        Some(NetworkPolicy {
            allow_internet: false,
            allow_out: vec![format!("{PRIVATE}/32")],
            deny_out: vec![],
            ..Default::default()
        }),
    )
    .await;
    assert_eq!(
        fetch(&c, &p.id, &format!("http://{INTERNET}:8080/")).await,
        None
    );
    assert_eq!(
        fetch(&c, &p.id, &format!("http://{PRIVATE}:8080/"))
            .await
            .as_deref(),
        Some("hello")
    );
    // The metadata address stays out of reach even when allowed.
    c.set_network(
        &p.id,
        &NetworkPolicy {
            allow_internet: false,
            allow_out: vec![METADATA.into()],
            deny_out: vec![],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        fetch(&c, &p.id, &format!("http://{METADATA}:8080/")).await,
        None
    );

    // Live changes: deny the test internet, then allow one address of it (allow beats deny).
    c.set_network(
        &a.id,
        &NetworkPolicy {
            allow_internet: true,
            allow_out: vec![],
            deny_out: vec!["198.51.100.0/24".into()],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{INTERNET}:8080/")).await,
        None
    );
    let info = c
        .set_network(
            &a.id,
            &NetworkPolicy {
                allow_internet: true,
                allow_out: vec![INTERNET.into()],
                deny_out: vec!["198.51.100.0/24".into()],
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(info.policy.allow_out, vec![INTERNET.to_string()]);
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{INTERNET}:8080/"))
            .await
            .as_deref(),
        Some("hello")
    );
    assert_eq!(c.get_network(&a.id).await.unwrap(), info);

    // Bad entries name themselves.
    match c
        .set_network(
            &a.id,
            &NetworkPolicy {
                allow_out: vec!["10.0.0.1".into(), "example.com".into()],
                ..Default::default()
            },
        )
        .await
    {
        Err(moat_client::Error::Api { status, body }) => {
            assert_eq!(status, 400);
            assert_eq!(body.error.code, ErrorCode::InvalidArgument);
            assert_eq!(body.error.field.as_deref(), Some("network.allow_out[1]"));
        }
        other => panic!("expected a 400, got {other:?}"),
    }

    // The rules survive a daemon crash and restart (sandboxes stay confined meanwhile).
    d.kill9();
    d.restart();
    let c = d.client();
    assert_eq!(
        fetch(&c, &p.id, &format!("http://{INTERNET}:8080/")).await,
        None
    );
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{INTERNET}:8080/"))
            .await
            .as_deref(),
        Some("hello")
    );

    // Bandwidth and connection-rate limits, set live.
    let upload = "head -c 3000000 /dev/zero | busybox nc -w 30 198.51.100.1 9000";
    let started = std::time::Instant::now();
    assert_eq!(sh(&c, &a.id, upload).await.stdout, "3000000");
    let unlimited = started.elapsed();
    c.set_network(
        &a.id,
        &NetworkPolicy {
            egress_mbps: Some(4),
            connections_per_second: Some(1),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let started = std::time::Instant::now();
    assert_eq!(sh(&c, &a.id, upload).await.stdout, "3000000");
    let limited = started.elapsed();
    // 3 MB at 4 Mbit/s (500 kB/s) takes about 6 s (nearer 4 s with the burst and segmentation
    // offload); only a lower bound with a wide margin is asserted, so a slow machine cannot fail it.
    assert!(
        limited >= Duration::from_secs(2),
        "4 Mbit/s cap: 3 MB took {limited:?} (unlimited: {unlimited:?})"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let burst = sh(
        &c,
        &a.id,
        &format!(
            "for i in 1 2 3 4 5 6; do (printf 'GET / HTTP/1.0\\r\\n\\r\\n' | \
             busybox nc -w 2 {INTERNET} 8080 | grep -q hello && echo ok) & done; wait"
        ),
    )
    .await;
    let ok = burst.stdout.lines().filter(|l| *l == "ok").count();
    assert!(
        (1..=3).contains(&ok),
        "{ok} of 6 quick connections at 1/s got through"
    );
    assert!(
        sh(&c, &a.id, "busybox nc -w 1 198.51.100.1 9 </dev/null")
            .await
            .exit
            .exit_code
            != Some(0)
    );

    // Deleting the sandboxes removes their host interfaces.
    for s in [&a.id, &b.id, &p.id] {
        c.delete_sandbox(s).await.unwrap();
    }
    let links = topo.host_interfaces();
    assert!(links.contains(HOST_UPLINK), "{links}");
    assert!(
        !links.contains("10.201."),
        "leftover sandbox interfaces: {links}"
    );
    d.stop();
}

#[tokio::test(flavor = "multi_thread")]
async fn network_flags_refused_without_networking() {
    let c = shared_client();
    match c
        .create_sandbox(&CreateSandboxRequest {
            network: Some(NetworkPolicy::default()),
            ..Default::default()
        })
        .await
    {
        Err(moat_client::Error::Api { status, body }) => {
            assert_eq!(
                (status, body.error.field.as_deref()),
                (400, Some("network"))
            );
        }
        other => panic!("expected a 400, got {other:?}"),
    }
    let s = create(&c, "base").await;
    assert!(s.network.is_none());
    assert_eq!(
        c.get_network(&s.id).await.unwrap_err().code(),
        Some(ErrorCode::Conflict)
    );
    // Loopback only.
    let out = sh(&c, &s.id, "ls /sys/class/net").await;
    assert_eq!(out.stdout.trim(), "lo", "{out:?}");
    c.delete_sandbox(&s.id).await.unwrap();
}
