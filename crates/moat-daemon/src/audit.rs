//! The audit log: every API action and every command started in a sandbox, appended to the `audit`
//! table of the daemon's database (see docs/audit.md).
//!
//! Writers send entries over a bounded channel to one writer task, which inserts them in batches (one
//! transaction each); a full channel makes the sender wait, so nothing is dropped. Commands are
//! observed by polling the agents of sandboxes that started commands: a process seen for the first time
//! is recorded as `command.start` (at its start time), an exited one as `command.exit`.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use moat_api::{AuditEntry, AuditQuery, SandboxState};
use rusqlite::{params, params_from_iter};
use serde_json::json;
use sha2::Digest;
use tokio::sync::{mpsc, oneshot};

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

#[derive(Default)]
struct Known {
    started: HashSet<ProcKey>,
    exited: HashSet<ProcKey>,
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
    /// Per sandbox, the processes already recorded.
    known: tokio::sync::Mutex<HashMap<String, Known>>,
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
            known: tokio::sync::Mutex::new(HashMap::new()),
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

    /// Records what changed in `id`'s processes since the last poll. `last`: the sandbox is going away,
    /// so commands still running are recorded as ended by it.
    pub async fn poll(&self, sandboxes: &Lifecycle, id: &str, last: bool) {
        // Ask the agent first, without holding the lock: one slow sandbox must not hold up the others.
        let list = match sandboxes.agent_untouched(id).await {
            Ok(agent) => {
                match tokio::time::timeout(Duration::from_secs(5), agent.processes()).await {
                    Ok(Ok(l)) => Some(l.processes),
                    Ok(Err(e)) => {
                        tracing::debug!(sandbox = %id, "audit poll: {e}");
                        None
                    }
                    Err(_) => None,
                }
            }
            Err(Error::NotFound { .. }) => None,
            Err(_) if !last => return, // starting/stopping: try again later
            Err(_) => None,
        };
        let mut known_all = self.known.lock().await;
        if !known_all.contains_key(id) {
            let k = self.load_known(id).await;
            known_all.insert(id.to_string(), k);
        }
        let Some(known) = known_all.get_mut(id) else {
            return;
        };
        let gone = list.is_none() && (last || !sandboxes.exists(id));
        if list.is_none() && !gone {
            return;
        }
        let now = now_ms();
        let mut running = false;
        for p in list.unwrap_or_default() {
            let key = (p.pid, p.started_at_us);
            let started_ms = (p.started_at_us / 1000) as i64;
            if known.started.insert(key) {
                self.record(NewEntry {
                    at_ms: started_ms,
                    actor: DAEMON.into(),
                    action: "command.start".into(),
                    sandbox_id: Some(id.to_string()),
                    status: None,
                    detail: json!({
                        "pid": p.pid, "argv": p.cmd, "cwd": p.cwd, "user": p.user, "tag": p.tag,
                        "pty": p.pty, "started_at_us": p.started_at_us,
                    }),
                })
                .await;
            }
            if known.exited.contains(&key) {
                continue;
            }
            match (&p.exit, p.running) {
                (Some(x), false) => {
                    known.exited.insert(key);
                    self.record(NewEntry {
                        at_ms: now.max(started_ms),
                        actor: DAEMON.into(),
                        action: "command.exit".into(),
                        sandbox_id: Some(id.to_string()),
                        status: x.exit_code.map(i64::from),
                        detail: json!({
                            "pid": p.pid, "argv": p.cmd, "cwd": p.cwd, "user": p.user, "tag": p.tag,
                            "exit_code": x.exit_code, "signal": x.signal, "timed_out": x.timed_out,
                            "reason": x.reason, "error": x.error,
                            "duration_ms": (now - started_ms).max(0),
                            "started_at_us": p.started_at_us,
                        }),
                    })
                    .await;
                }
                _ => running = true,
            }
        }
        if last || gone {
            // What is still running dies with the sandbox; what the agent forgot ended unseen.
            let open: Vec<ProcKey> = known.started.difference(&known.exited).copied().collect();
            for (pid, started_at_us) in open {
                let started_ms = (started_at_us / 1000) as i64;
                self.record(NewEntry {
                    at_ms: now.max(started_ms),
                    actor: DAEMON.into(),
                    action: "command.exit".into(),
                    sandbox_id: Some(id.to_string()),
                    status: None,
                    detail: json!({
                        "pid": pid, "reason": "sandbox_deleted", "signal": "SIGKILL",
                        "duration_ms": (now - started_ms).max(0), "started_at_us": started_at_us,
                    }),
                })
                .await;
            }
            known_all.remove(id);
            if let Ok(mut w) = self.watched.lock() {
                w.remove(id);
            }
        } else if !running {
            if let Ok(mut w) = self.watched.lock() {
                w.remove(id);
            }
        }
    }

    /// The processes of `id` already in the log (after a restart).
    async fn load_known(&self, id: &str) -> Known {
        let db = self.db.clone();
        let id = id.to_string();
        let rows = tokio::task::spawn_blocking(move || {
            db.with_conn(|c| {
                let mut st = c.prepare(
                    "SELECT action, json_extract(detail, '$.pid'), json_extract(detail, '$.started_at_us')
                     FROM audit WHERE sandbox_id = ?1 AND action IN ('command.start', 'command.exit')",
                )?;
                let rows = st.query_map(params![id], |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        r.get::<_, Option<i64>>(1)?,
                        r.get::<_, Option<i64>>(2)?,
                    ))
                })?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
            })
        })
        .await;
        let mut k = Known::default();
        if let Ok(Ok(rows)) = rows {
            for (action, pid, at) in rows {
                let (Some(pid), Some(at)) = (pid, at) else {
                    continue;
                };
                let key = (pid as u32, at as u64);
                if action == "command.start" {
                    k.started.insert(key);
                } else {
                    k.exited.insert(key);
                }
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
                let rows = st.query_map(params_from_iter(args), |r| {
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

/// RFC 3339 or Unix milliseconds → Unix milliseconds.
pub fn parse_time(field: &str, s: &str) -> Result<i64, Error> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    humantime::parse_rfc3339_weak(s)
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as i64)
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
