//! `POST /tcp?port=N`: a byte tunnel to a TCP port inside the sandbox. The request body is written to
//! the connection, the response body is what the connection sends back; either side ending ends the
//! tunnel. The daemon uses it to expose sandbox ports (HTTP and WebSocket preview URLs) on every
//! tier, without the sandbox needing a network.

use moat_api::protocol::endpoint;
use std::io;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::http::{streamed, ApiError, HandlerResult};

pub async fn tunnel(query: Option<&str>, mut body: Incoming) -> HandlerResult {
    let q = crate::http::query_of::<endpoint::Tcp>(query)?;
    if q.port == 0 {
        return Err(ApiError::invalid("port", "port must be 1..=65535"));
    }
    let conn = tokio::net::TcpStream::connect(("127.0.0.1", q.port))
        .await
        .map_err(|e| {
            ApiError::new(
                moat_api::ErrorCode::Unavailable,
                format!("nothing answers on port {} in the sandbox: {e}", q.port),
            )
        })?;
    let _ = conn.set_nodelay(true);
    let (mut rd, mut wr) = conn.into_split();
    tokio::spawn(async move {
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            if let Ok(data) = frame.into_data() {
                if wr.write_all(&data).await.is_err() {
                    break;
                }
            }
        }
        let _ = wr.shutdown().await;
    });
    let (tx, rx) = mpsc::channel::<io::Result<Bytes>>(8);
    tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => {
                    if tx
                        .send(Ok(Bytes::copy_from_slice(&buf[..n])))
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    break;
                }
            }
        }
    });
    let mut resp = streamed("application/octet-stream", rx, None);
    *resp.status_mut() = StatusCode::OK;
    Ok(resp)
}
