//! `/v1/sandboxes`: lifecycle endpoints.

use std::collections::BTreeMap;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::Json;
use moat_api::{CreateSandboxRequest, Sandbox, SandboxList, SandboxState, SetTimeoutRequest};

use super::error::{ApiError, ApiResult};
use super::St;
use crate::api::extract::{query_values, JsonBody};
use crate::sandboxes::ListFilter;

/// Create a sandbox.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    responses((status = 201, body = Sandbox), (status = 400, body = moat_api::ErrorBody),
              (status = 404, description = "unknown template", body = moat_api::ErrorBody),
              (status = 413, body = moat_api::ErrorBody)))]
pub async fn create(
    State(st): St,
    JsonBody(req): JsonBody<CreateSandboxRequest>,
) -> ApiResult<(
    StatusCode,
    axum::Extension<super::AuditSandbox>,
    Json<Sandbox>,
)> {
    let sbx = st.sandboxes.create(req).await?;
    let note = axum::Extension(super::AuditSandbox(sbx.id.clone()));
    Ok((StatusCode::CREATED, note, Json(sbx)))
}

/// List sandboxes, optionally filtered by state and metadata labels.
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(("state" = Option<String>, Query, description = "starting | running | paused | stopping"),
           ("metadata" = Option<Vec<String>>, Query, description = "key=value; repeat for more (all must match)")),
    responses((status = 200, body = SandboxList), (status = 400, body = moat_api::ErrorBody)))]
pub async fn list(State(st): St, req: Request) -> ApiResult<Json<SandboxList>> {
    let q = req.uri().query();
    let mut filter = ListFilter::default();
    for (k, _) in form_urlencoded::parse(q.unwrap_or("").as_bytes()) {
        if k != "state" && k != "metadata" {
            return Err(ApiError::invalid(
                &k,
                format!("unknown query parameter {k:?} (state, metadata)"),
            ));
        }
    }
    if let Some(s) = query_values(q, "state").last() {
        filter.state = Some(
            s.parse::<SandboxState>()
                .map_err(|m| ApiError::invalid("state", m))?,
        );
    }
    let mut md = BTreeMap::new();
    for kv in query_values(q, "metadata") {
        let (k, v) = kv.split_once('=').ok_or_else(|| {
            ApiError::invalid(
                "metadata",
                format!("metadata filter {kv:?} must be key=value"),
            )
        })?;
        md.insert(k.to_string(), v.to_string());
    }
    filter.metadata = md;
    Ok(Json(SandboxList {
        sandboxes: st.sandboxes.list(&filter)?,
    }))
}

/// Get one sandbox. One that ended without being asked to (its timeout, its agent lost, the OOM
/// killer) is a 404 whose message says when and why (the audit log's `sandbox.ended`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = moat_api::ErrorBody)))]
pub async fn get(State(st): St, Path(id): Path<String>) -> ApiResult<Json<Sandbox>> {
    match st.sandboxes.get(&id) {
        Err(crate::error::Error::NotFound { .. }) if crate::ids::valid_sandbox_id(&id) => {
            Err(gone(&st, &id).await)
        }
        r => Ok(Json(r?)),
    }
}

/// The 404 of a sandbox that is not there: with when and why it ended, when the log knows.
pub(crate) async fn gone(st: &super::AppState, id: &str) -> ApiError {
    let msg = match st.audit.end_of(id).await {
        Some((at_ms, reason, message)) => format!(
            "sandbox {id} ended at {} ({reason}): {message}",
            crate::clock::rfc3339(at_ms)
        ),
        None => format!("sandbox {id} not found"),
    };
    ApiError::not_found("id", msg)
}

/// Kill a sandbox and remove everything it had.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 204), (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn delete(State(st): St, Path(id): Path<String>) -> ApiResult<StatusCode> {
    // The audit log's last look at the sandbox's commands before they go.
    if st.sandboxes.get(&id).is_ok() {
        st.audit.poll(&st.sandboxes, &id, true).await;
    }
    st.sandboxes.delete(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Live resource usage of a sandbox, read on the host (cgroup counters, writable layer), with its limits.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/stats", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = moat_api::SandboxStats), (status = 404, body = moat_api::ErrorBody),
              (status = 409, body = moat_api::ErrorBody)))]
pub async fn stats(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<Json<moat_api::SandboxStats>> {
    Ok(Json(st.sandboxes.stats(&id).await?))
}

/// Set the sandbox to expire `timeout` seconds from now.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/timeout", tag = "sandboxes", params(("id" = String, Path)),
    request_body = SetTimeoutRequest,
    responses((status = 200, body = Sandbox), (status = 400, body = moat_api::ErrorBody), (status = 404, body = moat_api::ErrorBody)))]
pub async fn set_timeout(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<SetTimeoutRequest>,
) -> ApiResult<Json<Sandbox>> {
    Ok(Json(st.sandboxes.set_timeout(&id, req.timeout)?))
}

/// A sandbox's address and egress policy.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = moat_api::NetworkInfo), (status = 404, body = moat_api::ErrorBody),
              (status = 409, description = "the daemon runs without sandbox networking", body = moat_api::ErrorBody)))]
pub async fn get_network(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<Json<moat_api::NetworkInfo>> {
    Ok(Json(st.sandboxes.network(&id)?))
}

/// Replace a sandbox's egress policy; it is in force for new connections at once.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "sandboxes", params(("id" = String, Path)),
    request_body = moat_api::NetworkPolicy,
    responses((status = 200, body = moat_api::NetworkInfo), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn set_network(
    State(st): St,
    Path(id): Path<String>,
    JsonBody(policy): JsonBody<moat_api::NetworkPolicy>,
) -> ApiResult<Json<moat_api::NetworkInfo>> {
    Ok(Json(st.sandboxes.set_network(&id, policy).await?))
}
