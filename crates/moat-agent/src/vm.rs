//! VM mode (`moat-agent --vm`, the microvm tier): the agent is the guest kernel's first process,
//! started from the initramfs. It loads the virtio modules, mounts the read-only base disk under an
//! overlay whose upper layer is on the VM's writable disk, switches into that root, puts the
//! sandbox's processes in a cgroup of their own, and serves the daemon over a virtio-serial port
//! instead of a unix socket. See docs/microvm-tier.md.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use moat_api::guest::{self, GuestConfig};
use nix::mount::{mount, MsFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

fn err(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

fn mount_fs(
    src: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), String> {
    let _ = std::fs::create_dir_all(target);
    mount(Some(src), target, Some(fstype), flags, data)
        .map_err(|e| err(&format!("mount {fstype} on {target}"), e))
}

/// Loads the kernel modules of the initramfs in their order; parameters for a module given on the
/// kernel command line (`virtio_mmio.device=...`) are passed along.
fn load_modules(cmdline: &str) -> Result<(), String> {
    let order =
        std::fs::read_to_string(guest::MODULES_ORDER).map_err(|e| err(guest::MODULES_ORDER, e))?;
    for name in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let module = name.trim_end_matches(".ko");
        let params: Vec<&str> = cmdline
            .split_whitespace()
            .filter_map(|w| w.strip_prefix(module)?.strip_prefix('.'))
            .collect();
        let params = CString::new(params.join(" ")).map_err(|e| err(name, e))?;
        let file = std::fs::File::open(Path::new(guest::MODULES_DIR).join(name))
            .map_err(|e| err(name, e))?;
        match nix::kmod::finit_module(&file, &params, nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(err(&format!("loading {name}"), e)),
        }
    }
    Ok(())
}

/// The /dev node of the virtio disk with serial number `serial` (waits for it to appear).
fn disk_by_serial(serial: &str) -> Result<PathBuf, String> {
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(rd) = std::fs::read_dir("/sys/block") {
            for e in rd.flatten() {
                let s = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
                if s.trim() == serial {
                    let dev = Path::new("/dev").join(e.file_name());
                    if dev.exists() {
                        return Ok(dev);
                    }
                }
            }
        }
        if std::time::Instant::now() > until {
            return Err(format!("no disk with serial {serial}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn write_file(path: &str, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| err(path, e))
}

/// Everything before the agent serves: returns the guest's configuration.
pub fn boot() -> Result<GuestConfig, String> {
    let none = None::<&str>;
    let nosuid_nodev = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount_fs(
        "proc",
        "/proc",
        "proc",
        nosuid_nodev | MsFlags::MS_NOEXEC,
        none,
    )?;
    mount_fs(
        "sysfs",
        "/sys",
        "sysfs",
        nosuid_nodev | MsFlags::MS_NOEXEC,
        none,
    )?;
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    load_modules(&cmdline)?;
    let config_disk = disk_by_serial(guest::CONFIG_DISK_SERIAL)?;
    let config: GuestConfig = guest::decode_config_disk(
        &std::fs::read(&config_disk).map_err(|e| err(&config_disk.to_string_lossy(), e))?,
    )
    .map_err(|e| err("the configuration disk", e))?;

    let base = disk_by_serial(guest::BASE_DISK_SERIAL)?;
    let rw = disk_by_serial(guest::RW_DISK_SERIAL)?;
    mount_fs(
        &base.to_string_lossy(),
        "/base",
        "ext4",
        MsFlags::MS_RDONLY,
        Some("noload"),
    )?;
    mount_fs(&rw.to_string_lossy(), "/rw", "ext4", MsFlags::empty(), none)?;
    for d in ["/rw/upper", "/rw/work"] {
        std::fs::create_dir_all(d).map_err(|e| err(d, e))?;
    }
    crate::layerops::keep_upper("/rw/upper")?;
    mount_fs(
        "overlay",
        "/newroot",
        "overlay",
        MsFlags::empty(),
        Some("lowerdir=/base,upperdir=/rw/upper,workdir=/rw/work"),
    )?;
    for d in ["dev", "proc", "sys", "tmp"] {
        let _ = std::fs::create_dir_all(Path::new("/newroot").join(d));
    }
    if config.tmp_mb > 0 {
        mount_fs(
            "tmpfs",
            "/newroot/tmp",
            "tmpfs",
            nosuid_nodev,
            Some(&format!("size={}m,mode=1777", config.tmp_mb)),
        )?;
    }
    for d in ["/dev", "/proc", "/sys"] {
        let target = format!("/newroot{d}");
        mount(Some(d), target.as_str(), none, MsFlags::MS_MOVE, none)
            .map_err(|e| err(&format!("move {d}"), e))?;
    }
    std::env::set_current_dir("/newroot").map_err(|e| err("chdir /newroot", e))?;
    mount(Some("."), "/", none, MsFlags::MS_MOVE, none).map_err(|e| err("move the root", e))?;
    nix::unistd::chroot(".").map_err(|e| err("chroot", e))?;
    std::env::set_current_dir("/").map_err(|e| err("chdir /", e))?;

    mount_fs(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    let _ = std::fs::remove_file("/dev/ptmx");
    let _ = std::os::unix::fs::symlink("pts/ptmx", "/dev/ptmx");
    mount_fs(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        nosuid_nodev,
        Some("mode=1777"),
    )?;
    mount_fs(
        "cgroup2",
        "/sys/fs/cgroup",
        "cgroup2",
        nosuid_nodev | MsFlags::MS_NOEXEC,
        none,
    )?;
    write_file(
        "/sys/fs/cgroup/cgroup.subtree_control",
        "+cpu +memory +pids",
    )?;
    std::fs::create_dir_all(guest::SANDBOX_CGROUP).map_err(|e| err(guest::SANDBOX_CGROUP, e))?;
    if config.memory_bytes > 0 {
        write_file(
            &format!("{}/memory.max", guest::SANDBOX_CGROUP),
            &config.memory_bytes.to_string(),
        )?;
        // No swap in the guest; the limit is the memory.
        let _ = write_file(&format!("{}/memory.swap.max", guest::SANDBOX_CGROUP), "0");
    }
    if config.cpu > 0.0 {
        // A CFS quota per 100 ms period: fractions of the VM's vCPUs (whole ones are its -smp).
        let quota = ((config.cpu * 100_000.0) as u64).max(1000);
        write_file(
            &format!("{}/cpu.max", guest::SANDBOX_CGROUP),
            &format!("{quota} 100000"),
        )?;
    }
    if config.pids > 0 {
        write_file(
            &format!("{}/pids.max", guest::SANDBOX_CGROUP),
            &config.pids.to_string(),
        )?;
    }
    // Memory is bounded by the sandbox cgroup's memory.max, as on the other tiers: an allocation
    // larger than the guest's RAM succeeds and the cgroup's OOM killer ends the process that touches
    // too much (reported as `reason: "oom"`), instead of the heuristic refusing it up front (a
    // MemoryError where a container sandbox would be OOM-killed). The agent itself, outside that
    // cgroup, is never the guest OOM killer's choice.
    write_file("/proc/sys/vm/overcommit_memory", "1")?;
    write_file("/proc/self/oom_score_adj", "-1000")?;
    nix::unistd::sethostname(&config.hostname).map_err(|e| err("sethostname", e))?;
    Ok(config)
}

/// The `cgroup.procs` file every process the agent starts writes itself into (VM mode only).
pub static JOIN_CGROUP: std::sync::OnceLock<CString> = std::sync::OnceLock::new();

/// One host connection on the agent's virtio-serial port, as a tokio byte stream: a duplicate of
/// the port's descriptor registered with tokio for as long as the host stays connected. (tokio keeps
/// a hang-up as final readiness, so a registration that has seen the host closed is not reused.)
struct Port(AsyncFd<OwnedFd>);

impl AsyncRead for Port {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        loop {
            let mut guard = std::task::ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| {
                nix::unistd::read(fd.as_raw_fd(), unfilled).map_err(std::io::Error::from)
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                // A hang-up stays ready in tokio: without this, a closed port would spin here.
                Err(_would_block) if host_closed(self.0.get_ref()) => return Poll::Ready(Ok(())),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Port {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        loop {
            let mut guard = std::task::ready!(self.0.poll_write_ready(cx))?;
            match guard
                .try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(std::io::Error::from))
            {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) if host_closed(self.0.get_ref()) => {
                    return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()))
                }
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The /dev node of the virtio-serial port named `name` (there is no udev to make the
/// /dev/virtio-ports links: the names are in sysfs), and the inode of its sysfs directory: a port
/// unplugged and plugged in again gets the same node name, but a new sysfs directory.
fn port_device(name: &str) -> std::io::Result<(PathBuf, u64)> {
    use std::os::unix::fs::MetadataExt;
    for e in std::fs::read_dir("/sys/class/virtio-ports")?.flatten() {
        let n = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if n.trim() == name {
            let ino = std::fs::metadata(e.path())?.ino();
            return Ok((Path::new("/dev").join(e.file_name()), ino));
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!("no virtio-serial port {name}"),
    ))
}

fn open_port(name: &str) -> std::io::Result<((PathBuf, u64), OwnedFd)> {
    use std::os::unix::fs::OpenOptionsExt;
    let dev = port_device(name)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(&dev.0)?;
    Ok((dev, OwnedFd::from(f)))
}

/// Whether the host side of the port is closed: virtio-console reports POLLHUP for as long as no
/// host program holds QEMU's end (and reads return end-of-file).
fn host_closed(fd: &OwnedFd) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLOUT)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(_) => fds[0]
            .revents()
            .is_some_and(|r| r.intersects(PollFlags::POLLHUP | PollFlags::POLLERR)),
        Err(_) => true,
    }
}

/// Waits for hosts to connect to the agent's port without spinning: the port sits in an
/// edge-triggered epoll set, and virtio-console wakes its pollers when the host opens or closes its
/// end (and on data), so each wake-up is one check of the hang-up state. A connection that raced
/// with a check left its wake-up in the ready list, so the next wait returns at once.
struct HostWaiter {
    name: &'static str,
    /// The port's device (see `port_device`): a port unplugged and plugged in again (a restored
    /// snapshot) is a new one.
    dev: (PathBuf, u64),
    port: OwnedFd,
    epoll: nix::sys::epoll::Epoll,
}

impl HostWaiter {
    fn new(
        name: &'static str,
        (dev, port): ((PathBuf, u64), OwnedFd),
    ) -> std::io::Result<HostWaiter> {
        use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags};
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        epoll.add(
            &port,
            EpollEvent::new(EpollFlags::EPOLLIN | EpollFlags::EPOLLET, 0),
        )?;
        Ok(HostWaiter {
            name,
            dev,
            port,
            epoll,
        })
    }

    /// Whether the port is still the device named so.
    fn present(&self) -> bool {
        port_device(self.name).is_ok_and(|d| d == self.dev)
    }

    /// Blocks until a host is connected (true), or the port is gone (false).
    fn wait(&self) -> bool {
        use nix::sys::epoll::{EpollEvent, EpollTimeout};
        let mut events = [EpollEvent::empty(); 1];
        while host_closed(&self.port) {
            // An unplugged port wakes its pollers once, and is closed for good.
            if !self.present() {
                return false;
            }
            if let Err(e) = self.epoll.wait(&mut events, EpollTimeout::from(1000u16)) {
                if e != nix::errno::Errno::EINTR {
                    eprintln!("moat-agent: waiting on the agent's port: {e}");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
        true
    }

    /// The stream of the connected host.
    fn connection(&self) -> std::io::Result<Port> {
        let fd = self.port.try_clone()?;
        // SAFETY: the descriptor is owned by the OwnedFd moved in, which the AsyncFd keeps (and
        // closes only after deregistering it) for as long as it is registered.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from)?;
        Ok(Port(fd))
    }
}

/// Serves the daemon over the agent's port and the tier over the control port, forever.
pub async fn serve(agent: Arc<crate::server::Agent>) {
    tokio::spawn(serve_port(Arc::clone(&agent), guest::CONTROL_PORT));
    serve_port(agent, guest::AGENT_PORT).await
}

/// Serves one virtio-serial port forever: one HTTP/2 connection at a time, a new one each time the
/// host side connects again (a closed host side reads as the end of the stream); a port that is
/// unplugged and plugged in again is opened again.
async fn serve_port(agent: Arc<crate::server::Agent>, name: &'static str) {
    loop {
        // The port's device appears when virtio-console has probed it, moments after boot (or a
        // plug) at most.
        let until = std::time::Instant::now() + Duration::from_secs(20);
        let waiter = loop {
            match open_port(name).and_then(|p| HostWaiter::new(name, p)) {
                Ok(w) => break Arc::new(w),
                Err(e) if std::time::Instant::now() > until => {
                    eprintln!("moat-agent: opening port {name}: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        eprintln!("moat-agent {} serving on {name}", env!("CARGO_PKG_VERSION"));
        loop {
            let w = Arc::clone(&waiter);
            match tokio::task::spawn_blocking(move || w.wait()).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) => continue,
            }
            match waiter.connection() {
                Ok(port) => crate::server::serve_stream(port, Arc::clone(&agent)).await,
                Err(e) => {
                    eprintln!("moat-agent: the agent's port: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
            if !waiter.present() {
                break;
            }
        }
    }
}
