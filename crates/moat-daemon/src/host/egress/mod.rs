//! Egress decisions by name: every TCP connection of a sandbox goes through the daemon's transparent
//! proxy ([`proxy`]) and every DNS query through the daemon's resolver ([`dns`]); both ask
//! [`Egress::decide`] and send what happened to the connection log. Addresses alone are also enforced
//! by nftables (host/net.rs); this module is where names (TLS SNI, HTTP Host, DNS questions) are
//! checked. See docs/network.md.
//!
//! What a sandbox's slot holds is looked up in the daemon's state at each connection
//! ([`PolicySource`]), so a policy replaced live is in force for the next connection and nothing has to
//! be registered here.

pub mod dns;
pub mod intercept;
pub mod nflog;
pub mod proxy;
pub mod secrets;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use moat_api::{parse_destination, Destination, NetDecision, NetworkMode, NetworkPolicy};
use tokio::sync::mpsc;

use super::net::{NEVER, PRIVATE};

/// The sandbox holding a network slot, as the daemon's state knows it.
#[derive(Debug, Clone)]
pub struct SlotPolicy {
    pub sandbox_id: String,
    pub template: String,
    pub policy: NetworkPolicy,
    /// Its secrets (docs/secrets.md), when it has any.
    pub secrets: Option<Arc<secrets::SandboxSecrets>>,
}

/// Where the egress servers find who holds a slot (the daemon's database; a cluster's store later).
pub trait PolicySource: Send + Sync {
    fn by_slot(&self, slot: u32) -> Option<SlotPolicy>;
}

/// One connection attempt or DNS query, for the connection log.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub at_ms: i64,
    pub sandbox_id: String,
    pub template: String,
    pub protocol: &'static str,
    pub dst: Option<SocketAddrV4>,
    pub name: Option<String>,
    pub name_source: Option<String>,
    pub decision: NetDecision,
    pub rule: String,
    pub dialed: Option<SocketAddrV4>,
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub duration_ms: u64,
    pub error: Option<String>,
}

impl Event {
    /// An attempt of `sp`'s sandbox, now, decided by `rule`; nothing sent or received yet.
    pub fn new(
        sp: &SlotPolicy,
        protocol: &'static str,
        dst: Option<SocketAddrV4>,
        decision: NetDecision,
        rule: impl Into<String>,
    ) -> Event {
        Event {
            at_ms: now_ms(),
            sandbox_id: sp.sandbox_id.clone(),
            template: sp.template.clone(),
            protocol,
            dst,
            name: None,
            name_source: None,
            decision,
            rule: rule.into(),
            dialed: None,
            bytes_out: 0,
            bytes_in: 0,
            duration_ms: 0,
            error: None,
        }
    }
}

/// What [`Egress::decide`] concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub decision: NetDecision,
    /// The rule that decided, as the log shows it (`allow_out[1]`, `private range`, ...).
    pub rule: String,
    /// Connect to the name (resolved by the daemon) rather than the address the sandbox asked for.
    pub dial_name: bool,
}

impl Verdict {
    pub fn allowed(&self) -> bool {
        self.decision != NetDecision::Deny
    }
}

/// The daemon-wide deny list (`--deny-list`): addresses for nftables, names for the proxy and resolver.
#[derive(Debug, Clone, Default)]
pub struct DenyList {
    pub entries: Vec<Destination>,
}

impl DenyList {
    fn name_rule(&self, name: &str) -> bool {
        self.entries.iter().any(|d| d.matches_name(name))
    }
    fn has_ip(&self, ip: Ipv4Addr) -> bool {
        self.entries.iter().any(|d| d.contains(ip))
    }
    pub fn has_names(&self) -> bool {
        self.entries.iter().any(|d| d.is_name())
    }
}

/// The never-reached and private ranges of host/net.rs, parsed once (they are checked at every
/// connection and question).
static NEVER_NETS: std::sync::LazyLock<Vec<Destination>> =
    std::sync::LazyLock::new(|| parse_all(NEVER));
static PRIVATE_NETS: std::sync::LazyLock<Vec<Destination>> =
    std::sync::LazyLock::new(|| parse_all(PRIVATE));

