//! The network tests' topology, made of network namespaces (network safety rules): the daemon runs in
//! a "host" namespace whose only uplink is a veth to an "internet" namespace holding the test's own
//! HTTP servers (on a public-looking address, on a private address and on the cloud-metadata
//! address; `<dir>/www` is served at `http://198.51.100.1:8080/`), HTTPS servers and DNS server.
//! Nothing leaves this machine.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use moat_client::Client;

use crate::harness::*;

pub const INTERNET: &str = "198.51.100.1";
pub const HOST_UPLINK: &str = "198.51.100.2";
pub const PRIVATE: &str = "10.99.0.1";
pub const METADATA: &str = "169.254.169.254";
/// A second server of the test's "internet", the one the domain tests treat as hostile.
pub const EVIL: &str = "198.51.100.3";

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub struct Topology {
    pub host: String,
    pub internet: String,
    pub servers: Vec<Child>,
}

impl Topology {
    pub fn new(dir: &Path) -> Topology {
        // A tag of this topology's own (namespaces and links are named after it).
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let r = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 10_000;
        let tag = format!("{r:04}{}", std::process::id() % 10_000);
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
                    vec!["addr", "add", "198.51.100.3/32", "dev", &b],
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
        let dnsmasq_log = dir.join("dnsmasq.log");
        let start_dnsmasq = || -> Child {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&dnsmasq_log)
                .unwrap();
            Command::new("ip")
                .args(["netns", "exec", &internet])
                .args([
                    "dnsmasq",
                    "--keep-in-foreground",
                    "--no-resolv",
                    "--no-hosts",
                    "--conf-file=/dev/null",
                    // No pid file: several tests run their own dnsmasq at once.
                    "--pid-file=",
                    "--user=root",
                    "--listen-address=198.51.100.1",
                    "--bind-interfaces",
                    // Every query in the log: what a sandbox made the daemon ask upstream.
                    "--log-queries",
                    "--log-facility=-",
                    "--address=/test.example/198.51.100.1",
                    "--address=/good.example/198.51.100.1",
                    "--address=/also.example/198.51.100.1",
                    "--address=/evil.example/198.51.100.3",
                    // A public name that points inside (DNS rebinding): the proxy must refuse it.
                    "--address=/inside.example/10.99.0.1",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start dnsmasq")
        };
        t.servers.push(start_dnsmasq());
        // HTTPS: good.example and also.example on one address (the certificate chosen by SNI),
        // evil.example on another; each certificate names only its own host.
        let certs = dir.join("certs");
        std::fs::create_dir_all(&certs).unwrap();
        for name in ["good.example", "also.example", "evil.example"] {
            let out = Command::new("openssl")
                .args([
                    "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                ])
                .args(["-subj", &format!("/CN={name}")])
                .args(["-addext", &format!("subjectAltName=DNS:{name}")])
                .arg("-keyout")
                .arg(certs.join(format!("{name}.key")))
                .arg("-out")
                .arg(certs.join(format!("{name}.crt")))
                .output()
                .expect("openssl");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let tls_server = format!(
            "import socket, ssl, sys, threading\n\
             d = '{certs}'\n\
             def ctx(n):\n    c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); c.load_cert_chain(f'{{d}}/{{n}}.crt', f'{{d}}/{{n}}.key'); return c\n\
             names = sys.argv[2:]; ctxs = {{n: ctx(n) for n in names}}; main = ctxs[names[0]]\n\
             def pick(sock, name, _):\n    if name in ctxs: sock.context = ctxs[name]\n\
             main.sni_callback = pick\n\
             s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
             s.bind((sys.argv[1], 443)); s.listen(64)\n\
             def h(c):\n    try:\n        t = main.wrap_socket(c, server_side=True); t.recv(4096); t.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\nhello'); t.close()\n    except Exception:\n        c.close()\n\
             while True:\n    c, _ = s.accept(); threading.Thread(target=h, args=(c,)).start()\n",
            certs = certs.display()
        );
        t.servers.push(spawn(
            &internet,
            &[
                "python3",
                "-c",
                &tls_server,
                INTERNET,
                "good.example",
                "also.example",
            ],
        ));
        t.servers.push(spawn(
            &internet,
            &["python3", "-c", &tls_server, EVIL, "evil.example"],
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
        // dnsmasq answers (from the "host", as the daemon will ask it).
        let mut dns_up = false;
        let mut last = String::new();
        for _ in 0..200 {
            let out = Command::new("nsenter")
                .arg(format!("--net=/run/netns/{host}"))
                .args([
                    "busybox",
                    "timeout",
                    "2",
                    "busybox",
                    "nslookup",
                    "-type=a",
                    "test.example",
                    INTERNET,
                ])
                .output()
                .unwrap();
            last = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            if last.contains("Address: 198.51.100.1") {
                dns_up = true;
                break;
            }
            // dnsmasq has been seen to exit at start while other tests start theirs: start it again.
            if matches!(t.servers[1].try_wait(), Ok(Some(_))) {
                t.servers[1] = start_dnsmasq();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let dnsmasq = (
            t.servers[1].try_wait(),
            std::fs::read_to_string(&dnsmasq_log).unwrap_or_default(),
        );
        assert!(
            dns_up,
            "the test's DNS server did not come up (dnsmasq: {dnsmasq:?}); last answer: {last}"
        );
        for url in [
            format!("https://{INTERNET}/"),
            format!("https://{EVIL}/"),
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
    pub fn curl_from_host(&self, url: &str) -> Option<String> {
        for _ in 0..50 {
            let out = Command::new("ip")
                .args(["netns", "exec", &self.host, "curl", "-sk", "-m", "2", url])
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
    pub fn host_interfaces(&self) -> String {
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

/// The test topology and a daemon in its "host" namespace with sandbox networking on `subnet`, an
/// (empty) deny-list file and the busybox template `bb`.
pub async fn networked_daemon(
    dir: &Path,
    subnet: &str,
    extra: &[&str],
) -> (Topology, Daemon, Client, std::path::PathBuf) {
    let topo = Topology::new(dir);
    let rootfs = busybox_rootfs(dir);
    let deny_file = dir.join("deny.txt");
    std::fs::write(&deny_file, "# known-bad destinations\n").unwrap();
    let mut args = vec![
        "--deny-list",
        deny_file.to_str().unwrap(),
        "--network",
        "nat",
        "--dns",
        INTERNET,
        "--subnet",
        subnet,
        "--pool-size",
        "0",
    ];
    args.extend(extra);
    let d = Daemon::start_in_netns(&dir.join("data"), &topo.host, &args);
    let c = d.client();
    register_bb(&c, &rootfs).await;
    (topo, d, c, deny_file)
}
