//! Serving a front (the REST API, the E2B API) on a listener the way a port anyone may reach must
//! be served: every connection counted (in all and per client address) against caps kept below
//! the daemon's file limit, a connection over a cap answered `503` at once and closed, a request
//! head that does not arrive in time (a half-sent request, or an idle keep-alive connection) ending
//! its connection, and a request body that stops arriving ending its request. None of this needs
//! an API key: it holds before authentication, so a client without one cannot use up the file
//! descriptors sandboxes and agent connections need.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;

/// What a listener allows.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once, from all clients.
    pub max_connections: usize,
    /// Connections open at once from one client address.
    pub max_per_client: usize,
    /// How long a request's head may take to arrive, counted from when the connection is ready
    /// for it: a half-sent request, or an HTTP/1.1 connection idle between requests, is closed
    /// after it.
    pub header_timeout: Duration,
    /// How long a request body may go without sending a byte while it is being read (a request
    /// announcing a body and sending nothing); stdin streams are exempt.
    pub body_idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_connections: 4096,
            max_per_client: 1024,
            header_timeout: Duration::from_secs(30),
            body_idle_timeout: Duration::from_secs(60),
        }
    }
}

impl Limits {
    /// These limits with the total capped at half of the daemon's open-file limit (the other half
    /// stays for sandboxes, agent connections, the egress proxy and the database).
    pub fn within_file_limit(mut self) -> Limits {
        let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
            .map(|(soft, _)| soft)
            .unwrap_or(1024);
        let room = usize::try_from(soft / 2).unwrap_or(usize::MAX).max(16);
        if self.max_connections > room {
            tracing::warn!(
                asked = self.max_connections,
                allowed = room,
                "connection cap lowered to half the daemon's open-file limit"
            );
            self.max_connections = room;
        }
        self.max_per_client = self.max_per_client.min(self.max_connections);
        self
    }
}

/// Who a connection counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Client {
    Ip(IpAddr),
    /// A unix socket: one local client.
    Local,
}

/// The connection counts of one listener.
#[derive(Debug)]
pub struct Gate {
    limits: Limits,
    total: AtomicUsize,
    per: Mutex<HashMap<Client, usize>>,
}

/// One counted connection; dropping it gives its place back.
#[derive(Debug)]
pub struct Permit {
    gate: Arc<Gate>,
    client: Client,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.gate.total.fetch_sub(1, Ordering::Relaxed);
        let mut per = self
            .gate
            .per
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = per.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                per.remove(&self.client);
            }
        }
    }
}

impl Gate {
    pub fn new(limits: Limits) -> Arc<Gate> {
        Arc::new(Gate {
            limits,
            total: AtomicUsize::new(0),
            per: Mutex::new(HashMap::new()),
        })
    }

