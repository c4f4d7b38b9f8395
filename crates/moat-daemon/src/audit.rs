//! The audit log: every API action and every command started in a sandbox, appended to the `audit`
//! table of the daemon's database (see docs/audit.md).
//!
//! Writers send entries over a bounded channel to one writer task, which inserts them in batches (one
//! transaction each); a full channel makes the sender wait, so nothing is dropped. Commands come from
//! each agent's process journal (every start and exit, numbered in order, kept until read): the daemon
//! reads a sandbox's journal after the last record it wrote while the sandbox has commands running, and
//! once more before it is deleted, and writes `command.start` and `command.exit` at the times they
//! happened. None is missed however short the command; records an agent had to drop before they were
//! read (more than its bound between two reads) are written as one `command.lost` with their count.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use moat_api::{AuditEntry, AuditQuery, JournalEvent, SandboxState};
use rusqlite::{params, params_from_iter};
use serde_json::json;
use sha2::Digest;
use tokio::sync::{mpsc, oneshot};

use crate::agent::AgentClient;
use crate::clock::{now_ms, rfc3339};
use crate::db::Db;
use crate::error::Error;
use crate::sandboxes::Lifecycle;

/// Entries waiting for the writer; a full queue makes senders wait.
const QUEUE: usize = 4096;
/// Most entries inserted in one transaction.
const BATCH: usize = 512;
/// How often sandboxes with running commands are polled.
pub const POLL_EVERY: Duration = Duration::from_secs(2);
/// How long one read of an agent's process journal may take.
const JOURNAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Records in a full page of the journal (the agent's most per read).
const JOURNAL_PAGE: usize = 1000;
/// Default and largest `limit` of a query.
pub const DEFAULT_LIMIT: u32 = 100;
pub const MAX_LIMIT: u32 = 10_000;

/// Actor of requests without a valid API key.
pub const ANONYMOUS: &str = "anonymous";
/// Actor of what the daemon observes itself (command exits).
pub const DAEMON: &str = "daemon";

/// An entry to append.
#[derive(Debug, Clone)]
pub struct NewEntry {
    pub at_ms: i64,
    pub actor: String,
    pub action: String,
    pub sandbox_id: Option<String>,
    pub status: Option<i64>,
    pub detail: serde_json::Value,
}

enum Msg {
    Entry(NewEntry),
    Flush(oneshot::Sender<()>),
}

/// The id of an API key in the log: the first 12 hex digits of its SHA-256 (never the key).
pub fn key_id(key: &str) -> String {
    hex::encode(sha2::Sha256::digest(key.as_bytes()))[..12].to_string()
}

/// A process as the poller knows it: (pid, started_at_us).
type ProcKey = (u32, u64);

/// A command started and not yet seen to end.
#[derive(Debug, Clone, Default)]
struct Open {
    cmd: Vec<String>,
    cwd: String,
    user: String,
    tag: Option<String>,
}

impl Open {
    fn of(p: &moat_api::ProcessInfo) -> Open {
        Open {
            cmd: p.cmd.clone(),
            cwd: p.cwd.clone(),
            user: p.user.clone(),
            tag: p.tag.clone(),
        }
    }
}

/// What the log has of one sandbox's commands.
#[derive(Default)]
struct Known {
    /// Read from the database (after a restart) already.
    loaded: bool,
    /// The agent run (journal epoch) and the last of its records written.
    cursor: Option<(String, u64)>,
    /// Per agent run, the last record the log already had when the daemon started.
    resume: HashMap<String, u64>,
    open: HashMap<ProcKey, Open>,
}

/// Requests refused for their key that may be written one by one: a burst of this many, then this
/// many a second; the rest are counted and written as one `auth.refused` entry every
/// [`REFUSED_SUMMARY_EVERY`].
const REFUSED_BURST: f64 = 50.0;
const REFUSED_PER_SECOND: f64 = 20.0;
const REFUSED_SUMMARY_EVERY: Duration = Duration::from_secs(10);
/// Distinct actions a summary names (the rest are counted under `other`).
const REFUSED_ACTIONS: usize = 32;

/// Refused requests beyond the rate: counted, written as one summary.
#[derive(Debug)]
struct Refused {
    tokens: f64,
    last_ms: i64,
    suppressed: u64,
    since_ms: i64,
    actions: std::collections::BTreeMap<String, u64>,
    other: u64,
}

pub struct Audit {
    db: Arc<Db>,
    tx: mpsc::Sender<Msg>,
    refused: Mutex<Refused>,
    /// Sandboxes to poll for command starts and exits.
    watched: Mutex<HashSet<String>>,
    /// Per sandbox, what the log has of its commands (one poll of a sandbox at a time).
    known: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Known>>>>,
    /// Wakes the poller early when a command was started.
    wake: tokio::sync::Notify,
}

impl Audit {
    /// Creates the log and spawns its writer task (call inside the runtime); it keeps at most
    /// `max_entries` entries (0: no cap), the oldest going first as new ones are written.
    pub fn start(db: Arc<Db>, max_entries: u64) -> Arc<Audit> {
        let (tx, rx) = mpsc::channel(QUEUE);
        tokio::spawn(writer(db.clone(), rx, max_entries));
        let audit = Arc::new(Audit {
            db,
            tx,
            refused: Mutex::new(Refused {
                tokens: REFUSED_BURST,
                last_ms: now_ms(),
                suppressed: 0,
                since_ms: 0,
                actions: Default::default(),
                other: 0,
            }),
            watched: Mutex::new(HashSet::new()),
            known: Mutex::new(HashMap::new()),
            wake: tokio::sync::Notify::new(),
        });
        let weak = Arc::downgrade(&audit);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REFUSED_SUMMARY_EVERY);
            loop {
                tick.tick().await;
                let Some(a) = weak.upgrade() else { return };
                a.write_refused_summary().await;
            }
        });
        audit
    }

    /// Records a request refused for its API key: written as it is while such requests are
    /// rare; past [`REFUSED_PER_SECOND`] (after a burst) counted and summarised, so a client
    /// without a key cannot fill the log (or the disk) or push out real entries.
    pub async fn refused(&self, e: NewEntry) {
        let write = {
            let mut r = self.refused.lock().unwrap_or_else(|p| p.into_inner());
            let elapsed = (e.at_ms - r.last_ms).max(0) as f64 / 1000.0;
            r.tokens = (r.tokens + elapsed * REFUSED_PER_SECOND).min(REFUSED_BURST);
            r.last_ms = e.at_ms.max(r.last_ms);
            if r.tokens >= 1.0 {
                r.tokens -= 1.0;
                true
            } else {
                if r.suppressed == 0 {
                    r.since_ms = e.at_ms;
                }
                r.suppressed += 1;
                if r.actions.contains_key(&e.action) || r.actions.len() < REFUSED_ACTIONS {
                    *r.actions.entry(e.action.clone()).or_default() += 1;
                } else {
                    r.other += 1;
                }
                false
            }
        };
        if write {
            self.record(e).await;
        }
    }

    /// Writes the summary of refused requests not written one by one since the last one.
    async fn write_refused_summary(&self) {
        let entry = {
            let mut r = self.refused.lock().unwrap_or_else(|p| p.into_inner());
            if r.suppressed == 0 {
                return;
            }
            let mut actions: serde_json::Map<String, serde_json::Value> =
                std::mem::take(&mut r.actions)
                    .into_iter()
                    .map(|(k, v)| (k, v.into()))
                    .collect();
            if r.other > 0 {
                actions.insert("other".into(), r.other.into());
            }
            let e = NewEntry {
                at_ms: now_ms(),
                actor: ANONYMOUS.to_string(),
                action: "auth.refused".into(),
                sandbox_id: None,
                status: Some(401),
                detail: serde_json::json!({
                    "count": r.suppressed,
                    "since": rfc3339(r.since_ms),
                    "actions": actions,
                }),
            };
            r.suppressed = 0;
            r.other = 0;
            e
        };
        self.record(entry).await;
    }

    /// Appends an entry (waits while the writer's queue is full; never drops it).
    pub async fn record(&self, e: NewEntry) {
        if let Err(mpsc::error::SendError(Msg::Entry(e))) = self.tx.send(Msg::Entry(e)).await {
            // Only when the writer is gone (the runtime is shutting down): write it here.
            let db = self.db.clone();
            let r = tokio::task::spawn_blocking(move || insert(&db, &[e], 0)).await;
            if !matches!(r, Ok(Ok(()))) {
                tracing::error!("audit: could not write an entry");
            }
        }
    }

    /// Waits until everything recorded before is in the database (a pending summary of refused
    /// requests included).
    pub async fn flush(&self) {
        self.write_refused_summary().await;
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Writes a `sandbox.ended` entry for each sandbox that ends without being asked to (its
    /// timeout, its agent lost, the OOM killer), with the reason; forever.
    pub async fn record_ends(
        self: Arc<Self>,
        mut ends: tokio::sync::broadcast::Receiver<crate::sandboxes::Ended>,
    ) {
        use tokio::sync::broadcast::error::RecvError;
        loop {
            let (id, detail) = match ends.recv().await {
                Ok(e) => (
                    Some(e.id),
                    json!({"reason": e.reason, "message": e.message}),
                ),
                Err(RecvError::Lagged(n)) => (
                    None,
                    json!({"reason": "unknown", "message": format!("{n} sandbox ends were not recorded (too many at once)")}),
                ),
                Err(RecvError::Closed) => return,
            };
            self.record(NewEntry {
                at_ms: now_ms(),
                actor: DAEMON.into(),
                action: "sandbox.ended".into(),
                sandbox_id: id,
                status: None,
                detail,
            })
            .await;
        }
    }

    /// Polls `id` for command starts and exits from now on, until it has no running command.
    pub fn watch(&self, id: &str) {
        if let Ok(mut w) = self.watched.lock() {
            w.insert(id.to_string());
        }
        self.wake.notify_one();
    }

    /// Deletes entries older than `days` days and the oldest beyond `max_entries` (0: no such bound).
    pub fn prune(&self, days: u64, max_entries: u64) -> Result<usize> {
        prune_table(&self.db, "audit", days, max_entries)
    }

    /// Prunes now and every hour.
    pub async fn retention_loop(self: Arc<Self>, days: u64, max_entries: u64) {
        retention_loop("audit", move || self.prune(days, max_entries)).await
    }

    /// Polls watched sandboxes every [`POLL_EVERY`]. At start it watches every running sandbox, so
    /// commands that ended while the daemon was down are recorded too.
    pub async fn poll_loop(self: Arc<Self>, sandboxes: Arc<Lifecycle>) {
        let running = crate::sandboxes::ListFilter {
            state: Some(SandboxState::Running),
            ..Default::default()
        };
        if let Ok(list) = sandboxes.list(&running) {
            for s in &list {
                self.watch(&s.id);
            }
        }
        let mut tick = tokio::time::interval(POLL_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                // A command was started: look soon, so short ones are seen before the agent forgets them.
                _ = self.wake.notified() => tokio::time::sleep(Duration::from_millis(250)).await,
            }
            let ids: Vec<String> = self
                .watched
                .lock()
                .map(|w| w.iter().cloned().collect())
                .unwrap_or_default();
            for id in ids {
                self.poll(&sandboxes, &id, false).await;
            }
        }
    }

    /// Writes what `id`'s agent journaled since the last record written: every start and exit, in
    /// the agent's order, at the time it happened. `last`: the sandbox is going away, so commands
    /// still running are recorded as ended by it.
    pub async fn poll(&self, sandboxes: &Lifecycle, id: &str, last: bool) {
        let agent = match sandboxes.agent_untouched(id).await {
            Ok(agent) => Some(agent),
            Err(Error::NotFound { .. }) => None,
            Err(_) if !last => return, // starting/stopping/paused: try again later
            Err(_) => None,
        };
        // One poll of a sandbox at a time (the poller's and a delete's), without holding up others.
        let entry = {
            let mut all = self.known.lock().unwrap_or_else(|p| p.into_inner());
            all.entry(id.to_string()).or_default().clone()
        };
        let mut known = entry.lock().await;
        if !known.loaded {
            *known = self.load_known(id).await;
        }
        let mut drained = false;
        if let Some(agent) = agent {
            drained = self.read_journal(&agent, id, &mut known).await;
        }
        let gone = !drained && (last || !sandboxes.exists(id));
        if !drained && !gone {
            return; // unreachable for now: the journal keeps the records until the next poll
        }
        if last || gone {
            // What is still running dies with the sandbox.
            let now = now_ms();
            for ((pid, started_at_us), p) in std::mem::take(&mut known.open) {
                let started_ms = (started_at_us / 1000) as i64;
                self.record(NewEntry {
                    at_ms: now.max(started_ms),
                    actor: DAEMON.into(),
                    action: "command.exit".into(),
                    sandbox_id: Some(id.to_string()),
                    status: None,
                    detail: json!({
                        "pid": pid, "argv": p.cmd, "cwd": p.cwd, "user": p.user, "tag": p.tag,
                        "reason": "sandbox_deleted", "signal": "SIGKILL",
                        "duration_ms": (now - started_ms).max(0), "started_at_us": started_at_us,
                    }),
                })
                .await;
            }
            drop(known);
            self.known
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(id);
            if let Ok(mut w) = self.watched.lock() {
                w.remove(id);
            }
        } else if known.open.is_empty() {
            if let Ok(mut w) = self.watched.lock() {
                w.remove(id);
            }
        }
    }

    /// Reads `id`'s journal after the cursor to its end, writing each record; whether it got to the
    /// end (false: the agent did not answer).
    async fn read_journal(&self, agent: &AgentClient, id: &str, known: &mut Known) -> bool {
        loop {
            let after = known.cursor.as_ref().map_or(0, |(_, seq)| *seq);
            let j = match tokio::time::timeout(JOURNAL_TIMEOUT, agent.journal(after)).await {
                Ok(Ok(j)) => j,
                Ok(Err(e)) => {
                    tracing::debug!(sandbox = %id, "audit: reading the process journal: {e}");
                    return false;
                }
                Err(_) => return false,
            };
            match &known.cursor {
                Some((epoch, _)) if *epoch != j.epoch => {
                    // A new agent (a reset, a restore): its journal counts from 1.
                    known.cursor = Some((j.epoch.clone(), 0));
                    continue;
                }
                None => {
                    // First read since the daemon started: go on from what the log already has.
                    let seq = known.resume.get(&j.epoch).copied().unwrap_or(0);
                    known.cursor = Some((j.epoch.clone(), seq));
                    if seq != after {
                        continue;
                    }
                }
                Some(_) => {}
            }
            if j.first_seq > after + 1 {
                let lost = j.first_seq - after - 1;
                self.record(NewEntry {
                    at_ms: now_ms(),
                    actor: DAEMON.into(),
                    action: "command.lost".into(),
                    sandbox_id: Some(id.to_string()),
                    status: None,
                    detail: json!({
                        "records": lost, "journal_epoch": j.epoch, "journal_seq": j.first_seq - 1,
                        "why": "the sandbox's agent dropped its oldest process records before they were read",
                    }),
                })
                .await;
            }
            let full = j.records.len() >= JOURNAL_PAGE;
            for r in j.records {
                self.write_record(id, &j.epoch, &r, known).await;
                known.cursor = Some((j.epoch.clone(), r.seq));
            }
            if !full {
                return true;
            }
        }
    }

    async fn write_record(
        &self,
        id: &str,
        epoch: &str,
        r: &moat_api::JournalRecord,
        known: &mut Known,
    ) {
        let p = &r.process;
        let key = (p.pid, p.started_at_us);
        let at_ms = (r.at_us / 1000) as i64;
        let started_ms = (p.started_at_us / 1000) as i64;
        let entry = match r.event {
            JournalEvent::Start => {
                known.open.insert(key, Open::of(p));
                NewEntry {
                    at_ms,
                    actor: DAEMON.into(),
                    action: "command.start".into(),
                    sandbox_id: Some(id.to_string()),
                    status: None,
                    detail: json!({
                        "pid": p.pid, "argv": p.cmd, "cwd": p.cwd, "user": p.user, "tag": p.tag,
                        "pty": p.pty, "started_at_us": p.started_at_us,
                        "journal_epoch": epoch, "journal_seq": r.seq,
                    }),
                }
            }
            JournalEvent::Exit => {
                known.open.remove(&key);
                let x = p.exit.clone().unwrap_or_default();
                NewEntry {
                    at_ms: at_ms.max(started_ms),
                    actor: DAEMON.into(),
                    action: "command.exit".into(),
                    sandbox_id: Some(id.to_string()),
                    status: x.exit_code.map(i64::from),
                    detail: json!({
                        "pid": p.pid, "argv": p.cmd, "cwd": p.cwd, "user": p.user, "tag": p.tag,
                        "exit_code": x.exit_code, "signal": x.signal, "timed_out": x.timed_out,
                        "reason": x.reason, "error": x.error,
                        "duration_ms": (at_ms - started_ms).max(0),
                        "started_at_us": p.started_at_us,
                        "journal_epoch": epoch, "journal_seq": r.seq,
                    }),
                }
            }
        };
        self.record(entry).await;
    }

    /// What the log already has of `id`'s commands (after a restart): the last journal record
    /// written per agent run, and the commands started and not yet ended.
    async fn load_known(&self, id: &str) -> Known {
        let db = self.db.clone();
        let id = id.to_string();
        let rows = tokio::task::spawn_blocking(move || {
            db.with_conn(|c| {
                let mut st = c.prepare(
                    "SELECT action, detail FROM audit
                     WHERE sandbox_id = ?1 AND action IN ('command.start', 'command.exit', 'command.lost')
                     ORDER BY id",
                )?;
                let rows = st.query_map(params![id], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
                })?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
            })
        })
        .await;
        let mut k = Known {
            loaded: true,
            ..Default::default()
        };
        for (action, detail) in rows.ok().and_then(Result::ok).unwrap_or_default() {
            let Ok(d) = serde_json::from_str::<serde_json::Value>(&detail) else {
                continue;
            };
            if let (Some(epoch), Some(seq)) =
                (d["journal_epoch"].as_str(), d["journal_seq"].as_u64())
            {
                let best = k.resume.entry(epoch.to_string()).or_default();
                *best = (*best).max(seq);
            }
            let (Some(pid), Some(at)) = (d["pid"].as_u64(), d["started_at_us"].as_u64()) else {
                continue;
            };
            let key = (pid as u32, at);
            match action.as_str() {
                "command.start" => {
                    k.open.insert(
                        key,
                        Open {
                            cmd: serde_json::from_value(d["argv"].clone()).unwrap_or_default(),
                            cwd: d["cwd"].as_str().unwrap_or_default().to_string(),
                            user: d["user"].as_str().unwrap_or_default().to_string(),
                            tag: d["tag"].as_str().map(str::to_string),
                        },
                    );
                }
                "command.exit" => {
                    k.open.remove(&key);
                }
                _ => {}
            }
        }
        k
    }

    /// Entries matching `q` (and `sandbox`, which overrides `q.sandbox`), oldest first.
    pub async fn query(
        &self,
        q: &AuditQuery,
        sandbox: Option<&str>,
    ) -> Result<Vec<AuditEntry>, Error> {
        let mut sql = String::from(
            "SELECT id, at_ms, actor, action, sandbox_id, status, detail FROM audit WHERE 1=1",
        );
        let mut args: Vec<rusqlite::types::Value> = Vec::new();
        use rusqlite::types::Value as V;
        if let Some(s) = sandbox.or(q.sandbox.as_deref()) {
            sql.push_str(" AND sandbox_id = ?");
            args.push(V::Text(s.to_string()));
        }
        if let Some(a) = &q.action {
            sql.push_str(" AND action = ?");
            args.push(V::Text(a.clone()));
        }
        if let Some(a) = &q.actor {
            sql.push_str(" AND actor = ?");
            args.push(V::Text(a.clone()));
        }
        if let Some(s) = &q.since {
            sql.push_str(" AND at_ms >= ?");
            args.push(V::Integer(parse_time("since", s)?));
        }
        if let Some(s) = &q.until {
            sql.push_str(" AND at_ms < ?");
            args.push(V::Integer(parse_time("until", s)?));
        }
        let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
        if limit == 0 || limit > MAX_LIMIT {
            return Err(Error::invalid(
                "limit",
                format!("limit must be 1..={MAX_LIMIT}, got {limit}"),
            ));
        }
        sql.push_str(" ORDER BY at_ms, id LIMIT ?");
        args.push(V::Integer(i64::from(limit)));
        // Entries recorded just before this query are visible to it.
        self.flush().await;
        let db = self.db.clone();
        let rows = tokio::task::spawn_blocking(move || {
            db.with_conn(|c| {
                let mut st = c.prepare(&sql)?;
                let rows = st.query_map(params_from_iter(&args), |r| {
                    let at_ms: i64 = r.get(1)?;
                    let detail: String = r.get(6)?;
                    Ok(AuditEntry {
                        id: r.get(0)?,
                        at_ms,
                        at: rfc3339(at_ms),
                        actor: r.get(2)?,
                        action: r.get(3)?,
                        sandbox_id: r.get(4)?,
                        status: r.get(5)?,
                        detail: serde_json::from_str(&detail).unwrap_or(serde_json::Value::Null),
                    })
                })?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
            })
        })
        .await
        .map_err(Error::internal)?;
        rows.map_err(|e| Error::internal(format!("audit query: {e:#}")))
    }
}

