//! Snapshots, fork, reset, pause/resume and on_timeout=pause, on real sandboxes.

use std::time::Duration;

use moat_api::{
    CreateSandboxRequest, CreateSnapshotRequest, ErrorCode, ForkRequest, OnTimeout, ResetRequest,
    ResumeRequest, SandboxState, SnapshotKind, StartProcessRequest,
};
use moat_client::Client;

use crate::harness::*;

/// Status, code and field of a failed call.
fn api_err<T: std::fmt::Debug>(r: moat_client::Result<T>) -> (u16, ErrorCode, Option<String>) {
    match r {
        Err(moat_client::Error::Api { status, body }) => {
            (status, body.error.code, body.error.field)
        }
        other => panic!("expected an API error, got {other:?}"),
    }
}

/// A fingerprint of the parts of the filesystem the tests change: every entry's path, type, mode,
/// owner and size, and every regular file's content; but /etc/machine-id, which every sandbox gets
/// its own of (docs/snapshots.md, "Fork safety"; tests/e2e/forksafety.rs).
const FINGERPRINT: &str = "cd / && find root etc opt home usr/local -xdev ! -path etc/machine-id \
    -printf '%p %y %m %u %g %s %l\\n' 2>/dev/null | sort | sha256sum && \
    find root etc opt home usr/local -xdev -type f ! -path etc/machine-id -print0 2>/dev/null | \
    sort -z | xargs -0 sha256sum | sha256sum";

async fn fingerprint(c: &Client, id: &str) -> String {
    let out = sh(c, id, FINGERPRINT).await;
    assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    out.stdout
}

/// Changes of every kind a layer must carry: new files and directories, a setuid bit, a file owned by
/// another user, a deleted template file (whiteout), a replaced template directory (opaque), a
/// symlink, a hard link and (container tier) a fifo. A gvisor sandbox's named pipes live in gVisor's
/// memory, not in its files (docs/gvisor-tier.md), so no snapshot carries them there.
const CHANGES_ALL_TIERS: &str = "set -e; echo hello > /root/hello.txt; mkdir -p /opt/app/data; \
    head -c 300000 /dev/urandom > /opt/app/data/blob; chmod 4755 /opt/app/data/blob; \
    useradd -m alice; echo mine > /home/alice/own; chown alice:alice /home/alice/own; \
    rm /etc/motd; rm -rf /etc/apt && mkdir /etc/apt && echo only > /etc/apt/only; \
    ln -s /root/hello.txt /opt/app/link; ln /root/hello.txt /opt/app/hard";

fn changes() -> String {
    if is_container() {
        format!("{CHANGES_ALL_TIERS}; mkfifo /opt/app/fifo")
    } else {
        CHANGES_ALL_TIERS.to_string()
    }
}

