//! A running build's event log: kept in memory for whoever follows it, written to
//! `<data_dir>/builds/<id>/events.ndjson` for later, bounded; and the lines of a step's output.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use moat_api::BuildEvent;

/// Bytes of step output one build's log keeps (step events are always kept).
const MAX_LOG_BYTES: usize = 16 << 20;
/// Lines of a failed step's output its error shows.
const TAIL_LINES: usize = 30;

/// A running build: its events so far (for followers) and its cancellation.
pub struct LiveBuild {
    pub id: String,
    pub template: String,
    /// Event lines so far, and whether the build has ended.
    pub(super) state: std::sync::Mutex<(Vec<Bytes>, bool)>,
    pub(super) logged: AtomicUsize,
    pub(super) truncated: AtomicBool,
    pub(super) changed: tokio::sync::Notify,
    pub(super) cancel: tokio_util::sync::CancellationToken,
    pub(super) file: std::sync::Mutex<Option<std::fs::File>>,
}

impl LiveBuild {
    pub(super) fn emit(&self, ev: &BuildEvent) {
        let mut line = serde_json::to_vec(ev).unwrap_or_default();
        line.push(b'\n');
        if matches!(ev, BuildEvent::Log { .. }) {
            let total = self.logged.fetch_add(line.len(), Ordering::Relaxed) + line.len();
            if total > MAX_LOG_BYTES {
                if !self.truncated.swap(true, Ordering::Relaxed) {
                    self.emit(&BuildEvent::Log {
                        line: format!(
                            "[moat] the build log passed {} MiB; further output lines are not kept",
                            MAX_LOG_BYTES >> 20
                        ),
                        step: None,
                    });
                }
                return;
            }
        }
        if let Ok(mut f) = self.file.lock() {
            if let Some(f) = f.as_mut() {
                use std::io::Write;
                let _ = f.write_all(&line);
            }
        }
        if let Ok(mut s) = self.state.lock() {
            s.0.push(Bytes::from(line));
        }
        self.changed.notify_waiters();
    }

    pub(super) fn log(&self, step: u32, line: impl Into<String>) {
        self.emit(&BuildEvent::Log {
            line: line.into(),
            step: Some(step),
        });
    }

    pub(super) fn finish(&self) {
        if let Ok(mut s) = self.state.lock() {
            s.1 = true;
        }
        self.changed.notify_waiters();
    }

    /// Sends every event so far, then each new one, until the build ends or `tx` closes.
    pub async fn follow(self: Arc<Self>, tx: tokio::sync::mpsc::Sender<Bytes>) {
        let mut pos = 0;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let (batch, done) = match self.state.lock() {
                Ok(s) => (s.0[pos.min(s.0.len())..].to_vec(), s.1),
                Err(_) => return,
            };
            pos += batch.len();
            for b in batch {
                if tx.send(b).await.is_err() {
                    return;
                }
            }
            if done {
                // Lines pushed before `done` was set were in the batch just sent.
                return;
            }
            notified.await;
        }
    }
}

/// The last lines of a step's output, assembled from its chunks.
#[derive(Default)]
pub(super) struct Lines {
    partial: [Vec<u8>; 2],
    tail: std::collections::VecDeque<String>,
}

impl Lines {
    /// Feeds a chunk of stream `s` (0 stdout, 1 stderr); calls `out` with each complete line.
    pub(super) fn push(&mut self, s: usize, data: &[u8], out: &mut impl FnMut(String)) {
        self.partial[s].extend_from_slice(data);
        while let Some(i) = self.partial[s].iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial[s].drain(..=i).collect();
            let text = String::from_utf8_lossy(&line[..i])
                .trim_end_matches('\r')
                .to_string();
            self.keep(&text);
            out(text);
        }
        // A line without an end that keeps growing is cut (a progress bar redrawn with \r).
        if self.partial[s].len() > 8192 {
            let text = String::from_utf8_lossy(&self.partial[s]).into_owned();
            self.partial[s].clear();
            self.keep(&text);
            out(text);
        }
    }

    pub(super) fn flush(&mut self, out: &mut impl FnMut(String)) {
        for s in 0..2 {
            if !self.partial[s].is_empty() {
                let text = String::from_utf8_lossy(&self.partial[s]).into_owned();
                self.partial[s].clear();
                self.keep(&text);
                out(text);
            }
        }
    }

    fn keep(&mut self, line: &str) {
        if self.tail.len() == TAIL_LINES {
            self.tail.pop_front();
        }
        self.tail.push_back(line.to_string());
    }

    pub(super) fn tail(&self) -> String {
        self.tail.iter().cloned().collect::<Vec<_>>().join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_split_and_keep_a_tail() {
        let mut l = Lines::default();
        let mut got = Vec::new();
        l.push(0, b"one\ntw", &mut |s| got.push(s));
        l.push(1, b"err\r\n", &mut |s| got.push(s));
        l.push(0, b"o\n", &mut |s| got.push(s));
        l.push(0, b"last", &mut |s| got.push(s));
        l.flush(&mut |s| got.push(s));
        assert_eq!(got, vec!["one", "err", "two", "last"]);
        for i in 0..100 {
            l.push(0, format!("{i}\n").as_bytes(), &mut |_| {});
        }
        assert_eq!(l.tail().lines().count(), TAIL_LINES);
        assert!(l.tail().ends_with("99"));
    }

    #[tokio::test]
    async fn followers_get_every_event_then_the_end() {
        let live = Arc::new(LiveBuild {
            id: "bld_x".into(),
            template: "t".into(),
            state: std::sync::Mutex::new((Vec::new(), false)),
            logged: AtomicUsize::new(0),
            truncated: AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
            cancel: tokio_util::sync::CancellationToken::new(),
            file: std::sync::Mutex::new(None),
        });
        live.log(1, "before");
        let (tx, mut rx) = tokio::sync::mpsc::channel(16);
        let f = tokio::spawn(live.clone().follow(tx));
        live.log(1, "after");
        live.finish();
        f.await.unwrap();
        let mut got = Vec::new();
        while let Some(b) = rx.recv().await {
            got.push(String::from_utf8(b.to_vec()).unwrap());
        }
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].contains("before") && got[1].contains("after"));
    }
}
