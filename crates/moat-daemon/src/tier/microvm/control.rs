//! The tier's own requests to a VM's agent, over the agent's control port (a second virtio-serial
//! port with the same protocol, so they never wait behind the daemon's connection on the first):
//! freezing and thawing the sandbox's processes, and exporting the guest's writable layer (the
//! overlay's upper directory, which only the guest can read) as a tar archive that is unpacked
//! here into a layer directory.
//!
//! The archive comes from a guest that may be hostile: every entry is checked before it is made.
//! Paths stay inside the destination (no `..`, no absolute paths, no parent that is or leads
//! through a symlink, nothing made twice), only the kinds a layer holds are made (directories,
//! regular files, symlinks, hard links to files made before, fifos and whiteouts; other device
//! nodes are left out), only the extended attributes overlayfs and programs use are set
//! (`trusted.overlay.opaque`, `security.capability`, `user.*`), and the total size is bounded.

use std::collections::HashMap;
use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use crate::agent::{AgentClient, AgentStream, Dial};

/// Which VM's control port to reach.
#[derive(Debug, Clone)]
pub struct Target {
    pub id: String,
    /// The control port's socket (owned by the VM's `uid`).
    pub sock: PathBuf,
    pub uid: u32,
}

/// One agent client per VM on its control port, kept for the VM's life: a virtio-serial port has
/// no connection boundaries of its own, so a guest that has not yet seen one connection end would
/// read the next one's bytes as more of the first (the same holds for the daemon's connection on
/// the agent port).
#[derive(Clone)]
pub struct Connections {
    clients: Arc<tokio::sync::Mutex<HashMap<String, Arc<AgentClient>>>>,
    ports: super::PortState,
}

impl Connections {
    pub fn new(ports: super::PortState) -> Connections {
        Connections {
            clients: Arc::default(),
            ports,
        }
    }

    /// The VM's control-port client (made on first use; it dials when a call needs it).
    async fn client(&self, t: &Target) -> Arc<AgentClient> {
        let mut map = self.clients.lock().await;
        if let Some(c) = map.get(&t.id) {
            return c.clone();
        }
        let (sock, uid, id, ports) = (t.sock.clone(), t.uid, t.id.clone(), self.ports.clone());
        let dial: Dial = Arc::new(move || {
            let (path, id, ports) = (sock.clone(), id.clone(), ports.clone());
            Box::pin(async move {
                let std = tokio::task::spawn_blocking(move || {
                    let run = path.parent().unwrap_or(Path::new("/"));
                    ports.prepare(run, &id, uid, super::CONTROL_PORT_DEV)?;
                    super::qmp::connect_owned(&path, uid)
                })
                .await??;
                std.set_nonblocking(true)?;
                let stream: AgentStream = Box::pin(tokio::net::UnixStream::from_std(std)?);
                Ok(stream)
            })
        });
        let client = Arc::new(AgentClient::new(t.id.clone(), dial));
        map.insert(t.id.clone(), client.clone());
        client
    }

    /// Drops the connection to a VM that is gone.
    pub async fn forget(&self, id: &str) {
        self.clients.lock().await.remove(id);
    }

    /// Freezes (after which every process of the sandbox is stopped) or thaws the sandbox's
    /// processes.
    pub async fn set_frozen(&self, t: &Target, frozen: bool) -> Result<()> {
        self.client(t)
            .await
            .vm_freeze(frozen)
            .await
            .context("the VM's control port")
    }

    /// Sets the guest's wall clock to the host's. A request takes time to reach the guest, which
    /// would then be behind the host by that much (milliseconds under TCG: enough to put a command's
    /// start, stamped by the guest, before the request that started it in the audit log). So the
    /// clock is set three times: the first makes the connection, the second measures a round trip,
    /// the third sets the host's time plus half of it.
    pub async fn set_clock(&self, t: &Target) -> Result<()> {
        let client = self.client(t).await;
        send_clock(&client, Duration::ZERO).await?;
        let round_trip = send_clock(&client, Duration::ZERO).await?;
        send_clock(&client, round_trip / 2).await?;
        Ok(())
    }

