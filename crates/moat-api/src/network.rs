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
    /// IPv4 addresses or CIDRs. Allow beats deny.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_out: Vec<String>,
    /// Destinations refused: IPv4 addresses or CIDRs (`0.0.0.0/0` refuses everything not allowed).
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
            format!("{s:?}: domain rules are not supported yet; give IPv4 addresses or CIDRs")
        } else {
            format!("{s:?} is not an IPv4 address or CIDR")
        }
    })?;
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Ok((std::net::Ipv4Addr::from(u32::from(ip) & mask), len))
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
        assert!(parse_cidr("::1").unwrap_err().contains("IPv6"));
        assert!(parse_cidr("300.1.1.1").is_err());
    }

    #[test]
    fn default_policy_allows_the_internet() {
        let p: NetworkPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(p, NetworkPolicy::default());
        assert!(p.allow_internet);
    }
}