async fn snapshot(c: &Client, id: &str, name: Option<&str>) -> moat_api::Snapshot {
    c.create_snapshot(
        id,
        &CreateSnapshotRequest {
            name: name.map(str::to_string),
            ..Default::default()
        },
    )
    .await
    .expect("snapshot")
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_fork_ten_share_layers_and_diverge() {
    let c = shared_client();
    let src = create(&c, "base").await;
    let out = sh(&c, &src.id, &changes()).await;
    assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    let before = fingerprint(&c, &src.id).await;

    let snap = snapshot(&c, &src.id, None).await;
    assert_eq!(snap.layers.len(), 1);
    assert!(snap.layers[0].starts_with("sha256:"), "{snap:?}");
    assert!(snap.size_bytes >= 300_000, "{snap:?}");
    // Taking it did not change the source, and the source goes on running.
    assert_eq!(fingerprint(&c, &src.id).await, before);

    let forks = c
        .fork(
            &snap.id,
            &ForkRequest {
                count: 10,
                timeout: Some(600),
                ..Default::default()
            },
        )
        .await
        .expect("fork 10");
    assert_eq!(forks.len(), 10);
    for (i, f) in forks.iter().enumerate() {
        assert_eq!(f.snapshot.as_deref(), Some(snap.id.as_str()));
        assert_eq!(
            f.metadata.get("moat.fork-index").map(String::as_str),
            Some(i.to_string().as_str())
        );
    }
    // Every fork sees exactly the snapshot's files, with owners, modes and deletions intact.
    for f in &forks {
        assert_eq!(fingerprint(&c, &f.id).await, before, "fork {}", f.id);
        let out = sh(
            &c,
            &f.id,
            // find(1) rather than coreutils' stat and ls: those fail on this host's gVisor (statx
            // with AT_NO_AUTOMOUNT, docs/gvisor-tier.md), and the test is about the files.
            "find /opt/app/data/blob /home/alice/own -printf '%M %u\\n'; test ! -e /etc/motd && echo no-motd; \
             find /etc/apt -mindepth 1 -printf '%f\\n'; readlink /opt/app/link; \
             find /opt/app/hard -printf '%n\\n'; test -p /opt/app/fifo && echo fifo",
        )
        .await;
        let fifo = if is_container() { "fifo\n" } else { "" };
        assert_eq!(
            out.stdout,
            format!("-rwsr-xr-x root\n-rw-r--r-- alice\nno-motd\nonly\n/root/hello.txt\n2\n{fifo}"),
            "{out:?}"
        );
    }
    // Each diverges on its own: a write in one is seen by no other, nor by the source.
    for (i, f) in forks.iter().enumerate() {
        let out = sh(
            &c,
            &f.id,
            &format!("echo {i} > /root/mine; rm /root/hello.txt"),
        )
        .await;
        assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    }
    for (i, f) in forks.iter().enumerate() {
        let out = sh(&c, &f.id, "cat /root/mine; find /root -mindepth 1 -maxdepth 1 -not -name '.*' -printf '%f\\n' | sort").await;
        assert_eq!(out.stdout, format!("{i}\nmine\n"), "fork {i}");
    }
    assert_eq!(fingerprint(&c, &src.id).await, before);
    // Nothing was copied per fork: each one's writable layer holds only what it wrote (less than the
    // 300 KB blob; on microvm it counts the blocks of the VM's disk the guest wrote, its ext4 journal
    // and metadata included, about 200 KB for these two changes).
    let stats = c.sandbox_stats(&forks[0].id).await.unwrap();
    let most = if isolation() == moat_api::Isolation::Microvm {
        280_000
    } else {
        200_000
    };
    assert!(stats.disk_bytes < most, "{stats:?}");

    // The layer lives as long as a snapshot or sandbox uses it.
    let layer_dir = shared()
        .data_dir
        .join("layers")
        .join(snap.layers[0].trim_start_matches("sha256:"));
    assert!(layer_dir.is_dir(), "{}", layer_dir.display());
    // `system df` counts the layer once, however many forks use it.
    let df = c.disk_usage().await.unwrap();
    assert!(df.layers.count >= 1 && df.snapshots >= 1, "{df:?}");
    assert!(df.layers.bytes >= snap.size_bytes, "{df:?}");
    assert!(df.sandboxes.count >= 11, "{df:?}");
    assert!(
        df.templates.iter().any(|t| t.name == "base" && t.bytes > 0),
        "{df:?}"
    );
    c.delete_snapshot(&snap.id).await.unwrap();
    assert!(c.get_snapshot(&snap.id).await.unwrap_err().is_not_found());
    assert!(layer_dir.is_dir(), "a running fork still uses the layer");
    assert_eq!(fingerprint(&c, &forks[3].id).await.len(), before.len());
    for f in &forks {
        c.delete_sandbox(&f.id).await.unwrap();
    }
    assert!(!layer_dir.exists(), "unused layer was not removed");
    c.delete_sandbox(&src.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshots_stack_and_reset_returns_the_exact_state_every_time() {
    let c = shared_client();
    let src = create(&c, "base").await;
    assert_eq!(sh(&c, &src.id, &changes()).await.exit.exit_code, Some(0));
    let first = snapshot(&c, &src.id, None).await;
    // A sandbox from the snapshot, changed again and snapshotted: a second layer on the first.
    let mid = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(first.id.clone()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(mid.template, "base");
    let out = sh(
        &c,
        &mid.id,
        "echo second > /root/second; rm /root/hello.txt",
    )
    .await;
    assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    let name = format!("episode-{}", &mid.id[4..12]);
    let second = snapshot(&c, &mid.id, Some(&name)).await;
    assert_eq!(second.layers.len(), 2);
    assert_eq!(second.layers[0], first.layers[0]);
    assert_eq!(c.get_snapshot(&name).await.unwrap().id, second.id);

    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            snapshot: Some(name.clone()),
            timeout: Some(600),
            ..Default::default()
        })
        .await
        .unwrap();
    let start = fingerprint(&c, &sbx.id).await;
    assert_eq!(
        sh(&c, &sbx.id, "cat /root/second; find /root -mindepth 1 -maxdepth 1 -not -name '.*' -printf '%f\\n' | sort").await.stdout,
        "second\nsecond\n"
    );
    // 100 episodes; 10 on microvm, where a reset boots a VM (seconds under TCG, see
    // docs/microvm-tier.md) and the loop would take the suite's whole budget.
    let episodes = if isolation() == moat_api::Isolation::Microvm {
        10
    } else {
        100
    };
    for i in 0..episodes {
        // An episode: change files of every kind, leave a process running.
        let out = sh(
            &c,
            &sbx.id,
            &format!(
                "echo {i} > /root/second; rm -rf /opt/app; mkdir -p /usr/local/ep{i}; \
                 chmod 700 /home/alice; touch /etc/new{i}; (sleep 1000 &)"
            ),
        )
        .await;
        assert_eq!(out.exit.exit_code, Some(0), "episode {i}: {out:?}");
        let reset = c
            .reset_sandbox(&sbx.id, &ResetRequest::default())
            .await
            .unwrap_or_else(|e| panic!("reset {i}: {e}"));
        assert_eq!(reset.id, sbx.id);
        assert_eq!(reset.state, SandboxState::Running);
        assert_eq!(fingerprint(&c, &sbx.id).await, start, "after reset {i}");
    }
    // No process of an earlier episode survives a reset.
    let procs = c.list_processes(&sbx.id).await.unwrap();
    assert!(procs.iter().all(|p| !p.running), "{procs:?}");

    // Reset to another snapshot of the same template.
    c.reset_sandbox(
        &sbx.id,
        &ResetRequest {
            snapshot: Some(first.id.clone()),
        },
    )
    .await
    .unwrap();
    assert_eq!(
        sh(&c, &sbx.id, "cat /root/hello.txt").await.stdout,
        "hello\n"
    );
    assert_eq!(
        c.get_sandbox(&sbx.id).await.unwrap().snapshot.as_deref(),
        Some(first.id.as_str())
    );

    for id in [&src.id, &mid.id, &sbx.id] {
        c.delete_sandbox(id).await.unwrap();
    }
    for s in [&first.id, &second.id] {
        c.delete_snapshot(s).await.unwrap();
    }
}

/// CPU time of the sandbox's cgroup, µs, read on the host.
async fn cpu_us(c: &Client, id: &str) -> u64 {
    c.sandbox_stats(id).await.unwrap().cpu_usage_us
}

async fn count(c: &Client, id: &str) -> u64 {
    let out = sh(c, id, "cat /root/count").await;
    out.stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{out:?}"))
}

const COUNTER: &str = "i=0; while true; do i=$((i+1)); echo $i > /root/count.tmp; \
    mv /root/count.tmp /root/count; done";

#[tokio::test(flavor = "multi_thread")]
async fn pause_stops_cpu_and_resume_continues_the_count() {
    let c = shared_client();
    let sbx = create(&c, "base").await;
    c.start_process_background(
        &sbx.id,
        &StartProcessRequest {
            command: Some(COUNTER.into()),
            background: true,
            tag: Some("counter".into()),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    // The counter's first values (a loaded host may take a while to start it in an emulated VM).
    let mut counted = false;
    for _ in 0..100 {
        let out = sh(&c, &sbx.id, "cat /root/count 2>/dev/null").await;
        if out.stdout.trim().parse::<u64>().is_ok_and(|n| n > 0) {
            counted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(counted, "the counter did not start");

    let paused = c.pause_sandbox(&sbx.id).await.unwrap();
    assert_eq!(paused.sandbox.state, SandboxState::Paused);
    assert!(paused.processes_kept);
    // Frozen: no CPU time accrues, read from the host's cgroup accounting.
    let a = cpu_us(&c, &sbx.id).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let b = cpu_us(&c, &sbx.id).await;
    if isolation() == moat_api::Isolation::Microvm {
        // The cgroup holds QEMU, whose main loop may still wake while its vCPUs are stopped; the
        // spinning counter would have used the whole 1.5 s.
        assert!(b - a < 50_000, "a paused VM used {} µs of CPU", b - a);
    } else {
        assert_eq!(a, b, "a paused sandbox used CPU");
    }
    // Commands are refused with a clear answer; pausing again is a conflict.
    let (status, code, _) = api_err(c.list_processes(&sbx.id).await);
    assert_eq!((status, code), (409, ErrorCode::Conflict));
    assert_eq!(api_err(c.pause_sandbox(&sbx.id).await).0, 409);
    // A paused sandbox does not expire and can be snapshotted (it stays paused).
    let snap = snapshot(&c, &sbx.id, None).await;
    assert_eq!(
        c.get_sandbox(&sbx.id).await.unwrap().state,
        SandboxState::Paused
    );

    let resumed = c
        .resume_sandbox(&sbx.id, &ResumeRequest { timeout: Some(600) })
        .await
        .unwrap();
    assert_eq!(resumed.sandbox.state, SandboxState::Running);
    // The counter goes on from where it stopped: the value right after resume is the value at pause
    // (the file in the snapshot) plus what it counted since.
    let at_pause = {
        let s = c
            .create_sandbox(&CreateSandboxRequest {
                snapshot: Some(snap.id.clone()),
                timeout: Some(60),
                ..Default::default()
            })
            .await
            .unwrap();
        let n = count(&c, &s.id).await;
        c.delete_sandbox(&s.id).await.unwrap();
        n
    };
    let after = count(&c, &sbx.id).await;
    assert!(after >= at_pause, "count went back: {after} < {at_pause}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        count(&c, &sbx.id).await > after,
        "the counter did not go on"
    );
    let procs = c.list_processes(&sbx.id).await.unwrap();
    assert!(
        procs
            .iter()
            .any(|p| p.tag.as_deref() == Some("counter") && p.running),
        "{procs:?}"
    );
    assert_eq!(
        api_err(c.resume_sandbox(&sbx.id, &ResumeRequest::default()).await).0,
        409
    );
    c.delete_sandbox(&sbx.id).await.unwrap();
    c.delete_snapshot(&snap.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn on_timeout_pause_pauses_instead_of_killing() {
    let c = shared_client();
    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(2),
            on_timeout: Some(OnTimeout::Pause),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(sbx.on_timeout, OnTimeout::Pause);
    assert_eq!(
        sh(&c, &sbx.id, "echo kept > /root/f").await.exit.exit_code,
        Some(0)
    );
    let mut state = SandboxState::Running;
    for _ in 0..100 {
        state = c.get_sandbox(&sbx.id).await.unwrap().state;
        if state != SandboxState::Running {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(state, SandboxState::Paused);
    // Long past its timeout it is still there, paused.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        c.get_sandbox(&sbx.id).await.unwrap().state,
        SandboxState::Paused
    );
    c.resume_sandbox(&sbx.id, &ResumeRequest { timeout: Some(600) })
        .await
        .unwrap();
    assert_eq!(sh(&c, &sbx.id, "cat /root/f").await.stdout, "kept\n");
    c.delete_sandbox(&sbx.id).await.unwrap();
}

/// A `bb` sandbox that ran `setup`, then paused while a counter ran in the background.
async fn paused_counting_sandbox(
    c: &Client,
    disk_mb: Option<u64>,
    setup: &str,
) -> moat_api::Sandbox {
    let sbx = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bb".into()),
            timeout: Some(600),
            disk_mb,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(sh(c, &sbx.id, setup).await.exit.exit_code, Some(0));
    c.start_process_background(
        &sbx.id,
        &StartProcessRequest {
            command: Some(COUNTER.into()),
            background: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    c.pause_sandbox(&sbx.id).await.unwrap();
    sbx
}

#[tokio::test(flavor = "multi_thread")]
async fn paused_sandbox_keeps_files_and_processes_across_a_daemon_restart() {
    let tmp = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(tmp.path());
    let d = Daemon::start(&tmp.path().join("data"));
    let c = d.client();
    register_bb(&c, &rootfs).await;
    let sbx = paused_counting_sandbox(&c, None, "echo data > /root/f").await;

    d.kill9();
    d.restart();
    let c = d.client();
    assert_eq!(
        c.get_sandbox(&sbx.id).await.unwrap().state,
        SandboxState::Paused
    );
    let r = c
        .resume_sandbox(&sbx.id, &ResumeRequest::default())
        .await
        .unwrap();
    assert!(r.processes_kept);
    assert_eq!(sh(&c, &sbx.id, "cat /root/f").await.stdout, "data\n");
    let a = count(&c, &sbx.id).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(count(&c, &sbx.id).await > a, "the counter did not go on");
    c.delete_sandbox(&sbx.id).await.unwrap();
}

/// What a host reboot does to a sandbox, done by hand while the daemon is stopped: its processes
/// killed (thawed first: frozen tasks cannot die), every mount under its directory gone, its cgroups
/// removed.
fn simulate_reboot_of(data_dir: &std::path::Path, id: &str) {
    for dir in cgroup_dirs(id) {
        let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
        let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
    }
    for pid in cgroup_procs(id) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cgroup_procs(id).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "sandbox processes outlived SIGKILL"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let root = sandbox_dir(data_dir, id);
    if isolation() == moat_api::Isolation::Microvm {
        // A VM mounts nothing on the host: its QEMU (killed above) was all there was to end.
        for dir in cgroup_dirs(id) {
            let _ = std::fs::remove_dir(&dir);
        }
        return;
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut mounts: Vec<String> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(root.to_str().unwrap()))
        .map(str::to_string)
        .collect();
    mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
    assert!(!mounts.is_empty(), "no mounts under {}", root.display());
    for m in mounts {
        nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH).unwrap();
    }
    for dir in cgroup_dirs(id) {
        let _ = std::fs::remove_dir(&dir);
    }
}

/// A host reboot ends a paused sandbox's processes; the container tier cannot bring them back
/// (no CRIU here), but the sandbox stays paused with its files and resumes over them, saying so.
#[tokio::test(flavor = "multi_thread")]
async fn paused_sandbox_resumes_with_its_files_after_a_host_reboot() {
    let tmp = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(tmp.path());
    let data = tmp.path().join("data");
    let d = Daemon::start(&data);
    let c = d.client();
    register_bb(&c, &rootfs).await;
    for disk_mb in [Some(64), Some(0)] {
        let sbx = paused_counting_sandbox(
            &c,
            disk_mb,
            "mkdir -p /root/work && echo data > /root/work/f && rm /bin/true",
        )
        .await;

        d.stop();
        simulate_reboot_of(&data, &sbx.id);
        d.restart();
        let c = d.client();
        assert_eq!(
            c.get_sandbox(&sbx.id).await.unwrap().state,
            SandboxState::Paused,
            "disk_mb {disk_mb:?}"
        );
        // Nothing runs until it is resumed; a snapshot needs its processes' sandbox.
        assert_eq!(
            api_err(
                c.create_snapshot(&sbx.id, &CreateSnapshotRequest::default())
                    .await
            )
            .1,
            ErrorCode::Conflict
        );
        let r = c
            .resume_sandbox(&sbx.id, &ResumeRequest::default())
            .await
            .unwrap();
        assert!(!r.processes_kept, "disk_mb {disk_mb:?}");
        assert_eq!(r.sandbox.state, SandboxState::Running);
        // Its files, including a deletion from the template, are as they were; the counter is gone.
        let out = sh(&c, &sbx.id, "cat /root/work/f; ls /bin/true 2>&1; ps").await;
        assert!(out.stdout.starts_with("data\n"), "{out:?}");
        assert!(out.stdout.contains("No such file"), "{out:?}");
        assert!(!out.stdout.contains("count.tmp"), "{out:?}");
        let a = count(&c, &sbx.id).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(count(&c, &sbx.id).await, a, "a process survived the reboot");
        // And it works as a sandbox again: commands, pause and resume with its processes.
        assert_eq!(
            sh(&c, &sbx.id, "echo more >> /root/work/f")
                .await
                .exit
                .exit_code,
            Some(0)
        );
        c.pause_sandbox(&sbx.id).await.unwrap();
        let r = c
            .resume_sandbox(&sbx.id, &ResumeRequest::default())
            .await
            .unwrap();
        assert!(r.processes_kept);
        assert_eq!(
            sh(&c, &sbx.id, "cat /root/work/f").await.stdout,
            "data\nmore\n"
        );
        c.delete_sandbox(&sbx.id).await.unwrap();
        assert!(!sandbox_dir(&data, &sbx.id).exists());
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn snapshot_bad_input_and_unsupported_kinds() {
    let c = shared_client();
    let sbx = create(&c, "base").await;
    // Memory snapshots need CRIU on the container tier: refused with the reason, on the field
    // (full_snapshot_continues_a_counting_process takes them on gvisor).
    if is_container() {
        let (status, code, field) = api_err(
            c.create_snapshot(
                &sbx.id,
                &CreateSnapshotRequest {
                    kind: Some(SnapshotKind::Full),
                    ..Default::default()
                },
            )
            .await,
        );
        assert_eq!(
            (status, code, field.as_deref()),
            (503, ErrorCode::Unavailable, Some("kind"))
        );
    }
    let bad_name = CreateSnapshotRequest {
        name: Some("Bad Name".into()),
        ..Default::default()
    };
    assert_eq!(
        api_err(c.create_snapshot(&sbx.id, &bad_name).await)
            .2
            .as_deref(),
        Some("name")
    );
    let name = format!("dup-{}", &sbx.id[4..14]);
    let snap = snapshot(&c, &sbx.id, Some(&name)).await;
    assert_eq!(
        api_err(
            c.create_snapshot(
                &sbx.id,
                &CreateSnapshotRequest {
                    name: Some(name.clone()),
                    ..Default::default()
                }
            )
            .await
        )
        .0,
        409
    );
    assert_eq!(
        api_err(
            c.create_snapshot("sbx_nope", &CreateSnapshotRequest::default())
                .await
        )
        .0,
        404
    );
    for n in [0, 101] {
        let (s, _, f) = api_err(
            c.fork(
                &snap.id,
                &ForkRequest {
                    count: n,
                    ..Default::default()
                },
            )
            .await,
        );
        assert_eq!((s, f.as_deref()), (400, Some("count")));
    }
    let (s, _, f) = api_err(
        c.fork(
            "snap_missing",
            &ForkRequest {
                count: 1,
                ..Default::default()
            },
        )
        .await,
    );
    assert_eq!((s, f.as_deref()), (404, Some("id")));
    let (s, _, f) = api_err(
        c.create_sandbox(&CreateSandboxRequest {
            snapshot: Some(name.clone()),
            template: Some("code-interpreter".into()),
            ..Default::default()
        })
        .await,
    );
    assert_eq!((s, f.as_deref()), (400, Some("template")));
    let (s, _, f) = api_err(
        c.create_sandbox(&CreateSandboxRequest {
            snapshot: Some("nothing-here".into()),
            ..Default::default()
        })
        .await,
    );
    assert_eq!((s, f.as_deref()), (404, Some("snapshot")));
    let (s, _, f) = api_err(
        c.reset_sandbox(
            &sbx.id,
            &ResetRequest {
                snapshot: Some("nothing-here".into()),
            },
        )
        .await,
    );
    assert_eq!((s, f.as_deref()), (404, Some("snapshot")));
    let (s, _, f) = api_err(
        c.resume_sandbox(&sbx.id, &ResumeRequest { timeout: Some(0) })
            .await,
    );
    assert_eq!((s, f.as_deref()), (400, Some("timeout")));
    assert_eq!(
        api_err(c.resume_sandbox(&sbx.id, &ResumeRequest::default()).await).0,
        409,
        "resume of a running sandbox"
    );
    c.delete_snapshot(&name).await.unwrap();
    c.delete_sandbox(&sbx.id).await.unwrap();
}

/// A process that counts in a shell variable: each count goes to its stdout and to /root/count.
const TICKER: &str = "i=0; while :; do i=$((i+1)); echo $i; echo $i > /root/count.tmp; \
    mv /root/count.tmp /root/count; sleep 0.05; done";

/// The ticker's count (0 before its first).
async fn ticks(c: &Client, id: &str) -> u64 {
    let out = sh(c, id, "cat /root/count 2>/dev/null || echo 0").await;
    out.stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("{out:?}"))
}

/// The counter's pid when it runs in `id`.
async fn counter_pid(c: &Client, id: &str) -> Option<u32> {
    c.list_processes(id)
        .await
        .unwrap()
        .into_iter()
        .find(|p| p.tag.as_deref() == Some("counter") && p.running)
        .map(|p| p.pid)
}

/// Reads the counter's output from the start (`replay`) until it prints a number above `above`;
/// returns every number it printed. The first ones were printed before the snapshot: the agent's
/// output buffer, in the sandbox's memory, came back with it.
async fn counter_output_past(c: &Client, id: &str, above: u64) -> Vec<u64> {
    use futures::StreamExt;
    let mut ev = c.attach(id, "counter", true).await.unwrap();
    let mut text = Vec::new();
    let read = async {
        while let Some(e) = ev.next().await {
            if let moat_api::ProcessEvent::Stdout(ch) = e.unwrap() {
                text.extend(decode(&ch));
                let last = String::from_utf8_lossy(&text)
                    .lines()
                    .filter_map(|l| l.parse::<u64>().ok())
                    .next_back()
                    .unwrap_or(0);
                if last > above && text.ends_with(b"\n") {
                    return;
                }
            }
        }
        panic!("the counter's output ended");
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("the counter printed nothing new in 30 s");
    String::from_utf8_lossy(&text)
        .lines()
        .map(|l| l.parse().unwrap())
        .collect()
}

/// Full-state snapshots. On gvisor (runsc checkpoint/restore) a counting process goes on with its
/// memory: in the snapshotted sandbox, in two forks (each its own copy), and after a reset of one to
/// the snapshot; the agent's output buffer comes back too. The container tier refuses the kind
/// with the reason, on the field (it needs CRIU, which does not work on this kernel).
#[tokio::test(flavor = "multi_thread")]
async fn full_snapshot_continues_a_counting_process() {
    let c = shared_client();
    let sbx = create(&c, "base").await;
    let full = CreateSnapshotRequest {
        kind: Some(SnapshotKind::Full),
        ..Default::default()
    };
    if is_container() {
        let (status, code, field) = api_err(c.create_snapshot(&sbx.id, &full).await);
        assert_eq!(
            (status, code, field.as_deref()),
            (503, ErrorCode::Unavailable, Some("kind"))
        );
        c.delete_sandbox(&sbx.id).await.unwrap();
        return;
    }
    let info = c
        .start_process_background(
            &sbx.id,
            &StartProcessRequest {
                command: Some(TICKER.into()),
                tag: Some("counter".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let started = std::time::Instant::now();
    while ticks(&c, &sbx.id).await < 5 {
        assert!(started.elapsed() < Duration::from_secs(30), "no count");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let snap = c.create_snapshot(&sbx.id, &full).await.unwrap();
    assert_eq!(snap.kind, SnapshotKind::Full);
    let image = shared().data_dir.join("checkpoints").join(&snap.id);
    assert!(image.is_dir(), "{} missing", image.display());
    // The snapshotted sandbox goes on: same process, counting on.
    let after = ticks(&c, &sbx.id).await;
    assert!(after >= 5, "count went back to {after}");
    assert_eq!(counter_pid(&c, &sbx.id).await, Some(info.pid));
    let seen = counter_output_past(&c, &sbx.id, after + 3).await;
    assert_eq!(seen[..5], [1, 2, 3, 4, 5], "{seen:?}");

    let forks = c
        .fork(
            &snap.id,
            &ForkRequest {
                count: 2,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    for f in &forks {
        assert_eq!(f.state, SandboxState::Running);
        // The process exists only because its memory came back (a filesystem holds no process).
        assert_eq!(counter_pid(&c, &f.id).await, Some(info.pid), "{}", f.id);
        let first = ticks(&c, &f.id).await;
        assert!(first >= 5, "fork {} counts from {first}", f.id);
        let seen = counter_output_past(&c, &f.id, first + 3).await;
        assert_eq!(seen[..5], [1, 2, 3, 4, 5], "{seen:?}");
        assert!(seen.windows(2).all(|w| w[1] == w[0] + 1), "{seen:?}");
    }
    // Each fork is its own copy.
    let (a, b) = (&forks[0].id, &forks[1].id);
    assert_eq!(
        sh(&c, a, "touch /root/only-a").await.exit.exit_code,
        Some(0)
    );
    assert_eq!(
        sh(&c, b, "test -e /root/only-a").await.exit.exit_code,
        Some(1)
    );
    // Reset goes back to the snapshot's instant: the same count, the process still there.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before_reset = ticks(&c, b).await;
    c.signal(b, "counter", "SIGKILL").await.unwrap();
    let mut gone = false;
    for _ in 0..200 {
        if counter_pid(&c, b).await.is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the counter of {b} did not end");
    let reset = c
        .reset_sandbox(
            b,
            &ResetRequest {
                snapshot: Some(snap.id.clone()),
            },
        )
        .await
        .unwrap();
    assert_eq!(reset.state, SandboxState::Running);
    assert_eq!(counter_pid(&c, b).await, Some(info.pid));
    let first = ticks(&c, b).await;
    assert!(
        (5..before_reset).contains(&first),
        "after reset {first}, before {before_reset}"
    );

    c.delete_snapshot(&snap.id).await.unwrap();
    assert!(!image.exists(), "{} left behind", image.display());
    // A paused sandbox stays paused through a full-state snapshot, and goes on when resumed.
    c.pause_sandbox(&sbx.id).await.unwrap();
    let paused = c.create_snapshot(&sbx.id, &full).await.unwrap();
    assert_eq!(
        c.get_sandbox(&sbx.id).await.unwrap().state,
        SandboxState::Paused
    );
    c.resume_sandbox(&sbx.id, &ResumeRequest::default())
        .await
        .unwrap();
    let at_resume = ticks(&c, &sbx.id).await;
    let seen = counter_output_past(&c, &sbx.id, at_resume + 2).await;
    assert_eq!(seen[..5], [1, 2, 3, 4, 5], "{seen:?}");
    c.delete_snapshot(&paused.id).await.unwrap();
    for s in [&sbx.id, a, b] {
        c.delete_sandbox(s).await.unwrap();
    }
}

/// gVisor cannot save a Unix socket bound to a file path (a host socket under `--host-uds`): a
/// full-state snapshot of a sandbox holding one is refused with 409 and the reason, and the sandbox
/// goes on as before (its agent listens again, its processes keep running). The container tier
/// refuses the kind for every sandbox. A microVM saves its whole memory, the socket included: the
/// snapshot is taken, and a sandbox started from it has the server still listening.
#[tokio::test(flavor = "multi_thread")]
async fn full_snapshot_refuses_a_bound_unix_socket_and_the_sandbox_goes_on() {
    let c = shared_client();
    let sbx = create(&c, "base").await;
    let server = "import socket, time\n\
        s = socket.socket(socket.AF_UNIX)\n\
        s.bind('/root/app.sock')\n\
        s.listen()\n\
        print('listening', flush=True)\n\
        time.sleep(3600)\n";
    c.write_file(&sbx.id, "/root/server.py", server, &Default::default())
        .await
        .unwrap();
    let info = c
        .start_process_background(
            &sbx.id,
            &StartProcessRequest {
                cmd: Some(vec!["python3".into(), "/root/server.py".into()]),
                tag: Some("server".into()),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    // (gVisor's own stat of a host socket's file fails: the server says when it is bound.)
    let mut out = c.attach(&sbx.id, "server", true).await.unwrap();
    let mut up = false;
    let wait = async {
        use futures::StreamExt;
        while let Some(e) = out.next().await {
            if let moat_api::ProcessEvent::Stdout(ch) = e.unwrap() {
                if String::from_utf8_lossy(&decode(&ch)).contains("listening") {
                    return true;
                }
            }
        }
        false
    };
    if let Ok(v) = tokio::time::timeout(Duration::from_secs(30), wait).await {
        up = v;
    }
    drop(out);
    assert!(up, "the server did not bind its socket");
    let full = CreateSnapshotRequest {
        kind: Some(SnapshotKind::Full),
        ..Default::default()
    };
    if isolation() == moat_api::Isolation::Microvm {
        let snap = c.create_snapshot(&sbx.id, &full).await.unwrap();
        let fork = c
            .create_sandbox(&CreateSandboxRequest {
                snapshot: Some(snap.id.clone()),
                ..Default::default()
            })
            .await
            .unwrap();
        let out = sh(
            &c,
            &fork.id,
            "python3 -c \"import socket; s = socket.socket(socket.AF_UNIX); s.connect('/root/app.sock'); print('connected')\"",
        )
        .await;
        assert_eq!(out.stdout, "connected\n", "{out:?}");
        for id in [&fork.id, &sbx.id] {
            c.delete_sandbox(id).await.unwrap();
        }
        c.delete_snapshot(&snap.id).await.unwrap();
        return;
    }
    let (status, code, field) = api_err(c.create_snapshot(&sbx.id, &full).await);
    if is_container() {
        assert_eq!(
            (status, code, field.as_deref()),
            (503, ErrorCode::Unavailable, Some("kind"))
        );
    } else {
        assert_eq!((status, code), (409, ErrorCode::Conflict));
    }
    // Nothing was recorded, and the sandbox goes on.
    assert!(c
        .list_snapshots()
        .await
        .unwrap()
        .iter()
        .all(|s| s.sandbox_id != sbx.id));
    assert_eq!(sh(&c, &sbx.id, "echo ok").await.stdout, "ok\n");
    let procs = c.list_processes(&sbx.id).await.unwrap();
    assert!(procs
        .iter()
        .any(|p| p.pid == info.pid && p.running && p.tag.as_deref() == Some("server")));
    // Once the socket is closed, the same sandbox can be snapshotted in full.
    c.signal(&sbx.id, "server", "SIGKILL").await.unwrap();
    if !is_container() {
        let mut snap = None;
        for _ in 0..100 {
            if process_gone(&c, &sbx.id, info.pid).await {
                snap = Some(
                    c.create_snapshot(
                        &sbx.id,
                        &CreateSnapshotRequest {
                            kind: Some(SnapshotKind::Full),
                            ..Default::default()
                        },
                    )
                    .await
                    .unwrap(),
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let snap = snap.expect("the server did not end");
        assert_eq!(snap.kind, SnapshotKind::Full);
        c.delete_snapshot(&snap.id).await.unwrap();
    }
    c.delete_sandbox(&sbx.id).await.unwrap();
}

/// Whether process `pid` of `id` has ended.
async fn process_gone(c: &Client, id: &str, pid: u32) -> bool {
    !c.list_processes(id)
        .await
        .unwrap()
        .iter()
        .any(|p| p.pid == pid && p.running)
}