    /// Gives the guest's `eth0` the address, route and nameserver of `network` (None: down, with
    /// none): a VM restored from a snapshot into another sandbox's network.
    pub async fn set_network(
        &self,
        t: &Target,
        network: Option<moat_api::guest::GuestNetwork>,
    ) -> Result<()> {
        self.client(t)
            .await
            .vm_network(&moat_api::guest::NetworkRequest { network })
            .await
            .context("the VM's control port")
    }

    /// Exports the guest's writable layer into the empty directory `dest` (at most `max_bytes` of
    /// file data); with `freeze`, the agent keeps the sandbox's processes frozen while it reads it.
    pub async fn export_layer(
        &self,
        t: &Target,
        freeze: bool,
        dest: &Path,
        max_bytes: u64,
    ) -> Result<()> {
        use futures::TryStreamExt;
        let resp = self
            .client(t)
            .await
            .vm_layer(freeze)
            .await
            .context("the VM's control port")?;
        let stream =
            http_body_util::BodyDataStream::new(resp.into_body()).map_err(std::io::Error::other);
        let reader = tokio_util::io::SyncIoBridge::new(tokio_util::io::StreamReader::new(stream));
        let dest = dest.to_path_buf();
        let unpack = tokio::task::spawn_blocking(move || unpack_layer(reader, &dest, max_bytes));
        // A guest that never ends its archive holds up only its own snapshot, and not for ever
        // (the unpack ends when the response body is dropped).
        match tokio::time::timeout(EXPORT_TIMEOUT, unpack).await {
            Ok(r) => r?,
            Err(_) => {
                bail!("the VM's agent did not finish exporting its layer in {EXPORT_TIMEOUT:?}")
            }
        }
    }
}

/// Sets the guest's clock to the host's plus `ahead`; returns how long the request took.
async fn send_clock(client: &AgentClient, ahead: Duration) -> Result<Duration> {
    let started = std::time::Instant::now();
    let realtime_ns = (std::time::SystemTime::now() + ahead)
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos() as u64;
    client
        .vm_clock(realtime_ns)
        .await
        .context("the VM's control port")?;
    Ok(started.elapsed())
}

/// How long the export of a VM's writable layer may take.
const EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1800);

/// The extended attributes a layer may carry from a guest.
fn allowed_xattr(name: &str) -> bool {
    name == "trusted.overlay.opaque" || name == "security.capability" || name.starts_with("user.")
}

/// `rel` as plain names (no `..`, root or prefix; `.` dropped); None when it has any other.
fn plain(rel: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in rel.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

/// `dest/rel`, checked: nothing exists there yet, and its parent is `dest` or a directory made
/// under it (not a symlink, not leading out).
fn target(dest: &Path, canon_dest: &Path, rel: &Path) -> Result<PathBuf> {
    let full = dest.join(rel);
    let parent = full.parent().unwrap_or(dest);
    let canon = parent.canonicalize().with_context(|| {
        format!(
            "{}: its directory is not in the archive before it",
            rel.display()
        )
    })?;
    if canon != canon_dest.join(rel.parent().unwrap_or(Path::new(""))) {
        bail!("{} leads outside the layer", rel.display());
    }
    if std::fs::symlink_metadata(&full).is_ok() {
        bail!("{} is in the archive twice", rel.display());
    }
    Ok(full)
}

fn lsetxattr(path: &Path, name: &str, value: &[u8]) -> Result<()> {
    let p = CString::new(path.as_os_str().as_bytes())?;
    let n = CString::new(name)?;
    // SAFETY: both strings are NUL-terminated and `value` is valid for its length.
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("set {name} on {}", path.display()));
    }
    Ok(())
}

