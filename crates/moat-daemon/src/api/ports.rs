//! Exposed ports (preview URLs): HTTP and WebSocket requests relayed to a TCP port inside a sandbox,
//! through its agent (`POST /tcp`), so they work on every tier and without sandbox networking.
//!
//! Two ways to address a port (docs/ports.md):
//! - path: `/v1/sandboxes/{id}/ports/{port}/{path...}`;
//! - host: `{port}-{id}.<any domain>` as the `Host` header, any path (what a browser uses).
//!
//! Either needs the API key, the sandbox's access token (`X-Moat-Access-Token` header or the
//! `moat_access_token` query parameter, which also sets a cookie for the host form so a browser's
//! later requests carry it), or a sandbox created with `allow_public_traffic`. Neither the API key nor
//! the token reaches the sandbox.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderMap, HeaderValue, StatusCode};
use hyper_util::rt::TokioIo;
use moat_api::ErrorCode;

use super::error::ApiError;
use super::{api_key_given, constant_time_eq, AppState};

const TOKEN_HEADER: &str = "x-moat-access-token";
const TOKEN_PARAM: &str = "moat_access_token";
const TOKEN_COOKIE: &str = "moat_access_token";

/// `{port}-{id}.…` of a Host header.
fn host_target(headers: &HeaderMap) -> Option<(u16, String)> {
    let host = headers.get(header::HOST)?.to_str().ok()?;
    let first = host.split('.').next()?;
    let (port, id) = first.split_once('-')?;
    let port: u16 = port.parse().ok()?;
    (port > 0 && crate::ids::valid_sandbox_id(id)).then(|| (port, id.to_string()))
}

/// Middleware on the whole router: a request whose Host names a sandbox port is relayed, whatever its
/// path; everything else goes on to the API.
pub async fn host_form(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match host_target(req.headers()) {
        Some((port, id)) => {
            let path_and_query = req
                .uri()
                .path_and_query()
                .map(|p| p.as_str().to_string())
                .unwrap_or_else(|| "/".into());
            relay(&st, &id, port, path_and_query, req, true)
                .await
                .unwrap_or_else(IntoResponse::into_response)
        }
        None => next.run(req).await,
    }
}

/// `/v1/sandboxes/{id}/ports/{port}/{*path}` (any method).
pub async fn path_form(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let rest: Vec<&str> = path.splitn(6, '/').collect();
    // ["", "v1", "sandboxes", id, "ports", "{port}/..."]
    let (Some(id), Some(tail)) = (rest.get(3), rest.get(5)) else {
        return ApiError::not_found("port", "no port in the path").into_response();
    };
    let (port, sub) = tail.split_once('/').unwrap_or((tail, ""));
    let Ok(port) = port.parse::<u16>() else {
        return ApiError::invalid("port", format!("port {port:?} must be 1..=65535"))
            .into_response();
    };
    if port == 0 {
        return ApiError::invalid("port", "port must be 1..=65535").into_response();
    }
    let mut pq = format!("/{sub}");
    if let Some(q) = req.uri().query() {
        pq.push('?');
        pq.push_str(q);
    }
    let id = id.to_string();
    relay(&st, &id, port, pq, req, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Who may use the port: the API key, the sandbox's token, or anyone when it is public.
fn authorized(
    st: &AppState,
    sbx: &moat_api::Sandbox,
    headers: &HeaderMap,
    query: Option<&str>,
) -> bool {
    if sbx.allow_public_traffic {
        return true;
    }
    if api_key_given(headers)
        .is_some_and(|k| constant_time_eq(k.trim().as_bytes(), st.api_key.as_bytes()))
    {
        return true;
    }
    let token = sbx.access_token.as_bytes();
    if token.is_empty() {
        return false;
    }
    let from_header = headers.get(TOKEN_HEADER).and_then(|v| v.to_str().ok());
    let from_query = query.and_then(|q| {
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == TOKEN_PARAM)
            .map(|(_, v)| v.into_owned())
    });
    let from_cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == TOKEN_COOKIE)
        .map(|(_, v)| v.to_string());
    [from_header.map(str::to_string), from_query, from_cookie]
        .into_iter()
        .flatten()
        .any(|t| constant_time_eq(t.as_bytes(), token))
}

/// The query without moat's token parameter.
fn strip_token(path_and_query: &str) -> String {
    let Some((path, q)) = path_and_query.split_once('?') else {
        return path_and_query.to_string();
    };
    let kept: Vec<String> = q
        .split('&')
        .filter(|kv| kv.split('=').next() != Some(TOKEN_PARAM))
        .map(str::to_string)
        .collect();
    if kept.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{}", kept.join("&"))
    }
}