fn parse_all(list: &[&str]) -> Vec<Destination> {
    list.iter()
        .filter_map(|s| parse_destination(s).ok())
        .collect()
}

/// Whether the address is one no sandbox ever reaches (whatever the policy): "this" network, loopback,
/// link-local (cloud metadata), multicast and reserved, the sandbox subnet.
pub fn never(ip: Ipv4Addr, subnet: (Ipv4Addr, u8)) -> bool {
    NEVER_NETS.iter().any(|d| d.contains(ip))
        || Destination::Cidr(subnet.0, subnet.1).contains(ip)
        || ip.is_broadcast()
}

pub fn private(ip: Ipv4Addr) -> bool {
    PRIVATE_NETS.iter().any(|d| d.contains(ip))
}

/// The policy's entries, parsed (entries were checked when the policy was set; a bad one matches
/// nothing).
fn entries(list: &[String]) -> impl Iterator<Item = (usize, Destination)> + '_ {
    list.iter()
        .enumerate()
        .filter_map(|(i, e)| parse_destination(e).ok().map(|d| (i, d)))
}

/// Whether an address or CIDR entry of the policy's `allow_out` contains `ip`.
pub fn allowed_by_cidr(policy: &NetworkPolicy, ip: Ipv4Addr) -> bool {
    entries(&policy.allow_out).any(|(_, d)| d.contains(ip))
}

/// Decides a connection to `ip` (None for a DNS query) carrying `name` (SNI, Host or the DNS
/// question; None when there is none). First match wins:
/// 0. always blocked (never-reached addresses, the daemon-wide deny list) → deny, in every mode;
/// 1. a name entry of `allow_out` matching the name → allow (connect to the name);
/// 2. a CIDR of `allow_out` containing the address → allow;
/// 3. a name entry of `deny_out` → deny; 4. a CIDR of `deny_out` → deny;
/// 5. `allow_internet: false` → deny; 6. a private address → deny; 7. allow.
///
/// In `audit` mode, denials of steps 3–5 become `audit` (let through, logged); private addresses
/// stay refused.
pub fn decide(
    policy: &NetworkPolicy,
    deny: &DenyList,
    subnet: (Ipv4Addr, u8),
    ip: Option<Ipv4Addr>,
    name: Option<&str>,
) -> Verdict {
    let names_matter = policy.has_names() || deny.has_names();
    let v = |decision, rule: String, dial_name| Verdict {
        decision,
        rule,
        dial_name,
    };
    if let Some(ip) = ip {
        if never(ip, subnet) {
            return v(NetDecision::Deny, "always blocked".into(), false);
        }
        if deny.has_ip(ip) {
            return v(NetDecision::Deny, "deny list".into(), false);
        }
    }
    if let Some(n) = name {
        if deny.name_rule(n) {
            return v(NetDecision::Deny, "deny list".into(), false);
        }
        if let Some((i, _)) = entries(&policy.allow_out).find(|(_, d)| d.matches_name(n)) {
            return v(NetDecision::Allow, format!("allow_out[{i}]"), true);
        }
    }
    if let Some(ip) = ip {
        if let Some((i, _)) = entries(&policy.allow_out).find(|(_, d)| d.contains(ip)) {
            return v(NetDecision::Allow, format!("allow_out[{i}]"), false);
        }
    }
    let refuse = |rule: String| {
        let decision = match policy.mode {
            NetworkMode::Enforce => NetDecision::Deny,
            NetworkMode::Audit => NetDecision::Audit,
        };
        v(decision, rule, name.is_some() && names_matter)
    };
    if let Some(n) = name {
        if let Some((i, _)) = entries(&policy.deny_out).find(|(_, d)| d.matches_name(n)) {
            return refuse(format!("deny_out[{i}]"));
        }
    }
    if let Some(ip) = ip {
        if let Some((i, _)) = entries(&policy.deny_out).find(|(_, d)| d.contains(ip)) {
            return refuse(format!("deny_out[{i}]"));
        }
    }
    if !policy.allow_internet {
        return refuse("allow_internet: false".into());
    }
    if ip.is_some_and(private) {
        // Private ranges stay closed in audit mode too: they are opened by naming them only.
        return v(NetDecision::Deny, "private range".into(), false);
    }
    v(
        NetDecision::Allow,
        "allow_internet".into(),
        name.is_some() && names_matter,
    )
}

