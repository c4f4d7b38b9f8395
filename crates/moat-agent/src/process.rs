//! The process table, spawning (pipes or a PTY, own process group, user switch) and the reaper.
//!
//! Reaping: the agent may be PID 1 and must reap every zombie while still learning the status of the
//! processes it started. A reaper thread waits with `waitid(P_ALL, WEXITED | WNOWAIT)` (which does not
//! reap), then takes `spawn_lock` and reaps that one pid with `waitpid(pid, WNOHANG)`. `spawn_lock` is
//! also held around `Command::spawn` + inserting the pid in the table, because std's spawn reaps its
//! own child when exec fails and must not find it reaped by someone else.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use moat_api::{ExitStatus, JournalEvent, ProcessInfo, ProcessSelector, PtySize};
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};

use crate::http::{now_us, ApiError};
use crate::ring::{Reader, Ring, Stream, Utf8Carry};
use crate::users::User;

/// Exited processes kept for `GET /processes` and re-attach.
const MAX_EXITED: usize = 64;
/// How long after the exit the agent waits for the output pipes to reach EOF (a background child may
/// hold them open forever). What is already in a pipe is always read first, however late the output
/// thread gets to run: the exit event never overtakes the output written before it.
const OUTPUT_GRACE: Duration = Duration::from_millis(300);
/// After the grace, at most this much more is read before the exit is reported (a background child
/// that writes without pause must not hold the exit back forever).
const DRAIN_AFTER_GRACE: usize = 1 << 20;
const READ_BUF: usize = 64 * 1024;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What to start; validated by the caller.
pub struct SpawnSpec {
    /// Resolved program to execute.
    pub program: PathBuf,
    /// argv as requested (argv[0] is passed as is).
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// The variables the request set (what the process list shows).
    pub asked_env: std::collections::BTreeMap<String, String>,
    pub cwd: PathBuf,
    pub user: User,
    pub pty: Option<PtySize>,
    pub stdin: bool,
    pub tag: Option<String>,
}

/// A started process.
pub struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    pub cmd: Vec<String>,
    pub env: std::collections::BTreeMap<String, String>,
    pub cwd: String,
    pub user: String,
    pub started_at_us: u64,
    pub ring: Arc<Ring>,
    stdin: Mutex<Option<Arc<File>>>,
    master: Option<File>,
    pub timed_out: AtomicBool,
    /// The sandbox's OOM-kill count when the process started (None: unknown).
    oom_before: Option<u64>,
    fin: Mutex<Fin>,
    /// An eventfd the reaper makes readable when the process exits; it wakes the output threads.
    exit_fd: EventFd,
}

#[derive(Default)]
struct Fin {
    status: Option<ExitStatus>,
    open_outputs: u32,
}

impl Proc {
    pub fn is_pty(&self) -> bool {
        self.master.is_some()
    }

    pub fn running(&self) -> bool {
        lock(&self.fin).status.is_none()
    }

    pub fn stdin(&self) -> Option<Arc<File>> {
        lock(&self.stdin).clone()
    }

    /// Closes the agent's end of stdin; false when it was not open.
    pub fn close_stdin(&self) -> bool {
        lock(&self.stdin).take().is_some()
    }

    pub fn master(&self) -> Option<&File> {
        self.master.as_ref()
    }

    pub fn info(&self) -> ProcessInfo {
        let status = lock(&self.fin).status.clone();
        ProcessInfo {
            pid: self.pid,
            tag: self.tag.clone(),
            cmd: self.cmd.clone(),
            env: self.env.clone(),
            cwd: self.cwd.clone(),
            user: self.user.clone(),
            pty: self.is_pty(),
            stdin_open: lock(&self.stdin).is_some(),
            running: status.is_none(),
            exit: status,
            started_at_us: self.started_at_us,
        }
    }

    /// Called by the reaper.
    fn exited(self: &Arc<Self>, status: ExitStatus) {
        let mut fin = lock(&self.fin);
        fin.status = Some(status.clone());
        let outputs_done = fin.open_outputs == 0;
        drop(fin);
        lock(&self.stdin).take();
        if outputs_done {
            self.ring.finish(status);
        } else {
            // Cannot fail short of the counter overflowing, which one write per exit never does.
            let _ = self.exit_fd.write(1);
        }
    }

