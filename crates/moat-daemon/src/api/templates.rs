//! `/v1/templates`: list, register, build (streamed progress), remove.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use moat_api::{BuildEvent, RegisterTemplateRequest, Template, TemplateList};
use tokio::sync::mpsc;

use super::error::{ApiError, ApiResult};
use super::St;
use crate::api::extract::{JsonBody, QueryArgs};
use crate::template::spec;
use moat_api::ErrorCode;

/// List templates.
#[utoipa::path(get, path = "/v1/templates", tag = "templates", responses((status = 200, body = TemplateList)))]
pub async fn list(State(st): St) -> ApiResult<Json<TemplateList>> {
    Ok(Json(TemplateList {
        templates: st.templates.list()?,
    }))
}

/// Get one template.
#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates", params(("name" = String, Path)),
    responses((status = 200, body = Template), (status = 404, body = moat_api::ErrorBody)))]
pub async fn get(State(st): St, Path(name): Path<String>) -> ApiResult<Json<Template>> {
    Ok(Json(st.templates.get(&name)?))
}

/// Register a root filesystem directory or tarball, an OCI image layout or a `docker save` archive on
/// the daemon's host as a template.
#[utoipa::path(post, path = "/v1/templates", tag = "templates", request_body = RegisterTemplateRequest,
    responses((status = 201, body = Template), (status = 400, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody)))]
pub async fn register(
    State(st): St,
    JsonBody(req): JsonBody<RegisterTemplateRequest>,
) -> ApiResult<(StatusCode, Json<Template>)> {
    let t = st.templates.register(&req.name, &req.path).await?;
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
    let t = st.templates.pull(&name, &req).await?;
    Ok((StatusCode::CREATED, Json(t)))
}

#[derive(Debug, Default, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct BuildQuery {
    /// Run every step of a spec build again instead of taking it from the build cache.
    #[serde(default)]
    pub no_cache: bool,
    /// Path of the spec inside a build-context tar (default `moat.toml`).
    #[serde(default)]
    pub spec: Option<String>,
}

/// Build a template. From a spec (`moat.toml`, docs/templates.md): a JSON `BuildRequest`, the spec
/// as TOML (`Content-Type: application/toml`), or a tar of the build context holding the spec and the
/// files its `copy` steps take (`application/x-tar`). Without a body: `base` or `code-interpreter`
/// from Debian packages (debootstrap). The answer streams NDJSON `BuildEvent`s; a spec build's first
/// event names the build (`GET /v1/builds/{id}` and `/events` follow it after a disconnect), and the
/// build goes on when the client goes away.
#[utoipa::path(post, path = "/v1/templates/{name}/build", tag = "templates", params(("name" = String, Path), BuildQuery),
    request_body(content = moat_api::BuildRequest, description = "a spec as JSON, TOML (application/toml) or inside a build-context tar (application/x-tar); none for a debootstrap build"),
    responses((status = 200, description = "NDJSON stream of BuildEvent; the last line is `done` or `failed`", content_type = "application/x-ndjson", body = BuildEvent),
              (status = 400, body = moat_api::ErrorBody), (status = 409, body = moat_api::ErrorBody), (status = 413, body = moat_api::ErrorBody)))]
pub async fn build(
    State(st): St,
    Path(name): Path<String>,
    QueryArgs(q): QueryArgs<BuildQuery>,
    req: axum::extract::Request,
) -> ApiResult<Response> {
    moat_api::validate_template_name(&name)
        .map_err(|m| crate::api::error::ApiError::invalid("name", m))?;
    let ct = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if ct.starts_with("application/x-tar") {
        let (id, dir) = st.builds.new_dir()?;
        let started = async {
            let context = dir.join("context.tar");
            let limit = st.builds.max_context_bytes();
            save_body(req.into_body(), &context, limit).await?;
            let spec_name = q.spec.clone().unwrap_or_else(|| moat_api::SPEC_FILE.into());
            moat_api::check_context_path(&spec_name).map_err(|m| ApiError::invalid("spec", m))?;
            let text =
                tokio::task::spawn_blocking(move || spec::spec_from_context(&context, &spec_name))
                    .await
                    .map_err(ApiError::internal)??;
            let parsed = spec::parse_toml(&text)?;
            st.builds
                .start(id.clone(), &name, parsed, true, q.no_cache)
                .await
                .map_err(ApiError::from)
        }
        .await;
        return match started {
            Ok(live) => super::builds::follow(live),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        };
    }
    let limit = crate::api::extract::MAX_JSON_BODY.load(std::sync::atomic::Ordering::Relaxed);
    let body = crate::api::extract::read_limited(req.into_body(), limit).await?;
    if body.iter().all(u8::is_ascii_whitespace) {
        if q.no_cache || q.spec.is_some() {
            return Err(ApiError::invalid(
                "spec",
                "no_cache and spec go with a spec build; this request has no spec",
            ));
        }
        return debootstrap_build(st, name);
    }
    let (parsed, no_cache) =
        if ct.starts_with("application/toml") || !body.trim_ascii_start().starts_with(b"{") {
            let text = std::str::from_utf8(&body)
                .map_err(|_| ApiError::invalid("spec", "the spec is not UTF-8 text"))?;
            (spec::parse_toml(text)?, q.no_cache)
        } else {
            let r: moat_api::BuildRequest = crate::api::extract::parse_json(&body)?;
            (r.spec, r.no_cache || q.no_cache)
        };
    let (id, _dir) = st.builds.new_dir()?;
    let live = st.builds.start(id, &name, parsed, false, no_cache).await?;
    super::builds::follow(live)
}

/// Writes a request body to `path`, answering 413 past `limit` bytes.
async fn save_body(body: axum::body::Body, path: &std::path::Path, limit: u64) -> ApiResult<()> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncWriteExt;
    let mut f = tokio::fs::File::create(path)
        .await
        .map_err(|e| ApiError::internal(format!("create {}: {e}", path.display())))?;
    let mut body = body;
    let mut n: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::invalid("body", format!("could not read the build context: {e}"))
        })?;
        if let Ok(data) = frame.into_data() {
            n += data.len() as u64;
            if n > limit {
                return Err(ApiError::new(
                    ErrorCode::PayloadTooLarge,
                    format!("the build context is larger than {} MiB (moat serve --max-build-context-mb)", limit >> 20),
                ));
            }
            f.write_all(&data)
                .await
                .map_err(|e| ApiError::internal(format!("write {}: {e}", path.display())))?;
        }
    }
    f.flush()
        .await
        .map_err(|e| ApiError::internal(format!("write {}: {e}", path.display())))?;
    Ok(())
}

fn debootstrap_build(st: std::sync::Arc<super::AppState>, name: String) -> ApiResult<Response> {
    let (tx, rx) = mpsc::channel::<BuildEvent>(256);
    let st2 = st.clone();
    // The build goes on if the client disconnects; its result is in the template's status.
    tokio::spawn(async move {
        let result = st2.templates.build(&name, tx.clone()).await;
        let last = match result {
            Ok(template) => BuildEvent::Done {
                template: Box::new(template),
            },
            Err(e) => BuildEvent::Failed {
                message: e.to_string(),
                step: None,
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
    st.templates.delete(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}
