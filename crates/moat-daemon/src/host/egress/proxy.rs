//! The transparent proxy every TCP connection of a sandbox goes through. nftables redirects the
//! connection here (the sandbox still thinks it talks to the address it dialed); the proxy learns
//! that address (`SO_ORIGINAL_DST`), reads the name the client sends first — TLS SNI or HTTP Host —
//! when the policy has name rules, decides, then connects itself: to the *name* when a name rule
//! decided (resolved by the daemon, every address checked), never to an address the sandbox picked for
//! a name. Refused connections are reset. Every connection is logged with its bytes and duration.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use moat_api::NetDecision;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{Egress, Event, SlotPolicy};

/// How long the proxy waits for the client's first bytes when a name decides (a client that sends
/// nothing first, e.g. a server-speaks-first protocol, is decided by address after it).
const PEEK_TIMEOUT: Duration = Duration::from_secs(1);
/// Most bytes read before deciding (a TLS ClientHello fits in one record, 16 KiB).
const PEEK_MAX: usize = 16 * 1024 + 5;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Relay buffer per direction (tokio's default of 8 KiB costs bulk transfers half their speed).
const RELAY_BUF: usize = 128 * 1024;

/// Accepts redirected connections until the listener fails.
pub async fn serve(listener: TcpListener, egress: Arc<Egress>) {
    loop {
        let (conn, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "sandbox TCP proxy");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let egress = egress.clone();
        tokio::spawn(async move {
            let Some(sp) = egress.sandbox(peer) else {
                reset(conn);
                return;
            };
            let Some(orig) = original_dst(&conn) else {
                reset(conn);
                return;
            };
            let Some(_held) = egress.hold(peer, super::Kind::Tcp) else {
                reset(conn);
                refused_over_limit(&egress, sp, orig).await;
                return;
            };
            handle(&egress, sp, conn, orig).await;
        });
    }
}

/// Logs a connection refused because the sandbox holds its limit of open connections already.
async fn refused_over_limit(egress: &Egress, sp: SlotPolicy, orig: SocketAddrV4) {
    egress
        .log(Event::new(
            &sp,
            "tcp",
            Some(orig),
            NetDecision::Deny,
            "connection limit",
        ))
        .await;
}

/// The address the sandbox dialed, before nftables redirected it here.
fn original_dst(conn: &TcpStream) -> Option<SocketAddrV4> {
    let a =
        nix::sys::socket::getsockopt(&conn.as_fd(), nix::sys::socket::sockopt::OriginalDst).ok()?;
    Some(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
        u16::from_be(a.sin_port),
    ))
}

/// Closes with a reset, so the client sees "connection reset" at once.
fn reset(conn: TcpStream) {
    let _ = nix::sys::socket::setsockopt(
        &conn.as_fd(),
        nix::sys::socket::sockopt::Linger,
        &libc::linger {
            l_onoff: 1,
            l_linger: 0,
        },
    );
    drop(conn);
}

/// What the first bytes of a connection say about its name.
#[derive(Debug, PartialEq, Eq)]
pub enum Sniffed {
    /// Not enough bytes yet to tell.
    More,
    /// A name from TLS SNI (`sni`) or HTTP Host (`host`).
    Name(String, &'static str),
    /// Neither (or TLS without SNI, or a name that is an address).
    Nothing,
}

/// Reads the server name of a TLS ClientHello or the Host of an HTTP request at the start of `b`.
pub fn sniff(b: &[u8]) -> Sniffed {
    match b.first() {
        None => Sniffed::More,
        Some(0x16) => tls_sni(b),
        Some(c) if c.is_ascii_uppercase() => http_host(b),
        Some(_) => Sniffed::Nothing,
    }
}

fn named(n: &str, source: &'static str) -> Sniffed {
    let n = moat_api::normalize_name(n);
    if n.is_empty() || n.parse::<Ipv4Addr>().is_ok() || n.contains(':') || n.contains('[') {
        Sniffed::Nothing
    } else {
        Sniffed::Name(n, source)
    }
}

fn http_host(b: &[u8]) -> Sniffed {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(b) {
        Ok(httparse::Status::Partial) => Sniffed::More,
        Ok(httparse::Status::Complete(_)) => {
            let host = req
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case("host"))
                .and_then(|h| std::str::from_utf8(h.value).ok());
            match host {
                // Drop a port; an IPv6 literal ([...]) is no name.
                Some(h) if !h.starts_with('[') => {
                    named(h.rsplit_once(':').map_or(h, |(n, _)| n), "host")
                }
                _ => Sniffed::Nothing,
            }
        }
        Err(_) => Sniffed::Nothing,
    }
}

