//! Sandbox networking: one veth pair per sandbox (no bridge: sandboxes share no link), a /30 per
//! sandbox from the daemon's subnet, NAT out of the host, DNS redirected to the daemon's upstream
//! resolver, and an nftables table that enforces what each sandbox may reach. See docs/network.md.
//!
//! The table (`inet moat_<hash>`, one per data dir) is written in one `nft -f` transaction at start-up
//! (with a chain per live sandbox) and changed per sandbox by small transactions, so the rules are never
//! half there. It stays in the kernel while the daemon is down: sandboxes that outlive the daemon stay
//! confined. Host-side interfaces are named `<prefix>h<slot>`; the sweep removes those of slots no
//! sandbox holds.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use moat_api::{parse_cidr, parse_destination, Destination, NetworkMode, NetworkPolicy};

/// Destinations no sandbox ever reaches: "this" network, loopback, link-local (cloud metadata at
/// 169.254.169.254), multicast and reserved, broadcast.
pub const NEVER: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];
/// Private ranges, refused unless a sandbox's `allow_out` names them: RFC 1918, CGNAT (RFC 6598),
/// benchmarking (RFC 2544), IETF protocol assignments.
pub const PRIVATE: &[&str] = &[
    "10.0.0.0/8",
    "100.64.0.0/10",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
];

#[derive(Debug, Clone)]
pub struct Network {
    /// Interface name prefix, `mt` + 4 hex digits of the data dir's hash.
    prefix: String,
    table: String,
    subnet: Ipv4Addr,
    subnet_len: u8,
    /// Masquerade only out of this interface; None: out of any interface that is not a sandbox's.
    uplink: Option<String>,
    dns: Ipv4Addr,
    /// Ports of the daemon's resolver (UDP and TCP) and transparent TCP proxy (host/egress), which
    /// every DNS packet and TCP connection of a sandbox is redirected to.
    dns_port: u16,
    proxy_port: u16,
    /// NFLOG group of the connection log's nft `log` statements (from the data dir's hash, so two
    /// daemons in one network namespace do not share one).
    log_group: u16,
    /// Slots whose interface has a chain of its own in `by_if`; the others (the default policy) use
    /// the shared `sbx_default` chain, so a sandbox with the default policy costs no nft transaction.
    custom: std::sync::Arc<std::sync::Mutex<std::collections::HashSet<u32>>>,
    /// Daemon-wide deny lists (`--deny-list`): files of IPv4 addresses and CIDRs no sandbox reaches,
    /// whatever its own policy allows; re-read on change.
    deny_files: Vec<PathBuf>,
}

/// Parses a deny-list file: one IPv4 address, CIDR, domain or `*.domain` per line, `#` starts a
/// comment, blank lines are skipped. IPv6 entries are skipped (sandboxes have no IPv6 route at all);
/// anything else is an error naming the file and line.
pub fn parse_deny_list(text: &str, file: &str) -> Result<Vec<Destination>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let entry = line.split('#').next().unwrap_or("").trim();
        if entry.is_empty() {
            continue;
        }
        let addr = entry.split('/').next().unwrap_or("");
        if addr.parse::<std::net::Ipv6Addr>().is_ok() {
            continue;
        }
        if entry.starts_with('@') {
            bail!("{file}:{}: groups are not allowed in a deny list", n + 1);
        }
        out.push(parse_destination(entry).map_err(|m| anyhow!("{file}:{}: {m}", n + 1))?);
    }
    Ok(out)
}

/// Runs a program with `input` on stdin; the error carries its stderr.
fn run(argv: &[&str], input: &str) -> Result<()> {
    let mut child = Command::new(argv[0])
        .args(&argv[1..])
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("run {}", argv[0]))?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow!("no stdin"))?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "{}: {}",
            argv.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Interfaces of this process's network namespace (from /proc/net/dev: /sys/class/net shows the
/// namespace of whoever mounted /sys, which for a daemon started with `nsenter --net` is another).
fn interfaces() -> Vec<String> {
    std::fs::read_to_string("/proc/net/dev")
        .unwrap_or_default()
        .lines()
        .skip(2)
        .filter_map(|l| l.split(':').next().map(|n| n.trim().to_string()))
        .collect()
}

