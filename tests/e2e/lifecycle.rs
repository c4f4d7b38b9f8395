//! Sandbox lifecycle: create with options, list and filter, timeouts, concurrent creates, no leaks.

use std::time::Duration;

use moat_api::{CreateSandboxRequest, SandboxState};
use moat_client::SandboxFilter;

use crate::harness::*;

#[tokio::test(flavor = "multi_thread")]
async fn create_list_filter_get_and_limits() {
    let d = shared();
    let c = d.client();
    let tag = format!("run-{}", std::process::id());
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("base".into()),
            timeout: Some(120),
            env: env(&[("PROJECT", "moat")]),
            metadata: env(&[("suite", &tag), ("role", "lifecycle")]),
            cpu: Some(0.5),
            memory_mb: Some(256),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(s.id.starts_with("sbx_") && s.id.len() == 30);
    assert_eq!(s.state, SandboxState::Running);
    assert_eq!(s.env_keys, vec!["PROJECT".to_string()]);
    assert_eq!((s.cpu, s.memory_mb), (0.5, 256));
    // A microVM under TCG says so in its own info, as the daemon's tier list does; no other
    // sandbox carries a note.
    let tier_note = c
        .health()
        .await
        .unwrap()
        .tiers
        .into_iter()
        .find(|t| t.isolation == isolation())
        .and_then(|t| t.note)
        .unwrap_or_default();
    if isolation() == moat_api::Isolation::Microvm && tier_note.contains("TCG") {
        let note = s.isolation_note.clone().expect("a TCG microVM's note");
        assert!(note.contains("TCG") && note.contains("slower"), "{note}");
        assert_eq!(
            c.get_sandbox(&s.id).await.unwrap().isolation_note,
            Some(note)
        );
    } else {
        assert_eq!(s.isolation_note, None, "{tier_note}");
    }
    let out = sh(&c, &s.id, "echo $PROJECT").await;
    assert_eq!(out.stdout, "moat\n");

    // Limits reached the cgroup.
    let mem = cgroup_file(&s.id, "memory", "memory.limit_in_bytes")
        .or_else(|_| cgroup_file(&s.id, "memory", "memory.max"))
        .unwrap();
    if isolation() == moat_api::Isolation::Microvm {
        // A microVM's limit is its guest's: the cgroup of the sandbox's processes inside; the host
        // cgroup bounds QEMU (guest memory and its own).
        let inside = sh(&c, &s.id, "cat /sys/fs/cgroup/sandbox/memory.max").await;
        assert_eq!(inside.stdout.trim(), (256u64 << 20).to_string());
        assert!(mem.trim().parse::<u64>().unwrap() > 256 << 20, "{mem}");
    } else {
        assert_eq!(mem.trim(), (256u64 << 20).to_string());
    }

    let other = create(&c, "base").await;
    let found = c
        .list_sandboxes(&SandboxFilter {
            metadata: env(&[("suite", &tag)]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        found.iter().map(|x| x.id.as_str()).collect::<Vec<_>>(),
        vec![s.id.as_str()]
    );
    let none = c
        .list_sandboxes(&SandboxFilter {
            metadata: env(&[("suite", &tag), ("role", "other")]),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(none.is_empty());
    let running = c
        .list_sandboxes(&SandboxFilter {
            state: Some(SandboxState::Running),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(running.iter().any(|x| x.id == other.id) && running.iter().any(|x| x.id == s.id));

    let got = c.get_sandbox(&s.id).await.unwrap();
    assert_eq!(
        got.metadata.get("role").map(String::as_str),
        Some("lifecycle")
    );
    let before = got.expires_at.clone();
    let extended = c.set_timeout(&s.id, 3600).await.unwrap();
    assert!(
        extended.expires_at > before,
        "{} !> {before}",
        extended.expires_at
    );

    for id in [&s.id, &other.id] {
        let facts = host_facts(id);
        c.delete_sandbox(id).await.unwrap();
        assert_no_leaks(&facts, &d.data_dir);
        assert!(c.get_sandbox(id).await.unwrap_err().is_not_found());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn timeout_kills_and_cleans_up() {
    let d = shared();
    let c = d.client();
    // Long enough for the first command to finish before the timeout: an emulated (TCG) guest
    // booted beside the other tests' guests on two cores takes seconds for it.
    let timeout = if isolation() == moat_api::Isolation::Microvm {
        15
    } else {
        2
    };
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("base".into()),
            timeout: Some(timeout),
            ..Default::default()
        })
        .await
        .unwrap();
    sh(&c, &s.id, "sleep 1000 > /dev/null 2>&1 &").await;
    let facts = host_facts(&s.id);
    let gone = eventually(Duration::from_secs(15 + timeout), || {
        !sandbox_dir(&d.data_dir, &s.id).exists()
    })
    .await;
    assert!(gone, "sandbox still there after its timeout");
    wait_not_found(&c, &s.id).await;
    assert_no_leaks(&facts, &d.data_dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn twenty_concurrent_creates() {
    let c = shared_client();
    let creates = (0..20).map(|_| {
        let c = c.clone();
        async move { create(&c, "base").await }
    });
    let sandboxes = futures::future::join_all(creates).await;
    let mut ids: Vec<_> = sandboxes.iter().map(|s| s.id.clone()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 20);
    let runs = sandboxes.iter().map(|s| {
        let c = c.clone();
        let id = s.id.clone();
        async move { sh(&c, &id, "hostname").await.stdout }
    });
    let names = futures::future::join_all(runs).await;
    for (s, name) in sandboxes.iter().zip(names) {
        assert_eq!(name.trim(), s.hostname);
    }
    let deletes = ids.iter().map(|id| {
        let c = c.clone();
        let id = id.clone();
        async move { c.delete_sandbox(&id).await }
    });
    for r in futures::future::join_all(deletes).await {
        r.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sandbox_whose_pid1_dies_is_removed() {
    use futures::StreamExt;
    let d = shared();
    let c = d.client();
    let s = create(&c, "base").await;
    let facts = host_facts(&s.id);
    let pid1 = *facts.pids.iter().min().unwrap();
    // A command streaming its output when the sandbox dies under it.
    let mut events = c
        .start_process_stream(
            &s.id,
            &moat_api::StartProcessRequest {
                command: Some("echo up; sleep 120".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    loop {
        match events.next().await {
            Some(Ok(moat_api::ProcessEvent::Stdout(o))) if o.data.as_deref() == Some("up\n") => {
                break
            }
            Some(Ok(_)) => continue,
            other => panic!("before the kill: {other:?}"),
        }
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid1 as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    // The stream ends with an error event that says so, not with a silent stop.
    let mut last = None;
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(30), events.next())
        .await
        .expect("the stream of a dead sandbox's command stays open")
    {
        last = Some(ev.unwrap());
    }
    assert!(
        matches!(&last, Some(moat_api::ProcessEvent::Error { message }) if message.contains(&s.id)),
        "the stream ended with {last:?}"
    );
    let gone = eventually(Duration::from_secs(15), || {
        !sandbox_dir(&d.data_dir, &s.id).exists()
    })
    .await;
    assert!(gone, "sandbox with a dead PID 1 was not removed");
    wait_not_found(&c, &s.id).await;
    // Where it went is said: in its state (`ended`), in every other call's 404, and in the
    // audit log.
    let info = c.get_sandbox(&s.id).await.unwrap();
    assert_eq!(info.state, moat_api::SandboxState::Ended);
    let why = info.ended.expect("an ended sandbox says why").reason;
    assert!(
        matches!(why, moat_api::Reason::AgentLost | moat_api::Reason::Oom),
        "ended by {why:?}"
    );
    let err = c.sandbox_stats(&s.id).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        err.is_not_found() && (msg.contains("agent_lost") || msg.contains("oom")),
        "the 404 does not say why: {msg}"
    );
    let ended = c
        .sandbox_audit(
            &s.id,
            &moat_api::AuditQuery {
                action: Some("sandbox.ended".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert_eq!(ended[0].detail["reason"], "agent_lost", "{ended:?}");
    assert_no_leaks(&facts, &d.data_dir);
}
