//! The connection log: every TCP connection (through the proxy) and DNS question of every sandbox,
//! with the decision and the rule that made it, in the `netlog` table of the daemon's database. One
//! writer task inserts batches; followers of a sandbox's log get each entry as it is stored. Refused
//! (and, in audit mode, would-be-refused) attempts also go to the audit log. See docs/network.md.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use moat_api::{
    parse_destination, Destination, NetDecision, NetworkLogEntry, NetworkLogQuery, NetworkPolicy,
    NetworkProposal, ObservedDestination, GROUPS,
};
use rusqlite::{params, params_from_iter};
use tokio::sync::{broadcast, mpsc};

use crate::audit::{Audit, NewEntry, DAEMON};
use crate::clock::rfc3339;
use crate::db::Db;
use crate::error::Error;
use crate::host::egress::Event;

const QUEUE: usize = 4096;
const BATCH: usize = 512;
pub const DEFAULT_LIMIT: u32 = 100;
pub const MAX_LIMIT: u32 = 10_000;
/// Entries a proposal is made from (the newest).
const PROPOSAL_ENTRIES: u32 = 100_000;

pub struct NetLog {
    db: Arc<Db>,
    /// Most entries kept (0: no cap); the oldest go as new ones are written.
    max_entries: u64,
    live: broadcast::Sender<NetworkLogEntry>,
}

impl NetLog {
    /// Creates the log; returns it and the sender the proxy and resolver log through.
    pub fn start(
        db: Arc<Db>,
        audit: Arc<Audit>,
        max_entries: u64,
    ) -> (Arc<NetLog>, mpsc::Sender<Event>) {
        let (tx, rx) = mpsc::channel(QUEUE);
        let (live, _) = broadcast::channel(1024);
        let log = Arc::new(NetLog {
            db,
            max_entries,
            live,
        });
        tokio::spawn(log.clone().writer(rx, audit));
        (log, tx)
    }

    async fn writer(self: Arc<Self>, mut rx: mpsc::Receiver<Event>, audit: Arc<Audit>) {
        let mut batch = Vec::with_capacity(BATCH);
        while rx.recv_many(&mut batch, BATCH).await > 0 {
            let events = std::mem::take(&mut batch);
            let (db, max) = (self.db.clone(), self.max_entries);
            let stored = tokio::task::spawn_blocking(move || insert(&db, &events, max)).await;
            let stored = match stored {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::error!("connection log: {e:#}");
                    continue;
                }
                Err(e) => {
                    tracing::error!("connection log: {e}");
                    continue;
                }
            };
            for e in stored {
                if e.decision != NetDecision::Allow {
                    audit
                        .record(NewEntry {
                            at_ms: e.at_ms,
                            actor: DAEMON.into(),
                            action: format!("network.{}", e.decision.as_str()),
                            sandbox_id: Some(e.sandbox_id.clone()),
                            status: None,
                            detail: serde_json::to_value(&e).unwrap_or_default(),
                        })
                        .await;
                }
                let _ = self.live.send(e);
            }
        }
    }

    /// New entries as they are stored (subscribe before querying what is stored, then skip ids seen).
    pub fn subscribe(&self) -> broadcast::Receiver<NetworkLogEntry> {
        self.live.subscribe()
    }

    /// Entries of a sandbox (or of every sandbox of a template) matching `q`, oldest first.
    pub async fn query(
        &self,
        sandbox: Option<&str>,
        template: Option<&str>,
        q: &NetworkLogQuery,
        newest: bool,
    ) -> Result<Vec<NetworkLogEntry>, Error> {
        use rusqlite::types::Value as V;
        let mut sql = String::from(
            "SELECT id, at_ms, sandbox_id, protocol, dst_ip, dst_port, name, name_source, decision, \
             rule, dialed, bytes_out, bytes_in, duration_ms, error FROM netlog WHERE 1=1",
        );
        let mut args: Vec<V> = Vec::new();
        if let Some(s) = sandbox {
            sql.push_str(" AND sandbox_id = ?");
            args.push(V::Text(s.into()));
        }
        if let Some(t) = template {
            sql.push_str(" AND template = ?");
            args.push(V::Text(t.into()));
        }
        if let Some(a) = q.after {
            sql.push_str(" AND id > ?");
            args.push(V::Integer(a));
        }
        if let Some(d) = q.decision {
            sql.push_str(" AND decision = ?");
            args.push(V::Text(d.as_str().into()));
        }
        let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
        if limit == 0 || (limit > MAX_LIMIT && !newest) {
            return Err(Error::invalid(
                "limit",
                format!("limit must be 1..={MAX_LIMIT}, got {limit}"),
            ));
        }
        sql.push_str(if newest {
            " ORDER BY id DESC LIMIT ?"
        } else {
            " ORDER BY id LIMIT ?"
        });
        args.push(V::Integer(i64::from(limit)));
        let db = self.db.clone();
        let rows = tokio::task::spawn_blocking(move || {
            db.with_conn(|c| {
                let mut st = c.prepare(&sql)?;
                let rows = st.query_map(params_from_iter(&args), row)?;
                rows.collect::<rusqlite::Result<Vec<_>>>()
            })
        })
        .await
        .map_err(Error::internal)?
        .map_err(|e| Error::internal(format!("connection log query: {e:#}")))?;
        Ok(rows)
    }

    /// The tightest policy that allows what a sandbox (or a template's sandboxes) did.
    pub async fn proposal(
        &self,
        sandbox: Option<&str>,
        template: Option<&str>,
    ) -> Result<NetworkProposal, Error> {
        let q = NetworkLogQuery {
            limit: Some(PROPOSAL_ENTRIES),
            ..Default::default()
        };
        let entries = self.query(sandbox, template, &q, true).await?;
        Ok(propose(&entries))
    }

    /// Deletes entries older than `days` days and the oldest beyond `max_entries` (0: no bound).
    pub fn prune(&self, days: u64, max_entries: u64) -> Result<usize> {
        crate::audit::prune_table(&self.db, "netlog", days, max_entries)
    }

    /// Prunes now and every hour.
    pub async fn retention_loop(self: Arc<Self>, days: u64, max_entries: u64) {
        crate::audit::retention_loop("connection log", move || self.prune(days, max_entries)).await
    }
}

