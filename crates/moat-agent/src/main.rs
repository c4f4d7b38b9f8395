//! moat-agent: PID 1 of a sandbox. Serves the host↔agent protocol (HTTP/2 cleartext with prior
//! knowledge) on a unix socket; see docs/agent.md.

mod fsops;
mod http;
mod identity;
mod init;
mod journal;
mod layerops;
mod procapi;
mod process;
mod pty;
mod ring;
mod server;
mod tarops;
mod tcp;
mod trust;
mod users;
mod vm;
mod vmnet;
mod watch;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::FromRawFd;
use std::sync::Arc;

const USAGE: &str =
    "usage: moat-agent (--listen-fd N | --listen PATH | --vm) [--output-buffer-bytes N] | moat-agent --sync | moat-agent --hostname NAME";

#[derive(Debug, PartialEq)]
enum Listen {
    Fd(i32),
    Path(String),
    /// PID 1 of a microVM guest: boots the guest and serves on its virtio-serial port.
    Vm,
}

#[derive(Debug, PartialEq)]
struct Options {
    listen: Listen,
    output_buffer_bytes: usize,
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Options, String> {
    let mut listen = None;
    let mut output_buffer_bytes = 4 << 20;
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--listen-fd" => {
                let v = value()?;
                listen = Some(Listen::Fd(v.parse().map_err(|_| format!("bad fd {v:?}"))?));
            }
            "--listen" => listen = Some(Listen::Path(value()?)),
            "--vm" => listen = Some(Listen::Vm),
            "--output-buffer-bytes" => {
                let v = value()?;
                output_buffer_bytes = v
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("bad size {v:?}"))?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let listen = listen.ok_or("one of --listen-fd, --listen or --vm is required")?;
    Ok(Options {
        listen,
        output_buffer_bytes,
    })
}

fn open_listener(listen: &Listen) -> Result<std::os::unix::net::UnixListener, String> {
    match listen {
        Listen::Fd(fd) => {
            // SAFETY: F_SETFD on an fd number only touches the fd table; it fails cleanly if not open.
            if unsafe { libc::fcntl(*fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                return Err(format!("fd {fd}: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: the daemon passes us this listening socket; nothing else in the agent owns it.
            Ok(unsafe { std::os::unix::net::UnixListener::from_raw_fd(*fd) })
        }
        Listen::Path(p) => {
            let _ = std::fs::remove_file(p);
            std::os::unix::net::UnixListener::bind(p).map_err(|e| format!("binding {p}: {e}"))
        }
        Listen::Vm => Err("a VM's agent has no listener".into()),
    }
}

/// VM mode: boots the guest (or powers it off when that fails: the daemon sees the VM end and
/// reports the console's last lines).
fn vm_boot() -> BTreeMap<String, String> {
    match vm::boot() {
        Ok(config) => {
            if let Err(e) = init::loopback_up() {
                eprintln!("moat-agent: bringing lo up: {e}");
            }
            if let Err(e) = vmnet::configure(config.network.as_ref()) {
                eprintln!("moat-agent: guest boot failed: the network: {e}");
                // SAFETY: reboot(2) with a valid command; it does not return on success.
                unsafe { libc::reboot(libc::RB_POWER_OFF) };
                std::process::exit(1);
            }
            let procs = CString::new(format!("{}/cgroup.procs", moat_api::guest::SANDBOX_CGROUP))
                .expect("no NUL in a constant path");
            let _ = vm::JOIN_CGROUP.set(procs);
            let mut env: BTreeMap<String, String> = BTreeMap::from([(
                "PATH".to_string(),
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
            )]);
            env.extend(config.env);
            env
        }
        Err(e) => {
            eprintln!("moat-agent: guest boot failed: {e}");
            // SAFETY: reboot(2) with a valid command; it does not return on success.
            unsafe { libc::reboot(libc::RB_POWER_OFF) };
            std::process::exit(1);
        }
    }
}

fn main() {
    // `moat-agent --sync`: flush the sandbox's file caches to its root filesystem and exit (the gvisor
    // tier runs it before it copies the sandbox's writable layer, as gVisor may cache writes).
    if std::env::args().nth(1).as_deref() == Some("--sync") {
        // SAFETY: sync(2) takes no arguments and cannot fail.
        unsafe { libc::sync() };
        return;
    }
    // `moat-agent --hostname NAME`: set the sandbox's hostname and exit (the gvisor tier runs it,
    // with CAP_SYS_ADMIN for this one process, after restoring a full-state snapshot).
    if std::env::args().nth(1).as_deref() == Some("--hostname") {
        let name = std::env::args().nth(2).unwrap_or_default();
        if let Err(e) = nix::unistd::sethostname(&name) {
            eprintln!("moat-agent: sethostname {name:?}: {e}");
            std::process::exit(1);
        }
        return;
    }
    let opts = match parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("moat-agent: {msg}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let vm_env = (opts.listen == Listen::Vm).then(vm_boot);
    let listener = match vm_env.is_some() {
        true => None,
        false => Some(open_listener(&opts.listen).and_then(|l| {
            l.set_nonblocking(true).map_err(|e| e.to_string())?;
            Ok(l)
        })),
    };
    let listener = match listener.transpose() {
        Ok(l) => l,
        Err(msg) => {
            eprintln!("moat-agent: {msg}");
            std::process::exit(1);
        }
    };
    if std::process::id() == 1 {
        if let Err(e) = init::loopback_up() {
            eprintln!("moat-agent: bringing lo up: {e}");
        }
        if let Err(e) = init::not_dumpable() {
            eprintln!("moat-agent: PR_SET_DUMPABLE: {e}");
        }
    }
    let base_env: BTreeMap<String, String> = vm_env.unwrap_or_else(|| {
        std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect()
    });
    let procs = process::Processes::new(opts.output_buffer_bytes);
    {
        let procs = Arc::clone(&procs);
        if let Err(e) = std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || procs.reap_forever())
        {
            eprintln!("moat-agent: starting the reaper: {e}");
            std::process::exit(1);
        }
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("moat-agent: runtime: {e}");
            std::process::exit(1);
        }
    };
    let agent = Arc::new(server::Agent {
        procs,
        base_env: std::sync::RwLock::new(base_env),
    });
    rt.block_on(async move {
        let Some(listener) = listener else {
            return vm::serve(agent).await;
        };
        let listener = match tokio::net::UnixListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("moat-agent: listener: {e}");
                std::process::exit(1);
            }
        };
        eprintln!("moat-agent {} listening", env!("CARGO_PKG_VERSION"));
        let rebind = match &opts.listen {
            Listen::Path(p) => Some(std::path::PathBuf::from(p)),
            Listen::Fd(_) | Listen::Vm => None,
        };
        server::serve(listener, agent, rebind).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn argument_parsing() {
        assert_eq!(
            parse_args(args("--listen-fd 3")),
            Ok(Options {
                listen: Listen::Fd(3),
                output_buffer_bytes: 4 << 20
            })
        );
        assert_eq!(
            parse_args(args("--listen /tmp/a.sock --output-buffer-bytes 100")),
            Ok(Options {
                listen: Listen::Path("/tmp/a.sock".into()),
                output_buffer_bytes: 100
            })
        );
        assert!(parse_args(args("--listen")).is_err());
        assert!(parse_args(args("--bogus")).is_err());
        assert!(parse_args(args("")).is_err());
        assert!(parse_args(args("--listen-fd x")).is_err());
    }
}
