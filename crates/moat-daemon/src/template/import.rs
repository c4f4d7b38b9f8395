//! Imports a root filesystem from the host: a directory (copied with `cp -a`) or a tarball (unpacked
//! with GNU tar). Both keep numeric ownership, modes, hard links and symlinks, so a template behaves
//! like the tree it came from. Real tools rather than Rust reimplementations: they get setuid bits,
//! xattrs, sparse files and reflinks right.

use std::collections::HashSet;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Stdio;

use anyhow::{bail, Context};
use tokio::process::Command;

/// Copies a root filesystem directory into `target` (which must not exist), keeping ownership, modes,
/// symlinks, hard links and xattrs.
pub async fn import_directory(src: &Path, target: &Path) -> anyhow::Result<()> {
    let meta = tokio::fs::metadata(src)
        .await
        .with_context(|| format!("root filesystem directory {}", src.display()))?;
    if !meta.is_dir() {
        bail!("{} is not a directory", src.display());
    }
    prepare_target(target).await?;
    let mut cmd = Command::new("cp");
    cmd.arg("-a")
        .arg("--reflink=auto")
        .arg("--no-target-directory")
        .arg(src)
        .arg(target);
    run_or_clean(cmd, target, "cp").await
}

/// Compression of a tarball, by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    None,
    Gzip,
    Xz,
    Zstd,
    Bzip2,
}

impl Compression {
    fn detect(head: &[u8]) -> Self {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
            Compression::Xz
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else if head.starts_with(b"BZh") {
            Compression::Bzip2
        } else {
            Compression::None
        }
    }

    fn tar_flag(self) -> Option<&'static str> {
        match self {
            Compression::None => None,
            Compression::Gzip => Some("--gzip"),
            Compression::Xz => Some("--xz"),
            Compression::Zstd => Some("--zstd"),
            Compression::Bzip2 => Some("--bzip2"),
        }
    }
}

/// Unpacks a root filesystem tarball (plain, gzip, xz, zstd or bzip2) into `target` (which must not
/// exist), keeping numeric ownership, modes, hard links and xattrs.
pub async fn import_tarball(src: &Path, target: &Path) -> anyhow::Result<()> {
    let meta = tokio::fs::metadata(src)
        .await
        .with_context(|| format!("root filesystem tarball {}", src.display()))?;
    if !meta.is_file() {
        bail!("{} is not a regular file", src.display());
    }
    let path = src.to_path_buf();
    let head = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
        let mut head = Vec::with_capacity(8);
        std::fs::File::open(&path)?.take(8).read_to_end(&mut head)?;
        Ok(head)
    })
    .await
    .context("reading a tarball's header")?
    .with_context(|| format!("reading {}", src.display()))?;
    let compression = Compression::detect(&head);

    prepare_target(target).await?;
    tokio::fs::create_dir(target)
        .await
        .with_context(|| format!("creating {}", target.display()))?;
    let mut cmd = Command::new("tar");
    cmd.arg("--extract")
        .arg("--numeric-owner")
        .arg("--same-owner")
        .arg("--preserve-permissions")
        .arg("--xattrs")
        .arg("--xattrs-include=*");
    if let Some(flag) = compression.tar_flag() {
        cmd.arg(flag);
    }
    cmd.arg("--file").arg(src).arg("--directory").arg(target);
    run_or_clean(cmd, target, "tar").await
}

/// Checks that `target` does not exist yet and creates its parent.
async fn prepare_target(target: &Path) -> anyhow::Result<()> {
    if tokio::fs::symlink_metadata(target).await.is_ok() {
        bail!("import target {} already exists", target.display());
    }
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    Ok(())
}