/// The shared state of the proxy and the resolver.
pub struct Egress {
    subnet: (Ipv4Addr, u8),
    upstream: SocketAddr,
    source: Arc<dyn PolicySource>,
    /// Swapped whole on reload; readers take the `Arc` (a threat feed may be large: never copied).
    deny: RwLock<Arc<DenyList>>,
    events: mpsc::Sender<Event>,
    /// Per slot, TCP connections open through the proxy and DNS questions being forwarded: each holds
    /// file descriptors of the daemon, which a hostile sandbox must not exhaust for everyone.
    inflight: std::sync::Mutex<std::collections::HashMap<(u32, Kind), usize>>,
    limits: Limits,
    /// How the proxy verifies a secret's host when it connects to it: the host's trust roots and
    /// `--egress-ca-file` (made at first use).
    upstream_tls: std::sync::OnceLock<Arc<rustls::ClientConfig>>,
    extra_roots: RwLock<Option<std::path::PathBuf>>,
    /// Where a placeholder headed to the wrong host is reported (the daemon acts on its policy).
    violations: std::sync::OnceLock<mpsc::UnboundedSender<(String, intercept::Violation)>>,
}

/// What a sandbox holds open in the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Tcp,
    Dns,
}

/// How much of the daemon one sandbox may hold at once.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// TCP connections open through the proxy, per sandbox.
    pub connections: usize,
    /// DNS questions being forwarded upstream, per sandbox.
    pub dns: usize,
    /// TCP connections open through the proxy, all sandboxes together (what the daemon's file
    /// descriptors allow, keeping room for its API and sandboxes).
    pub total: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        let nofile = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .map(|(soft, _)| soft as usize)
            .unwrap_or(1024);
        Limits {
            connections: 1024,
            dns: 64,
            // Two descriptors per connection; half of them for everything else.
            total: (nofile / 4).max(64),
        }
    }
}

/// One unit of a sandbox's share (a connection, a question in flight); returned on drop.
pub struct Held<'a> {
    egress: &'a Egress,
    key: (u32, Kind),
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut m = self
            .egress
            .inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

/// How long a name lookup of the daemon's own (for the proxy) may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

impl Egress {
    pub fn new(
        subnet: (Ipv4Addr, u8),
        upstream: SocketAddr,
        source: Arc<dyn PolicySource>,
        deny: DenyList,
        events: mpsc::Sender<Event>,
        limits: Limits,
    ) -> Arc<Egress> {
        Arc::new(Egress {
            subnet,
            upstream,
            source,
            deny: RwLock::new(Arc::new(deny)),
            events,
            inflight: Default::default(),
            limits,
            upstream_tls: Default::default(),
            extra_roots: RwLock::new(None),
            violations: Default::default(),
        })
    }

    /// Roots trusted, besides the host's, for a secret's host (`--egress-ca-file`; set before the
    /// first connection).
    pub fn set_extra_roots(&self, path: Option<std::path::PathBuf>) {
        *self.extra_roots.write().unwrap_or_else(|e| e.into_inner()) = path;
    }

    /// The TLS client configuration the proxy uses towards a secret's host.
    pub fn upstream_tls(&self) -> Arc<rustls::ClientConfig> {
        self.upstream_tls
            .get_or_init(|| {
                let extra = self
                    .extra_roots
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                Arc::new(upstream_tls(extra.as_deref()))
            })
            .clone()
    }

    /// Where violations go (set once by the daemon).
    pub fn set_violation_sink(&self, tx: mpsc::UnboundedSender<(String, intercept::Violation)>) {
        let _ = self.violations.set(tx);
    }

    /// Reports a placeholder of `sandbox` headed where it does not belong.
    pub fn violated(&self, sandbox: &str, v: intercept::Violation) {
        tracing::warn!(sandbox, secret = %v.secret, host = %v.host, place = v.place,
            "a secret's placeholder headed to a host it does not belong to: refused");
        if let Some(tx) = self.violations.get() {
            let _ = tx.send((sandbox.to_string(), v));
        }
    }

