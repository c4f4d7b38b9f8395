//! Fork safety (docs/snapshots.md, "Fork safety"): forks of one snapshot are not copies of each
//! other where it matters. Every sandbox gets its own machine-id, hostname and `MOAT_SANDBOX_ID`;
//! forks of a full-state snapshot (gvisor, microvm: the same memory) read different random bytes
//! from the kernel and from Python's `os.urandom`, and find /run/moat/forked naming themselves.

use moat_api::{CreateSnapshotRequest, ForkRequest, SnapshotKind};

use crate::harness::*;

/// What a sandbox says of itself: machine-id, hostname, MOAT_SANDBOX_ID, 16 bytes of /dev/urandom
/// and of os.urandom (hex), and /run/moat/forked (or `-`).
const PROBE: &str = "cat /etc/machine-id; hostname; echo \"$MOAT_SANDBOX_ID\"; \
    od -An -tx1 -N16 /dev/urandom | tr -d ' \\n'; echo; \
    python3 -c 'import os; print(os.urandom(16).hex())'; \
    cat /run/moat/forked 2>/dev/null || echo -";

#[derive(Debug)]
struct Probe {
    machine_id: String,
    hostname: String,
    sandbox_id: String,
    urandom: String,
    os_urandom: String,
    forked: String,
}

async fn probe(c: &moat_client::Client, id: &str) -> Probe {
    let out = sh(c, id, PROBE).await;
    let l: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(l.len(), 6, "{out:?}");
    Probe {
        machine_id: l[0].into(),
        hostname: l[1].into(),
        sandbox_id: l[2].into(),
        urandom: l[3].into(),
        os_urandom: l[4].into(),
        forked: l[5].into(),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn forks_of_one_snapshot_are_not_copies_of_each_other() {
    let c = shared_client();
    let src = create(&c, "base").await;
    let before = probe(&c, &src.id).await;
    assert_eq!(before.machine_id.len(), 32, "{before:?}");
    assert_eq!(before.sandbox_id, src.id);
    assert_eq!(before.hostname, src.hostname);
    assert_eq!(before.forked, "-", "a sandbox that forked nothing");

    let kind = if is_container() {
        // The container tier has filesystem snapshots only (CRIU: docs/snapshots.md); its forks
        // start fresh processes over a copy of the files, /etc/machine-id included.
        SnapshotKind::Filesystem
    } else {
        SnapshotKind::Full
    };
    let snap = c
        .create_snapshot(
            &src.id,
            &CreateSnapshotRequest {
                kind: Some(kind),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let forks = c
        .fork(
            &snap.id,
            &ForkRequest {
                count: 2,
                timeout: Some(300),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let (a, b) = (probe(&c, &forks[0].id).await, probe(&c, &forks[1].id).await);
    for (f, p) in [(&forks[0], &a), (&forks[1], &b)] {
        assert_eq!(p.sandbox_id, f.id, "MOAT_SANDBOX_ID of {}", f.id);
        assert_eq!(p.hostname, f.hostname, "hostname of {}", f.id);
        assert_eq!(p.machine_id.len(), 32, "{p:?}");
        assert_ne!(p.machine_id, before.machine_id, "the source's machine-id");
        if kind == SnapshotKind::Full {
            // It continues the source's processes: told so, with its own id.
            assert!(p.forked.contains(&f.id), "/run/moat/forked: {:?}", p.forked);
        } else {
            assert_eq!(p.forked, "-", "{p:?}");
        }
    }
    assert_ne!(a.machine_id, b.machine_id);
    assert_ne!(a.urandom, b.urandom, "/dev/urandom of two forks");
    assert_ne!(a.os_urandom, b.os_urandom, "os.urandom of two forks");
    for id in [&src.id, &forks[0].id, &forks[1].id] {
        c.delete_sandbox(id).await.unwrap();
    }
    c.delete_snapshot(&snap.id).await.unwrap();
}