/// Runs `cmd`; on failure removes whatever it left at `target` and returns its error output.
async fn run_or_clean(mut cmd: Command, target: &Path, tool: &str) -> anyhow::Result<()> {
    let result = async {
        let output = cmd
            .env("LC_ALL", "C")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .with_context(|| format!("running {tool}"))?;
        if !output.status.success() {
            bail!(
                "{tool} failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            );
        }
        anyhow::Ok(())
    }
    .await;
    if result.is_err() {
        match tokio::fs::remove_dir_all(target).await {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => {
                tracing::warn!(target = %target.display(), error = %err, "removing a failed import")
            }
        }
    }
    result
}

/// Bytes used by a tree: `st_blocks * 512`, hard links counted once, symlinks not followed. Entries
/// that vanish during the walk are skipped.
pub fn disk_usage(path: &Path) -> std::io::Result<u64> {
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut total = 0u64;
    let mut stack = vec![path.to_path_buf()];
    let mut top = true;
    while let Some(p) = stack.pop() {
        let meta = match std::fs::symlink_metadata(&p) {
            Ok(meta) => meta,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound && !top => continue,
            Err(err) => return Err(err),
        };
        top = false;
        if meta.nlink() > 1 && !meta.is_dir() && !seen.insert((meta.dev(), meta.ino())) {
            continue;
        }
        total += meta.blocks() * 512;
        if meta.is_dir() {
            let entries = match std::fs::read_dir(&p) {
                Ok(entries) => entries,
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => continue,
                Err(err) => return Err(err),
            };
            for entry in entries {
                stack.push(entry?.path());
            }
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    /// A small root filesystem: a file, a hard link to it, a symlink, and a setuid file owned by 1234.
    fn sample_tree(dir: &Path) -> PathBuf {
        let root = dir.join("src");
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::write(root.join("bin/a"), b"hello").unwrap();
        std::fs::hard_link(root.join("bin/a"), root.join("bin/b")).unwrap();
        std::os::unix::fs::symlink("a", root.join("bin/c")).unwrap();
        std::os::unix::fs::symlink("/nonexistent/target", root.join("dangling")).unwrap();
        let d = root.join("bin/d");
        std::fs::write(&d, b"#!/bin/sh\n").unwrap();
        std::os::unix::fs::chown(&d, Some(1234), Some(1234)).unwrap();
        // chown clears setuid, so the mode comes last.
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o4755)).unwrap();
        std::fs::create_dir(root.join("tmp")).unwrap();
        std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777))
            .unwrap();
        root
    }

    fn check_tree(src: &Path, target: &Path) {
        assert_eq!(std::fs::read(target.join("bin/a")).unwrap(), b"hello");
        let a = std::fs::metadata(target.join("bin/a")).unwrap();
        let b = std::fs::metadata(target.join("bin/b")).unwrap();
        assert_eq!(a.ino(), b.ino(), "hard link kept");
        assert_eq!(a.nlink(), 2);
        assert_ne!(
            a.ino(),
            std::fs::metadata(src.join("bin/a")).unwrap().ino(),
            "a copy, not the source"
        );
        assert_eq!(
            std::fs::read_link(target.join("bin/c")).unwrap(),
            PathBuf::from("a")
        );
        assert_eq!(
            std::fs::read_link(target.join("dangling")).unwrap(),
            PathBuf::from("/nonexistent/target")
        );
        let d = std::fs::symlink_metadata(target.join("bin/d")).unwrap();
        assert_eq!((d.uid(), d.gid()), (1234, 1234));
        assert_eq!(d.mode() & 0o7777, 0o4755);
        let tmp = std::fs::symlink_metadata(target.join("tmp")).unwrap();
        assert_eq!(tmp.mode() & 0o7777, 0o1777);
    }

    fn tar(args: &[&str]) {
        let status = std::process::Command::new("tar")
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "tar {args:?}");
    }

    #[tokio::test]
    async fn directory_keeps_links_owners_and_modes() {
        let dir = tempfile::tempdir().unwrap();
        let src = sample_tree(dir.path());
        let target = dir.path().join("store/t1");
        import_directory(&src, &target).await.unwrap();
        check_tree(&src, &target);

        let err = import_directory(&src, &target)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("already exists"), "{err}");
    }

    #[tokio::test]
    async fn directory_validates_source() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        let err = import_directory(&dir.path().join("missing"), &target)
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("missing"), "{err:#}");
        std::fs::write(dir.path().join("file"), b"x").unwrap();
        let err = import_directory(&dir.path().join("file"), &target)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a directory"), "{err}");
        assert!(!target.exists());
    }

    #[tokio::test]
    async fn tarballs_plain_gzip_xz_and_zstd() {
        let dir = tempfile::tempdir().unwrap();
        let src = sample_tree(dir.path());
        let s = src.to_str().unwrap();
        for (name, flag) in [
            ("a.tar", None),
            ("a.tgz", Some("-z")),
            ("a.txz", Some("-J")),
        ] {
            let archive = dir.path().join(name);
            let mut args = vec!["--numeric-owner", "-c"];
            args.extend(flag);
            args.extend(["-f", archive.to_str().unwrap(), "-C", s, "."]);
            tar(&args);
            let target = dir.path().join(format!("out-{name}"));
            import_tarball(&archive, &target).await.unwrap();
            check_tree(&src, &target);
        }
    }

    #[tokio::test]
    async fn tarball_failure_removes_the_partial_target() {
        let dir = tempfile::tempdir().unwrap();
        let bogus = dir.path().join("bogus.tar.gz");
        // Gzip magic, then garbage.
        std::fs::write(&bogus, [0x1f, 0x8b, 1, 2, 3, 4, 5, 6, 7, 8, 9]).unwrap();
        let target = dir.path().join("t");
        let err = import_tarball(&bogus, &target)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("tar failed"), "{err}");
        assert!(!target.exists());

        let err = import_tarball(dir.path(), &target)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let err = import_tarball(&dir.path().join("nope.tar"), &target)
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains("nope.tar"), "{err:#}");
        assert!(!target.exists());
    }

    #[test]
    fn compression_magic() {
        assert_eq!(Compression::detect(&[0x1f, 0x8b, 8]), Compression::Gzip);
        assert_eq!(
            Compression::detect(&[0xfd, b'7', b'z', b'X', b'Z', 0, 0]),
            Compression::Xz
        );
        assert_eq!(
            Compression::detect(&[0x28, 0xb5, 0x2f, 0xfd]),
            Compression::Zstd
        );
        assert_eq!(Compression::detect(b"BZh91AY"), Compression::Bzip2);
        assert_eq!(Compression::detect(b"bin/\0\0\0\0"), Compression::None);
        assert_eq!(Compression::detect(&[]), Compression::None);
    }

    #[test]
    fn disk_usage_counts_hard_links_once() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tree");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(root.join("f"), vec![7u8; 64 * 1024]).unwrap();
        let one = disk_usage(&root).unwrap();
        assert!(one >= 64 * 1024, "{one}");
        std::fs::hard_link(root.join("f"), root.join("g")).unwrap();
        assert_eq!(disk_usage(&root).unwrap(), one);
        // A symlink to a big tree is not followed.
        std::os::unix::fs::symlink("/usr", root.join("usr")).unwrap();
        assert!(disk_usage(&root).unwrap() < one + 64 * 1024);
        assert!(disk_usage(&dir.path().join("missing")).is_err());
    }
}
