//! HTTP plumbing: the response body type, the error type every handler returns, and helpers for
//! JSON bodies, query strings and streamed (channel-fed) bodies.

use std::convert::Infallible;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use moat_api::protocol::Endpoint;
use moat_api::{ErrorBody, ErrorCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::mpsc;

/// Body of every response.
pub type RespBody = http_body_util::combinators::BoxBody<Bytes, io::Error>;
/// Result of every handler.
pub type HandlerResult = Result<Response<RespBody>, ApiError>;

/// Largest JSON request body accepted.
const MAX_JSON_BODY: usize = 1 << 20;

/// An error answered as `moat_api::ErrorBody` with the status of its code.
#[derive(Debug)]
pub struct ApiError(pub ErrorBody);

impl ApiError {
    pub fn new(code: ErrorCode, msg: impl Into<String>) -> Self {
        ApiError(ErrorBody::new(code, msg))
    }
    pub fn invalid(field: &str, msg: impl Into<String>) -> Self {
        ApiError(ErrorBody::new(ErrorCode::InvalidArgument, msg).with_field(field))
    }
    pub fn not_found(msg: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, msg)
    }
    pub fn conflict(msg: impl Into<String>) -> Self {
        Self::new(ErrorCode::Conflict, msg)
    }
    /// 409 about a request field: what it names is not in the state the operation needs (a
    /// directory where a file is read, a file where a directory is listed).
    pub fn conflict_on(field: &str, msg: impl Into<String>) -> Self {
        ApiError(ErrorBody::new(ErrorCode::Conflict, msg).with_field(field))
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, msg)
    }

    /// Maps an OS error on `what` (usually a path) to the closest error class.
    pub fn io(what: &str, e: &io::Error) -> Self {
        let code = match e.kind() {
            io::ErrorKind::NotFound => ErrorCode::NotFound,
            io::ErrorKind::PermissionDenied => ErrorCode::PermissionDenied,
            io::ErrorKind::AlreadyExists => ErrorCode::Conflict,
            _ => match e.raw_os_error() {
                Some(libc::ENOTEMPTY)
                | Some(libc::EISDIR)
                | Some(libc::ENOTDIR)
                | Some(libc::EBUSY)
                | Some(libc::EXDEV) => ErrorCode::Conflict,
                Some(libc::EROFS) | Some(libc::EPERM) => ErrorCode::PermissionDenied,
                // A path the request named that the kernel cannot take: too long, a symlink loop,
                // or not a name at all.
                Some(libc::ENAMETOOLONG) | Some(libc::ELOOP) | Some(libc::EINVAL) => {
                    ErrorCode::InvalidArgument
                }
                // The sandbox's own disk quota (or inode count, or file size limit) is used up.
                Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => {
                    ErrorCode::PayloadTooLarge
                }
                _ => ErrorCode::Internal,
            },
        };
        let err = Self::new(code, format!("{what}: {e}"));
        // `what` is a path for every filesystem operation: name the query field it came from.
        if what.starts_with('/') {
            ApiError(err.0.with_field("path"))
        } else {
            err
        }
    }

    pub fn into_response(self) -> Response<RespBody> {
        let status = StatusCode::from_u16(self.0.error.code.status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::to_vec(&self.0).unwrap_or_else(|_| b"{}".to_vec());
        let mut resp = Response::new(full(body));
        *resp.status_mut() = status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/json"),
        );
        resp
    }
}