/// Deletes the rows of a log table (`audit`, `netlog`: columns `id`, `at_ms`) older than `days` days
/// and the oldest beyond `max_entries` (0: no such bound).
pub fn prune_table(db: &Db, table: &'static str, days: u64, max_entries: u64) -> Result<usize> {
    let age = i64::try_from(days).unwrap_or(i64::MAX);
    let cutoff = now_ms().saturating_sub(age.saturating_mul(86_400_000));
    let max = i64::try_from(max_entries).unwrap_or(i64::MAX);
    Ok(db.with_conn(|c| {
        let mut n = 0;
        if days > 0 {
            n += c.execute(&format!("DELETE FROM {table} WHERE at_ms < ?1"), params![cutoff])?;
        }
        if max_entries > 0 {
            n += c.execute(
                &format!("DELETE FROM {table} WHERE id <= (SELECT id FROM {table} ORDER BY id DESC LIMIT 1 OFFSET ?1)"),
                params![max],
            )?;
        }
        Ok(n)
    })?)
}

/// Runs `prune` now and every hour (on a blocking thread), logging what it removed.
pub async fn retention_loop(
    what: &'static str,
    prune: impl Fn() -> Result<usize> + Send + Sync + Clone + 'static,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(3600));
    loop {
        tick.tick().await;
        match tokio::task::spawn_blocking(prune.clone()).await {
            Ok(Ok(n)) if n > 0 => tracing::info!("{what}: pruned {n} entries"),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::error!("{what} prune: {e:#}"),
            Err(e) => tracing::error!("{what} prune: {e}"),
        }
    }
}

