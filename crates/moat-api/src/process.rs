//! Processes inside a sandbox: start, stream, re-attach, stdin, signals, PTY.
//!
//! A process is addressed by its pid (inside the sandbox) or by the tag given at start; in a path the
//! selector `{process}` is a decimal pid or a tag (tags may not be all digits).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /v1/sandboxes/{id}/processes`
///
/// Exactly one of `cmd` (argv, no shell) or `command` (a shell string run with `/bin/bash -c`, or
/// `/bin/sh -c` where bash is missing) must be given.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StartProcessRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Working directory; the user's home directory when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Extra environment, on top of the sandbox's environment.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// A user name from the sandbox's /etc/passwd, or a numeric uid; `root` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Seconds after which the process group is killed (exit reports `timed_out`); none when absent or 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    /// Keep stdin open for `.../stdin`; otherwise stdin is /dev/null.
    #[serde(default)]
    pub stdin: bool,
    /// Name to address the process by, unique among running processes; not all digits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Run on a pseudo-terminal of this size (stdout and stderr merge into `pty` events).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pty: Option<PtySize>,
    /// Answer at once with the process info instead of streaming its events.
    #[serde(default)]
    pub background: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

/// How a process ended.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExitStatus {
    /// Exit code when the process exited normally.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// Signal name (e.g. `SIGKILL`) when a signal ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
    /// True when the process was killed because its `timeout` passed.
    #[serde(default)]
    pub timed_out: bool,
    /// Set when the process could not be started (e.g. the program does not exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why the process ended when it was not its own doing: `oom` (killed by the kernel's OOM killer
    /// because the sandbox reached its memory limit) or `timeout` (its `timeout` passed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A chunk of output. `data` holds it when it is valid UTF-8 (split characters are carried to the next
/// chunk), `data_b64` (standard base64) otherwise.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct OutputChunk {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_b64: Option<String>,
    /// When the agent read it, microseconds since the Unix epoch.
    pub timestamp_us: u64,
}

/// One line of a process event stream (`application/x-ndjson`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProcessEvent {
    /// First event: the process runs with this pid.
    Start {
        pid: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tag: Option<String>,
    },
    Stdout(OutputChunk),
    Stderr(OutputChunk),
    /// Output of a process on a PTY.
    Pty(OutputChunk),
    /// Output bytes that were dropped from the bounded buffer before this reader saw them.
    Dropped {
        bytes: u64,
    },
    /// Last event.
    Exit(ExitStatus),
    /// Last event instead of `exit`: the stream broke before the process's end was known (the
    /// sandbox's agent died, or the sandbox ended); the message says what happened.
    Error {
        message: String,
    },
}

/// A process as `GET .../processes` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub pid: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// argv as executed.
    pub cmd: Vec<String>,
    /// The variables its start request set (not those it inherited from the sandbox).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    pub cwd: String,
    pub user: String,
    pub pty: bool,
    pub stdin_open: bool,
    pub running: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit: Option<ExitStatus>,
    /// Microseconds since the Unix epoch.
    pub started_at_us: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// What a record of the agent's process journal says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalEvent {
    Start,
    Exit,
}

/// One record of the agent's process journal: a process started or exited. `process` is the process
/// as it was then (at an exit, with its `exit`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournalRecord {
    /// 1, 2, 3, ... in the order the agent saw the events; never reused while the agent runs.
    pub seq: u64,
    pub event: JournalEvent,
    /// When it happened, microseconds since the Unix epoch.
    pub at_us: u64,
    pub process: ProcessInfo,
}

/// Query of the agent's `GET /journal`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalQuery {
    /// Only records with a greater `seq` (0 or absent: from the oldest kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// At most this many records (default and largest 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// Answer of the agent's `GET /journal`: every process start and exit, in order, without gaps. The
/// agent keeps the newest records only (bounded in number and bytes); a reader that fell behind sees
/// `first_seq` beyond the one it asked for, and knows how many it lost.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessJournal {
    /// Names this agent's run: `seq` counts anew when it changes (a new agent).
    pub epoch: String,
    /// The oldest record still kept (`next_seq` when there is none).
    pub first_seq: u64,
    /// The `seq` the next record will get.
    pub next_seq: u64,
    pub records: Vec<JournalRecord>,
}

/// Query of `GET .../processes/{process}/events` (re-attach).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct AttachQuery {
    /// Replay the output kept since the start (default true); false streams only new output.
    #[serde(default)]
    pub replay: Option<bool>,
}

/// `POST .../processes/{process}/signal`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalRequest {
    /// `SIGTERM`, `TERM` or a number such as `15`.
    pub signal: String,
}

/// `POST .../processes/{process}/resize`
pub type ResizeRequest = PtySize;

/// Agent-internal `POST /env`: variables merged into the environment of processes started from now on.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvUpdate {
    pub env: BTreeMap<String, String>,
}

/// Agent-internal `POST /config`: per-sandbox limits the agent applies to processes it starts from now
/// on. Absent fields are left as they are.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// RLIMIT_NOFILE (soft and hard) of every started process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nofile: Option<u64>,
    /// Size of each process's output buffer, in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_bytes: Option<u64>,
    /// Timeout in seconds of a process whose request gives none; 0 means none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_timeout: Option<f64>,
    /// File whose `oom_kill N` line counts the sandbox's OOM kills (read to tell an OOM kill from
    /// another SIGKILL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_counter: Option<String>,
    /// RLIMIT_NPROC (soft and hard) of every started process: the process limit where the sandbox's
    /// processes are not host processes a cgroup could count (the gvisor tier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nproc: Option<u64>,
    /// User of a process whose request names none (root when never set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Working directory of a process whose request names none (the user's home when never set or
    /// missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Who the sandbox is, told at every start (a fork or a restore included: docs/snapshots.md,
    /// "Fork safety").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<SandboxIdentity>,
    /// The sandbox's egress certificate authority (PEM), for its trust stores: the proxy answers
    /// with certificates it signs when it carries the sandbox's secrets (docs/secrets.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_ca: Option<String>,
}