/// The first IPv4 nameserver of a resolv.conf that is not on loopback.
pub fn upstream_dns(resolv_conf: &str) -> Option<Ipv4Addr> {
    resolv_conf
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .find(|a| !a.is_loopback())
}

/// The interface of the default route (the uplink), from /proc/net/route.
pub fn default_route_interface() -> Option<String> {
    let t = std::fs::read_to_string("/proc/net/route").ok()?;
    t.lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() > 2 && f[1] == "00000000")
        .map(|f| f[0].to_string())
}

impl Network {
    pub fn new(
        id_hash: &str,
        subnet: &str,
        uplink: Option<String>,
        dns: Ipv4Addr,
        slots: u32,
    ) -> Result<Network> {
        let (base, len) = parse_cidr(subnet).map_err(|e| anyhow!("--subnet: {e}"))?;
        let have = 1u64 << (32 - len as u32);
        if have < slots as u64 * 4 {
            bail!("--subnet {subnet} is too small: {slots} sandboxes need a /30 each (a /{} or larger)", 32 - (slots as u64 * 4).next_power_of_two().trailing_zeros());
        }
        if let Some(u) = &uplink {
            if u.is_empty()
                || u.len() > 15
                || !u
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
            {
                bail!("--uplink {u:?} is not an interface name");
            }
        }
        let h = &id_hash[..4];
        Ok(Network {
            prefix: format!("mt{h}"),
            table: format!("moat_{h}"),
            subnet: base,
            subnet_len: len,
            uplink,
            dns,
            dns_port: 53,
            proxy_port: 0,
            log_group: id_hash
                .get(4..8)
                .and_then(|h| u16::from_str_radix(h, 16).ok())
                .unwrap_or(1)
                .max(1),
            custom: Default::default(),
            deny_files: Vec::new(),
        })
    }

    /// Adds daemon-wide deny-list files; each is read now, so a missing or malformed one stops the
    /// daemon from starting with a clear error.
    pub fn with_deny_files(mut self, files: Vec<PathBuf>) -> Result<Network> {
        self.deny_files = files;
        self.deny_list()?;
        Ok(self)
    }

    /// Where the daemon's resolver and TCP proxy listen (host/egress).
    pub fn with_ports(mut self, dns_port: u16, proxy_port: u16) -> Network {
        self.dns_port = dns_port;
        self.proxy_port = proxy_port;
        self
    }

    /// The upstream resolver sandboxes' questions are forwarded to.
    pub fn upstream_dns(&self) -> Ipv4Addr {
        self.dns
    }

    pub fn subnet(&self) -> (Ipv4Addr, u8) {
        (self.subnet, self.subnet_len)
    }

    pub fn deny_files(&self) -> &[PathBuf] {
        &self.deny_files
    }