/// RFC 3339 (with `Z` or an offset; also without one, read as UTC) or Unix milliseconds → Unix
/// milliseconds.
pub fn parse_time(field: &str, s: &str) -> Result<i64, Error> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.timestamp_millis())
        .or_else(|| {
            humantime::parse_rfc3339_weak(s)
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as i64)
        })
        .ok_or_else(|| {
            Error::invalid(
                field,
                format!("{field} must be RFC 3339 (2024-05-01T12:00:00Z) or Unix milliseconds, got {s:?}"),
            )
        })
}

fn insert(db: &Db, entries: &[NewEntry], max_entries: u64) -> Result<()> {
    Ok(db.with_conn(|c| {
        let tx = c.transaction()?;
        {
            let mut st = tx.prepare_cached(
                "INSERT INTO audit (at_ms, actor, action, sandbox_id, status, detail)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )?;
            for e in entries {
                st.execute(params![
                    e.at_ms,
                    e.actor,
                    e.action,
                    e.sandbox_id,
                    e.status,
                    e.detail.to_string()
                ])?;
            }
        }
        cap(&tx, "audit", max_entries)?;
        tx.commit()
    })?)
}

/// Removes the oldest rows of a log table (ids only grow) beyond `max_entries` (0: no cap), in the
/// transaction that just inserted: the cap holds all the time, not only when retention runs.
pub fn cap(c: &rusqlite::Connection, table: &str, max_entries: u64) -> rusqlite::Result<()> {
    if max_entries == 0 {
        return Ok(());
    }
    let last = c.last_insert_rowid();
    let keep = i64::try_from(max_entries).unwrap_or(i64::MAX);
    if last > keep {
        c.execute(
            &format!("DELETE FROM {table} WHERE id <= ?1"),
            params![last - keep],
        )?;
    }
    Ok(())
}

async fn writer(db: Arc<Db>, mut rx: mpsc::Receiver<Msg>, max_entries: u64) {
    while let Some(first) = rx.recv().await {
        let mut msgs = vec![first];
        while msgs.len() < BATCH {
            match rx.try_recv() {
                Ok(m) => msgs.push(m),
                Err(_) => break,
            }
        }
        let mut entries = Vec::new();
        let mut acks = Vec::new();
        for m in msgs {
            match m {
                Msg::Entry(e) => entries.push(e),
                Msg::Flush(a) => acks.push(a),
            }
        }
        if !entries.is_empty() {
            let entries = Arc::new(entries);
            // A failed write (disk full, locked database) is retried, then reported loudly.
            for attempt in 0..5 {
                let (db, batch) = (db.clone(), entries.clone());
                match tokio::task::spawn_blocking(move || insert(&db, &batch, max_entries)).await {
                    Ok(Ok(())) => break,
                    Ok(Err(e)) if attempt < 4 => {
                        tracing::warn!("audit write failed, retrying: {e:#}");
                        tokio::time::sleep(Duration::from_millis(200 << attempt)).await;
                    }
                    Ok(Err(e)) => {
                        tracing::error!("audit: LOST {} entries: {e:#}", entries.len())
                    }
                    Err(e) => {
                        tracing::error!("audit: LOST {} entries: {e}", entries.len());
                        break;
                    }
                }
            }
        }
        for a in acks {
            let _ = a.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The journal is read to its end, each record written once in order, and a daemon that starts
    /// again goes on after the last record the log has.
    #[tokio::test]
    async fn the_process_journal_is_written_once_and_in_order() {
        let db = Arc::new(Db::open_in_memory().unwrap());
        let audit = Audit::start(db, 0);
        let fake = crate::agent::fake::FakeAgent::new();
        let f = fake.clone();
        let agent = AgentClient::new(
            "sbx_test",
            Arc::new(move || {
                let f = f.clone();
                Box::pin(async move { Ok(f.connect()) })
            }),
        );
        let start = |n: usize| moat_api::StartProcessRequest {
            cmd: Some(vec!["true".into(), n.to_string()]),
            ..Default::default()
        };
        for n in 0..3 {
            agent.run_streamed(&start(n), |_| {}).await.unwrap();
        }
        let mut known = audit.load_known("sbx_test").await;
        assert!(audit.read_journal(&agent, "sbx_test", &mut known).await);
        assert!(audit.read_journal(&agent, "sbx_test", &mut known).await);
        audit.flush().await;
        let q = AuditQuery::default();
        let all = audit.query(&q, Some("sbx_test")).await.unwrap();
        let actions: Vec<(&str, u64)> = all
            .iter()
            .map(|e| (e.action.as_str(), e.detail["journal_seq"].as_u64().unwrap()))
            .collect();
        assert_eq!(
            actions,
            [
                ("command.start", 1),
                ("command.exit", 2),
                ("command.start", 3),
                ("command.exit", 4),
                ("command.start", 5),
                ("command.exit", 6)
            ]
        );
        assert!(known.open.is_empty());
        // As after a restart: the log's own records say where to go on.
        agent.run_streamed(&start(3), |_| {}).await.unwrap();
        let mut again = audit.load_known("sbx_test").await;
        assert!(audit.read_journal(&agent, "sbx_test", &mut again).await);
        audit.flush().await;
        let all = audit.query(&q, Some("sbx_test")).await.unwrap();
        assert_eq!(all.len(), 8, "{all:#?}");
        assert_eq!(all[7].detail["journal_seq"], 8);
        assert_eq!(all[7].detail["argv"][1], "3");
    }

    #[tokio::test]
    async fn record_query_prune() {
        let db = Arc::new(Db::open_in_memory().unwrap());
        let audit = Audit::start(db, 0);
        for i in 0..5 {
            audit
                .record(NewEntry {
                    at_ms: 1000 + i,
                    actor: key_id("k"),
                    action: if i % 2 == 0 { "a" } else { "b" }.into(),
                    sandbox_id: Some(format!("s{}", i % 2)),
                    status: Some(200),
                    detail: json!({"i": i}),
                })
                .await;
        }
        let all = audit.query(&AuditQuery::default(), None).await.unwrap();
        assert_eq!(all.len(), 5);
        assert_eq!(all[0].detail["i"], 0);
        let q = AuditQuery {
            action: Some("a".into()),
            since: Some("1001".into()),
            ..Default::default()
        };
        assert_eq!(audit.query(&q, None).await.unwrap().len(), 2);
        assert_eq!(audit.query(&q, Some("s1")).await.unwrap().len(), 0);
        let bad = AuditQuery {
            since: Some("yesterday".into()),
            ..Default::default()
        };
        let e = audit.query(&bad, None).await.unwrap_err();
        assert_eq!(e.field(), Some("since"));
        assert_eq!(parse_time("t", "1970-01-01T00:00:01Z").unwrap(), 1000);
        assert_eq!(parse_time("t", "1970-01-01T01:00:01+01:00").unwrap(), 1000);
        assert_eq!(parse_time("t", "1969-12-31T23:59:59.5Z").unwrap(), -500);
        assert!(parse_time("t", "").is_err());
        // Old entries go by age, then the oldest beyond the cap.
        assert_eq!(audit.prune(100_000_000, 3).unwrap(), 2);
        assert_eq!(
            audit.query(&AuditQuery::default(), None).await.unwrap()[0].at_ms,
            1002
        );
        assert_eq!(audit.prune(0, 0).unwrap(), 0);
        assert_eq!(audit.prune(1, 100).unwrap(), 3);
        assert_eq!(key_id("k").len(), 12);
    }

    fn entry(at_ms: i64, action: &str) -> NewEntry {
        NewEntry {
            at_ms,
            actor: ANONYMOUS.into(),
            action: action.into(),
            sandbox_id: None,
            status: Some(401),
            detail: json!({}),
        }
    }

    #[tokio::test]
    async fn refused_requests_are_rate_limited_and_summarised() {
        let db = Arc::new(Db::open_in_memory().unwrap());
        let audit = Audit::start(db, 0);
        let t = now_ms();
        // A flood of key-less requests within one second.
        for i in 0..1000 {
            let action = if i % 2 == 0 {
                "GET /v1/sandboxes"
            } else {
                "POST /v1/sandboxes"
            };
            audit.refused(entry(t + i / 1000, action)).await;
        }
        audit.flush().await;
        let all = audit
            .query(
                &AuditQuery {
                    limit: Some(MAX_LIMIT),
                    ..Default::default()
                },
                None,
            )
            .await
            .unwrap();
        let one_by_one = all.iter().filter(|e| e.action != "auth.refused").count();
        assert_eq!(one_by_one, REFUSED_BURST as usize);
        let summary = all.iter().find(|e| e.action == "auth.refused").unwrap();
        assert_eq!(summary.detail["count"], 1000 - REFUSED_BURST as u64);
        assert_eq!(summary.status, Some(401));
        let actions = summary.detail["actions"].as_object().unwrap();
        assert_eq!(actions.len(), 2);
        // The rate comes back: a second later, refused requests are written one by one again.
        audit.refused(entry(t + 2000, "GET /v1/templates")).await;
        audit.flush().await;
        let last = audit
            .query(&AuditQuery::default(), None)
            .await
            .unwrap()
            .into_iter()
            .last()
            .unwrap();
        assert_eq!(last.action, "GET /v1/templates");
    }

    #[tokio::test]
    async fn the_cap_holds_as_entries_are_written() {
        let db = Arc::new(Db::open_in_memory().unwrap());
        let audit = Audit::start(db, 10);
        for i in 0..25 {
            audit.record(entry(i, &format!("a{i}"))).await;
        }
        audit.flush().await;
        let all = audit.query(&AuditQuery::default(), None).await.unwrap();
        assert_eq!(all.len(), 10);
        assert_eq!(all[0].action, "a15");
        assert_eq!(all[9].action, "a24");
    }
}
