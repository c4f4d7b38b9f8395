//! The Connect protocol (connectrpc.com/docs/protocol) with the JSON codec, as E2B's envd speaks it:
//! unary calls are a JSON body answered with a JSON body (`application/json`); streaming calls carry
//! envelopes (a flag byte, a 4-byte big-endian length, a JSON message) in both directions
//! (`application/connect+json`), and a stream ends with an envelope flagged 0x02 holding `{}` or
//! `{"error": {...}}`. Errors carry string codes (`not_found`, `invalid_argument`, ...).

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use http_body_util::BodyExt;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Content type of streaming requests and responses; clients compare it exactly.
pub const STREAM_CT: &str = "application/connect+json";
/// Largest message accepted in a request envelope or unary body.
pub const MAX_MESSAGE: usize = 16 << 20;
const END_STREAM: u8 = 0x02;
const COMPRESSED: u8 = 0x01;

/// A Connect error: a code from the protocol's list and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::InvalidArgument => "invalid_argument",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error answer (the protocol's table).
    fn status(self) -> http::StatusCode {
        use http::StatusCode as S;
        match self {
            Code::Canceled => S::from_u16(499).unwrap_or(S::BAD_REQUEST),
            Code::Internal => S::INTERNAL_SERVER_ERROR,
            Code::DeadlineExceeded => S::GATEWAY_TIMEOUT,
            Code::InvalidArgument | Code::FailedPrecondition => S::BAD_REQUEST,
            Code::NotFound => S::NOT_FOUND,
            Code::AlreadyExists => S::CONFLICT,
            Code::ResourceExhausted => S::TOO_MANY_REQUESTS,
            Code::Unimplemented => S::NOT_IMPLEMENTED,
            Code::Unavailable => S::SERVICE_UNAVAILABLE,
            Code::Unauthenticated => S::UNAUTHORIZED,
        }
    }
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> ConnectError {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code.as_str(), "message": self.message})
    }
}

/// moat's API errors in Connect's terms.
impl From<crate::api::error::ApiError> for ConnectError {
    fn from(e: crate::api::error::ApiError) -> ConnectError {
        use moat_api::ErrorCode as E;
        let code = match e.0.error.code {
            E::InvalidArgument => Code::InvalidArgument,
            E::NotFound => Code::NotFound,
            E::Conflict => Code::FailedPrecondition,
            E::Unauthorized => Code::Unauthenticated,
            E::PayloadTooLarge => Code::ResourceExhausted,
            E::Unavailable => Code::Unavailable,
            E::InsufficientStorage => Code::ResourceExhausted,
            E::Unprocessable => Code::InvalidArgument,
            _ => Code::Internal,
        };
        ConnectError::new(code, e.0.error.message)
    }
}

impl IntoResponse for ConnectError {
    /// The unary form: the status of the code and a JSON body.
    fn into_response(self) -> Response {
        (self.code.status(), axum::Json(self.json())).into_response()
    }
}

pub type ConnectResult<T> = Result<T, ConnectError>;

/// Reads a unary request's JSON message.
pub async fn unary_request<T: DeserializeOwned>(body: Body) -> ConnectResult<T> {
    let bytes = http_body_util::Limited::new(body, MAX_MESSAGE)
        .collect()
        .await
        .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("read the request: {e}")))?
        .to_bytes();
    parse(&bytes)
}

fn parse<T: DeserializeOwned>(bytes: &[u8]) -> ConnectResult<T> {
    let bytes = if bytes.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| ConnectError::new(Code::InvalidArgument, format!("invalid message: {e}")))
}

