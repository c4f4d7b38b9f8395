//! The bounded, ordered output buffer of one process and the readers (event streams) attached to it.
//!
//! Rule: with at least one reader attached, the writer (the pipe reader thread) waits while the
//! slowest attached reader is more than `cap` bytes behind — a slow client slows the process down.
//! With no reader attached the oldest chunks are dropped to stay within `cap`. A reader whose cursor
//! points before the oldest retained chunk gets `Dropped` and continues from the oldest one.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use base64::Engine;
use bytes::Bytes;
use moat_api::{ExitStatus, OutputChunk, ProcessEvent};
use tokio::sync::watch;

/// Which output a chunk came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
    Pty,
}

/// One read of output.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub stream: Stream,
    pub data: Bytes,
    pub timestamp_us: u64,
    /// Offset of the chunk's first byte in the process's logical output stream.
    start: u64,
}

impl Chunk {
    /// The event this chunk is sent as.
    pub fn to_event(&self) -> ProcessEvent {
        let mut out = OutputChunk {
            data: None,
            data_b64: None,
            timestamp_us: self.timestamp_us,
        };
        match std::str::from_utf8(&self.data) {
            Ok(s) => out.data = Some(s.to_string()),
            Err(_) => {
                out.data_b64 = Some(base64::engine::general_purpose::STANDARD.encode(&self.data))
            }
        }
        match self.stream {
            Stream::Stdout => ProcessEvent::Stdout(out),
            Stream::Stderr => ProcessEvent::Stderr(out),
            Stream::Pty => ProcessEvent::Pty(out),
        }
    }
}

#[derive(Default)]
struct State {
    chunks: VecDeque<Chunk>,
    /// Bytes held in `chunks`.
    size: usize,
    /// Offset of the oldest retained byte.
    start: u64,
    /// Offset one past the newest byte.
    end: u64,
    /// Cursor of every attached reader.
    readers: HashMap<u64, u64>,
    next_reader: u64,
    exit: Option<ExitStatus>,
    /// `end` when the exit was recorded: readers get the exit once they have read up to here. Output
    /// that comes later (a background child still writing) stays in the ring for a replaying
    /// re-attach but never holds a live stream's exit back.
    exit_at: u64,
}

impl State {
    /// Where a live stream's output ends: the exit offset once there is one, else the newest byte.
    fn stream_end(&self) -> u64 {
        if self.exit.is_some() {
            self.exit_at
        } else {
            self.end
        }
    }

    /// The cursor of the slowest reader that still has output to read (before the exit, if any).
    fn min_cursor(&self) -> Option<u64> {
        let end = self.stream_end();
        self.readers.values().copied().filter(|c| *c < end).min()
    }
}

/// What a reader gets next.
#[derive(Debug, Clone)]
pub enum Item {
    Chunk(Chunk),
    Dropped(u64),
    Exit(ExitStatus),
}

pub struct Ring {
    cap: usize,
    state: Mutex<State>,
    /// Signalled when a reader advances or detaches (the writer may be waiting for room).
    room: Condvar,
    /// Bumped on every push and on exit (readers wait on it).
    changed: watch::Sender<u64>,
}

