//! The REST API: routing, API-key auth, the OpenAPI document and the error fallbacks.

mod audit;
mod builds;
mod code;
mod doc;
pub mod error;
pub mod extract;
pub mod mcp;
mod network;
pub(crate) mod ports;
mod proxy;
mod sandboxes;
mod secrets;
pub mod serve;
mod snapshots;
mod templates;
mod ws;

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::{Json, Router};
use moat_api::ErrorCode;
use utoipa::OpenApi;

use crate::sandboxes::{Builds, Lifecycle, Pool, Snapshots, Templates};
use error::ApiError;

/// What the REST front (and the E2B and MCP fronts over it) works with: the lifecycle's parts,
/// the key, and the logs.
pub struct AppState {
    pub sandboxes: Arc<Lifecycle>,
    pub pool: Arc<Pool>,
    pub snapshots: Arc<Snapshots>,
    pub templates: Arc<Templates>,
    pub builds: Arc<Builds>,
    pub api_key: String,
    pub audit: Arc<crate::audit::Audit>,
    pub netlog: Arc<crate::netlog::NetLog>,
    pub vault: Arc<crate::secrets::Vault>,
}

/// Set on a response by a handler whose path has no sandbox id but that concerns one (create), so the
/// audit log files the request under it.
#[derive(Debug, Clone)]
pub struct AuditSandbox(pub String);

pub type St = State<Arc<AppState>>;

