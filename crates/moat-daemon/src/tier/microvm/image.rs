//! The guest's disks. The base disk is one ext4 image of a template with its snapshot layers merged
//! (made with `mkfs.ext4 -d` from a read-only overlay of them), built once per layer stack and
//! shared read-only by every VM over it. Each VM has its own sparse ext4 disk for the overlay's
//! upper and work directories.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::host::mount;

/// Changes whenever the way base images are made changes (old ones are then rebuilt).
const FORMAT: &str = "moat-microvm-base-1";

/// The cache key of a layer stack: each directory's identity (a rebuilt template is a new directory).
pub fn key(template_rootfs: &Path, layers: &[PathBuf]) -> Result<String> {
    let mut h = Sha256::new();
    h.update(FORMAT);
    for d in std::iter::once(template_rootfs).chain(layers.iter().map(PathBuf::as_path)) {
        let m = std::fs::metadata(d).with_context(|| format!("stat {}", d.display()))?;
        h.update(format!(
            "\n{}:{}:{}:{}",
            d.display(),
            m.dev(),
            m.ino(),
            m.ctime()
        ));
    }
    Ok(format!("{:x}", h.finalize())[..32].to_string())
}

fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let out = cmd
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("run {what}"))?;
    if !out.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Makes the base image `out` of `template_rootfs` under `layers` (top first... as [`super::SandboxSpec`]:
/// bottom first).
pub fn build_base(template_rootfs: &Path, layers: &[PathBuf], out: &Path) -> Result<()> {
    let started = std::time::Instant::now();
    let staging = out.with_extension("staging");
    let _ = mount::unmount_tree(&staging);
    let _ = std::fs::remove_dir_all(&staging);
    let tmp = out.with_extension("tmp");
    let source = if layers.is_empty() {
        template_rootfs.to_path_buf()
    } else {
        std::fs::create_dir_all(&staging)?;
        let mut lowers: Vec<String> = layers
            .iter()
            .rev()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        lowers.push(template_rootfs.to_string_lossy().into_owned());
        nix::mount::mount(
            Some("overlay"),
            &staging,
            Some("overlay"),
            nix::mount::MsFlags::MS_RDONLY,
            Some(format!("lowerdir={}", lowers.join(":")).as_str()),
        )
        .context("mount the layers read-only")?;
        staging.clone()
    };
    let (bytes, entries) = crate::tier::layer::tree_usage(&source, u64::MAX);
    let size_mb = (bytes + bytes / 5) / (1 << 20) + 64;
    let res = run(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-t",
                "ext4",
                "-O",
                "^has_journal",
                "-m",
                "0",
                "-b",
                "4096",
            ])
            .args(["-N", &(entries + entries / 5 + 1024).to_string()])
            .args(["-E", "root_owner=0:0,nodiscard"])
            .arg("-d")
            .arg(&source)
            .arg(&tmp)
            .arg(format!("{size_mb}M")),
        "mkfs.ext4 -d",
    );
    if !layers.is_empty() {
        mount::unmount_tree(&staging)?;
        let _ = std::fs::remove_dir(&staging);
    }
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    std::fs::rename(&tmp, out)?;
    tracing::info!(image = %out.display(), size_mb, took = ?started.elapsed(), "microvm base image built");
    Ok(())
}

/// Makes a VM's writable disk: a sparse ext4 image of `size_mb` MiB (with `inodes`, 0: mkfs's
/// default), root's and 0600: QEMU gets a descriptor of it, never its path.
pub fn create_rw_disk(path: &Path, size_mb: u64, inodes: u64) -> Result<()> {
    {
        let f =
            std::fs::File::create(path).with_context(|| format!("create {}", path.display()))?;
        f.set_len(size_mb << 20)?;
    }
    let mut cmd = Command::new("mkfs.ext4");
    cmd.args(["-q", "-F", "-t", "ext4", "-m", "0"])
        .args(["-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"]);
    if inodes > 0 {
        cmd.args(["-N", &inodes.to_string()]);
    }
    cmd.arg(path).arg(format!("{size_mb}M"));
    run(&mut cmd, "mkfs.ext4")?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_changes_with_the_layer_stack() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let k1 = key(a.path(), &[]).unwrap();
        assert_eq!(k1, key(a.path(), &[]).unwrap());
        assert_ne!(k1, key(a.path(), &[b.path().to_path_buf()]).unwrap());
        assert_ne!(k1, key(b.path(), &[]).unwrap());
        assert!(key(&a.path().join("missing"), &[]).is_err());
    }
}
