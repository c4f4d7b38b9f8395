//! Secrets that never enter a sandbox (docs/secrets.md): the sandbox holds a placeholder, and the
//! daemon's egress proxy puts the value on the wire, only towards the hosts the secret belongs to.

use serde::{Deserialize, Serialize};

/// Longest secret name and value.
pub const SECRET_NAME_MAX: usize = 128;
pub const SECRET_VALUE_MAX: usize = 16 * 1024;
/// Every placeholder starts with this, followed by 32 lowercase hex digits.
pub const PLACEHOLDER_PREFIX: &str = "moat-secret-";
pub const PLACEHOLDER_LEN: usize = PLACEHOLDER_PREFIX.len() + 32;

/// A secret as declared: on a sandbox (`secrets` at create, `PUT /v1/sandboxes/{id}/secrets/{name}`),
/// a template (`PUT /v1/templates/{name}/secrets/{secret}`) or the whole daemon
/// (`PUT /v1/secrets/{name}`). Its value is write-only: no answer ever carries it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SecretSpec {
    /// The environment variable that holds the placeholder inside (`GITHUB_TOKEN`): letters, digits
    /// and `_`, not starting with a digit. In a `PUT .../secrets/{name}` it may be left out.
    #[serde(default)]
    pub name: String,
    /// The real value (at most 16 KiB). Never returned, never logged.
    pub value: String,
    /// Where it may go: domains (`api.github.com`) and wildcards (`*.example.com`: subdomains
    /// only). Only TLS connections to these hosts carry it.
    pub hosts: Vec<String>,
    /// `placeholder` (default): the value replaces the placeholder wherever the request carries it
    /// (headers, the URL, the body when `body` is true). `header`: also sets `header` to `format`
    /// on every request to the hosts, even when the code never mentions the secret.
    #[serde(default)]
    pub inject: SecretInject,
    /// For `inject: header`: the header to set (default `Authorization`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// For `inject: header`: the header's value, `{value}` standing for the secret (default
    /// `Bearer {value}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Also replace the placeholder in request bodies (up to 8 MiB) to the hosts (default false:
    /// a body is sent as written).
    #[serde(default)]
    pub body: bool,
}

impl std::fmt::Debug for SecretSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSpec")
            .field("name", &self.name)
            .field("value", &"<redacted>")
            .field("hosts", &self.hosts)
            .field("inject", &self.inject)
            .field("header", &self.header)
            .field("body", &self.body)
            .finish()
    }
}

/// How a secret reaches its hosts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum SecretInject {
    #[default]
    Placeholder,
    Header,
}

/// What the API says of a secret: everything but its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretInfo {
    pub name: String,
    pub hosts: Vec<String>,
    pub inject: SecretInject,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    pub body: bool,
    /// `sandbox`, `template` or `daemon`: where it was declared.
    pub scope: String,
    /// In a sandbox's list: the placeholder its processes see in `$NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placeholder: Option<String>,
    /// RFC 3339: when the value was last set (a rotation changes it).
    pub updated_at: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretList {
    pub secrets: Vec<SecretInfo>,
}

/// What follows a placeholder heading where it does not belong (the connection is refused in
/// every case).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SecretViolation {
    /// Refuse it, log it (connection log rule `secret`) and audit it.
    #[default]
    Block,
    /// ... and pause the sandbox.
    BlockAndPause,
    /// ... and take a snapshot of the sandbox's files at that moment (named in the audit entry).
    BlockAndSnapshot,
    /// ... and end the sandbox (`ended.reason: killed_by_policy`).
    BlockAndKill,
}

impl SecretViolation {
    pub fn is_block(&self) -> bool {
        *self == SecretViolation::Block
    }
}

/// Checks a secret's name: an environment variable name, at most 128 characters.
pub fn check_secret_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= SECRET_NAME_MAX
        && !name.as_bytes()[0].is_ascii_digit()
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "a secret's name is an environment variable name: letters, digits and '_', not starting \
             with a digit, 1 to {SECRET_NAME_MAX} characters"
        ))
    }
}

/// Checks a whole spec; the error names the field.
pub fn check_secret(s: &SecretSpec) -> Result<(), (&'static str, String)> {
    check_secret_name(&s.name).map_err(|m| ("name", m))?;
    if s.value.is_empty() || s.value.len() > SECRET_VALUE_MAX {
        return Err((
            "value",
            format!("a secret's value is 1 to {SECRET_VALUE_MAX} bytes"),
        ));
    }
    if s.value.contains(PLACEHOLDER_PREFIX) || s.value.bytes().any(|b| b == b'\r' || b == b'\n') {
        return Err((
            "value",
            "a secret's value may not contain line breaks or a moat placeholder".into(),
        ));
    }
    if s.hosts.is_empty() || s.hosts.len() > 64 {
        return Err(("hosts", "a secret names 1 to 64 hosts it may go to".into()));
    }
    for h in &s.hosts {
        match crate::parse_destination(h) {
            Ok(d) if d.is_name() => {}
            _ => {
                return Err((
                    "hosts",
                    format!(
                        "{h:?} is not a host name: a secret goes to domains (api.github.com) or \
                         wildcards (*.example.com), never to addresses"
                    ),
                ))
            }
        }
    }
    if let Some(h) = &s.header {
        if h.is_empty()
            || !h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(("header", format!("{h:?} is not a header name")));
        }
    }
    if let Some(f) = &s.format {
        if !f.contains("{value}") || f.bytes().any(|b| b == b'\r' || b == b'\n') {
            return Err((
                "format",
                "a header format is one line with {value} in it (\"Bearer {value}\")".into(),
            ));
        }
    }
    if (s.header.is_some() || s.format.is_some()) && s.inject != SecretInject::Header {
        return Err(("inject", "header and format are for inject: header".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SecretSpec {
        SecretSpec {
            name: "GITHUB_TOKEN".into(),
            value: "ghp_x".into(),
            hosts: vec!["api.github.com".into()],
            inject: SecretInject::Placeholder,
            header: None,
            format: None,
            body: false,
        }
    }

    #[test]
    fn specs_are_checked_and_never_show_their_value() {
        assert!(check_secret(&spec()).is_ok());
        assert!(!format!("{:?}", spec()).contains("ghp_x"));
        let bad = |f: fn(&mut SecretSpec), field: &str| {
            let mut s = spec();
            f(&mut s);
            assert_eq!(check_secret(&s).unwrap_err().0, field);
        };
        bad(|s| s.name = "1X".into(), "name");
        bad(|s| s.name = "A-B".into(), "name");
        bad(|s| s.value = String::new(), "value");
        bad(|s| s.value = "a\r\nX-Evil: 1".into(), "value");
        bad(|s| s.hosts = vec![], "hosts");
        bad(|s| s.hosts = vec!["10.0.0.1".into()], "hosts");
        bad(|s| s.header = Some("X".into()), "inject");
        bad(
            |s| {
                s.inject = SecretInject::Header;
                s.format = Some("Bearer".into())
            },
            "format",
        );
        let j: SecretSpec = serde_json::from_str(
            r#"{"name":"K","value":"v","hosts":["*.example.com"],"inject":"header"}"#,
        )
        .unwrap();
        assert_eq!(j.inject, SecretInject::Header);
        assert!(check_secret(&j).is_ok());
    }
}
