//! Sandbox networking and the egress policy, in a topology this test makes out of network namespaces
//! (network safety rules): the daemon runs in a "host" namespace whose only uplink is a veth to an
//! "internet" namespace holding the test's own HTTP servers (on a public-looking address, on a private
//! address and on the cloud-metadata address) and its own DNS server. Nothing leaves this machine.

use std::time::Duration;

use moat_api::{CreateSandboxRequest, ErrorCode, NetworkPolicy};
use moat_client::Client;

use crate::harness::*;
use crate::topology::*;

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

/// An HTTP/1.1 GET from inside a sandbox to `ip:port` with `Host: host`: Some(body) when a server
/// answered 200, None when the connection was refused or reset.
async fn get_with_host(c: &Client, id: &str, ip: &str, port: u16, host: &str) -> Option<String> {
    let out = sh(
        c,
        id,
        &format!(
            "printf 'GET / HTTP/1.1\\r\\nHost: {host}\\r\\nConnection: close\\r\\n\\r\\n' | busybox nc -w 3 {ip} {port}"
        ),
    )
    .await;
    let (head, body) = out.stdout.split_once("\r\n\r\n")?;
    head.contains(" 200 ").then(|| body.to_string())
}

/// A real TLS 1.2 ClientHello for `sni` (from rustls), sent from inside a sandbox to `ip:443`: the
/// name on the certificate the server answered with (TLS 1.2 sends it in clear), or None when the
/// connection was refused or reset.
async fn tls_server_name(c: &Client, id: &str, ip: &str, sni: &str) -> Option<String> {
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS12])
        .unwrap()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(sni.to_string()).unwrap();
    let mut conn = rustls::ClientConnection::new(std::sync::Arc::new(config), name).unwrap();
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).unwrap();
    let path = format!("/tmp/hello-{sni}");
    c.write_file(id, &path, hello, &Default::default())
        .await
        .unwrap();
    let out = sh(
        c,
        id,
        &format!("busybox nc -w 2 {ip} 443 < {path} | busybox grep -oE '(good|also|evil)\\.example' | busybox head -1"),
    )
    .await;
    let n = out.stdout.trim();
    (!n.is_empty()).then(|| n.to_string())
}

