//! The audit log: API actions (with who, what, which sandbox, outcome, when) and commands (argv, cwd,
//! user, exit, duration) are recorded completely and in order, can be filtered and exported as JSON
//! lines, outlive the sandbox, and survive a daemon restart.

use std::time::Duration;

use futures::StreamExt;

use moat_api::{AuditEntry, AuditQuery, CreateSandboxRequest, StartProcessRequest};

use crate::harness::*;

fn pos(entries: &[AuditEntry], f: impl Fn(&AuditEntry) -> bool, what: &str) -> usize {
    entries
        .iter()
        .position(f)
        .unwrap_or_else(|| panic!("no {what} in {entries:#?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn audit_log_records_a_session() {
    let tmp = tempfile::tempdir().unwrap();
    let (d, c) = busybox_daemon(tmp.path(), &[]).await;
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            metadata: env(&[("who", "audit-test")]),
            timeout: Some(120),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = s.id.clone();
    let out = sh(&c, &id, "echo hi; exit 3").await;
    assert_eq!(out.exit.exit_code, Some(3));
    let bg = c
        .start_process_background(
            &id,
            &StartProcessRequest {
                cmd: Some(vec!["sleep".into(), "1".into()]),
                tag: Some("napper".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    c.write_file(&id, "/tmp/a.txt", "hello", &Default::default())
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let bad = http
        .get(format!("{}/v1/sandboxes/{id}/files", d.url))
        .bearer_auth(d.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status().as_u16(), 400);
    let wrong = http
        .get(format!("{}/v1/sandboxes/{id}", d.url))
        .bearer_auth("moat_not-the-key")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    // The background command's exit is seen by the poller within a few seconds.
    for _ in 0..40 {
        let exits = c
            .sandbox_audit(
                &id,
                &AuditQuery {
                    action: Some("command.exit".into()),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        if exits
            .iter()
            .any(|e| e.detail["pid"].as_u64() == Some(u64::from(bg.pid)))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    c.delete_sandbox(&id).await.unwrap();
    let all = AuditQuery {
        limit: Some(10_000),
        ..Default::default()
    };
    let entries = c.sandbox_audit(&id, &all).await.unwrap();
    let actions: Vec<String> = entries
        .iter()
        .map(|e| format!("{} {:?}", e.action, e.status))
        .collect();
    let me = &entries[pos(&entries, |e| e.action == "POST /v1/sandboxes", "create")];
    assert_eq!(me.status, Some(201));
    assert_eq!(me.actor.len(), 12, "{me:?}");
    let create = pos(&entries, |e| e.action == "POST /v1/sandboxes", "create");
    let starts: Vec<usize> = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.action == "POST /v1/sandboxes/{id}/processes")
        .map(|(i, _)| i)
        .collect();
    assert_eq!(starts.len(), 2, "{actions:#?}");
    let fg_start = pos(
        &entries,
        |e| e.action == "command.start" && e.detail["pid"].as_u64() == Some(u64::from(out.pid)),
        "foreground command.start",
    );
    let fg_exit = pos(
        &entries,
        |e| e.action == "command.exit" && e.detail["pid"].as_u64() == Some(u64::from(out.pid)),
        "foreground command.exit",
    );
    let fg = &entries[fg_start];
    assert_eq!(fg.detail["argv"][0], "/bin/sh");
    assert_eq!(fg.detail["user"], "root");
    assert!(fg.detail["cwd"].is_string());
    assert_eq!(entries[fg_exit].status, Some(3));
    assert_eq!(entries[fg_exit].detail["exit_code"], 3);
    let bg_start = pos(
        &entries,
        |e| e.action == "command.start" && e.detail["pid"].as_u64() == Some(u64::from(bg.pid)),
        "background command.start",
    );
    let bg_exit = pos(
        &entries,
        |e| e.action == "command.exit" && e.detail["pid"].as_u64() == Some(u64::from(bg.pid)),
        "background command.exit",
    );
    assert_eq!(entries[bg_start].detail["tag"], "napper");
    assert_eq!(entries[bg_exit].detail["exit_code"], 0);
    let dur = entries[bg_exit].detail["duration_ms"].as_i64().unwrap();
    assert!(dur >= 1000, "background duration {dur} ms");
    let write = pos(
        &entries,
        |e| e.action == "PUT /v1/sandboxes/{id}/files" && e.status == Some(200),
        "file write",
    );
    let bad = pos(
        &entries,
        |e| e.action == "GET /v1/sandboxes/{id}/files" && e.status == Some(400),
        "bad request",
    );
    assert!(
        entries[bad].detail["error"].is_string(),
        "{:?}",
        entries[bad]
    );
    let unauth = pos(
        &entries,
        |e| e.status == Some(401) && e.actor == "anonymous",
        "401",
    );
    let delete = pos(
        &entries,
        |e| e.action == "DELETE /v1/sandboxes/{id}" && e.status == Some(204),
        "delete",
    );
    // In order: create, the first command's request, its start and exit, the background one, the write,
    // the bad request, the unauthorized one, the delete.
    assert!(
        create < starts[0] && starts[0] < fg_start && fg_start < fg_exit,
        "{actions:#?}"
    );
    assert!(starts[1] < bg_start && bg_start < bg_exit, "{actions:#?}");
    assert!(
        starts[1] < write && write < bad && bad < unauth && unauth < delete,
        "{actions:#?}"
    );
    for w in entries.windows(2) {
        assert!(w[0].at_ms <= w[1].at_ms, "not in time order: {w:#?}");
    }

    // Filters.
    let exits = c
        .audit(&AuditQuery {
            sandbox: Some(id.clone()),
            action: Some("command.exit".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(exits.len(), 2, "{exits:#?}");
    let anon = c
        .audit(&AuditQuery {
            actor: Some("anonymous".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(anon.iter().all(|e| e.actor == "anonymous") && !anon.is_empty());
    let since = c
        .audit(&AuditQuery {
            sandbox: Some(id.clone()),
            since: Some(entries[delete].at_ms.to_string()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(since.iter().all(|e| e.at_ms >= entries[delete].at_ms));
    let limited = c
        .audit(&AuditQuery {
            limit: Some(2),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(limited.len(), 2);
    let badq = http
        .get(format!("{}/v1/audit?since=yesterday", d.url))
        .bearer_auth(d.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(badq.status().as_u16(), 400);
    let body: serde_json::Value = badq.json().await.unwrap();
    assert_eq!(body["error"]["field"], "since");

    // Export as JSON lines.
    let export = http
        .get(format!(
            "{}/v1/audit?format=jsonl&limit=10000&sandbox={id}",
            d.url
        ))
        .bearer_auth(d.api_key())
        .send()
        .await
        .unwrap();
    assert_eq!(
        export.headers()["content-type"].to_str().unwrap(),
        "application/x-ndjson"
    );
    let text = export.text().await.unwrap();
    let lines: Vec<AuditEntry> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert!(lines.len() >= entries.len());
    assert_eq!(lines[..entries.len()], entries[..]);

    // The log survives a restart.
    d.stop();
    d.restart();
    let after = c.sandbox_audit(&id, &all).await.unwrap();
    assert!(after.len() >= entries.len());
    assert_eq!(after[..entries.len()], entries[..]);
    d.stop();
}

/// Thousands of commands that end at once, started faster than the daemon reads: each start and each
/// exit is in the log, once, the exit after its start, with its exit code. (Before the agent kept a
/// journal, the daemon polled its process list, which keeps the last 64 exits: most were missing.)
#[tokio::test(flavor = "multi_thread")]
async fn audit_log_keeps_every_short_command() {
    let tmp = tempfile::tempdir().unwrap();
    let (d, c) = busybox_daemon(tmp.path(), &[]).await;
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let id = s.id.clone();
    // Thousands on the container tier; fewer where each command costs more (a user-space kernel,
    // an emulated VM), still far past what a process list keeps.
    let n: usize = match isolation() {
        moat_api::Isolation::Container => 2000,
        moat_api::Isolation::Gvisor => 1000,
        _ => 300,
    };
    // At most 8 in flight.
    let pids: std::collections::BTreeMap<(u32, u64), usize> = futures::stream::iter(0..n)
        .map(|i| {
            let (c, id) = (c.clone(), id.clone());
            async move {
                let req = StartProcessRequest {
                    cmd: Some(vec!["sh".into(), "-c".into(), format!("exit {}", i % 7)]),
                    ..Default::default()
                };
                let p = c.start_process_background(&id, &req).await.unwrap();
                ((p.pid, p.started_at_us), i)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert_eq!(pids.len(), n);
    let q = |action: &str| AuditQuery {
        action: Some(action.into()),
        limit: Some(10_000),
        ..Default::default()
    };
    // The daemon reads the journal while commands run (every 2 s) and once more at the delete.
    tokio::time::sleep(Duration::from_secs(3)).await;
    c.delete_sandbox(&id).await.unwrap();
    let entries = c
        .sandbox_audit(
            &id,
            &AuditQuery {
                limit: Some(10_000),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(
        !entries.iter().any(|e| e.action == "command.lost"),
        "records lost"
    );
    let key = |e: &AuditEntry| {
        (
            e.detail["pid"].as_u64().unwrap() as u32,
            e.detail["started_at_us"].as_u64().unwrap(),
        )
    };
    let mut started = std::collections::BTreeMap::new();
    let mut exited = std::collections::BTreeMap::new();
    for (pos, e) in entries.iter().enumerate() {
        match e.action.as_str() {
            "command.start" => assert!(started.insert(key(e), pos).is_none(), "twice: {e:?}"),
            "command.exit" => assert!(exited.insert(key(e), pos).is_none(), "twice: {e:?}"),
            _ => {}
        }
    }
    assert_eq!(
        started.len(),
        n,
        "{} of {n} starts",
        c.sandbox_audit(&id, &q("command.start"))
            .await
            .unwrap()
            .len()
    );
    assert_eq!(exited.len(), n, "{} of {n} exits", exited.len());
    for (k, i) in &pids {
        let (Some(s), Some(x)) = (started.get(k), exited.get(k)) else {
            panic!("command {i} ({k:?}) missing from the log");
        };
        assert!(s < x, "command {i}: its exit comes before its start");
        let exit = &entries[*x];
        assert_eq!(exit.detail["exit_code"], (i % 7) as u64, "{exit:?}");
        assert_ne!(exit.detail["reason"], "sandbox_deleted", "{exit:?}");
    }
    d.stop();
}
