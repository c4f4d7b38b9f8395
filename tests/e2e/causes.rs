//! Failure causes as state (docs/failures.md): each cause provoked for real, then read back from the
//! API: a process the OOM killer ended, a fork refused at the pids limit, a full disk (conditions of
//! a running sandbox); a timeout, an idle timeout, a killed agent (a sandbox that ended, kept with
//! `state: ended`, the reason, the time and its last log lines). And idempotent creates: a create
//! whose answer was lost, retried with its key, gives the same sandbox.

use std::time::Duration;

use moat_api::{CreateSandboxRequest, Reason, SandboxState};

use crate::harness::*;

/// Waits (up to `secs`) for sandbox `id` to show a condition of `reason`.
async fn condition(
    c: &moat_client::Client,
    id: &str,
    reason: Reason,
    secs: u64,
) -> moat_api::Cause {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let s = c.get_sandbox(id).await.unwrap();
        if let Some(found) = s.conditions.iter().find(|c| c.reason == reason) {
            return found.clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no {} condition on {id}: {:?}",
            reason.as_str(),
            s.conditions
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (up to `secs`) for sandbox `id` to end; returns why.
async fn ended(c: &moat_client::Client, id: &str, secs: u64) -> moat_api::Cause {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let s = c.get_sandbox(id).await.unwrap();
        if s.state == SandboxState::Ended {
            return s.ended.expect("an ended sandbox says why");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{id} is still {:?}",
            s.state
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The fork bomb of the pids case: 60 children that end by themselves in 2 s.
const FORKS: &str = r#"python3 -c '
import os, time
refused = 0
for i in range(60):
    try:
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
    except OSError:
        refused += 1
print("refused", refused)
'; sleep 3"#;

/// A process over the memory limit, then its exit status.
const MEMORY_BOMB: &str = "python3 -c 'x = bytearray(512 << 20)'; echo rc=$?";

/// What each tier lets the host see: on the container tier the kernel names the process its OOM
/// killer ended and the fork it refused in the sandbox's own cgroup; on gvisor the OOM killer ends
/// the Sentry (the sandbox ends with `oom`) and forks are the Sentry's own business; a microVM's
/// guest kernel kills and refuses inside the VM, unseen by the host. The disk condition is read
/// from the quota image on the host (container and gvisor; a VM's disk is its own filesystem).
#[tokio::test]
async fn what_degraded_a_running_sandbox_is_part_of_its_state() {
    let c = shared_client();
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("base".into()),
            timeout: Some(300),
            memory_mb: Some(128),
            pids: Some(40),
            disk_mb: Some(64),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(c.get_sandbox(&s.id).await.unwrap().conditions.is_empty());
    let tier = isolation();

    if tier != moat_api::Isolation::Microvm {
        // Writing past the disk quota fails with ENOSPC, and the sandbox says its disk is full.
        let out = sh(
            &c,
            &s.id,
            "dd if=/dev/zero of=/home/user/fill bs=1M count=100 2>&1; sync; echo rc=$?",
        )
        .await;
        assert!(out.stdout.contains("No space left"), "{out:?}");
        let disk = condition(&c, &s.id, Reason::DiskFull, 10).await;
        assert!(disk.message.contains("64 MiB"), "{disk:?}");
        sh(&c, &s.id, "rm -f /home/user/fill").await;
    }

    match tier {
        moat_api::Isolation::Container => {
            // The OOM killer ends the process; the sandbox lives on and says which process.
            let out = sh(&c, &s.id, MEMORY_BOMB).await;
            assert!(out.stdout.contains("rc=137"), "{out:?}");
            let oom = condition(&c, &s.id, Reason::Oom, 10).await;
            assert!(
                oom.process
                    .as_deref()
                    .is_some_and(|p| p.contains("python3")),
                "{oom:?}"
            );
            assert!(oom.message.contains("128 MiB"), "{oom:?}");
            // Forks past the pids limit are refused.
            let out = sh(&c, &s.id, FORKS).await;
            assert!(
                out.stdout.contains("refused") && !out.stdout.contains("refused 0"),
                "{out:?}"
            );
            let pids = condition(&c, &s.id, Reason::PidsExhausted, 10).await;
            assert!(pids.message.contains("40"), "{pids:?}");
            let s = c.get_sandbox(&s.id).await.unwrap();
            assert_eq!(s.state, SandboxState::Running);
            let mut reasons: Vec<_> = s.conditions.iter().map(|c| c.reason).collect();
            reasons.sort_by_key(|r| r.as_str());
            assert_eq!(
                reasons,
                [Reason::DiskFull, Reason::Oom, Reason::PidsExhausted]
            );
            c.delete_sandbox(&s.id).await.unwrap();
        }
        moat_api::Isolation::Gvisor => {
            // The host's OOM killer ends the Sentry: the sandbox ends, and says so.
            let _ = try_run_req(
                &c,
                &s.id,
                moat_api::StartProcessRequest {
                    cmd: Some(vec!["/bin/sh".into(), "-c".into(), MEMORY_BOMB.into()]),
                    ..Default::default()
                },
            )
            .await;
            let end = ended(&c, &s.id, 30).await;
            assert_eq!(end.reason, Reason::Oom, "{end:?}");
            assert!(end.message.contains("128 MiB"), "{end:?}");
        }
        moat_api::Isolation::Microvm => {
            // The guest's kernel ends the process inside the VM; the sandbox lives on. The host's
            // log says nothing of it, so no condition is claimed (docs/failures.md).
            let out = sh(&c, &s.id, MEMORY_BOMB).await;
            assert!(out.stdout.contains("rc=137"), "{out:?}");
            let s = c.get_sandbox(&s.id).await.unwrap();
            assert_eq!(s.state, SandboxState::Running);
            assert!(s.conditions.is_empty(), "{:?}", s.conditions);
            c.delete_sandbox(&s.id).await.unwrap();
        }
    }
}

#[tokio::test]
async fn a_sandbox_that_ended_on_its_own_says_why_and_when() {
    let c = shared_client();
    let make = |timeout, idle| CreateSandboxRequest {
        template: Some("base".into()),
        timeout: Some(timeout),
        idle_timeout: idle,
        ..Default::default()
    };
    let timed = c.create_sandbox(&make(2, None)).await.unwrap();
    let idle = c.create_sandbox(&make(300, Some(2))).await.unwrap();
    let killed = c.create_sandbox(&make(300, None)).await.unwrap();
    assert_eq!(sh(&c, &killed.id, "echo up").await.stdout, "up\n");

    // Its agent (the container's PID 1, gVisor's Sentry, the VM's QEMU) killed from the host.
    let main = main_pid(&cgroup_procs(&killed.id));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(main as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();

    let t = ended(&c, &timed.id, 30).await;
    assert_eq!(t.reason, Reason::Timeout, "{t:?}");
    // `idle` is looked at without touching its idle clock only through the list of ended ones.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let i = loop {
        let list = c
            .list_sandboxes(&moat_client::SandboxFilter {
                state: Some(SandboxState::Ended),
                ..Default::default()
            })
            .await
            .unwrap();
        if let Some(s) = list.into_iter().find(|s| s.id == idle.id) {
            break s.ended.unwrap();
        }
        assert!(std::time::Instant::now() < deadline, "idle never ended");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(i.reason, Reason::Idle, "{i:?}");
    let k = ended(&c, &killed.id, 30).await;
    assert_eq!(k.reason, Reason::AgentLost, "{k:?}");
    if is_container() {
        // The agent's own log, kept with its end.
        assert!(
            k.log.iter().any(|l| l.contains("moat-agent")),
            "{:?}",
            k.log
        );
    }
    for cause in [&t, &i, &k] {
        assert!(chrono_like(&cause.at), "an RFC 3339 time: {:?}", cause.at);
    }
    // Every other call on it is a 404 that says why.
    let e = c.delete_sandbox(&timed.id).await.unwrap_err();
    assert!(e.is_not_found());
    assert!(e.to_string().contains("(timeout)"), "{e}");
    // The default list has only the living.
    let live = c.list_sandboxes(&Default::default()).await.unwrap();
    assert!(live.iter().all(|s| s.state != SandboxState::Ended));
}

fn chrono_like(at: &str) -> bool {
    at.len() >= 20 && at.as_bytes()[4] == b'-' && at.contains('T')
}

#[tokio::test]
async fn a_create_retried_with_its_idempotency_key_gives_the_same_sandbox() {
    let d = shared();
    let key = format!("retry-{}", std::process::id());
    let body = serde_json::json!({
        "template": "base",
        "timeout": 300,
        "metadata": {"idem": key},
    });
    let http = reqwest::Client::new();
    let post = |body: &serde_json::Value, timeout: Duration| {
        http.post(format!("{}/v1/sandboxes", d.url))
            .bearer_auth(d.api_key())
            .header("Idempotency-Key", &key)
            .timeout(timeout)
            .json(body)
            .send()
    };
    // The first answer is lost: the client gives up before the daemon answers.
    let lost = post(&body, Duration::from_millis(5)).await;
    assert!(lost.is_err(), "the create answered in under 5 ms: {lost:?}");
    // The retry waits for the create in flight and returns its sandbox.
    let r = post(&body, Duration::from_secs(120)).await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(
        r.headers()
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    let first: moat_api::Sandbox = r.json().await.unwrap();
    let again: moat_api::Sandbox = post(&body, Duration::from_secs(120))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again.id, first.id);
    let c = d.client();
    let mine = c
        .list_sandboxes(&moat_client::SandboxFilter {
            metadata: [("idem".to_string(), key.clone())].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(mine.len(), 1, "one sandbox for the key: {mine:?}");
    // Another body under the same key: 422 naming the header.
    let mut other = body.clone();
    other["timeout"] = serde_json::json!(301);
    let r = post(&other, Duration::from_secs(120)).await.unwrap();
    assert_eq!(r.status(), 422);
    let err: moat_api::ErrorBody = r.json().await.unwrap();
    assert_eq!(err.error.field.as_deref(), Some("Idempotency-Key"));
    c.delete_sandbox(&first.id).await.unwrap();
}
