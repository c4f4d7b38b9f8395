//! The daemon's DNS resolver for sandboxes. nftables redirects every packet a sandbox sends to port 53
//! (UDP or TCP, whatever server it names) here. A question for a name the sandbox's policy allows is
//! forwarded to the upstream resolver (`--dns`) and its answer returned; any other is answered
//! `REFUSED` without leaving the host, so a sandbox whose internet is off cannot tunnel data out
//! through DNS. `AAAA` questions get an empty answer (sandboxes have no IPv6), so clients go straight
//! to IPv4. Every question is logged.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

use super::{Egress, Event};

/// How long the upstream resolver may take to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(4);
/// Most DNS-over-TCP queries one connection may send, and how long it may idle.
const TCP_QUERIES: usize = 64;
const TCP_IDLE: Duration = Duration::from_secs(10);

/// Answers queries arriving over UDP until the socket fails.
pub async fn serve_udp(sock: UdpSocket, egress: Arc<Egress>) {
    let sock = Arc::new(sock);
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = match sock.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "sandbox DNS (udp)");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let query = buf[..n].to_vec();
        let (sock, egress) = (sock.clone(), egress.clone());
        tokio::spawn(async move {
            if let Some(answer) = answer(&egress, peer, &query, false).await {
                let _ = sock.send_to(&answer, peer).await;
            }
        });
    }
}

/// Answers queries arriving over TCP (two-byte length prefix, several per connection).
pub async fn serve_tcp(listener: TcpListener, egress: Arc<Egress>) {
    loop {
        let (mut conn, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "sandbox DNS (tcp)");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let egress = egress.clone();
        tokio::spawn(async move {
            for _ in 0..TCP_QUERIES {
                let Ok(Ok(query)) = tokio::time::timeout(TCP_IDLE, read_framed(&mut conn)).await
                else {
                    return;
                };
                let Some(answer) = answer(&egress, peer, &query, true).await else {
                    return;
                };
                if write_framed(&mut conn, &answer).await.is_err() {
                    return;
                }
            }
        });
    }
}

async fn read_framed(conn: &mut TcpStream) -> Result<Vec<u8>> {
    let len = conn.read_u16().await? as usize;
    let mut b = vec![0u8; len];
    conn.read_exact(&mut b).await?;
    Ok(b)
}

async fn write_framed(conn: &mut TcpStream, msg: &[u8]) -> Result<()> {
    let len = u16::try_from(msg.len()).map_err(|_| anyhow!("DNS message too long"))?;
    let mut b = len.to_be_bytes().to_vec();
    b.extend_from_slice(msg);
    conn.write_all(&b).await?;
    Ok(())
}

/// An answer of our own to `query` with `code` and no records.
fn reply(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::new();
    m.set_id(query.id())
        .set_message_type(MessageType::Response)
        .set_op_code(query.op_code())
        .set_recursion_desired(query.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code);
    m.add_queries(query.queries().iter().cloned());
    m.to_vec().ok()
}

