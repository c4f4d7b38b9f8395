//! A sandbox's writable layer on the host, shared by the tiers that build the root filesystem as a
//! host overlay (container, gvisor): `<dir>/upper` + `<dir>/work`, or `<dir>/disk/upper` +
//! `<dir>/disk/work` on an ext4 image (`<dir>/disk.img`) when the sandbox has a disk quota.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

use crate::host::{diskimage, mount};

/// Names in a sandbox directory that make up its writable layer (kept by a release).
/// (`layer-base` and `disk-baseline`: the microvm tier's count of the layers its disk was made
/// over, and the disk's size when it was made.)
const LAYER_NAMES: [&str; 5] = ["upper", "work", "disk.img", "layer-base", "disk-baseline"];

/// Makes (or, with `keep_files`, reopens) the writable layer of the sandbox directory `dir` and
/// returns the directory holding its `upper` and `work`.
pub fn prepare(dir: &Path, limits: &moat_api::SandboxLimits, keep_files: bool) -> Result<PathBuf> {
    let layer = if limits.disk_mb > 0 {
        let started = std::time::Instant::now();
        let image = dir.join("disk.img");
        if keep_files && image.exists() {
            diskimage::mount_image(&image, &dir.join("disk"))?;
        } else {
            diskimage::create_and_mount(
                &image,
                limits.disk_mb,
                limits.disk_inodes,
                &dir.join("disk"),
            )?;
        }
        tracing::debug!(dir = %dir.display(), "disk image ready in {:?}", started.elapsed());
        dir.join("disk")
    } else {
        dir.to_path_buf()
    };
    for sub in ["upper", "work"] {
        std::fs::create_dir_all(layer.join(sub)).with_context(|| format!("mkdir {sub}"))?;
    }
    Ok(layer)
}

/// The `upper` directory of the sandbox directory `dir`.
pub fn upper(dir: &Path) -> PathBuf {
    if dir.join("disk.img").exists() {
        dir.join("disk/upper")
    } else {
        dir.join("upper")
    }
}

/// Bytes and inodes the writable layer uses.
pub fn usage(dir: &Path) -> Result<(u64, u64)> {
    if dir.join("disk.img").exists() {
        diskimage::used(&dir.join("disk"))
    } else {
        Ok(tree_usage(&dir.join("upper"), 1_000_000))
    }
}

/// What the writable layer of the sandbox directory `dir` can still take (its quota image's
/// available bytes); None without a quota image.
pub fn room(dir: &Path) -> Option<u64> {
    if !dir.join("disk.img").exists() {
        return None;
    }
    diskimage::available(&dir.join("disk")).ok()
}

/// Caps what the writable layer of the sandbox directory `dir` may still write at `room` bytes
/// (None: its quota only); None when it has no quota image (its writes go to the host's
/// filesystem directly and no cap applies).
pub fn cap_room(dir: &Path, room: Option<u64>) -> Result<Option<u64>> {
    if !dir.join("disk.img").exists() {
        return Ok(None);
    }
    diskimage::cap_room(&dir.join("disk"), room).map(Some)
}

/// Removes everything in the (unmounted) sandbox directory but its writable layer.
pub fn remove_all_but_layer(dir: &Path) -> Result<()> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for e in rd.flatten() {
        let name = e.file_name();
        if LAYER_NAMES.iter().any(|k| name == *k) {
            continue;
        }
        let p = e.path();
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            mount::remove_unmounted_tree(&p)?;
        } else {
            std::fs::remove_file(&p).with_context(|| format!("remove {}", p.display()))?;
        }
    }
    Ok(())
}

/// Copies a writable layer into the new directory `dest`: modes (setuid included), owners, hard links,
/// sparse files, device nodes (whiteouts) and extended attributes (opaque directories, file
/// capabilities) are kept.
pub fn copy(src: &Path, dest: &Path) -> Result<()> {
    let out = Command::new("cp")
        .args([
            "-dR",
            "--preserve=mode,ownership,timestamps,links,xattr",
            "--sparse=auto",
            "--no-target-directory",
        ])
        .arg(src)
        .arg(dest)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .output()
        .context("run cp")?;
    if !out.status.success() {
        bail!(
            "copy the writable layer: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Bytes (allocated) and entries under `dir`, counting at most `max_entries` (a layer without a disk
/// quota has no cheaper source).
pub(crate) fn tree_usage(dir: &Path, max_entries: u64) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut n) = (0u64, 0u64);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            n += 1;
            if n > max_entries {
                return (bytes, n);
            }
            if let Ok(m) = e.metadata() {
                bytes += m.blocks() * 512;
                if m.is_dir() {
                    stack.push(e.path());
                }
            }
        }
    }
    (bytes, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_keeps_only_the_layer() {
        let d = tempfile::tempdir().unwrap();
        for sub in ["upper/etc", "work", "rootfs", "sock"] {
            std::fs::create_dir_all(d.path().join(sub)).unwrap();
        }
        std::fs::write(d.path().join("upper/etc/f"), "x").unwrap();
        std::fs::write(d.path().join("config.json"), "{}").unwrap();
        remove_all_but_layer(d.path()).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["upper", "work"]);
        assert!(d.path().join("upper/etc/f").exists());
        let (bytes, inodes) = usage(d.path()).unwrap();
        assert_eq!(inodes, 2);
        assert!(bytes > 0);
        assert_eq!(upper(d.path()), d.path().join("upper"));
    }
}
