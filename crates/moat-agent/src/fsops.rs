//! File endpoints: read/write whole files (streamed), stat, exists, list, mkdir, rename, remove.

use moat_api::protocol::endpoint;
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use moat_api::{DirListing, EntryInfo, ExistsResponse, FileType, MkdirResponse};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

use crate::http::{json, no_content, streamed, ApiError, HandlerResult};
use crate::users;

const CHUNK: usize = 64 * 1024;
const MAX_DEPTH: u32 = 32;

/// Resolves a request path: relative paths are relative to /root; `.` and `..` are folded lexically.
pub fn resolve(p: &str, field: &str) -> Result<PathBuf, ApiError> {
    if p.is_empty() {
        return Err(ApiError::invalid(field, "path is empty"));
    }
    if p.contains('\0') {
        return Err(ApiError::invalid(field, "path contains a NUL byte"));
    }
    let joined = Path::new("/root").join(p);
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    Ok(out)
}

/// Runs blocking filesystem work off the async workers.
pub async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("worker failed: {e}")))?
}

/// `EntryInfo` of `path` from lstat.
pub fn entry_info(path: &Path) -> Result<EntryInfo, ApiError> {
    let shown = path.display().to_string();
    let m = std::fs::symlink_metadata(path).map_err(|e| ApiError::io(&shown, &e))?;
    let ft = m.file_type();
    let file_type = if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    };
    let mode = m.mode() & 0o7777;
    Ok(EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        path: shown,
        file_type,
        size: m.len(),
        mode,
        permissions: moat_api::permissions_string(mode),
        uid: m.uid(),
        gid: m.gid(),
        modified: m.mtime(),
        symlink_target: ft
            .is_symlink()
            .then(|| {
                std::fs::read_link(path)
                    .ok()
                    .map(|t| t.to_string_lossy().into_owned())
            })
            .flatten(),
    })
}

/// `mkdir -p` that chowns every directory it creates; returns whether the last one was created.
pub fn create_dirs(path: &Path, uid: u32, gid: u32) -> Result<bool, ApiError> {
    let shown = path.display().to_string();
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => return Ok(false),
        Ok(m) if m.file_type().is_symlink() && path.is_dir() => return Ok(false),
        Ok(_) => {
            return Err(ApiError::conflict(format!(
                "{shown} exists and is not a directory"
            )))
        }
        Err(_) => {}
    }
    if let Some(parent) = path.parent() {
        create_dirs(parent, uid, gid)?;
    }
    match std::fs::create_dir(path) {
        Ok(()) => {
            std::os::unix::fs::chown(path, Some(uid), Some(gid))
                .map_err(|e| ApiError::io(&shown, &e))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && path.is_dir() => Ok(false),
        Err(e) => Err(ApiError::io(&shown, &e)),
    }
}

fn lookup_user(spec: Option<&str>) -> Result<users::User, ApiError> {
    users::lookup(spec, Path::new("/etc")).map_err(|e| ApiError::invalid("user", e))
}

/// `GET /files?path=`: streams the file in 64 KiB chunks.
pub async fn read_file(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::ReadFile>(query)?;
    let path = resolve(&q.path, "path")?;
    let shown = path.display().to_string();
    let file = std::fs::File::open(&path).map_err(|e| ApiError::io(&shown, &e))?;
    let meta = file.metadata().map_err(|e| ApiError::io(&shown, &e))?;
    if meta.is_dir() {
        return Err(ApiError::conflict_on(
            "path",
            format!("{shown} is a directory"),
        ));
    }
    // A size is sent only where it is the content's: files of /proc, /sys and cgroupfs report 0 or
    // 4096 whatever they hold, and are streamed to their end instead.
    let len = (meta.is_file() && meta.len() > 0 && !on_pseudo_fs(&file)).then_some(meta.len());
    let (tx, rx) = mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        let mut file = file;
        loop {
            let mut buf = vec![0u8; CHUNK];
            match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    if tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            }
        }
    });
    Ok(streamed("application/octet-stream", rx, len))
}

