//! The filesystem API. Every path is resolved by the agent inside the sandbox's own root, so `..`,
//! absolute paths and symlinks resolve within the sandbox and never reach the host.

use serde::{Deserialize, Serialize};

/// `?path=` of the file endpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Absolute path inside the sandbox, or relative to `/root`.
    pub path: String,
}

/// Query of `PUT .../files` (body: the file's bytes, streamed; the file is replaced atomically).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct WriteQuery {
    pub path: String,
    /// Octal permission bits, e.g. `644` or `0755`; 0644 when absent (or the replaced file's mode).
    #[serde(default)]
    pub mode: Option<String>,
    /// Owner of the file and of created parents (name or uid); root when absent.
    #[serde(default)]
    pub user: Option<String>,
}

/// Query of `GET .../fs/list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    pub path: String,
    /// How deep to descend (1 = the directory's own entries); 1 when absent, at most 32.
    #[serde(default)]
    pub depth: Option<u32>,
}

/// Query of `DELETE .../fs`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    pub path: String,
    /// Remove a non-empty directory with its contents.
    #[serde(default)]
    pub recursive: Option<bool>,
}

/// Query of `GET .../fs/watch`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    pub path: String,
    /// Also watch subdirectories (including ones created later).
    #[serde(default)]
    pub recursive: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum FileType {
    File,
    Dir,
    Symlink,
    Other,
}

/// What `stat`, `list`, `write`, `rename` answer with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EntryInfo {
    pub name: String,
    /// Absolute path inside the sandbox.
    pub path: String,
    #[serde(rename = "type")]
    pub file_type: FileType,
    pub size: u64,
    /// Permission bits (e.g. 420 = 0644).
    pub mode: u32,
    /// `rwxr-xr-x` form of `mode`.
    pub permissions: String,
    pub uid: u32,
    pub gid: u32,
    /// Last modification, seconds since the Unix epoch.
    pub modified: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DirListing {
    pub entries: Vec<EntryInfo>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExistsResponse {
    pub exists: bool,
}

/// `POST .../fs/mkdir` (like `mkdir -p`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    pub path: String,
    /// Owner of created directories (name or uid); root when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MkdirResponse {
    /// False when the directory existed already.
    pub created: bool,
    pub entry: EntryInfo,
}

/// `POST .../fs/rename`
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RenameRequest {
    pub from: String,
    pub to: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum FsEventKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// One line of `GET .../fs/watch` (`application/x-ndjson`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FsEvent {
    #[serde(rename = "type")]
    pub kind: FsEventKind,
    /// Absolute path inside the sandbox.
    pub path: String,
    pub timestamp_us: u64,
}

/// Renders permission bits the way `ls -l` does (without the type letter).
pub fn permissions_string(mode: u32) -> String {
    let mut s = String::with_capacity(9);
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// Parses `644`, `0644` or `0o644`.
pub fn parse_mode(s: &str) -> Result<u32, String> {
    let t = s.trim_start_matches("0o");
    let m = u32::from_str_radix(t, 8).map_err(|_| format!("mode {s:?} is not an octal number"))?;
    if m > 0o7777 {
        return Err(format!("mode {s:?} is larger than 07777"));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(permissions_string(0o755), "rwxr-xr-x");
        assert_eq!(permissions_string(0o640), "rw-r-----");
        assert_eq!(parse_mode("0644").unwrap(), 0o644);
        assert_eq!(parse_mode("755").unwrap(), 0o755);
        assert!(parse_mode("9").is_err());
        assert!(parse_mode("77777").is_err());
    }
}