fn row(r: &rusqlite::Row) -> rusqlite::Result<NetworkLogEntry> {
    let at_ms: i64 = r.get(1)?;
    let decision: String = r.get(8)?;
    Ok(NetworkLogEntry {
        id: r.get(0)?,
        at_ms,
        at: rfc3339(at_ms),
        sandbox_id: r.get(2)?,
        protocol: r.get(3)?,
        dst_ip: r.get(4)?,
        dst_port: r.get(5)?,
        name: r.get(6)?,
        name_source: r.get(7)?,
        decision: match decision.as_str() {
            "allow" => NetDecision::Allow,
            "audit" => NetDecision::Audit,
            _ => NetDecision::Deny,
        },
        rule: r.get(9)?,
        dialed: r.get(10)?,
        bytes_out: r.get::<_, i64>(11)? as u64,
        bytes_in: r.get::<_, i64>(12)? as u64,
        duration_ms: r.get::<_, i64>(13)? as u64,
        error: r.get(14)?,
    })
}

/// Inserts events in one transaction; returns them as stored (with their ids).
fn insert(db: &Db, events: &[Event], max_entries: u64) -> Result<Vec<NetworkLogEntry>> {
    Ok(db.with_conn(|c| {
        let tx = c.transaction()?;
        let mut out = Vec::with_capacity(events.len());
        {
            let mut st = tx.prepare_cached(
                "INSERT INTO netlog (at_ms, sandbox_id, template, protocol, dst_ip, dst_port, name, \
                 name_source, decision, rule, dialed, bytes_out, bytes_in, duration_ms, error) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
            )?;
            for e in events {
                let dst_ip = e.dst.map(|d| d.ip().to_string());
                let dst_port = e.dst.map(|d| d.port());
                let dialed = e.dialed.map(|d| d.to_string());
                st.execute(params![
                    e.at_ms,
                    e.sandbox_id,
                    e.template,
                    e.protocol,
                    dst_ip,
                    dst_port,
                    e.name,
                    e.name_source,
                    e.decision.as_str(),
                    e.rule,
                    dialed,
                    e.bytes_out as i64,
                    e.bytes_in as i64,
                    e.duration_ms as i64,
                    e.error,
                ])?;
                out.push(NetworkLogEntry {
                    id: tx.last_insert_rowid(),
                    at_ms: e.at_ms,
                    at: rfc3339(e.at_ms),
                    sandbox_id: e.sandbox_id.clone(),
                    protocol: e.protocol.to_string(),
                    dst_ip,
                    dst_port,
                    name: e.name.clone(),
                    name_source: e.name_source.clone(),
                    decision: e.decision,
                    rule: e.rule.clone(),
                    dialed,
                    bytes_out: e.bytes_out,
                    bytes_in: e.bytes_in,
                    duration_ms: e.duration_ms,
                    error: e.error.clone(),
                });
            }
        }
        crate::audit::cap(&tx, "netlog", max_entries)?;
        tx.commit()?;
        Ok(out)
    })?)
}

