//! `/v1/builds`: template builds from a spec (status, steps, events, cancel) and the build cache.
//! A build starts at `POST /v1/templates/{name}/build` (templates.rs).

use axum::extract::{Path, State};
use axum::response::Response;
use axum::Json;
use moat_api::{Build, BuildList, PruneResult};

use super::error::{ApiError, ApiResult};
use super::St;
use crate::api::extract::QueryArgs;

#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct BuildListQuery {
    /// Only the builds of this template.
    #[serde(default)]
    pub template: Option<String>,
    /// Most builds listed, newest first (default 50, at most 200).
    #[serde(default)]
    #[param(minimum = 1, maximum = 200)]
    pub limit: Option<u32>,
}

/// List builds, newest first.
#[utoipa::path(get, path = "/v1/builds", tag = "templates", params(BuildListQuery),
    responses((status = 200, body = BuildList), (status = 400, body = moat_api::ErrorBody)))]
pub async fn list(
    State(st): St,
    QueryArgs(q): QueryArgs<BuildListQuery>,
) -> ApiResult<Json<BuildList>> {
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::invalid("limit", "limit must be 1..=200"));
    }
    Ok(Json(BuildList {
        builds: st.builds.list(q.template.as_deref(), limit)?,
    }))
}

/// One build: its status, each step (cached or run, duration, layer) and why it failed.
#[utoipa::path(get, path = "/v1/builds/{id}", tag = "templates", params(("id" = String, Path)),
    responses((status = 200, body = Build), (status = 404, body = moat_api::ErrorBody)))]
pub async fn get(State(st): St, Path(id): Path<String>) -> ApiResult<Json<Build>> {
    Ok(Json(st.builds.get(&id)?))
}

/// A build's events from its start (NDJSON `BuildEvent`s: `started`, `step`, `log`, `step_done`, and
/// `done` or `failed` last); for a running build the stream follows it to its end.
#[utoipa::path(get, path = "/v1/builds/{id}/events", tag = "templates", params(("id" = String, Path)),
    responses((status = 200, description = "NDJSON stream of BuildEvent", content_type = "application/x-ndjson", body = moat_api::BuildEvent),
              (status = 404, body = moat_api::ErrorBody)))]
pub async fn events(State(st): St, Path(id): Path<String>) -> ApiResult<Response> {
    let file = st.builds.events_file(&id)?;
    if let Some(live) = st.builds.live_build(&id) {
        return follow(live);
    }
    let f = tokio::fs::File::open(&file)
        .await
        .map_err(|e| ApiError::internal(format!("the log of build {id}: {e}")))?;
    Response::builder()
        .header(http::header::CONTENT_TYPE, moat_api::NDJSON)
        .body(axum::body::Body::from_stream(
            tokio_util::io::ReaderStream::new(f),
        ))
        .map_err(ApiError::internal)
}

/// An NDJSON response following a running build.
pub(super) fn follow(
    live: std::sync::Arc<crate::sandboxes::builds::LiveBuild>,
) -> ApiResult<Response> {
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(256);
    tokio::spawn(live.follow(tx));
    let body =
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
    Response::builder()
        .header(http::header::CONTENT_TYPE, moat_api::NDJSON)
        .body(axum::body::Body::from_stream(body))
        .map_err(ApiError::internal)
}

use futures::StreamExt;

/// Stop a running build: its step is killed and its sandbox removed; the template stays as it was.
#[utoipa::path(post, path = "/v1/builds/{id}/cancel", tag = "templates", params(("id" = String, Path)),
    responses((status = 202, body = Build), (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn cancel(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<(http::StatusCode, Json<Build>)> {
    Ok((http::StatusCode::ACCEPTED, Json(st.builds.cancel(&id)?)))
}

/// Empty the build cache: the next build of every spec runs all its steps. Layers that templates,
/// snapshots or sandboxes use stay.
#[utoipa::path(delete, path = "/v1/build-cache", tag = "templates",
    responses((status = 200, body = PruneResult)))]
pub async fn prune(State(st): St) -> ApiResult<Json<PruneResult>> {
    let b = st.builds.clone();
    let r = tokio::task::spawn_blocking(move || b.prune_cache())
        .await
        .map_err(ApiError::internal)??;
    Ok(Json(r))
}