/// The sandbox's connection log once it holds an entry `pred` accepts (the log is written a moment
/// after the connection closes).
async fn log_until(
    c: &Client,
    id: &str,
    pred: impl Fn(&moat_api::NetworkLogEntry) -> bool,
) -> Vec<moat_api::NetworkLogEntry> {
    let q = moat_api::NetworkLogQuery {
        limit: Some(1000),
        ..Default::default()
    };
    for _ in 0..200 {
        let log = c.network_log(id, &q).await.unwrap();
        if log.iter().any(&pred) {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!(
        "no such entry in the connection log of {id}: {:#?}",
        c.network_log(id, &q).await.unwrap()
    );
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
    let (topo, d, c, deny_file) = networked_daemon(tmp.path(), "10.201.0.0/16", &[]).await;

    // Default policy: the public internet, nothing else.
    let a = create_bb(&c, None).await;
    let net = a.network.clone().expect("a network");
    assert!(net.ip.starts_with("10.201."), "{net:?}");
    assert!(net.policy.allow_internet);
    if isolation() == moat_api::Isolation::Microvm {
        // A VM's link is a TAP device on the host (its NIC's other end) with the gateway's
        // address, and no IPv6 address a guest could talk to.
        let addrs = topo.host_interfaces();
        let ifname = addrs
            .lines()
            .find(|l| l.contains(&format!("inet {}/30", net.gateway)))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or_else(|| panic!("no host interface with {}: {addrs}", net.gateway))
            .to_string();
        let link = std::process::Command::new("ip")
            .args(["-n", &topo.host, "-d", "-o", "link", "show", "dev", &ifname])
            .output()
            .unwrap();
        let link = String::from_utf8_lossy(&link.stdout);
        assert!(link.contains("tun type tap"), "{link}");
        assert!(
            !addrs.lines().any(
                |l| l.split_whitespace().nth(1) == Some(ifname.as_str()) && l.contains("inet6")
            ),
            "{addrs}"
        );
        // Inside, the guest's kernel holds the sandbox's address and routes through the gateway.
        let inside = sh(&c, &a.id, "busybox ip -4 addr show eth0; busybox ip route").await;
        assert!(
            inside.stdout.contains(&format!("inet {}/30", net.ip))
                && inside
                    .stdout
                    .contains(&format!("default via {}", net.gateway)),
            "{inside:?}"
        );
    }
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
        // (gVisor shows ::1 on lo with scope 00: loopback is loopback whatever the scope column says.)
        v6.lines().all(|l| {
            l.split_whitespace().last() == Some("lo") || l.split_whitespace().nth(3) != Some("00")
        }),
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
    // The server is up once its own loopback answers (a gVisor sandbox takes longer to start it).
    let mut served = false;
    for _ in 0..50 {
        if fetch(&c, &b.id, "http://127.0.0.1:8000/passwd")
            .await
            .is_some()
        {
            served = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        served,
        "sandbox b's server does not answer on its own loopback"
    );
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
                allow_out: vec!["10.0.0.1".into(), "exa mple.com".into()],
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
    // A closed port: the proxy has accepted the sandbox's connection before it connects upstream, so
    // the sandbox sees it reset (no answer), and the log says why.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let out = sh(&c, &a.id, "printf x | busybox nc -w 1 198.51.100.1 9").await;
    assert_eq!(out.stdout, "", "{out:?}");
    let log = log_until(&c, &a.id, |e| e.dst_port == Some(9)).await;
    let e = log.iter().find(|e| e.dst_port == Some(9)).unwrap();
    assert!(
        e.error.as_deref().unwrap_or("").contains("refused"),
        "{e:?}"
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
    // Secrets travel only through the egress proxy: without networking they are refused (409);
    // a bad one is a 400 naming its field first.
    let secret = |hosts: &[&str]| moat_api::SecretSpec {
        name: "TOKEN".into(),
        value: "v".into(),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        inject: Default::default(),
        header: None,
        format: None,
        body: false,
    };
    for (hosts, want) in [
        (&["api.example.com"][..], (409, None)),
        (&["10.0.0.1"][..], (400, Some("secrets[0].hosts"))),
    ] {
        match c
            .create_sandbox(&CreateSandboxRequest {
                secrets: vec![secret(hosts)],
                ..Default::default()
            })
            .await
        {
            Err(moat_client::Error::Api { status, body }) => {
                assert_eq!((status, body.error.field.as_deref()), want, "{body:?}");
            }
            other => panic!("expected {want:?}, got {other:?}"),
        }
    }
    let s = create(&c, "base").await;
    assert!(s.network.is_none());
    assert_eq!(
        c.get_network(&s.id).await.unwrap_err().code(),
        Some(ErrorCode::Conflict)
    );
    // Loopback only.
    let out = sh(
        &c,
        &s.id,
        "sed -n '3,$p' /proc/net/dev | cut -d: -f1 | tr -d ' '",
    )
    .await;
    assert_eq!(out.stdout.trim(), "lo", "{out:?}");
    c.delete_sandbox(&s.id).await.unwrap();
}

/// Domain rules, checked on TLS SNI, HTTP Host and DNS by the daemon's proxy and resolver, the
/// connection log, audit mode and allow-list proposals — all in the test's own namespaces.
#[tokio::test(flavor = "multi_thread")]
async fn domain_rules_and_connection_log_in_a_test_made_network() {
    use moat_api::{NetDecision, NetworkLogQuery, NetworkMode};
    let tmp = tempfile::tempdir().unwrap();
    let (_topo, d, c, deny_file) = networked_daemon(
        tmp.path(),
        "10.202.0.0/16",
        &[
            "--default-network",
            r#"{"allow_internet": false, "allow_out": ["good.example"]}"#,
            "--max-connections-per-sandbox",
            "4",
        ],
    )
    .await;

    // Internet off, one domain allowed: the daemon's default policy (`--default-network`) for a
    // sandbox created without one.
    let s = create_bb(&c, None).await;
    assert_eq!(
        s.network.as_ref().unwrap().policy,
        NetworkPolicy {
            allow_internet: false,
            allow_out: vec!["good.example".into()],
            ..Default::default()
        }
    );
    let id = &s.id;
    // DNS: the allowed name resolves, any other is refused by the daemon's resolver.
    let ok = sh(&c, id, "busybox nslookup good.example").await;
    assert!(ok.stdout.contains(INTERNET), "{ok:?}");
    let refused = sh(&c, id, "busybox nslookup evil.example").await;
    assert!(!refused.stdout.contains(EVIL), "{refused:?}");
    // TLS: the allowed name reaches its server; the other name is reset.
    assert_eq!(
        tls_server_name(&c, id, INTERNET, "good.example")
            .await
            .as_deref(),
        Some("good.example")
    );
    assert_eq!(tls_server_name(&c, id, EVIL, "evil.example").await, None);
    // A forged SNI: the allowed name sent to the denied server's address. The proxy connects to the
    // name itself, so the sandbox gets good.example's server, never evil's.
    assert_eq!(
        tls_server_name(&c, id, EVIL, "good.example")
            .await
            .as_deref(),
        Some("good.example")
    );
    // HTTP Host works the same way; direct-IP access to the allowed name's address, without a name,
    // is governed by the CIDR rules only (here: refused).
    assert_eq!(
        get_with_host(&c, id, INTERNET, 8080, "good.example")
            .await
            .as_deref(),
        Some("hello")
    );
    assert_eq!(
        get_with_host(&c, id, INTERNET, 8080, "evil.example").await,
        None
    );
    assert_eq!(
        fetch(&c, id, &format!("http://{INTERNET}:8080/")).await,
        None
    );
    // What nftables decides alone is logged too: UDP, and TCP refused before it reaches the proxy.
    sh(
        &c,
        id,
        // busybox tftp: a UDP datagram to port 69 (busybox nc has no UDP mode). Two flows 0.6 s
        // apart: each entry has its packet's time, not the time of a batch the kernel sent.
        "(busybox timeout 2 busybox tftp -g -r x -l /tmp/x 198.51.100.1 &); sleep 0.6; \
         busybox timeout 2 busybox tftp -g -r y -l /tmp/y 198.51.100.1; true",
    )
    .await;
    assert_eq!(
        fetch(&c, id, &format!("http://{METADATA}:8080/")).await,
        None
    );
    // A name allowed by the policy that resolves to a private address is not followed (DNS
    // rebinding), unless the private range is allowed too.
    c.set_network(
        id,
        &NetworkPolicy {
            allow_internet: false,
            allow_out: vec!["good.example".into(), "inside.example".into()],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        get_with_host(&c, id, INTERNET, 8080, "inside.example").await,
        None
    );

    // The log has each case, with the rule that decided.
    let log = log_until(&c, id, |e| {
        e.name.as_deref() == Some("inside.example") && e.protocol == "tcp"
    })
    .await;
    // Entries of what nftables decided alone come through NFLOG, apart from the proxy's own: wait
    // for each kind (an emulated VM on a loaded host may be seconds behind).
    let log = if log.iter().any(|e| e.protocol == "udp") {
        log
    } else {
        log_until(&c, id, |e| e.protocol == "udp").await
    };
    let log = if log.iter().any(|e| e.dst_ip.as_deref() == Some(METADATA)) {
        log
    } else {
        log_until(&c, id, |e| e.dst_ip.as_deref() == Some(METADATA)).await
    };
    let tftp = |l: &[moat_api::NetworkLogEntry]| {
        l.iter()
            .filter(|e| e.protocol == "udp" && e.dst_port == Some(69))
            .count()
    };
    let mut log = log;
    for _ in 0..200 {
        if tftp(&log) >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        log = c
            .network_log(
                id,
                &moat_api::NetworkLogQuery {
                    limit: Some(1000),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
    }
    let udp: Vec<i64> = log
        .iter()
        .filter(|e| e.protocol == "udp" && e.dst_port == Some(69))
        .map(|e| e.at_ms)
        .collect();
    assert!(
        udp.len() >= 2 && udp.iter().max().unwrap() - udp.iter().min().unwrap() >= 400,
        "two UDP flows 0.6 s apart logged at {udp:?}"
    );
    let e = log
        .iter()
        .find(|e| e.protocol == "udp" && e.dst_port == Some(69))
        .unwrap_or_else(|| panic!("no UDP entry in {log:#?}"));
    assert_eq!(
        (e.decision, e.rule.as_str(), e.dst_ip.as_deref()),
        (NetDecision::Deny, "allow_internet: false", Some(INTERNET))
    );
    let e = log
        .iter()
        .find(|e| e.dst_ip.as_deref() == Some(METADATA))
        .unwrap_or_else(|| panic!("no metadata entry in {log:#?}"));
    assert_eq!(
        (e.decision, e.rule.as_str(), e.protocol.as_str(), e.dst_port),
        (NetDecision::Deny, "always blocked", "tcp", Some(8080))
    );
    let find = |proto: &str, name: &str, dst: Option<&str>| {
        log.iter()
            .find(|e| {
                e.protocol == proto
                    && e.name.as_deref() == Some(name)
                    && (dst.is_none() || e.dst_ip.as_deref() == dst)
            })
            .unwrap_or_else(|| panic!("no {proto} {name} {dst:?} in {log:#?}"))
            .clone()
    };
    let e = find("dns", "good.example", None);
    assert_eq!(
        (e.decision, e.rule.as_str()),
        (NetDecision::Allow, "allow_out[0]")
    );
    let e = find("dns", "evil.example", None);
    assert_eq!(
        (e.decision, e.rule.as_str()),
        (NetDecision::Deny, "allow_internet: false")
    );
    let e = find("tcp", "good.example", Some(INTERNET));
    assert_eq!(e.decision, NetDecision::Allow);
    assert_eq!(e.name_source.as_deref(), Some("sni"));
    assert!(e.bytes_in > 500 && e.bytes_out > 100, "{e:?}");
    let forged = find("tcp", "good.example", Some(EVIL));
    assert_eq!(forged.dialed.as_deref(), Some(&*format!("{INTERNET}:443")));
    let e = find("tcp", "evil.example", Some(EVIL));
    assert_eq!(
        (e.decision, e.rule.as_str()),
        (NetDecision::Deny, "allow_internet: false")
    );
    let e = log
        .iter()
        .find(|e| e.protocol == "tcp" && e.name.is_none() && e.dst_port == Some(8080))
        .expect("the direct-IP attempt");
    assert_eq!(e.decision, NetDecision::Deny);
    let e = find("tcp", "inside.example", None);
    // Refused with a rule of its own (not logged as an allow with an error).
    assert_eq!(
        (e.decision, e.rule.as_str()),
        (NetDecision::Deny, "rebinding (private range)")
    );
    assert!(
        e.error.as_deref().unwrap_or("").contains("private range"),
        "{e:?}"
    );
    // Refusals are in the audit log too.
    let audit = c
        .sandbox_audit(
            id,
            &moat_api::AuditQuery {
                action: Some("network.deny".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(
        audit.iter().any(|a| a.detail["name"] == "evil.example"),
        "{audit:#?}"
    );
    assert!(
        audit.iter().any(|a| a.detail["name"] == "inside.example"
            && a.detail["rule"] == "rebinding (private range)"),
        "{audit:#?}"
    );
    // Filters.
    let denied = c
        .network_log(
            id,
            &NetworkLogQuery {
                decision: Some(NetDecision::Deny),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(!denied.is_empty() && denied.iter().all(|e| e.decision == NetDecision::Deny));

    // Internet on, one name denied (with a wildcard): the rest works, the denied name does not, by
    // DNS or SNI.
    c.set_network(
        id,
        &NetworkPolicy {
            deny_out: vec!["*.example".into()],
            allow_out: vec!["also.example".into()],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(tls_server_name(&c, id, EVIL, "evil.example").await, None);
    assert_eq!(
        tls_server_name(&c, id, INTERNET, "also.example")
            .await
            .as_deref(),
        Some("also.example")
    );
    assert!(!sh(&c, id, "busybox nslookup evil.example")
        .await
        .stdout
        .contains(EVIL));

    // The daemon-wide deny list takes names too, and beats a sandbox's allow.
    c.set_network(
        id,
        &NetworkPolicy {
            allow_out: vec!["evil.example".into()],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        tls_server_name(&c, id, EVIL, "evil.example")
            .await
            .as_deref(),
        Some("evil.example")
    );
    std::fs::write(&deny_file, "evil.example\n").unwrap();
    let mut blocked = false;
    for _ in 0..20 {
        if tls_server_name(&c, id, EVIL, "evil.example")
            .await
            .is_none()
        {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(blocked, "a name added to the deny list stayed reachable");
    log_until(&c, id, |e| {
        e.rule == "deny list" && e.name.as_deref() == Some("evil.example")
    })
    .await;
    std::fs::write(&deny_file, "").unwrap();

    // Audit mode: nothing is refused (but what is always blocked), what would be is logged as audit,
    // and the proposal is the tightest policy allowing what the sandbox did.
    let a = create_bb(
        &c,
        Some(NetworkPolicy {
            allow_internet: false,
            mode: NetworkMode::Audit,
            ..Default::default()
        }),
    )
    .await;
    // Follow the log live while the sandbox works.
    let mut live = c
        .follow_network_log(&a.id, &NetworkLogQuery::default())
        .await
        .unwrap();
    assert_eq!(
        get_with_host(&c, &a.id, INTERNET, 8080, "good.example")
            .await
            .as_deref(),
        Some("hello")
    );
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{INTERNET}:8080/"))
            .await
            .as_deref(),
        Some("hello")
    );
    assert_eq!(
        fetch(&c, &a.id, &format!("http://{METADATA}:8080/")).await,
        None
    );
    let first = tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(&mut live))
        .await
        .expect("a live entry")
        .unwrap()
        .unwrap();
    assert_eq!(first.sandbox_id, a.id);
    assert_eq!(
        (first.decision, first.rule.as_str()),
        (NetDecision::Audit, "allow_internet: false")
    );
    drop(live);
    // UDP that the policy would refuse goes out and is logged as audit.
    sh(
        &c,
        &a.id,
        "busybox timeout 2 busybox tftp -g -r x -l /tmp/x 198.51.100.1; true",
    )
    .await;
    log_until(&c, &a.id, |e| {
        e.protocol == "udp" && e.decision == NetDecision::Audit && e.rule == "allow_internet: false"
    })
    .await;
    let log = log_until(&c, &a.id, |e| {
        e.dst_ip.as_deref() == Some(INTERNET) && e.name.is_none()
    })
    .await;
    assert!(
        log.iter().all(|e| e.decision != NetDecision::Allow),
        "{log:#?}"
    );
    let p = c.network_proposal(&a.id).await.unwrap();
    assert!(!p.policy.allow_internet);
    assert_eq!(p.policy.allow_out, [INTERNET, "good.example"], "{p:#?}");
    // The template's proposal covers every sandbox started from it.
    let t = c.template_network_proposal("bb").await.unwrap();
    for want in ["good.example", "also.example", "evil.example", INTERNET] {
        assert!(
            t.policy.allow_out.iter().any(|e| e == want),
            "{want}: {t:#?}"
        );
    }
    // The proposal applied: what the sandbox did works, nothing else does.
    c.set_network(&a.id, &p.policy).await.unwrap();
    assert_eq!(
        get_with_host(&c, &a.id, INTERNET, 8080, "good.example")
            .await
            .as_deref(),
        Some("hello")
    );
    assert_eq!(tls_server_name(&c, &a.id, EVIL, "evil.example").await, None);

    // A sandbox holds at most 4 connections through the proxy here (--max-connections-per-sandbox):
    // more are reset and logged, so no sandbox exhausts the daemon's file descriptors; they come
    // back as connections close.
    sh(
        &c,
        &a.id,
        "for i in 1 2 3 4 5 6; do (sleep 4 | busybox nc 198.51.100.1 9000 >/dev/null 2>&1 &); \
         done; sleep 1",
    )
    .await;
    let log = log_until(&c, &a.id, |e| e.rule == "connection limit").await;
    let over = log.iter().filter(|e| e.rule == "connection limit").count();
    assert!(
        over <= 2,
        "{over} connections refused for the limit: {log:#?}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        get_with_host(&c, &a.id, INTERNET, 8080, "good.example")
            .await
            .as_deref(),
        Some("hello")
    );

    // Bad entries name themselves.
    for (bad, field) in [
        ("@nope", "network.allow_out[0]"),
        ("exa mple.com", "network.allow_out[0]"),
    ] {
        match c
            .set_network(
                &a.id,
                &NetworkPolicy {
                    allow_out: vec![bad.into()],
                    ..Default::default()
                },
            )
            .await
        {
            Err(moat_client::Error::Api { status, body }) => {
                assert_eq!(
                    (status, body.error.field.as_deref()),
                    (400, Some(field)),
                    "{bad}"
                );
            }
            other => panic!("expected a 400 for {bad}, got {other:?}"),
        }
    }
    for s in [&s.id, &a.id] {
        c.delete_sandbox(s).await.unwrap();
    }
    // The log outlives the sandbox.
    assert!(!c
        .network_log(&a.id, &NetworkLogQuery::default())
        .await
        .unwrap()
        .is_empty());
    d.stop();
}

/// A full-state snapshot of a networked sandbox (gvisor): the sandbox and a fork restored from it
/// both reach the test's internet server, the fork with its own address (runsc restore takes the
/// interfaces of the network namespace it restores into), and the fork's processes run on. The
/// container tier refuses the kind (docs/snapshots.md).
#[tokio::test(flavor = "multi_thread")]
async fn full_snapshot_of_a_networked_sandbox_forks_with_its_own_address() {
    let tmp = tempfile::tempdir().unwrap();
    let (_topo, _d, c, _) = networked_daemon(tmp.path(), "10.203.0.0/16", &[]).await;
    let a = create_bb(&c, None).await;
    let full = moat_api::CreateSnapshotRequest {
        kind: Some(moat_api::SnapshotKind::Full),
        ..Default::default()
    };
    if is_container() {
        match c.create_snapshot(&a.id, &full).await {
            Err(moat_client::Error::Api { status, body }) => assert_eq!(
                (status, body.error.code, body.error.field.as_deref()),
                (503, ErrorCode::Unavailable, Some("kind"))
            ),
            other => panic!("expected a refusal, got {other:?}"),
        }
        c.delete_sandbox(&a.id).await.unwrap();
        return;
    }
    let sleeper = c
        .start_process_background(
            &a.id,
            &moat_api::StartProcessRequest {
                command: Some("sleep 3600".into()),
                tag: Some("sleeper".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let snap = c.create_snapshot(&a.id, &full).await.unwrap();
    let hello = format!("http://{INTERNET}:8080/");
    assert_eq!(fetch(&c, &a.id, &hello).await.as_deref(), Some("hello"));
    let forks = c
        .fork(
            &snap.id,
            &moat_api::ForkRequest {
                count: 1,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let f = &forks[0];
    let ip = f.network.as_ref().expect("a network").ip.clone();
    assert_ne!(Some(&ip), a.network.as_ref().map(|n| &n.ip));
    let addrs = sh(&c, &f.id, "busybox ip -4 addr").await.stdout;
    assert!(addrs.contains(&format!("inet {ip}/")), "{addrs}");
    assert_eq!(fetch(&c, &f.id, &hello).await.as_deref(), Some("hello"));
    assert!(c
        .list_processes(&f.id)
        .await
        .unwrap()
        .iter()
        .any(|p| p.pid == sleeper.pid && p.running));
    // The snapshotted sandbox still reaches the server too, with its address.
    assert_eq!(fetch(&c, &a.id, &hello).await.as_deref(), Some("hello"));
    for id in [&f.id, &a.id] {
        c.delete_sandbox(id).await.unwrap();
    }
    c.delete_snapshot(&snap.id).await.unwrap();
}

/// A POST to the daemon's E2B API (it listens inside the test's "host" namespace); the status and
/// the JSON answer.
fn e2b_post(
    topo: &Topology,
    port: u16,
    key: &str,
    path: &str,
    body: &str,
) -> (u16, serde_json::Value) {
    let out = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.host,
            "curl",
            "-s",
            "-m",
            "60",
            "-w",
            "\n%{http_code}",
            "-X",
        ])
        .args(["POST", &format!("http://127.0.0.1:{port}{path}")])
        .args([
            "-H",
            &format!("X-API-KEY: {key}"),
            "-H",
            "Content-Type: application/json",
        ])
        .args(["-d", body])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (json, status) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (
        status.trim().parse().unwrap_or(0),
        serde_json::from_str(json).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn e2b_network_options_become_the_egress_policy() {
    let tmp = tempfile::tempdir().unwrap();
    let port = 6629 + (std::process::id() % 1000) as u16;
    let (topo, d, c, _deny) = networked_daemon(
        tmp.path(),
        "10.222.0.0/16",
        &["--e2b-listen", &format!("127.0.0.1:{port}")],
    )
    .await;
    let key = d.api_key();
    // The E2B listener comes up beside the API.
    let mut up = false;
    for _ in 0..50 {
        if e2b_post(&topo, port, &key, "/v2/sandboxes/none/connect", "{}").0 == 404 {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(up, "the E2B API did not answer");
    // E2B's SDK: allow_internet_access=False plus an allowOut entry (allow beats deny).
    let (status, made) = e2b_post(
        &topo,
        port,
        &key,
        "/v2/sandboxes",
        &format!(
            r#"{{"templateID":"bb","timeout":120,"metadata":{{}},"envVars":{{}},"allow_internet_access":false,"network":{{"allowOut":["{INTERNET}"]}}}}"#
        ),
    );
    assert_eq!(status, 201, "{made}");
    let id = made["sandboxID"].as_str().unwrap().to_string();
    let s = c.get_sandbox(&id).await.unwrap();
    let policy = s.network.expect("a network").policy;
    assert!(!policy.allow_internet, "{policy:?}");
    assert_eq!(policy.allow_out, vec![INTERNET.to_string()]);
    assert_eq!(policy.deny_out, vec!["0.0.0.0/0".to_string()]);
    assert_eq!(
        fetch(&c, &id, &format!("http://{INTERNET}:8080/"))
            .await
            .as_deref(),
        Some("hello")
    );
    assert_eq!(fetch(&c, &id, &format!("http://{EVIL}:8080/")).await, None);
    // update_network: the same mapping, live.
    let (status, _) = {
        let out = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &topo.host,
                "curl",
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "-X",
                "PUT",
            ])
            .arg(format!("http://127.0.0.1:{port}/sandboxes/{id}/network"))
            .args([
                "-H",
                &format!("X-API-KEY: {key}"),
                "-H",
                "Content-Type: application/json",
            ])
            .args([
                "-d",
                &format!(r#"{{"allowOut":["{EVIL}"],"denyOut":["0.0.0.0/0"]}}"#),
            ])
            .output()
            .unwrap();
        (
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse::<u16>()
                .unwrap_or(0),
            (),
        )
    };
    assert_eq!(status, 204);
    assert_eq!(
        fetch(&c, &id, &format!("http://{INTERNET}:8080/")).await,
        None
    );
    // Options moat has no equivalent for are refused, naming them.
    let (status, err) = e2b_post(
        &topo,
        port,
        &key,
        "/v2/sandboxes",
        r#"{"templateID":"bb","metadata":{},"envVars":{},"network":{"dnsServers":["198.51.100.1"]}}"#,
    );
    assert_eq!(status, 400);
    assert!(
        err["message"]
            .as_str()
            .unwrap_or("")
            .contains("network.dnsServers"),
        "{err}"
    );
    c.delete_sandbox(&id).await.unwrap();
}