/// The tightest policy allowing every attempt in `entries`: internet off, and in `allow_out` a group
/// for names a group covers, the name itself otherwise, and the address (a /32) of connections that
/// carried no name. Attempts the daemon refuses whatever the policy (always blocked, deny list) are
/// left out: no policy could allow them.
pub fn propose(entries: &[NetworkLogEntry]) -> NetworkProposal {
    let mut seen: BTreeMap<String, (u64, std::collections::BTreeSet<String>)> = BTreeMap::new();
    let groups: Vec<(String, Destination)> = GROUPS
        .iter()
        .filter_map(|(g, _)| {
            let e = format!("@{g}");
            parse_destination(&e).ok().map(|d| (e, d))
        })
        .collect();
    for e in entries {
        // What no policy can allow: always blocked, the deny list, and names that lead there.
        if ["always blocked", "deny list"]
            .iter()
            .any(|r| e.rule == *r || e.rule == format!("rebinding ({r})"))
        {
            continue;
        }
        let (entry, covers) = match (&e.name, &e.dst_ip) {
            (Some(n), _) => {
                let g = groups.iter().find(|(_, d)| d.matches_name(n));
                (g.map_or(n.clone(), |(g, _)| g.clone()), n.clone())
            }
            (None, Some(ip)) => (ip.clone(), format!("{ip}:{}", e.dst_port.unwrap_or(0))),
            (None, None) => continue,
        };
        let s = seen.entry(entry).or_default();
        s.0 += 1;
        s.1.insert(covers);
    }
    let observed: Vec<ObservedDestination> = seen
        .into_iter()
        .map(|(entry, (count, covers))| ObservedDestination {
            entry,
            count,
            covers: covers.into_iter().collect(),
        })
        .collect();
    NetworkProposal {
        policy: NetworkPolicy {
            allow_internet: false,
            allow_out: observed.iter().map(|o| o.entry.clone()).collect(),
            ..Default::default()
        },
        observed,
        entries: entries.len() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: Option<&str>, ip: Option<&str>, rule: &str) -> NetworkLogEntry {
        NetworkLogEntry {
            id: 1,
            at_ms: 0,
            at: String::new(),
            sandbox_id: "sbx".into(),
            protocol: if ip.is_some() { "tcp" } else { "dns" }.into(),
            dst_ip: ip.map(str::to_string),
            dst_port: ip.map(|_| 443),
            name: name.map(str::to_string),
            name_source: None,
            decision: NetDecision::Audit,
            rule: rule.into(),
            dialed: None,
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: 0,
            error: None,
        }
    }

    #[test]
    fn proposal_groups_names_and_keeps_bare_addresses() {
        let p = propose(&[
            entry(Some("pypi.org"), None, "allow_internet"),
            entry(
                Some("files.pythonhosted.org"),
                Some("203.0.113.1"),
                "allow_internet",
            ),
            entry(
                Some("api.example.com"),
                Some("203.0.113.2"),
                "allow_internet",
            ),
            entry(Some("api.example.com"), None, "allow_internet"),
            entry(None, Some("198.51.100.7"), "allow_internet: false"),
            entry(None, Some("169.254.169.254"), "always blocked"),
            entry(Some("bad.example"), None, "deny list"),
        ]);
        assert_eq!(
            p.policy.allow_out,
            ["198.51.100.7", "@pypi", "api.example.com"]
        );
        assert!(!p.policy.allow_internet);
        assert_eq!(p.entries, 7);
        let pypi = p.observed.iter().find(|o| o.entry == "@pypi").unwrap();
        assert_eq!(pypi.count, 2);
        assert_eq!(pypi.covers, ["files.pythonhosted.org", "pypi.org"]);
        // The proposal is a valid policy.
        for e in &p.policy.allow_out {
            parse_destination(e).unwrap();
        }
    }

    #[test]
    fn stored_and_queried() {
        let db = Arc::new(Db::open_in_memory().unwrap());
        let ev = Event {
            at_ms: 1_700_000_000_000,
            sandbox_id: "sbx_a".into(),
            template: "base".into(),
            protocol: "tcp",
            dst: Some("198.51.100.1:443".parse().unwrap()),
            name: Some("test.example".into()),
            name_source: Some("sni".into()),
            decision: NetDecision::Deny,
            rule: "deny_out[0]".into(),
            dialed: None,
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: 3,
            error: None,
        };
        let stored = insert(
            &db,
            &[
                ev.clone(),
                Event {
                    sandbox_id: "sbx_b".into(),
                    ..ev
                },
            ],
            0,
        )
        .unwrap();
        assert_eq!(stored.len(), 2);
        assert!(stored[1].id > stored[0].id);
        let rows = db
            .with_conn(|c| {
                let mut st = c.prepare(
                    "SELECT id, at_ms, sandbox_id, protocol, dst_ip, dst_port, name, name_source, decision, \
                     rule, dialed, bytes_out, bytes_in, duration_ms, error FROM netlog WHERE sandbox_id = 'sbx_a'",
                )?;
                let r = st.query_map([], row)?.collect::<rusqlite::Result<Vec<_>>>()?;
                Ok(r)
            })
            .unwrap();
        assert_eq!(rows, vec![stored[0].clone()]);
        assert_eq!(rows[0].dst_port, Some(443));
        assert_eq!(rows[0].decision, NetDecision::Deny);
    }
}
