//! envd's HTTP side (port 49983) on moat's agent: `/health`, `/envs`, file download and upload
//! (`/files`, multipart or a raw body, gzip, E2B's signed URLs), the two Connect services, and any
//! other port relayed to the sandbox.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use http::StatusCode;
use sha2::{Digest, Sha256};

use moat_api::WriteQuery;

use super::{E2b, User};
use crate::agent::AgentError;
use crate::api::constant_time_eq;

/// envd's plain-HTTP error: `{"code": <status>, "message"}`.
pub(super) fn http_error(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    (
        status,
        axum::Json(serde_json::json!({"code": status.as_u16(), "message": message})),
    )
        .into_response()
}

/// The sandbox's access token (`envdAccessToken`), or the answer a request for it gets.
fn token_of(e: &E2b, id: &str) -> Result<moat_api::Sandbox, Response> {
    e.app.sandboxes.get(id).map_err(|err| {
        // What envd's proxy answers for a sandbox it does not know (the SDK reads "was not found").
        http_error(
            StatusCode::BAD_GATEWAY,
            format!("sandbox {id} was not found: {}", err),
        )
    })
}

fn header_token(headers: &http::HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_string())
}

fn token_ok(given: Option<String>, token: &str) -> bool {
    !token.is_empty() && given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes()))
}

/// A request to envd (49983) of sandbox `id`.
pub(super) async fn handle(e: &Arc<E2b>, id: &str, req: Request) -> Response {
    let sbx = match token_of(e, id) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let given = header_token(req.headers(), "x-access-token");
    let authed = token_ok(given, &sbx.access_token);
    let status_of = |r: &Response| r.status().as_u16();
    if path == "/health" {
        return match e.app.sandboxes.agent(id).await {
            Ok(_) => StatusCode::NO_CONTENT.into_response(),
            Err(err) => http_error(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {id} is not reachable: {}", err),
            ),
        };
    }
    let signed_ok =
        path == "/files" && signature_valid(req.uri().query(), req.method(), &sbx.access_token);
    if !authed && !signed_ok {
        let r = http_error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong X-Access-Token (the sandbox's envdAccessToken)",
        );
        e.audit(
            crate::audit::ANONYMOUS.into(),
            format!("e2b {method} {path}"),
            Some(id),
            401,
        )
        .await;
        return r;
    }
    let agent = match e.app.sandboxes.agent(id).await {
        Ok(a) => a,
        Err(err) => {
            return http_error(
                StatusCode::BAD_GATEWAY,
                format!("sandbox {id} is not reachable: {}", err),
            )
        }
    };
    let query_user = (path == "/files")
        .then(|| files_query(req.uri().query()).username)
        .flatten();
    let user = match e
        .user_of(id, &agent, req.headers(), query_user.as_deref())
        .await
    {
        Ok(u) => u,
        Err(msg) => {
            return if path.starts_with("/process.") || path.starts_with("/filesystem.") {
                let err =
                    super::connect::ConnectError::new(super::connect::Code::Unauthenticated, msg);
                if super::connect::is_stream(req.headers()) {
                    super::connect::stream_error(err)
                } else {
                    err.into_response()
                }
            } else {
                http_error(StatusCode::UNAUTHORIZED, msg)
            }
        }
    };
    let resp = if let Some(m) = path.strip_prefix("/process.Process/") {
        let (parts, body) = req.into_parts();
        if parts.method != http::Method::POST {
            return http_error(StatusCode::METHOD_NOT_ALLOWED, "Connect calls are POSTs");
        }
        super::process::handle(e, id, &agent, &user, m, &parts.headers, body).await
    } else if let Some(m) = path.strip_prefix("/filesystem.Filesystem/") {
        let (parts, body) = req.into_parts();
        if parts.method != http::Method::POST {
            return http_error(StatusCode::METHOD_NOT_ALLOWED, "Connect calls are POSTs");
        }
        super::filesystem::handle(e, id, &agent, &user, m, &parts.headers, body).await
    } else {
        match (method.clone(), path.as_str()) {
            (http::Method::GET, "/envs") => {
                axum::Json(e.app.sandboxes.environment(id).unwrap_or_default()).into_response()
            }
            (http::Method::GET, "/files") => download(&agent, &user, req).await,
            (http::Method::POST, "/files") => upload(&agent, &user, req).await,
            _ => http_error(
                StatusCode::NOT_FOUND,
                format!("no envd endpoint {method} {path}"),
            ),
        }
    };
    // Reads and the streams that follow processes are not audited one by one; changes are.
    if method != http::Method::GET && path != "/process.Process/List" {
        let actor = format!("sandbox-token:{}", &id[..id.len().min(12)]);
        e.audit(
            actor,
            format!("e2b {method} {path}"),
            Some(id),
            status_of(&resp),
        )
        .await;
    }
    resp
}