/// Unpacks a layer archive from a guest into the empty directory `dest` (see the module's notes):
/// at most `max_bytes` of file data, and at most one entry per 4 KiB of it (no filesystem on the
/// VM's disk holds more files than that) or a million, whichever is more.
pub fn unpack_layer(reader: impl Read, dest: &Path, max_bytes: u64) -> Result<()> {
    let max_entries = (max_bytes / 4096).max(1_000_000);
    let mut entries = 0u64;
    use nix::sys::stat::{mknod, Mode, SFlag};
    let canon_dest = dest.canonicalize()?;
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(true);
    ar.set_preserve_mtime(true);
    ar.set_unpack_xattrs(false);
    ar.set_overwrite(false);
    let (mut bytes, mut skipped) = (0u64, 0u64);
    for entry in ar.entries().context("read the layer archive")? {
        let mut entry = entry.context("read the layer archive")?;
        entries += 1;
        if entries > max_entries {
            bail!("the layer archive holds more than {max_entries} entries");
        }
        let raw = entry.path()?.into_owned();
        let rel = plain(&raw)
            .ok_or_else(|| anyhow!("layer entry {:?} is not a plain relative path", raw))?;
        let kind = entry.header().entry_type();
        let size = entry.header().size()?;
        bytes = bytes.saturating_add(size);
        if bytes > max_bytes {
            bail!("the layer archive holds more than the VM's disk ({max_bytes} bytes)");
        }
        let xattrs: Vec<(String, Vec<u8>)> = match entry.pax_extensions()? {
            Some(exts) => exts
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    let key = e.key().ok()?.strip_prefix("SCHILY.xattr.")?.to_string();
                    Some((key, e.value_bytes().to_vec()))
                })
                .filter(|(k, _)| allowed_xattr(k))
                .collect(),
            None => Vec::new(),
        };
        let dst = target(dest, &canon_dest, &rel)?;
        let h = entry.header().clone();
        let (uid, gid) = (h.uid()? as u32, h.gid()? as u32);
        let mode = Mode::from_bits_truncate(h.mode()? & 0o7777);
        if kind.is_dir() || kind.is_file() || kind == tar::EntryType::GNUSparse || kind.is_symlink()
        {
            // tar's own checks hold too (no `..`, the parent resolved inside `dest`).
            if !entry
                .unpack_in(dest)
                .with_context(|| format!("unpack {}", rel.display()))?
            {
                bail!("layer entry {} was refused", rel.display());
            }
        } else if kind.is_hard_link() {
            let link = entry
                .link_name()?
                .ok_or_else(|| anyhow!("hard link {} has no target", rel.display()))?;
            let link = plain(&link)
                .ok_or_else(|| anyhow!("hard link {} leads outside the layer", rel.display()))?;
            let src = dest.join(&link);
            let m = std::fs::symlink_metadata(&src).with_context(|| {
                format!(
                    "hard link {}: no {} before it",
                    rel.display(),
                    link.display()
                )
            })?;
            let canon_src = src.parent().unwrap_or(dest).canonicalize()?;
            if !m.is_file() || canon_src != canon_dest.join(link.parent().unwrap_or(Path::new("")))
            {
                bail!(
                    "hard link {} must name a regular file of the layer",
                    rel.display()
                );
            }
            std::fs::hard_link(&src, &dst)
                .with_context(|| format!("hard link {}", rel.display()))?;
            continue;
        } else if kind.is_fifo()
            || (kind.is_character_special()
                && h.device_major()?.unwrap_or(1) == 0
                && h.device_minor()?.unwrap_or(1) == 0)
        {
            // A fifo, or a whiteout (a character device 0:0).
            let sflag = if kind.is_fifo() {
                SFlag::S_IFIFO
            } else {
                SFlag::S_IFCHR
            };
            mknod(&dst, sflag, mode, 0).with_context(|| format!("mknod {}", rel.display()))?;
            nix::unistd::fchownat(
                None,
                &dst,
                Some(uid.into()),
                Some(gid.into()),
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .with_context(|| format!("chown {}", rel.display()))?;
        } else {
            // Device nodes (the guest's own /dev is not in its layer) and kinds a layer has no use for.
            skipped += 1;
            continue;
        }
        for (k, v) in &xattrs {
            lsetxattr(&dst, k, v)?;
        }
    }
    if skipped > 0 {
        tracing::warn!(dest = %dest.display(), skipped, "left device nodes and unknown entries out of a VM's layer");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(build: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        build(&mut b);
        b.into_inner().unwrap()
    }

    fn header(kind: tar::EntryType, size: u64, mode: u32) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h
    }

    fn append(b: &mut tar::Builder<Vec<u8>>, kind: tar::EntryType, path: &str, data: &[u8]) {
        let mut h = header(kind, data.len() as u64, 0o755);
        b.append_data(&mut h, path, data).unwrap();
    }

    #[test]
    fn a_layer_keeps_whiteouts_opaque_dirs_links_and_modes() {
        let d = tempfile::tempdir().unwrap();
        let tar = archive(|b| {
            append(b, tar::EntryType::Directory, "etc", b"");
            b.append_pax_extensions([
                ("SCHILY.xattr.trusted.overlay.opaque", b"y".as_slice()),
                ("SCHILY.xattr.trusted.overlay.redirect", b"/x".as_slice()),
            ])
            .unwrap();
            append(b, tar::EntryType::Directory, "etc/apt", b"");
            let mut h = header(tar::EntryType::Regular, 4, 0o4755);
            b.append_data(&mut h, "etc/apt/f", b"data".as_slice())
                .unwrap();
            let mut h = header(tar::EntryType::Link, 0, 0o644);
            b.append_link(&mut h, "etc/g", "etc/apt/f").unwrap();
            let mut h = header(tar::EntryType::Char, 0, 0);
            h.set_device_major(0).unwrap();
            h.set_device_minor(0).unwrap();
            b.append_data(&mut h, "etc/motd", std::io::empty()).unwrap();
            let mut h = header(tar::EntryType::Char, 0, 0o666);
            h.set_device_major(1).unwrap();
            h.set_device_minor(1).unwrap();
            b.append_data(&mut h, "etc/mem", std::io::empty()).unwrap();
            let mut h = header(tar::EntryType::Symlink, 0, 0o777);
            b.append_link(&mut h, "etc/l", "/etc/passwd").unwrap();
        });
        unpack_layer(tar.as_slice(), d.path(), 1 << 20).unwrap();
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let r = d.path();
        assert_eq!(std::fs::read(r.join("etc/apt/f")).unwrap(), b"data");
        assert_eq!(
            std::fs::metadata(r.join("etc/apt/f")).unwrap().mode() & 0o7777,
            0o4755
        );
        assert_eq!(std::fs::metadata(r.join("etc/g")).unwrap().nlink(), 2);
        let wh = std::fs::symlink_metadata(r.join("etc/motd")).unwrap();
        assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
        assert!(!r.join("etc/mem").exists(), "a real device node was made");
        assert_eq!(
            std::fs::read_link(r.join("etc/l")).unwrap(),
            Path::new("/etc/passwd")
        );
        let p = CString::new(r.join("etc/apt").as_os_str().as_bytes()).unwrap();
        let mut buf = [0u8; 8];
        for (name, want) in [
            ("trusted.overlay.opaque", 1),
            ("trusted.overlay.redirect", -1),
        ] {
            let n = CString::new(name).unwrap();
            // SAFETY: NUL-terminated strings and a buffer of the length passed.
            let got = unsafe {
                libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len())
            };
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn hostile_archives_are_refused() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "through a symlink",
                archive(|b| {
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "out", "/tmp").unwrap();
                    let mut h = header(tar::EntryType::Char, 0, 0);
                    h.set_device_major(0).unwrap();
                    h.set_device_minor(0).unwrap();
                    b.append_data(&mut h, "out/x", std::io::empty()).unwrap();
                }),
            ),
            (
                "a link to outside",
                archive(|b| {
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "out", "/etc").unwrap();
                    let mut h = header(tar::EntryType::Link, 0, 0o644);
                    b.append_link(&mut h, "shadow", "out/shadow").unwrap();
                }),
            ),
            (
                "twice",
                archive(|b| {
                    append(b, tar::EntryType::Regular, "f", b"1");
                    let mut h = header(tar::EntryType::Symlink, 0, 0o777);
                    b.append_link(&mut h, "f", "/etc/passwd").unwrap();
                }),
            ),
            (
                "too big",
                archive(|b| append(b, tar::EntryType::Regular, "big", &[7u8; 4096])),
            ),
            (
                "no parent",
                archive(|b| append(b, tar::EntryType::Regular, "a/b", b"1")),
            ),
        ];
        for (what, tar) in cases {
            let d = tempfile::tempdir().unwrap();
            let dest = d.path().join("layer");
            std::fs::create_dir(&dest).unwrap();
            assert!(unpack_layer(tar.as_slice(), &dest, 1024).is_err(), "{what}");
            assert!(!Path::new("/tmp/x").exists() && !d.path().join("shadow").exists());
        }
    }
}
