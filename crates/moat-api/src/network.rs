//! A sandbox's network: its egress policy and address. See docs/network.md.

use serde::{Deserialize, Serialize};

/// What a sandbox may reach. Whatever the policy, a sandbox never reaches the host, another sandbox,
/// link-local addresses (cloud metadata) or multicast, and has no IPv6.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    /// Public internet (everything not private, not in `deny_out`); the daemon's default when absent.
    #[serde(default = "yes")]
    pub allow_internet: bool,
    /// Destinations allowed even when `allow_internet` is off or they are private (RFC 1918, CGNAT):
    /// IPv4 addresses or CIDRs, domains (`pypi.org`), wildcards (`*.example.com`: subdomains only)
    /// and named groups (`@pypi`, `@npm`, `@debian`, `@github`, ...). Allow beats deny.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    /// Destinations refused: the same kinds of entries as `allow_out` (`0.0.0.0/0` refuses everything
    /// not allowed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_out: Vec<String>,
    /// Outgoing bandwidth cap in Mbit/s (packets over it are dropped, so TCP slows down to it);
    /// none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_mbps: Option<u32>,
    /// Most new outgoing connections per second (over it, connection attempts are dropped); none
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connections_per_second: Option<u32>,
    /// `enforce` (default) refuses what the policy denies; `audit` lets it through and logs it as
    /// `audit` (what the policy would have refused). The always-blocked destinations stay blocked.
    #[serde(default, skip_serializing_if = "NetworkMode::is_enforce")]
    pub mode: NetworkMode,
    /// What follows a secret's placeholder heading to a host it does not belong to (docs/secrets.md):
    /// `block` (default), `block_and_pause`, `block_and_snapshot` or `block_and_kill`.
    #[serde(default, skip_serializing_if = "crate::SecretViolation::is_block")]
    pub on_secret_violation: crate::SecretViolation,
}

/// Whether a policy refuses what it denies or only logs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NetworkMode {
    #[default]
    Enforce,
    Audit,
}

impl NetworkMode {
    pub fn is_enforce(&self) -> bool {
        *self == NetworkMode::Enforce
    }
}

fn yes() -> bool {
    true
}

impl Default for NetworkPolicy {
    fn default() -> Self {
        NetworkPolicy {
            allow_internet: true,
            allow_out: Vec::new(),
            deny_out: Vec::new(),
            egress_mbps: None,
            connections_per_second: None,
            mode: NetworkMode::Enforce,
            on_secret_violation: crate::SecretViolation::Block,
        }
    }
}

/// A sandbox's network as the API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkInfo {
    /// The sandbox's IPv4 address (its `eth0`).
    pub ip: String,
    /// Its gateway on the host (which answers nothing but forwarding and DNS).
    pub gateway: String,
    pub policy: NetworkPolicy,
}

/// An IPv4 address or CIDR: `(network, prefix length)`; the error names what is wrong.
pub fn parse_cidr(s: &str) -> Result<(std::net::Ipv4Addr, u8), String> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => (
            a,
            l.parse::<u8>()
                .ok()
                .filter(|l| *l <= 32)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0..=32"))?,
        ),
        None => (s, 32),
    };
    let ip: std::net::Ipv4Addr = addr.parse().map_err(|_| {
        if addr.parse::<std::net::Ipv6Addr>().is_ok() {
            format!("{s:?}: IPv6 is not routed to sandboxes (they have no IPv6)")
        } else if addr.chars().any(|c| c.is_ascii_alphabetic()) {
            format!("{s:?} is a domain, not an IPv4 address or CIDR")
        } else {
            format!("{s:?} is not an IPv4 address or CIDR")
        }
    })?;
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok((std::net::Ipv4Addr::from(u32::from(ip) & mask), len))
}

/// Named groups usable in `allow_out` / `deny_out` as `@name`: the domains common package registries
/// and code hosts serve from.
pub const GROUPS: &[(&str, &[&str])] = &[
    (
        "pypi",
        &["pypi.org", "files.pythonhosted.org", "pypi.python.org"],
    ),
    (
        "npm",
        &["registry.npmjs.org", "registry.yarnpkg.com", "npmjs.org"],
    ),
    (
        "debian",
        &[
            "deb.debian.org",
            "security.debian.org",
            "ftp.debian.org",
            "*.debian.org",
        ],
    ),
    (
        "github",
        &[
            "github.com",
            "*.github.com",
            "*.githubusercontent.com",
            "ghcr.io",
            "*.ghcr.io",
        ],
    ),
    (
        "crates",
        &[
            "crates.io",
            "index.crates.io",
            "static.crates.io",
            "static.rust-lang.org",
        ],
    ),
    (
        "huggingface",
        &["huggingface.co", "*.huggingface.co", "*.hf.co"],
    ),
    (
        "docker",
        &[
            "registry-1.docker.io",
            "auth.docker.io",
            "production.cloudflare.docker.com",
            "*.docker.io",
        ],
    ),
];