/// Query parameters of `/files`.
#[derive(Debug, Default, serde::Deserialize)]
struct FilesQuery {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    signature: Option<String>,
    #[serde(default)]
    signature_expiration: Option<i64>,
}

fn files_query(q: Option<&str>) -> FilesQuery {
    serde_urlencoded::from_str(q.unwrap_or("")).unwrap_or_default()
}

/// E2B's signature of a file URL: `v1_` + base64(sha256("path:op:user:token[:expiration]")).
fn signature(path: &str, op: &str, user: &str, token: &str, expiration: Option<i64>) -> String {
    let mut raw = format!("{path}:{op}:{user}:{token}");
    if let Some(x) = expiration {
        raw.push_str(&format!(":{x}"));
    }
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(raw.as_bytes()))
    )
}

pub(super) fn is_signed(query: Option<&str>) -> bool {
    files_query(query).signature.is_some()
}

fn signature_valid(query: Option<&str>, method: &http::Method, token: &str) -> bool {
    let q = files_query(query);
    let (Some(sig), Some(path)) = (q.signature.as_deref(), q.path.as_deref()) else {
        return false;
    };
    if token.is_empty() {
        return false;
    }
    if q.signature_expiration
        .is_some_and(|x| x < crate::clock::now_ms() / 1000)
    {
        return false;
    }
    let op = if method == http::Method::GET {
        "read"
    } else {
        "write"
    };
    let want = signature(
        path,
        op,
        q.username.as_deref().unwrap_or(""),
        token,
        q.signature_expiration,
    );
    constant_time_eq(sig.as_bytes(), want.as_bytes())
}

/// A signed `/files` URL without E2B's sandbox headers (a browser or curl following
/// `download_url()`): the sandbox is the one whose token the signature was made with.
pub(super) async fn signed_files(e: &Arc<E2b>, req: Request) -> Response {
    let Ok(all) = e.app.sandboxes.list(&Default::default()) else {
        return http_error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "sandbox list unavailable",
        );
    };
    let query = req.uri().query().map(str::to_string);
    let found = all
        .into_iter()
        .find(|s| signature_valid(query.as_deref(), req.method(), &s.access_token));
    match found {
        Some(r) => handle(e, &r.id, req).await,
        None => http_error(
            StatusCode::UNAUTHORIZED,
            "the URL's signature matches no sandbox (or it expired)",
        ),
    }
}

/// `GET /files?path=&username=`: the file's bytes.
async fn download(agent: &crate::agent::AgentClient, user: &User, req: Request) -> Response {
    let q = files_query(req.uri().query());
    let Some(path) = q.path.filter(|p| !p.is_empty()) else {
        return http_error(StatusCode::BAD_REQUEST, "path is missing");
    };
    let path = user.resolve(&path);
    let resp = match agent.read_file(&path).await {
        Ok(r) => r,
        Err(err) => return agent_error_response(err),
    };

    let name = path.rsplit('/').next().unwrap_or("").replace('"', "");
    let (parts, body) = resp.into_parts();
    let mut out = Response::builder()
        .status(StatusCode::OK)
        .header(http::header::CONTENT_TYPE, "application/octet-stream")
        .header(
            http::header::CONTENT_DISPOSITION,
            format!("inline; filename=\"{name}\""),
        );
    if let Some(len) = parts.headers.get(http::header::CONTENT_LENGTH) {
        out = out.header(http::header::CONTENT_LENGTH, len);
    }
    out.body(Body::new(body))
        .unwrap_or_else(|err| http_error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))
}

