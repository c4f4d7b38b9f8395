//! Commands: exit codes, signals, streaming, stdin, background processes, re-attach, PTY, concurrency.

use std::time::Duration;

use futures::{SinkExt, StreamExt};
use moat_api::{ProcessEvent, PtySize, StartProcessRequest};
use tokio_tungstenite::tungstenite::Message;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread")]
async fn python_exit_codes_and_signals() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let out = run_req(
        &c,
        &s.id,
        StartProcessRequest {
            cmd: Some(vec!["python3".into(), "-c".into(), "print(6*7)".into()]),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(out.stdout, "42\n");
    assert_eq!(out.exit.exit_code, Some(0));

    let out = run_req(
        &c,
        &s.id,
        StartProcessRequest {
            command: Some("exit 3".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(out.exit.exit_code, Some(3));
    assert_eq!(out.exit.signal, None);

    let out = sh(&c, &s.id, "echo out; echo err >&2; kill -9 $$").await;
    assert_eq!(out.stdout, "out\n");
    assert_eq!(out.stderr, "err\n");
    assert_eq!(out.exit.signal.as_deref(), Some("SIGKILL"));
    assert_eq!(out.exit.exit_code, None);

    // A program that does not exist is a clear 400, not a hang.
    let err = c
        .start_process_stream(
            &s.id,
            &StartProcessRequest {
                cmd: Some(vec!["no-such-program".into()]),
                ..Default::default()
            },
        )
        .await
        .err()
        .expect("must fail");
    assert_eq!(
        err.code(),
        Some(moat_api::ErrorCode::InvalidArgument),
        "{err}"
    );

    // Command timeout kills the process group and says so.
    let out = run_req(
        &c,
        &s.id,
        StartProcessRequest {
            command: Some("sleep 30".into()),
            timeout: Some(0.5),
            ..Default::default()
        },
    )
    .await;
    assert!(out.exit.timed_out, "{:?}", out.exit);

    // env, cwd and user.
    let out = run_req(
        &c,
        &s.id,
        StartProcessRequest {
            command: Some("echo $GREETING; pwd; id -un".into()),
            env: env(&[("GREETING", "hello")]),
            cwd: Some("/tmp".into()),
            user: Some("user".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(out.stdout, "hello\n/tmp\nuser\n");
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn background_stdin_signal_and_reattach() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let info = c
        .start_process_background(
            &s.id,
            &StartProcessRequest {
                command: Some("cat; echo done".into()),
                stdin: true,
                background: true,
                tag: Some("catter".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(info.running);
    let listed = c.list_processes(&s.id).await.unwrap();
    assert!(listed
        .iter()
        .any(|p| p.pid == info.pid && p.tag.as_deref() == Some("catter")));
    c.send_stdin(&s.id, "catter", "abc\n").await.unwrap();
    c.send_stdin(&s.id, &info.pid.to_string(), "def\n")
        .await
        .unwrap();
    c.close_stdin(&s.id, "catter").await.unwrap();
    // Re-attach later: the output kept since the start is replayed, then the exit.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut ev = c.attach(&s.id, "catter", true).await.unwrap();
    let mut text = Vec::new();
    let mut exit = None;
    while let Some(e) = ev.next().await {
        match e.unwrap() {
            ProcessEvent::Stdout(ch) => text.extend(decode(&ch)),
            ProcessEvent::Exit(x) => exit = Some(x),
            _ => {}
        }
    }
    assert_eq!(String::from_utf8_lossy(&text), "abc\ndef\ndone\n");
    assert_eq!(exit.unwrap().exit_code, Some(0));

    // A signal to a background process ends it with that signal.
    let info = c
        .start_process_background(
            &s.id,
            &StartProcessRequest {
                command: Some("sleep 100".into()),
                background: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    c.signal(&s.id, &info.pid.to_string(), "SIGTERM")
        .await
        .unwrap();
    let mut ev = c.attach(&s.id, &info.pid.to_string(), false).await.unwrap();
    let mut exit = None;
    while let Some(e) = ev.next().await {
        if let ProcessEvent::Exit(x) = e.unwrap() {
            exit = Some(x);
        }
    }
    assert_eq!(exit.unwrap().signal.as_deref(), Some("SIGTERM"));
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn pty_over_websocket() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let info = c
        .start_process_background(
            &s.id,
            &StartProcessRequest {
                cmd: Some(vec!["/bin/bash".into(), "--norc".into(), "-i".into()]),
                pty: Some(PtySize { cols: 80, rows: 24 }),
                background: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(info.pty);
    let mut ws = c.attach_ws(&s.id, &info.pid.to_string()).await.unwrap();
    ws.send(Message::Text(
        r#"{"type":"resize","cols":100,"rows":40}"#.into(),
    ))
    .await
    .unwrap();
    ws.send(Message::Binary(b"stty size; tty; exit 7\n".to_vec()))
        .await
        .unwrap();
    let mut screen = Vec::new();
    let mut exit = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, ws.next()).await {
        match msg.unwrap() {
            Message::Binary(b) => screen.extend_from_slice(&b),
            Message::Text(t) => {
                if let Ok(ProcessEvent::Exit(x)) = serde_json::from_str::<ProcessEvent>(&t) {
                    exit = Some(x);
                }
            }
            Message::Close(_) => break,
            _ => {}
        }
    }
    let screen = String::from_utf8_lossy(&screen);
    assert!(screen.contains("40 100"), "{screen}");
    assert!(screen.contains("/dev/pts/"), "{screen}");
    assert_eq!(exit.expect("exit event").exit_code, Some(7));
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_commands_in_one_sandbox() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let runs = (0..50).map(|i| {
        let c = c.clone();
        let id = s.id.clone();
        async move {
            (
                i,
                sh(&c, &id, &format!("echo {i}; exit $(({i} % 7))")).await,
            )
        }
    });
    let results = futures::future::join_all(runs).await;
    for (i, out) in results {
        assert_eq!(out.stdout, format!("{i}\n"));
        assert_eq!(out.exit.exit_code, Some(i % 7));
    }
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn output_flood_keeps_daemon_memory_bounded() {
    let d = shared();
    let c = d.client();
    let s = create(&c, "base").await;
    let before = d.rss_kib();
    // 200 MB of output through a stream the test reads slowly at first.
    let mut ev = c
        .start_process_stream(
            &s.id,
            &StartProcessRequest {
                command: Some("head -c 200000000 /dev/zero | base64 -w 1000".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut total = 0usize;
    let mut peak = 0;
    while let Some(e) = ev.next().await {
        match e.unwrap() {
            ProcessEvent::Stdout(ch) => total += decode(&ch).len(),
            ProcessEvent::Dropped { bytes } => panic!("dropped {bytes}"),
            _ => {}
        }
        if total % (16 << 20) < 70_000 {
            peak = peak.max(d.rss_kib());
        }
    }
    assert!(total > 200_000_000, "{total}");
    let grew = peak.saturating_sub(before);
    assert!(
        grew < 64 * 1024,
        "daemon RSS grew by {grew} KiB for 270 MB of output"
    );
    c.delete_sandbox(&s.id).await.unwrap();
}
