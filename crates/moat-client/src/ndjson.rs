//! Incremental NDJSON decoding: one JSON value per line, lines may split across chunks.

use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// A stream of decoded items (process events, build events, fs events).
pub type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T>> + Send>>;

/// A stream of raw bytes (file contents, tar archives).
pub type ByteStream = Pin<Box<dyn Stream<Item = Result<Bytes>> + Send>>;

/// Splits a byte stream into lines without buffering more than one partial line.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: BytesMut,
    /// How far `buf` has been searched for a newline already.
    scanned: usize,
}

impl LineSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk of input.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line (without its `\n` or `\r\n`), if one is buffered.
    pub fn next_line(&mut self) -> Option<Bytes> {
        let pos = self.buf[self.scanned..].iter().position(|&b| b == b'\n');
        match pos {
            Some(i) => {
                let mut line = self.buf.split_to(self.scanned + i + 1);
                self.scanned = 0;
                line.truncate(line.len() - 1);
                if line.last() == Some(&b'\r') {
                    line.truncate(line.len() - 1);
                }
                Some(line.freeze())
            }
            None => {
                self.scanned = self.buf.len();
                None
            }
        }
    }

    /// The unterminated rest at the end of input, if it is not empty.
    pub fn finish(&mut self) -> Option<Bytes> {
        self.scanned = 0;
        if self.buf.is_empty() {
            None
        } else {
            Some(self.buf.split().freeze())
        }
    }
}

fn decode_line<T: DeserializeOwned>(line: &[u8]) -> Option<Result<T>> {
    if line.iter().all(|b| b.is_ascii_whitespace()) {
        return None;
    }
    Some(serde_json::from_slice(line).map_err(|e| {
        Error::Decode(format!(
            "bad event line {:?}: {e}",
            String::from_utf8_lossy(&line[..line.len().min(200)])
        ))
    }))
}

/// Decodes an NDJSON byte stream into items as lines arrive. Ends after the first error.
pub fn decode<T, S, E>(bytes: S) -> EventStream<T>
where
    T: DeserializeOwned + Send + 'static,
    S: Stream<Item = std::result::Result<Bytes, E>> + Send + 'static,
    E: Into<Error>,
{
    struct State<S> {
        input: Pin<Box<S>>,
        lines: LineSplitter,
        done: bool,
    }
    let state = State {
        input: Box::pin(bytes),
        lines: LineSplitter::new(),
        done: false,
    };
    Box::pin(futures::stream::unfold(state, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            while let Some(line) = st.lines.next_line() {
                if let Some(item) = decode_line::<T>(&line) {
                    st.done = item.is_err();
                    return Some((item, st));
                }
            }
            match st.input.next().await {
                Some(Ok(chunk)) => st.lines.push(&chunk),
                Some(Err(e)) => {
                    st.done = true;
                    return Some((Err(e.into()), st));
                }
                None => {
                    st.done = true;
                    if let Some(rest) = st.lines.finish() {
                        if let Some(item) = decode_line::<T>(&rest) {
                            return Some((item, st));
                        }
                    }
                    return None;
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_lines_across_chunks() {
        let mut s = LineSplitter::new();
        s.push(b"{\"a\":");
        assert_eq!(s.next_line(), None);
        s.push(b"1}\n{\"b\"");
        assert_eq!(s.next_line().as_deref(), Some(&b"{\"a\":1}"[..]));
        assert_eq!(s.next_line(), None);
        s.push(b":2}\r\n\n{\"c\":3}");
        assert_eq!(s.next_line().as_deref(), Some(&b"{\"b\":2}"[..]));
        assert_eq!(s.next_line().as_deref(), Some(&b""[..]));
        assert_eq!(s.next_line(), None);
        assert_eq!(s.finish().as_deref(), Some(&b"{\"c\":3}"[..]));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn many_lines_in_one_chunk() {
        let mut s = LineSplitter::new();
        s.push(b"a\nb\nc\n");
        let lines: Vec<_> = std::iter::from_fn(|| s.next_line()).collect();
        assert_eq!(lines, vec![&b"a"[..], &b"b"[..], &b"c"[..]]);
        assert_eq!(s.finish(), None);
    }

    #[tokio::test]
    async fn decodes_events_byte_by_byte() {
        let text = b"{\"type\":\"start\",\"pid\":7}\n\n{\"type\":\"stdout\",\"data\":\"hi\\n\",\"timestamp_us\":1}\n{\"type\":\"exit\",\"exit_code\":0}";
        let chunks: Vec<std::result::Result<Bytes, Error>> = text
            .iter()
            .map(|b| Ok(Bytes::copy_from_slice(&[*b])))
            .collect();
        let events: Vec<moat_api::ProcessEvent> = decode(futures::stream::iter(chunks))
            .map(|r| r.expect("decodes"))
            .collect()
            .await;
        assert_eq!(events.len(), 3);
        assert_eq!(
            events[0],
            moat_api::ProcessEvent::Start { pid: 7, tag: None }
        );
        assert!(matches!(events[2], moat_api::ProcessEvent::Exit(ref s) if s.exit_code == Some(0)));
    }

    #[tokio::test]
    async fn bad_line_is_an_error_and_ends() {
        let chunks: Vec<std::result::Result<Bytes, Error>> =
            vec![Ok(Bytes::from_static(b"nope\n{\"type\":\"exit\"}\n"))];
        let items: Vec<Result<moat_api::ProcessEvent>> =
            decode(futures::stream::iter(chunks)).collect().await;
        assert_eq!(items.len(), 1);
        assert!(matches!(items[0], Err(Error::Decode(_))));
    }
}
