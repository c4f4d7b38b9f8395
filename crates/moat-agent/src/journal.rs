//! The process journal: every process start and exit, numbered in the order they happened, kept
//! (the newest, bounded) until the daemon has read them. The daemon's audit log reads it after the
//! last record it wrote, so no start or exit is missed however short the command or however long
//! between two reads; a reader that fell behind the bound learns how many records it lost.

use std::collections::VecDeque;
use std::sync::Mutex;

use moat_api::{JournalEvent, JournalQuery, JournalRecord, ProcessInfo, ProcessJournal};

/// Most records kept.
const MAX_RECORDS: usize = 16_384;
/// Most bytes of argv, cwd, user and tag kept over all records.
const MAX_BYTES: usize = 16 << 20;
/// Most records in one answer.
pub const MAX_READ: usize = 1000;

pub struct Journal {
    epoch: String,
    inner: Mutex<Inner>,
}

struct Inner {
    records: VecDeque<(JournalRecord, usize)>,
    bytes: usize,
    next_seq: u64,
}

fn size_of(p: &ProcessInfo) -> usize {
    p.cmd.iter().map(String::len).sum::<usize>()
        + p.cwd.len()
        + p.user.len()
        + p.tag.as_ref().map_or(0, String::len)
        + 64
}

impl Journal {
    /// A journal for an agent run that `epoch` names.
    pub fn new(epoch: String) -> Journal {
        Journal {
            epoch,
            inner: Mutex::new(Inner {
                records: VecDeque::new(),
                bytes: 0,
                next_seq: 1,
            }),
        }
    }

    /// Appends a record; the oldest go when the bounds are passed.
    pub fn push(&self, event: JournalEvent, at_us: u64, mut process: ProcessInfo) {
        // The journal feeds the audit log: a process's variables (a token passed to one command)
        // stay out of it.
        process.env.clear();
        let mut j = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let size = size_of(&process);
        let seq = j.next_seq;
        j.next_seq += 1;
        j.bytes += size;
        j.records.push_back((
            JournalRecord {
                seq,
                event,
                at_us,
                process,
            },
            size,
        ));
        while j.records.len() > MAX_RECORDS || (j.bytes > MAX_BYTES && j.records.len() > 1) {
            if let Some((_, s)) = j.records.pop_front() {
                j.bytes -= s;
            }
        }
    }

    /// The records after `q.after`, oldest first.
    pub fn read(&self, q: &JournalQuery) -> ProcessJournal {
        let j = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let after = q.after.unwrap_or(0);
        let limit = q
            .limit
            .map_or(MAX_READ, |l| (l as usize).clamp(1, MAX_READ));
        let first_seq = j.records.front().map_or(j.next_seq, |(r, _)| r.seq);
        // Records are numbered without gaps, so the one after `after` sits at a known index.
        let skip = (after + 1).saturating_sub(first_seq) as usize;
        ProcessJournal {
            epoch: self.epoch.clone(),
            first_seq,
            next_seq: j.next_seq,
            records: j
                .records
                .iter()
                .skip(skip)
                .take(limit)
                .map(|(r, _)| r.clone())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(pid: u32, argv_len: usize) -> ProcessInfo {
        ProcessInfo {
            pid,
            tag: None,
            cmd: vec!["x".repeat(argv_len)],
            env: Default::default(),
            cwd: "/".into(),
            user: "root".into(),
            pty: false,
            stdin_open: false,
            running: true,
            exit: None,
            started_at_us: u64::from(pid),
        }
    }

    fn read(j: &Journal, after: u64) -> ProcessJournal {
        j.read(&JournalQuery {
            after: Some(after),
            limit: None,
        })
    }

    #[test]
    fn records_come_in_order_after_the_cursor() {
        let j = Journal::new("e".into());
        for pid in 1..=5 {
            j.push(JournalEvent::Start, 0, info(pid, 1));
            j.push(JournalEvent::Exit, 0, info(pid, 1));
        }
        let all = read(&j, 0);
        assert_eq!((all.first_seq, all.next_seq), (1, 11));
        let seqs: Vec<u64> = all.records.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, (1..=10).collect::<Vec<_>>());
        assert_eq!(all.records[1].event, JournalEvent::Exit);
        let rest = read(&j, 7);
        assert_eq!(
            rest.records.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![8, 9, 10]
        );
        assert!(read(&j, 10).records.is_empty());
        assert!(read(&j, 99).records.is_empty());
        let some = j.read(&JournalQuery {
            after: Some(2),
            limit: Some(2),
        });
        assert_eq!(
            some.records.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![3, 4]
        );
    }

    #[test]
    fn the_oldest_go_and_a_reader_sees_how_many() {
        let j = Journal::new("e".into());
        for pid in 0..(MAX_RECORDS as u32 + 10) {
            j.push(JournalEvent::Start, 0, info(pid, 1));
        }
        let r = read(&j, 0);
        assert_eq!(r.first_seq, 11, "10 records went");
        assert_eq!(r.records.len(), MAX_READ);
        assert_eq!(r.records[0].seq, 11);
        // Bytes bound too: a few huge argvs push out the rest.
        let j = Journal::new("e".into());
        for pid in 0..4 {
            j.push(JournalEvent::Start, 0, info(pid, MAX_BYTES / 3));
        }
        let r = read(&j, 0);
        assert!(r.first_seq > 1 && r.records.len() < 4, "{}", r.first_seq);
    }
}
