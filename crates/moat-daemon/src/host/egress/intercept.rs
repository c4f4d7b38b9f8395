//! TLS termination towards a secret's host (docs/secrets.md). The proxy answers the sandbox's TLS
//! connection with a certificate for the host signed by the sandbox's own authority, reads its HTTP
//! requests (HTTP/1.1 or HTTP/2, whichever the client chose), puts the secrets' values where their
//! placeholders are (headers, the URL, bodies when asked) and sets `inject: header` headers, then
//! sends each request on its own TLS connection to the real host, verified against the host's
//! trust roots. What comes back has every secret value turned back into its placeholder, so a
//! server that echoes a request cannot hand the value to the sandbox. A placeholder of a secret
//! that does not belong to the host is refused (403) and reported. A WebSocket upgrade passes
//! through untouched after its headers.

use std::convert::Infallible;
use std::net::SocketAddrV4;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::secrets::{Replacer, SandboxSecrets, Scanner};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type OutBody = BoxBody<Bytes, BoxError>;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest request body rewritten for a `body: true` secret (it is read whole first).
const BODY_MAX: usize = 8 << 20;

/// A placeholder headed where it does not belong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The secret's name (never its value).
    pub secret: String,
    pub host: String,
    /// Where it was: `header`, `url`, `body`, `sni`, `dns`, `stream`.
    pub place: &'static str,
}

/// What an intercepted connection did.
#[derive(Debug, Default)]
pub struct Outcome {
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub requests: u64,
    pub violation: Option<Violation>,
    pub error: Option<String>,
}

