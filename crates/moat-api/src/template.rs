//! Templates: the read-only root filesystems sandboxes start from.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum TemplateSource {
    /// Built by moat from Debian packages with debootstrap.
    Debootstrap,
    /// Copied from a root filesystem directory on the host.
    Directory,
    /// Unpacked from a root filesystem tarball on the host.
    Tarball,
    /// The layers of an OCI or Docker image: an image layout or `docker save` archive on the host, or
    /// pulled from a registry.
    Image,
    /// Built from a template spec (`moat.toml`): a base and cached step layers.
    Spec,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum TemplateStatus {
    Building,
    Ready,
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Template {
    pub name: String,
    pub source: TemplateSource,
    pub status: TemplateStatus,
    /// Bytes on disk.
    pub size_bytes: u64,
    /// RFC 3339.
    pub created_at: String,
    /// Why the last build failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// What a spec-built template starts from (`template base`, `image python:3.12-slim`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// Content digests of a spec-built template's layers over its base, bottom first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    /// Environment, user, working directory and start command its sandboxes get.
    #[serde(default, skip_serializing_if = "crate::TemplateConfig::is_empty")]
    pub config: crate::TemplateConfig,
    /// The build that made it (`GET /v1/builds/{id}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build_id: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// `POST /v1/templates`: register a root filesystem directory or tarball on the daemon's host.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RegisterTemplateRequest {
    /// 1–63 characters of `[a-z0-9._-]`, starting with a letter or digit.
    pub name: String,
    /// Absolute host path of a root filesystem directory, a (compressed) root filesystem tarball, an
    /// OCI image layout (directory or tar) or a `docker save` archive (recognised by their
    /// `index.json` / `manifest.json`).
    pub path: String,
}

/// `POST /v1/templates/{name}/pull`: make a template from an image in an OCI registry.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PullTemplateRequest {
    /// `[registry/]repository[:tag|@sha256:digest]`; Docker Hub when no registry is named.
    pub image: String,
    /// Registry user (basic auth, or to obtain a bearer token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<String>,
    /// Talk plain HTTP to the registry (a registry on localhost or a private network).
    #[serde(default)]
    pub insecure: bool,
}

/// One line of `POST /v1/templates/{name}/build` (`application/x-ndjson`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BuildEvent {
    /// A build phase and how far it is (`total` 0 when unknown).
    Progress {
        phase: String,
        done: u64,
        total: u64,
    },
    /// A line of the build tool's output (of step `step` in a spec build).
    Log {
        line: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        step: Option<u32>,
    },
    /// First event of a spec build: its id and steps (`GET /v1/builds/{id}/events` follows it again).
    Started(Box<crate::BuildStarted>),
    /// A step of a spec build begins, or is taken from the cache (`cached`).
    Step {
        index: u32,
        total: u32,
        description: String,
        cached: bool,
    },
    /// A step of a spec build finished.
    StepDone {
        index: u32,
        duration_ms: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        layer: Option<String>,
        #[serde(default)]
        size_bytes: u64,
    },
    /// Last event of a successful build.
    Done { template: Box<Template> },
    /// Last event of a failed build: what failed (the step and the end of its output).
    Failed {
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        step: Option<u32>,
    },
}

/// Template names: 1–63 characters of `[a-z0-9._-]`, starting with a letter or digit.
pub fn validate_template_name(name: &str) -> Result<(), String> {
    let ok_len = !name.is_empty() && name.len() <= 63;
    let ok_first = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let ok_chars = name
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if ok_len && ok_first && ok_chars && name != "." && name != ".." {
        Ok(())
    } else {
        Err(format!(
            "template name {name:?} must be 1-63 characters of [a-z0-9._-] starting with a letter or digit"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(validate_template_name("base").is_ok());
        assert!(validate_template_name("py-3.11").is_ok());
        assert!(validate_template_name("").is_err());
        assert!(validate_template_name("../etc").is_err());
        assert!(validate_template_name("Base").is_err());
        assert!(validate_template_name(&"a".repeat(64)).is_err());
    }
}