/// The answer to one query from `peer`, or None to drop it (not a sandbox, or not DNS at all).
async fn answer(egress: &Egress, peer: SocketAddr, bytes: &[u8], tcp: bool) -> Option<Vec<u8>> {
    let sp = egress.sandbox(peer)?;
    let query = Message::from_vec(bytes).ok()?;
    if query.message_type() != MessageType::Query {
        return None;
    }
    let Some(q) = query
        .queries()
        .first()
        .filter(|_| query.op_code() == OpCode::Query)
    else {
        return reply(&query, ResponseCode::FormErr);
    };
    let name = moat_api::normalize_name(&q.name().to_utf8());
    let qtype = q.query_type();
    let mut verdict = egress.decide(&sp, None, Some(&name));
    // A placeholder in a name would carry it out in the question itself (DNS tunnelling).
    let leak = sp
        .secrets
        .as_deref()
        .and_then(|sec| sec.placeholder_in(name.as_bytes()))
        .map(|s| super::intercept::Violation {
            secret: s.name.clone(),
            host: name.clone(),
            place: "dns",
        });
    if leak.is_some() {
        verdict.decision = moat_api::NetDecision::Deny;
        verdict.rule = "secret".into();
    }
    let started = Instant::now();
    // Questions forwarded at once per sandbox are bounded (each holds a socket of the daemon).
    let held = egress.hold(peer, super::Kind::Dns);
    if held.is_none() && verdict.allowed() {
        verdict.decision = moat_api::NetDecision::Deny;
        verdict.rule = "dns limit".into();
    }
    let (out, error) = if !verdict.allowed() {
        (reply(&query, ResponseCode::Refused), None)
    } else if qtype == RecordType::AAAA {
        (reply(&query, ResponseCode::NoError), None)
    } else {
        match forward(egress.upstream(), bytes, query.id(), tcp).await {
            Ok(a) => (Some(a), None),
            Err(e) => (
                reply(&query, ResponseCode::ServFail),
                Some(format!("{e:#}")),
            ),
        }
    };
    egress
        .log(Event {
            name: Some(name),
            name_source: Some(format!("dns:{qtype}")),
            bytes_out: bytes.len() as u64,
            bytes_in: out.as_ref().map_or(0, |o| o.len() as u64),
            duration_ms: started.elapsed().as_millis() as u64,
            error: error.or_else(|| {
                leak.as_ref().map(|v| {
                    format!(
                        "the placeholder of secret {} in a DNS question: refused",
                        v.secret
                    )
                })
            }),
            ..Event::new(&sp, "dns", None, verdict.decision, verdict.rule)
        })
        .await;
    if let Some(v) = leak {
        egress.violated(&sp.sandbox_id, v);
    }
    out
}

/// Sends a query to the upstream resolver and returns its answer (checked to be the answer to it).
async fn forward(upstream: SocketAddr, query: &[u8], id: u16, tcp: bool) -> Result<Vec<u8>> {
    let exchange = async {
        let answer = if tcp {
            let mut c = TcpStream::connect(upstream).await?;
            write_framed(&mut c, query).await?;
            read_framed(&mut c).await?
        } else {
            let s = UdpSocket::bind("0.0.0.0:0").await?;
            s.connect(upstream).await?;
            s.send(query).await?;
            let mut b = vec![0u8; 4096];
            loop {
                let n = s.recv(&mut b).await?;
                if n >= 2 && u16::from_be_bytes([b[0], b[1]]) == id {
                    break b[..n].to_vec();
                }
            }
        };
        anyhow::Ok(answer)
    };
    let answer = tokio::time::timeout(UPSTREAM_TIMEOUT, exchange)
        .await
        .map_err(|_| anyhow!("upstream resolver {upstream} did not answer"))?
        .with_context(|| format!("upstream resolver {upstream}"))?;
    Message::from_vec(&answer).context("upstream answer is not DNS")?;
    Ok(answer)
}

/// The IPv4 addresses of a name, asked of `upstream` (for the proxy, which connects to names itself).
pub async fn lookup_a(upstream: SocketAddr, name: &str) -> Result<Vec<Ipv4Addr>> {
    let fqdn = Name::from_ascii(format!("{name}.")).with_context(|| format!("{name:?}"))?;
    let mut m = Message::new();
    let id: u16 = rand::random();
    m.set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(fqdn, RecordType::A));
    let answer = forward(upstream, &m.to_vec()?, id, false).await?;
    let a = Message::from_vec(&answer)?;
    if a.response_code() != ResponseCode::NoError {
        bail!("{name}: {}", a.response_code());
    }
    let ips: Vec<Ipv4Addr> = a
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            Some(RData::A(a)) => Some(a.0),
            _ => None,
        })
        .collect();
    if ips.is_empty() {
        bail!("{name} has no IPv4 address");
    }
    Ok(ips)
}
