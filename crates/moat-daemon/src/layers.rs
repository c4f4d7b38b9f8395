//! The layer store: read-only filesystem layers, addressed by the sha256 of their content, that sit
//! between a template's root filesystem and a sandbox's writable layer. A snapshot is a list of layers;
//! every sandbox started from it mounts the same directories (idmapped, read-only), so nothing is
//! copied per sandbox.
//!
//! Layout: `<data_dir>/layers/<hex digest>/` (the layer's tree, owned by the template's ids 0..65535 as
//! a template is) and `<data_dir>/layers/tmp-<random>/` while one is being made. A layer is an overlay
//! upper directory: deleted files are whiteouts (character devices 0:0) and replaced directories carry
//! `trusted.overlay.opaque`, which overlayfs honours in lower layers too.
//!
//! A layer lives as long as a sandbox or a snapshot lists it: [`LayerStore::gc`] removes the others
//! (called after a snapshot or sandbox goes, and at start-up, which also removes `tmp-*` leftovers of a
//! crash).

use std::collections::HashSet;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rand::RngCore;
use sha2::{Digest, Sha256};

pub struct LayerStore {
    root: PathBuf,
    /// Scratch directories being filled now (a snapshot or build step): the collection leaves them
    /// alone however long they take; other `tmp-*` directories are a crash's leftovers.
    active: std::sync::Mutex<HashSet<String>>,
}

/// `sha256:<64 hex>`.
pub fn valid_digest(d: &str) -> bool {
    d.strip_prefix("sha256:")
        .is_some_and(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl LayerStore {
    pub fn new(root: PathBuf) -> Result<LayerStore> {
        std::fs::create_dir_all(&root).with_context(|| format!("mkdir {}", root.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))?;
        Ok(LayerStore {
            root,
            active: Default::default(),
        })
    }

    fn active(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.active
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Directory of a layer (which may not exist).
    pub fn path(&self, digest: &str) -> Result<PathBuf> {
        if !valid_digest(digest) {
            bail!("bad layer digest {digest:?}");
        }
        Ok(self.root.join(&digest["sha256:".len()..]))
    }

    /// A fresh, empty directory to build a layer in; hand it to [`LayerStore::commit`].
    pub fn scratch(&self) -> Result<PathBuf> {
        let mut b = [0u8; 8];
        rand::rngs::OsRng.fill_bytes(&mut b);
        let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
        let name = format!("tmp-{hex}");
        let dir = self.root.join(&name);
        // Under the lock a collection holds while it looks: it never sees the directory untracked.
        let mut active = self.active();
        std::fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        active.insert(name);
        Ok(dir)
    }

    /// Hashes the tree in `scratch` and moves it to its content address (or drops it when that layer
    /// exists already). Returns the digest and the bytes the layer takes.
    pub fn commit(&self, scratch: &Path) -> Result<(String, u64)> {
        let (digest, bytes) = digest_tree(scratch)?;
        self.commit_hashed(scratch, &digest, bytes)
    }

    /// [`LayerStore::commit`] of a tree already hashed with [`digest_tree`] (so the caller can hash
    /// outside a lock and move the layer into place under it). `scratch` may be a directory inside a
    /// scratch directory.
    pub fn commit_hashed(&self, scratch: &Path, digest: &str, bytes: u64) -> Result<(String, u64)> {
        let dest = self.path(digest)?;
        if dest.exists() {
            crate::host::mount::remove_unmounted_tree(scratch)?;
        } else {
            std::fs::rename(scratch, &dest)
                .with_context(|| format!("rename {} to {}", scratch.display(), dest.display()))?;
        }
        if let Some(name) = scratch.file_name() {
            self.active().remove(&*name.to_string_lossy());
        }
        Ok((digest.to_string(), bytes))
    }

    /// Removes every layer not in `keep` and every scratch directory no snapshot or build is filling
    /// (a crash's leftovers). Returns the digests removed.
    pub fn gc(&self, keep: &HashSet<String>) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        let mut active = self.active();
        let mut seen = HashSet::new();
        for e in std::fs::read_dir(&self.root)?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if name.starts_with("tmp-") {
                if active.contains(&name) {
                    seen.insert(name);
                } else {
                    crate::host::mount::remove_unmounted_tree(&path)?;
                }
                continue;
            }
            let digest = format!("sha256:{name}");
            if valid_digest(&digest) && !keep.contains(&digest) {
                crate::host::mount::remove_unmounted_tree(&path)?;
                removed.push(digest);
            }
        }
        // Scratch directories their owner removed (or moved into place) are not tracked any more.
        active.retain(|n| seen.contains(n));
        Ok(removed)
    }

    /// Number of layers and the bytes the store takes on disk.
    pub fn usage(&self) -> (u64, u64) {
        let count = std::fs::read_dir(&self.root)
            .map(|rd| {
                rd.flatten()
                    .filter(|e| {
                        valid_digest(&format!("sha256:{}", e.file_name().to_string_lossy()))
                    })
                    .count() as u64
            })
            .unwrap_or(0);
        (count, tree_bytes(&self.root))
    }
}

fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            if let Ok(m) = e.metadata() {
                total += m.blocks() * 512;
                if m.is_dir() {
                    stack.push(e.path());
                }
            }
        }
    }
    total
}