/// The client's stream with the bytes the proxy peeked at put back in front.
struct Prefixed<S> {
    head: Bytes,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.head.is_empty() {
            let n = self.head.len().min(buf.remaining());
            let b = self.head.split_to(n);
            buf.put_slice(&b);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Answers with the one certificate made for the host.
#[derive(Debug)]
struct One(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for One {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

enum Upstream {
    H1(tokio::sync::Mutex<hyper::client::conn::http1::SendRequest<OutBody>>),
    H2(hyper::client::conn::http2::SendRequest<OutBody>),
}

struct Shared {
    secrets: Arc<SandboxSecrets>,
    host: String,
    upstream: Upstream,
    violation: Mutex<Option<Violation>>,
    out: AtomicU64,
    inn: AtomicU64,
    requests: AtomicU64,
}

impl Shared {
    fn violate(&self, secret: &str, place: &'static str) -> Response<OutBody> {
        let mut v = self.violation.lock().unwrap_or_else(|e| e.into_inner());
        if v.is_none() {
            *v = Some(Violation {
                secret: secret.to_string(),
                host: self.host.clone(),
                place,
            });
        }
        let body = serde_json::json!({"error": {"code": "forbidden", "message": format!(
            "moat: the placeholder of secret {secret} may not go to {} (found in the {place})",
            self.host
        )}});
        let mut r = Response::new(full(body.to_string()));
        *r.status_mut() = StatusCode::FORBIDDEN;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        r
    }
}

fn full(b: impl Into<Bytes>) -> OutBody {
    Full::new(b.into()).map_err(|e| match e {}).boxed()
}

fn bad_gateway(msg: String) -> Response<OutBody> {
    let mut r = Response::new(full(msg));
    *r.status_mut() = StatusCode::BAD_GATEWAY;
    r
}

/// Serves one intercepted connection to `host` (dialed at `target`) until either side closes.
pub async fn serve(
    conn: TcpStream,
    head: Vec<u8>,
    host: String,
    target: SocketAddrV4,
    secrets: Arc<SandboxSecrets>,
    roots: Arc<rustls::ClientConfig>,
) -> Outcome {
    let mut outcome = Outcome::default();
    let leaf = match secrets.ca.leaf(&host) {
        Ok(l) => l,
        Err(e) => {
            outcome.error = Some(format!("certificate for {host}: {e:#}"));
            return outcome;
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut sc = match rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
    {
        Ok(b) => b
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(One(leaf))),
        Err(e) => {
            outcome.error = Some(format!("TLS: {e}"));
            return outcome;
        }
    };
    sc.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(sc));
    let client = Prefixed {
        head: Bytes::from(head),
        inner: conn,
    };
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(client)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            // A client that pins its certificate, or trusts only its own roots, ends here.
            outcome.error = Some(format!(
                "TLS with the sandbox (does it trust its moat CA?): {e}"
            ));
            return outcome;
        }
        Err(_) => {
            outcome.error = Some("TLS with the sandbox: timed out".into());
            return outcome;
        }
    };
    let client_h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let upstream = match connect(&host, target, &roots, client_h2).await {
        Ok(u) => u,
        Err(e) => {
            outcome.error = Some(e);
            // The sandbox still gets an answer rather than a dropped connection.
            let msg = outcome.error.clone().unwrap_or_default();
            let svc = hyper::service::service_fn(move |_req: Request<Incoming>| {
                let m = msg.clone();
                async move { Ok::<_, Infallible>(bad_gateway(format!("moat: {m}\n"))) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tls), svc)
                .await;
            return outcome;
        }
    };
    let shared = Arc::new(Shared {
        secrets,
        host,
        upstream,
        violation: Mutex::new(None),
        out: AtomicU64::new(0),
        inn: AtomicU64::new(0),
        requests: AtomicU64::new(0),
    });
    let sh = shared.clone();
    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
        let sh = sh.clone();
        async move { Ok::<_, Infallible>(handle(&sh, req).await) }
    });
    if let Err(e) = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection_with_upgrades(TokioIo::new(tls), svc)
        .await
    {
        let e = e.to_string();
        if !e.contains("connection closed") && !e.contains("connection reset") {
            outcome.error = Some(e);
        }
    }
    outcome.bytes_out = shared.out.load(Ordering::Relaxed);
    outcome.bytes_in = shared.inn.load(Ordering::Relaxed);
    outcome.requests = shared.requests.load(Ordering::Relaxed);
    outcome.violation = shared
        .violation
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    outcome
}

/// The proxy's own verified TLS connection to the real host, speaking HTTP/2 when both sides do.
async fn connect(
    host: &str,
    target: SocketAddrV4,
    roots: &rustls::ClientConfig,
    h2: bool,
) -> Result<Upstream, String> {
    let tcp = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(target)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => return Err(format!("connect {target}: {e}")),
        Err(_) => return Err(format!("connect {target}: timed out")),
    };
    let _ = tcp.set_nodelay(true);
    let mut cc = roots.clone();
    cc.alpn_protocols = if h2 {
        vec![b"h2".to_vec(), b"http/1.1".to_vec()]
    } else {
        vec![b"http/1.1".to_vec()]
    };
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host}: {e}"))?;
    let tls = tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        tokio_rustls::TlsConnector::from(Arc::new(cc)).connect(name, tcp),
    )
    .await
    .map_err(|_| format!("TLS with {host}: timed out"))?
    .map_err(|e| format!("TLS with {host}: {e}"))?;
    let up_h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let io = TokioIo::new(tls);
    if up_h2 {
        let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(|e| format!("HTTP/2 with {host}: {e}"))?;
        tokio::spawn(conn);
        Ok(Upstream::H2(send))
    } else {
        let (send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(|e| format!("HTTP/1.1 with {host}: {e}"))?;
        tokio::spawn(conn.with_upgrades());
        Ok(Upstream::H1(tokio::sync::Mutex::new(send)))
    }
}

/// Whether a request's authority (`host[:port]`) names `host`.
fn same_host(authority: &str, host: &str) -> bool {
    let name = match authority.rsplit_once(':') {
        Some((n, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => authority,
    };
    moat_api::normalize_name(name) == moat_api::normalize_name(host)
}

/// Headers that belong to one hop of a connection (never forwarded between HTTP versions).
const HOP: [&str; 6] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "upgrade",
];

/// A header value with the host's placeholders replaced, looking inside `Basic` credentials too
/// (git and many clients send a token as a Basic password). Err: a placeholder that does not
/// belong here.
fn rewrite_header(
    secrets: &SandboxSecrets,
    host: &str,
    out: &Replacer,
    v: &[u8],
) -> Result<Vec<u8>, String> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let basic = v
        .get(..6)
        .is_some_and(|p| p.eq_ignore_ascii_case(b"basic "))
        .then(|| b64.decode(v[6..].trim_ascii()).ok())
        .flatten();
    if let Some(creds) = basic {
        if let Some(s) = secrets.foreign_in(&creds, Some(host)) {
            return Err(s.name.clone());
        }
        if secrets.placeholder_in(&creds).is_some() {
            let mut r = b"Basic ".to_vec();
            r.extend_from_slice(b64.encode(out.all(&creds)).as_bytes());
            return Ok(r);
        }
    }
    if let Some(s) = secrets.foreign_in(v, Some(host)) {
        return Err(s.name.clone());
    }
    Ok(out.all(v))
}

