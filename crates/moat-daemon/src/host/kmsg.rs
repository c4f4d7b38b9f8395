//! The kernel's log (`/dev/kmsg`), read for what it alone says about a cgroup: which process the
//! OOM killer ended in it, and that a fork was refused at its pids limit. (cgroup counters say how
//! many, not which or when; Kubernetes' kubelet reads the same lines for the same reason.) Only
//! records written after the reader starts are read.

use std::io::Read;

/// What the kernel said about a cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelEvent {
    /// `oom-kill:...,oom_memcg=CGROUP,...,task=NAME,pid=PID,...`
    OomKill { task: String, pid: u32 },
    /// `cgroup: fork rejected by pids controller in CGROUP` (said once per cgroup).
    ForkRejected,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelNote {
    /// The cgroup's path in its hierarchy (`/moat/sbx_...`).
    pub cgroup: String,
    pub event: KernelEvent,
}

/// Parses one `/dev/kmsg` record (`PRIO,SEQ,USEC,FLAGS;MESSAGE`).
pub fn parse(record: &str) -> Option<KernelNote> {
    let message = record.split_once(';')?.1.lines().next()?.trim();
    if let Some(fields) = message.strip_prefix("oom-kill:") {
        let field = |name: &str| {
            fields
                .split(',')
                .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        };
        return Some(KernelNote {
            cgroup: field("oom_memcg")?.to_string(),
            event: KernelEvent::OomKill {
                task: field("task")?.to_string(),
                pid: field("pid")?.parse().ok()?,
            },
        });
    }
    let cgroup = message.strip_prefix("cgroup: fork rejected by pids controller in ")?;
    Some(KernelNote {
        cgroup: cgroup.trim().to_string(),
        event: KernelEvent::ForkRejected,
    })
}

/// Reads the kernel's log from now on in a thread of its own, sending what it says about cgroups.
/// Returns false (and reads nothing) where `/dev/kmsg` cannot be read.
pub fn watch(tx: tokio::sync::mpsc::UnboundedSender<KernelNote>) -> bool {
    let mut f = match std::fs::File::open("/dev/kmsg") {
        Ok(f) => f,
        Err(e) => {
            tracing::info!("/dev/kmsg: {e}; OOM kills and refused forks are counted, not named");
            return false;
        }
    };
    // SAFETY: lseek on a descriptor we own; /dev/kmsg's SEEK_END skips the records already there.
    unsafe {
        use std::os::fd::AsRawFd;
        libc::lseek(f.as_raw_fd(), 0, libc::SEEK_END);
    }
    let spawned = std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || {
            // One read is one record (at most 8 KiB as the kernel writes them).
            let mut buf = vec![0u8; 16 << 10];
            loop {
                match f.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        if let Some(note) = parse(&String::from_utf8_lossy(&buf[..n])) {
                            if tx.send(note).is_err() {
                                return;
                            }
                        }
                    }
                    // EPIPE: records were overwritten before this read; go on with the next.
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        tracing::warn!("/dev/kmsg: {e}; no more kernel notes");
                        return;
                    }
                }
            }
        });
    spawned.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_oom_kill_names_its_cgroup_and_process() {
        let r = "3,1234,352919597,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/moat/sbx_x,task_memcg=/moat/sbx_x/a,task=python3,pid=2341,uid=100000\n";
        assert_eq!(
            parse(r),
            Some(KernelNote {
                cgroup: "/moat/sbx_x".into(),
                event: KernelEvent::OomKill {
                    task: "python3".into(),
                    pid: 2341
                }
            })
        );
    }

    #[test]
    fn a_refused_fork_names_its_cgroup() {
        let r = "6,99,352938956,-;cgroup: fork rejected by pids controller in /moat/sbx_y\n";
        assert_eq!(
            parse(r),
            Some(KernelNote {
                cgroup: "/moat/sbx_y".into(),
                event: KernelEvent::ForkRejected
            })
        );
    }

    #[test]
    fn other_records_are_not_notes() {
        assert_eq!(
            parse("6,1,2,-;Memory cgroup out of memory: Killed process 1 (x)"),
            None
        );
        assert_eq!(parse("no separator"), None);
        assert_eq!(parse("3,1,2,-;oom-kill:task=x"), None);
    }
}
