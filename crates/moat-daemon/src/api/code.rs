//! `/v1/sandboxes/{id}/code`: stateful code execution with rich results, and its contexts.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use moat_api::{
    CodeContext, CodeContextList, CodeEvent, CreateCodeContextRequest, ErrorBody, RunCodeRequest,
};
use tokio::sync::mpsc;

use super::error::ApiResult;
use super::St;
use crate::api::extract::JsonBody;
use crate::code;

/// Run code in a context (the language's default context unless `context_id` is given), streaming
/// `stdout`, `stderr`, `result` and `error` events as NDJSON; `end` is always last.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/code", tag = "code", params(("id" = String, Path)),
    request_body = RunCodeRequest,
    responses((status = 200, description = "NDJSON stream of CodeEvent; the last line is `end`", content_type = "application/x-ndjson", body = CodeEvent),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn run(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<RunCodeRequest>,
) -> ApiResult<Response> {
    let agent = st.sandboxes.agent(&id).await?;
    let ctx = in_sandbox(&st, &id, code::prepare(&agent, &id, &req).await).await?;
    let (tx, rx) = mpsc::channel::<CodeEvent>(256);
    // The cell runs to its end (or timeout) even if the client goes away.
    tokio::spawn(code::run(agent, id, ctx, req, tx, code::Abandoned::RunsOn));
    super::ndjson_response(rx)
}

/// Create a code context: a fresh kernel with its own state.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/code/contexts", tag = "code", params(("id" = String, Path)),
    request_body = CreateCodeContextRequest,
    responses((status = 201, body = CodeContext), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn create_context(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<CreateCodeContextRequest>,
) -> ApiResult<(StatusCode, Json<CodeContext>)> {
    let agent = st.sandboxes.agent(&id).await?;
    let ctx_id = format!("ctx_{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let started = code::start(&agent, &ctx_id, req.language.unwrap_or_default(), req.cwd).await;
    let ctx = in_sandbox(&st, &id, started).await?;
    Ok((StatusCode::CREATED, Json(ctx)))
}

/// List the sandbox's code contexts (default ones included once used).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/code/contexts", tag = "code", params(("id" = String, Path)),
    responses((status = 200, body = CodeContextList), (status = 404, body = ErrorBody)))]
pub async fn list_contexts(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<Json<CodeContextList>> {
    let agent = st.sandboxes.agent(&id).await?;
    Ok(Json(CodeContextList {
        contexts: in_sandbox(&st, &id, code::list(&agent).await).await?,
    }))
}

/// Restart a context: a fresh kernel with the same id, language and cwd; all state is gone.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/code/contexts/{context}/restart", tag = "code",
    params(("id" = String, Path), ("context" = String, Path)),
    responses((status = 200, body = CodeContext), (status = 404, body = ErrorBody)))]
pub async fn restart_context(
    State(st): St,
    Path((id, context)): Path<(String, String)>,
) -> ApiResult<Json<CodeContext>> {
    let agent = st.sandboxes.agent(&id).await?;
    let restarted = async {
        let ctx = code::get(&agent, &context, "context").await?;
        code::restart(&agent, &id, &ctx).await
    };
    Ok(Json(in_sandbox(&st, &id, restarted.await).await?))
}

/// Delete a context and its kernel.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/code/contexts/{context}", tag = "code",
    params(("id" = String, Path), ("context" = String, Path)),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn delete_context(
    State(st): St,
    Path((id, context)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    let agent = st.sandboxes.agent(&id).await?;
    let deleted = async {
        let ctx = code::get(&agent, &context, "context").await?;
        code::delete(&agent, &id, &ctx).await
    };
    in_sandbox(&st, &id, deleted.await).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `r`, with an agent that did not answer judged by what became of sandbox `id` (a sandbox that
/// ended or is being paused is the client's 404 or 409, not the host's 500).
async fn in_sandbox<T>(
    st: &super::AppState,
    id: &str,
    r: Result<T, crate::error::Error>,
) -> ApiResult<T> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => Err(st.sandboxes.agent_error(id, e).await.into()),
    }
}
