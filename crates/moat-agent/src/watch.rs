//! `GET /fs/watch`: inotify events as an NDJSON stream of `FsEvent`. The inotify instance (and with
//! it every watch) goes away when the client does.

use moat_api::protocol::endpoint;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use moat_api::{FsEvent, FsEventKind, NDJSON};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::fsops::{resolve, temp_of};
use crate::http::{ndjson_line, now_us, streamed, ApiError, HandlerResult};

/// Most watches one stream may add (recursive watches of huge trees stop there).
const MAX_WATCHES: usize = 8192;

struct Ino(Inotify);

impl AsRawFd for Ino {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_CLOSE_WRITE
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DONT_FOLLOW
}

struct Watcher {
    dirs: HashMap<WatchDescriptor, PathBuf>,
    recursive: bool,
    /// Renames of the file API's temporary files under way (inotify cookie → destination new).
    renames: HashMap<u32, bool>,
}

impl Watcher {
    fn add(&mut self, ino: &Inotify, path: &Path) -> nix::Result<()> {
        if self.dirs.len() >= MAX_WATCHES {
            return Ok(());
        }
        let wd = ino.add_watch(path, mask())?;
        self.dirs.insert(wd, path.to_path_buf());
        Ok(())
    }

    /// Adds watches on every directory below `dir` (not following symlinks).
    fn add_tree(&mut self, ino: &Inotify, dir: &Path) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in rd.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                let p = entry.path();
                if self.add(ino, &p).is_ok() {
                    self.add_tree(ino, &p);
                }
            }
        }
    }

    /// Turns raw events into API events (and follows new subdirectories when recursive).
    fn translate(
        &mut self,
        ino: &Inotify,
        events: Vec<nix::sys::inotify::InotifyEvent>,
    ) -> Vec<FsEvent> {
        let mut out = Vec::new();
        for ev in events {
            if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
                self.dirs.remove(&ev.wd);
                continue;
            }
            let Some(base) = self.dirs.get(&ev.wd) else {
                continue;
            };
            let path = match &ev.name {
                Some(n) if !n.is_empty() => base.join(n),
                _ => base.clone(),
            };
            let m = ev.mask;
            // The file API writes beside the destination and renames over it: the temporary file
            // is not reported, and its rename is what the user did (created, written).
            if let Some(new) = ev
                .name
                .as_deref()
                .and_then(|n| n.to_str())
                .and_then(temp_of)
            {
                if m.contains(AddWatchFlags::IN_MOVED_FROM) {
                    if self.renames.len() >= 1024 {
                        self.renames.clear();
                    }
                    self.renames.insert(ev.cookie, new);
                }
                continue;
            }
            if m.contains(AddWatchFlags::IN_MOVED_TO) {
                if let Some(new) = self.renames.remove(&ev.cookie) {
                    let path = path.display().to_string();
                    if new {
                        out.push(FsEvent {
                            kind: FsEventKind::Create,
                            path: path.clone(),
                            timestamp_us: now_us(),
                        });
                    }
                    out.push(FsEvent {
                        kind: FsEventKind::Write,
                        path,
                        timestamp_us: now_us(),
                    });
                    continue;
                }
            }
            let kind = if m.contains(AddWatchFlags::IN_CREATE) {
                FsEventKind::Create
            } else if m.intersects(AddWatchFlags::IN_MODIFY | AddWatchFlags::IN_CLOSE_WRITE) {
                FsEventKind::Write
            } else if m.contains(AddWatchFlags::IN_DELETE) {
                FsEventKind::Remove
            } else if m.intersects(AddWatchFlags::IN_MOVED_FROM | AddWatchFlags::IN_MOVED_TO) {
                FsEventKind::Rename
            } else if m.contains(AddWatchFlags::IN_ATTRIB) {
                FsEventKind::Chmod
            } else {
                continue;
            };
            let new_dir = m.contains(AddWatchFlags::IN_ISDIR)
                && m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO);
            out.push(FsEvent {
                kind,
                path: path.display().to_string(),
                timestamp_us: now_us(),
            });
            if self.recursive && new_dir && self.add(ino, &path).is_ok() {
                self.add_tree(ino, &path);
                // Entries made inside the new directory before its watch existed would be missed:
                // report them as created.
                let mut found = Vec::new();
                collect_entries(&path, &mut found, 0);
                out.extend(found.into_iter().map(|p| FsEvent {
                    kind: FsEventKind::Create,
                    path: p.display().to_string(),
                    timestamp_us: now_us(),
                }));
            }
        }
        out
    }
}

