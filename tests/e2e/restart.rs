//! kill -9 of the daemon: running sandboxes are re-adopted, their processes and timeouts go on, and
//! leftovers of a crash are swept.

use std::time::Duration;

use futures::StreamExt;
use moat_api::{CreateSandboxRequest, ProcessEvent, RegisterTemplateRequest, StartProcessRequest};

use crate::harness::*;

#[tokio::test(flavor = "multi_thread")]
async fn sandboxes_survive_daemon_kill9() {
    let tmp = tempfile::tempdir().unwrap();
    // The data dir sits under a directory only host root may enter (like /root): sandboxes must start
    // all the same (their root is an unprivileged host uid).
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let rootfs = busybox_rootfs(tmp.path());
    let d = Daemon::start(&tmp.path().join("data"));
    let c = d.client();
    c.register_template(&RegisterTemplateRequest {
        name: "bb".into(),
        path: rootfs.display().to_string(),
    })
    .await
    .unwrap();
    let keep = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bb".into()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let short = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bb".into()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let bg = StartProcessRequest {
        command: Some("i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done".into()),
        background: true,
        tag: Some("ticker".into()),
        ..Default::default()
    };
    let ticker = c.start_process_background(&keep.id, &bg).await.unwrap();
    let keep_facts = host_facts(&keep.id);
    let short_facts = host_facts(&short.id);
    // A full-state snapshot (gvisor) outlives the daemon: sandboxes started from it after the
    // restart continue its processes.
    let full = if is_container() {
        None
    } else {
        let snap = c
            .create_snapshot(
                &keep.id,
                &moat_api::CreateSnapshotRequest {
                    kind: Some(moat_api::SnapshotKind::Full),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        Some(snap)
    };
    let keep_facts = if full.is_some() {
        // The snapshot restored the sandbox's Sentry: new host processes.
        host_facts(&keep.id)
    } else {
        keep_facts
    };

    d.kill9();
    // While the daemon is down the sandbox goes on running.
    assert!(keep_facts
        .pids
        .iter()
        .all(|p| std::path::Path::new(&format!("/proc/{p}")).exists()));
    d.restart();
    let c = d.client();

    let listed: Vec<_> = c
        .list_sandboxes(&Default::default())
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert!(
        listed.contains(&keep.id) && listed.contains(&short.id),
        "{listed:?}"
    );
    let out = sh(&c, &keep.id, "echo still here").await;
    assert_eq!(out.stdout, "still here\n");
    let procs = c.list_processes(&keep.id).await.unwrap();
    assert!(
        procs.iter().any(|p| p.pid == ticker.pid && p.running),
        "{procs:?}"
    );
    // Re-attach to output produced before and after the crash.
    let mut ev = c.attach(&keep.id, "ticker", true).await.unwrap();
    let mut text = Vec::new();
    while let Some(e) = ev.next().await {
        if let ProcessEvent::Stdout(ch) = e.unwrap() {
            text.extend(decode(&ch));
            if String::from_utf8_lossy(&text).contains("tick 3\n") {
                break;
            }
        }
    }
    assert!(String::from_utf8_lossy(&text).starts_with("tick 0\n"));
    if let Some(snap) = &full {
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
        let procs = c.list_processes(&forks[0].id).await.unwrap();
        assert!(
            procs.iter().any(|p| p.pid == ticker.pid && p.running),
            "{procs:?}"
        );
        c.delete_sandbox(&forks[0].id).await.unwrap();
    }

    // Timeouts still fire after the restart.
    c.set_timeout(&short.id, 1).await.unwrap();
    let gone = eventually(Duration::from_secs(15), || {
        !sandbox_dir(&d.data_dir, &short.id).exists()
    })
    .await;
    assert!(gone, "timeout did not fire after restart");
    wait_not_found(&c, &short.id).await;
    assert_no_leaks(&short_facts, &d.data_dir);

    // A sandbox whose processes died while the daemon was down is cleaned up at the next start,
    // and so are leftovers no database row owns (a crash mid-create).
    d.kill9();
    for p in &keep_facts.pids {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*p as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let orphan = sandbox_dir(&d.data_dir, "sbx_orphanorphanorphanorphanor");
    std::fs::create_dir_all(orphan.join("upper")).unwrap();
    let parent = moat_daemon::host::cgroup::parent_for(&d.data_dir);
    let orphan_cgroup = std::path::Path::new("/sys/fs/cgroup/pids")
        .join(&parent)
        .join("sbx_orphanorphanorphanorphanor");
    std::fs::create_dir_all(&orphan_cgroup).unwrap();
    // A checkpoint image without a snapshot (a crash between writing and recording it).
    let orphan_image = d
        .data_dir
        .join("checkpoints/snap_orphanorphanorphanorphanor");
    std::fs::create_dir_all(&orphan_image).unwrap();
    std::fs::write(orphan_image.join("checkpoint.img"), "x").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    d.restart();
    let c = d.client();
    assert!(
        !orphan_image.exists(),
        "leftover checkpoint image not swept"
    );
    if let Some(snap) = &full {
        assert!(d.data_dir.join("checkpoints").join(&snap.id).is_dir());
    }
    assert!(crate::harness::gone(&c, &keep.id).await.is_some());
    assert_no_leaks(&keep_facts, &d.data_dir);
    assert!(!orphan.exists(), "leftover sandbox dir not swept");
    assert!(!orphan_cgroup.exists(), "leftover cgroup not swept");
    d.stop();
}
