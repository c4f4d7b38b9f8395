//! What nftables decides alone — UDP other than DNS, ICMP, and every packet refused before the proxy
//! sees it (the always-blocked ranges, the deny list, the host's own addresses, rate limits) — reaches
//! the connection log through NFLOG: the rules that decide a new flow carry `log group G prefix "<D|A|U>
//! <rule>"`, and this reader turns each logged packet into an [`Event`]. One thread reads the netlink
//! socket (blocking); events go to the log like the proxy's.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use moat_api::NetDecision;
use nix::sys::socket::{
    bind, recv, send, socket, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol,
    SockType,
};

use super::{Egress, Event};

const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULA_CFG_QTHRESH: u16 = 5;
const NFULA_TIMESTAMP: u16 = 3;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_ERROR: u16 = 2;
/// Bytes of each packet copied to us: an IPv4 header with options and the transport ports.
const COPY_RANGE: u32 = 96;

/// A netlink attribute: length, type, payload padded to 4 bytes.
fn attr(t: u16, payload: &[u8]) -> Vec<u8> {
    let len = 4 + payload.len();
    let mut a = Vec::with_capacity(len.next_multiple_of(4));
    a.extend_from_slice(&(len as u16).to_ne_bytes());
    a.extend_from_slice(&t.to_ne_bytes());
    a.extend_from_slice(payload);
    a.resize(len.next_multiple_of(4), 0);
    a
}

/// An nfnetlink_log config message for `group` carrying `attrs`.
fn config_msg(group: u16, attrs: &[u8], seq: u32) -> Vec<u8> {
    let len = 16 + 4 + attrs.len();
    let mut m = Vec::with_capacity(len);
    m.extend_from_slice(&(len as u32).to_ne_bytes());
    m.extend_from_slice(&((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG).to_ne_bytes());
    m.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    m.extend_from_slice(&seq.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family AF_UNSPEC, version 0, resource id = the group (big endian).
    m.extend_from_slice(&[0, 0]);
    m.extend_from_slice(&group.to_be_bytes());
    m.extend_from_slice(attrs);
    m
}

/// Opens a netlink socket bound to NFLOG group `group`, copying the first bytes of each packet.
pub fn open(group: u16) -> Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )
    .context("netlink socket (NETLINK_NETFILTER)")?;
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).context("bind the netlink socket")?;
    let mut mode = COPY_RANGE.to_be_bytes().to_vec();
    mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
    // The kernel batches a group's packets (by default up to 100 of them or 1 s) before it sends
    // them: each is sent at once instead, so an entry's time is its packet's, not its batch's.
    let at_once = attr(NFULA_CFG_QTHRESH, &1u32.to_be_bytes());
    for (seq, msg) in [
        config_msg(group, &attr(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND]), 1),
        config_msg(group, &attr(NFULA_CFG_MODE, &mode), 2),
        config_msg(group, &at_once, 3),
    ]
    .into_iter()
    .enumerate()
    {
        send(fd.as_raw_fd(), &msg, MsgFlags::empty()).context("configure NFLOG")?;
        let mut b = [0u8; 1024];
        let n = recv(fd.as_raw_fd(), &mut b, MsgFlags::empty()).context("NFLOG config ack")?;
        if n >= 20 && u16::from_ne_bytes([b[4], b[5]]) == NLMSG_ERROR {
            let err = i32::from_ne_bytes([b[16], b[17], b[18], b[19]]);
            if err != 0 {
                bail!(
                    "NFLOG group {group}: config step {} refused: {}",
                    seq + 1,
                    nix::errno::Errno::from_raw(-err)
                );
            }
        }
    }
    Ok(fd)
}

/// One packet nftables logged: the rule's prefix, the packet's start and, when the kernel stamped
/// it, its time (ms since the Unix epoch).
#[derive(Debug, PartialEq, Eq)]
pub struct Logged {
    pub prefix: String,
    pub payload: Vec<u8>,
    pub at_ms: Option<i64>,
}

/// The NFLOG packets in one netlink datagram.
pub fn parse(mut b: &[u8]) -> Vec<Logged> {
    let mut out = Vec::new();
    while b.len() >= 16 {
        let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
        let kind = u16::from_ne_bytes([b[4], b[5]]);
        if len < 16 || len > b.len() {
            break;
        }
        if kind == (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET && len >= 20 {
            let mut attrs = &b[20..len];
            let mut l = Logged {
                prefix: String::new(),
                payload: Vec::new(),
                at_ms: None,
            };
            while attrs.len() >= 4 {
                let alen = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
                let atype = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x3fff;
                if alen < 4 || alen > attrs.len() {
                    break;
                }
                let data = &attrs[4..alen];
                match atype {
                    NFULA_PREFIX => {
                        let s = data.split(|c| *c == 0).next().unwrap_or(&[]);
                        l.prefix = String::from_utf8_lossy(s).into_owned();
                    }
                    NFULA_PAYLOAD => l.payload = data.to_vec(),
                    // struct nfulnl_msg_packet_timestamp { __be64 sec; __be64 usec; }
                    NFULA_TIMESTAMP if data.len() >= 16 => {
                        let be = |o: usize| {
                            u64::from_be_bytes(data[o..o + 8].try_into().unwrap_or([0; 8]))
                        };
                        let (sec, usec) = (be(0), be(8));
                        if sec > 0 {
                            l.at_ms = i64::try_from(sec * 1000 + usec / 1000).ok();
                        }
                    }
                    _ => {}
                }
                attrs = &attrs[alen.next_multiple_of(4).min(attrs.len())..];
            }
            out.push(l);
        }
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    out
}

/// (protocol, source, destination) of an IPv4 packet's start; ports are 0 for protocols without.
pub fn packet_info(p: &[u8]) -> Option<(&'static str, Ipv4Addr, SocketAddrV4)> {
    if p.len() < 20 || p[0] >> 4 != 4 {
        return None;
    }
    let ihl = ((p[0] & 0x0f) as usize) * 4;
    let src = Ipv4Addr::new(p[12], p[13], p[14], p[15]);
    let dst = Ipv4Addr::new(p[16], p[17], p[18], p[19]);
    let port = |o: usize| {
        p.get(ihl + o..ihl + o + 2)
            .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]))
    };
    let (proto, port) = match p[9] {
        1 => ("icmp", 0),
        6 => ("tcp", port(2)),
        17 => ("udp", port(2)),
        _ => ("ip", 0),
    };
    Some((proto, src, SocketAddrV4::new(dst, port)))
}

