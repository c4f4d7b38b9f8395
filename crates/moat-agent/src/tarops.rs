//! `GET /fs/tar` and `PUT /fs/tar`: tar archives streamed in both directions without buffering the
//! whole archive (a blocking worker on one side, a bounded channel on the other).

use moat_api::protocol::endpoint;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use bytes::{Buf, Bytes};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::sync::mpsc;

use crate::fsops::{blocking, create_dirs, resolve};
use crate::http::{no_content, streamed, ApiError, HandlerResult};

const CHUNK: usize = 64 * 1024;

/// A `Write` that sends 64 KiB pieces into a bounded channel (blocking when it is full).
pub(crate) struct ChannelWriter {
    tx: mpsc::Sender<std::io::Result<Bytes>>,
    buf: Vec<u8>,
}

impl ChannelWriter {
    pub(crate) fn new(tx: mpsc::Sender<std::io::Result<Bytes>>) -> ChannelWriter {
        ChannelWriter {
            tx,
            buf: Vec::with_capacity(CHUNK),
        }
    }
}

impl ChannelWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK)));
        self.tx
            .blocking_send(Ok(data))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client went away"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}

/// A blocking `Read` over request body pieces arriving through a bounded channel.
struct ChannelReader {
    rx: mpsc::Receiver<std::io::Result<Bytes>>,
    cur: Bytes,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.cur.is_empty() {
            match self.rx.blocking_recv() {
                Some(Ok(b)) => self.cur = b,
                Some(Err(e)) => return Err(e),
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.cur.len());
        out[..n].copy_from_slice(&self.cur[..n]);
        self.cur.advance(n);
        Ok(n)
    }
}

fn build_archive(path: &Path, w: ChannelWriter) -> std::io::Result<()> {
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    b.mode(tar::HeaderMode::Complete);
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        b.append_dir_all(".", path)?;
    } else {
        let name = path
            .file_name()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("file"));
        b.append_path_with_name(path, name)?;
    }
    let mut w = b.into_inner()?;
    w.flush()
}

/// `GET /fs/tar?path=`
pub fn download(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::DownloadTar>(query)?;
    let path = resolve(&q.path, "path")?;
    let shown = path.display().to_string();
    std::fs::symlink_metadata(&path).map_err(|e| ApiError::io(&shown, &e))?;
    let (tx, rx) = mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        let w = ChannelWriter {
            tx: tx.clone(),
            buf: Vec::with_capacity(CHUNK),
        };
        if let Err(e) = build_archive(&path, w) {
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                eprintln!("moat-agent: tar of {}: {e}", path.display());
            }
            let _ = tx.blocking_send(Err(e));
        }
    });
    Ok(streamed("application/x-tar", rx, None))
}

fn extract(dest: &Path, r: impl Read) -> Result<(), ApiError> {
    let mut ar = tar::Archive::new(r);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(true);
    ar.set_preserve_mtime(true);
    ar.set_overwrite(true);
    let bad = |e: std::io::Error| ApiError::invalid("body", format!("reading tar archive: {e}"));
    for entry in ar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let name = entry
            .path()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        match entry.unpack_in(dest) {
            Ok(true) => {}
            Ok(false) => {
                return Err(ApiError::invalid(
                    "body",
                    format!("tar entry {name:?} would land outside {}", dest.display()),
                ))
            }
            Err(e) => return Err(unpack_error(&name, &e)),
        }
    }
    Ok(())
}

/// What an entry that could not be unpacked is answered with. The tar crate wraps the system's
/// error in its own (its kind kept, its errno hidden): an errno found under it is judged like any
/// filesystem error (a full disk, a read-only file), anything else is the archive's fault (a link
/// out of the destination, a malformed header), never the server's.
fn unpack_error(name: &str, e: &std::io::Error) -> ApiError {
    let what = format!("extracting {name:?}");
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.raw_os_error().is_some() {
                return ApiError::io(&what, io);
            }
        }
        cause = c.source();
    }
    ApiError::invalid("body", format!("{what}: {e}"))
}

/// `PUT /fs/tar?path=`
pub async fn upload(query: Option<&str>, mut body: Incoming) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::UploadTar>(query)?;
    let dest = resolve(&q.path, "path")?;
    {
        let dest = dest.clone();
        blocking(move || create_dirs(&dest, 0, 0)).await?;
    }
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(8);
    let worker = tokio::task::spawn_blocking(move || {
        extract(
            &dest,
            ChannelReader {
                rx,
                cur: Bytes::new(),
            },
        )
    });
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    if tx.send(Ok(data)).await.is_err() {
                        break; // the extractor stopped (error); its result says why
                    }
                }
            }
            Err(e) => {
                let _ = tx
                    .send(Err(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        e.to_string(),
                    )))
                    .await;
                break;
            }
        }
    }
    drop(tx);
    worker
        .await
        .map_err(|e| ApiError::internal(format!("tar worker failed: {e}")))??;
    no_content()
}

#[cfg(test)]
mod tests {
    use super::*;
    use moat_api::ErrorCode;

    fn archive(f: impl FnOnce(&mut tar::Builder<Vec<u8>>)) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        f(&mut b);
        b.into_inner().unwrap_or_else(|e| panic!("{e}"))
    }

    fn header(kind: tar::EntryType, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h
    }

    #[test]
    fn an_entry_escaping_the_destination_is_the_archives_fault() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        // A hard link to a file outside the destination: tar refuses it with its own error.
        let tar = archive(|b| {
            let mut h = header(tar::EntryType::Link, 0);
            b.append_link(&mut h, "escape", "../../../../etc/passwd")
                .unwrap_or_else(|e| panic!("{e}"));
        });
        let e = extract(dir.path(), &tar[..]).err().map(|e| e.0.error);
        let e = e.unwrap_or_else(|| panic!("an escaping link was unpacked"));
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}");
        assert_eq!(e.field.as_deref(), Some("body"));
    }

    #[test]
    fn a_filesystem_refusal_keeps_its_errno() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let long = "a".repeat(300);
        let tar = archive(|b| {
            let mut h = header(tar::EntryType::Regular, 1);
            b.append_data(&mut h, &long, &b"x"[..])
                .unwrap_or_else(|e| panic!("{e}"));
        });
        let e = extract(dir.path(), &tar[..]).err().map(|e| e.0.error);
        let e = e.unwrap_or_else(|| panic!("a 300-byte name was unpacked"));
        assert_eq!(e.code, ErrorCode::InvalidArgument, "{e:?}");
        assert!(e.message.contains("too long"), "{e:?}");
    }
}