/// The identity the agent gives its sandbox: what must differ between two forks of one snapshot.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxIdentity {
    /// `MOAT_SANDBOX_ID` of processes started from now on.
    pub sandbox_id: String,
    /// The hostname (set where the agent may: a microVM's guest; elsewhere the tier sets it).
    pub hostname: String,
    /// 32 lowercase hex digits for /etc/machine-id (and /var/lib/dbus/machine-id when present).
    pub machine_id: String,
    /// Base64 of random bytes from the host, mixed into the guest kernel's entropy pool, which is
    /// then reseeded (a restored VM's pool is a copy of its snapshot's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entropy: Option<String>,
    /// This sandbox continues another's processes (a full-state restore): /run/moat/forked is
    /// written for long-lived programs to reseed; otherwise a stale one is removed.
    #[serde(default)]
    pub forked: bool,
}

/// A process selector from a path segment: digits are a pid, anything else a tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessSelector {
    Pid(u32),
    Tag(String),
}

impl ProcessSelector {
    pub fn parse(s: &str) -> Result<ProcessSelector, String> {
        if s.is_empty() {
            return Err("process selector is empty".into());
        }
        if s.bytes().all(|b| b.is_ascii_digit()) {
            s.parse::<u32>()
                .map(ProcessSelector::Pid)
                .map_err(|_| format!("pid {s} is out of range"))
        } else {
            validate_tag(s)?;
            Ok(ProcessSelector::Tag(s.to_string()))
        }
    }
}

impl std::fmt::Display for ProcessSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessSelector::Pid(p) => write!(f, "{p}"),
            ProcessSelector::Tag(t) => write!(f, "{t}"),
        }
    }
}

/// Tags: 1–64 characters of `[A-Za-z0-9._-]`, not all digits.
pub fn validate_tag(tag: &str) -> Result<(), String> {
    if tag.is_empty() || tag.len() > 64 {
        return Err("tag must be 1 to 64 characters".into());
    }
    if !tag
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err("tag may hold only letters, digits, '.', '_' and '-'".into());
    }
    if tag.bytes().all(|b| b.is_ascii_digit()) {
        return Err("tag may not be all digits (digits address a pid)".into());
    }
    Ok(())
}

/// Parses `SIGTERM`, `TERM`, `term` or `15` into a signal number.
pub fn parse_signal(s: &str) -> Result<i32, String> {
    let t = s.trim();
    if let Ok(n) = t.parse::<i32>() {
        return if (1..=64).contains(&n) {
            Ok(n)
        } else {
            Err(format!("signal number {n} is out of range 1..64"))
        };
    }
    let upper = t.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, num)| *num)
        .ok_or_else(|| format!("unknown signal {s:?}"))
}

/// Name of a signal number, `SIG` prefixed (`SIG37` for ones without a name).
pub fn signal_name(num: i32) -> String {
    SIGNALS
        .iter()
        .find(|(_, n)| *n == num)
        .map(|(name, _)| format!("SIG{name}"))
        .unwrap_or_else(|| format!("SIG{num}"))
}

/// x86_64 Linux signal numbers.
const SIGNALS: &[(&str, i32)] = &[
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ILL", 4),
    ("TRAP", 5),
    ("ABRT", 6),
    ("BUS", 7),
    ("FPE", 8),
    ("KILL", 9),
    ("USR1", 10),
    ("SEGV", 11),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("STKFLT", 16),
    ("CHLD", 17),
    ("CONT", 18),
    ("STOP", 19),
    ("TSTP", 20),
    ("TTIN", 21),
    ("TTOU", 22),
    ("URG", 23),
    ("XCPU", 24),
    ("XFSZ", 25),
    ("VTALRM", 26),
    ("PROF", 27),
    ("WINCH", 28),
    ("IO", 29),
    ("PWR", 30),
    ("SYS", 31),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors() {
        assert_eq!(
            ProcessSelector::parse("42").unwrap(),
            ProcessSelector::Pid(42)
        );
        assert_eq!(
            ProcessSelector::parse("web-1").unwrap(),
            ProcessSelector::Tag("web-1".into())
        );
        assert!(ProcessSelector::parse("").is_err());
        assert!(ProcessSelector::parse("a/b").is_err());
        assert!(ProcessSelector::parse("99999999999").is_err());
    }

    #[test]
    fn signals() {
        assert_eq!(parse_signal("SIGTERM").unwrap(), 15);
        assert_eq!(parse_signal("kill").unwrap(), 9);
        assert_eq!(parse_signal("2").unwrap(), 2);
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("SIGFOO").is_err());
        assert_eq!(signal_name(9), "SIGKILL");
        assert_eq!(signal_name(40), "SIG40");
    }

    #[test]
    fn event_wire_format() {
        let ev = ProcessEvent::Stdout(OutputChunk {
            data: Some("hi\n".into()),
            data_b64: None,
            timestamp_us: 7,
        });
        assert_eq!(
            serde_json::to_string(&ev).unwrap(),
            r#"{"type":"stdout","data":"hi\n","timestamp_us":7}"#
        );
        let exit: ProcessEvent = serde_json::from_str(r#"{"type":"exit","exit_code":3}"#).unwrap();
        assert_eq!(
            exit,
            ProcessEvent::Exit(ExitStatus {
                exit_code: Some(3),
                ..Default::default()
            })
        );
    }
}