    /// A place for a connection from `client`, unless a cap is reached.
    pub fn enter(self: &Arc<Self>, client: Client) -> Option<Permit> {
        let mut per = self
            .per
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mine = per.get(&client).copied().unwrap_or(0);
        if mine >= self.limits.max_per_client
            || self.total.load(Ordering::Relaxed) >= self.limits.max_connections
        {
            return None;
        }
        per.insert(client, mine + 1);
        self.total.fetch_add(1, Ordering::Relaxed);
        Some(Permit {
            gate: self.clone(),
            client,
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }
}

/// What a connection over a cap gets before it is closed.
const FULL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: 108\r\n\r\n{\"error\":{\"code\":\"unavailable\",\"message\":\"too many connections to this moat daemon; try again in a moment\"}}";

/// A listener the fronts are served on.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// An accepted connection.
enum Accepted {
    Tcp(tokio::net::TcpStream, IpAddr),
    Unix(tokio::net::UnixStream),
}

impl Accepted {
    fn client(&self) -> Client {
        match self {
            Accepted::Tcp(_, ip) => Client::Ip(*ip),
            Accepted::Unix(_) => Client::Local,
        }
    }

    /// Answers 503 with what fits in the socket's buffer, without waiting, and closes.
    fn refuse(self) {
        let _ = match &self {
            Accepted::Tcp(s, _) => s.try_write(FULL),
            Accepted::Unix(s) => s.try_write(FULL),
        };
    }
}

impl Listener {
    async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Listener::Tcp(l) => {
                let (s, addr) = l.accept().await?;
                // Streamed answers are many small writes: without TCP_NODELAY, Nagle's algorithm
                // and the peer's delayed ACK add ~40 ms to the first event of a stream.
                let _ = s.set_nodelay(true);
                Ok(Accepted::Tcp(s, addr.ip()))
            }
            Listener::Unix(l) => Ok(Accepted::Unix(l.accept().await?.0)),
        }
    }
}

/// Serves `router` on `listener` within the limits of `gate` (which every API listener shares, so
/// their caps hold together) until `shutdown`, then lets the requests in flight finish (at most
/// 10 s). `exempt` says which requests' bodies may stay idle as long as they like (stdin streams).
pub async fn serve(
    listener: Listener,
    router: Router,
    gate: Arc<Gate>,
    exempt: fn(&http::request::Parts) -> bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let limits = gate.limits;
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        // A peer that stops answering pings is gone: its connection goes.
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(20));
    let mut shutdown = std::pin::pin!(shutdown);
    let mut accept_errors = 0u64;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            () = &mut shutdown => break,
        };
        let conn = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors (EMFILE/ENFILE) or a connection reset before it was
                // taken: wait a little instead of spinning, and say so now and then.
                accept_errors += 1;
                if accept_errors.is_power_of_two() {
                    tracing::warn!(errors = accept_errors, "accept: {e}");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        let Some(permit) = gate.enter(conn.client()) else {
            conn.refuse();
            continue;
        };
        let router = router.clone();
        let idle = limits.body_idle_timeout;
        let header_timeout = limits.header_timeout;
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            // The first bytes decide HTTP/1 or HTTP/2, and nothing in hyper times that wait out:
            // a TCP connection that sends nothing is closed after the header timeout. (The unix
            // socket is its owner's alone.)
            if let Accepted::Tcp(s, _) = &conn {
                let mut first = [0u8; 1];
                match tokio::time::timeout(header_timeout, s.peek(&mut first)).await {
                    Ok(Ok(n)) if n > 0 => {}
                    _ => return,
                }
            }
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (parts, body) = req.into_parts();
                let body = if exempt(&parts) {
                    Body::new(body)
                } else {
                    Body::new(IdleTimeout::new(body, idle))
                };
                let mut router = router.clone();
                async move {
                    use tower_service::Service;
                    router.call(Request::from_parts(parts, body)).await
                }
            });
            let served = match conn {
                Accepted::Tcp(s, _) => {
                    watcher
                        .watch(
                            builder
                                .serve_connection_with_upgrades(TokioIo::new(s), svc)
                                .into_owned(),
                        )
                        .await
                }
                Accepted::Unix(s) => {
                    watcher
                        .watch(
                            builder
                                .serve_connection_with_upgrades(TokioIo::new(s), svc)
                                .into_owned(),
                        )
                        .await
                }
            };
            if let Err(e) = served {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(Duration::from_secs(10)) => {
            tracing::info!("stopping with requests still in flight");
        }
    }
}

/// A request body that fails when no byte of it arrives for `timeout` while it is being read.
pub struct IdleTimeout<B> {
    inner: B,
    timeout: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<B> IdleTimeout<B> {
    pub fn new(inner: B, timeout: Duration) -> IdleTimeout<B> {
        IdleTimeout {
            inner,
            timeout,
            sleep: None,
        }
    }
}

impl<B> http_body::Body for IdleTimeout<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(f) => {
                // The clock runs only while the reader waits for the next frame.
                this.sleep = None;
                Poll::Ready(f.map(|r| r.map_err(Into::into)))
            }
            Poll::Pending => {
                let timeout = this.timeout;
                let sleep = this
                    .sleep
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                        "the request body sent nothing for {} s",
                        timeout.as_secs()
                    )
                    .into()))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn the_gate_counts_per_client_and_in_all() {
        let gate = Gate::new(Limits {
            max_connections: 3,
            max_per_client: 2,
            ..Default::default()
        });
        let a = Client::Ip("127.0.0.1".parse().unwrap());
        let b = Client::Ip("127.0.0.2".parse().unwrap());
        let a1 = gate.enter(a).unwrap();
        let _a2 = gate.enter(a).unwrap();
        assert!(gate.enter(a).is_none(), "per-client cap");
        let _b1 = gate.enter(b).unwrap();
        assert!(gate.enter(Client::Local).is_none(), "total cap");
        drop(a1);
        assert_eq!(gate.open(), 2);
        assert!(gate.enter(a).is_some());
        assert_eq!(
            FULL.len() - FULL.windows(4).position(|w| w == b"\r\n\r\n").unwrap() - 4,
            108
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_stops_sending_fails_and_one_that_sends_does_not() {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
        let body = http_body_util::StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut timed = IdleTimeout::new(body, Duration::from_secs(60));
        tx.send(Ok(Frame::data(Bytes::from_static(b"abc"))))
            .await
            .unwrap();
        let f = timed.frame().await.unwrap().unwrap();
        assert_eq!(f.into_data().unwrap(), "abc");
        // Nothing more arrives: the next read fails after the timeout.
        let err = timed.frame().await.unwrap().unwrap_err();
        assert!(err.to_string().contains("sent nothing for 60 s"), "{err}");
        drop(tx);
    }
}
