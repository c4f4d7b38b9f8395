//! Chaos (issue 32's trial, made permanent): `kill -9` of the daemon at seeded random points of a burst
//! of creates, a running command, a file upload, a snapshot and a fork. After each restart every
//! sandbox, snapshot and fork the daemon answered for is there and usable, the upload is whole or
//! absent (never half a file), nothing is left `starting` or `stopping`, and every sandbox listed
//! answers; at the end, with everything deleted, nothing of any sandbox that ever existed — answered
//! or half-made — is left on the host (mounts, cgroups, loop devices, directories, namespaces).

use std::collections::BTreeSet;
use std::time::Duration;

use moat_api::{CreateSandboxRequest, CreateSnapshotRequest, ForkRequest, SandboxState};

use crate::harness::*;

/// xorshift64*: the test's own seeded randomness (MOAT_CHAOS_SEED), printed so a failure replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

const UPLOAD_BYTES: usize = 4 << 20;

/// The names in directory `dir` (the sandboxes a tier's directory holds).
fn names_in(dir: &std::path::Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn kill9_at_random_points_loses_nothing_answered_and_leaks_nothing() {
    let seed = std::env::var("MOAT_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_207u64);
    let mut rng = Rng(seed | 1);
    // Each round costs a restart and a burst of creates: fewer where a create costs more.
    let rounds = match isolation() {
        moat_api::Isolation::Container => 6,
        moat_api::Isolation::Gvisor => 4,
        _ => 2,
    };
    let tmp = tempfile::tempdir().unwrap();
    let (d, c) = busybox_daemon(tmp.path(), &[]).await;
    let data = d.data_dir.clone();
    let keep = c
        .create_sandbox(&CreateSandboxRequest {
            timeout: Some(1800),
            ..Default::default()
        })
        .await
        .unwrap();
    let base_snap = c
        .create_snapshot(&keep.id, &CreateSnapshotRequest::default())
        .await
        .unwrap();
    // Every sandbox id the host ever held a directory for, answered or not.
    let mut ever: BTreeSet<String> = BTreeSet::new();
    let tier_dir = sandbox_dir(&data, "x").parent().unwrap().to_path_buf();
    let payload: Vec<u8> = (0..UPLOAD_BYTES).map(|i| (i % 251) as u8).collect();

    for round in 0..rounds {
        let delay = Duration::from_millis(rng.below(700));
        eprintln!("chaos seed {seed} round {round}: kill -9 after {delay:?}");
        let upload_path = format!("/tmp/upload-{round}");
        let mut burst = tokio::task::JoinSet::new();
        for _ in 0..4 {
            let c = c.clone();
            burst.spawn(async move {
                let r = c
                    .create_sandbox(&CreateSandboxRequest {
                        timeout: Some(1800),
                        ..Default::default()
                    })
                    .await;
                ("create", r.map(|s| vec![s.id]).ok())
            });
        }
        {
            let (c, id) = (c.clone(), keep.id.clone());
            burst.spawn(async move {
                let r = try_run_req(
                    &c,
                    &id,
                    moat_api::StartProcessRequest {
                        command: Some(
                            "for i in 1 2 3 4 5 6 7 8 9 10; do echo $i; sleep 0.1; done".into(),
                        ),
                        ..Default::default()
                    },
                )
                .await;
                ("exec", r.ok().map(|_| vec![]))
            });
        }
        {
            let (c, id, body, path) = (
                c.clone(),
                keep.id.clone(),
                payload.clone(),
                upload_path.clone(),
            );
            burst.spawn(async move {
                let r = c.write_file(&id, &path, body, &Default::default()).await;
                ("upload", r.ok().map(|_| vec![]))
            });
        }
        {
            let (c, id) = (c.clone(), keep.id.clone());
            burst.spawn(async move {
                let r = c
                    .create_snapshot(&id, &CreateSnapshotRequest::default())
                    .await;
                ("snapshot", r.ok().map(|s| vec![s.id]))
            });
        }
        {
            let (c, snap) = (c.clone(), base_snap.id.clone());
            burst.spawn(async move {
                let r = c
                    .fork(
                        &snap,
                        &ForkRequest {
                            count: 2,
                            timeout: Some(1800),
                            ..Default::default()
                        },
                    )
                    .await;
                (
                    "fork",
                    r.ok().map(|l| l.into_iter().map(|s| s.id).collect()),
                )
            });
        }
        tokio::time::sleep(delay).await;
        d.kill9();
        // What the host holds now: every sandbox made or half-made.
        ever.extend(names_in(&tier_dir));
        let mut answered_sandboxes = Vec::new();
        let mut answered_snapshots = Vec::new();
        let mut uploaded = false;
        while let Some(r) = burst.join_next().await {
            let (what, ok) = r.unwrap();
            match (what, ok) {
                ("create" | "fork", Some(ids)) => answered_sandboxes.extend(ids),
                ("snapshot", Some(ids)) => answered_snapshots.extend(ids),
                ("upload", Some(_)) => uploaded = true,
                _ => {}
            }
        }
        eprintln!(
            "  answered before the kill: {} sandboxes, {} snapshots, upload {uploaded}",
            answered_sandboxes.len(),
            answered_snapshots.len()
        );
        d.restart();
        ever.extend(answered_sandboxes.iter().cloned());

        // Nothing is left half-way once recovery is done.
        let mut settled = false;
        for _ in 0..60 {
            let list = c.list_sandboxes(&Default::default()).await.unwrap();
            if list
                .iter()
                .all(|s| matches!(s.state, SandboxState::Running | SandboxState::Paused))
            {
                settled = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(
            settled,
            "round {round}: sandboxes left starting or stopping"
        );
        // What was answered is there and usable.
        for id in &answered_sandboxes {
            let s = c.get_sandbox(id).await.unwrap_or_else(|e| {
                panic!("round {round}: {id} was answered 201 and is gone after the restart: {e}")
            });
            assert_eq!(s.state, SandboxState::Running, "round {round}: {id}");
        }
        for snap in &answered_snapshots {
            c.get_snapshot(snap).await.unwrap_or_else(|e| {
                panic!("round {round}: snapshot {snap} was answered and is gone: {e}")
            });
        }
        // Every sandbox listed answers (and `ls` equals what the host runs).
        let list = c.list_sandboxes(&Default::default()).await.unwrap();
        let listed: BTreeSet<String> = list.iter().map(|s| s.id.clone()).collect();
        assert_eq!(
            listed,
            names_in(&tier_dir),
            "round {round}: listed and on the host differ"
        );
        for s in &list {
            ever.insert(s.id.clone());
            let out = sh(&c, &s.id, "echo ok").await;
            assert_eq!(
                out.stdout.trim(),
                "ok",
                "round {round}: {} does not answer",
                s.id
            );
        }
        // The upload is whole or absent: never a torn file.
        match c.stat(&keep.id, &upload_path).await {
            Ok(info) => assert_eq!(info.size, UPLOAD_BYTES as u64, "round {round}: torn upload"),
            Err(e) => {
                assert!(e.is_not_found(), "round {round}: {e}");
                assert!(
                    !uploaded,
                    "round {round}: the upload was answered and is gone"
                );
            }
        }
    }

    // Everything removed through the API; then nothing of any of them is left on the host.
    for s in c.list_sandboxes(&Default::default()).await.unwrap() {
        c.delete_sandbox(&s.id).await.unwrap();
    }
    for s in c.list_snapshots().await.unwrap() {
        c.delete_snapshot(&s.id).await.unwrap();
    }
    d.stop();
    assert!(ever.len() > rounds, "{ever:?}");
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for id in &ever {
        assert!(!mountinfo.contains(id.as_str()), "a mount of {id} is left");
        assert!(cgroup_dirs(id).is_empty(), "cgroups of {id} are left");
        assert!(loops_of(id).is_empty(), "a loop device of {id} is left");
        assert!(
            !sandbox_dir(&data, id).exists(),
            "the directory of {id} is left"
        );
    }
    assert!(
        !mountinfo.contains(&data.display().to_string()),
        "mounts under the data dir are left"
    );
}
