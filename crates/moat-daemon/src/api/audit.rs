//! `/v1/audit` and `/v1/sandboxes/{id}/audit`: reading and exporting the audit log.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use moat_api::{AuditEntry, AuditList, AuditQuery};

use super::error::{ApiError, ApiResult};
use super::St;

fn parse_query(req: &Request) -> ApiResult<AuditQuery> {
    let q = req.uri().query().unwrap_or("");
    let de = serde_urlencoded::Deserializer::new(form_urlencoded::parse(q.as_bytes()));
    let q: AuditQuery = serde_path_to_error::deserialize(de)
        .map_err(|e| crate::api::error::from_serde_path(e, "query"))?;
    match q.format.as_deref() {
        None | Some("json") | Some("jsonl") => Ok(q),
        Some(f) => Err(ApiError::invalid(
            "format",
            format!("format must be json or jsonl, got {f:?}"),
        )),
    }
}

fn answer(q: &AuditQuery, entries: Vec<AuditEntry>) -> ApiResult<Response> {
    if q.format.as_deref() != Some("jsonl") {
        return Ok(Json(AuditList { entries }).into_response());
    }
    let mut out = Vec::new();
    for e in &entries {
        serde_json::to_writer(&mut out, e).map_err(ApiError::internal)?;
        out.push(b'\n');
    }
    Response::builder()
        .header(http::header::CONTENT_TYPE, moat_api::NDJSON)
        .body(Body::from(out))
        .map_err(ApiError::internal)
}

/// The audit log: API actions and commands, oldest first; `format=jsonl` exports it as JSON lines.
#[utoipa::path(get, path = "/v1/audit", tag = "audit", params(AuditQuery),
    responses((status = 200, description = "`format=json`: the entries; `format=jsonl`: one `AuditEntry` per line",
               content((AuditList = "application/json"), (AuditEntry = "application/x-ndjson"))),
              (status = 400, body = moat_api::ErrorBody)))]
pub async fn list(State(st): St, req: Request) -> ApiResult<Response> {
    let q = parse_query(&req)?;
    let entries = st.audit.query(&q, None).await?;
    answer(&q, entries)
}

/// The audit log of one sandbox (also after it was deleted).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/audit", tag = "audit", params(("id" = String, Path), AuditQuery),
    responses((status = 200, description = "`format=json`: the entries; `format=jsonl`: one `AuditEntry` per line",
               content((AuditList = "application/json"), (AuditEntry = "application/x-ndjson"))),
              (status = 400, body = moat_api::ErrorBody), (status = 404, body = moat_api::ErrorBody)))]
pub async fn for_sandbox(
    State(st): St,
    Path(id): Path<String>,
    req: Request,
) -> ApiResult<Response> {
    if !crate::ids::valid_sandbox_id(&id) {
        return Err(ApiError::not_found(
            "id",
            format!("sandbox {id:?} not found"),
        ));
    }
    let q = parse_query(&req)?;
    let entries = st.audit.query(&q, Some(&id)).await?;
    answer(&q, entries)
}
