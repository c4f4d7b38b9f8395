//! A size- and inode-limited filesystem for a sandbox's writable layer: a sparse ext4 image file,
//! attached to a loop device and mounted.
//!
//! The image is made with `mkfs.ext4` (no journal, lazy inode tables, no reserved blocks, no blocks
//! kept for growing it: a fresh 10 GiB image takes about 230 KiB of the host's disk) and attached
//! with the loop ioctls (`LOOP_CTL_GET_FREE` + `LOOP_CONFIGURE`) with `LO_FLAGS_AUTOCLEAR`: the kernel
//! detaches the loop device by itself once the filesystem is unmounted everywhere, so unmounting the
//! sandbox's tree is all the cleanup there is and a daemon crash cannot leave a loop device behind.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use nix::mount::{mount, MsFlags};

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;

/// Dirty (written, not yet on disk) bytes a sandbox's disk may hold in the host's page cache;
/// a writer past it waits for its own device's writeback, not everyone's (see [`limit_dirty`]).
pub const DIRTY_BYTES: u64 = 64 << 20;

/// `struct loop_info64` of <linux/loop.h>.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` of <linux/loop.h>.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Arguments of `mkfs.ext4` for an image of `size_mb` MiB with `inodes` inodes.
pub fn mkfs_args(image: &Path, size_mb: u64, inodes: u64) -> Vec<String> {
    vec![
        "-q".into(),
        "-F".into(),
        "-t".into(),
        "ext4".into(),
        "-O".into(),
        // No journal (a sandbox's layer is disposable), and no blocks reserved for growing the
        // filesystem later (never done): mkfs would write 4 MiB of them into every image.
        "^has_journal,^resize_inode".into(),
        "-E".into(),
        "lazy_itable_init=1,nodiscard".into(),
        "-m".into(),
        "0".into(),
        "-N".into(),
        inodes.to_string(),
        image.to_string_lossy().into_owned(),
        format!("{size_mb}M"),
    ]
}

/// ext4 options of a sandbox's image.
const MOUNT_OPTIONS: &str = "noinit_itable,discard,errors=remount-ro";

