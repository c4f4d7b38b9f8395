//! The warm pool: creates of the default template take a sandbox started ahead of demand, get the
//! creator's environment and limits, and the pool refills.

use std::time::Duration;

use moat_api::{CreateSandboxRequest, RegisterTemplateRequest};

use crate::harness::*;

async fn pool_ready(c: &moat_client::Client) -> u32 {
    c.health().await.unwrap().pool.map(|p| p.ready).unwrap_or(0)
}

/// Waits until the pool holds `n` ready sandboxes: a few seconds for containers, longer for
/// microVMs that boot (under TCG on the build machine, seconds each, two cores for all).
async fn pool_fills(c: &moat_client::Client, n: u32) -> bool {
    let wait = if isolation() == moat_api::Isolation::Microvm {
        Duration::from_secs(180)
    } else {
        Duration::from_secs(10)
    };
    let until = std::time::Instant::now() + wait;
    while std::time::Instant::now() < until {
        if pool_ready(c).await == n {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Whether the daemon's log says sandbox `id` was taken from the warm pool.
fn from_pool(d: &Daemon, id: &str) -> bool {
    let log = std::fs::read_to_string(d.data_dir.join("daemon.log")).unwrap();
    log.lines()
        .any(|l| l.contains("from the warm pool") && l.contains(id))
}

#[tokio::test(flavor = "multi_thread")]
async fn creates_are_served_from_the_warm_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(tmp.path());
    let d = Daemon::start_with(
        &tmp.path().join("data"),
        &["--default-template", "bb", "--pool-size", "2"],
    );
    let c = d.client();
    let health = c.health().await.unwrap();
    let pool = health.pool.expect("pool info");
    assert_eq!((pool.template.as_str(), pool.size), ("bb", 2));
    c.register_template(&RegisterTemplateRequest {
        name: "bb".into(),
        path: rootfs.display().to_string(),
    })
    .await
    .unwrap();
    assert!(pool_fills(&c, 2).await, "pool did not fill");
    // Pooled sandboxes are not anyone's yet: not listed.
    assert!(c
        .list_sandboxes(&Default::default())
        .await
        .unwrap()
        .is_empty());

    let microvm = isolation() == moat_api::Isolation::Microvm;
    let limited = CreateSandboxRequest {
        env: env(&[("GREETING", "from-the-pool")]),
        metadata: env(&[("k", "v")]),
        cpu: Some(0.5),
        memory_mb: Some(128),
        timeout: Some(60),
        ..Default::default()
    };
    if microvm {
        // A VM's memory and vCPUs (and its guest's inner limits) are fixed when it boots: a create
        // asking for other limits boots a VM of its own, which has them inside.
        let own = c.create_sandbox(&limited).await.unwrap();
        assert!(!from_pool(&d, &own.id), "{} came from the pool", own.id);
        let inside = sh(
            &c,
            &own.id,
            "cat /sys/fs/cgroup/sandbox/memory.max /sys/fs/cgroup/sandbox/cpu.max",
        )
        .await
        .stdout;
        assert_eq!(inside, format!("{}\n50000 100000\n", 128u64 << 20));
        c.delete_sandbox(&own.id).await.unwrap();
    }
    // On microvm a create with the defaults takes a pooled VM; elsewhere any limits do.
    let s = c
        .create_sandbox(&if microvm {
            CreateSandboxRequest {
                cpu: None,
                memory_mb: None,
                ..limited.clone()
            }
        } else {
            limited.clone()
        })
        .await
        .unwrap();
    assert!(
        from_pool(&d, &s.id),
        "{} was not served from the pool",
        s.id
    );
    assert_eq!(s.template, "bb");
    assert_eq!(s.metadata.get("k").map(String::as_str), Some("v"));
    let out = sh(&c, &s.id, "echo $GREETING; hostname").await;
    assert_eq!(out.stdout, format!("from-the-pool\n{}\n", s.hostname));
    if !microvm {
        let mem = cgroup_file(&s.id, "memory", "memory.limit_in_bytes")
            .or_else(|_| cgroup_file(&s.id, "memory", "memory.max"))
            .unwrap();
        assert_eq!(mem.trim(), (128u64 << 20).to_string());
        let quota = cgroup_file(&s.id, "cpu", "cpu.cfs_quota_us")
            .or_else(|_| cgroup_file(&s.id, "cpu", "cpu.max"))
            .unwrap();
        assert!(quota.starts_with("50000"), "{quota}");
    }
    let listed = c.list_sandboxes(&Default::default()).await.unwrap();
    assert_eq!(listed.len(), 1);
    // The pool refills.
    assert!(pool_fills(&c, 2).await, "pool did not refill");
    let facts = host_facts(&s.id);
    c.delete_sandbox(&s.id).await.unwrap();
    assert_no_leaks(&facts, &d.data_dir);
    // A clean stop takes the pooled sandboxes (nobody's yet) with it, and the daemon's empty cgroup
    // parent; the next start refills the pool.
    d.stop();
    let left: Vec<_> = std::fs::read_dir(sandbox_dir(&d.data_dir, ""))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(
        left.is_empty(),
        "pooled sandboxes outlived a clean stop: {left:?}"
    );
    let parent = moat_daemon::host::cgroup::parent_for(&d.data_dir);
    assert!(
        !std::path::Path::new("/sys/fs/cgroup/pids")
            .join(&parent)
            .exists(),
        "cgroup parent {parent} left"
    );
    d.restart();
    let c = d.client();
    assert!(
        pool_fills(&c, 2).await,
        "pool did not refill after a restart"
    );
    // Removing the template drains its pool first.
    c.delete_template("bb").await.unwrap();
    assert_eq!(pool_ready(&c).await, 0);
    d.stop();
    assert!(
        std::fs::read_dir(sandbox_dir(&d.data_dir, ""))
            .unwrap()
            .next()
            .is_none(),
        "pooled sandboxes left"
    );
}