/// A cursor over a ClientHello, every read bounds-checked.
struct Cur<'a>(&'a [u8]);

impl<'a> Cur<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<usize> {
        self.take(1).map(|b| b[0] as usize)
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn vec8(&mut self) -> Option<&'a [u8]> {
        let n = self.u8()?;
        self.take(n)
    }
    fn vec16(&mut self) -> Option<&'a [u8]> {
        let n = self.u16()?;
        self.take(n)
    }
}

fn tls_sni(b: &[u8]) -> Sniffed {
    if b.len() < 5 {
        return Sniffed::More;
    }
    let len = u16::from_be_bytes([b[3], b[4]]) as usize;
    if b.len() < 5 + len {
        return Sniffed::More;
    }
    let parse = || -> Option<Option<String>> {
        let mut hs = Cur(&b[5..5 + len]);
        if hs.u8()? != 1 {
            return None; // not a ClientHello
        }
        let body_len = {
            let l = hs.take(3)?;
            (l[0] as usize) << 16 | (l[1] as usize) << 8 | l[2] as usize
        };
        // A ClientHello longer than its first record is not read further.
        let mut ch = Cur(hs.take(body_len)?);
        ch.take(2 + 32)?; // version, random
        ch.vec8()?; // session id
        ch.vec16()?; // cipher suites
        ch.vec8()?; // compression methods
        let mut exts = Cur(ch.vec16()?);
        while let Some(t) = exts.u16() {
            let mut data = Cur(exts.vec16()?);
            if t != 0 {
                continue;
            }
            let mut list = Cur(data.vec16()?);
            while let Some(kind) = list.u8() {
                let name = list.vec16()?;
                if kind == 0 {
                    return Some(std::str::from_utf8(name).ok().map(str::to_string));
                }
            }
        }
        Some(None)
    };
    match parse() {
        Some(Some(n)) => named(&n, "sni"),
        _ => Sniffed::Nothing,
    }
}