    /// The entries of every deny-list file, as they are now.
    pub fn deny_list(&self) -> Result<Vec<Destination>> {
        let mut all = Vec::new();
        for f in &self.deny_files {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("--deny-list {}", f.display()))?;
            all.extend(parse_deny_list(&text, &f.display().to_string())?);
        }
        Ok(all)
    }

    /// The addresses of a deny list, as nftables set elements (names are the proxy's and resolver's).
    fn deny_cidrs(list: &[Destination]) -> Vec<String> {
        list.iter()
            .filter_map(|d| match d {
                Destination::Cidr(a, l) => Some(format!("{a}/{l}")),
                _ => None,
            })
            .collect()
    }

    fn deny_elements(list: &[Destination]) -> String {
        let cidrs = Self::deny_cidrs(list);
        if cidrs.is_empty() {
            String::new()
        } else {
            format!(" elements = {{ {} }};", cidrs.join(", "))
        }
    }

    /// Re-reads the deny-list files and swaps the set's contents in one transaction. The egress
    /// chain sees every outgoing packet, so connections already open to a newly denied address are
    /// cut too. Returns the entries now in force (the names are for the proxy and resolver).
    pub fn reload_deny_list(&self) -> Result<Vec<Destination>> {
        let list = self.deny_list()?;
        let cidrs = Self::deny_cidrs(&list);
        let t = &self.table;
        let mut s = format!("flush set inet {t} deny4\n");
        if !cidrs.is_empty() {
            s.push_str(&format!(
                "add element inet {t} deny4 {{ {} }}\n",
                cidrs.join(", ")
            ));
        }
        run(&["nft", "-f", "-"], &s).context("load the deny list")?;
        Ok(list)
    }

    /// Host-side (gateway) and sandbox addresses of a slot's /30.
    pub fn addresses(&self, slot: u32) -> (Ipv4Addr, Ipv4Addr) {
        let base = u32::from(self.subnet) + slot * 4;
        (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
    }

    pub fn host_if(&self, slot: u32) -> String {
        format!("{}h{slot}", self.prefix)
    }

    fn chain(slot: u32) -> String {
        format!("sbx_{slot}")
    }

    /// The whole table: base chains plus one policy chain per live sandbox (slot → policy).
    ///
    /// A packet from a sandbox meets, in order: `guard` (prerouting, before any address is rewritten):
    /// spoofed sources dropped, IPv6 dropped, DNS let on to the resolver, the never-reached ranges,
    /// the deny list and the host's own addresses refused, then the sandbox's own chain (rate limits;
    /// TCP on to the proxy; other protocols by the policy's CIDRs); `prerouting` (nat): DNS
    /// redirected to the daemon's resolver, TCP to its proxy; `input`: only those two ports open to
    /// sandboxes, and to nobody else; `forward`: no TCP (the proxy carries it); `postrouting`: NAT.
    pub fn ruleset(&self, live: &BTreeMap<u32, NetworkPolicy>) -> Result<String> {
        let p = &self.prefix;
        let t = &self.table;
        let mut never: Vec<String> = NEVER.iter().map(|s| s.to_string()).collect();
        never.push(format!("{}/{}", self.subnet, self.subnet_len));
        let masq = match &self.uplink {
            Some(u) => format!("iifname \"{p}h*\" oifname \"{u}\" masquerade"),
            None => format!("iifname \"{p}h*\" oifname != \"{p}h*\" masquerade"),
        };
        let (dns, proxy) = (self.dns_port, self.proxy_port);
        let mut s = format!(
            "table inet {t} {{}}\ndelete table inet {t}\ntable inet {t} {{\n\
             \tset never4 {{ type ipv4_addr; flags interval; elements = {{ {never} }} }}\n\
             \tset private4 {{ type ipv4_addr; flags interval; elements = {{ {private} }} }}\n\
             \tset deny4 {{ type ipv4_addr; flags interval; auto-merge;{deny} }}\n\
             \tmap by_if {{ type ifname : verdict; }}\n\
             \tchain sbx_default {{}}\n\
             \tchain guard {{ type filter hook prerouting priority -150; policy accept;\n\
             \t\tiifname != \"{p}h*\" return\n\
             \t\tfib saddr . iif oif missing drop\n\
             \t\tmeta nfproto ipv6 drop\n\
             \t\tmeta l4proto {{ tcp, udp }} th dport 53 accept\n\
             \t\tip daddr @never4 {log_never} reject\n\
             \t\tip daddr @deny4 {log_deny} reject\n\
             \t\tfib daddr type local {log_never} reject\n\
             \t\tiifname vmap @by_if\n\
             \t\tjump sbx_default\n\t}}\n\
             \tchain input {{ type filter hook input priority filter - 5; policy accept;\n\
             \t\tiifname \"{p}h*\" ct state established,related accept\n\
             \t\tiifname \"{p}h*\" ct status dnat meta l4proto {{ tcp, udp }} th dport {dns} accept\n\
             \t\tiifname \"{p}h*\" ct status dnat tcp dport {proxy} accept\n\
             \t\tiifname \"{p}h*\" reject\n\
             \t\tct state new udp dport {dns} reject\n\
             \t\tct state new tcp dport {{ {dns}, {proxy} }} reject\n\t}}\n\
             \tchain forward {{ type filter hook forward priority filter - 5; policy accept;\n\
             \t\toifname \"{p}h*\" ct state established,related accept\n\
             \t\toifname \"{p}h*\" reject\n\
             \t\tiifname \"{p}h*\" meta l4proto tcp reject\n\
             \t\tiifname \"{p}h*\" meta nfproto ipv6 reject\n\
             \t\tiifname \"{p}h*\" ip daddr @never4 reject\n\
             \t\tiifname \"{p}h*\" ip daddr @deny4 reject\n\t}}\n\
             \tchain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n\
             \t\tiifname \"{p}h*\" meta l4proto {{ tcp, udp }} th dport 53 redirect to :{dns}\n\
             \t\tiifname \"{p}h*\" meta l4proto tcp redirect to :{proxy}\n\t}}\n\
             \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n\
             \t\t{masq}\n\t}}\n}}\n",
            never = never.join(", "),
            private = PRIVATE.join(", "),
            deny = Self::deny_elements(&self.deny_list()?),
            log_never = self.log("D", "always blocked"),
            log_deny = self.log("D", "deny list"),
        );
        s.push_str(&self.chain_commands("sbx_default", &NetworkPolicy::default())?);
        for (slot, policy) in live {
            s.push_str(&self.policy_commands(*slot, policy)?);
        }
        Ok(s)
    }

    /// nft commands that (re)make a slot's policy chain and point its interface at it. TCP is
    /// accepted here for the proxy, which applies the whole policy (names included) and logs; the
    /// CIDRs of the policy decide the other protocols.
    fn policy_commands(&self, slot: u32, policy: &NetworkPolicy) -> Result<String> {
        let t = &self.table;
        let c = Self::chain(slot);
        let mut s = self.chain_commands(&c, policy)?;
        s.push_str(&format!(
            "add element inet {t} by_if {{ \"{}\" : jump {c} }}\n",
            self.host_if(slot)
        ));
        Ok(s)
    }

    /// nft commands that (re)make chain `c` with `policy`'s rules.
    fn chain_commands(&self, c: &str, policy: &NetworkPolicy) -> Result<String> {
        let t = &self.table;
        let cidrs = |list: &[String]| -> Result<Vec<(usize, String)>> {
            let mut v = Vec::new();
            for (i, e) in list.iter().enumerate() {
                if let Destination::Cidr(a, l) = parse_destination(e).map_err(|m| anyhow!(m))? {
                    v.push((i, format!("{a}/{l}")));
                }
            }
            Ok(v)
        };
        let enforce = policy.mode == NetworkMode::Enforce;
        // What a refusal of the policy's own rules does in this mode: refuse and log `D`, or (audit)
        // log `U` once per flow and let it through.
        let refuse = |rule: &str| {
            if enforce {
                format!("{} reject", self.log("D", rule))
            } else {
                format!("ct state new {} accept", self.log("U", rule))
            }
        };
        let mut s = format!("add chain inet {t} {c}\nflush chain inet {t} {c}\n");
        let mut rule = |r: &str| s.push_str(&format!("add rule inet {t} {c} {r}\n"));
        if let Some(n) = policy.connections_per_second {
            rule(&format!(
                "ct state new limit rate over {n}/second burst {n} packets {} reject",
                self.log("D", "connections_per_second")
            ));
        }
        if let Some(mbps) = policy.egress_mbps {
            // 1 Mbit/s = 125 kbytes/s; a burst of a tenth of a second (at least 64 KiB).
            let kbytes = mbps as u64 * 125;
            rule(&format!(
                "limit rate over {kbytes} kbytes/second burst {} kbytes drop",
                (kbytes / 10).max(64)
            ));
        }
        // TCP: the proxy decides and logs.
        rule("meta l4proto tcp accept");
        if policy.has_names() && enforce {
            // QUIC (HTTP/3) carries its name where nftables cannot check it: clients fall back to
            // TCP, where the proxy does.
            rule(&format!(
                "udp dport 443 {} reject",
                self.log("D", "quic (names are checked on TCP)")
            ));
        }
        for (i, cidr) in cidrs(&policy.allow_out)? {
            rule(&format!(
                "ip daddr {cidr} ct state new {} accept",
                self.log("A", &format!("allow_out[{i}]"))
            ));
            rule(&format!("ip daddr {cidr} accept"));
        }
        for (i, cidr) in cidrs(&policy.deny_out)? {
            rule(&format!(
                "ip daddr {cidr} {}",
                refuse(&format!("deny_out[{i}]"))
            ));
        }
        if !policy.allow_internet {
            rule(&refuse("allow_internet: false"));
        }
        rule(&format!(
            "ip daddr @private4 {} reject",
            self.log("D", "private range")
        ));
        rule(&format!(
            "ct state new {} accept",
            self.log("A", "allow_internet")
        ));
        rule("accept");
        Ok(s)
    }

    /// An nft `log` statement sending the packet to the daemon's connection log (host/egress/nflog.rs)
    /// with the decision (`A`llow, `D`eny, a`U`dit) and the rule.
    fn log(&self, decision: &str, rule: &str) -> String {
        format!("log group {} prefix \"{decision} {rule}\"", self.log_group)
    }

    /// The NFLOG group the connection log reads.
    pub fn log_group(&self) -> u16 {
        self.log_group
    }

    /// Installs the table (replacing an older one atomically) and turns on IPv4 forwarding.
    pub fn install(&self, live: &BTreeMap<u32, NetworkPolicy>) -> Result<()> {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enable IPv4 forwarding")?;
        run(&["nft", "-f", "-"], &self.ruleset(live)?).context("install the nftables table")?;
        *self.custom.lock().unwrap_or_else(|e| e.into_inner()) = live.keys().copied().collect();
        Ok(())
    }

    /// Replaces a sandbox's policy (live: one transaction).
    pub fn set_policy(&self, slot: u32, policy: &NetworkPolicy) -> Result<()> {
        run(&["nft", "-f", "-"], &self.policy_commands(slot, policy)?)
            .context("apply the network policy")?;
        self.custom
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(slot);
        Ok(())
    }

    /// Gives the sandbox whose PID 1 is `pid` its `eth0`, address, route and policy. The veth pair is
    /// made with its sandbox end in the sandbox's namespace already (moving an interface between
    /// namespaces costs the kernel more than making it there), and a sandbox with the default policy
    /// needs no nft transaction (its interface falls through to `sbx_default`).
    pub fn attach(&self, slot: u32, pid: u32, policy: &NetworkPolicy) -> Result<()> {
        self.attach_to(slot, &format!("/proc/{pid}/ns/net"), Some(pid), policy)
    }

    /// Like [`Network::attach`] for a network namespace held by a file (a bind mount of one) rather
    /// than by a process: the gvisor tier makes the namespace before the sandbox that joins it.
    pub fn attach_netns(&self, slot: u32, netns: &Path, policy: &NetworkPolicy) -> Result<()> {
        let path = netns
            .to_str()
            .ok_or_else(|| anyhow::anyhow!("network namespace path is not UTF-8"))?;
        self.attach_to(slot, path, None, policy)
    }

    fn attach_to(
        &self,
        slot: u32,
        netns_path: &str,
        pid: Option<u32>,
        policy: &NetworkPolicy,
    ) -> Result<()> {
        let (gw, ip) = self.addresses(slot);
        let host = self.prepare_slot(slot, policy)?;
        let netns = format!("--net={netns_path}");
        let host_end = format!(
            "addr add {gw}/30 dev {host}\n\
             link set {host} up\n"
        );
        match pid {
            Some(pid) => run(
                &["ip", "-batch", "-"],
                &format!("link add {host} type veth peer name eth0 netns {pid}\n{host_end}"),
            )
            .context("make the sandbox's veth pair")?,
            // `ip` names a namespace by pid or by a name under /run/netns, not by path: make the
            // pair inside the sandbox's namespace and send the host end to the daemon's.
            None => {
                run(
                    &["nsenter", &netns, "ip", "-batch", "-"],
                    &format!(
                        "link add eth0 type veth peer name {host} netns {}\n",
                        std::process::id()
                    ),
                )
                .context("make the sandbox's veth pair")?;
                run(&["ip", "-batch", "-"], &host_end)
                    .context("configure the host end of the sandbox's veth pair")?;
            }
        }
        configure_sandbox_end(&netns, gw, ip)
    }

    /// Before a slot's host interface is made: removes a leftover of a crash with its name (which
    /// would make the new one fail) and installs the slot's policy chain when the policy is not the
    /// default (or the slot had one). Returns the interface's name.
    fn prepare_slot(&self, slot: u32, policy: &NetworkPolicy) -> Result<String> {
        let host = self.host_if(slot);
        if interfaces().contains(&host) {
            let _ = run(&["ip", "link", "del", &host], "");
        }
        let custom = self
            .custom
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&slot);
        if custom || *policy != NetworkPolicy::default() {
            self.set_policy(slot, policy)?;
        }
        Ok(host)
    }

    /// Gives the VM of slot `slot` (the microvm tier) its link: the slot's host interface is a TAP
    /// device instead of a veth pair's end, with the gateway's address, under the same rules (they
    /// match the interface by name) — the VM's virtio-net device is its other end, and the VM's own
    /// kernel holds the sandbox's address. Returns the TAP's descriptor for QEMU. The device is
    /// not persistent: it goes when the last descriptor of it closes (QEMU's, when the VM ends),
    /// so a crashed daemon leaves no interface behind a dead VM.
    pub fn attach_tap(&self, slot: u32, policy: &NetworkPolicy) -> Result<OwnedFd> {
        let (gw, _) = self.addresses(slot);
        let host = self.prepare_slot(slot, policy)?;
        let tap = open_tap(&host)?;
        // No IPv6 on the host's end (the guard chain drops a sandbox's IPv6 anyway): the host has
        // no link-local address a guest could talk to. A host without IPv6 has no such file.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{host}/disable_ipv6"), "1");
        run(
            &["ip", "-batch", "-"],
            &format!("addr add {gw}/30 dev {host}\nlink set {host} up\n"),
        )
        .context("configure the VM's TAP device")?;
        Ok(tap)
    }

    /// Gives the sandbox's end of slot `slot` in the namespace at `netns` its address and route
    /// again: gVisor's netstack takes them off the interface when it takes the interface over, and
    /// a sandbox restored from a checkpoint into the same namespace finds them there again.
    pub fn reconfigure_netns(&self, slot: u32, netns: &Path) -> Result<()> {
        let path = netns
            .to_str()
            .ok_or_else(|| anyhow::anyhow!("network namespace path is not UTF-8"))?;
        let (gw, ip) = self.addresses(slot);
        configure_sandbox_end(&format!("--net={path}"), gw, ip)
    }

    /// Removes a slot's interface (gone with the sandbox's namespace anyway) and its policy chain.
    pub fn detach(&self, slot: u32) -> Result<()> {
        let host = self.host_if(slot);
        if interfaces().contains(&host) {
            // The kernel removes the pair by itself once the sandbox's namespace is gone, which may
            // happen between the check and the delete: only an interface still there is an error.
            if let Err(e) = run(&["ip", "link", "del", &host], "") {
                if interfaces().contains(&host) {
                    return Err(e);
                }
            }
        }
        let custom = self
            .custom
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&slot);
        if !custom {
            return Ok(());
        }
        let t = &self.table;
        let c = Self::chain(slot);
        // Element and chain may be gone already (a sweep); each delete is its own transaction.
        let _ = run(
            &["nft", "-f", "-"],
            &format!("delete element inet {t} by_if {{ \"{host}\" }}\n"),
        );
        let _ = run(&["nft", "-f", "-"], &format!("delete chain inet {t} {c}\n"));
        Ok(())
    }

    /// Host-side interfaces of this daemon whose slot is not in `live`.
    pub fn stale_interfaces(&self, live: &std::collections::HashSet<u32>) -> Vec<u32> {
        let pre = format!("{}h", self.prefix);
        interfaces()
            .iter()
            .filter_map(|n| n.strip_prefix(&pre).and_then(|s| s.parse::<u32>().ok()))
            .filter(|s| !live.contains(s))
            .collect()
    }
}