/// The decision and rule a prefix (`D deny_out[1]`) carries.
pub fn decision(prefix: &str) -> Option<(NetDecision, String)> {
    let (d, rule) = prefix.split_once(' ')?;
    let d = match d {
        "A" => NetDecision::Allow,
        "D" => NetDecision::Deny,
        "U" => NetDecision::Audit,
        _ => return None,
    };
    Some((d, rule.trim().to_string()))
}

/// Reads logged packets until the socket fails; runs on a thread of its own.
pub fn read_loop(fd: OwnedFd, egress: Arc<Egress>) {
    let mut buf = vec![0u8; 64 * 1024];
    // A sandbox sending UDP to many destinations makes many entries: when the log's queue is full
    // they are dropped (and counted) rather than piling up in memory.
    let mut dropped = 0u64;
    loop {
        let n = match recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty()) {
            Ok(n) => n,
            Err(nix::errno::Errno::EINTR) => continue,
            // The kernel dropped messages the reader was too slow for: go on with the next.
            Err(nix::errno::Errno::ENOBUFS) => {
                tracing::warn!("connection log: the kernel dropped NFLOG messages");
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "connection log: NFLOG reader stopped");
                return;
            }
        };
        for l in parse(&buf[..n]) {
            let (Some((decision, rule)), Some((protocol, src, dst))) =
                (decision(&l.prefix), packet_info(&l.payload))
            else {
                continue;
            };
            let Some(sp) = egress.sandbox(SocketAddr::V4(SocketAddrV4::new(src, 0))) else {
                continue;
            };
            let mut ev = Event::new(&sp, protocol, Some(dst), decision, rule);
            if let Some(at) = l.at_ms {
                ev.at_ms = at;
            }
            if !egress.try_log(ev) {
                dropped += 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(dropped, "connection log: queue full, NFLOG entries dropped");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packets_and_prefixes() {
        // A UDP packet 10.200.0.6:40000 → 198.51.100.1:5353.
        let mut ip = vec![0x45, 0, 0, 28, 0, 0, 0, 0, 64, 17, 0, 0];
        ip.extend_from_slice(&[10, 200, 0, 6, 198, 51, 100, 1]);
        ip.extend_from_slice(&[0x9c, 0x40, 0x14, 0xe9, 0, 8, 0, 0]);
        let (proto, src, dst) = packet_info(&ip).unwrap();
        assert_eq!(proto, "udp");
        assert_eq!(src, Ipv4Addr::new(10, 200, 0, 6));
        assert_eq!(dst, "198.51.100.1:5353".parse().unwrap());
        assert_eq!(packet_info(&ip[..10]), None);
        assert_eq!(
            decision("D deny_out[2]"),
            Some((NetDecision::Deny, "deny_out[2]".into()))
        );
        assert_eq!(
            decision("U allow_internet: false"),
            Some((NetDecision::Audit, "allow_internet: false".into()))
        );
        assert_eq!(decision("X y"), None);

        // A netlink datagram with one NFLOG packet: header, nfgenmsg, a prefix and the payload.
        let mut attrs = attr(NFULA_PREFIX, b"D always blocked\0");
        attrs.extend(attr(NFULA_PAYLOAD, &ip));
        attrs.extend(attr(3, &[1, 2, 3])); // something else, skipped
        let len = 20 + attrs.len();
        let mut msg = (len as u32).to_ne_bytes().to_vec();
        msg.extend_from_slice(&((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET).to_ne_bytes());
        msg.extend_from_slice(&[0; 10]);
        msg.extend_from_slice(&[2, 0, 0, 7]);
        msg.extend(attrs);
        let two = [msg.clone(), msg.clone()].concat();
        let got = parse(&two);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].prefix, "D always blocked");
        assert_eq!(got[0].payload, ip);
        assert_eq!(got[0].at_ms, None);
        // The kernel's stamp of the packet, when it has one, is the entry's time.
        let mut stamped = attr(NFULA_PREFIX, b"D always blocked\0");
        let mut ts = 1_700_000_000u64.to_be_bytes().to_vec();
        ts.extend(500_000u64.to_be_bytes());
        stamped.extend(attr(NFULA_TIMESTAMP, &ts));
        let mut m = ((20 + stamped.len()) as u32).to_ne_bytes().to_vec();
        m.extend_from_slice(&((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET).to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(&[2, 0, 0, 7]);
        m.extend(stamped);
        assert_eq!(parse(&m)[0].at_ms, Some(1_700_000_000_500));
        // Truncated or lying lengths: no panic, nothing made up.
        for cut in 0..msg.len() {
            let _ = parse(&msg[..cut]);
        }
        let mut bad = msg.clone();
        bad[20] = 0xff;
        let _ = parse(&bad);
    }
}