/// Reads the client's first bytes until they name a destination (or can't), at most `PEEK_MAX` bytes
/// or `PEEK_TIMEOUT`.
async fn peek(conn: &mut TcpStream) -> (Vec<u8>, Option<(String, &'static str)>) {
    let deadline = tokio::time::Instant::now() + PEEK_TIMEOUT;
    let mut buf = Vec::with_capacity(2048);
    let mut chunk = vec![0u8; 4096];
    loop {
        match sniff(&buf) {
            Sniffed::Name(n, s) => return (buf, Some((n, s))),
            Sniffed::Nothing => return (buf, None),
            Sniffed::More if buf.len() >= PEEK_MAX => return (buf, None),
            Sniffed::More => {}
        }
        match tokio::time::timeout_at(deadline, conn.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
            _ => return (buf, None),
        }
    }
}

async fn handle(egress: &Egress, sp: SlotPolicy, mut conn: TcpStream, orig: SocketAddrV4) {
    let started = Instant::now();
    let mut ev = Event::new(&sp, "tcp", Some(orig), NetDecision::Deny, "");
    // The name can change the decision only when there are name rules, and not when an allow_out
    // CIDR already allows the address (allow beats deny) unless the deny list has names (which beat
    // everything): then no need to wait for the client's first bytes.
    let deny_names = egress.deny_list().has_names();
    // With secrets, the first bytes always count: a TLS name they belong to is intercepted, and a
    // placeholder must not leave in clear.
    let secrets = sp.secrets.clone();
    let names_matter = deny_names
        || secrets.is_some()
        || (sp.policy.has_names() && !super::allowed_by_cidr(&sp.policy, *orig.ip()));
    let (mut head, mut name) = if names_matter {
        peek(&mut conn).await
    } else {
        (Vec::new(), None)
    };
    let verdict = egress.decide(&sp, Some(*orig.ip()), name.as_ref().map(|n| n.0.as_str()));
    ev.decision = verdict.decision;
    ev.rule = verdict.rule.clone();
    if let Some((n, s)) = &name {
        ev.name = Some(n.clone());
        ev.name_source = Some(s.to_string());
    }
    let finish = |mut ev: Event, error: Option<String>| {
        ev.duration_ms = started.elapsed().as_millis() as u64;
        ev.error = error;
        ev
    };
    if let Some(v) = secrets
        .as_deref()
        .and_then(|sec| secret_in_clear(sec, &head, name.as_ref(), orig))
    {
        ev.decision = NetDecision::Deny;
        ev.rule = "secret".into();
        let why = violation_message(&v);
        reset(conn);
        egress.log(finish(ev, Some(why))).await;
        egress.violated(&sp.sandbox_id, v);
        return;
    }
    if !verdict.allowed() {
        reset(conn);
        egress.log(finish(ev, None)).await;
        return;
    }
    let target = match (verdict.dial_name, &name) {
        (true, Some((n, _))) => match egress.lookup(n).await {
            Err(e) => Err((None, format!("{e:#}"))),
            Ok(ips) => {
                let ok: Vec<Ipv4Addr> = ips
                    .iter()
                    .copied()
                    .filter(|ip| egress.undialable(&sp.policy, *ip).is_none())
                    .collect();
                // The address the sandbox asked for when the name has it (same server as the
                // sandbox's own lookup), else the name's first allowed address.
                match ok.iter().find(|ip| *ip == orig.ip()).or(ok.first()) {
                    Some(ip) => Ok(SocketAddrV4::new(*ip, orig.port())),
                    None => {
                        let why = ips
                            .first()
                            .and_then(|ip| egress.undialable(&sp.policy, *ip))
                            .unwrap_or("blocked");
                        // An allowed name that leads only where no sandbox may go (DNS
                        // rebinding to metadata, the gateway, a host address, a private range):
                        // a refusal, with a rule of its own.
                        Err((
                            Some(format!("rebinding ({why})")),
                            format!("{n} resolved only to addresses no sandbox may reach ({why})"),
                        ))
                    }
                }
            }
        },
        _ => Ok(orig),
    };
    let target = match target {
        Ok(t) => t,
        Err((refusal, e)) => {
            if let Some(rule) = refusal {
                ev.decision = NetDecision::Deny;
                ev.rule = rule;
            }
            reset(conn);
            egress.log(finish(ev, Some(e))).await;
            return;
        }
    };
    ev.dialed = Some(target);
    if let (Some(sec), Some((n, "sni"))) = (&secrets, &name) {
        if sec.intercepts(n) {
            let o = super::intercept::serve(
                conn,
                head,
                n.clone(),
                target,
                sec.clone(),
                egress.upstream_tls(),
            )
            .await;
            ev.bytes_out = o.bytes_out;
            ev.bytes_in = o.bytes_in;
            ev.name_source = Some("sni (secrets)".into());
            let mut error = o.error;
            if let Some(v) = o.violation {
                ev.decision = NetDecision::Deny;
                ev.rule = "secret".into();
                error = Some(violation_message(&v));
                egress.log(finish(ev, error)).await;
                egress.violated(&sp.sandbox_id, v);
                return;
            }
            egress.log(finish(ev, error)).await;
            return;
        }
    }
    let mut upstream =
        match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(SocketAddr::V4(target)))
            .await
        {
            Ok(Ok(u)) => u,
            Ok(Err(e)) => {
                reset(conn);
                egress
                    .log(finish(ev, Some(format!("connect {target}: {e}"))))
                    .await;
                return;
            }
            Err(_) => {
                reset(conn);
                egress
                    .log(finish(ev, Some(format!("connect {target}: timed out"))))
                    .await;
                return;
            }
        };
    let _ = upstream.set_nodelay(true);
    let _ = conn.set_nodelay(true);
    // Without name rules nothing waited for the client: learn the name for the log from its first
    // bytes if it speaks first, without holding up a server that speaks first.
    if !names_matter {
        let mut chunk = vec![0u8; 16 * 1024];
        tokio::select! {
            r = conn.read(&mut chunk) => {
                if let Ok(n) = r {
                    head.extend_from_slice(&chunk[..n]);
                    if let Sniffed::Name(n, s) = sniff(&head) {
                        name = Some((n, s));
                    }
                }
            }
            _ = upstream.readable() => {}
        }
        if let Some((n, s)) = &name {
            ev.name = Some(n.clone());
            ev.name_source = Some(s.to_string());
        }
    }
    let mut error = None;
    if !head.is_empty() {
        if let Err(e) = upstream.write_all(&head).await {
            error = Some(format!("write to {target}: {e}"));
        }
    }
    ev.bytes_out = head.len() as u64;
    let cleartext = head.first().is_some_and(|b| *b != 0x16);
    if let (None, Some(sec), true) = (&error, &secrets, cleartext) {
        // Not TLS: every byte the sandbox sends is watched for a placeholder.
        let r = relay_watched(&mut conn, &mut upstream, sec).await;
        ev.bytes_out += r.0;
        ev.bytes_in = r.1;
        if let Some(secret) = r.2 {
            let v = super::intercept::Violation {
                secret,
                host: name
                    .as_ref()
                    .map_or_else(|| target.ip().to_string(), |(n, _)| n.clone()),
                place: "stream",
            };
            ev.decision = NetDecision::Deny;
            ev.rule = "secret".into();
            reset(conn);
            egress.log(finish(ev, Some(violation_message(&v)))).await;
            egress.violated(&sp.sandbox_id, v);
            return;
        }
        egress.log(finish(ev, r.3)).await;
        return;
    }
    if error.is_none() {
        match tokio::io::copy_bidirectional_with_sizes(
            &mut conn,
            &mut upstream,
            RELAY_BUF,
            RELAY_BUF,
        )
        .await
        {
            Ok((out, inn)) => {
                ev.bytes_out += out;
                ev.bytes_in = inn;
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => error = Some(e.to_string()),
        }
    }
    egress.log(finish(ev, error)).await;
}

/// A placeholder of `sec` in the first bytes of a connection: in the TLS server name (any host is
/// wrong for it), in an HTTP Host, or anywhere in bytes that are not TLS (a secret never goes in
/// clear, even to its own host).
fn secret_in_clear(
    sec: &super::secrets::SandboxSecrets,
    head: &[u8],
    name: Option<&(String, &'static str)>,
    orig: SocketAddrV4,
) -> Option<super::intercept::Violation> {
    let host = name.map_or_else(|| orig.ip().to_string(), |(n, _)| n.clone());
    if let Some((n, src)) = name {
        if let Some(s) = sec.placeholder_in(n.as_bytes()) {
            return Some(super::intercept::Violation {
                secret: s.name.clone(),
                host,
                place: if *src == "sni" { "sni" } else { "header" },
            });
        }
    }
    if head.first().is_some_and(|b| *b != 0x16) {
        if let Some(s) = sec.placeholder_in(head) {
            return Some(super::intercept::Violation {
                secret: s.name.clone(),
                host,
                place: "stream",
            });
        }
    }
    None
}

fn violation_message(v: &super::intercept::Violation) -> String {
    match v.place {
        "stream" => format!(
            "the placeholder of secret {} sent in clear to {} (secrets go only over TLS, to their \
             hosts): refused",
            v.secret, v.host
        ),
        _ => format!(
            "the placeholder of secret {} headed to {}, a host it does not belong to (in the {}): \
             refused",
            v.secret, v.host, v.place
        ),
    }
}

/// Relays both ways, watching what the sandbox sends for a placeholder of `sec`: (bytes out,
/// bytes in, the secret whose placeholder stopped it, an error).
async fn relay_watched(
    conn: &mut TcpStream,
    upstream: &mut TcpStream,
    sec: &super::secrets::SandboxSecrets,
) -> (u64, u64, Option<String>, Option<String>) {
    let (mut cr, mut cw) = conn.split();
    let (mut ur, mut uw) = upstream.split();
    let up = async {
        let mut buf = vec![0u8; RELAY_BUF];
        let mut scan = super::secrets::Scanner::new();
        let mut sent = 0u64;
        loop {
            let n = cr.read(&mut buf).await?;
            if n == 0 {
                let _ = uw.shutdown().await;
                return Ok::<_, std::io::Error>((sent, None));
            }
            if let Some(s) = scan.foreign(sec, &buf[..n], None) {
                return Ok((sent, Some(s.name.clone())));
            }
            uw.write_all(&buf[..n]).await?;
            sent += n as u64;
        }
    };
    let down = async {
        let n = tokio::io::copy(&mut ur, &mut cw).await?;
        let _ = cw.shutdown().await;
        Ok::<_, std::io::Error>(n)
    };
    tokio::pin!(up, down);
    let (mut up_r, mut down_r) = (None, None);
    while up_r.is_none() || down_r.is_none() {
        tokio::select! {
            r = &mut up, if up_r.is_none() => {
                if let Ok((sent, Some(secret))) = r {
                    return (sent, 0, Some(secret), None);
                }
                up_r = Some(r);
            }
            r = &mut down, if down_r.is_none() => down_r = Some(r),
        }
    }
    let mut error = None;
    let (mut sent, mut inn) = (0, 0);
    match up_r {
        Some(Ok((n, _))) => sent = n,
        Some(Err(e)) if e.kind() != std::io::ErrorKind::ConnectionReset => {
            error = Some(e.to_string())
        }
        _ => {}
    }
    match down_r {
        Some(Ok(n)) => inn = n,
        Some(Err(e)) if e.kind() != std::io::ErrorKind::ConnectionReset => {
            error = Some(e.to_string())
        }
        _ => {}
    }
    (sent, inn, None, error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TLS 1.3 ClientHello record with the given SNI (and a few other extensions around it).
    pub fn client_hello(sni: Option<&str>) -> Vec<u8> {
        let mut exts = Vec::new();
        // supported_versions: TLS 1.3
        exts.extend_from_slice(&[0x00, 0x2b, 0x00, 0x03, 0x02, 0x03, 0x04]);
        if let Some(n) = sni {
            let n = n.as_bytes();
            let mut e = vec![0x00, 0x00];
            let list_len = n.len() + 3;
            e.extend_from_slice(&((list_len + 2) as u16).to_be_bytes());
            e.extend_from_slice(&(list_len as u16).to_be_bytes());
            e.push(0);
            e.extend_from_slice(&(n.len() as u16).to_be_bytes());
            e.extend_from_slice(n);
            exts.extend_from_slice(&e);
        }
        // padding
        exts.extend_from_slice(&[0x00, 0x15, 0x00, 0x04, 0, 0, 0, 0]);
        let mut body = vec![0x03, 0x03];
        body.extend_from_slice(&[7u8; 32]);
        body.extend_from_slice(&[32]);
        body.extend_from_slice(&[9u8; 32]);
        body.extend_from_slice(&[0x00, 0x02, 0x13, 0x01]);
        body.extend_from_slice(&[0x01, 0x00]);
        body.extend_from_slice(&(exts.len() as u16).to_be_bytes());
        body.extend_from_slice(&exts);
        let mut hs = vec![0x01];
        hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend_from_slice(&body);
        let mut rec = vec![0x16, 0x03, 0x01];
        rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
        rec.extend_from_slice(&hs);
        rec
    }

    #[test]
    fn sni_from_a_client_hello() {
        let ch = client_hello(Some("Pypi.ORG"));
        assert_eq!(sniff(&ch), Sniffed::Name("pypi.org".into(), "sni"));
        // Split anywhere: more bytes needed, never a wrong answer.
        for cut in 0..ch.len() {
            assert_eq!(sniff(&ch[..cut]), Sniffed::More, "cut at {cut}");
        }
        assert_eq!(sniff(&client_hello(None)), Sniffed::Nothing);
        assert_eq!(sniff(&client_hello(Some("203.0.113.5"))), Sniffed::Nothing);
        // Garbage after a handshake header, lengths that lie: no panic, no name.
        let mut bad = ch.clone();
        bad[6] = 0xff; // a handshake length longer than the record
        assert_eq!(sniff(&bad), Sniffed::Nothing);
        for i in 5..ch.len() {
            let mut b = ch.clone();
            b[i] = b[i].wrapping_add(0x80);
            let _ = sniff(&b);
        }
    }

    #[test]
    fn host_from_an_http_request() {
        let r = b"GET /simple/ HTTP/1.1\r\nUser-Agent: x\r\nHost: Files.Example.com:8080\r\n\r\n";
        assert_eq!(sniff(r), Sniffed::Name("files.example.com".into(), "host"));
        assert_eq!(sniff(&r[..20]), Sniffed::More);
        assert_eq!(sniff(b"GET / HTTP/1.0\r\n\r\n"), Sniffed::Nothing);
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: 10.0.0.1\r\n\r\n"),
            Sniffed::Nothing
        );
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n"),
            Sniffed::Nothing
        );
        assert_eq!(sniff(b"SSH-2.0-OpenSSH_9.2\r\n"), Sniffed::Nothing);
        assert_eq!(sniff(b"\x00\x00\x00\x08"), Sniffed::Nothing);
    }
}