    /// Takes one unit of a sandbox's share of `kind`, or None when it holds its limit already.
    pub fn hold(&self, peer: SocketAddr, kind: Kind) -> Option<Held<'_>> {
        let SocketAddr::V4(p) = peer else {
            return None;
        };
        let slot = self.slot_of(*p.ip())?;
        let max = match kind {
            Kind::Tcp => self.limits.connections,
            Kind::Dns => self.limits.dns,
        };
        let mut m = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        if kind == Kind::Tcp
            && m.iter()
                .filter(|(k, _)| k.1 == Kind::Tcp)
                .map(|(_, n)| n)
                .sum::<usize>()
                >= self.limits.total
        {
            return None;
        }
        let n = m.entry((slot, kind)).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Held {
            egress: self,
            key: (slot, kind),
        })
    }

    /// Sends an event without waiting; false when the log's queue is full (the event is dropped).
    pub fn try_log(&self, e: Event) -> bool {
        self.events.try_send(e).is_ok()
    }

    pub fn set_deny_list(&self, deny: DenyList) {
        *self.deny.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(deny);
    }

    fn deny_list(&self) -> Arc<DenyList> {
        self.deny.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The slot a peer address belongs to: only a sandbox's own address (`.2` of its /30) counts.
    pub fn slot_of(&self, peer: Ipv4Addr) -> Option<u32> {
        let (base, len) = self.subnet;
        let off = u32::from(peer).checked_sub(u32::from(base))?;
        (off < (1u64 << (32 - len as u32)) as u32 && off % 4 == 2).then_some(off / 4)
    }

    /// Who is behind a peer address, or None (not a sandbox, or a slot no sandbox holds).
    pub fn sandbox(&self, peer: SocketAddr) -> Option<SlotPolicy> {
        let SocketAddr::V4(p) = peer else {
            return None;
        };
        self.source.by_slot(self.slot_of(*p.ip())?)
    }

    pub fn decide(&self, sp: &SlotPolicy, ip: Option<Ipv4Addr>, name: Option<&str>) -> Verdict {
        decide(&sp.policy, &self.deny_list(), self.subnet, ip, name)
    }

    /// Why the daemon may not connect to `ip` on behalf of the sandbox (after resolving a name it
    /// asked for): the never-reached ranges, the host's own addresses, the deny list, and private
    /// ranges unless a CIDR of the sandbox's `allow_out` names them. None when it may.
    pub fn undialable(&self, policy: &NetworkPolicy, ip: Ipv4Addr) -> Option<&'static str> {
        if never(ip, self.subnet) || ip.is_unspecified() || local_addresses().contains(&ip) {
            return Some("always blocked");
        }
        if self.deny_list().has_ip(ip) {
            return Some("deny list");
        }
        if private(ip) && !allowed_by_cidr(policy, ip) {
            return Some("private range");
        }
        None
    }

    /// Resolves a name's IPv4 addresses through the upstream resolver.
    pub async fn lookup(&self, name: &str) -> anyhow::Result<Vec<Ipv4Addr>> {
        tokio::time::timeout(LOOKUP_TIMEOUT, dns::lookup_a(self.upstream, name))
            .await
            .map_err(|_| anyhow::anyhow!("looking up {name} timed out"))?
    }

    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Sends an event to the connection log (waits when the log's queue is full: nothing is lost).
    pub async fn log(&self, e: Event) {
        let _ = self.events.send(e).await;
    }
}