/// Creates the sparse image `image` and mounts it at `target` (nosuid, nodev). Returns the loop device.
pub fn create_and_mount(image: &Path, size_mb: u64, inodes: u64, target: &Path) -> Result<PathBuf> {
    {
        let f = File::create(image).with_context(|| format!("create {}", image.display()))?;
        f.set_len(size_mb << 20)
            .with_context(|| format!("size {}", image.display()))?;
    }
    let out = Command::new("mkfs.ext4")
        .args(mkfs_args(image, size_mb, inodes))
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .context("run mkfs.ext4 (install e2fsprogs)")?;
    if !out.status.success() {
        bail!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    mount_image(image, target)
}

/// Mounts an existing image (made by [`create_and_mount`]) at `target`: a sandbox coming back with
/// the files it had.
pub fn mount_image(image: &Path, target: &Path) -> Result<PathBuf> {
    let (dev, _file) = attach(image)?;
    std::fs::create_dir_all(target).with_context(|| format!("mkdir {}", target.display()))?;
    // noinit_itable: the sparse file already reads as zeros, so the kernel need not write the inode
    // tables (which would allocate them on the host). discard: blocks the sandbox frees are punched
    // out of the image file, so what it deletes is the host's again.
    mount(
        Some(&dev),
        target,
        Some("ext4"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some(MOUNT_OPTIONS),
    )
    .with_context(|| format!("mount {} at {}", dev.display(), target.display()))?;
    if let Err(e) = limit_dirty(&dev) {
        tracing::warn!("{e:#}");
    }
    // `_file` (the loop device's fd) closes here: the mount now holds the device, and autoclear
    // detaches it when the last mount goes.
    Ok(dev)
}

/// Bounds the dirty pages of the block device `dev` (a sandbox's disk) at [`DIRTY_BYTES`], strictly:
/// its writer is throttled to its own device's writeback once it has that much unwritten, instead
/// of filling the host's dirty page pool, which makes every writer on the host wait (the daemon's
/// database, other sandboxes). The device's `bdi` `max_bytes` (Linux 6.2), else `max_ratio` 1%.
fn limit_dirty(dev: &Path) -> Result<()> {
    let name = dev
        .file_name()
        .with_context(|| format!("no device name in {}", dev.display()))?;
    let bdi = Path::new("/sys/block").join(name).join("bdi");
    let by_bytes = std::fs::write(bdi.join("max_bytes"), DIRTY_BYTES.to_string());
    if by_bytes.is_err() {
        std::fs::write(bdi.join("max_ratio"), "1")
            .with_context(|| format!("limit the dirty pages of {}", dev.display()))?;
    }
    std::fs::write(bdi.join("strict_limit"), "1")
        .with_context(|| format!("strict dirty limit of {}", dev.display()))?;
    Ok(())
}

/// Attaches `image` to a free loop device with autoclear. The returned file keeps it attached until
/// closed (or, after a mount, until the filesystem is unmounted).
fn attach(image: &Path) -> Result<(PathBuf, File)> {
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .with_context(|| format!("open {}", image.display()))?;
    let ctl = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .context("open /dev/loop-control")?;
    for _ in 0..20 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(std::io::Error::last_os_error()).context("LOOP_CTL_GET_FREE");
        }
        let dev = PathBuf::from(format!("/dev/loop{n}"));
        let loopf = match OpenOptions::new().read(true).write(true).open(&dev) {
            Ok(f) => f,
            // The node may appear a moment after the device is created.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).with_context(|| format!("open {}", dev.display())),
        };
        // SAFETY: LoopConfig is plain data; all-zero is a valid value.
        let mut cfg: LoopConfig = unsafe { std::mem::zeroed() };
        cfg.fd = backing.as_raw_fd() as u32;
        // Direct I/O to the image file: the sandbox's data is cached once (in its own filesystem's
        // pages), not twice; the kernel turns it off by itself where the host's filesystem cannot.
        cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO;
        let name = image.as_os_str().as_encoded_bytes();
        let len = name.len().min(63);
        cfg.info.lo_file_name[..len].copy_from_slice(&name[..len]);
        // SAFETY: `cfg` is a valid loop_config that outlives the call; the kernel only reads it.
        let r = unsafe { libc::ioctl(loopf.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) };
        if r == 0 {
            return Ok((dev, loopf));
        }
        let e = std::io::Error::last_os_error();
        // EBUSY: someone else took this device between GET_FREE and CONFIGURE; try another.
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e).with_context(|| format!("LOOP_CONFIGURE {}", dev.display()));
        }
    }
    bail!("no free loop device")
}

/// Bytes and inodes in use on the filesystem mounted at `dir`.
pub fn used(dir: &Path) -> Result<(u64, u64)> {
    let s =
        nix::sys::statvfs::statvfs(dir).with_context(|| format!("statvfs {}", dir.display()))?;
    let bytes = (s.blocks() - s.blocks_free()) as u64 * s.fragment_size() as u64;
    let inodes = (s.files() - s.files_free()) as u64;
    Ok((bytes, inodes))
}

