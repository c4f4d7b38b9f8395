//! Per-sandbox process and file endpoints. The agent inside the sandbox implements them over the
//! host↔agent protocol; the daemon checks the caller, the sandbox and JSON bodies, then streams requests
//! and answers through unchanged, so HTTP/2 flow control reaches from the client to the sandbox and
//! nothing is buffered whole in the daemon.

use axum::body::Body;
use axum::extract::{Path, Request};
use axum::response::Response;
use moat_api::*;
use serde::de::DeserializeOwned;

use super::St;
use crate::error::{ApiError, ApiResult};
use crate::extract::{parse_json, read_limited, MAX_JSON_BODY};

/// The agent's path for a request to `/v1/sandboxes/{id}/<rest>`: `/<rest>` with the query.
fn agent_path(req: &Request, id: &str) -> String {
    let pq = req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("");
    let prefix = format!("/v1/sandboxes/{id}");
    pq.strip_prefix(&prefix).unwrap_or(pq).to_string()
}

async fn forward(st: &St, id: &str, req: Request, body: Option<Body>) -> ApiResult<Response> {
    let agent = st.sandboxes.agent(id).await?;
    forward_to(&agent, id, req, body).await
}

async fn forward_to(
    agent: &crate::agent::AgentClient,
    id: &str,
    req: Request,
    body: Option<Body>,
) -> ApiResult<Response> {
    let path = agent_path(&req, id);
    let method = req.method().clone();
    let ct = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = body.unwrap_or_else(|| req.into_body());
    let resp = agent
        .send(method, &path, ct.as_deref(), body)
        .await
        .map_err(|e| ApiError::internal(format!("sandbox {id}: agent unreachable: {e:#}")))?;
    let (parts, incoming) = resp.into_parts();
    let mut out = Response::builder().status(parts.status);
    for h in [http::header::CONTENT_TYPE, http::header::CONTENT_LENGTH] {
        if let Some(v) = parts.headers.get(&h) {
            out = out.header(h, v);
        }
    }
    out.body(Body::new(incoming)).map_err(ApiError::internal)
}

/// Forwards a JSON request after checking it parses as `T` (400 naming the field, 413 when too big).
async fn forward_json<T: DeserializeOwned>(st: &St, id: &str, req: Request) -> ApiResult<Response> {
    // The sandbox is checked first: an unknown one is a 404 whatever the body says.
    let agent = st.sandboxes.agent(id).await?;
    let (parts, body) = req.into_parts();
    let bytes = read_limited(
        body,
        MAX_JSON_BODY.load(std::sync::atomic::Ordering::Relaxed),
    )
    .await?;
    parse_json::<T>(&bytes)?;
    let req = Request::from_parts(parts, Body::empty());
    forward_to(&agent, id, req, Some(Body::from(bytes))).await
}

/// Checks a query string parses as `T` before forwarding.
fn check_query<T: DeserializeOwned>(req: &Request) -> ApiResult<()> {
    let q = req.uri().query().unwrap_or("");
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(q.as_bytes()));
    serde_path_to_error::deserialize::<_, T>(de)
        .map(|_| ())
        .map_err(|e| crate::error::from_serde_path(e, "query"))
}

fn check_selector(sel: &str) -> ApiResult<()> {
    ProcessSelector::parse(sel)
        .map(|_| ())
        .map_err(|m| ApiError::invalid("process", m))
}

/// Start a process. Streams its events as NDJSON unless `background` is set.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes", tag = "processes", params(("id" = String, Path)),
    request_body = StartProcessRequest,
    responses((status = 200, description = "NDJSON stream: start, stdout/stderr/pty/dropped, exit", content_type = "application/x-ndjson", body = ProcessEvent),
              (status = 201, description = "background process started", body = ProcessInfo),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn start_process(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward_json::<StartProcessRequest>(&st, &id, req).await
}

/// Running processes and the most recent exited ones.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", tag = "processes", params(("id" = String, Path)),
    responses((status = 200, body = ProcessList), (status = 404, body = ErrorBody)))]
pub async fn list_processes(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward(&st, &id, req, None).await
}