/// One entry of `allow_out` / `deny_out`, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// An IPv4 network (an address is a /32).
    Cidr(std::net::Ipv4Addr, u8),
    /// Exactly this name (lower case, no trailing dot).
    Domain(String),
    /// Any name below this one (`*.example.com` → `example.com`), not the name itself.
    Wildcard(String),
    /// A named group (`@pypi`).
    Group(&'static str),
}

/// Lower case, without the trailing dot.
pub fn normalize_name(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// A DNS name of labels of letters, digits, `-` and `_`; `dotted`: at least two labels.
fn valid_domain(d: &str, dotted: bool) -> bool {
    d.len() <= 253
        && (d.contains('.') || !dotted)
        && d.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        && !d
            .rsplit('.')
            .next()
            .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
}

/// Parses an `allow_out` / `deny_out` entry: an IPv4 address or CIDR, a domain, `*.domain`, or
/// `@group`. The error says what is wrong with it.
pub fn parse_destination(s: &str) -> Result<Destination, String> {
    if let Some(g) = s.strip_prefix('@') {
        return GROUPS
            .iter()
            .find(|(n, _)| *n == g)
            .map(|(n, _)| Destination::Group(n))
            .ok_or_else(|| {
                let names: Vec<String> = GROUPS.iter().map(|(n, _)| format!("@{n}")).collect();
                format!("{s:?} is not a known group ({})", names.join(", "))
            });
    }
    let first = s.split('/').next().unwrap_or("");
    if first.parse::<std::net::Ipv4Addr>().is_ok()
        || first.parse::<std::net::Ipv6Addr>().is_ok()
        || s.bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'/')
    {
        let (a, l) = parse_cidr(s)?;
        return Ok(Destination::Cidr(a, l));
    }
    let name = normalize_name(s);
    let (wild, bare) = match name.strip_prefix("*.") {
        Some(rest) => (true, rest.to_string()),
        None => (false, name.clone()),
    };
    if !valid_domain(&bare, !wild) {
        return Err(format!(
            "{s:?} is not an IPv4 address, CIDR, domain (example.com), wildcard (*.example.com) or group (@pypi)"
        ));
    }
    Ok(if wild {
        Destination::Wildcard(bare)
    } else {
        Destination::Domain(bare)
    })
}

impl Destination {
    /// Whether a (normalized) name matches this entry; CIDRs match no name.
    pub fn matches_name(&self, name: &str) -> bool {
        match self {
            Destination::Cidr(..) => false,
            Destination::Domain(d) => name == d,
            Destination::Wildcard(d) => name
                .strip_suffix(d.as_str())
                .is_some_and(|head| head.ends_with('.') && head.len() > 1),
            Destination::Group(g) => {
                GROUPS
                    .iter()
                    .find(|(n, _)| n == g)
                    .is_some_and(|(_, list)| {
                        list.iter()
                            .any(|e| parse_destination(e).is_ok_and(|d| d.matches_name(name)))
                    })
            }
        }
    }

    /// Whether an address is inside this entry; names match no address.
    pub fn contains(&self, ip: std::net::Ipv4Addr) -> bool {
        match self {
            Destination::Cidr(net, len) => {
                let mask = if *len == 0 { 0 } else { u32::MAX << (32 - len) };
                u32::from(ip) & mask == u32::from(*net)
            }
            _ => false,
        }
    }

    pub fn is_name(&self) -> bool {
        !matches!(self, Destination::Cidr(..))
    }
}

impl NetworkPolicy {
    /// Whether any entry names a domain, a wildcard or a group.
    pub fn has_names(&self) -> bool {
        self.allow_out
            .iter()
            .chain(&self.deny_out)
            .any(|e| parse_destination(e).is_ok_and(|d| d.is_name()))
    }
}

/// What the daemon did with a connection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum NetDecision {
    Allow,
    Deny,
    /// Let through in `audit` mode although the policy would have refused it.
    Audit,
}

impl NetDecision {
    pub fn as_str(&self) -> &'static str {
        match self {
            NetDecision::Allow => "allow",
            NetDecision::Deny => "deny",
            NetDecision::Audit => "audit",
        }
    }
}

/// One entry of a sandbox's connection log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkLogEntry {
    /// Increasing with insertion (use it as `after` to page or to resume a stream).
    pub id: i64,
    /// When the attempt started, milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// The same time, RFC 3339.
    pub at: String,
    pub sandbox_id: String,
    /// `tcp` (through the daemon's proxy, or refused before it), `dns` (a query to the daemon's
    /// resolver), `udp` or `icmp` (the first packet of a flow nftables decided).
    pub protocol: String,
    /// The address the sandbox asked for (TCP), absent for DNS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst_ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dst_port: Option<u16>,
    /// The name: TLS SNI, HTTP Host, or the DNS question.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Where the name came from: `sni`, `host` or `dns` (with the query type, e.g. `dns:A`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name_source: Option<String>,
    pub decision: NetDecision,
    /// The rule that decided: `allow_out[0]`, `deny_out[2]`, `allow_internet`, `private range`,
    /// `always blocked`, `deny list`, ...
    pub rule: String,
    /// The address the daemon connected to (for a name it resolved the name itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dialed: Option<String>,
    /// Bytes from the sandbox / to the sandbox.
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub duration_ms: u64,
    /// Why an allowed connection still failed (the name did not resolve, the server refused, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Answer of `GET /v1/sandboxes/{id}/network/log`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkLog {
    pub entries: Vec<NetworkLogEntry>,
}

