//! `/v1/sandboxes`: lifecycle endpoints.

use std::collections::BTreeMap;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::Json;
use moat_api::{CreateSandboxRequest, Sandbox, SandboxList, SandboxState, SetTimeoutRequest};

use super::error::{ApiError, ApiResult};
use super::St;
use crate::api::extract::{query_values, JsonBody};
use crate::sandboxes::{ListFilter, IDEMPOTENCY_KEY};

/// Create a sandbox. With an `Idempotency-Key` header, a retry of the same request (its answer
/// lost) returns the sandbox the first one made (`Idempotent-Replayed: true`) for 24 h; another
/// request under the same key is a 422; a retry after that sandbox was deleted or ended is a 409.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    params(("Idempotency-Key" = Option<String>, Header, description = "1 to 255 visible ASCII characters; a retry with the same key and body returns the same sandbox")),
    responses((status = 201, body = Sandbox), (status = 400, body = moat_api::ErrorBody),
              (status = 404, description = "unknown template", body = moat_api::ErrorBody),
              (status = 409, description = "the sandbox made under this Idempotency-Key was deleted or has ended", body = moat_api::ErrorBody),
              (status = 413, body = moat_api::ErrorBody),
              (status = 422, description = "the Idempotency-Key was used for another request", body = moat_api::ErrorBody)))]
pub async fn create(
    State(st): St,
    headers: axum::http::HeaderMap,
    JsonBody(req): JsonBody<CreateSandboxRequest>,
) -> ApiResult<axum::response::Response> {
    use axum::response::IntoResponse;
    let key = match headers.get(IDEMPOTENCY_KEY) {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::invalid(IDEMPOTENCY_KEY, "an Idempotency-Key is visible ASCII")
        })?),
    };
    let (sbx, replayed) = match key {
        Some(k) => st.sandboxes.create_once(k, req).await?,
        None => (st.sandboxes.create(req).await?, false),
    };
    let note = axum::Extension(super::AuditSandbox(sbx.id.clone()));
    let mut r = (StatusCode::CREATED, note, Json(sbx)).into_response();
    if replayed {
        r.headers_mut().insert(
            "idempotent-replayed",
            axum::http::HeaderValue::from_static("true"),
        );
    }
    Ok(r)
}

/// List sandboxes, optionally filtered by state and metadata labels.
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(("state" = Option<String>, Query, description = "starting | running | paused | stopping | ended (those that ended without a request in the last 24 h)"),
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
/// killer) is kept for 24 h with `state: ended` and `ended` saying when and why; a deleted one is a
/// 404.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", params(("id" = String, Path)),
    responses((status = 200, body = Sandbox), (status = 404, body = moat_api::ErrorBody)))]
pub async fn get(State(st): St, Path(id): Path<String>) -> ApiResult<Json<Sandbox>> {
    Ok(Json(st.sandboxes.inspect(&id).await?))
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
