//! The machine description and the markdown report.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::peers::version;
use crate::stats::{fmt_ms, summarize};

/// Whether a row ran.
#[derive(Debug, Clone, PartialEq)]
pub enum RowStatus {
    Ok,
    NotInstalled(String),
    Failed(String),
}

/// One line of a results table.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    pub isolation: String,
    pub status: RowStatus,
    pub samples: Vec<Duration>,
    /// Compared with the scenario's reference row (moat); false for sub-measurements.
    pub ratio: bool,
}

impl Row {
    pub fn new(name: impl Into<String>, isolation: impl Into<String>) -> Row {
        Row {
            name: name.into(),
            isolation: isolation.into(),
            status: RowStatus::Ok,
            samples: Vec::new(),
            ratio: true,
        }
    }

    pub fn ok(&self) -> bool {
        self.status == RowStatus::Ok
    }

    pub fn fail(&mut self, why: impl Into<String>) {
        self.status = RowStatus::Failed(why.into());
    }
}

/// A markdown table of `rows`; ratios are medians over the median of `rows[reference]`.
pub fn table(rows: &[Row], reference: usize) -> String {
    let ref_median = rows
        .get(reference)
        .and_then(|r| summarize(&r.samples))
        .map(|s| s.median);
    let mut out = String::new();
    out.push_str("| row | median ms | p95 ms | min ms | runs | × moat (median) | isolation |\n");
    out.push_str("|---|---:|---:|---:|---:|---:|---|\n");
    for row in rows {
        let summary = summarize(&row.samples);
        let (median, p95, min, runs) = match (&row.status, summary) {
            (RowStatus::Ok, Some(s)) => (fmt_ms(s.median), fmt_ms(s.p95), fmt_ms(s.min), s.runs),
            (RowStatus::NotInstalled(why), _) => {
                (format!("not installed ({why})"), "".into(), "".into(), 0)
            }
            (RowStatus::Failed(why), _) => (
                format!("failed: {why}"),
                "".into(),
                "".into(),
                row.samples.len(),
            ),
            (RowStatus::Ok, None) => ("no samples".into(), "".into(), "".into(), 0),
        };
        let ratio = match (row.ratio && row.ok(), summary, ref_median) {
            (true, Some(s), Some(r)) if !r.is_zero() => {
                format!("{:.2}×", s.median.as_secs_f64() / r.as_secs_f64())
            }
            _ => "—".into(),
        };
        let _ = writeln!(
            out,
            "| {} | {median} | {p95} | {min} | {runs} | {ratio} | {} |",
            row.name, row.isolation
        );
    }
    out
}

/// One scenario's part of the report: a heading, what it measures, its tables, or why it failed.
#[derive(Debug, Clone, Default)]
pub struct Section {
    pub title: String,
    pub intro: String,
    pub body: String,
    /// The scenario stopped with this error (the bench then fails).
    pub failed: Option<String>,
}

impl Section {
    pub fn new(title: impl Into<String>, intro: impl Into<String>) -> Section {
        Section {
            title: title.into(),
            intro: intro.into(),
            ..Section::default()
        }
    }

    /// Appends markdown (a table, a note) to the body, separated by a blank line.
    pub fn push(&mut self, md: impl AsRef<str>) {
        if !self.body.is_empty() && !self.body.ends_with("\n\n") {
            self.body.push('\n');
        }
        self.body.push_str(md.as_ref());
        if !self.body.ends_with('\n') {
            self.body.push('\n');
        }
    }

    pub fn markdown(&self) -> String {
        let mut md = format!("## {}\n\n", self.title);
        if !self.intro.is_empty() {
            md.push_str(&self.intro);
            md.push_str("\n\n");
        }
        if let Some(e) = &self.failed {
            let _ = writeln!(md, "**The scenario failed:** {e}\n");
        }
        md.push_str(&self.body);
        md
    }
}

/// A markdown table: `cols` are (header, right-aligned); every row has one cell per column.
pub fn grid(cols: &[(&str, bool)], rows: &[Vec<String>]) -> String {
    let mut out = String::from("|");
    for (h, _) in cols {
        let _ = write!(out, " {h} |");
    }
    out.push_str("\n|");
    for (_, right) in cols {
        out.push_str(if *right { "---:|" } else { "---|" });
    }
    out.push('\n');
    for row in rows {
        out.push('|');
        for cell in row {
            let _ = write!(out, " {} |", cell.replace('|', "/"));
        }
        out.push('\n');
    }
    out
}