    /// Called once by each output thread, at EOF or when the grace after the exit has passed.
    fn output_done(&self) {
        let mut fin = lock(&self.fin);
        fin.open_outputs = fin.open_outputs.saturating_sub(1);
        if fin.open_outputs == 0 {
            if let Some(status) = fin.status.clone() {
                drop(fin);
                self.ring.finish(status);
            }
        }
    }
}

#[derive(Default)]
struct Table {
    running: HashMap<u32, Arc<Proc>>,
    exited: VecDeque<Arc<Proc>>,
}

/// All processes the agent started.
pub struct Processes {
    spawn_lock: Mutex<()>,
    table: Mutex<Table>,
    /// Bumped on every spawn; the reaper waits on it while there are no children.
    spawned: (Mutex<u64>, Condvar),
    /// Output buffer of each new process, bytes.
    ring_cap: AtomicUsize,
    /// RLIMIT_NOFILE of new processes; 0 leaves the agent's own.
    nofile: AtomicU64,
    /// RLIMIT_NPROC of new processes; 0 leaves the agent's own.
    nproc: AtomicU64,
    /// Timeout (ms) of processes whose request gives none; 0: none.
    pub default_timeout_ms: AtomicU64,
    /// File with the sandbox's `oom_kill N` counter.
    oom_counter: Mutex<Option<PathBuf>>,
    /// User and working directory of a process whose request names none (a template's `user` and
    /// `workdir`).
    defaults: Mutex<(Option<String>, Option<String>)>,
    /// Every start and exit, in order, for the daemon's audit log.
    pub journal: crate::journal::Journal,
}

/// The `oom_kill` count of a cgroup events file (v1 `memory.oom_control`, v2 `memory.events`).
pub fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
}

impl Processes {
    pub fn new(ring_cap: usize) -> Arc<Processes> {
        Arc::new(Processes {
            spawn_lock: Mutex::new(()),
            table: Mutex::new(Table::default()),
            spawned: (Mutex::new(0), Condvar::new()),
            ring_cap: AtomicUsize::new(ring_cap),
            nofile: AtomicU64::new(0),
            nproc: AtomicU64::new(0),
            default_timeout_ms: AtomicU64::new(0),
            oom_counter: Mutex::new(None),
            defaults: Mutex::new((None, None)),
            journal: crate::journal::Journal::new(format!("{:x}-{}", now_us(), std::process::id())),
        })
    }

    /// Applies `POST /config` (absent fields stay as they are).
    pub fn configure(&self, c: &moat_api::AgentConfig) {
        if let Some(n) = c.nofile {
            self.nofile.store(n, Ordering::SeqCst);
        }
        if let Some(n) = c.nproc {
            self.nproc.store(n, Ordering::SeqCst);
        }
        if let Some(n) = c.output_bytes {
            self.ring_cap.store(n as usize, Ordering::SeqCst);
        }
        if let Some(t) = c.command_timeout {
            self.default_timeout_ms
                .store((t * 1000.0) as u64, Ordering::SeqCst);
        }
        if let Some(p) = &c.oom_counter {
            *lock(&self.oom_counter) = Some(PathBuf::from(p));
        }
        let mut d = lock(&self.defaults);
        if let Some(u) = &c.user {
            d.0 = Some(u.clone());
        }
        if let Some(w) = &c.cwd {
            d.1 = Some(w.clone());
        }
    }

    /// The default user and working directory of processes (`POST /config`).
    pub fn defaults(&self) -> (Option<String>, Option<String>) {
        lock(&self.defaults).clone()
    }

    /// The sandbox's OOM-kill count now, when known.
    fn oom_kills(&self) -> Option<u64> {
        let path = lock(&self.oom_counter).clone()?;
        parse_oom_kills(&std::fs::read_to_string(path).ok()?)
    }

    /// Looks a process up: running ones first, then the most recent exited one.
    pub fn find(&self, sel: &ProcessSelector) -> Option<Arc<Proc>> {
        let t = lock(&self.table);
        match sel {
            ProcessSelector::Pid(pid) => t
                .running
                .get(pid)
                .cloned()
                .or_else(|| t.exited.iter().rev().find(|p| p.pid == *pid).cloned()),
            ProcessSelector::Tag(tag) => t
                .running
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned()
                .or_else(|| {
                    t.exited
                        .iter()
                        .rev()
                        .find(|p| p.tag.as_deref() == Some(tag))
                        .cloned()
                }),
        }
    }

