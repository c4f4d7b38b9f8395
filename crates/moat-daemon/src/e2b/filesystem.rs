//! envd's `filesystem.Filesystem` service on moat's agent (`/fs/*`): stat, list with depth, mkdir,
//! move, remove, and directory watches, both the stream (`WatchDir`) and the polled kind
//! (`CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`, which the sync SDK uses; the daemon holds
//! their events).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt;
use moat_api::{DirListing, EntryInfo, FileType, FsEvent, FsEventKind, MkdirResponse};
use moat_e2b_proto::filesystem as pb;
use tokio::sync::mpsc;

use super::connect::{self, Code, ConnectError, ConnectResult, Envelopes};
use super::process::agent_error;
use super::{E2b, Ids, User};
use crate::agent::AgentClient;

/// Most polled watchers one sandbox may have at once.
const MAX_WATCHERS: usize = 64;
/// Events a polled watcher holds between two polls (older ones are dropped).
const MAX_PENDING: usize = 10_000;

/// envd's `EntryInfo` of one of the agent's (Go's `FileMode.String()` for `permissions`).
pub(super) fn entry(e: &EntryInfo, ids: &Ids) -> pb::EntryInfo {
    let (kind, letter) = match e.file_type {
        FileType::File => (pb::FileType::File, '-'),
        FileType::Dir => (pb::FileType::Directory, 'd'),
        FileType::Symlink => (pb::FileType::Symlink, 'L'),
        FileType::Other => (pb::FileType::Unspecified, '?'),
    };
    pb::EntryInfo {
        name: e.name.clone(),
        r#type: kind as i32,
        path: e.path.clone(),
        size: e.size as i64,
        mode: e.mode & 0o777,
        permissions: format!("{letter}{}", moat_api::permissions_string(e.mode & 0o777)),
        owner: ids.name(e.uid, false),
        group: ids.name(e.gid, true),
        modified_time: Some(moat_e2b_proto::pbjson_types::Timestamp {
            seconds: e.modified,
            nanos: 0,
        }),
        symlink_target: e.symlink_target.clone(),
        metadata: Default::default(),
    }
}

async fn stat_of(agent: &AgentClient, path: &str) -> ConnectResult<EntryInfo> {
    agent.stat(path).await.map_err(agent_error)
}

/// `/filesystem.Filesystem/{method}`.
pub(super) async fn handle(
    e: &E2b,
    id: &str,
    agent: &AgentClient,
    user: &User,
    method: &str,
    headers: &http::HeaderMap,
    body: Body,
) -> Response {
    use axum::response::IntoResponse;
    if method == "WatchDir" {
        return watch_dir(agent, user, headers, body).await;
    }
    let ids = e.ids(id, agent).await;
    let result = match method {
        "Stat" => {
            async {
                let r: pb::StatRequest = connect::unary_request(body).await?;
                let info = stat_of(agent, &user.resolve(&r.path)).await?;
                Ok(connect::unary_response(&pb::StatResponse {
                    entry: Some(entry(&info, &ids)),
                }))
            }
            .await
        }
        "ListDir" => {
            async {
                let r: pb::ListDirRequest = connect::unary_request(body).await?;
                let list: DirListing = agent
                    .list_dir(&user.resolve(&r.path), r.depth.clamp(1, 32))
                    .await
                    .map_err(agent_error)?;
                Ok(connect::unary_response(&pb::ListDirResponse {
                    entries: list.entries.iter().map(|x| entry(x, &ids)).collect(),
                }))
            }
            .await
        }
        "MakeDir" => {
            async {
                let r: pb::MakeDirRequest = connect::unary_request(body).await?;
                let path = user.resolve(&r.path);
                let req = moat_api::MkdirRequest {
                    path: path.clone(),
                    user: Some(user.name.clone()),
                };
                let made: MkdirResponse = agent.mkdir(&req).await.map_err(agent_error)?;
                if !made.created {
                    return Err(ConnectError::new(
                        Code::AlreadyExists,
                        format!("directory '{path}' already exists"),
                    ));
                }
                Ok(connect::unary_response(&pb::MakeDirResponse {
                    entry: Some(entry(&made.entry, &ids)),
                }))
            }
            .await
        }
        "Move" => {
            async {
                let r: pb::MoveRequest = connect::unary_request(body).await?;
                let info: EntryInfo = agent
                    .rename(&user.resolve(&r.source), &user.resolve(&r.destination))
                    .await
                    .map_err(agent_error)?;
                Ok(connect::unary_response(&pb::MoveResponse {
                    entry: Some(entry(&info, &ids)),
                }))
            }
            .await
        }
        "Remove" => {
            async {
                let r: pb::RemoveRequest = connect::unary_request(body).await?;
                let path = user.resolve(&r.path);
                let done = agent.remove(&path, true).await.map_err(agent_error);
                match done {
                    // envd removes with RemoveAll: a missing path is no error.
                    Ok(_)
                    | Err(ConnectError {
                        code: Code::NotFound,
                        ..
                    }) => Ok(connect::unary_response(&pb::RemoveResponse {})),
                    Err(err) => Err(err),
                }
            }
            .await
        }
        "CreateWatcher" => {
            async {
                let r: pb::CreateWatcherRequest = connect::unary_request(body).await?;
                let watcher = e
                    .watchers
                    .create(agent, id, &user.resolve(&r.path), r.recursive)
                    .await?;
                Ok(connect::unary_response(&pb::CreateWatcherResponse {
                    watcher_id: watcher,
                }))
            }
            .await
        }
        "GetWatcherEvents" => {
            async {
                let r: pb::GetWatcherEventsRequest = connect::unary_request(body).await?;
                let events = e.watchers.take(id, &r.watcher_id)?;
                Ok(connect::unary_response(&pb::GetWatcherEventsResponse {
                    events,
                }))
            }
            .await
        }
        "RemoveWatcher" => {
            async {
                let r: pb::RemoveWatcherRequest = connect::unary_request(body).await?;
                e.watchers.remove(id, &r.watcher_id)?;
                Ok(connect::unary_response(&pb::RemoveWatcherResponse {}))
            }
            .await
        }
        other => Err(ConnectError::new(
            Code::Unimplemented,
            format!("filesystem.Filesystem/{other} is not a method of this service"),
        )),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

/// The agent's watch of `path` (NDJSON `FsEvent`s), checked to exist and be a directory first.
async fn agent_watch(
    agent: &AgentClient,
    path: &str,
    recursive: bool,
) -> ConnectResult<http::Response<hyper::body::Incoming>> {
    let info = stat_of(agent, path).await?;
    if info.file_type != FileType::Dir {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            format!("path {path} not a directory"),
        ));
    }
    let resp = agent.watch(path, recursive).await.map_err(agent_error)?;
    Ok(resp)
}

