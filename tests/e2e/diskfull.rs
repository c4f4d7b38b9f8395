//! A full disk (issue 32's trial, made permanent): the daemon's data directory on a small
//! filesystem of the test's own (a loop-mounted ext4 image), sandboxes whose quotas add up to more
//! than it has. A sandbox filling its disk is stopped at the host's reserve with ENOSPC, its files
//! intact; while the host is low nothing new is made (507 with what to do); with the filesystem
//! then filled to the last byte from outside, a timeout change and a delete still work and are in
//! the audit log; when space returns everything works again, after a restart too.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use moat_api::{AuditQuery, CreateSandboxRequest, CreateSnapshotRequest, ErrorCode, SandboxState};

use crate::harness::*;

const FS_MB: u64 = 768;
const RESERVE_MB: u64 = 128;
const QUOTA_MB: u64 = 700;

/// An ext4 filesystem of the test's own, mounted at `at`; unmounted when dropped.
struct LoopFs {
    at: PathBuf,
}

impl LoopFs {
    fn new(image: &Path, mb: u64, at: &Path) -> LoopFs {
        std::fs::create_dir_all(at).unwrap();
        let f = std::fs::File::create(image).unwrap();
        f.set_len(mb << 20).unwrap();
        drop(f);
        let ok = |c: &mut Command| assert!(c.status().unwrap().success(), "{c:?}");
        ok(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-m", "0"])
            .arg(image));
        ok(Command::new("mount")
            .args(["-o", "loop"])
            .arg(image)
            .arg(at));
        LoopFs {
            at: at.to_path_buf(),
        }
    }