/// An agent call's error as envd's answer (`{"code", "message"}`, the agent's status; 502 when it
/// did not answer).
fn agent_error_response(err: AgentError) -> Response {
    let (status, message) = match err {
        AgentError::Refused { status, body } => (status, body.error.message),
        other => (StatusCode::BAD_GATEWAY, other.to_string()),
    };
    let status = if message.contains("No space left") {
        StatusCode::INSUFFICIENT_STORAGE
    } else {
        status
    };
    http_error(status, message)
}

/// Writes one file through the agent (atomically, owned by the user); envd's answer entry.
async fn write_one(
    agent: &crate::agent::AgentClient,
    user: &User,
    path: &str,
    body: Body,
) -> Result<serde_json::Value, Response> {
    let path = user.resolve(path);
    let q = WriteQuery {
        path: path.clone(),
        mode: None,
        user: Some(user.name.clone()),
    };
    agent
        .write_file(&q, body)
        .await
        .map_err(agent_error_response)?;
    let name = path.rsplit('/').next().unwrap_or("").to_string();
    Ok(serde_json::json!({"name": name, "type": "file", "path": path}))
}

/// `POST /files`: multipart (each part's filename is its destination) or a raw body at `path`,
/// gzip-compressed when `Content-Encoding: gzip`.
async fn upload(agent: &crate::agent::AgentClient, user: &User, req: Request) -> Response {
    if req
        .headers()
        .keys()
        .any(|k| k.as_str().starts_with("x-metadata-"))
    {
        return http_error(
            StatusCode::BAD_REQUEST,
            "file metadata (X-Metadata-*) is not supported by this server (moat answers as envd 0.5.7)",
        );
    }
    let q = files_query(req.uri().query());
    let ct = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let gzip = req
        .headers()
        .get(http::header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("gzip"));
    let mut written = Vec::new();
    if ct.starts_with("multipart/form-data") {
        // multer itself, not axum's `Multipart`: that one stops a body at axum's 2 MB default, and
        // an upload may be as large as the sandbox's disk (E2B's SDK sends every write this way).
        let boundary = match multer::parse_boundary(&ct) {
            Ok(b) => b,
            Err(err) => {
                return http_error(StatusCode::BAD_REQUEST, format!("multipart body: {err}"))
            }
        };
        let mut mp = multer::Multipart::new(req.into_body().into_data_stream(), boundary);
        let single = q.path.clone();
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(err) => {
                    return http_error(StatusCode::BAD_REQUEST, format!("multipart body: {err}"))
                }
            };
            let dest = match (&single, field.file_name()) {
                (Some(p), _) if !p.is_empty() => p.clone(),
                (_, Some(name)) if !name.is_empty() => super::percent_decode(name),
                _ => {
                    return http_error(
                        StatusCode::BAD_REQUEST,
                        "a part has no file name and no path was given",
                    )
                }
            };
            // The part streams to the agent while it arrives (the field borrows the body, so it is
            // fed through a channel). A body that breaks off or is malformed half-way is the
            // client's problem (400), never reported as the agent's: the agent drops the partial
            // file (it writes beside the destination and renames only a complete one).
            let mut field = field;
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, std::io::Error>>(8);
            let feed = async move {
                loop {
                    match field.chunk().await {
                        Ok(Some(c)) => {
                            if tx.send(Ok(c)).await.is_err() {
                                return None;
                            }
                        }
                        Ok(None) => return None,
                        Err(err) => {
                            let msg = err.to_string();
                            let _ = tx.send(Err(std::io::Error::other(msg.clone()))).await;
                            return Some(msg);
                        }
                    }
                }
            };
            let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
            let (written_one, body_err) = tokio::join!(write_one(agent, user, &dest, body), feed);
            if let Some(err) = body_err {
                return http_error(StatusCode::BAD_REQUEST, format!("multipart body: {err}"));
            }
            match written_one {
                Ok(v) => written.push(v),
                Err(r) => return r,
            }
        }
    } else {
        let Some(path) = q.path.filter(|p| !p.is_empty()) else {
            return http_error(StatusCode::BAD_REQUEST, "path is missing");
        };
        let body = if gzip {
            match gunzip(req.into_body()).await {
                Ok(b) => b,
                Err(r) => return r,
            }
        } else {
            req.into_body()
        };
        match write_one(agent, user, &path, body).await {
            Ok(v) => written.push(v),
            Err(r) => return r,
        }
    }
    if written.is_empty() {
        return http_error(StatusCode::BAD_REQUEST, "no file in the request");
    }
    axum::Json(written).into_response()
}

