//! Resource limits: CPU quota, memory (OOM reported as such), disk and /tmp quotas, pids, open files,
//! command and idle timeouts, live stats. Every attack is time-bound.

use std::time::{Duration, Instant};

use futures::StreamExt;
use moat_api::{CreateSandboxRequest, StartProcessRequest};
use moat_client::Client;
use serde_json::json;

use crate::harness::*;

async fn create_with(c: &Client, req: CreateSandboxRequest) -> moat_api::Sandbox {
    c.create_sandbox(&CreateSandboxRequest {
        template: Some("base".into()),
        timeout: Some(300),
        ..req
    })
    .await
    .expect("create sandbox")
}

/// Runs `sh -c cmd` with a timeout (seconds).
async fn sh_timed(c: &Client, id: &str, cmd: &str, timeout: f64) -> Output {
    run_req(
        c,
        id,
        StartProcessRequest {
            cmd: Some(vec!["/bin/sh".into(), "-c".into(), cmd.into()]),
            timeout: Some(timeout),
            ..Default::default()
        },
    )
    .await
}

fn cpu_usage_us(id: &str) -> u64 {
    if let Ok(s) = cgroup_file(id, "cpuacct", "cpuacct.usage") {
        return s.trim().parse::<u64>().unwrap() / 1000;
    }
    let s = cgroup_file(id, "cpu", "cpu.stat").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn free_bytes(p: &std::path::Path) -> u64 {
    let s = nix::sys::statvfs::statvfs(p).unwrap();
    s.blocks_available() * s.fragment_size()
}

#[tokio::test(flavor = "multi_thread")]
async fn cpu_quota_holds_a_spin_on_every_core() {
    let c = shared_client();
    let s = create_with(
        &c,
        CreateSandboxRequest {
            cpu: Some(0.5),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(s.limits.cpu, 0.5);
    // A microVM's fraction of a vCPU is a quota on the guest's cgroup of the sandbox's processes:
    // their CPU time is read there (the host cgroup's holds QEMU, the guest kernel and emulation).
    let vm = isolation() == moat_api::Isolation::Microvm;
    let usage = |c: Client, id: String| async move {
        if vm {
            let out = sh(&c, &id, "cat /sys/fs/cgroup/sandbox/cpu.stat").await;
            out.stdout
                .lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .unwrap_or_else(|| panic!("no usage_usec in {}", out.stdout))
                .trim()
                .parse::<u64>()
                .unwrap()
        } else {
            cpu_usage_us(&id)
        }
    };
    let before = usage(c.clone(), s.id.clone()).await;
    let t = Instant::now();
    // Two spinners (one per host core) for 5 s.
    let out = sh_timed(
        &c,
        &s.id,
        "for i in 1 2; do timeout 5 sh -c 'while :; do :; done' & done; wait",
        20.0,
    )
    .await;
    let wall = t.elapsed().as_secs_f64();
    let used = (usage(c.clone(), s.id.clone()).await - before) as f64 / 1e6;
    let ratio = used / wall;
    eprintln!("cpu=0.5: {used:.2} s CPU over {wall:.2} s wall = {ratio:.3} cores");
    assert_eq!(out.exit.exit_code, Some(0), "{out:?}");
    assert!(ratio <= 0.55, "used {ratio:.3} cores with cpu=0.5");
    assert!(ratio >= 0.3, "the spin hardly ran: {ratio:.3} cores");
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_bomb_is_reported_as_oom() {
    let c = shared_client();
    let s = create_with(
        &c,
        CreateSandboxRequest {
            memory_mb: Some(256),
            ..Default::default()
        },
    )
    .await;
    let swap = cgroup_file(&s.id, "memory", "memory.memsw.limit_in_bytes")
        .or_else(|_| cgroup_file(&s.id, "memory", "memory.swap.max"));
    // The host cgroup of a microVM holds QEMU (guest RAM + QEMU itself); it must not swap either.
    let host_limit = if isolation() == moat_api::Isolation::Microvm {
        cgroup_file(&s.id, "memory", "memory.limit_in_bytes")
            .or_else(|_| cgroup_file(&s.id, "memory", "memory.max"))
            .unwrap()
            .trim()
            .parse::<u64>()
            .unwrap()
    } else {
        256 << 20
    };
    if let Ok(v) = swap {
        let v = v.trim();
        assert!(v == "0" || v == host_limit.to_string(), "swap allowed: {v}");
    }
    let bomb = StartProcessRequest {
        cmd: Some(vec![
            "python3".into(),
            "-c".into(),
            "a = b'x' * (1 << 30)\nprint('survived')".into(),
        ]),
        timeout: Some(60.0),
        ..Default::default()
    };
    if isolation() == moat_api::Isolation::Gvisor {
        // gvisor: the sandbox's memory is the Sentry's, and at the cgroup's limit the host's OOM
        // killer ends the Sentry, and the sandbox with it (tests/e2e/GVISOR.md). The daemon sees
        // it, says why, and removes it; a neighbour goes on.
        let neighbour = create(&c, "base").await;
        let mut events = c.start_process_stream(&s.id, &bomb).await.unwrap();
        let mut survived = false;
        while let Some(Ok(ev)) = events.next().await {
            if let moat_api::ProcessEvent::Stdout(ch) = ev {
                survived |= String::from_utf8_lossy(&decode(&ch)).contains("survived");
            }
        }
        assert!(!survived, "1 GiB fit in a 256 MiB sandbox");
        let mut gone = false;
        for _ in 0..150 {
            if crate::harness::gone(&c, &s.id).await.is_some() {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(gone, "the sandbox outlived its Sentry");
        let log = std::fs::read_to_string(shared().data_dir.join("daemon.log")).unwrap();
        assert!(
            log.lines()
                .any(|l| l.contains(&s.id) && l.contains("ran out of memory")),
            "the daemon did not say why {} ended",
            s.id
        );
        assert_eq!(sh(&c, &neighbour.id, "echo alive").await.stdout, "alive\n");
        c.delete_sandbox(&neighbour.id).await.unwrap();
        return;
    }
    let out = run_req(&c, &s.id, bomb).await;
    eprintln!("memory bomb: {:?}", out.exit);
    assert_eq!(out.exit.signal.as_deref(), Some("SIGKILL"), "{out:?}");
    assert!(!out.exit.timed_out);
    assert_eq!(out.exit.reason.as_deref(), Some("oom"), "{out:?}");
    // The agent survived and answers.
    assert_eq!(sh(&c, &s.id, "echo alive").await.stdout, "alive\n");
    let st = c.sandbox_stats(&s.id).await.unwrap();
    assert!(st.oom_kills >= 1, "{st:?}");
    // The process list reports it too.
    let procs = c.list_processes(&s.id).await.unwrap();
    assert!(procs
        .iter()
        .any(|p| p.exit.as_ref().and_then(|e| e.reason.as_deref()) == Some("oom")));
    // A plain SIGKILL is not an OOM.
    let out = sh_timed(&c, &s.id, "kill -9 $$", 10.0).await;
    assert_eq!(out.exit.signal.as_deref(), Some("SIGKILL"));
    assert_eq!(out.exit.reason, None);
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn disk_and_tmp_fill_end_in_enospc_and_the_host_is_untouched() {
    let d = shared();
    let c = d.client();
    let s = create_with(
        &c,
        CreateSandboxRequest {
            disk_mb: Some(64),
            disk_inodes: Some(2048),
            tmp_mb: Some(32),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        (s.limits.disk_mb, s.limits.disk_inodes, s.limits.tmp_mb),
        (64, 2048, 32)
    );
    let facts = host_facts(&s.id);
    let free_before = free_bytes(&d.data_dir);
    let out = sh_timed(
        &c,
        &s.id,
        "dd if=/dev/zero of=/root/fill bs=1M count=500 2>&1; echo rc=$?",
        60.0,
    )
    .await;
    assert!(out.stdout.contains("No space left on device"), "{out:?}");
    let free_after = free_bytes(&d.data_dir);
    let lost = free_before.saturating_sub(free_after);
    eprintln!(
        "disk_mb=64: host free space went down by {} MiB",
        lost >> 20
    );
    assert!(lost < 100 << 20, "host lost {} MiB", lost >> 20);
    let st = c.sandbox_stats(&s.id).await.unwrap();
    assert!(st.disk_bytes >= 50 << 20, "{st:?}");
    // Inodes.
    let out = sh_timed(
        &c,
        &s.id,
        "rm -f /root/fill; mkdir /root/many && cd /root/many && i=0; while [ $i -lt 4000 ]; do printf '' > f$i || break; i=$((i+1)); done; echo made=$i",
        60.0,
    )
    .await;
    let made: u32 = out
        .stdout
        .trim()
        .strip_prefix("made=")
        .unwrap_or_else(|| panic!("{out:?}"))
        .parse()
        .unwrap();
    assert!(made < 2048, "{made} files with 2048 inodes: {out:?}");
    assert!(out.stderr.contains("No space left"), "{out:?}");
    // /tmp is its own 32 MiB.
    let out = sh_timed(
        &c,
        &s.id,
        "df -m /tmp | tail -1; dd if=/dev/zero of=/tmp/fill bs=1M count=100 2>&1",
        60.0,
    )
    .await;
    assert!(out.stdout.contains("No space left on device"), "{out:?}");
    // A 32 MiB filesystem of its own (its name differs by tier: tmpfs, or gVisor's "none").
    let size = out
        .stdout
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1));
    assert_eq!(size, Some("32"), "{out:?}");
    c.delete_sandbox(&s.id).await.unwrap();
    wait_not_found(&c, &s.id).await;
    assert_no_leaks(&facts, &d.data_dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn fork_bomb_hits_the_pids_limit_and_neighbours_are_fine() {
    let d = shared();
    let c = d.client();
    let bomb = create_with(
        &c,
        CreateSandboxRequest {
            pids: Some(64),
            ..Default::default()
        },
    )
    .await;
    let neighbour = create(&c, "base").await;
    let started = Instant::now();
    let c2 = c.clone();
    let id = bomb.id.clone();
    let attack = tokio::spawn(async move {
        sh_timed(
            &c2,
            &id,
            "bash -c 'f() { f | f & }; f' 2>&1 | head -c 2000; sleep 1",
            8.0,
        )
        .await
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The cgroup counts the sandbox's processes on the container tier; on gvisor it counts the
    // host threads of the Sentry and its stubs (bounded at 16 per process + 256) while the Sentry
    // itself holds the sandbox's processes to the limit (RLIMIT_NPROC, set by the agent).
    let bound = if is_container() { 64 } else { 64 * 16 + 256 };
    let pids = cgroup_file(&bomb.id, "pids", "pids.current").unwrap();
    assert!(pids.trim().parse::<u64>().unwrap() <= bound, "{pids}");
    let t = Instant::now();
    let out = sh(&c, &neighbour.id, "echo neighbour").await;
    assert_eq!(out.stdout, "neighbour\n");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "neighbour took {:?}",
        t.elapsed()
    );
    let t = Instant::now();
    c.get_sandbox(&neighbour.id).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(2));
    let out = tokio::time::timeout(Duration::from_secs(30), attack)
        .await
        .expect("bomb bounded")
        .unwrap();
    // EAGAIN at the pids limit: reported by bash inside the bomb, or by the outer shell when the bomb
    // filled the limit before the shell could fork the rest of its pipeline.
    let said = format!("{}{}", out.stdout, out.stderr);
    assert!(
        said.contains("Resource temporarily unavailable") || said.contains("Cannot fork"),
        "{out:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    c.delete_sandbox(&bomb.id).await.unwrap();
    c.delete_sandbox(&neighbour.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn nofile_and_command_timeout_reach_processes() {
    let c = shared_client();
    let s = create_with(
        &c,
        CreateSandboxRequest {
            nofile: Some(1234),
            command_timeout: Some(1),
            output_bytes: Some(1 << 20),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        (
            s.limits.nofile,
            s.limits.command_timeout,
            s.limits.output_bytes
        ),
        (1234, 1, 1 << 20)
    );
    let out = sh(&c, &s.id, "ulimit -n; ulimit -Hn").await;
    assert_eq!(out.stdout, "1234\n1234\n");
    let t = Instant::now();
    let out = sh(&c, &s.id, "sleep 30").await;
    assert!(out.exit.timed_out, "{out:?}");
    assert_eq!(out.exit.reason.as_deref(), Some("timeout"));
    assert!(t.elapsed() < Duration::from_secs(10));
    // A request's own timeout wins over the default.
    let out = sh_timed(&c, &s.id, "sleep 1.5; echo done", 10.0).await;
    assert_eq!(out.stdout, "done\n");
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_timeout_kills_an_untouched_sandbox() {
    let c = shared_client();
    let idle = create_with(
        &c,
        CreateSandboxRequest {
            idle_timeout: Some(2),
            ..Default::default()
        },
    )
    .await;
    let busy = create_with(
        &c,
        CreateSandboxRequest {
            idle_timeout: Some(3),
            ..Default::default()
        },
    )
    .await;
    // Touch `busy` every second for 6 s; leave `idle` alone.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        c.get_sandbox(&busy.id).await.unwrap();
    }
    let gone = matches!(c.list_sandboxes(&Default::default()).await, Ok(l) if !l.iter().any(|s| s.id == idle.id));
    assert!(gone, "idle sandbox still there");
    c.get_sandbox(&busy.id).await.expect("busy sandbox kept");
    c.delete_sandbox(&busy.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_are_plausible() {
    let c = shared_client();
    let s = create_with(&c, CreateSandboxRequest::default()).await;
    c.start_process_background(
        &s.id,
        &StartProcessRequest {
            cmd: Some(vec![
                "python3".into(),
                "-c".into(),
                "import time\na = b'x' * (100 << 20)\ntime.sleep(60)".into(),
            ]),
            timeout: Some(60.0),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let mut last;
    let ok = {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let st = c.sandbox_stats(&s.id).await.unwrap();
            let good = st.memory_bytes >= 100 << 20 && st.pids >= 2;
            last = Some(st);
            if good || Instant::now() > deadline {
                break good;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    let st = last.unwrap();
    assert!(ok, "{st:?}");
    assert!(st.memory_peak_bytes >= st.memory_bytes);
    assert!(st.cpu_usage_us > 0);
    assert!(st.cpu_cores >= 0.0 && st.cpu_cores < 4.0, "{st:?}");
    assert_eq!(st.limits, s.limits);
    c.delete_sandbox(&s.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_limits_are_400_naming_the_field() {
    let d = shared();
    let http = reqwest::Client::new();
    for (body, field) in [
        (json!({"pids": 0}), "pids"),
        (json!({"disk_mb": -1}), "disk_mb"),
        (json!({"disk_mb": 1u64 << 40}), "disk_mb"),
        (json!({"nofile": 1_000_000}), "nofile"),
        (json!({"tmp_mb": 1_000_000}), "tmp_mb"),
        (json!({"output_bytes": 10}), "output_bytes"),
        (json!({"idle_timeout": 1u64 << 40}), "idle_timeout"),
        (json!({"disk_mb": 0, "disk_inodes": 5000}), "disk_inodes"),
    ] {
        let resp = http
            .post(format!("{}/v1/sandboxes", d.url))
            .bearer_auth(d.api_key())
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400, "{body}");
        let e: moat_api::ErrorBody = resp.json().await.unwrap();
        assert_eq!(e.error.field.as_deref(), Some(field), "{body}: {e:?}");
    }
}

/// The noisy-neighbour trial (issue 32): one sandbox runs a fork bomb, a memory bomb and a disk
/// fill at once, with the daemon's default limits; a neighbour's commands and the API keep
/// answering, every one of them. (How fast is the benchmark's business: bench scenario 13.)
#[tokio::test(flavor = "multi_thread")]
async fn a_neighbour_and_the_api_keep_working_beside_the_abuse_trio() {
    let d = shared();
    let c = d.client();
    let noisy = create(&c, "base").await;
    let quiet = create(&c, "base").await;
    let abuse = "(while true; do tail /dev/zero; done) >/dev/null 2>&1 & \
         (while true; do dd if=/dev/zero of=/fill bs=1M count=512 2>/dev/null; rm -f /fill; done) >/dev/null 2>&1 & \
         (f(){ f|f& }; f) >/dev/null 2>&1 &";
    let started = run_req(
        &c,
        &noisy.id,
        StartProcessRequest {
            cmd: Some(vec!["bash".into(), "-c".into(), abuse.into()]),
            timeout: Some(20.0),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(started.exit.exit_code, Some(0), "{started:?}");
    let deadline = Instant::now() + Duration::from_secs(8);
    let (mut execs, mut reads) = (0, 0);
    while Instant::now() < deadline {
        let out = sh_timed(&c, &quiet.id, "echo alive", 30.0).await;
        assert_eq!(out.stdout, "alive\n", "neighbour command {execs}: {out:?}");
        execs += 1;
        let s = c.get_sandbox(&quiet.id).await.expect("the API answers");
        assert_eq!(s.state, moat_api::SandboxState::Running);
        reads += 1;
    }
    eprintln!("beside the abuse: {execs} neighbour commands and {reads} API reads, all answered");
    assert!(execs >= 3, "only {execs} neighbour commands in 8 s");
    // The noisy sandbox goes with its bombs still running (on gvisor its memory bomb may have
    // ended it already: the Sentry is the sandbox's memory, see GVISOR.md).
    match c.delete_sandbox(&noisy.id).await {
        Ok(()) => {}
        Err(e) if e.is_not_found() => {}
        Err(e) => panic!("delete the noisy sandbox: {e}"),
    }
    wait_not_found(&c, &noisy.id).await;
    assert_eq!(sh(&c, &quiet.id, "echo still").await.stdout, "still\n");
    c.delete_sandbox(&quiet.id).await.unwrap();
}
