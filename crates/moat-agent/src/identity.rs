//! Fork safety: who the sandbox is, given by the daemon at every start (`POST /config`'s
//! `identity`). Two forks of one full-state snapshot start as copies of each other's memory: the
//! same kernel entropy pool (in a microVM), the same machine-id, hostname and environment. This
//! gives each its own: a machine-id, `MOAT_SANDBOX_ID` for new processes, the host's random bytes
//! mixed into the kernel's pool and a reseed, the hostname where the agent may set it, and
//! `/run/moat/forked` for long-lived programs to watch and reseed their own generators.

use std::io::Write;
use std::path::Path;

use base64::Engine;
use moat_api::SandboxIdentity;

/// Written when the sandbox continues another's processes.
pub const FORKED: &str = "/run/moat/forked";

/// `RNDADDENTROPY`: `_IOW('R', 0x03, int[2])`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`: `_IO('R', 0x07)`.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// Applies `id`; returns what could not be done (nothing that stops the sandbox: a container
/// shares the host's kernel pool and cannot set its hostname, which its init did).
pub fn apply(
    id: &SandboxIdentity,
    env: &std::sync::RwLock<std::collections::BTreeMap<String, String>>,
) -> Vec<String> {
    let mut missed = Vec::new();
    if let Ok(mut e) = env.write() {
        e.insert("MOAT_SANDBOX_ID".into(), id.sandbox_id.clone());
    }
    if let Err(e) = write_machine_id(Path::new("/etc/machine-id"), &id.machine_id, true) {
        missed.push(format!("/etc/machine-id: {e}"));
    }
    let _ = write_machine_id(Path::new("/var/lib/dbus/machine-id"), &id.machine_id, false);
    let current = nix::unistd::gethostname().ok();
    if current.as_deref().and_then(|h| h.to_str()) != Some(id.hostname.as_str()) {
        if let Err(e) = nix::unistd::sethostname(&id.hostname) {
            missed.push(format!("hostname: {e}"));
        }
    }
    if let Some(b64) = &id.entropy {
        match base64::engine::general_purpose::STANDARD.decode(b64) {
            Ok(bytes) => {
                if let Err(e) = add_entropy(&bytes) {
                    missed.push(format!("entropy: {e}"));
                }
            }
            Err(e) => missed.push(format!("entropy: {e}")),
        }
    }
    let forked = Path::new(FORKED);
    if id.forked {
        let body = format!(
            "{{\"sandbox_id\":\"{}\",\"at_ms\":{}}}\n",
            id.sandbox_id,
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0)
        );
        let wrote = std::fs::create_dir_all("/run/moat").and_then(|()| {
            let _ = std::fs::remove_file(forked);
            std::fs::write(forked, body)
        });
        if let Err(e) = wrote {
            missed.push(format!("{FORKED}: {e}"));
        }
    } else {
        let _ = std::fs::remove_file(forked);
    }
    missed
}

/// Writes `id` to `path` as a new regular file (a symlink planted there is replaced, not followed);
/// only where the file or its directory is there already unless `create`.
fn write_machine_id(path: &Path, id: &str, create: bool) -> std::io::Result<()> {
    let exists = path.symlink_metadata().is_ok();
    let may_create = create && path.parent().is_some_and(Path::is_dir);
    if !exists && !may_create {
        return Ok(());
    }
    replace_file(path, format!("{id}\n").as_bytes(), 0o444)
}

/// Replaces `path` with a new regular file holding `body` with `mode`, written beside it and renamed
/// over it (a symlink planted at `path` is replaced, not followed).
pub fn replace_file(path: &Path, body: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = path.with_extension("moat-new");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)?;
    f.write_all(body)?;
    drop(f);
    std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(mode))?;
    std::fs::rename(&tmp, path)
}

/// Mixes `bytes` into the kernel's entropy pool (credited where the agent may, CAP_SYS_ADMIN, as
/// a guest's PID 1 is) and asks for a reseed of its generator.
fn add_entropy(bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + bytes.len());
    info.extend_from_slice(&((bytes.len() * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(bytes.len() as i32).to_ne_bytes());
    info.extend_from_slice(bytes);
    use std::os::fd::AsRawFd;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of 8 bytes plus buf_size bytes, which `info`
    // holds; the descriptor is open for the call.
    let credited = unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) } == 0;
    if !credited {
        // Without CAP_SYS_ADMIN: a write mixes the bytes in, uncredited.
        f.write_all(bytes)?;
    }
    // SAFETY: RNDRESEEDCRNG takes no argument. Refused without CAP_SYS_ADMIN: the kernel then
    // reseeds on its own schedule (the bytes are mixed in already).
    unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_id_replaces_a_planted_symlink_without_following_it() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("victim");
        std::fs::write(&target, "keep").unwrap();
        let path = dir.path().join("machine-id");
        std::os::unix::fs::symlink(&target, &path).unwrap();
        write_machine_id(&path, "0123456789abcdef0123456789abcdef", true).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "0123456789abcdef0123456789abcdef\n"
        );
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        assert!(!path.symlink_metadata().unwrap().file_type().is_symlink());
    }

    #[test]
    fn an_absent_optional_machine_id_is_not_created() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dbus/machine-id");
        write_machine_id(&path, "00", false).unwrap();
        assert!(!path.exists());
    }
}
