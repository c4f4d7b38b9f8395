//! Clients without a key that try to wreck the daemon: a flood of idle connections, requests that
//! never finish their head or their body. The API listener counts connections per client address
//! and in all, answers 503 over its caps, and closes what stays silent; no sandbox is harmed and
//! the client with the key is served throughout.

use std::time::Duration;

use moat_api::{CreateSandboxRequest, RegisterTemplateRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::*;

/// A connection to the daemon from source address `from` (another loopback address than the
/// client with the key uses, so the per-client cap counts it apart).
async fn connect_from(from: &str, port: u16) -> tokio::net::TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
    sock.connect(format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .unwrap()
}

/// What arrives on `s` within `wait`: Some(bytes) (empty: the daemon closed it), None: nothing.
async fn read_within(s: &mut tokio::net::TcpStream, wait: Duration) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(wait, s.read(&mut buf)).await {
        Ok(Ok(n)) => Some(buf[..n].to_vec()),
        Ok(Err(_)) => Some(Vec::new()),
        Err(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_keyless_connection_flood_harms_no_sandbox() {
    let tmp = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(tmp.path());
    let d = Daemon::start_with(
        &tmp.path().join("data"),
        &[
            "--pool-size",
            "0",
            "--max-connections",
            "64",
            "--max-connections-per-client",
            "24",
            "--header-timeout",
            "2",
            "--body-idle-timeout",
            "2",
        ],
    );
    let c = d.client();
    c.register_template(&RegisterTemplateRequest {
        name: "bb".into(),
        path: rootfs.display().to_string(),
    })
    .await
    .unwrap();
    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bb".into()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();

    // 80 connections from one address that send nothing: 24 are held, the rest answered 503 and
    // closed at once.
    let mut flood = Vec::new();
    for _ in 0..80 {
        flood.push(connect_from("127.0.0.2", d.port).await);
    }
    let answers = futures::future::join_all(
        flood
            .iter_mut()
            .map(|s| read_within(s, Duration::from_millis(500))),
    )
    .await;
    let mut held = Vec::new();
    let mut refused = 0;
    for (s, a) in flood.into_iter().zip(answers) {
        match a {
            Some(b) if b.starts_with(b"HTTP/1.1 503") => {
                assert!(String::from_utf8_lossy(&b).contains("too many connections"));
                refused += 1;
            }
            Some(b) => panic!("unexpected answer: {}", String::from_utf8_lossy(&b)),
            None => held.push(s),
        }
    }
    assert_eq!(held.len(), 24, "held past the per-client cap");
    assert_eq!(refused, 56);

    // The client with the key is served meanwhile, and its sandbox runs.
    let out = sh(&c, &sbx.id, "echo still-here").await;
    assert_eq!(out.stdout.trim(), "still-here");

    // A request whose head never ends, and one whose body never comes: both end after their
    // timeouts instead of holding the connection for ever.
    let mut half_head = connect_from("127.0.0.3", d.port).await;
    half_head
        .write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut no_body = connect_from("127.0.0.3", d.port).await;
    let head = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{{",
        d.api_key()
    );
    no_body.write_all(head.as_bytes()).await.unwrap();
    let answered = read_within(&mut no_body, Duration::from_secs(8))
        .await
        .expect("a body that never comes held its request past the body idle timeout");
    let text = String::from_utf8_lossy(&answered);
    assert!(
        answered.is_empty() || text.starts_with("HTTP/1.1 400"),
        "{text}"
    );
    let closed = read_within(&mut half_head, Duration::from_secs(8))
        .await
        .expect("a half-sent head held its connection past the header timeout");
    assert!(
        closed.is_empty() || String::from_utf8_lossy(&closed).starts_with("HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&closed)
    );

    // The idle flood is closed by the header timeout, which frees the address's places.
    for s in &mut held {
        let got = read_within(s, Duration::from_secs(8))
            .await
            .expect("an idle connection was never closed");
        assert!(
            got.is_empty() || String::from_utf8_lossy(&got).starts_with("HTTP/1.1 408"),
            "{}",
            String::from_utf8_lossy(&got)
        );
    }
    let mut again = connect_from("127.0.0.2", d.port).await;
    again
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = read_within(&mut again, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(
        answer.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&answer)
    );

    // Nothing was harmed.
    let s = c.get_sandbox(&sbx.id).await.unwrap();
    assert_eq!(s.state, moat_api::SandboxState::Running);
    assert_eq!(sh(&c, &sbx.id, "echo ok").await.stdout.trim(), "ok");
    c.delete_sandbox(&sbx.id).await.unwrap();
    d.stop();
}