/// A body holding these bytes.
pub fn full(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// An empty body.
pub fn empty() -> RespBody {
    full(Bytes::new())
}

/// A JSON response.
pub fn json<T: Serialize>(status: StatusCode, v: &T) -> HandlerResult {
    let body =
        serde_json::to_vec(v).map_err(|e| ApiError::internal(format!("encoding response: {e}")))?;
    let mut resp = Response::new(full(body));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Ok(resp)
}

/// `204 No Content`.
pub fn no_content() -> HandlerResult {
    let mut resp = Response::new(empty());
    *resp.status_mut() = StatusCode::NO_CONTENT;
    Ok(resp)
}

/// A streamed response with this content type fed by a channel.
pub fn streamed(
    content_type: &'static str,
    rx: mpsc::Receiver<io::Result<Bytes>>,
    len: Option<u64>,
) -> Response<RespBody> {
    let mut resp = Response::new(ChannelBody { rx, len }.boxed());
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    if let Some(n) = len {
        resp.headers_mut()
            .insert(header::CONTENT_LENGTH, header::HeaderValue::from(n));
    }
    resp
}

/// Response body fed by a bounded channel; dropping it (client gone) makes the sender's `send` fail,
/// which is how producers learn to stop.
pub struct ChannelBody {
    rx: mpsc::Receiver<io::Result<Bytes>>,
    len: Option<u64>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self.len {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}

/// Reads a whole (small) JSON request body into `T`; bad JSON or unknown fields → 400.
pub async fn read_json<T, B>(body: B) -> Result<T, ApiError>
where
    T: DeserializeOwned,
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let bytes = Limited::new(body, MAX_JSON_BODY)
        .collect()
        .await
        .map_err(|e| ApiError::invalid("body", format!("reading request body: {e}")))?
        .to_bytes();
    serde_json::from_slice(&bytes).map_err(|e| {
        let msg = e.to_string();
        let field = field_of_serde_error(&msg).unwrap_or_else(|| "body".to_string());
        ApiError::invalid(&field, format!("invalid request body: {msg}"))
    })
}

/// Parses a query string into `T`; unknown or malformed parameters → 400.
pub fn parse_query<T: DeserializeOwned>(query: Option<&str>) -> Result<T, ApiError> {
    serde_urlencoded::from_str(query.unwrap_or("")).map_err(|e| {
        let msg = e.to_string();
        let field = field_of_serde_error(&msg).unwrap_or_else(|| "query".to_string());
        ApiError::invalid(&field, format!("invalid query: {msg}"))
    })
}

/// The query of endpoint `E` (its type is the protocol table's).
pub fn query_of<E: Endpoint>(query: Option<&str>) -> Result<E::Query, ApiError> {
    parse_query(query)
}

/// The JSON body of endpoint `E` (its type is the protocol table's).
pub async fn body_of<E, B>(body: B) -> Result<E::Body, ApiError>
where
    E: Endpoint,
    B: Body<Data = Bytes>,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    read_json(body).await
}

/// Pulls the field name out of serde's "unknown field `x`" / "missing field `x`" messages.
fn field_of_serde_error(msg: &str) -> Option<String> {
    for prefix in ["unknown field `", "missing field `"] {
        if let Some(rest) = msg.find(prefix).map(|i| &msg[i + prefix.len()..]) {
            return rest.split('`').next().map(str::to_string);
        }
    }
    None
}

/// Serializes one NDJSON line.
pub fn ndjson_line<T: Serialize>(v: &T) -> Bytes {
    let mut line = serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec());
    line.push(b'\n');
    Bytes::from(line)
}

/// Microseconds since the Unix epoch.
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_field_extraction() {
        assert_eq!(
            field_of_serde_error("unknown field `foo`, expected one of").as_deref(),
            Some("foo")
        );
        assert_eq!(
            field_of_serde_error("missing field `path`").as_deref(),
            Some("path")
        );
        assert_eq!(field_of_serde_error("invalid digit"), None);
    }

    #[test]
    fn query_parsing() {
        let q: moat_api::ListQuery =
            parse_query(Some("path=%2Ftmp&depth=2")).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(q.path, "/tmp");
        assert_eq!(q.depth, Some(2));
        let e = parse_query::<moat_api::ListQuery>(Some("path=x&bogus=1")).err();
        assert_eq!(e.and_then(|e| e.0.error.field).as_deref(), Some("bogus"));
        let e = parse_query::<moat_api::ListQuery>(Some("depth=1")).err();
        assert_eq!(e.and_then(|e| e.0.error.field).as_deref(), Some("path"));
    }

    #[test]
    fn path_errors_are_the_requests_fault() {
        let code = |errno| {
            ApiError::io("/x", &io::Error::from_raw_os_error(errno))
                .0
                .error
                .code
        };
        assert_eq!(code(libc::ENAMETOOLONG), ErrorCode::InvalidArgument);
        assert_eq!(code(libc::ELOOP), ErrorCode::InvalidArgument);
        assert_eq!(code(libc::ENOSPC), ErrorCode::PayloadTooLarge);
        assert_eq!(code(libc::EDQUOT), ErrorCode::PayloadTooLarge);
        assert_eq!(code(libc::EIO), ErrorCode::Internal);
        let e = ApiError::io("/x", &io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        assert_eq!(e.0.error.field.as_deref(), Some("path"));
    }
}
