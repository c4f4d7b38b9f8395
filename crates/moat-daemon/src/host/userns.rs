//! User namespaces made only to carry an id mapping, for idmapped mounts (`mount_setattr` takes the
//! mapping as a user namespace file descriptor).

use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

/// A user namespace whose uid and gid maps are both `inside outside count` (one line of uid_map).
/// A short-lived process creates it; the returned descriptor keeps it alive after that process is gone.
pub fn with_map(inside: u32, outside: u32, count: u32) -> Result<OwnedFd> {
    let mut cmd = Command::new("sleep");
    cmd.arg("30")
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: unshare is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::unshare(libc::CLONE_NEWUSER) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // spawn returns once the child has exec'd, so it is in its new namespace by then.
    let mut child = cmd.spawn().context("spawn a user namespace holder")?;
    let pid = child.id();
    let result = (|| {
        let map = format!("{inside} {outside} {count}\n");
        std::fs::write(format!("/proc/{pid}/uid_map"), &map).context("write uid_map")?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map).context("write gid_map")?;
        let fd: OwnedFd = std::fs::File::open(format!("/proc/{pid}/ns/user"))
            .context("open the user namespace")?
            .into();
        Ok(fd)
    })();
    let _ = child.kill();
    let _ = child.wait();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn makes_a_namespace_with_the_map() {
        // Writing a map of host ids needs root (the test suite runs as root).
        let fd = with_map(1000, 0, 10).unwrap();
        // A distinct user namespace from ours.
        let ours = std::fs::metadata("/proc/self/ns/user").unwrap();
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let st = nix::sys::stat::fstat(fd.as_raw_fd()).unwrap();
        assert_ne!(st.st_ino, ours.ino());
    }
}