/// Headers that describe one hop, not the message (RFC 9110 §7.6.1), plus moat's credentials.
fn forwardable(name: &str, upgrade: bool) -> bool {
    !matches!(
        name,
        "authorization"
            | "x-api-key"
            | TOKEN_HEADER
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
    ) && (upgrade || !matches!(name, "connection" | "upgrade"))
}

async fn relay(
    st: &AppState,
    id: &str,
    port: u16,
    path_and_query: String,
    req: Request,
    host_form: bool,
) -> Result<Response, ApiError> {
    let sbx = st.sandboxes.get(id)?;
    if !authorized(st, &sbx, req.headers(), req.uri().query()) {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            format!(
                "port {port} of sandbox {id} needs the API key or the sandbox's access token \
                 ({TOKEN_HEADER} header or {TOKEN_PARAM} query parameter)"
            ),
        ));
    }
    let set_cookie = host_form
        && req.uri().query().is_some_and(|q| {
            q.split('&')
                .any(|kv| kv.split('=').next() == Some(TOKEN_PARAM))
        });
    let mut resp = relay_unchecked(st, &sbx, port, path_and_query, req).await?;
    if set_cookie {
        let cookie = format!(
            "{TOKEN_COOKIE}={}; Path=/; HttpOnly; SameSite=Lax",
            sbx.access_token
        );
        if let Ok(v) = HeaderValue::from_str(&cookie) {
            resp.headers_mut().append(header::SET_COOKIE, v);
        }
    }
    Ok(resp)
}

/// Relays a request (its caller checked who may) to `port` inside the sandbox, WebSocket upgrades
/// included.
pub(crate) async fn relay_unchecked(
    st: &AppState,
    sbx: &moat_api::Sandbox,
    port: u16,
    path_and_query: String,
    mut req: Request,
) -> Result<Response, ApiError> {
    let id = sbx.id.as_str();
    let agent = st.sandboxes.agent(id).await?;
    // The sandbox is not idle while this connection (or the WebSocket it becomes) is open.
    let hold = Arc::new(st.sandboxes.hold(id));
    let io = agent.tcp_tunnel(port).await.map_err(|e| {
        ApiError::new(
            ErrorCode::Unavailable,
            format!("port {port} of sandbox {id}: {e:#}"),
        )
    })?;
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        .handshake::<_, Body>(TokioIo::new(io))
        .await
        .map_err(|e| ApiError::internal(format!("port {port}: HTTP handshake: {e}")))?;
    let held = hold.clone();
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
        drop(held);
    });

    let upgrade = req.headers().get(header::UPGRADE).is_some();
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut up = http::Request::builder()
        .method(parts.method)
        .uri(strip_token(&path_and_query));
    for (name, value) in &parts.headers {
        if forwardable(name.as_str(), upgrade) {
            up = up.header(name, value);
        }
    }
    let upstream = up
        .body(body)
        .map_err(|e| ApiError::internal(format!("build the relayed request: {e}")))?;
    let mut resp = sender.send_request(upstream).await.map_err(|e| {
        ApiError::new(
            ErrorCode::Unavailable,
            format!("port {port} of sandbox {id}: {e}"),
        )
    })?;

    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let Some(client_upgrade) = client_upgrade else {
            return Err(ApiError::internal("the sandbox switched protocols unasked"));
        };
        let server_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            if let (Ok(c), Ok(s)) = (client_upgrade.await, server_upgrade.await) {
                let _ =
                    tokio::io::copy_bidirectional(&mut TokioIo::new(c), &mut TokioIo::new(s)).await;
            }
            drop(hold);
        });
        let (parts, _) = resp.into_parts();
        return Ok(Response::from_parts(parts, Body::empty()));
    }
    let (mut parts, body) = resp.into_parts();
    parts.headers.remove(header::CONNECTION);
    parts.headers.remove("keep-alive");
    Ok(Response::from_parts(parts, Body::new(body)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names() {
        let mut h = HeaderMap::new();
        let id = crate::ids::new_sandbox_id();
        h.insert(
            header::HOST,
            format!("8080-{id}.preview.example:6628").parse().unwrap(),
        );
        assert_eq!(host_target(&h), Some((8080, id.clone())));
        h.insert(header::HOST, "127.0.0.1:6628".parse().unwrap());
        assert_eq!(host_target(&h), None);
        h.insert(header::HOST, "0-sbx_x.example".parse().unwrap());
        assert_eq!(host_target(&h), None);
    }

    #[test]
    fn token_is_not_forwarded() {
        assert_eq!(strip_token("/a?moat_access_token=x"), "/a");
        assert_eq!(strip_token("/a?b=1&moat_access_token=x&c=2"), "/a?b=1&c=2");
        assert_eq!(strip_token("/a"), "/a");
        assert!(!forwardable("authorization", false));
        assert!(!forwardable("x-moat-access-token", true));
        assert!(!forwardable("upgrade", false));
        assert!(forwardable("upgrade", true));
        assert!(forwardable("content-type", false));
    }
}
