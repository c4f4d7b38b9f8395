//! Snapshots, forks, reset and pause/resume.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use moat_api::{
    CreateSnapshotRequest, ForkRequest, ForkResponse, PauseResult, ResetRequest, ResumeRequest,
    Sandbox, Snapshot, SnapshotList,
};

use super::error::ApiResult;
use super::St;
use crate::api::extract::JsonBody;

/// Take a snapshot of a running or paused sandbox (its processes are frozen while its changes are
/// copied; a paused sandbox stays paused).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots", params(("id" = String, Path)),
    request_body = CreateSnapshotRequest,
    responses((status = 201, body = Snapshot), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody),
              (status = 503, description = "kind full is not supported by this tier on this host", body = moat_api::ErrorBody)))]
pub async fn create(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<CreateSnapshotRequest>,
) -> ApiResult<(StatusCode, Json<Snapshot>)> {
    Ok((
        StatusCode::CREATED,
        Json(st.snapshots.snapshot(&id, req).await?),
    ))
}

/// List snapshots.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, body = SnapshotList)))]
pub async fn list(State(st): St) -> ApiResult<Json<SnapshotList>> {
    Ok(Json(SnapshotList {
        snapshots: st.snapshots.list()?,
    }))
}

/// Get a snapshot by id or name.
#[utoipa::path(get, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path, description = "id or name")),
    responses((status = 200, body = Snapshot), (status = 404, body = moat_api::ErrorBody)))]
pub async fn get(State(st): St, Path(id): Path<String>) -> ApiResult<Json<Snapshot>> {
    Ok(Json(st.snapshots.get(&id)?))
}

/// Delete a snapshot (sandboxes started from it keep running; its layers go with the last of them).
#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots", params(("id" = String, Path, description = "id or name")),
    responses((status = 204), (status = 404, body = moat_api::ErrorBody)))]
pub async fn delete(State(st): St, Path(id): Path<String>) -> ApiResult<StatusCode> {
    st.snapshots.delete(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Start `count` sandboxes from a snapshot in one call (all or none).
#[utoipa::path(post, path = "/v1/snapshots/{id}/fork", tag = "snapshots", params(("id" = String, Path, description = "id or name")),
    request_body = ForkRequest,
    responses((status = 201, body = ForkResponse), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody)))]
pub async fn fork(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ForkRequest>,
) -> ApiResult<(StatusCode, Json<ForkResponse>)> {
    let sandboxes = st.snapshots.fork(&id, req).await?;
    Ok((StatusCode::CREATED, Json(ForkResponse { sandboxes })))
}

/// Reset a sandbox in place to a snapshot, or to the state it was created in: every process is
/// killed and every change since is dropped; id, limits, environment and timeout stay.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/reset", tag = "snapshots", params(("id" = String, Path)),
    request_body = ResetRequest,
    responses((status = 200, body = Sandbox), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn reset(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ResetRequest>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(st.snapshots.reset(&id, req).await?))
}

/// Pause a sandbox: every process is frozen (no CPU), memory and files kept; it does not expire
/// while paused.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = PauseResult), (status = 404, body = moat_api::ErrorBody),
              (status = 409, body = moat_api::ErrorBody)))]
pub async fn pause(State(st): St, Path(id): Path<String>) -> ApiResult<Json<PauseResult>> {
    Ok(Json(st.sandboxes.pause(&id).await?))
}

/// Resume a paused sandbox where it stopped; its timeout starts again.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", params(("id" = String, Path)),
    request_body = ResumeRequest,
    responses((status = 200, body = PauseResult), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn resume(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<ResumeRequest>,
) -> ApiResult<Json<PauseResult>> {
    Ok(Json(st.sandboxes.resume(&id, req).await?))
}

/// Disk used by templates, snapshot layers (each once) and sandboxes' writable layers.
#[utoipa::path(get, path = "/v1/system/df", tag = "snapshots",
    responses((status = 200, body = moat_api::DiskUsage)))]
pub async fn disk_usage(State(st): St) -> ApiResult<Json<moat_api::DiskUsage>> {
    Ok(Json(st.snapshots.disk_usage().await?))
}
