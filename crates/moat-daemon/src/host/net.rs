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
use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use moat_api::{parse_cidr, NetworkPolicy};

/// Destinations no sandbox ever reaches: "this" network, loopback, link-local (cloud metadata at
/// 169.254.169.254), multicast and reserved, broadcast.
const NEVER: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3"];
/// Private ranges, refused unless a sandbox's `allow_out` names them: RFC 1918, CGNAT (RFC 6598),
/// benchmarking (RFC 2544), IETF protocol assignments.
const PRIVATE: &[&str] = &[
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
    /// Daemon-wide deny lists (`--deny-list`): files of IPv4 addresses and CIDRs no sandbox reaches,
    /// whatever its own policy allows; re-read on change.
    deny_files: Vec<PathBuf>,
}

/// Parses a deny-list file: one IPv4 address or CIDR per line, `#` starts a comment, blank lines
/// are skipped. IPv6 entries are skipped (sandboxes have no IPv6 route at all); anything else that
/// is not an address is an error naming the file and line.
pub fn parse_deny_list(text: &str, file: &str) -> Result<Vec<String>> {
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
        let (a, l) = parse_cidr(entry).map_err(|m| anyhow!("{file}:{}: {m}", n + 1))?;
        out.push(format!("{a}/{l}"));
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

    pub fn deny_files(&self) -> &[PathBuf] {
        &self.deny_files
    }

    /// The entries of every deny-list file, as they are now.
    pub fn deny_list(&self) -> Result<Vec<String>> {
        let mut all = Vec::new();
        for f in &self.deny_files {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("--deny-list {}", f.display()))?;
            all.extend(parse_deny_list(&text, &f.display().to_string())?);
        }
        Ok(all)
    }

    fn deny_elements(list: &[String]) -> String {
        if list.is_empty() {
            String::new()
        } else {
            format!(" elements = {{ {} }};", list.join(", "))
        }
    }

    /// Re-reads the deny-list files and swaps the set's contents in one transaction. The egress
    /// chain sees every outgoing packet, so connections already open to a newly denied address are
    /// cut too. Returns how many entries are in force.
    pub fn reload_deny_list(&self) -> Result<usize> {
        let list = self.deny_list()?;
        let t = &self.table;
        let mut s = format!("flush set inet {t} deny4\n");
        if !list.is_empty() {
            s.push_str(&format!(
                "add element inet {t} deny4 {{ {} }}\n",
                list.join(", ")
            ));
        }
        run(&["nft", "-f", "-"], &s).context("load the deny list")?;
        Ok(list.len())
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
    pub fn ruleset(&self, live: &BTreeMap<u32, NetworkPolicy>) -> Result<String> {
        let p = &self.prefix;
        let t = &self.table;
        let mut never: Vec<String> = NEVER.iter().map(|s| s.to_string()).collect();
        never.push(format!("{}/{}", self.subnet, self.subnet_len));
        let masq = match &self.uplink {
            Some(u) => format!("iifname \"{p}h*\" oifname \"{u}\" masquerade"),
            None => format!("iifname \"{p}h*\" oifname != \"{p}h*\" masquerade"),
        };
        let mut s = format!(
            "table inet {t} {{}}\ndelete table inet {t}\ntable inet {t} {{\n\
             \tset never4 {{ type ipv4_addr; flags interval; elements = {{ {never} }} }}\n\
             \tset private4 {{ type ipv4_addr; flags interval; elements = {{ {private} }} }}\n\
             \tset deny4 {{ type ipv4_addr; flags interval; auto-merge;{deny} }}\n\
             \tmap by_if {{ type ifname : verdict; }}\n\
             \tchain input {{ type filter hook input priority filter - 5; policy accept;\n\
             \t\tiifname \"{p}h*\" ct state established,related accept\n\
             \t\tiifname \"{p}h*\" reject\n\t}}\n\
             \tchain forward {{ type filter hook forward priority filter - 5; policy accept;\n\
             \t\toifname \"{p}h*\" ct state established,related accept\n\
             \t\toifname \"{p}h*\" reject\n\
             \t\tiifname \"{p}h*\" jump egress\n\t}}\n\
             \tchain egress {{\n\
             \t\tmeta nfproto ipv6 reject\n\
             \t\tip daddr @never4 reject\n\
             \t\tip daddr @deny4 reject\n\
             \t\tiifname vmap @by_if\n\
             \t\tct status dnat meta l4proto {{ tcp, udp }} th dport 53 accept\n\
             \t\tip daddr @private4 reject\n\
             \t\taccept\n\t}}\n\
             \tchain prerouting {{ type nat hook prerouting priority dstnat; policy accept;\n\
             \t\tiifname \"{p}h*\" meta l4proto {{ tcp, udp }} th dport 53 dnat ip to {dns}\n\t}}\n\
             \tchain postrouting {{ type nat hook postrouting priority srcnat; policy accept;\n\
             \t\t{masq}\n\t}}\n}}\n",
            never = never.join(", "),
            private = PRIVATE.join(", "),
            deny = Self::deny_elements(&self.deny_list()?),
            dns = self.dns,
        );
        for (slot, policy) in live {
            s.push_str(&self.policy_commands(*slot, policy)?);
        }
        Ok(s)
    }

    /// nft commands that (re)make a slot's policy chain and point its interface at it.
    fn policy_commands(&self, slot: u32, policy: &NetworkPolicy) -> Result<String> {
        let t = &self.table;
        let c = Self::chain(slot);
        let cidrs = |list: &[String]| -> Result<String> {
            let v = list
                .iter()
                .map(|e| {
                    parse_cidr(e)
                        .map(|(a, l)| format!("{a}/{l}"))
                        .map_err(|m| anyhow!(m))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(v.join(", "))
        };
        let mut s = format!("add chain inet {t} {c}\nflush chain inet {t} {c}\n");
        if let Some(n) = policy.connections_per_second {
            s.push_str(&format!(
                "add rule inet {t} {c} ct state new limit rate over {n}/second burst {n} packets reject\n"
            ));
        }
        if let Some(mbps) = policy.egress_mbps {
            // 1 Mbit/s = 125 kbytes/s; a burst of a tenth of a second (at least 64 KiB).
            let kbytes = mbps as u64 * 125;
            s.push_str(&format!(
                "add rule inet {t} {c} limit rate over {kbytes} kbytes/second burst {} kbytes drop\n",
                (kbytes / 10).max(64)
            ));
        }
        if !policy.allow_out.is_empty() {
            s.push_str(&format!(
                "add rule inet {t} {c} ip daddr {{ {} }} accept\n",
                cidrs(&policy.allow_out)?
            ));
        }
        if !policy.deny_out.is_empty() {
            s.push_str(&format!(
                "add rule inet {t} {c} ip daddr {{ {} }} reject\n",
                cidrs(&policy.deny_out)?
            ));
        }
        if !policy.allow_internet {
            s.push_str(&format!("add rule inet {t} {c} reject\n"));
        }
        s.push_str(&format!(
            "add element inet {t} by_if {{ \"{}\" : jump {c} }}\n",
            self.host_if(slot)
        ));
        Ok(s)
    }

    /// Installs the table (replacing an older one atomically) and turns on IPv4 forwarding.
    pub fn install(&self, live: &BTreeMap<u32, NetworkPolicy>) -> Result<()> {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").context("enable IPv4 forwarding")?;
        run(&["nft", "-f", "-"], &self.ruleset(live)?).context("install the nftables table")
    }

    /// Replaces a sandbox's policy (live: one transaction).
    pub fn set_policy(&self, slot: u32, policy: &NetworkPolicy) -> Result<()> {
        run(&["nft", "-f", "-"], &self.policy_commands(slot, policy)?)
            .context("apply the network policy")
    }

    /// Gives the sandbox whose PID 1 is `pid` its `eth0`, address, route and policy.
    pub fn attach(&self, slot: u32, pid: u32, policy: &NetworkPolicy) -> Result<()> {
        let (gw, ip) = self.addresses(slot);
        let host = self.host_if(slot);
        let peer = format!("{}s{slot}", self.prefix);
        // A leftover of a crash with the same name would make `link add` fail.
        let _ = run(&["ip", "link", "del", &host], "");
        self.set_policy(slot, policy)?;
        run(
            &["ip", "-batch", "-"],
            &format!(
                "link add {host} type veth peer name {peer}\n\
                 link set {peer} netns {pid}\n\
                 addr add {gw}/30 dev {host}\n\
                 link set {host} up\n"
            ),
        )
        .context("make the sandbox's veth pair")?;
        let netns = format!("--net=/proc/{pid}/ns/net");
        run(
            &["nsenter", &netns, "ip", "-batch", "-"],
            &format!(
                "link set {peer} name eth0\n\
                 addr add {ip}/30 dev eth0\n\
                 link set eth0 up\n\
                 route add default via {gw}\n"
            ),
        )
        .context("configure the sandbox's eth0")
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
            "# known bad\n203.0.113.7\n\n198.51.100.0/24  # a range\n2001:db8::/32\n",
            "bad.txt",
        )
        .unwrap();
        assert_eq!(list, ["203.0.113.7/32", "198.51.100.0/24"]);
        let err = parse_deny_list("203.0.113.7\nevil.example\n", "bad.txt").unwrap_err();
        assert!(err.to_string().starts_with("bad.txt:2: "), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("deny.txt");
        std::fs::write(&f, "203.0.113.0/24\n").unwrap();
        let n = net().with_deny_files(vec![f.clone()]).unwrap();
        let rules = n.ruleset(&BTreeMap::new()).unwrap();
        assert!(rules.contains("elements = { 203.0.113.0/24 }"), "{rules}");
        // Checked before any sandbox's own policy: a sandbox's allow_out cannot undo it.
        let deny = rules.find("ip daddr @deny4 reject").unwrap();
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
        assert!(r.contains("dnat ip to 10.255.255.53"), "{r}");
        assert!(
            r.contains("add rule inet moat_abcd sbx_3 ip daddr { 10.1.2.3/32 } accept"),
            "{r}"
        );
        assert!(
            r.contains("add rule inet moat_abcd sbx_3 ip daddr { 8.8.8.0/24 } reject"),
            "{r}"
        );
        assert!(r.contains("add rule inet moat_abcd sbx_3 reject"), "{r}");
        assert!(r.contains("\"mtabcdh3\" : jump sbx_3"), "{r}");
        // Allow comes before deny.
        assert!(
            r.find("accept\nadd rule inet moat_abcd sbx_3 ip daddr { 8.8")
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
            r.contains("ct state new limit rate over 5/second burst 5 packets reject"),
            "{r}"
        );
        let bad = NetworkPolicy {
            allow_out: vec!["example.com".into()],
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