    /// Free bytes (what the daemon sees as free).
    fn avail(&self) -> u64 {
        let s = nix::sys::statvfs::statvfs(&self.at).unwrap();
        s.blocks_available() as u64 * s.fragment_size() as u64
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// Takes every byte left on the filesystem of `path` (something else than moat filling it).
fn fill_up(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![1u8; 1 << 20];
    while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
    let _ = f.sync_all();
}

/// Runs `cmd` in sandbox `id` until its output says `word` (the disk guard acts within a second or
/// two); Err with the last output after 10 s.
async fn until_says(
    c: &moat_client::Client,
    id: &str,
    cmd: &str,
    word: &str,
) -> Result<Output, Output> {
    let mut last = Output::default();
    for _ in 0..50 {
        last = sh(c, id, cmd).await;
        if last.stdout.contains(word) {
            return Ok(last);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last)
}

/// Whether the host caps this tier's sandbox disks (container, gvisor: the image is mounted on the
/// host) rather than pausing the sandbox (microvm: only the guest mounts it).
fn capped_on_the_host() -> bool {
    isolation() != moat_api::Isolation::Microvm
}

fn is_507(r: Result<impl std::fmt::Debug, moat_client::Error>, what: &str) {
    match r {
        Err(e) if e.code() == Some(ErrorCode::InsufficientStorage) => {
            assert!(e.to_string().contains("reserve"), "{what}: {e}");
        }
        other => panic!("{what}: expected 507, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_disk_harms_no_sandbox_and_the_api_recovers() {
    let tmp = tempfile::tempdir().unwrap();
    let fs = LoopFs::new(&tmp.path().join("fs.img"), FS_MB, &tmp.path().join("data"));
    let quota = QUOTA_MB.to_string();
    let reserve = RESERVE_MB.to_string();
    let (d, c) = busybox_daemon(
        tmp.path(),
        &["--disk-reserve-mb", &reserve, "--default-disk-mb", &quota],
    )
    .await;
    let make = || CreateSandboxRequest {
        timeout: Some(1800),
        ..Default::default()
    };
    let a = c.create_sandbox(&make()).await.unwrap();
    let b = c.create_sandbox(&make()).await.unwrap();
    let df = c.disk_usage().await.unwrap();
    let f = df.filesystem.expect("df names the filesystem");
    assert_eq!(f.reserve_bytes, RESERVE_MB << 20);
    assert_eq!(f.quota_bytes, (2 * QUOTA_MB) << 20, "{f:?}");
    assert!(f.quota_bytes > f.total_bytes && !f.low, "{f:?}");

    // A fills its disk, which is larger than what the host has: stopped at the host's reserve.
    let marker = "written before the disk filled";
    let o = sh(&c, &a.id, &format!("echo '{marker}' > /marker && sync")).await;
    assert_eq!(o.exit.exit_code, Some(0), "{o:?}");
    let fill = "busybox dd if=/dev/zero of=/big bs=1M count=760 2>&1; echo rc=$?; sync";
    if capped_on_the_host() {
        let o = sh(&c, &a.id, fill).await;
        eprintln!("dd in the sandbox: {}", o.stdout.trim());
        assert!(o.stdout.contains("No space left"), "{o:?}");
        assert!(!o.stdout.contains("rc=0"), "{o:?}");
    } else {
        // A microVM's disk is the guest's: the host cannot cap it, and pauses the VM instead.
        let o = sh(&c, &a.id, &format!("({fill}) > /dd.log 2>&1 &")).await;
        assert_eq!(o.exit.exit_code, Some(0), "{o:?}");
        let mut state = None;
        for _ in 0..600 {
            state = Some(c.get_sandbox(&a.id).await.unwrap().state);
            if state == Some(SandboxState::Paused) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(
            state,
            Some(SandboxState::Paused),
            "the filling VM was not paused"
        );
    }
    let avail = fs.avail();
    eprintln!(
        "host free after the fill: {} MiB (reserve {RESERVE_MB} MiB)",
        avail >> 20
    );
    assert!(
        avail >= (RESERVE_MB - 32) << 20,
        "the sandbox took the reserve: {} MiB free",
        avail >> 20
    );
    if capped_on_the_host() {
        // Its files are whole and its filesystem writable (a delete needs no space).
        let o = sh(&c, &a.id, "cat /marker; touch /still-writable && echo ok").await;
        assert_eq!(o.stdout, format!("{marker}\nok\n"), "{o:?}");
    }

    // Low: nothing new is made, with what to do; what exists goes on.
    let df = c.disk_usage().await.unwrap().filesystem.unwrap();
    assert!(df.low, "{df:?}");
    is_507(c.create_sandbox(&make()).await, "create");
    is_507(
        c.create_snapshot(&b.id, &CreateSnapshotRequest::default())
            .await,
        "snapshot",
    );
    let o = sh(&c, &b.id, "echo alive").await;
    assert_eq!(o.stdout, "alive\n");

    // Something else takes every byte left (the reserve too).
    let filler = fs.at.join("filler");
    fill_up(&filler);
    assert!(fs.avail() < 1 << 20, "{} bytes left", fs.avail());
    // A timeout change and a delete still work, and the audit log has them.
    c.set_timeout(&b.id, 900)
        .await
        .expect("timeout change on a full disk");
    c.delete_sandbox(&b.id)
        .await
        .expect("delete on a full disk");
    wait_not_found(&c, &b.id).await;
    let audit = c
        .audit(&AuditQuery {
            sandbox: Some(b.id.clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let actions: Vec<String> = audit
        .iter()
        .map(|e| format!("{} {:?}", e.action, e.status))
        .collect();
    assert!(
        audit
            .iter()
            .any(|e| e.action.starts_with("DELETE") && e.status == Some(204)),
        "{actions:?}"
    );
    assert!(
        audit.iter().any(|e| e.action.contains("/timeout")),
        "{actions:?}"
    );
    // Space returns: the filler goes, A deletes its file (a paused microVM is deleted).
    std::fs::remove_file(&filler).unwrap();
    let mut live = vec![];
    if capped_on_the_host() {
        let o = sh(&c, &a.id, "cat /marker; rm /big && sync && echo removed").await;
        assert_eq!(o.stdout, format!("{marker}\nremoved\n"), "{o:?}");
        live.push(a.id.clone());
    } else {
        c.delete_sandbox(&a.id).await.expect("delete a paused VM");
        wait_not_found(&c, &a.id).await;
    }
    let mut low = true;
    for _ in 0..50 {
        low = c.disk_usage().await.unwrap().filesystem.unwrap().low;
        if !low {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!low, "still low with {} MiB free", fs.avail() >> 20);
    let again = c
        .create_sandbox(&make())
        .await
        .expect("create after recovery");
    if capped_on_the_host() {
        // The guard lifts the caps within a second or two of the space coming back.
        let write = "busybox dd if=/dev/zero of=/again bs=1M count=64 2>&1 && sync && echo wrote";
        if let Err(last) = until_says(&c, &a.id, write, "wrote").await {
            panic!(
                "A cannot write after the space came back ({} MiB free on the host): {last:?}",
                fs.avail() >> 20
            );
        }
    }
    let mut kept = false;
    for _ in 0..50 {
        if tmp.path().join("data/moat.db.reserve").exists() {
            kept = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(kept, "the database's reserve was not made again");

    // The daemon dies while the host is full (its caps stay in the kernel with the mounts); the
    // space comes back while it is down: the new daemon lifts the caps it did not set, and finds
    // everything as it was.
    fill_up(&filler);
    // (A microVM is not written to here: with the host full, QEMU stops a VM whose disk write
    // fails, and the guard pauses one that grows.)
    if capped_on_the_host() {
        let probe = "echo x > /probe.$$ 2>&1 && sync && echo wrote || echo refused";
        assert!(
            until_says(&c, &again.id, probe, "refused").await.is_ok(),
            "a sandbox could still write with the host full"
        );
    }
    d.kill9();
    std::fs::remove_file(&filler).unwrap();
    d.restart();
    let mut ids: Vec<String> = c
        .list_sandboxes(&Default::default())
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    ids.sort();
    live.push(again.id.clone());
    live.sort();
    assert_eq!(ids, live);
    if capped_on_the_host() {
        let o = sh(&c, &a.id, "cat /marker").await;
        assert_eq!(o.stdout, format!("{marker}\n"), "{o:?}");
    }
    let write = "busybox dd if=/dev/zero of=/after bs=1M count=32 2>&1 && sync && echo wrote";
    if let Err(last) = until_says(&c, &again.id, write, "wrote").await {
        panic!("the caps of the daemon that died were not lifted: {last:?}");
    }
    for id in live {
        c.delete_sandbox(&id).await.unwrap();
    }
    d.stop();
    drop(fs);
}
