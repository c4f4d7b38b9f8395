//! Secrets (docs/secrets.md): declared on a sandbox, a template or the whole daemon; answers carry
//! names, hosts and placeholders, never a value.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use moat_api::{SecretInfo, SecretList, SecretSpec};

use super::error::ApiResult;
use super::St;
use crate::api::extract::JsonBody;
use crate::error::Error;
use crate::secrets::Scope;

/// The name in the path is the secret's; a body naming another is refused.
fn named(mut spec: SecretSpec, name: &str) -> Result<SecretSpec, Error> {
    if !spec.name.is_empty() && spec.name != name {
        return Err(Error::invalid(
            "name",
            format!("the body names {:?}, the path {name:?}", spec.name),
        ));
    }
    spec.name = name.to_string();
    Ok(spec)
}

/// The secrets of a sandbox: its own, its template's and the daemon's, with its placeholders.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/secrets", tag = "secrets", params(("id" = String, Path)),
    responses((status = 200, body = SecretList), (status = 404, body = moat_api::ErrorBody)))]
pub async fn list_for_sandbox(
    State(st): St,
    Path(id): Path<String>,
) -> ApiResult<Json<SecretList>> {
    Ok(Json(SecretList {
        secrets: st.sandboxes.secrets_of(&id)?,
    }))
}

/// Declare or rotate (replace the value of) a sandbox's secret; new connections use it at once,
/// and processes started from now on see `$NAME` (its placeholder).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/secrets/{name}", tag = "secrets",
    params(("id" = String, Path), ("name" = String, Path)), request_body = SecretSpec,
    responses((status = 200, body = SecretInfo), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody),
              (status = 409, description = "the sandbox has no network", body = moat_api::ErrorBody)))]
pub async fn put_for_sandbox(
    State(st): St,
    Path((id, name)): Path<(String, String)>,
    JsonBody(spec): JsonBody<SecretSpec>,
) -> ApiResult<Json<SecretInfo>> {
    let spec = named(spec, &name)?;
    Ok(Json(st.sandboxes.put_secret(&id, &spec).await?))
}

/// Remove a sandbox's own secret.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/secrets/{name}", tag = "secrets",
    params(("id" = String, Path), ("name" = String, Path)),
    responses((status = 204), (status = 404, body = moat_api::ErrorBody)))]
pub async fn delete_for_sandbox(
    State(st): St,
    Path((id, name)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    st.sandboxes.delete_secret(&id, &name)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Daemon-wide secrets (every sandbox created from now on with networking gets them).
#[utoipa::path(get, path = "/v1/secrets", tag = "secrets",
    responses((status = 200, body = SecretList)))]
pub async fn list_daemon(State(st): St) -> ApiResult<Json<SecretList>> {
    Ok(Json(SecretList {
        secrets: st.vault.list(&Scope::Daemon)?,
    }))
}

/// Declare or rotate a daemon-wide secret.
#[utoipa::path(put, path = "/v1/secrets/{name}", tag = "secrets", params(("name" = String, Path)),
    request_body = SecretSpec,
    responses((status = 200, body = SecretInfo), (status = 400, body = moat_api::ErrorBody)))]
pub async fn put_daemon(
    State(st): St,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<SecretSpec>,
) -> ApiResult<Json<SecretInfo>> {
    let spec = named(spec, &name)?;
    Ok(Json(st.vault.put(&Scope::Daemon, &spec)?))
}

/// Remove a daemon-wide secret.
#[utoipa::path(delete, path = "/v1/secrets/{name}", tag = "secrets", params(("name" = String, Path)),
    responses((status = 204), (status = 404, body = moat_api::ErrorBody)))]
pub async fn delete_daemon(State(st): St, Path(name): Path<String>) -> ApiResult<StatusCode> {
    st.vault.delete(&Scope::Daemon, &name)?;
    Ok(StatusCode::NO_CONTENT)
}

/// A template's secrets (every sandbox created from it from now on gets them).
#[utoipa::path(get, path = "/v1/templates/{name}/secrets", tag = "secrets", params(("name" = String, Path)),
    responses((status = 200, body = SecretList), (status = 404, body = moat_api::ErrorBody)))]
pub async fn list_template(State(st): St, Path(name): Path<String>) -> ApiResult<Json<SecretList>> {
    st.templates.get(&name)?;
    Ok(Json(SecretList {
        secrets: st.vault.list(&Scope::Template(name))?,
    }))
}

/// Declare or rotate a template's secret.
#[utoipa::path(put, path = "/v1/templates/{name}/secrets/{secret}", tag = "secrets",
    params(("name" = String, Path), ("secret" = String, Path)), request_body = SecretSpec,
    responses((status = 200, body = SecretInfo), (status = 400, body = moat_api::ErrorBody),
              (status = 404, body = moat_api::ErrorBody)))]
pub async fn put_template(
    State(st): St,
    Path((name, secret)): Path<(String, String)>,
    JsonBody(spec): JsonBody<SecretSpec>,
) -> ApiResult<Json<SecretInfo>> {
    st.templates.get(&name)?;
    let spec = named(spec, &secret)?;
    Ok(Json(st.vault.put(&Scope::Template(name), &spec)?))
}

/// Remove a template's secret.
#[utoipa::path(delete, path = "/v1/templates/{name}/secrets/{secret}", tag = "secrets",
    params(("name" = String, Path), ("secret" = String, Path)),
    responses((status = 204), (status = 404, body = moat_api::ErrorBody)))]
pub async fn delete_template(
    State(st): St,
    Path((name, secret)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    st.vault.delete(&Scope::Template(name), &secret)?;
    Ok(StatusCode::NO_CONTENT)
}