/// A table cell for a row that did not run.
pub fn status_cell(status: &RowStatus) -> Option<String> {
    match status {
        RowStatus::Ok => None,
        RowStatus::NotInstalled(why) => Some(format!("not installed ({why})")),
        RowStatus::Failed(why) => Some(format!("failed: {why}")),
    }
}

/// `YYYY-MM-DD`, `HH:MM:SS` of a Unix time, in UTC.
pub fn utc(t: SystemTime) -> (String, String) {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    (
        format!("{y:04}-{m:02}-{d:02}"),
        format!("{:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60),
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn field(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn git(workspace: &Path, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("git")
        .arg("-C")
        .arg(workspace)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A bullet list describing the machine and the tools' versions.
pub fn machine(workspace: &Path, moat_version: &str) -> String {
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = field(&cpuinfo, "model name").unwrap_or_else(|| "unknown".into());
    let nproc = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem = field(&read("/proc/meminfo"), "MemTotal")
        .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .map_or("unknown".into(), |kib| {
            format!("{:.1} GiB", kib as f64 / 1024.0 / 1024.0)
        });
    let cgroup = if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        "v2 (unified)"
    } else if Path::new("/sys/fs/cgroup/memory").exists() {
        "v1 (hybrid)"
    } else {
        "unknown"
    };
    let os = read("/etc/os-release")
        .lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map_or_else(|| "unknown".into(), |v| v.trim_matches('"').to_string());
    let rev = git(workspace, &["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty = git(workspace, &["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
    let mut out = String::new();
    let _ = writeln!(out, "- OS: {os}, kernel `{kernel}`, cgroup {cgroup}");
    let _ = writeln!(out, "- CPU: {cpu}, {nproc} cores (nproc); memory {mem}");
    let _ = writeln!(
        out,
        "- moat {moat_version} (git {rev}{}), release build",
        if dirty { ", uncommitted changes" } else { "" }
    );
    let _ = writeln!(out, "- bubblewrap: {}", version("bwrap", "--version"));
    let _ = writeln!(out, "- runsc: {}", version("runsc", "--version"));
    let _ = writeln!(out, "- runc: {}", version("runc", "--version"));
    let _ = writeln!(
        out,
        "- podman: {} (OCI runtime {}); conmon: {}",
        version("podman", "--version"),
        crate::peers::PODMAN_RUNTIME,
        version("conmon", "--version")
    );
    let _ = writeln!(
        out,
        "- util-linux (unshare, nsenter): {}",
        version("unshare", "--version")
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(utc(t), ("2023-11-14".into(), "22:13:20".into()));
    }

    #[test]
    fn table_ratios_and_states() {
        let ms = Duration::from_millis;
        let mut moat = Row::new("moat", "x");
        moat.samples = vec![ms(10), ms(10), ms(10)];
        let mut peer = Row::new("peer", "y");
        peer.samples = vec![ms(5), ms(5), ms(5)];
        let mut sub = Row::new("sub", "z");
        sub.samples = vec![ms(1)];
        sub.ratio = false;
        let mut missing = Row::new("gone", "w");
        missing.status = RowStatus::NotInstalled("apt-get install -y gone".into());
        let t = table(&[moat, peer, sub, missing], 0);
        assert!(
            t.contains("| moat | 10.00 | 10.00 | 10.00 | 3 | 1.00× | x |"),
            "{t}"
        );
        assert!(
            t.contains("| peer | 5.00 | 5.00 | 5.00 | 3 | 0.50× | y |"),
            "{t}"
        );
        assert!(
            t.contains("| sub | 1.00 | 1.00 | 1.00 | 1 | — | z |"),
            "{t}"
        );
        assert!(t.contains("not installed (apt-get install -y gone)"), "{t}");
    }

    #[test]
    fn grids_and_sections() {
        let g = grid(
            &[("tool", false), ("MiB", true)],
            &[vec!["a|b".into(), "1.0".into()]],
        );
        assert_eq!(g, "| tool | MiB |\n|---|---:|\n| a/b | 1.0 |\n");
        let mut s = Section::new("1. X", "what");
        s.push("t1");
        s.push("t2\n");
        assert_eq!(s.markdown(), "## 1. X\n\nwhat\n\nt1\n\nt2\n");
    }
}