/// Bytes the filesystem mounted at `dir` can still give an unprivileged writer (f_bavail).
pub fn available(dir: &Path) -> Result<u64> {
    let s =
        nix::sys::statvfs::statvfs(dir).with_context(|| format!("statvfs {}", dir.display()))?;
    Ok(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// The ext4 sysfs directory (`/sys/fs/ext4/<device>`) of the filesystem mounted at `dir`.
fn ext4_sysfs(dir: &Path) -> Result<PathBuf> {
    let st = nix::sys::stat::stat(dir).with_context(|| format!("stat {}", dir.display()))?;
    let (major, minor) = (libc::major(st.st_dev), libc::minor(st.st_dev));
    let dev = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}"))
        .with_context(|| format!("the block device {major}:{minor} of {}", dir.display()))?;
    let name = dev
        .file_name()
        .with_context(|| format!("no device name in {}", dev.display()))?;
    let sys = Path::new("/sys/fs/ext4").join(name);
    if !sys.exists() {
        bail!(
            "{} is not an ext4 filesystem ({} absent)",
            dir.display(),
            sys.display()
        );
    }
    Ok(sys)
}

/// Caps what can still be written to the ext4 filesystem mounted at `dir` at `room` bytes — for
/// every writer, root included: the filesystem's reserved clusters (`reserved_clusters` in its sysfs
/// directory, which only the kernel's own metadata updates may use) are raised to all its free
/// space but `room`. None gives back ext4's own reserve (2% of the blocks, at most 4096). Writes
/// past the cap fail with ENOSPC, as at the sandbox's own quota; nothing written is touched.
/// Returns the bytes that can be written now.
pub fn cap_room(dir: &Path, room: Option<u64>) -> Result<u64> {
    let sys = ext4_sysfs(dir)?.join("reserved_clusters");
    let s =
        nix::sys::statvfs::statvfs(dir).with_context(|| format!("statvfs {}", dir.display()))?;
    let block = (s.fragment_size() as u64).max(1);
    let total = s.blocks() as u64;
    // statfs's free blocks count the reserved clusters (its available blocks do not) and leave
    // out blocks promised to delayed allocations: what the reserve may be set within.
    let current: u64 = std::fs::read_to_string(&sys)
        .with_context(|| format!("read {}", sys.display()))?
        .trim()
        .parse()
        .with_context(|| format!("parse {}", sys.display()))?;
    let free = s.blocks_free() as u64;
    let own = (total / 50).min(4096);
    let want = match room {
        None => own,
        Some(r) => free.saturating_sub(r / block).max(own),
    }
    .min(total.saturating_sub(1));
    if want != current {
        std::fs::write(&sys, want.to_string())
            .with_context(|| format!("write {} to {}", want, sys.display()))?;
    }
    Ok(free.saturating_sub(want) * block)
}

/// Copies the image file `src` to the new file `dst` (mode 0600) with its holes: only the ranges
/// that hold data are copied (SEEK_DATA / SEEK_HOLE), so a mostly empty disk image of gigabytes
/// costs what it holds, in time and in space.
pub fn copy_sparse(src: &Path, dst: &Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let from = File::open(src).with_context(|| format!("open {}", src.display()))?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)
        .with_context(|| format!("create {}", dst.display()))?;
    let len = from.metadata()?.len();
    to.set_len(len)?;
    let (fi, fo) = (from.as_raw_fd(), to.as_raw_fd());
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on a descriptor this function owns.
        let data = unsafe { libc::lseek(fi, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no data past `pos`
            }
            return Err(e).with_context(|| format!("SEEK_DATA in {}", src.display()));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fi, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error())
                .with_context(|| format!("SEEK_HOLE in {}", src.display()));
        }
        let (mut off_in, mut off_out) = (data, data);
        while off_in < hole {
            // SAFETY: both descriptors are open files of this function; the offsets are locals.
            let n = unsafe {
                libc::copy_file_range(
                    fi,
                    &mut off_in,
                    fo,
                    &mut off_out,
                    (hole - off_in) as usize,
                    0,
                )
            };
            if n < 0 {
                return Err(std::io::Error::last_os_error())
                    .with_context(|| format!("copy {} to {}", src.display(), dst.display()));
            }
            if n == 0 {
                bail!("{} ended while being copied", src.display());
            }
        }
        pos = hole;
    }
    to.sync_all()?;
    Ok(())
}

