//! Hardening is on by default; `--no-hardening` (kept for measuring its cost) really turns it off.

use moat_api::{CreateSandboxRequest, RegisterTemplateRequest};

use crate::harness::*;

fn status_field(status: &str, key: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn hardening_on_by_default_and_off_only_when_asked() {
    let c = shared_client();
    let s = create(&c, "base").await;
    let st = sh(&c, &s.id, "cat /proc/self/status").await.stdout;
    if isolation() == moat_api::Isolation::Microvm {
        // A microVM's boundary is its guest kernel and QEMU: root inside keeps its capabilities
        // (its own kernel's, as in E2B's and Firecracker's guests: mount, modules, nested
        // containers), while on the host QEMU — every process of the sandbox there — is an
        // unprivileged uid with no capabilities, no_new_privs and its seccomp filter.
        assert_eq!(status_field(&st, "CapEff:"), "000001ffffffffff", "{st}");
        let pids = cgroup_procs(&s.id);
        assert!(!pids.is_empty(), "no host process in the sandbox's cgroup");
        for pid in pids {
            let host = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            assert_eq!(status_field(&host, "Seccomp:"), "2", "host pid {pid}");
            assert_eq!(status_field(&host, "NoNewPrivs:"), "1", "host pid {pid}");
            assert_eq!(
                status_field(&host, "CapEff:"),
                "0000000000000000",
                "host pid {pid}"
            );
            assert_eq!(
                status_field(&host, "CapPrm:"),
                "0000000000000000",
                "host pid {pid}"
            );
            assert_ne!(uid_of(pid), 0, "host pid {pid} runs as root");
        }
        c.delete_sandbox(&s.id).await.unwrap();
        return;
    }
    if !is_container() {
        // gVisor: moat's capability set inside; on the host every process of the sandbox (the
        // Sentry, its ptrace stubs, the gofer) runs with no_new_privs under runsc's seccomp filter.
        // `--no-hardening` is the container tier's.
        assert_eq!(status_field(&st, "CapBnd:"), "00000000a00405fb");
        let pids = cgroup_procs(&s.id);
        assert!(pids.len() >= 2, "{pids:?}");
        for pid in pids {
            let host = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
            assert_eq!(status_field(&host, "Seccomp:"), "2", "host pid {pid}");
            assert_eq!(status_field(&host, "NoNewPrivs:"), "1", "host pid {pid}");
        }
        c.delete_sandbox(&s.id).await.unwrap();
        return;
    }
    assert_eq!(status_field(&st, "Seccomp:"), "2");
    assert_eq!(status_field(&st, "NoNewPrivs:"), "1");
    assert_eq!(status_field(&st, "CapBnd:"), "00000000a00405fb");
    c.delete_sandbox(&s.id).await.unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(tmp.path());
    let d = Daemon::start_with(
        &tmp.path().join("data"),
        &["--no-hardening", "--pool-size", "0"],
    );
    let c = d.client();
    c.register_template(&RegisterTemplateRequest {
        name: "bb".into(),
        path: rootfs.display().to_string(),
    })
    .await
    .unwrap();
    let s = c
        .create_sandbox(&CreateSandboxRequest {
            template: Some("bb".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    let st = sh(&c, &s.id, "cat /proc/self/status").await.stdout;
    assert_eq!(status_field(&st, "Seccomp:"), "0", "{st}");
    assert_ne!(status_field(&st, "CapBnd:"), "00000000a00405fb");
    // Still confined by its own user namespace: root inside is not root outside.
    let facts = host_facts(&s.id);
    assert!(facts.host_uid >= 100_000);
    c.delete_sandbox(&s.id).await.unwrap();
    assert_no_leaks(&facts, &d.data_dir);
    d.stop();
}
