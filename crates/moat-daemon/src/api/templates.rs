//! `/v1/templates`: list, register, build (streamed progress), remove.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use moat_api::{BuildEvent, RegisterTemplateRequest, Template, TemplateList};
use tokio::sync::mpsc;

use super::St;
use crate::error::ApiResult;
use crate::extract::JsonBody;
use crate::template::store::to_api;

/// List templates.
#[utoipa::path(get, path = "/v1/templates", tag = "templates", responses((status = 200, body = TemplateList)))]
pub async fn list(State(st): St) -> ApiResult<Json<TemplateList>> {
    let templates = st
        .sandboxes
        .db
        .list_templates()?
        .iter()
        .map(to_api)
        .collect();
    Ok(Json(TemplateList { templates }))
}

/// Get one template.
#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 200, body = Template), (status = 404, body = moat_api::ErrorBody)))]
pub async fn get(State(st): St, Path(name): Path<String>) -> ApiResult<Json<Template>> {
    Ok(Json(st.sandboxes.templates.get(&st.sandboxes.db, &name)?))
}

/// Register a root filesystem directory or tarball, an OCI image layout or a `docker save` archive on
/// the daemon's host as a template.
#[utoipa::path(post, path = "/v1/templates", tag = "templates", request_body = RegisterTemplateRequest,
    responses((status = 201, body = Template), (status = 400, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn register(
    State(st): St,
    JsonBody(req): JsonBody<RegisterTemplateRequest>,
) -> ApiResult<(StatusCode, Json<Template>)> {
    let t = st
        .sandboxes
        .templates
        .register(&st.sandboxes.db, &req.name, &req.path)
        .await?;
    Ok((StatusCode::CREATED, Json(t)))
}

/// Make a template from an image in an OCI registry (Docker Hub, GHCR, a private registry): its
/// layers are pulled, checked against their digests and applied in order.
#[utoipa::path(post, path = "/v1/templates/{name}/pull", tag = "templates", params(("name" = String, Path)),
    request_body = moat_api::PullTemplateRequest,
    responses((status = 201, body = Template), (status = 400, body = moat_api::ErrorBody),
              (status = 409, body = moat_api::ErrorBody), (status = 500, description = "the pull failed; the message says why", body = moat_api::ErrorBody)))]
pub async fn pull(
    State(st): St,
    Path(name): Path<String>,
    JsonBody(req): JsonBody<moat_api::PullTemplateRequest>,
) -> ApiResult<(StatusCode, Json<Template>)> {
    let t = st
        .sandboxes
        .templates
        .pull(&st.sandboxes.db, &name, &req)
        .await?;
    Ok((StatusCode::CREATED, Json(t)))
}

/// Build a template from Debian packages (debootstrap), streaming progress as NDJSON `BuildEvent`s.
#[utoipa::path(post, path = "/v1/templates/{name}/build", tag = "templates", params(("name" = String, Path)),
    responses((status = 200, description = "NDJSON stream of BuildEvent; the last line is `done` or `failed`", content_type = "application/x-ndjson", body = BuildEvent),
              (status = 400, body = moat_api::ErrorBody)))]
pub async fn build(State(st): St, Path(name): Path<String>) -> ApiResult<Response> {
    moat_api::validate_template_name(&name)
        .map_err(|m| crate::error::ApiError::invalid("name", m))?;
    let (tx, rx) = mpsc::channel::<BuildEvent>(256);
    let st2 = st.clone();
    // The build goes on if the client disconnects; its result is in the template's status.
    tokio::spawn(async move {
        let result = st2
            .sandboxes
            .templates
            .build(&st2.sandboxes.db, &name, tx.clone())
            .await;
        let last = match result {
            Ok(template) => BuildEvent::Done { template },
            Err(e) => BuildEvent::Failed {
                message: e.0.error.message,
            },
        };
        let _ = tx.send(last).await;
    });
    super::ndjson_response(rx)
}

/// Remove a template that no sandbox uses.
#[utoipa::path(delete, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 204), (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn delete(State(st): St, Path(name): Path<String>) -> ApiResult<StatusCode> {
    st.sandboxes.drain_pool(&name).await?;
    let removed = st.sandboxes.templates.remove(&st.sandboxes.db, &name);
    st.sandboxes.resume_pool();
    removed?;
    Ok(StatusCode::NO_CONTENT)
}