async fn handle(sh: &Arc<Shared>, req: Request<Incoming>) -> Response<OutBody> {
    sh.requests.fetch_add(1, Ordering::Relaxed);
    let (mut parts, body) = req.into_parts();
    let secrets = &sh.secrets;
    let host = sh.host.as_str();
    let out = secrets.outgoing(host);
    // The URL.
    let uri = parts.uri.to_string();
    if let Some(s) = secrets.foreign_in(uri.as_bytes(), Some(host)) {
        let name = s.name.clone();
        return sh.violate(&name, "url");
    }
    if secrets.placeholder_in(uri.as_bytes()).is_some() {
        match String::from_utf8(out.all(uri.as_bytes()))
            .ok()
            .and_then(|u| u.parse().ok())
        {
            Some(u) => parts.uri = u,
            None => return bad_gateway("moat: the URL with the secret is not a URL\n".into()),
        }
    }
    // The headers.
    let mut headers = http::HeaderMap::with_capacity(parts.headers.len() + 2);
    for (k, v) in &parts.headers {
        match rewrite_header(secrets, host, &out, v.as_bytes()) {
            Ok(nv) => match HeaderValue::from_bytes(&nv) {
                Ok(nv) => {
                    headers.append(k.clone(), nv);
                }
                Err(_) => return bad_gateway(format!("moat: header {k} is not valid\n")),
            },
            Err(name) => return sh.violate(&name, "header"),
        }
    }
    for s in secrets
        .secrets
        .iter()
        .filter(|s| s.inject == moat_api::SecretInject::Header && s.belongs_to(host))
    {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(s.header.as_bytes()),
            HeaderValue::from_str(&s.header_value()),
        ) {
            headers.insert(k, v);
        }
    }
    // Answers come back unencoded, so that a value in them can be turned back into its
    // placeholder.
    headers.insert(
        http::header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    let upgrade = parts.extensions.remove::<hyper::upgrade::OnUpgrade>();
    let wants_upgrade = headers.contains_key(http::header::UPGRADE);
    // The body: rewritten whole for a `body: true` secret, else streamed and watched.
    let body_out = Replacer::new(
        secrets
            .secrets
            .iter()
            .filter(|s| s.body && s.belongs_to(host))
            .map(|s| {
                (
                    s.placeholder.clone().into_bytes(),
                    s.value.clone().into_bytes(),
                )
            })
            .collect(),
    );
    let body: OutBody = if !body_out.is_empty() {
        let whole = match Limited::new(body, BODY_MAX).collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) => {
                let mut r = bad_gateway(format!(
                    "moat: a request body to rewrite is read whole, at most {BODY_MAX} bytes: {e}\n"
                ));
                *r.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                return r;
            }
        };
        if let Some(s) = secrets.foreign_in(&whole, Some(host)) {
            let name = s.name.clone();
            return sh.violate(&name, "body");
        }
        let b = body_out.all(&whole);
        headers.remove(http::header::TRANSFER_ENCODING);
        headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(b.len()));
        sh.out.fetch_add(b.len() as u64, Ordering::Relaxed);
        full(b)
    } else {
        Watched {
            inner: body,
            sh: sh.clone(),
            scan: Scanner::new(),
        }
        .boxed()
    };
    let h2_up = matches!(sh.upstream, Upstream::H2(_));
    let authority = parts
        .uri
        .authority()
        .map(|a| a.to_string())
        .or_else(|| {
            headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        })
        .unwrap_or_else(|| host.to_string());
    // The request must be for the host the connection was terminated for: a shared front (a CDN)
    // routes by Host, so `Host: attacker.example` inside a connection to a secret's host would
    // carry the value to another site (domain fronting).
    if !same_host(&authority, host) {
        let mut r = Response::new(full(format!(
            "moat: this connection carries secrets for {host}; a request for {authority} is \
             refused (open a connection to that host instead)\n"
        )));
        *r.status_mut() = StatusCode::MISDIRECTED_REQUEST;
        return r;
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    if h2_up {
        for h in HOP {
            headers.remove(h);
        }
        headers.remove(http::header::HOST);
        parts.version = http::Version::HTTP_2;
        parts.uri = match format!("https://{authority}{path}").parse() {
            Ok(u) => u,
            Err(_) => return bad_gateway("moat: bad request target\n".into()),
        };
    } else {
        if parts.version == http::Version::HTTP_2 {
            for h in HOP {
                headers.remove(h);
            }
        }
        if !headers.contains_key(http::header::HOST) {
            if let Ok(v) = HeaderValue::from_str(&authority) {
                headers.insert(http::header::HOST, v);
            }
        }
        parts.version = http::Version::HTTP_11;
        parts.uri = match path.parse() {
            Ok(u) => u,
            Err(_) => return bad_gateway("moat: bad request target\n".into()),
        };
    }
    parts.headers = headers;
    let req = Request::from_parts(parts, body);
    let sent = match &sh.upstream {
        Upstream::H2(s) => s.clone().send_request(req).await,
        Upstream::H1(s) => {
            let mut s = s.lock().await;
            if let Err(e) = s.ready().await {
                return bad_gateway(format!("moat: {host}: {e}\n"));
            }
            s.send_request(req).await
        }
    };
    // A placeholder found in a streamed body stops it; the request failed because of that.
    let found = sh
        .violation
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if let Some(v) = found {
        if v.place == "body" {
            return sh.violate(&v.secret, "body");
        }
    }
    let mut resp = match sent {
        Ok(r) => r,
        Err(e) => return bad_gateway(format!("moat: {host}: {e}\n")),
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS && wants_upgrade {
        let up = hyper::upgrade::on(&mut resp);
        if let Some(down) = upgrade {
            tokio::spawn(async move {
                if let (Ok(up), Ok(down)) = (up.await, down.await) {
                    let (mut up, mut down) = (TokioIo::new(up), TokioIo::new(down));
                    let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                }
            });
        }
        let (parts, _) = resp.into_parts();
        return Response::from_parts(parts, full(Bytes::new()));
    }
    // What comes back: values become placeholders again.
    let (mut parts, body) = resp.into_parts();
    let back = secrets.incoming();
    let mut headers = http::HeaderMap::with_capacity(parts.headers.len());
    for (k, v) in &parts.headers {
        if let Ok(nv) = HeaderValue::from_bytes(&back.all(v.as_bytes())) {
            headers.append(k.clone(), nv);
        }
    }
    for h in HOP {
        headers.remove(h);
    }
    let bodiless = parts.status == StatusCode::NO_CONTENT
        || parts.status == StatusCode::NOT_MODIFIED
        || parts.status.is_informational();
    if !bodiless {
        // The length may change with the rewriting; the body is sent as it comes.
        headers.remove(http::header::CONTENT_LENGTH);
    }
    parts.headers = headers;
    let body = Redacted {
        inner: body,
        rep: back,
        sh: sh.clone(),
        done: false,
    };
    Response::from_parts(parts, body.boxed())
}

/// A request body streamed as written, stopped at a placeholder of a secret that does not belong
/// to the host.
struct Watched {
    inner: Incoming,
    sh: Arc<Shared>,
    scan: Scanner,
}

impl Body for Watched {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) => {
                if let Some(d) = f.data_ref() {
                    let sh = &this.sh;
                    sh.out.fetch_add(d.len() as u64, Ordering::Relaxed);
                    if let Some(s) = this.scan.foreign(&sh.secrets, d, Some(&sh.host)) {
                        let mut v = sh.violation.lock().unwrap_or_else(|e| e.into_inner());
                        if v.is_none() {
                            *v = Some(Violation {
                                secret: s.name.clone(),
                                host: sh.host.clone(),
                                place: "body",
                            });
                        }
                        return Poll::Ready(Some(Err(
                            "a secret's placeholder to another host".into()
                        )));
                    }
                }
                Poll::Ready(Some(Ok(f)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Box::new(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body with every secret's value turned back into its placeholder.
struct Redacted {
    inner: Incoming,
    rep: Replacer,
    sh: Arc<Shared>,
    done: bool,
}

impl Body for Redacted {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => {
                        this.sh.inn.fetch_add(d.len() as u64, Ordering::Relaxed);
                        let out = this.rep.push(&d);
                        if !out.is_empty() {
                            return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                        }
                    }
                    Err(f) => return Poll::Ready(Some(Ok(f))),
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(Box::new(e)))),
                Poll::Ready(None) => {
                    this.done = true;
                    let rest = this.rep.finish();
                    if !rest.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(rest)))));
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_for_the_connections_host_or_refused() {
        assert!(same_host("api.github.com", "api.github.com"));
        assert!(same_host("API.GitHub.com.:443", "api.github.com"));
        assert!(!same_host("evil.example", "api.github.com"));
        assert!(!same_host(
            "api.github.com.evil.example:443",
            "api.github.com"
        ));
        assert!(!same_host("[::1]:443", "api.github.com"));
    }
}