/// Loop devices whose backing file lies under `dir` (for leak checks and diagnostics).
pub fn loops_backed_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/sys/block") else {
        return out;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(b) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            if Path::new(b.trim()).starts_with(dir) {
                out.push(name);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_copy_keeps_data_and_holes() {
        use std::io::{Seek, SeekFrom, Write};
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let (src, dst) = (d.path().join("a.img"), d.path().join("b.img"));
        let mut f = File::create(&src).unwrap();
        f.set_len(1 << 30).unwrap();
        f.write_all(b"head").unwrap();
        f.seek(SeekFrom::Start(512 << 20)).unwrap();
        f.write_all(&[9u8; 70000]).unwrap();
        drop(f);
        copy_sparse(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let m = std::fs::metadata(&dst).unwrap();
        assert_eq!(m.len(), 1 << 30);
        assert!(
            m.blocks() * 512 < 4 << 20,
            "copied the holes: {} bytes",
            m.blocks() * 512
        );
        assert!(
            copy_sparse(&src, &dst).is_err(),
            "overwrote an existing file"
        );
    }

    #[test]
    fn mkfs_arguments() {
        let a = mkfs_args(Path::new("/d/disk.img"), 1024, 65536);
        assert_eq!(a.last().unwrap(), "1024M");
        let i = a.iter().position(|x| x == "-N").unwrap();
        assert_eq!(a[i + 1], "65536");
        assert!(a.contains(&"^has_journal,^resize_inode".to_string()));
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }

    #[test]
    fn image_limits_size_and_inodes() {
        if !nix::unistd::Uid::effective().is_root() || !Path::new("/dev/loop-control").exists() {
            eprintln!("skipped: needs root and loop devices");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("disk.img");
        let mnt = dir.path().join("mnt");
        let t = std::time::Instant::now();
        let dev = create_and_mount(&img, 32, 1024, &mnt).unwrap();
        eprintln!("image made and mounted in {:?}", t.elapsed());
        {
            // Its dirty pages are limited on its own, and it is cached once (direct I/O).
            let sys = Path::new("/sys/block").join(dev.file_name().unwrap());
            let read = |p: &str| std::fs::read_to_string(sys.join(p)).unwrap();
            assert_eq!(read("bdi/strict_limit").trim(), "1");
            if sys.join("bdi/max_bytes").exists() {
                let max: u64 = read("bdi/max_bytes").trim().parse().unwrap();
                // The kernel keeps it as a ratio of the host's dirty limit: about what was asked.
                assert!(max <= DIRTY_BYTES + (DIRTY_BYTES / 4), "max_bytes {max}");
            }
            assert_eq!(read("loop/dio").trim(), "1", "direct I/O");
        }
        {
            // What an idle sandbox's image costs the host: a 10 GiB one (the default quota), fresh.
            use std::os::unix::fs::MetadataExt;
            let idle = dir.path().join("idle.img");
            std::fs::File::create(&idle)
                .unwrap()
                .set_len(10_240 << 20)
                .unwrap();
            let out = Command::new("mkfs.ext4")
                .args(mkfs_args(&idle, 10_240, 655_360))
                .output()
                .unwrap();
            assert!(out.status.success(), "{out:?}");
            let kib = std::fs::metadata(&idle).unwrap().blocks() / 2;
            assert!(kib < 1024, "a fresh 10 GiB image takes {kib} KiB");
        }
        assert_eq!(loops_backed_under(dir.path()).len(), 1);
        let s = nix::sys::statvfs::statvfs(&mnt).unwrap();
        assert!(s.files() <= 2048, "{}", s.files());
        let big = std::fs::write(mnt.join("big"), vec![1u8; 40 << 20]);
        assert_eq!(big.unwrap_err().raw_os_error(), Some(libc::ENOSPC));
        std::fs::remove_file(mnt.join("big")).unwrap();
        {
            // Capped: 4 MiB more can be written, then ENOSPC; uncapped: the quota again.
            use std::os::unix::fs::MetadataExt;
            let avail = || {
                let s = nix::sys::statvfs::statvfs(&mnt).unwrap();
                s.blocks_available() as u64 * s.fragment_size() as u64
            };
            // Caps one after the other are each what was asked (not what is left of the last).
            for want in [2 << 20, 16 << 20, 4 << 20] {
                let room = cap_room(&mnt, Some(want)).unwrap();
                assert!(want - room < 8192, "asked {want}, got {room}");
                assert_eq!(avail(), room);
            }
            let r = std::fs::write(mnt.join("capped"), vec![1u8; 8 << 20]);
            assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ENOSPC));
            std::fs::remove_file(mnt.join("capped")).unwrap();
            std::fs::write(mnt.join("small"), vec![1u8; 1 << 20]).unwrap();
            let room = cap_room(&mnt, None).unwrap();
            assert!(room > 20 << 20, "uncapped room {room}");
            std::fs::write(mnt.join("capped"), vec![1u8; 8 << 20]).unwrap();
            // What the sandbox deletes goes back to the host (discard punches it out).
            let sync =
                || nix::unistd::syncfs(std::fs::File::open(&mnt).unwrap().as_raw_fd()).unwrap();
            sync();
            let before = std::fs::metadata(&img).unwrap().blocks() * 512;
            std::fs::remove_file(mnt.join("capped")).unwrap();
            sync();
            let after = std::fs::metadata(&img).unwrap().blocks() * 512;
            assert!(before - after >= 7 << 20, "image {before} -> {after} bytes");
        }
        nix::mount::umount2(&mnt, nix::mount::MntFlags::MNT_DETACH).unwrap();
        let mut left = loops_backed_under(dir.path());
        for _ in 0..100 {
            if left.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            left = loops_backed_under(dir.path());
        }
        assert!(left.is_empty(), "loop devices left: {left:?}");
    }
}
