//! End-to-end tests: start the agent binary on a unix socket and talk HTTP/2 to it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use moat_api::{
    DirListing, EntryInfo, ExistsResponse, FsEvent, FsEventKind, MkdirResponse, ProcessEvent,
    ProcessInfo, ProcessList,
};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

struct Agent {
    child: Child,
    sock: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Conn {
    send: SendRequest<Full<Bytes>>,
    _agent: Agent,
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

async fn start() -> Conn {
    start_with(&[]).await
}

async fn start_with(args: &[&str]) -> Conn {
    let dir = tmp();
    let sock = dir.path().join("a.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_moat-agent"))
        .arg("--listen")
        .arg(&sock)
        .args(args)
        .env_remove("TERM") // the agent sets TERM for pty processes only where its own env lacks it
        .env("MOAT_TEST_BASE", "inherited")
        .spawn()
        .expect("start agent");
    let agent = Agent {
        child,
        sock,
        _dir: dir,
    };
    let mut stream = None;
    for _ in 0..200 {
        if let Ok(s) = tokio::net::UnixStream::connect(&agent.sock).await {
            stream = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stream = stream.expect("agent socket never came up");
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    Conn {
        send,
        _agent: agent,
    }
}

impl Conn {
    async fn raw(
        &mut self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> hyper::Response<hyper::body::Incoming> {
        request(&mut self.send, method, path, body).await
    }

    async fn call(
        &mut self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
    ) -> (StatusCode, Bytes) {
        let resp = self.raw(method, path, body).await;
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, body)
    }

    async fn json(&mut self, method: Method, path: &str, body: Value) -> (StatusCode, Value) {
        let (s, b) = self.call(method, path, body.to_string()).await;
        let v = if b.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&b).expect("json body")
        };
        (s, v)
    }

    async fn events(&mut self, method: Method, path: &str, body: Value) -> Vec<ProcessEvent> {
        let (s, b) = self.call(method, path, body.to_string()).await;
        assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
        parse_events(&b)
    }
}

/// One request on an HTTP/2 connection (a clone of `Conn::send` makes concurrent ones).
async fn request(
    send: &mut SendRequest<Full<Bytes>>,
    method: Method,
    path: &str,
    body: impl Into<Bytes>,
) -> hyper::Response<hyper::body::Incoming> {
    let req = Request::builder()
        .method(method)
        .uri(format!("http://agent{path}"))
        .body(Full::new(body.into()))
        .expect("request");
    send.send_request(req).await.expect("send")
}

/// A process event stream (JSON lines).
fn parse_events(body: &[u8]) -> Vec<ProcessEvent> {
    body.split(|c| *c == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("event"))
        .collect()
}

/// Concatenated output of one kind of event, and the exit.
fn output(events: &[ProcessEvent], want: &str) -> String {
    events
        .iter()
        .filter_map(|e| match (e, want) {
            (ProcessEvent::Stdout(c), "stdout")
            | (ProcessEvent::Stderr(c), "stderr")
            | (ProcessEvent::Pty(c), "pty") => c.data.clone(),
            _ => None,
        })
        .collect()
}

fn exit(events: &[ProcessEvent]) -> moat_api::ExitStatus {
    match events.last() {
        Some(ProcessEvent::Exit(s)) => s.clone(),
        other => panic!("last event is not exit: {other:?}"),
    }
}

fn assert_error(status: StatusCode, body: &Value, want: StatusCode, field: Option<&str>) {
    assert_eq!(status, want, "{body}");
    assert_eq!(body["error"]["field"].as_str(), field, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_routing() {
    let mut c = start().await;
    let (s, v) = c.json(Method::GET, "/health", Value::Null).await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(v["protocol"], json!(moat_api::AGENT_PROTOCOL_VERSION));
    let (s, v) = c.json(Method::GET, "/nope", Value::Null).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let (s, _) = c.json(Method::DELETE, "/health", Value::Null).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    // Every route of the protocol's table is the agent's: a method it does not take answers 405
    // naming the ones it does (never 404), as the table says.
    use moat_api::protocol::{resolve, Resolved, Route};
    let sel = moat_api::ProcessSelector::Tag("t".into());
    for &route in Route::ALL {
        let path = route
            .path(route.takes_process().then_some(&sel))
            .expect("path");
        let Resolved::MethodNotAllowed(allowed) = resolve(&Method::PATCH, &path) else {
            panic!("{path} takes PATCH");
        };
        let resp = c.raw(Method::PATCH, &path, "").await;
        assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED, "{path}");
        let allow = resp.headers()[http::header::ALLOW]
            .to_str()
            .unwrap()
            .to_string();
        let want: Vec<&str> = allowed.iter().map(Method::as_str).collect();
        assert_eq!(allow, want.join(", "), "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreground_output_and_exit() {
    let mut c = start().await;
    let ev = c
        .events(
            Method::POST,
            "/processes",
            json!({"cmd": ["sh", "-c", "echo hi; echo err >&2; exit 3"]}),
        )
        .await;
    assert!(
        matches!(ev.first(), Some(ProcessEvent::Start { .. })),
        "{ev:?}"
    );
    assert_eq!(output(&ev, "stdout"), "hi\n");
    assert_eq!(output(&ev, "stderr"), "err\n");
    assert_eq!(exit(&ev).exit_code, Some(3));

    let ev = c
        .events(Method::POST, "/processes", json!({"command": "kill -9 $$"}))
        .await;
    let st = exit(&ev);
    assert_eq!(
        (st.exit_code, st.signal.as_deref()),
        (None, Some("SIGKILL"))
    );

    let ev = c
        .events(
            Method::POST,
            "/processes",
            json!({"cmd": ["sleep", "10"], "timeout": 0.5}),
        )
        .await;
    let st = exit(&ev);
    assert!(st.timed_out, "{st:?}");
    assert_eq!(st.signal.as_deref(), Some("SIGKILL"));

    let ev = c
        .events(Method::POST, "/processes", json!({"command": "echo $FOO $HOME $MOAT_TEST_BASE; pwd", "env": {"FOO": "bar"}, "cwd": "/tmp"}))
        .await;
    assert_eq!(output(&ev, "stdout"), "bar /root inherited\n/tmp\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_waits_for_output_but_not_for_background_children() {
    let mut c = start().await;
    // A silent background child keeps the pipe open: the exit comes after the grace, with everything
    // written before it.
    let t = std::time::Instant::now();
    let ev = c
        .events(
            Method::POST,
            "/processes",
            json!({"command": "sleep 5 & echo before; head -c 100000 /dev/zero | tr '\\0' a"}),
        )
        .await;
    let out = output(&ev, "stdout");
    assert!(
        out.starts_with("before\n"),
        "{:?}",
        &out[..out.len().min(40)]
    );
    assert_eq!(out.len(), 7 + 100_000);
    assert_eq!(exit(&ev).exit_code, Some(0));
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());

    // A background child that writes without pause does not hold the exit back either.
    let t = std::time::Instant::now();
    let ev = c
        .events(
            Method::POST,
            "/processes",
            json!({"command": "timeout 8 yes x & echo before"}),
        )
        .await;
    assert!(output(&ev, "stdout").starts_with("before\n"));
    assert_eq!(exit(&ev).exit_code, Some(0));
    assert!(t.elapsed() < Duration::from_secs(6), "{:?}", t.elapsed());

    // Many commands at once on two cores: each one's output is whole when its exit arrives.
    let mut runs = Vec::new();
    for i in 0..48 {
        let mut send = c.send.clone();
        runs.push(tokio::spawn(async move {
            let body = json!({"command": format!("echo start{i}; head -c 50000 /dev/zero | tr '\\0' b; echo end{i}")});
            let resp = request(&mut send, Method::POST, "/processes", body.to_string()).await;
            let b = resp.into_body().collect().await.expect("body").to_bytes();
            let ev = parse_events(&b);
            (i, output(&ev, "stdout"), exit(&ev).exit_code)
        }));
    }
    for r in runs {
        let (i, out, code) = r.await.expect("join");
        assert_eq!(code, Some(0));
        let want = format!("start{i}\n{}end{i}\n", "b".repeat(50_000));
        assert!(
            out == want,
            "command {i}: {} bytes of {}",
            out.len(),
            want.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_stdin_and_reattach() {
    let mut c = start().await;
    let (s, v) = c
        .json(
            Method::POST,
            "/processes",
            json!({"cmd": ["cat"], "stdin": true, "background": true, "tag": "catter"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let info: ProcessInfo = serde_json::from_value(v).expect("info");
    assert!(info.running && info.stdin_open);
    // A second running process with the same tag is refused.
    let (s, _) = c
        .json(
            Method::POST,
            "/processes",
            json!({"cmd": ["true"], "background": true, "tag": "catter"}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    let (s, _) = c.call(Method::POST, "/processes/catter/stdin", "abc").await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = c
        .call(
            Method::POST,
            &format!("/processes/{}/close-stdin", info.pid),
            "",
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let ev = c
        .events(Method::GET, "/processes/catter/events", Value::Null)
        .await;
    assert!(matches!(ev.first(), Some(ProcessEvent::Start { pid, .. }) if *pid == info.pid));
    assert_eq!(output(&ev, "stdout"), "abc");
    assert_eq!(exit(&ev).exit_code, Some(0));
    // Exited: listed with its exit, stdin refused, events replay then end.
    let (_, v) = c.json(Method::GET, "/processes", Value::Null).await;
    let list: ProcessList = serde_json::from_value(v).expect("list");
    let p = list
        .processes
        .iter()
        .find(|p| p.pid == info.pid)
        .expect("listed");
    assert_eq!(p.exit.as_ref().and_then(|e| e.exit_code), Some(0));
    let (s, _) = c.call(Method::POST, "/processes/catter/stdin", "x").await;
    assert_eq!(s, StatusCode::CONFLICT);
    let ev = c
        .events(
            Method::GET,
            "/processes/catter/events?replay=false",
            Value::Null,
        )
        .await;
    assert_eq!(output(&ev, "stdout"), "");
    assert_eq!(exit(&ev).exit_code, Some(0));
    // Signals go to the group.
    let (_, v) = c
        .json(
            Method::POST,
            "/processes",
            json!({"cmd": ["sleep", "30"], "background": true}),
        )
        .await;
    let pid = v["pid"].as_u64().expect("pid");
    let (s, v) = c
        .json(
            Method::POST,
            &format!("/processes/{pid}/signal"),
            json!({"signal": "NOPE"}),
        )
        .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, Some("signal"));
    let (s, _) = c
        .json(
            Method::POST,
            &format!("/processes/{pid}/signal"),
            json!({"signal": "TERM"}),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let ev = c
        .events(
            Method::GET,
            &format!("/processes/{pid}/events"),
            Value::Null,
        )
        .await;
    assert_eq!(exit(&ev).signal.as_deref(), Some("SIGTERM"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_and_resize() {
    let mut c = start().await;
    let ev = c
        .events(
            Method::POST,
            "/processes",
            json!({"cmd": ["tty"], "pty": {"cols": 80, "rows": 24}}),
        )
        .await;
    assert!(output(&ev, "pty").starts_with("/dev/pts/"), "{ev:?}");
    assert_eq!(exit(&ev).exit_code, Some(0));

    let (s, v) = c
        .json(
            Method::POST,
            "/processes",
            json!({"command": "read line; stty size; echo $TERM", "pty": {"cols": 80, "rows": 24}, "background": true, "tag": "term"}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let (s, _) = c
        .json(
            Method::POST,
            "/processes/term/resize",
            json!({"cols": 100, "rows": 40}),
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = c.call(Method::POST, "/processes/term/stdin", "go\n").await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let ev = c
        .events(Method::GET, "/processes/term/events", Value::Null)
        .await;
    let out = output(&ev, "pty");
    assert!(out.contains("40 100"), "{out:?}");
    assert!(out.contains("xterm-256color"), "{out:?}");
    // Resize of a non-pty process is a conflict.
    let (_, v) = c
        .json(
            Method::POST,
            "/processes",
            json!({"cmd": ["sleep", "5"], "background": true}),
        )
        .await;
    let pid = v["pid"].as_u64().expect("pid");
    let (s, _) = c
        .json(
            Method::POST,
            &format!("/processes/{pid}/resize"),
            json!({"cols": 1, "rows": 1}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_process_requests() {
    let mut c = start().await;
    let cases = [
        (json!({}), "cmd"),
        (json!({"cmd": []}), "cmd"),
        (json!({"cmd": ["true"], "command": "true"}), "cmd"),
        (json!({"cmd": ["no-such-program-xyz"]}), "cmd"),
        (json!({"cmd": ["true"], "tag": "12"}), "tag"),
        (json!({"cmd": ["true"], "timeout": -1.0}), "timeout"),
        (
            json!({"cmd": ["true"], "pty": {"cols": 0, "rows": 5}}),
            "pty",
        ),
        (json!({"cmd": ["true"], "user": "no-such-user-xyz"}), "user"),
        (json!({"cmd": ["true"], "cwd": "/no/such/dir"}), "cwd"),
        (json!({"cmd": ["true"], "bogus": 1}), "bogus"),
    ];
    for (body, field) in cases {
        let (s, v) = c.json(Method::POST, "/processes", body.clone()).await;
        assert_error(s, &v, StatusCode::BAD_REQUEST, Some(field));
    }
    let (s, v) = c
        .json(Method::GET, "/processes/a%2Fb/events", Value::Null)
        .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, Some("process"));
    let (s, _) = c
        .json(Method::GET, "/processes/nobody/events", Value::Null)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, _) = c
        .json(Method::GET, "/processes/999999/events", Value::Null)
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

fn q(p: &Path) -> String {
    p.to_str()
        .expect("utf8 path")
        .replace('%', "%25")
        .replace('&', "%26")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_file_round_trip() {
    let mut c = start().await;
    let dir = tmp();
    let path = dir.path().join("sub/dir/big.bin");
    let data: Vec<u8> = (0..20 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let want = Sha256::digest(&data);
    let (s, v) = c
        .call(
            Method::PUT,
            &format!("/files?path={}&mode=600", q(&path)),
            data,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{}", String::from_utf8_lossy(&v));
    let info: EntryInfo = serde_json::from_slice(&v).expect("entry");
    assert_eq!((info.size, info.mode), (20 * 1024 * 1024, 0o600));
    let resp = c
        .raw(Method::GET, &format!("/files?path={}", q(&path)), "")
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-length"], "20971520");
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(Sha256::digest(&body), want);
    // Replacing keeps the old mode; GET of a directory or a missing file fails properly.
    let (s, v) = c
        .call(Method::PUT, &format!("/files?path={}", q(&path)), "small")
        .await;
    assert_eq!(s, StatusCode::OK);
    let info: EntryInfo = serde_json::from_slice(&v).expect("entry");
    assert_eq!((info.size, info.mode), (5, 0o600));
    let (s, v) = c
        .json(
            Method::GET,
            &format!("/files?path={}", q(dir.path())),
            Value::Null,
        )
        .await;
    // Reading a directory as a file: the path is in the wrong state for it, not malformed.
    assert_error(s, &v, StatusCode::CONFLICT, Some("path"));
    let (s, _) = c
        .json(
            Method::GET,
            &format!("/files?path={}/missing", q(dir.path())),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, v) = c
        .json(
            Method::PUT,
            &format!("/files?path={}/x&mode=999", q(dir.path())),
            Value::Null,
        )
        .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, Some("mode"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_operations() {
    let mut c = start().await;
    let dir = tmp();
    let d = dir.path();
    let (s, v) = c
        .json(
            Method::POST,
            "/fs/mkdir",
            json!({"path": d.join("a/b").to_str()}),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let m: MkdirResponse = serde_json::from_value(v).expect("mkdir");
    assert!(m.created);
    let (_, v) = c
        .json(
            Method::POST,
            "/fs/mkdir",
            json!({"path": d.join("a/b").to_str()}),
        )
        .await;
    assert_eq!(v["created"], json!(false));
    std::fs::write(d.join("a/b/f.txt"), "x").expect("write");
    std::fs::write(d.join("a/top.txt"), "y").expect("write");
    std::os::unix::fs::symlink("/", d.join("a/link")).expect("symlink");
    let (s, _) = c
        .json(
            Method::POST,
            "/fs/mkdir",
            json!({"path": d.join("a/top.txt/z").to_str()}),
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);

    let (s, v) = c
        .json(
            Method::GET,
            &format!("/fs/list?path={}&depth=2", q(d)),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let l: DirListing = serde_json::from_value(v).expect("listing");
    let names: Vec<String> = l
        .entries
        .iter()
        .map(|e| {
            e.path
                .strip_prefix(d.to_str().unwrap_or(""))
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(names, vec!["/a", "/a/b", "/a/link", "/a/top.txt"]);
    let (s, v) = c
        .json(
            Method::GET,
            &format!("/fs/list?path={}&depth=33", q(d)),
            Value::Null,
        )
        .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, Some("depth"));

    let (_, v) = c
        .json(
            Method::GET,
            &format!("/fs/stat?path={}", q(&d.join("a/link"))),
            Value::Null,
        )
        .await;
    let st: EntryInfo = serde_json::from_value(v).expect("stat");
    assert_eq!(st.symlink_target.as_deref(), Some("/"));
    let (s, _) = c
        .json(
            Method::GET,
            &format!("/fs/stat?path={}", q(&d.join("nope"))),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let (s, v) = c
        .json(
            Method::POST,
            "/fs/rename",
            json!({"from": d.join("a/top.txt").to_str(), "to": d.join("new/dir/t.txt").to_str()}),
        )
        .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["size"], json!(1));
    let (s, _) = c
        .json(
            Method::POST,
            "/fs/rename",
            json!({"from": d.join("gone").to_str(), "to": d.join("x").to_str()}),
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (_, v) = c
        .json(
            Method::GET,
            &format!("/fs/exists?path={}", q(&d.join("a/top.txt"))),
            Value::Null,
        )
        .await;
    assert!(
        !serde_json::from_value::<ExistsResponse>(v)
            .expect("exists")
            .exists
    );

    let (s, _) = c
        .json(
            Method::DELETE,
            &format!("/fs?path={}", q(&d.join("a"))),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::CONFLICT);
    let (s, _) = c
        .json(
            Method::DELETE,
            &format!("/fs?path={}&recursive=true", q(&d.join("a"))),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    assert!(!d.join("a").exists());
    let (s, v) = c
        .json(Method::DELETE, "/fs?path=/&recursive=true", Value::Null)
        .await;
    assert_error(s, &v, StatusCode::BAD_REQUEST, Some("path"));
    let (s, _) = c
        .json(
            Method::DELETE,
            &format!("/fs?path={}", q(&d.join("a"))),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tar_round_trip() {
    use std::os::unix::fs::PermissionsExt;
    let mut c = start().await;
    let src = tmp();
    std::fs::create_dir_all(src.path().join("d/e")).expect("mkdir");
    std::fs::write(src.path().join("d/e/x.sh"), "#!/bin/sh\n").expect("write");
    std::fs::set_permissions(
        src.path().join("d/e/x.sh"),
        std::fs::Permissions::from_mode(0o751),
    )
    .expect("chmod");
    std::fs::write(src.path().join("top"), "top").expect("write");
    std::os::unix::fs::symlink("top", src.path().join("ln")).expect("symlink");
    let (s, tarball) = c
        .call(Method::GET, &format!("/fs/tar?path={}", q(src.path())), "")
        .await;
    assert_eq!(s, StatusCode::OK);
    let dst = tmp();
    let out = dst.path().join("out");
    let (s, b) = c
        .call(Method::PUT, &format!("/fs/tar?path={}", q(&out)), tarball)
        .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        std::fs::read_to_string(out.join("top")).expect("top"),
        "top"
    );
    assert_eq!(
        std::fs::read_link(out.join("ln")).expect("link"),
        Path::new("top")
    );
    let mode = std::fs::metadata(out.join("d/e/x.sh"))
        .expect("x.sh")
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o751);
    // An entry escaping the target is refused.
    let mut evil = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_size(1);
    h.set_mode(0o644);
    h.as_gnu_mut().expect("gnu").name[..9].copy_from_slice(b"../escape");
    h.set_cksum();
    evil.append(&h, &b"x"[..]).expect("append");
    let evil = evil.into_inner().expect("tar");
    let (s, _) = c
        .call(Method::PUT, &format!("/fs/tar?path={}", q(&out)), evil)
        .await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(!dst.path().join("escape").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_sees_create() {
    let mut c = start().await;
    let dir = tmp();
    std::fs::create_dir(dir.path().join("sub")).expect("mkdir");
    let (s, _) = c
        .json(
            Method::GET,
            &format!("/fs/watch?path={}/missing", q(dir.path())),
            Value::Null,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let resp = c
        .raw(
            Method::GET,
            &format!("/fs/watch?path={}&recursive=true", q(dir.path())),
            "",
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    std::fs::write(dir.path().join("sub/new.txt"), "hello").expect("write");
    let mut buf = Vec::new();
    let found = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(d) = frame.into_data() {
                buf.extend_from_slice(&d);
            }
            for line in buf.split(|c| *c == b'\n').filter(|l| !l.is_empty()) {
                if let Ok(ev) = serde_json::from_slice::<FsEvent>(line) {
                    if ev.kind == FsEventKind::Create && ev.path.ends_with("sub/new.txt") {
                        return true;
                    }
                }
            }
        }
        false
    })
    .await;
    assert_eq!(found.ok(), Some(true), "{}", String::from_utf8_lossy(&buf));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounded_output_drops_or_backpressures() {
    let mut c = start_with(&["--output-buffer-bytes", "4096"]).await;
    // An attached reader (the foreground stream) gets every byte: the writer waits for it.
    let ev = c
        .events(
            Method::POST,
            "/processes",
            json!({"command": "head -c 300000 /dev/zero | tr '\\0' a"}),
        )
        .await;
    assert_eq!(output(&ev, "stdout").len(), 300_000);
    assert!(!ev.iter().any(|e| matches!(e, ProcessEvent::Dropped { .. })));
    // With nobody attached the oldest output is dropped, and a late reader is told how much.
    let (_, v) = c
        .json(
            Method::POST,
            "/processes",
            json!({"command": "head -c 100000 /dev/zero | tr '\\0' b", "background": true, "tag": "flood"}),
        )
        .await;
    let pid = v["pid"].as_u64().expect("pid") as u32;
    for _ in 0..200 {
        let (_, v) = c.json(Method::GET, "/processes", Value::Null).await;
        let list: ProcessList = serde_json::from_value(v).expect("list");
        if list.processes.iter().any(|p| p.pid == pid && !p.running) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let ev = c
        .events(Method::GET, "/processes/flood/events", Value::Null)
        .await;
    let dropped: u64 = ev
        .iter()
        .map(|e| match e {
            ProcessEvent::Dropped { bytes } => *bytes,
            _ => 0,
        })
        .sum();
    let kept = output(&ev, "stdout").len() as u64;
    assert!(
        dropped > 0 && kept <= 4096 + 65536,
        "dropped {dropped} kept {kept}"
    );
    assert_eq!(dropped + kept, 100_000);
    assert_eq!(exit(&ev).exit_code, Some(0));
}

/// A request body that yields one chunk and then fails (the client resets the stream).
struct FailingBody(u8);

impl http_body::Body for FailingBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        self.0 += 1;
        std::task::Poll::Ready(Some(match self.0 {
            1 => Ok(http_body::Frame::data(Bytes::from_static(
                b"partial new content",
            ))),
            _ => Err(std::io::Error::other("client gave up")),
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_upload_keeps_old_file() {
    let c = start().await;
    let dir = tmp();
    let path = dir.path().join("keep.txt");
    std::fs::write(&path, "old").expect("write");
    let stream = tokio::net::UnixStream::connect(&c._agent.sock)
        .await
        .expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let req = Request::builder()
        .method(Method::PUT)
        .uri(format!("http://agent/files?path={}", q(&path)))
        .body(FailingBody(0))
        .expect("request");
    let _ = send.send_request(req).await; // fails one way or another
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(std::fs::read_to_string(&path).expect("read"), "old");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .expect("readdir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left.len(), 1, "temp file left behind: {left:?}");
}