impl Ring {
    pub fn new(cap: usize) -> Arc<Ring> {
        Arc::new(Ring {
            cap: cap.max(1),
            state: Mutex::new(State::default()),
            room: Condvar::new(),
            changed: watch::Sender::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends a chunk, blocking (this is called from a plain thread) while an attached reader is too
    /// far behind.
    pub fn push(&self, stream: Stream, data: Bytes, timestamp_us: u64) {
        if data.is_empty() {
            return;
        }
        let len = data.len() as u64;
        let mut st = self.lock();
        loop {
            match st.min_cursor() {
                Some(min) if st.end + len - min > self.cap as u64 => {
                    st = self.room.wait(st).unwrap_or_else(|p| p.into_inner());
                }
                _ => break,
            }
        }
        let start = st.end;
        st.chunks.push_back(Chunk {
            stream,
            data,
            timestamp_us,
            start,
        });
        st.end += len;
        st.size += len as usize;
        let min = st.min_cursor();
        while st.size > self.cap {
            let Some(front) = st.chunks.front() else {
                break;
            };
            let front_end = front.start + front.data.len() as u64;
            if min.is_some_and(|m| m < front_end) {
                break;
            }
            st.size -= front.data.len();
            st.chunks.pop_front();
            st.start = front_end;
        }
        drop(st);
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Records how the process ended; readers send it after the remaining output.
    pub fn finish(&self, status: ExitStatus) {
        let mut st = self.lock();
        if st.exit.is_none() {
            st.exit = Some(status);
            st.exit_at = st.end;
        }
        drop(st);
        self.room.notify_all();
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// Attaches a reader: with `replay` from the very start (so it learns about dropped bytes),
    /// otherwise from the current end.
    pub fn attach(self: &Arc<Self>, replay: bool) -> Reader {
        let mut st = self.lock();
        let id = st.next_reader;
        st.next_reader += 1;
        let cursor = if replay { 0 } else { st.end };
        st.readers.insert(id, cursor);
        drop(st);
        Reader {
            ring: Arc::clone(self),
            id,
            rx: self.changed.subscribe(),
        }
    }
}

/// An attached reader; detaches on drop.
pub struct Reader {
    ring: Arc<Ring>,
    id: u64,
    rx: watch::Receiver<u64>,
}

impl Reader {
    /// Returns what is available now, if anything.
    fn try_next(&mut self) -> Option<Item> {
        let mut st = self.ring.lock();
        let cursor = st.readers.get(&self.id).copied().unwrap_or(st.end);
        if cursor < st.start {
            let start = st.start;
            st.readers.insert(self.id, start);
            return Some(Item::Dropped(start - cursor));
        }
        if cursor < st.stream_end() {
            let idx = st
                .chunks
                .partition_point(|c| c.start + c.data.len() as u64 <= cursor);
            let chunk = st.chunks.get(idx).cloned()?;
            st.readers
                .insert(self.id, chunk.start + chunk.data.len() as u64);
            drop(st);
            self.ring.room.notify_all();
            return Some(Item::Chunk(chunk));
        }
        // Caught up: the exit if there is one, else nothing yet.
        st.exit.clone().map(Item::Exit)
    }

    /// The next item, waiting for output; after `Exit` the reader is done.
    pub async fn next(&mut self) -> Item {
        loop {
            self.rx.borrow_and_update();
            if let Some(item) = self.try_next() {
                return item;
            }
            if self.rx.changed().await.is_err() {
                // Cannot happen while the ring is alive (we hold an Arc to it); end cleanly anyway.
                return Item::Exit(ExitStatus {
                    error: Some("output buffer closed".into()),
                    ..Default::default()
                });
            }
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut st = self.ring.lock();
        st.readers.remove(&self.id);
        drop(st);
        self.ring.room.notify_all();
    }
}

/// Holds back an incomplete trailing UTF-8 sequence so that characters are not split across chunks.
#[derive(Default)]
pub struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    /// Returns the bytes to emit now for `data` read after the previous call.
    pub fn feed(&mut self, data: &[u8]) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.pending);
        buf.extend_from_slice(data);
        if let Err(e) = std::str::from_utf8(&buf) {
            if e.error_len().is_none() {
                let tail = buf.split_off(e.valid_up_to());
                if tail.len() <= 3 {
                    self.pending = tail;
                } else {
                    buf.extend_from_slice(&tail);
                }
            }
        }
        buf
    }

    /// Whatever is still held back (at end of stream).
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn data_of(item: Item) -> Vec<u8> {
        match item {
            Item::Chunk(c) => c.data.to_vec(),
            other => panic!("expected chunk, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn drops_oldest_without_readers() {
        let ring = Ring::new(10);
        ring.push(Stream::Stdout, Bytes::from_static(b"aaaa"), 1);
        ring.push(Stream::Stdout, Bytes::from_static(b"bbbb"), 2);
        ring.push(Stream::Stderr, Bytes::from_static(b"cccc"), 3);
        ring.finish(ExitStatus::default());
        let mut r = ring.attach(true);
        assert!(matches!(r.next().await, Item::Dropped(4)));
        assert_eq!(data_of(r.next().await), b"bbbb");
        let c = r.next().await;
        assert!(matches!(&c, Item::Chunk(c) if c.stream == Stream::Stderr));
        assert!(matches!(r.next().await, Item::Exit(_)));
    }

    #[tokio::test]
    async fn exit_comes_after_earlier_output_not_after_later_output() {
        let ring = Ring::new(8);
        let mut live = ring.attach(true);
        ring.push(Stream::Stdout, Bytes::from_static(b"before"), 1);
        ring.finish(ExitStatus::default());
        // A background child goes on writing far past the ring's size: the reader still gets all
        // the output from before the exit, then the exit, and the writer is not held back after.
        let w = Arc::clone(&ring);
        let writer = std::thread::spawn(move || {
            for _ in 0..100 {
                w.push(Stream::Stdout, Bytes::from_static(b"later"), 2);
            }
        });
        assert_eq!(data_of(live.next().await), b"before");
        assert!(matches!(live.next().await, Item::Exit(_)));
        writer.join().expect("writer");
        // A live attach after the exit ends at once; a replaying one learns what was dropped.
        assert!(matches!(ring.attach(false).next().await, Item::Exit(_)));
        let mut replay = ring.attach(true);
        assert!(matches!(replay.next().await, Item::Dropped(_)));
        assert!(matches!(replay.next().await, Item::Exit(_)));
    }

    #[tokio::test]
    async fn no_replay_sees_only_new_output() {
        let ring = Ring::new(100);
        ring.push(Stream::Stdout, Bytes::from_static(b"old"), 1);
        let mut r = ring.attach(false);
        ring.push(Stream::Stdout, Bytes::from_static(b"new"), 2);
        assert_eq!(data_of(r.next().await), b"new");
    }

    #[tokio::test]
    async fn slow_reader_applies_backpressure() {
        let ring = Ring::new(8);
        let mut r = ring.attach(true);
        let w = Arc::clone(&ring);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for i in 0..6u8 {
                w.push(Stream::Stdout, Bytes::from(vec![b'a' + i; 4]), 0);
                let _ = done_tx.send(i);
            }
        });
        // The writer can get 2 chunks (8 bytes) ahead of the reader, then must wait.
        std::thread::sleep(Duration::from_millis(100));
        let pushed: Vec<u8> = done_rx.try_iter().collect();
        assert_eq!(pushed, vec![0, 1]);
        // Reading everything unblocks it, and nothing is dropped.
        for i in 0..6u8 {
            assert_eq!(data_of(r.next().await), vec![b'a' + i; 4]);
        }
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(2)).ok(), Some(2));
    }

    #[tokio::test]
    async fn detaching_reader_releases_writer() {
        let ring = Ring::new(4);
        let r = ring.attach(true);
        ring.push(Stream::Stdout, Bytes::from_static(b"1234"), 0);
        let w = Arc::clone(&ring);
        let t = std::thread::spawn(move || w.push(Stream::Stdout, Bytes::from_static(b"5678"), 0));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished());
        drop(r);
        assert!(t.join().is_ok());
        let mut r2 = ring.attach(true);
        assert!(matches!(r2.next().await, Item::Dropped(4)));
        assert_eq!(data_of(r2.next().await), b"5678");
    }