/// A gzip-compressed body, decompressed (bounded by the daemon's largest upload, 4 GiB).
async fn gunzip(body: Body) -> Result<Body, Response> {
    use http_body_util::BodyExt;
    use std::io::Read;
    let bytes = http_body_util::Limited::new(body, 1 << 30)
        .collect()
        .await
        .map_err(|err| {
            http_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("read the body: {err}"),
            )
        })?
        .to_bytes();
    let out = tokio::task::spawn_blocking(move || {
        let mut d = flate2::read::GzDecoder::new(&bytes[..]).take(4 << 30);
        let mut out = Vec::new();
        d.read_to_end(&mut out).map(|_| out)
    })
    .await
    .map_err(|err| http_error(StatusCode::INTERNAL_SERVER_ERROR, err.to_string()))?
    .map_err(|err| http_error(StatusCode::BAD_REQUEST, format!("gzip body: {err}")))?;
    Ok(Body::from(out))
}

/// A request to another port of the sandbox (E2B's `E2b-Sandbox-Port`): relayed like moat's exposed
/// ports, with E2B's traffic token (`E2B-Traffic-Access-Token`) or the sandbox's access token.
pub(super) async fn other_port(e: &Arc<E2b>, id: &str, port: u16, req: Request) -> Response {
    let sbx = match token_of(e, id) {
        Ok(s) => s,
        Err(r) => return r,
    };
    let headers = req.headers();
    let ok = sbx.allow_public_traffic
        || token_ok(
            header_token(headers, "e2b-traffic-access-token"),
            &sbx.access_token,
        )
        || token_ok(header_token(headers, "x-access-token"), &sbx.access_token);
    if !ok {
        return http_error(
            StatusCode::UNAUTHORIZED,
            format!("port {port} of sandbox {id} needs E2B-Traffic-Access-Token (or a sandbox created with allowPublicTraffic)"),
        );
    }
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    crate::api::ports::relay_unchecked(&e.app, &sbx, port, pq, req)
        .await
        .unwrap_or_else(|err| {
            http_error(
                StatusCode::from_u16(err.0.error.code.status()).unwrap_or(StatusCode::BAD_GATEWAY),
                err.0.error.message,
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_match_the_sdks() {
        // The SDK: "v1_" + base64 (no padding) of sha256("path:operation:user:token").
        let s = signature("/home/user/a.txt", "read", "", "tok", None);
        assert!(s.starts_with("v1_") && !s.ends_with('='), "{s}");
        let q = format!("path=%2Fhome%2Fuser%2Fa.txt&signature={s}");
        assert!(signature_valid(Some(&q), &http::Method::GET, "tok"));
        assert!(!signature_valid(Some(&q), &http::Method::POST, "tok"));
        assert!(!signature_valid(Some(&q), &http::Method::GET, "other"));
        let expired = signature("/a", "read", "", "tok", Some(1));
        let q = format!("path=%2Fa&signature={expired}&signature_expiration=1");
        assert!(!signature_valid(Some(&q), &http::Method::GET, "tok"));
    }
}
