//! Mounts: idmapped bind mounts of template layers, the per-sandbox overlay, unmounting and the
//! mountinfo scan the start-up sweep relies on.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use nix::mount::{mount, umount2, MntFlags, MsFlags};

// From <linux/mount.h>; the libc crate has the syscall numbers but not all of these.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const OPEN_TREE_CLOEXEC: libc::c_uint = libc::O_CLOEXEC as libc::c_uint;
const AT_RECURSIVE: libc::c_uint = 0x8000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

fn cpath(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .with_context(|| format!("path {} has a NUL byte", p.display()))
}

/// Mounts `src` at `target` read-only, nosuid, nodev, with file ownership shifted through the user
/// namespace `userns` (host uid 0 on disk appears as the namespace's root). The template stays owned by
/// host root on disk and every sandbox sees it as its own root's.
pub fn idmapped_bind(src: &Path, target: &Path, userns: &OwnedFd) -> Result<()> {
    let src_c = cpath(src)?;
    let target_c = cpath(target)?;
    // SAFETY: open_tree takes a valid NUL-terminated path and flags; it returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            src_c.as_ptr(),
            OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("open_tree {}", src.display()));
    }
    // SAFETY: the syscall returned a fresh descriptor that nothing else owns.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    let empty = c"";
    // SAFETY: `attr` is a valid mount_attr of the size passed; the fds are open for the call's duration.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error()).context("mount_setattr(MOUNT_ATTR_IDMAP)");
    }
    // SAFETY: valid fd and NUL-terminated paths; move_mount attaches the detached tree at target.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            target_c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("move_mount to {}", target.display()));
    }
    Ok(())
}

/// Mounts an overlay of `lowers` (read-only, topmost first) and `upper`/`work` (the sandbox's writable
/// layer) at `target`.
pub fn overlay(lowers: &[PathBuf], upper: &Path, work: &Path, target: &Path) -> Result<()> {
    for p in lowers.iter().map(PathBuf::as_path).chain([upper, work]) {
        let s = p.to_string_lossy();
        if s.contains(',') || s.contains(':') {
            bail!("overlay layer path {s} may not contain ',' or ':'");
        }
    }
    let lower: Vec<String> = lowers.iter().map(|l| l.display().to_string()).collect();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.join(":"),
        upper.display(),
        work.display()
    );
    // The options must fit in one page.
    if opts.len() > 4000 {
        bail!("overlay options too long ({} layers)", lowers.len());
    }
    mount(
        Some("overlay"),
        target,
        Some("overlay"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .with_context(|| format!("mount overlay at {}", target.display()))
}

/// Mounts a tmpfs of `size_mb` MiB and `inodes` inodes at `target` (created when missing), mode 1777,
/// owned by `owner` (the sandbox's root), nosuid and nodev. Its pages are charged to the memory cgroup
/// of whoever writes them.
pub fn tmpfs(root: &Path, rel: &str, size_mb: u64, inodes: u64, owner: u32) -> Result<()> {
    let target = mkdir_no_symlinks(root, rel)?;
    let target = target.as_path();
    let opts = tmpfs_options(size_mb, inodes, owner);
    mount(
        Some("tmpfs"),
        target,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(opts.as_str()),
    )
    .with_context(|| format!("mount tmpfs at {}", target.display()))
}

pub fn tmpfs_options(size_mb: u64, inodes: u64, owner: u32) -> String {
    format!("size={size_mb}m,nr_inodes={inodes},mode=1777,uid={owner},gid={owner}")
}

/// Makes the directory `root/rel` (like `mkdir -p`), refusing to follow a symlink at any step: `root`
/// is a sandbox's root filesystem, whose links point wherever its template says.
pub fn mkdir_no_symlinks(root: &Path, rel: &str) -> Result<PathBuf> {
    let mut p = root.to_path_buf();
    for c in rel.split('/').filter(|c| !c.is_empty()) {
        if c == "." || c == ".." {
            bail!("bad path component {c:?} in {rel:?}");
        }
        p.push(c);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => bail!("/{rel}: {} is not a directory", p.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&p).with_context(|| format!("mkdir {}", p.display()))?;
            }
            Err(e) => return Err(e).with_context(|| format!("stat {}", p.display())),
        }
    }
    Ok(p)
}

/// Lazily unmounts `target` and everything below it; not mounted is fine.
pub fn unmount_tree(target: &Path) -> Result<()> {
    let mut points: Vec<PathBuf> = mounts_under(target)?;
    // Deepest first.
    points.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    for p in points {
        match umount2(&p, MntFlags::MNT_DETACH) {
            Ok(()) | Err(nix::errno::Errno::EINVAL) | Err(nix::errno::Errno::ENOENT) => {}
            Err(e) => bail!("umount {}: {e}", p.display()),
        }
    }
    Ok(())
}

/// Mount points at or below `dir`, from /proc/self/mountinfo.
pub fn mounts_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let info =
        std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
    Ok(parse_mount_points(&info)
        .into_iter()
        .filter(|p| p.starts_with(dir))
        .collect())
}

/// Mount points of a mountinfo text (field 5, with octal escapes decoded).
pub fn parse_mount_points(info: &str) -> Vec<PathBuf> {
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_octal(p)))
        .collect()
}

fn unescape_octal(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Removes a directory tree after making sure nothing below it is mounted. This is the one place the
/// daemon deletes sandbox trees: deleting through a still-mounted template layer would destroy it.
pub fn remove_unmounted_tree(dir: &Path) -> Result<()> {
    let left = mounts_under(dir)?;
    if !left.is_empty() {
        bail!(
            "refusing to remove {}: still mounted: {left:?}",
            dir.display()
        );
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("remove {}", dir.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tmpfs_option_string() {
        assert_eq!(
            tmpfs_options(64, 16384, 1_000_000_000),
            "size=64m,nr_inodes=16384,mode=1777,uid=1000000000,gid=1000000000"
        );
    }

    #[test]
    fn mountinfo_points() {
        let info = "22 27 0:21 / /proc rw,relatime - proc proc rw\n\
                    90 27 0:50 / /var/lib/moat/sandboxes/a\\040b/rootfs rw - overlay overlay rw\n";
        assert_eq!(
            parse_mount_points(info),
            vec![
                PathBuf::from("/proc"),
                PathBuf::from("/var/lib/moat/sandboxes/a b/rootfs")
            ]
        );
    }

    #[test]
    fn overlay_rejects_separators() {
        let p = Path::new("/tmp/a,b");
        let ok = Path::new("/tmp/ok");
        assert!(overlay(&[p.to_path_buf()], ok, ok, ok).is_err());
        assert!(overlay(&[ok.to_path_buf(), PathBuf::from("/tmp/x:y")], ok, ok, ok).is_err());
    }
}