/// The content digest of a layer tree: sha256 over every entry in path order — its path, type, mode,
/// owner, size, device number, link target, extended attributes and content. Also returns the
/// allocated bytes. Hard links hash as the same content twice (the digest names content, not layout).
pub fn digest_tree(dir: &Path) -> Result<(String, u64)> {
    let mut h = Sha256::new();
    let mut bytes = 0u64;
    let mut entries = Vec::new();
    collect(dir, Path::new(""), &mut entries)?;
    entries.sort();
    let mut buf = vec![0u8; 1 << 16];
    for rel in entries {
        let full = dir.join(&rel);
        let m =
            std::fs::symlink_metadata(&full).with_context(|| format!("stat {}", full.display()))?;
        bytes += m.blocks() * 512;
        let ft = m.file_type();
        h.update(rel.as_os_str().as_bytes());
        h.update([0]);
        h.update(
            format!(
                "{:o} {} {} {} {}\n",
                m.mode(),
                m.uid(),
                m.gid(),
                if ft.is_file() { m.size() } else { 0 },
                if ft.is_char_device() || ft.is_block_device() {
                    m.rdev()
                } else {
                    0
                }
            )
            .as_bytes(),
        );
        if ft.is_symlink() {
            h.update(std::fs::read_link(&full)?.as_os_str().as_bytes());
            h.update([0]);
        }
        for (name, value) in xattrs(&full)? {
            h.update(&name);
            h.update([0]);
            h.update((value.len() as u64).to_le_bytes());
            h.update(&value);
        }
        if ft.is_file() {
            let mut f =
                std::fs::File::open(&full).with_context(|| format!("open {}", full.display()))?;
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
            }
        }
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((format!("sha256:{hex}"), bytes))
}

fn collect(base: &Path, rel: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let dir = base.join(rel);
    for e in std::fs::read_dir(&dir).with_context(|| format!("read {}", dir.display()))? {
        let e = e?;
        let r = rel.join(e.file_name());
        let is_dir = e.file_type()?.is_dir();
        out.push(r.clone());
        if is_dir {
            collect(base, &r, out)?;
        }
    }
    Ok(())
}

/// Extended attributes of `path` (not following a symlink), sorted by name.
fn xattrs(path: &Path) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a null buffer of size 0 asks for the needed size only.
    let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOTSUP) {
            return Ok(Vec::new());
        }
        return Err(e).with_context(|| format!("listxattr {}", path.display()));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut names = vec![0u8; n as usize];
    // SAFETY: `names` has room for `n` bytes, the size passed.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if n < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("listxattr {}", path.display()));
    }
    names.truncate(n as usize);
    let mut out = Vec::new();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let cname = std::ffi::CString::new(name)?;
        // SAFETY: size query with a null buffer.
        let len = unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), std::ptr::null_mut(), 0) };
        if len < 0 {
            continue;
        }
        let mut value = vec![0u8; len as usize];
        // SAFETY: `value` has room for `len` bytes, the size passed.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len < 0 {
            continue;
        }
        value.truncate(len as usize);
        out.push((name.to_vec(), value));
    }
    out.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_name_content() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for d in [a.path(), b.path()] {
            std::fs::create_dir(d.join("etc")).unwrap();
            std::fs::write(d.join("etc/hello"), "world").unwrap();
            std::os::unix::fs::symlink("hello", d.join("etc/link")).unwrap();
        }
        let (da, _) = digest_tree(a.path()).unwrap();
        let (db, _) = digest_tree(b.path()).unwrap();
        assert!(valid_digest(&da), "{da}");
        assert_eq!(da, db);
        std::fs::write(b.path().join("etc/hello"), "World").unwrap();
        assert_ne!(da, digest_tree(b.path()).unwrap().0);
    }

    #[test]
    fn commit_dedups_and_gc_removes_unused() {
        let root = tempfile::tempdir().unwrap();
        let store = LayerStore::new(root.path().join("layers")).unwrap();
        let s1 = store.scratch().unwrap();
        std::fs::write(s1.join("f"), "x").unwrap();
        let (d1, _) = store.commit(&s1).unwrap();
        assert!(!s1.exists());
        let s2 = store.scratch().unwrap();
        std::fs::write(s2.join("f"), "x").unwrap();
        let (d2, _) = store.commit(&s2).unwrap();
        assert_eq!(d1, d2);
        assert!(!s2.exists());
        assert!(store.path(&d1).unwrap().join("f").exists());
        assert!(store.gc(&[d1.clone()].into()).unwrap().is_empty());
        // A scratch directory being filled survives a collection; a leftover does not.
        let filling = store.scratch().unwrap();
        let leftover = root.path().join("layers/tmp-0011223344556677");
        std::fs::create_dir(&leftover).unwrap();
        store.gc(&[d1.clone()].into()).unwrap();
        assert!(filling.exists() && !leftover.exists());
        assert_eq!(store.gc(&HashSet::new()).unwrap(), vec![d1.clone()]);
        assert!(!store.path(&d1).unwrap().exists());
        assert!(store.path("sha256:../../etc").is_err());
    }
}
