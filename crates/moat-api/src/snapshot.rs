//! Snapshots, forks, reset and pause/resume. See docs/snapshots.md.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{Isolation, Sandbox, SandboxLimits};

/// What a sandbox does when its timeout (or idle timeout) passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// Kill it and remove everything it had (the default).
    #[default]
    Kill,
    /// Pause it: processes frozen, files kept, until it is resumed or deleted.
    Pause,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Kill => "kill",
            OnTimeout::Pause => "pause",
        }
    }
}

/// What a snapshot captures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum SnapshotKind {
    /// The root filesystem (every change made since the template); sandboxes started from it run
    /// fresh processes.
    #[default]
    Filesystem,
    /// Filesystem and the memory of every process: sandboxes started from it continue them. Needs a
    /// tier and host that can checkpoint processes (the API says when it cannot).
    Full,
}

/// `POST /v1/sandboxes/{id}/snapshots`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshotRequest {
    /// Unique name (the same rules as template names); the snapshot can be addressed by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `filesystem` (default) or `full`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<SnapshotKind>,
    /// Labels for filtering and bookkeeping.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// A saved state of a sandbox that new sandboxes start from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Snapshot {
    /// `snap_` followed by 26 base32 characters.
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub kind: SnapshotKind,
    /// The sandbox it was taken from (which may be gone by now).
    pub sandbox_id: String,
    /// The template at the bottom of its layer stack.
    pub template: String,
    pub isolation: Isolation,
    /// Content digests (`sha256:...`) of its layers above the template, bottom first; the last one
    /// is what this snapshot added.
    pub layers: Vec<String>,
    /// Bytes of the layer this snapshot added (layers shared with others are not counted again).
    pub size_bytes: u64,
    /// RFC 3339.
    pub created_at: String,
    /// How long the sandbox was frozen while its changes were captured, milliseconds.
    pub frozen_ms: u64,
    /// Limits of the source sandbox; sandboxes started from the snapshot get them unless they ask
    /// for others.
    pub limits: SandboxLimits,
    /// Names of the environment variables of the source sandbox (passed on to forks).
    pub env_keys: Vec<String>,
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotList {
    pub snapshots: Vec<Snapshot>,
}

/// `POST /v1/snapshots/{id}/fork`: start `count` sandboxes from a snapshot in one call.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many sandboxes, 1..=100.
    pub count: u32,
    /// Seconds until each is killed; the daemon default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Labels for every fork (each also gets `moat.fork-index` = 0..count-1).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    /// Environment variables added to (or replacing) the snapshot's.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// What each fork does at its timeout.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
}

/// Answer of a fork: the new sandboxes, in fork-index order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkResponse {
    pub sandboxes: Vec<Sandbox>,
}

/// `POST /v1/sandboxes/{id}/reset`: put a running sandbox back into a snapshot's state, in place.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResetRequest {
    /// Snapshot id or name; when absent, what the sandbox was created from (its snapshot, or its
    /// template's clean state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
}

/// `POST /v1/sandboxes/{id}/resume`
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResumeRequest {
    /// New timeout in seconds from now; the daemon default when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
}

/// Answer of pause and resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PauseResult {
    pub sandbox: Sandbox,
    /// Whether the sandbox's processes were kept (false when they were lost, e.g. the host rebooted
    /// while it was paused: it then resumes with its files but no processes).
    pub processes_kept: bool,
}

/// Checks a snapshot name (the same rules as a template name).
pub fn validate_snapshot_name(name: &str) -> Result<(), String> {
    crate::validate_template_name(name)
        .map_err(|_| format!("snapshot name {name:?} must be 1-63 characters of [a-z0-9._-] starting with a letter or digit"))?;
    if name.starts_with("snap_") {
        return Err(format!(
            "snapshot name {name:?} may not start with \"snap_\" (ids do)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(validate_snapshot_name("episode-0").is_ok());
        assert!(validate_snapshot_name("snap_x").is_err());
        assert!(validate_snapshot_name("Bad").is_err());
        assert!(validate_snapshot_name("").is_err());
    }

    #[test]
    fn kinds_and_modes_are_lowercase() {
        assert_eq!(
            serde_json::to_string(&SnapshotKind::Full).unwrap(),
            "\"full\""
        );
        assert_eq!(
            serde_json::to_string(&OnTimeout::Pause).unwrap(),
            "\"pause\""
        );
        let r: ForkRequest = serde_json::from_str(r#"{"count": 3}"#).unwrap();
        assert_eq!(r.count, 3);
        assert!(serde_json::from_str::<ForkRequest>(r#"{"count": 3, "bogus": 1}"#).is_err());
    }
}
