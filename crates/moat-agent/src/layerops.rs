//! VM mode only: the sandbox's processes and writable layer, for the microvm tier's pause and
//! snapshots (the other tiers reach both from the host). `POST /vm/freeze` freezes or thaws the
//! sandbox cgroup; `GET /vm/layer` streams the overlay's upper directory as a tar archive that
//! keeps what a layer is made of: whiteouts (character devices 0:0), extended attributes (opaque
//! directories, file capabilities) as PAX `SCHILY.xattr.*` records, hard links, modes, owners and
//! times. The daemon checks every entry when it unpacks the archive (the guest is not trusted).

use moat_api::protocol::endpoint;
use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use hyper::body::Incoming;
use moat_api::guest::SANDBOX_CGROUP;
use tokio::sync::mpsc;

use crate::http::{no_content, streamed, ApiError, HandlerResult};
use crate::tarops::ChannelWriter;

/// The overlay's upper directory, opened before the agent changed its root (it is not reachable
/// by path from the sandbox's root).
static UPPER: OnceLock<OwnedFd> = OnceLock::new();

/// Whether the host froze the sandbox (and so a `GET /vm/layer` must leave it frozen).
static FROZEN: Mutex<bool> = Mutex::new(false);

/// Keeps a descriptor of the upper directory at `path` (called once at boot).
pub fn keep_upper(path: &str) -> Result<(), String> {
    let f = std::fs::File::open(path).map_err(|e| format!("open {path}: {e}"))?;
    let _ = UPPER.set(OwnedFd::from(f));
    Ok(())
}

fn upper_root() -> Result<PathBuf, ApiError> {
    let fd = UPPER.get().ok_or_else(|| {
        ApiError::not_found("this agent has no writable layer to export (VM mode only)")
    })?;
    Ok(PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())))
}

/// Freezes (`true`) or thaws the sandbox cgroup; a freeze waits until every process is frozen,
/// then writes the VM's disk through (a paused VM's files then survive the end of its QEMU, as in
/// a host reboot).
fn set_frozen(frozen: bool) -> std::io::Result<()> {
    std::fs::write(
        format!("{SANDBOX_CGROUP}/cgroup.freeze"),
        if frozen { "1" } else { "0" },
    )?;
    if !frozen {
        return Ok(());
    }
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let events = std::fs::read_to_string(format!("{SANDBOX_CGROUP}/cgroup.events"))?;
        if events.lines().any(|l| l.trim() == "frozen 1") {
            if let Some(fd) = UPPER.get() {
                // SAFETY: syncfs on a descriptor this process keeps open for its whole life.
                if unsafe { libc::syncfs(fd.as_raw_fd()) } < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            return Ok(());
        }
        if Instant::now() > until {
            let _ = std::fs::write(format!("{SANDBOX_CGROUP}/cgroup.freeze"), "0");
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the sandbox's processes did not freeze within 10 s",
            ));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// `POST /vm/freeze`
pub async fn freeze(body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::VmFreeze, _>(body).await?;
    tokio::task::spawn_blocking(move || {
        let mut held = FROZEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        set_frozen(req.frozen)?;
        *held = req.frozen;
        std::io::Result::Ok(())
    })
    .await
    .map_err(|e| ApiError::internal(format!("freeze worker: {e}")))?
    .map_err(|e| ApiError::internal(format!("cgroup.freeze of the sandbox: {e}")))?;
    no_content()
}

/// `POST /vm/clock`
pub async fn set_clock(body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::VmClock, _>(body).await?;
    if UPPER.get().is_none() {
        return Err(ApiError::conflict("only a VM's agent sets its clock"));
    }
    let ts = nix::sys::time::TimeSpec::new(
        (req.realtime_ns / 1_000_000_000) as libc::time_t,
        (req.realtime_ns % 1_000_000_000) as libc::c_long,
    );
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts)
        .map_err(|e| ApiError::internal(format!("clock_settime: {e}")))?;
    no_content()
}

/// `POST /vm/network`: gives the guest's `eth0` another address, route and nameserver, or takes
/// them away (a VM restored from a snapshot into another sandbox's network).
pub async fn set_network(body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::VmNetwork, _>(body).await?;
    if UPPER.get().is_none() {
        return Err(ApiError::conflict(
            "only a VM's agent configures its network",
        ));
    }
    tokio::task::spawn_blocking(move || crate::vmnet::configure(req.network.as_ref()))
        .await
        .map_err(|e| ApiError::internal(format!("network worker: {e}")))?
        .map_err(|e| ApiError::internal(format!("the guest's network: {e}")))?;
    no_content()
}

/// `GET /vm/layer[?freeze=true]`
pub fn download(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::VmLayer>(query)?;
    let root = upper_root()?;
    let (tx, rx) = mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        let held = FROZEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let freeze = q.freeze && !*held;
        let res = (|| {
            if freeze {
                set_frozen(true)?;
            }
            let r = archive(&root, ChannelWriter::new(tx.clone()));
            if freeze {
                set_frozen(false)?;
            }
            r
        })();
        drop(held);
        if let Err(e) = res {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                eprintln!("moat-agent: export of the writable layer: {e}");
            }
            let _ = tx.blocking_send(Err(e));
        }
    });
    Ok(streamed("application/x-tar", rx, None))
}