/// Makes the TAP device `name` in the daemon's network namespace and returns its descriptor
/// (`IFF_VNET_HDR`: QEMU's virtio-net passes checksum and segmentation offloads through).
fn open_tap(name: &str) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .context("open /dev/net/tun (the tun module)")?;
    if name.len() >= libc::IFNAMSIZ {
        bail!("interface name {name} is too long");
    }
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads (and fills in) the ifreq, valid for the call; the descriptor is ours.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut ifr) } < 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("make TAP device {name}"));
    }
    Ok(OwnedFd::from(tun))
}

/// Address, route and links of a sandbox's end (`eth0`, and `lo`) in the namespace `netns`
/// (`--net=PATH` for nsenter).
fn configure_sandbox_end(netns: &str, gw: Ipv4Addr, ip: Ipv4Addr) -> Result<()> {
    run(
        &["nsenter", netns, "ip", "-batch", "-"],
        // lo too: gVisor's netstack copies the namespace's interfaces as they are when the
        // sandbox starts (the container tier's agent would bring it up itself).
        &format!(
            "link set lo up\n\
             addr replace {ip}/30 dev eth0\n\
             link set eth0 up\n\
             route replace default via {gw}\n"
        ),
    )
    .context("configure the sandbox's eth0")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net() -> Network {
        Network::new(
            "abcdef",
            "10.200.0.0/16",
            None,
            "10.255.255.53".parse().unwrap(),
            4096,
        )
        .unwrap()
    }

    #[test]
    fn addresses_per_slot() {
        let n = net();
        assert_eq!(
            n.addresses(0),
            ("10.200.0.1".parse().unwrap(), "10.200.0.2".parse().unwrap())
        );
        assert_eq!(
            n.addresses(65),
            ("10.200.1.5".parse().unwrap(), "10.200.1.6".parse().unwrap())
        );
        assert_eq!(n.host_if(4095), "mtabcdh4095");
        assert!(n.host_if(4095).len() <= 15);
        assert!(Network::new("abcd", "10.0.0.0/24", None, Ipv4Addr::LOCALHOST, 4096).is_err());
        assert!(Network::new(
            "abcd",
            "10.0.0.0/16",
            Some("bad name".into()),
            Ipv4Addr::LOCALHOST,
            4096
        )
        .is_err());
    }

    #[test]
    fn deny_list_files() {
        let list = parse_deny_list(
            "# known bad\n203.0.113.7\n\n198.51.100.0/24  # a range\n2001:db8::/32\n*.evil.example\n",
            "bad.txt",
        )
        .unwrap();
        assert_eq!(
            Network::deny_cidrs(&list),
            ["203.0.113.7/32", "198.51.100.0/24"]
        );
        assert_eq!(list[2], Destination::Wildcard("evil.example".into()));
        let err = parse_deny_list("203.0.113.7\nevil example\n", "bad.txt").unwrap_err();
        assert!(err.to_string().starts_with("bad.txt:2: "), "{err}");
        assert!(parse_deny_list("@pypi\n", "bad.txt").is_err());

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("deny.txt");
        std::fs::write(&f, "203.0.113.0/24\n").unwrap();
        let n = net().with_deny_files(vec![f.clone()]).unwrap();
        let rules = n.ruleset(&BTreeMap::new()).unwrap();
        assert!(rules.contains("elements = { 203.0.113.0/24 }"), "{rules}");
        // Checked before any sandbox's own policy: a sandbox's allow_out cannot undo it.
        let deny = rules
            .find("ip daddr @deny4 log group 1 prefix \"D deny list\" reject")
            .unwrap();
        assert!(deny < rules.find("iifname vmap @by_if").unwrap());
        assert!(net()
            .with_deny_files(vec![dir.path().join("missing")])
            .is_err());
        std::fs::write(&f, "not an address\n").unwrap();
        assert!(n.deny_list().is_err());
    }

    #[test]
    fn ruleset_has_the_fixed_blocks_and_policies() {
        let n = net();
        let mut live = BTreeMap::new();
        live.insert(
            3,
            NetworkPolicy {
                allow_internet: false,
                allow_out: vec!["10.1.2.3".into()],
                deny_out: vec!["8.8.8.0/24".into()],
                ..Default::default()
            },
        );
        let r = n.ruleset(&live).unwrap();
        assert!(r.contains("169.254.0.0/16"), "{r}");
        assert!(r.contains("10.200.0.0/16"), "{r}");
        let r = n.clone().with_ports(5353, 4444).ruleset(&live).unwrap();
        assert!(r.contains("th dport 53 redirect to :5353"), "{r}");
        assert!(r.contains("meta l4proto tcp redirect to :4444"), "{r}");
        assert!(
            r.contains("ct state new tcp dport { 5353, 4444 } reject"),
            "{r}"
        );
        // Spoofed sources are dropped before anything else looks at the packet.
        let guard = &r[r.find("chain guard").unwrap()..];
        assert!(guard.find("fib saddr").unwrap() < guard.find("dport 53 accept").unwrap());
        // Each decision of nftables is logged once per flow with its rule (host/egress/nflog.rs).
        assert!(
            r.contains("add rule inet moat_abcd sbx_3 ip daddr 10.1.2.3/32 ct state new log group 1 prefix \"A allow_out[0]\" accept\nadd rule inet moat_abcd sbx_3 ip daddr 10.1.2.3/32 accept"),
            "{r}"
        );
        assert!(
            r.contains("add rule inet moat_abcd sbx_3 ip daddr 8.8.8.0/24 log group 1 prefix \"D deny_out[0]\" reject"),
            "{r}"
        );
        assert!(
            r.contains("add rule inet moat_abcd sbx_3 log group 1 prefix \"D allow_internet: false\" reject"),
            "{r}"
        );
        assert!(
            r.contains("ip daddr @never4 log group 1 prefix \"D always blocked\" reject"),
            "{r}"
        );
        assert!(r.contains("\"mtabcdh3\" : jump sbx_3"), "{r}");
        // Interfaces without a chain of their own (the default policy) fall through to sbx_default.
        assert!(
            r.contains("iifname vmap @by_if\n\t\tjump sbx_default"),
            "{r}"
        );
        assert!(
            r.contains("add rule inet moat_abcd sbx_default meta l4proto tcp accept"),
            "{r}"
        );
        // Allow comes before deny.
        assert!(
            r.find("accept\nadd rule inet moat_abcd sbx_3 ip daddr 8.8")
                .is_some(),
            "{r}"
        );
        let limited = NetworkPolicy {
            egress_mbps: Some(8),
            connections_per_second: Some(5),
            ..Default::default()
        };
        let r = n.policy_commands(4, &limited).unwrap();
        assert!(
            r.contains("limit rate over 1000 kbytes/second burst 100 kbytes drop"),
            "{r}"
        );
        assert!(
            r.contains("ct state new limit rate over 5/second burst 5 packets log group 1 prefix \"D connections_per_second\" reject"),
            "{r}"
        );
        // Names are for the proxy: not in nftables, but QUIC is refused so clients use TCP.
        let named = NetworkPolicy {
            allow_internet: false,
            allow_out: vec!["pypi.org".into(), "10.0.0.0/8".into()],
            ..Default::default()
        };
        let r = n.policy_commands(5, &named).unwrap();
        assert!(!r.contains("pypi"), "{r}");
        assert!(r.contains("sbx_5 udp dport 443 log"), "{r}");
        assert!(r.contains("sbx_5 ip daddr 10.0.0.0/8 accept"), "{r}");
        let audit = NetworkPolicy {
            mode: NetworkMode::Audit,
            ..named.clone()
        };
        let r = n.policy_commands(5, &audit).unwrap();
        // Audit mode refuses only what is refused in every mode (private ranges not allowed).
        let rejects: Vec<&str> = r.lines().filter(|l| l.contains("reject")).collect();
        assert_eq!(
            rejects,
            ["add rule inet moat_abcd sbx_5 ip daddr @private4 log group 1 prefix \"D private range\" reject"],
            "{r}"
        );
        assert!(
            r.contains("sbx_5 ct state new log group 1 prefix \"U allow_internet: false\" accept"),
            "{r}"
        );
        let bad = NetworkPolicy {
            allow_out: vec!["exa mple.com".into()],
            ..Default::default()
        };
        assert!(n.set_policy(1, &bad).is_err());
    }

    #[test]
    fn resolv_conf_and_routes() {
        assert_eq!(
            upstream_dns("# x\nnameserver 127.0.0.53\nnameserver 10.0.0.2\n"),
            Some("10.0.0.2".parse().unwrap())
        );
        assert_eq!(upstream_dns("nameserver ::1\n"), None);
    }
}