#[derive(OpenApi)]
#[openapi(
    info(title = "moat", description = "Self-hosted sandboxes for AI agents: isolated Linux machines driven over REST."),
    paths(
        health,
        sandboxes::create, sandboxes::list, sandboxes::get, sandboxes::delete, sandboxes::set_timeout,
        sandboxes::stats, sandboxes::get_network, sandboxes::set_network,
        proxy::start_process, proxy::list_processes, proxy::process_events, proxy::process_stdin,
        proxy::process_close_stdin, proxy::process_signal, proxy::process_resize,
        proxy::read_file, proxy::write_file, proxy::stat, proxy::exists, proxy::list_dir, proxy::mkdir,
        proxy::rename, proxy::remove, proxy::download_tar, proxy::upload_tar, proxy::watch,
        ws::process_ws,
        templates::list, templates::get, templates::register, templates::build, templates::pull, templates::delete,
        builds::list, builds::get, builds::events, builds::cancel, builds::prune,
        code::run, code::create_context, code::list_contexts, code::restart_context, code::delete_context,
        audit::list, audit::for_sandbox,
        network::log, network::proposal, network::template_proposal,
        snapshots::create, snapshots::list, snapshots::get, snapshots::delete, snapshots::fork,
        snapshots::reset, snapshots::pause, snapshots::resume, snapshots::disk_usage,
        secrets::list_for_sandbox, secrets::put_for_sandbox, secrets::delete_for_sandbox,
        secrets::list_daemon, secrets::put_daemon, secrets::delete_daemon,
        secrets::list_template, secrets::put_template, secrets::delete_template,
    ),
    components(schemas(moat_api::ErrorBody, moat_api::ProcessEvent, moat_api::FsEvent, moat_api::BuildEvent, moat_api::CodeEvent)),
    modifiers(&BearerAuth),
    tags(
        (name = "sandboxes", description = "Sandbox lifecycle"),
        (name = "processes", description = "Commands, background processes, stdin, signals and PTYs"),
        (name = "files", description = "The sandbox's filesystem"),
        (name = "templates", description = "Root filesystems sandboxes start from"),
        (name = "code", description = "Stateful code execution with rich results (code interpreter)"),
        (name = "audit", description = "The audit log of API actions and commands"),
        (name = "network", description = "The connection log and allow-list proposals"),
        (name = "snapshots", description = "Snapshots, forks and reset"),
        (name = "secrets", description = "Secrets kept out of sandboxes, put on the wire by the egress proxy"),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{
            HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme,
        };
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        openapi.security = Some(vec![SecurityRequirement::new(
            "api_key",
            Vec::<String>::new(),
        )]);
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let v1 = Router::new()
        .route(
            "/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(
            "/v1/sandboxes/{id}",
            get(sandboxes::get).delete(sandboxes::delete),
        )
        .route("/v1/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route("/v1/sandboxes/{id}/stats", get(sandboxes::stats))
        .route(
            "/v1/sandboxes/{id}/network",
            get(sandboxes::get_network).put(sandboxes::set_network),
        )
        .route("/v1/sandboxes/{id}/network/log", get(network::log))
        .route(
            "/v1/sandboxes/{id}/network/proposal",
            get(network::proposal),
        )
        .route(
            "/v1/templates/{name}/network/proposal",
            get(network::template_proposal),
        )
        .route(
            "/v1/sandboxes/{id}/processes",
            post(proxy::start_process).get(proxy::list_processes),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/events",
            get(proxy::process_events),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/stdin",
            post(proxy::process_stdin),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/close-stdin",
            post(proxy::process_close_stdin),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/signal",
            post(proxy::process_signal),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/resize",
            post(proxy::process_resize),
        )
        .route(
            "/v1/sandboxes/{id}/processes/{process}/ws",
            get(ws::process_ws),
        )
        .route(
            "/v1/sandboxes/{id}/files",
            get(proxy::read_file).put(proxy::write_file),
        )
        .route("/v1/sandboxes/{id}/fs/stat", get(proxy::stat))
        .route("/v1/sandboxes/{id}/fs/exists", get(proxy::exists))
        .route("/v1/sandboxes/{id}/fs/list", get(proxy::list_dir))
        .route("/v1/sandboxes/{id}/fs/mkdir", post(proxy::mkdir))
        .route("/v1/sandboxes/{id}/fs/rename", post(proxy::rename))
        .route("/v1/sandboxes/{id}/fs", delete(proxy::remove))
        .route(
            "/v1/sandboxes/{id}/fs/tar",
            get(proxy::download_tar).put(proxy::upload_tar),
        )
        .route("/v1/sandboxes/{id}/fs/watch", get(proxy::watch))
        .route("/v1/sandboxes/{id}/code", post(code::run))
        .route(
            "/v1/sandboxes/{id}/code/contexts",
            post(code::create_context).get(code::list_contexts),
        )
        .route(
            "/v1/sandboxes/{id}/code/contexts/{context}",
            delete(code::delete_context),
        )
        .route(
            "/v1/sandboxes/{id}/code/contexts/{context}/restart",
            post(code::restart_context),
        )
        .route(
            "/v1/templates",
            get(templates::list).post(templates::register),
        )
        .route(
            "/v1/templates/{name}",
            get(templates::get).delete(templates::delete),
        )
        .route("/v1/templates/{name}/build", post(templates::build))
        .route("/v1/templates/{name}/pull", post(templates::pull))
        .route("/v1/builds", get(builds::list))
        .route("/v1/builds/{id}", get(builds::get))
        .route("/v1/builds/{id}/events", get(builds::events))
        .route("/v1/builds/{id}/cancel", post(builds::cancel))
        .route("/v1/build-cache", delete(builds::prune))
        .route("/v1/sandboxes/{id}/snapshots", post(snapshots::create))
        .route("/v1/sandboxes/{id}/reset", post(snapshots::reset))
        .route("/v1/sandboxes/{id}/pause", post(snapshots::pause))
        .route("/v1/sandboxes/{id}/resume", post(snapshots::resume))
        .route("/v1/snapshots", get(snapshots::list))
        .route(
            "/v1/snapshots/{id}",
            get(snapshots::get).delete(snapshots::delete),
        )
        .route("/v1/snapshots/{id}/fork", post(snapshots::fork))
        .route("/v1/system/df", get(snapshots::disk_usage))
        .route("/v1/sandboxes/{id}/secrets", get(secrets::list_for_sandbox))
        .route(
            "/v1/sandboxes/{id}/secrets/{name}",
            put(secrets::put_for_sandbox).delete(secrets::delete_for_sandbox),
        )
        .route("/v1/secrets", get(secrets::list_daemon))
        .route(
            "/v1/secrets/{name}",
            put(secrets::put_daemon).delete(secrets::delete_daemon),
        )
        .route("/v1/templates/{name}/secrets", get(secrets::list_template))
        .route(
            "/v1/templates/{name}/secrets/{secret}",
            put(secrets::put_template).delete(secrets::delete_template),
        )
        .route("/v1/audit", get(audit::list))
        .route("/v1/sandboxes/{id}/audit", get(audit::for_sandbox))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/healthz", get(health))
        .route("/openapi.json", get(openapi))
        // Exposed ports check their own credentials (API key, the sandbox's token, or public).
        .route("/v1/sandboxes/{id}/ports/{port}", any(ports::path_form))
        .route("/v1/sandboxes/{id}/ports/{port}/", any(ports::path_form))
        .route(
            "/v1/sandboxes/{id}/ports/{port}/{*path}",
            any(ports::path_form),
        )
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            ports::host_form,
        ))
        .with_state(state)
}

/// A process's stdin stream (`POST .../processes/{process}/stdin`), which may stay quiet as long as
/// the process runs: exempt from the listener's body idle timeout.
pub fn stdin_stream(parts: &http::request::Parts) -> bool {
    parts.uri.path().ends_with("/stdin") && parts.method == http::Method::POST
}

/// An `application/x-ndjson` response with one JSON line per item a task sends on `rx`.
pub(crate) fn ndjson_response<T: serde::Serialize + Send + 'static>(
    rx: tokio::sync::mpsc::Receiver<T>,
) -> Result<Response, ApiError> {
    use futures::StreamExt;
    let lines = tokio_stream::wrappers::ReceiverStream::new(rx).map(|item| {
        let mut line = serde_json::to_vec(&item).unwrap_or_default();
        line.push(b'\n');
        Ok::<_, std::convert::Infallible>(bytes::Bytes::from(line))
    });
    Response::builder()
        .header(http::header::CONTENT_TYPE, moat_api::NDJSON)
        .body(axum::body::Body::from_stream(lines))
        .map_err(ApiError::internal)
}