/// Filters of `GET /v1/sandboxes/{id}/network/log`; entries come oldest first.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams))]
#[cfg_attr(feature = "openapi", into_params(parameter_in = Query))]
#[serde(deny_unknown_fields)]
pub struct NetworkLogQuery {
    /// Only entries with a greater id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<i64>,
    /// Only this decision: `allow`, `deny` or `audit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision: Option<NetDecision>,
    /// At most this many (default 100, at most 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", param(minimum = 1, maximum = 10000))]
    pub limit: Option<u32>,
    /// Keep the answer open and stream new entries as JSON lines as they happen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<bool>,
}

/// A destination seen in the connection log, for an allow-list proposal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ObservedDestination {
    /// The entry proposed: a group, a domain or an address.
    pub entry: String,
    /// Connections and queries it covers.
    pub count: u64,
    /// The names or addresses it covers.
    pub covers: Vec<String>,
}

/// Answer of `GET /v1/sandboxes/{id}/network/proposal` and `GET /v1/templates/{name}/network/proposal`:
/// the tightest policy that would have allowed everything observed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkProposal {
    pub policy: NetworkPolicy,
    pub observed: Vec<ObservedDestination>,
    /// Log entries the proposal was made from.
    pub entries: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidrs() {
        assert_eq!(
            parse_cidr("10.1.2.3"),
            Ok(("10.1.2.3".parse().unwrap(), 32))
        );
        assert_eq!(
            parse_cidr("10.1.2.3/8"),
            Ok(("10.0.0.0".parse().unwrap(), 8))
        );
        assert_eq!(parse_cidr("0.0.0.0/0"), Ok(("0.0.0.0".parse().unwrap(), 0)));
        assert!(parse_cidr("10.0.0.0/33").is_err());
        assert!(parse_cidr("example.com").unwrap_err().contains("domain"));
        assert!(parse_cidr("300.1.1.1").is_err());
        assert!(parse_cidr("::1").unwrap_err().contains("IPv6"));
        assert!(parse_cidr("300.1.1.1").is_err());
    }

    #[test]
    fn default_policy_allows_the_internet() {
        let p: NetworkPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(p, NetworkPolicy::default());
        assert!(p.allow_internet);
    }

    #[test]
    fn destinations() {
        assert_eq!(
            parse_destination("10.0.0.0/8"),
            Ok(Destination::Cidr("10.0.0.0".parse().unwrap(), 8))
        );
        assert_eq!(
            parse_destination("PyPI.org."),
            Ok(Destination::Domain("pypi.org".into()))
        );
        assert_eq!(
            parse_destination("*.example.com"),
            Ok(Destination::Wildcard("example.com".into()))
        );
        assert_eq!(parse_destination("@npm"), Ok(Destination::Group("npm")));
        assert!(parse_destination("@nope").unwrap_err().contains("@pypi"));
        for bad in [
            "exa mple.com",
            "localhost",
            "*.",
            "a..b",
            "-a.com",
            "1.2.3",
            "300.1.1.1",
            "::1",
            "*.*.a.com",
        ] {
            assert!(parse_destination(bad).is_err(), "{bad}");
        }
        let w = parse_destination("*.example.com").unwrap();
        assert!(w.matches_name("a.example.com"));
        assert!(w.matches_name("a.b.example.com"));
        assert!(!w.matches_name("example.com"));
        assert!(!w.matches_name("badexample.com"));
        assert!(parse_destination("*.internal")
            .unwrap()
            .matches_name("db.internal"));
        let g = parse_destination("@github").unwrap();
        assert!(g.matches_name("github.com"));
        assert!(g.matches_name("objects.githubusercontent.com"));
        assert!(!g.matches_name("github.com.evil.net"));
        let c = parse_destination("192.168.1.0/24").unwrap();
        assert!(c.contains("192.168.1.77".parse().unwrap()));
        assert!(!c.contains("192.168.2.1".parse().unwrap()));
        assert!(!c.matches_name("192.168.1.1"));
        let p = NetworkPolicy {
            allow_out: vec!["10.0.0.1".into(), "@pypi".into()],
            ..Default::default()
        };
        assert!(p.has_names());
        assert!(!NetworkPolicy::default().has_names());
        let audit: NetworkPolicy = serde_json::from_str(r#"{"mode":"audit"}"#).unwrap();
        assert_eq!(audit.mode, NetworkMode::Audit);
        assert_eq!(
            serde_json::to_string(&NetworkPolicy::default()).unwrap(),
            r#"{"allow_internet":true}"#
        );
    }
}