/// The extended attributes of `path` (not following a symlink), as (name, value).
pub fn xattrs(path: &Path) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut names = vec![0u8; 4096];
    let n = loop {
        // SAFETY: `c` is a NUL-terminated path and `names` a buffer of the length passed.
        let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) if names.len() < 1 << 20 => names.resize(names.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(e),
        }
    };
    let mut out = Vec::new();
    for name in names[..n].split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let Ok(name_s) = std::str::from_utf8(name) else {
            continue;
        };
        let cname = CString::new(name)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidData))?;
        let mut value = vec![0u8; 256];
        loop {
            // SAFETY: both strings are NUL-terminated and `value` is a buffer of the length passed.
            let v = unsafe {
                libc::lgetxattr(
                    c.as_ptr(),
                    cname.as_ptr(),
                    value.as_mut_ptr().cast(),
                    value.len(),
                )
            };
            if v >= 0 {
                value.truncate(v as usize);
                out.push((name_s.to_string(), value));
                break;
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ERANGE) if value.len() < 1 << 20 => value.resize(value.len() * 8, 0),
                Some(libc::ENODATA) => break,
                _ => return Err(e),
            }
        }
    }
    Ok(out)
}

/// Writes the tree under `root` (without `root` itself) as a tar archive: a directory before what
/// it holds, the second and later names of a file as hard links to its first; sockets are left out
/// (a socket file means nothing without its process).
fn archive(root: &Path, w: ChannelWriter) -> std::io::Result<()> {
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    let mut first_name: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let mut dirs = vec![PathBuf::new()];
    while let Some(rel) = dirs.pop() {
        let mut names: Vec<_> = std::fs::read_dir(root.join(&rel))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<std::io::Result<_>>()?;
        names.sort();
        for name in names {
            let rel = rel.join(&name);
            let full = root.join(&rel);
            let meta = std::fs::symlink_metadata(&full)?;
            if meta.file_type().is_socket() {
                continue;
            }
            let attrs = xattrs(&full)?;
            if !attrs.is_empty() {
                let keys: Vec<String> = attrs
                    .iter()
                    .map(|(k, _)| format!("SCHILY.xattr.{k}"))
                    .collect();
                b.append_pax_extensions(
                    keys.iter()
                        .map(String::as_str)
                        .zip(attrs.iter().map(|(_, v)| v.as_slice())),
                )?;
            }
            if meta.is_file() && meta.nlink() > 1 {
                let key = (meta.dev(), meta.ino());
                if let Some(first) = first_name.get(&key) {
                    let mut h = tar::Header::new_gnu();
                    h.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
                    h.set_entry_type(tar::EntryType::Link);
                    h.set_size(0);
                    b.append_link(&mut h, &rel, first)?;
                    continue;
                }
                first_name.insert(key, rel.clone());
            }
            let ft = meta.file_type();
            if ft.is_fifo() || ft.is_char_device() || ft.is_block_device() {
                // (tar's own append of a special file names it by its full path.)
                let mut h = tar::Header::new_gnu();
                h.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
                h.set_entry_type(if ft.is_fifo() {
                    tar::EntryType::Fifo
                } else if ft.is_char_device() {
                    tar::EntryType::Char
                } else {
                    tar::EntryType::Block
                });
                h.set_size(0);
                let rdev = meta.rdev();
                h.set_device_major(libc::major(rdev))?;
                h.set_device_minor(libc::minor(rdev))?;
                b.append_data(&mut h, &rel, std::io::empty())?;
                continue;
            }
            b.append_path_with_name(&full, &rel)?;
            if meta.is_dir() {
                dirs.push(rel);
            }
        }
    }
    let mut w = b.into_inner()?;
    std::io::Write::flush(&mut w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archive_keeps_links_fifos_and_skips_sockets() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("a/b")).unwrap();
        std::fs::write(r.join("a/b/f"), "data").unwrap();
        std::fs::hard_link(r.join("a/b/f"), r.join("a/g")).unwrap();
        std::os::unix::fs::symlink("b/f", r.join("a/s")).unwrap();
        nix::unistd::mkfifo(
            &r.join("p"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(r.join("sock")).unwrap();
        let (tx, mut rx) = mpsc::channel(1024);
        archive(r, ChannelWriter::new(tx)).unwrap();
        let mut bytes = Vec::new();
        while let Ok(Ok(b)) = rx.try_recv() {
            bytes.extend_from_slice(&b);
        }
        let mut ar = tar::Archive::new(bytes.as_slice());
        let mut seen = Vec::new();
        for e in ar.entries().unwrap() {
            let e = e.unwrap();
            let kind = e.header().entry_type();
            let link = e.link_name().unwrap().map(|l| l.display().to_string());
            seen.push((e.path().unwrap().display().to_string(), kind, link));
        }
        let names: Vec<&str> = seen.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "p", "a/b", "a/g", "a/s", "a/b/f"]);
        assert!(seen
            .iter()
            .any(|(n, k, _)| n == "p" && *k == tar::EntryType::Fifo));
        assert!(seen.iter().any(|(n, k, l)| n == "a/s"
            && *k == tar::EntryType::Symlink
            && l.as_deref() == Some("b/f")));
        // `a/g` comes first (sorted), so `a/b/f` is the link to it.
        assert!(seen.iter().any(|(n, k, l)| n == "a/b/f"
            && *k == tar::EntryType::Link
            && l.as_deref() == Some("a/g")));
    }
}