    /// Running processes (by start time), then the kept exited ones (oldest first).
    pub fn list(&self) -> Vec<ProcessInfo> {
        let t = lock(&self.table);
        let mut running: Vec<&Arc<Proc>> = t.running.values().collect();
        running.sort_by_key(|p| (p.started_at_us, p.pid));
        running
            .into_iter()
            .chain(t.exited.iter())
            .map(|p| p.info())
            .collect()
    }

    /// Starts a process. With `attach`, a replaying reader is attached before any output is read.
    pub fn spawn(
        &self,
        spec: SpawnSpec,
        attach: bool,
    ) -> Result<(Arc<Proc>, Option<Reader>), ApiError> {
        let ring = Ring::new(self.ring_cap.load(Ordering::SeqCst));
        let nofile = self.nofile.load(Ordering::SeqCst);
        let nproc = self.nproc.load(Ordering::SeqCst);
        let oom_before = self.oom_kills();
        let reader = attach.then(|| ring.attach(true));
        let mut cmd = Command::new(&spec.program);
        if let Some(arg0) = spec.argv.first() {
            cmd.arg0(arg0);
        }
        cmd.args(spec.argv.iter().skip(1))
            .env_clear()
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .current_dir(&spec.cwd);

        let mut master = None;
        if let Some(size) = spec.pty {
            let (m, slave) = crate::pty::open(size)
                .map_err(|e| ApiError::internal(format!("opening a pty: {e}")))?;
            let dup = |fd: &OwnedFd| {
                fd.try_clone()
                    .map_err(|e| ApiError::internal(format!("dup: {e}")))
            };
            cmd.stdin(Stdio::from(dup(&slave)?))
                .stdout(Stdio::from(dup(&slave)?))
                .stderr(Stdio::from(slave));
            master = Some(File::from(m));
        } else {
            cmd.stdin(if spec.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        }

        let is_pty = spec.pty.is_some();
        // SAFETY: these are plain syscalls reading integers (no allocation, no locks).
        let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
        let switch_user = spec.user.uid != euid || spec.user.gid != egid;
        let (uid, gid) = (spec.user.uid, spec.user.gid);
        let groups: Vec<libc::gid_t> = spec.user.groups.clone();
        let oom_adj_path = c"/proc/self/oom_score_adj";
        // VM mode: every process joins the sandbox's cgroup (its limits and OOM count).
        let join_cgroup: Option<&'static std::ffi::CStr> =
            crate::vm::JOIN_CGROUP.get().map(|c| c.as_c_str());
        // SAFETY: the closure runs in the forked child before exec and only makes async-signal-safe
        // syscalls (open, write, close, setrlimit, setsid, setpgid, ioctl, setgroups, setgid, setuid) on
        // data allocated before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(procs) = join_cgroup {
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(fd);
                }
                // The OOM killer takes a sandbox process before the agent (best effort: a process
                // may lower it again, to 0 at most, which still leaves the agent the smallest).
                let fd = libc::open(oom_adj_path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(fd, b"1000".as_ptr().cast(), 4);
                    libc::close(fd);
                }
                if nofile > 0 {
                    let lim = libc::rlimit {
                        rlim_cur: nofile,
                        rlim_max: nofile,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if nproc > 0 {
                    let lim = libc::rlimit {
                        rlim_cur: nproc,
                        rlim_max: nproc,
                    };
                    if libc::setrlimit(libc::RLIMIT_NPROC, &lim) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if is_pty {
                    if libc::setsid() < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::setpgid(0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if switch_user
                    && (libc::setgroups(groups.len(), groups.as_ptr()) < 0
                        || libc::setgid(gid) < 0
                        || libc::setuid(uid) < 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }

        let exit_fd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| ApiError::internal(format!("eventfd: {e}")))?;

        let guard = lock(&self.spawn_lock);
        if let Some(tag) = &spec.tag {
            if lock(&self.table)
                .running
                .values()
                .any(|p| p.tag.as_ref() == Some(tag))
            {
                return Err(ApiError::conflict(format!(
                    "a running process already has tag {tag:?}"
                )));
            }
        }
        let mut child = cmd.spawn().map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                ApiError::invalid("cmd", format!("starting {:?}: {e}", spec.program))
            }
            _ => ApiError::internal(format!("starting {:?}: {e}", spec.program)),
        })?;
        let pid = child.id();
        let stdin = if is_pty {
            master
                .as_ref()
                .and_then(|m| m.try_clone().ok())
                .map(Arc::new)
        } else {
            child
                .stdin
                .take()
                .map(|s| Arc::new(File::from(OwnedFd::from(s))))
        };
        let mut outputs: Vec<(Stream, File)> = Vec::new();
        if let Some(m) = master.as_ref().and_then(|m| m.try_clone().ok()) {
            outputs.push((Stream::Pty, m));
        }
        if let Some(s) = child.stdout.take() {
            outputs.push((Stream::Stdout, File::from(OwnedFd::from(s))));
        }
        if let Some(s) = child.stderr.take() {
            outputs.push((Stream::Stderr, File::from(OwnedFd::from(s))));
        }
        let proc = Arc::new(Proc {
            pid,
            tag: spec.tag.clone(),
            cmd: spec.argv.clone(),
            env: spec.asked_env.clone(),
            cwd: spec.cwd.to_string_lossy().into_owned(),
            user: spec.user.name.clone(),
            started_at_us: now_us(),
            ring,
            stdin: Mutex::new(if is_pty || spec.stdin { stdin } else { None }),
            master,
            timed_out: AtomicBool::new(false),
            oom_before,
            fin: Mutex::new(Fin {
                status: None,
                open_outputs: outputs.len() as u32,
            }),
            exit_fd,
        });
        lock(&self.table).running.insert(pid, Arc::clone(&proc));
        // Under the spawn lock, which the reaper takes before it takes a process out: the start is
        // journaled before its exit can be.
        self.journal
            .push(JournalEvent::Start, proc.started_at_us, proc.info());
        drop(guard);
        // The command holds the parent's copies of the pty slave; close them so EOF is seen.
        drop(cmd);
        drop(child); // never waited on: the reaper does that.
        {
            let (m, cv) = &self.spawned;
            *lock(m) += 1;
            cv.notify_all();
        }
        for (stream, file) in outputs {
            let p = Arc::clone(&proc);
            std::thread::spawn(move || pump_output(p, stream, file));
        }
        Ok((proc, reader))
    }

    /// Reaps children forever (run on its own thread).
    pub fn reap_forever(self: Arc<Self>) {
        loop {
            let seen = *lock(&self.spawned.0);
            // SAFETY: siginfo_t is plain data; zeroed is a valid value for it.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: `info` is a valid, writable siginfo_t; WNOWAIT leaves the child a zombie.
            let r =
                unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
            if r < 0 {
                match std::io::Error::last_os_error().raw_os_error() {
                    Some(libc::EINTR) => {}
                    Some(libc::ECHILD) => {
                        let (m, cv) = &self.spawned;
                        let g = lock(m);
                        if *g == seen {
                            let _ = cv.wait_timeout(g, Duration::from_secs(1));
                        }
                    }
                    _ => std::thread::sleep(Duration::from_millis(50)),
                }
                continue;
            }
            // SAFETY: waitid succeeded with WEXITED, so si_pid is the field that was filled in.
            let pid = unsafe { info.si_pid() };
            if pid <= 0 {
                continue;
            }
            let guard = lock(&self.spawn_lock);
            let mut raw = 0;
            // SAFETY: `raw` is a valid int to write the status into.
            let r = unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) };
            let proc = if r == pid {
                let mut t = lock(&self.table);
                let p = t.running.remove(&(pid as u32));
                if let Some(p) = &p {
                    t.exited.push_back(Arc::clone(p));
                    while t.exited.len() > MAX_EXITED {
                        t.exited.pop_front();
                    }
                }
                p
            } else {
                None
            };
            drop(guard);
            if let Some(p) = proc {
                let mut status = decode_status(raw);
                status.timed_out = p.timed_out.load(Ordering::SeqCst);
                let killed = status.signal.as_deref() == Some("SIGKILL")
                    || status.exit_code == Some(128 + libc::SIGKILL);
                if status.timed_out {
                    status.reason = Some("timeout".into());
                } else if killed {
                    if let (Some(before), Some(now)) = (p.oom_before, self.oom_kills()) {
                        if now > before {
                            status.reason = Some("oom".into());
                        }
                    }
                }
                p.exited(status);
                self.journal.push(JournalEvent::Exit, now_us(), p.info());
            }
        }
    }
}