/// Trust roots for a secret's host: the host's own store (`SSL_CERT_FILE`/`SSL_CERT_DIR` honoured)
/// and the PEM certificates of `extra`.
fn upstream_tls(extra: Option<&std::path::Path>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for e in &native.errors {
        tracing::warn!("egress trust roots: {e}");
    }
    let (added, _) = roots.add_parsable_certificates(native.certs);
    let mut extra_n = 0;
    if let Some(p) = extra {
        match std::fs::read(p) {
            Ok(pem) => {
                let certs: Vec<_> = rustls::pki_types::pem::PemObject::pem_slice_iter(&pem)
                    .filter_map(Result::ok)
                    .collect();
                extra_n = roots.add_parsable_certificates(certs).0;
            }
            Err(e) => tracing::error!(path = %p.display(), "--egress-ca-file: {e}"),
        }
    }
    tracing::debug!(system = added, extra = extra_n, "egress trust roots");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// The host's own IPv4 addresses (a name a sandbox asks for must not lead the proxy to the host).
fn local_addresses() -> Vec<Ipv4Addr> {
    nix::ifaddrs::getifaddrs()
        .map(|it| {
            it.filter_map(|i| i.address)
                .filter_map(|a| a.as_sockaddr_in().map(|s| s.ip()))
                .collect()
        })
        .unwrap_or_default()
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SUBNET: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 200, 0, 0), 16);

    fn ip(s: &str) -> Option<Ipv4Addr> {
        Some(s.parse().unwrap())
    }

    fn pol(allow_internet: bool, allow: &[&str], deny: &[&str]) -> NetworkPolicy {
        NetworkPolicy {
            allow_internet,
            allow_out: allow.iter().map(|s| s.to_string()).collect(),
            deny_out: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn rule(p: &NetworkPolicy, a: Option<Ipv4Addr>, n: Option<&str>) -> (NetDecision, String) {
        let v = decide(p, &DenyList::default(), SUBNET, a, n);
        (v.decision, v.rule)
    }

    use NetDecision::*;

    #[test]
    fn allow_list_of_names() {
        let p = pol(false, &["pypi.org", "*.example.com", "@npm"], &[]);
        assert_eq!(
            rule(&p, ip("203.0.113.9"), Some("pypi.org")),
            (Allow, "allow_out[0]".into())
        );
        assert_eq!(
            rule(&p, None, Some("a.example.com")),
            (Allow, "allow_out[1]".into())
        );
        assert_eq!(
            rule(&p, None, Some("registry.npmjs.org")),
            (Allow, "allow_out[2]".into())
        );
        // Not listed, no name, or an address without a name: internet is off.
        for (a, n) in [
            (None, Some("example.com")),
            (ip("203.0.113.9"), None),
            (ip("203.0.113.9"), Some("evil.net")),
        ] {
            assert_eq!(rule(&p, a, n), (Deny, "allow_internet: false".into()));
        }
        // A name that is allowed is dialed by name (the proxy ignores the address asked for).
        assert!(
            decide(
                &p,
                &DenyList::default(),
                SUBNET,
                ip("203.0.113.66"),
                Some("pypi.org")
            )
            .dial_name
        );
    }

    #[test]
    fn deny_names_and_precedence() {
        let p = pol(
            true,
            &["10.1.0.0/16", "good.example"],
            &["*.evil.example", "0.0.0.0/0"],
        );
        // Allow beats deny, names and CIDRs alike.
        assert_eq!(
            rule(&p, ip("10.1.2.3"), None),
            (Allow, "allow_out[0]".into())
        );
        assert_eq!(
            rule(&p, ip("203.0.113.1"), Some("good.example")),
            (Allow, "allow_out[1]".into())
        );
        assert_eq!(
            rule(&p, ip("10.1.2.3"), Some("x.evil.example")),
            (Allow, "allow_out[0]".into())
        );
        assert_eq!(
            rule(&p, ip("203.0.113.1"), Some("x.evil.example")),
            (Deny, "deny_out[0]".into())
        );
        assert_eq!(
            rule(&p, ip("203.0.113.1"), None),
            (Deny, "deny_out[1]".into())
        );
        // Private ranges need an allow; the never-reached ones cannot be allowed.
        let open = pol(true, &["169.254.169.254", "192.168.0.0/16"], &[]);
        assert_eq!(
            rule(&open, ip("10.9.9.9"), None),
            (Deny, "private range".into())
        );
        assert_eq!(
            rule(&open, ip("192.168.3.3"), None),
            (Allow, "allow_out[1]".into())
        );
        for never in ["169.254.169.254", "127.0.0.1", "10.200.0.6", "224.0.0.1"] {
            assert_eq!(
                rule(&open, ip(never), None),
                (Deny, "always blocked".into()),
                "{never}"
            );
        }
        assert_eq!(
            rule(&open, ip("198.51.100.1"), None),
            (Allow, "allow_internet".into())
        );
    }

    #[test]
    fn audit_mode_and_deny_list() {
        let mut p = pol(false, &[], &[]);
        p.mode = NetworkMode::Audit;
        assert_eq!(
            rule(&p, ip("198.51.100.1"), None),
            (Audit, "allow_internet: false".into())
        );
        assert_eq!(
            rule(&p, ip("169.254.169.254"), None),
            (Deny, "always blocked".into())
        );
        let deny = DenyList {
            entries: vec![
                parse_destination("203.0.113.0/24").unwrap(),
                parse_destination("*.bad.example").unwrap(),
            ],
        };
        let open = pol(true, &["203.0.113.7", "x.bad.example"], &[]);
        for (a, n) in [(ip("203.0.113.7"), None), (None, Some("x.bad.example"))] {
            let v = decide(&open, &deny, SUBNET, a, n);
            assert_eq!((v.decision, v.rule.as_str()), (Deny, "deny list"));
        }
        // A deny list of names makes every named connection dial its name.
        assert!(
            decide(
                &pol(true, &[], &[]),
                &deny,
                SUBNET,
                ip("198.51.100.1"),
                Some("ok.example")
            )
            .dial_name
        );
        assert!(
            !decide(
                &pol(true, &[], &[]),
                &DenyList::default(),
                SUBNET,
                ip("198.51.100.1"),
                Some("ok.example")
            )
            .dial_name
        );
    }

    struct None_;
    impl PolicySource for None_ {
        fn by_slot(&self, _: u32) -> Option<SlotPolicy> {
            None
        }
    }

    #[test]
    fn slots_from_peer_addresses() {
        let (tx, _rx) = mpsc::channel(1);
        let e = Egress::new(
            SUBNET,
            "127.0.0.1:53".parse().unwrap(),
            Arc::new(None_),
            DenyList::default(),
            tx,
            Limits {
                connections: 2,
                dns: 1,
                total: 3,
            },
        );
        assert_eq!(e.slot_of("10.200.0.2".parse().unwrap()), Some(0));
        // Each sandbox's share of the daemon is bounded and comes back when released.
        let a: SocketAddr = "10.200.0.2:1000".parse().unwrap();
        let b: SocketAddr = "10.200.0.6:1000".parse().unwrap();
        let (h1, h2) = (e.hold(a, Kind::Tcp), e.hold(a, Kind::Tcp));
        assert!(h1.is_some() && h2.is_some());
        assert!(e.hold(a, Kind::Tcp).is_none());
        let hb = e.hold(b, Kind::Tcp);
        assert!(hb.is_some(), "another sandbox has its own share");
        // ... within the daemon's total.
        assert!(e.hold(b, Kind::Tcp).is_none());
        assert!(e.hold(a, Kind::Dns).is_some());
        drop(hb);
        drop(h1);
        assert!(e.hold(a, Kind::Tcp).is_some());
        drop(h2);
        assert!(e.inflight.lock().unwrap().is_empty());
        assert_eq!(e.slot_of("10.200.1.6".parse().unwrap()), Some(65));
        // Gateways, network and broadcast addresses, and addresses outside the subnet are nobody's.
        for other in ["10.200.0.1", "10.200.0.3", "10.201.0.2", "10.199.255.254"] {
            assert_eq!(e.slot_of(other.parse().unwrap()), None, "{other}");
        }
        let p = NetworkPolicy::default();
        assert_eq!(
            e.undialable(&p, "127.0.0.1".parse().unwrap()),
            Some("always blocked")
        );
        assert_eq!(
            e.undialable(&p, "10.0.0.1".parse().unwrap()),
            Some("private range")
        );
        assert_eq!(e.undialable(&p, "198.51.100.1".parse().unwrap()), None);
        let allowed = pol(true, &["10.0.0.0/8"], &[]);
        assert_eq!(e.undialable(&allowed, "10.0.0.1".parse().unwrap()), None);
    }
}