/// envd's event for one of the agent's: the name relative to the watched directory.
fn fs_event(root: &str, ev: &FsEvent) -> pb::FilesystemEvent {
    let root = root.trim_end_matches('/');
    let name = ev
        .path
        .strip_prefix(root)
        .map(|r| r.trim_start_matches('/'))
        .unwrap_or(&ev.path)
        .to_string();
    let kind = match ev.kind {
        FsEventKind::Create => pb::EventType::Create,
        FsEventKind::Write => pb::EventType::Write,
        FsEventKind::Remove => pb::EventType::Remove,
        FsEventKind::Rename => pb::EventType::Rename,
        FsEventKind::Chmod => pb::EventType::Chmod,
    };
    pb::FilesystemEvent {
        name,
        r#type: kind as i32,
        entry: None,
    }
}

/// Feeds the agent's watch events, one at a time, to `f` (false from `f` stops it).
async fn pump(resp: http::Response<hyper::body::Incoming>, mut f: impl FnMut(FsEvent) -> bool) {
    let mut body = resp.into_body();
    let mut buf = bytes::BytesMut::new();
    while let Some(Ok(frame)) = body.frame().await {
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(i) = buf.iter().position(|b| *b == b'\n') {
            let line = buf.split_to(i + 1);
            if let Ok(ev) = serde_json::from_slice::<FsEvent>(&line[..i]) {
                if !f(ev) {
                    return;
                }
            }
        }
        if buf.len() > 1 << 20 {
            return;
        }
    }
}

async fn watch_dir(
    agent: &AgentClient,
    user: &User,
    headers: &http::HeaderMap,
    body: Body,
) -> Response {
    let req: pb::WatchDirRequest = match Envelopes::new(body).next().await {
        Ok(Some(r)) => r,
        Ok(None) => {
            return connect::stream_error(ConnectError::new(
                Code::InvalidArgument,
                "no request message",
            ))
        }
        Err(err) => return connect::stream_error(err),
    };
    let root = user.resolve(&req.path);
    let resp = match agent_watch(agent, &root, req.recursive).await {
        Ok(r) => r,
        Err(err) => return connect::stream_error(err),
    };
    let keepalive = connect::keepalive(headers);
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    let (ev_tx, mut ev_rx) = mpsc::channel::<FsEvent>(256);
    tokio::spawn(pump(resp, move |ev| {
        ev_tx.try_send(ev).is_ok() || !ev_tx.is_closed()
    }));
    tokio::spawn(async move {
        use pb::watch_dir_response::Event;
        let msg = |ev: Event| connect::message(&pb::WatchDirResponse { event: Some(ev) });
        if tx
            .send(msg(Event::Start(pb::watch_dir_response::StartEvent {})))
            .await
            .is_err()
        {
            return;
        }
        let mut tick = tokio::time::interval(keepalive);
        tick.tick().await;
        loop {
            let out = tokio::select! {
                ev = ev_rx.recv() => match ev {
                    Some(ev) => msg(Event::Filesystem(fs_event(&root, &ev))),
                    None => {
                        let _ = tx.send(connect::end(None)).await;
                        return;
                    }
                },
                _ = tick.tick() => msg(Event::Keepalive(pb::watch_dir_response::KeepAlive {})),
            };
            if tx.send(out).await.is_err() {
                return;
            }
        }
    });
    connect::stream_response(tokio_stream::wrappers::ReceiverStream::new(rx))
}