/// The API key a request carries: `Authorization: Bearer <key>` or `X-API-Key: <key>`.
fn api_key_given(h: &http::HeaderMap) -> Option<&str> {
    h.get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// Checks the API key, then records the request in the audit log once the response head is known
/// (bodies are never buffered: streams keep streaming).
async fn auth(State(st): St, req: Request, next: Next) -> Response {
    let at_ms = crate::clock::now_ms();
    let template = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| req.uri().path().to_string());
    let method = req.method().clone();
    let mut sandbox_id = path_param(&template, req.uri().path(), "{id}");
    let query = req.uri().query().map(str::to_string);
    let given = api_key_given(req.headers());
    let (actor, resp) = match given {
        Some(k) if constant_time_eq(k.trim().as_bytes(), st.api_key.as_bytes()) => {
            (crate::audit::key_id(&st.api_key), next.run(req).await)
        }
        Some(_) => (
            crate::audit::ANONYMOUS.to_string(),
            ApiError::new(ErrorCode::Unauthorized, "wrong API key").into_response(),
        ),
        None => (
            crate::audit::ANONYMOUS.to_string(),
            ApiError::new(
                ErrorCode::Unauthorized,
                "missing API key: send 'Authorization: Bearer <key>' (the key is in the daemon's data dir, file api-key)",
            )
            .into_response(),
        ),
    };
    if sandbox_id.is_none() {
        sandbox_id = resp.extensions().get::<AuditSandbox>().map(|s| s.0.clone());
    }
    let status = resp.status();
    if method == http::Method::POST
        && template == "/v1/sandboxes/{id}/processes"
        && status.is_success()
    {
        if let Some(id) = &sandbox_id {
            st.audit.watch(id);
        }
    }
    let mut detail = serde_json::Map::new();
    if let Some(q) = query {
        detail.insert("query".into(), q.into());
    }
    if let Some(n) = resp.extensions().get::<crate::api::error::ErrorNote>() {
        detail.insert("error".into(), n.message.clone().into());
        if let Some(f) = &n.field {
            detail.insert("field".into(), f.clone().into());
        }
    }
    let entry = crate::audit::NewEntry {
        at_ms,
        actor,
        action: format!("{method} {template}"),
        sandbox_id,
        status: Some(i64::from(status.as_u16())),
        detail: serde_json::Value::Object(detail),
    };
    if status == http::StatusCode::UNAUTHORIZED {
        // Rate-limited and summarised: a client without a key cannot fill the log.
        st.audit.refused(entry).await;
    } else {
        st.audit.record(entry).await;
    }
    resp
}

/// The value of `name` (e.g. `{id}`) in `path` matched by the route `template`.
fn path_param(template: &str, path: &str, name: &str) -> Option<String> {
    template
        .split('/')
        .zip(path.split('/'))
        .find(|(t, _)| *t == name)
        .map(|(_, v)| v.to_string())
        .filter(|v| !v.is_empty())
}

pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Liveness and what this host offers.
#[utoipa::path(get, path = "/healthz", security(()), responses((status = 200, body = moat_api::Health)))]
async fn health(State(st): St) -> Json<moat_api::Health> {
    Json(moat_api::Health {
        status: "ok".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        tiers: st.sandboxes.tier_infos(),
        pool: st.pool.info(),
    })
}

/// The OpenAPI document, with the errors and constraints of this daemon (see `doc`).
async fn openapi(State(st): St) -> Json<serde_json::Value> {
    Json(doc::document(&st.sandboxes.bounds()))
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(
        ErrorCode::NotFound,
        format!("no such endpoint: {} {}", req.method(), req.uri().path()),
    )
}

async fn method_not_allowed(req: Request) -> Response {
    let mut r = ApiError::new(
        ErrorCode::InvalidArgument,
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
    .into_response();
    *r.status_mut() = http::StatusCode::METHOD_NOT_ALLOWED;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openapi_document_lists_the_endpoints() {
        let doc = serde_json::to_value(ApiDoc::openapi()).unwrap();
        let paths = doc["paths"].as_object().unwrap();
        for p in [
            "/v1/sandboxes",
            "/v1/sandboxes/{id}",
            "/v1/sandboxes/{id}/processes",
            "/v1/sandboxes/{id}/files",
            "/v1/sandboxes/{id}/stats",
            "/v1/sandboxes/{id}/fs/watch",
            "/v1/templates/{name}/build",
            "/v1/sandboxes/{id}/code",
            "/v1/sandboxes/{id}/code/contexts/{context}/restart",
            "/v1/audit",
            "/v1/sandboxes/{id}/audit",
        ] {
            assert!(paths.contains_key(p), "missing {p}");
        }
        assert!(doc["components"]["schemas"]["CreateSandboxRequest"].is_object());
    }

    #[test]
    fn path_params() {
        assert_eq!(
            path_param(
                "/v1/sandboxes/{id}/processes",
                "/v1/sandboxes/abc/processes",
                "{id}"
            )
            .as_deref(),
            Some("abc")
        );
        assert_eq!(path_param("/v1/sandboxes", "/v1/sandboxes", "{id}"), None);
    }

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
    }
}