/// Whether a file is on a kernel pseudo filesystem (procfs, sysfs, cgroupfs, ...), whose sizes
/// mean nothing.
fn on_pseudo_fs(file: &std::fs::File) -> bool {
    use nix::sys::statfs::{
        fstatfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC, DEBUGFS_MAGIC, PROC_SUPER_MAGIC,
        SECURITYFS_MAGIC, SYSFS_MAGIC,
    };
    fstatfs(file).is_ok_and(|st| {
        [
            PROC_SUPER_MAGIC,
            SYSFS_MAGIC,
            CGROUP_SUPER_MAGIC,
            CGROUP2_SUPER_MAGIC,
            DEBUGFS_MAGIC,
            SECURITYFS_MAGIC,
        ]
        .contains(&st.filesystem_type())
    })
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The name a file is written under beside its destination before it is renamed over it:
/// `.NAME.moat-new-PID-N` for a file that did not exist, `.NAME.moat-tmp-PID-N` for one replaced.
/// Watchers (`watch.rs`) hide these and report the rename as what it is to the user: the file
/// created (when new) and written.
pub(crate) fn temp_name(name: &str, new: bool) -> String {
    format!(
        ".{name}.moat-{}-{}-{}",
        if new { "new" } else { "tmp" },
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Whether `name` is one of [`temp_name`]'s, and if so whether its destination is new.
pub fn temp_of(name: &str) -> Option<bool> {
    if !name.starts_with('.') {
        return None;
    }
    let (new, rest) = if let Some(i) = name.rfind(".moat-new-") {
        (true, &name[i + ".moat-new-".len()..])
    } else if let Some(i) = name.rfind(".moat-tmp-") {
        (false, &name[i + ".moat-tmp-".len()..])
    } else {
        return None;
    };
    let mut parts = rest.split('-');
    let numeric =
        |p: Option<&str>| p.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    (numeric(parts.next()) && numeric(parts.next()) && parts.next().is_none()).then_some(new)
}

/// `PUT /files?path=&mode=&user=`: body → temp file → fsync → rename over the target.
pub async fn write_file(query: Option<&str>, body: Incoming) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::WriteFile>(query)?;
    let path = resolve(&q.path, "path")?;
    let mode = q
        .mode
        .as_deref()
        .map(moat_api::parse_mode)
        .transpose()
        .map_err(|e| ApiError::invalid("mode", e))?;
    let user = lookup_user(q.user.as_deref())?;
    let shown = path.display().to_string();
    let (Some(parent), Some(name)) = (path.parent().map(Path::to_path_buf), path.file_name())
    else {
        return Err(ApiError::invalid("path", "cannot write to /"));
    };
    let existing = std::fs::metadata(&path).ok();
    if existing.as_ref().is_some_and(|m| m.is_dir()) {
        return Err(ApiError::conflict_on(
            "path",
            format!("{shown} is a directory"),
        ));
    }
    let mode = mode
        .or(existing.as_ref().map(|m| m.mode() & 0o7777))
        .unwrap_or(0o644);
    let (uid, gid) = (user.uid, user.gid);
    {
        let parent = parent.clone();
        blocking(move || create_dirs(&parent, uid, gid)).await?;
    }
    let tmp = parent.join(temp_name(&name.to_string_lossy(), existing.is_none()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| ApiError::io(&shown, &e))?;
    let result = fill_temp(file, body, mode, uid, gid).await;
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(ApiError::io(&shown, &e));
    }
    json(StatusCode::OK, &entry_info(&path)?)
}

async fn fill_temp(
    file: std::fs::File,
    mut body: Incoming,
    mode: u32,
    uid: u32,
    gid: u32,
) -> Result<(), ApiError> {
    let mut f = tokio::fs::File::from_std(file);
    let werr = |e: std::io::Error| ApiError::io("writing file", &e);
    while let Some(frame) = body.frame().await {
        let frame =
            frame.map_err(|e| ApiError::invalid("body", format!("reading request body: {e}")))?;
        if let Ok(data) = frame.into_data() {
            f.write_all(&data).await.map_err(werr)?;
        }
    }
    f.flush().await.map_err(werr)?;
    let f = f.into_std().await;
    blocking(move || {
        f.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(werr)?;
        std::os::unix::fs::fchown(&f, Some(uid), Some(gid)).map_err(werr)?;
        f.sync_all().map_err(werr)
    })
    .await
}

/// `GET /fs/stat?path=`
pub fn stat(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::Stat>(query)?;
    json(StatusCode::OK, &entry_info(&resolve(&q.path, "path")?)?)
}

/// `GET /fs/exists?path=`
pub fn exists(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::Exists>(query)?;
    let path = resolve(&q.path, "path")?;
    json(
        StatusCode::OK,
        &ExistsResponse {
            exists: std::fs::symlink_metadata(path).is_ok(),
        },
    )
}

/// `GET /fs/list?path=&depth=`
pub async fn list(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::ListDir>(query)?;
    let depth = q.depth.unwrap_or(1);
    if depth == 0 || depth > MAX_DEPTH {
        return Err(ApiError::invalid(
            "depth",
            format!("depth must be between 1 and {MAX_DEPTH}"),
        ));
    }
    let path = resolve(&q.path, "path")?;
    let entries = blocking(move || {
        let info = entry_info(&path)?;
        if info.file_type != FileType::Dir {
            return Err(ApiError::conflict_on(
                "path",
                format!("{} is not a directory", info.path),
            ));
        }
        let mut out = Vec::new();
        walk(&path, depth, &mut out).map_err(|e| ApiError::io(&info.path, &e))?;
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    })
    .await?;
    json(StatusCode::OK, &DirListing { entries })
}

fn walk(dir: &Path, depth: u32, out: &mut Vec<EntryInfo>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let Ok(info) = entry_info(&entry.path()) else {
            continue;
        };
        let is_dir = info.file_type == FileType::Dir;
        out.push(info);
        if is_dir && depth > 1 {
            // An unreadable subdirectory is listed but not descended into.
            let _ = walk(&entry.path(), depth - 1, out);
        }
    }
    Ok(())
}

/// `POST /fs/mkdir`
pub async fn mkdir(body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::Mkdir, _>(body).await?;
    let path = resolve(&req.path, "path")?;
    let user = lookup_user(req.user.as_deref())?;
    let resp = blocking(move || {
        let created = create_dirs(&path, user.uid, user.gid)?;
        Ok(MkdirResponse {
            created,
            entry: entry_info(&path)?,
        })
    })
    .await?;
    json(
        if resp.created {
            StatusCode::CREATED
        } else {
            StatusCode::OK
        },
        &resp,
    )
}

/// `POST /fs/rename`
pub async fn rename(body: Incoming) -> HandlerResult {
    let req = crate::http::body_of::<endpoint::Rename, _>(body).await?;
    let from = resolve(&req.from, "from")?;
    let to = resolve(&req.to, "to")?;
    let info = blocking(move || {
        let shown = from.display().to_string();
        std::fs::symlink_metadata(&from).map_err(|e| ApiError::io(&shown, &e))?;
        if let Some(parent) = to.parent() {
            create_dirs(parent, 0, 0)?;
        }
        std::fs::rename(&from, &to).map_err(|e| ApiError::io(&format!("renaming {shown}"), &e))?;
        entry_info(&to)
    })
    .await?;
    json(StatusCode::OK, &info)
}

/// `DELETE /fs?path=&recursive=`
pub async fn remove(query: Option<&str>) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::Remove>(query)?;
    let path = resolve(&q.path, "path")?;
    if path == Path::new("/") {
        return Err(ApiError::invalid("path", "refusing to remove /"));
    }
    let recursive = q.recursive.unwrap_or(false);
    blocking(move || {
        let shown = path.display().to_string();
        let m = std::fs::symlink_metadata(&path).map_err(|e| ApiError::io(&shown, &e))?;
        let r = if m.is_dir() {
            if recursive {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_dir(&path)
            }
        } else {
            std::fs::remove_file(&path)
        };
        r.map_err(|e| ApiError::io(&shown, &e))
    })
    .await?;
    no_content()
}

