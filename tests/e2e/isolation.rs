//! Isolation facts of a sandbox (of the run's tier), checked from inside and from the host.

use crate::harness::*;

#[tokio::test(flavor = "multi_thread")]
async fn sandbox_is_isolated_from_host() {
    let d = shared();
    let c = d.client();
    let s = create(&c, "base").await;

    // PID 1 is the agent, and only the sandbox's own processes are visible.
    let vm = isolation() == moat_api::Isolation::Microvm;
    // A guest kernel's own threads are visible in its /proc (they have no command line): a microVM
    // counts the processes that have one.
    let count = if vm {
        "n=0; for p in /proc/[0-9]*; do [ -n \"$(tr -d '\\0' < $p/cmdline 2>/dev/null)\" ] && n=$((n+1)); done; echo $n"
    } else {
        "ls /proc | grep -c '^[0-9]'"
    };
    let out = sh(
        &c,
        &s.id,
        &format!("cat /proc/1/cmdline | tr '\\0' ' '; echo; {count}"),
    )
    .await;
    let mut lines = out.stdout.lines();
    // gVisor starts it by its path (an OCI process has no argv[0] of its own); a guest kernel runs
    // it as the initramfs's /init.
    let agent = match isolation() {
        moat_api::Isolation::Container => "moat-agent ",
        moat_api::Isolation::Gvisor => "/dev/.moat/agent ",
        moat_api::Isolation::Microvm => "/init --vm",
    };
    assert!(lines.next().unwrap().starts_with(agent), "{}", out.stdout);
    let visible: u32 = lines.next().unwrap().trim().parse().unwrap();
    assert!(
        visible <= 5,
        "{visible} processes visible inside:\n{}",
        out.stdout
    );
    let host_procs = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .count();
    assert!(
        host_procs > visible as usize + 5,
        "host has {host_procs} processes"
    );

    // Nothing of the sandbox appears in the host's mount table as a cgroup mount (other container
    // runtimes on the host parse those lines; runsc refuses to start when it meets one).
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let cgroup_lines: Vec<&str> = mountinfo
        .lines()
        .filter(|l| {
            l.contains(&s.id)
                && l.split(" - ")
                    .nth(1)
                    .is_some_and(|f| f.starts_with("cgroup"))
        })
        .collect();
    assert!(cgroup_lines.is_empty(), "{cgroup_lines:?}");

    // Its own hostname.
    let out = sh(&c, &s.id, "hostname").await;
    assert_eq!(out.stdout.trim(), s.hostname);
    assert_ne!(
        out.stdout.trim(),
        nix::unistd::gethostname().unwrap().to_string_lossy()
    );

    // Root inside, an unprivileged uid on the host.
    let out = sh(&c, &s.id, "id -u; cat /proc/self/uid_map").await;
    assert!(out.stdout.starts_with("0\n"), "{}", out.stdout);
    let facts = host_facts(&s.id);
    if is_container() {
        assert!(
            facts.host_uid >= 100_000,
            "sandbox root is host uid {}",
            facts.host_uid
        );
        for pid in &facts.pids {
            assert_eq!(uid_of(*pid), facts.host_uid);
        }
    } else {
        // gVisor: root inside is a task of the Sentry, which runs as an unprivileged host user; a
        // microVM's root is the guest's, and QEMU runs as the sandbox's unprivileged host uid.
        let main = main_pid(&facts.pids);
        assert_ne!(uid_of(main), 0, "the sandbox's host process runs as root");
    }

    // A host file is invisible inside.
    let marker = format!("moat-host-marker-{}", std::process::id());
    std::fs::write(format!("/root/{marker}"), "secret").unwrap();
    let out = sh(
        &c,
        &s.id,
        &format!(
            "cat /root/{marker} 2>&1; ls /root; find / -xdev -name '{marker}' 2>/dev/null | wc -l"
        ),
    )
    .await;
    std::fs::remove_file(format!("/root/{marker}")).unwrap();
    assert!(!out.stdout.contains("secret"), "{}", out.stdout);
    assert!(out.stdout.trim_end().ends_with('0'), "{}", out.stdout);

    // A file written inside lands only in the sandbox's own writable layer.
    let base_images = || -> Vec<(std::path::PathBuf, std::time::SystemTime)> {
        std::fs::read_dir(d.data_dir.join("microvm-images"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("base-"))
            .map(|e| (e.path(), e.metadata().unwrap().modified().unwrap()))
            .collect()
    };
    let images_before = base_images();
    let inside = format!("inside-marker-{}", std::process::id());
    let out = sh(
        &c,
        &s.id,
        &format!("echo data > /etc/{inside} && echo data > /tmp/{inside} && echo ok"),
    )
    .await;
    assert_eq!(out.stdout, "ok\n");
    assert!(!std::path::Path::new(&format!("/etc/{inside}")).exists());
    assert!(!std::path::Path::new(&format!("/tmp/{inside}")).exists());
    let template_etc = d.data_dir.join("templates/base/rootfs/etc").join(&inside);
    assert!(!template_etc.exists(), "write leaked into the template");
    let dir = sandbox_dir(&d.data_dir, &s.id);
    if vm {
        // A guest writes to its own disk image; the shared read-only base images are unchanged.
        assert!(dir.join("disk.img").is_file());
        assert!(!images_before.is_empty());
        let after = base_images();
        for (path, mtime) in &images_before {
            assert!(
                after.contains(&(path.clone(), *mtime)),
                "{path:?} was written"
            );
        }
    } else {
        // The writable layer is `disk/upper` on the sandbox's disk image, or `upper` without a disk quota.
        let layer = if dir.join("disk/upper").is_dir() {
            dir.join("disk/upper")
        } else {
            dir.join("upper")
        };
        let upper = layer.join("etc").join(&inside);
        assert!(upper.exists(), "write is not in the sandbox's own layer");
        use std::os::unix::fs::MetadataExt;
        if is_container() {
            assert_eq!(
                std::fs::metadata(&upper).unwrap().uid(),
                facts.host_uid,
                "files of sandbox root are owned by its host uid"
            );
        } else {
            // gVisor keeps the ids the sandbox used (root = 0) in a directory only root can enter.
            assert_eq!(std::fs::metadata(&upper).unwrap().uid(), 0);
            assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        }
    }

    // Escapes through the file API resolve inside the sandbox.
    let out = sh(
        &c,
        &s.id,
        "ln -s / /tmp/rootlink && ln -s /etc/hostname /tmp/hn && echo ok",
    )
    .await;
    assert_eq!(out.stdout, "ok\n");
    for path in [
        "/tmp/hn",
        "/tmp/rootlink/etc/hostname",
        "../../../../etc/hostname",
        "/../../etc/hostname",
    ] {
        if isolation() == moat_api::Isolation::Gvisor && path == "/tmp/rootlink/etc/hostname" {
            // This host's runsc drops what follows a symlink to "/" (docs/gvisor-tier.md): the path
            // ends at the sandbox's own root directory, which is refused — still nothing of the host.
            let err = c.read_file(&s.id, path).await.err().expect("read refused");
            assert!(err.to_string().contains("is a directory"), "{err}");
            continue;
        }
        let bytes = read_all(&c, &s.id, path).await;
        assert_eq!(
            String::from_utf8_lossy(&bytes).trim(),
            "moat",
            "{path} must read the sandbox's /etc/hostname"
        );
    }
    c.delete_sandbox(&s.id).await.unwrap();
    assert_no_leaks(&facts, &d.data_dir);
}

pub async fn read_all(c: &moat_client::Client, id: &str, path: &str) -> Vec<u8> {
    use futures::StreamExt;
    let mut st = c
        .read_file(id, path)
        .await
        .unwrap_or_else(|e| panic!("read {path}: {e}"));
    let mut v = Vec::new();
    while let Some(b) = st.next().await {
        v.extend_from_slice(&b.unwrap());
    }
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn sandboxes_do_not_see_each_other() {
    let c = shared_client();
    let a = create(&c, "base").await;
    let b = create(&c, "base").await;
    let out = sh(
        &c,
        &a.id,
        "echo from-a > /tmp/shared && sleep 0.2 && echo ok",
    )
    .await;
    assert_eq!(out.stdout, "ok\n");
    let out = sh(&c, &b.id, "cat /tmp/shared 2>&1 || echo missing").await;
    assert!(out.stdout.contains("missing"), "{}", out.stdout);
    let fa = host_facts(&a.id);
    let fb = host_facts(&b.id);
    if is_container() {
        assert_ne!(
            fa.host_uid, fb.host_uid,
            "each sandbox has its own host uid range"
        );
    } else {
        assert_ne!(
            main_pid(&fa.pids),
            main_pid(&fb.pids),
            "each has its own Sentry (or QEMU)"
        );
    }
    assert_ne!(fa.netns, fb.netns);
    c.delete_sandbox(&a.id).await.unwrap();
    c.delete_sandbox(&b.id).await.unwrap();
}