/// Turns a wait status into the API's exit status.
pub fn decode_status(raw: i32) -> ExitStatus {
    let mut s = ExitStatus::default();
    if libc::WIFEXITED(raw) {
        s.exit_code = Some(libc::WEXITSTATUS(raw));
    } else if libc::WIFSIGNALED(raw) {
        s.signal = Some(moat_api::signal_name(libc::WTERMSIG(raw)));
    }
    s
}

/// Copies one output of a process into its ring until EOF (EIO on a pty whose slave is closed).
///
/// Until the process has exited and this output is drained, the thread holds the exit event back
/// (`output_done`): it waits on the pipe and the exit eventfd together, and after the exit keeps
/// reading while data is there, for up to `OUTPUT_GRACE` waiting for EOF. Then it releases the exit
/// but goes on copying until EOF, so a background child that inherited the pipe never gets SIGPIPE.
fn pump_output(proc: Arc<Proc>, stream: Stream, mut file: File) {
    let mut buf = vec![0u8; READ_BUF];
    let mut carry = Utf8Carry::default();
    let mut released = false;
    let mut deadline: Option<Instant> = None;
    let mut after_grace = 0usize;
    loop {
        if !released {
            let mut fds = [
                PollFd::new(file.as_fd(), PollFlags::POLLIN),
                PollFd::new(proc.exit_fd.as_fd(), PollFlags::POLLIN),
            ];
            // Before the exit: wait for output or the exit. After it: for output, until the deadline.
            let (n, timeout) = match deadline {
                None => (2, PollTimeout::NONE),
                Some(d) => (
                    1,
                    PollTimeout::try_from(d.saturating_duration_since(Instant::now()))
                        .unwrap_or(PollTimeout::MAX),
                ),
            };
            let r = match poll(&mut fds[..n], timeout) {
                Ok(r) => r,
                Err(Errno::EINTR) => continue,
                Err(_) => {
                    released = true;
                    proc.output_done();
                    continue;
                }
            };
            let ready = |fd: &PollFd| fd.any().unwrap_or(false);
            if deadline.is_none() && ready(&fds[1]) {
                deadline = Some(Instant::now() + OUTPUT_GRACE);
            }
            if !ready(&fds[0]) {
                if r == 0 {
                    // The grace passed with nothing left to read.
                    released = true;
                    proc.output_done();
                }
                continue;
            }
        }
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let out = carry.feed(&buf[..n]);
                proc.ring.push(stream, Bytes::from(out), now_us());
                if !released && deadline.is_some_and(|d| Instant::now() >= d) {
                    after_grace += n;
                    if after_grace >= DRAIN_AFTER_GRACE {
                        released = true;
                        proc.output_done();
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    proc.ring
        .push(stream, Bytes::from(carry.finish()), now_us());
    if !released {
        proc.output_done();
    }
}

/// Sends `sig` to the process group of `proc` (its pid: every process gets its own group).
pub fn signal_group(proc: &Proc, sig: i32) -> std::io::Result<()> {
    // SAFETY: kill has no memory-safety preconditions.
    if unsafe { libc::kill(-(proc.pid as i32), sig) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Kills the process group once `secs` pass, marking the exit as timed out.
pub fn arm_timeout(proc: Arc<Proc>, secs: f64) {
    let Ok(d) = Duration::try_from_secs_f64(secs) else {
        return;
    };
    tokio::spawn(async move {
        tokio::time::sleep(d).await;
        if proc.running() {
            proc.timed_out.store(true, Ordering::SeqCst);
            let _ = signal_group(&proc, libc::SIGKILL);
        }
    });
}

/// The raw fd of a pty master, for ioctls.
pub fn master_fd(proc: &Proc) -> Option<i32> {
    proc.master().map(|m| m.as_raw_fd())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_counter_formats() {
        let v2 = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n";
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n";
        assert_eq!(parse_oom_kills(v2), Some(1));
        assert_eq!(parse_oom_kills(v1), Some(4));
        assert_eq!(parse_oom_kills("nothing 1\n"), None);
    }

    #[test]
    fn status_decoding() {
        assert_eq!(decode_status(3 << 8).exit_code, Some(3));
        let s = decode_status(9);
        assert_eq!((s.exit_code, s.signal.as_deref()), (None, Some("SIGKILL")));
    }
}
