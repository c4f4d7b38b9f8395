//! A byte stream to a TCP port inside the sandbox (the agent's `POST /tcp`): the ports proxy and
//! the ready check of a template's start command.

use axum::body::Body;
use futures::StreamExt;
use http_body_util::BodyExt;
use moat_api::protocol::{endpoint, TcpQuery};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::wire::AgentError;
use super::AgentClient;

impl AgentClient {
    /// One end of an in-memory duplex pipe pumped to and from the agent's HTTP/2 stream to `port`
    /// inside the sandbox. An error when nothing listens there.
    pub async fn tcp_tunnel(&self, port: u16) -> Result<tokio::io::DuplexStream, AgentError> {
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<bytes::Bytes>>(8);
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
        let resp = self
            .request::<endpoint::Tcp>(None, &TcpQuery { port }, None, body)
            .await?;
        let (ours, theirs) = tokio::io::duplex(64 << 10);
        let (mut rd, mut wr) = tokio::io::split(theirs);
        tokio::spawn(async move {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx
                            .send(Ok(bytes::Bytes::copy_from_slice(&buf[..n])))
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }
            }
        });
        let mut incoming = resp.into_body().into_data_stream();
        tokio::spawn(async move {
            while let Some(Ok(chunk)) = incoming.next().await {
                if wr.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            let _ = wr.shutdown().await;
        });
        Ok(ours)
    }
}