    #[test]
    fn utf8_carry_keeps_characters_whole() {
        let mut c = Utf8Carry::default();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(c.feed(&[b'a', euro[0], euro[1]]), b"a");
        assert_eq!(c.feed(&[euro[2], b'b']), "€b".as_bytes());
        assert!(c.finish().is_empty());
        // Invalid bytes pass through untouched (sent as base64 later).
        assert_eq!(c.feed(&[0xff, b'x']), vec![0xff, b'x']);
        // An incomplete sequence at end of stream is flushed by finish.
        assert!(c.feed(&euro[..1]).is_empty());
        assert_eq!(c.finish(), euro[..1].to_vec());
    }

    #[test]
    fn chunk_encoding() {
        let c = Chunk {
            stream: Stream::Stdout,
            data: Bytes::from_static(b"hi"),
            timestamp_us: 5,
            start: 0,
        };
        assert!(matches!(c.to_event(), ProcessEvent::Stdout(o) if o.data.as_deref() == Some("hi")));
        let c = Chunk {
            stream: Stream::Pty,
            data: Bytes::from_static(&[0xff]),
            timestamp_us: 5,
            start: 0,
        };
        assert!(
            matches!(c.to_event(), ProcessEvent::Pty(o) if o.data_b64.as_deref() == Some("/w=="))
        );
    }
}