/// Every entry below `dir` (not following symlinks), bounded in depth and count.
fn collect_entries(dir: &Path, out: &mut Vec<PathBuf>, depth: usize) {
    if depth > 32 || out.len() >= MAX_WATCHES {
        return;
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in rd.flatten() {
        let p = entry.path();
        out.push(p.clone());
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            collect_entries(&p, out, depth + 1);
        }
    }
}

/// `GET /fs/watch?path=&recursive=`
pub fn watch(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::Watch>(query)?;
    let path = resolve(&q.path, "path")?;
    let shown = path.display().to_string();
    let meta = std::fs::symlink_metadata(&path).map_err(|e| ApiError::io(&shown, &e))?;
    let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| ApiError::internal(format!("inotify: {e}")))?;
    let mut w = Watcher {
        dirs: HashMap::new(),
        recursive: q.recursive.unwrap_or(false),
        renames: HashMap::new(),
    };
    w.add(&ino, &path)
        .map_err(|e| ApiError::io(&shown, &std::io::Error::from(e)))?;
    if w.recursive && meta.is_dir() {
        w.add_tree(&ino, &path);
    }
    // SAFETY: `Ino` owns the inotify fd and keeps it open for as long as the AsyncFd exists.
    let afd = unsafe { AsyncFd::register_with_interest(Ino(ino), tokio::io::Interest::READABLE) }
        .map_err(|e| ApiError::internal(format!("inotify registration: {e}")))?;
    let (tx, rx) = mpsc::channel::<std::io::Result<Bytes>>(64);
    tokio::spawn(async move {
        loop {
            let mut guard = tokio::select! {
                g = afd.readable() => match g { Ok(g) => g, Err(_) => return },
                _ = tx.closed() => return,
            };
            let events = match guard.try_io(|inner| {
                inner
                    .get_ref()
                    .0
                    .read_events()
                    .map_err(std::io::Error::from)
            }) {
                Ok(Ok(evs)) => evs,
                Ok(Err(e)) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
                Err(_would_block) => continue,
            };
            for ev in w.translate(&afd.get_ref().0, events) {
                if tx.send(Ok(ndjson_line(&ev))).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(streamed(NDJSON, rx, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(w: &mut Watcher, ino: &Inotify) -> Vec<(FsEventKind, String)> {
        let mut got = Vec::new();
        for _ in 0..50 {
            match ino.read_events() {
                Ok(evs) => got.extend(w.translate(ino, evs)),
                Err(nix::errno::Errno::EAGAIN) => {
                    if !got.is_empty() {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => panic!("{e}"),
            }
        }
        got.into_iter()
            .map(|e| {
                let name = Path::new(&e.path).file_name().unwrap();
                (e.kind, name.to_string_lossy().into_owned())
            })
            .collect()
    }

    #[test]
    fn a_file_api_write_is_a_create_and_a_write_of_the_file_never_its_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let ino = Inotify::init(InitFlags::IN_NONBLOCK).unwrap();
        let mut w = Watcher {
            dirs: HashMap::new(),
            recursive: false,
            renames: HashMap::new(),
        };
        w.add(&ino, dir.path()).unwrap();
        // What write_file does: a temporary beside, filled, chmod, renamed over the destination.
        let write = |new: bool| {
            let tmp = dir.path().join(crate::fsops::temp_name("f.txt", new));
            std::fs::write(&tmp, b"data").unwrap();
            std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))
                .unwrap();
            std::fs::rename(&tmp, dir.path().join("f.txt")).unwrap();
        };
        write(true);
        assert_eq!(
            drain(&mut w, &ino),
            vec![
                (FsEventKind::Create, "f.txt".into()),
                (FsEventKind::Write, "f.txt".into())
            ]
        );
        write(false);
        assert_eq!(
            drain(&mut w, &ino),
            vec![(FsEventKind::Write, "f.txt".into())]
        );
        // A rename the user made is still a rename.
        std::fs::rename(dir.path().join("f.txt"), dir.path().join("g.txt")).unwrap();
        let got = drain(&mut w, &ino);
        assert!(
            got.iter().all(|(k, _)| *k == FsEventKind::Rename),
            "{got:?}"
        );
        assert_eq!(got.len(), 2, "{got:?}");
    }
}