#[cfg(test)]
mod tests {
    #[test]
    fn temporary_names_are_recognised_and_nothing_else() {
        assert_eq!(super::temp_of(&super::temp_name("f.txt", true)), Some(true));
        assert_eq!(
            super::temp_of(&super::temp_name("a.moat-tmp-1", false)),
            Some(false)
        );
        for other in [
            "f.txt",
            ".f.moat-tmp-",
            ".f.moat-tmp-1",
            ".f.moat-new-1-x",
            "f.moat-tmp-1-2",
        ] {
            assert_eq!(super::temp_of(other), None, "{other}");
        }
    }

    use super::*;

    fn r(p: &str) -> String {
        resolve(p, "path")
            .map(|p| p.display().to_string())
            .unwrap_or_else(|e| format!("ERR {}", e.0))
    }

    #[test]
    fn path_resolution() {
        assert_eq!(r("/etc/passwd"), "/etc/passwd");
        assert_eq!(r("notes.txt"), "/root/notes.txt");
        assert_eq!(r("a/./b/../c"), "/root/a/c");
        assert_eq!(r("../../../../etc"), "/etc");
        assert_eq!(r("/"), "/");
        assert_eq!(r("/a//b/"), "/a/b");
        assert!(r("").starts_with("ERR"));
        assert!(r("a\0b").starts_with("ERR"));
    }

    #[test]
    fn entry_info_and_dirs() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let d = dir.path().join("x/y");
        // SAFETY: plain id getters.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        assert!(matches!(create_dirs(&d, uid, gid), Ok(true)));
        assert!(matches!(create_dirs(&d, uid, gid), Ok(false)));
        let f = d.join("f");
        std::fs::write(&f, b"hello").unwrap_or_else(|e| panic!("{e}"));
        assert!(create_dirs(&f, uid, gid).is_err());
        std::os::unix::fs::symlink("f", d.join("l")).unwrap_or_else(|e| panic!("{e}"));
        let info = entry_info(&d.join("l")).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(info.file_type, FileType::Symlink);
        assert_eq!(info.symlink_target.as_deref(), Some("f"));
        let info = entry_info(&f).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!((info.size, info.name.as_str()), (5, "f"));
        let mut out = Vec::new();
        walk(dir.path(), 2, &mut out).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(out.len(), 2); // x and x/y, not x/y/*
    }
}
