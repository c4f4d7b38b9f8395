//! `moat cp SRC DST`: files and directories between the host and a sandbox, streamed.

use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use moat_api::{FileType, MkdirRequest};
use moat_client::{Client, WriteOptions};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::parse::{copy_target, parse_location, DstKind, Location};

pub async fn cp(client: &Client, src: &str, dst: &str) -> anyhow::Result<i32> {
    let src = parse_location(src).map_err(anyhow::Error::msg)?;
    let dst = parse_location(dst).map_err(anyhow::Error::msg)?;
    match (src, dst) {
        (Location::Host(src), Location::Sandbox { id, path }) => {
            upload(client, &src, &id, &path).await?
        }
        (Location::Sandbox { id, path }, Location::Host(dst)) => {
            download(client, &id, &path, &dst).await?
        }
        (Location::Host(_), Location::Host(_)) => {
            anyhow::bail!("one of SRC and DST must be a sandbox path, ID:PATH")
        }
        (Location::Sandbox { .. }, Location::Sandbox { .. }) => {
            anyhow::bail!("copying between two sandboxes is not supported; copy through the host")
        }
    }
    Ok(0)
}

async fn remote_kind(client: &Client, id: &str, path: &str) -> anyhow::Result<DstKind> {
    match client.stat(id, path).await {
        Ok(e) if e.file_type == FileType::Dir => Ok(DstKind::Dir),
        Ok(_) => Ok(DstKind::File),
        Err(e) if e.is_not_found() => Ok(DstKind::Missing),
        Err(e) => Err(e.into()),
    }
}

fn local_kind(path: &Path) -> anyhow::Result<DstKind> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(DstKind::Dir),
        Ok(_) => Ok(DstKind::File),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(DstKind::Missing),
        Err(e) => Err(anyhow::Error::new(e).context(path.display().to_string())),
    }
}

/// Host → sandbox: a file streams to `PUT /files` (keeping its mode); a directory streams as a tar
/// archive to `PUT /fs/tar`.
async fn upload(client: &Client, src: &Path, id: &str, dst: &str) -> anyhow::Result<()> {
    let meta = tokio::fs::metadata(src)
        .await
        .with_context(|| src.display().to_string())?;
    let kind = remote_kind(client, id, dst).await?;
    let target =
        copy_target(src, meta.is_dir(), Path::new(dst), kind).map_err(anyhow::Error::msg)?;
    let target = target
        .to_str()
        .with_context(|| format!("{} is not valid UTF-8", target.display()))?;
    if meta.is_dir() {
        client
            .mkdir(
                id,
                &MkdirRequest {
                    path: target.to_string(),
                    user: None,
                },
            )
            .await?;
        let (body, task) = tar_body(src.to_path_buf());
        let sent = client.upload_tar(id, target, body).await;
        // A failure to read the host directory explains a failed upload better than the upload error.
        task.await
            .context("tar task failed")?
            .with_context(|| format!("archiving {}", src.display()))?;
        sent?;
    } else {
        let file = tokio::fs::File::open(src)
            .await
            .with_context(|| src.display().to_string())?;
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(file));
        let opts = WriteOptions {
            mode: Some(format!("{:o}", meta.permissions().mode() & 0o7777)),
            user: None,
        };
        client.write_file(id, target, body, &opts).await?;
    }
    Ok(())
}

/// A tar archive of `dir` (entries relative to it), built on a blocking thread as the body is sent.
fn tar_body(dir: PathBuf) -> (reqwest::Body, tokio::task::JoinHandle<io::Result<()>>) {
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(8);
    let task = tokio::task::spawn_blocking(move || {
        let writer = io::BufWriter::with_capacity(64 * 1024, ChannelWriter { tx: tx.clone() });
        let mut builder = tar::Builder::new(writer);
        builder.follow_symlinks(false);
        let result = builder
            .append_dir_all("", &dir)
            .and_then(|()| builder.into_inner())
            .and_then(|mut w| w.flush());
        if let Err(e) = &result {
            let _ = tx.blocking_send(Err(io::Error::new(e.kind(), e.to_string())));
        }
        result
    });
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (reqwest::Body::wrap_stream(stream), task)
}

/// `Write` into a bounded channel (blocks while the HTTP body is behind).
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
}

impl Write for ChannelWriter {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.tx
            .blocking_send(Ok(Bytes::copy_from_slice(buf)))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "the upload ended early"))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Sandbox → host: a file streams into a temporary file renamed into place; a directory comes as a
/// tar archive unpacked into the destination.
async fn download(client: &Client, id: &str, src: &str, dst: &Path) -> anyhow::Result<()> {
    let entry = client.stat(id, src).await?;
    let is_dir = entry.file_type == FileType::Dir;
    let target =
        copy_target(Path::new(src), is_dir, dst, local_kind(dst)?).map_err(anyhow::Error::msg)?;
    if is_dir {
        tokio::fs::create_dir_all(&target)
            .await
            .with_context(|| target.display().to_string())?;
        let stream = client.download_tar(id, src).await?;
        let reader = tokio_util::io::StreamReader::new(stream.map_err(io::Error::other));
        let bridge = tokio_util::io::SyncIoBridge::new(reader);
        let dest = target.clone();
        tokio::task::spawn_blocking(move || {
            let mut archive = tar::Archive::new(bridge);
            archive.set_preserve_permissions(true);
            archive.set_overwrite(true);
            archive.unpack(&dest)
        })
        .await
        .context("untar task failed")?
        .with_context(|| format!("unpacking into {}", target.display()))?;
    } else {
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let tmp = tempfile::NamedTempFile::new_in(&parent)
            .with_context(|| format!("creating a temporary file in {}", parent.display()))?;
        let (file, tmp_path) = tmp.into_parts();
        let mut file = tokio::fs::File::from_std(file);
        let mut stream = client.read_file(id, src).await?;
        while let Some(chunk) = stream.next().await {
            file.write_all(&chunk?).await?;
        }
        file.flush().await?;
        file.set_permissions(std::fs::Permissions::from_mode(entry.mode & 0o7777))
            .await?;
        drop(file);
        tmp_path
            .persist(&target)
            .with_context(|| target.display().to_string())?;
    }
    Ok(())
}