/// A unary answer.
pub fn unary_response<T: Serialize>(msg: &T) -> Response {
    match serde_json::to_vec(msg) {
        Ok(body) => ([(http::header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => ConnectError::new(Code::Internal, e.to_string()).into_response(),
    }
}

/// One envelope: flags and the message.
pub fn envelope(flags: u8, msg: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(5 + msg.len());
    b.put_u8(flags);
    b.put_u32(msg.len() as u32);
    b.put_slice(msg);
    b.freeze()
}

/// The envelope of one streamed message.
pub fn message<T: Serialize>(msg: &T) -> Bytes {
    envelope(
        0,
        &serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec()),
    )
}

/// The end-of-stream envelope: success, or an error.
pub fn end(err: Option<&ConnectError>) -> Bytes {
    let payload = match err {
        None => b"{}".to_vec(),
        Some(e) => serde_json::to_vec(&serde_json::json!({"error": e.json()})).unwrap_or_default(),
    };
    envelope(END_STREAM, &payload)
}

/// A streaming answer whose envelopes (each ready to send, the end one included) come from `body`.
pub fn stream_response(body: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    Response::builder()
        .header(http::header::CONTENT_TYPE, STREAM_CT)
        .body(Body::from_stream(
            body.map(Ok::<_, std::convert::Infallible>),
        ))
        .unwrap_or_else(|e| ConnectError::new(Code::Internal, e.to_string()).into_response())
}

/// A streaming answer that is only an error (the call failed before its first message).
pub fn stream_error(err: ConnectError) -> Response {
    stream_response(futures::stream::once(async move { end(Some(&err)) }))
}

/// Splits a request body into envelopes as they arrive (a client stream, or the single message of a
/// server-stream call).
pub struct Envelopes {
    body: Body,
    buf: BytesMut,
    done: bool,
}

impl Envelopes {
    pub fn new(body: Body) -> Envelopes {
        Envelopes {
            body,
            buf: BytesMut::new(),
            done: false,
        }
    }

    /// The next message, None at the end of the body (or at an end-of-stream envelope).
    pub async fn next<T: DeserializeOwned>(&mut self) -> ConnectResult<Option<T>> {
        loop {
            if self.buf.len() >= 5 {
                let flags = self.buf[0];
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if len > MAX_MESSAGE {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!("message of {len} bytes is larger than {MAX_MESSAGE}"),
                    ));
                }
                if self.buf.len() >= 5 + len {
                    self.buf.advance(5);
                    let msg = self.buf.split_to(len);
                    if flags & COMPRESSED != 0 {
                        return Err(ConnectError::new(
                            Code::Unimplemented,
                            "compressed messages are not supported (identity only)",
                        ));
                    }
                    if flags & END_STREAM != 0 {
                        self.done = true;
                        return Ok(None);
                    }
                    return parse(&msg).map(Some);
                }
            }
            if self.done {
                if !self.buf.is_empty() {
                    return Err(ConnectError::new(
                        Code::InvalidArgument,
                        "the request ended inside a message",
                    ));
                }
                return Ok(None);
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => {
                    return Err(ConnectError::new(
                        Code::Canceled,
                        format!("the request stream broke: {e}"),
                    ))
                }
                None => self.done = true,
            }
        }
    }
}

/// Whether a request is a streaming one (by its content type).
pub fn is_stream(headers: &http::HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with(STREAM_CT))
}

/// `Connect-Timeout-Ms`, when the call has a deadline.
pub fn timeout(headers: &http::HeaderMap) -> Option<std::time::Duration> {
    headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(std::time::Duration::from_millis)
}

/// `Keepalive-Ping-Interval` (seconds) E2B's clients ask for on long streams.
pub fn keepalive(headers: &http::HeaderMap) -> std::time::Duration {
    let secs = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|s| *s > 0)
        .unwrap_or(90);
    std::time::Duration::from_secs(secs.min(3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn envelopes_split_across_chunks_and_end() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&message(&serde_json::json!({"a": 1})));
        wire.extend_from_slice(&message(&serde_json::json!({"a": 2})));
        wire.extend_from_slice(&end(None));
        // Fed one byte at a time.
        let chunks: Vec<Result<Bytes, std::io::Error>> =
            wire.iter().map(|b| Ok(Bytes::from(vec![*b]))).collect();
        let body = Body::from_stream(futures::stream::iter(chunks));
        let mut env = Envelopes::new(body);
        let a: serde_json::Value = env.next().await.unwrap().unwrap();
        let b: serde_json::Value = env.next().await.unwrap().unwrap();
        assert_eq!((a["a"].as_i64(), b["a"].as_i64()), (Some(1), Some(2)));
        assert!(env.next::<serde_json::Value>().await.unwrap().is_none());
    }

    #[tokio::test]
    async fn bad_envelopes_are_errors() {
        let mut huge = vec![0u8];
        huge.extend_from_slice(&((MAX_MESSAGE as u32) + 1).to_be_bytes());
        let mut env = Envelopes::new(Body::from(huge));
        assert_eq!(
            env.next::<serde_json::Value>().await.unwrap_err().code,
            Code::ResourceExhausted
        );
        let mut env = Envelopes::new(Body::from(vec![0u8, 0, 0, 0, 9, b'{']));
        assert_eq!(
            env.next::<serde_json::Value>().await.unwrap_err().code,
            Code::InvalidArgument
        );
        let mut env = Envelopes::new(Body::from(envelope(COMPRESSED, b"{}").to_vec()));
        assert_eq!(
            env.next::<serde_json::Value>().await.unwrap_err().code,
            Code::Unimplemented
        );
    }

    #[test]
    fn end_frames_and_errors() {
        assert_eq!(&end(None)[..], b"\x02\x00\x00\x00\x02{}");
        let e = end(Some(&ConnectError::new(Code::NotFound, "gone")));
        assert_eq!(e[0], 0x02);
        let v: serde_json::Value = serde_json::from_slice(&e[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        let r = ConnectError::new(Code::NotFound, "x").into_response();
        assert_eq!(r.status(), 404);
    }
}