struct Watcher {
    sandbox: String,
    events: Arc<Mutex<Vec<pb::FilesystemEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

/// The polled watchers (the daemon holds their events until the client asks).
#[derive(Default)]
pub struct Watchers {
    by_id: Mutex<HashMap<String, Watcher>>,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Watcher>> {
        self.by_id
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    async fn create(
        &self,
        agent: &AgentClient,
        sandbox: &str,
        path: &str,
        recursive: bool,
    ) -> ConnectResult<String> {
        {
            let mut m = self.lock();
            // Watchers whose stream ended (their sandbox went away) are dropped first.
            m.retain(|_, w| {
                !w.task.is_finished() || !w.events.lock().map(|e| e.is_empty()).unwrap_or(true)
            });
            if m.values().filter(|w| w.sandbox == sandbox).count() >= MAX_WATCHERS {
                return Err(ConnectError::new(
                    Code::ResourceExhausted,
                    format!("sandbox {sandbox} has {MAX_WATCHERS} watchers already"),
                ));
            }
        }
        let resp = agent_watch(agent, path, recursive).await?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = events.clone();
        let root = path.to_string();
        let task = tokio::spawn(pump(resp, move |ev| {
            let mut v = sink
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if v.len() >= MAX_PENDING {
                v.remove(0);
            }
            v.push(fs_event(&root, &ev));
            true
        }));
        let id = format!("w{:016x}", rand::random::<u64>());
        self.lock().insert(
            id.clone(),
            Watcher {
                sandbox: sandbox.to_string(),
                events,
                task,
            },
        );
        Ok(id)
    }

    fn take(&self, sandbox: &str, id: &str) -> ConnectResult<Vec<pb::FilesystemEvent>> {
        let m = self.lock();
        let w = m.get(id).filter(|w| w.sandbox == sandbox).ok_or_else(|| {
            ConnectError::new(Code::NotFound, format!("watcher with id {id} not found"))
        })?;
        let mut v = w
            .events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Ok(std::mem::take(&mut *v))
    }

    fn remove(&self, sandbox: &str, id: &str) -> ConnectResult<()> {
        let mut m = self.lock();
        match m.get(id) {
            Some(w) if w.sandbox == sandbox => {
                w.task.abort();
                m.remove(id);
                Ok(())
            }
            _ => Err(ConnectError::new(
                Code::NotFound,
                format!("watcher with id {id} not found"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_read_as_envd_writes_them() {
        let ids = Ids {
            passwd: "user:x:1000:1000::/home/user:/bin/sh\n".into(),
            group: "user:x:1000:\n".into(),
        };
        let e = entry(
            &EntryInfo {
                name: "a.txt".into(),
                path: "/home/user/a.txt".into(),
                file_type: FileType::File,
                size: 5,
                mode: 0o644,
                permissions: "rw-r--r--".into(),
                uid: 1000,
                gid: 1000,
                modified: 1_700_000_000,
                symlink_target: None,
            },
            &ids,
        );
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        assert_eq!(v["size"], "5");
        assert_eq!(v["mode"], 420);
        assert_eq!(v["permissions"], "-rw-r--r--");
        assert_eq!(
            (v["owner"].as_str(), v["group"].as_str()),
            (Some("user"), Some("user"))
        );
        assert_eq!(v["modifiedTime"], "2023-11-14T22:13:20+00:00");
    }

    #[test]
    fn event_names_are_relative_to_the_watched_directory() {
        let ev = FsEvent {
            kind: FsEventKind::Create,
            path: "/home/user/dir/sub/f".into(),
            timestamp_us: 0,
        };
        let e = fs_event("/home/user/dir/", &ev);
        assert_eq!(e.name, "sub/f");
        assert_eq!(e.r#type, pb::EventType::Create as i32);
    }
}