/// Re-attach to a process: its kept output (unless `replay=false`), then live output, then its exit.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{process}/events", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path, description = "pid or tag"), AttachQuery),
    responses((status = 200, content_type = "application/x-ndjson", body = ProcessEvent), (status = 404, body = ErrorBody)))]
pub async fn process_events(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    check_selector(&process)?;
    check_query::<AttachQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Write the request body to the process's stdin (streamed; it may stay open as long as needed).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/stdin", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, description = "stdin not open", body = ErrorBody)))]
pub async fn process_stdin(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    check_selector(&process)?;
    forward(&st, &id, req, None).await
}

/// Close the process's stdin (EOF).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/close-stdin", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn process_close_stdin(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    check_selector(&process)?;
    forward(&st, &id, req, None).await
}

/// Send a signal to the process's group.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/signal", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)), request_body = SignalRequest,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn process_signal(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    check_selector(&process)?;
    forward_json::<SignalRequest>(&st, &id, req).await
}

/// Resize the process's PTY.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{process}/resize", tag = "processes",
    params(("id" = String, Path), ("process" = String, Path)), request_body = PtySize,
    responses((status = 204), (status = 400, body = ErrorBody), (status = 409, description = "not a PTY", body = ErrorBody)))]
pub async fn process_resize(
    st: St,
    Path((id, process)): Path<(String, String)>,
    req: Request,
) -> ApiResult<Response> {
    check_selector(&process)?;
    forward_json::<PtySize>(&st, &id, req).await
}

/// Download a file (streamed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/octet-stream", body = Vec<u8>), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn read_file(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<PathQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Upload a file (streamed, any size); it replaces the target atomically.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", params(("id" = String, Path), WriteQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 200, body = EntryInfo), (status = 400, body = ErrorBody)))]
pub async fn write_file(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<WriteQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Describe a path (not following a final symlink).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/stat", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = EntryInfo), (status = 404, body = ErrorBody)))]
pub async fn stat(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<PathQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Whether a path exists.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/exists", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, body = ExistsResponse)))]
pub async fn exists(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<PathQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// List a directory, to `depth` levels.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/list", tag = "files", params(("id" = String, Path), ListQuery),
    responses((status = 200, body = DirListing), (status = 404, body = ErrorBody)))]
pub async fn list_dir(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<ListQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Create a directory and its parents.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fs/mkdir", tag = "files", params(("id" = String, Path)),
    request_body = MkdirRequest, responses((status = 200, body = MkdirResponse), (status = 409, body = ErrorBody)))]
pub async fn mkdir(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward_json::<MkdirRequest>(&st, &id, req).await
}

/// Rename or move a path.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fs/rename", tag = "files", params(("id" = String, Path)),
    request_body = RenameRequest, responses((status = 200, body = EntryInfo), (status = 404, body = ErrorBody)))]
pub async fn rename(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    forward_json::<RenameRequest>(&st, &id, req).await
}

/// Remove a file or directory (`recursive` for a non-empty one).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/fs", tag = "files", params(("id" = String, Path), RemoveQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn remove(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<RemoveQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Download a directory (or file) as a tar stream.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/tar", tag = "files", params(("id" = String, Path), PathQuery),
    responses((status = 200, content_type = "application/x-tar", body = Vec<u8>), (status = 404, body = ErrorBody)))]
pub async fn download_tar(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<PathQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Unpack a tar stream into a directory.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/fs/tar", tag = "files", params(("id" = String, Path), PathQuery),
    request_body(content = Vec<u8>, content_type = "application/x-tar"),
    responses((status = 204), (status = 400, body = ErrorBody)))]
pub async fn upload_tar(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<PathQuery>(&req)?;
    forward(&st, &id, req, None).await
}

/// Watch a directory: inotify events as NDJSON until the client disconnects.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/fs/watch", tag = "files", params(("id" = String, Path), WatchQuery),
    responses((status = 200, content_type = "application/x-ndjson", body = FsEvent), (status = 404, body = ErrorBody)))]
pub async fn watch(st: St, Path(id): Path<String>, req: Request) -> ApiResult<Response> {
    check_query::<WatchQuery>(&req)?;
    forward(&st, &id, req, None).await
}
